"""Nothing silently wrong: every public op of MLA decode, KDA verification, AttnRes + RMSNorm and KDA decode,
driven with generated inputs that are often bad (page ids past int32 or outside the pool, lengths past the
cache or given as floats or bools, offsets that break their promise, NaN / negative / zero / out-of-fp32
scales and epsilons), either
refuses them by name (ValueError naming the argument) or returns what the reference computes. On a CPU the
Triton kernels run in the interpreter, so shapes stay small and each property tries 25 cases."""

from __future__ import annotations

import math

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.nn.attn_res import attn_res_mix
from k3lab.nn.norms import rms_norm
from k3lab.ops import attn_res_norm as arn
from k3lab.ops import kda_decode as kd
from k3lab.ops import kda_verify as kv
from k3lab.ops import mla_decode as mla

from refusals import examples, refused

from hypothesis import event, given  # noqa: E402  (refusals skips the module without hypothesis)
from hypothesis import strategies as st  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SETTINGS = examples(25)

# Scalars a caller may pass as a scale or an epsilon: plausible ones and the bad ones every op refuses.
BAD_SCALARS = [math.nan, math.inf, -math.inf, 0.0, -1.0, -0.25, 1e-45, 1e39, True, "0.1", torch.tensor(0.1)]
SCALARS = st.one_of(st.sampled_from(BAD_SCALARS), st.floats(0.05, 2.0), st.sampled_from([1, 2]))


# ------------------------------------------------------------------ MLA decode
INT32 = 2**31


@st.composite
def mla_calls(draw):
    B, Tq, H = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 3]))
    paged = draw(st.booleans())
    ps, per, n_pages = 16, draw(st.integers(1, 2)), draw(st.integers(1, 4))
    bad_ids = [n_pages, -1, 2**32 + 1, -2**32 + 1, 2**40]  # past the pool, negative, wrapping in int32
    page_ids = st.one_of(st.integers(0, n_pages - 1), st.sampled_from(bad_ids))
    table = [[draw(page_ids) for _ in range(per)] for _ in range(B)]
    wide = any(not -INT32 <= x < INT32 for row in table for x in row)
    bt_dtype = torch.int64 if wide else draw(st.sampled_from([torch.int32, torch.int64]))
    L = per * ps if paged else draw(st.integers(8, 40))
    lengths = draw(st.one_of(st.none(), st.lists(st.integers(-2, L + 3), min_size=B, max_size=B)))
    if lengths is not None and draw(st.integers(0, 5)) == 0:  # whole lengths as floats or bools: refused
        lengths = [float(n) + 0.5 for n in lengths] if draw(st.booleans()) else [n > 0 for n in lengths]
    return dict(B=B, Tq=Tq, H=H, paged=paged, ps=ps, n_pages=n_pages, table=table, bt_dtype=bt_dtype, L=L,
                lengths=lengths, scale=draw(SCALARS), variant=draw(st.sampled_from(["before", "after"])))


def _mla_reference(q, kv_, lengths, table, ps, scale, paged):
    """fp64 reference on the contiguous rows each request reads (only the pages its length uses)."""
    if not paged:
        return mla.reference(q.double(), kv_.double(), lengths, scale=scale)
    B = q.shape[0]
    L = table.shape[1] * ps
    cache = torch.zeros(B, L, mla.LATENT_DIM, dtype=torch.float64)
    for b in range(B):
        n = int(lengths[b])
        for p in range(-(-n // ps)):
            cache[b, p * ps:(p + 1) * ps] = kv_[int(table[b, p])].double()
    return mla.reference(q.double(), cache, lengths, scale=scale)


@SETTINGS
@given(mla_calls())
def test_mla_decode_refuses_by_name_or_matches_the_reference(c):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(c["B"], c["Tq"], c["H"], mla.LATENT_DIM, generator=g).to(DEV)
    rows = (c["n_pages"], c["ps"]) if c["paged"] else (c["B"], c["L"])
    kv_ = torch.randn(*rows, mla.LATENT_DIM, generator=g).to(DEV)
    table = torch.tensor(c["table"], dtype=c["bt_dtype"], device=DEV) if c["paged"] else None
    lengths = None if c["lengths"] is None else torch.tensor(c["lengths"], device=DEV)
    fn = mla.mla_decode_after if c["variant"] == "after" else mla.mla_decode_before
    try:
        o, lse = fn(q, kv_, lengths, block_table=table, scale=c["scale"], backend="triton")
    except ValueError as exc:
        refused(exc, "scale", "block_table", "lengths", "cache", "q_len")
        return
    assert lengths is None or lengths.dtype in (torch.int64, torch.int32), f"took {lengths.dtype} lengths"
    used = lengths if lengths is not None else torch.full((c["B"],), kv_.shape[1])
    ref_o, ref_lse = _mla_reference(q.cpu(), kv_.cpu(), used.cpu(), None if table is None else table.cpu(),
                                    c["ps"], c["scale"], c["paged"])
    bench.check(o.cpu(), ref_o, dtype="fp32", name="o")
    bench.check(lse.cpu(), ref_lse, dtype="fp32", name="lse")
    event("computed, equal to the reference")


def test_mla_page_ids_are_checked_before_narrowing():
    """The reviewer's case: an int64 id of 2**32 + 1 would wrap to page 1 in int32."""
    q = torch.randn(1, 1, 2, mla.LATENT_DIM, device=DEV)
    pool, bt = mla.to_paged(torch.randn(1, 64, mla.LATENT_DIM, device=DEV), 16)
    for bad in (2**32 + 1, -2**32 + 1):
        table = bt.long().clone()
        table[0, 0] = bad
        for fn in (mla.mla_decode_after, mla.mla_decode_before):
            with pytest.raises(ValueError, match="block_table holds page ids outside the pool"):
                fn(q, pool, torch.tensor([64], device=DEV), block_table=table)


# ------------------------------------------------------------------ KDA verification
@st.composite
def verify_calls(draw):
    H, V = draw(st.sampled_from([1, 2])), 32  # 32: the before kernel's tile
    mode = draw(st.sampled_from(["uniform", "cu_seqlens", "lengths"]))
    T = draw(st.integers(1, 4))
    call = dict(H=H, V=V, mode=mode, T=T, scale=draw(SCALARS), before=draw(st.booleans()),
                final=draw(st.booleans()), cu=None, lengths=None,
                max_seqlen=draw(st.one_of(st.none(), st.integers(-1, 10), st.just(True))))
    if mode == "cu_seqlens":
        seqs = draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))
        cu = [0]
        for n in seqs:
            cu.append(cu[-1] + n)
        if draw(st.booleans()):  # a broken offset list: out of order, not starting at 0 or not ending at T
            i = draw(st.integers(0, len(cu) - 1))
            cu[i] = draw(st.integers(-2, cu[-1] + 2))
        call["cu"], call["T"] = cu, max(1, seqs and sum(seqs))
    elif mode == "lengths":
        call["B"] = draw(st.integers(1, 2))
        call["lengths"] = draw(st.lists(st.integers(-1, T + 1), min_size=call["B"], max_size=call["B"]))
        call["lengths_dtype"] = draw(st.sampled_from([torch.int32] * 4 + [torch.float32, torch.bool]))
    call.setdefault("B", 1 if mode == "cu_seqlens" else draw(st.integers(1, 2)))
    return call


@SETTINGS
@given(verify_calls())
def test_kda_verify_refuses_by_name_or_matches_the_reference(c):
    g = torch.Generator().manual_seed(1)
    B, T, H, V = c["B"], c["T"], c["H"], c["V"]
    q = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=g), dim=-1).to(DEV)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=g), dim=-1).to(DEV)
    v = torch.randn(B, T, H, V, generator=g).to(DEV)
    gate = (-torch.rand(B, T, H, 128, generator=g)).to(DEV)
    beta = torch.rand(B, T, H, generator=g).to(DEV)
    cu = None if c["cu"] is None else torch.tensor(c["cu"], dtype=torch.int32, device=DEV)
    lengths = None if c["lengths"] is None else torch.tensor(c["lengths"], device=DEV).to(c["lengths_dtype"])
    fn = kv.kda_verify_before if c["before"] else kv.kda_verify
    try:
        o, states = fn(q, k, v, gate, beta, None, scale=c["scale"], cu_seqlens=cu, lengths=lengths,
                       max_seqlen=c["max_seqlen"], final_state_only=c["final"])
    except ValueError as exc:
        refused(exc, "scale", "cu_seqlens", "max_seqlen", "lengths", "T (positions")
        return
    assert lengths is None or lengths.dtype == torch.int32, f"took {lengths.dtype} lengths"
    ref_o, ref_s = kv.reference_verify(q, k, v, gate, beta, None, scale=c["scale"], cu_seqlens=cu,
                                       lengths=lengths)
    bench.check(o, ref_o, dtype="fp32", name="o")
    event("computed, equal to the reference")
    if c["final"]:
        return  # the final states are checked against the all-states path in test_kda_verify.py
    live = ~torch.isnan(ref_s)
    assert live.any() or ref_s.numel() == 0 or (lengths is not None and int(lengths.max()) == 0)
    bench.check(states[live], ref_s[live], dtype="fp32", name="states")


def test_kda_verify_refuses_a_max_seqlen_shorter_than_a_sequence():
    """The reviewer's case: cu_seqlens [0, 3, 8] with max_seqlen=2 left tokens 2.. unwritten."""
    g = torch.Generator().manual_seed(2)
    x = [torch.randn(1, 8, 1, d, generator=g).to(DEV) for d in (128, 128, 8, 128)]
    beta = torch.rand(1, 8, 1, generator=g).to(DEV)
    cu = torch.tensor([0, 3, 8], device=DEV)
    for fn in (kv.kda_verify, kv.kda_verify_before):
        with pytest.raises(ValueError, match="max_seqlen = 2 is shorter than the longest sequence"):
            fn(*x, beta, None, cu_seqlens=cu, max_seqlen=2)


# ------------------------------------------------------------------ AttnRes + RMSNorm
@SETTINGS
@given(T=st.integers(1, 2), n_blocks=st.integers(-1, 4), push=st.booleans(), eps=SCALARS,
       impl=st.sampled_from(["before", "after"]), delta=st.booleans())
def test_attn_res_norm_refuses_by_name_or_matches_the_reference(T, n_blocks, push, eps, impl, delta):
    g = torch.Generator().manual_seed(3)
    D, slots = 32, 4
    r = lambda *s: torch.randn(*s, generator=g).to(DEV)  # noqa: E731
    x = dict(prefix=r(T, D), delta=r(T, D) if delta else None, blocks=r(slots, T, D),
             res_norm_w=1 + 0.1 * r(D), res_proj_w=0.05 * r(D), next_norm_w=1 + 0.1 * r(D))
    expect = None
    if isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0 \
            and 0 <= n_blocks <= slots - push:
        prefix = x["prefix"].double() + (x["delta"].double() if delta else 0)
        sources = torch.cat([x["blocks"][:n_blocks].double(), prefix[None]])
        h = attn_res_mix(sources, x["res_norm_w"].double(), x["res_proj_w"].double(), eps)
        expect = rms_norm(h, x["next_norm_w"].double(), eps)
    try:
        out = arn.attn_res_norm(x["prefix"], x["delta"], x["blocks"], n_blocks, x["res_norm_w"],
                                x["res_proj_w"], x["next_norm_w"], eps=eps, push_block=push, impl=impl)
    except ValueError as exc:
        refused(exc, "eps", "n_blocks")
        return
    assert expect is not None, f"accepted eps={eps!r}, n_blocks={n_blocks}, which the reference refuses"
    bench.check(out, expect, dtype="fp32", name="out")
    event("computed, equal to the reference")


# ------------------------------------------------------------------ KDA decode
@SETTINGS
@given(eps=SCALARS, lower_bound=st.one_of(st.sampled_from([-5.0, -1.0, 0.0, 1.0, -math.inf, math.nan, True]),
                                          st.floats(-8.0, -0.5)),
       backend=st.sampled_from(["triton", "torch"]))
def test_kda_decode_refuses_by_name_or_matches_the_reference(eps, lower_bound, backend):
    inputs, cache, w = kd.make_example(1, 1, dtype=torch.float32, device=DEV, seed=5)
    w.eps, w.lower_bound = eps, lower_bound
    try:
        ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, compute_dtype=torch.float64)
    except ValueError as exc:
        ref_out, ref_exc = None, exc
    try:
        out = kd.kda_decode(**inputs, cache=cache, weights=w, backend=backend)
    except ValueError as exc:
        refused(exc, "weights.eps", "weights.lower_bound")
        assert ref_out is None, f"{backend} refused what the reference takes: {exc}"
        return
    assert ref_out is not None, f"{backend} took what the reference refuses: {ref_exc}"
    bench.check(out, ref_out, dtype="fp32", name="out")
    bench.check(cache.state, ref.state, dtype="fp32", name="state")
    event("computed, equal to the reference")
