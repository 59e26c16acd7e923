"""Nothing silently wrong, for the step's glue ops: the one-row GEMV, SiTU-GLU, the MoE router and the
partial-attention merge, driven with generated inputs that are often bad (wrong ranks, widths, dtypes,
strides, top_k and tile heights out of range, scalars of the wrong type or not finite, a NaN or +inf
log-sum-exp), either refuse them by name
(a ValueError naming the argument) or return what the plain PyTorch reference computes in fp64. Triton
runs in the interpreter on a CPU, so shapes stay small and each property tries 40 cases."""

from __future__ import annotations

import math

import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.nn.moe import route
from k3lab.nn.situ import situ_glu
from k3lab.ops import gemv as gv
from k3lab.ops import situ_glu as sg
from k3lab.ops.mla_decode.merge import merge_partials
from k3lab.ops.moe_router import route_and_sort

from refusals import examples, refused

from hypothesis import event, given  # noqa: E402  (refusals skips the module without hypothesis)
from hypothesis import strategies as st  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = examples(40)
DTYPES = st.sampled_from([torch.float32] * 3 + [torch.float16] * 2 + [torch.int32, torch.float64])


def mostly(good: list, bad: list):
    """Good values three times as often as bad ones: most cases compute, every bad value is tried."""
    return st.sampled_from(good * max(1, (3 * len(bad)) // max(len(good), 1)) + bad)


def _tensor(shape, dtype, g):
    t = torch.randn(*shape, generator=g, dtype=torch.float64) * 2
    return (t.round() if not dtype.is_floating_point else t).to(dtype).to(DEV)


@SETTINGS
@given(rows=mostly([1], [2]), K=st.sampled_from([0, 8, 33]), N=st.sampled_from([0, 5, 70]),
       K_w=mostly([None], [7]), dx=DTYPES, dw=mostly([None], [torch.float16, torch.int32]),
       transposed=mostly([False], [True]),
       backend=st.sampled_from([None, "triton", "torch"]))
def test_gemv_refuses_by_name_or_matches_the_reference(rows, K, N, K_w, dx, dw, transposed, backend):
    g = torch.Generator().manual_seed(1)
    x = _tensor((rows, K), dx, g)
    w = _tensor((N, K if K_w is None else K_w), dx if dw is None else dw, g)
    if transposed:
        w = w.t().contiguous().t()  # the same values, column-major: refused (rows must be contiguous)
    try:
        y = gv.gemv(x, w, backend=backend)
    except ValueError as exc:
        refused(exc, "x", "w", "backend")
        return
    ref = x.double().cpu() @ w.double().cpu().t()
    assert y.shape == (1, N) and y.dtype == x.dtype
    bench.check(y.cpu(), ref, dtype="fp16" if x.dtype == torch.float16 else "fp32", name="y")
    event("computed, equal to the reference")


@SETTINGS
@given(lead=st.sampled_from([(), (3,), (2, 4)]), width=mostly([0, 16, 64], [7]), dtype=DTYPES,
       out_kind=mostly([None, "ok"], ["short", "dtype"]), strided=mostly([False], [True]),
       backend=st.sampled_from([None, "triton", "torch"]))
def test_situ_glu_refuses_by_name_or_matches_the_reference(lead, width, dtype, out_kind, strided, backend):
    g = torch.Generator().manual_seed(2)
    gu = _tensor((*lead, width * (2 if strided else 1)), dtype, g)
    if strided:
        gu = gu[..., ::2]  # every other column: the values stand, the row stride does not collapse
    f = gu.shape[-1] // 2
    out = None
    if out_kind == "ok":
        out = torch.empty(*lead, f, dtype=dtype, device=DEV)
    elif out_kind == "short":
        out = torch.empty(*lead, max(f - 1, 0) + 1 if f == 0 else f - 1, dtype=dtype, device=DEV)
    elif out_kind == "dtype":
        out = torch.empty(*lead, f, dtype=torch.float16 if dtype != torch.float16 else torch.float32,
                          device=DEV)
    try:
        y = sg.situ_glu_stacked(gu, out=out, backend=backend)
    except ValueError as exc:
        refused(exc, "gu", "out", "backend")
        return
    a, b = gu.double().cpu().chunk(2, dim=-1)
    ref = situ_glu(a, b)
    assert y.shape == ref.shape and y.dtype == gu.dtype and (out is None or y.data_ptr() == out.data_ptr())
    bench.check(y.cpu(), ref, dtype="fp16" if dtype == torch.float16 else "fp32", name="y")
    event("computed, equal to the reference")


@SETTINGS
@given(N=st.sampled_from([1, 3, 9]), E=st.sampled_from([4, 16]),
       top_k=mostly([1, 2, 4], [0, 17, True, 2.0]),
       scaling=mostly([1.0, 2.5, 1], [True, "1", math.nan, math.inf]),
       renormalize=mostly([True, False], [1]), bias_kind=mostly([None, "ok"], ["short"]),
       num_experts=mostly([None], [5]), block_m=mostly([16, 32], [8, 17]),
       dtype=mostly([torch.float32, torch.float16], [torch.int32]),
       backend=st.sampled_from([None, "triton", "torch"]))
def test_router_refuses_by_name_or_matches_the_reference(N, E, top_k, scaling, renormalize, bias_kind,
                                                         num_experts, block_m, dtype, backend):
    g = torch.Generator().manual_seed(3)
    logits = _tensor((N, E), dtype, g)
    bias = None if bias_kind is None else _tensor((E if bias_kind == "ok" else E - 1,), torch.float32, g)
    try:
        w, idx, sort = route_and_sort(logits, bias, top_k, scaling=scaling, renormalize=renormalize,
                                      num_experts=num_experts, block_m=block_m, backend=backend)
    except ValueError as exc:
        refused(exc, "num_experts", "bias", "top_k", "scaling", "renormalize", "block_m", "backend",
                 "logits")
        return
    ref_w, ref_idx, _ = route(logits.double().cpu(), None if bias is None else bias.double().cpu(), top_k,
                              scaling, renormalize)
    assert math.isfinite(scaling), f"took scaling={scaling!r}"
    # the chosen set is the reference's (ties between equal logits may order slots differently)
    assert torch.equal(idx.cpu().sort(dim=-1).values, ref_idx.sort(dim=-1).values)
    by_expert = torch.zeros(N, E, dtype=torch.float64).scatter_(1, idx.cpu(), w.double().cpu())
    ref_by_expert = torch.zeros(N, E, dtype=torch.float64).scatter_(1, ref_idx, ref_w.double())
    bench.check(by_expert, ref_by_expert, dtype="fp32", name="weights")
    assert int(sort.counts.sum()) == N * top_k
    event("computed, equal to the reference")


@SETTINGS
@given(n=mostly([1, 3], [0]), rows=st.sampled_from([(2,), (2, 3)]), D=st.sampled_from([8, 130]),
       lse_shape=mostly(["ok"], ["short"]), empty=st.booleans(), poison=mostly([None], [math.nan, math.inf]),
       dtype=mostly([torch.float32, torch.float16], [torch.int32]),
       backend=mostly(["torch", "triton"], ["cuda"]))
def test_merge_refuses_by_name_or_matches_the_reference(n, rows, D, lse_shape, empty, poison, dtype, backend):
    g = torch.Generator().manual_seed(4)
    o = _tensor((n, *rows, D), dtype, g)
    lse = _tensor((n, *rows) if lse_shape == "ok" else (n, *rows[:-1], rows[-1] + 1), torch.float32, g)
    if empty and n > 1 and lse_shape == "ok":
        lse[0] = -math.inf  # a piece that holds no position: weight 0
    if poison is not None and lse.numel():
        lse.view(-1)[-1] = poison  # no log-sum-exp: refused
    try:
        out, out_lse = merge_partials(o, lse, backend)
    except ValueError as exc:
        refused(exc, "o_parts", "lse_parts", "backend")
        return
    assert poison is None or lse.numel() == 0, f"took an lse holding {poison}"
    lse64, o64 = lse.double().cpu(), o.double().cpu()
    ref_lse = torch.logsumexp(lse64, dim=0)
    ref = (torch.exp(lse64 - ref_lse).unsqueeze(-1) * o64).sum(0)
    bench.check(out.cpu(), ref, dtype="fp16" if dtype == torch.float16 else "fp32", name="o")
    bench.check(out_lse.cpu(), ref_lse, dtype="fp32", name="lse")
    event("computed, equal to the reference")
