"""The optimized ops, one module or package per op (see each op's docstring for its contract).

Shared by the op packages: `Backend` (one row of an op's backend table), `forced_backend` (the name a
caller argument or the op's K3LAB_<OP>_BACKEND variable forces) and `triton_status`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


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
