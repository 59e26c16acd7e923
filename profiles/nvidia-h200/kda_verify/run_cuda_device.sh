#!/usr/bin/env bash
# One device call for the CUDA verify kernel (kernels/kda_verify.cu): its GPU tests, the sweep of its
# forms beside the Triton step form, then the main case (before / after / fla in one run) with the
# CUDA step form as 'after' if it beat the Triton step form in the sweep (K3LAB_KDA_VERIFY_FORM),
# else with the Triton default; last, Nsight Compute's stall reasons for the CUDA forms. Each bench is
# its own process writing its own JSON, so one failing case does not lose the others.
#   K3LAB_COMMIT=<hash> bash profiles/nvidia-h200/kda_verify/run_cuda_device.sh $OUT   (fla wheel in .whl)
set -u
OUT=${1:?output folder}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
t0=$(date +%s)
python3 -c "from k3lab.ops import kda_verify_cuda as kc; print(kc.status())" 2>&1 | tail -1
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_kda_verify.py -k cuda 2>&1 | tail -6
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 60 python3 -m k3lab.cli bench kda_verify --json "$OUT/sweep.json" --cases b1_t4.narrow8_w1 \
  b1_t4.cuda8_w4 b1_t4.cudachunk8_w8 b1_t4.cuda8_w8 b1_t4.cuda4_w2 \
  b1_t1.cuda8_w4 b1_t2.cuda8_w4 b1_t8.cuda8_w4 b8_t4.cuda8_w4 2>&1 | tail -1
echo "sweep done at $(( $(date +%s) - t0 )) s"
WIN=$(python3 - "$OUT/sweep.json" <<'PY'
import json, sys
try:
    r = {x["case"]: x["median_us"] for x in json.load(open(sys.argv[1])) if x["mode"] == "graph"}
    print("cuda" if r["b1_t4.cuda8_w4"] < r["b1_t4.narrow8_w1"] else "step")
except Exception:
    print("step")
PY
)
echo "main case 'after' form: $WIN"
K3LAB_KDA_VERIFY_FORM=$WIN timeout 60 python3 -m k3lab.cli bench kda_verify --cases b1_t4 b1_t4.final_only \
  --json "$OUT/v.json" 2>&1 | tail -1
echo "main done at $(( $(date +%s) - t0 )) s"
python3 - "$OUT" <<'PY'
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
        print(f"{r['case']:22s} {r['variant']:6s} {r['median_us']:6.2f} us {e.get('kernel', '')} w{e.get('num_warps')}"
              f" S {r['error']['states']['max_rel']:.0e}")
PY
for f in cuda cuda_chunk; do
  timeout 30 ncu -k regex:kda_verify_kernel --launch-skip 1 --launch-count 1 --csv --print-units base \
    --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 profiles/nvidia-h200/kda_verify/ncu_target.py $f > "$OUT/ncu_$f.csv" 2>&1
  python3 - "$OUT/ncu_$f.csv" "$f" <<'PY'
import csv, sys
vals = {}
for row in csv.reader(open(sys.argv[1])):
    if len(row) > 3 and row[-3].startswith(("gpu__", "smsp__")):
        try:
            vals[row[-3].replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")] = float(row[-1].replace(",", ""))
        except ValueError:
            pass
top = sorted(((v, k) for k, v in vals.items() if not k.startswith(("gpu__", "smsp__inst"))), reverse=True)[:6]
print(sys.argv[2], {k: vals[k] for k in vals if k.startswith(("gpu__", "smsp__inst"))}, [(k, round(v, 2)) for v, k in top])
PY
done
echo "all done at $(( $(date +%s) - t0 )) s"
