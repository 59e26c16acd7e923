"""Open any trace file k3lab understands and return its kernel frame.

Detection looks at the content, not only the name: gzip and SQLite magic bytes, the top-level
JSON keys (rocprofv3's "rocprofiler-sdk-tool", Kineto's traceEvents + schemaVersion, legacy
rocprof's GPU/COPY process names), and for CSV the header columns.
"""

from __future__ import annotations

import gzip
import json
import sqlite3
from pathlib import Path

import pandas as pd

from k3lab.profiling import legacy, rocpd, rocprofv3
from k3lab.profiling.csvutil import header_of
from k3lab.profiling.frame import concat_frames
from k3lab.profiling.torch_trace import is_torch_trace, kernels_from_trace

_SQLITE_MAGIC = b"SQLite format 3\x00"
_GZIP_MAGIC = b"\x1f\x8b"

FORMATS = {
    "rocprofv3-kernel-csv": "rocprofv3 *_kernel_trace.csv",
    "rocprofv3-copy-csv": "rocprofv3 *_memory_copy_trace.csv",
    "rocprofv3-json": "rocprofv3 *_results.json (gzipped or not)",
    "rocpd": "rocpd SQLite *_results.db (rocprofv3 default from ROCm 7.0)",
    "rocprof-v1-csv": "legacy rocprof v1 results.csv",
    "rocprof-v1-json": "legacy rocprof v1 results.json",
    "rocprof-v1-db": "legacy rocprof v1 results.db",
    "torch": "torch.profiler Chrome trace JSON (CUDA, ROCm or CPU; gzipped or not)",
    "stats": "kernel statistics CSV (rocprofv3 --stats, rocprof v1 results.stats.csv): use read_stats",
}


def _raw(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == _GZIP_MAGIC else data


def _unknown(path: Path, what: str) -> ValueError:
    known = "; ".join(FORMATS.values())
    return ValueError(f"read_trace: {path} is not a supported trace ({what}). Supported: {known}; "
                      "or a rocprofv3 output directory")


def detect_format(path) -> str:
    """Name of the format of `path` (a key of FORMATS, or 'rocprofv3-dir'); ValueError naming
    the file when it is none of them."""
    return _sniff(Path(path))[0]


def _sniff(path: Path):
    """(format, payload): the parsed JSON object or the decoded text, so a file is read once."""
    if not path.exists():
        raise ValueError(f"read_trace: {path} does not exist")
    if path.is_dir():
        return "rocprofv3-dir", None
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(_SQLITE_MAGIC):
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            names = rocpd.object_names(con)
        finally:
            con.close()
        if rocpd.is_rocpd(names):
            return "rocpd", None
        if legacy.is_v1_db(names):
            return "rocprof-v1-db", None
        raise _unknown(path, f"an SQLite database with tables {sorted(names)[:8]}")
    data = _raw(path)
    if data.lstrip()[:1] in (b"{", b"["):
        obj = _json(path, data)
        return _json_format(path, obj), obj
    text = data.decode("utf-8", errors="replace")
    header = header_of(text[:65536])
    if rocprofv3.is_kernel_trace_header(header):
        return "rocprofv3-kernel-csv", text
    if rocprofv3.is_copy_trace_header(header):
        return "rocprofv3-copy-csv", text
    if legacy.is_v1_csv_header(header):
        return "rocprof-v1-csv", text
    if rocprofv3.is_stats_header(header):
        return "stats", text
    if {"domain", "function"} <= set(header):
        raise _unknown(path, "a host API trace (HIP/HSA/marker/RCCL calls), which has no GPU kernels")
    if "counter_name" in header:
        raise _unknown(path, "a counter-collection CSV (one row per kernel x counter)")
    if '"Metric Name"' in text[:65536] or '"Kernel Name"' in text[:65536]:
        raise _unknown(path, "Nsight Compute CSV output: read it with parse_ncu_csv")
    raise _unknown(path, f"first line {text[:80]!r}")


def _json(path: Path, data: bytes):
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise _unknown(path, f"invalid JSON: {err}") from None


def _json_format(path: Path, obj) -> str:
    if rocprofv3.is_results_json(obj):
        return "rocprofv3-json"
    if legacy.is_v1_json(obj):
        return "rocprof-v1-json"
    if is_torch_trace(obj):
        return "torch"
    keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
    raise _unknown(path, f"JSON with top-level keys {keys}")


def read_trace(path) -> pd.DataFrame:
    """Kernel frame (one row per kernel / copy execution; see k3lab.profiling.frame) of any
    supported file, or of a rocprofv3 output directory. ValueError for an unknown format."""
    path = Path(path)
    fmt, payload = _sniff(path)
    readers = {
        "rocprofv3-dir": lambda: read_rocprofv3_dir(path),
        "rocpd": lambda: rocpd.read_rocpd(path),
        "rocprof-v1-db": lambda: legacy.read_v1_db(path),
        "rocprofv3-json": lambda: rocprofv3.read_results_json(payload),
        "rocprof-v1-json": lambda: legacy.read_v1_json(payload),
        "torch": lambda: kernels_from_trace(payload, label=str(path)),
        "rocprofv3-kernel-csv": lambda: rocprofv3.read_kernel_trace_csv(payload),
        "rocprofv3-copy-csv": lambda: rocprofv3.read_copy_trace_csv(payload),
        "rocprof-v1-csv": lambda: legacy.read_v1_csv(payload),
    }
    if fmt == "stats":
        raise ValueError(f"read_trace: {path} holds per-name statistics, not one row per kernel "
                         "execution; read it with read_stats")
    frame = readers[fmt]()
    frame.attrs["path"] = str(path)
    frame.attrs["format"] = fmt
    return frame


def read_stats(path) -> pd.DataFrame:
    """A kernel statistics CSV (rocprofv3 `*_kernel_stats.csv`, legacy `results.stats.csv`) as a
    kernel table (the columns of kernel_table)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"read_stats: {path} is not a file")
    return rocprofv3.read_stats_csv(_raw(path).decode("utf-8"))


def read_rocprofv3_dir(directory) -> pd.DataFrame:
    """Everything one rocprofv3 run wrote under `directory` (any depth; rocprofv3 nests files
    under host/pid folders by default): the JSON results if present, else the kernel and copy
    CSVs, else rocpd databases. Several processes' files are joined."""
    directory = Path(directory)
    found = {kind: sorted(directory.rglob(pattern)) for kind, pattern in (
        ("json", "*_results.json*"), ("kernel", "*_kernel_trace.csv"), ("copy", "*_memory_copy_trace.csv"),
        ("db", "*_results.db"))}
    if found["json"]:
        frames = [read_trace(p) for p in found["json"]]
    elif found["kernel"] or found["copy"]:
        frames = [read_trace(p) for p in found["kernel"] + found["copy"]]
    elif found["db"]:
        frames = [read_trace(p) for p in found["db"]]
    else:
        raise ValueError(f"read_trace: {directory} holds no rocprofv3 output (*_results.json, "
                         "*_kernel_trace.csv, *_memory_copy_trace.csv or *_results.db)")
    source = frames[0].attrs.get("source", "rocprofv3")
    out = concat_frames(frames, source=source)
    out.attrs["files"] = [str(p) for ps in found.values() for p in ps]
    return out
