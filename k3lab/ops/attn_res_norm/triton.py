"""The fused AttnRes + RMSNorm step as one Triton program per token (GPU, or Triton's interpreter on
CPU): every source read once, the stored blocks taken a group at a time with an online softmax
between groups, the fp32 mixture kept in registers through the norm."""

from __future__ import annotations

import torch

from k3lab import env

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain PyTorch path still works; k3lab.ops.triton_status says what is missing
    triton = None



if triton is not None:
    from k3lab.ops.triton_math import round_to

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
            x = round_to(x.to(tl.float32) + dx.to(tl.float32), prefix_ptr.dtype.element_ty, INT_ROUND)
        if PUSH or HAS_DELTA:
            # every warp has read the partial before any warp overwrites it: a row narrower than the
            # program's threads is held by several warps at once, and without this barrier a warp
            # that loads late reads the zeros (or the sum) another warp already stored (the loop that
            # found it: profiles/nvidia-h200/gpu_check/attn_res_race_*.json)
            tl.debug_barrier()
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
        # online softmax over the sources: the partial first, then the blocks group by group
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
        tl.store(out_ptr + base + cols, round_to(y, out_ptr.dtype.element_ty, INT_ROUND), mask=mask)


def launch(prefix, delta, blocks, n_blocks, w_mix, next_norm_w, eps, push_block, cfg: dict,
           int_round=None) -> torch.Tensor:
    """One launch of T programs with `cfg` (a Triton `launch_config`); returns the normed output.
    int_round: round bf16 with integer arithmetic (default: only under Triton's interpreter, whose
    casts truncate; on a GPU the conversion instruction rounds to nearest even by itself)."""
    T, D = prefix.shape
    out = torch.empty_like(prefix)
    if T == 0:
        return out
    # no tile taller than the blocks in use
    g = min(int(cfg["group"]), 1 << max(n_blocks - 1, 0).bit_length())
    _attn_res_norm_kernel[(T,)](
        prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous(),
        blocks.stride(0), 0, eps, D=D, N_BLOCKS=n_blocks, HAS_DELTA=delta is not None, PUSH=push_block,
        BLOCK_D=triton.next_power_of_2(D), GROUP=g, PREFETCH=int(cfg["prefetch"]),
        W_RELOAD=int(cfg["w_reload"]),
        STAGES=int(cfg["stages"]),
        INT_ROUND=int(env.triton_interpreted() if int_round is None else bool(int_round)),
        num_warps=int(cfg["num_warps"]))
    return out
