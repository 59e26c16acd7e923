"""The Triton kernels of KDA verification: the streaming kernel (the shape of the original: run-time
length, per-token loads; also the wide-tile path once the GPU is full) and the narrow kernel (narrow
tiles, compile-time length, every input loaded and every token-invariant product computed before
the recurrence). Both run on NVIDIA, AMD (not yet run on AMD hardware by this project) and the CPU
interpreter. Inputs are checked and made contiguous by k3lab.ops.kda_verify.inputs.prepare."""

from __future__ import annotations

import triton
import triton.language as tl

from k3lab.ops.kda_verify.inputs import HEAD_DIM


@triton.jit
def sequence_span(seq_info, i_b, T, RAGGED: tl.constexpr):
    """(first token row, length) of sequence i_b: RAGGED 1 reads cu_seqlens [N + 1] (flattened
    tokens), 2 reads lengths [N] in a padded [N, T] layout, 0 is the uniform [N, T] batch."""
    if RAGGED == 1:
        bos = tl.load(seq_info + i_b).to(tl.int64)
        L = tl.load(seq_info + i_b + 1).to(tl.int64) - bos
    elif RAGGED == 2:
        bos = i_b.to(tl.int64) * T
        L = tl.load(seq_info + i_b).to(tl.int64)
    else:
        bos = i_b.to(tl.int64) * T
        L = T
    return bos, L


@triton.jit
def program_tile(h0, seq_info, T, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                 RAGGED: tl.constexpr):
    """What a program of either kernel starts from: its (sequence, head) and span of tokens, the K rows
    and BV value columns of its state tile, their offsets in a [K, V] state, and the initial state tile
    (fp32). Grid: (V / BV tiles, sequences x heads)."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, L = sequence_span(seq_info, i_b, T, RAGGED)
    offs_k = tl.arange(0, K)
    cols = i_v * BV + tl.arange(0, BV)
    tile = offs_k[:, None] * V + cols[None, :]
    S = tl.load(h0 + (i_b * H + i_h).to(tl.int64) * K * V + tile)
    return i_b, i_h, bos, L, offs_k, cols, tile, S


@triton.jit
def verify_stream_kernel(q, k, v, g, beta, h0, o, hs, seq_info, scale, T_run,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                          RAGGED: tl.constexpr, ALL_STATES: tl.constexpr):
    """One program per (tile of BV columns, sequence x head). The token loop's length is read at
    run time and each token's inputs are loaded inside it: T memory round trips in series."""
    i_b, i_h, bos, L, offs_k, offs_v, tile, S = program_tile(h0, seq_info, T_run, H, K, V, BV, RAGGED)
    t = 0
    while t < L:  # a while loop: the interpreter cannot range() over a run-time scalar
        row = (bos + t) * H + i_h
        q_t = tl.load(q + row * K + offs_k).to(tl.float32) * scale
        k_t = tl.load(k + row * K + offs_k).to(tl.float32)
        g_t = tl.load(g + row * K + offs_k).to(tl.float32)
        v_t = tl.load(v + row * V + offs_v).to(tl.float32)
        b_t = tl.load(beta + row).to(tl.float32)
        S = S * tl.exp(g_t)[:, None]
        u = tl.sum(S * k_t[:, None], axis=0)
        S = S + k_t[:, None] * (b_t * (v_t - u))[None, :]
        o_t = tl.sum(S * q_t[:, None], axis=0)
        tl.store(o + row * V + offs_v, o_t.to(o.dtype.element_ty))
        if ALL_STATES:
            tl.store(hs + row * K * V + tile, S)
        t += 1
    if not ALL_STATES:
        tl.store(hs + (i_b * H + i_h).to(tl.int64) * K * V + tile, S)


@triton.jit
def verify_narrow_kernel(q, k, v, g, beta, h0, o, hs, seq_info, scale,
                          T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BV: tl.constexpr, RAGGED: tl.constexpr, ALL_STATES: tl.constexpr):
    """Narrow tiles, one wave. T is a compile-time constant (the uniform length, or the ragged
    batch's longest sequence), so the loops unroll. Three phases: every load, then every
    state-independent quantity, then the recurrence."""
    i_b, i_h, bos, L, offs_k, cols, tile, S = program_tile(h0, seq_info, T, H, K, V, BV, RAGGED)
    cv = cols[None, :]  # [1, BV]: a row of the tile
    # Phase 1, hoisted loads: every position's inputs are requested before any is used, so the T
    # loads overlap: one memory round trip, not T. A dead ragged position reads k = g = beta = 0,
    # which makes its update the identity, so the unrolled loop needs no branch.
    qs = ()
    ks = ()
    gs = ()
    vs = ()
    bs = ()
    offs_in = offs_k
    for t in tl.static_range(T):
        row = (bos + t) * H + i_h
        if RAGGED == 0:
            qs = qs + (tl.load(q + row * K + offs_in),)
            ks = ks + (tl.load(k + row * K + offs_in),)
            gs = gs + (tl.load(g + row * K + offs_in),)
            vs = vs + (tl.load(v + row * V + cv),)
            bs = bs + (tl.load(beta + row),)
        else:
            alive = L > t
            # lane-wise position masks, not a scalar one splat to the vector: Triton's interpreter
            # splats a scalar comparison as int32, which its loads refuse from 3.9 on
            alive_k = (offs_in < K) & (offs_in * 0 + t < L)
            alive_v = (cv < V) & (cv * 0 + t < L)
            qs = qs + (tl.load(q + row * K + offs_in, mask=alive_k, other=0.0),)
            ks = ks + (tl.load(k + row * K + offs_in, mask=alive_k, other=0.0),)
            gs = gs + (tl.load(g + row * K + offs_in, mask=alive_k, other=0.0),)
            vs = vs + (tl.load(v + row * V + cv, mask=alive_v, other=0.0),)
            bs = bs + (tl.load(beta + row, mask=alive, other=0.0),)
    # Loads may not move across a barrier: without it the compiler interleaves position t+1's loads
    # with the arithmetic on position t's data and pays a round trip per position again.
    tl.debug_barrier()
    # Phase 2, token-invariant work (nothing here depends on the state). Each vector is broadcast to
    # the tile's shape here, so its move into the tile's register layout (through shared memory)
    # happens now and not on the recurrence's critical path: decay d = exp(g), d*k, d*q, k, and the
    # scalars q.k and beta*v.
    ds = ()
    dks = ()
    dqs = ()
    kf = ()
    qks = ()
    bvs = ()
    for t in tl.static_range(T):
        q_t = tl.broadcast_to(qs[t][:, None], (K, BV)).to(tl.float32) * scale
        k_t = tl.broadcast_to(ks[t][:, None], (K, BV)).to(tl.float32)
        d_t = tl.exp(tl.broadcast_to(gs[t][:, None], (K, BV)).to(tl.float32))
        ds = ds + (d_t,)
        dks = dks + (d_t * k_t,)
        dqs = dqs + (d_t * q_t,)
        kf = kf + (k_t,)
        qks = qks + (tl.sum(q_t * k_t, axis=0, keep_dims=True),)  # [1, BV], every column the same
        bvs = bvs + (bs[t].to(tl.float32) * vs[t].to(tl.float32),)
    # Phase 3, the recurrence. With S the state before position t:
    #   u = S^T (d*k) and p = S^T (d*q): two independent reductions of the same tile, side by side;
    #   delta = beta (v - u);  S' = d*S + k delta^T;  o = S'^T q = p + (q.k) delta.
    # The chain from S to S' is one multiply, one reduction over K and one fused multiply-add.
    for t in tl.static_range(T):
        u = tl.sum(S * dks[t], axis=0, keep_dims=True)  # [1, BV]
        p = tl.sum(S * dqs[t], axis=0, keep_dims=True)
        S_dec = S * ds[t]
        delta = bvs[t] - bs[t].to(tl.float32) * u
        S = S_dec + kf[t] * delta
        o_t = p + qks[t] * delta
        row_t = (bos + t) * H + i_h
        if RAGGED == 0:
            tl.store(o + row_t * V + cv, o_t.to(o.dtype.element_ty))
            if ALL_STATES:
                tl.store(hs + row_t * K * V + tile, S)
        else:
            # padded layout (lengths): a dead position's q is 0, so its output row is written as 0;
            # flattened layout (cu_seqlens): the row belongs to the next sequence, so it is skipped
            if RAGGED == 1:
                tl.store(o + row_t * V + cv, o_t.to(o.dtype.element_ty), mask=(cv < V) & (cv * 0 + t < L))
            else:
                tl.store(o + row_t * V + cv, o_t.to(o.dtype.element_ty))
            if ALL_STATES:
                tl.store(hs + row_t * K * V + tile, S, mask=tile * 0 + t < L)
    if not ALL_STATES:
        tl.store(hs + (i_b * H + i_h).to(tl.int64) * K * V + tile, S)


def launch_stream(q, k, v, g, beta, h0, o, hs, seq_info, *, scale: float, n_seq: int, heads: int, v_dim: int,
                  mode: int, all_states: bool, tile_v: int, num_warps: int) -> None:
    """The streaming kernel over (V / tile_v, n_seq x heads) programs; the token loop runs q.shape[1]
    (or the ragged length) steps."""
    verify_stream_kernel[(v_dim // tile_v, n_seq * heads)](
        q, k, v, g, beta, h0, o, hs, seq_info, scale, q.shape[1], H=heads, K=HEAD_DIM, V=v_dim, BV=tile_v,
        RAGGED=mode, ALL_STATES=all_states, num_warps=num_warps)


def launch_narrow(q, k, v, g, beta, h0, o, hs, seq_info, *, scale: float, n_seq: int, positions: int,
                  heads: int, v_dim: int, mode: int, all_states: bool, tile_v: int, num_warps: int) -> None:
    """The narrow kernel with T = `positions` compiled in, over (V / tile_v, n_seq x heads) programs."""
    verify_narrow_kernel[(v_dim // tile_v, n_seq * heads)](
        q, k, v, g, beta, h0, o, hs, seq_info, scale, T=positions, H=heads, K=HEAD_DIM, V=v_dim, BV=tile_v,
        RAGGED=mode, ALL_STATES=all_states, num_warps=num_warps)
