"""Small helpers for the profilers' CSV files: real CSV parsing (kernel names hold commas and
quotes), header names matched case-insensitively, blank rows skipped."""

from __future__ import annotations

import csv
import io


def read_rows(text: str) -> tuple[list[str], list[dict[str, str]]]:
    """Header (lower-cased) and rows as dicts keyed by the lower-cased header. Blank rows are
    skipped (some doc samples end with an empty line); short rows are padded with ''."""
    reader = csv.reader(io.StringIO(text))
    header = None
    rows = []
    for cells in reader:
        if not cells or all(not c.strip() for c in cells):
            continue
        if header is None:
            header = [c.strip().lower() for c in cells]
            continue
        cells = cells + [""] * (len(header) - len(cells))
        rows.append(dict(zip(header, cells)))
    return header or [], rows


def header_of(text: str) -> list[str]:
    """Lower-cased cells of the first non-blank line."""
    for line in text.splitlines():
        if line.strip():
            return [c.strip().lower() for c in next(csv.reader([line]))]
    return []


def to_int(value: str | None):
    """Integer from a CSV cell, or None for '' / 'n/a'."""
    if value is None:
        return None
    value = str(value).strip()
    if value == "" or value.lower() in ("n/a", "nan", "none"):
        return None
    try:
        return int(value)
    except ValueError:
        return int(float(value))


def agent_label(value: str | None) -> str:
    """rocprofv3 writes agents as "Agent 4" (current) or a bare 4 (ROCm 6.2): one spelling."""
    value = (value or "").strip()
    return f"Agent {value}" if value.isdigit() else value
