"""HolisticTraceAnalysis (HTA) on a before/after pair of k3lab traces, as two small tables.

    folders = hta.write_folders({"before": cap_before, "after": cap_after})  # Captures or trace paths
    result = hta.compare(folders["before"], folders["after"])
    result.note        # who made the tables (HTA and its version, or k3lab and why not HTA) and what rows are
    result.breakdown   # per variant and name: time and its share
    result.diff        # the names whose call count changed or that moved a large share of the time

Where HTA is installed (the `hta` extra: pip install -e ".[hta]") the tables are HTA's:
- breakdown: for a trace with GPU kernels, HTA's GPU kernel breakdown (`get_gpu_kernel_breakdown`:
  per kernel sum/mean/min/max us and its type, the smallest folded into 'others'), calls = sum / mean
  (HTA gives no count), share = the kernel's part of the variant's kernel time; for a CPU trace (no
  GPU kernel) HTA's op summary over the steps (calls and total us per op name, from HTA's own parse),
  share = the op's time over the steps' time, inclusive of the ops it calls, so nested ops' shares
  overlap.
- diff: HTA's TraceDiff over every step of both folders, GPU kernels or CPU ops (export.hta_trace_diff).
HTA's parser rounds each event to whole microseconds by default, which makes sub-microsecond CPU ops
negative; the calls here turn that rounding off (HTA_DISABLE_NS_ROUNDING) for their duration.
For a GPU pair HTA reads copies of the folders without the host's operator events (`HOST_OP_CATEGORIES`,
`without_host_ops`): its GPU tables place each kernel in a step through the runtime launch that
correlates with it, so those events, often half of a trace and the costliest for HTA to parse (it builds
their call stacks), change nothing in them (tests/test_hta_tables.py compares both reads on the H200
pair); `host_ops=True` reads the whole folders.

Without HTA the same call returns k3lab's own tables, labelled so (`source == "k3lab"`): the
variants' `kernel_table` and `trace_diff`, read from the same folders.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from k3lab.profiling import export
from k3lab.profiling.diff import DEVICE_KINDS, device_work, trace_diff
from k3lab.profiling.frame import kernel_table
from k3lab.profiling.read import read_trace

DIFF_COLUMNS = ("name", "change", "before_calls", "after_calls", "before_us", "after_us", "diff_us")
# the host events HTA's GPU tables do not read (module docstring); the step marks are always kept
HOST_OP_CATEGORIES = frozenset({"cpu_op", "python_function"})
BREAKDOWN_COLUMNS = ("variant", "name", "kind", "calls", "total_us", "share")


@dataclass(frozen=True)
class Comparison:
    """A before/after pair's two tables (module docstring). source: 'HTA' or 'k3lab'; device: 'gpu'
    when the traces hold GPU kernels, else 'cpu' (host ops); note: one line saying both."""

    breakdown: pd.DataFrame
    diff: pd.DataFrame
    source: str
    device: str
    note: str

    def __str__(self) -> str:
        return self.note

    def _repr_html_(self) -> str:
        import html

        return (f"<p>{html.escape(self.note)}</p>"
                f"<b>Breakdown</b>{self.breakdown.round(3).to_html(index=False)}"
                f"<b>Diff</b>{self.diff.round(2).to_html(index=False)}")


def _rank_file(folder) -> Path:
    folder = Path(folder)
    files = sorted(folder.glob("rank-*.json*")) if folder.is_dir() else []
    if not files:
        raise ValueError(f"folder: {folder} holds no rank-<N>.json.gz (write it with write_folders or "
                         "k3lab.profile.write_hta_folder)")
    return files[0]


def write_folders(traces: dict, root=None) -> dict[str, Path]:
    """For each variant -> Capture (or trace path) of `traces`, the HTA folder `export.write_hta_folder`
    writes beside the trace (or under `root`), named after the trace file, replaced if present.
    Returns variant -> folder."""
    if not isinstance(traces, dict) or not traces:
        raise ValueError(f"traces: expected a dict variant -> Capture or trace path, got {traces!r}")
    out = {}
    for variant, item in traces.items():
        path = getattr(item, "trace_path", item)
        if not isinstance(path, (str, Path)) or not Path(path).is_file():
            raise ValueError(f"traces[{variant!r}]: expected a Capture with a trace file or a trace path, "
                             f"got {item!r}")
        path = Path(path)
        folder = Path(root) if root is not None else path.parent
        folder = folder / f"{path.name.split('.')[0]}.hta"
        export.write_hta_folder(path, folder, overwrite=True)
        out[variant] = folder
    return out


def without_host_ops(folder, into) -> Path:
    """A copy of an HTA folder's rank files in `into` without the complete events of the host's operators
    (categories HOST_OP_CATEGORIES; `ProfilerStep#N` ranges kept whatever their category): what HTA's
    GPU kernel breakdown and GPU trace diff read, at a fraction of the parse. Returns `into`."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(folder).glob("rank-*.json*")):
        doc = export._trace(f)
        keep = [e for e in doc["traceEvents"]
                if not (isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") in HOST_OP_CATEGORIES
                        and not str(e.get("name", "")).startswith("ProfilerStep#"))]
        name = f.name if f.name.endswith(".gz") else f.name + ".gz"
        (into / name).write_bytes(gzip.compress(json.dumps({**doc, "traceEvents": keep}).encode(), 1))
    return into


def _steps_in(folder) -> int:
    """The ProfilerStep ranges in a folder's trace (k3lab's per-step figures divide by it)."""
    return max(len(export.trace_steps(folder)), 1)


@contextlib.contextmanager
def _exact_times():
    """HTA_DISABLE_NS_ROUNDING=1 while HTA parses (module docstring), restored afterwards."""
    key = "HTA_DISABLE_NS_ROUNDING"
    old = os.environ.get(key)
    os.environ[key] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def _hta_breakdown(folder, device: str) -> pd.DataFrame:
    if device == "gpu":
        k = export.hta_kernel_breakdown(folder)
        calls = (k["sum_us"] / k["mean_us"]).where(k["mean_us"] > 0).round()
        out = pd.DataFrame({"name": k["name"], "kind": k["kernel_type"], "calls": calls,
                            "total_us": k["sum_us"].astype(float)})
        total = out["total_us"].sum()
    else:
        from hta.trace_diff import DeviceType, LabeledTrace

        with export._quiet_hta():
            lt = LabeledTrace(label="k3lab", trace_dir=str(folder))
            ops = lt.extract_ops(iteration=lt.iterations(), device_type=DeviceType.CPU)
            summary = lt.get_ops_summary(ops)
        steps = summary["name"].str.startswith("ProfilerStep#")
        total = float(summary.loc[steps, "total_duration"].sum())
        rows = summary[~steps & ~summary["name"].str.startswith(export.STEP_PREFIX)]
        out = pd.DataFrame({"name": rows["name"], "kind": rows["cat"], "calls": rows["counts"],
                            "total_us": rows["total_duration"].astype(float)})
    out["share"] = out["total_us"] / total if total > 0 else 0.0
    return out.sort_values("total_us", ascending=False, kind="stable")


def _k3lab_breakdown(frame: pd.DataFrame) -> pd.DataFrame:
    t = kernel_table(device_work(frame))
    return t.rename(columns={"category": "kind"})[["name", "kind", "calls", "total_us", "share"]]


def _select(diff: pd.DataFrame, before_total: float, min_share: float) -> pd.DataFrame:
    """The rows whose call count changed, then those whose time moved by min_share of before's total
    time, each group largest time change first."""
    calls = diff["before_calls"] != diff["after_calls"]
    keep = calls | (diff["diff_us"].abs() >= min_share * before_total)
    # every column from the kept rows alone: a full-length column would bring the dropped rows back
    # as NaN when nothing is kept (two traces of the same work)
    out = diff[keep].assign(_c=~calls[keep], _o=-diff.loc[keep, "diff_us"].abs())
    out = out.sort_values(["_c", "_o"], kind="stable")[list(DIFF_COLUMNS)].reset_index(drop=True)
    return out.astype({"before_calls": int, "after_calls": int})


def compare(before, after, *, min_share: float = 0.05, top: int = 12, host_ops: bool = False) -> Comparison:
    """HTA's kernel breakdown and trace diff of two HTA folders (module docstring), or k3lab's own tables
    where HTA does not import (the note says which ran and why). The diff keeps the names whose call
    count changed (listed first) or whose time moved by at least `min_share` of before's total (GPU:
    its kernel time; CPU: its top-level ops' time); each table holds at most `top` rows per variant
    (breakdown) or in all (diff), largest first. host_ops: let HTA read a GPU pair's host operator
    events too (by default it reads copies without them: the same tables, sooner)."""
    if not isinstance(min_share, (int, float)) or not 0 <= min_share < 1:
        raise ValueError(f"min_share: expected a number in [0, 1), got {min_share!r}")
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        raise ValueError(f"top: expected a positive int, got {top!r}")
    if not isinstance(host_ops, bool):
        raise ValueError(f"host_ops: expected True or False, got {host_ops!r}")
    files = {"before": _rank_file(before), "after": _rank_file(after)}
    frames = {v: read_trace(p) for v, p in files.items()}
    device = "gpu" if any(f["kind"].isin(DEVICE_KINDS).any() for f in frames.values()) else "cpu"
    rows = "GPU kernels" if device == "gpu" else "CPU ops (a CPU trace has no GPU kernel)"
    ok, why = export.hta_status()
    if ok:
        with _exact_times(), tempfile.TemporaryDirectory(prefix="k3lab-hta-") as tmp:
            read = {"before": before, "after": after}
            if device == "gpu" and not host_ops:
                read = {v: without_host_ops(f, Path(tmp) / v) for v, f in read.items()}
            parts = {v: _hta_breakdown(f, device) for v, f in read.items()}
            diff = export.hta_trace_diff(read["before"], read["after"], device=device).reset_index()
        diff = diff.rename(columns={"kernel": "name"})
        source, note = "HTA", f"HolisticTraceAnalysis {why}: its breakdown and trace diff of {rows}"
        if device == "gpu" and not host_ops:
            note += " (read without the host's operator events, which those tables do not use)"
    else:
        steps = {v: _steps_in(f) for v, f in (("before", before), ("after", after))}
        parts = {v: _k3lab_breakdown(frames[v]) for v in frames}
        d = trace_diff(frames["before"], frames["after"], steps=(steps["before"], steps["after"])).kernels
        diff = pd.DataFrame({"name": d["name"], "change": d["status"],
                             "before_calls": d["calls_before"] * steps["before"],
                             "after_calls": d["calls_after"] * steps["after"],
                             "before_us": d["us_before"] * steps["before"],
                             "after_us": d["us_after"] * steps["after"]})
        diff["diff_us"] = diff["after_us"] - diff["before_us"]
        source = "k3lab"
        note = f"HTA not used ({why}): k3lab's own kernel_table and trace_diff of {rows} instead"
    breakdown = pd.concat([p.head(top).assign(variant=v) for v, p in parts.items()], ignore_index=True)
    before_total = float(parts["before"]["total_us"].sum()) if device == "gpu" else _step_us(frames["before"])
    return Comparison(breakdown[list(BREAKDOWN_COLUMNS)], _select(diff, before_total, min_share).head(top),
                      source, device, note)


def _step_us(frame: pd.DataFrame) -> float:
    """A CPU trace's time in its top-level work ops (k3lab's frame), the diff's yardstick."""
    return float(device_work(frame)["dur_us"].sum())


__all__ = ["BREAKDOWN_COLUMNS", "DIFF_COLUMNS", "HOST_OP_CATEGORIES", "Comparison", "compare",
           "without_host_ops", "write_folders"]
