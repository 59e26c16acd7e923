"""Argument checks shared by k3lab.speculative: each names the bad argument and what was expected."""

from __future__ import annotations

import math
import numbers

import numpy as np



def probabilities(name: str, values) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of probabilities in [0, 1]; got {values!r}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of probabilities; got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must not contain NaN or infinity; got {arr.tolist()}")
    if np.any(arr < 0) or np.any(arr > 1):
        raise ValueError(f"{name} must lie in [0, 1]; got {arr.tolist()}")
    return arr


def probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a probability in [0, 1]; got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > 1:
        raise ValueError(f"{name} must be a probability in [0, 1]; got {value!r}")
    return value


def count_arg(name: str, value, *, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high} (the length of the acceptance curve or cost table); "
                         f"got {value}")
    return value


def cost_arg(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a non-negative time in microseconds; got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative time in microseconds; got {value!r}")
    return value
