"""The ladder of notebook 01 (DCP): from one masked block of a vector to the log-sum-exp merge of the
ranks' partial attention, the kernel `k3lab.ops.mla_decode.merge` launches.

    exp_shift      programs, offsets and masks: out = exp(x - c) over a vector no block size divides
    row_lse        one row in registers: a stable log-sum-exp (max first), padded columns at -inf
    merge_two      two pieces' (o, lse) into attention over both, one program per row
    merge_pieces   N pieces (some empty) as one [N, BLOCK_D] tile per program: the merge kernel

The merge puzzles are graded against attention computed over the whole history in fp64: their pieces
are softmax-weighted partials over disjoint position sets (a DCP layout, interleaved), so a correct merge
must give the single-rank answer, not just agree with the merge formula.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.workshop._core import Case

from ._grade import Puzzle

NB = "01_dcp"


# ------------------------------------------------------------------------------------ exp_shift
@triton.jit
def _exp_shift(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, tl.exp(x - c).to(out_ptr.dtype.element_ty), mask=mask)


def exp_shift(kernel, x, c):
    """out[i] = exp(x[i] - c) for x [n]: programs of BLOCK = 128 elements, the last one partly past n."""
    out = torch.empty_like(x)
    BLOCK = 128
    kernel[(triton.cdiv(x.numel(), BLOCK),)](x, out, x.numel(), c, BLOCK=BLOCK)
    return out


EXP_SHIFT_STUB = '''\
@triton.jit
def exp_shift_kernel(x_ptr, out_ptr, n, c, BLOCK: tl.constexpr):
    pid = tl.program_id(0)                     # this program's block: elements pid*BLOCK ... +BLOCK-1
    offs = tl.arange(0, BLOCK)                 # TODO 1: this program's element indices
    mask = offs < n                            # lanes past the end of x: neither loaded nor stored
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    y = x                                      # TODO 2: exp(x - c), computed in fp32 (x may be fp16)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
'''


def _exp_shift_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, n, dt in (("n = 1000: 8 programs, the last holds 104 of its 128 lanes", 1000, torch.float32),
                         ("n = 129: the second program holds one element", 129, torch.float32),
                         ("n = 300, fp16", 300, torch.float16),
                         ("n = 256: every block full", 256, torch.float32)):
        x = 3.0 * torch.randn(n, generator=gen, dtype=torch.float64)
        c = float(x.max())  # exp(x - max) <= 1: what a softmax computes
        out.append(Case(label, {"x": x.to(device=device, dtype=dt), "c": c}, dt))
    return out


def _exp_shift_reference(case: Case):
    return torch.exp(case.inputs["x"].double().cpu() - case.inputs["c"])


EXP_SHIFT = Puzzle(
    name="exp_shift", notebook=NB, step=1, minutes=5, title="Programs, offsets and masks",
    statement="""\
**Ladder 1: programs, offsets and masks.** `exp_shift(kernel, x, c)` launches `cdiv(n, 128)` programs
over a vector `x [n]`; program `pid` owns elements `pid*128 ... pid*128 + 127`. Fill the two TODOs of
`exp_shift_kernel`: the program's element indices, and `exp(x - c)` in fp32 (the store casts back). The
mask keeps the last program's lanes past `n` from reading or writing outside `x`. Cases: n = 1000, 129,
300 (fp16) and 256.""",
    kernel_name="exp_shift_kernel", stub=EXP_SHIFT_STUB, wrapper=exp_shift, solution=_exp_shift,
    cases=_exp_shift_cases, reference=_exp_shift_reference, outputs=("out",))


# ------------------------------------------------------------------------------------ row_lse
@triton.jit
def _row_lse(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
    tl.store(lse_ptr + row, lse)


def row_lse(kernel, x):
    """lse [R] fp32 of scores x [R, N]: one program per row, BLOCK = N rounded up to a power of two."""
    R, N = x.shape
    x = x.contiguous()
    lse = torch.empty(R, dtype=torch.float32, device=x.device)
    kernel[(R,)](x, lse, N, BLOCK=triton.next_power_of_2(N))
    return lse


ROW_LSE_STUB = '''\
@triton.jit
def row_lse_kernel(x_ptr, lse_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)                     # one program per row of N scores
    cols = tl.arange(0, BLOCK)                 # BLOCK >= N: the whole row in registers
    x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
    # TODO 1: m = the row's largest score (the padded lanes hold -inf: they never win)
    # TODO 2: lse = m + log(sum of exp(x - m)): padded lanes add exp(-inf) = 0
    lse = tl.max(x, axis=0) * 0.0              # placeholder: replace with TODO 2's lse
    tl.store(lse_ptr + row, lse)
'''


def _row_lse_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, R, N, shift, dt in (
            ("4 rows of 37 scores", 4, 37, 0.0, torch.float32),
            ("scores near 120: exp(x) overflows fp32 unless the max comes off first", 3, 50, 120.0,
             torch.float32),
            ("N = 64, fp16 scores", 5, 64, 0.0, torch.float16),
            ("one score per row", 3, 1, 2.0, torch.float32)):
        x = shift + 4.0 * torch.randn(R, N, generator=gen, dtype=torch.float64)
        out.append(Case(label, {"x": x.to(device=device, dtype=dt)}, torch.float32))
    return out


def _row_lse_reference(case: Case):
    return torch.logsumexp(case.inputs["x"].double().cpu(), dim=-1)


ROW_LSE = Puzzle(
    name="row_lse", notebook=NB, step=2, minutes=6, title="A row reduction kept in registers",
    statement="""\
**Ladder 2: a stable log-sum-exp of one row.** `row_lse(kernel, x)` gives each row of scores `x [R, N]`
one program, holding the whole row in registers (`BLOCK` = N rounded up to a power of two; the padded
lanes load as `-inf`). Write `lse = log(sum_j exp(x_j))` the stable way: take the row's max `m` first,
then `m + log(sum_j exp(x_j - m))`. One case has scores near 120, where `exp(x)` overflows fp32. The
result is fp32 [R]; the reference is `torch.logsumexp` in fp64.""",
    kernel_name="row_lse_kernel", stub=ROW_LSE_STUB, wrapper=row_lse, solution=_row_lse,
    cases=_row_lse_cases, reference=_row_lse_reference, outputs=("lse",))


# ------------------------------------------------------------------------------ merge pieces
def _pieces(gen, R: int, L: int, D: int, N: int, interleave: int, shift: float):
    """Partial attention of R query rows over L positions split among N pieces (position p belongs to
    piece (p // interleave) % N), fp64: o_parts [N, R, D], lse_parts [N, R] (an empty piece: 0, -inf),
    and the whole history's o [R, D], lse [R]."""
    s = shift + 2.0 * torch.randn(R, L, generator=gen, dtype=torch.float64)
    v = torch.randn(L, D, generator=gen, dtype=torch.float64)
    owner = (torch.arange(L) // interleave) % N
    o_parts = torch.zeros(N, R, D, dtype=torch.float64)
    lse_parts = torch.full((N, R), float("-inf"), dtype=torch.float64)
    for n in range(N):
        idx = (owner == n).nonzero().flatten()
        if idx.numel():
            lse_parts[n] = torch.logsumexp(s[:, idx], dim=-1)
            o_parts[n] = torch.softmax(s[:, idx], dim=-1) @ v[idx]
    return o_parts, lse_parts, torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _merge_reference(case: Case):
    return case.extra["o"], case.extra["lse"]


# ------------------------------------------------------------------------------------ merge_two
@triton.jit
def _merge_two(o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, o_ptr, lse_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    l1 = tl.load(lse1_ptr + row).to(tl.float32)
    l2 = tl.load(lse2_ptr + row).to(tl.float32)
    m = tl.maximum(l1, l2)                     # finite: piece 1 always holds positions
    w1 = tl.exp(l1 - m)
    w2 = tl.exp(l2 - m)                        # an empty piece 2 (-inf) weighs 0
    s = w1 + w2
    o1 = tl.load(o1_ptr + row * D + d, mask=dmask, other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + row * D + d, mask=dmask, other=0.0).to(tl.float32)
    o = (w1 * o1 + w2 * o2) / s
    tl.store(o_ptr + row * D + d, o.to(o_ptr.dtype.element_ty), mask=dmask)
    tl.store(lse_ptr + row, m + tl.log(s))


def merge_two(kernel, o1, lse1, o2, lse2):
    """(o [R, D] in o1's dtype, lse [R] fp32) over the union of two pieces' positions, from each
    piece's o [R, D] and lse [R]: one program per row."""
    R, D = o1.shape
    o = torch.empty_like(o1)
    lse = torch.empty(R, dtype=torch.float32, device=o1.device)
    kernel[(R,)](o1.contiguous(), lse1.contiguous(), o2.contiguous(), lse2.contiguous(), o, lse, D,
                 BLOCK_D=triton.next_power_of_2(D))
    return o, lse


MERGE_TWO_STUB = '''\
@triton.jit
def merge_two_kernel(o1_ptr, lse1_ptr, o2_ptr, lse2_ptr, o_ptr, lse_ptr, D, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)                     # one program per query row
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    l1 = tl.load(lse1_ptr + row).to(tl.float32)
    l2 = tl.load(lse2_ptr + row).to(tl.float32)   # -inf where piece 2 holds no position
    o1 = tl.load(o1_ptr + row * D + d, mask=dmask, other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + row * D + d, mask=dmask, other=0.0).to(tl.float32)
    # TODO 1: each piece's weight exp(lse_n - m), m the larger lse; s = their sum
    # TODO 2: o = the weighted mean of o1 and o2; lse = m + log(s)
    o = o1                                     # placeholder
    lse = l1                                   # placeholder
    tl.store(o_ptr + row * D + d, o.to(o_ptr.dtype.element_ty), mask=dmask)
    tl.store(lse_ptr + row, lse)
'''


def _merge_two_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, R, L, D, inter, shift, dt in (
            ("3 rows, 20 positions interleaved one by one, D = 64", 3, 20, 64, 1, 0.0, torch.float32),
            ("D = 40 (BLOCK_D 64), blocks of 8 positions", 4, 24, 40, 8, 0.0, torch.float32),
            ("scores near 100: exp(lse) overflows fp32", 2, 18, 32, 1, 100.0, torch.float32),
            ("5 positions in blocks of 8: piece 2 is empty (lse = -inf)", 3, 5, 32, 8, 0.0, torch.float32),
            ("fp16 partial outputs", 3, 30, 48, 2, 0.0, torch.float16)):
        o_parts, lse_parts, o, lse = _pieces(gen, R, L, D, 2, inter, shift)
        inputs = {"o1": o_parts[0].to(device=device, dtype=dt), "lse1": lse_parts[0].float().to(device),
                  "o2": o_parts[1].to(device=device, dtype=dt), "lse2": lse_parts[1].float().to(device)}
        out.append(Case(label, inputs, dt, extra={"o": o, "lse": lse}))
    return out


MERGE_TWO = Puzzle(
    name="merge_two", notebook=NB, step=3, minutes=7, title="Two partial answers into one",
    statement="""\
**Ladder 3: merge two pieces of attention.** Piece `n` of a history gives each query row its partial
output `o_n [R, D]` (softmax-weighted over the piece's own positions) and its log-sum-exp `lse_n [R]`.
Over both pieces, `lse = log(exp(lse_1) + exp(lse_2))` and `o = w_1 o_1 + w_2 o_2` with
`w_n = exp(lse_n - lse)`. Fill the TODOs of `merge_two_kernel` (one program per row), subtracting the
larger lse before any `exp`. Piece 1 always holds positions; in one case piece 2 holds none (`lse_2 =
-inf`, `o_2 = 0`). Graded against attention over the whole history in fp64.""",
    kernel_name="merge_two_kernel", stub=MERGE_TWO_STUB, wrapper=merge_two, solution=_merge_two,
    cases=_merge_two_cases, reference=_merge_reference, outputs=("o", "lse"))


# ------------------------------------------------------------------------------------ merge_pieces
@triton.jit
def _merge_pieces(o_ptr, lse_ptr, out_ptr, out_lse_ptr, N, R, D, N_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    n = tl.arange(0, N_PAD)
    nmask = n < N
    lse = tl.load(lse_ptr + n * R + row, mask=nmask, other=float("-inf")).to(tl.float32)
    m = tl.max(lse, axis=0)                    # finite: some piece holds positions
    w = tl.exp(lse - m)                        # empty and padded pieces weigh 0
    s = tl.sum(w, axis=0)
    d = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    o = tl.load(o_ptr + (n[:, None] * R + row) * D + d[None, :], mask=nmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    acc = tl.sum(o * (w / s)[:, None], axis=0)
    tl.store(out_ptr + row * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    if blk == 0:
        tl.store(out_lse_ptr + row, m + tl.log(s))


def merge_pieces(kernel, o_parts, lse_parts):
    """(o [R, D] in o_parts' dtype, lse [R] fp32) from N pieces' o_parts [N, R, D] and lse_parts [N, R]:
    a program per (row, block of 32 value columns); N_PAD = N rounded up to a power of two (>= 2)."""
    N, R, D = o_parts.shape
    out = torch.empty(R, D, dtype=o_parts.dtype, device=o_parts.device)
    out_lse = torch.empty(R, dtype=torch.float32, device=o_parts.device)
    BLOCK_D = 32
    kernel[(R, triton.cdiv(D, BLOCK_D))](o_parts.contiguous(), lse_parts.contiguous(), out, out_lse, N, R, D,
                                         N_PAD=max(2, triton.next_power_of_2(N)), BLOCK_D=BLOCK_D)
    return out, out_lse


MERGE_PIECES_STUB = '''\
@triton.jit
def merge_pieces_kernel(o_ptr, lse_ptr, out_ptr, out_lse_ptr, N, R, D,
                        N_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)                     # one query row ...
    blk = tl.program_id(1)                     # ... and one block of BLOCK_D value columns
    n = tl.arange(0, N_PAD)                    # the pieces, padded to a power of two
    nmask = n < N
    lse = tl.load(lse_ptr + n * R + row, mask=nmask, other=float("-inf")).to(tl.float32)
    # TODO 1: every piece's weight exp(lse_n - m) and their sum s (empty and padded pieces: weight 0)
    w = tl.where(nmask, 1.0, 0.0)              # placeholder weights
    s = tl.sum(w, axis=0)                      # placeholder sum
    d = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    # TODO 2: load the [N_PAD, BLOCK_D] tile of o_parts [N, R, D] for this row and these columns
    #         (a 2-D mask: real pieces and real columns), as fp32
    # TODO 3: acc = the sum over pieces of (w / s) * o
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)   # placeholder
    tl.store(out_ptr + row * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    if blk == 0:                               # one program per row writes its lse
        tl.store(out_lse_ptr + row, tl.log(s))  # TODO 4: the lse of the whole history
'''


def _merge_pieces_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, N, R, L, D, inter, shift, dt in (
            ("4 pieces, interleave 1, D = 64 (two column blocks)", 4, 3, 37, 64, 1, 0.0, torch.float32),
            ("4 pieces, interleave 8, 20 positions: pieces 2, 3 empty", 4, 2, 20, 32, 8, 0.0, torch.float32),
            ("3 pieces (N_PAD 4), D = 40: a partial column block", 3, 3, 25, 40, 2, 0.0, torch.float32),
            ("scores near 100: exp(lse) overflows fp32", 8, 2, 45, 32, 1, 100.0, torch.float32),
            ("8 pieces, fp16 partial outputs", 8, 3, 50, 48, 2, 0.0, torch.float16)):
        o_parts, lse_parts, o, lse = _pieces(gen, R, L, D, N, inter, shift)
        inputs = {"o_parts": o_parts.to(device=device, dtype=dt), "lse_parts": lse_parts.float().to(device)}
        out.append(Case(label, inputs, dt, extra={"o": o, "lse": lse}))
    return out


MERGE_PIECES = Puzzle(
    name="merge_pieces", notebook=NB, step=4, minutes=10, title="The DCP merge kernel",
    statement="""\
**Ladder 4: the merge kernel.** Now `N` pieces (DCP's ranks): `o_parts [N, R, D]`, `lse_parts [N, R]`,
a rank holding none of a row's positions sends `o = 0, lse = -inf`. `merge_pieces(kernel, ...)` runs a
program per (row, block of 32 value columns); each holds all N pieces at once as an `[N_PAD, BLOCK_D]`
tile (`N_PAD` = N rounded up to a power of two). Fill the TODOs: the weights from the lse vector, the
2-D masked load of the tile, the weighted sum over pieces (`axis=0`), and the merged lse (written by the
column block 0 only). This is the shape of `k3lab.ops.mla_decode.merge`'s kernel. Graded against
attention over the whole history in fp64.""",
    kernel_name="merge_pieces_kernel", stub=MERGE_PIECES_STUB, wrapper=merge_pieces, solution=_merge_pieces,
    cases=_merge_pieces_cases, reference=_merge_reference, outputs=("o", "lse"))

PUZZLES = (EXP_SHIFT, ROW_LSE, MERGE_TWO, MERGE_PIECES)
