"""One-GPU benchmark of what DCP8 changes on each GPU: the local attention's shape, the merge, the memory.

    k3lab bench dcp --json OUT.json [--save-profiles] [--smoke]

- local attention (the MLA op's after, bf16, one decode token, graph replay, inputs rotated so
  they are read from HBM): TP8's shape (12 heads over the whole history) against DCP8's (96 heads
  over 1/8 of it) at 32K and 128K positions, B = 1 and 8, plus B = 64 at 32K for the merge's share;
  each beside its cache-read floor (`work.local_work`'s bytes; the record carries them and the flops,
  extra['bytes'] and extra['flops']). Target: DCP8 within 1.1x of TP8.
- merge at N = 8 partials of 12 heads (the a2a merge a rank runs), B = 1 and 64, graph replay:
  `merge_partials` impl='torch' (before) against impl='triton' (after, one launch); each also as
  a share of the DCP8 local attention at 32K and 128K of the same batch. Target: Triton 3x faster.
- memory: `dcp.measure_shard_bytes` for the 142,000-token conversation (K3's 24 MLA layers) under
  TP8 and DCP8 in FP8 and BF16: torch.cuda.memory_allocated around the shards against the formula
  (agreeing within the allocator's page, `measure_shard_bytes`).

Every timed output is checked against the fp32 reference first. `one_gpu` returns the records with the
ratios and memory beside them; `print_summary` prints those. smoke=True runs tiny sizes (on a CPU in
fp32 through Triton's interpreter) to check the code itself.
"""

from __future__ import annotations

import pandas as pd
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.ops import mla_decode
from k3lab.ops.mla_decode.merge import merge_partials
from k3lab.parallel import dcp

from .tables import CONVERSATION, NAME, WORLD
from .work import local_work, merge_work

TP_HEADS = 12
LOCAL_CASES = ((32768, 1), (32768, 8), (131072, 1), (131072, 8), (32768, 64))
MERGE_BATCHES = (1, 64)


def _local_case(L: int, B: int, shape: str, gen, timing: dict, graph: bool, dt, backend: str | None = None):
    """One record of the op's after at TP8's or DCP8's per-GPU shape (backend: the op's choice, or
    forced, e.g. 'triton' to compare the two shapes on one kernel)."""
    heads, rows = (TP_HEADS, L) if shape == "tp8" else (TP_HEADS * WORLD, -(-L // WORLD))
    dev = gen.device
    work = local_work(B, rows, heads, dt.itemsize)
    bytes_per_set = work["bytes"]

    def make():
        q = torch.randn(B, 1, heads, 576, device=dev, generator=gen).to(dt)
        cache = torch.randn(B, rows, 576, device=dev, generator=gen).to(dt)
        return q, cache

    sets = bench.rotation_sets(make, bytes_per_set)
    plans = [mla_decode.plan_after(q, c, fold_heads=heads > 16, backend=backend) for q, c in sets]
    o, lse = plans[0]()
    ref_o, ref_lse = mla_decode.reference(*sets[0])
    err = bench.check(o, ref_o, dtype=dt, name=f"{shape} after L={L} B={B}")
    bench.check(lse, ref_lse, dtype=torch.float32, name=f"{shape} lse L={L} B={B}", max_rel=1e-2,
                rel_l2=1e-3)  # lse of bf16 inputs, both sides in fp32
    t = bench.time_fn(lambda p: p(), graph=graph, rotate=[(p,) for p in plans], **timing)
    floor = bench.floor_us(bytes=bytes_per_set)
    return bench.make_record(NAME, f"local_{shape}_B{B}_L{L}{'.' + backend if backend else ''}", "after", t,
                             shape={"batch": B, "context": L, "rows": rows, "heads": heads},
                             dtype=dt, floor_us=floor, error=err, backend_used=plans[0].backend,
                             layout=shape, **work)


def _merge_case(B: int, gen, timing: dict, graph: bool, dt):
    """Records of the a2a merge of N = 8 partials of 12 heads: torch (before) and Triton (after)."""
    dev = gen.device

    def make():
        o = torch.randn(WORLD, B, 1, TP_HEADS, 512, device=dev, generator=gen).to(dt)
        lse = torch.randn(WORLD, B, 1, TP_HEADS, device=dev, generator=gen) * 3
        return o, lse

    work = merge_work(WORLD, B, TP_HEADS, 512, dt.itemsize)
    nbytes = work["bytes"]
    sets = bench.rotation_sets(make, nbytes)
    o, lse = sets[0]
    w = torch.softmax(lse.double(), dim=0)
    ref = (w[..., None] * o.double()).sum(0)
    out = []
    for variant, impl in (("before", "torch"), ("after", "triton")):
        got, got_lse = merge_partials(o, lse, impl)
        err = bench.check(got, ref, dtype=dt, name=f"merge {impl} B={B}")
        bench.check(got_lse, torch.logsumexp(lse.double(), 0), dtype=torch.float32, name=f"merge lse {impl}")
        # timed as the decode runs it: on the op's own lse, without the value check (a host sync)
        t = bench.time_fn(lambda a, b, impl=impl: merge_partials(a, b, impl, check_values=False), graph=graph,
                          rotate=sets, **timing)
        out.append(bench.make_record(NAME, f"merge_N{WORLD}_B{B}", variant, t,
                                     shape={"pieces": WORLD, "batch": B, "heads": TP_HEADS, "value_dim": 512},
                                     dtype=dt, floor_us=bench.floor_us(bytes=nbytes), error=err,
                                     impl=impl, **work))
    return out


def _memory(device) -> list[dict]:
    full = K3Config.full()
    rows = []
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        for world in (1, WORLD):
            m = dcp.measure_shard_bytes(full, CONVERSATION, world, dtype=dtype, device=device)
            m["layout"] = "tp8" if world == 1 else "dcp8"
            rows.append(m)
    return rows


def one_gpu(smoke: bool = False) -> dict:
    gpu = torch.cuda.is_available()
    if not gpu and not smoke:
        raise RuntimeError("the dcp study times kernels on a CUDA or ROCm GPU (smoke=True, or --smoke, "
                           "checks the code on a CPU; notebook 01 and tests/test_dcp*.py check DCP on gloo "
                           "ranks)")
    dev = torch.device("cuda" if gpu else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    timing = dict(warmup=1, repeats=2, calls_per_sample=1) if smoke else dict(warmup=10, repeats=50)
    graph = gpu
    dt = torch.bfloat16 if gpu else torch.float32  # bf16 products are wrong in Triton's interpreter
    cases = ((128, 2),) if smoke else LOCAL_CASES
    records, ratios = [], []
    for L, B in cases:
        tp = _local_case(L, B, "tp8", gen, timing, graph, dt)
        dc = _local_case(L, B, "dcp8", gen, timing, graph, dt)
        records += [tp, dc]
        row = {"context": L, "batch": B, "tp8_us": tp.median_us, "dcp8_us": dc.median_us,
               "ratio": dc.median_us / tp.median_us, "target": 1.1,
               "tp8_backend": tp.extra.get("backend_used"),
               "dcp8_backend": dc.extra.get("backend_used")}
        if row["tp8_backend"] != row["dcp8_backend"]:  # the same shapes on one kernel: the seed's claim
            same = _local_case(L, B, "tp8", gen, timing, graph, dt, backend=row["dcp8_backend"])
            records.append(same)
            row.update(tp8_same_backend_us=same.median_us, ratio_same_backend=dc.median_us / same.median_us)
        ratios.append(row)
    merges = []
    for B in ((2,) if smoke else MERGE_BATCHES):
        before, after = _merge_case(B, gen, timing, graph, dt)
        records += [before, after]
        local = {r.shape["context"]: r.median_us for r in records
                 if r.extra.get("layout") == "dcp8" and r.shape["batch"] == B}
        merges.append(
            {
                "batch": B,
                "torch_us": before.median_us,
                "triton_us": after.median_us,
                "speedup": before.median_us / after.median_us,
                "target": 3.0,
                "share_of_local_attention": {
                    str(L): {
                        "torch": before.median_us / (t + before.median_us),
                        "triton": after.median_us / (t + after.median_us),
                    }
                    for L, t in local.items()
                },
            }
        )
    memory = _memory(dev) if gpu else []
    return {"records": records, "local_ratio": ratios, "merge": merges, "memory": memory}


def print_summary(result: dict) -> None:
    """The ratios, merges and memory of a `one_gpu` result, one table each."""
    print(f"{'context':>8} {'B':>3} {'TP8 us':>9} {'DCP8 us':>9} {'DCP8/TP8':>9}  (target <= 1.1)  backends; "
          "same backend")
    for r in result["local_ratio"]:
        same = (f"  TP8 on {r['dcp8_backend']}: {r['tp8_same_backend_us']:.2f} us, ratio "
                f"{r['ratio_same_backend']:.2f}"
                if "ratio_same_backend" in r else "")
        print(f"{r['context']:>8} {r['batch']:>3} {r['tp8_us']:>9.2f} {r['dcp8_us']:>9.2f} "
              f"{r['ratio']:>9.2f}  {r['tp8_backend']} / {r['dcp8_backend']}{same}")
    print(f"{'merge B':>8} {'torch us':>9} {'triton us':>9} {'speedup':>8}  (target >= 3)  share of decode")
    for m in result["merge"]:
        shares = "; ".join(f"L={L}: torch {s['torch']:.0%}, triton {s['triton']:.0%}"
                           for L, s in m["share_of_local_attention"].items())
        print(f"{m['batch']:>8} {m['torch_us']:>9.2f} {m['triton_us']:>9.2f} {m['speedup']:>8.2f}  {shares}")
    for m in result["memory"]:
        off = "" if m["agrees"] else "  OFF BY MORE THAN ONE PAGE"
        print(f"memory {m['layout']:<5} {m['dtype']:<14} formula {m['formula'] / 1e6:9.1f} MB  measured "
              f"{m['measured'] / 1e6:9.1f} MB  ({m['how']}){off}")


# -------------------------------------------------------------------------------------- live run
def live_attention() -> tuple[str, str]:
    """(decode, why) for the gloo ranks' shards, which are CPU tensors (`check.default_attention`)."""
    from k3lab.parallel.check import default_attention

    if default_attention("cpu") == "after":
        return "after", "the MLA op's after, in Triton's interpreter (CPU tensors)"
    return "reference", ("the reference decode: gloo ranks hold CPU tensors, and Triton runs on CPU tensors "
                         "only in its interpreter (TRITON_INTERPRET=1, which k3lab sets only when there is "
                         "no GPU)")


def live_run(world_size: int = 4, *, tqs=(1, 4), interleaves=(1, 16), batch: int = 3, heads: int = 2,
             length: int = 96, attention: str | None = None, timeout_s: float = 120) -> pd.DataFrame:
    """DCP on `world_size` gloo ranks (processes on this machine) against single-rank fp64 attention.

    One spawned run per (Tq, interleave); both merges in each. Returns one row per merge, rank and case.
    attention: the decode on each shard (None: `live_attention`).
    """
    from k3lab.parallel import spawn
    from k3lab.parallel.check import dcp_rank_check

    attention = attention or live_attention()[0]
    frames = []
    for tq in tqs:
        for inter in interleaves:
            opts = dict(batch=batch, tq=tq, heads=heads, length=length, dtype="float32", interleave=inter,
                        local=attention, seed=tq * 100 + inter, merges=list(dcp.MERGES))
            rows = spawn(dcp_rank_check, world_size, opts, backend="gloo", timeout_s=timeout_s)
            frames.append(pd.DataFrame(rows).assign(tq=tq, interleave=inter))
    return pd.concat(frames, ignore_index=True)[
        ["tq", "interleave", "merge", "rank", "held", "rel", "lse_abs", "nan"]
    ]


# ---------------------------------------------------------------------------------------- study contract
# `k3lab bench dcp` on a GPU: the one-GPU benchmark (`one_gpu`) as one case.
def case_names(preset=None) -> list[str]:
    return ["one_gpu"]


def run(preset=None, cases=None, *, smoke: bool = False) -> list:
    """Local attention at TP8's and DCP8's shapes, the merge, the 142K cache (needs a GPU; smoke=True
    runs tiny sizes anywhere, to check the code); prints the ratios, merges and memory
    (`print_summary`) and returns the records."""
    if cases and list(cases) != ["one_gpu"]:
        raise ValueError(f"cases must be ['one_gpu'], got {list(cases)}")
    result = one_gpu(smoke=smoke)
    print_summary(result)
    return result["records"]


def profile_targets(preset=None) -> dict:
    """The study's before/after kernels at one small case, for traces: the a2a merge of N = 8 partials
    at B = 1, torch ('before') and Triton ('after', one launch), as the decode runs it (no value check).
    On a GPU at TP8's 12 heads in bf16; on a CPU at 2 heads in fp32 through Triton's interpreter."""
    gpu = torch.cuda.is_available()
    dev, dt, heads = ("cuda", torch.bfloat16, TP_HEADS) if gpu else ("cpu", torch.float32, 2)
    gen = torch.Generator(device=dev).manual_seed(0)
    o = torch.randn(WORLD, 1, 1, heads, 512, device=dev, generator=gen).to(dt)
    lse = torch.randn(WORLD, 1, 1, heads, device=dev, generator=gen) * 3
    return {v: (lambda impl=impl: merge_partials(o, lse, impl, check_values=False))
            for v, impl in (("before", "torch"), ("after", "triton"))}
