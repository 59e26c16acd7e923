"""Device script, round 3: the bulk-copy after kernel (kernel='bulk', Hopper TMA) against the
per-thread-copy split kernel (kernel='split'), in one run on the H200.

1. compiled facts of both kernels at 32K (registers, spills, shared memory, programs per SM);
2. correctness of the bulk kernel on the GPU (bf16 and fp16, paged and contiguous, mixed lengths,
   q_len 1..8, NaN in every pool row past a length) against the fp32 reference;
3. the study's main cases (default kernels) and sweep points ('.split', '.bulk*', split counts),
   written to $OUT/main.json and $OUT/sweep.json (records: check first, then time);
4. graph time of the split kernel and the merge alone, per kernel, at 32K and 128K;
5. the split kernel's launch configurations that hit an illegal memory access in round 2, each in
   its own process with CUDA_LAUNCH_BLOCKING=1 (which kernel, which configuration);
6. a short table.

Run on the device from the repository root: PYTHONPATH=. python3 profiles/nvidia-h200/mla_padding/round3.py
"""
import json
import os
import subprocess
import sys
import time

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
sys.path.insert(0, ".")
import torch  # noqa: E402

import k3lab  # noqa: E402,F401
from k3lab import bench  # noqa: E402
from k3lab.ops import mla_decode as mla  # noqa: E402
from k3lab.studies import mla_padding as st  # noqa: E402

BUDGET_S = float(os.environ.get("BUDGET_S", "225"))
RESULT = {"facts": {}, "checks": [], "per_kernel": {}, "hunt": {}}


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def dump():
    with open(os.path.join(OUT, "round3.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def compiled_facts(plan):
    out = []
    for k in plan._kernels:
        ck = k.compiled
        if ck is None:
            continue
        ck._init_handles()
        out.append({"kernel": ck.name, "regs": ck.n_regs, "spills": ck.n_spills,
                    "smem_kb": round(ck.metadata.shared / 1024, 1), "warps": ck.metadata.num_warps})
    return out


# 1 + 4. facts and per-kernel graph times ---------------------------------------------------------
def per_kernel(plan, reps=20):
    flush = mla._l2_flush_buffer()
    res = {}
    for i, k in enumerate(plan._kernels):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            k()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            k()
        ts = []
        for _ in range(reps):
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        res[["split", "merge"][i]] = round(sorted(ts)[len(ts) // 2], 2)
    res["plan"] = round(mla._time_plan(plan, reps), 2)
    return res


for name, n in (("ctx32k", 32768), ("ctx128k", 131072)):
    case = st.Case(name, 1, n)
    s = st._make_set(case, 12, torch.bfloat16, seed=5)
    for kern in ("bulk", "split"):
        try:
            plan = mla.plan_after(s["q"], s["pool"], s["lengths"], block_table=s["table"], kernel=kern)
            plan()
            torch.cuda.synchronize()
            key = f"{name}.{kern}"
            RESULT["facts"][key] = {"plan": plan.facts(), "compiled": compiled_facts(plan)}
            RESULT["per_kernel"][key] = per_kernel(plan)
            say(key, RESULT["facts"][key]["compiled"], "splits", plan.num_splits, "ppu", plan.programs_per_unit,
                RESULT["per_kernel"][key])
        except Exception as exc:  # keep going: the rest of the run still says something
            RESULT["facts"][f"{name}.{kern}"] = f"{type(exc).__name__}: {exc}"
            say(name, kern, "FAILED", type(exc).__name__, str(exc)[:300])
    del s
dump()

# 2. correctness of the bulk kernel on the GPU ---------------------------------------------------
def check_one(label, B, Tq, L, lengths, dtype, paged, splits, poison, kernel="bulk"):
    g = torch.Generator().manual_seed(len(label) * 7 + L)
    q = torch.randn(B, Tq, 12, 576, generator=g).to("cuda", dtype)
    cache = torch.randn(B, L, 576, generator=g).to("cuda", dtype)
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    if paged:
        kv, bt = mla.to_paged(cache, 64, seed=3, spare_pages=2)
        if poison:
            kv = kv.clone()
            for b, nn in enumerate(lengths):
                pages = -(-nn // 64)
                kv[int(bt[b, pages - 1]), nn - (pages - 1) * 64:] = float("nan")
                for p in bt[b, pages:]:
                    kv[int(p)] = float("nan")
    else:
        kv, bt = cache, None
    ref_o, ref_l = mla.reference(q.float(), cache.float(), lens)
    try:
        plan = mla.plan_after(q, kv, lens, block_table=bt, num_splits=splits, kernel=kernel)
        o, lse = plan()
        torch.cuda.synchronize()
        err = bench.check_all({"o": (o, ref_o), "lse": (lse, ref_l)}, dtype=dtype)
        RESULT["checks"].append({"label": label, "ok": True, "kernel": plan.kernel,
                                 "max_rel_o": err["o"]["max_rel"], "max_abs_lse": err["lse"]["max_abs"]})
    except Exception as exc:
        RESULT["checks"].append({"label": label, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        say("CHECK FAILED", label, type(exc).__name__, str(exc)[:300])


for dtype in (torch.bfloat16, torch.float16):
    dn = str(dtype).split(".")[-1]
    check_one(f"{dn} paged 1x4096 q1", 1, 1, 4096, [4096], dtype, True, None, False)
    check_one(f"{dn} paged mixed q1 poison", 3, 1, 1000, [1000, 77, 640], dtype, True, None, True)
    check_one(f"{dn} paged mixed q1 s3 poison", 3, 1, 1000, [1000, 77, 640], dtype, True, 3, True)
    check_one(f"{dn} contiguous mixed q1", 2, 1, 700, [700, 129], dtype, False, None, False)
    check_one(f"{dn} paged q1 s1 (final write)", 2, 1, 300, [300, 200], dtype, True, 1, True)
    for tq in (2, 4, 8):
        check_one(f"{dn} paged q{tq} verify poison", 2, tq, 530, [530, 131], dtype, True, None, True)
    check_one(f"{dn} split paged mixed q1 poison", 3, 1, 1000, [1000, 77, 640], dtype, True, None, True, "split")
bad = [c for c in RESULT["checks"] if not c["ok"]]
say(f"bulk checks: {len(RESULT['checks']) - len(bad)} passed, {len(bad)} failed")
dump()
BULK_OK = not bad

# 3. the study's cases -----------------------------------------------------------------------------
MAIN = ["ctx32k", "ctx128k", "ctx1k", "b8_8k", "b64_8k", "verify4_32k"]
SWEEP_A = ["ctx32k.split", "ctx128k.split", "ctx32k.bulk_bn64w4s2", "ctx128k.bulk_bn64w4s2", "ctx32k.s128",
           "ctx32k.s132", "ctx128k.s128", "ctx1k.split", "verify4_32k.bulk"]
SWEEP_B = ["b8_8k.split", "b64_8k.split", "ctx32k.bulk_bn64w8s1", "ctx128k.bulk_bn64w8s1", "ctx32k.s264",
           "ctx128k.s264", "ctx1k.s16", "ctx1k.s32"]
records = {"main": [], "sweep": []}


def run_cases(label, names, reserve_s):
    for n in names:
        if time.time() - T0 > BUDGET_S - reserve_s:
            say("skipping", n, "(time)")
            continue
        try:
            records[label].extend(st.run(cases=[n], log=lambda m: say(m)))
        except Exception as exc:
            say("CASE FAILED", n, type(exc).__name__, str(exc)[:400])
            RESULT.setdefault("case_errors", {})[n] = f"{type(exc).__name__}: {str(exc)[:400]}"
        with open(os.path.join(OUT, f"{label}.json"), "w") as f:
            json.dump([r.to_dict() for r in records[label]], f)


run_cases("main", MAIN, 60)
run_cases("sweep", SWEEP_A, 60)
dump()

# 5. the illegal memory access of round 2 ------------------------------------------------------------
HUNT = r"""
import sys, torch
sys.path.insert(0, ".")
import k3lab
from k3lab.ops import mla_decode as mla
from k3lab.studies import mla_padding as st
bn, w, s = (int(x) for x in sys.argv[1].split(","))
c = st._make_set(st.Case("ctx32k", 1, 32768), 12, torch.bfloat16, seed=5)
plan = mla.plan_after(c["q"], c["pool"], c["lengths"], block_table=c["table"], kernel="split", block_n=bn,
                      num_warps=w, num_stages=s)
print("splits", plan.num_splits, "grid", plan.grid, flush=True)
for i, k in enumerate(plan._kernels):
    k()
    torch.cuda.synchronize()
    print("kernel", i, "ok", flush=True)
ro, rl = mla.reference(c["q"].float(), c["cache"].float(), c["lengths"])
o, l = plan()
torch.cuda.synchronize()
print("max_abs", float((o.float() - ro).abs().max()), "lse", float((l - rl).abs().max()), flush=True)
"""
if time.time() - T0 < BUDGET_S - 35:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONPATH=".")
    procs = {cfg: subprocess.Popen([sys.executable, "-c", HUNT, cfg], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=env)
             for cfg in ("32,8,3", "32,4,2", "16,4,3", "64,4,1", "64,8,1", "128,8,1")}
    deadline = min(T0 + BUDGET_S - 5, time.time() + 45)
    for cfg, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            out = (p.communicate()[0] or "") + "\nTIMEOUT"
        lines = [ln for ln in out.splitlines() if ln.strip()]
        RESULT["hunt"][cfg] = {"rc": p.returncode, "tail": lines[-6:]}
        say("hunt", cfg, "rc", p.returncode, " | ".join(lines[-4:])[:400])
dump()
run_cases("sweep", SWEEP_B, 15)

# 6. table ---------------------------------------------------------------------------------------------
allr = records.get("main", []) + records.get("sweep", [])
say("-- graph replay, us (after = default kernel; .split = per-thread split kernel) --")
rows = {}
for r in allr:
    if r.mode != "graph":
        continue
    rows.setdefault(r.case, {})[r.variant] = (r.median_us, r.floor_us, r.extra.get("kernel"), r.extra.get("num_splits"))
for case in sorted(rows):
    v = rows[case]
    aft = v.get("after")
    fl = next(iter(v.values()))[1]
    txt = "  ".join(f"{k}={t:.2f}" for k, (t, _, _, _) in sorted(v.items()))
    extra = f"  [{aft[2]} s{aft[3]}] bw={fl / aft[0]:.2f}" if aft else ""
    print(f"{case:26s} floor={fl:6.2f}  {txt}{extra}", flush=True)
say("done; bulk checks ok" if BULK_OK else "done; BULK CHECKS FAILED")
