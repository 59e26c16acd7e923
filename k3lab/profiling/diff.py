"""Before against after as a diff of two kernel frames: kernels gone, new and changed, time per category,
launches, and the trace files to open in Perfetto.

    d = trace_diff(before_frame, after_frame, steps=3, paths={"before": p0, "after": p1})
    d.kernels      one row per kernel name: status (gone / new / changed / same), calls and us per step
    d.categories   one row per category: us per step before and after, and the change
    d.launches     counts() of each side, per step (launches, copies, bytes, API launches)
    d.summary()    the diff in a few lines; a notebook shows the summary and both tables

    d = capture_diff(before_fn, after_fn, steps=3)  # capture both here, then diff (a notebook's live diff)

Frames are what `read_trace` and `Capture.kernels` return, from any profiler k3lab reads (torch.profiler
on CUDA, ROCm or CPU, rocprofv3 CSV/JSON/rocpd, rocprof v1). Device work (kernels, copies, memsets) is
compared where a frame holds any; a CPU trace's top-level ops otherwise.

Why not HolisticTraceAnalysis's TraceDiff: it reads Kineto JSON only, laid out as one folder per run
with one file per rank and iterations marked by ProfilerStep annotations, and compares CPU operators
and their kernels per iteration. k3lab's frames also come from rocprofv3 and rocpd, the committed
traces carry no ProfilerStep marks (steps are counted by the capture), and HTA is not a dependency of
the environment. The comparison needed here is a join of two per-name tables, which `kernel_table`
already gives.
"""

from __future__ import annotations

import dataclasses
import html
import re
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from k3lab.profiling.frame import _check_frame, counts, kernel_table

STATUSES = ("gone", "new", "changed", "same")
PERFETTO = "https://ui.perfetto.dev"
DEVICE_KINDS = ("kernel", "memcpy", "memset")


def device_work(df: pd.DataFrame) -> pd.DataFrame:
    """The rows a diff compares: kernels, copies and memsets where the frame has any, else the CPU
    trace's ops that do work (views and metadata ops, kind 'cpu_meta', left out)."""
    if "kind" not in df.columns:
        return df
    dev = df[df["kind"].isin(DEVICE_KINDS)]
    return dev if len(dev) else df[df["kind"] == "cpu_op"]


@dataclass(frozen=True)
class TraceDiff:
    """Two kernel frames compared (module docstring). `labels` name the two sides; `paths` the trace
    files (label -> path) where known; `steps` the steps each trace holds (per-step figures divide by it);
    `tolerance` the relative change of a kernel's time per step below which it counts as the same."""

    kernels: pd.DataFrame
    categories: pd.DataFrame
    launches: pd.DataFrame
    labels: tuple[str, str]
    steps: tuple[int, int]
    tolerance: float
    paths: dict = field(default_factory=dict)
    note: str = ""

    def total_us(self, side: str) -> float:
        """Device time per step of one side (`labels[0]` or `labels[1]`)."""
        col = self._col(side, "us")
        return float(self.kernels[col].sum())

    def _col(self, side: str, what: str) -> str:
        if side not in self.labels:
            raise ValueError(f"side must be one of {self.labels}, got {side!r}")
        return f"{what}_{side}"

    def names(self, status: str) -> list[str]:
        """The kernel names with `status` ('gone', 'new', 'changed', 'same')."""
        if status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
        return self.kernels.loc[self.kernels["status"] == status, "name"].tolist()

    def summary(self) -> str:
        a, b = self.labels
        la, lb = (self.launches.loc[s, "launches"] for s in self.labels)
        lines = [f"{a}: {_n(la)} launches and {self.total_us(a):,.1f} us of device time per step; "
                 f"{b}: {_n(lb)} launches and {self.total_us(b):,.1f} us"]
        verbs = (("gone", f"only in {a}"), ("new", f"only in {b}"), ("changed", "in both, time changed"))
        for status, verb in verbs:
            rows = self.kernels[self.kernels["status"] == status]
            if len(rows):
                col = f"us_{a}" if status == "gone" else f"us_{b}"
                lines.append(f"{status} ({verb}): {len(rows)} kernel(s), {rows[col].sum():,.1f} us per step: "
                             + ", ".join(short_name(n) for n in rows["name"].head(4))
                             + (" ..." if len(rows) > 4 else ""))
        for side, path in self.paths.items():
            lines.append(f"{side} trace: {path} (open in {PERFETTO})")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        head = "<br>".join(html.escape(s) for s in self.summary().splitlines())
        kern = self.kernels.assign(name=self.kernels["name"].map(short_name)).round(2).to_html(index=False)
        cats = self.categories.round(2).to_html(index=False)
        return f"<p>{head}</p><b>Kernels (per step)</b>{kern}<b>Time per category (us per step)</b>{cats}"


def _n(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _top_level(name: str) -> str:
    """The name up to its argument list, template arguments kept ('f<a<b>>(int)' -> 'f<a<b>>')."""
    depth = 0
    for i, ch in enumerate(name):
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0 and i > 0:
            return name[:i]
    return name


def short_name(name: str, width: int = 60) -> str:
    """A kernel name a table can show: no 'void ', no argument list, and where still longer than
    `width`, the template arguments folded to the functor or op they name ('<...MulFunctor>')."""
    s = _top_level(name.removeprefix("void ").strip())
    if len(s) <= width:
        return s
    head = s.split("<", 1)[0]
    what = re.findall(r"(\w+(?:Functor|Ops|Op)\b|direct_copy_kernel_cuda|\w+_kernel\b)", s[len(head):])
    s = f"{head}<...{what[-1]}>" if what else f"{head}<...>"
    return s if len(s) <= width else s[: width - 3] + "..."


def _per_step(table: pd.DataFrame, steps: int, label: str) -> pd.DataFrame:
    out = table[["name", "category", "calls", "total_us"]].copy()
    out["calls"] = out["calls"] / steps
    out["total_us"] = out["total_us"] / steps
    return out.rename(columns={"calls": f"calls_{label}", "total_us": f"us_{label}"})


def _steps(v, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def trace_diff(before: pd.DataFrame, after: pd.DataFrame, *, steps: int | tuple[int, int] = 1,
               labels: tuple[str, str] = ("before", "after"), paths: dict | None = None,
               tolerance: float = 0.05) -> TraceDiff:
    """Compare two kernel frames (module docstring). steps: steps traced in each (one int for both);
    labels: the two sides' names; paths: label -> trace file, shown for Perfetto; tolerance: the
    relative change in a kernel's time per step (or any change in its calls) that makes it 'changed'."""
    _check_frame(before, "trace_diff(before)")
    _check_frame(after, "trace_diff(after)")
    sa, sb = (steps, steps) if isinstance(steps, int) and not isinstance(steps, bool) else tuple(steps)
    sa, sb = _steps(sa, "steps"), _steps(sb, "steps")
    if (not isinstance(labels, tuple) or len(labels) != 2 or not all(isinstance(x, str) and x for x in labels)
            or labels[0] == labels[1]):
        raise ValueError(f"labels must be two different non-empty strings, got {labels!r}")
    if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    a, b = labels
    wa, wb = device_work(before), device_work(after)
    ta, tb = _per_step(kernel_table(wa), sa, a), _per_step(kernel_table(wb), sb, b)
    k = ta.merge(tb, on="name", how="outer", suffixes=("", "_b"))
    k["category"] = k["category"].fillna(k.pop("category_b"))
    for col in (f"calls_{a}", f"us_{a}", f"calls_{b}", f"us_{b}"):
        k[col] = k[col].fillna(0.0)
    k["delta_us"] = k[f"us_{b}"] - k[f"us_{a}"]

    def status(row) -> str:
        if row[f"calls_{b}"] == 0:
            return "gone"
        if row[f"calls_{a}"] == 0:
            return "new"
        base = max(row[f"us_{a}"], 1e-9)
        if row[f"calls_{a}"] != row[f"calls_{b}"] or abs(row["delta_us"]) > tolerance * base:
            return "changed"
        return "same"

    k["status"] = k.apply(status, axis=1) if len(k) else pd.Series(dtype=object)
    order = {s: i for i, s in enumerate(STATUSES)}
    k = k.assign(_o=k["status"].map(order), _t=-k[[f"us_{a}", f"us_{b}"]].max(axis=1))
    k = k.sort_values(["_o", "_t"], kind="stable").drop(columns=["_o", "_t"]).reset_index(drop=True)
    k = k[["name", "category", "status", f"calls_{a}", f"calls_{b}", f"us_{a}", f"us_{b}", "delta_us"]]

    cats = (k.groupby("category", sort=False)[[f"us_{a}", f"us_{b}"]].sum().reset_index())
    cats["delta_us"] = cats[f"us_{b}"] - cats[f"us_{a}"]
    cats = cats.sort_values(f"us_{a}", ascending=False, kind="stable").reset_index(drop=True)

    launches = pd.DataFrame({a: counts(before, steps=sa), b: counts(after, steps=sb)}).T
    launches.index.name = "side"
    paths = {str(s): str(Path(p)) for s, p in (paths or {}).items()}
    return TraceDiff(k, cats, launches, labels, (sa, sb), float(tolerance), paths)


CPU_NOTE = ("captured on a CPU: the rows are ATen ops timed on the host, not GPU kernels (a Triton kernel "
            "run by the interpreter shows only the copies of its arguments); on a GPU the same call lists "
            "the device's kernels")


def capture_diff(before, after, *, steps: int = 3, warmup: int = 1, name: str = "diff",
                 labels: tuple[str, str] = ("before", "after"), trace_dir=None,
                 tolerance: float = 0.05) -> TraceDiff:
    """Profile `steps` calls of each of the callables `before()` and `after()` (after `warmup` unprofiled
    calls) with `k3lab.profile.capture`, and diff the two kernel frames; the diff's paths are the two
    trace files written (under `trace_dir`, default `default_trace_dir()`), named `<name>-<label>-...`.
    On a CPU the note says the rows are ATen ops, so a reader does not take them for GPU kernels."""
    from k3lab.profiling.capture import capture

    if not callable(before) or not callable(after):
        raise ValueError(f"before and after must be callables, got {type(before).__name__} and "
                         f"{type(after).__name__}")
    if (not isinstance(labels, tuple) or len(labels) != 2 or not all(isinstance(x, str) and x for x in labels)
            or labels[0] == labels[1]):
        raise ValueError(f"labels must be two different non-empty strings, got {labels!r}")
    caps = {lab: capture(fn, steps=steps, warmup=warmup, trace_dir=trace_dir, name=f"{name}-{lab}")
            for lab, fn in zip(labels, (before, after))}
    a, b = (caps[lab] for lab in labels)
    d = trace_diff(a.kernels, b.kernels, steps=steps, labels=labels, tolerance=tolerance,
                   paths={lab: c.trace_path for lab, c in caps.items() if c.trace_path is not None})
    return dataclasses.replace(d, note=CPU_NOTE) if a.device == "cpu" else d


__all__ = ["CPU_NOTE", "PERFETTO", "STATUSES", "TraceDiff", "capture_diff", "device_work", "short_name",
           "trace_diff"]
