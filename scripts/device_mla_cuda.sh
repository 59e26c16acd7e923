#!/usr/bin/env bash
# The hand-written CUDA MLA decode (kernels/mla_decode.cu, k3lab/ops/mla_decode_cuda.py)
# on an H200, in one device call:
#  1. build it for the device (nvcc, sm_90a): registers and spills from ptxas, shared memory;
#  1b. a smoke run (60 s limit) of each form on a small case; a failure or a hang stops the script;
#  2. its GPU tests (tests/test_mla_decode_cuda.py: paged and contiguous, mixed lengths, lengths that
#     are not multiples of the 32-row tile, NaN past the lengths, one piece, graph replay), in their
#     own process so that a fault there does not stop the timing step from reporting;
#  3. check (fp32 reference) then time, graph replay with rotated input sets, the CUDA kernel beside
#     the Triton `after` plan at ctx1k, ctx32k, ctx128k and b8_8k (B = 1 unless named, 12 heads, bf16,
#     paged, page 64: the mla_padding study's inputs), plus 8 warps per block, a few piece counts and
#     ring depths. Records (study mla_padding): '<case>.cuda' (the split kernel: 5 stages, 4 warps),
#     '<case>.cuda.team' (the team kernel), '<case>.cuda.team.sp<N>', '<case>.cuda.team.nopdl' (sweep
#     points) and '<case>.r5.split' (the Triton after in the same process);
#     a kernel whose check fails is timed anyway but written to mla_cuda_unchecked.json only.
#  4. NCU=1: one ncu report of the split kernel at 32K (speed of light, occupancy, warp states) in
#     $OUT/ncu_mla_cuda.txt.
# Prints a table last. Files in $OUT: mla_cuda.json, mla_cuda_unchecked.json (if any), build.txt,
# tests.txt, ncu_mla_cuda.txt (NCU=1).
#   OUT=dir K3LAB_COMMIT=<hash> [NCU=1] [CASES=ctx32k,ctx128k] [TIMING_ONLY=1] bash scripts/device_mla_cuda.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"

if [ "${TIMING_ONLY:-0}" != 1 ]; then  # TIMING_ONLY=1: steps 3 and 3b only
echo "== 1. build"
timeout 240 python3 - <<'PY' 2>&1 | tee "$OUT/build.txt"
import re
from pathlib import Path
from k3lab.ops import _build
from k3lab.ops import mla_decode_cuda as mc
ok, why = mc.status()
print("status:", ok, why)
kind, target = _build.device_target()
lib = _build.compile_kernel(mc.NAME, kind=kind, target=target, output="shared")
report = Path(str(lib) + ".log").read_text()
for name, regs in zip(re.findall(r"Compiling entry function '(\w+)'", report), re.findall(r"Used (\d+) registers", report)):
    print(f"{name:48s} {regs} registers")
print("spill stores:", re.findall(r"(\d+) bytes spill stores", report))
if ok:
    print({(s, w): {"regs": mc.registers(s, w), "smem": mc.smem_bytes(s)} for s in mc.STAGES for w in mc.WARPS})
PY

echo "== 1b. smoke (one small decode per form, 60 s limit: a hang here must not eat the call)"
if ! timeout 60 python3 - <<'PY'
import torch
from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc
q = torch.randn(2, 1, 12, 576, device="cuda").bfloat16()
cache = torch.randn(2, 4097, 576, device="cuda").bfloat16()
lens = torch.tensor([4097, 100], device="cuda", dtype=torch.int32)
pool, bt = mla.to_paged(cache, 64)
ro, rl = mla.reference(q.float(), cache.float(), lens)
for form, warps in (("team", 4), ("split", 4), ("split", 8)):
    for paged in (True, False):
        o, lse = mc.mla_decode_cuda(q, pool if paged else cache, lens, block_table=bt if paged else None, warps=warps,
                                    form=form)
        torch.cuda.synchronize()
        err = ((o.float() - ro).norm() / ro.norm()).item()
        print(f"{form} warps {warps} paged {paged}: rel_l2 {err:.2e}  lse max abs {(lse - rl).abs().max().item():.2e}",
              flush=True)
PY
then
  echo "SMOKE FAILED OR HUNG: skipping the tests and the timing (see above)"; exit 3
fi

echo "== 2. tests"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_mla_decode_cuda.py 2>&1 | tail -40 | tee "$OUT/tests.txt"

fi

echo "== 3. timing"
timeout "${TIMING_TIMEOUT:-300}" python3 - "$OUT" <<'PY'
import json, os, sys, time, traceback
import torch
from k3lab import bench, env
from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st
out = sys.argv[1]
t0 = time.time()
info = env.detect()
HEADS = 12
want = [c for c in os.environ.get("CASES", "ctx1k,ctx32k,ctx128k,b8_8k").split(",") if c]
cases = {c.name: c for c in (st.Case("ctx1k", 1, 1024), st.Case("ctx32k", 1, 32768), st.Case("ctx128k", 1, 131072),
                                st.Case("b8_8k", 8, 8192), st.Case("tiny", 1, 100))}  # tiny: a CPU dry run
SWEEP = {"ctx1k": [("team", dict(form="team"))], "b8_8k": [("team", dict(form="team"))],
         "ctx32k": [("team", dict(form="team")), ("team.sp64", dict(form="team", num_splits=64)),
                    ("team.sp96", dict(form="team", num_splits=96)), ("team.nopdl", dict(form="team", pdl=False))],
         "ctx128k": [("team", dict(form="team")), ("team.sp96", dict(form="team", num_splits=96))]}
checked, unchecked, rows = [], [], []

def record(rcase, variant, fn_of_set, sets, nbytes, floor, shape, errors, facts, ok):
    rot = [(s,) for s in sets]
    timing = bench.time_fn(fn_of_set, rotate=rot, graph=torch.cuda.is_available(), warmup=10, repeats=100)
    tbs = nbytes / (timing.median_us * 1e-6) / 1e12
    rec = bench.make_record("mla_padding", rcase, variant, timing, shape=shape, dtype=torch.bfloat16, floor_us=floor,
                            error=errors, cache_bytes=nbytes, achieved_tbs=tbs, copy_bw_fraction=tbs / info.peak.bandwidth_tbs,
                            compute_units=info.compute_units, layout="paged", peer=None, **facts)
    (checked if ok else unchecked).append(rec)
    rows.append((rcase, variant, timing.median_us, floor, floor / timing.median_us, "ok" if ok else "UNCHECKED"))
    print(f"{time.time() - t0:5.0f} s  {rcase:22s} {variant:6s} {timing.median_us:9.2f} us  floor {floor:7.2f}  "
          f"{floor / timing.median_us:6.1%}  {'ok' if ok else 'UNCHECKED'}", flush=True)

for name in want:
    case = cases[name]
    first = st._make_set(case, HEADS, torch.bfloat16, seed=11)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, HEADS, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=16) - 1)]
    floor = bench.floor_us(bytes=nbytes)
    shape = {"batch": case.batch, "context": case.context, "q_len": 1, "heads": HEADS, "padded_heads": 16,
             "latent": 576, "value": 512, "page_size": st.PAGE_SIZE, "ragged": False,
             "lengths_sum": sum(first["lengths_host"])}
    ro, rl = mla.reference(first["q"].float(), first["pool"].float(), first["lengths"], block_table=first["table"])
    variants = [("cuda", f"{name}.cuda", {})] + [("cuda", f"{name}.cuda.{tag}", kw) for tag, kw in SWEEP.get(name, [])]
    variants.append(("triton", f"{name}.r5.split", {}))
    for kind, rcase, kw in variants:
        try:
            if kind == "cuda":
                plans = [mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], **kw) for s in sets]
            else:
                plans = [mla.plan_after(s["q"], s["pool"], s["lengths"], block_table=s["table"]) for s in sets]
            o, lse = plans[0]()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            try:
                errors = bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
                ok = True
            except AssertionError as exc:
                errors, ok = {"failed": str(exc)[:500]}, False
                print(f"CHECK FAILED {rcase}: {str(exc)[:300]}", flush=True)
            idx = {id(s): i for i, s in enumerate(sets)}
            record(rcase, "after", lambda s, p=plans: p[idx[id(s)]](), sets, nbytes, floor, shape, errors,
                   plans[0].facts(), ok)
        except Exception:
            traceback.print_exc()
            print(f"FAILED {rcase}", flush=True)
        json.dump([r.to_dict() for r in checked], open(f"{out}/mla_cuda.json", "w"), indent=1)
        if unchecked:
            json.dump([r.to_dict() for r in unchecked], open(f"{out}/mla_cuda_unchecked.json", "w"), indent=1)
    del sets, first
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

print(f"\n{'case':24s} {'us':>9s} {'floor':>8s} {'of floor':>9s}")
for rcase, variant, us, floor, frac, flag in rows:
    print(f"{rcase:24s} {us:9.2f} {floor:8.2f} {frac:9.1%}  {flag}")
PY

if [ "${TIMING_ONLY:-0}" != 1 ]; then
echo "== 3b. timeline probe"
FORMS=split,team timeout 120 python3 scripts/device_mla_probe.py 2>&1 | tail -20
fi

if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null 2>&1; then
  echo "== 4. ncu"
  cat > /tmp/mla_ncu.py <<'PY'
import torch
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st
s = st._make_set(st.Case("ctx32k", 1, 32768), 12, torch.bfloat16, seed=3)
p = mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], form="team")
for _ in range(3):
    p()
torch.cuda.synchronize()
PY
  timeout 200 ncu --kernel-name regex:team_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis python3 /tmp/mla_ncu.py \
    > "$OUT/ncu_mla_cuda.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers|Stall|Warp Cycles" "$OUT/ncu_mla_cuda.txt" | head -30
fi
