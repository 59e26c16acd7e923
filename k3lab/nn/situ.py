"""SiTU-GLU, K3's gated activation (docs/k3.md).

    a = 4 tanh(g / 4) sigmoid(g)   (a SiLU whose positive side saturates at 4)
    u' = 25 tanh(u / 25)           (the linear branch, soft-clamped to (-25, 25))
    out = a * u'

computed in fp32 (fp64 when given fp64) and returned in the inputs' dtype. The bounds keep the
product finite in low precision whatever the projections produce.
"""

from __future__ import annotations

import torch

from .norms import compute_dtype

GATE_BOUND = 4.0
UP_BOUND = 25.0


def _check_float(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got "
                         f"{getattr(t, 'dtype', type(t).__name__)}")


def situ_gate(g: torch.Tensor) -> torch.Tensor:
    """4 tanh(g/4) sigmoid(g), in g's compute dtype (no cast back)."""
    _check_float("g", g)
    return GATE_BOUND * torch.tanh(g / GATE_BOUND) * torch.sigmoid(g)


def situ_up(u: torch.Tensor) -> torch.Tensor:
    """25 tanh(u/25), in u's compute dtype (no cast back)."""
    _check_float("u", u)
    return UP_BOUND * torch.tanh(u / UP_BOUND)


def situ_glu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU of the gate projection g and the up projection u (same shape)."""
    _check_float("g", g)
    _check_float("u", u)
    if g.shape != u.shape:
        raise ValueError(f"u must have g's shape {tuple(g.shape)}, got {tuple(u.shape)}")
    dt = compute_dtype(g, u)
    return (situ_gate(g.to(dt)) * situ_up(u.to(dt))).to(torch.promote_types(g.dtype, u.dtype))
