"""`k3lab report`: run what this machine can, execute the notebooks, write build/report.html.

The page opens with what k3lab is and one table, a row per optimization of the seed article: what
it does, its committed H200 before / after / peer / floor, whether this machine's run checked it,
and its notebook. One section per study follows (the committed H200 records, then this run). Every
notebook is executed into build/notebooks/ as .ipynb and .html (`pages`): plotly figures are drawn from a
local copy of plotly.js and widgets by a widget view carried in the page, so every page opens without a
network.

A study or notebook that fails, and any cell that reaches the per-cell timeout, is named at the top
of the page, a notebook with the cell that stopped it (its place among the code cells, its index, its
first line) and the reason, as the notebook's own page says in a banner on top; `build_report` then
exits non-zero (SystemExit) with the same lines, so `make run` fails too.

Ctrl-C ends the run within seconds (`workers` says how the notebooks stop): nothing queued starts, the
running kernels and workers are killed, and an interrupted report is written at once (a banner at the
top, each stopped or unstarted notebook and study named, the notebooks' own pages marked, timings.json
'interrupted'); then SystemExit(130). And since a run can also die without a chance to write anything
(SIGKILL, a lost machine), the previous report is moved to report.previous.html before the run starts
and report.html says 'running' until the run writes it: an older page never looks current.

Which form: by default every study runs its quick form (`studies.report_form`: on a GPU the cases the
notebooks and the first page show, every variant still checked; on a CPU the smallest cases), so that
`make run` takes about ten minutes on an H200 and well under twenty on two CPU cores; `full=True`
(`k3lab report --full`) runs every case. The page and the progress lines say which form ran, and the
cases of each study. On a GPU every kernels/*.cu is built first, in parallel (`kernels`). One overall
bar with an ETA runs over every step (`eta`); out/timings.json keeps each step's seconds.

On a GPU the notebooks share its memory. The studies run in this process, whose cached memory is given
back before the notebooks start; each notebook's kernel notes its peak (k3lab._cells), timings.json keeps
it, and the next run on this kind of machine starts a notebook only where the peaks of those running
beside it leave room in the memory free at the start (`workers.run_notebooks`). Where no peak is known
yet, a notebook that runs out of GPU memory beside others runs again alone after them, said in the
progress lines and in timings.json: on an H100 (80 GB) four notebooks at a time once left one 3 GiB.
tests/test_report_memory.py runs the scheduling and the rerun with real workers (on a CPU, and on an
H100 with a notebook's peak read back from its GPU).

Modules: `execute` (the notebook runner), `workers` (one process per notebook, and Ctrl-C), `front` (the
first screen), `sections` (per study), `tables` (compact before/after tables, shared with `k3lab bench`),
`eta` (the overall bar and its ETA), `kernels` (the parallel build), `pages` (the offline notebook pages).
"""

from __future__ import annotations

import html
import json
import os
import signal
import threading
import time
from pathlib import Path

from k3lab.report.execute import (
    CELL_TIMEOUT_S,
    PLOTLY_MIME,
    CellTimedOut,
    NotebookFailed,
    NotebookInterrupted,
    add_html_for_plotly,
    execute_notebook,
)
from k3lab.report.front import OPTIMIZATIONS, Checks, front_table
from k3lab.report.eta import (
    Plan,
    Progress,
    default_workers,
    expected_seconds,
    fmt_duration,
    machine_kind,
    measured_peaks,
    measured_seconds,
    timing_files,
)
from k3lab.report.sections import LiveRun, form_text, progress, run_study, study_section

__all__ = ["CELL_TIMEOUT_S", "INTERRUPTED_EXIT", "OPTIMIZATIONS", "RECORDS_ENV", "PLOTLY_MIME",
           "CellTimedOut", "NotebookFailed", "NotebookInterrupted", "add_html_for_plotly", "build_report",
           "execute_notebook", "notebook_paths"]

REPO = Path(__file__).resolve().parent.parent.parent
INTERRUPTED_EXIT = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)
# set while the report's notebooks run: the folder its studies saved this run's records in (out/records),
# for a notebook that shows this machine's fresh records (notebook 09's serving runs) instead of rerunning
RECORDS_ENV = "K3LAB_REPORT_RECORDS"
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
    return sorted(Path(root or REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


def _write_plotly_js(out: Path) -> None:
    """out/plotly.min.js, plotly's own copy (rewritten when it differs: a truncated one is replaced)."""
    from plotly.offline import get_plotlyjs

    from k3lab.files import write_atomic

    target, text = out / "plotly.min.js", get_plotlyjs()
    if not target.exists() or target.stat().st_size != len(text.encode()):
        write_atomic(target, text)


def _mark_running(out: Path, commit: str) -> None:
    """Before a run: the previous report.html becomes report.previous.html, and report.html says that a
    run began and has not written its report (so a run killed without a word leaves no old page as if
    current)."""
    from k3lab.files import write_atomic

    page = out / "report.html"
    if page.exists():
        os.replace(page, out / "report.previous.html")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    write_atomic(page, "<!doctype html><html><head><meta charset='utf-8'><title>k3lab report (running)"
                       f"</title><style>{STYLE}</style></head><body><h1>k3lab report: not finished</h1>"
                       f"<p class='fail'>A run began at {when} (commit {html.escape(commit)}) and has not "
                       "written its report: this page is replaced when the run ends or is interrupted. If "
                       "no run is going on, it was killed before it could write one.</p><p>The previous "
                       "report, if there was one: <a href='report.previous.html'>report.previous.html</a> "
                       "(its notebook pages may have been replaced by this run's).</p></body></html>\n")


# a notebook's outcome (workers.Outcome.status) as the first screen's 'checked on this machine' (a stop
# in a known cell adds it: "FAILED (code cell 15 of 21 timed out)")
NOTEBOOK_CHECK = {"passed": "passed", "timeout": "FAILED (a cell timed out)", "failed": "FAILED",
                  "interrupted": "INTERRUPTED", "not started": "not run (interrupted)"}
STOPPED_IN = {"timeout": "FAILED ({} timed out)", "failed": "FAILED ({} raised an error)",
              "interrupted": "INTERRUPTED ({} was running)"}
NOTEBOOK_LINE = {"timeout": "FAILED, timed out: ", "failed": "FAILED: ", "interrupted": "INTERRUPTED: ",
                 "not started": "NOT RUN: "}
FAILURE_KIND = {"timeout": "timed out", "failed": "failed"}


def _run_notebooks(paths: list[Path], out: Path, timeout_s: int, workers: int, t0: float, checks: Checks,
                   failures: list[str], bar: Progress | None = None,
                   outcomes_by_stem: dict | None = None,
                   start_order: list[Path] | None = None,
                   memory: tuple[dict, float] | None = None) -> tuple[list[str], bool]:
    """Execute the notebooks in worker processes (`workers`), started in `start_order` (the same paths;
    None: file order); one list item of HTML per notebook, in file order, and whether Ctrl-C stopped
    them. `bar` marks each notebook as its worker starts and ends (an interrupted one stays unfinished,
    so the timings show it as interrupted); `outcomes_by_stem` gets each notebook's workers.Outcome (for
    timings.json); memory: workers.run_notebooks' (expected peaks, GiB they share), None on a CPU."""
    from k3lab.report import workers as pool

    def started(p: Path) -> None:
        progress(t0, f"notebook {p.stem}: started")
        if bar is not None:
            bar.start(f"notebook:{p.stem}")

    def ended(p: Path, got) -> None:
        progress(t0, f"notebook {p.stem}: {_notebook_status(got)}")
        if bar is not None and got.status != "interrupted":
            bar.finish(f"notebook:{p.stem}")

    order = list(paths) if start_order is None else list(start_order)
    if sorted(map(str, order)) != sorted(map(str, paths)):
        raise ValueError(f"start_order must hold the same notebooks as paths, got {order} for {list(paths)}")
    def retried(p: Path, got) -> None:
        progress(t0, f"notebook {p.stem}: ran out of GPU memory beside {', '.join(got.rerun_alone)} "
                     f"({got.message[:120]}): it runs again alone after them")

    outcomes, stopped = pool.run_notebooks(order, out / "notebooks", timeout_s, workers, started, ended,
                                           memory=memory, retried=retried)
    rows = []
    for p in paths:
        got = outcomes[p]
        status = _notebook_status(got)
        checks.notebooks[p.stem] = _notebook_check(got)
        if outcomes_by_stem is not None:
            outcomes_by_stem[p.stem] = got
        if got.status in ("failed", "timeout"):
            failures.append(f"notebook {p.name} ({FAILURE_KIND[got.status]}: {got.message})")
        cls = " class='fail'" if got.status != "passed" else ""
        where = (f' (<a href="notebooks/{p.stem}.html#k3lab-stopped-here">where it stopped</a>)'
                 if got.cell and got.page else "")
        rows.append(f'<li{cls}><a href="notebooks/{p.stem}.html">{html.escape(p.stem)}</a> '
                    f'(<a href="notebooks/{p.name}">ipynb</a>): {html.escape(status)}{where}</li>')
    return rows, stopped


def _notebook_memory(gpu: bool, paths: list[Path], source: Path | None) -> tuple[dict, float] | None:
    """(each notebook's GPU memory peak in the timings file the ETA read, the GiB free on the GPU now)
    for workers.run_notebooks; None on a CPU. The studies ran in this process: its cached GPU memory is
    given back first, so the notebooks' kernels have it."""
    if not gpu:
        return None
    import gc

    import torch

    from k3lab._cells import give_back_gpu_cache

    gc.collect()
    give_back_gpu_cache()
    peaks = measured_peaks(source)
    free = torch.cuda.mem_get_info()[0] / 2 ** 30
    return {p: peaks[f"notebook:{p.stem}"] for p in paths if f"notebook:{p.stem}" in peaks}, free


def _notebook_check(got) -> str:
    """A notebook's outcome for the first screen: 'passed', 'FAILED (code cell 15 of 21 timed out)'."""
    cell = (got.cell or {}).get("code_cell")
    if cell and got.status in STOPPED_IN:
        return STOPPED_IN[got.status].format(f"code cell {cell} of {got.cell.get('code_cells')}")
    return NOTEBOOK_CHECK[got.status]


def _notebook_status(got) -> str:
    """One notebook's line: 'passed in 12 s (slowest cell 3 s)', 'FAILED: ...', 'INTERRUPTED: ...'."""
    if got.status == "passed":
        return f"passed in {got.seconds:.0f} s (slowest cell {got.slowest:.0f} s)"
    return NOTEBOOK_LINE[got.status] + got.message


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


def _other_half(path: Path, skipped: str, machine: dict, form: str) -> tuple[dict, dict | None]:
    """The steps of the half this run skipped (keys starting with `skipped`, 'study:' or 'notebook:')
    from the timings file `path` left in the same folder by an earlier complete run of this machine kind
    and form, and where they came from ({}, None when there is no such file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}, None
    if not (isinstance(data, dict) and data.get("machine_kind") == machine and data.get("form") == form
            and data.get("status") == "complete" and isinstance(data.get("steps"), dict)):
        return {}, None
    steps = {k: v for k, v in data["steps"].items() if k.startswith(skipped)}
    carried = {"steps": sorted(steps), "finished_at": data.get("finished_at"), "total_s": data.get("total_s"),
               "why": f"this run skipped its {skipped.rstrip(':')} steps; the earlier run in this folder "
                      "timed them on this machine kind"}
    return steps, carried if steps else None


def _write_timings(out: Path, plan: Plan, kind: str, form: str, total_s: float, stopped: str = "",
                   notebooks: dict | None = None, skipped: str | None = None) -> None:
    """out/timings.json: each step's seconds beside what the ETA expected, the machine kind they were
    measured on (`eta.machine_kind`: the next report on this kind of machine takes its ETA from them),
    and the run's status: 'complete', or 'interrupted' with what was running (`stopped`), each stopped
    step's seconds so far marked 'interrupted', and the steps that never started. Each notebook step
    adds its code cells' seconds ('cells': cell id -> seconds) and, when it did not pass, its status and
    the cell that stopped it (`notebooks`: workers.Outcome by stem). `skipped` ('study:' or 'notebook:',
    the half --skip-studies or --skip-notebooks left out): the steps of that half are carried over from
    the timings.json an earlier complete run of this machine kind and form left in `out` (`_other_half`;
    named under 'carried'), so the report's two halves run in two calls with one --out leave one file
    holding both."""
    from k3lab import env
    from k3lab.files import write_atomic

    machine = machine_kind(kind)
    steps, carried = _other_half(out / "timings.json", skipped, machine, form) if skipped else ({}, None)
    now = time.time()
    for s in plan.steps:
        if s.finished is not None and s.started is not None:
            steps[s.key] = {"seconds": round(s.finished - s.started, 1), "expected": s.expected}
        elif s.started is not None and stopped:
            steps[s.key] = {"seconds": round(now - s.started, 1), "expected": s.expected,
                            "status": "interrupted"}
        got = (notebooks or {}).get(s.key.split(":", 1)[1]) if s.key.startswith("notebook:") else None
        if got is not None and s.key in steps:
            steps[s.key]["cells"] = {str(cell_id): sec for cell_id, sec in got.cells}
            if got.status != "passed":
                steps[s.key]["status"] = got.status
            if got.cell:
                steps[s.key]["stopped_at"] = got.cell.get("text")
            if got.gpu_peak_gib is not None:
                steps[s.key]["gpu_peak_gib"] = got.gpu_peak_gib
            if got.rerun_alone:  # its step spans both tries and the wait between: keep the rerun's own time
                steps[s.key]["rerun_alone_after_running_out_of_memory_beside"] = got.rerun_alone
                steps[s.key]["seconds"] = round(got.seconds, 1)
    data = {"machine": kind, "machine_kind": machine, "form": form, "environment": env.describe(),
            "workers": plan.workers, "total_s": round(total_s, 1), "finished_at": round(now, 1),
            "status": "interrupted" if stopped else "complete", "steps": steps}
    if carried:
        data["carried"] = carried
    if stopped:
        data["interrupted"] = {"while": stopped,
                               "not_started": [s.key for s in plan.steps if s.started is None]}
    write_atomic(out / "timings.json", json.dumps(data, indent=1) + "\n")


def _study_checks(runs: list[LiveRun], checks: Checks, failures: list[str]) -> None:
    """Each study's line for the first screen, and the failed ones in `failures` (once)."""
    for run in runs:
        checks.studies[run.name] = run.status + (f" ({form_text(run)})" if run.form else "")
        if run.status == "FAILED" and f"study {run.name}" not in failures:
            failures.append(f"study {run.name}")


def _shown_path(path: Path) -> str:
    """A path as the progress line shows it: relative to the tree when inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _running_steps(plan: Plan) -> list[str]:
    return [s.key for s in plan.steps if s.started is not None and s.finished is None]


class _CtrlC:
    """While a report runs (main thread only): the first SIGINT raises KeyboardInterrupt, later ones
    are ignored, so the interrupted report is written whole; the previous handler comes back after."""

    def __init__(self):
        self.hits = 0
        self.previous = None

    def _handler(self, signum, frame) -> None:
        self.hits += 1
        if self.hits == 1:
            raise KeyboardInterrupt

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _sweep(since: int | None) -> None:
    """SIGKILL to every process this one started since `since` (a /proc start time) that still runs:
    a study's ranks, a compiler, a worker caught between its start and its place in the list."""
    from k3lab.report import workers as pool

    if since is not None:
        pool.kill_tree(pool.descendants(os.getpid(), since=since))


def _unstarted(paths: list[Path], out: Path, checks: Checks) -> list[str]:
    """Rows and pages (`workers.placeholder`) of notebooks an interrupted report never started."""
    from k3lab.report import workers as pool

    rows = []
    for p in paths:
        pool.placeholder(p, out / "notebooks", "the report was interrupted before this notebook started")
        checks.notebooks[p.stem] = NOTEBOOK_CHECK["not started"]
        rows.append(f"<li class='fail'>{html.escape(p.stem)} (<a href='notebooks/{p.name}'>ipynb</a>): "
                    "NOT RUN: the report was interrupted before it started</li>")
    return rows


def build_report(out: Path = Path("build"), preset: str | None = None, run_studies: bool = True,
                 run_notebooks: bool = True, timeout_s: int = CELL_TIMEOUT_S, workers: int | None = None,
                 notebooks: Path | None = None, studies: list[str] | None = None, full: bool = False,
                 tty: bool | None = None) -> Path:
    """Write out/report.html; SystemExit naming what failed when anything did (after writing it);
    after Ctrl-C an interrupted report, then SystemExit(INTERRUPTED_EXIT) (module docstring).

    full: every case of every study (default: the quick forms, see the module docstring); workers:
    notebooks executed at a time (None: eta.default_workers for this machine); tty: force the progress
    bar on (True) or plain lines (False), default
    whether stderr is a terminal."""
    from k3lab import env
    from k3lab.bench import git_commit
    from k3lab.report import workers as pool
    from k3lab.studies import GPU_ONLY, STUDIES, canonical

    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive integer or None, got {workers!r}")
    t0 = time.time()
    since = pool.start_ticks()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _mark_running(out, git_commit())
    _write_plotly_js(out)
    gpu = env.detect().backend != "cpu"
    kind, form = ("gpu" if gpu else "cpu"), ("full" if full else "quick")
    workers = default_workers(kind) if workers is None else workers
    checks, failures = Checks(), []

    names = [canonical(n) for n in (studies if studies is not None else STUDIES)]
    nb_paths = notebook_paths(notebooks) if run_notebooks else []
    # the ETA from this machine kind's last measured run (eta module docstring)
    measured, source = measured_seconds(machine_kind(kind), form, timing_files(out))
    plan = Plan(workers=workers)
    if gpu and (run_studies or nb_paths):  # studies and notebooks then find every .cu built
        plan.add("kernels", expected_seconds(kind, form, "kernels", measured))
    for n in names if run_studies else []:
        if gpu or n not in GPU_ONLY:
            plan.add(f"study:{n}", expected_seconds(kind, form, f"study:{n}", measured))
    # notebooks start longest first (the expected seconds above), so that the last to start is a short
    # one and the workers end close together; the page keeps file order
    nb_expected = {p: expected_seconds(kind, form, f"notebook:{p.stem}", measured) for p in nb_paths}
    nb_start = sorted(nb_paths, key=lambda p: -nb_expected[p])
    for p in nb_start:
        plan.add(f"notebook:{p.stem}", nb_expected[p], parallel=True)
    basis = (f"the steps' seconds in {_shown_path(source)}" if source is not None
             else "the table of expected seconds (no measured run of this machine kind yet)")

    progress(t0, f"k3lab report: {_form_line(gpu, full)}; {len(names) if run_studies else 0} studies, "
                 f"{len(nb_paths)} notebooks ({workers} at a time); expected about "
                 f"{fmt_duration(plan.eta(time.time()))} on this {kind.upper()}, from {basis}")
    kernel_line, stopped = "", ""
    runs: list[LiveRun] = []
    nb_rows: list[str] | None = None
    outcomes: dict = {}
    with _CtrlC():
        try:
            with Progress(plan, t0, tty=tty) as bar:
                if plan.get("kernels") is not None:
                    bar.start("kernels")
                    kernel_line = _build_kernels(t0)
                    bar.finish("kernels")
                for n in names:
                    if not run_studies:
                        runs.append(LiveRun(n))
                        continue
                    key, step = f"study:{n}", plan.get(f"study:{n}")
                    if step is not None:
                        bar.start(key)
                    budget = step.expected if step is not None and gpu and not full else None  # GPU_QUICK's
                    runs.append(run_study(n, preset, out, gpu, t0, full=full, budget_s=budget))
                    if step is not None:
                        bar.finish(key)
                _study_checks(runs, checks, failures)
                if run_notebooks:
                    memory = _notebook_memory(gpu, nb_paths, source)
                    before = os.environ.get(RECORDS_ENV)
                    os.environ[RECORDS_ENV] = str((out / "records").resolve())
                    try:
                        nb_rows, interrupted = _run_notebooks(nb_paths, out, timeout_s, workers, t0, checks,
                                                              failures, bar, outcomes, start_order=nb_start,
                                                              memory=memory)
                    finally:
                        if before is None:
                            os.environ.pop(RECORDS_ENV, None)
                        else:
                            os.environ[RECORDS_ENV] = before
                    if interrupted:
                        raise KeyboardInterrupt
        except KeyboardInterrupt:
            stopped = ", ".join(k.replace(":", " ") for k in _running_steps(plan)) or "the report"
            progress(t0, f"interrupted (Ctrl-C) while {stopped} ran: writing an interrupted report")
            _sweep(since)
            for n in names[len(runs):]:
                step = plan.get(f"study:{n}")
                runs.append(LiveRun(n, status="INTERRUPTED" if step is not None and step.started is not None
                                    else "not run (the report was interrupted)"))
            _study_checks(runs, checks, failures)
            if nb_rows is None:
                nb_rows = _unstarted(nb_paths, out, checks)
        total_s = time.time() - t0
        skipped = "study:" if not run_studies else "notebook:" if not run_notebooks else None
        _write_timings(out, plan, kind, form, total_s, stopped, outcomes, skipped=skipped)
        path = _write_page(out, runs, nb_rows or [], checks, failures, kernel_line, stopped, total_s,
                           gpu=gpu, full=full, run_studies=run_studies)
    progress(t0, f"report written to {path}" + (" (interrupted)" if stopped else ""))
    if stopped:
        raise SystemExit(INTERRUPTED_EXIT)
    if failures:
        raise SystemExit(f"k3lab report: written to {path}, but these failed:\n"
                         + "\n".join(f"  - {f}" for f in failures))
    return path


def _write_page(out: Path, runs: list[LiveRun], nb_rows: list[str], checks: Checks, failures: list[str],
                kernel_line: str, stopped: str, total_s: float, *, gpu: bool, full: bool,
                run_studies: bool) -> Path:
    """out/report.html (written to a temp file and renamed); an interrupted run's page says so at the
    top and keeps to what this run did (the committed records of studies it did not run are left to a
    whole run's page, so the interrupted one is written at once)."""
    from k3lab import env
    from k3lab.bench import git_commit
    from k3lab.files import write_atomic

    title = "k3lab report" + (" (interrupted)" if stopped else "")
    page = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>",
        '<script src="plotly.min.js"></script>', f"<style>{STYLE}</style></head><body>",
        f"<h1>{title}</h1>", f"<p>{html.escape(INTRO)}</p>",
        f"<p><code>{html.escape(env.describe())}</code><br>commit {html.escape(git_commit())}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {total_s:.0f} s</p>",
        f"<p class='form'>Studies: {html.escape(_form_line(gpu, full)) if run_studies else 'not run'}."
        + (f" {html.escape(kernel_line)}." if kernel_line else "") + "</p>",
    ]
    if stopped:
        page.append(f"<p class='fail interrupted'><b>Interrupted</b> (Ctrl-C) after {total_s:.0f} s, while "
                    f"{html.escape(stopped)} ran: this is not a complete run. What finished is shown; what "
                    "was stopped or never started is marked INTERRUPTED or NOT RUN below, and so are the "
                    "notebooks' own pages.</p>")
    if failures:
        page.append("<div class='fail failed'><b>Failed:</b><ul>"
                    + "".join(f"<li>{html.escape(f)}</li>" for f in failures) + "</ul></div>")
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
    if stopped:
        page.append("<ul>" + "".join(f"<li>{html.escape(r.name)}: {html.escape(r.status)}</li>" for r in runs)
                    + "</ul>")
        page += [study_section(run, REPO, gpu) for run in runs if run.records or run.status == "FAILED"]
    else:
        page += [study_section(run, REPO, gpu) for run in runs]
    page.append("</body></html>")
    path = out / "report.html"
    write_atomic(path, "\n".join(page))
    return path
