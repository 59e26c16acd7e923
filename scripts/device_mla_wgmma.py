"""Issue 5, one device call: form 'wgmma' of the CUDA MLA decode (kernels/mla_wgmma.h) checked against
the fp32 reference on odd shapes, then timed beside the default mma.sync split kernel the way the
mla_padding study times (its inputs and rotation, graph replay), with the read floor of the same
bytes (scripts/mla_read_probe.cu's ring reader, when built). Prints a table; writes $OUT/wgmma.json.
    OUT=dir PYTHONPATH=. python3 scripts/device_mla_wgmma.py
HOT_SMALL=1 also times the first form with the query, lengths and block table shared by every input set
(only the caches rotate), as in a model whose MLA layers read the same small tensors every step.
"""
import json
import math
import os
import zlib

import torch

from k3lab import bench, env
from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
dev = "cuda"
gen = torch.Generator(device=dev).manual_seed(7)
checks = []


CHECK_FORMS = os.environ.get("CHECK_FORMS", "wgmma").split(",")
TIME_FORMS = tuple(os.environ.get("TIME_FORMS", "split,wgmma").split(","))


def plan_kwargs(spec):
    """A form spec as plan() arguments: 'wgmma' (the default merge), 'wgmma/k' (the merge kernel),
    'wgmma/np' (no programmatic dependent launch), 'wgmma/s120' (120 pieces)."""
    form, *opts = spec.split("/")
    kw = {"form": form}
    for o in opts:
        if o == "k":
            kw["merge"] = "kernel"
        elif o == "np":
            kw["pdl"] = False
        elif o[0] == "s":
            kw["num_splits"] = int(o[1:])
    return kw


def check_case(label, lengths, heads=12, page=64, paged=True, nan_tail=True, splits=None):
    for form in CHECK_FORMS:
        check_form(f"{form}: {label}", lengths, form, heads, page, paged, nan_tail, splits)


def check_form(label, lengths, form, heads, page, paged, nan_tail, splits):
    B, L = len(lengths), max(lengths)
    q = torch.randn(B, 1, heads, 576, device=dev, generator=gen).to(torch.bfloat16)
    cache = torch.randn(B, L, 576, device=dev, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    if paged:
        pool, table = mla.to_paged(cache, page, seed=3)
        if nan_tail:  # rows past each length inside its last page: NaN must not reach the output
            for b, n in enumerate(lengths):
                last = n // page
                if last < table.shape[1] and n % page:
                    pool[table[b, last].long(), n % page:] = float("nan")
        p = mc.plan(q, pool, lens, block_table=table, **{"num_splits": splits, **plan_kwargs(form)})
    else:
        p = mc.plan(q, cache, lens, **{"num_splits": splits, **plan_kwargs(form)})
    o, lse = p()
    ro, rl = mla.reference(q.float(), cache.float(), lengths=lens)
    err = bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
    checks.append({"case": label, "splits": p.num_splits, "chunk": p.chunk, **{k: v["max_rel"] for k, v in err.items()}})
    print(f"check {label:34s} splits {p.num_splits:4d}  o max_rel {err['o']['max_rel']:.2e}  lse {err['lse']['max_rel']:.2e}",
          flush=True)


print("registers: wgmma", mc.registers(form="wgmma"), " split", mc.registers(), flush=True)

check_case("1 x 100, one piece", [100], splits=1)
check_case("1 x 1000", [1000])
check_case("1 x 4133, 16 heads", [4133], heads=16)
check_case("1 x 4133, 5 heads, 3 pieces", [4133], heads=5, splits=3)
check_case("3 ragged (5000, 77, 2048)", [5000, 77, 2048])
check_case("2 contiguous (3000, 1234)", [3000, 1234], paged=False)
check_case("1 x 32768", [32768])
check_case("1 x 8200, pages of 128", [8200], page=128)

def unchecked(label):
    """Diagnostic builds whose outputs are meaningless: no arithmetic (data-only), no merge (no-merge), or
    anything else a label says is unchecked (e.g. a tile stream in the wrong layout)."""
    return label.endswith(("data-only", "no-merge", "unchecked"))


# other builds of kernels/mla_decode.cu (each with its own -Dk3mla=... namespace), as label:path in
# WG_VARIANTS, e.g. data-only:/tmp/mla_diag.so (K3_MLA_WG_DATA_ONLY: the same tile stream, no
# arithmetic; outputs not checked) or cp:/tmp/mla_cp.so (K3_MLA_WG_CPASYNC; checked like the default)
builds = mc.load_variants(os.environ.get("WG_VARIANTS", ""))
real_library = mc._library
for label, lib in builds.items():
    if not unchecked(label):
        mc._library = lambda lib=lib: lib
        print(f"build {label}:", flush=True)
        check_case(f"{label}: 3 ragged (5000, 77, 2048)", [5000, 77, 2048])
        check_case(f"{label}: 1 x 4133, 16 heads", [4133], heads=16)
        check_case(f"{label}: 2 contiguous (3000, 1234)", [3000, 1234], paged=False)
        check_case(f"{label}: 1 x 1000, one piece", [1000], splits=1)
        mc._library = real_library
bw = env.PEAKS["H200"].bandwidth_tbs * 1e12


def timing_row(case, form, t, splits, nbytes):
    """One timed form as the JSON keeps it (and a printed line): median and spread, pieces, share of
    the copy bandwidth."""
    row = {"us": t.median_us, "p20": t.p20_us, "p80": t.p80_us, "splits": splits, "share": nbytes / bw / (t.median_us * 1e-6)}
    print(f"{case:8s} {form:15s} {t.median_us:8.2f} us  {100 * row['share']:5.1f}% of copy bw  splits {splits}", flush=True)
    return row

rows = {}
CASES = os.environ.get("CASES", "ctx1k,ctx32k,ctx128k,b8_8k,b64_8k").split(",")
for name, batch, ctx in (("ctx1k", 1, 1024), ("ctx32k", 1, 32768), ("ctx128k", 1, 131072), ("b8_8k", 8, 8192),
                         ("b64_8k", 64, 8192)):
    if name not in CASES:
        continue
    case = st.Case(name, batch, ctx)
    first = st._make_set(case, 12, torch.bfloat16, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, 12, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64) - 1)]
    res = {}
    for form in TIME_FORMS + tuple(f"wgmma-{k}" for k in builds):
        if form.startswith("wgmma-"):
            mc._library = lambda lib=builds[form[6:]]: lib
        kw = plan_kwargs(form) if not form.startswith("wgmma-") else {"form": "wgmma"}
        plans = [mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], **kw) for s in sets]
        o, lse = plans[0]()
        if not unchecked(form):
            ro, rl = mla.reference(first["q"].float(), first["cache"].float(), lengths=first["lengths"])
            bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
        t = bench.time_fn(lambda p: p(), rotate=[(p,) for p in plans], graph=True, warmup=10, repeats=60)
        if not unchecked(form):  # again after the replays
            o, lse = plans[0]()
            bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
        res[form] = timing_row(name, form, t, plans[0].num_splits, nbytes)
        mc._library = real_library
    if os.environ.get("HOT_SMALL"):  # the same default decode with q, lengths and block table shared by
        # every input set (only the caches rotate): as in a model, where every MLA layer of a step reads
        # the same lengths and table and q was just written, so those small tensors are in L2
        f0 = TIME_FORMS[0]
        hot = [mc.plan(first["q"], s["pool"], first["lengths"], block_table=first["table"], **plan_kwargs(f0)) for s in sets]
        t = bench.time_fn(lambda p: p(), rotate=[(p,) for p in hot], graph=True, warmup=10, repeats=60)
        res[f"{f0}-hot-small"] = timing_row(name, f"{f0}-hot-small", t, hot[0].num_splits, nbytes)
    rows[name] = {"bytes": nbytes, "sets": len(sets), "floor_us": nbytes / bw * 1e6, "forms": res}
    del sets, first
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()),
           "commit": bench.git_commit(), "copy_bandwidth_tbs": bw / 1e12,
           "checks": checks, "rows": rows}, open(os.path.join(out, "wgmma.json"), "w"), indent=1)
for f in TIME_FORMS[1:]:
    print(f"ratio {TIME_FORMS[0]}/{f}: " + ", ".join(f"{k} {v['forms'][TIME_FORMS[0]]['us'] / v['forms'][f]['us']:.2f}x"
                                                  for k, v in rows.items()))
assert all(math.isfinite(v["forms"][f]["us"]) for v in rows.values() for f in TIME_FORMS)
