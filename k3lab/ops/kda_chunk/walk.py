"""The Triton chunk walks of KDA prefill: the plain walk / replay and the summaries of the group scan.

Both walk a group's chunks in order, keeping one [128 x BV] fp32 tile of a state-like matrix on chip:
  walk / replay: E = U - W S;  O = Qg S + Aqk E (written);  S <- diag(d) S + Kd^T E
                 (the plain walk: one group per sequence from the initial state; the replay: every group
                 from its starting state, all groups in parallel)
  summaries:     X <- diag(d) X + Kd^T (R - W X) from X = 0 on the wider state [N | b] (K + V columns):
                 N with right-hand side R = -W diag(D so far), D = the product of the chunks' d (exact, a
                 diagonal), b with R = U. Then S_out = (D + N) S_in + b for the whole group.
Products use the input dtype's matrix units with fp32 accumulation and an fp32 state (as fla does); fp32
inputs take exact fp32 products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .inputs import CHUNK, HEAD_DIM, WHILE, dot_precisions, pipeline_stages
from .plan import KdaPlan, Work, choose_block_v

WARPS = 4
STAGES = 2  # the loop bodies have no branch: the compiler fetches the next chunk's operands early
# LDS two stages of the walk ask for, by value-tile width (Triton 3.6, gfx942): 64 columns pass 64 KiB
WALK_TWO_STAGE_LDS = {32: 64 * 1024, 64: 72 * 1024}
REPLAY_BLOCK_V = 64  # the replay has many programs already: whole 64-column tiles
SUMMARY_BLOCK = 64


@triton.jit
def state_tile(ptr, item, rk, rbv, v0, K: tl.constexpr, V: tl.constexpr):
    """Pointers to columns v0 + rbv (rbv = tl.arange(0, BV)) of the rows rk = tl.arange(0, K) of matrix
    `item` of a row-major [items, K, V] buffer (a state [N, H, K, V], item = n * H + h): the [K, BV]
    tile of a state one program keeps on chip."""
    return ptr + (item * K + rk)[:, None] * V + v0 + rbv[None, :]


@triton.jit
def _chunk_maps(w, kdt, dd, base, K: tl.constexpr, C: tl.constexpr):
    """W [C, K], Kd^T [K, C] and d [K] of chunk-head item `base`: what every walk step reads."""
    rc = tl.arange(0, C)
    rk = tl.arange(0, K)
    W = tl.load(w + base * C * K + rc[:, None] * K + rk[None, :])
    KdT = tl.load(kdt + base * K * C + rk[:, None] * C + rc[None, :])
    return W, KdT, tl.load(dd + base * K + rk)


@triton.jit
def _walk_step(
    S,
    cidx,
    h,
    w,
    u,
    qg,
    kdt,
    aqk,
    dd,
    chunk_tok,
    chunk_len,
    o,
    H,
    v0,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """One chunk: E = U - W S; O = Qg S + Aqk E (stored); returns diag(d) S + Kd^T E."""
    rc = tl.arange(0, C)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    INTER = w.dtype.element_ty
    base = cidx * H + h
    W, KdT, d = _chunk_maps(w, kdt, dd, base, K, C)
    U = tl.load(u + base * C * V + rc[:, None] * V + v0 + rbv[None, :]).to(tl.float32)
    Qg = tl.load(qg + base * C * K + rc[:, None] * K + rk[None, :])
    A = tl.load(aqk + base * C * C + rc[:, None] * C + rc[None, :])
    Sb = S.to(INTER)
    E = U - tl.dot(W, Sb, input_precision=PREC)
    Eb = E.to(INTER)
    out = tl.dot(Qg, Sb, input_precision=PREC) + tl.dot(A, Eb, input_precision=PREC)
    tok0 = tl.load(chunk_tok + cidx).to(tl.int64)
    L = tl.load(chunk_len + cidx)
    tl.store(
        o + ((tok0 + rc) * H + h)[:, None] * V + v0 + rbv[None, :],
        out.to(o.dtype.element_ty),
        mask=(rc < L)[:, None],
    )
    return d[:, None] * S + tl.dot(KdT, Eb, input_precision=PREC)


@triton.jit(do_not_specialize=["H"])
def _walk_kernel(
    w,
    u,
    qg,
    kdt,
    aqk,
    dd,
    chunk_tok,
    chunk_len,
    grp_chunk0,
    grp_nchunks,
    grp_seq,
    grp_sin,
    grp_last,
    s_in,
    o,
    s_final,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    HAS_SIN: tl.constexpr,
    PREC: tl.constexpr,
    WHILE: tl.constexpr,
):
    """One program per (value tile, head, group): walk the group's chunks keeping S [K, BV] on chip,
    from s_in[grp_sin[group]] (zeros without HAS_SIN); a sequence's last group writes s_final."""
    iv = tl.program_id(0)
    h = tl.program_id(1)
    gi = tl.program_id(2)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    v0 = iv * BV
    c0 = tl.load(grp_chunk0 + gi).to(tl.int64)
    nch = tl.load(grp_nchunks + gi)
    if HAS_SIN:
        sidx = tl.load(grp_sin + gi).to(tl.int64)
        S = tl.load(state_tile(s_in, sidx * H + h, rk, rbv, v0, K, V))
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if WHILE:
        t = 0
        while t < nch:
            S = _walk_step(
                S, c0 + t, h, w, u, qg, kdt, aqk, dd, chunk_tok, chunk_len, o, H, v0, K, V, C, BV, PREC
            )
            t += 1
    else:
        for t in range(nch):
            S = _walk_step(
                S, c0 + t, h, w, u, qg, kdt, aqk, dd, chunk_tok, chunk_len, o, H, v0, K, V, C, BV, PREC
            )
    if tl.load(grp_last + gi) != 0:
        n = tl.load(grp_seq + gi).to(tl.int64)
        tl.store(state_tile(s_final, n * H + h, rk, rbv, v0, K, V), S)


@triton.jit
def _summary_step(
    X,
    Dc,
    cidx,
    h,
    w,
    u,
    kdt,
    dd,
    H,
    is_n,
    not_n,
    col0,
    vcol0,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """One chunk of a summary walk: X <- diag(d) X + Kd^T (rhs - W X); Dc, the product of d so far.
    is_n / not_n: [BV] masks, every lane equal (which half of [N | b] this program builds)."""
    rc = tl.arange(0, C)
    rbv = tl.arange(0, BV)
    INTER = w.dtype.element_ty
    base = cidx * H + h
    W, KdT, d = _chunk_maps(w, kdt, dd, base, K, C)
    # program-uniform masks instead of a branch: the loop stays one straight body the compiler can
    # software-pipeline; a masked-off load costs no memory traffic
    Wc = tl.load(w + base * C * K + rc[:, None] * K + col0 + rbv[None, :], mask=is_n[None, :], other=0.0)
    Uc = tl.load(u + base * C * V + rc[:, None] * V + vcol0 + rbv[None, :], mask=not_n[None, :], other=0.0)
    Wc = Wc.to(tl.float32)
    Uc = Uc.to(tl.float32)
    rhs = Uc - Wc * Dc[None, :]
    Dc = Dc * tl.load(dd + base * K + col0 + rbv, mask=is_n, other=1.0)
    E = rhs - tl.dot(W, X.to(INTER), input_precision=PREC)
    X = d[:, None] * X + tl.dot(KdT, E.to(INTER), input_precision=PREC)
    return X, Dc


@triton.jit(do_not_specialize=["H"])
def _summary_kernel(
    w,
    u,
    kdt,
    dd,
    grp_chunk0,
    grp_nchunks,
    sum_grp,
    sum_n,
    sum_b,
    sum_d,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    WHILE: tl.constexpr,
):
    """One program per (column tile of [N | b], head, summarised group). Tiles below K // BV build
    N (right-hand side -W diag(D so far), D tracked exactly); the others build b (right-hand side U).
    Both walk X <- diag(d) X + Kd^T (rhs - W X) from X = 0."""
    it = tl.program_id(0)
    h = tl.program_id(1)
    si = tl.program_id(2)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    gi = tl.load(sum_grp + si)
    c0 = tl.load(grp_chunk0 + gi).to(tl.int64)
    nch = tl.load(grp_nchunks + gi)
    n_tile = it < K // BV
    # the loads' masks as [BV] vectors compared lane by lane, not a scalar comparison splat to a tile:
    # Triton's interpreter tags a scalar comparison with its operands' int32 type and splats it as int32,
    # which its loads refuse from 3.9 on (compiled code is the same either way: one uniform predicate)
    it_v = it + tl.zeros([BV], dtype=tl.int32)
    is_n = it_v < K // BV
    not_n = it_v >= K // BV
    col0 = (it % (K // BV)) * BV  # N: columns of M (b tiles keep an in-range, masked-off offset)
    vcol0 = (it % (K // BV)) * BV  # b: value columns
    X = tl.zeros([K, BV], dtype=tl.float32)
    Dc = tl.full([BV], 1.0, dtype=tl.float32)
    if WHILE:
        t = 0
        while t < nch:
            X, Dc = _summary_step(
                X, Dc, c0 + t, h, w, u, kdt, dd, H, is_n, not_n, col0, vcol0, K, V, C, BV, PREC
            )
            t += 1
    else:
        for t in range(nch):
            X, Dc = _summary_step(
                X, Dc, c0 + t, h, w, u, kdt, dd, H, is_n, not_n, col0, vcol0, K, V, C, BV, PREC
            )
    sbase = si.to(tl.int64) * H + h
    if n_tile:
        tl.store(state_tile(sum_n, sbase, rk, rbv, col0, K, K), X)
        tl.store(sum_d + sbase * K + col0 + rbv, Dc)
    else:
        tl.store(state_tile(sum_b, sbase, rk, rbv, vcol0, K, V), X)


def block_v(plan: KdaPlan) -> int:
    """Value-tile width of `walk`: 64 columns for the replay, `choose_block_v` for the plain walk."""
    return REPLAY_BLOCK_V if plan.uses_scan else choose_block_v(plan.n_seqs, plan.heads)


def walk(work: Work, plan: KdaPlan, o: torch.Tensor, s_final: torch.Tensor, s_in: torch.Tensor | None,
         sin_index: torch.Tensor) -> None:
    """Walk every group of `plan` from s_in[sin_index[group]] (zeros when s_in is None), writing o
    [B, T, H, 128] and, from each sequence's last group, s_final [N, H, 128, 128] fp32. One launch."""
    H, bv = plan.heads, block_v(plan)
    _walk_kernel[(HEAD_DIM // bv, H, plan.n_groups)](
        work.w, work.u, work.qg, work.kdt, work.aqk, work.d, plan.chunk_tok, plan.chunk_len, plan.grp_chunk0,
        plan.grp_nchunks, plan.grp_seq, sin_index, plan.grp_last, s_in if s_in is not None else s_final, o,
        s_final,
        H, K=HEAD_DIM, V=HEAD_DIM, C=CHUNK, BV=bv, HAS_SIN=s_in is not None,
        PREC=dot_precisions(work.w.dtype)["walk"], WHILE=WHILE, num_warps=WARPS,
        num_stages=min(STAGES, pipeline_stages(WALK_TWO_STAGE_LDS[bv])),
    )  # fmt: skip


def summaries(work: Work, plan: KdaPlan, sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Every non-last group's summary into sums = (N [S, H, K, K], b [S, H, K, V], D [S, H, K]), fp32,
    S = plan.n_summaries. One launch."""
    K, H = HEAD_DIM, plan.heads
    sum_n, sum_b, sum_d = sums
    _summary_kernel[(2 * K // SUMMARY_BLOCK, H, plan.n_summaries)](
        work.w, work.u, work.kdt, work.d, plan.grp_chunk0, plan.grp_nchunks, plan.sum_grp, sum_n, sum_b,
        sum_d, H,
        K=K, V=K, C=CHUNK, BV=SUMMARY_BLOCK, PREC=dot_precisions(work.w.dtype)["walk"], WHILE=WHILE,
        num_warps=WARPS, num_stages=STAGES,
    )  # fmt: skip
