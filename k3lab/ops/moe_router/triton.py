"""The router's top-k and the expert sort as two Triton launches (decode-sized batches).

    launch 1 (_topk_kernel): one program per token: sigmoid, + bias, top-k, the weights
    launch 2 (_sort_kernel): one program: the counting sort of the N * k (token, slot) pairs by
                             expert, padded per expert to whole tiles (an inputs.ExpertSort)

Launch 1 packs each candidate into one int64 key, (order-preserving bits of score + bias, E_POW2 - 1 -
expert), so one max reduction per slot yields the best expert, the lowest index among equal scores.
Launch 2 walks the pairs twice in flat order, a block at a time: each pair's row is a per-expert cursor
plus its rank among the block's earlier pairs of that expert, and the block's last pair of each expert
moves the cursor. From zeroed cursors the first walk leaves the counts; the tile layout is their
cumulative sum; from each expert's first padded row the second walk stores the pairs, in flat (token,
slot) order within an expert, as the stable argsort of sort_by_expert gives. The cursors live in a
small global scratch, ordered by barriers (no histogram or register gather, whose lowerings vary across
Triton versions); every other store has its own address. One program is the right size while the
pairs are few (decode); `MAX_PAIRS` bounds them.

Checked against the torch path (tests/test_moe_router.py).
"""

from __future__ import annotations

import torch

from k3lab.ops.moe_experts.inputs import ExpertSort, check_block_m, max_tiles

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path still runs; the backend table says why this one does not
    triton = None

MAX_PAIRS = 2048  # N * top_k that launch 2's single program sorts (decode); a first bound, not measured
ROW_BLOCK = 256   # padding rows stored per step past the tiles in use

if triton is not None:

    @triton.jit
    def _topk_kernel(logits_ptr, stride_n, stride_e, bias_ptr, weights_ptr, idx_ptr, scaling,
                     E: tl.constexpr, E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                     HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, E_POW2)
        ok = cols < E
        row = logits_ptr + n * stride_n
        choice = tl.sigmoid(tl.load(row + cols * stride_e, mask=ok, other=0.0).to(tl.float32))
        if HAS_BIAS:
            choice += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        choice = tl.where(choice == choice, choice, float("-inf"))  # NaN: chosen last, still in range
        bits = choice.to(tl.int32, bitcast=True)
        order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # signed order = float order
        gone = tl.full([E_POW2], -(1 << 62), tl.int64)  # below every real key
        key = tl.where(ok, order * E_POW2 + (E_POW2 - 1 - cols), gone)
        slots = tl.arange(0, K_POW2)
        sel = tl.zeros([K_POW2], dtype=tl.int64)
        for j in range(TOP_K):
            best = tl.max(key, 0)
            e = E_POW2 - 1 - (best & (E_POW2 - 1))
            sel = tl.where(slots == j, e, sel)
            key = tl.where(cols == e, gone, key)
        real = slots < TOP_K
        s = tl.sigmoid(tl.load(row + sel * stride_e, mask=real, other=0.0).to(tl.float32))
        s = tl.where(real, s, 0.0)
        if RENORMALIZE:
            s = s / (tl.sum(s, 0) + 1e-20)
        tl.store(weights_ptr + n * TOP_K + slots, s * scaling, mask=real)
        tl.store(idx_ptr + n * TOP_K + slots, sel, mask=real)

    @triton.jit
    def _rank_pass(idx_ptr, cursor_ptr, pair_ptr, pairs, E: tl.constexpr, BLOCK_P: tl.constexpr,
                   WRITE_ROWS: tl.constexpr):
        # every pair in flat order: row = cursor[expert] + its rank among the block's earlier pairs of
        # that expert; the block's last pair of each expert moves the cursor past the block's pairs.
        # Run-time bounds are while loops: the interpreter cannot range() over them.
        offs = tl.arange(0, BLOCK_P)
        p0 = 0
        while p0 < pairs:
            p = p0 + offs
            real = p < pairs
            ex = tl.load(idx_ptr + p, mask=real, other=E).to(tl.int32)
            same = ex[:, None] == ex[None, :]
            rank = tl.sum((same & (offs[None, :] < offs[:, None])).to(tl.int32), 1)
            last = tl.sum((same & (offs[None, :] > offs[:, None])).to(tl.int32), 1) == 0
            row = tl.load(cursor_ptr + ex, mask=real, other=0) + rank
            tl.debug_barrier()  # every lane has read the cursors before any moves
            tl.store(cursor_ptr + ex, row + 1, mask=real & last)
            if WRITE_ROWS:
                tl.store(pair_ptr + row, p, mask=real)
            tl.debug_barrier()
            p0 += BLOCK_P

    @triton.jit
    def _sort_kernel(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, tiles,
                     E: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_R: tl.constexpr):
        bins = tl.arange(0, BINS)
        experts = bins < E
        tl.store(cursor_ptr + bins, tl.zeros([BINS], dtype=tl.int32), mask=experts)
        tl.debug_barrier()
        _rank_pass(idx_ptr, cursor_ptr, pair_ptr, pairs, E, BLOCK_P, False)  # pass 1: the counts
        counts = tl.load(cursor_ptr + bins, mask=experts, other=0)
        tiles_per = (counts + BLOCK_M - 1) // BLOCK_M
        tile_start = tl.cumsum(tiles_per, 0) - tiles_per
        n_tiles = tl.sum(tiles_per, 0)
        row0 = tile_start * BLOCK_M
        tl.debug_barrier()  # every lane has read the counts before the cursors restart
        tl.store(cursor_ptr + bins, row0, mask=experts)
        tl.store(counts_ptr + bins, counts.to(tl.int64), mask=experts)
        tl.store(n_tiles_ptr, n_tiles)
        most = tl.max(tiles_per, 0)
        r = 0
        while r < most:  # each expert names its tiles
            tl.store(tile_expert_ptr + tile_start + r, bins, mask=r < tiles_per)
            r += 1
        for j in range(0, BLOCK_M - 1):  # the padding rows that end each expert's last tile
            pad = row0 + counts + j
            tl.store(pair_ptr + pad, pairs, mask=pad < row0 + tiles_per * BLOCK_M)
        rows = tl.arange(0, BLOCK_R)
        q0 = n_tiles * BLOCK_M
        while q0 < tiles * BLOCK_M:  # the rows of the unused tiles
            tl.store(pair_ptr + q0 + rows, pairs, mask=q0 + rows < tiles * BLOCK_M)
            q0 += BLOCK_R
        t0 = n_tiles
        while t0 < tiles:  # the unused tiles: the last expert, as searchsorted gives
            tl.store(tile_expert_ptr + t0 + rows, E - 1, mask=t0 + rows < tiles)
            t0 += BLOCK_R
        tl.debug_barrier()
        _rank_pass(idx_ptr, cursor_ptr, pair_ptr, pairs, E, BLOCK_P, True)  # pass 2: each pair's row


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def topk_weights(logits, bias, top_k: int, scaling: float, renormalize: bool):
    """Launch 1 on checked inputs: (weights [N, top_k] fp32, idx [N, top_k] int64)."""
    N, E = logits.shape
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        _topk_kernel[(N,)](logits, logits.stride(0), logits.stride(1), logits if bias is None else bias,
                           weights, idx, float(scaling), E=E, E_POW2=_pow2(E), TOP_K=top_k,
                           K_POW2=_pow2(top_k), HAS_BIAS=bias is not None, RENORMALIZE=bool(renormalize),
                           num_warps=1)
    return weights, idx


def sort_block_cap(wave_width: int | None = None) -> int:
    """Pairs the sort compares with every expert bin at once: its [BLOCK_P, BINS] one-hot tile is
    BLOCK_P x 1024 values over the program's lanes. 128 on 32-lane devices (docs/decode_step.md);
    32 on 64-lane ones, where 128 spills 192 registers on gfx942 / gfx950 (the ISA report; not yet
    run on AMD hardware by this project). wave_width: read from the device when None."""
    from k3lab import env

    wave = wave_width if wave_width is not None else env.detect().wave_width
    return 32 if wave == 64 else 128


def sort_pairs(idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """Launch 2: the ExpertSort that inputs.sort_by_expert(idx, num_experts, block_m) builds, from
    idx [N, k] (int64 or int32, contiguous, values in [0, num_experts): the router's output, not read
    back) with N * k <= MAX_PAIRS. Sizes come from N, k, E and block_m alone (no read-back).
    ValueError on a bad argument, before the launch."""
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx must be an int32 or int64 [N, k] tensor, got "
                         f"{getattr(idx, 'dtype', type(idx))}")
    if not idx.is_contiguous():
        raise ValueError("idx must be contiguous (the router's output is)")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    check_block_m(block_m)
    if idx.numel() > MAX_PAIRS:
        raise ValueError(f"idx holds {idx.numel()} pairs, more than the single-program sort takes "
                         f"(MAX_PAIRS={MAX_PAIRS}); use inputs.sort_by_expert")
    P, dev = idx.numel(), idx.device
    T = max_tiles(P, num_experts, block_m)
    if P == 0:
        z = torch.zeros(1, dtype=torch.int32, device=dev)
        return ExpertSort(z[:0], z[:0], z, torch.zeros(num_experts, dtype=torch.int64, device=dev), block_m,
                          0, 0)
    pair_of_row = torch.empty(T * block_m, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(T, dtype=torch.int32, device=dev)
    n_tiles = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int64, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)  # scratch: one row cursor per expert
    block_p = min(sort_block_cap(), max(16, _pow2(P)))
    _sort_kernel[(1,)](idx, cursor, counts, pair_of_row, tile_expert, n_tiles, P, T, E=num_experts,
                       BINS=_pow2(num_experts), BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_R=ROW_BLOCK,
                       num_warps=8 if block_p > 64 else 4)
    return ExpertSort(pair_of_row, tile_expert, n_tiles, counts, block_m, T, P)
