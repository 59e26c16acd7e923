"""Compact before/after tables, shared by `k3lab bench` and the report.

`compact(records)` gives one row per case (and timing mode): before, after, the fastest peer, the
floor, after/before and after/peer, in microseconds, with columns that hold nothing dropped.
`shown_cases(records)` picks the cases a chart or table shows: the library's own cases (sweep points
and measured variants are named with a dot and left out), the graph-replay timing where a case has one,
at most `limit` of them (a variant timed only eagerly, such as a before that
cannot be captured in a graph, stays beside the graph timings).
"""

from __future__ import annotations

import math

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


def to_html(table: pd.DataFrame) -> str:
    """A compact table as HTML, three significant digits, empty cells blank."""
    return table.to_html(index=False, na_rep="", float_format=lambda x: f"{x:.3g}", border=0, classes="data")
