#!/usr/bin/env bash
# Issue 6, this session's records call: GPU tests of the CUDA prologue and the chunk kernels, the
# study (calibration of the 'cuda' and 'rows' prologues, each checked against fp64 first; the whole
# crossover grid with fla's chunk_kda where the budget leaves room for its compile; the group-size
# sweep; the ragged case), then torch.profiler traces of one call per variant at 12 heads x 16K.
# Prebuilt kernels in .cache/kbuild (carry .cache and .whl).
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_prefill_final.sh
source "$(dirname "$0")/device_env.sh"
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-.cache/kbuild}"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kda_prologue_cuda.py tests/test_kda_chunk.py 2>&1 \
  | tee "$OUT/tests_log.txt" | tail -6
timeout "${RUN_TIMEOUT:-370}" python3 -m k3lab.studies.kda_scan --out "$OUT" --issue6 --budget-s "${BUDGET_S:-350}" \
  --fla-first-s "${FLA_FIRST_S:-150}" --phases calibrate,cases,sweep --prologues cuda,rows 2>&1 \
  | tee "$OUT/run6_log.txt" | grep -v "^ *$" | tail -40
TRACE_TIMEOUT=60 OUT="$OUT" bash "$(dirname "$0")/device_prefill_traces.sh" >/dev/null 2>&1; ls "$OUT"
