"""Result checks: a result against its fp32/fp64 reference under a per-dtype relative error bound
(`TOLERANCES`); NaN and Inf never pass."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


class CheckFailed(AssertionError):
    """A result is outside its dtype's bound, or holds NaN/Inf."""


@dataclass(frozen=True)
class Tolerance:
    """Bounds for a result computed in `dtype` against an fp32/fp64 reference.

    max_rel: max_i |got_i - ref_i| / max(|ref_i|, floor), with floor = rms(ref): elements much smaller
    than the typical magnitude are judged against that magnitude (their own relative error says
    nothing about a kernel that accumulates in low precision). rel_l2: ||got - ref|| / ||ref||.
    """

    max_rel: float
    rel_l2: float


# Sized from what rounding alone does to N(0,1) data (fp16: max_rel 4.9e-4, rel_l2 2.1e-4; bf16: 3.9e-3,
# 1.7e-3; fp8 e4m3: 5.9e-2, 2.6e-2; e5m2: 0.11, 0.053), with 5-10x room for the accumulation a kernel
# does in that format, yet tight enough that rounding to the next coarser format fails, and so do a
# wrong index or a missing term (O(1) errors). fp32 and fp64 leave room for a different summation order
# or algorithm (chunked vs recurrent) against an fp64 reference.
TOLERANCES: dict[str, Tolerance] = {
    "fp64": Tolerance(max_rel=1e-9, rel_l2=1e-11),
    "fp32": Tolerance(max_rel=2e-4, rel_l2=2e-5),
    "tf32": Tolerance(max_rel=5e-3, rel_l2=1e-3),
    "fp16": Tolerance(max_rel=5e-3, rel_l2=1e-3),
    "bf16": Tolerance(max_rel=5e-2, rel_l2=1e-2),
    "fp8": Tolerance(max_rel=3e-1, rel_l2=1e-1),          # e4m3
    "fp8_e5m2": Tolerance(max_rel=5e-1, rel_l2=2e-1),
}

_DTYPE_KEYS = {
    torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
}
for _name, _key in (("float8_e4m3fn", "fp8"), ("float8_e4m3fnuz", "fp8"), ("float8_e5m2", "fp8_e5m2"),
                    ("float8_e5m2fnuz", "fp8_e5m2")):
    if hasattr(torch, _name):
        _DTYPE_KEYS[getattr(torch, _name)] = _key
_ALIASES = {"float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "float16": "fp16",
            "half": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8", "e4m3": "fp8", "e5m2": "fp8_e5m2"}


def tolerance_for(dtype) -> tuple[str, Tolerance]:
    """(key, Tolerance) for a torch dtype or a name ('bf16', 'tf32', 'fp8', ...)."""
    if isinstance(dtype, torch.dtype):
        key = _DTYPE_KEYS.get(dtype)
    elif isinstance(dtype, str):
        key = _ALIASES.get(dtype.lower(), dtype.lower())
    else:
        key = None
    if key not in TOLERANCES:
        raise ValueError(f"dtype must be a floating torch dtype or one of {sorted(TOLERANCES)}, got "
                         f"{dtype!r}")
    return key, TOLERANCES[key]


def _error_figures(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    g = got.detach().to(torch.float64)
    r = ref.detach().to(device=g.device, dtype=torch.float64)
    if r.numel() == 0:
        return {"max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "ref_rms": 0.0}
    diff = (g - r).abs()
    ref_rms = float(r.pow(2).mean().sqrt())
    floor = max(ref_rms, 1e-30)
    max_rel = float((diff / torch.clamp(r.abs(), min=floor)).max())
    ref_norm = float(torch.linalg.vector_norm(r))
    diff_norm = float(torch.linalg.vector_norm(g - r))
    rel_l2 = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    return {"max_abs": float(diff.max()), "max_rel": max_rel, "rel_l2": rel_l2, "ref_rms": ref_rms}


def check(got: torch.Tensor, ref: torch.Tensor, *, dtype, name: str = "output",
          max_rel: float | None = None, rel_l2: float | None = None) -> dict[str, Any]:
    """Compare `got` with `ref` (computed in fp32/fp64). Returns the error figures (max_abs, max_rel,
    rel_l2, ref_rms, bounds, dtype); raises CheckFailed when either bound is exceeded or when got or
    ref holds NaN or Inf (always, whatever the bounds). `max_rel` / `rel_l2` override the dtype's
    bounds for one call (say why where you do)."""
    if not isinstance(got, torch.Tensor) or not isinstance(ref, torch.Tensor):
        kinds = f"{type(got).__name__} and {type(ref).__name__}"
        raise ValueError(f"{name}: got and ref must be tensors, got {kinds}")  # noqa: TRY004 - bad input is a ValueError here
    if tuple(got.shape) != tuple(ref.shape):
        raise ValueError(f"{name}: got has shape {tuple(got.shape)} but ref has {tuple(ref.shape)}")
    key, tol = tolerance_for(dtype)
    bound_rel = tol.max_rel if max_rel is None else max_rel
    bound_l2 = tol.rel_l2 if rel_l2 is None else rel_l2
    if not got.is_floating_point() and not got.is_complex():
        got = got.to(torch.float64)
    for label, t in (("got", got), ("ref", ref)):
        # upcast first: isfinite/isnan have no fp8 kernels; upcasting keeps NaN and Inf
        wide = t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)
        finite = torch.isfinite(wide)
        if not bool(finite.all()):
            bad = int((~finite).sum())
            n_nan = int(torch.isnan(wide).sum())
            raise CheckFailed(f"{name}: {label} has {bad} non-finite values ({n_nan} NaN, {bad - n_nan} Inf) "
                              f"of {t.numel()}")
    figs = _error_figures(got, ref)
    figs.update({"dtype": key, "bound_max_rel": bound_rel, "bound_rel_l2": bound_l2})
    problems = []
    if not figs["max_rel"] <= bound_rel:
        problems.append(f"max_rel {figs['max_rel']:.3e} > {bound_rel:.1e}")
    if not figs["rel_l2"] <= bound_l2:
        problems.append(f"rel_l2 {figs['rel_l2']:.3e} > {bound_l2:.1e}")
    if problems:
        raise CheckFailed(f"{name} ({key}): " + "; ".join(problems) +
                          f" (max_abs {figs['max_abs']:.3e}, ref rms {figs['ref_rms']:.3e})")
    return figs


def check_all(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], dtype, **bounds) -> dict[str, dict]:
    """check() every (got, ref) pair (outputs and saved state together). `dtype` is one dtype for all
    or a dict name -> dtype. Checks all pairs, then raises one CheckFailed naming every failure."""
    if not pairs:
        raise ValueError("pairs must name at least one (got, ref) pair")
    results: dict[str, dict] = {}
    failures: list[str] = []
    for name, pair in pairs.items():
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"pairs[{name!r}] must be a (got, ref) tuple")
        dt = dtype[name] if isinstance(dtype, dict) else dtype
        try:
            results[name] = check(pair[0], pair[1], dtype=dt, name=name, **bounds)
        except CheckFailed as exc:
            failures.append(str(exc))
    if failures:
        raise CheckFailed("; ".join(failures))
    return results
