"""Where RotateKV's attention-sink-aware quantization would keep tokens exact on SmolLM2, against `sink_tokens`
(python experiments/methods/massive_activations.py; a few seconds on CPU, writes massive_activations.json here).

RotateKV (Su et al. 2025; its public code, `LlamaModel.forward`) keeps in 16 bits, per layer and batch row, the tokens
that hold the 20 largest |entries| of the layer's input hidden states ("pivot tokens": massive activations, which
coincide with attention sinks). kvq_lab's `sink_tokens=S` keeps the first S positions exact instead. This script
runs the 4 windows that `task=ppl` scores (CoQA stories, 512 + 512 tokens, no BOS) and counts, over the 30 layers,
the positions of RotateKV's pivot entries: at position 0, within the first 4, or later (and which tokens those are),
so the README can say what `sink_tokens` covers of RotateKV's selection here.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import torch
from omegaconf import OmegaConf

from kvq_lab.models.loading import load_model
from kvq_lab.tasks.decode import make_windows
from kvq_lab.tasks.text import source_text

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOP = 20  # RotateKV's PIVOT_TOKEN: entries of the hidden states, not tokens


def main() -> None:
    model, tok = load_model("smollm2-135m")
    t = OmegaConf.load(ROOT / "conf/task/ppl.yaml")
    text = source_text(t, Path(os.environ.get("KVQ_DATA_DIR", ROOT / "data")))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    batch = make_windows(ids, int(t.context_tokens), int(t.eval_tokens), int(t.windows))  # [W, 1024]
    with torch.no_grad():
        hs = model(batch, output_hidden_states=True).hidden_states  # 31 x [W, T, 576]: the input of layer l is hs[l]
    where, later = Counter(), Counter()
    per_layer = []
    for layer in range(model.config.num_hidden_layers):
        h = hs[layer].abs()  # [W, T, hidden]
        top = h.flatten(1).topk(TOP, dim=1).indices // h.shape[-1]  # [W, TOP] token positions of the entries
        tokens = [sorted(set(row.tolist())) for row in top]
        per_layer.append(tokens)
        for w, row in enumerate(top.tolist()):
            for p in row:
                where["position 0" if p == 0 else "positions 1-3" if p < 4 else "position >= 4"] += 1
                if p >= 4:
                    later[repr(tok.decode([int(batch[w, p])]))] += 1
    n = sum(where.values())
    out = {
        "entries": n,
        "share": {k: round(v / n, 4) for k, v in sorted(where.items())},
        "later_tokens": dict(later.most_common(10)),
        "pivot_positions_per_layer": per_layer,
    }
    (HERE / "massive_activations.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: out[k] for k in ("entries", "share", "later_tokens")}, indent=1))
    print("layers whose pivots are all at position 0:", sum(all(p == [0] for p in lay) for lay in per_layer))


if __name__ == "__main__":
    main()
