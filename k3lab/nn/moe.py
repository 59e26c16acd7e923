"""K3's MLPs: the dense SiTU-GLU MLP of layer 0 and the latent mixture of experts of layers 1-92.

Latent MoE (docs/k3.md), for a token x [7168]:

    s = sigmoid(x_fp32 @ gate^T)                    896 scores
    idx = topk(s + e_score_correction_bias, 16)     the bias steers *which* experts, never how much
    w = s[idx] / (sum s[idx] + 1e-20) * scaling     weights from the unbiased scores, summing to 1
    z = routed_expert_down_proj(x)                  7168 -> 3584, once per token, shared by its experts
    y_lat = RMSNorm_3584(sum_j w_j expert_idx_j(z)) each expert: w2(SiTU-GLU(w1 z, w3 z)), 3584 -> 3072 ->
    3584
    out = routed_expert_up_proj(y_lat) + shared(x)  3584 -> 7168; the shared MLP sees the original x
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from k3lab.runtime.args import int_arg

from .norms import RMSNorm, check_hidden_states
from .situ import situ_glu


def check_scaling(scaling) -> float:
    """The router's `scaling` as a float: a real number (not a bool, not a tensor) and finite, since an
    infinite or NaN one makes every weight inf or NaN; ValueError naming it otherwise. One rule for this
    reference and the router op (k3lab.ops.moe_router)."""
    if isinstance(scaling, bool) or not isinstance(scaling, numbers.Real) or not math.isfinite(scaling):
        raise ValueError(f"scaling must be a real number, finite, got {scaling!r}")
    return float(scaling)


def route(logits, bias, top_k, scaling=1.0, renormalize=True):
    """Pick `top_k` experts per token and their weights.

    logits: [N, E] router logits (computed in fp32); bias: [E] e_score_correction_bias.
    Returns (weights [N, top_k] fp32, idx [N, top_k] long, scores [N, E] fp32). Selection uses
    scores + bias; the weights use the scores alone, renormalised over the chosen experts. top_k an int
    in [1, E] (never a bool), scaling finite, renormalize a bool: ValueError naming the argument."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point [N, E] tensor, got "
                         f"{getattr(logits, 'shape', logits)}")
    E = logits.shape[1]
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (E,)):
        raise ValueError(f"bias must be a [E={E}] tensor or None, got {getattr(bias, 'shape', bias)!r}")
    top_k = int_arg("top_k", top_k, low=1, high=E)
    scaling = check_scaling(scaling)
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    dt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scores = torch.sigmoid(logits.to(dt))
    choice = scores if bias is None else scores + bias.to(dt)
    idx = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(-1, idx)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, idx, scores


class SiTUMLP(nn.Module):
    """down_proj(SiTU-GLU(gate_proj x, up_proj x)): layer 0's dense MLP and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.hidden_size = hidden_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **f)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, **f)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, **f)

    def forward(self, x):
        return self.down_proj(situ_glu(self.gate_proj(x), self.up_proj(x)))


class RoutedExpert(nn.Module):
    """One routed expert at the latent width: w2(SiTU-GLU(w1 z, w3 z)), 3584 -> 3072 -> 3584."""

    def __init__(self, latent_size: int, intermediate_size: int, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.w1 = nn.Linear(latent_size, intermediate_size, bias=False, **f)
        self.w3 = nn.Linear(latent_size, intermediate_size, bias=False, **f)
        self.w2 = nn.Linear(intermediate_size, latent_size, bias=False, **f)

    def forward(self, z):
        return self.w2(situ_glu(self.w1(z), self.w3(z)))


class MoEGate(nn.Module):
    """The router: weight [E, hidden] and e_score_correction_bias [E] (fp32, selection only)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scaling: float = 1.0,
                 renormalize: bool = True, *, device=None, dtype=None):
        super().__init__()
        self.top_k, self.scaling, self.renormalize = top_k, scaling, renormalize
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size, device=device, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, device=device, dtype=torch.float32)
        )

    def forward(self, x):
        """x [N, hidden] -> (weights [N, k] fp32, idx [N, k], scores [N, E] fp32); logits in fp32."""
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        logits = x.to(dt) @ self.weight.to(dt).t()
        return route(logits, self.e_score_correction_bias, self.top_k, self.scaling, self.renormalize)


class LatentMoE(nn.Module):
    """K3's MoE layer. forward(x [B, T, hidden]) -> [B, T, hidden]."""

    def __init__(self, config, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        h, lat = config.hidden_size, config.routed_expert_hidden_size
        self.hidden_size = h
        self.gate = MoEGate(h, config.num_experts, config.num_experts_per_token, config.routed_scaling_factor,
                            config.norm_topk_prob, **f)
        self.routed_expert_down_proj = nn.Linear(h, lat, bias=False, **f)
        self.experts = nn.ModuleList(RoutedExpert(lat, config.moe_intermediate_size, **f)
                                     for _ in range(config.num_experts))
        self.routed_expert_norm = RMSNorm(lat, eps=config.rms_norm_eps, **f)
        self.routed_expert_up_proj = nn.Linear(lat, h, bias=False, **f)
        self.shared_experts = (SiTUMLP(h, config.shared_intermediate_size, **f)
                               if config.num_shared_experts else None)

    def routed_latent(self, x_flat):
        """The combined expert output at the latent width, before its norm: [N, 3584] in fp32."""
        weights, idx, _ = self.gate(x_flat)
        z = self.routed_expert_down_proj(x_flat)
        acc_dtype = torch.float64 if x_flat.dtype == torch.float64 else torch.float32
        y = torch.zeros(z.shape, dtype=acc_dtype, device=z.device)
        for e in idx.unique().tolist():  # only the experts some token chose
            rows, slot = (idx == e).nonzero(as_tuple=True)
            # a token picks an expert at most once, so `rows` has no repeats (index_add_ is very slow on CPU)
            y[rows] += weights[rows, slot, None].to(acc_dtype) * self.experts[e](z[rows]).to(acc_dtype)
        return y

    def forward(self, x):
        B, T = check_hidden_states(x, self.hidden_size, self.routed_expert_down_proj.weight.dtype)
        x_flat = x.reshape(B * T, -1)
        y_lat = self.routed_expert_norm(self.routed_latent(x_flat), out_dtype=x.dtype)
        out = self.routed_expert_up_proj(y_lat)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x_flat)
        return out.view(B, T, -1)


class DenseMLP(SiTUMLP):
    """Layer 0's MLP (first_k_dense_replace = 1): SiTU-GLU at width `intermediate_size` (K3: 33792)."""

    def __init__(self, config, *, device=None, dtype=None):
        super().__init__(config.hidden_size, config.intermediate_size, device=device, dtype=dtype)

    def forward(self, x):
        check_hidden_states(x, self.hidden_size, self.gate_proj.weight.dtype)
        return super().forward(x)
