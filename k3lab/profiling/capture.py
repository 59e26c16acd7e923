"""Capture one region with torch.profiler and return its kernel table and trace file.

torch.profiler is the backend that runs everywhere: CUPTI kernels on NVIDIA, roctracer kernels
on ROCm, ATen ops on a CPU. The trace is written as Chrome/Perfetto JSON (open it in
ui.perfetto.dev), atomically, and never over an existing file unless overwrite=True, so a
committed reference trace is not replaced by accident. The kernel table is parsed from that
same trace file, so `capture` and `read_trace` agree by construction.
"""

from __future__ import annotations

import atexit
import contextlib
import gzip
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from k3lab.profiling.frame import NoKernelsRecorded, category_table, counts, kernel_table
from k3lab.profiling.torch_trace import kernels_from_trace

BACKENDS = ("auto", "torch", "rocprofv3")
# Kineto's progress lines ("USDT:... profiler_start", "STAGE:... Completed Stage"), written straight to
# the process's stderr on every profiler start and stop whatever KINETO_LOG_LEVEL says: noise in a
# notebook's output. Other native stderr output passes through.
_KINETO_CHATTER = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")
_counter = itertools.count()
_said: set[str] = set()


@dataclass
class Capture:
    """A profiled region: `kernels` (one row per kernel / copy / op execution, see
    k3lab.profiling.frame), `steps` (how many calls of the step were profiled), `trace_path`,
    `backend` ('torch.profiler' or 'rocprofv3'), `device` ('cuda', 'rocm' or 'cpu'), `note`."""

    kernels: pd.DataFrame
    steps: int
    trace_path: Path | None
    backend: str
    device: str
    name: str
    note: str = ""
    files: list[Path] = field(default_factory=list)
    _profiler: object = field(default=None, repr=False)

    @property
    def table(self) -> pd.DataFrame:
        """Per-name aggregate: name, category, calls, total_us, mean_us, min_us, max_us, share, bytes."""
        return kernel_table(self.kernels)

    @property
    def categories(self) -> pd.DataFrame:
        """Per-category aggregate: category, calls, total_us, share."""
        return category_table(self.kernels)

    def counts(self) -> dict:
        """Per step: launches, copies, bytes_copied (and bytes_known: copies with a known size)."""
        return counts(self.kernels, self.steps)

    def total_us(self) -> float:
        """Device (or CPU-op) time per step, summed over rows, in microseconds."""
        return float(self.kernels["dur_us"].sum()) / self.steps

    def profiler_table(self, row_limit: int = 15) -> str:
        """torch.profiler's own key_averages table (torch.profiler captures only)."""
        if self._profiler is None:
            raise ValueError("profiler_table: only a torch.profiler capture keeps the profiler object")
        averages = self._profiler.key_averages()
        return averages.table(sort_by=sort_key(averages, self.device), row_limit=row_limit)

    def __repr__(self) -> str:
        c = self.counts()
        return (f"Capture({self.name!r}, {self.backend} on {self.device}, steps={self.steps}, "
                f"{c['launches']} launches/step, {c['copies']} copies/step, "
                f"{self.total_us():.1f} us/step, trace={self.trace_path})"
                + (f"\n  note: {self.note}" if self.note else ""))


def sort_key(averages, device: str) -> str:
    """The key_averages sort key for self device time: torch >= 2.4 names it
    `self_device_time_total`, older releases `self_cuda_time_total`; on a CPU, self CPU time."""
    if device == "cpu":
        return "self_cpu_time_total"
    sample = averages[0] if len(averages) else None
    if sample is not None and hasattr(sample, "self_device_time_total"):
        return "self_device_time_total"
    return "self_cuda_time_total"


def device_time_us(event) -> float:
    """Total device time of a key_averages row, under either field name (new or old torch)."""
    for attr in ("device_time_total", "cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def default_trace_dir() -> Path:
    """$K3LAB_TRACE_DIR, else this process's scratch folder <tmp>/k3lab-traces/<pid>: scratch traces stay
    out of the repository, and the scratch folder goes when its process does, however it ends. At a
    normal exit it is removed then; a process killed outright runs no exit code (nbval and Jupyter kill a
    notebook's kernel at shutdown), so a small watcher process started with the folder removes it once
    the pipe this process holds to it closes, which the system does when the process is gone. Making
    the folder sweeps what dead processes left beside it (`sweep_scratch`: a watcher that never ran,
    older versions' traces). So notebooks and tests leave nothing in the temp folder; `k3lab report` and
    `k3lab profile` keep their traces under their --out."""
    chosen = os.environ.get("K3LAB_TRACE_DIR")
    return Path(chosen) if chosen else _scratch_dir()


# The watcher: waits for end of input (its stdin is a pipe whose only writer is the traced process, so
# the read ends when that process ends, by exit or kill), then removes the folder. Its own session: the
# kill of the kernel's process group does not reach it; it imports nothing heavy and exits at once.
_WATCHER = """import os, shutil, sys
sys.stdin.buffer.read()
shutil.rmtree(sys.argv[1], ignore_errors=True)
try:
    os.rmdir(os.path.dirname(sys.argv[1]))  # k3lab-traces, when no other process's folder is in it
except OSError:
    pass
"""
_scratch: dict[int, tuple[Path, object]] = {}  # pid -> (its scratch folder, its watcher's Popen)


def _scratch_dir() -> Path:
    """This process's scratch trace folder, made (with its watcher and its exit-time removal) on the
    first call in each process (a forked child gets its own)."""
    pid = os.getpid()
    if pid in _scratch:
        return _scratch[pid][0]
    import subprocess

    folder = Path(tempfile.gettempdir()) / "k3lab-traces" / str(pid)
    sweep_scratch(folder.parent)
    folder.mkdir(parents=True, exist_ok=True)
    watcher = None
    with contextlib.suppress(OSError):  # without a watcher the exit-time removal still runs
        watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(folder)], stdin=subprocess.PIPE,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    if not _scratch:
        atexit.register(_remove_scratch)
    _scratch[pid] = (folder, watcher)
    return folder


# A trace file (or rocprofv3 folder) as `unique_trace_path` names it: <name>-<device>-<date>-<time>-<pid>-<n>
# [.trace.json[.gz]]. Older versions wrote them straight into <tmp>/k3lab-traces and removed them only
# at a normal exit, so a killed process left its files there.
_TRACE_NAME = re.compile(r"^[A-Za-z0-9_.-]+-[0-9]{8}-[0-9]{6}-(?P<pid>[0-9]+)-[0-9]+"
                         r"(?:\.trace\.json(?:\.gz)?)?$")


def _alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts: signal 0 is refused, not unknown)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True
    return True


def sweep_scratch(root) -> list[Path]:
    """Remove what dead processes left in the scratch root `root` (<tmp>/k3lab-traces), returning what
    was removed: a pid folder (a name of digits) whose process no longer exists, and a trace file or
    folder named as `unique_trace_path` names them whose pid no longer exists (left by older versions
    that wrote there directly). A live process's folder or trace, a symbolic link and every other name
    are left alone, and an entry that cannot be removed (another user's) is skipped. Run when a process
    makes its scratch folder, so leftovers from killed processes do not pile up."""
    root = Path(root)
    removed: list[Path] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if entry.is_symlink():
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        match = _TRACE_NAME.match(entry.name)
        if entry.name.isdigit() and entry.name.isascii() and is_dir:
            pid = int(entry.name)
        elif match is not None:
            pid = int(match["pid"])
        else:
            continue
        if _alive(pid):
            continue
        try:
            if is_dir:
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def _remove_scratch() -> None:
    """At exit: remove this process's scratch folder and let its watcher go (it finds nothing left)."""
    entry = _scratch.get(os.getpid())
    if entry is None:
        return
    folder, watcher = entry
    shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError, ValueError):
        folder.parent.rmdir()  # k3lab-traces itself, when no other process's folder is in it
    if watcher is not None:
        with contextlib.suppress(Exception):
            watcher.stdin.close()
            watcher.wait(timeout=5)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_") or "capture"


def unique_trace_path(trace_dir, name: str, device: str, suffix: str = ".trace.json") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(trace_dir) / f"{_slug(name)}-{device}-{stamp}-{os.getpid()}-{next(_counter)}{suffix}"


def atomic_move(tmp: Path, path: Path, *, overwrite: bool) -> Path:
    """Move a finished temporary file into place; an existing file is kept unless overwrite=True."""
    path = Path(path)
    if path.exists() and not overwrite:
        tmp.unlink(missing_ok=True)
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it (committed reference "
                              "traces are never replaced silently)")
    if str(path).endswith(".gz") and not str(tmp).endswith(".gz"):
        gz_tmp = tmp.with_name(tmp.name + ".gz")
        with open(tmp, "rb") as src, gzip.open(gz_tmp, "wb") as dst:
            shutil.copyfileobj(src, dst)
        tmp.unlink()
        tmp = gz_tmp
    os.replace(tmp, path)  # atomic on one filesystem: readers see the old file or the new one
    return path


def _tmp_beside(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp.json", dir=path.parent)
    os.close(fd)
    return Path(tmp)


def write_chrome_trace(kernels: pd.DataFrame, path, *, overwrite: bool = False, meta: dict
                       | None = None) -> Path:
    """Write a kernel frame as a Chrome/Perfetto trace (one track per device and stream), atomically.

    Used for rocprofv3 results, whose own JSON Perfetto cannot open. Timestamps are written
    relative to the first row (`k3lab_base_ns` keeps the original clock)."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it")
    cats = {"kernel": "kernel", "memcpy": "gpu_memcpy", "memset": "gpu_memset", "cpu_op": "cpu_op",
            "cpu_meta": "cpu_op"}
    devices = {d: i for i, d in enumerate(dict.fromkeys(kernels["device"]))}
    base = int(kernels["start_ns"].min()) if len(kernels) else 0
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": str(dev)}}
              for dev, pid in devices.items()]
    for row in kernels.itertuples(index=False):
        args = {"device": row.device, "category": row.category, "k3lab_kind": row.kind}
        for key in ("stream", "correlation", "bytes"):
            value = getattr(row, key)
            if not pd.isna(value):
                args[key] = int(value)
        events.append({"ph": "X", "cat": cats[row.kind], "name": row.name, "pid": devices[row.device],
                       "tid": int(row.stream) if not pd.isna(row.stream) else 0,
                       "ts": (int(row.start_ns) - base) / 1e3, "dur": int(row.dur_ns) / 1e3, "args": args})
    doc = {"schemaVersion": 1, "displayTimeUnit": "ms", "traceEvents": events, "k3lab_base_ns": base,
           "k3lab": {"source": kernels.attrs.get("source"), **(meta or {})}}
    tmp = _tmp_beside(path)
    tmp.write_text(json.dumps(doc))
    return atomic_move(tmp, path, overwrite=overwrite)


def _device_backend(device: str | None) -> str:
    if device is not None:
        if device not in ("cpu", "cuda", "rocm"):
            raise ValueError(f"device: expected 'cpu', 'cuda', 'rocm' or None, got {device!r}")
        return device
    from k3lab import env

    return env.detect().backend


def _note_for(backend: str, device: str) -> str:
    tracer = {"cuda": "CUPTI kernels", "rocm": "roctracer kernels", "cpu": "CPU ops"}[device]
    if backend == "torch":
        return f"torch.profiler ({tracer})"
    if shutil.which("rocprofv3") is None:
        return f"rocprofv3 not on PATH: using torch.profiler ({tracer})"
    return (f"rocprofv3 is on PATH but traces a child process (use capture_rocprofv3 with a script); "
            f"this in-process capture uses torch.profiler ({tracer})")


@contextlib.contextmanager
def _without_kineto_chatter():
    """Run the block with file descriptor 2 sent to a temporary file, then copy every line that is not
    Kineto's progress chatter back to stderr (so a real native error message still shows)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(keepends=True)
                    if not _KINETO_CHATTER.match(ln)]
            if kept:
                os.write(2, "".join(kept).encode())


def capture(fn: Callable[[], object], *, steps: int = 1, warmup: int = 1, trace_dir=None, name: str
            | None = None,
            backend: str = "auto", device: str | None = None, trace_path=None, overwrite: bool = False,
            record_shapes: bool = True) -> Capture:
    """Profile `steps` calls of `fn()` (after `warmup` unprofiled calls) with torch.profiler.

    device: None detects the backend (k3lab.env); 'cpu' records CPU ops only, even on a GPU machine.
    trace_path: exact output path (.json or .json.gz); by default a new file in `trace_dir`
    (default `default_trace_dir()`, whose temp-folder traces last as long as this process) named after
    `name`. An existing file is never replaced
    unless overwrite=True. On a GPU, a capture that recorded no kernel raises NoKernelsRecorded
    (the trace is kept and named in the message).
    """
    if not callable(fn):
        raise ValueError(f"fn: expected a callable taking no arguments, got {type(fn).__name__}; "
                         "for a script or command use capture_rocprofv3")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup: expected an int >= 0, got {warmup!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "rocprofv3":
        raise ValueError("backend='rocprofv3' traces a child process and cannot profile a Python callable "
                         "in this process; call capture_rocprofv3(script_or_cmd) instead")
    dev = _device_backend(device)
    name = name or getattr(fn, "__name__", "capture")
    note = _note_for(backend, dev)
    if backend == "auto" and dev == "rocm" and note not in _said:
        print(f"k3lab.profile: {note}")  # say once per process what is used instead of rocprofv3
        _said.add(note)

    path = Path(trace_path) if trace_path is not None else unique_trace_path(
        trace_dir or default_trace_dir(), name, dev)
    if path.exists() and not overwrite:  # checked before anything runs
        raise FileExistsError(f"trace_path: {path} exists; pass overwrite=True to replace it")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from k3lab.profiling.export import STEP_PREFIX, label

    gpu = dev != "cpu"
    if gpu and not torch.cuda.is_available():
        raise ValueError(f"device: {dev!r} asked for, but torch sees no GPU; use device='cpu' or None")
    for _ in range(warmup):
        fn()
    if gpu:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    with _without_kineto_chatter(), profile(activities=activities, record_shapes=record_shapes) as prof:
        for i in range(steps):
            with label(f"{STEP_PREFIX}{i}"):  # a record_function range, and NVTX / ROCTX on a GPU
                fn()
        if gpu:
            torch.cuda.synchronize()

    tmp = _tmp_beside(path)
    prof.export_chrome_trace(str(tmp))
    trace = json.loads(tmp.read_text())
    path = atomic_move(tmp, path, overwrite=overwrite)
    try:
        kernels = kernels_from_trace(trace, expect_gpu=gpu, label=f"capture {name!r} ({path})")
    except NoKernelsRecorded as err:
        raise NoKernelsRecorded(f"{err} Trace kept at {path}.") from None
    if not gpu and len(kernels) == 0:
        note += "; the region ran no ATen op (pure-Python or Triton-interpreter work is not traced as ops)"
    return Capture(kernels=kernels, steps=steps, trace_path=path, backend="torch.profiler", device=dev,
                   name=name, note=note, files=[path], _profiler=prof)
