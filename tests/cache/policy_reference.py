"""Today's cache outputs, kept to check that the policy refactor changed nothing: per config, the last-position
logits of a 40-token prefill and 12 teacher-forced decode steps through the peaked test Llama, and 16 greedy tokens
after them (`outputs`). `tests/cache/data/policy_reference.pt` holds them as made with the code of commit f953f50
(before policies existed: the tree of 5260b4a, which adds this file) by `python tests/cache/policy_reference.py`;
tests/cache/test_policies.py recomputes and compares bit for bit.

Both sides compute in the `PORTABLE` environment, in a process of their own (`portable_outputs`): MKL's CNR
`COMPATIBLE` branch (its SSE2 path, the same bits on Intel and AMD processors), ATen's and oneDNN's non-vectorized
kernels, one thread. The first reference was made in the default environment, on another processor: on this AMD one
its logits differed in the last bits at every config (tokens equal), and so would a test session's own mode
(`kvq_lab.models.numerics`); the reference was remade in this environment from 5260b4a's tree, which the code of
today reproduces bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "data" / "policy_reference.pt"
# a process that computes the same bits on any x86 processor (the module docstring)
PORTABLE = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
PORTABLE["OMP_NUM_THREADS"] = "1"

# knob mappings (`kvq_lab.cache.knobs.cache_config`): KIVI Table 1's fake quant and KIVI's streaming, with the
# options that change the streams (sinks, a window, transforms, other formats)
CONFIGS: dict[str, dict] = {
    "table1_KC_VT": {"bits": 2, "mode": "simulated"},
    "table1_KC_VC": {"bits": 2, "value_axis": "channel", "mode": "simulated"},
    "table1_KT_VT_S4": {"bits": 2, "key_axis": "token", "sink_tokens": 4, "mode": "simulated"},
    "table1_4bit_rope_pre": {"bits": 4, "rope": "pre", "mode": "simulated"},
    "kivi_R32": {"bits": 2, "mode": "packed", "exact_window": 32, "backend": "torch"},
    "kivi_R0_S4": {"bits": 2, "mode": "packed", "sink_tokens": 4, "backend": "torch"},
    "kivi_R32_hadamard": {
        "bits": 2,
        "mode": "packed",
        "exact_window": 32,
        "transform": "hadamard",
        "backend": "torch",
    },
    "kivi_fp8_KT_VC": {
        "format": "fp8_e4m3",
        "key_axis": "token",
        "value_axis": "channel",
        "mode": "packed",
        "exact_window": 32,
        "backend": "torch",
    },
}


def outputs(model, knobs: dict) -> dict[str, torch.Tensor]:
    """{"logits": [13, vocab] (after the prefill, then after each teacher-forced step), "tokens": [16] greedy}, on one
    thread."""
    from kvq_lab.cache.knobs import cache_config

    cfg = cache_config(knobs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a matmul's sums depend on the thread count; one thread gives the same bits anywhere
    try:
        return _outputs(model, cfg)
    finally:
        torch.set_num_threads(threads)


def _outputs(model, cfg) -> dict[str, torch.Tensor]:
    from kvq_lab.cache import QuantizedKVCache

    ids = torch.randint(3, 256, (1, 52), generator=torch.Generator().manual_seed(7))
    cache = QuantizedKVCache.for_model(model, cfg)
    rows = []
    with torch.no_grad():
        rows.append(model(ids[:, :40], past_key_values=cache).logits[0, -1])
        for t in range(40, 52):
            rows.append(model(ids[:, t : t + 1], past_key_values=cache).logits[0, -1])
        out = model.generate(
            ids[:, :40],
            past_key_values=QuantizedKVCache.for_model(model, cfg),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
        )
    return {"logits": torch.stack(rows), "tokens": out[0, 40:]}


def portable_outputs(configs: dict[str, dict]) -> dict[str, dict[str, torch.Tensor]]:
    """{name: `outputs`} of the peaked test Llama under each config (knob mappings), computed in a process of its own
    in the `PORTABLE` environment."""
    with tempfile.TemporaryDirectory() as tmp:
        out, spec = Path(tmp) / "outputs.pt", Path(tmp) / "configs.json"
        spec.write_text(json.dumps(configs))
        cmd = [sys.executable, str(Path(__file__).resolve()), str(out), str(spec)]
        p = subprocess.run(cmd, env={**os.environ, **PORTABLE}, capture_output=True, text=True, timeout=600)
        if p.returncode:
            raise RuntimeError(f"computing the outputs failed: {p.stderr[-2000:]}")
        return torch.load(out)


if __name__ == "__main__":  # [<outputs.pt> <configs.json>]: without arguments, the reference of CONFIGS
    if any(os.environ.get(k) != v for k, v in PORTABLE.items()):  # MKL and ATen read these when they start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PORTABLE})
    sys.path.insert(0, str(HERE.parent))
    from helpers_models import peaked_llama

    target, configs = REFERENCE, CONFIGS
    if len(sys.argv) == 3:
        target, configs = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    model = peaked_llama()
    torch.save({name: outputs(model, knobs) for name, knobs in configs.items()}, target)
    print(f"wrote {target}")
