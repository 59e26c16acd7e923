#!/usr/bin/env bash
# One device call: the fused form of the CUDA MLA decode (merge inside the split kernel after a grid
# barrier, one cooperative launch; kernels/mla_decode.cu, k3lab/ops/mla_decode_cuda.py merge='fused')
# against the two-kernel form (the current default) and the Triton after, on an H200:
#  1. smoke (60 s limit): capacity (occupancy x SMs), graph-capture check of the cooperative launch,
#     registers, then one fused decode at 4K and 32K checked against the fp32 reference and the
#     barrier's counters (bounded spin: a hang gives up and is counted, the script stops);
#  2. the fused GPU tests (tests/test_mla_decode_cuda.py -k fused/too_large), in their own process;
#  3. check then time (graph replay, rotated input sets, the mla_padding study's inputs: 12 heads,
#     paged bf16, page 64) at ctx1k, ctx32k, ctx128k, b8_8k: records '<case>.fused' (fused form),
#     '<case>.r6.cuda' (two-kernel form) and '<case>.r6.triton' (the Triton after), all variant 'after'.
#     (Commit a13fe58 also timed '<case>.fused.plain', the fused kernel launched without the
#     cooperative attribute, DIAG=1, to see what the attribute costs: nothing measurable; that
#     diagnostic launch is gone from the library since.)
# Tests run with K3LAB_MLA_MERGE=$TEST_MERGE (default auto: the fused form wherever it applies).
# Files in $OUT: mla_fused.json (checked records), mla_fused_unchecked.json (if any), smoke.txt, tests.txt.
#   OUT=dir K3LAB_COMMIT=<hash> K3LAB_KERNEL_CACHE=.cache/kbuild [STEPS=123] [CASES=...] bash scripts/device_mla_fused.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"
STEPS="${STEPS:-123}"

if [[ "$STEPS" == *1* ]]; then
echo "== 1. smoke"
if ! timeout 60 python3 - <<'PY' 2>&1 | tee "$OUT/smoke.txt"; then
import sys, torch
from k3lab import bench
from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc
print("status:", mc.status())
dev = torch.cuda.current_device()
props = torch.cuda.get_device_properties(dev)
ms = int(props.shared_memory_per_block_optin)
print("fused max blocks:", mc.fused_max_blocks(dev, ms), "SMs", props.multi_processor_count)
print("capturable:", mc.fused_capturable(dev, ms))
print("registers: fused", mc.fused_registers(), "split", mc.registers())
bad = 0
for B, L, paged in ((1, 4097, False), (1, 4097, True), (1, 32768, True), (3, 5000, True)):
    q = torch.randn(B, 1, 12, 576, device="cuda").bfloat16()
    cache = torch.randn(B, L, 576, device="cuda").bfloat16()
    lens = torch.tensor([L] + [L // (i + 2) for i in range(B - 1)], device="cuda", dtype=torch.int32)
    pool, bt = mla.to_paged(cache, 64)
    p = mc.plan(q, pool if paged else cache, lens, block_table=bt if paged else None, merge="fused")
    o, lse = p()
    torch.cuda.synchronize()
    c, t = p._barrier.tolist()
    ro, rl = mla.reference(q.float(), cache.float(), lens)
    try:
        bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
        ok = t == 0 and c == p.programs
    except AssertionError as exc:
        print("CHECK FAILED", str(exc)[:300])
        ok = False
    print(f"B {B} L {L} paged {paged}: splits {p.num_splits} merge {p.merge} counter {c} timeouts {t} "
          f"rel_l2 {((o.float() - ro).norm() / ro.norm()).item():.2e} {'ok' if ok else 'BAD'}", flush=True)
    bad += not ok
sys.exit(1 if bad else 0)
PY
  echo "SMOKE FAILED OR HUNG: skipping the rest"; exit 3
fi
fi

if [[ "$STEPS" == *2* ]]; then
echo "== 2. tests"
K3LAB_MLA_MERGE="${TEST_MERGE:-auto}" timeout "${TEST_TIMEOUT:-100}" python3 -m pytest -q -p no:cacheprovider \
  tests/test_mla_decode_cuda.py ${TEST_K:+-k "$TEST_K"} 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi

if [[ "$STEPS" == *3* ]]; then
echo "== 3. timing"
timeout "${TIMING_TIMEOUT:-110}" python3 - "$OUT" <<'PY'
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
want = [c for c in os.environ.get("CASES", "ctx32k,ctx128k,ctx1k,b8_8k").split(",") if c]
cases = {c.name: c for c in (st.Case("ctx1k", 1, 1024), st.Case("ctx32k", 1, 32768), st.Case("ctx128k", 1, 131072),
                                st.Case("b8_8k", 8, 8192))}
checked, unchecked, rows = [], [], []


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
    for tag, mk in (("fused", lambda s: mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], merge="fused")),
                    ("r6.cuda", lambda s: mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], merge="kernel")),
                    ("r6.triton", lambda s: mla.plan_after(s["q"], s["pool"], s["lengths"], block_table=s["table"],
                                                           kernel="split"))):
        rcase = f"{name}.{tag}"
        try:
            plans = [mk(s) for s in sets]
            o, lse = plans[0]()
            torch.cuda.synchronize()
            try:
                errors = bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
                ok = True
            except AssertionError as exc:
                errors, ok = {"failed": str(exc)[:500]}, False
                print(f"CHECK FAILED {rcase}: {str(exc)[:300]}", flush=True)
            idx = {id(s): i for i, s in enumerate(sets)}
            timing = bench.time_fn(lambda s: plans[idx[id(s)]](), rotate=[(s,) for s in sets], graph=True,
                                   warmup=10, repeats=100)
            facts = plans[0].facts()
            if tag == "fused":
                timeouts = sum(p.barrier_timeouts() for p in plans)
                facts["barrier_timeouts"] = timeouts
                facts["merge_why"] = plans[0].merge_why
                ok = ok and timeouts == 0 and all(p.merge == "fused" for p in plans)
                o, lse = plans[0]()  # after the timing: still right
                torch.cuda.synchronize()
                try:
                    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
                except AssertionError as exc:
                    ok = False
                    print(f"CHECK AFTER TIMING FAILED {rcase}: {str(exc)[:300]}", flush=True)
            tbs = nbytes / (timing.median_us * 1e-6) / 1e12
            rec = bench.make_record("mla_padding", rcase, "after", timing, shape=shape, dtype=torch.bfloat16,
                                    floor_us=floor, error=errors, cache_bytes=nbytes, achieved_tbs=tbs,
                                    copy_bw_fraction=tbs / info.peak.bandwidth_tbs, compute_units=info.compute_units,
                                    layout="paged", peer=None, rotate_sets=len(sets), **facts)
            (checked if ok else unchecked).append(rec)
            rows.append((rcase, timing.median_us, timing.p20_us, timing.p80_us, floor, "ok" if ok else "UNCHECKED"))
            print(f"{time.time() - t0:5.0f} s  {rcase:18s} {timing.median_us:8.2f} us  floor {floor:7.2f}  "
                  f"{floor / timing.median_us:6.1%}  {'ok' if ok else 'UNCHECKED'}", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"FAILED {rcase}", flush=True)
        json.dump([r.to_dict() for r in checked], open(f"{out}/mla_fused.json", "w"), indent=1)
        if unchecked:
            json.dump([r.to_dict() for r in unchecked], open(f"{out}/mla_fused_unchecked.json", "w"), indent=1)
    del sets, first
    torch.cuda.empty_cache()
print(f"\n{'case':18s} {'us':>8s} {'p20':>8s} {'p80':>8s} {'floor':>7s} {'of copy bw':>10s}")
for rcase, us, p20, p80, floor, flag in rows:
    print(f"{rcase:18s} {us:8.2f} {p20:8.2f} {p80:8.2f} {floor:7.2f} {floor / us:10.1%}  {flag}")
PY
fi
