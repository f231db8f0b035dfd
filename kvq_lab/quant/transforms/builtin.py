"""Imports every transform so that each registers itself in `kvq_lab.quant.transforms.TRANSFORMS`.

The one place that knows the plugins: a new transform adds its import here. (Not `all.py`: a submodule named `all`
would shadow the builtin `all` inside the package.)
"""

from kvq_lab.quant.transforms import hadamard, innerq, interleave, rhadamard, rope_pre, rotatekv  # noqa: F401  (imported for their registration)
