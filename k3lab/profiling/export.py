"""Traces other tools open: HolisticTraceAnalysis (HTA) folders, named ranges for Nsight Systems / rocprofv3.

HTA reads a folder of Kineto traces, one per rank (`TraceAnalysis(trace_dir=...)`), each carrying its
rank in `distributedInfo` and its iterations as `ProfilerStep#N` ranges. A k3lab capture marks its steps
`k3lab.step.N` (record_function ranges); `with_step_marks` adds the matching `ProfilerStep#N` range over
each and the rank, and `write_hta_folder` writes the result as `<folder>/rank-<rank>.json.gz`. The same
trace is Chrome/Perfetto JSON (ui.perfetto.dev): the step and part ranges show as named slices.

`label(name)` opens a record_function range and, where a CUDA or ROCm build of torch sees a GPU, an NVTX
range of the same name (torch.cuda.nvtx; a ROCm build of torch routes it to ROCTX, not yet run on AMD
hardware by this project), so Nsight Systems and rocprofv3's marker trace name the parts torch.profiler
names.

HTA is optional (pip install HolisticTraceAnalysis; its import also needs psutil): `hta_status()` says
whether it imports and why not; `hta_kernel_breakdown(folder)` runs its kernel breakdown and
`hta_trace_diff(before, after)` its trace diff; without it k3lab's own `trace_diff` / `kernel_table` are
what runs.
"""

from __future__ import annotations

import contextlib
import copy
import gzip
import json
import re
from pathlib import Path

import pandas as pd

from k3lab.profiling.capture import _tmp_beside, atomic_move

STEP_PREFIX = "k3lab.step."
_STEP = re.compile(r"^k3lab\.step\.(\d+)$")


def _trace(trace_or_path) -> dict:
    if isinstance(trace_or_path, dict):
        trace = trace_or_path
    elif isinstance(trace_or_path, (str, Path)):
        path = Path(trace_or_path)
        if not path.is_file():
            raise ValueError(f"trace: {path} is not a file")
        data = path.read_bytes()
        trace = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)
    else:
        raise ValueError(f"trace: expected a Kineto trace (dict) or its path, got "
                         f"{type(trace_or_path).__name__}")
    if not isinstance(trace.get("traceEvents"), list):
        raise ValueError("trace: expected a Kineto trace (a dict with a traceEvents list)")
    return trace


def with_step_marks(trace_or_path, *, rank: int = 0, world_size: int = 1) -> dict:
    """A copy of a Kineto trace that HTA can read: one `ProfilerStep#N` range (cat user_annotation) over
    each `k3lab.step.N` range, unless the trace has ProfilerStep ranges already, and `distributedInfo`
    with `rank` when the trace has none. ValueError when the trace has neither kind of step range (HTA
    cuts a trace into iterations by them)."""
    if not isinstance(rank, int) or rank < 0 or not isinstance(world_size, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank, world_size: expected 0 <= rank < world_size, got {rank!r}, {world_size!r}")
    out = copy.deepcopy(_trace(trace_or_path))
    events = out["traceEvents"]
    has_steps = any(isinstance(e, dict) and str(e.get("name", "")).startswith("ProfilerStep#")
                    for e in events)
    if not has_steps:
        marks = [dict(e, name=f"ProfilerStep#{m.group(1)}") for e in events
                 if isinstance(e, dict) and e.get("ph") == "X" and (m := _STEP.match(str(e.get("name", ""))))]
        if not marks:
            raise ValueError("trace: no ProfilerStep#N and no k3lab.step.N ranges: HTA needs step marks "
                             "(capture with k3lab.profile.capture, which marks each step)")
        events.extend(marks)
    out.setdefault("distributedInfo", {"rank": rank, "world_size": world_size, "backend": "none"})
    return out


def write_hta_folder(trace_or_path, folder, *, rank: int = 0, overwrite: bool = False) -> Path:
    """Write `with_step_marks(trace)` as `<folder>/rank-<rank>.json.gz`, atomically; an existing file is
    kept unless overwrite=True. Returns the file's path; `TraceAnalysis(trace_dir=folder)` reads it."""
    trace = with_step_marks(trace_or_path, rank=rank)
    path = Path(folder) / f"rank-{rank}.json.gz"
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    tmp = _tmp_beside(path)
    tmp.write_text(json.dumps(trace))
    return atomic_move(tmp, path, overwrite=overwrite)


def hta_status() -> tuple[bool, str]:
    """(True, version) when HolisticTraceAnalysis imports here, else (False, why)."""
    try:
        import hta  # noqa: F401
        from hta.trace_analysis import TraceAnalysis  # noqa: F401
    except ImportError as exc:
        return False, (f"HolisticTraceAnalysis is not importable ({exc}); pip install HolisticTraceAnalysis "
                       "psutil, or use k3lab.profile.trace_diff")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return True, version("HolisticTraceAnalysis")
    except PackageNotFoundError:
        return True, "unknown version"


@contextlib.contextmanager
def _quiet_hta():
    """HTA logs a line per parsed file and per stage, at WARNING level; keep a notebook's output to the
    result (HTA's errors still show)."""
    import io
    import logging
    import warnings

    logger = logging.getLogger("hta")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore", category=FutureWarning)  # HTA's pandas calls (inplace=...)
        warnings.simplefilter("ignore", category=DeprecationWarning)
        try:
            yield
        finally:
            logger.setLevel(level)


def hta_kernel_breakdown(folder) -> pd.DataFrame:
    """HTA's GPU kernel breakdown of an HTA folder (`write_hta_folder`): one row per kernel name with its
    summed, mean, min and max duration in us and its kind (COMPUTATION, MEMORY, COMMUNICATION), as HTA
    reports them. Empty for a CPU-only trace (no GPU kernel). RuntimeError naming the fallback when HTA
    is not installed."""
    ok, why = hta_status()
    if not ok:
        raise RuntimeError(why)
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("*.json*")):
        raise ValueError(f"folder: {folder} holds no trace (write one with write_hta_folder)")
    from hta.trace_analysis import TraceAnalysis

    with _quiet_hta():
        analysis = TraceAnalysis(trace_dir=str(folder), include_last_profiler_step=True)
        _, kernels = analysis.get_gpu_kernel_breakdown(visualize=False)
    return kernels.rename(columns=lambda c: c.replace(" (us)", "_us").replace(" ", "_"))


def trace_steps(folder) -> list[int]:
    """The step numbers N of the `ProfilerStep#N` ranges in an HTA folder's rank files, sorted: the steps
    HTA finds there (`hta_steps`), read without HTA. HTA parses a whole trace to answer (on a GPU step's
    trace, tens of seconds), so the diff asks this instead."""
    folder = Path(folder)
    files = sorted(folder.glob("rank-*.json*")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"folder: {folder} holds no rank-<N>.json.gz (write one with write_hta_folder)")
    found = set()
    for f in files:
        for e in _trace(f)["traceEvents"]:
            name = e.get("name", "") if isinstance(e, dict) and e.get("ph") == "X" else ""
            if isinstance(name, str) and name.startswith("ProfilerStep#") and name[13:].isdigit():
                found.add(int(name[13:]))
    return sorted(found)


def hta_steps(folder) -> list[int]:
    """The profiler steps HTA finds in an HTA folder (RuntimeError naming the fallback without HTA)."""
    ok, why = hta_status()
    if not ok:
        raise RuntimeError(why)
    from hta.trace_analysis import TraceAnalysis

    with _quiet_hta():
        return [int(s) for s in TraceAnalysis(trace_dir=str(folder), include_last_profiler_step=True)
                .get_profiler_steps()]


def hta_trace_diff(before, after, *, device: str = "gpu") -> pd.DataFrame:
    """HTA's trace diff of two HTA folders (`write_hta_folder`) over every step each holds, by name:
    GPU kernels (device='gpu') or CPU ops and named ranges, the step marks left out (device='cpu', for
    a trace captured on a CPU): before_calls, before_us, after_calls, after_us, diff_calls, diff_us and
    HTA's change mark ('+' new, '-' gone, '=' same count, ...). RuntimeError naming the fallback
    (k3lab.profile.trace_diff) when HTA is not installed."""
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device: expected 'gpu' or 'cpu', got {device!r}")
    ok, why = hta_status()
    if not ok:
        raise RuntimeError(why)
    from hta.trace_diff import DeviceType, TraceDiff

    steps = [trace_steps(f) for f in (before, after)]
    with _quiet_hta():
        df = TraceDiff.compare_traces(str(before), str(after), control_iteration=steps[0],
                                      test_iteration=steps[1],
                                      device_type=DeviceType.GPU if device == "gpu" else DeviceType.CPU)
    if device == "cpu":
        df = df[~df.index.str.startswith(("ProfilerStep#", STEP_PREFIX))]
    names = {"Control_counts": "before_calls", "Control_total_duration": "before_us",
             "Test_counts": "after_calls", "Test_total_duration": "after_us", "diff_counts": "diff_calls",
             "diff_duration": "diff_us", "counts_change_categories": "change"}
    return df.rename(columns=names).rename_axis("kernel")


def _nvtx():
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        import torch.cuda.nvtx as nvtx
    except ImportError:
        return None
    return nvtx


@contextlib.contextmanager
def label(name: str):
    """A named range: record_function (torch.profiler, Kineto, HTA, Perfetto) and, where torch sees a
    GPU, an NVTX range (ROCTX on ROCm) of the same name for Nsight Systems / rocprofv3 --marker-trace."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty string, got {name!r}")
    from torch.profiler import record_function

    nvtx = _nvtx()
    if nvtx is not None:
        nvtx.range_push(name)
    try:
        with record_function(name):
            yield
    finally:
        if nvtx is not None:
            nvtx.range_pop()
