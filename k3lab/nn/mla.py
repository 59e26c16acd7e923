"""Multi-head Latent Attention (MLA) references in plain PyTorch.

`latent_attention` is the absorbed decode core every MLA kernel in k3lab is checked against:
all query heads attend to one shared 576-wide latent row per position (MQA over the latent),
keys are the whole row, values its first `value_dim` (512) columns.
"""

from __future__ import annotations

import torch


def latent_attention(q, cache, lengths=None, scale=None, value_dim=512):
    """Absorbed MLA attention over a latent cache, in fp32 (fp64 when given fp64).

    q: [B, Tq, H, D] (D = 576: the 512 absorbed nope part and the 64 rope part);
    cache: [B, L, D]; lengths: [B] ints, positions of each request's cache in use (the Tq new
    tokens included), default L. Query t of request b sits at position lengths[b] - Tq + t and sees
    positions up to and including its own (causal inside a verification group).
    scale defaults to 192^-0.5 (K3's qk head dim, unchanged by absorption).
    Returns (o [B, Tq, H, value_dim], lse [B, Tq, H]); lse is the natural-log log-sum-exp of the
    scaled scores, the figure partial results are merged by (DCP, split-history decode).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Tq, H, D], got shape {tuple(q.shape)}")
    B, Tq, H, D = q.shape
    if cache.dim() != 3 or cache.shape[0] != B or cache.shape[2] != D:
        raise ValueError(f"cache must be [B={B}, L, D={D}], got {tuple(cache.shape)}")
    if not 0 < value_dim <= D:
        raise ValueError(f"value_dim must be in (0, {D}], got {value_dim}")
    L = cache.shape[1]
    if lengths is None:
        lengths = torch.full((B,), L, dtype=torch.long, device=q.device)
    lengths = torch.as_tensor(lengths, device=q.device).long()
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(lengths.shape)}")
    if bool((lengths > L).any()):
        raise ValueError(f"lengths must be <= the cache length {L}, got max {int(lengths.max())}")
    if bool((lengths < Tq).any()):
        raise ValueError(f"lengths must be >= q_len {Tq} (the new tokens are in the cache), "
                         f"got min {int(lengths.min())}")
    scale = 192 ** -0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 or cache.dtype == torch.float64 else torch.float32
    qf, cf = q.to(dt), cache.to(dt)
    scores = torch.einsum("bthd,bld->bthl", qf, cf) * scale
    pos = torch.arange(L, device=q.device)
    qpos = lengths[:, None] - Tq + torch.arange(Tq, device=q.device)[None, :]  # [B, Tq]
    visible = pos[None, None, :] <= qpos[:, :, None]  # [B, Tq, L]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = (scores - lse.unsqueeze(-1)).exp()
    o = torch.einsum("bthl,blv->bthv", p, cf[..., :value_dim])
    return o, lse
