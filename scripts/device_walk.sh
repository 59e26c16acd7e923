#!/usr/bin/env bash
# Issue 6: the CUDA walks (kernels/kda_walk.cu): their GPU tests and the prologue's, then the walk
# bench (scripts/device_walk_bench.py). Prebuilt kernels in .cache/kbuild (carry .cache).
#   OUT=dir CASES="h12_b1_t16384 ..." bash scripts/device_walk.sh
source "$(dirname "$0")/device_env.sh"
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-.cache/kbuild}"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -x tests/test_kda_walk_cuda.py \
  tests/test_kda_prologue_cuda.py 2>&1 | tee "$OUT/tests_log.txt" | tail -15
timeout "${BENCH_TIMEOUT:-200}" python3 scripts/device_walk_bench.py ${CASES:-h12_b1_t16384} 2>&1 | tee "$OUT/bench_log.txt"
if [ -n "${NCU-1}" ] && command -v ncu >/dev/null; then  # NCU= (empty) skips the counters
  timeout 150 ncu --kernel-name-base mangled --kernel-name "regex:${NCU_KERNEL:-walk_kernelILb1}" --launch-skip 2 \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --print-details all --csv --page details python3 scripts/kda_walk_ncu_target.py \
    > "$OUT/ncu.csv" 2> "$OUT/ncu_err.txt"
  python3 "$(dirname "$0")/ncu_table.py" "$OUT/ncu.csv"
fi
