"""Read a rocpd SQLite database (`*_results.db`, the rocprofv3 default output from ROCm 7.0).

Schema: shared/fixtures/FORMATS.md section 9 and rocprofiler-sdk's rocpd schema. The physical
tables carry a per-session UUID suffix; the reader queries the unsuffixed views
(`rocpd_kernel_dispatch`, `rocpd_info_kernel_symbol`, `rocpd_info_agent`, `rocpd_memory_copy`,
`rocpd_string`, `rocpd_event`) with LEFT JOINs, so a dispatch whose symbol or event row is
missing still counts. Timestamps are integer nanoseconds.
No real rocpd database was available to this project: the reader follows the documented schema
and is tested on a small database built in the test from that schema. Not yet run on AMD
hardware by this project.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd

from k3lab.profiling.frame import make_frame
from k3lab.profiling.rocprofv3 import copy_name


def object_names(con: sqlite3.Connection) -> set[str]:
    return {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}


def is_rocpd(names: set[str]) -> bool:
    return "rocpd_kernel_dispatch" in names or any(n.startswith("rocpd_kernel_dispatch_") for n in names)


def _agent(index, kind) -> str:
    return f"Agent {index}" if index is not None else (kind or "")


def read_rocpd(path: str | Path) -> pd.DataFrame:
    """Kernel dispatches and memory copies (with their byte size) of a rocpd database."""
    con = sqlite3.connect(f"file:{Path(path)}?mode=ro", uri=True)
    try:
        names = object_names(con)
        if "rocpd_kernel_dispatch" not in names:
            raise ValueError(f"{path}: a rocpd database without the unsuffixed rocpd_kernel_dispatch "
                             "view; it may come from an older rocpd schema")
        event_join = ("LEFT JOIN rocpd_event E ON E.id = K.event_id AND E.guid = K.guid"
                      if "rocpd_event" in names else "")
        corr = "E.correlation_id" if event_join else "NULL"
        rows = []
        sql = f"""
            SELECT K.start, K."end", S.display_name, S.kernel_name, A.logical_index, A.type,
                   K.stream_id, K.queue_id, {corr}
            FROM rocpd_kernel_dispatch K
            LEFT JOIN rocpd_info_kernel_symbol S ON S.id = K.kernel_id AND S.guid = K.guid
            LEFT JOIN rocpd_info_agent A ON A.id = K.agent_id AND A.guid = K.guid
            {event_join}"""
        for start, end, display, kname, index, kind, stream, queue, cid in con.execute(sql):
            rows.append({"name": display or kname or "unknown kernel", "kind": "kernel",
                         "start_ns": int(start), "dur_ns": int(end) - int(start),
                         "device": _agent(index, kind), "stream": stream if stream is not None else queue,
                         "correlation": cid})
        if "rocpd_memory_copy" in names:
            event_join = event_join.replace("K.", "M.")
            sql = f"""
                SELECT M.start, M."end", N.string, M.size, SA.logical_index, SA.type,
                       DA.logical_index, DA.type, M.stream_id, {corr}
                FROM rocpd_memory_copy M
                LEFT JOIN rocpd_string N ON N.id = M.name_id AND N.guid = M.guid
                LEFT JOIN rocpd_info_agent SA ON SA.id = M.src_agent_id AND SA.guid = M.guid
                LEFT JOIN rocpd_info_agent DA ON DA.id = M.dst_agent_id AND DA.guid = M.guid
                {event_join}"""
            for start, end, name, size, s_idx, s_type, d_idx, d_type, stream, cid in con.execute(sql):
                gpu = (d_idx, d_type) if d_type == "GPU" else (s_idx, s_type)
                rows.append({"name": copy_name(name or ""), "kind": "memcpy", "start_ns": int(start),
                             "dur_ns": int(end) - int(start), "bytes": size, "device": _agent(*gpu),
                             "stream": stream, "correlation": cid})
    finally:
        con.close()
    return make_frame(rows, source="rocpd")
