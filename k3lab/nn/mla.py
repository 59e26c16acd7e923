"""Multi-head Latent Attention (MLA) references in plain PyTorch.

`latent_attention` is the absorbed decode core every MLA kernel in k3lab is checked against:
all query heads attend to one shared 576-wide latent row per position (MQA over the latent),
keys are the whole row, values its first `value_dim` (512) columns.

`MultiHeadLatentAttention` is the whole layer (docs/k3.md) in its two forms:
- naive (prefill): expand the cached latents through kv_b_proj into per-head keys
  [k_nope 128 | k_pe 64, shared by all heads] and values (128), then causal softmax attention;
- absorbed (decode): fold kv_b_proj's key half into the query (q_lat = q_nope @ W_UK, 512 wide),
  attend over the 576-wide latent rows with `latent_attention`, and unfold the result through the
  value half (o = o_lat @ W_UV).
Both use the softmax scale 192^-0.5 and no rotary embedding (K3 is NoPE: the 64 "rope" dims are
stored and used as they are). The output gate sigmoid(g_proj x) is applied before o_proj.
`MLACache` is the latent history: one 576-wide row per position, appended to at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .norms import RMSNorm, check_hidden_states, compute_dtype


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
    B, Tq, _, D = q.shape
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


# ------------------------------------------------------------------ the layer and its cache
@dataclass
class MLACache:
    """The latent history of one MLA layer: latent [B, L, 576] = [kv_a_layernorm(c) 512 | k_pe 64] per
    position. It grows by one row per token (576 B per position in FP8; here in the model's dtype)."""

    latent: torch.Tensor

    @property
    def length(self) -> int:
        return self.latent.shape[1]

    def append(self, rows: torch.Tensor) -> MLACache:
        """A new cache with `rows` [B, T, 576] after the existing positions (the old one is untouched)."""
        if rows.dim() != 3 or rows.shape[0] != self.latent.shape[0] or rows.shape[2] != self.latent.shape[2]:
            raise ValueError(f"rows must be [B={self.latent.shape[0]}, T, {self.latent.shape[2]}], "
                             f"got {tuple(rows.shape)}")
        return MLACache(torch.cat([self.latent, rows.to(self.latent.dtype)], dim=1))

    def entries(self) -> dict[str, torch.Tensor]:
        return {"latent": self.latent}

    def nbytes(self) -> int:
        return self.latent.numel() * self.latent.element_size()


class MultiHeadLatentAttention(nn.Module):
    """One MLA layer, weights [out, in] under K3's names.

    forward(x [B, T, hidden], cache=None, form=None) -> (out [B, T, hidden], new_cache). x is the
    pre-normed hidden state; the T new tokens follow the cache's positions. form: 'naive',
    'absorbed', or None (naive for T > 1, absorbed for T = 1). The input cache is never modified."""

    def __init__(self, config, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        h, nh = config.hidden_size, config.num_attention_heads
        self.hidden_size, self.num_heads = h, nh
        self.nope_dim, self.rope_dim, self.v_dim = (
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
        )
        self.kv_lora_rank = config.kv_lora_rank
        self.latent_dim = config.mla_latent_dim
        self.scale = config.mla_softmax_scale
        # the official reference uses eps 1e-6 on the two low-rank norms, vLLM 1e-5; k3lab follows the config
        self.q_a_proj = nn.Linear(h, config.q_lora_rank, bias=False, **f)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps, **f)
        self.q_b_proj = nn.Linear(config.q_lora_rank, nh * config.qk_head_dim, bias=False, **f)
        self.kv_a_proj_with_mqa = nn.Linear(h, config.mla_latent_dim, bias=False, **f)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps, **f)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, nh * (self.nope_dim + self.v_dim), bias=False, **f)
        self.g_proj = nn.Linear(h, nh * self.v_dim, bias=False, **f)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=False, **f)

    def empty_cache(self, batch: int) -> MLACache:
        w = self.kv_a_proj_with_mqa.weight
        return MLACache(torch.zeros(batch, 0, self.latent_dim, device=w.device, dtype=w.dtype))

    def check_cache(self, cache: MLACache, batch: int) -> None:
        if not isinstance(cache, MLACache):
            raise ValueError(f"cache must be an MLACache or None, got {type(cache).__name__}")  # noqa: TRY004
        t = cache.latent
        if t.dim() != 3 or t.shape[0] != batch or t.shape[2] != self.latent_dim:
            raise ValueError(f"cache.latent must be [B={batch}, L, {self.latent_dim}], got {tuple(t.shape)}")

    # the two halves of kv_b_proj, per head: W_UK [H, 128, 512] makes keys, W_UV [H, 128, 512] values
    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def project(self, x):
        """(q_nope [B,T,H,128], q_pe [B,T,H,64], latent rows [B,T,576]) for the new tokens."""
        B, T = x.shape[:2]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, self.num_heads, -1)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return q_nope, q_pe, torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def attend_naive(self, q_nope, q_pe, latent):
        """Per-head keys and values expanded from every cached latent row; causal softmax. [B,T,H,128]."""
        B, T, H, _ = q_nope.shape
        L = latent.shape[1]
        kv = self.kv_b_proj(latent[..., :self.kv_lora_rank]).view(B, L, H, self.nope_dim + self.v_dim)
        dt = compute_dtype(q_nope, latent)
        k_nope, v = kv.to(dt).split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = latent[..., self.kv_lora_rank:].to(dt)  # [B, L, 64]: one rope key shared by all heads
        scores = (torch.einsum("bthd,blhd->bhtl", q_nope.to(dt), k_nope)
                  + torch.einsum("bthd,bld->bhtl", q_pe.to(dt), k_pe)) * self.scale
        qpos = L - T + torch.arange(T, device=latent.device)  # the new tokens are the last T positions
        visible = torch.arange(L, device=latent.device)[None, :] <= qpos[:, None]
        p = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.einsum("bhtl,blhv->bthv", p, v)

    def attend_absorbed(self, q_nope, q_pe, latent):
        """kv_b_proj folded into the query and the output: attention over the 576-wide rows. [B,T,H,128]."""
        dt = compute_dtype(q_nope, latent)
        w_uk, w_uv = (w.to(dt) for w in self.absorbed_weights())
        q_lat = torch.einsum("bthd,hdc->bthc", q_nope.to(dt), w_uk)  # [B, T, H, 512]
        o_lat, _ = latent_attention(torch.cat([q_lat, q_pe.to(dt)], dim=-1), latent.to(dt), scale=self.scale,
                                    value_dim=self.kv_lora_rank)
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv)

    def forward(self, x, cache=None, form=None):
        B, T = check_hidden_states(x, self.hidden_size, self.q_a_proj.weight.dtype)
        if cache is not None:
            self.check_cache(cache, B)
        if form not in (None, "naive", "absorbed"):
            raise ValueError(f"form must be None, 'naive' or 'absorbed', got {form!r}")
        q_nope, q_pe, rows = self.project(x)
        new_cache = (cache if cache is not None else self.empty_cache(B)).append(rows)
        if form == "naive" or (form is None and T > 1):
            o = self.attend_naive(q_nope, q_pe, new_cache.latent)
        else:
            o = self.attend_absorbed(q_nope, q_pe, new_cache.latent)
        gate = torch.sigmoid(self.g_proj(x).view(B, T, self.num_heads, self.v_dim).to(o.dtype))
        out = self.o_proj((o * gate).to(x.dtype).reshape(B, T, self.num_heads * self.v_dim))
        return out, new_cache
