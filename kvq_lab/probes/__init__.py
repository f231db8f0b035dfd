"""Error measured where the tensors are consumed: reconstruction, attention-score and attention-output error of a
key/value quantizer pair, per layer and head, in several definitions side by side (see `metrics`, `errors`).

    capture.py  q/k/v each attention layer really uses (one exact forward pass, no fork of attention)
    metrics.py  kivi_ratio, rel_fro, sqnr_db, sparsity, topk_mass (pure functions, formulas in docstrings)
    errors.py   one layer's errors: quantize K/V as the run's CacheConfig says, compare A, AV, ... per head
    probe.py    over prompts -> ProbeResult (tables [layer, head])
    report.py   flat metrics, W&B tables, heat-maps; KIVI-Table-2 markdown over records
    task.py     task=probe and probe=true
"""

from .capture import LayerCapture, capture, capture_attention
from .errors import ERROR_QUANTITIES, ProbeSettings, layer_errors, quantize_kv
from .metrics import ERRORS, kivi_ratio, rel_fro, sparsity, sqnr_db, topk_mass
from .probe import ProbeResult, probe_model

__all__ = [
    "ERRORS",
    "ERROR_QUANTITIES",
    "LayerCapture",
    "ProbeResult",
    "ProbeSettings",
    "capture",
    "capture_attention",
    "kivi_ratio",
    "layer_errors",
    "probe_model",
    "quantize_kv",
    "rel_fro",
    "sparsity",
    "sqnr_db",
    "topk_mass",
]
