"""Floors: the time the hardware cannot beat (bytes over bandwidth, flops over matrix rate, launches
over the launch cost measured here once per process)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from k3lab import env as _env
from k3lab.bench.timing import time_fn

_launch_cache: dict[str, float] = {}


def _empty_kernel() -> Callable[[], None]:
    # torch.cuda._sleep(0) launches a kernel that spins zero cycles: an empty kernel with no Python
    # tensor bookkeeping. Fall back to a one-element fill where a build lacks it.
    if hasattr(torch.cuda, "_sleep"):
        return lambda: torch.cuda._sleep(0)
    x = torch.zeros(1, device="cuda")
    return lambda: x.fill_(1.0)


def launch_cost_us(mode: str = "eager") -> float | None:
    """Cost of one empty kernel launch on this GPU, measured once per process and mode: per launch
    among 100 back-to-back eager launches ('eager'), or per kernel inside a 100-kernel graph ('graph').
    That is the launch's share of a chain of kernels, the case a launch floor is for. None on CPU:
    launch cost is not modelled there."""
    if mode not in ("eager", "graph"):
        raise ValueError(f"mode must be 'eager' or 'graph', got {mode!r}")
    if not torch.cuda.is_available():
        return None
    if mode not in _launch_cache:
        t = time_fn(_empty_kernel(), warmup=20, repeats=200, graph=(mode == "graph"), calls_per_sample=100)
        _launch_cache[mode] = t.median_us
    return _launch_cache[mode]


def floor_breakdown(*, bytes: float = 0, flops: float = 0, launches: int = 0, device=None, peak=None,
                    launch_mode: str = "eager") -> dict[str, Any]:
    """The three lower bounds separately: memory_us = bytes / bandwidth, compute_us = flops / bf16
    matrix rate, launch_us = launches x measured empty-kernel cost; floor_us = the largest (each one
    alone is a time the device cannot beat; they can overlap, so they are not added)."""
    for label, v in (("bytes", bytes), ("flops", flops), ("launches", launches)):
        if v < 0:
            raise ValueError(f"{label} must be >= 0, got {v}")
    info = device if device is not None else _env.detect()
    pk = peak if peak is not None else info.peak
    memory_us = bytes / (pk.bandwidth_tbs * 1e6) if bytes else 0.0
    compute_us = flops / (pk.bf16_tflops * 1e6) if flops else 0.0
    launch_note = ""
    launch_us = 0.0
    if launches:
        if info.backend == "cpu":
            launch_note = "launch cost is not modelled on CPU"
        else:
            per = launch_cost_us(launch_mode)
            if per is None:
                launch_note = "no GPU in this process to measure a launch on"
            else:
                launch_us = launches * per
    return {"memory_us": memory_us, "compute_us": compute_us, "launch_us": launch_us,
            "floor_us": max(memory_us, compute_us, launch_us), "bandwidth_tbs": pk.bandwidth_tbs,
            "bf16_tflops": pk.bf16_tflops, "peak": pk.name, "launch_note": launch_note}


def floor_us(*, bytes: float = 0, flops: float = 0, launches: int = 0, device=None, peak=None,
             launch_mode: str = "eager") -> float:
    """Lower bound in microseconds: max(bytes / bandwidth, flops / bf16 rate, launches x launch cost),
    from `k3lab.env.detect().peak` unless `peak=` (an env.Peak) is passed. On CPU the launch term is
    not modelled (a warning says so when launches > 0). See `floor_breakdown` for the parts."""
    parts = floor_breakdown(bytes=bytes, flops=flops, launches=launches, device=device, peak=peak,
                            launch_mode=launch_mode)
    if parts["launch_note"]:
        warnings.warn(f"floor_us: {parts['launch_note']}; the floor counts bytes and flops only",
                      stacklevel=2)
    return parts["floor_us"]
