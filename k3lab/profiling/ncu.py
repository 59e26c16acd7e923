"""Nsight Compute (ncu) on NVIDIA, on request: the command for one kernel of a child process, and
a parser for its `--csv` output.

ncu replays a kernel many times to read its counters, so it runs the workload in a child
process (never the notebook's own) and profiles only the kernel named. `--clock-control none`
keeps the GPU's normal boost clock instead of ncu's default base-clock lock, so durations
compare with the event timings of `k3lab.bench`.

The CSV parser reads both layouts ncu prints: the default "details" page (one row per kernel
launch x metric: "ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit",
"Metric Value", optionally followed by rule columns) and the `--page raw` layout (one row per
launch, one column per metric, a units row under the header). Anything before the header (the
program's own output, "==PROF==" lines) is skipped; "n/a" becomes NaN; thousands separators
(en-US "1,234.5") are removed. A comma-decimal locale ("65,77") is not supported.

The parser is tested on an excerpt of a real ncu CSV. Where `k3lab profile --tool ncu` has run is
data, not this text: `k3lab.studies.runs` (part `profile_tools`), held to the records under profiles/.
"""

from __future__ import annotations

import csv
import io
import math
import re
import shlex
import sys
from pathlib import Path

import pandas as pd

# What the studies ask of one kernel: time, DRAM bytes, how busy memory and the SMs were, and
# occupancy. All are standard ncu metric names (ncu --query-metrics lists them).
DEFAULT_NCU_METRICS = (
    "gpu__time_duration.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "launch__registers_per_thread",
)

_METRIC = re.compile(r"^[A-Za-z0-9_.]+$")


def child_command(script_or_cmd) -> list[str]:
    """A child-process command from a script path ('study.py' -> [python, 'study.py']), an
    argument list, or a shell-style string."""
    if callable(script_or_cmd):
        raise ValueError("script_or_cmd: a profiler that runs the workload in a child process needs a "
                         "script path or a command (e.g. [sys.executable, '-m', 'k3lab.cli', 'profile', "
                         "'kda']), not a Python callable; use k3lab.profile.capture(fn) for a callable")
    if isinstance(script_or_cmd, Path) or (isinstance(script_or_cmd, str) and script_or_cmd.endswith(".py")
                                           and " " not in script_or_cmd.strip()):
        return [sys.executable, str(script_or_cmd)]
    if isinstance(script_or_cmd, str):
        cmd = shlex.split(script_or_cmd)
    elif isinstance(script_or_cmd, (list, tuple)) and all(isinstance(c, (str, Path)) for c in script_or_cmd):
        cmd = [str(c) for c in script_or_cmd]
    else:
        raise ValueError(f"script_or_cmd: expected a script path, a command string or a list of "
                         f"strings, got {type(script_or_cmd).__name__}")
    if not cmd:
        raise ValueError("script_or_cmd: the command is empty")
    return cmd


def ncu_command(script_or_cmd, *, kernel_name: str, metrics=DEFAULT_NCU_METRICS, launch_skip: int = 0,
                launch_count: int = 1, regex: bool = False, ncu: str = "ncu",
                extra_args: tuple[str, ...] = ()) -> list[str]:
    """The ncu command line that profiles `launch_count` launches (after skipping `launch_skip`)
    of the kernel called `kernel_name` in a child process, printing CSV in base units.

    regex=True matches `kernel_name` as a regular expression (ncu's "regex:" prefix), which
    suits Triton or templated names. Run it with subprocess and give stdout to `parse_ncu_csv`.
    """
    if not isinstance(kernel_name, str) or not kernel_name.strip():
        raise ValueError(f"kernel_name: expected a non-empty kernel name, got {kernel_name!r}")
    metrics = list(metrics)
    if not metrics or not all(isinstance(m, str) and _METRIC.match(m) for m in metrics):
        raise ValueError(f"metrics: expected ncu metric names like 'dram__bytes_read.sum', got {metrics!r}")
    if not isinstance(launch_skip, int) or launch_skip < 0:
        raise ValueError(f"launch_skip: expected an int >= 0, got {launch_skip!r}")
    if not isinstance(launch_count, int) or launch_count < 1:
        raise ValueError(f"launch_count: expected an int >= 1, got {launch_count!r}")
    return [ncu, "--clock-control", "none", "--target-processes", "all",
            "--kernel-name", f"regex:{kernel_name}" if regex else kernel_name,
            "--launch-skip", str(launch_skip), "--launch-count", str(launch_count),
            "--metrics", ",".join(metrics), "--csv", "--print-units", "base",
            *extra_args, *child_command(script_or_cmd)]


def _number(text: str) -> float:
    text = (text or "").strip()
    if text == "" or text.lower() in ("n/a", "nan"):
        return math.nan
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return math.nan


_TIME = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9,
         "s": 1e9}
_PREFIX = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SCALED = re.compile(r"^(K|M|G|T)?(byte|hz|cycle|inst|sector|request|warp)(/second|/s)?$", re.IGNORECASE)


def base_unit(value: float, unit: str) -> tuple[float, str]:
    """(value, unit) in base units: times in ns, bytes/cycles/Hz without a K/M/G/T prefix."""
    unit = (unit or "").strip()
    if unit in _TIME:
        return value * _TIME[unit], "ns"
    m = _SCALED.match(unit)
    if m:
        prefix = (m.group(1) or "").upper()
        return value * _PREFIX[prefix], m.group(2).lower() + (m.group(3) or "")
    return value, unit


def _csv_part(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines)
                  if line.startswith('"') and ('"Metric Name"' in line or '"Kernel Name"' in line)), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line with \"Kernel Name\" or \"Metric Name\") found")
    body = [line for line in lines[start:] if line.startswith('"')]  # drop ==PROF== and program output
    return list(csv.reader(io.StringIO("\n".join(body))))


def parse_ncu_csv(source) -> pd.DataFrame:
    """Long table of an ncu --csv output (text, or a path to it): one row per launch x metric with
    columns id, kernel, section, metric, unit, value, value_base, unit_base."""
    text = Path(source).read_text() if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and Path(source).is_file()) else str(source)
    rows = _csv_part(text)
    header = [h.strip() for h in rows[0]]
    col = {h.lower(): i for i, h in enumerate(header)}

    def get(r, name, default=""):
        i = col.get(name)
        return r[i] if i is not None and i < len(r) else default

    out = []
    if "metric name" in col:
        for r in rows[1:]:
            metric = get(r, "metric name").strip()
            if not metric:
                continue  # a rule row (advice text), not a metric
            value, unit = _number(get(r, "metric value")), get(r, "metric unit").strip()
            vb, ub = base_unit(value, unit)
            out.append({"id": int(_number(get(r, "id", "0"))) if get(r, "id") else 0,
                        "kernel": get(r, "kernel name"), "section": get(r, "section name"),
                        "metric": metric, "unit": unit, "value": value, "value_base": vb, "unit_base": ub})
    else:  # --page raw: metrics are columns, the row under the header gives units
        ident = {"id", "process id", "process name", "host name", "kernel name", "context", "stream",
                 "block size", "grid size", "device", "cc"}
        metrics = [h for h in header if h.lower() not in ident]
        units = rows[1] if len(rows) > 1 and not get(rows[1], "id").strip() else None
        for r in rows[2 if units else 1:]:
            for m in metrics:
                i = header.index(m)
                unit = units[i].strip() if units and i < len(units) else ""
                value = _number(r[i] if i < len(r) else "")
                vb, ub = base_unit(value, unit)
                out.append({"id": int(_number(get(r, "id", "0"))), "kernel": get(r, "kernel name"),
                            "section": "raw", "metric": m, "unit": unit, "value": value,
                            "value_base": vb, "unit_base": ub})
    if not out:
        raise ValueError("the ncu CSV holds a header but no metric row (did the kernel name match?)")
    return pd.DataFrame(out)


def ncu_metrics(df: pd.DataFrame) -> pd.DataFrame:
    """One row per profiled launch, one column per metric (base units)."""
    if not {"id", "kernel", "metric", "value_base"} <= set(df.columns):
        raise ValueError("ncu_metrics: pass the DataFrame returned by parse_ncu_csv")
    return df.pivot_table(index=["id", "kernel"], columns="metric", values="value_base",
                          aggfunc="first").reset_index()
