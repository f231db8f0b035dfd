"""What rope=pre's cos/sin table costs in the model by its bytes alone: `run7/step_split.py` as is, or (`ZERO=1`)
with every position id the caches keep replaced by 0, so the kernel rotates every key with the table's first row
(wrong outputs, the same arithmetic, ~256 bytes of table read instead of 256 bytes per position). The difference
between the two runs' rope=pre steps is what the table's reads cost, in the C call and in the model's own ops.

    python experiments/cache_speed/issue14/run10/table_bytes.py --length 8192 --dtype bf16 --steps 30 \\
        --caches "R128 (cpu)" "preRoPE (cpu)"
    ZERO=1 python experiments/cache_speed/issue14/run10/table_bytes.py ...  (the same arguments)
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

import torch

from kvq_lab.cache import rope

STEP_SPLIT = Path(__file__).resolve().parents[1] / "run7" / "step_split.py"

if os.environ.get("ZERO"):
    keep = rope.PositionLog.keep
    zeroed: dict = {}

    def keep_zeros(self, answer, N, layer):
        """`PositionLog.keep` of the same answer with its ids zeroed (one zeroed answer per answer, so the layers
        after the first still find it written)."""
        z = zeroed.get(id(answer))
        if z is None or z[0] is not answer:
            z = zeroed[id(answer)] = (answer, (torch.zeros_like(answer[0]), answer[1]))
        return keep(self, z[1], N, layer)

    rope.PositionLog.keep = keep_zeros

sys.argv = [str(STEP_SPLIT), *sys.argv[1:]]
runpy.run_path(str(STEP_SPLIT), run_name="__main__")
