"""Error measured where the tensors are consumed: reconstruction, attention-score and attention-output error of a
key/value quantizer pair, per layer and head, in several definitions side by side (see `metrics`, `errors`).

    settings.py ProbeSettings and quantity names (torch-free: validation imports it)
    capture.py  q/k/v each attention layer really uses (one exact forward pass, no fork of attention)
    metrics.py  kivi_ratio, rel_fro, sqnr_db, sparsity, topk_mass (pure functions, formulas in docstrings)
    errors.py   one layer's errors: quantize K/V as the run's CacheConfig says, compare A, AV, ... per head
    probe.py    over prompts -> ProbeResult (tables [layer, head])
    report.py   flat metrics, W&B tables, heat-maps; KIVI-Table-2 markdown over records
(task=probe and probe=true live with the other tasks: kvq_lab/tasks/probe.py)
"""

from kvq_lab.common.lazy import lazy_getattr

# Names resolve lazily (as kvq_lab.quant and kvq_lab.cache): config validation imports kvq_lab.probes.settings
# (through kvq_lab.tasks.probe), which must not pay for torch.
_EXPORTS = {
    "LayerCapture": "capture",
    "capture_qkv": "capture",
    "capture_attention": "capture",
    "ERROR_QUANTITIES": "settings",
    "ProbeSettings": "settings",
    "layer_errors": "errors",
    "quantize_kv": "errors",
    "ERRORS": "metrics",
    "kivi_ratio": "metrics",
    "rel_fro": "metrics",
    "sparsity": "metrics",
    "sqnr_db": "metrics",
    "topk_mass": "metrics",
    "ProbeResult": "probe",
    "probe_model": "probe",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
