"""Imports every code format so that each registers itself in `kvq_lab.quant.formats.FORMATS`.

The one place that knows the plugins: a new format adds its import here.
"""

from kvq_lab.quant.formats import (  # noqa: F401  (registration)
    fp8,
    int_,
    iq4_nl,
    lut,
    mxfp4,
    nuq,
    nvfp4,
    q4_0,
    q4_1,
    q5_0,
    q5_1,
    q8_0,
    turbo,
)
