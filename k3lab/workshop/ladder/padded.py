"""The ladder of notebook 04 (MLA padding): from one 16-row `tl.dot` to the padded decode tile of
`k3lab.ops.mla_decode.triton`'s "after" kernel, simplified (one token per request, no split history).

    dot16           c = a @ b with a's M <= 16 rows padded to the 16 a matrix-unit tile takes
    tile_attention  12 heads padded to 16 against one block of positions: scores, softmax, values (the
                    value is the first DV latent columns, as MLA's absorbed decode reads it)
    online_softmax  the same over a history of several blocks, carried by an online softmax
    padded_decode   the decode tile: a batch of requests of their own lengths, the latent split into
                    its value part and its rope part (two score products), natural-log lse

MLA's real sizes are 576 latent columns (512 value + 64 rope) and 12 heads per GPU; the puzzles keep
the heads and shrink the latent (64, or 32 + 16) so Triton's interpreter runs them in seconds. Graded
against `k3lab.nn.mla.latent_attention` (or a @ b) in fp64. fp32 cases of one product are held to the
tf32 bound (on NVIDIA GPUs `tl.dot` of fp32 inputs rounds them to tf32 by default); attention's two
products through a softmax to the bf16 bound (`_tol`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.nn.mla import latent_attention
from k3lab.workshop._core import Case

from ._grade import Puzzle

NB = "04_mla_padding"


def _tol(dt: torch.dtype, products: int = 1):
    """The case's bound: one product of fp32 inputs is held to tf32 (what `tl.dot` rounds them to on NVIDIA
    GPUs). Attention chains two products through a softmax (scores, then the weighted values), and exp()
    scales the scores' rounding by their size (an fp32 case of the online softmax measured 1.29e-3 rel_l2
    on an H100), so it is held to the next coarser bound, bf16's, which a wrong mask, index or missing
    rescale (O(1) errors) still fails."""
    if products > 1 and dt == torch.float32:
        return "bf16"
    return "tf32" if dt == torch.float32 else dt


# ------------------------------------------------------------------------------------ dot16
@triton.jit
def _dot16(a_ptr, b_ptr, c_ptr, M, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm < M)[:, None], other=0.0)
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    c = tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], c, mask=(rm < M)[:, None])


def dot16(kernel, a, b):
    """c [M, N] fp32 = a [M, K] @ b [K, N] for M <= 16, in one program whose tile has BLOCK_M = 16 rows
    (K and N powers of two, >= 16)."""
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    kernel[(1,)](a.contiguous(), b.contiguous(), c, M, K=K, N=N, BLOCK_M=16)
    return c


DOT16_STUB = '''\
@triton.jit
def dot16_kernel(a_ptr, b_ptr, c_ptr, M, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)                 # 16 rows: the height of a matrix-unit tile
    rk = tl.arange(0, K)
    rn = tl.arange(0, N)
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    # TODO 1: load a [M, K] as a [BLOCK_M, K] tile: rows M ... 15 masked, loaded as 0
    # TODO 2: c = tl.dot(a, b): one matrix-unit product, accumulated in fp32
    c = tl.zeros((BLOCK_M, N), dtype=tl.float32)   # placeholder
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], c, mask=(rm < M)[:, None])   # the M real rows
'''


def _dot16_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, M, K, N, dt in (("12 rows (MLA's heads per GPU), K = 64, fp16", 12, 64, 32, torch.float16),
                               ("5 rows, fp32 (held to tf32)", 5, 32, 64, torch.float32),
                               ("16 rows: no padding", 16, 64, 16, torch.float16),
                               ("1 row", 1, 16, 32, torch.float16)):
        a = torch.randn(M, K, generator=gen, dtype=torch.float64)
        b = torch.randn(K, N, generator=gen, dtype=torch.float64)
        inputs = {"a": a.to(device=device, dtype=dt), "b": b.to(device=device, dtype=dt)}
        out.append(Case(label, inputs, _tol(dt)))
    return out


DOT16 = Puzzle(
    name="dot16", notebook=NB, step=1, minutes=6, title="A 16-row tl.dot",
    statement="""\
**Ladder 1: a 16-row `tl.dot`.** A matrix unit (an NVIDIA mma, an AMD MFMA) multiplies tiles of at least
16 rows, and `tl.dot` compiles only for such tiles. MLA has 12 query heads per GPU. `dot16(kernel, a, b)`
launches one program with `BLOCK_M = 16`; `a [M, K]` has `M <= 16` rows. Load `a` as a 16-row tile
(rows past `M` masked, loaded as 0), multiply with `tl.dot`, and the given store writes the `M` real
rows of `c [M, N]` (fp32). Graded against `a @ b` in fp64; fp32 inputs are held to the tf32 bound.""",
    kernel_name="dot16_kernel", stub=DOT16_STUB, wrapper=dot16, solution=_dot16, cases=_dot16_cases,
    reference=lambda case: case.inputs["a"].double().cpu() @ case.inputs["b"].double().cpu(), outputs=("c",))


# ------------------------------------------------------------------------- attention cases
def _attention_cases(seed: int, device: str, specs, batched: bool) -> list[Case]:
    """Cases of one-token decode. specs: (label, H, lengths, L, D, DV, dtype). batched: q [B, H, D],
    cache [B, L, D] (rows past a request's length are stale), lengths [B]; else one request, q [H, D]
    and cache [lengths[0], D]. The value is the first DV latent columns; scale = D ** -0.5."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, H, lengths, L, D, DV, dt in specs:
        B = len(lengths)
        q = torch.randn(B, H, D, generator=gen, dtype=torch.float64)
        cache = torch.randn(B, L, D, generator=gen, dtype=torch.float64)
        if batched:
            inputs = {"q": q, "cache": cache, "lengths": torch.tensor(lengths)}
        else:
            inputs = {"q": q[0], "cache": cache[0, :lengths[0]]}
        inputs = {k: v.to(device=device, dtype=dt if v.is_floating_point() else v.dtype)
                  for k, v in inputs.items()}
        inputs["scale"] = D ** -0.5
        out.append(Case(label, inputs, _tol(dt, products=2), extra={"value_dim": DV}))
    return out


def _attention_reference(case: Case):
    """(o, lse) of `latent_attention` in fp64, shaped as the case's q (batched or one request)."""
    x = case.inputs
    q, cache = x["q"].double().cpu(), x["cache"].double().cpu()
    batched = "lengths" in x
    if not batched:
        q, cache = q[None], cache[None]
    o, lse = latent_attention(q[:, None], cache, x["lengths"].cpu() if batched else None, scale=x["scale"],
                              value_dim=case.extra["value_dim"])
    o, lse = o[:, 0], lse[:, 0]
    return (o, lse) if batched else (o[0], lse[0])


# ------------------------------------------------------------------------------------ tile_attention
@triton.jit
def _tile_attention(q_ptr, kv_ptr, o_ptr, lse_ptr, H, L, scale, D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    rh = tl.arange(0, BLOCK_H)
    rd = tl.arange(0, D)
    rv = tl.arange(0, DV)
    pos = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + rh[:, None] * D + rd[None, :], mask=(rh < H)[:, None], other=0.0)
    k = tl.load(kv_ptr + pos[:, None] * D + rd[None, :], mask=(pos < L)[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where((pos < L)[None, :], s, float("-inf"))
    m = tl.max(s, axis=1)
    p = tl.exp(s - m[:, None])
    denom = tl.sum(p, axis=1)
    v = tl.load(kv_ptr + pos[:, None] * D + rv[None, :], mask=(pos < L)[:, None], other=0.0)
    o = tl.dot(p.to(v.dtype), v) / denom[:, None]
    tl.store(o_ptr + rh[:, None] * DV + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=(rh < H)[:, None])
    tl.store(lse_ptr + rh, m + tl.log(denom), mask=rh < H)


def tile_attention(kernel, q, cache, scale):
    """One token's attention, H <= 16 heads q [H, D] over L <= 32 positions cache [L, D]; the value is
    the first DV = D / 2 latent columns. Returns (o [H, DV] in q's dtype, lse [H] fp32). One program:
    BLOCK_H = 16 heads, BLOCK_N = 32 positions."""
    H, D = q.shape
    L = cache.shape[0]
    DV = D // 2
    o = torch.empty(H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, dtype=torch.float32, device=q.device)
    kernel[(1,)](q.contiguous(), cache.contiguous(), o, lse, H, L, scale, D=D, DV=DV, BLOCK_H=16, BLOCK_N=32)
    return o, lse


TILE_ATTENTION_STUB = '''\
@triton.jit
def tile_attention_kernel(q_ptr, kv_ptr, o_ptr, lse_ptr, H, L, scale, D: tl.constexpr, DV: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    rh = tl.arange(0, BLOCK_H)                 # 16 head rows: H real, the rest padding
    rd = tl.arange(0, D)                       # latent columns
    rv = tl.arange(0, DV)                      # the value: the first DV latent columns
    pos = tl.arange(0, BLOCK_N)                # positions: L real
    q = tl.load(q_ptr + rh[:, None] * D + rd[None, :], mask=(rh < H)[:, None], other=0.0)
    k = tl.load(kv_ptr + pos[:, None] * D + rd[None, :], mask=(pos < L)[:, None], other=0.0)
    # TODO 1: s = scale * q @ k^T as one tl.dot ([BLOCK_H, BLOCK_N]); positions >= L get -inf
    # TODO 2: per head row: m = max, p = exp(s - m), denom = sum of p
    # TODO 3: load v [BLOCK_N, DV] (the first DV columns of the positions' latent rows);
    #         o = tl.dot(p in v's dtype, v) / denom; lse = m + log(denom)
    o = tl.zeros((BLOCK_H, DV), dtype=tl.float32)   # placeholder
    lse = tl.zeros((BLOCK_H,), dtype=tl.float32)    # placeholder
    tl.store(o_ptr + rh[:, None] * DV + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=(rh < H)[:, None])
    tl.store(lse_ptr + rh, lse, mask=rh < H)
'''

_TILE_SPECS = (  # (label, H, lengths, L, D, DV, dtype)
    ("12 heads, 32 positions, fp16", 12, [32], 32, 64, 32, torch.float16),
    ("12 heads, 20 positions: 12 masked", 12, [20], 20, 64, 32, torch.float16),
    ("5 heads, 9 positions, fp32 (two products: held to bf16)", 5, [9], 9, 32, 16, torch.float32),
    ("16 heads, 1 position", 16, [1], 1, 64, 32, torch.float16),
)

TILE_ATTENTION = Puzzle(
    name="tile_attention", notebook=NB, step=2, minutes=8, title="12 heads padded to 16: one tile",
    statement="""\
**Ladder 2: attention of 12 heads over one tile.** MLA's absorbed decode scores every head against the
same latent rows, and the value is the first DV columns of those rows. With the heads padded to 16, one
`tl.dot` gives all heads' scores and a second their values. `tile_attention(kernel, q, cache, scale)`
runs one program: `q [H <= 16, D]`, `cache [L <= 32, D]`, `DV = D / 2`. Fill the TODOs: the scores with
masked positions at `-inf`, the softmax per head row, the value product, and lse = `m + log(denom)`
(natural log). The padded head rows (zero queries) are computed and never stored. Graded against
`k3lab.nn.mla.latent_attention` in fp64.""",
    kernel_name="tile_attention_kernel", stub=TILE_ATTENTION_STUB, wrapper=tile_attention,
    solution=_tile_attention,
    cases=lambda seed, device: _attention_cases(seed, device, _TILE_SPECS, batched=False),
    reference=_attention_reference, outputs=("o", "lse"))


# ------------------------------------------------------------------------------------ online_softmax
@triton.jit
def _online_softmax(q_ptr, kv_ptr, o_ptr, lse_ptr, H, scale, L: tl.constexpr, D: tl.constexpr,
                    DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    rh = tl.arange(0, BLOCK_H)
    rd = tl.arange(0, D)
    rv = tl.arange(0, DV)
    q = tl.load(q_ptr + rh[:, None] * D + rd[None, :], mask=(rh < H)[:, None], other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, DV), dtype=tl.float32)
    for n0 in range(0, L, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < L
        k = tl.load(kv_ptr + pos[:, None] * D + rd[None, :], mask=pmask[:, None], other=0.0)
        s = tl.where(pmask[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))   # finite: every block holds a real position
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptr + pos[:, None] * D + rv[None, :], mask=pmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(o_ptr + rh[:, None] * DV + rv[None, :], (acc / denom[:, None]).to(o_ptr.dtype.element_ty),
             mask=(rh < H)[:, None])
    tl.store(lse_ptr + rh, m + tl.log(denom), mask=rh < H)


def online_softmax(kernel, q, cache, scale):
    """One token's attention, H <= 16 heads q [H, D] over any L positions cache [L, D], in blocks of
    BLOCK_N = 16 positions; the value is the first DV = D / 2 latent columns. Returns (o [H, DV] in q's
    dtype, lse [H] fp32). One program, BLOCK_H = 16."""
    H, D = q.shape
    L = cache.shape[0]
    DV = D // 2
    o = torch.empty(H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, dtype=torch.float32, device=q.device)
    kernel[(1,)](q.contiguous(), cache.contiguous(), o, lse, H, scale, L=L, D=D, DV=DV,
                 BLOCK_H=16, BLOCK_N=16)
    return o, lse


ONLINE_SOFTMAX_STUB = '''\
@triton.jit
def online_softmax_kernel(q_ptr, kv_ptr, o_ptr, lse_ptr, H, scale, L: tl.constexpr, D: tl.constexpr,
                          DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    rh = tl.arange(0, BLOCK_H)
    rd = tl.arange(0, D)
    rv = tl.arange(0, DV)
    q = tl.load(q_ptr + rh[:, None] * D + rd[None, :], mask=(rh < H)[:, None], other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)   # per head: the largest score so far
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)       # sum of exp(s - m) so far
    acc = tl.zeros((BLOCK_H, DV), dtype=tl.float32)      # sum of exp(s - m) * v so far
    for n0 in range(0, L, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = pos < L
        k = tl.load(kv_ptr + pos[:, None] * D + rd[None, :], mask=pmask[:, None], other=0.0)
        v = tl.load(kv_ptr + pos[:, None] * D + rv[None, :], mask=pmask[:, None], other=0.0)
        # TODO 1: this block's scores s [BLOCK_H, BLOCK_N] (masked positions at -inf)
        # TODO 2: m_new = max(m, the block's max); alpha = exp(m - m_new) rescales denom and acc;
        #         p = exp(s - m_new); denom and acc take this block (acc through tl.dot(p, v))
        # TODO 3: m = m_new
    # TODO 4: o = acc / denom and lse = m + log(denom)
    o = acc                                             # placeholder
    lse = denom                                         # placeholder
    tl.store(o_ptr + rh[:, None] * DV + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=(rh < H)[:, None])
    tl.store(lse_ptr + rh, lse, mask=rh < H)
'''

_ONLINE_SPECS = (  # (label, H, lengths, L, D, DV, dtype)
    ("12 heads, 80 positions: 5 blocks of 16, fp16", 12, [80], 80, 64, 32, torch.float16),
    ("12 heads, 37 positions: the last block holds 5", 12, [37], 37, 64, 32, torch.float16),
    ("7 heads, 50 positions, fp32 (two products: held to bf16)", 7, [50], 50, 32, 16, torch.float32),
    ("12 heads, 9 positions: one block", 12, [9], 9, 64, 32, torch.float16),
)

ONLINE_SOFTMAX = Puzzle(
    name="online_softmax", notebook=NB, step=3, minutes=10, title="Online softmax over blocks",
    statement="""\
**Ladder 3: a history longer than a tile.** The history no longer fits one tile: walk it in blocks of
`BLOCK_N = 16` positions and carry the softmax online. Per head row keep `m` (the largest score so far),
`denom` (the sum of `exp(s - m)`) and `acc` (the sum of `exp(s - m) v`); when a block raises `m`, multiply
`denom` and `acc` by `alpha = exp(m_old - m_new)` before adding the block. At the end `o = acc / denom`
and `lse = m + log(denom)`. Same shapes as ladder 2, with `L` up to 80. This loop is the body of the
MLA decode kernel. Graded against `k3lab.nn.mla.latent_attention` in fp64.""",
    kernel_name="online_softmax_kernel", stub=ONLINE_SOFTMAX_STUB, wrapper=online_softmax,
    solution=_online_softmax,
    cases=lambda seed, device: _attention_cases(seed, device, _ONLINE_SPECS, batched=False),
    reference=_attention_reference, outputs=("o", "lse"))


# ------------------------------------------------------------------------------------ padded_decode
@triton.jit
def _padded_decode(q_ptr, kv_ptr, len_ptr, o_ptr, lse_ptr, H, L, scale, DV: tl.constexpr, DR: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    D = DV + DR
    length = tl.load(len_ptr + b)
    rh = tl.arange(0, BLOCK_H)
    rv = tl.arange(0, DV)
    rr = tl.arange(0, DR)
    hmask = (rh < H)[:, None]
    q_row = q_ptr + (b * H + rh[:, None]) * D
    q_c = tl.load(q_row + rv[None, :], mask=hmask, other=0.0)
    q_pe = tl.load(q_row + DV + rr[None, :], mask=hmask, other=0.0)
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, DV), dtype=tl.float32)
    n0 = 0
    while n0 < length:                         # a run-time bound: a while loop (see the statement)
        pos = n0 + tl.arange(0, BLOCK_N)
        pmask = (pos < length)[:, None]
        row = kv_ptr + (b * L + pos[:, None]) * D
        k_c = tl.load(row + rv[None, :], mask=pmask, other=0.0)
        k_pe = tl.load(row + DV + rr[None, :], mask=pmask, other=0.0)
        s = (tl.dot(q_c, tl.trans(k_c)) + tl.dot(q_pe, tl.trans(k_pe))) * scale
        s = tl.where((pos < length)[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_c.dtype), k_c)
        m = m_new
        n0 += BLOCK_N
    o = acc / denom[:, None]
    tl.store(o_ptr + (b * H + rh[:, None]) * DV + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=hmask)
    tl.store(lse_ptr + b * H + rh, m + tl.log(denom), mask=rh < H)


def padded_decode(kernel, q, cache, lengths, scale):
    """MLA's one-token decode for a batch: q [B, H <= 16, DV + DR], cache [B, L, DV + DR] with DV = 2 DR
    (the latent's value part, then its rope part), lengths [B] (request b reads rows 0 ... lengths[b]-1;
    the rest are stale). Returns (o [B, H, DV] in q's dtype, lse [B, H] fp32, natural log). One program
    per request: BLOCK_H = 16 heads, BLOCK_N = 16 positions a step."""
    B, H, D = q.shape
    DR = D // 3
    o = torch.empty(B, H, D - DR, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, dtype=torch.float32, device=q.device)
    kernel[(B,)](q.contiguous(), cache.contiguous(), lengths.to(torch.int32).contiguous(), o, lse, H,
                 cache.shape[1], scale, DV=D - DR, DR=DR, BLOCK_H=16, BLOCK_N=16)
    return o, lse


PADDED_DECODE_STUB = '''\
@triton.jit
def padded_decode_kernel(q_ptr, kv_ptr, len_ptr, o_ptr, lse_ptr, H, L, scale, DV: tl.constexpr,
                         DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)                       # one program per request
    D = DV + DR                                # a latent row: DV value columns, then DR rope columns
    length = tl.load(len_ptr + b)              # rows 0 ... length-1 of this request's cache are real
    rh = tl.arange(0, BLOCK_H)
    rv = tl.arange(0, DV)
    rr = tl.arange(0, DR)
    hmask = (rh < H)[:, None]
    # TODO 1: load q_c [BLOCK_H, DV] and q_pe [BLOCK_H, DR] of request b (q is [B, H, D]), heads padded
    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, DV), dtype=tl.float32)
    n0 = 0
    while n0 < length:                         # a run-time bound: a while loop (see the statement)
        pos = n0 + tl.arange(0, BLOCK_N)
        # TODO 2: load k_c [BLOCK_N, DV] and k_pe [BLOCK_N, DR] of request b (cache is [B, L, D]),
        #         positions past length masked
        # TODO 3: s = (q_c @ k_c^T + q_pe @ k_pe^T) * scale, masked positions at -inf;
        #         the online softmax step of ladder 3, with k_c as the value
        n0 += BLOCK_N
    o = acc                                              # placeholder: acc / denom
    lse = denom                                          # placeholder: m + log(denom)
    tl.store(o_ptr + (b * H + rh[:, None]) * DV + rv[None, :], o.to(o_ptr.dtype.element_ty), mask=hmask)
    tl.store(lse_ptr + b * H + rh, lse, mask=rh < H)
'''

_DECODE_SPECS = (  # (label, H, lengths, L, D, DV, dtype)
    ("12 heads, two requests of 40 and 23 positions, fp16", 12, [40, 23], 40, 48, 32, torch.float16),
    ("12 heads, three requests, stale rows past each length", 12, [17, 50, 3], 64, 48, 32, torch.float16),
    ("5 heads, fp32 (two products: held to bf16)", 5, [33, 16], 40, 48, 32, torch.float32),
    ("16 heads, one request, DV = 64 and DR = 32", 16, [29], 32, 96, 64, torch.float16),
)

PADDED_DECODE = Puzzle(
    name="padded_decode", notebook=NB, step=4, minutes=12, title="The padded decode tile",
    statement="""\
**Ladder 4: the padded decode tile.** Now a batch of requests, each with its own history length, and
MLA's real latent layout: a row is `DV` value columns then `DR` rope columns (K3: 512 + 64; here 32 + 16),
so a score is `q_c . k_c + q_pe . k_pe`, two `tl.dot`s of the 16-row query tile, and the value is `k_c`.
`padded_decode(kernel, q, cache, lengths, scale)` runs one program per request over
`q [B, H, DV + DR]`, `cache [B, L, DV + DR]`; request `b` reads rows `0 ... lengths[b] - 1` only.
Fill the TODOs with ladder 3's loop (a `while`: Triton's interpreter cannot run a `for` to a bound
known only at run time). Return the natural-log lse. This is the "after" kernel of
`k3lab.ops.mla_decode.triton` without its split history. Graded against
`k3lab.nn.mla.latent_attention` in fp64.""",
    kernel_name="padded_decode_kernel", stub=PADDED_DECODE_STUB, wrapper=padded_decode,
    solution=_padded_decode,
    cases=lambda seed, device: _attention_cases(seed, device, _DECODE_SPECS, batched=True),
    reference=_attention_reference, outputs=("o", "lse"))

PUZZLES = (DOT16, TILE_ATTENTION, ONLINE_SOFTMAX, PADDED_DECODE)
