"""Read legacy rocprof (v1) output, so an old trace lying around still opens.

Layouts from shared/fixtures/FORMATS.md section 10, checked on the rocm-blogs fixtures (rocprof
--tool-version 1, ROCm 6.0): the per-dispatch `results.csv` (KernelName, BeginNs, EndNs),
`results.json` (a Chrome trace whose ts/dur/args are strings; kernels live in processes named
"GPU<n>", copies in "COPY", host calls in "CPU HIP API"), and `results.db` (SQLite with OPS and
COPY tables). The stats CSVs are read by `read_stats`.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd

from k3lab.profiling.csvutil import read_rows, to_int
from k3lab.profiling.frame import make_frame


def is_v1_csv_header(header: list[str]) -> bool:
    return "kernelname" in header and "beginns" in header


def read_v1_csv(text: str) -> pd.DataFrame:
    header, rows = read_rows(text)
    if not is_v1_csv_header(header):
        raise ValueError(f"not a rocprof v1 results.csv: header {header[:8]}")
    out = []
    for r in rows:
        start, end = to_int(r["beginns"]), to_int(r["endns"])
        out.append({"name": r["kernelname"], "kind": "kernel", "start_ns": start, "dur_ns": end - start,
                    "device": f"gpu-id {r.get('gpu-id', '').strip()}", "stream": to_int(r.get("queue-id")),
                    "correlation": to_int(r.get("index"))})
    return make_frame(out, source="rocprof-v1-csv")


def _process_names(events: list) -> dict:
    return {str(e.get("pid")): (e.get("args") or {}).get("name", "") for e in events
            if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "process_name"}


def is_v1_json(obj) -> bool:
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        return False
    names = set(_process_names(obj["traceEvents"]).values())
    return any(n.startswith("GPU") for n in names) and ("COPY" in names or "CPU HIP API" in names) \
        and "schemaVersion" not in obj


def read_v1_json(obj: dict) -> pd.DataFrame:
    if not is_v1_json(obj):
        raise ValueError("not a rocprof v1 results.json: no GPU/COPY process names")
    procs = _process_names(obj["traceEvents"])
    out = []
    for e in obj["traceEvents"]:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        proc = procs.get(str(e.get("pid")), "")
        if not (proc.startswith("GPU") or proc == "COPY"):
            continue  # host API calls
        args = e.get("args") or {}
        start, end = to_int(args.get("BeginNs")), to_int(args.get("EndNs"))
        if start is None or end is None:  # fall back to the microsecond ts/dur strings
            start = round(float(e["ts"]) * 1000)
            end = start + round(float(e.get("dur", 0)) * 1000)
        out.append({"name": str(e.get("name", "")), "kind": "memcpy" if proc == "COPY" else "kernel",
                    "start_ns": start, "dur_ns": end - start,
                    "device": f"gpu-id {args.get('dev-id', '')}".strip(),
                    "stream": to_int(args.get("stream-id"))})
    return make_frame(out, source="rocprof-v1-json")


def is_v1_db(names: set[str]) -> bool:
    return {"OPS", "COPY"} <= names


def read_v1_db(path: str | Path) -> pd.DataFrame:
    con = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        out = []
        for table, kind in (("OPS", "kernel"), ("COPY", "memcpy")):
            for start, end, name, dev, stream in con.execute(
                    f'SELECT BeginNs, EndNs, Name, "dev-id", "stream-id" FROM {table}'):
                out.append(
                    {
                        "name": name,
                        "kind": kind,
                        "start_ns": int(start),
                        "dur_ns": int(end) - int(start),
                        "device": f"gpu-id {dev}",
                        "stream": stream,
                    }
                )
    finally:
        con.close()
    return make_frame(out, source="rocprof-v1-db")
