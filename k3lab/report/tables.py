"""Compact before/after tables, shared by `k3lab bench` and the report.

`compact(records)` gives one row per case (and timing mode): before, after, the fastest peer, the
floor, after/before and after/peer, in microseconds, with columns that hold nothing dropped.
`shown_cases(records)` picks the cases a chart or table shows: the library's own cases (sweep points
and measured variants are named with a dot and left out), the graph-replay timing where a case has one,
at most `limit` of them (a variant timed only eagerly, such as a before that
cannot be captured in a graph, stays beside the graph timings). `in_case_order(records, study)` puts
records in the order the study lists its cases (committed records load in file-name order), so a
table's rows and a figure's floor line follow the sweep. Numbers are written plainly (2,890, never
2.89e+03), each column in the one unit its header names.
"""

from __future__ import annotations

import math
import re

import pandas as pd

COLUMNS = {"case": "case", "mode": "mode", "before_us": "before (us)", "after_us": "after (us)",
           "peer": "peer", "peer_us": "peer (us)", "floor_us": "floor (us)"}
MAX_CASES = 15


def compact(records) -> pd.DataFrame:
    """bench.compare(records) reduced to case, mode, before, after, peer, floor and the two ratios
    (after/before < 1: the after is faster; after/peer < 1: it beats the peer); all-empty columns and
    a mode column with one value are dropped."""
    from k3lab import bench

    table = bench.compare(records)
    out = table[list(COLUMNS)].rename(columns=COLUMNS)
    out["after/before"] = [a / b if b > 0 else math.nan for a, b
                           in zip(table["after_us"], table["before_us"])]
    out["after/peer"] = [a / p if p > 0 else math.nan for a, p in zip(table["after_us"], table["peer_us"])]
    out = out.dropna(axis=1, how="all")
    if "peer" in out and out["peer"].isna().all():
        out = out.drop(columns=["peer"])
    if "mode" in out and out["mode"].nunique() <= 1:
        out = out.drop(columns=["mode"])
    return out.reset_index(drop=True)


def shown_cases(records, limit: int = MAX_CASES) -> list:
    """The records of the cases to show (see the module docstring), in the records' order."""
    names = [r.case for r in records if "." not in r.case]
    cases = list(dict.fromkeys(n for n in names if f"{n}_graph" not in names))[:limit]
    graph = {(r.case, r.variant) for r in records if r.mode == "graph"}
    graph_cases = {c for c, v in graph if v == "after"}
    return [r for r in records if r.case in cases and
            (r.case not in graph_cases or r.mode == "graph" or (r.case, r.variant) not in graph)]


def case_order(study: str) -> list[str]:
    """The study's case names as it lists them (the GPU preset's, then the default's); [] when the
    study cannot say (an unknown name, a study that needs what this machine lacks to list them)."""
    from k3lab.studies import load_study

    try:
        module = load_study(study)
    except ValueError:
        return []
    names = []
    for preset in ("tp8", None):
        try:
            names += list(module.case_names(preset))
        except Exception:  # noqa: BLE001 - the order is a nicety; file order stays
            pass
    return list(dict.fromkeys(names))


def natural_key(case: str) -> tuple:
    """A case name's sweep order: numbers by value, with k / M suffixes (ctx1k < ctx32k < ctx128k,
    b1_8k < b8_8k < b64_8k), text between them as text."""
    parts = re.findall(r"(\d+)([kKM]?)|(\D+)", case)
    key = []
    for digits, suffix, text in parts:
        if text:
            key.append((1, text, 0))
        else:
            key.append((0, "", int(digits) * {"": 1, "k": 1024, "K": 1024, "M": 1 << 20}[suffix]))
    return tuple(key)


def in_case_order(records, study: str) -> list:
    """records sorted by their case's place in the study's list (`case_order`, the sweep's order); the
    cases that list lacks (committed GPU cases, listed only where a GPU is) follow in `natural_key` order."""
    order = {c: i for i, c in enumerate(case_order(study))}
    return sorted(records, key=lambda r: (order.get(r.case, len(order)), natural_key(r.case)))


def plain(x) -> str:
    """A number as people write it: 2,890 / 42.9 / 4.21 / 0.05 (never an exponent)."""
    if x is None or not math.isfinite(x):
        return ""
    if abs(x) >= 100:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if abs(x) >= 0.01 or x == 0 else f"{x:.1g}"


def to_html(table: pd.DataFrame) -> str:
    """A compact table as HTML, numbers written plainly (`plain`), empty cells blank."""
    return table.to_html(index=False, na_rep="", float_format=plain, border=0, classes="data")
