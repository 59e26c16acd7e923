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
                              stride_block, eps, D: tl.constexpr, N_BLOCKS: tl.constexpr, NB_PAD: tl.constexpr,
                              HAS_DELTA: tl.constexpr, PUSH: tl.constexpr, BLOCK_D: tl.constexpr,
                              CHUNK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        base = row.to(tl.int64) * D
        # the partial sum: add the delta and round to the storage dtype, as the persistent residual does
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        if HAS_DELTA:
            x = (x.to(tl.float32) + tl.load(delta_ptr + base + cols, mask=mask, other=0.0).to(tl.float32))
            x = _round_to(x, prefix_ptr.dtype.element_ty)
        if PUSH:
            tl.store(blocks_ptr + N_BLOCKS * stride_block.to(tl.int64) + base + cols, x, mask=mask)
            tl.store(prefix_ptr + base + cols, tl.zeros_like(x), mask=mask)
        elif HAS_DELTA:
            tl.store(prefix_ptr + base + cols, x, mask=mask)
        xf = x.to(tl.float32)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0)
        logit_x = tl.sum(xf * w, axis=0) * tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        h = xf
        if N_BLOCKS > 0:
            # Pass 1, the logits of the stored blocks: each step loads one column chunk of *every*
            # block at once, so all of them are in flight together (a source-by-source walk waits
            # for one load and one reduction per source: latency-bound for a single token).
            rows = tl.arange(0, NB_PAD)
            rmask = rows < N_BLOCKS
            rbase = blocks_ptr + rows[:, None].to(tl.int64) * stride_block + base
            dot = tl.zeros([NB_PAD], dtype=tl.float32)
            ss = tl.zeros([NB_PAD], dtype=tl.float32)
            for c0 in tl.static_range(0, D, CHUNK):
                ccols = c0 + tl.arange(0, CHUNK)
                cmask = ccols < D
                v = tl.load(rbase + ccols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
                v = v.to(tl.float32)
                wc = tl.load(w_mix_ptr + ccols, mask=cmask, other=0.0)
                dot += tl.sum(v * wc[None, :], axis=1)
                ss += tl.sum(v * v, axis=1)
            logits = tl.where(rmask, dot * tl.rsqrt(ss / D + eps), float("-inf"))
            m = tl.maximum(tl.max(logits, axis=0), logit_x)
            p_blocks = tl.exp(logits - m)  # 0 for the padding rows
            p_x = tl.exp(logit_x - m)
            total = tl.sum(p_blocks, axis=0) + p_x
            # Pass 2, the mix: the weights are known, so the block loads have no reduction between
            # them (they come back from L2, where pass 1 just brought them).
            h = xf * p_x
            for i in tl.static_range(N_BLOCKS):
                p_i = tl.sum(tl.where(rows == i, p_blocks, 0.0), axis=0)
                v = tl.load(blocks_ptr + i * stride_block.to(tl.int64) + base + cols, mask=mask, other=0.0)
                h += p_i * v.to(tl.float32)
            h = h / total
        y = h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)
        y = y * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + base + cols, _round_to(y, out_ptr.dtype.element_ty), mask=mask)


# columns of every stored block loaded per step of the logit pass: 8 blocks x 512 columns keeps
# 16 KiB in flight per program without crowding the registers that hold the row
CHUNK_COLUMNS = 512


def _num_warps(block_d: int) -> int:
    # about 16 values per thread keeps the fp32 mixture, one source and the weights in registers
    threads = max(32, block_d // 16)
    return max(1, min(16, threads // 32))


def fold_mix_weight(res_norm_w, res_proj_w):
    """The AttnRes logit weight norm_w * proj_w as one fp32 vector: folded once when weights load."""
    return (res_norm_w.float() * res_proj_w.float()).contiguous()


def after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False,
          mix_weight=None):
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
    _attn_res_norm_kernel[(T,)](
        prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous(),
        blocks.stride(0), eps, D=D, N_BLOCKS=n_blocks, NB_PAD=max(2, triton.next_power_of_2(max(n_blocks, 1))),
        HAS_DELTA=delta is not None, PUSH=push_block, BLOCK_D=block_d, CHUNK=min(block_d, CHUNK_COLUMNS),
        num_warps=_num_warps(block_d))
    return out


def attn_res_norm(*args, impl: str = "after", **kwargs):
    """Entry point: impl 'after' (fused Triton kernel) or 'before' (plain PyTorch sequence)."""
    if impl == "after":
        return after(*args, **kwargs)
    if impl == "before":
        return before(*args, **kwargs)
    raise ValueError(f"impl must be 'after' or 'before', got {impl!r}")
