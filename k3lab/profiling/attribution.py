"""Where a step's time goes: each kernel of a replayed step named by the part of the program that
launched it, with the idle gap before it, summed per part.

A CUDA (or HIP) graph replay shows kernels but no host code, so it cannot say which layer part a
kernel belongs to. An eager run of the same program can: a kernel's launch call sits, on the host,
inside the `record_function` ranges the program opened (`part_labels`). The two kernel sequences are
the same program, so they are aligned by kernel name (`align_parts`), and the replay's kernels take the
eager run's labels. Then per kernel: its duration and the gap since the previous kernel ended on the
device (the bubble a launch or a dependency left), and per part: kernels, kernel time, gap time and,
where the caller gives it, the part's bytes floor (`attribute`). The rows sum to the replay's span
from the first kernel's start to the last kernel's end, which `span_us` gives for the check against
the timed step.

Pure functions over kernel frames (k3lab.profiling.frame) and parsed Kineto traces; no GPU needed.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Mapping

import pandas as pd

UNLABELLED = "(unlabelled)"
WORK_KINDS = ("kernel", "memcpy", "memset")


def part_labels(trace: dict, prefix: str) -> dict[int, str]:
    """Correlation id -> the innermost host range named `prefix`... that encloses the kernel's launch
    call, with `prefix` removed. Ranges are `record_function` events (cat 'user_annotation' in Kineto);
    launches are the 'cuda_runtime' / 'cuda_driver' events that carry the correlation id the device row
    carries. Launches outside every such range are left out (the caller labels them UNLABELLED)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("trace: expected a parsed Kineto trace (a dict with a traceEvents list)")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix: expected a non-empty string, got {prefix!r}")
    ranges: dict[tuple, list[tuple[float, float, str]]] = {}
    launches = []
    for e in trace["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), str(e.get("name", ""))
        key = (e.get("pid"), e.get("tid"))
        if cat == "user_annotation" and name.startswith(prefix):
            t0 = float(e["ts"])
            ranges.setdefault(key, []).append((t0, t0 + float(e.get("dur", 0)), name[len(prefix):]))
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches.append((key, float(e["ts"]), int(corr)))
    starts = {}
    for key, rs in ranges.items():
        rs.sort(key=lambda r: (r[0], -r[1]))
        starts[key] = [r[0] for r in rs]
    out = {}
    for key, ts, corr in launches:
        rs = ranges.get(key)
        if not rs:
            continue
        best = None
        # the innermost enclosing range: the latest-starting one that still covers ts
        for j in range(bisect.bisect_right(starts[key], ts) - 1, -1, -1):
            t0, t1, label = rs[j]
            if t1 >= ts:
                best = label
                break
        if best is not None:
            out[corr] = best
    return out


def labelled(frame: pd.DataFrame, labels: Mapping[int, str]) -> pd.DataFrame:
    """The device work rows of `frame` in start order with a `part` column from `labels` (correlation
    id -> part), UNLABELLED where a row's correlation is unknown."""
    work = frame[frame["kind"].isin(WORK_KINDS)].sort_values("start_ns").reset_index(drop=True)
    work = work.copy()
    work["part"] = [labels.get(int(c), UNLABELLED) if pd.notna(c) else UNLABELLED
                    for c in work["correlation"]]
    return work


def align_parts(eager: pd.DataFrame, replay: pd.DataFrame) -> tuple[pd.DataFrame, float]:
    """`replay` (device rows of one graph replay) with the `part` of the eager row it matches, aligned by
    kernel name in order (difflib over the two name sequences). Returns (frame, matched share): the
    share of replay rows that found an eager row; the rest get UNLABELLED."""
    if "part" not in eager.columns:
        raise ValueError("eager: expected a frame with a 'part' column (see labelled())")
    rep = replay[replay["kind"].isin(WORK_KINDS)].sort_values("start_ns").reset_index(drop=True).copy()
    a, b = list(eager["name"]), list(rep["name"])
    parts = [UNLABELLED] * len(b)
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            parts[block.b + k] = eager["part"].iat[block.a + k]
    rep["part"] = parts
    matched = sum(p != UNLABELLED for p in parts) / len(parts) if parts else 0.0
    return rep, matched


def gaps(rows: pd.DataFrame) -> pd.Series:
    """Per row (in start order), microseconds the device sat idle before it: its start minus the latest
    end of the rows before it (0 when it overlaps them; 0 for the first)."""
    start = rows["start_ns"].to_numpy()
    end = start + rows["dur_ns"].to_numpy()
    out, latest = [], None
    for s, e in zip(start, end):
        out.append(0.0 if latest is None else max(0.0, (s - latest) / 1e3))
        latest = e if latest is None else max(latest, e)
    return pd.Series(out, index=rows.index, dtype=float)


def span_us(rows: pd.DataFrame) -> float:
    """Microseconds from the first row's start to the last row's end."""
    if len(rows) == 0:
        return 0.0
    return float(((rows["start_ns"] + rows["dur_ns"]).max() - rows["start_ns"].min()) / 1e3)


def by_kernel(rows: pd.DataFrame, name=None) -> pd.DataFrame:
    """Per (part, kernel name): kernels (launches in the step), kernel_us (their summed durations),
    mean_us, gap_us (the idle time before them); longest kernel_us first. `name(full_name)` shortens
    the names first (templated CUDA names run to hundreds of characters). What the part table sums,
    split one level further: which kernels of a part take its time, and how many launches each adds."""
    if "part" not in rows.columns:
        raise ValueError("rows: expected a frame with a 'part' column (see align_parts() / labelled())")
    d = rows.assign(gap_us=gaps(rows))
    d["kernel"] = [name(n) if name else n for n in d["name"]]
    g = d.groupby(["part", "kernel"], sort=False).agg(kernels=("dur_us", "size"), kernel_us=("dur_us", "sum"),
                                                      gap_us=("gap_us", "sum")).reset_index()
    g["mean_us"] = g["kernel_us"] / g["kernels"]
    return g.sort_values("kernel_us", ascending=False, kind="stable").reset_index(drop=True)


def attribute(rows: pd.DataFrame, floors_us: Mapping[str, float] | None = None,
              group=None) -> pd.DataFrame:
    """Per part (or per `group(part)` when given): kernels, kernel_us (the sum of the rows' durations),
    gap_us (the idle time before them), total_us = kernel_us + gap_us, share of the span, and where
    `floors_us` names the part, floor_us (its bytes over the bandwidth) and kernel_vs_floor. Parts keep
    the order they first appear in the step. The totals over every part equal `span_us(rows)` when no two
    rows overlap."""
    if "part" not in rows.columns:
        raise ValueError("rows: expected a frame with a 'part' column (see align_parts() / labelled())")
    d = rows.copy()
    d["gap_us"] = gaps(d)
    d["group"] = [group(p) if group else p for p in d["part"]]
    order = list(dict.fromkeys(d["group"]))
    span = span_us(d)
    out = []
    for g in order:
        s = d[d["group"] == g]
        row = {"part": g, "kernels": int(len(s)), "kernel_us": float(s["dur_us"].sum()),
               "gap_us": float(s["gap_us"].sum())}
        row["total_us"] = row["kernel_us"] + row["gap_us"]
        row["share"] = row["total_us"] / span if span else 0.0
        f = (floors_us or {}).get(g)
        row["floor_us"] = float(f) if f is not None else None
        row["kernel_vs_floor"] = row["kernel_us"] / f if f else None
        out.append(row)
    return pd.DataFrame(out)
