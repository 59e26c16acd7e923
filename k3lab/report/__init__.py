"""`k3lab report`: run what this machine can, execute the notebooks, write build/report.html.

The page opens with what k3lab is and one table, a row per optimization of the seed article: what
it does, its committed H200 before / after / peer / floor, whether this machine's run checked it,
and its notebook. One section per study follows (the committed H200 records, then this run). Every
notebook is executed into build/notebooks/ as .ipynb and .html; plotly figures are drawn from a local
copy of plotly.js, so the page opens without a network.

A study or notebook that fails, and any cell that reaches the per-cell timeout, is named at the top
of the page and makes `build_report` exit non-zero (SystemExit), so `make run` fails too.

Modules: `execute` (the notebook runner), `front` (the first screen), `sections` (per study),
`tables` (compact before/after tables, shared with `k3lab bench`).
"""

from __future__ import annotations

import html
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
from k3lab.report.sections import LiveRun, progress, run_study, study_section

__all__ = ["CELL_TIMEOUT_S", "OPTIMIZATIONS", "PLOTLY_MIME", "CellTimedOut", "NotebookFailed",
           "add_html_for_plotly", "build_report", "execute_notebook", "notebook_paths"]

REPO = Path(__file__).resolve().parent.parent.parent
INTRO = (
    "k3lab runs the optimizations that serve Kimi K3 fast, each as a before and an after that are checked "
    "against a plain PyTorch reference, timed and profiled on the machine at hand (an AMD or NVIDIA GPU, "
    "or a CPU). This page shows what each optimization did on an NVIDIA H200 (committed records) and "
    "whether this machine's run checked it.")
STYLE = ("body{font-family:sans-serif;max-width:1280px;margin:auto;padding:0 12px}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;vertical-align:top}th{background:#f3f3f3}"
         "td.num{white-space:nowrap;text-align:right}tr.planned td{color:#777}.fail{color:#b00}section{margin-top:28px}")


def notebook_paths(root: Path | None = None) -> list[Path]:
    return sorted((root or REPO / "notebooks").glob("[0-9][0-9]*_*.ipynb"))


def _write_plotly_js(out: Path) -> None:
    from plotly.offline import get_plotlyjs

    target = out / "plotly.min.js"
    if not target.exists():
        target.write_text(get_plotlyjs(), encoding="utf-8")


def _run_notebooks(paths: list[Path], out: Path, timeout_s: int, workers: int, t0: float,
                   checks: Checks, failures: list[str]) -> list[str]:
    """Execute the notebooks in spawned worker processes (kernel clients share nothing); one list
    item of HTML per notebook, in file order."""
    from k3lab.report.execute import run_in_worker

    rows: dict[Path, str] = {}
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    with pool:
        futures = {pool.submit(run_in_worker, p, out / "notebooks", timeout_s, t0): p for p in paths}
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
            cls = " class='fail'" if status.startswith("FAILED") else ""
            rows[p] = (f'<li{cls}><a href="notebooks/{p.stem}.html">{html.escape(p.stem)}</a> '
                       f'(<a href="notebooks/{p.name}">ipynb</a>): {html.escape(status)}</li>')
    return [rows[p] for p in paths]


def build_report(out: Path = Path("build"), preset: str | None = None, run_studies: bool = True,
                 run_notebooks: bool = True, timeout_s: int = CELL_TIMEOUT_S, workers: int = 2,
                 notebooks: Path | None = None, studies: list[str] | None = None) -> Path:
    """Write out/report.html; SystemExit naming what failed when anything did (after writing it)."""
    from k3lab import env
    from k3lab.bench import git_commit
    from k3lab.studies import STUDIES

    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_plotly_js(out)
    gpu = env.detect().backend != "cpu"
    checks, failures = Checks(), []

    names = list(studies if studies is not None else STUDIES)
    runs = [run_study(n, preset, out, gpu, t0) if run_studies else LiveRun(n) for n in names]
    for run in runs:
        checks.studies[run.name] = run.status
        if run.status == "FAILED":
            failures.append(f"study {run.name}")
    nb_rows = (_run_notebooks(notebook_paths(notebooks), out, timeout_s, workers, t0, checks, failures)
               if run_notebooks else [])

    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>k3lab report</title>",
        '<script src="plotly.min.js"></script>', f"<style>{STYLE}</style></head><body>",
        "<h1>k3lab report</h1>", f"<p>{html.escape(INTRO)}</p>",
        f"<p><code>{html.escape(env.describe())}</code><br>commit {html.escape(git_commit())}, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {time.time() - t0:.0f} s</p>",
    ]
    if failures:
        page.append("<p class='fail'><b>Failed:</b> " + html.escape(", ".join(failures)) + "</p>")
    page += ["<h2>The optimizations</h2>", front_table(REPO, checks),
             "<p>Times per call in microseconds (ms where marked); after/before and after/peer below 1 "
             "mean the after is faster. Peer: the fastest public implementation timed in the same run. "
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
