"""The CUDA walks' launches at 12 heads x 16K tokens for `ncu` (scripts/device_walk.sh profiles the
replay's third launch: occupancy, issue rate, stall reasons): the prologue, then the summaries and the
replay three times each."""

import torch

from k3lab.ops import kda_chunk as kc
from k3lab.studies import kda_scan as ks

case = ks.parse_case("h12_b1_t16384")
inp = ks.make_inputs(case)
runner = ks.Runner(case, inp)
parts = kc.after_launches(*runner._args(), 128**-0.5, inp["initial_state"], None, plan=runner.plan_after,
                          work=runner.work, walk="cuda")
parts["prologue"]()
for _ in range(3):
    for p in ("summaries", "scan", "replay"):
        parts[p]()
torch.cuda.synchronize()
