#!/usr/bin/env bash
# One device call for the hand-written verify kernel (kernels/kda_verify.cu): its GPU tests, then in
# one process the forms side by side at B = 1, T = 4 (the main case with before / Triton step 'after'
# / fla, the 4-warp 'cuda' form and the warp form on 1 and 4 warps, each plain and as a
# programmatic dependent launch), then the main cases (T = 1, 2, 4, 8, final_only, B = 8) again with
# the fastest of them as 'after' (K3LAB_KDA_VERIFY_FORM, _WARPS and _PDL) and its depth profile
# without PDL. Every case is checked against fp64 before it is timed; a failing case is
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
warp = [f"b1_t4.cudawarp8_w{w}{p}" for w in (1, 4) for p in ("", "_pdl")]
sweep = ["b1_t4", "b1_t4.cuda8_w4", "b1_t4.cuda8_w4_pdl"] + (warp if tests_rc == 0 else [])
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
# the fastest 'after' at b1_t4 (graph replay): (median, form, warps, pdl)
after = [(r["median_us"], r["extra"]["form"] or "step", r["extra"]["num_warps"], bool(r["extra"].get("pdl")))
         for r in recs if r["mode"] == "graph" and r["variant"] == "after" and r["case"].startswith("b1_t4")]
for a in sorted(after):
    print("b1_t4 after", a)
best = min(after)
print("main cases with", best)
if best[1] in ("cuda", "cuda_warp"):  # the main cases again with that form as 'after' (the step-form ones are replaced)
    os.environ.update(K3LAB_KDA_VERIFY_FORM=best[1], K3LAB_KDA_VERIFY_WARPS=str(best[2]),
                      K3LAB_KDA_VERIFY_PDL="1" if best[3] else "0")
    recs = [r for r in recs if r["case"] != "b1_t4"]
    run(["b1_t4", "b1_t1", "b1_t2", "b1_t8", "b1_t4.final_only", "b8_t4"], tag=" (best form)")
    w = best[2]
    if best[1] == "cuda_warp":  # its depth and batch profile with and without PDL, as sweep points
        run([f"b{b}_t{t}.cudawarp8_w{w}{p}" for b, t in ((1, 1), (1, 2), (1, 8), (8, 4)) for p in ("", "_pdl")])
        with open("/tmp/kv_best_warps", "w") as f:
            f.write(str(w))
for r in recs:
    if r["mode"] == "graph":
        e = r["extra"]
        err = r["error"]["states"]["max_rel"]
        print(f"{r['case']:24s} {r['variant']:6s} {r['median_us']:6.2f} us  {e.get('kernel', '')} w{e.get('num_warps')}"
              f" pdl={e.get('pdl')} S {err:.0e}")
PY
echo "bench done at $(( $(date +%s) - t0 )) s"
if [ "${2:-}" = ncu ]; then
  timeout 40 ncu -k regex:kda_verify --launch-skip 1 --launch-count 1 --csv --print-units base \
    --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    python3 profiles/nvidia-h200/kda_verify/ncu_target.py cuda_warp "$(cat /tmp/kv_best_warps 2>/dev/null || echo 1)" > "$OUT/ncu_cuda_warp.csv" 2>&1
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
