#!/usr/bin/env bash
# Issue 6, second device call: the study with issue 6's calibration (prologue candidates
# PROLOGUE_CANDIDATES_I6, the after's walk-side options AFTER_CANDIDATES; each checked end to end
# against fp64 before it can be chosen), then the main 12-head cases with what it chose (before,
# after, fla's chunk_kda in the same run) and the group-size sweep at 12 heads x 16K.
# Records in $OUT/records.json, log in $OUT/run5_log.txt.
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_prefill_issue6_records.sh
source "$(dirname "$0")/device_env.sh"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout "${RUN_TIMEOUT:-215}" python3 -m k3lab.studies.kda_scan --out "$OUT" --issue6 --budget-s "${BUDGET_S:-195}" \
  --fla-first-s 35 --phases calibrate,cases,sweep --sweep-cases h12_b1_t16384 \
  --cases "${CASES:-h12_b1_t16384,h12_b1_t65536,h12_b8_t65536,h12_b8_t16384}" \
  2>&1 | tee "$OUT/run5_log.txt" | grep -v "^ *$" | tail -60
ls "$OUT"
