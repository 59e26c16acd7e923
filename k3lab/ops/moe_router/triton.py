"""The router's top-k and the expert sort in Triton: one launch at decode sizes, two beyond.

    one launch  (_route_sort_kernel, `route_sort`): one program: the top-k of every token, then the sort
    two launches (`topk_weights`, `sort_pairs`):    _topk_kernel, one program per token; then
                                                    _sort_kernel, one program: the sort

Top-k. Each candidate is one int64 key, (order-preserving bits of score + bias, E_POW2 - 1 - expert):
keys are distinct, and descending key order is descending score with the lowest expert index first
among equal scores (a NaN score is made -inf: chosen last, its index still in range). `tl.topk`, a
bitonic top-k network over the row, gives the K_POW2 largest keys in descending order, the expert in
their low bits: a fixed set of compare-and-swap rounds that every lane works on at once (about 40 for
16 of 1,024), where one max reduction per chosen slot would be top_k reductions in a row, each a
chain across every lane. Rows go ROWS at a time ([ROWS, E_POW2]).

Sort (an inputs.ExpertSort). First every row is padding (`pairs`), every tile the last expert (what
searchsorted gives past the tiles in use), then one barrier, then the pairs:
  - pairs that fit one block (P <= the block, `sort_block_cap`): all in registers from the [P, P]
    comparison of the pairs' experts: each pair's rank among the earlier pairs of its expert, its
    expert's count, and the tiles of the chosen experts below its own (summed over each expert's first
    pair). Then the stores; no scratch, nothing per expert bin but zeroing the counts.
  - more pairs: the pairs are walked twice in flat order, a block at a time: each pair's row is a
    per-expert cursor plus its rank among the block's earlier pairs of that expert, and the block's
    last pair of each expert moves the cursor. From zeroed cursors the first walk leaves the counts;
    the tile layout is their cumulative sum; from each expert's first padded row the second walk
    stores the pairs. The cursors live in a small global scratch, ordered by barriers (no histogram or
    register gather, whose lowerings vary across Triton versions).
Either way a pair's row is its expert's first padded row plus its flat-order rank within the expert,
as the stable argsort of sort_by_expert gives. In the one launch the sort reads the chosen experts
back from `idx` after a barrier (global stores of a program are visible to all its lanes after one).

Bounds: `MAX_PAIRS` pairs for either form (one program sorts); `FUSED_PAIRS`, the most pairs
route_and_sort sends to the one launch, whose single program walks the tokens' top-k ROWS at a time
(beyond it the per-token programs of the two launches work in parallel). Both are first bounds, not
measured; the glue records of the decode_step study time both forms (docs/decode_step.md).

Checked against the torch path (tests/test_moe_router.py).
"""

from __future__ import annotations

import torch

from k3lab.ops.moe_experts.inputs import ExpertSort, check_block_m, max_tiles

from k3lab.ops import expect, int_arg

from .inputs import check_router

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path still runs; the backend table says why this one does not
    triton = None

MAX_PAIRS = 2048   # N * top_k that one program sorts (decode); a first bound, not measured
FUSED_PAIRS = 32   # N * top_k that route_and_sort routes and sorts in one launch (2 tokens at top-16)
FUSED_ROWS = 2     # tokens the one launch takes through the top-k at once
ROW_BLOCK = 1024   # rows (or tiles) the padding fill stores per step
TOPK_LANES = 256   # lanes of a top-k program for the bitonic network over 1,024 keys: 8 warps of 32

if triton is not None:

    @triton.jit
    def _topk_rows(logits_ptr, stride_n, stride_e, bias_ptr, weights_ptr, idx_ptr, scaling, n0, n_tokens,
                   E: tl.constexpr, E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                   ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
        # tokens n0 .. n0 + ROWS - 1 (those < n_tokens): sigmoid, + bias, top-k, weights, stored
        rows = n0 + tl.arange(0, ROWS).to(tl.int64)
        live = rows < n_tokens
        cols = tl.arange(0, E_POW2)
        ok = live[:, None] & (cols < E)[None, :]
        row = logits_ptr + rows[:, None] * stride_n
        choice = tl.sigmoid(tl.load(row + cols[None, :] * stride_e, mask=ok, other=0.0).to(tl.float32))
        if HAS_BIAS:
            choice += tl.load(bias_ptr + cols, mask=cols < E, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(choice == choice, choice, float("-inf"))  # NaN: chosen last, still in range
        bits = choice.to(tl.int32, bitcast=True)
        order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # signed order = float order
        gone = tl.full([ROWS, E_POW2], -(1 << 62), tl.int64)  # below every real key
        key = tl.where(ok, order * E_POW2 + (E_POW2 - 1 - cols)[None, :], gone)
        top = tl.topk(key, K_POW2)  # [ROWS, K_POW2], descending
        sel = E_POW2 - 1 - (top & (E_POW2 - 1))
        slots = tl.arange(0, K_POW2)
        real = live[:, None] & (slots < TOP_K)[None, :]
        s = tl.sigmoid(tl.load(row + sel * stride_e, mask=real, other=0.0).to(tl.float32))
        s = tl.where(real, s, 0.0)
        if RENORMALIZE:
            s = s / (tl.sum(s, 1) + 1e-20)[:, None]
        out = rows[:, None] * TOP_K + slots[None, :]
        tl.store(weights_ptr + out, s * scaling, mask=real)
        tl.store(idx_ptr + out, sel, mask=real)

    @triton.jit
    def _topk_kernel(logits_ptr, stride_n, stride_e, bias_ptr, weights_ptr, idx_ptr, scaling, n_tokens,
                     E: tl.constexpr, E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                     HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
        _topk_rows(logits_ptr, stride_n, stride_e, bias_ptr, weights_ptr, idx_ptr, scaling,
                   tl.program_id(0), n_tokens, E, E_POW2, TOP_K, K_POW2, 1, HAS_BIAS, RENORMALIZE)

    @triton.jit
    def _sort_prepare(cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, pairs, tiles, E: tl.constexpr,
                      BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      ONE_BLOCK: tl.constexpr):
        # what the sort overwrites after a barrier: padding rows, unused tiles, zero counts or cursors
        offs = tl.arange(0, BLOCK_R)
        q0 = 0
        while q0 < tiles * BLOCK_M:  # run-time bounds are while loops: the interpreter cannot range() them
            tl.store(pair_ptr + q0 + offs, pairs, mask=q0 + offs < tiles * BLOCK_M)
            q0 += BLOCK_R
        t0 = 0
        while t0 < tiles:
            tl.store(tile_expert_ptr + t0 + offs, E - 1, mask=t0 + offs < tiles)
            t0 += BLOCK_R
        bins = tl.arange(0, BINS)
        if ONE_BLOCK:
            tl.store(counts_ptr + bins, tl.zeros([BINS], dtype=tl.int64), mask=bins < E)
        else:
            tl.store(cursor_ptr + bins, tl.zeros([BINS], dtype=tl.int32), mask=bins < E)

    @triton.jit
    def _sort_one_block(idx_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, E: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
        # every pair at once (pairs <= BLOCK_P); the caller's fills are behind a barrier
        p = tl.arange(0, BLOCK_P)
        real = p < pairs
        ex = tl.load(idx_ptr + p, mask=real, other=E).to(tl.int32)
        same = (ex[:, None] == ex[None, :]) & real[None, :]
        count = tl.sum(same.to(tl.int32), 1)
        rank = tl.sum((same & (p[None, :] < p[:, None])).to(tl.int32), 1)
        first = real & (rank == 0)  # one pair stands for each chosen expert
        tiles_of = tl.where(first, (count + BLOCK_M - 1) // BLOCK_M, 0)
        start = tl.sum(tl.where(ex[None, :] < ex[:, None], tiles_of[None, :], 0), 1)  # tiles of lower experts
        tl.store(pair_ptr + start * BLOCK_M + rank, p, mask=real)
        tl.store(counts_ptr + ex, count.to(tl.int64), mask=first)
        tl.store(n_tiles_ptr, tl.sum(tiles_of, 0))
        most = tl.max(tiles_of, 0)
        r = 0
        while r < most:  # each chosen expert names its tiles
            tl.store(tile_expert_ptr + start + r, ex, mask=r < tiles_of)
            r += 1

    @triton.jit
    def _rank_pass(idx_ptr, cursor_ptr, pair_ptr, pairs, E: tl.constexpr, BLOCK_P: tl.constexpr,
                   WRITE_ROWS: tl.constexpr):
        # every pair in flat order: row = cursor[expert] + its rank among the block's earlier pairs of
        # that expert; the block's last pair of each expert moves the cursor past the block's pairs.
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
    def _sort_blocks(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs,
                     E: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
        # the pairs a block at a time through the cursors (zeroed by the caller, behind a barrier)
        bins = tl.arange(0, BINS)
        experts = bins < E
        _rank_pass(idx_ptr, cursor_ptr, pair_ptr, pairs, E, BLOCK_P, False)  # pass 1: the counts
        counts = tl.load(cursor_ptr + bins, mask=experts, other=0)
        tiles_per = (counts + BLOCK_M - 1) // BLOCK_M
        tile_start = tl.cumsum(tiles_per, 0) - tiles_per
        tl.debug_barrier()  # every lane has read the counts before the cursors restart
        tl.store(cursor_ptr + bins, tile_start * BLOCK_M, mask=experts)
        tl.store(counts_ptr + bins, counts.to(tl.int64), mask=experts)
        tl.store(n_tiles_ptr, tl.sum(tiles_per, 0))
        most = tl.max(tiles_per, 0)
        r = 0
        while r < most:  # each expert names its tiles
            tl.store(tile_expert_ptr + tile_start + r, bins, mask=r < tiles_per)
            r += 1
        tl.debug_barrier()
        _rank_pass(idx_ptr, cursor_ptr, pair_ptr, pairs, E, BLOCK_P, True)  # pass 2: each pair's row

    @triton.jit
    def _sort_pairs_of(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs,
                       E: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                       ONE_BLOCK: tl.constexpr):
        if ONE_BLOCK:
            _sort_one_block(idx_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, E, BLOCK_M,
                            BLOCK_P)
        else:
            _sort_blocks(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, E,
                         BINS, BLOCK_M, BLOCK_P)

    @triton.jit
    def _sort_kernel(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, tiles,
                     E: tl.constexpr, BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_R: tl.constexpr, ONE_BLOCK: tl.constexpr):
        _sort_prepare(cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, pairs, tiles, E, BINS, BLOCK_M,
                      BLOCK_R, ONE_BLOCK)
        tl.debug_barrier()
        _sort_pairs_of(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, E,
                       BINS, BLOCK_M, BLOCK_P, ONE_BLOCK)

    @triton.jit
    def _route_sort_kernel(logits_ptr, stride_n, stride_e, bias_ptr, weights_ptr, idx_ptr, scaling, n_tokens,
                           cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, tiles,
                           E: tl.constexpr, E_POW2: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                           ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                           BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_R: tl.constexpr, ONE_BLOCK: tl.constexpr):
        _sort_prepare(cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, pairs, tiles, E, BINS, BLOCK_M,
                      BLOCK_R, ONE_BLOCK)
        n0 = 0
        while n0 < n_tokens:
            _topk_rows(logits_ptr, stride_n, stride_e, bias_ptr, weights_ptr, idx_ptr, scaling, n0, n_tokens,
                       E, E_POW2, TOP_K, K_POW2, ROWS, HAS_BIAS, RENORMALIZE)
            n0 += ROWS
        tl.debug_barrier()  # idx and the fills are in place for every lane
        _sort_pairs_of(idx_ptr, cursor_ptr, counts_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr, pairs, E,
                       BINS, BLOCK_M, BLOCK_P, ONE_BLOCK)


def _pow2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def sort_block_cap(wave_width: int | None = None) -> int:
    """Pairs the sort compares with each other at once: its [BLOCK_P, BLOCK_P] comparison tile over the
    program's lanes. 128 on 32-lane devices (docs/decode_step.md); 32 on 64-lane ones, where 128
    spills on gfx942 / gfx950 (the ISA report; not yet run on AMD hardware by this project). Up to
    this many pairs the sort is one block, in registers. wave_width: read from the device when None."""
    from k3lab import env

    wave = wave_width if wave_width is not None else env.detect().wave_width
    return 32 if wave == 64 else 128


def default_topk_warps(wave_width: int | None = None) -> int:
    """Warps of a top-k program: TOPK_LANES lanes, 8 warps on 32-lane devices (the H200's fastest of 4, 8
    and 16: the glue records) and 4 on 64-lane ones, where 8 spill registers on gfx942 / gfx950 under
    Triton 3.9 (the ISA report; not yet run on AMD hardware by this project). wave_width: read from the
    device when None."""
    from k3lab import env

    wave = wave_width if wave_width is not None else env.detect().wave_width
    return TOPK_LANES // (wave or 32)


def _topk_meta(logits, bias, top_k: int, renormalize: bool) -> dict:
    E = logits.shape[1]
    # K_POW2 >= 2 where the row has 2: tl.topk of one key from one row would reduce to a scalar
    return dict(E=E, E_POW2=_pow2(E), TOP_K=top_k, K_POW2=min(max(_pow2(top_k), 2), _pow2(E)),
                HAS_BIAS=bias is not None, RENORMALIZE=bool(renormalize))


def _sort_buffers(P: int, num_experts: int, block_m: int, dev) -> tuple[ExpertSort, torch.Tensor, dict]:
    """(the ExpertSort to fill, the cursor scratch, the sort's constexprs and warps) for P > 0 pairs."""
    T = max_tiles(P, num_experts, block_m)
    block_p = min(sort_block_cap(), max(16, _pow2(P)))
    one_block = P <= block_p
    i32 = dict(dtype=torch.int32, device=dev)
    sort = ExpertSort(torch.empty(T * block_m, **i32), torch.empty(T, **i32), torch.empty(1, **i32),
                      torch.empty(num_experts, dtype=torch.int64, device=dev), block_m, T, P)
    cursor = sort.counts if one_block else torch.empty(num_experts, **i32)  # scratch (unused in one block)
    meta = dict(E=num_experts, BINS=_pow2(num_experts), BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_R=ROW_BLOCK,
                ONE_BLOCK=one_block, num_warps=8 if block_p > 64 else 4)
    return sort, cursor, meta


def _empty_sort(num_experts: int, block_m: int, dev) -> ExpertSort:
    z = torch.zeros(1, dtype=torch.int32, device=dev)
    return ExpertSort(z[:0], z[:0], z, torch.zeros(num_experts, dtype=torch.int64, device=dev), block_m, 0, 0)


def _sort_args(sort: ExpertSort, cursor: torch.Tensor) -> tuple:
    return (cursor, sort.counts, sort.pair_of_row, sort.tile_expert, sort.n_tiles, sort.pairs, sort.max_tiles)


def topk_weights(logits, bias, top_k: int, scaling: float, renormalize: bool, topk_warps: int | None = None):
    """The first of the two launches: (weights [N, top_k] fp32, idx [N, top_k] int64), after
    `check_router`'s checks. topk_warps: a top-k program's warps (`default_topk_warps()` when None; the
    glue bench tries others)."""
    check_router(logits, bias, top_k, scaling, renormalize)
    return launch_topk_weights(logits, bias, int(top_k), scaling, renormalize, topk_warps)


def launch_topk_weights(logits, bias, top_k: int, scaling: float, renormalize: bool,
                        topk_warps: int | None = None):
    """`topk_weights` on inputs `check_router` has passed (route_and_sort's path: no second check)."""
    N, _ = logits.shape
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N:
        _topk_kernel[(N,)](logits, logits.stride(0), logits.stride(1), logits if bias is None else bias,
                           weights, idx, float(scaling), N, **_topk_meta(logits, bias, top_k, renormalize),
                           num_warps=topk_warps or default_topk_warps())
    return weights, idx


def sort_pairs(idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """The second of the two launches: the ExpertSort that inputs.sort_by_expert(idx, num_experts,
    block_m) builds, from idx [N, k] (int64 or int32, contiguous, values in [0, num_experts): the
    router's output, not read back) with N * k <= MAX_PAIRS. Sizes come from N, k, E and block_m alone
    (no read-back). ValueError on a bad argument, before the launch."""
    expect("idx", idx, shape=2, dtype=(torch.int32, torch.int64), contiguous=True, what="[N, k]")
    num_experts = int_arg("num_experts", num_experts, low=1, what="a positive integer")
    check_block_m(block_m)
    if idx.numel() > MAX_PAIRS:
        raise ValueError(f"idx holds {idx.numel()} pairs, more than the single-program sort takes "
                         f"(MAX_PAIRS={MAX_PAIRS}); use inputs.sort_by_expert")
    if idx.numel() == 0:
        return _empty_sort(num_experts, block_m, idx.device)
    sort, cursor, meta = _sort_buffers(idx.numel(), num_experts, block_m, idx.device)
    _sort_kernel[(1,)](idx, *_sort_args(sort, cursor), **meta)
    return sort


def route_sort(logits, bias, top_k: int, scaling: float, renormalize: bool, block_m: int,
               topk_warps: int | None = None):
    """The one launch with N * top_k <= MAX_PAIRS, after `check_router`'s checks: (weights [N, top_k]
    fp32, idx [N, top_k] int64, ExpertSort), the same as topk_weights followed by sort_pairs.
    route_and_sort takes it up to FUSED_PAIRS pairs; any N within MAX_PAIRS runs (tests, the glue bench).
    Its warps: the more of `topk_warps` (`default_topk_warps()` when None) and the sort's."""
    check_router(logits, bias, top_k, scaling, renormalize, block_m=block_m)
    return launch_route_sort(logits, bias, int(top_k), scaling, renormalize, block_m, topk_warps)


def launch_route_sort(logits, bias, top_k: int, scaling: float, renormalize: bool, block_m: int,
                      topk_warps: int | None = None):
    """`route_sort` on inputs `check_router` has passed (route_and_sort's path: no second check)."""
    N, E = logits.shape
    if N * top_k > MAX_PAIRS:
        raise ValueError(f"logits: N={N} tokens x top_k={top_k} is more pairs than one program sorts "
                         f"(MAX_PAIRS={MAX_PAIRS})")
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    idx = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    if N == 0:
        return weights, idx, _empty_sort(E, block_m, logits.device)
    sort, cursor, meta = _sort_buffers(N * top_k, E, block_m, logits.device)
    meta |= _topk_meta(logits, bias, top_k, renormalize)
    meta["num_warps"] = max(meta["num_warps"], topk_warps or default_topk_warps())
    _route_sort_kernel[(1,)](logits, logits.stride(0), logits.stride(1), logits if bias is None else bias,
                             weights, idx, float(scaling), N, *_sort_args(sort, cursor),
                             ROWS=min(_pow2(N), FUSED_ROWS), **meta)
    return weights, idx, sort
