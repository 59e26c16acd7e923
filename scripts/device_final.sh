#!/usr/bin/env bash
# The last GPU session of 2026-11-30: the reworked AttnRes kernel, the pipelined MLA decode, and
# the KDA prefill prologues. Each stage has its own time limit so a slow one cannot take the others'
# results with it. Usage: OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_final.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT" /tmp/k3lab-run
timeout 100 python3 -m k3lab.cli bench copy_removal --out /tmp/k3lab-run --json "$OUT/attn_res.json" --cases \
  attn_res_t1_s2 attn_res_t1_s9 attn_res_t64_s9 attn_res_t8192_s2 attn_res_t8192_s5 attn_res_t8192_s9 2>&1 | tail -16
timeout 190 python3 -m k3lab.cli bench mla_padding --out /tmp/k3lab-run --json "$OUT/mla.json" --cases \
  ctx1k ctx32k ctx128k b1_8k b8_8k b64_8k ragged8_8k verify4_32k ctx32k.s1 ctx32k.s16 ctx32k.s64 ctx32k.s128 \
  ctx32k.s256 2>&1 | tail -20
timeout 110 python3 -m k3lab.studies.kda_scan --out /tmp/k3lab-run/ks --phases calibrate --budget-s 90 2>&1 | tail -12
tar czf "$OUT/kda_scan.tgz" -C /tmp/k3lab-run ks
