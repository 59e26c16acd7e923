"""Checks and timings of the launch_overhead study (the package docstring says what it measures): its cases,
each variant checked against the expected values before it is timed into records.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3lab import bench
from k3lab import env as _env
from k3lab.studies import select_cases
from k3lab.studies.peers import on_gpu

from .tables import size_label, GRAPH_COPIES, NAME, SEED_COPIES_PER_STEP, SEED_COPY_BYTES


_GPU_SIZES = [SEED_COPY_BYTES] + [4 ** k * 1024 for k in range(1, 9)]  # 1,792 B, 4 KiB .. 64 MiB
_CPU_SIZES = [SEED_COPY_BYTES] + [4 ** k * 1024 for k in range(1, 6)]  # 1,792 B, 4 KiB .. 1 MiB


def _copy_sizes() -> dict[str, int]:
    return {f"copy_{size_label(n)}": n for n in (_GPU_SIZES if on_gpu() else _CPU_SIZES)}


def _triton_ok() -> bool:
    if not on_gpu():
        return False
    try:
        import triton  # noqa: F401
    except (ImportError, RuntimeError, OSError):  # absent or broken install: the case is skipped
        return False
    return True


def case_names(preset=None) -> list[str]:
    """Cases on this machine: tiny_op, the empty kernels (GPU only), then copies by growing size."""
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    names = ["tiny_op"]
    if on_gpu():
        names.append("empty_kernel")
        if _triton_ok():
            names.append("empty_triton")
    return names + list(_copy_sizes())


def _device() -> torch.device:
    return _env.detect().device


def triton_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _store_one(ptr):
        tl.store(ptr, 1.0)

    return _store_one


def _build(case: str) -> dict:
    """The op for a case: fn (called as fn(*args) over the `rotate` sets, or fn()), and
    prepare() -> (result tensors, expected tensors) that resets state so one call (or one call per
    rotated set) must turn `result` into `expected`."""
    dev = _device()
    if case == "tiny_op":
        x = torch.rand(1, device=dev) + 0.5
        return {"fn": lambda: x.add_(1.0), "rotate": None, "prepare": lambda: ([x], [x.clone() + 1.0]),
                "bytes": 8, "dtype": "float32", "shape": {"elements": 1}}
    if case == "empty_kernel":
        if not hasattr(torch.cuda, "_sleep"):
            raise ValueError("empty_kernel needs torch.cuda._sleep, absent in this torch build")
        return {"fn": lambda: torch.cuda._sleep(0), "rotate": None, "prepare": None, "bytes": 0,
                "dtype": "none", "shape": {"threads": 1}}
    if case == "empty_triton":
        kernel = triton_kernel()
        y = torch.zeros(1, device=dev)
        return {"fn": lambda: kernel[(1,)](y), "rotate": None,
                "prepare": lambda: ([y.zero_()], [torch.ones_like(y)]), "bytes": 4, "dtype": "float32",
                "shape": {"programs": 1}}
    sizes = _copy_sizes()
    if case not in sizes:
        raise ValueError(f"unknown case {case!r}; cases here: {case_names()}")
    n = sizes[case]

    def make():
        return (torch.randint(1, 256, (n,), dtype=torch.uint8, device=dev),
                torch.randint(1, 256, (n,), dtype=torch.uint8, device=dev))

    # Small copies would be timed cache-hot: cycle enough pairs to exceed twice the cache.
    sets = bench.rotation_sets(make, 2 * n, max_sets=64 if on_gpu() else 8)

    def copy(src, dst):
        dst.copy_(src)

    def prepare():
        for _, d in sets:
            d.random_(1, 256)  # random bytes: only a copy that really ran can make dst equal src
        return [d for _, d in sets], [s for s, _ in sets]

    return {"fn": copy, "rotate": sets, "prepare": prepare, "bytes": 2 * n, "dtype": "uint8",
            "shape": {"bytes": n}}


def _compare(case: str, results: list, expected: list) -> dict:
    worst: dict = {}
    for i, (got, ref) in enumerate(zip(results, expected)):
        figs = bench.check(got.to(torch.float64), ref.to(torch.float64), dtype="fp64", name=f"{case}[{i}]")
        if not worst or figs["max_rel"] > worst["max_rel"]:
            worst = figs
    return worst


def _verify(case: str, op: dict, graph: bool) -> dict:
    """Run the variant once (eagerly, or by replaying a captured graph) and check its result."""
    if op["prepare"] is None:
        return {"checked": "nothing to compare: an empty kernel has no result"}
    calls = len(op["rotate"]) if op["rotate"] else 1
    g = bench.capture_graph(op["fn"], copies=calls, rotate=op["rotate"]) if graph else None
    results, expected = op["prepare"]()  # after capture: the capture's warm-up calls changed state
    if g is not None:
        g.replay()
        torch.cuda.synchronize()
    else:
        for i in range(calls):
            op["fn"](*op["rotate"][i]) if op["rotate"] else op["fn"]()
    figs = _compare(case, results, expected)
    figs["checked"] = f"{'graph replay' if graph else 'eager'} result vs expected"
    return figs


def _timing_args() -> dict:
    return {"warmup": 20, "repeats": 200} if on_gpu() else {"warmup": 3, "repeats": 30}


def run(preset=None, cases=None) -> list[bench.Record]:
    """Check, then time, every case: 'before' (eager) everywhere, 'after' (graph replay) on a GPU."""
    chosen = select_cases(case_names(preset), cases)
    gpu = on_gpu()
    launch_eager = bench.launch_cost_us("eager") if gpu else None
    launch_graph = bench.launch_cost_us("graph") if gpu else None
    records: list[bench.Record] = []
    for case in chosen:
        op = _build(case)
        variants = [("before", False)] + ([("after", True)] if gpu else [])
        for variant, graph in variants:
            err = _verify(case, op, graph)
            # Both variants time 100 back-to-back calls per sample, so they differ only in how the
            # calls are launched (one by one, or one graph replay).
            # On CPU (no graph to compare with) the timer picks the batch itself to keep CI short.
            t = bench.time_fn(op["fn"], rotate=op["rotate"], graph=graph,
                              calls_per_sample=GRAPH_COPIES if gpu else None, **_timing_args())
            floor = bench.floor_us(bytes=op["bytes"]) if op["bytes"] >= 1024 else None
            lone = None
            if not graph:  # a lone call with its own timer pair: latency, timer overhead included
                lone = bench.time_fn(op["fn"], rotate=op["rotate"], calls_per_sample=1, **_timing_args())
            extra = {"bytes_moved": op["bytes"],
                     "lone_call_us": lone.median_us if lone else None,
                     "lone_call_timer_overhead_us": lone.overhead_us if lone else None,
                     "achieved_gbs": op["bytes"] / t.median_us / 1e3 if op["bytes"] else None,
                     "launch_eager_us": launch_eager, "launch_graph_us": launch_graph,
                     "launch_note": "" if gpu else "launch cost is not modelled on CPU (host overhead only)"}
            if case == f"copy_{size_label(SEED_COPY_BYTES)}":
                extra["per_decode_step_us"] = SEED_COPIES_PER_STEP * t.median_us
            records.append(bench.make_record(NAME, case, variant, t, shape=op["shape"], dtype=op["dtype"],
                                             floor_us=floor, error=err, **extra))
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """'before': the tiny op and the seed's 1,792-byte copy launched eagerly; 'after' (GPU only): one
    replay of a graph holding the same two ops."""
    case_names(preset)  # validates preset
    dev = _device()
    x = torch.rand(1, device=dev) + 0.5
    src = torch.randint(1, 256, (SEED_COPY_BYTES,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def step():
        x.add_(1.0)
        dst.copy_(src)

    targets = {"before": step}
    if on_gpu():
        g = bench.capture_graph(step, copies=1)
        targets["after"] = g.replay
    return targets


