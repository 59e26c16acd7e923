#!/usr/bin/env bash
# One device call for the hand-written verify kernel (kernels/kda_verify.cu): its GPU tests, then in
# one process the forms side by side (the main case b1_t4 with before / Triton step 'after' / fla,
# the 4-warp 'cuda' form, the warp form plain and as a programmatic dependent launch, at T = 1, 2, 4,
# 8), then the main cases again with the fastest b1_t4 form as 'after' (K3LAB_KDA_VERIFY_FORM and
# K3LAB_KDA_VERIFY_PDL). Every case is checked against fp64 before it is timed; a failing case is
# reported and skipped, and the JSON is rewritten after each case, so a late failure loses nothing.
#   K3LAB_COMMIT=<hash> bash profiles/nvidia-h200/kda_verify/run_cuda_device.sh $OUT [ncu]   (fla wheel in .whl)
set -u
OUT=${1:?output folder}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:. || exit 1
t0=$(date +%s)
python3 -c "from k3lab.ops import kda_verify_cuda as kc; print(kc.status())" 2>&1 | tail -1
timeout 75 python3 -m pytest -q -p no:cacheprovider --tb=line tests/test_kda_verify.py -k cuda 2>&1 | tail -12
WARP_OK=${PIPESTATUS[0]}
echo "tests rc=$WARP_OK at $(( $(date +%s) - t0 )) s"
timeout 110 python3 - "$OUT/kda_verify.json" "$WARP_OK" <<'PY'
import json, os, sys, time
from k3lab.studies import kda_verify as study

path, tests_rc = sys.argv[1], int(sys.argv[2])
warp = [f"b1_t{t}.cudawarp8_w1{p}" for t in (4, 1, 2, 8) for p in ("", "_pdl")]
sweep = ["b1_t4", "b1_t4.cuda8_w4"] + (warp if tests_rc == 0 else [])
recs, t0 = [], time.time()


def run(cases, tag=""):
    for c in cases:
        try:
            recs.extend(r.to_dict() for r in study.run(cases=[c]))
        except Exception as exc:  # noqa: BLE001 - report and go on with the next case
            print(f"FAILED {c}{tag}: {exc!r}"[:400])
        with open(path, "w") as f:
            json.dump(recs, f)
        print(f"{c}{tag} done at {time.time() - t0:.0f} s", flush=True)


run(sweep)
graph = {r["case"]: r["median_us"] for r in recs if r["mode"] == "graph" and r["variant"] == "after"}
forms = {"step": graph.get("b1_t4"), "cuda": graph.get("b1_t4.cuda8_w4"),
         "cuda_warp": graph.get("b1_t4.cudawarp8_w1"), "cuda_warp+pdl": graph.get("b1_t4.cudawarp8_w1_pdl")}
best = min((v, k) for k, v in forms.items() if v is not None)[1]
print("b1_t4 'after' forms (graph us):", forms, "-> main cases with", best)
if best != "step":  # the main cases again, with that form as 'after' (their step-form records are replaced)
    os.environ["K3LAB_KDA_VERIFY_FORM"] = best.split("+")[0]
    os.environ["K3LAB_KDA_VERIFY_PDL"] = "1" if best.endswith("+pdl") else "0"
    recs = [r for r in recs if r["case"] != "b1_t4"]
    run(["b1_t4", "b1_t1", "b1_t2", "b1_t8", "b1_t4.final_only"], tag=f" ({best})")
for r in recs:
    if r["mode"] == "graph":
        e = r["extra"]
        err = r["error"]["states"]["max_rel"]
        print(f"{r['case']:24s} {r['variant']:6s} {r['median_us']:6.2f} us  {e.get('kernel', '')} w{e.get('num_warps')}"
              f" pdl={e.get('pdl')} S {err:.0e}")
PY
echo "bench done at $(( $(date +%s) - t0 )) s"
if [ "${2:-}" = ncu ]; then
  timeout 40 ncu -k regex:kda_verify_warp_kernel --launch-skip 1 --launch-count 1 --csv --print-units base \
    --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 profiles/nvidia-h200/kda_verify/ncu_target.py cuda_warp > "$OUT/ncu_cuda_warp.csv" 2>&1
  python3 - "$OUT/ncu_cuda_warp.csv" <<'PY'
import csv, sys
vals = {}
for row in csv.reader(open(sys.argv[1])):
    if len(row) > 3 and row[-3].startswith(("gpu__", "smsp__")):
        try:
            vals[row[-3].replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")] = float(row[-1].replace(",", ""))
        except ValueError:
            pass
top = sorted(((v, k) for k, v in vals.items() if not k.startswith(("gpu__", "smsp__inst"))), reverse=True)[:8]
print("ncu cuda_warp", {k: vals[k] for k in vals if k.startswith(("gpu__", "smsp__inst"))}, [(k, round(v, 2)) for v, k in top])
PY
fi
echo "all done at $(( $(date +%s) - t0 )) s"
