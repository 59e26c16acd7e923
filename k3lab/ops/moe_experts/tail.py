"""The latent MoE's tail: RMSNorm of the combined expert output, up_proj rows, added into an output.

    out[:, col0 : col0 + R] += rms_norm(y_lat, norm_w, eps) @ up_rows^T

y_lat [N, LAT] is the all-reduced latent (fp32); up_rows [R, LAT] are the rows of
routed_expert_up_proj this rank computes (all 7168 in the replicated tail, its 896 under TP8 in the
sharded one); out [N, H] (contiguous, up_rows' dtype) is the tensor they are added into (the shared
expert's output after its all-reduce for the replicated tail, this rank's not-yet-reduced shared
partial for the sharded one). The normed latent is rounded to up_rows' dtype before the product, as
the nn layer rounds it.

Two forms, the same for either tail, so that the replicated-vs-sharded ratio measures the rows:
  tail_triton  one Triton launch for the norm (`norm_rows`: a program per row, the normed latent
               written in up_rows' dtype), then one addmm_ (cuBLAS / hipBLASLt on a GPU) that adds
               the product into out's column slice in place: the slice is a strided view with unit
               column stride, which the BLAS call takes as its output with a leading dimension of H,
               so no copy of out is made and the add is one rounding.
               One row (decode at batch 1): a single launch instead (`_tail_row_kernel`): every
               program computes the row's RMS itself (the latent is 14 KB, read from the L2), normalizes
               and rounds each block of it as the norm kernel does, streams a block of up_rows' rows
               (one of ROW_BLOCKS) against it and adds its outputs into out's columns (fp32 sum, one
               rounding, as addmm_).
               At one row the BLAS call is a split-K GEMM (two kernels) and the norm a third: three
               launches for a 6 MB weight stream that one covers.
  tail_torch   the plain reference: nn.norms.rms_norm (several small kernels), matmul, add.
The norm kernel is checked against tail_torch (tests/test_moe_experts.py); its times are in the
decode_step records (profiles/<device>/decode_step/).
"""

from __future__ import annotations

import torch

from k3lab.nn.norms import rms_norm
from k3lab.ops import expect, positive_finite

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

NORM_BLOCK = 4096  # latent values a norm program loads at once (K3's 3584 in one block)
# (rows of up_rows, latent columns per step, warps) a one-row tail program may take: on a GPU
# `triton.autotune` picks among them per (R, LAT) on the first call (call once before capturing a
# graph; the autotuner restores out between its trials, as the kernel adds into it); the interpreter
# (tests) and the ISA report take them as given
ROW_BLOCKS = ((1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 8), (8, 512, 8), (1, 2048, 8),
              (2, 2048, 8))


def check_tail(y_lat, norm_w, up_rows, out, col0: int, eps=None) -> tuple[int, int, int]:
    """Validate the tail's inputs; returns (N, LAT, R). col0 an int (a bool is not a column), eps (when
    given) the rule every op's epsilon follows (`positive_finite`)."""
    for name, t, dims in (("y_lat", y_lat, 2), ("norm_w", norm_w, 1), ("up_rows", up_rows, 2),
                          ("out", out, 2)):
        expect(name, t, shape=dims, dtype="float")
    N, LAT = y_lat.shape
    R = up_rows.shape[0]
    if up_rows.shape[1] != LAT or norm_w.shape != (LAT,):
        raise ValueError(f"up_rows must be [R, LAT={LAT}] and norm_w [LAT], got {tuple(up_rows.shape)} and "
                         f"{tuple(norm_w.shape)}")
    if out.shape[0] != N or not (isinstance(col0, int) and not isinstance(col0, bool) and 0 <= col0
                                 and col0 + R <= out.shape[1]):
        raise ValueError(f"out must be [N={N}, H] with columns [col0, col0 + R={R}) inside it, got out "
                         f"{tuple(out.shape)} and col0={col0!r}")
    expect("out", out, dtype=up_rows.dtype, contiguous=True)  # up_rows' dtype: the tail adds in place
    if len({t.device for t in (y_lat, norm_w, up_rows, out)}) != 1:
        raise ValueError("y_lat, norm_w, up_rows and out must be on one device")
    if eps is not None:
        positive_finite("eps", eps)
    return N, LAT, R


def tail_torch(y_lat, norm_w, eps, up_rows, out, col0: int = 0) -> torch.Tensor:
    """Plain PyTorch (the reference); adds into out in place and returns it."""
    check_tail(y_lat, norm_w, up_rows, out, col0, eps)
    normed = rms_norm(y_lat, norm_w, eps, out_dtype=up_rows.dtype)
    out[:, col0:col0 + up_rows.shape[0]] += normed @ up_rows.t()
    return out


if triton is not None:
    from k3lab.ops.triton_math import launch_rows, rms_inv, rms_row, round_to

    @triton.jit
    def _norm_kernel(y_ptr, nw_ptr, o_ptr, eps, LAT: tl.constexpr, BLOCK: tl.constexpr):
        # one row: sum of squares in fp32, then y * rsqrt(mean + eps) * w cast to o's dtype
        row = tl.program_id(0).to(tl.int64)
        rms_row(y_ptr + row * LAT, nw_ptr, o_ptr + row * LAT, eps, LAT, BLOCK, False)


    @triton.jit
    def _tail_row_kernel(y_ptr, nw_ptr, up_ptr, out_ptr, eps, R, stride_up, LAT: tl.constexpr,
                         NORM_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         INT_ROUND: tl.constexpr):
        # out[r] += sum_k round(y[k] * inv * nw[k]) * up[r, k] for this program's BLOCK_N rows r
        inv = rms_inv(y_ptr, eps, LAT, NORM_BLOCK)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < R
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, LAT, BLOCK_K):
            kk = k0 + rk
            kmask = kk < LAT
            y = tl.load(y_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + kk, mask=kmask, other=0.0).to(tl.float32)
            x = round_to(y * inv * nw, up_ptr.dtype.element_ty, INT_ROUND).to(tl.float32)
            u = tl.load(up_ptr + rn[:, None].to(tl.int64) * stride_up + kk[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc += u.to(tl.float32) * x[None, :]
        o = tl.load(out_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn, round_to(o + tl.sum(acc, axis=1), out_ptr.dtype.element_ty, INT_ROUND),
                 mask=nmask)


if triton is not None:
    _tail_row_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in ROW_BLOCKS],
        key=["R", "LAT"], restore_value=["out_ptr"])(_tail_row_kernel)


def tail_row(y_lat, norm_w, eps, up_rows, out, col0: int = 0, blocks=None) -> torch.Tensor:
    """The one-row tail in one launch (module docstring) on checked inputs with N = 1; blocks: one of
    ROW_BLOCKS to run, None to let the autotuner choose on a GPU (the first of ROW_BLOCKS in the
    interpreter). Returns out."""
    R, LAT = up_rows.shape
    if up_rows.stride(1) != 1:
        up_rows = up_rows.contiguous()
    args = (y_lat.contiguous(), norm_w.contiguous(), up_rows, out.narrow(1, col0, R), float(eps), R,
            up_rows.stride(0))
    common = {"LAT": LAT, "NORM_BLOCK": min(NORM_BLOCK, triton.next_power_of_2(LAT)),
              "INT_ROUND": y_lat.device.type == "cpu"}
    launch_rows(_tail_row_tuned, _tail_row_kernel, lambda bn: triton.cdiv(R, bn), args, common, blocks=blocks,
                fallback=ROW_BLOCKS[0], tune=y_lat.device.type != "cpu")
    return out


def norm_rows(y_lat: torch.Tensor, norm_w: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """rms_norm(y_lat, norm_w, eps) in fp32, written as out_dtype [N, LAT]: one Triton launch (none
    for N = 0). Raises ValueError on bad shapes or a non-positive eps."""
    expect("y_lat", y_lat, shape=2, dtype="float")
    N, LAT = y_lat.shape
    expect("norm_w", norm_w, shape=(LAT,), dtype="float", device=y_lat.device, what=f"[LAT={LAT}]")
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    if triton is None:
        raise ValueError("norm_rows needs triton (not installed); use tail_torch")
    normed = torch.empty(N, LAT, dtype=out_dtype, device=y_lat.device)
    if N:
        block = min(NORM_BLOCK, triton.next_power_of_2(LAT))
        _norm_kernel[(N,)](y_lat.contiguous(), norm_w.contiguous(), normed, float(eps), LAT=LAT, BLOCK=block,
                           num_warps=4)
    return normed


def tail_triton(y_lat, norm_w, eps, up_rows, out, col0: int = 0) -> torch.Tensor:
    """The Triton norm, then the product added into out's columns by one in-place addmm_; one row:
    `tail_row`'s single launch. Returns out."""
    N, LAT, R = check_tail(y_lat, norm_w, up_rows, out, col0, eps)
    if N == 0:
        return out
    if N == 1:
        return tail_row(y_lat, norm_w, eps, up_rows, out, col0)
    normed = norm_rows(y_lat, norm_w, eps, up_rows.dtype)
    out[:, col0:col0 + R].addmm_(normed, up_rows.t())
    return out
