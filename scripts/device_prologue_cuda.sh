#!/usr/bin/env bash
# Issue 6: the CUDA prologue (kernels/kda_prologue.cu) on the device. Its GPU tests, the whole
# tests/test_kda_verify.py on the GPU, then the study's calibration with the 'cuda' and 'rows'
# prologues (each checked end to end against fp64 first) and the 12-head 16K case (before, after,
# fla's chunk_kda in one run). Prebuilt kernels: K3LAB_KERNEL_CACHE=.cache/kbuild (carry .cache).
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_prologue_cuda.sh
source "$(dirname "$0")/device_env.sh"
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-.cache/kbuild}"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout 150 python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_kda_prologue_cuda.py tests/test_kda_verify.py} 2>&1 | tee "$OUT/tests_log.txt" | tail -25
timeout "${RUN_TIMEOUT:-200}" python3 -m k3lab.studies.kda_scan --out "$OUT" --issue6 --budget-s "${BUDGET_S:-180}" \
  --fla-first-s 35 --phases "${PHASES:-calibrate,cases}" --prologues "${PROLOGUES:-cuda,rows}" \
  --cases "${CASES:-h12_b1_t16384}" 2>&1 | tee "$OUT/study_log.txt" | grep -v "^ *$" | tail -45
