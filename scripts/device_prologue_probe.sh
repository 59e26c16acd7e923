#!/usr/bin/env bash
# Issue 6: the CUDA prologue's timeline probe and ncu counters of one launch (prebuilt kernels in
# .cache/kbuild; carry .cache). OUT=dir bash scripts/device_prologue_probe.sh
source "$(dirname "$0")/device_env.sh"
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-.cache/kbuild}"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_kda_prologue_cuda.py 2>&1 | tail -4
timeout 120 python3 scripts/device_prologue_probe.py ${CASES:-h12_b1_t16384} 2>&1 | tee "$OUT/probe_log.txt"
if [ -n "${NCU-1}" ] && command -v ncu >/dev/null; then  # NCU= (empty) skips the counters
  timeout 150 ncu --kernel-name-base mangled --kernel-name regex:k3kp --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section InstructionStats --print-details all --csv --page details python3 scripts/device_prologue_probe.py h12_b1_t16384 > "$OUT/ncu.csv" 2> "$OUT/ncu_err.txt"
  python3 "$(dirname "$0")/ncu_table.py" "$OUT/ncu.csv"
fi
