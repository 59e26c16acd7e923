"""Timing GPU work with device events (eager or CUDA/HIP graph replay) and CPU work with perf_counter:
median with 20th/80th percentiles and the timer's own overhead; rotation of inputs larger than the cache."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from k3lab.runtime.graphs import capture_calls, indexed_call


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
                f"samples, {self.mode}, {self.calls_per_sample} {what}; timer overhead "
                f"{self.overhead_us:.2f} us)")


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


def _time_graph(call, warmup: int, repeats: int, min_time_s: float | None, copies: int) -> list[float]:
    graph = capture_calls(call, copies, warmup)
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
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _
                 in range(n)]
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
    graph = capture_calls(call, first_guess, 1)
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
            calls_per_sample: int | None = None, device=None) -> Timing:
    """Time `fn` per call: the median and p20/p80 of `repeats` samples (more if `min_time_s` asks for a
    longer run), each sample = one timer pair around `calls_per_sample` back-to-back calls, divided by
    that count. GPU (when torch sees one, or device='cuda'): device events, after `warmup` calls. CPU:
    perf_counter.

    calls_per_sample (k): None picks, while running the warm-up calls one by one, enough calls that a
    sample lasts ~0.5 ms (1..100; 1 for calls of 0.5 ms or more). Why several calls per sample: an event
    pair alone can cost more host time than a small kernel takes (docs/launch_overhead.md); one event pair
    around k calls measures the cost of a call in a
    stream of work (what a decode step of many kernels sees: launch-bound ops show their launch rate,
    long ops their GPU time), and spreads the timer over k. k=1 gives the latency of a lone call,
    timer included.

    graph=True (GPU only): capture a CUDA/HIP graph holding k successive calls (the Timing reports k as
    `graph_copies`) and time its replays; per call = replay time / k. Why a graph of k calls rather than N
    replays of a one-call graph: each replay pays a graph launch of its own (a few us), which would
    swamp the per-kernel cost we want to show. A served decode step is one graph of hundreds of
    kernels, so the cost of a kernel inside a long graph is the figure that matters. With k=None the
    graph's size comes from a short replay of a first graph sized by the eager warm-up (the eager
    warm-up alone would give launch-bound steps a few calls per graph, whose per-call figures would
    then carry part of the replay's launch).

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
    if calls_per_sample is not None and (not isinstance(calls_per_sample, int) or calls_per_sample < 1):
        raise ValueError(f"calls_per_sample must be an int >= 1 or None, got {calls_per_sample!r}")
    k = calls_per_sample
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
            raise ValueError(f"flush_l2=True flushes before each sample, so calls_per_sample must be 1, got "
                             f"{k}")
        k = 1

    call = indexed_call(fn, rotate)
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
