"""The step's glue kernels, each against its torch path at the step's shapes: the fused router + expert
sort (k3lab.ops.moe_router, K3's E = 896, top_k = 16, N = 1 and 64 tokens) and SiTU-GLU
(k3lab.ops.situ_glu at the TP8 widths, N = 1 and 64 rows). The `glue_fused` switch turns both on in
the whole step; here each is timed alone.

    k3lab bench decode_step --cases glue --json F      (GPU; records of study decode_step, cases glue.*)

Each case is checked before it is timed: the router's two paths must pick the same experts in the
same order, weights within 1e-5 relative, and the same ExpertSort; SiTU-GLU's Triton path must match
the fp64 reference and the torch path within bf16 bounds. Then each path is timed under a CUDA graph
(k3lab.bench.time_fn, graph=True: the cost of a call inside a long graph, as the step replays it).
Records: variant 'before' = the torch path, 'after' = the Triton path; cases
glue.moe_router.N<n> and glue.situ_glu.<width>_N<n>. GPU only: on a CPU nothing is measured.
"""

from __future__ import annotations

import torch

from k3lab import bench
from k3lab.ops.moe_experts.inputs import default_block_m
from k3lab.ops.moe_router import route_and_sort
from k3lab.ops.situ_glu import situ_glu_stacked, widths

STUDY = "decode_step"
PREFIX = "glue."  # case prefix of these records
E, TOP_K, SCALING = 896, 16, 2.5
SORT_FIELDS = ("pair_of_row", "tile_expert", "n_tiles", "counts")
VARIANTS = (("before", "torch"), ("after", "triton"))


def router_check(n_tokens: int, seed: int = 0, device: str = "cuda") -> tuple[dict, tuple]:
    """(check dict, call arguments) for one batch: both paths run once on the same fresh logits. The
    check's 'ok' is False when the experts, their order, the weights or the sort differ."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n_tokens, E, device=device, generator=gen) * 2
    bias = torch.randn(E, device=device, generator=gen) * 0.05
    m = default_block_m(n_tokens, TOP_K, E)
    out = {b: route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m, backend=b) for _, b in VARIANTS}
    (w0, i0, s0), (w1, i1, s1) = out["torch"], out["triton"]
    chk = {"idx_equal": bool(torch.equal(i0, i1)),
           "weights_max_rel": float(((w1 - w0).abs() / w0.abs()).max()),
           "sort_equal": {f: bool(torch.equal(getattr(s0, f), getattr(s1, f))) for f in SORT_FIELDS}}
    chk["ok"] = chk["idx_equal"] and chk["weights_max_rel"] <= 1e-5 and all(chk["sort_equal"].values())
    return chk, (logits, bias, m)


def router_records(sizes=(1, 64), device: str = "cuda", repeats: int = 100) -> list[bench.Record]:
    """Two records per batch size (torch 'before', triton 'after'), after `router_check`; a failed check
    is a bench.CheckFailed naming the batch, before anything is timed."""
    out = []
    for n in sizes:
        chk, (logits, bias, m) = router_check(n, device=device)
        if not chk["ok"]:
            raise bench.CheckFailed(f"moe_router at N = {n}: the triton path differs from torch: {chk}")
        for variant, b in VARIANTS:
            t = bench.time_fn(lambda b=b: route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m,
                                                         backend=b),
                              graph=device != "cpu", device=device, repeats=repeats, warmup=2)
            out.append(bench.make_record(STUDY, f"{PREFIX}moe_router.N{n}", variant, t,
                                         shape={"tokens": n, "experts": E, "top_k": TOP_K, "block_m": m},
                                         dtype=logits.dtype, error=chk, backend_used=b))
    return out


def situ_glu_records(rows=(1, 64), dtype=torch.bfloat16) -> list[bench.Record]:
    """Two records per (TP8 width, row count): torch 'before', triton 'after', each a call as the step
    makes it (no out=: the result allocated from the graph's pool), after checking the Triton path
    against the fp64 reference and the torch path. Inputs stay hot in L2, as the matmul that produces gu
    in the step leaves them."""
    out = []
    for what, f in widths().items():
        for n in rows:
            gu = torch.randn(n, 2 * f, device="cuda", dtype=dtype) * 8
            ref = situ_glu_stacked(gu.double(), backend="torch")
            fast = situ_glu_stacked(gu, backend="triton")
            torch.testing.assert_close(fast.double(), ref, rtol=2 ** -8, atol=1e-6)
            torch.testing.assert_close(fast, situ_glu_stacked(gu, backend="torch"), rtol=2 ** -7, atol=1e-6)
            err = {"max_abs_vs_fp64": float((fast.double() - ref).abs().max()),
                   "bounds": "rtol 2^-8 against fp64, 2^-7 against the torch path; atol 1e-6"}
            for variant, b in VARIANTS:
                t = bench.time_fn(lambda b=b: situ_glu_stacked(gu, backend=b), graph=True)
                out.append(bench.make_record(STUDY, f"{PREFIX}situ_glu.{what}_N{n}", variant, t,
                                             shape={"rows": n, "F": f, "width": what}, dtype=dtype, error=err,
                                             backend_used=b))
    return out


def run(log=print) -> list[bench.Record]:
    """Both glue kernels' records; [] on a CPU (said in the log)."""
    if not torch.cuda.is_available():
        log("decode_step glue: the glue kernels are timed on a GPU; there is none here, so nothing is "
            "measured (tests/test_moe_router.py and tests/test_situ_glu_op.py check them on a CPU)")
        return []
    return router_records() + situ_glu_records()
