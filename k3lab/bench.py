"""Timing, correctness checks, floors and result records: the measuring half of k3lab.

One place for each of these, used by notebooks, the CLI and the tests:

- `time_fn`      time GPU work with device events (eager or CUDA/HIP graph replay) or CPU work with
                 perf_counter; median with 20th/80th percentiles and the timer's own overhead.
- `check`        compare a result with its reference under a per-dtype relative error bound
                 (`TOLERANCES`); NaN and Inf never pass. `check_all` does several outputs at once.
- `floor_us`     the time the hardware cannot beat: bytes over bandwidth, flops over matrix rate,
                 launches over launch cost (measured here once per process on a GPU).
- `Record`       one measured (study, case, variant); `save_records` / `load_records` keep them as JSON
                 under profiles/<device>/<study>/, `compare` lines before, after, peer and floor up.

No dependency on triton.testing (its do_bench needs a GPU driver and hides its choices); plotly is
never imported here.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import math
import os
import re
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from k3lab import env as _env

__all__ = [
    "PEERS",
    "TOLERANCES",
    "VARIANTS",
    "CheckFailed",
    "Record",
    "Timing",
    "Tolerance",
    "capture_graph",
    "check",
    "check_all",
    "compare",
    "device_slug",
    "floor_breakdown",
    "floor_us",
    "git_commit",
    "launch_cost_us",
    "load_records",
    "make_record",
    "records_frame",
    "rotation_count",
    "rotation_sets",
    "save_records",
    "time_fn",
    "tolerance_for",
    "validate_variant",
]

# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """Statistics of one timed function, in microseconds per call.

    Each sample brackets `calls_per_sample` back-to-back calls with one pair of timers and divides by
    that count. mode: 'eager' (device events around eagerly launched calls), 'graph' (device events
    around one replay of a CUDA/HIP graph holding the calls) or 'cpu' (perf_counter). overhead_us: the
    same timer around an empty function, per call (divided by calls_per_sample too), so a reader can
    tell when a figure is mostly the timer; it is reported, never subtracted.
    """

    median_us: float
    p20_us: float
    p80_us: float
    repeats: int
    mode: str
    overhead_us: float
    calls_per_sample: int = 1
    flush_l2: bool = False
    rotate_sets: int = 1
    samples_us: list[float] = field(default_factory=list, repr=False)

    @property
    def graph_copies(self) -> int:
        """Calls captured in the replayed graph (1 outside graph mode)."""
        return self.calls_per_sample if self.mode == "graph" else 1

    def summary(self) -> str:
        what = {"graph": "calls per graph replay", "eager": "back-to-back calls per sample",
                "cpu": "calls per sample"}[self.mode] if self.mode in ("graph", "eager", "cpu") else "calls"
        return (f"{self.median_us:.2f} us (p20 {self.p20_us:.2f}, p80 {self.p80_us:.2f}; {self.repeats} "
                f"samples, {self.mode}, {self.calls_per_sample} {what}; timer overhead {self.overhead_us:.2f} us)")


def _percentile(sorted_vals: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_vals:
        raise ValueError("no samples to summarise")
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _stats(samples_us: list[float]) -> tuple[float, float, float]:
    s = sorted(samples_us)
    return _percentile(s, 50), _percentile(s, 20), _percentile(s, 80)


def _use_gpu(device) -> bool:
    if device is None:
        return torch.cuda.is_available()
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asks for a GPU but torch sees none (torch.cuda.is_available() "
                         "is False); pass device='cpu' or leave it None")
    return dev.type == "cuda"


def _caller(fn: Callable, rotate: list[tuple] | None) -> Callable[[int], Any]:
    """call(i) runs fn on the i-th input set (cycled), or fn() when there is no rotation."""
    if rotate is None:
        return lambda i: fn()
    n = len(rotate)
    return lambda i: fn(*rotate[i % n])


@functools.lru_cache(maxsize=1)
def _flush_buffer() -> torch.Tensor:
    # Twice the L2 so that writing it evicts whatever the timed call left there.
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (64 << 20)
    return torch.empty(2 * l2, dtype=torch.int8, device="cuda")


def _done(samples: list[float], repeats: int, min_time_s: float | None, k: int) -> bool:
    return len(samples) >= repeats and (min_time_s is None or sum(samples) * k * 1e-6 >= min_time_s)


def _time_cpu(call, warmup: int, repeats: int, min_time_s: float | None, k: int = 1) -> list[float]:
    for i in range(warmup):
        call(i)
    samples: list[float] = []
    i = 0
    clock = time.perf_counter
    while not _done(samples, repeats, min_time_s, k):
        t0 = clock()
        for _ in range(k):
            call(i)
            i += 1
        samples.append((clock() - t0) * 1e6 / k)
    return samples


def _time_eager_gpu(call, warmup: int, repeats: int, min_time_s: float | None, flush_l2: bool,
                    k: int = 1) -> list[float]:
    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    flush = _flush_buffer() if flush_l2 else None
    samples: list[float] = []
    i = 0
    while not _done(samples, repeats, min_time_s, k):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for j in range(repeats):
            if flush is not None:
                flush.zero_()  # outside the events: evicts L2 without being timed
            starts[j].record()
            for _ in range(k):
                call(i)
                i += 1
            ends[j].record()
        torch.cuda.synchronize()
        samples += [s.elapsed_time(e) * 1e3 / k for s, e in zip(starts, ends)]
    return samples


def capture_graph(fn: Callable, *, copies: int = 1, rotate: list[tuple] | None = None,
                  warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Capture `copies` successive calls of fn (cycling through `rotate` argument sets, as time_fn
    does) into a CUDA/HIP graph after `warmup` eager calls on a side stream; replay with .replay()."""
    if not torch.cuda.is_available():
        raise ValueError("capture_graph needs a CUDA/HIP device; torch sees none")
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    return _capture_graph(_caller(fn, rotate), copies, warmup)


def _capture_graph(call, copies: int, warmup: int) -> torch.cuda.CUDAGraph:
    # Warm up on a side stream first (cuBLAS workspaces, Triton compilation, allocator pools):
    # nothing may be allocated for the first time inside capture.
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


def _time_graph(call, warmup: int, repeats: int, min_time_s: float | None, copies: int) -> list[float]:
    graph = _capture_graph(call, copies, warmup)
    for _ in range(max(warmup, 1)):
        graph.replay()
    torch.cuda.synchronize()
    samples: list[float] = []
    while not _done(samples, repeats, min_time_s, copies):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for j in range(repeats):
            starts[j].record()
            graph.replay()
            ends[j].record()
        torch.cuda.synchronize()
        samples += [s.elapsed_time(e) * 1e3 / copies for s, e in zip(starts, ends)]
    return samples


AUTO_SAMPLE_US = 500.0  # auto calls_per_sample: enough calls that one sample lasts about this long
MAX_CALLS_PER_SAMPLE = 100


def _auto_calls(call, gpu: bool, warmup: int) -> int:
    """Run the warm-up calls one by one, each timed alone, and pick enough back-to-back calls that a
    sample lasts ~AUTO_SAMPLE_US (1..MAX_CALLS_PER_SAMPLE) from the median of the warm calls (the first
    is left out when there are several: it may compile or allocate). The warm-up is not repeated
    afterwards, so a slow function costs no extra calls."""
    n = max(warmup, 1)
    if gpu:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for i, (a, b) in enumerate(pairs):
            a.record()
            call(i)
            b.record()
        torch.cuda.synchronize()
        lone = [a.elapsed_time(b) * 1e3 for a, b in pairs]
    else:
        lone = []
        for i in range(n):
            t0 = time.perf_counter()
            call(i)
            lone.append((time.perf_counter() - t0) * 1e6)
    est = _stats(lone[1:] if n > 1 else lone)[0]
    return _calls_for(est)


def _calls_for(per_call_us: float) -> int:
    return int(min(MAX_CALLS_PER_SAMPLE, max(1, math.ceil(AUTO_SAMPLE_US / max(per_call_us, 1e-3)))))


def _graph_calls(call, first_guess: int) -> int:
    """Calls per graph from a short replay of a graph of `first_guess` calls. The eager warm-up prices a
    launch-bound call at its launch (tens of us); in a graph it costs a few us, so the eager guess
    leaves a graph of a handful of calls, and each replay's own launch (a few us) would then add a
    share that depends on that handful: run-to-run differences of ~30% at a few us per call (seen on
    the H200 for the one-token AttnRes step, 5 vs 9 calls per graph). Never fewer than the guess."""
    graph = _capture_graph(call, first_guess, 1)
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(3)]
    for a, b in pairs:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    per_call = _stats([a.elapsed_time(b) * 1e3 / first_guess for a, b in pairs])[0]
    del graph
    return max(first_guess, _calls_for(per_call))


def time_fn(fn: Callable, *, warmup: int = 10, repeats: int = 100, graph: bool = False,
            rotate: list[tuple] | None = None, min_time_s: float | None = None, flush_l2: bool = False,
            calls_per_sample: int | None = None, graph_copies: int | None = None, device=None) -> Timing:
    """Time `fn` per call: the median and p20/p80 of `repeats` samples (more if `min_time_s` asks for a
    longer run), each sample = one timer pair around `calls_per_sample` back-to-back calls, divided by
    that count. GPU (when torch sees one, or device='cuda'): device events, after `warmup` calls. CPU:
    perf_counter.

    calls_per_sample (k): None picks, while running the warm-up calls one by one, enough calls that a
    sample lasts ~0.5 ms (1..100; 1 for calls of 0.5 ms or more). Why several calls per sample: on the lent H200 an event pair alone costs 6-10 us of host
    time, more than a small kernel; one event pair around k calls measures the cost of a call in a
    stream of work (what a decode step of many kernels sees: launch-bound ops show their launch rate,
    long ops their GPU time), and spreads the timer over k. k=1 gives the latency of a lone call,
    timer included.

    graph=True (GPU only): capture a CUDA/HIP graph holding k successive calls (`graph_copies` is the
    same knob) and time its replays; per call = replay time / k. Why a graph of k calls rather than N
    replays of a one-call graph: each replay pays a graph launch of its own (a few us), which would
    swamp the per-kernel cost we want to show. A served decode step is one graph of hundreds of
    kernels, so the cost of a kernel inside a long graph is the figure that matters. With k=None the
    graph's size comes from a short replay of a first graph sized by the eager warm-up (records from
    before 2026-11-30's third session sized it from the eager warm-up alone: a few calls per graph
    for launch-bound steps, whose per-call figures then carried part of the replay's launch).

    rotate: a list of argument tuples; call i runs fn(*rotate[i % len(rotate)]) so inputs that fit in
    cache are not timed hot (see `rotation_sets`). flush_l2: write a 2 x L2 buffer before each sample,
    outside the events (eager GPU only, and only with k=1, since the calls of one sample share it).
    overhead_us: the same timer around an empty function, per call (reported, never subtracted).
    """
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")  # noqa: TRY004 - bad input is a ValueError here
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if min_time_s is not None and min_time_s < 0:
        raise ValueError(f"min_time_s must be >= 0 or None, got {min_time_s}")
    if rotate is not None:
        rotate = [tuple(a) if isinstance(a, (tuple, list)) else (a,) for a in rotate]
        if not rotate:
            raise ValueError("rotate must be a non-empty list of argument tuples, or None")
    for label, v in (("calls_per_sample", calls_per_sample), ("graph_copies", graph_copies)):
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"{label} must be an int >= 1 or None, got {v!r}")
    if calls_per_sample is not None and graph_copies is not None and calls_per_sample != graph_copies:
        raise ValueError(f"graph_copies={graph_copies} and calls_per_sample={calls_per_sample} name the same "
                         "knob; pass one")
    k = calls_per_sample if calls_per_sample is not None else graph_copies
    gpu = _use_gpu(device)
    if graph and not gpu:
        raise ValueError("graph=True needs a CUDA/HIP device (graph replay does not exist on CPU); "
                         "pass graph=False on CPU")
    if graph and flush_l2:
        raise ValueError("flush_l2=True cannot be combined with graph=True: the flush would be inside "
                         "the replayed graph; use rotate= to keep inputs cold under graphs")
    if flush_l2 and not gpu:
        raise ValueError("flush_l2=True is a GPU option (it evicts the device L2); on CPU use rotate=")
    if flush_l2:
        if k not in (None, 1):
            raise ValueError(f"flush_l2=True flushes before each sample, so calls_per_sample must be 1, got {k}")
        k = 1

    call = _caller(fn, rotate)
    empty = lambda i: None  # noqa: E731 - the timer around nothing
    n_sets = len(rotate) if rotate else 1
    if k is None:
        k = _auto_calls(call, gpu, warmup)
        warmup = 0  # _auto_calls ran the warm-up
        if graph:  # with rotating inputs a replay must visit every set, or later sets are never timed
            k = max(_graph_calls(call, max(k, n_sets)), n_sets)
    if not gpu:
        samples = _time_cpu(call, warmup, repeats, min_time_s, k)
        overhead = _stats(_time_cpu(empty, 3, repeats, None, 1))[0] / k
        mode = "cpu"
    elif graph:
        samples = _time_graph(call, warmup, repeats, min_time_s, k)
        overhead = _stats(_time_eager_gpu(empty, 3, repeats, None, False))[0] / k
        mode = "graph"
    else:
        samples = _time_eager_gpu(call, warmup, repeats, min_time_s, flush_l2, k)
        overhead = _stats(_time_eager_gpu(empty, 3, repeats, None, False))[0] / k
        mode = "eager"
    med, p20, p80 = _stats(samples)
    return Timing(med, p20, p80, len(samples), mode, overhead, k, flush_l2, n_sets, samples)


def _cache_bytes() -> int:
    if torch.cuda.is_available():
        return getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or (64 << 20)
    return 32 << 20  # a server CPU's last-level cache slice, order of magnitude


def rotation_count(bytes_per_set: int, *, cache_bytes: int | None = None, max_sets: int = 64) -> int:
    """How many input sets to cycle so that together they exceed twice the cache (L2 on a GPU,
    32 MiB assumed on CPU): 1 when one set already does."""
    if bytes_per_set <= 0:
        raise ValueError(f"bytes_per_set must be > 0, got {bytes_per_set}")
    cache = cache_bytes if cache_bytes is not None else _cache_bytes()
    return int(min(max_sets, max(1, math.ceil(2 * cache / bytes_per_set))))


def rotation_sets(make: Callable[[], tuple], bytes_per_set: int, *, cache_bytes: int | None = None,
                  max_sets: int = 64) -> list[tuple]:
    """`rotation_count(...)` fresh input sets from `make()` (each call must return new random tensors)."""
    n = rotation_count(bytes_per_set, cache_bytes=cache_bytes, max_sets=max_sets)
    sets = []
    for _ in range(n):
        s = make()
        sets.append(tuple(s) if isinstance(s, (tuple, list)) else (s,))
    return sets


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


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
        raise ValueError(f"dtype must be a floating torch dtype or one of {sorted(TOLERANCES)}, got {dtype!r}")
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


# ----------------------------------------------------------------------------------------------
# Floors
# ----------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------

VARIANTS = ("before", "after", "reference")
# Public packages a k3lab kernel is compared with in the same run ('torch' = plain PyTorch ops).
PEERS = {"fla", "torch", "triton", "aiter", "flashmla", "flashinfer", "flash_attn", "vllm", "sglang", "cublas"}


def validate_variant(variant: str) -> str:
    if variant in VARIANTS or variant in PEERS:
        return variant
    raise ValueError(f"variant must be one of {list(VARIANTS)} or a peer package name {sorted(PEERS)}, "
                     f"got {variant!r}")


@dataclass
class Record:
    study: str
    case: str
    variant: str
    device: str
    backend: str
    versions: dict
    commit: str
    date: str
    shape: dict
    dtype: str
    median_us: float
    p20_us: float
    p80_us: float
    floor_us: float | None = None
    error: dict = field(default_factory=dict)
    mode: str = "eager"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        validate_variant(self.variant)
        for label in ("study", "case"):
            v = getattr(self, label)
            if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", v):
                raise ValueError(f"{label} must be a non-empty name of letters, digits, '_', '.', '-' "
                                 f"(it becomes a file name), got {v!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = {f.name for f in dataclasses.fields(cls)
                   if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING} - set(d)
        if missing:
            raise ValueError(f"record is missing fields {sorted(missing)}")
        return cls(**{k: v for k, v in d.items() if k in names})


def _repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


# The committed results: found from any working directory (a notebook runs in notebooks/).
PROFILES = _repo_root() / "profiles"


@functools.lru_cache(maxsize=4)
def git_commit(path: str | None = None) -> str:
    """K3LAB_COMMIT from the environment when it is set and looks like a commit id (a copied tree,
    such as a device machine's, may carry a stale .git); else HEAD of the git tree holding k3lab
    (or `path`), '-dirty' appended when it has changes; else 'unknown'."""
    given = os.environ.get("K3LAB_COMMIT", "").strip()
    if given:
        if not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", given):
            raise ValueError(f"K3LAB_COMMIT must be a commit id (7-40 hex digits, optional '-dirty'), got {given!r}")
        return given
    where = path or str(_repo_root())
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                              check=False, timeout=10)
        if head.returncode != 0:
            raise OSError(head.stderr)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, check=False, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_slug(device: str | None = None, backend: str | None = None) -> str:
    """Folder name for a device: 'cpu' on CPU, else the lower-cased name with non-alphanumerics
    as '-' ('NVIDIA H200' -> 'nvidia-h200')."""
    if device is None or backend is None:
        info = _env.detect()
        device = device if device is not None else info.name
        backend = backend if backend is not None else info.backend
    if backend == "cpu":
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    return slug or "unknown-device"


def _dtype_name(dtype) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).replace("torch.", "")
    return str(dtype)


def make_record(study: str, case: str, variant: str, timing: Timing, *, shape: dict, dtype,
                floor_us: float | None = None, error: dict | None = None, **extra) -> Record:
    """A Record for this machine now: device, backend, versions, commit and date filled in; the
    timing's repeats, overhead and graph copies kept in `extra`."""
    if not isinstance(timing, Timing):
        raise ValueError(f"timing must be a bench.Timing, got {type(timing).__name__}")  # noqa: TRY004 - bad input is a ValueError here
    if not isinstance(shape, dict):
        raise ValueError(f"shape must be a dict of named sizes, got {type(shape).__name__}")  # noqa: TRY004 - bad input is a ValueError here
    info = _env.detect()
    ext = {"repeats": timing.repeats, "overhead_us": timing.overhead_us,
           "calls_per_sample": timing.calls_per_sample, "graph_copies": timing.graph_copies,
           "rotate_sets": timing.rotate_sets, "flush_l2": timing.flush_l2}
    ext.update(extra)
    return Record(study=study, case=case, variant=variant, device=info.name, backend=info.backend,
                  versions=dict(_env.versions()), commit=git_commit(),
                  date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                  shape=dict(shape), dtype=_dtype_name(dtype), median_us=timing.median_us,
                  p20_us=timing.p20_us, p80_us=timing.p80_us, floor_us=floor_us,
                  error=dict(error or {}), mode=timing.mode, extra=_jsonable(ext))


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.dtype):
        return _dtype_name(obj)
    if isinstance(obj, torch.Tensor) and obj.numel() == 1:
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _git_tracked(path: Path) -> bool:
    try:
        out = subprocess.run(["git", "ls-files", "--error-unmatch", path.name], cwd=path.parent,
                             capture_output=True, text=True, check=False, timeout=10)
        return out.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_records(records: Iterable[Record], root=None, overwrite: bool = False) -> list[Path]:
    """Write records as JSON: <root>/<device-slug>/<study>/<case>__<variant>.json, one file per
    (device, study, case, variant) holding a list (eager and graph timings of one variant share it).
    Atomic (temp file + os.replace). A file git tracks is a committed reference: it is not replaced
    unless overwrite=True. Returns the paths written."""
    root = PROFILES if root is None else root
    records = list(records)
    if not records:
        raise ValueError("records is empty: nothing to save")
    groups: dict[Path, list[Record]] = {}
    for r in records:
        if not isinstance(r, Record):
            raise ValueError(f"records must hold bench.Record, got {type(r).__name__}")  # noqa: TRY004 - bad input is a ValueError here
        path = Path(root) / device_slug(r.device, r.backend) / r.study / f"{r.case}__{r.variant}.json"
        groups.setdefault(path, []).append(r)
    for path in groups:  # refuse before writing anything
        if path.exists() and not overwrite and _git_tracked(path):
            raise FileExistsError(f"{path} is a committed reference (tracked by git); pass overwrite=True "
                                  "to replace it, or save under another root= for a scratch run")
    for path, recs in groups.items():
        _write_atomic(path, json.dumps([r.to_dict() for r in recs], indent=1, sort_keys=True) + "\n")
    return list(groups)


def load_records(study: str | None = None, device: str | None = None, root=None) -> list[Record]:
    """Read records back from <root>/<device-slug>/<study>/*.json. `device` is a slug ('nvidia-h200',
    'cpu') or a device name; None reads every device. Missing folders give an empty list."""
    base = Path(PROFILES if root is None else root)
    if not base.is_dir():
        return []
    dev_dirs = sorted(p for p in base.iterdir() if p.is_dir())
    if device is not None:
        slug = device if device == "cpu" else re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
        dev_dirs = [p for p in dev_dirs if p.name == slug]
    out: list[Record] = []
    for d in dev_dirs:
        study_dirs = [d / study] if study else sorted(p for p in d.iterdir() if p.is_dir())
        for sd in study_dirs:
            for f in sorted(sd.glob("*.json")) if sd.is_dir() else []:
                data = json.loads(f.read_text())
                for item in data if isinstance(data, list) else [data]:
                    out.append(Record.from_dict(item))
    return out


def records_frame(records: Iterable[Record]):
    """One row per record with the main fields (shape and error flattened to strings)."""
    import pandas as pd

    rows = []
    for r in records:
        rows.append({"device": r.device, "study": r.study, "case": r.case, "variant": r.variant, "mode": r.mode,
                     "dtype": r.dtype, "median_us": r.median_us, "p20_us": r.p20_us, "p80_us": r.p80_us,
                     "floor_us": r.floor_us, "shape": json.dumps(r.shape, sort_keys=True),
                     "max_rel": r.error.get("max_rel"), "commit": r.commit, "date": r.date})
    return pd.DataFrame(rows)


def _variant_order(v: str) -> tuple:
    return (VARIANTS.index(v) if v in VARIANTS else len(VARIANTS), v)


def _mode_label(recs: list[Record]) -> str:
    """One mode when all records share it, else 'before:eager after:graph' (variant:mode pairs)."""
    modes = {r.mode for r in recs}
    if len(modes) == 1:
        return modes.pop()
    pairs = {r.variant: r.mode for r in recs}
    return " ".join(f"{v}:{pairs[v]}" for v in sorted(pairs, key=_variant_order))


def compare(records: Iterable[Record]):
    """One row per (device, study, case): before_us, after_us, reference_us, <peer>_us per peer,
    peer (the fastest peer) and peer_us, floor_us (the largest floor given), and the ratios
    speedup = before / after, after_vs_peer = peer / after (> 1: after beats the peer),
    floor_fraction = floor / after (1 = at the floor).

    `mode` names the timing mode, or 'before:eager after:graph' when the variants were timed
    differently (graph replay as the 'after' of a launch-bound case). When one variant of a case was
    timed in several modes, the case gets one row per mode instead."""
    import pandas as pd

    by_case: dict[tuple, list[Record]] = {}
    for r in records:
        by_case.setdefault((r.device, r.study, r.case), []).append(r)
    groups: list[list[Record]] = []
    for recs in by_case.values():
        modes_per_variant: dict[str, set] = {}
        for r in recs:
            modes_per_variant.setdefault(r.variant, set()).add(r.mode)
        if any(len(m) > 1 for m in modes_per_variant.values()):
            split: dict[str, list[Record]] = {}
            for r in recs:
                split.setdefault(r.mode, []).append(r)
            groups += list(split.values())
        else:
            groups.append(recs)
    rows = []
    peer_names = sorted({r.variant for recs in groups for r in recs if r.variant not in VARIANTS})
    for recs in groups:
        first = recs[0]
        g = {"device": first.device, "study": first.study, "case": first.case, "mode": _mode_label(recs),
             "before_us": math.nan, "after_us": math.nan, "reference_us": math.nan, "floor_us": math.nan}
        peers: dict[str, float] = {}
        for r in recs:
            if r.variant in VARIANTS:
                g[f"{r.variant}_us"] = r.median_us
            else:
                peers[r.variant] = r.median_us
            if r.floor_us is not None and not (g["floor_us"] >= r.floor_us):
                g["floor_us"] = float(r.floor_us)
        for p in peer_names:
            g[f"{p}_us"] = peers.get(p, math.nan)
        if peers:
            best = min(peers, key=peers.get)
            g["peer"], g["peer_us"] = best, peers[best]
        else:
            g["peer"], g["peer_us"] = None, math.nan
        after = g["after_us"]
        g["speedup"] = g["before_us"] / after if after > 0 else math.nan
        g["after_vs_peer"] = g["peer_us"] / after if after > 0 else math.nan
        g["floor_fraction"] = g["floor_us"] / after if after > 0 else math.nan
        rows.append(g)
    cols = ["device", "study", "case", "mode", "before_us", "after_us", "reference_us",
            *[f"{p}_us" for p in peer_names], "peer", "peer_us", "floor_us", "speedup", "after_vs_peer",
            "floor_fraction"]
    return pd.DataFrame(rows, columns=cols)
