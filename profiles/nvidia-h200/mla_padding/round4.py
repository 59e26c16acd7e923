"""Device script, round 4 (written for the lead's call; not yet run): find which piece of the
bulk-copy after kernel goes wrong on the H200, find the split kernel's launch configuration that
hit an illegal memory access in round 2, then time the bulk form that is right.

Round 3 (round3.py, commit e7931ef, profiles/nvidia-h200/mla_padding/traces/round3_result.json): the bulk
kernel gave wrong bf16 outputs on a paged cache (rel_l2 3.7 at 1 x 4096) and an illegal memory
access on a contiguous one, while Triton's interpreter matches the fp32 reference for every form.

1. Every bulk form (mla_decode.BULK_OPTIONS via K3LAB_MLA_BULK_OPTIONS, and two launch
   configurations) is checked in its own process with CUDA_LAUNCH_BLOCKING=1 (a fault kills only
   that process): bf16 paged 1 x 4096; paged mixed lengths with NaN past them; q_len 4; contiguous
   mixed lengths last (the case that faulted). The six split configurations of round 2 run the
   same way at 32K, kernel by kernel (split, then merge).
2. The fastest-expected bulk form that passed every check is timed: the study's '<case>.bulk'
   sweep points (main cases keep the split default) -> $OUT/sweep.json, plus the main cases
   ctx32k and ctx128k (split default, einsum, SDPA) -> $OUT/main.json.
3. A table.

Run from the repository root: PYTHONPATH=. python3 profiles/nvidia-h200/mla_padding/round4.py
"""
import json
import os
import subprocess
import sys
import time

T0 = time.time()
OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
BUDGET_S = float(os.environ.get("BUDGET_S", "225"))
RESULT = {"forms": {}, "split_configs": {}, "chosen": None}


def say(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def dump():
    with open(os.path.join(OUT, "round4.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


CHECK = r"""
import json, sys, torch
sys.path.insert(0, ".")
import k3lab
from k3lab import bench
from k3lab.ops import mla_decode as mla
cfg = json.loads(sys.argv[1])

def case(label, B, Tq, L, lengths, paged, poison, launch_kw=True):
    g = torch.Generator().manual_seed(L + Tq)
    q = torch.randn(B, Tq, 12, 576, generator=g).to("cuda", torch.bfloat16)
    cache = torch.randn(B, L, 576, generator=g).to("cuda", torch.bfloat16)
    lens = torch.tensor(lengths, device="cuda", dtype=torch.int32)
    bt = None
    kv = cache
    if paged:
        kv, bt = mla.to_paged(cache, 64, seed=3, spare_pages=2)
        if poison:
            kv = kv.clone()
            for b, n in enumerate(lengths):
                pages = -(-n // 64)
                kv[int(bt[b, pages - 1]), n - (pages - 1) * 64:] = float("nan")
    ref_o, ref_l = mla.reference(q.float(), cache.float(), lens)
    try:
        kw = cfg["plan"] if launch_kw else {k: v for k, v in cfg["plan"].items() if k == "kernel"}
        plan = mla.plan_after(q, kv, lens, block_table=bt, **kw)
        for i, k in enumerate(plan._kernels):
            k()
            torch.cuda.synchronize()
        o, lse = plan.out, plan.lse
        err = bench.check_all({"o": (o, ref_o), "lse": (lse, ref_l)}, dtype=torch.bfloat16)
        print("RESULT", json.dumps({"case": label, "ok": True, "rel_l2_o": err["o"]["rel_l2"],
                                    "splits": plan.num_splits, "kernel": plan.kernel}), flush=True)
    except Exception as exc:
        print("RESULT", json.dumps({"case": label, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:240]}"}),
              flush=True)
        if "illegal" in str(exc) or "CUDA" in str(exc):
            sys.exit(3)

if cfg.get("hunt"):
    case("ctx32k", 1, 1, 32768, [32768], True, False)
else:
    case("paged 1x4096", 1, 1, 4096, [4096], True, False)
    case("paged mixed NaN past lengths", 3, 1, 1000, [1000, 77, 640], True, True)
    case("paged q4 verify", 2, 4, 530, [530, 131], True, True, launch_kw=False)  # 64 rows: its own launch
    case("contiguous mixed", 2, 1, 700, [700, 129], False, False)
"""

FORMS = {  # name: (K3LAB_MLA_BULK_OPTIONS, plan kwargs, environment for the timed run); preferred first
    "default": ("", {}, {}),
    "kpe_bulk": ("kpe=bulk", {}, {}),
    "row_sum": ("sum=row", {}, {}),
    "kpe_load": ("kpe=load", {}, {}),
    "w8": ("", {"num_warps": 8}, {"K3LAB_MLA_AFTER_CONFIG": "64,8,1"}),
    "s2_pipelined": ("", {"num_stages": 2}, {"K3LAB_MLA_AFTER_CONFIG": "64,4,2"}),
    "no_pdl": ("", {"pdl": False}, {"K3LAB_MLA_PDL": "0"}),
    "s3_tail64": ("tail=64", {"num_stages": 3}, {"K3LAB_MLA_AFTER_CONFIG": "64,4,3"}),
    "bn32": ("", {"block_n": 32}, {"K3LAB_MLA_AFTER_CONFIG": "32,4,1"}),
    "no_bulk_copy": ("kc_bulk=0", {}, {}),
    "no_bulk_copy_all_plain": ("kc_bulk=0,kpe=load,sum=row", {}, {}),
}
SPLIT_CONFIGS = ("32,8,3", "32,4,2", "16,4,3", "64,4,1", "64,8,1", "128,8,1")

procs = {}
for name, (opts, kw, _) in FORMS.items():
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONPATH=".", K3LAB_MLA_BULK_OPTIONS=opts)
    arg = json.dumps({"plan": dict(kw, kernel="bulk")})
    procs[("form", name)] = subprocess.Popen([sys.executable, "-c", CHECK, arg], stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, env=env)
for cfg in SPLIT_CONFIGS:
    bn, w, s = (int(x) for x in cfg.split(","))
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONPATH=".")
    arg = json.dumps({"hunt": True, "plan": {"kernel": "split", "block_n": bn, "num_warps": w, "num_stages": s}})
    procs[("split", cfg)] = subprocess.Popen([sys.executable, "-c", CHECK, arg], stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True, env=env)
deadline = time.time() + 75
for (kind, name), p in procs.items():
    try:
        out, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        p.kill()
        out = (p.communicate()[0] or "") + "\nTIMEOUT"
    results = [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]
    errors = [ln for ln in out.splitlines() if "Error" in ln or "error" in ln][-3:]
    entry = {"rc": p.returncode, "results": results, "errors": errors}
    RESULT["forms" if kind == "form" else "split_configs"][name] = entry
    say(kind, name, "rc", p.returncode, [(r["case"], r["ok"], round(r.get("rel_l2_o", -1), 4)) for r in results],
        errors[-1][:200] if errors else "")
dump()

passing = [n for n, e in RESULT["forms"].items()
           if e["rc"] == 0 and len(e["results"]) == 4 and all(r["ok"] for r in e["results"])]
say("bulk forms right on the H200:", passing)
chosen = next((n for n in FORMS if n in passing), None)
RESULT["chosen"] = chosen
dump()


sys.path.insert(0, ".")
import k3lab  # noqa: E402,F401
from k3lab.studies import mla_padding as st  # noqa: E402

records = {"main": [], "sweep": []}


def run_cases(label, names, reserve_s):
    for n in names:
        if time.time() - T0 > BUDGET_S - reserve_s:
            say("skipping", n, "(time)")
            continue
        try:
            records[label].extend(st.run(cases=[n], log=lambda m: say(m)))
        except Exception as exc:
            say("CASE FAILED", n, type(exc).__name__, str(exc)[:300])
        with open(os.path.join(OUT, f"{label}.json"), "w") as f:
            json.dump([r.to_dict() for r in records[label]], f)


if chosen is not None:
    opts, kw, env = FORMS[chosen]
    os.environ["K3LAB_MLA_BULK_OPTIONS"] = opts
    os.environ.update(env)  # K3LAB_MLA_AFTER_CONFIG applies to one-token (16-row) launches only
    say("timing form", chosen, "with", opts or "default options", env or "default launch")
    run_cases("sweep", ["ctx32k.bulk", "ctx128k.bulk"], 45)
    for k in env:
        os.environ.pop(k, None)
    os.environ.pop("K3LAB_MLA_BULK_OPTIONS", None)
if "s3_tail64" in passing:  # three copy buffers, one program per SM (the points carry their own form)
    run_cases("sweep", ["ctx32k.bulk_bn64w4s3t64", "ctx128k.bulk_bn64w4s3t64"], 45)
if chosen is not None:
    os.environ["K3LAB_MLA_BULK_OPTIONS"] = opts
    os.environ.update(env)
    run_cases("sweep", ["ctx1k.bulk", "b8_8k.bulk", "b64_8k.bulk", "ragged8_8k.bulk", "verify4_32k.bulk"], 45)
    for k in env:
        os.environ.pop(k, None)
    os.environ.pop("K3LAB_MLA_BULK_OPTIONS", None)
if "s3_tail64" in passing:
    run_cases("sweep", ["ctx1k.bulk_bn64w4s3t64", "b8_8k.bulk_s3t64", "b64_8k.bulk_s3t64", "ragged8_8k.bulk_s3t64"],
              45)
if "default" in passing:
    run_cases("sweep", ["ctx32k.bulk_bn64w4s2", "ctx128k.bulk_bn64w4s2", "ctx32k.bulk_bn64w8s1"], 45)
run_cases("main", ["ctx32k", "ctx128k"], 25)
dump()

say("-- graph replay, us --")
rows = {}
for r in records["main"] + records["sweep"]:
    if r.mode == "graph":
        rows.setdefault(r.case, {})[r.variant] = (r.median_us, r.floor_us, r.extra.get("kernel"),
                                                  r.extra.get("num_splits"))
for case in sorted(rows):
    v = rows[case]
    fl = next(iter(v.values()))[1]
    aft = v.get("after")
    txt = "  ".join(f"{k}={t:.2f}" for k, (t, _, _, _) in sorted(v.items()))
    extra = f"  [{aft[2]} s{aft[3]}] bw={fl / aft[0]:.2f}" if aft else ""
    print(f"{case:24s} floor={fl:6.2f}  {txt}{extra}", flush=True)
say("done; chosen bulk form:", chosen)
