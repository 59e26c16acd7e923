#!/usr/bin/env bash
# Third device call of 2026-11-30 (session 3): the GPU tests of issue 4's kernels and the harness,
# the AttnRes main cases and traces with `after`'s choices (the cluster kernel for a few tokens and
# 5+ sources) timed with graphs sized from a replay, and KDA decode traces with the B=1 split of 16
# columns. Results in $OUT/all.tgz.   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_round3.sh
source "$(dirname "$0")/device_env.sh"
timeout 200 python3 -m pytest -q tests/test_kda_decode.py tests/test_attn_res_cuda.py tests/test_attn_res_norm.py \
  tests/test_bench.py tests/test_packed_matmul.py 2>&1 | tail -6
OUT=$W MAIN=1 SWEEP_TIMEOUT=240 ATTN_RES_SHAPES="1:2" ATTN_RES_SWEPT="tile8" \
  bash scripts/device_attn_res.sh 2>&1 | grep -v "^ *$" | tail -24
timeout 90 python3 -m k3lab.studies.kda_decode_bench --out $W/kd --batches 1 --repeats 50 --trace 2>&1 | tail -6
tar czf "$OUT/all.tgz" -C "$W" .
