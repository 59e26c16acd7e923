"""`k3lab report`: run what this machine can, execute the notebooks, write build/report.html.

The page opens with what k3lab is and one table, a row per optimization of the seed article: what
it does, its committed H200 before / after / peer / floor, whether this machine's run checked it,
and its notebook. One section per study follows (the committed H200 records, then this run). Every
notebook is executed into build/notebooks/ as .ipynb and .html; plotly figures are drawn from a local
copy of plotly.js, so the page opens without a network.

A study or notebook that fails, and any cell that reaches the per-cell timeout, is named at the top
of the page and makes `build_report` exit non-zero (SystemExit), so `make run` fails too.

Which form: by default every study runs its quick form (`studies.report_form`: on a GPU the cases the
notebooks and the first page show, every variant still checked; on a CPU the smallest cases), so that
`make run` takes about ten minutes on an H200 and well under twenty on two CPU cores; `full=True`
(`k3lab report --full`) runs every case. The page and the progress lines say which form ran, and the
cases of each study. On a GPU every kernels/*.cu is built first, in parallel (`kernels`). One overall
bar with an ETA runs over every step (`eta`); out/timings.json keeps each step's seconds.

Modules: `execute` (the notebook runner), `front` (the first screen), `sections` (per study),
`tables` (compact before/after tables, shared with `k3lab bench`), `eta` (the overall bar and its ETA),
`kernels` (the parallel build).
"""

from __future__ import annotations

import html
import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from k3lab.report.execute import (
    CELL_TIMEOUT_S,
    PLOTLY_MIME,
    CellTimedOut,
    NotebookFailed,
    add_html_for_plotly,
    execute_notebook,
)
from k3lab.report.front import OPTIMIZATIONS, Checks, front_table
from k3lab.report.eta import Plan, Progress, expected_seconds, fmt_duration
from k3lab.report.sections import LiveRun, form_text, progress, run_study, study_section

__all__ = ["CELL_TIMEOUT_S", "OPTIMIZATIONS", "PLOTLY_MIME", "CellTimedOut", "NotebookFailed",
           "add_html_for_plotly", "build_report", "execute_notebook", "notebook_paths"]

REPO = Path(__file__).resolve().parent.parent.parent
INTRO = (
    "k3lab runs the optimizations that serve Kimi K3 fast, each as a before and an after that are checked "
    "against a plain PyTorch reference, timed and profiled on the machine at hand (an AMD or NVIDIA GPU, "
    "or a CPU). This page shows what each optimization did on an NVIDIA H200 (committed records) and "
    "whether this machine's run checked it.")
STYLE = (
    "body{font-family:sans-serif;max-width:1280px;margin:auto;padding:0 "
    "12px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px "
    "6px;font-size:13px;vertical-align:top}th{background:#f3f3f3}td.num{white-space:nowrap;text-align:right}tr.planned td{color:#777}.fail{color:#b00}section{margin-top:28px}"  # noqa: E501 (a CSS literal)
)


def notebook_paths(root: Path | None = None) -> list[Path]:
    return sorted((root or REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


def _write_plotly_js(out: Path) -> None:
    from plotly.offline import get_plotlyjs

    target = out / "plotly.min.js"
    if not target.exists():
        target.write_text(get_plotlyjs(), encoding="utf-8")


def _run_notebooks(paths: list[Path], out: Path, timeout_s: int, workers: int, t0: float,
                   checks: Checks, failures: list[str], bar: Progress | None = None) -> list[str]:
    """Execute the notebooks in spawned worker processes (kernel clients share nothing); one list
    item of HTML per notebook, in file order. The pool starts them in order as workers free up, so
    `bar` marks the first `workers` started now and the next one each time one ends."""
    from k3lab.report.execute import run_in_worker

    rows: dict[Path, str] = {}
    queue = list(paths)

    def started(n: int) -> None:
        for _ in range(min(n, len(queue))):
            p = queue.pop(0)
            progress(t0, f"notebook {p.stem}: started")
            if bar is not None:
                bar.start(f"notebook:{p.stem}")

    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        futures = {pool.submit(run_in_worker, p, out / "notebooks", timeout_s): p for p in paths}
        started(workers)
        for fut in as_completed(futures):
            p = futures[fut]
            try:
                _, seconds, slowest = fut.result()
                status = f"passed in {seconds:.0f} s (slowest cell {slowest:.0f} s)"
                checks.notebooks[p.stem] = "passed"
            except CellTimedOut as exc:
                status = f"FAILED, timed out: {str(exc).splitlines()[0]}"
                checks.notebooks[p.stem] = "FAILED (a cell timed out)"
                failures.append(f"notebook {p.name} (timeout)")
            except Exception as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                status = f"FAILED: {first}"
                checks.notebooks[p.stem] = "FAILED"
                failures.append(f"notebook {p.name}")
            progress(t0, f"notebook {p.stem}: {status}")
            if bar is not None:
                bar.finish(f"notebook:{p.stem}")
            started(1)
            cls = " class='fail'" if status.startswith("FAILED") else ""
            rows[p] = (f'<li{cls}><a href="notebooks/{p.stem}.html">{html.escape(p.stem)}</a> '
                       f'(<a href="notebooks/{p.name}">ipynb</a>): {html.escape(status)}</li>')
    return [rows[p] for p in paths]


def _build_kernels(t0: float) -> str:
    """Every kernels/*.cu built for this GPU, in parallel; one progress line; the page's line."""
    from k3lab.report import kernels

    start = time.perf_counter()
    results, note = kernels.build_all()
    failed = [f"{n} ({status})" for n, _, status in results if status != "built"]
    line = (f"kernels: {len(results) - len(failed)} of {len(results)} built ({note}) in "
            f"{time.perf_counter() - start:.0f} s" if results else f"kernels: none built ({note})")
    if failed:
        line += "; not built: " + "; ".join(failed)
    progress(t0, line)
    return line


def _form_line(gpu: bool, full: bool) -> str:
    if full:
        return "full form: every case of every study (k3lab report --full)"
    where = ("on a GPU: the cases the notebooks and the first page show, every variant checked"
             if gpu else "on a CPU: the smallest cases that run every kernel, in Triton's interpreter")
    return f"quick form ({where}); k3lab report --full runs every case"


def _write_timings(out: Path, plan: Plan, kind: str, form: str, total_s: float) -> None:
    """out/timings.json: each step's seconds, to hold against the ETA table (eta.EXPECTED_S)."""
    from k3lab import env

    steps = {s.key: {"seconds": round(s.finished - s.started, 1), "expected": s.expected}
             for s in plan.steps if s.finished is not None and s.started is not None}
    data = {"machine": kind, "form": form, "environment": env.describe(), "workers": plan.workers,
            "total_s": round(total_s, 1), "steps": steps}
    (out / "timings.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def build_report(out: Path = Path("build"), preset: str | None = None, run_studies: bool = True,
                 run_notebooks: bool = True, timeout_s: int = CELL_TIMEOUT_S, workers: int = 2,
                 notebooks: Path | None = None, studies: list[str] | None = None, full: bool = False,
                 tty: bool | None = None) -> Path:
    """Write out/report.html; SystemExit naming what failed when anything did (after writing it).

    full: every case of every study (default: the quick forms, see the module docstring); workers:
    notebooks executed at a time; tty: force the progress bar on (True) or plain lines (False), default
    whether stderr is a terminal."""
    from k3lab import env
    from k3lab.bench import git_commit
    from k3lab.studies import GPU_ONLY, STUDIES, canonical

    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_plotly_js(out)
    gpu = env.detect().backend != "cpu"
    kind, form = ("gpu" if gpu else "cpu"), ("full" if full else "quick")
    checks, failures = Checks(), []

    names = [canonical(n) for n in (studies if studies is not None else STUDIES)]
    nb_paths = notebook_paths(notebooks) if run_notebooks else []
    plan = Plan(workers=workers)
    if gpu and (run_studies or nb_paths):  # studies and notebooks then find every .cu built
        plan.add("kernels", expected_seconds(kind, form, "kernels"))
    for n in names if run_studies else []:
        if gpu or n not in GPU_ONLY:
            plan.add(f"study:{n}", expected_seconds(kind, form, f"study:{n}"))
    for p in nb_paths:
        plan.add(f"notebook:{p.stem}", expected_seconds(kind, form, f"notebook:{p.stem}"), parallel=True)

    progress(t0, f"k3lab report: {_form_line(gpu, full)}; {len(names) if run_studies else 0} studies, "
                 f"{len(nb_paths)} notebooks ({workers} at a time); expected about "
                 f"{fmt_duration(plan.eta(time.time()))} on this {kind.upper()}")
    kernel_line = ""
    with Progress(plan, t0, tty=tty) as bar:
        if plan.get("kernels") is not None:
            bar.start("kernels")
            kernel_line = _build_kernels(t0)
            bar.finish("kernels")
        runs = []
        for n in names:
            if not run_studies:
                runs.append(LiveRun(n))
                continue
            key, step = f"study:{n}", plan.get(f"study:{n}")
            if step is not None:
                bar.start(key)
            budget = step.expected if step is not None and gpu and not full else None  # GPU_QUICK's budget
            runs.append(run_study(n, preset, out, gpu, t0, full=full, budget_s=budget))
            if step is not None:
                bar.finish(key)
        for run in runs:
            checks.studies[run.name] = run.status + (f" ({form_text(run)})" if run.form else "")
            if run.status == "FAILED":
                failures.append(f"study {run.name}")
        nb_rows = (_run_notebooks(nb_paths, out, timeout_s, workers, t0, checks, failures, bar)
                   if run_notebooks else [])
    total_s = time.time() - t0
    _write_timings(out, plan, kind, form, total_s)

    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>k3lab report</title>",
        '<script src="plotly.min.js"></script>', f"<style>{STYLE}</style></head><body>",
        "<h1>k3lab report</h1>", f"<p>{html.escape(INTRO)}</p>",
        f"<p><code>{html.escape(env.describe())}</code><br>commit {html.escape(git_commit())}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {total_s:.0f} s</p>",
        f"<p class='form'>Studies: {html.escape(_form_line(gpu, full)) if run_studies else 'not run'}."
        + (f" {html.escape(kernel_line)}." if kernel_line else "") + "</p>",
    ]
    if failures:
        page.append("<p class='fail'><b>Failed:</b> " + html.escape(", ".join(failures)) + "</p>")
    page += ["<h2>The optimizations</h2>", front_table(REPO, checks),
             "<p>The H200 columns are the committed records (profiles/nvidia-h200/), whichever form ran "
             "here: a case the quick form leaves to <code>--full</code> is still shown from its record. "
             "Times per call, one unit per row. Speedup: before / after (2.00x: the after takes half the "
             "time); after vs peer: peer / after (above 1x the after beats the peer). Peer: the fastest "
             "public implementation timed in the same run. "
             "Floor: the bytes the step must move over the measured copy bandwidth, or its launches.</p>"]
    if nb_rows:
        page.append("<h2>Notebooks</h2><ul>" + "".join(nb_rows) + "</ul>")
    page.append("<h2>Studies</h2>")
    page += [study_section(run, REPO, gpu) for run in runs]
    page.append("</body></html>")
    path = out / "report.html"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(page), encoding="utf-8")
    tmp.replace(path)
    progress(t0, f"report written to {path}")
    if failures:
        raise SystemExit(f"k3lab report: written to {path}, but these failed: {', '.join(failures)}")
    return path
