"""One verify step (B = 1, T = 4, 12 heads, bf16) in the form named on the command line, run twice
(the first builds and warms up), for Nsight Compute: profile the second launch of the kernel.

    ncu -k regex:kda_verify --launch-skip 1 --launch-count 1 ... python3 ncu_target.py cuda_warp [warps]
"""

import sys

import torch

from k3lab.ops import kda_verify as kv
from k3lab.studies import kda_verify as study

form = sys.argv[1] if len(sys.argv) > 1 else "cuda"
warps = int(sys.argv[2]) if len(sys.argv) > 2 else None
x = study.make_inputs(1, 4, 12, dtype=torch.bfloat16, device="cuda")
for _ in range(2):
    kv.kda_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], tile_v=8, form=form,
                  num_warps=warps, pdl=False)
torch.cuda.synchronize()
