"""AttnRes + RMSNorm in one pass (seed section 3, "AttnRes mixes earlier layer-block outputs...").

Between two sublayers K3 does, per token:

    prefix <- bf16(prefix + delta)                      the running partial sum keeps its bf16 rounding
    sources = [block_0, ..., block_{n-1}, prefix]       completed block sums, then the partial
    logit_i = sum_d RMSNorm(V_i)[d] * res_norm_w[d] * res_proj_w[d]
    h = sum_i softmax(logit)_i V_i                      fp32
    out = RMSNorm(h) * next_norm_w                      the next sublayer's input norm
    at a block boundary: blocks[n] <- prefix; prefix <- 0

`before` is that sequence in plain PyTorch (a dozen kernels, every intermediate through memory).
`after` is one Triton kernel: one program per token reads every source once, takes the stored
blocks a group at a time as one tile with an online softmax between groups, keeps the fp32 mixture
in registers through the norm, and writes only the persistent updates and the normed output. How
many blocks per group, warps, and how the loads run ahead are chosen by `launch_config` from the
token count (a single all-blocks tile for small batches, a software-pipelined walk for large ones).
Both update `prefix` / `blocks` in place and return the normed output.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain PyTorch path still works; `after` says what is missing
    triton = None


def _check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block):
    if prefix.dim() != 2:
        raise ValueError(f"prefix must be [T, D], got shape {tuple(prefix.shape)}")
    T, D = prefix.shape
    if delta is not None and delta.shape != prefix.shape:
        raise ValueError(f"delta must match prefix [T={T}, D={D}], got {tuple(delta.shape)}")
    if blocks.dim() != 3 or blocks.shape[1:] != (T, D):
        raise ValueError(f"blocks must be [max_blocks, T={T}, D={D}], got {tuple(blocks.shape)}")
    if blocks.dtype != prefix.dtype:
        raise ValueError(f"blocks must have prefix's dtype {prefix.dtype}, got {blocks.dtype}")
    if not 0 <= n_blocks <= blocks.shape[0] - (1 if push_block else 0):
        raise ValueError(f"n_blocks must be in [0, {blocks.shape[0] - (1 if push_block else 0)}] for "
                         f"{blocks.shape[0]} block slots (push_block={push_block}), got {n_blocks}")
    for name, w in (("res_norm_w", res_norm_w), ("res_proj_w", res_proj_w), ("next_norm_w", next_norm_w)):
        if w.shape != (D,):
            raise ValueError(f"{name} must be [D={D}], got {tuple(w.shape)}")
    return T, D


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def before(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False):
    """The unfused sequence in plain PyTorch (the seed's "before"). Updates prefix/blocks in place."""
    _check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block)
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    sources = torch.cat([blocks[:n_blocks], prefix.unsqueeze(0)]).float()  # [S, T, D]
    w = res_norm_w.float() * res_proj_w.float()
    logits = (_rms(sources, eps) * w).sum(-1)  # [S, T]
    p = torch.softmax(logits, dim=0)
    h = (p.unsqueeze(-1) * sources).sum(0)
    out = (_rms(h, eps) * next_norm_w.float()).to(prefix.dtype)
    if push_block:
        blocks[n_blocks].copy_(prefix)
        prefix.zero_()
    return out


if triton is not None:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr, INT_ROUND: tl.constexpr):
        # Round to nearest even as torch does: the persistent residual must match it bit for bit.
        # A GPU's conversion instruction already rounds to nearest even. Triton's interpreter (the
        # CPU path) truncates bf16 casts and mis-rounds carries, so there (INT_ROUND) bf16 is rounded
        # with integer arithmetic, which costs ~10% more instructions at one token on the H200.
        if INT_ROUND and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _widen(x):
        # bf16 -> fp32 spelled as the bit shift it is. The mix widens the group a second time this way
        # so the compiler does not merge it with the logits' widening and keep an fp32 copy of the
        # whole group live across the reduction (twice the registers of the bf16 group).
        if x.dtype == tl.bfloat16:
            return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            return x.to(tl.float32)

    @triton.jit
    def _mix_group(cur, valid, w, h, m, s, eps, D: tl.constexpr):
        # one online-softmax step over a [GROUP, BLOCK_D] tile of blocks (padding rows: valid=False)
        v = cur.to(tl.float32)
        dot = tl.sum(v * w[None, :], axis=1)
        ss = tl.sum(v * v, axis=1)
        logits = tl.where(valid, dot * tl.rsqrt(ss / D + eps), float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=0))
        scale_old = tl.exp(m - m_new)
        p = tl.exp(logits - m_new)  # 0 on padding rows
        h = h * scale_old + tl.sum(p[:, None] * _widen(cur), axis=0)
        s = s * scale_old + tl.sum(p, axis=0)
        return h, m_new, s

    @triton.jit
    def _update_partial(x, dx, prefix_ptr, blocks_ptr, base, cols, mask, push_offset,
                        HAS_DELTA: tl.constexpr, PUSH: tl.constexpr, INT_ROUND: tl.constexpr):
        # the partial sum: add the delta and round to the storage dtype, as the persistent residual
        # does; at a block boundary it becomes the next stored block and the partial restarts at 0
        if HAS_DELTA:
            x = _round_to(x.to(tl.float32) + dx.to(tl.float32), prefix_ptr.dtype.element_ty, INT_ROUND)
        if PUSH:
            tl.store(blocks_ptr + push_offset + base + cols, x, mask=mask)
            tl.store(prefix_ptr + base + cols, tl.zeros_like(x), mask=mask)
        elif HAS_DELTA:
            tl.store(prefix_ptr + base + cols, x, mask=mask)
        return x

    @triton.jit(do_not_specialize=["w_step"])  # w_step must stay a run-time value (see W_RELOAD)
    def _attn_res_norm_kernel(prefix_ptr, delta_ptr, blocks_ptr, out_ptr, w_mix_ptr, w_next_ptr,
                              stride_block, w_step, eps, D: tl.constexpr, N_BLOCKS: tl.constexpr,
                              HAS_DELTA: tl.constexpr, PUSH: tl.constexpr, BLOCK_D: tl.constexpr,
                              GROUP: tl.constexpr, PREFETCH: tl.constexpr, W_RELOAD: tl.constexpr,
                              STAGES: tl.constexpr, INT_ROUND: tl.constexpr):
        # One program per token. The stored blocks are taken GROUP at a time as one [GROUP, BLOCK_D]
        # tile: the group's loads are all in flight together, its logits come from one reduction, and
        # an online softmax carries the mixture from group to group. GROUP = all blocks (rounded up to
        # a power of two) is a single step: every load of the token in one round trip (small T, where
        # a chain of per-block load -> reduce trips is the whole cost). GROUP = 1 walks the blocks one
        # at a time, the least registers (large T, where occupancy keeps HBM busy).
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        base = row.to(tl.int64) * D
        stride = stride_block.to(tl.int64)
        N_GROUPS: tl.constexpr = (N_BLOCKS + GROUP - 1) // GROUP
        g_rows = tl.arange(0, GROUP)
        g_ptrs = blocks_ptr + g_rows[:, None].to(tl.int64) * stride + base + cols[None, :]
        # every load that does not depend on a reduction comes before the first one in program order:
        # a reduction ends in a barrier, and no load after it starts before it (the compiler may still
        # hold some of these back under register pressure)
        if PREFETCH and STAGES == 0 and N_GROUPS > 0:
            nxt = tl.load(g_ptrs, mask=(g_rows < N_BLOCKS)[:, None] & mask[None, :], other=0.0)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0)
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            dx = tl.load(delta_ptr + base + cols, mask=mask, other=0.0)
        # online softmax over the sources: the partial first, then the blocks group by group. (The
        # partial last, so that its arithmetic need not wait ahead of the block loads, was measured
        # and was no faster: records attn_res_t1_s*.tile8x.)
        x = _update_partial(x, dx if HAS_DELTA else x, prefix_ptr, blocks_ptr, base, cols, mask,
                            N_BLOCKS * stride, HAS_DELTA, PUSH, INT_ROUND)
        h = x.to(tl.float32)
        m = tl.sum(h * w, axis=0) * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        s = m * 0.0 + 1.0
        if STAGES == 0:
            for g in tl.static_range(N_GROUPS):  # at most 8 groups: unrolled, one compile per shape
                valid = (g * GROUP + g_rows) < N_BLOCKS
                if PREFETCH:
                    cur = nxt
                    if g + 1 < N_GROUPS:  # the next group's loads fly while this one is reduced
                        nxt = tl.load(g_ptrs + (g + 1) * GROUP * stride,
                                      mask=(((g + 1) * GROUP + g_rows) < N_BLOCKS)[:, None] & mask[None, :],
                                      other=0.0)
                else:
                    cur = tl.load(g_ptrs + g * GROUP * stride, mask=valid[:, None] & mask[None, :], other=0.0)
                if W_RELOAD:  # re-read the weight (cache-hot) instead of keeping it live across the loop;
                    # w_step is 0 at run time, unknown to the compiler, which would otherwise merge the reads
                    w = tl.load(w_mix_ptr + g * w_step + cols, mask=mask, other=0.0)
                h, m, s = _mix_group(cur, valid, w, h, m, s, eps, D)
        else:
            # a loop the compiler keeps rolled and software-pipelines: STAGES groups' loads run ahead
            # through shared memory (asynchronous copies), so the loads in flight cost no registers
            for g in tl.range(0, N_GROUPS, num_stages=STAGES):
                valid = (g * GROUP + g_rows) < N_BLOCKS
                cur = tl.load(g_ptrs + g * GROUP * stride, mask=valid[:, None] & mask[None, :], other=0.0)
                if W_RELOAD:
                    w = tl.load(w_mix_ptr + g * w_step + cols, mask=mask, other=0.0)
                h, m, s = _mix_group(cur, valid, w, h, m, s, eps, D)
        h = h * (1.0 / s)
        y = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        y = y * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols, _round_to(y, out_ptr.dtype.element_ty, INT_ROUND), mask=mask)


    @triton.jit
    def _piece_in(prefix_ptr, delta_ptr, blocks_ptr, w_mix_ptr, base, stride, OFF: tl.constexpr,
                  W: tl.constexpr, D: tl.constexpr, NBP: tl.constexpr, N_BLOCKS: tl.constexpr,
                  HAS_DELTA: tl.constexpr):
        # one piece [OFF, OFF + W) of the row: every stored block's columns as one [NBP, W] tile
        cols = OFF + tl.arange(0, W)
        mask = cols < D
        rows = tl.arange(0, NBP)
        tile = tl.load(blocks_ptr + rows[:, None].to(tl.int64) * stride + base + cols[None, :],
                       mask=(rows < N_BLOCKS)[:, None] & mask[None, :], other=0.0)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0)
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        dx = x
        if HAS_DELTA:
            dx = tl.load(delta_ptr + base + cols, mask=mask, other=0.0)
        return cols, mask, tile, w, x, dx

    @triton.jit
    def _piece_stats(tile, x, w):
        # partial logit sums of one piece: blocks' (w . v, v . v) per row, then the partial's
        v = tile.to(tl.float32)
        xf = x.to(tl.float32)
        return (tl.sum(v * w[None, :], axis=1), tl.sum(v * v, axis=1),
                tl.sum(xf * w, axis=0), tl.sum(xf * xf, axis=0))

    @triton.jit
    def _piece_mix(tile, x, pb, px, WIDEN_ONCE: tl.constexpr):
        # WIDEN_ONCE=0 widens the tile again (see _widen) so no fp32 copy stays live across the softmax
        v = tile.to(tl.float32) if WIDEN_ONCE else _widen(tile)
        return px * x.to(tl.float32) + tl.sum(pb[:, None] * v, axis=0)

    @triton.jit
    def _piece_out(out_ptr, w_next_ptr, base, cols, mask, y, INT_ROUND: tl.constexpr):
        y = y * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols, _round_to(y, out_ptr.dtype.element_ty, INT_ROUND), mask=mask)

    @triton.jit
    def _attn_res_norm_split_kernel(prefix_ptr, delta_ptr, blocks_ptr, out_ptr, w_mix_ptr, w_next_ptr,
                                    stride_block, eps, D: tl.constexpr, N_BLOCKS: tl.constexpr,
                                    HAS_DELTA: tl.constexpr, PUSH: tl.constexpr, NBP: tl.constexpr,
                                    W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                                    INT_ROUND: tl.constexpr, WIDEN_ONCE: tl.constexpr):
        # The small-batch kernel: one program per token, every stored block loaded in one step (as the
        # GROUP = all-blocks tile of the kernel above), but the row taken as up to three power-of-two
        # pieces (7168 = 4096 + 2048 + 1024) instead of one 8192-wide tile. At one token a single SM
        # issues every instruction of the step, and an 8192-wide tile spends 1/8 of them on masked
        # lanes. The softmax is exact (all logits before any mixing), not online.
        row = tl.program_id(0)
        base = row.to(tl.int64) * D
        stride = stride_block.to(tl.int64)
        push_off = N_BLOCKS * stride
        # all loads first: none waits on a reduction
        c0, m0, t0, w0, x0, d0 = _piece_in(prefix_ptr, delta_ptr, blocks_ptr, w_mix_ptr, base, stride,
                                           0, W0, D, NBP, N_BLOCKS, HAS_DELTA)
        if W1 > 0:
            c1, m1, t1, w1, x1, d1 = _piece_in(prefix_ptr, delta_ptr, blocks_ptr, w_mix_ptr, base, stride,
                                               W0, W1, D, NBP, N_BLOCKS, HAS_DELTA)
        if W2 > 0:
            c2, m2, t2, w2, x2, d2 = _piece_in(prefix_ptr, delta_ptr, blocks_ptr, w_mix_ptr, base, stride,
                                               W0 + W1, W2, D, NBP, N_BLOCKS, HAS_DELTA)
        x0 = _update_partial(x0, d0, prefix_ptr, blocks_ptr, base, c0, m0, push_off, HAS_DELTA, PUSH, INT_ROUND)
        db, sb, dx, sx = _piece_stats(t0, x0, w0)
        if W1 > 0:
            x1 = _update_partial(x1, d1, prefix_ptr, blocks_ptr, base, c1, m1, push_off, HAS_DELTA, PUSH,
                                 INT_ROUND)
            a, b, c, d = _piece_stats(t1, x1, w1)
            db, sb, dx, sx = db + a, sb + b, dx + c, sx + d
        if W2 > 0:
            x2 = _update_partial(x2, d2, prefix_ptr, blocks_ptr, base, c2, m2, push_off, HAS_DELTA, PUSH,
                                 INT_ROUND)
            a, b, c, d = _piece_stats(t2, x2, w2)
            db, sb, dx, sx = db + a, sb + b, dx + c, sx + d
        rows = tl.arange(0, NBP)
        lb = tl.where(rows < N_BLOCKS, db * tl.rsqrt(sb / D + eps), float("-inf"))
        lx = dx * tl.rsqrt(sx / D + eps)
        m = tl.maximum(tl.max(lb, axis=0), lx)
        pb = tl.exp(lb - m)  # 0 on padding rows
        px = tl.exp(lx - m)
        inv = 1.0 / (tl.sum(pb, axis=0) + px)
        pb = pb * inv
        px = px * inv
        h0 = _piece_mix(t0, x0, pb, px, WIDEN_ONCE)
        hh = tl.sum(h0 * h0, axis=0)
        if W1 > 0:
            h1 = _piece_mix(t1, x1, pb, px, WIDEN_ONCE)
            hh += tl.sum(h1 * h1, axis=0)
        if W2 > 0:
            h2 = _piece_mix(t2, x2, pb, px, WIDEN_ONCE)
            hh += tl.sum(h2 * h2, axis=0)
        r = tl.rsqrt(hh / D + eps)
        _piece_out(out_ptr, w_next_ptr, base, c0, m0, h0 * r, INT_ROUND)
        if W1 > 0:
            _piece_out(out_ptr, w_next_ptr, base, c1, m1, h1 * r, INT_ROUND)
        if W2 > 0:
            _piece_out(out_ptr, w_next_ptr, base, c2, m2, h2 * r, INT_ROUND)


    @triton.jit
    def _attn_res_norm_spread_kernel(prefix_ptr, delta_ptr, blocks_ptr, out_ptr, w_mix_ptr, w_next_ptr,
                                     part_ptr, epoch_ptr, stride_block, eps, max_polls,
                                     D: tl.constexpr, N_BLOCKS: tl.constexpr, HAS_DELTA: tl.constexpr,
                                     PUSH: tl.constexpr, NS: tl.constexpr, CHUNK: tl.constexpr,
                                     P: tl.constexpr, P_POW2: tl.constexpr, INT_ROUND: tl.constexpr,
                                     EXACT_DOT: tl.constexpr):
        # A few tokens: each token's row is spread over P programs (P units instead of one), CHUNK
        # columns each. What a program needs from the other columns is small: every source's w . v
        # and the Gram matrix G_ij = v_i . v_j of the sources (the partial is source N_BLOCKS). From
        # G come each source's RMS (its diagonal) and the mixture's norm, |h|^2 = p^T G p, so one
        # exchange of these partial sums through memory is all the step needs; each program then
        # mixes and writes its own columns.
        row = tl.program_id(0)
        piece = tl.program_id(1)
        cols = piece * CHUNK + tl.arange(0, CHUNK)
        mask = cols < D
        base = row.to(tl.int64) * D
        stride = stride_block.to(tl.int64)
        src = tl.arange(0, NS)
        tile = tl.load(blocks_ptr + src[:, None].to(tl.int64) * stride + base + cols[None, :],
                       mask=(src < N_BLOCKS)[:, None] & mask[None, :], other=0.0)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0)
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        dx = x
        if HAS_DELTA:
            dx = tl.load(delta_ptr + base + cols, mask=mask, other=0.0)
        # this call's epoch: one more than what every program of the row published last call
        slots = epoch_ptr + row * P_POW2
        epoch = tl.atomic_add(slots + piece, 0) + 1
        x = _update_partial(x, dx, prefix_ptr, blocks_ptr, base, cols, mask, N_BLOCKS * stride, HAS_DELTA, PUSH,
                            INT_ROUND)
        vs = tl.where((src == N_BLOCKS)[:, None], x[None, :], tile)  # the sources, in the storage dtype
        if EXACT_DOT:  # fp32 storage, or Triton's interpreter (whose bf16 dot is wrong): plain fp32 FMAs
            vf = vs.to(tl.float32)
            gram = tl.dot(vf, tl.trans(vf), input_precision="ieee")
        else:  # bf16/fp16 products are exact in the fp32 accumulator: the matrix units do it
            gram = tl.dot(vs, tl.trans(vs))
        v = vs.to(tl.float32)
        wdot = tl.sum(v * w[None, :], axis=1)
        stride_p = NS * NS + NS
        mine = part_ptr + (row * P + piece).to(tl.int64) * stride_p
        tl.store(mine + src[:, None] * NS + src[None, :], gram)
        tl.store(mine + NS * NS + src, wdot)
        # publish (release: the partial sums are visible before the epoch), then wait until every
        # program of the row has published this epoch (bounded: a broken launch fails a check
        # instead of hanging the GPU)
        tl.debug_barrier()
        tl.atomic_xchg(slots + piece, epoch, sem="release")
        pr = tl.arange(0, P_POW2)
        seen = tl.atomic_add(slots + pr, 0, mask=pr < P, sem="acquire")
        polls = 0
        while (tl.sum(((seen != epoch) & (pr < P)).to(tl.int32), axis=0) > 0) & (polls < max_polls):
            seen = tl.atomic_add(slots + pr, 0, mask=pr < P, sem="acquire")
            polls += 1
        everyone = part_ptr + (row * P).to(tl.int64) * stride_p
        g3 = tl.load(everyone + pr[:, None, None] * stride_p + src[None, :, None] * NS + src[None, None, :],
                     mask=(pr < P)[:, None, None], other=0.0, cache_modifier=".cg")
        gram = tl.sum(g3, axis=0)
        wdot = tl.sum(tl.load(everyone + pr[:, None] * stride_p + NS * NS + src[None, :],
                              mask=(pr < P)[:, None], other=0.0, cache_modifier=".cg"), axis=0)
        ss = tl.sum(tl.where(src[:, None] == src[None, :], gram, 0.0), axis=1)
        logits = tl.where(src <= N_BLOCKS, wdot * tl.rsqrt(ss / D + eps), float("-inf"))
        e = tl.exp(logits - tl.max(logits, axis=0))  # 0 on padding rows
        p = e / tl.sum(e, axis=0)
        hh = tl.sum(tl.sum(p[:, None] * gram * p[None, :], axis=1), axis=0)
        h = tl.sum(p[:, None] * v, axis=0)
        y = h * tl.rsqrt(hh / D + eps) * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols, _round_to(y, out_ptr.dtype.element_ty, INT_ROUND), mask=mask)


SPREAD_MAX_PROGRAMS = 16
_EPOCHS: dict = {}  # device -> int32 epoch slots [token, program] of the spread kernel, kept across calls


def _epoch_slots(device, tokens: int) -> torch.Tensor:
    """The spread kernel's epoch slots for `tokens` tokens on `device`, made once (zeros) and reused, so
    graph replays need no reset launch. One stream at a time may use the spread kernel per device."""
    have = _EPOCHS.get(device)
    if have is None or have.numel() < tokens * SPREAD_MAX_PROGRAMS:
        have = torch.zeros(max(tokens, 256) * SPREAD_MAX_PROGRAMS, dtype=torch.int32, device=device)
        _EPOCHS[device] = have
    return have


def row_pieces(d: int) -> tuple[int, int, int]:
    """The row of width d as up to three power-of-two pieces, largest first, zeros for absent ones;
    only the last piece can have masked lanes (7168 -> (4096, 2048, 1024); 100 -> (64, 32, 4))."""
    if d < 1:
        raise ValueError(f"d must be >= 1, got {d}")
    pieces, rest = [], d
    while rest and len(pieces) < 2:
        p = 1 << (rest.bit_length() - 1)
        pieces.append(p)
        rest -= p
    if rest:
        pieces.append(1 << (rest - 1).bit_length())
    return tuple(pieces + [0] * (3 - len(pieces)))


# Launch configuration, chosen per call by `launch_config` (the rule and the H200 sweep behind it are
# documented there). Fields: group (blocks per tile step), num_warps, prefetch (the next group's loads
# issued before this group is reduced), w_reload (re-read the logit weight each step instead of
# keeping it in registers), stages (0: the loop over groups is unrolled; k > 0: a rolled loop that
# the compiler software-pipelines k deep through shared memory).
def launch_config(tokens: int, n_blocks: int, compute_units: int | None = None) -> dict:
    """The kernel configuration for `tokens` tokens and `n_blocks` stored blocks.

    The rule, from the H200 sweep (profiles/nvidia-h200/copy_removal/attn_res_t*_s*.<variant>, hidden
    7168, graph replay; the variants are copy_removal.ATTN_RES_VARIANTS):
    - tokens <= compute units: one program per token and at most one per unit, so one SM does all
      of a token's work with nothing beside it: the step is bound by latency and by that SM's
      instruction issue. Every stored block is loaded as one tile in a single step ("tile8": group
      = all blocks, 8 warps). 1 token, 9 sources: 6.1 us vs 7.9 us walking the blocks with 8 warps
      and 9.3 us for the previous kernel. 16 and 32 warps were slower (6.6, 9.0 us): the work per
      SM is the same (about 2,750 instructions per thread at 8 warps for 9 sources, in the compiled
      code), more warps only add cross-warp reduction, and 32 spill registers.
    - more tokens, 2+ stored blocks: bandwidth-bound. One block at a time in a rolled loop that the
      compiler software-pipelines 3 deep through shared memory ("pipe8s3"): the loads in flight
      cost no registers, 128 registers per thread leave room for two programs of 8 warps per unit.
      8192 tokens, 9 sources: 382 us, 87% of the floor (the previous kernel: 487 us, 68%); 5 sources
      260 us, 85%; 3 sources 202 us, 82% (walk4: 216 us). Also best at 512 tokens.
    - more tokens, 0-1 stored blocks: a loop of one step has nothing to pipeline; the block is
      prefetched in registers with 4 warps ("walk4"): 8192 tokens, 2 sources: 160 us, 86% (pipe8s3:
      195 us).
    The switch at one token per unit follows from the reasoning above; the sweep brackets it (tile8
    best at 64 tokens, pipe8s3 at 512) but did not time the tokens in between. On AMD GPUs the same
    rule applies untuned (not yet run on AMD hardware by this project).
    compute_units: the device's SM/CU count (read from the device when None).
    """
    if compute_units is None:
        from k3lab import env
        compute_units = env.detect().compute_units or 1
    all_blocks = 1 << max(n_blocks - 1, 0).bit_length()  # next power of two
    if tokens <= SPREAD_MAX_TOKENS:
        return dict(SPREAD_CONFIG)
    if tokens <= compute_units:
        return dict(SMALL_BATCH_CONFIG, group=all_blocks)
    if n_blocks >= 2:
        return {"group": 1, "num_warps": 8, "prefetch": 0, "w_reload": 0, "stages": 3, "split": 0, "widen_once": 0,
                "spread": 0}
    return {"group": 1, "num_warps": 4, "prefetch": 1, "w_reload": 0, "stages": 0, "split": 0, "widen_once": 0,
            "spread": 0}


# The small-batch choice (tokens <= compute units): split = 1 runs _attn_res_norm_split_kernel (the row
# as power-of-two pieces, all blocks in one step), split = 0 the all-blocks tile of the main kernel.
SMALL_BATCH_CONFIG = {"group": 8, "num_warps": 8, "prefetch": 1, "w_reload": 0, "stages": 0, "split": 0,
                      "widen_once": 0, "spread": 0}
# Up to SPREAD_MAX_TOKENS tokens, each token's row is spread over several programs (spread = columns
# per program; _attn_res_norm_spread_kernel).
SPREAD_MAX_TOKENS = 0
SPREAD_CONFIG = {"group": 8, "num_warps": 4, "prefetch": 1, "w_reload": 0, "stages": 0, "split": 0,
                 "widen_once": 0, "spread": 1024}


def fold_mix_weight(res_norm_w, res_proj_w):
    """The AttnRes logit weight norm_w * proj_w as one fp32 vector: folded once when weights load."""
    return (res_norm_w.float() * res_proj_w.float()).contiguous()


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


_CONFIG_KEYS = ("num_warps", "prefetch", "group", "w_reload", "stages", "split", "widen_once", "spread")


def after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False,
          mix_weight=None, int_round=None, **config):
    """One Triton kernel for the whole step. Same arguments, effects and result as `before`;
    pass `mix_weight=fold_mix_weight(...)` (folded at load time) to keep the step at one launch.
    config: num_warps / prefetch / group / w_reload / stages / split / widen_once override
    `launch_config`'s choice (for sweeps). int_round: round bf16 with integer arithmetic (default:
    only under Triton's interpreter, whose casts truncate; a GPU's conversion rounds to nearest even)."""
    T, D = _check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block)
    if triton is None:
        raise RuntimeError("attn_res_norm.after needs Triton, which is not installed; use before()")
    unknown = set(config) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown launch options {sorted(unknown)}; expected some of {_CONFIG_KEYS}")
    for name, t in (("prefix", prefix), ("blocks", blocks)) + ((("delta", delta),) if delta is not None else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    if w_mix.shape != (D,) or w_mix.dtype != torch.float32:
        raise ValueError(f"mix_weight must be fp32 [D={D}], got {w_mix.dtype} {tuple(w_mix.shape)}")
    given = {k: v for k, v in config.items() if v is not None}
    cfg = {**(launch_config(T, n_blocks) if len(given) < len(_CONFIG_KEYS) else {}), **given}
    warps, pf, g, wr, st, split, once = (int(cfg[k]) for k in
                                         ("num_warps", "prefetch", "group", "w_reload", "stages", "split",
                                          "widen_once"))
    spread = int(cfg.get("spread", 0))
    if spread and (spread < 16 or spread & (spread - 1)):
        raise ValueError(f"spread must be 0 or a power of two >= 16 (columns per program), got {spread}")
    if g < 1 or g & (g - 1):
        raise ValueError(f"group must be a power of two >= 1, got {g}")
    for name, v in (("prefetch", pf), ("w_reload", wr), ("split", split), ("widen_once", once)):
        if v not in (0, 1):
            raise ValueError(f"{name} must be 0 or 1, got {v}")
    if st < 0:
        raise ValueError(f"stages must be >= 0 (0: unrolled loop), got {st}")
    exact = int(_interpreted() if int_round is None else bool(int_round))
    all_blocks = 1 << max(n_blocks - 1, 0).bit_length()
    g = min(g, all_blocks)  # no tile taller than the blocks in use
    out = torch.empty_like(prefix)
    if T == 0:
        return out
    common = (prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous())
    if spread:
        n_prog = -(-D // spread)
        if n_prog > 1 and _interpreted():
            raise ValueError(f"spread={spread} puts {n_prog} programs on each row, and they wait for each other; "
                             f"Triton's interpreter runs programs one after another: use spread >= D={D} there")
        if n_prog > SPREAD_MAX_PROGRAMS:
            raise ValueError(f"spread={spread} needs {n_prog} programs per row for D={D}; at most "
                             f"{SPREAD_MAX_PROGRAMS}: use wider pieces")
        ns = max(16, 1 << n_blocks.bit_length())  # the sources (blocks + the partial), padded for tl.dot
        part = torch.empty(T * n_prog * (ns * ns + ns), dtype=torch.float32, device=prefix.device)
        p_pow2 = 1 << (n_prog - 1).bit_length()
        _attn_res_norm_spread_kernel[(T, n_prog)](
            *common, part, _epoch_slots(prefix.device, T), blocks.stride(0),
            eps, 1 << 22, D=D, N_BLOCKS=n_blocks, HAS_DELTA=delta is not None, PUSH=push_block, NS=ns,
            CHUNK=spread, P=n_prog, P_POW2=p_pow2, INT_ROUND=exact,
            EXACT_DOT=int(_interpreted() or prefix.dtype == torch.float32), num_warps=warps)
        return out
    if split:
        w0, w1, w2 = row_pieces(D)
        _attn_res_norm_split_kernel[(T,)](
            *common, blocks.stride(0), eps, D=D, N_BLOCKS=n_blocks, HAS_DELTA=delta is not None,
            PUSH=push_block, NBP=all_blocks, W0=w0, W1=w1, W2=w2, INT_ROUND=exact, WIDEN_ONCE=once,
            num_warps=warps)
        return out
    _attn_res_norm_kernel[(T,)](
        *common, blocks.stride(0), 0, eps, D=D, N_BLOCKS=n_blocks, HAS_DELTA=delta is not None, PUSH=push_block,
        BLOCK_D=triton.next_power_of_2(D), GROUP=g, PREFETCH=pf, W_RELOAD=wr, STAGES=st, INT_ROUND=exact,
        num_warps=warps)
    return out


def attn_res_norm(*args, impl: str = "after", **kwargs):
    """Entry point: impl 'after' (fused Triton kernel) or 'before' (plain PyTorch sequence)."""
    if impl == "after":
        return after(*args, **kwargs)
    if impl == "before":
        return before(*args, **kwargs)
    raise ValueError(f"impl must be 'after' or 'before', got {impl!r}")
