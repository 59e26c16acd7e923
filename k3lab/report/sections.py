"""One report section per study: its committed H200 records, then what this machine's run found.

On a CPU the Triton kernels run in Triton's interpreter, so their timings say nothing about speed:
the section then says which cases were checked and shows no CPU timing, except for studies that time
host code (`studies.HOST_SIDE`), whose CPU timings are the measurement.
"""

from __future__ import annotations

import html
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from k3lab.report import tables
from k3lab.report.front import HEADLINE_DEVICE

INTERPRETER_NOTE = "correctness checked; interpreter timings not meaningful"


@dataclass
class LiveRun:
    """A study's run on this machine: its records, or why there are none."""

    name: str
    records: list = field(default_factory=list)
    status: str = "skipped (studies not run)"
    seconds: float = 0.0
    error: str = ""


def progress(t0: float, message: str) -> None:
    """One progress line on stderr: seconds since the report began, then the message."""
    print(f"[{time.time() - t0:6.0f} s] {message}", file=sys.stderr, flush=True)


def run_study(name: str, preset: str | None, out: Path, gpu: bool, t0: float) -> LiveRun:
    """Run one study's checks and timings here; GPU-only studies are skipped on a CPU, by name."""
    from k3lab import bench
    from k3lab.studies import CPU_CASES, GPU_ONLY, StudyNotAvailable, load_study

    if name in GPU_ONLY and not gpu:
        return LiveRun(name, status="skipped (needs a GPU)")
    progress(t0, f"study {name}: started")
    start = time.perf_counter()
    try:
        records = load_study(name).run(preset=preset, cases=None if gpu else CPU_CASES.get(name))
        if records:
            bench.save_records(records, root=str(out / "records"), overwrite=True)
        run = LiveRun(name, records, "passed", time.perf_counter() - start)
    except StudyNotAvailable as exc:
        run = LiveRun(name, status=f"skipped ({exc})")
    except Exception:
        run = LiveRun(name, status="FAILED", seconds=time.perf_counter() - start, error=traceback.format_exc())
    progress(t0, f"study {name}: {run.status} in {run.seconds:.0f} s")
    return run


def _figure(records, title: str) -> str:
    from k3lab import plots

    fig = plots.before_after(records, log=True, title=title)
    return fig.to_html(include_plotlyjs=False, full_html=False)


def _committed(name: str, root: Path) -> str:
    from k3lab import bench

    records = [r for r in bench.load_records(study=name, device=HEADLINE_DEVICE, root=root / "profiles")]
    shown = tables.shown_cases(records)
    if not shown:
        return "<p>No committed H200 records for this study.</p>"
    first = shown[0]
    where = html.escape(f"{first.device}, torch {first.versions.get('torch', '?')}")
    return (f"<h4>On the H200 (committed records; {where})</h4>" + tables.to_html(tables.compact(shown))
            + _figure(shown, f"{name} on the H200 (us, log)"))


def _live(run: LiveRun, gpu: bool) -> str:
    from k3lab.studies import HOST_SIDE

    head = "<h4>On this machine</h4>"
    if run.status == "FAILED":
        return head + f"<pre class='fail'>FAILED\n{html.escape(run.error)}</pre>"
    if not run.records:
        return head + f"<p>{html.escape(run.status)}</p>"
    cases = sorted({r.case for r in run.records})
    if not gpu and run.name not in HOST_SIDE:
        return head + (f"<p>{INTERPRETER_NOTE} ({len(cases)} cases: "
                       f"{html.escape(', '.join(cases[:tables.MAX_CASES]))}"
                       f"{', ...' if len(cases) > tables.MAX_CASES else ''}).</p>")
    shown = tables.shown_cases(run.records)
    return (head + f"<p>passed, {len(cases)} cases, {run.seconds:.0f} s</p>" + tables.to_html(tables.compact(shown))
            + _figure(shown, f"{run.name} on this machine (us, log)"))


def study_section(run: LiveRun, root: Path, gpu: bool) -> str:
    from k3lab.studies import ABOUT

    about = html.escape(ABOUT.get(run.name, ""))
    return (f"<section id='study-{run.name}'><h3>{html.escape(run.name)}</h3><p>{about}</p>"
            + _committed(run.name, root) + _live(run, gpu) + "</section>")
