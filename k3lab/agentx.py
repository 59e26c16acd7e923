"""The seed's headline arithmetic, from its inputs (docs/k3.md, "AgentX"): tokens per dollar, the
ratios it quotes, and reading a throughput-vs-interactivity curve at a target interactivity.

    tokens per dollar = total tokens/s per GPU x 3600 / (USD per GPU-hour)

The seed's inputs at 50 tokens/s/user P90 interactivity: 7,567 (MI355X) and 6,083 (HGX B300) total
tokens/s/GPU at $1.50 and $2.26 per GPU-hour (SemiAnalysis's modelled TCO), which give 18.16 M and
9.69 M tokens per dollar: +87.4% tokens per dollar, +24.4% throughput, 46.6% lower cost per token.
`SEED` holds those inputs, labelled as the seed's; nothing here was measured by k3lab.

The public calculator reads a system's curve at a target interactivity by monotone interpolation
between measured points; `interpolate` does the same with Steffen's method, which never overshoots
the data (a monotone curve stays monotone, no new extrema between points).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class System:
    name: str
    tokens_per_s_gpu: float
    usd_per_gpu_hour: float


SEED = {"interactivity_tok_s_user": 50.0,
        "mi355x": System("AMD Instinct MI355X (seed)", 7567.0, 1.50),
        "b300": System("NVIDIA HGX B300 (seed)", 6083.0, 2.26)}


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def tokens_per_dollar(tokens_per_s_gpu: float, usd_per_gpu_hour: float) -> float:
    """Total tokens served per dollar of GPU time."""
    return (
        _positive("tokens_per_s_gpu", tokens_per_s_gpu)
        * 3600.0
        / _positive("usd_per_gpu_hour", usd_per_gpu_hour)
    )


def compare(a: System, b: System) -> dict[str, float]:
    """The seed's ratios of system `a` over `b`: tokens per dollar of each, tokens_per_dollar_gain
    (a/b - 1), throughput_gain (a/b - 1 in tokens/s/GPU), cost_per_token_lower (1 - cost_a/cost_b)."""
    ta = tokens_per_dollar(a.tokens_per_s_gpu, a.usd_per_gpu_hour)
    tb = tokens_per_dollar(b.tokens_per_s_gpu, b.usd_per_gpu_hour)
    return {"tokens_per_dollar_a": ta, "tokens_per_dollar_b": tb, "tokens_per_dollar_gain": ta / tb - 1,
            "throughput_gain": a.tokens_per_s_gpu / b.tokens_per_s_gpu - 1,
            "cost_per_token_lower": 1 - tb / ta}


def _steffen_slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    h = np.diff(x)
    d = np.diff(y) / h
    m = np.zeros_like(y)
    if len(x) == 2:
        return np.full_like(y, d[0])
    p = (d[:-1] * h[1:] + d[1:] * h[:-1]) / (h[:-1] + h[1:])
    m[1:-1] = (np.sign(d[:-1]) + np.sign(d[1:])) * np.minimum.reduce(
        [np.abs(d[:-1]), np.abs(d[1:]), 0.5 * np.abs(p)]
    )
    for end, (dd, hh, d2, h2) in ((0, (d[0], h[0], d[1], h[1])), (-1, (d[-1], h[-1], d[-2], h[-2]))):
        pe = dd * (1 + hh / (hh + h2)) - d2 * hh / (hh + h2)
        m[end] = 0.0 if pe * dd <= 0 else (2 * dd if abs(pe) > 2 * abs(dd) else pe)
    return m


def interpolate(x: Sequence[float], y: Sequence[float], at) -> np.ndarray | float:
    """The monotone (Steffen) interpolant through points (x, y) evaluated at `at`; x strictly
    increasing, at least two points; `at` outside [x[0], x[-1]] is refused (no extrapolation)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if x.ndim != 1 or x.shape != y.shape or len(x) < 2:
        raise ValueError(f"x and y must be 1-D of one length >= 2, got shapes {x.shape} and {y.shape}")
    if not np.all(np.diff(x) > 0):
        raise ValueError("x must be strictly increasing")
    q = np.asarray(at, dtype=float)
    if np.any(q < x[0]) or np.any(q > x[-1]):
        raise ValueError(f"at must lie within [{x[0]}, {x[-1]}] (no extrapolation), got {at!r}")
    m = _steffen_slopes(x, y)
    i = np.clip(np.searchsorted(x, q, side="right") - 1, 0, len(x) - 2)
    h = x[i + 1] - x[i]
    d = (y[i + 1] - y[i]) / h
    a = (m[i] + m[i + 1] - 2 * d) / h ** 2
    b = (3 * d - 2 * m[i] - m[i + 1]) / h
    s = q - x[i]
    out = y[i] + m[i] * s + b * s ** 2 + a * s ** 3
    return float(out) if out.ndim == 0 else out
