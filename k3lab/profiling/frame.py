"""The one kernel table every reader returns, and the aggregations over it.

A kernel frame has one row per execution of a GPU kernel, memory copy or memset (or, in a CPU
trace, per top-level ATen op) with these columns:

  name        kernel / op name as the tool wrote it
  category    `categorize(name)`
  kind        'kernel', 'memcpy', 'memset'; on a CPU trace 'cpu_op', or 'cpu_meta' for a view or
              metadata op that does no work (aten::view, aten::t, ...: no kernel on a GPU)
  start_ns    start on the tool's own clock, integer nanoseconds (int64)
  dur_ns      duration, integer nanoseconds (int64)
  start_us    start in microseconds from the first row of the file (float; for timelines)
  dur_us      duration in microseconds (float)
  bytes       bytes moved, where the tool says (memory copies); <NA> elsewhere (nullable Int64)
  device      where it ran: 'gpu0', 'Agent 4', 'cpu', ...
  stream      stream or queue id where known (nullable Int64)
  correlation the launch's correlation id where known (nullable Int64)
  source      which reader produced the row ('torch', 'rocprofv3-csv', 'rocprofv3-json', ...)
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from k3lab.profiling.categories import categorize

COLUMNS = ("name", "category", "kind", "start_ns", "dur_ns", "start_us", "dur_us", "bytes", "device",
           "stream", "correlation", "source")
KINDS = ("kernel", "memcpy", "memset", "cpu_op", "cpu_meta")
TABLE_COLUMNS = ("name", "category", "calls", "total_us", "mean_us", "min_us", "max_us", "share", "bytes")


class NoKernelsRecorded(RuntimeError):
    """A GPU trace or capture holds no kernel: the tracer (CUPTI / roctracer) saw nothing.

    Raised instead of returning an empty table, so a broken trace never reads as "zero cost".
    """


def _nullable_int(values: Iterable) -> pd.Series:
    return pd.array([None if v is None or (isinstance(v, float) and np.isnan(v)) else int(v)
                     for v in values], dtype="Int64")


def make_frame(rows: list[dict], source: str) -> pd.DataFrame:
    """Build a kernel frame from row dicts holding name, kind, start_ns, dur_ns and optionally
    bytes, device, stream, correlation. Sorted by start; start_us counts from the first row."""
    if not rows:
        frame = pd.DataFrame({c: pd.Series(dtype=t) for c, t in _EMPTY_DTYPES.items()})
        frame.attrs["source"] = source
        return frame
    start = np.array([int(r["start_ns"]) for r in rows], dtype=np.int64)
    dur = np.array([int(r["dur_ns"]) for r in rows], dtype=np.int64)
    names = [str(r["name"]) for r in rows]
    frame = pd.DataFrame({
        "name": names,
        "category": [categorize(n) for n in names],
        "kind": [r["kind"] for r in rows],
        "start_ns": start,
        "dur_ns": dur,
        "start_us": (start - start.min()) / 1e3,
        "dur_us": dur / 1e3,
        "bytes": _nullable_int(r.get("bytes") for r in rows),
        "device": [str(r.get("device", "")) for r in rows],
        "stream": _nullable_int(r.get("stream") for r in rows),
        "correlation": _nullable_int(r.get("correlation") for r in rows),
        "source": source,
    })
    bad = set(frame["kind"]) - set(KINDS)
    if bad:
        raise ValueError(f"make_frame: kind must be one of {KINDS}, got {sorted(bad)}")
    frame = frame.sort_values("start_ns", kind="stable").reset_index(drop=True)
    frame.attrs["source"] = source
    return frame


_EMPTY_DTYPES = {"name": object, "category": object, "kind": object, "start_ns": np.int64,
                 "dur_ns": np.int64, "start_us": float, "dur_us": float, "bytes": "Int64",
                 "device": object, "stream": "Int64", "correlation": "Int64", "source": object}


def concat_frames(frames: list[pd.DataFrame], source: str) -> pd.DataFrame:
    """Join frames from one run (a kernel trace and a copy trace, say) on one clock."""
    frames = [f for f in frames if len(f)]
    if not frames:
        return make_frame([], source)
    out = pd.concat(frames, ignore_index=True).sort_values("start_ns", kind="stable")
    out = out.reset_index(drop=True)
    out["start_us"] = (out["start_ns"] - out["start_ns"].min()) / 1e3
    out.attrs["source"] = source
    return out


def _check_frame(df: pd.DataFrame, who: str) -> None:
    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{who}: expected a kernel DataFrame, got {type(df).__name__}")
    missing = [c for c in ("name", "category", "dur_us") if c not in df.columns]
    if missing:
        raise ValueError(f"{who}: the DataFrame lacks columns {missing}; pass the output of "
                         "read_trace() or Capture.kernels")


def kernel_table(df: pd.DataFrame) -> pd.DataFrame:
    """Aggregate a kernel frame per name: calls, total/mean/min/max time (us), share of the total
    time (0..1) and bytes moved (where known), sorted by total time, largest first."""
    _check_frame(df, "kernel_table")
    if len(df) == 0:
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("name", "category") else float)
                             for c in TABLE_COLUMNS})
    has_bytes = "bytes" in df.columns
    grouped = df.groupby(["name", "category"], sort=False, dropna=False)
    table = grouped["dur_us"].agg(calls="count", total_us="sum", mean_us="mean", min_us="min",
                                  max_us="max").reset_index()
    if has_bytes:
        # min_count=1: a kernel with no byte count stays <NA> rather than becoming 0 bytes.
        table["bytes"] = pd.array(grouped["bytes"].sum(min_count=1).to_numpy(), dtype="Int64")
    else:
        table["bytes"] = pd.array([None] * len(table), dtype="Int64")
    total = table["total_us"].sum()
    table["share"] = table["total_us"] / total if total > 0 else 0.0
    table = table.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)
    return table[list(TABLE_COLUMNS)]


def category_table(df: pd.DataFrame) -> pd.DataFrame:
    """Like `kernel_table`, but one row per category."""
    _check_frame(df, "category_table")
    table = df.groupby("category", sort=False)["dur_us"].agg(calls="count", total_us="sum").reset_index()
    total = table["total_us"].sum()
    table["share"] = table["total_us"] / total if total > 0 else 0.0
    return table.sort_values("total_us", ascending=False, kind="stable").reset_index(drop=True)


def _per_step(value: int, steps: int):
    return value // steps if value % steps == 0 else value / steps


def counts(df: pd.DataFrame, steps: int = 1) -> dict:
    """Per-step counts from a kernel frame.

    launches:     device operations enqueued (kernels, memcpys, memsets); on a CPU trace, top-level
                  ops that do work (kind 'cpu_meta' rows, views and metadata, are not counted)
    copies:       launches whose category is 'copy' (DMA copies and copy kernels alike)
    bytes_copied: bytes of those copies where the trace gives a size (0 when none does; see
                  `bytes_known`, the number of copies with a known size)
    api_launches: host API calls that enqueued work (cudaLaunchKernel, hipModuleLaunchKernel,
                  cudaGraphLaunch, cudaMemcpyAsync, ...), from a torch.profiler GPU trace; None
                  elsewhere. A graph replay shows many kernels but one API launch.
    Integers when `steps` divides the totals, floats otherwise.
    """
    _check_frame(df, "counts")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"counts: steps must be a positive int, got {steps!r}")
    work = df[df["kind"] != "cpu_meta"] if "kind" in df.columns else df
    copies = work[work["category"] == "copy"]
    known = copies["bytes"].dropna() if "bytes" in copies.columns else pd.Series(dtype="Int64")
    return {
        "launches": _per_step(len(work), steps),
        "copies": _per_step(len(copies), steps),
        "bytes_copied": _per_step(int(known.sum()) if len(known) else 0, steps),
        "bytes_known": _per_step(len(known), steps),
        "api_launches": _per_step(df.attrs["api_launches"], steps) if "api_launches" in df.attrs else None,
    }
