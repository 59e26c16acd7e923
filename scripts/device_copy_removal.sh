#!/usr/bin/env bash
# One GPU session for notebook 03 and the harness: copy_removal (AttnRes fusion, packing at full
# depth), the launch-overhead curve, the profiler self-check, and traces of before/after.
# Usage on a GPU machine: OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_copy_removal.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:."
OUT="${OUT:-build/device}"; mkdir -p "$OUT" /tmp/k3lab-run
python3 -m k3lab.cli info
python3 -m k3lab.profile --trace-dir /tmp/k3lab-run/selfcheck | tail -5
python3 -m k3lab.cli bench copy_removal --cases attn_res_t1_s2 attn_res_t1_s9 attn_res_t64_s2 attn_res_t64_s5 \
  attn_res_t64_s9 attn_res_t8192_s2 attn_res_t8192_s5 attn_res_t8192_s9 packing \
  --out /tmp/k3lab-run --json "$OUT/copy_removal.json"
python3 -m k3lab.cli profile copy_removal --out /tmp/k3lab-run --steps 3 --top 8
for f in /tmp/k3lab-run/traces/copy_removal/*.json; do gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
python3 -m k3lab.studies.launch_overhead --json "$OUT/launch_overhead.json" | tail -25
