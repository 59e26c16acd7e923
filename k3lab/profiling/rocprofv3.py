"""Read rocprofv3 (ROCprofiler-SDK) output: kernel-trace CSV, memory-copy-trace CSV, the
`_results.json` file, and the `--stats` kernel statistics CSV.

Layouts are those of shared/fixtures/FORMATS.md sections 1-3, 5 and 7, checked on the fixture
files (the 2024 and the current CSV layouts, a real MI350X `_results.json`). Columns are found by
name, case-insensitively, never by position; timestamps are integer nanoseconds.
The memory-copy CSV has no byte count, so its rows carry bytes <NA>; the JSON copy records may
carry `bytes` (a field of the SDK's copy record, read when present, not seen in a fixture).
"""

from __future__ import annotations

import pandas as pd

from k3lab.profiling.categories import categorize
from k3lab.profiling.csvutil import agent_label, read_rows, to_int
from k3lab.profiling.frame import TABLE_COLUMNS, make_frame

_DIRECTIONS = {
    "MEMORY_COPY_HOST_TO_DEVICE": "Memcpy HtoD",
    "MEMORY_COPY_DEVICE_TO_HOST": "Memcpy DtoH",
    "MEMORY_COPY_DEVICE_TO_DEVICE": "Memcpy DtoD",
    "MEMORY_COPY_HOST_TO_HOST": "Memcpy HtoH",
    "MEMORY_COPY_DEVICE_TO_DEVICE_PEER": "Memcpy PtoP",
}


def copy_name(direction: str) -> str:
    """'MEMORY_COPY_HOST_TO_DEVICE' -> 'Memcpy HtoD' (unknown directions keep their spelling)."""
    return _DIRECTIONS.get(direction.strip(), direction.strip() or "Memcpy")


def is_kernel_trace_header(header: list[str]) -> bool:
    return "kernel_name" in header and "start_timestamp" in header and "end_timestamp" in header \
        and "counter_name" not in header


def is_copy_trace_header(header: list[str]) -> bool:
    return "direction" in header and "start_timestamp" in header


def is_stats_header(header: list[str]) -> bool:
    return {"name", "calls", "totaldurationns"} <= set(header)


def read_kernel_trace_csv(text: str) -> pd.DataFrame:
    """One row per KERNEL_DISPATCH row of a `*_kernel_trace.csv` (2024 or current layout)."""
    header, rows = read_rows(text)
    if not is_kernel_trace_header(header):
        raise ValueError(f"not a rocprofv3 kernel trace: header {header[:8]}")
    out = []
    for r in rows:
        if r.get("kind", "KERNEL_DISPATCH").strip() != "KERNEL_DISPATCH":
            continue
        start, end = to_int(r["start_timestamp"]), to_int(r["end_timestamp"])
        stream = to_int(r["stream_id"]) if "stream_id" in r else to_int(r.get("queue_id"))
        out.append({"name": r["kernel_name"], "kind": "kernel", "start_ns": start, "dur_ns": end - start,
                    "device": agent_label(r.get("agent_id")), "stream": stream,
                    "correlation": to_int(r.get("correlation_id"))})
    return make_frame(out, source="rocprofv3-csv")


def read_copy_trace_csv(text: str) -> pd.DataFrame:
    """One row per MEMORY_COPY row of a `*_memory_copy_trace.csv`; bytes <NA> (the CSV has none)."""
    header, rows = read_rows(text)
    if not is_copy_trace_header(header):
        raise ValueError(f"not a rocprofv3 memory copy trace: header {header[:8]}")
    out = []
    for r in rows:
        if r.get("kind", "MEMORY_COPY").strip() != "MEMORY_COPY":
            continue
        direction = r["direction"].strip()
        start, end = to_int(r["start_timestamp"]), to_int(r["end_timestamp"])
        # The GPU side of the copy: destination for host-to-device, source otherwise.
        side = "destination_agent_id" if direction.endswith("HOST_TO_DEVICE") else "source_agent_id"
        out.append({"name": copy_name(direction), "kind": "memcpy", "start_ns": start, "dur_ns": end - start,
                    "device": agent_label(r.get(side)), "stream": to_int(r.get("stream_id")),
                    "correlation": to_int(r.get("correlation_id")), "bytes": None})
    return make_frame(out, source="rocprofv3-csv")


def is_results_json(obj) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("rocprofiler-sdk-tool"), list)


def _decoder(proc: dict):
    """kind index -> kind name and (kind, operation) -> operation name, from the file's own string
    table: the enum values change between SDK versions, so they are never hard-coded."""
    table = (proc.get("strings") or {}).get("buffer_records") or []
    kinds = [b.get("kind") for b in table]
    ops = [b.get("operations") or [] for b in table]

    def kind(i):
        return kinds[i] if isinstance(i, int) and 0 <= i < len(kinds) else None

    def operation(k, o):
        return ops[k][o] if isinstance(k, int) and 0 <= k < len(ops) and isinstance(o, int) \
            and 0 <= o < len(ops[k]) else None
    return kind, operation


def _handle(value):
    return value.get("handle") if isinstance(value, dict) else value


def read_results_json(obj: dict) -> pd.DataFrame:
    """Kernel dispatches (and memory copies, when traced) of a rocprofv3 `_results.json`."""
    if not is_results_json(obj):
        raise ValueError("not a rocprofv3 results JSON: no 'rocprofiler-sdk-tool' list")
    rows = []
    agent_names = {}
    for proc in obj["rocprofiler-sdk-tool"]:
        kind, operation = _decoder(proc)
        agents = {}
        for a in proc.get("agents") or []:
            label = f"Agent {a.get('logical_node_id', a.get('node_id'))}"
            agents[_handle(a.get("id"))] = (label, a.get("type"))
            agent_names[label] = a.get("product_name") or a.get("name")
        symbols = {}
        for s in proc.get("kernel_symbols") or []:
            symbols[s.get("kernel_id")] = (s.get("formatted_kernel_name") or s.get("demangled_kernel_name")
                                           or s.get("truncated_kernel_name") or s.get("kernel_name"))
        buffers = proc.get("buffer_records") or {}
        for r in buffers.get("kernel_dispatch") or []:
            if kind(r.get("kind")) not in (None, "KERNEL_DISPATCH"):
                continue
            info = r.get("dispatch_info") or {}
            kid = info.get("kernel_id")
            start, end = int(r["start_timestamp"]), int(r["end_timestamp"])
            rows.append({"name": symbols.get(kid) or f"kernel_id {kid}", "kind": "kernel",
                         "start_ns": start, "dur_ns": end - start,
                         "device": agents.get(_handle(info.get("agent_id")),
                                              (f"agent {_handle(info.get('agent_id'))}",))[0],
                         "stream": _handle(r.get("stream_id")) if r.get("stream_id") is not None
                         else _handle(info.get("queue_id")),
                         "correlation": (r.get("correlation_id") or {}).get("internal")})
        for r in buffers.get("memory_copy") or []:
            k = r.get("kind")
            if kind(k) not in (None, "MEMORY_COPY"):
                continue
            direction = operation(k, r.get("operation")) or ""
            src = agents.get(_handle(r.get("src_agent_id")), ("", None))
            dst = agents.get(_handle(r.get("dst_agent_id")), ("", None))
            gpu_side = dst if dst[1] == 2 else src  # agent type 2 is a GPU
            start, end = int(r["start_timestamp"]), int(r["end_timestamp"])
            rows.append({"name": copy_name(direction), "kind": "memcpy", "start_ns": start,
                         "dur_ns": end - start, "device": gpu_side[0], "bytes": r.get("bytes"),
                         "stream": _handle(r.get("stream_id")),
                         "correlation": (r.get("correlation_id") or {}).get("internal")})
    frame = make_frame(rows, source="rocprofv3-json")
    frame.attrs["agents"] = agent_names
    return frame


def read_stats_csv(text: str) -> pd.DataFrame:
    """A `*_kernel_stats.csv` (rocprofv3 --stats) or legacy `results.stats.csv` as a kernel table
    (the columns of `kernel_table`; share = Percentage / 100, bytes <NA>)."""
    header, rows = read_rows(text)
    if not is_stats_header(header):
        raise ValueError(f"not a profiler stats CSV: header {header[:8]}")
    table = pd.DataFrame({
        "name": [r["name"] for r in rows],
        "calls": [int(r["calls"]) for r in rows],
        "total_us": [float(r["totaldurationns"]) / 1e3 for r in rows],
        "mean_us": [float(r["averagens"]) / 1e3 for r in rows],
        "min_us": [float(r["minns"]) / 1e3 if r.get("minns") else float("nan") for r in rows],
        "max_us": [float(r["maxns"]) / 1e3 if r.get("maxns") else float("nan") for r in rows],
        "share": [float(r["percentage"]) / 100.0 for r in rows],
    })
    table["category"] = [categorize(n) for n in table["name"]]
    table["bytes"] = pd.array([None] * len(table), dtype="Int64")
    return table[list(TABLE_COLUMNS)]
