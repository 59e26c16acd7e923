"""Acceptance curves (conditional per-position acceptance) and the committed-tokens formula."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from k3lab.speculative.inputs import count_arg, probabilities, probability


# The seed (section 6): AgentX's fixed acceptance reference commits 3.00 tokens per cycle with
# three drafts and 3.36 with four, counting the recovery or bonus token.
REFERENCE_COMMITTED: dict[int, float] = {3: 3.00, 4: 3.36}


# --------------------------------------------------------------------------------------------
# Acceptance curves
# --------------------------------------------------------------------------------------------


def constant_acceptance(rate: float, depth: int) -> np.ndarray:
    """Every drafted position is accepted with the same conditional probability ``rate``."""
    rate = probability("rate", rate)
    depth = count_arg("depth", depth)
    return np.full(depth, rate)


def geometric_acceptance(first: float, decay: float, depth: int) -> np.ndarray:
    """a[i] = first * decay**i: later drafts are accepted less often (the drafter drifts further
    from the target the more of its own tokens it conditions on)."""
    first = probability("first", first)
    decay = probability("decay", decay)
    depth = count_arg("depth", depth)
    return first * decay ** np.arange(depth, dtype=np.float64)


def _bisect(f, lo: float, hi: float, iters: int = 200) -> float:
    """Root of an increasing function f on [lo, hi] (f(lo) <= 0 <= f(hi))."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_geometric_acceptance(targets: Mapping[int, float] = REFERENCE_COMMITTED) -> tuple[float, float]:
    """(first, decay) of the geometric curve whose expected committed tokens hit two targets.

    ``targets`` maps two depths k1 < k2 to expected committed tokens per cycle. For a fixed decay,
    committed(k1) rises with ``first``, so ``first`` is found by bisection; the outer bisection then
    moves the decay until committed(k2) matches as well.
    """
    if not isinstance(targets, Mapping) or len(targets) != 2:
        raise ValueError(f"targets must map exactly two depths to committed tokens; got {targets!r}")
    (k1, e1), (k2, e2) = sorted((count_arg("targets depth", k), float(e)) for k, e in targets.items())
    if k1 == k2:
        raise ValueError(f"targets must name two different depths; got {targets!r}")
    if not (1 <= e1 <= k1 + 1 and e1 < e2 <= e1 + (k2 - k1)):
        raise ValueError(f"targets are not reachable by any acceptance curve: {targets!r}")

    def committed(first: float, decay: float, k: int) -> float:
        return float(1.0 + np.cumprod(first * decay ** np.arange(k)).sum())

    def first_for(decay: float) -> float:
        return _bisect(lambda a: committed(a, decay, k1) - e1, 0.0, 1.0)

    # Slower decay (larger `decay`) with committed(k1) held fixed gives a larger committed(k2).
    lo, hi = 1e-6, 1.0
    if committed(first_for(hi), hi, k2) < e2 or committed(first_for(lo), lo, k2) > e2:
        raise ValueError(f"targets need a rising acceptance curve, which a geometric decay cannot give: "
                         f"{targets!r}")
    decay = _bisect(lambda d: committed(first_for(d), d, k2) - e2, lo, hi)
    return first_for(decay), decay


def reference_acceptance(depth: int = 8) -> np.ndarray:
    """A stand-in for AgentX's fixed acceptance reference, ``depth`` positions long.

    AgentX's own curve file is not public here. This is a geometric decay a[i] = first * decay**i
    with its two parameters fitted so that 3 drafts commit 3.00 and 4 drafts commit 3.36 tokens per
    cycle, the two figures the seed quotes (first ~ 0.835, decay ~ 0.951). It reproduces those two
    numbers and nothing else about the real curve: positions beyond the fourth are extrapolation.
    """
    depth = count_arg("depth", depth)
    first, decay = fit_geometric_acceptance(REFERENCE_COMMITTED)
    return first * decay ** np.arange(depth, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# The formula
# --------------------------------------------------------------------------------------------


def _survival(acceptance: np.ndarray) -> np.ndarray:
    """S[j] = P(the first j drafts are all accepted), j = 0..len; S[0] = 1."""
    return np.concatenate(([1.0], np.cumprod(acceptance)))


def expected_committed_all(acceptance) -> np.ndarray:
    """Expected committed tokens per cycle for every depth k = 1..len(acceptance) (entry k - 1).

    A cycle commits token j + 1 (j = 1..k) exactly when the first j drafts are accepted, and always
    commits one token from the target (recovery or bonus); by linearity of expectation
    E[committed | k] = S[0] + S[1] + ... + S[k] with S[j] = a[0] * ... * a[j-1].
    """
    a = probabilities("acceptance", acceptance)
    return np.cumsum(_survival(a))[1:]


def expected_committed(acceptance, depth: int) -> float:
    """Expected committed tokens per cycle when drafting ``depth`` tokens (recovery/bonus counted)."""
    a = probabilities("acceptance", acceptance)
    depth = count_arg("depth", depth, high=a.size)
    return float(_survival(a[:depth]).sum())


def committed_distribution(acceptance, depth: int) -> np.ndarray:
    """P(a cycle commits c tokens) for c = 1..depth + 1 (entry c - 1).

    c <= depth: the first c - 1 drafts accepted, draft c rejected; c = depth + 1: all accepted.
    """
    a = probabilities("acceptance", acceptance)
    depth = count_arg("depth", depth, high=a.size)
    s = _survival(a[:depth])
    return np.concatenate((s[:-1] * (1.0 - a[:depth]), s[-1:]))


def break_even_growth(acceptance) -> np.ndarray:
    """committed(k + 1) / committed(k) - 1 for k = 1..len - 1 (entry k - 1): going from k to k + 1
    drafts raises the rate only if the whole cycle grows by less than this fraction."""
    e = expected_committed_all(acceptance)
    return e[1:] / e[:-1] - 1.0
