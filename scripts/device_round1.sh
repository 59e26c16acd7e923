#!/usr/bin/env bash
# One device call: the GPU tests of the experimental AttnRes kernels and KDA kernels, the AttnRes
# experiments (SPREAD) and main cases (MAIN), the KDA decode bench with cold state, and the KDA verify
# tile/vk sweep points. Everything lands in $OUT/all.tgz (the device returns at most 8 files).
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_round1.sh
# (Ran at commit 7ebd1a1; tests/test_attn_res_spread.py has since been removed with its kernel.)
source "$(dirname "$0")/device_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
timeout 150 python3 -m pytest -q -x tests/test_attn_res_spread.py tests/test_attn_res_cuda.py tests/test_kda_decode.py \
  tests/test_kda_verify.py 2>&1 | tail -8
OUT=$W SPREAD=1 MAIN=1 SWEEP_TIMEOUT=260 ATTN_RES_SHAPES="1:9" ATTN_RES_SWEPT="tile8" \
  bash scripts/device_attn_res.sh 2>&1 | grep -v "^ *$" | tail -60
timeout 120 python3 -m k3lab.studies.kda_decode_bench --out $W/kd --batches 1,8,32,128 2>&1 | tail -14
timeout 150 python3 -m k3lab.cli bench kda_verify --out /tmp/k3v --json $W/kda_verify.json --cases b1_t4 b1_t4.final_only \
  b1_t4.tile8_w1 b1_t4.tile8_w2 b1_t4.tile4_w1 b1_t4.vk8_w1 b1_t4.vk8_w2 b1_t4.vk4_w1 b1_t4.narrow8_w1 b1_t4.narrow4_w1 2>&1 | tail -20
tar czf "$OUT/all.tgz" -C "$W" .
