"""The ladder of notebook 02 (MoE output sharding): adding a product into one rank's column slice of an
output, then the one-token tail kernel itself (`k3lab.ops.moe_experts.tail`'s row kernel, simplified).

    column_add   out[:, col0 : col0 + R] += y: 2-D offsets with a row stride and a column offset
    tail_row     one token: out[col0 + r] += sum_k RMSNorm(lat)[k] * up_rows[r, k], a program per block
                 of up_rows' rows, the latent's norm recomputed by every program, K walked in blocks

Graded in fp64 against plain PyTorch: the slice add, and `k3lab.nn.norms.rms_norm` with the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.nn.norms import rms_norm
from k3lab.workshop._core import Case

from ._grade import Puzzle

NB = "02_moe_sharding"
EPS = 1e-5


# ------------------------------------------------------------------------------------ column_add
@triton.jit
def _column_add(out_ptr, y_ptr, H, R, col0, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = r < R
    y = tl.load(y_ptr + row * R + r, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + row * H + col0 + r
    cur = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (cur + y).to(out_ptr.dtype.element_ty), mask=mask)


def column_add(kernel, out, y, col0):
    """out [N, H] (contiguous; changed in place and returned) gets y [N, R] added into its columns
    col0 ... col0 + R - 1: a program per (row, block of 32 columns of y)."""
    N, R = y.shape
    BLOCK = 32
    kernel[(N, triton.cdiv(R, BLOCK))](out, y.contiguous(), out.shape[1], R, col0, BLOCK=BLOCK)
    return out


COLUMN_ADD_STUB = '''\
@triton.jit
def column_add_kernel(out_ptr, y_ptr, H, R, col0, BLOCK: tl.constexpr):
    row = tl.program_id(0)                     # one token (row of out and of y) ...
    r = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)   # ... and BLOCK of y's R columns
    mask = r < R
    y = tl.load(y_ptr + row * R + r, mask=mask, other=0.0).to(tl.float32)
    # TODO 1: the addresses of y's columns r in out: row `row` of out [N, H], columns col0 + r
    # TODO 2: load them, add y (in fp32) and store the sum back in out's dtype
    tl.store(out_ptr + row * R + r, y.to(out_ptr.dtype.element_ty), mask=mask)   # placeholder
'''


def _column_add_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, N, H, R, col0, dt in (
            ("TP4 rank 1: columns 16-31 of 64, 3 tokens", 3, 64, 16, 16, torch.float32),
            ("the last rank's slice: columns 72-95 of 96", 2, 96, 24, 72, torch.float32),
            ("R = 40: a second, partly masked column block", 4, 128, 40, 48, torch.float32),
            ("fp16 output, one token", 1, 64, 32, 0, torch.float16)):
        o = torch.randn(N, H, generator=gen, dtype=torch.float64)
        y = torch.randn(N, R, generator=gen, dtype=torch.float64)
        out.append(Case(label, {"out": o.to(device=device, dtype=dt), "y": y.to(device=device, dtype=dt),
                                "col0": col0}, dt))
    return out


def _column_add_reference(case: Case):
    x = case.inputs
    out = x["out"].double().cpu().clone()
    out[:, x["col0"]:x["col0"] + x["y"].shape[1]] += x["y"].double().cpu()
    return out


COLUMN_ADD = Puzzle(
    name="column_add", notebook=NB, step=1, minutes=6, title="Adding into one rank's columns",
    statement="""\
**Ladder 1: add into a column slice.** Under the sharded tail, rank `r` computes only its `R` output
columns and adds them into its `[N, H]` buffer at columns `col0 ... col0 + R - 1`. `column_add(kernel,
out, y, col0)` runs a program per (token, block of 32 of y's columns). Fill the TODOs: where column `r`
of `y`'s row lands in `out` (row stride `H`, offset `col0`), then load, add in fp32 and store. Every
other column of `out` must come back unchanged.""",
    kernel_name="column_add_kernel", stub=COLUMN_ADD_STUB, wrapper=column_add, solution=_column_add,
    cases=_column_add_cases, reference=_column_add_reference, outputs=("out",))


# ------------------------------------------------------------------------------------ tail_row
@triton.jit
def _tail_row(lat_ptr, nw_ptr, up_ptr, out_ptr, R, col0, eps, LAT: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ks = tl.arange(0, BLOCK_K)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, LAT, BLOCK_K):
        y = tl.load(lat_ptr + k0 + ks, mask=k0 + ks < LAT, other=0.0).to(tl.float32)
        ss += y * y
    inv = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / LAT + eps)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < R
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, LAT, BLOCK_K):
        kmask = k0 + ks < LAT
        y = tl.load(lat_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        normed = (y * inv * w).to(up_ptr.dtype.element_ty).to(tl.float32)  # rounded as the layer rounds it
        up = tl.load(up_ptr + rn[:, None] * LAT + k0 + ks[None, :], mask=nmask[:, None] & kmask[None, :],
                     other=0.0).to(tl.float32)
        acc += up * normed[None, :]
    dst = out_ptr + col0 + rn
    cur = tl.load(dst, mask=nmask, other=0.0).to(tl.float32)
    tl.store(dst, (cur + tl.sum(acc, axis=1)).to(out_ptr.dtype.element_ty), mask=nmask)


def tail_row(kernel, lat, norm_w, up_rows, out, col0, eps=1e-5):
    """One token's tail: out [H] (up_rows' dtype; changed in place and returned) gets
    RMSNorm(lat [LAT], norm_w [LAT]) @ up_rows [R, LAT]^T added into columns col0 ... col0 + R - 1.
    A program per 8 rows of up_rows, walking LAT in blocks of 32."""
    R, LAT = up_rows.shape
    BLOCK_N, BLOCK_K = 8, 32
    kernel[(triton.cdiv(R, BLOCK_N),)](lat.contiguous(), norm_w.contiguous(), up_rows.contiguous(), out, R,
                                       col0, eps, LAT=LAT, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return out


TAIL_ROW_STUB = '''\
@triton.jit
def tail_row_kernel(lat_ptr, nw_ptr, up_ptr, out_ptr, R, col0, eps, LAT: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    ks = tl.arange(0, BLOCK_K)
    # TODO 1: inv = 1 / sqrt(mean of lat * lat over the LAT values + eps): walk LAT in blocks of
    #         BLOCK_K, summing squares into a [BLOCK_K] fp32 accumulator, then reduce it
    inv = 1.0                                  # placeholder
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)   # this program's rows of up_rows
    nmask = rn < R
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, LAT, BLOCK_K):
        kmask = k0 + ks < LAT
        y = tl.load(lat_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + k0 + ks, mask=kmask, other=0.0).to(tl.float32)
        normed = (y * inv * w).to(up_ptr.dtype.element_ty).to(tl.float32)  # rounded as the layer does
        # TODO 2: load the [BLOCK_N, BLOCK_K] tile of up_rows [R, LAT] (rows rn, columns k0 + ks)
        #         and add up * normed into acc
    # TODO 3: add each row's sum (acc over axis 1) into out at columns col0 + rn
    tl.store(out_ptr + col0 + rn, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=nmask)  # placeholder
'''


def _tail_row_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, H, R, LAT, col0, dt in (
            ("TP4 rank 2: 16 rows of 64, LAT = 96 (three K blocks)", 64, 16, 96, 32, torch.float32),
            ("R = 20: the last program holds 4 of its 8 rows; LAT = 100", 80, 20, 100, 60, torch.float32),
            ("fp16 weights and output, LAT = 64", 64, 32, 64, 0, torch.float16),
            ("a latent far from unit scale", 48, 12, 40, 12, torch.float32)):
        scale = 30.0 if LAT == 40 else 3.0
        lat = scale * torch.randn(LAT, generator=gen, dtype=torch.float64)
        nw = 1.0 + 0.1 * torch.randn(LAT, generator=gen, dtype=torch.float64)
        up = torch.randn(R, LAT, generator=gen, dtype=torch.float64) / LAT ** 0.5
        o = torch.randn(H, generator=gen, dtype=torch.float64)
        inputs = {"lat": lat.float().to(device), "norm_w": nw.to(device=device, dtype=dt),
                  "up_rows": up.to(device=device, dtype=dt), "out": o.to(device=device, dtype=dt),
                  "col0": col0, "eps": EPS}
        out.append(Case(label, inputs, dt))
    return out


def _tail_row_reference(case: Case):
    x = {k: (v.double().cpu() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
    out = x["out"].clone()
    R = x["up_rows"].shape[0]
    out[x["col0"]:x["col0"] + R] += x["up_rows"] @ rms_norm(x["lat"], x["norm_w"], x["eps"])
    return out


TAIL_ROW = Puzzle(
    name="tail_row", notebook=NB, step=2, minutes=10, title="The one-token tail kernel",
    statement="""\
**Ladder 2: the one-token tail.** At batch 1 the tail is one launch: every program computes the
latent's RMS itself (the latent is small and cached), then streams `BLOCK_N` rows of `up_rows [R, LAT]`
against the normed latent and adds its `BLOCK_N` outputs into `out` at columns `col0 + r`. Fill the
TODOs of `tail_row_kernel`: the sum of squares over LAT in blocks of `BLOCK_K`, the masked
`[BLOCK_N, BLOCK_K]` tile of `up_rows` multiplied into the accumulator, and the add into `out` (fp32
sum, one rounding). Graded against `rms_norm(lat, norm_w) @ up_rows.T` added into the slice, in fp64.""",
    kernel_name="tail_row_kernel", stub=TAIL_ROW_STUB, wrapper=tail_row, solution=_tail_row,
    cases=_tail_row_cases, reference=_tail_row_reference, outputs=("out",))

PUZZLES = (COLUMN_ADD, TAIL_ROW)
