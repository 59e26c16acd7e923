"""CUDA/HIP graph capture: successive calls of a function recorded once, replayed with `.replay()`.

The engine captures a whole decode step with it; bench's `time_fn(graph=True)` times the replays of
the same capture, so what is timed is what the engine runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def indexed_call(fn: Callable, rotate: list[tuple] | None) -> Callable[[int], Any]:
    """call(i) runs fn on the i-th argument set of `rotate` (cycled), or fn() when rotate is None."""
    if rotate is None:
        return lambda i: fn()
    n = len(rotate)
    return lambda i: fn(*rotate[i % n])


def capture_graph(fn: Callable, *, copies: int = 1, rotate: list[tuple] | None = None,
                  warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Capture `copies` successive calls of fn (cycling through `rotate` argument sets, as
    bench.time_fn does) into a CUDA/HIP graph after `warmup` eager calls on a side stream; replay with
    .replay(). ValueError without a GPU or with copies < 1, before anything runs."""
    if not torch.cuda.is_available():
        raise ValueError("capture_graph needs a CUDA/HIP device; torch sees none")
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    return capture_calls(indexed_call(fn, rotate), copies, warmup)


def capture_calls(call: Callable[[int], Any], copies: int, warmup: int) -> torch.cuda.CUDAGraph:
    """Capture call(0) .. call(copies - 1) into one graph, after max(warmup, 1) eager calls.

    The warm-up runs on a side stream first (cuBLAS workspaces, Triton compilation, allocator pools):
    nothing may be allocated for the first time inside capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(max(warmup, 1)):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    torch.cuda.synchronize()
    return graph
