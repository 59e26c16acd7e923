"""Tasks of notebooks 01 (DCP) and 04 (MLA padding): merging partial attention by log-sum-exp, and a
decode whose matrix products take exactly 16 query rows.

Both are graded against `k3lab.nn.mla.latent_attention` in fp64 over the whole history: the merge
receives the per-rank partials of a real DCP layout (`k3lab.parallel.dcp.owner`), so a correct merge
must give single-rank attention, as `dcp_decode` does.
"""

from __future__ import annotations

import torch

from k3lab.nn.mla import latent_attention
from k3lab.parallel.dcp import owner

from ._core import Case, Mismatch, Task

LATENT, VALUE = 576, 512
SCALE = 192 ** -0.5
MMA_ROWS = 16


# ------------------------------------------------------------------------------------------ 01
def _partials(q64, cache64, world: int, interleave: int):
    """Per-rank (o [N, B, H, 512], lse [N, B, H]) of one decode query over each rank's positions,
    fp64; a rank holding none of them gives o = 0, lse = -inf (what dcp_decode's ranks send)."""
    B, _, H, _ = q64.shape
    L = cache64.shape[1]
    ranks = owner(torch.arange(L), world, interleave)
    o = torch.zeros(world, B, H, VALUE, dtype=torch.float64)
    lse = torch.full((world, B, H), float("-inf"), dtype=torch.float64)
    for r in range(world):
        idx = (ranks == r).nonzero().flatten()
        if idx.numel():
            o_r, l_r = latent_attention(q64, cache64[:, idx], scale=SCALE)
            o[r], lse[r] = o_r[:, 0], l_r[:, 0]
    return o, lse


def _merge_cases(seed: int, device) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    specs = [  # (label, world, interleave, positions, query scale, dtype)
        ("4 ranks, interleave 1", 4, 1, 37, 1.0, torch.float32),
        ("4 ranks, interleave 16, 20 positions: ranks 2 and 3 empty", 4, 16, 20, 1.0, torch.float32),
        ("large scores (lse ~ 10^2): exp(lse) overflows fp32", 4, 1, 29, 60.0, torch.float32),
        ("8 ranks, interleave 2, fp16 partials", 8, 2, 45, 1.0, torch.float16),
        ("3 ranks, fp64", 3, 1, 25, 1.0, torch.float64),
    ]
    for label, world, inter, L, qs, dt in specs:
        q = qs * torch.randn(2, 1, 3, LATENT, generator=gen, dtype=torch.float64)
        cache = torch.randn(2, L, LATENT, generator=gen, dtype=torch.float64)
        o, lse = _partials(q, cache, world, inter)
        lse_dt = torch.float64 if dt == torch.float64 else torch.float32
        out.append(Case(label, {"o_parts": o.to(dt), "lse_parts": lse.to(lse_dt)}, dt,
                        extra={"q": q, "cache": cache}, out_dtype={"o": dt}))
    return out


def _merge_reference(case: Case):
    o, lse = latent_attention(case.extra["q"], case.extra["cache"], scale=SCALE)
    return o[:, 0], lse[:, 0]


def merge_solution(o_parts, lse_parts):
    """Attention over the union of N disjoint pieces from each piece's (o_n, lse_n):
    lse = log sum_n exp(lse_n), o = sum_n exp(lse_n - lse) o_n, with the max subtracted first."""
    acc = torch.float64 if o_parts.dtype == torch.float64 else torch.float32
    lse_n = lse_parts.to(acc)
    m = lse_n.amax(dim=0)                                  # finite while one piece holds positions
    lse = m + torch.log(torch.exp(lse_n - m).sum(dim=0))   # an empty piece adds exp(-inf) = 0
    w = torch.exp(lse_n - lse)                             # each piece's share of the mass
    o = (w[..., None] * o_parts.to(acc)).sum(dim=0)
    return o.to(o_parts.dtype), lse


MERGE_STUB = '''\
def merge(o_parts, lse_parts):
    """o_parts [N, B, H, 512]: each rank's attention over its own positions; lse_parts [N, B, H]:
    its log-sum-exp (-inf where the rank holds no position, and then o is 0).
    Return (o [B, H, 512] in o_parts' dtype, lse [B, H]): attention over all positions."""
    # TODO: the total lse; each rank's weight exp(lse_n - lse); the weighted sum of the o_n.
    #       Subtract the largest lse first, or exp() overflows.
    raise NotImplementedError("write the merge")
'''

MERGE = Task(
    name="dcp_merge", notebook="01_dcp", minutes=15,
    statement="""\
**Task: merge the ranks' partial answers.** Under DCP each rank attends over the positions it holds and
returns its partial output `o_n` with its log-sum-exp `lse_n`. Write `merge(o_parts, lse_parts)` that
returns attention over the whole history: `lse = log sum_n exp(lse_n)` and
`o = sum_n exp(lse_n - lse) o_n`. A rank that holds no position sends `o = 0, lse = -inf`. Work in
fp32 (fp64 for fp64 input) and subtract the largest lse before any `exp`: one case has scores large
enough that `exp(lse)` overflows fp32. `check` compares your merge with single-rank fp64 attention.""",
    signature="merge(o_parts: Tensor[N, B, H, 512], lse_parts: Tensor[N, B, H]) -> (o: Tensor[B, H, 512], "
              "lse: Tensor[B, H])",
    outputs=("o", "lse"), cases=_merge_cases, reference=_merge_reference, solution=merge_solution,
    stub=MERGE_STUB,
    forbidden=("k3lab.ops.mla_decode.merge.merge_partials", "k3lab.ops.mla_decode.merge.lse_weights",
               "k3lab.ops.mla_decode.merge._merge_torch", "k3lab.ops.mla_decode.merge._merge_triton"),
    hints=(
        "Each rank's o_n is already normalised over its own positions, and lse_n measures how much softmax "
        "mass those positions carry. Ask what share of the whole mass belongs to rank n.",
        "The whole mass is sum_n exp(lse_n), so lse = log sum_n exp(lse_n) and rank n's weight is "
        "exp(lse_n - lse); o is the weighted sum of the o_n. Take m = max_n lse_n out before any exp "
        "(lse = m + log sum_n exp(lse_n - m)) or fp32 overflows; an empty rank's exp(-inf) is 0 by itself.",
        "In fp32 (fp64 for fp64 input): `l = lse_parts.float(); m = l.amax(0)`, "
        "`lse = m + torch.log(torch.exp(l - m).sum(0))`, `w = torch.exp(l - lse)`; then "
        "`(w[..., None] * o_parts.float()).sum(0)`, cast back to o_parts.dtype, with lse.",
    ))


# ------------------------------------------------------------------------------------------ 04
def mma16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A matrix unit: a @ b where a has exactly 16 rows (a [..., 16, K], b [..., K, N], leading dims
    broadcast). Like an MFMA / mma tile, it takes no other row count."""
    if not isinstance(a, torch.Tensor) or a.dim() < 2 or a.shape[-2] != MMA_ROWS:
        rows = a.shape[-2] if isinstance(a, torch.Tensor) and a.dim() >= 2 else None
        raise ValueError(f"mma16: a must be [..., 16, K] (a matrix-unit tile has 16 rows), got {rows} rows")
    if not isinstance(b, torch.Tensor) or b.dim() < 2 or b.shape[-2] != a.shape[-1]:
        raise ValueError(f"mma16: b must be [..., K={a.shape[-1]}, N], got "
                         f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    return a @ b


def _pad_cases(seed: int, device) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    specs = [  # (label, B, Tq, H, L, lengths, dtype)
        ("12 heads, one token, two requests of different lengths", 2, 1, 12, 40, [40, 23], torch.float32),
        ("12 heads, a verification group of 4 tokens", 1, 4, 12, 50, [45], torch.float32),
        ("5 heads, 2 tokens", 2, 2, 5, 33, [17, 33], torch.float32),
        ("12 heads, fp64", 2, 1, 12, 30, [9, 30], torch.float64),
    ]
    out = []
    for label, B, Tq, H, L, lengths, dt in specs:
        q = torch.randn(B, Tq, H, LATENT, generator=gen, dtype=torch.float64)
        cache = torch.randn(B, L, LATENT, generator=gen, dtype=torch.float64)  # rows past a length: stale
        inputs = {"q": q.to(dt), "cache": cache.to(dt), "lengths": torch.tensor(lengths), "scale": SCALE}
        out.append(Case(label, inputs, dt))
    return out


def _pad_reference(case: Case):
    x = case.inputs
    return latent_attention(x["q"].double(), x["cache"].double(), x["lengths"], scale=x["scale"])


def _pad_run(fn, case: Case):
    calls = []

    def counted(a, b):
        out = mma16(a, b)
        calls.append(tuple(a.shape))
        return out

    x = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs.items()}
    result = fn(**x, mma16=counted)
    if len(calls) < 2:
        raise Mismatch(f"mma16 was called {len(calls)} time(s): both products (scores and values) go "
                       "through the 16-row matrix unit")
    return result


def padded_decode_solution(q, cache, lengths, scale, mma16):
    """Pad the heads to 16 rows, run both products through mma16, mask positions a token may not see,
    and return only the real heads."""
    B, Tq, H, D = q.shape
    L = cache.shape[1]
    q16 = torch.zeros(B, Tq, MMA_ROWS, D, dtype=q.dtype)
    q16[:, :, :H] = q                                                  # rows H..15 are padding
    s = mma16(q16, cache.transpose(1, 2)[:, None]) * scale             # [B, Tq, 16, L]
    qpos = lengths[:, None] - Tq + torch.arange(Tq)[None, :]           # each token's own position
    visible = torch.arange(L)[None, None, :] <= qpos[:, :, None]       # [B, Tq, L]: up to its own, included
    s = s.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    o = mma16(p, cache[:, None, :, :VALUE])                            # [B, Tq, 16, 512]
    return o[:, :, :H], lse[:, :, :H]


PAD_STUB = '''\
def padded_decode(q, cache, lengths, scale, mma16):
    """q [B, Tq, H, 576] with H <= 16; cache [B, L, 576]; lengths [B]: request b's history ends at
    lengths[b] (its Tq new tokens included; rows past it are stale). Token t of request b sits at
    position lengths[b] - Tq + t and sees positions up to and including its own.
    Both products must go through mma16(a [..., 16, K], b [..., K, N]), which takes 16 rows only.
    Return (o [B, Tq, H, 512], lse [B, Tq, H]) for the H real heads."""
    # TODO: pad q to 16 heads; scores = mma16(...) * scale; mask what a token may not see;
    #       lse and softmax; o = mma16(p, values = first 512 latent columns); drop the padded heads.
    raise NotImplementedError("write the padded decode")
'''

PAD = Task(
    name="mla_pad_heads", notebook="04_mla_padding", minutes=15,
    statement="""\
**Task: pad 12 heads to 16 and keep the answer exact.** A matrix unit takes tiles of 16 rows;
`mma16(a, b)` stands in for one and refuses any other row count. Write
`padded_decode(q, cache, lengths, scale, mma16)` for MLA's absorbed decode: pad the H query heads to 16
rows, compute the scores and the value sum with `mma16`, mask every position a token may not see
(past its own position, which also hides the stale rows past `lengths`), and return only the H real
heads' `o` and natural-log `lse`. `check` compares with `k3lab.nn.mla.latent_attention` in fp64 and
counts your `mma16` calls.""",
    signature="padded_decode(q: Tensor[B, Tq, H, 576], cache: Tensor[B, L, 576], lengths: Tensor[B], "
              "scale: float, mma16) -> (o: Tensor[B, Tq, H, 512], lse: Tensor[B, Tq, H])",
    outputs=("o", "lse"), cases=_pad_cases, reference=_pad_reference, solution=padded_decode_solution,
    stub=PAD_STUB, run=_pad_run,
    forbidden=("k3lab.nn.mla.latent_attention", "k3lab.ops.mla_decode.peers.reference",
               "k3lab.ops.mla_decode.peers.einsum_decode", "k3lab.ops.mla_decode.peers.sdpa_decode",
               "k3lab.ops.mla_decode.plan_before", "k3lab.ops.mla_decode.plan_after",
               "k3lab.ops.mla_decode.mla_decode_before", "k3lab.ops.mla_decode.mla_decode_after"),
    hints=(
        "Padding rows cost nothing in the answer: no head's softmax sees another head's scores, so "
        "whatever rows H..15 hold never reaches the H real heads, as long as you drop them at the end.",
        "Copy q into a zero [B, Tq, 16, 576] tensor; scores = mma16(q16, cache^T) * scale are "
        "[B, Tq, 16, L]. Token t of request b sits at position lengths[b] - Tq + t and sees every "
        "position up to and including its own: set the others to -inf before the logsumexp. Then "
        "o = mma16(softmax, the first 512 latent columns of the cache).",
        "`q16 = torch.zeros(B, Tq, 16, D, dtype=q.dtype); q16[:, :, :H] = q`; "
        "`s = mma16(q16, cache.transpose(1, 2)[:, None]) * scale`; "
        "`qpos = lengths[:, None] - Tq + torch.arange(Tq)`; `visible = torch.arange(L) <= qpos[..., None]`; "
        "`s = s.masked_fill(~visible[:, :, None, :], float('-inf'))`; logsumexp, exp, the second mma16, "
        "and keep `[:, :, :H]` of both results.",
    ))
