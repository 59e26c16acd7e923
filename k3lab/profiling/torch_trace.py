"""Read torch.profiler (Kineto) Chrome-trace JSON: CUDA (CUPTI), ROCm (roctracer) and CPU traces.

What the reader relies on (shared/fixtures/FORMATS.md section 11, checked on the fixtures):
- device work is `ph == "X"` with `cat` 'kernel', 'gpu_memcpy' or 'gpu_memset' on both vendors;
  `ts`/`dur` are microseconds (floats with ns fractions on ROCm, integers on older CUDA);
- `args.device` / `args.stream` / `args.correlation` / `args['External id']` on device rows;
- CUDA memcpy rows carry `args.bytes`, ROCm ones do not: there the size is recovered from the
  ATen copy op the memcpy came from (linked by External id), when exactly one memcpy links to it;
- host launch calls are `cat == "cuda_runtime"` on both vendors (hipLaunchKernel on ROCm).
A CPU-only trace has no device rows: its rows are the top-level ATen ops of each thread (an op
called inside another op, such as aten::mm inside aten::matmul, is part of its parent's row);
view and metadata ops that do no work (aten::view, aten::t, a no-op aten::contiguous) get kind
'cpu_meta', so they are not counted as launches.
"""

from __future__ import annotations

import math
import re

import pandas as pd

from k3lab.profiling.frame import NoKernelsRecorded, make_frame

_DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset",
                "memcpy": "memcpy", "memset": "memset"}
_LAUNCH = re.compile(r"launchkernel|modulelaunch|graphlaunch|culaunch|launchcooperative", re.IGNORECASE)
# Host API calls that put work on a stream: kernel and graph launches, async copies and memsets.
# With a CUDA/HIP graph, one graph launch replaces many kernel launches: this count shows it.
_ENQUEUE = re.compile(r"launchkernel|modulelaunch|graphlaunch|culaunch|launchcooperative|memcpy|memset",
                      re.IGNORECASE)
_COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize",
             "aten::to", "aten::clone", "aten::contiguous"}

# ATen dtype names as the profiler's "Input type" writes them -> bytes per element.
DTYPE_BYTES = {
    "float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "long": 8,
    "int": 4, "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::complex<float>": 8, "c10::complex<double>": 16, "c10::complex<c10::Half>": 4,
    "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1, "c10::Float8_e4m3fnuz": 1,
    "c10::Float8_e5m2fnuz": 1, "c10::Float8_e8m0fnu": 1, "unsigned int": 4, "unsigned short": 2,
    "unsigned long": 8,
}


def is_torch_trace(obj) -> bool:
    """A Kineto trace: a dict with a traceEvents list and Kineto's schemaVersion or deviceProperties,
    or events in Kineto categories (cpu_op, kernel, cuda_runtime)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        return False
    if "schemaVersion" in obj or "deviceProperties" in obj:
        return True
    cats = {e.get("cat") for e in obj["traceEvents"][:2000] if isinstance(e, dict)}
    return bool(cats & {"cpu_op", "kernel", "cuda_runtime", "gpu_memcpy"})


def vendor_of(trace: dict) -> str:
    """'rocm', 'cuda' or 'cpu' for a Kineto trace (FORMATS.md section 11 "Detect ROCm/CUDA")."""
    if any(k in trace for k in ("roctracer_version", "hip_runtime_version", "hip_driver_version")):
        return "rocm"
    if any(k in trace for k in ("cuda_runtime_version", "cuda_driver_version", "cupti_version")):
        return "cuda"
    names = [str(e.get("name", "")) for e in trace.get("traceEvents", [])
             if isinstance(e, dict) and e.get("cat") == "cuda_runtime"]
    if any(n.startswith("hip") for n in names):
        return "rocm"
    if any(n.startswith("cu") for n in names):
        return "cuda"
    props = trace.get("deviceProperties") or []
    warp = {p.get("warpSize") for p in props if isinstance(p, dict)}
    if 64 in warp:
        return "rocm"
    if 32 in warp:
        return "cuda"
    has_device_rows = any(isinstance(e, dict) and str(e.get("cat", "")).lower() in _DEVICE_CATS
                          for e in trace.get("traceEvents", []))
    return "gpu" if has_device_rows else "cpu"


def _ns(value) -> int:
    # ts/dur are microseconds; ROCm writes floats with ns fractions, older CUDA writes integers.
    return round(float(value) * 1000.0)


def _int_or_none(value):
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def op_bytes(event: dict):
    """Size of the first tensor input of a CPU op from its recorded shapes, or None."""
    args = event.get("args") or {}
    dims, types = args.get("Input Dims"), args.get("Input type")
    if not dims or not types or not isinstance(dims[0], list):
        return None
    size = DTYPE_BYTES.get(types[0])
    if size is None or not dims[0]:
        return None
    return math.prod(int(d) for d in dims[0]) * size


# Ops that only make a view or metadata (or return their input unchanged): on a GPU they launch
# nothing. A top-level op counts as work if it, or any op nested in it, is not one of these
# (aten::reshape that had to copy calls aten::clone; aten::contiguous of a contiguous tensor calls nothing).
META_OPS = frozenset(f"aten::{op}" for op in (
    "view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute", "expand", "expand_as",
    "as_strided", "slice", "select", "unsqueeze", "squeeze", "unbind", "split", "split_with_sizes", "chunk",
    "narrow", "detach", "alias", "resolve_conj", "resolve_neg", "contiguous", "to", "lift_fresh", "empty",
    "empty_like", "empty_strided", "flatten", "unflatten", "view_as", "diagonal", "movedim", "swapaxes",
    "numpy_T", "real", "imag", "view_as_real", "view_as_complex", "_nested_tensor_from_mask_left_aligned",
    "set_", "result_type", "is_nonzero", "size", "stride", "dim", "requires_grad_"))


def _top_level_ops(ops: list[dict]) -> list[tuple[dict, bool]]:
    """(op, does_work) for each op not nested inside another op on the same thread: one row per
    user-visible op call. does_work is False for a view/metadata op with no working op inside."""
    by_thread: dict[tuple, list[dict]] = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    top: list[list] = []
    for events in by_thread.values():
        events.sort(key=lambda e: (_ns(e["ts"]), -_ns(e["ts"]) - _ns(e.get("dur", 0))))
        open_until = None
        for e in events:
            start, end = _ns(e["ts"]), _ns(e["ts"]) + _ns(e.get("dur", 0))
            works = str(e.get("name", "")) not in META_OPS
            if open_until is None or start >= open_until:
                top.append([e, works])
                open_until = end
            elif works:
                top[-1][1] = True  # a working op nested in the current top-level op
    return [(e, works) for e, works in top]


def kernels_from_trace(trace, *, expect_gpu: bool | None = None, label: str = "trace") -> pd.DataFrame:
    """Kernel frame of a Kineto trace (a parsed JSON dict).

    expect_gpu=True: the trace must hold device rows, else NoKernelsRecorded (a GPU capture that
    recorded no kernel). None: raise only when the trace shows kernel launches but no kernels
    (the device tracer failed); a trace with neither is read as a CPU trace.
    """
    if not is_torch_trace(trace):
        raise ValueError(f"{label}: not a torch.profiler (Kineto) trace: no traceEvents list")
    events = [e for e in trace["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    vendor = vendor_of(trace)
    device_events = [e for e in events if str(e.get("cat", "")).lower() in _DEVICE_CATS]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    launches = [e for e in events if e.get("cat") == "cuda_runtime"
                and _LAUNCH.search(str(e.get("name", "")))]

    if device_events:
        frame = make_frame(_device_rows(device_events, cpu_ops), source="torch")
        frame.attrs["api_launches"] = sum(
            1 for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
            and _ENQUEUE.search(str(e.get("name", ""))))
    elif expect_gpu or (expect_gpu is None and launches):
        if not launches and cpu_ops:  # nothing was sent to the GPU: the region's tensors live on the CPU
            why = ("No launch call was made while CPU ops ran: the region computed on CPU tensors. Move its "
                   "tensors to the GPU, or capture with device='cpu' to profile the CPU ops.")
        else:
            why = ("The device tracer (CUPTI on NVIDIA, roctracer/rocprofiler on ROCm) recorded nothing: "
                   "check that the profiler was given the CUDA activity and that the work ran inside the "
                   "region.")
        raise NoKernelsRecorded(
            f"{label}: a GPU trace ({vendor}) with no kernel, memcpy or memset row "
            f"({len(launches)} launch calls, {len(cpu_ops)} CPU ops recorded). {why}")
    else:
        rows = []
        for e, works in _top_level_ops(cpu_ops):
            name, args = str(e.get("name", "")), e.get("args") or {}
            # traces k3lab wrote keep theirs
            kind = args.get("k3lab_kind") or ("cpu_op" if works else "cpu_meta")
            nbytes = _int_or_none(args.get("bytes"))  # likewise
            if nbytes is None and name in _COPY_OPS and kind == "cpu_op":
                nbytes = op_bytes(e)
            rows.append({"name": name, "kind": kind, "start_ns": _ns(e["ts"]),
                         "dur_ns": _ns(e.get("dur", 0)), "device": "cpu",
                         "stream": _int_or_none(args.get("stream", e.get("tid"))),
                         "correlation": _int_or_none(args.get("External id", args.get("correlation"))),
                         "bytes": nbytes})
        frame = make_frame(rows, source="torch")
        vendor = "cpu"  # the rows are CPU ops, whatever machine wrote the trace
    frame.attrs.update(vendor=vendor, devices=[p.get("name") for p in trace.get("deviceProperties") or []
                                               if isinstance(p, dict)],
                       base_time_ns=trace.get("baseTimeNanoseconds"))
    return frame


def _device_rows(device_events: list[dict], cpu_ops: list[dict]) -> list[dict]:
    ops_by_ext = {}
    for e in cpu_ops:
        ext = (e.get("args") or {}).get("External id")
        if ext is not None:
            ops_by_ext[ext] = e
    memcpy_per_ext: dict = {}
    for e in device_events:
        if _DEVICE_CATS[str(e.get("cat")).lower()] == "memcpy":
            ext = (e.get("args") or {}).get("External id")
            memcpy_per_ext[ext] = memcpy_per_ext.get(ext, 0) + 1
    rows = []
    for e in device_events:
        args = e.get("args") or {}
        kind = _DEVICE_CATS[str(e.get("cat")).lower()]
        nbytes = _int_or_none(args.get("bytes"))
        if nbytes is None and kind == "memcpy":
            # ROCm Kineto gives no size: take it from the ATen copy op behind this memcpy, but only
            # when that op issued exactly this one memcpy (otherwise the size would be counted twice).
            ext = args.get("External id")
            op = ops_by_ext.get(ext)
            if op is not None and op.get("name") in _COPY_OPS and memcpy_per_ext.get(ext) == 1:
                nbytes = op_bytes(op)
        device = args.get("device", e.get("pid"))
        rows.append({"name": str(e.get("name", "")), "kind": kind, "start_ns": _ns(e["ts"]),
                     "dur_ns": _ns(e.get("dur", 0)), "bytes": nbytes,
                     "device": f"gpu{device}" if _int_or_none(device) is not None else str(device),
                     "stream": _int_or_none(args.get("stream", e.get("tid"))),
                     "correlation": _int_or_none(args.get("correlation"))})
    return rows
