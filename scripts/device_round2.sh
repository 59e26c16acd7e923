#!/usr/bin/env bash
# Second device call of 2026-11-30 (session 3): the AttnRes cluster kernel as `after` chooses it
# (GPU tests, the few-token comparison, the main cases and traces) and the KDA decode sweep with cold
# state (every option per batch, then records with each batch's best). Results in $OUT/all.tgz.
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_round2.sh
# (Ran at commit dc23e22; tests/test_attn_res_spread.py has since been removed with its kernel.)
source "$(dirname "$0")/device_env.sh"
timeout 150 python3 -m pytest -q tests/test_attn_res_spread.py tests/test_attn_res_cuda.py 2>&1 | tail -4
OUT=$W SPREAD=1 MAIN=1 SWEEP_TIMEOUT=280 ATTN_RES_SHAPES="1:9" ATTN_RES_SWEPT="tile8" \
  bash scripts/device_attn_res.sh 2>&1 | grep -v "^ *$" | tail -40
timeout 200 python3 -m k3lab.studies.kda_decode_bench --out $W/kd --batches 1,8,32,128 --tuned 2>&1 | grep -v "^sweep" | tail -14
python3 - <<'PY' 2>&1 | tail -12
import json
rows = json.load(open("/tmp/k3w/kd/sweep.json"))
for B in sorted({r["B"] for r in rows}):
    got = sorted((r for r in rows if r["B"] == B and r.get("graph_us")), key=lambda r: r["graph_us"])[:4]
    for r in got:
        print(B, round(r["graph_us"], 2), {k: r[k] for k in ("tile_v", "threads", "split", "hints", "layout",
                                                              "prefetch_ahead") if k in r})
PY
tar czf "$OUT/all.tgz" -C "$W" .
