"""AttnRes + RMSNorm in one pass (seed section 3, "AttnRes mixes earlier layer-block outputs...").

Between two sublayers K3 does, per token:

    prefix <- bf16(prefix + delta)                      the running partial sum keeps its bf16 rounding
    sources = [block_0, ..., block_{n-1}, prefix]       completed block sums, then the partial
    logit_i = sum_d RMSNorm(V_i)[d] * res_norm_w[d] * res_proj_w[d]
    h = sum_i softmax(logit)_i V_i                      fp32
    out = RMSNorm(h) * next_norm_w                      the next sublayer's input norm
    at a block boundary: blocks[n] <- prefix; prefix <- 0

`before` is that sequence in plain PyTorch (a dozen kernels, every intermediate through memory).
`after` is one Triton kernel: one program per token walks the sources once with an online softmax,
keeps the fp32 mixture in registers through the norm, and writes only the persistent updates and
the normed output. Both update `prefix` / `blocks` in place and return the normed output.
"""

from __future__ import annotations

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
    def _round_to(x, dtype: tl.constexpr):
        # Round to nearest even as torch does: the persistent residual must match it bit for bit.
        # bf16 is rounded with integer arithmetic, because Triton's interpreter (the CPU path)
        # truncates bf16 casts and mis-rounds carries; on a GPU this is a few integer ops.
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _attn_res_norm_kernel(prefix_ptr, delta_ptr, blocks_ptr, out_ptr, w_mix_ptr, w_next_ptr,
                              stride_block, eps, D: tl.constexpr, N_BLOCKS: tl.constexpr,
                              HAS_DELTA: tl.constexpr, PUSH: tl.constexpr, BLOCK_D: tl.constexpr,
                              PREFETCH: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        base = row.to(tl.int64) * D
        stride = stride_block.to(tl.int64)
        # the partial sum: add the delta and round to the storage dtype, as the persistent residual does
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(delta_ptr + base + cols, mask=mask, other=0.0).to(tl.float32))
            x = _round_to(x, prefix_ptr.dtype.element_ty)
        if PUSH:
            tl.store(blocks_ptr + N_BLOCKS * stride + base + cols, x, mask=mask)
            tl.store(prefix_ptr + base + cols, tl.zeros_like(x), mask=mask)
        elif HAS_DELTA:
            tl.store(prefix_ptr + base + cols, x, mask=mask)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # online softmax over the sources, the partial first, then each stored block, each read once
        h = x.to(tl.float32)
        m = tl.sum(h * w, axis=0) * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        s = 1.0
        # PREFETCH = how many blocks ahead loads are issued, so they are in flight while the current
        # block is reduced (0: load, then reduce, one block at a time)
        if PREFETCH >= 1:
            n1 = tl.load(blocks_ptr + base + cols, mask=mask, other=0.0)
        if PREFETCH >= 2 and N_BLOCKS > 1:
            n2 = tl.load(blocks_ptr + stride + base + cols, mask=mask, other=0.0)
        for i in tl.static_range(N_BLOCKS):  # 0..8 blocks: unrolled, one compile each
            if PREFETCH == 0:
                cur = tl.load(blocks_ptr + i * stride + base + cols, mask=mask, other=0.0)
            elif PREFETCH == 1:
                cur = n1
                if i + 1 < N_BLOCKS:
                    n1 = tl.load(blocks_ptr + (i + 1) * stride + base + cols, mask=mask, other=0.0)
            else:
                cur = n1
                if i + 1 < N_BLOCKS:
                    n1 = n2
                if i + 2 < N_BLOCKS:
                    n2 = tl.load(blocks_ptr + (i + 2) * stride + base + cols, mask=mask, other=0.0)
            v = cur.to(tl.float32)
            logit = tl.sum(v * w, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / D + eps)
            m_new = tl.maximum(m, logit)
            scale_old = tl.exp(m - m_new)
            p = tl.exp(logit - m_new)
            h = h * scale_old + p * v
            s = s * scale_old + p
            m = m_new
        h = h / s
        y = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        y = y * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols, _round_to(y, out_ptr.dtype.element_ty), mask=mask)


# Launch configuration: one program per token; warps per program and how many blocks ahead the
# loads run (0, 1 or 2). Chosen by the H200 sweep (profiles/nvidia-h200/copy_removal, the '.w'
# cases): 4 warps with one block of prefetch was best overall (8 warps is faster below ~64 tokens).
DEFAULT_NUM_WARPS = 4
DEFAULT_PREFETCH = 1


def fold_mix_weight(res_norm_w, res_proj_w):
    """The AttnRes logit weight norm_w * proj_w as one fp32 vector: folded once when weights load."""
    return (res_norm_w.float() * res_proj_w.float()).contiguous()


def after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False,
          mix_weight=None, num_warps=None, prefetch=None):
    """One Triton kernel for the whole step. Same arguments, effects and result as `before`;
    pass `mix_weight=fold_mix_weight(...)` (folded at load time) to keep the step at one launch."""
    T, D = _check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block)
    if triton is None:
        raise RuntimeError("attn_res_norm.after needs Triton, which is not installed; use before()")
    for name, t in (("prefix", prefix), ("blocks", blocks)) + ((("delta", delta),) if delta is not None else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    if w_mix.shape != (D,) or w_mix.dtype != torch.float32:
        raise ValueError(f"mix_weight must be fp32 [D={D}], got {w_mix.dtype} {tuple(w_mix.shape)}")
    out = torch.empty_like(prefix)
    block_d = triton.next_power_of_2(D)
    warps = num_warps or DEFAULT_NUM_WARPS
    _attn_res_norm_kernel[(T,)](
        prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous(),
        blocks.stride(0), eps, D=D, N_BLOCKS=n_blocks, HAS_DELTA=delta is not None, PUSH=push_block,
        BLOCK_D=block_d, PREFETCH=DEFAULT_PREFETCH if prefetch is None else int(prefetch), num_warps=warps)
    return out


def attn_res_norm(*args, impl: str = "after", **kwargs):
    """Entry point: impl 'after' (fused Triton kernel) or 'before' (plain PyTorch sequence)."""
    if impl == "after":
        return after(*args, **kwargs)
    if impl == "before":
        return before(*args, **kwargs)
    raise ValueError(f"impl must be 'after' or 'before', got {impl!r}")
