"""AttnRes + RMSNorm in one pass (seed section 3, "AttnRes mixes earlier layer-block outputs...").

Between two sublayers K3 does, per token:

    prefix <- bf16(prefix + delta)                      the running partial sum keeps its bf16 rounding
    sources = [block_0, ..., block_{n-1}, prefix]       completed block sums, then the partial
    logit_i = sum_d RMSNorm(V_i)[d] * res_norm_w[d] * res_proj_w[d]
    h = sum_i softmax(logit)_i V_i                      fp32
    out = RMSNorm(h) * next_norm_w                      the next sublayer's input norm
    at a block boundary: blocks[n] <- prefix; prefix <- 0

`before` is that sequence in plain PyTorch (a dozen kernels, every intermediate through memory).
`after` is one kernel launch: one Triton program per token reads every source once, takes the stored
blocks a group at a time as one tile with an online softmax between groups, keeps the fp32 mixture
in registers through the norm, and writes only the persistent updates and the normed output. How
many blocks per group, warps, and how the loads run ahead are chosen by `launch_config` from the
token count (a single all-blocks tile for small batches, a software-pipelined walk for large ones).
For a few tokens and many sources on a GPU with thread-block clusters (Hopper and later) it runs
the CUDA kernel of k3lab.ops.attn_res_cuda instead, one token's row over a cluster of 7 blocks,
when that kernel builds here (`kernel_status` says which kernel runs and why).
Both update `prefix` / `blocks` in place and return the normed output.
"""

from __future__ import annotations

import torch

from k3lab import env

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
        # A GPU's conversion instruction already rounds to nearest even (checked bit-exact on the H200).
        # Triton's interpreter (the CPU path) truncates bf16 casts and mis-rounds carries, so there
        # (INT_ROUND) bf16 is rounded with integer arithmetic.
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


# Launch configuration, chosen per call by `launch_config` (the rule and the H200 sweep behind it are
# documented there). Fields: group (blocks per tile step), num_warps, prefetch (the next group's loads
# issued before this group is reduced), w_reload (re-read the logit weight each step instead of
# keeping it in registers), stages (0: the loop over groups is unrolled; k > 0: a rolled loop that
# the compiler software-pipelines k deep through shared memory).
def launch_config(tokens: int, n_blocks: int, compute_units: int | None = None, cluster_pieces: int = 0) -> dict:
    """The kernel configuration for `tokens` tokens and `n_blocks` stored blocks: {"kernel":
    "cuda_cluster"} or {"kernel": "triton", and the Triton kernel's options}.

    cluster_pieces: blocks per row of the CUDA cluster kernel (ceil(hidden / 1024)) when it can run
    here, else 0. It is chosen when every block of every row gets an SM of its own (tokens x pieces
    <= compute units) and there are at least CLUSTER_MIN_BLOCKS stored blocks. Measured on the H200
    (hidden 7168, graph replay, records attn_res_t*_s*.cudacluster): 1 token, 9 sources 5.24 us vs
    6.16 us for tile8; 8 tokens, 9 sources 5.40 vs 6.27; 5 sources 5.04 vs 5.28; but 2 sources
    4.36 vs 3.48 (the cluster launch and its barriers cost ~0.9 us more than one program's work).

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
        compute_units = env.detect().compute_units or 1
    if cluster_pieces and n_blocks >= CLUSTER_MIN_BLOCKS and tokens * cluster_pieces <= compute_units:
        return {"kernel": "cuda_cluster"}
    all_blocks = 1 << max(n_blocks - 1, 0).bit_length()  # next power of two
    if tokens <= compute_units:
        return {"kernel": "triton", "group": all_blocks, "num_warps": 8, "prefetch": 1, "w_reload": 0, "stages": 0}
    if n_blocks >= 2:
        return {"kernel": "triton", "group": 1, "num_warps": 8, "prefetch": 0, "w_reload": 0, "stages": 3}
    return {"kernel": "triton", "group": 1, "num_warps": 4, "prefetch": 1, "w_reload": 0, "stages": 0}


CLUSTER_MIN_BLOCKS = 4  # 5+ sources: below that one Triton program is faster than a cluster (above)
KERNELS = ("triton", "cuda_cluster")


def kernel_status(prefix: torch.Tensor, delta: torch.Tensor | None = None, blocks: torch.Tensor | None = None
                  ) -> tuple[int, str]:
    """(cluster pieces per row, why): how many blocks per row the CUDA cluster kernel would use for
    these tensors (0 when it cannot run on them here: then `after` uses the Triton kernel, and `why`
    says why). The first call on a GPU builds kernels/attn_res_norm.cu (tens of seconds, then
    cached)."""
    from k3lab.ops import attn_res_cuda  # imports this module: imported here, not at the top

    return attn_res_cuda.cluster_pieces(prefix, delta, blocks)


def fold_mix_weight(res_norm_w, res_proj_w):
    """The AttnRes logit weight norm_w * proj_w as one fp32 vector: folded once when weights load."""
    return (res_norm_w.float() * res_proj_w.float()).contiguous()


def after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False,
          mix_weight=None, num_warps=None, prefetch=None, group=None, w_reload=None, stages=None, int_round=None,
          kernel=None):
    """One kernel launch for the whole step. Same arguments, effects and result as `before`;
    pass `mix_weight=fold_mix_weight(...)` (folded at load time) to keep the step at one launch.
    kernel: 'triton', 'cuda_cluster', or None (`launch_config` chooses; see `kernel_status`).
    num_warps / prefetch / group / w_reload / stages override `launch_config`'s choice of Triton
    options (for sweeps; they imply kernel='triton').
    int_round: round bf16 with integer arithmetic (default: only under Triton's interpreter, whose
    casts truncate; on a GPU the conversion instruction rounds to nearest even by itself)."""
    T, D = _check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block)
    if triton is None:
        raise RuntimeError("attn_res_norm.after needs Triton, which is not installed; use before()")
    for name, t in (("prefix", prefix), ("blocks", blocks)) + ((("delta", delta),) if delta is not None else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    if w_mix.shape != (D,) or w_mix.dtype != torch.float32:
        raise ValueError(f"mix_weight must be fp32 [D={D}], got {w_mix.dtype} {tuple(w_mix.shape)}")
    if kernel not in (None, *KERNELS):
        raise ValueError(f"kernel must be one of {KERNELS} or None, got {kernel!r}")
    options = (num_warps, prefetch, group, w_reload, stages)
    if kernel is None and any(o is not None for o in options):
        kernel = "triton"
    cfg = {}
    if kernel is None or (kernel == "triton" and None in options):
        pieces = kernel_status(prefix, delta, blocks)[0] if kernel is None and T > 0 else 0
        cfg = launch_config(T, n_blocks, cluster_pieces=pieces)
        kernel = cfg["kernel"]
    if kernel == "cuda_cluster":
        from k3lab.ops import attn_res_cuda

        return attn_res_cuda.cuda_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w,
                                        eps=eps, push_block=push_block, mix_weight=w_mix, mode="cluster")
    warps = int(cfg["num_warps"] if num_warps is None else num_warps)
    pf = int(cfg["prefetch"] if prefetch is None else prefetch)
    g = int(cfg["group"] if group is None else group)
    wr = int(cfg["w_reload"] if w_reload is None else w_reload)
    st = int(cfg["stages"] if stages is None else stages)
    if g < 1 or g & (g - 1):
        raise ValueError(f"group must be a power of two >= 1, got {group}")
    if pf not in (0, 1) or wr not in (0, 1):
        raise ValueError(f"prefetch and w_reload must be 0 or 1, got {prefetch}, {w_reload}")
    if st < 0:
        raise ValueError(f"stages must be >= 0 (0: unrolled loop), got {stages}")
    g = min(g, 1 << max(n_blocks - 1, 0).bit_length())  # no tile taller than the blocks in use
    out = torch.empty_like(prefix)
    if T == 0:
        return out
    _attn_res_norm_kernel[(T,)](
        prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous(),
        blocks.stride(0), 0, eps, D=D, N_BLOCKS=n_blocks, HAS_DELTA=delta is not None, PUSH=push_block,
        BLOCK_D=triton.next_power_of_2(D), GROUP=g, PREFETCH=pf, W_RELOAD=wr, STAGES=st,
        INT_ROUND=int(env.triton_interpreted() if int_round is None else bool(int_round)),
        num_warps=warps)
    return out


def attn_res_norm(*args, impl: str = "after", **kwargs):
    """Entry point: impl 'after' (fused Triton kernel) or 'before' (plain PyTorch sequence)."""
    if impl == "after":
        return after(*args, **kwargs)
    if impl == "before":
        return before(*args, **kwargs)
    raise ValueError(f"impl must be 'after' or 'before', got {impl!r}")
