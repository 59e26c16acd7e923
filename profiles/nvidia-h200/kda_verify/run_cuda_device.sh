#!/usr/bin/env bash
# One device call for the CUDA verify kernel (kernels/kda_verify.cu): its GPU tests, then the main
# case (before / after / fla in one run, after = the kernel's default form), then the sweep of the
# kernel's forms and configs beside the Triton step form. Each bench is its own process writing its
# own JSON, so one failing case does not lose the others. Usage (repo root, fla wheel in .whl):
#   K3LAB_COMMIT=<hash> bash profiles/nvidia-h200/kda_verify/run_cuda_device.sh $OUT
set -u
OUT=${1:?output folder}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
t0=$(date +%s)
python3 -c "from k3lab.ops import kda_verify_cuda as kc; print(kc.status())" 2>&1 | tail -2
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_kda_verify.py -k cuda 2>&1 | tail -12
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 60 python3 -m k3lab.cli bench kda_verify --cases b1_t4 b1_t4.final_only --json "$OUT/v.json" 2>&1 | tail -3
echo "main done at $(( $(date +%s) - t0 )) s"
timeout 55 python3 -m k3lab.cli bench kda_verify --json "$OUT/sweep.json" --cases b1_t4.narrow8_w1 \
  b1_t4.cudachunk8_w4 b1_t4.cuda8_w8 b1_t4.cuda8_w2 b1_t4.cuda4_w4 b1_t4.cudachunk8_w8 \
  b1_t1.cuda8_w4 b1_t2.cuda8_w4 b1_t8.cuda8_w4 b1_t1.cudachunk8_w4 b1_t2.cudachunk8_w4 b1_t8.cudachunk8_w8 \
  b8_t4.cuda8_w4 b32_t4.cuda8_w4 2>&1 | tail -3
echo "sweep done at $(( $(date +%s) - t0 )) s"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
rows = []
for name in ("v.json", "sweep.json"):
    p = Path(sys.argv[1]) / name
    if p.is_file():
        rows += json.loads(p.read_text())
for r in rows:
    if r["mode"] == "graph":
        e = r["extra"]
        print(f"{r['case']:24s} {r['variant']:7s} {r['median_us']:7.2f} us  {e.get('kernel', '')}"
              f" tile {e.get('tile_v')} w{e.get('num_warps')}  S err {r['error']['states']['max_rel']:.1e}")
EOF
