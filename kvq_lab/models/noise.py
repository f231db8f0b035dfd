"""Rounding noise: the same model, computed with other float rounding (`noise=permute:<seed>`).

At 4 bits or fewer per element, fake quant of every cached token turns a last-bit difference in a key into a whole
quantization step (a code flips), and a few flips change a greedy answer: per-turn answers are then a chaotic function
of float rounding, and only aggregates over many turns are measurements. To tell a method's effect from that noise, a
study reruns its baseline row under a perturbation that keeps the mathematics and changes only the rounding, and prints
what that alone does beside every difference (`kvq_lab.report.noise`).

`permute:<seed>` permutes the channels of the residual stream by a seeded permutation p of [0, hidden): the embedding's
columns, the columns of every projection that reads the stream (q, k, v, gate, up, the output head), the rows of every
one that writes to it (o, down) and the weights of the norms over it. Every operation on the stream is elementwise
per channel (residual adds, norm weights) or a sum over its channels (projections, the norms' mean square), so the
permuted model computes the same function; each such sum adds its terms in another order, so its float rounding
differs, by one unit in the last place here and there. Exact in the weights (a permutation copies values), in place
(the parameters keep their storage), one draw per seed. Other rounding-only reruns need no knob: `model.dtype=float64`
(the reference, CPU), `batch_size`, `prefix_reuse` (`kvq_lab.report.noise.ROUNDING_KNOBS`).
"""

from __future__ import annotations

import re

from kvq_lab.common.errors import ConfigError

NOISE_HELP = (
    "`none`, or `permute:<seed>`: rerun a row under a perturbation that keeps the mathematics and changes only float "
    "rounding (the residual stream's channels permuted, `kvq_lab/models/noise.py`), recorded in the run's config and "
    "name; a study prints what it alone does beside each difference (`kvq_lab.report.noise`)"
)
_PERMUTE = re.compile(r"permute(?::(\d+))?")

READS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Linear layers whose input is the (normed) stream
WRITES = ("o_proj", "down_proj")  # Linear layers whose output is added to the stream
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def parse_noise(value) -> str:
    """The `noise` knob -> its canonical spelling: `none` or `permute:<seed>` (`permute` alone is seed 0).
    Raises a one-line ConfigError for anything else."""
    if value is None or value == "none" or value is False:
        return "none"
    m = _PERMUTE.fullmatch(str(value))
    if m is None:
        raise ConfigError(f"noise={value!r} is not a noise rerun; choose none or permute:<seed> (e.g. permute:1)")
    return f"permute:{int(m.group(1) or 0)}"


def apply_noise(model, noise: str):
    """Apply the canonical `noise` (`parse_noise`) to a loaded model, in place; -> the model."""
    if noise == "none":
        return model
    return permute_hidden(model, int(noise.split(":")[1]))


def permute_hidden(model, seed: int):
    """Permute the residual-stream channels of a decoder-only transformer (Llama, Gemma-3 layouts) by a seeded
    permutation, in place (see the module docstring); -> the model. Raises ConfigError, naming the parameter, where
    a parameter of the stream's width is not one this function knows how to permute (another architecture)."""
    import torch

    hidden = model.config.get_text_config().hidden_size
    p = torch.randperm(hidden, generator=torch.Generator().manual_seed(seed))
    done: set[int] = set()

    def take(param, dim: int) -> None:
        if id(param) in done:  # tied weights (the output head is the embedding): permuted once
            return
        with torch.no_grad():
            param.copy_(param.index_select(dim, p.to(param.device)))
        done.add(id(param))

    take(model.get_input_embeddings().weight, 1)  # [vocab, hidden]: token -> stream
    head = model.get_output_embeddings()
    if head is not None:
        take(head.weight, 1)  # [vocab, hidden]: stream -> logits
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in READS:
            take(module.weight, 1)  # [out, hidden]
        elif leaf in WRITES:
            take(module.weight, 0)  # [hidden, in]
            if module.bias is not None:
                take(module.bias, 0)
        elif (leaf in NORMS or name.endswith("model.norm") or name == "norm") and module.weight.shape == (hidden,):
            take(module.weight, 0)
    left = [n for n, t in model.named_parameters() if id(t) not in done and hidden in t.shape]
    if left:
        raise ConfigError(
            f"noise=permute: {left[0]} has the residual stream's width ({hidden}) but this architecture's layout is "
            "not known to kvq_lab/models/noise.py; use noise=none, or model.dtype=float64 / batch_size / prefix_reuse "
            "as the rounding-only rerun"
        )
    return model
