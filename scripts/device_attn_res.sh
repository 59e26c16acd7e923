#!/usr/bin/env bash
# AttnRes + RMSNorm on a GPU: sweep the fused kernel's launch choices, pick the best overall, and
# time the study's cases with it (records carry the choice). OUT=dir bash scripts/device_attn_res.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"
timeout 200 python3 - "$OUT/attn_res_tuned.json" <<'PY'
import json, sys
from k3lab import bench
from k3lab.ops import attn_res_norm as arn
from k3lab.studies import copy_removal as cr
sweep = cr.attn_res_sweep(warps=(4, 8), prefetch=(1, 2))
best = cr.best_attn_res_config(sweep)
print("best:", best)
for r in sweep:
    print(f"{r.case:28s} {r.median_us:9.2f} us  floor {r.floor_us:8.2f}")
arn.DEFAULT_NUM_WARPS, arn.DEFAULT_PREFETCH = best["num_warps"], best["prefetch"]
cases = [c for c in cr.case_names() if c.startswith("attn_res")]
main = cr.run(cases=cases)
for r in main:
    r.extra.update(num_warps=best["num_warps"], prefetch=best["prefetch"])
print(bench.compare(main)[["case", "mode", "before_us", "after_us", "floor_us", "speedup", "floor_fraction"]]
      .to_string(index=False))
json.dump([r.to_dict() for r in sweep + main], open(sys.argv[1], "w"), indent=1)
PY
