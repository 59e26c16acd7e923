"""One report section per study: its committed H200 records, then what this machine's run found.

On a CPU the Triton kernels run in Triton's interpreter, so their timings say nothing about speed:
the section then says which cases were checked and shows no CPU timing, except for studies that time
host code (`studies.HOST_SIDE`), whose CPU timings are the measurement. A study whose records are not
before / after timings gives its own table (`report_table`). Each live part says which form
of the study ran (`studies.report_form`: quick by default, full with `k3lab report --full`) and its cases.
"""

from __future__ import annotations

import html
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from k3lab.report import tables
from k3lab.report.front import HEADLINE_DEVICE
from k3lab.report.eta import say

INTERPRETER_NOTE = "correctness checked; interpreter timings not meaningful"


@dataclass
class LiveRun:
    """A study's run on this machine: its records, or why there are none."""

    name: str
    records: list = field(default_factory=list)
    status: str = "skipped (studies not run)"
    seconds: float = 0.0
    error: str = ""
    form: str = ""  # 'quick' or 'full' when it ran
    cases: list[str] | None = None  # the cases asked for (None: every case)
    why: str = ""  # what the quick form keeps


def progress(t0: float, message: str) -> None:
    """One progress line on stderr: seconds since the report began, then the message."""
    say(t0, message)


def form_text(run: LiveRun) -> str:
    """'quick form: cases a, b' / 'quick form: every case' / 'full form: every case' ('' if not run)."""
    if not run.form:
        return ""
    cases = "every case" if run.cases is None else "cases " + ", ".join(run.cases)
    return f"{run.form} form: {cases}"


def run_study(name: str, preset: str | None, out: Path, gpu: bool, t0: float, full: bool = False,
              budget_s: float | None = None) -> LiveRun:
    """Run one study's checks and timings here, in the form `studies.report_form` gives (quick unless
    `full`); GPU-only studies are skipped on a CPU, by name. `budget_s`: the line at its end says when
    the study took longer."""
    from k3lab import bench
    from k3lab.studies import GPU_ONLY, StudyNotAvailable, load_study, report_form

    if name in GPU_ONLY and not gpu:
        return LiveRun(name, status="skipped (needs a GPU)")
    form = report_form(name, gpu, full)
    shown = form_text(LiveRun(name, form=form.form, cases=form.cases))
    progress(t0, f"study {name}: started ({shown})")
    start = time.perf_counter()
    meta = {"form": form.form, "cases": form.cases, "why": form.why}
    try:
        records = load_study(name).run(preset=preset, cases=form.cases, **form.kwargs)
        if records:
            bench.save_records(records, root=str(out / "records"), overwrite=True)
        run = LiveRun(name, records, "passed", time.perf_counter() - start, **meta)
    except StudyNotAvailable as exc:
        run = LiveRun(name, status=f"skipped ({exc})")
    except Exception:
        run = LiveRun(name, status="FAILED", seconds=time.perf_counter() - start,
                      error=traceback.format_exc(), **meta)
    over = (f" (over its budget of {budget_s:.0f} s)" if budget_s is not None and run.seconds > budget_s
            else "")
    progress(t0, f"study {name}: {run.status} in {run.seconds:.0f} s{over}")
    return run


def _figure(records, title: str) -> str:
    from k3lab import plots

    fig = plots.before_after(records, log=True, title=title)
    return fig.to_html(include_plotlyjs=False, full_html=False)


def _committed(name: str, root: Path) -> str:
    from k3lab import bench

    records = bench.load_records(study=name, device=HEADLINE_DEVICE, root=root / "profiles")
    shown = tables.shown_cases(tables.in_case_order(records, name))
    if not shown:
        return "<p>No committed H200 records for this study.</p>"
    first = shown[0]
    where = html.escape(f"{first.device}, torch {first.versions.get('torch', '?')}")
    return (f"<h4>On the H200 (committed records; {where})</h4>" + tables.to_html(tables.compact(shown))
            + _figure(shown, f"{name} on the H200 (us, log)") + _roofline(name, records, shown))


def _roofline(name: str, records: list, shown: list) -> str:
    """The shown cases' graph-replayed timings against the H200's measured ceilings, with MI355X's
    datasheet ceilings drawn as projected (plots.study_roofline); '' for a study whose records carry no
    bytes and flops (no formulas: agent_cache's copies, the serving records)."""
    from k3lab import plots

    cases = list(dict.fromkeys(r.case for r in shown))
    try:
        fig = plots.study_roofline(name, device=HEADLINE_DEVICE, cases=cases, modes=("graph",),
                                   records=records, projected="MI355X")
    except ValueError:
        return ""
    return fig.to_html(include_plotlyjs=False, full_html=False)


def _live(run: LiveRun, gpu: bool) -> str:
    from k3lab.studies import HOST_SIDE

    head = "<h4>On this machine</h4>"
    if run.form:
        head += (f"<p class='form'>{html.escape(form_text(run))}"
                 + (f" ({html.escape(run.why)})" if run.form == "quick" and run.why else "")
                 + ("; <code>k3lab report --full</code> runs every case" if run.cases is not None else "")
                 + "</p>")
    if run.status == "FAILED":
        return head + f"<pre class='fail'>FAILED\n{html.escape(run.error)}</pre>"
    if not run.records:
        return head + f"<p>{html.escape(run.status)}</p>"
    cases = list(dict.fromkeys(r.case for r in tables.in_case_order(run.records, run.name)))
    own = _own_table(run, gpu)
    if own is not None:
        return head + f"<p>passed, {len(cases)} cases, {run.seconds:.0f} s</p>" + own
    if not gpu and run.name not in HOST_SIDE:
        return head + (f"<p>{INTERPRETER_NOTE} ({len(cases)} cases: "
                       f"{html.escape(', '.join(cases[:tables.MAX_CASES]))}"
                       f"{', ...' if len(cases) > tables.MAX_CASES else ''}).</p>")
    shown = tables.shown_cases(tables.in_case_order(run.records, run.name))
    return (head + f"<p>passed, {len(cases)} cases, {run.seconds:.0f} s</p>"
            + tables.to_html(tables.compact(shown))
            + _figure(shown, f"{run.name} on this machine (us, log)"))


def _own_table(run: LiveRun, gpu: bool) -> str | None:
    """The study's own table of its records when it has one (`report_table(records)` -> DataFrame, for
    records that are not before / after timings, such as serving_run's one record per run), with its
    `REPORT_NOTE[kind]` above it; None for the common before / after table."""
    from k3lab.studies import load_study

    module = load_study(run.name)
    make = getattr(module, "report_table", None)
    if make is None:
        return None
    note = getattr(module, "REPORT_NOTE", {}).get("gpu" if gpu else "cpu", "")
    return (f"<p>{html.escape(note)}</p>" if note else "") + tables.to_html(make(run.records))


def study_section(run: LiveRun, root: Path, gpu: bool) -> str:
    from k3lab.studies import ABOUT

    about = html.escape(ABOUT.get(run.name, ""))
    return (f"<section id='study-{run.name}'><h3>{html.escape(run.name)}</h3><p>{about}</p>"
            + _committed(run.name, root) + _live(run, gpu) + "</section>")
