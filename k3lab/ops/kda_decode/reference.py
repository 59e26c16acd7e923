"""The plain PyTorch reference of one KDA decode step, from k3lab.nn pieces, in fp32 or fp64."""

from __future__ import annotations

import torch

from k3lab.nn import KDACache
from k3lab.nn.kda import kda_beta, kda_gate, kda_recurrent, short_conv
from k3lab.nn.norms import gated_rms_norm, l2_normalize
from k3lab.ops.kda_decode.inputs import HEAD_DIM, L2_EPS, validate


def reference(q, k, v, g_raw, beta_raw, gate, cache, weights, *, state_layout="kv",
              compute_dtype=torch.float32, handoff_dtype=None) -> tuple[torch.Tensor, KDACache]:
    """The decode step from k3lab.nn pieces, in `compute_dtype` (fp32 or fp64). Pure: returns
    (out [B, H*V], new cache), both in compute_dtype (conv states too: they hold past inputs exactly),
    and leaves `cache` untouched. handoff_dtype (e.g. bf16) rounds the conv outputs and o to it, where
    the unfused chain stores them in memory."""
    B, H = validate(q, k, v, g_raw, beta_raw, gate, cache, weights, None, state_layout)
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    dt, K, w = compute_dtype, HEAD_DIM, weights

    def handoff(x):
        return x if handoff_dtype is None else x.to(handoff_dtype).to(dt)

    def conv(x, weight, state):  # short_conv on one token: [B, C] -> [B, C], new state [B, C, 3]
        y, new_state = short_conv(x.to(dt)[:, None], weight.to(dt), state.to(dt))
        return handoff(y[:, 0]), new_state

    yq, cq = conv(q, w.conv_q, cache.conv_q)
    yk, ck = conv(k, w.conv_k, cache.conv_k)
    yv, cv = conv(v, w.conv_v, cache.conv_v)
    qn = l2_normalize(yq.view(B, 1, H, K), eps=L2_EPS)
    kn = l2_normalize(yk.view(B, 1, H, K), eps=L2_EPS)
    g = kda_gate(g_raw.to(dt), w.A_log.to(dt), w.dt_bias.to(dt), w.lower_bound)  # [B, H, K]
    beta = kda_beta(beta_raw.to(dt))  # [B, H]
    S0 = cache.state.to(dt)
    if state_layout == "vk":
        S0 = S0.transpose(-1, -2)
    o, S = kda_recurrent(qn, kn, yv.view(B, 1, H, K), g[:, None], beta[:, None], scale=K ** -0.5,
                         initial_state=S0)
    o = handoff(o)
    out = gated_rms_norm(o, gate.to(dt).view(B, 1, H, K), w.o_norm.to(dt), w.eps)
    if state_layout == "vk":
        S = S.transpose(-1, -2)
    return out.reshape(B, H * K), KDACache(cq, ck, cv, S.contiguous())


def write_back(cache: KDACache, new: KDACache) -> None:
    for name in ("conv_q", "conv_k", "conv_v", "state"):
        getattr(cache, name).copy_(getattr(new, name))
