"""The latent MoE's tail: RMSNorm of the combined expert output, up_proj rows, added into an output.

    out[:, col0 : col0 + R] += rms_norm(y_lat, norm_w, eps) @ up_rows^T

y_lat [N, LAT] is the all-reduced latent (fp32); up_rows [R, LAT] are the rows of
routed_expert_up_proj this rank computes (all 7168 in the replicated tail, its 896 under TP8 in the
sharded one); out [N, H] is the tensor they are added into (the shared expert's output after its
all-reduce for the replicated tail, this rank's not-yet-reduced shared partial for the sharded one).
The normed latent is rounded to up_rows' dtype before the product, as the nn layer rounds it.

Backends: `tail_torch` (norm, matmul, add: three kernels, the normed latent through memory) and
`tail_triton` (one launch: each program takes a block of rows and output columns, finds the rows'
norms from the fp32 latent, applies them while loading the latent tiles of the product, and adds
the result into out in place, one rounding). The Triton kernel is checked in the interpreter; not
yet run on a GPU.
"""

from __future__ import annotations

import torch

from k3lab.nn.norms import rms_norm

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def check_tail(y_lat, norm_w, up_rows, out, col0: int) -> tuple[int, int, int]:
    """Validate the tail's inputs; returns (N, LAT, R)."""
    for name, t, dims in (("y_lat", y_lat, 2), ("norm_w", norm_w, 1), ("up_rows", up_rows, 2), ("out", out, 2)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or not t.is_floating_point():
            raise ValueError(f"{name} must be a {dims}-D floating-point tensor, got {getattr(t, 'shape', t)}")
    N, LAT = y_lat.shape
    R = up_rows.shape[0]
    if up_rows.shape[1] != LAT or norm_w.shape != (LAT,):
        raise ValueError(f"up_rows must be [R, LAT={LAT}] and norm_w [LAT], got {tuple(up_rows.shape)} and "
                         f"{tuple(norm_w.shape)}")
    if out.shape[0] != N or not (isinstance(col0, int) and 0 <= col0 and col0 + R <= out.shape[1]):
        raise ValueError(f"out must be [N={N}, H] with columns [col0, col0 + R={R}) inside it, got out "
                         f"{tuple(out.shape)} and col0={col0!r}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (the tail adds into it in place)")
    if len({t.device for t in (y_lat, norm_w, up_rows, out)}) != 1:
        raise ValueError("y_lat, norm_w, up_rows and out must be on one device")
    return N, LAT, R


def tail_torch(y_lat, norm_w, eps, up_rows, out, col0: int = 0) -> torch.Tensor:
    """Plain PyTorch; adds into out in place and returns it."""
    check_tail(y_lat, norm_w, up_rows, out, col0)
    normed = rms_norm(y_lat, norm_w, eps, out_dtype=up_rows.dtype)
    out[:, col0:col0 + up_rows.shape[0]] += normed @ up_rows.t()
    return out


if triton is not None:

    @triton.jit
    def _tail_kernel(y_ptr, nw_ptr, w_ptr, out_ptr, N, eps, out_stride, col0, LAT: tl.constexpr,
                     R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < R
        ks = tl.arange(0, BLOCK_K)
        y_base = y_ptr + rows[:, None].to(tl.int64) * LAT
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, LAT, BLOCK_K):
            y = tl.load(y_base + k0 + ks[None, :], mask=row_ok[:, None] & ((k0 + ks) < LAT)[None, :], other=0.0)
            ss += tl.sum(y * y, axis=1)
        inv = 1.0 / tl.sqrt(ss / LAT + eps)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + cols[None, :].to(tl.int64) * LAT  # up_rows[col, k] read as [k, col]
        for k0 in range(0, LAT, BLOCK_K):
            k_ok = (k0 + ks) < LAT
            y = tl.load(y_base + k0 + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            nw = tl.load(nw_ptr + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = (y * inv[:, None] * nw[None, :]).to(w_ptr.dtype.element_ty)
            b = tl.load(w_base + k0 + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
        o_ptrs = out_ptr + rows[:, None].to(tl.int64) * out_stride + col0 + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_ptrs, (o + acc).to(out_ptr.dtype.element_ty), mask=mask)


def tail_blocks(n_tokens: int) -> dict:
    """Row and column blocks: 16-row tiles up to 64 tokens (more programs streaming up_proj, which
    is what decode pays for), 64-row tiles beyond; 16 output columns per program."""
    return {"BLOCK_M": 16 if n_tokens <= 64 else 64, "BLOCK_N": 16 if n_tokens <= 64 else 64, "BLOCK_K": 128,
            "num_warps": 4}


def tail_triton(y_lat, norm_w, eps, up_rows, out, col0: int = 0) -> torch.Tensor:
    """One Triton launch; adds into out in place and returns it. y_lat is read as fp32."""
    N, LAT, R = check_tail(y_lat, norm_w, up_rows, out, col0)
    if triton is None:
        raise ValueError("the triton tail needs triton (not installed); use tail_torch")
    if N == 0:
        return out
    y = y_lat.float().contiguous()
    cfg = tail_blocks(N)
    grid = (triton.cdiv(N, cfg["BLOCK_M"]), triton.cdiv(R, cfg["BLOCK_N"]))
    _tail_kernel[grid](y, norm_w.contiguous(), up_rows.contiguous(), out, N, float(eps), out.stride(0), col0,
                       LAT=LAT, R=R, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                       num_warps=cfg["num_warps"])
    return out
