"""Device probe for the MLA split kernel: launch variants, per-kernel (split / merge) graph times,
compiled facts (registers, spills, shared memory, mma version), and an ncu target (--ncu).

Records it wrote: '<ctx>.r1.*' (round 1, commit 74864a8, an earlier VARIANTS table with the
column-chunked kernel since removed), '<ctx>.r2.*' (round 2, commit 697758b, this VARIANTS table).
--pick times the decode configurations in PICK at 32K and 128K (commit c65c81d: it stopped on an
illegal memory access in one of them; see k3lab/ops/mla_decode.py). Run on the device from the
repository root: PYTHONPATH=. python3 profiles/nvidia-h200/mla_padding/probe.py [--ncu | --pick]."""
import json, os, sys, time, re
import torch
sys.path.insert(0, ".")
import k3lab
from k3lab import bench
from k3lab.ops import mla_decode as mla
from k3lab.studies import mla_padding as st

OUT = os.environ.get("OUT", "/tmp/out")
T0 = time.time()
RES = {}
heads = 12
dt = torch.bfloat16
CTX = {"ctx1k": 1024, "ctx32k": 32768, "ctx128k": 131072}

def sets_for(name, n):
    case = st.Case(name, 1, n)
    first = st._make_set(case, heads, dt, seed=11)
    nb = st.cache_bytes(case, dt)
    k = bench.rotation_count(nb, max_sets=8)
    return case, [first] + [st._make_set(case, heads, dt, seed=100 + i) for i in range(k - 1)], nb

def facts(ck):
    if ck is None:
        return {}
    ck._init_handles()
    tt = ck.asm["ttgir"]
    return {"regs": ck.n_regs, "spills": ck.n_spills, "smem_kb": round(ck.metadata.shared / 1024, 1),
            "mma": "".join(sorted(set(re.findall(r"versionMajor = (\d)", tt)))),
            "async_copies": tt.count("async_copy_global_to_local"), "wgdot": tt.count("warp_group_dot ")}

VARIANTS = {  # name: (block_n, warps, stages, merge_dv, pdl)
    "bn32w4s3": (32, 4, 3, 16, True),
    "bn32w4s3_nopdl": (32, 4, 3, 16, False),
    "bn32w4s3_m32": (32, 4, 3, 32, True),
    "bn64w4s2": (64, 4, 2, 16, True),
}
PLAN = [  # (context, variant, splits); None = the rule
    ("ctx32k", "bn32w4s3", None), ("ctx32k", "bn32w4s3_nopdl", None), ("ctx32k", "bn32w4s3", 132),
    ("ctx32k", "bn32w4s3", 264), ("ctx32k", "bn32w4s3", 396), ("ctx32k", "bn32w4s3_m32", None),
    ("ctx32k", "bn64w4s2", 132), ("ctx32k", "bn64w4s2", 264),
    ("ctx128k", "bn32w4s3", None), ("ctx128k", "bn32w4s3_nopdl", None), ("ctx128k", "bn32w4s3", 264),
    ("ctx128k", "bn32w4s3", 396), ("ctx128k", "bn64w4s2", 132), ("ctx128k", "bn64w4s2", 264),
    ("ctx1k", "bn32w4s3", None), ("ctx1k", "bn32w4s3_nopdl", None), ("ctx1k", "bn32w4s3", 1),
]

def plan_for(s, var, splits):
    bn, w, stg, mdv, pdl = VARIANTS[var]
    return mla.plan_after(s["q"], s["pool"], s["lengths"], block_table=s["table"], num_splits=splits,
                          block_n=bn, num_warps=w, num_stages=stg, merge_dv=mdv, pdl=pdl)

def main():
    only_ncu = "--ncu" in sys.argv
    records, rows = [], []
    cache = {}
    for ctx, var, splits in PLAN:
        if ctx not in cache:
            cache = {ctx: sets_for(ctx, CTX[ctx])}  # free the previous context
        case, sets, nb = cache[ctx]
        try:
            plans = [plan_for(s, var, splits) for s in sets]
        except Exception as exc:
            rows.append((ctx, var, splits, f"FAIL {type(exc).__name__}: {str(exc)[:120]}"))
            continue
        s0 = sets[0]
        ref_o, ref_l = mla.latent_attention(s0["q"].float(), s0["cache"].float(), lengths=s0["lengths"])
        o, lse = plans[0]()
        err = bench.check_all({"o": (o, ref_o), "lse": (lse, ref_l)}, dtype=dt)
        f = facts(plans[0]._kernels[0].compiled)
        rot = [(p,) for p in plans]
        try:
            tot = bench.time_fn(lambda p: p(), rotate=rot, graph=True, warmup=10, repeats=60)
        except Exception as exc:
            rows.append((ctx, var, splits, f"TIMING FAIL {type(exc).__name__}: {str(exc)[:150]}"))
            continue
        if var == "bn32w4s3" and splits is None:
            RES.setdefault(ctx, {})["pdl"] = tot.median_us
        if var == "bn32w4s3_nopdl":
            RES.setdefault(ctx, {})["nopdl"] = tot.median_us
        spl = bench.time_fn(lambda p: p._kernels[0](), rotate=rot, graph=True, warmup=10, repeats=60)
        mrg = None
        if len(plans[0]._kernels) > 1:
            mrg = bench.time_fn(lambda p: p._kernels[1](), rotate=rot, graph=True, warmup=10, repeats=60).median_us
        floor = bench.floor_us(bytes=nb)
        rec = bench.make_record(st.NAME, f"{ctx}.{var}.sp{plans[0].num_splits}", "after", tot, shape={"batch": 1, "context": CTX[ctx],
                                "q_len": 1, "heads": heads, "page_size": 64}, dtype=dt, floor_us=floor, error=err,
                                split_us=spl.median_us, merge_us=mrg, num_splits=plans[0].num_splits, pdl=plans[0].pdl, variant_cfg=VARIANTS[var],
                                programs_per_unit=plans[0].programs_per_unit, cache_bytes=nb, **f)
        records.append(rec)
        rows.append((ctx, var, plans[0].num_splits, f"{tot.median_us:8.2f} split {spl.median_us:7.2f} merge {mrg if mrg is None else round(mrg,2)!s:>6} "
                     f"bw {floor / tot.median_us:5.1%} ppu {plans[0].programs_per_unit} {f} err {err['o']['rel_l2']:.1e}"))
        del plans
        if time.time() - T0 > 45:
            rows.append(("stop", "time", 0, "budget"))
            break
    with open(os.path.join(OUT, "probe.json"), "w") as fh:
        json.dump([r.to_dict() for r in records], fh)
    ok = all(v.get("pdl", 1e9) <= v.get("nopdl", 0) * 1.01 for v in RES.values()) and len(RES) > 0
    with open(os.path.join(OUT, "pdl_ok"), "w") as fh:
        fh.write("1" if ok else "0")
    print("pdl", RES, "ok" if ok else "off")
    print(f"floor 32K {bench.floor_us(bytes=32768*576*2):.2f} us; total {time.time()-T0:.0f}s")
    for r in rows:
        print(f"{r[0]:8s} {r[1]:18s} sp{r[2]:<4} {r[3]}")

def ncu_target():
    case, sets, nb = sets_for("ctx32k", 32768)
    s = sets[0]
    ps = [plan_for(s, "bn32w4s3_nopdl", None), plan_for(s, "bn64w4s2", 132)]
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for p in ps:
        p()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()

PICK = [(32, 4, 3), (32, 4, 2), (16, 4, 3), (32, 8, 3), (64, 4, 1), (64, 8, 1), (128, 8, 1)]

def pick():
    """Time the decode (16-row) launch configurations at 32K and 128K with the rule's split count;
    write the best (sum of times relative to the default's) to $OUT/pick.txt."""
    records, times, rows = [], {}, []
    for ctx in ("ctx32k", "ctx128k"):
        case, sets, nb = sets_for(ctx, CTX[ctx])
        s0 = sets[0]
        ref_o, ref_l = mla.latent_attention(s0["q"].float(), s0["cache"].float(), lengths=s0["lengths"])
        for cfg in PICK:
            name = "bn%dw%ds%d" % cfg
            try:
                plans = [mla.plan_after(s["q"], s["pool"], s["lengths"], block_table=s["table"], block_n=cfg[0],
                                        num_warps=cfg[1], num_stages=cfg[2]) for s in sets]
                o, lse = plans[0]()
                err = bench.check_all({"o": (o, ref_o), "lse": (lse, ref_l)}, dtype=dt)
                tot = bench.time_fn(lambda p: p(), rotate=[(p,) for p in plans], graph=True, warmup=10, repeats=60)
            except Exception as exc:
                rows.append(f"{ctx} {name} FAIL {type(exc).__name__}: {str(exc)[:100]}")
                continue
            times[(ctx, cfg)] = tot.median_us
            f = facts(plans[0]._kernels[0].compiled)
            records.append(bench.make_record(st.NAME, f"{ctx}.pick.{name}", "after", tot, shape={"batch": 1,
                           "context": CTX[ctx], "q_len": 1, "heads": heads, "page_size": 64}, dtype=dt,
                           floor_us=bench.floor_us(bytes=nb), error=err, cache_bytes=nb, **plans[0].facts(), **f))
            rows.append(f"{ctx} {name:10s} {tot.median_us:8.2f} us sp{plans[0].num_splits} ppu{plans[0].programs_per_unit} "
                        f"bw {bench.floor_us(bytes=nb) / tot.median_us:5.1%} {f}")
            del plans
        del sets
        torch.cuda.empty_cache()
    base = PICK[0]
    score = {c: sum(times[(x, c)] / times[(x, base)] for x in ("ctx32k", "ctx128k"))
             for c in PICK if ("ctx32k", c) in times and ("ctx128k", c) in times}
    best = min(score, key=score.get) if score else base
    with open(os.path.join(OUT, "pick.txt"), "w") as fh:
        fh.write("%d,%d,%d" % best)
    with open(os.path.join(OUT, "pick.json"), "w") as fh:
        json.dump([r.to_dict() for r in records], fh)
    for r in rows:
        print(r)
    print("pick", best, {("%d,%d,%d" % c): round(v, 3) for c, v in score.items()}, f"{time.time() - T0:.0f}s")

if __name__ == "__main__":
    if "--pick" in sys.argv:
        pick()
        sys.exit(0)
    ncu_target() if "--ncu" in sys.argv else main()
