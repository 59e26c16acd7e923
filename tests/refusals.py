"""What the bad-input property tests share: the hypothesis settings, the check that a refusal names its
argument, and the integer rule (k3lab.ops.int_arg) written out independently, with a strategy that
draws the values a caller may pass as a length, a count or an index, good and bad."""

from __future__ import annotations

import math
import numbers

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def examples(n: int):
    """Deterministic hypothesis settings trying `n` cases (the interpreter is slow: kept small)."""
    return settings(max_examples=n, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def refused(exc: Exception, *names: str) -> None:
    """A refusal must name the argument it refuses."""
    assert any(n in str(exc) for n in names), f"refusal does not name any of {names}: {exc}"
    event(f"refused: {next(n for n in names if n in str(exc))}")


def as_int(value, low: int = 0, high: int | None = None) -> int | None:
    """The int a length, count or index stands for, or None where the ops must refuse it: a Python or
    numpy integer or a 0-d integer tensor in [low, high]; never a bool, a float or anything else."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() or value.dtype.is_floating_point or value.dtype == torch.bool:
            return None
        value = int(value)
    if not isinstance(value, numbers.Integral):
        return None
    v = int(value)
    return v if low <= v and (high is None or v <= high) else None


def int_like(low: int, high: int):
    """Values for an integer argument whose valid range is [low, high]: valid ones as Python ints,
    numpy ints and 0-d tensors, and the bad ones (bools, floats, negative, past the range, text)."""
    good = st.integers(low, high)
    return st.one_of(
        good, good, good.map(np.int64), good.map(torch.tensor),
        st.sampled_from([True, False, float(max(low, 1)), 2.5, math.nan, "3", None]),
        st.integers(high + 1, high + 3), st.integers(low - 3, low - 1),
        good.map(float), good.map(lambda v: torch.tensor(float(v))), good.map(lambda v: torch.tensor([v])),
    )
