"""Normalisations used across K3, in plain PyTorch.

All of them do their arithmetic in fp32 (fp64 when given fp64) and hand back the input's dtype:
bf16 squares and sums lose too much to be a reference.
"""

from __future__ import annotations

import torch
from torch import nn


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp64 if any tensor is fp64, else fp32: the precision references compute in."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t
                                in tensors) else torch.float32


def _require_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _require_vector(name: str, w: torch.Tensor | None, size: int) -> None:
    if w is None:
        return
    _require_float(name, w)
    if w.shape != (size,):
        raise ValueError(f"{name} must be [{size}] (the last dimension of x), got {tuple(w.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-5,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight * x * rsqrt(mean(x^2) + eps) over the last dimension, in fp32, cast back to x's dtype
    (or `out_dtype`). weight=None normalises without a scale (the AttnRes keys)."""
    _require_float("x", x)
    _require_vector("weight", weight, x.shape[-1])
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    dt = compute_dtype(x, weight)
    xf = x.to(dt)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(dt)
    return y.to(out_dtype or x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-5
                   ) -> torch.Tensor:
    """RMSNorm(x) * weight * sigmoid(gate), in fp32, cast back to x's dtype (KDA's output norm)."""
    _require_float("gate", gate)
    if gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {tuple(gate.shape)}")
    dt = compute_dtype(x, gate, weight)
    y = rms_norm(x, weight, eps, out_dtype=dt)
    return (y * torch.sigmoid(gate.to(dt))).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension, in fp32, cast back (KDA's q and k)."""
    _require_float("x", x)
    if not eps > 0:
        raise ValueError(f"eps must be positive, got {eps}")
    dt = compute_dtype(x)
    xf = x.to(dt)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """A learned-scale RMSNorm: parameter `weight` [dim]."""

    def __init__(self, dim: int, eps: float = 1e-5, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"dim must be a positive integer, got {dim!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype=out_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def check_hidden_states(x: torch.Tensor, hidden_size: int, dtype: torch.dtype,
                        name: str = "x") -> tuple[int, int]:
    """The input check every layer shares: `x` is [B, T >= 1, hidden_size] in the layer's weight dtype.
    Returns (B, T); raises ValueError naming `name` otherwise."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor [B, T, {hidden_size}], got {type(x).__name__}")  # noqa: TRY004
    if x.dim() != 3 or x.shape[-1] != hidden_size:
        raise ValueError(f"{name} must be [B, T, hidden_size={hidden_size}], got shape {tuple(x.shape)}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{name} must hold at least one token, got shape {tuple(x.shape)}")
    if x.dtype != dtype:
        raise ValueError(f"{name} must have the layer's weight dtype {dtype}, got {x.dtype}")
    return x.shape[0], x.shape[1]
