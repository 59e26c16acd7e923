"""Merge attention computed over disjoint pieces of a history into attention over all of it.

Each piece n contributes a partial output o_n (softmax-weighted over its own positions) and its
natural-log log-sum-exp lse_n. Over the union:

    lse = log sum_n exp(lse_n)            o = sum_n exp(lse_n - lse) o_n

computed stably with m = max_n lse_n. A piece that holds no position of a query carries lse_n = -inf
and o_n = 0 and gets weight 0 (its o_n is not read, so NaN there cannot leak); when every piece is
empty the result is o = 0, lse = -inf, never NaN. The pieces are split-history programs of one
decode or the ranks of decode context parallelism (k3lab.parallel.dcp), where N is the world size.

`merge_partials(o_parts, lse_parts, backend=None)`: o_parts [N, ..., D], lse_parts [N, ...]. Returns
o in o_parts' dtype and lse in float32 (float64 for float64 inputs); the math runs in float32 (float64
for float64 inputs). Backends (`BACKENDS`, k3lab.ops' contract: `backend=` or K3LAB_MLA_MERGE_BACKEND
forces one; unforced, triton on GPU tensors and torch on CPU tensors): 'torch' is a handful of
elementwise and reduction kernels (the reference, and the before); 'triton' is one launch (one program
per output row and 128-column block, the after), and runs in Triton's interpreter on a CPU at small
sizes. `lse_weights(lse_parts)` gives the weights exp(lse_n - lse) and
the total alone (DCP's ag_rs merge rescales each rank's partial with them before its reduce-scatter).

Values: an lse is finite, or -inf for an empty piece. A NaN or +inf lse would make every weight of its
row NaN (exp(+inf - +inf)), so both functions refuse one (ValueError naming lse_parts), before any
kernel: one reduction and one device sync. `check_values=False` skips that read, for callers whose lse
come straight from the attention op (DCP's merges, inside a decode step) and under CUDA-graph capture,
where nothing can be read. A NaN in some o_n reaches only the rows that piece weighs into, as a NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.ops import Backend, check_finite, expect, triton_and_torch

BLOCK_D = 128  # value columns per merge program


LSE_VALUES = "a log-sum-exp is finite, or -inf for a piece that holds no position"


def _check_lse(lse_parts) -> None:
    expect("lse_parts", lse_parts, dtype="float", what="[N, ...]")
    if lse_parts.dim() < 1:
        raise ValueError(f"lse_parts must be [N, ...] (at least one dim), got shape {tuple(lse_parts.shape)}")


def _check(o_parts, lse_parts, backend, check_values) -> Backend:
    """Validate the inputs; the row that merges them."""
    expect("o_parts", o_parts, what="[N, ..., D]")
    if o_parts.dim() < 2:
        raise ValueError(f"o_parts must be a tensor [N, ..., D] with N >= 1 pieces, got "
                         f"{tuple(o_parts.shape)}")
    expect("lse_parts", lse_parts, shape=o_parts.shape[:-1],
           what=f"[N, ...] = {tuple(o_parts.shape[:-1])} (o_parts without its last dim)")
    if o_parts.shape[0] < 1:
        raise ValueError("o_parts must hold at least one piece (N = o_parts.shape[0] >= 1)")
    expect("o_parts", o_parts, dtype="float")
    expect("lse_parts", lse_parts, dtype="float", device=o_parts.device)
    row = BACKENDS.pick(backend, o_parts.device, need="after")
    if check_values:
        check_finite(LSE_VALUES, {"lse_parts": lse_parts}, neg_inf_ok=("lse_parts",))
    return row


def _math_dtype(o_parts, lse_parts) -> torch.dtype:
    wide = torch.float64 in (o_parts.dtype, lse_parts.dtype)
    return torch.float64 if wide else torch.float32


def lse_weights(lse_parts: torch.Tensor, *, check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(w [N, ...], lse [...]): each piece's share exp(lse_n - lse) of the total and the total lse.

    Empty pieces (-inf) get weight 0; when all are empty every weight is 0 and lse = -inf. Computed
    in float32 (float64 for float64 input). A NaN or +inf lse is refused (module docstring).
    """
    _check_lse(lse_parts)
    if check_values:
        check_finite(LSE_VALUES, {"lse_parts": lse_parts}, neg_inf_ok=("lse_parts",))
    lse = lse_parts.to(torch.float64 if lse_parts.dtype == torch.float64 else torch.float32)
    m = lse.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # all pieces empty: -inf - 0 stays -inf
    w = torch.exp(lse - m)  # empty piece: exp(-inf) = 0
    s = w.sum(dim=0)
    s_safe = torch.where(s > 0, s, torch.ones_like(s))  # both branches of a where are computed
    total = torch.where(s > 0, m + torch.log(s_safe), torch.full_like(s, float("-inf")))
    return w / s_safe, total


def _merge_torch(o_parts, lse_parts):
    acc = _math_dtype(o_parts, lse_parts)
    frac, total = lse_weights(lse_parts.to(acc), check_values=False)
    o = torch.where(frac[..., None] > 0, o_parts.to(acc), torch.zeros((), dtype=acc, device=o_parts.device))
    o = (o * frac[..., None]).sum(dim=0)
    return o.to(o_parts.dtype), total


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, out_lse_ptr, N, D, rows_per_b,
                  s_on, s_ob, s_or, s_ln, s_lb, s_lr,
                  N_PAD: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = row // rows_per_b
    r = row % rows_per_b
    n = tl.arange(0, N_PAD)
    nmask = n < N
    lse = tl.load(lse_ptr + n * s_ln + b * s_lb + r * s_lr, mask=nmask, other=float("-inf"))
    lse = lse.to(tl.float64) if WIDE else lse.to(tl.float32)
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    s = tl.sum(w, 0)
    s_safe = tl.where(s > 0, s, 1.0)  # both branches of a where are evaluated: no 0 / 0, no log(0)
    frac = w / s_safe
    d = blk * BLOCK + tl.arange(0, BLOCK)
    dmask = d < D
    o = tl.load(o_ptr + n[:, None] * s_on + b * s_ob + r * s_or + d[None, :],
                mask=nmask[:, None] & dmask[None, :], other=0.0)
    o = o.to(tl.float64) if WIDE else o.to(tl.float32)
    o = tl.where(frac[:, None] > 0, o, 0.0)
    acc = tl.sum(o * frac[:, None], 0)
    tl.store(out_ptr + row * D + d, acc.to(out_ptr.dtype.element_ty), mask=dmask)
    if blk == 0:
        tl.store(out_lse_ptr + row, tl.where(s > 0, m + tl.log(s_safe), float("-inf")))


def _rows_view(t: torch.Tensor, keep_last: bool):
    """[N, ..., (D)] as [N, B, R, (D)] by strides, copying only when the middle dims do not collapse."""
    mid = t.shape[1:-1] if keep_last else t.shape[1:]
    if len(mid) == 0:
        return t.unsqueeze(1).unsqueeze(1)
    lead = mid[0]
    tail = 1
    for x in mid[1:]:
        tail *= x
    shape = (t.shape[0], lead, tail) + ((t.shape[-1],) if keep_last else ())
    try:
        return t.view(shape)
    except RuntimeError:
        return t.reshape(shape)


def _merge_triton(o_parts, lse_parts):
    N, D = o_parts.shape[0], o_parts.shape[-1]
    out_shape = o_parts.shape[1:]
    o3 = _rows_view(o_parts, True)
    if o3.stride(-1) != 1:
        o3 = o3.contiguous()
    l3 = _rows_view(lse_parts, False)
    _, B, R, _ = o3.shape
    acc = _math_dtype(o_parts, lse_parts)
    out = torch.empty(out_shape, dtype=o_parts.dtype, device=o_parts.device)
    out_lse = torch.empty(out_shape[:-1], dtype=acc, device=o_parts.device)
    if out.numel() == 0:
        return out, out_lse
    grid = (B * R, triton.cdiv(D, BLOCK_D))
    _merge_kernel[grid](o3, l3, out, out_lse, N, D, R,
                        o3.stride(0), o3.stride(1), o3.stride(2), l3.stride(0), l3.stride(1), l3.stride(2),
                        N_PAD=max(2, triton.next_power_of_2(N)), BLOCK=BLOCK_D, WIDE=acc == torch.float64)
    return out, out_lse


# callables (on checked inputs): after(o_parts, lse_parts) -> (o, lse); the torch row is the reference
# and the before (a handful of elementwise and reduction kernels)
BACKENDS = triton_and_torch("mla_merge", {"after": _merge_triton}, {"after": _merge_torch})
BACKEND_ENV = BACKENDS.env


def merge_partials(o_parts: torch.Tensor, lse_parts: torch.Tensor, backend: str | None = None, *,
                   check_values: bool = True):
    """Merge N partial attentions (see the module docstring). Returns (o [..., D], lse [...]).
    backend: a name of BACKENDS, None to choose. check_values: refuse a NaN or +inf lse (one device
    sync); False for lse the attention op produced."""
    return _check(o_parts, lse_parts, backend, check_values).after(o_parts, lse_parts)
