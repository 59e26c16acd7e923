#!/usr/bin/env bash
# Issue 6, the closing GPU call: every KDA prefill GPU test (tests/test_kda_chunk.py on the GPU, the CUDA
# prologue's and walks'), then the two cases that take the group scan again with fla beside them (fla's
# own time moves between calls). Prebuilt kernels in .cache/kbuild (carry .cache and .whl).
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_issue6_tests.sh
source "$(dirname "$0")/device_env.sh"
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-.cache/kbuild}"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout "${TEST_TIMEOUT:-330}" python3 -m pytest -q -p no:cacheprovider tests/test_kda_walk_cuda.py \
  tests/test_kda_prologue_cuda.py tests/test_kda_chunk.py 2>&1 | tee "$OUT/tests_log.txt" | tail -8
mkdir -p "$W/rec"
timeout 120 python3 -m k3lab.studies.kda_scan --out "$W/rec" --budget-s 100 --fla-first-s 60 --phases cases \
  --cases h12_b1_t16384,h12_b1_t65536 2>&1 | tee "$OUT/run8_log.txt" | grep -v "^ *$" | tail -5
tar czf "$OUT/run8.tgz" -C "$W" rec
