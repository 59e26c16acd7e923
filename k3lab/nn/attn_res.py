"""Block Attention Residuals (AttnRes), K3's replacement for the plain residual stream.

Instead of adding every layer's output into one running sum, K3 keeps a few *block* sums (the
embedding, then one per 12 decoder layers) and the running partial sum of the current block. Before
each attention and each MLP, and at the model output, it mixes those sources with a learned,
input-dependent softmax over depth (docs/k3.md):

    keys_i = RMSNorm(V_i) (no weight);  logit_i = sum_d keys_i[d] * norm_weight[d] * proj_weight[d]
    p = softmax_i(logit_i);             h = sum_i p_i V_i          (fp32)

The mix is per position: it never looks at other tokens, so decoding carries no AttnRes history
from one step to the next. `AttnResState` is the depth-wise state *within* one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .norms import compute_dtype, rms_norm


def attn_res_mix(sources, norm_weight, proj_weight, eps=1e-5):
    """Mix `sources` [S, ..., D] over their first dimension; returns h [..., D] in fp32 (fp64 for fp64).

    norm_weight: [D] (the *_res_norm weight); proj_weight: [D] or [1, D] (the *_res_proj weight).
    One source mixes to itself (softmax over one logit is 1)."""
    if not isinstance(sources, torch.Tensor) or sources.dim() < 2 or not sources.is_floating_point():
        raise ValueError(f"sources must be a floating-point tensor [S, ..., D], got "
                         f"{getattr(sources, 'shape', sources)}")
    if sources.shape[0] < 1:
        raise ValueError("sources must hold at least one source")
    D = sources.shape[-1]
    if norm_weight.shape != (D,):
        raise ValueError(f"norm_weight must be [D={D}], got {tuple(norm_weight.shape)}")
    if proj_weight.shape not in ((D,), (1, D)):
        raise ValueError(f"proj_weight must be [D={D}] or [1, D={D}], got {tuple(proj_weight.shape)}")
    dt = compute_dtype(sources, norm_weight, proj_weight)
    v = sources.to(dt)
    keys = rms_norm(v, None, eps)
    logits = (keys * (norm_weight.to(dt) * proj_weight.reshape(D).to(dt))).sum(-1)  # [S, ...]
    p = logits.softmax(dim=0)
    return (p.unsqueeze(-1) * v).sum(0)


@dataclass(frozen=True)
class AttnResState:
    """Depth state of the tokens in flight: completed block sums and the current block's partial sum,
    each [B, T, D] in the model's dtype (the running sums keep that rounding, as in the seed)."""

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor

    @classmethod
    def start(cls, embeddings: torch.Tensor) -> AttnResState:
        """Before layer 0: no block yet; the partial sum is the token embeddings."""
        return cls((), embeddings)

    def sources(self) -> torch.Tensor:
        """[S, B, T, D]: the completed blocks, then the partial sum."""
        return torch.stack([*self.blocks, self.partial])

    def mix(self, norm_weight, proj_weight, eps) -> torch.Tensor:
        return attn_res_mix(self.sources(), norm_weight, proj_weight, eps)

    def push_block(self) -> AttnResState:
        """Close the current block: its partial sum becomes a stored block and the partial restarts at 0."""
        return AttnResState((*self.blocks, self.partial), torch.zeros_like(self.partial))

    def add(self, delta: torch.Tensor) -> AttnResState:
        return AttnResState(self.blocks, self.partial + delta.to(self.partial.dtype))
