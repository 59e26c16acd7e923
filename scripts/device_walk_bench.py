"""Issue 6: the walking launches of the KDA prefill by kind (kernels/kda_walk.cu against the Triton
walks) at given cases, each launch timed on its own (eager device events) on the same prologue
outputs, then the whole before and after with each walk. Prints a table; writes $OUT/walk_<case>.json.
   PYTHONPATH=. python3 scripts/device_walk_bench.py [case ...]"""

import json
import os
import sys

import torch

from k3lab import bench, env
from k3lab.ops import kda_chunk as kc
from k3lab.ops import kda_walk_cuda as kwc
from k3lab.studies import kda_scan as ks

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
kw = {"warmup": 3, "repeats": 30}
for name in sys.argv[1:] or ["h12_b1_t16384"]:
    case = ks.parse_case(name)
    inp = ks.make_inputs(case)
    args = tuple(inp[x] for x in ("q", "k", "v", "g", "beta"))
    runner = ks.Runner(case, inp)
    rows = {}
    for walk in ("triton", "cuda"):
        for label, plan in (("scan", runner.plan_after), ("plain", runner.plan_before)):
            parts = kc.after_launches(*args, None, inp["initial_state"], inp["cu_seqlens"], plan=plan,
                                      work=runner.work, walk=walk)
            for part in ("prologue", "summaries", "scan", "replay", "walk"):
                if part in parts:
                    parts[part]()
            for part in ("summaries", "scan", "replay", "walk"):
                if part in parts:
                    rows[f"{walk}.{label}.{part}"] = bench.time_fn(parts[part], **kw).median_us
            if walk == "cuda":  # the other stage counts of kernels/kda_walk.cu
                stages, tiles = dict(kwc.STAGES), dict(kwc.TILES)
                for part, replay, st, ti in (("summaries", False, 2, 2), ("replay", True, 2, 1), ("walk", True, 2, 2)):
                    if part in parts:
                        kwc.STAGES[replay], kwc.TILES[replay] = st, ti
                        rows[f"cuda.{label}.{part}.s{st}t{ti}"] = bench.time_fn(parts[part], **kw).median_us
                        kwc.STAGES.update(stages)
                        kwc.TILES.update(tiles)
        for variant in ("before", "after"):
            fn = getattr(runner, variant)
            runner.tune = runner.tune_after = {"walk": walk}
            rows[f"{walk}.{variant}"] = bench.time_fn(fn, **kw).median_us
    for gs in (int(x) for x in os.environ.get("GROUP_SIZES", "16,32").split(",") if x):  # the after's, CUDA walks
        plan = kc.make_plan(case.lengths, case.heads, gs, device=args[0].device)
        rows[f"cuda.after.gs{gs}"] = bench.time_fn(
            lambda p=plan: runner.after(plan=p), **kw).median_us
    rows["group_size"] = runner.group_size
    meta = {"device": torch.cuda.get_device_name(), "versions": dict(env.versions()),
            "commit": bench.git_commit(), "case": name, "mode": "eager device events, each launch alone",
            "source": "scripts/device_walk_bench.py", "rows_us": rows}
    with open(os.path.join(out, f"walk_{name}.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(f"{name} (gs {runner.group_size}):")
    for key, val in rows.items():
        if key != "group_size":
            print(f"  {key:28s} {val:8.1f} us")
