"""The 'torch' row of mla_decode's backend table: the plain-PyTorch reference as a plan.

A plan here has the shape of the kernels' plans (validated once by `inputs.validate`, called with no
arguments, returning (o, lse) in its own buffers, `backend` and `facts()`), and computes
`k3lab.nn.mla.latent_attention` in fp32 (fp64 for fp64 inputs) over the cache, a paged one gathered
first. It is the before and the after alike: both compute this; the split count, padding and folding
of the kernels do not change the result, so the reference takes and ignores them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3lab.nn.mla import latent_attention
from k3lab.ops.mla_decode.inputs import VALUE_DIM, check_scale, gather_paged, validate

NAME = "torch"


@dataclass
class ReferencePlan:
    """A validated reference decode: `plan()` computes (o, lse) into `out` [B, Tq, H, 512] (q's dtype)
    and `lse` [B, Tq, H] (fp32, fp64 for fp64 inputs), overwritten by each call."""

    q: torch.Tensor = field(repr=False)
    cache: torch.Tensor = field(repr=False)  # [B, L, 576], or a paged pool gathered by block_table per call
    block_table: torch.Tensor | None = field(repr=False)  # None: a contiguous cache
    lengths: torch.Tensor = field(repr=False)
    scale: float
    out: torch.Tensor
    lse: torch.Tensor
    backend: str = NAME
    num_splits: int = 1
    launches: int = 0  # plain PyTorch ops, no kernel of k3lab's own

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache if self.block_table is None else gather_paged(self.cache, self.block_table)
        o, lse = latent_attention(self.q, cache, lengths=self.lengths, scale=self.scale, value_dim=VALUE_DIM)
        self.out.copy_(o)
        self.lse.copy_(lse)
        return self.out, self.lse

    def facts(self) -> dict:
        return {"backend": self.backend, "num_splits": self.num_splits, "launches": self.launches}


def plan(q, cache, lengths=None, *, block_table=None, scale=None, **_kernel_options) -> ReferencePlan:
    """Validate once (the kernels' rules, `inputs.validate`) and return a `ReferencePlan`. The kernels'
    options (num_splits, pad, fold_heads, form, pad_fill) are accepted and have no effect here."""
    inp = validate(q, cache, lengths, block_table)
    scale = check_scale(scale)
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    wide = torch.float64 if torch.float64 in (q.dtype, cache.dtype) else torch.float32
    out = torch.empty(B, Tq, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Tq, H, dtype=wide, device=q.device)
    return ReferencePlan(q, cache, inp.block_table if inp.paged else None, inp.lengths, scale, out, lse)
