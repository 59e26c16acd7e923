#!/usr/bin/env bash
# Issue 6, run 7: the cases that take the group scan (12 heads, B = 1, 16K and 64K tokens) with the
# CUDA walks (kernels/kda_walk.cu) as the after's default, each checked against fp64, fla's chunk_kda
# beside them; the walk bench; traces of one call per variant at 12 heads x 16K. Prebuilt kernels in
# .cache/kbuild (carry .cache and .whl).   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_prefill_run7.sh
source "$(dirname "$0")/device_env.sh"
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-.cache/kbuild}"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
mkdir -p "$W/rec" "$W/tr"
timeout 250 python3 -m k3lab.studies.kda_scan --out "$W/rec" --budget-s 230 --fla-first-s 150 --phases cases \
  --cases h12_b1_t16384,h12_b1_t65536 2>&1 | tee "$OUT/run7_log.txt" | grep -v "^ *$" | tail -14
OUT="$W/rec" timeout 90 python3 scripts/device_walk_bench.py h12_b1_t16384 > "$OUT/walk_bench_log.txt" 2>&1; tail -22 "$OUT/walk_bench_log.txt"
TRACE_TIMEOUT=60 OUT="$W/tr" bash "$(dirname "$0")/device_prefill_traces.sh" >/dev/null 2>&1
tar czf "$OUT/run7.tgz" -C "$W" rec tr; ls "$OUT"; tar tzf "$OUT/run7.tgz" | wc -l
