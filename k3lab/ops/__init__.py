"""The optimized ops, one module or package per op (see each op's docstring for its contract).

Shared by the op packages: `Backend` (one row of an op's backend table), `forced_backend` (the name a
caller argument or the op's K3LAB_<OP>_BACKEND variable forces), `triton_status`, and
`positive_finite`, the one rule for every op's scales and epsilons.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import Callable

FP32_TINY, FP32_MAX = 2.0 ** -126, (2.0 - 2.0 ** -23) * 2.0 ** 127  # fp32's normal range (kernel scalars)


def positive_finite(name: str, value) -> float:
    """`value` as a float; ValueError naming `name` unless it is a real number (not a bool, not a
    tensor, which would cost a host sync), finite and > 0, and a normal fp32 number (the kernels take
    it in fp32, where 1e39 is inf and 1e-45 is 0). The one rule for the scales and epsilons of every
    op and backend: a NaN scale gives an all-NaN output, a negative one a different softmax, a
    negative eps a NaN norm, and the references and the CUDA backends refuse them."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not FP32_TINY <= value <= FP32_MAX):
        raise ValueError(f"{name} must be a positive finite number within fp32's normal range "
                         f"[{FP32_TINY:.3g}, {FP32_MAX:.3g}], got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: `available()` -> (ok, why); lower priority is tried first."""

    name: str
    priority: int
    available: Callable[[], tuple[bool, str]]


def forced_backend(given: str | None, env_name: str, names: tuple[str, ...],
                   arg: str = "backend") -> str | None:
    """The backend forced by the caller's argument `given`, else by the environment variable `env_name`,
    else None; ValueError naming the argument (or the variable) when the name is not one of `names`."""
    name = given if given is not None else (os.environ.get(env_name) or None)
    if name is not None and name not in names:
        where = arg if given is not None else env_name
        raise ValueError(f"{where} must be one of {names} or None, got {name!r}")
    return name


def triton_status() -> tuple[bool, str]:
    """(True, Triton's version) when Triton imports here (GPU, or its interpreter on CPU), else (False,
    why)."""
    try:
        import triton
    except ImportError:
        return False, "Triton is not installed"
    return True, f"Triton {triton.__version__} kernels"
