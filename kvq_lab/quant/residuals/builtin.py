"""Imports every residual correction so that each registers itself in `kvq_lab.quant.residuals.RESIDUALS`.

The one place that knows the plugins: a new correction adds its import here.
"""

from kvq_lab.quant.residuals import lowrank, qjl, sparse  # noqa: F401  (registration)
