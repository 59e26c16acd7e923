"""One call of each prologue launch and of the after's walk-side launches at 12 heads x 16K tokens,
for `ncu` (scripts/device_prefill_issue6.sh profiles them: occupancy, issue rate, stall reasons)."""

import torch

from k3lab.ops import kda_chunk as kc
from k3lab.studies import kda_scan as ks

case = ks.parse_case("h12_b1_t16384")
inp = ks.make_inputs(case)
runner = ks.Runner(case, inp)
q, k, v, g, beta = runner._args()
for kind, opts in (("rows", {}), ("flat", {}), ("flat", {"dot3": True})):
    for f in kc.prologue_launches(q, k, v, g, beta, runner.plan_before, 128**-0.5, runner.work, options=opts,
                                  prologue=kind).values():
        f()
parts = kc.after_launches(q, k, v, g, beta, 128**-0.5, inp["initial_state"], None, plan=runner.plan_after,
                          work=runner.work)
for p in ("summaries", "scan", "replay"):
    parts[p]()
torch.cuda.synchronize()
