"""`k3lab report`: run what this machine can, execute the notebooks, write build/report.html.

The report is one static page: the machine line, each study's before/after/peer/floor table and
figure from this run, the committed records of real GPU runs (profiles/), and links to every
notebook executed into build/notebooks/ as .ipynb and .html. Plotly figures are rendered from
their JSON with a local copy of plotly.js, so the report opens without a network.
"""

from __future__ import annotations

import html
import multiprocessing
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLOTLY_MIME = "application/vnd.plotly.v1+json"


@dataclass
class ReportParts:
    sections: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


def notebook_paths(root: Path | None = None) -> list[Path]:
    return sorted(p for p in (root or REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def add_html_for_plotly(nb) -> int:
    """Give every plotly output a text/html twin so nbconvert's HTML shows it; returns the count."""
    import plotly.io as pio

    count = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data and "text/html" not in data:
                fig = pio.from_json(_as_json(data[PLOTLY_MIME]), skip_invalid=True)
                data["text/html"] = pio.to_html(fig, include_plotlyjs=False, full_html=False)
                count += 1
    return count


def _as_json(value) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value)


def execute_notebook(path: Path, out_dir: Path, timeout_s: int) -> tuple[Path, float]:
    """Execute one notebook headless into out_dir (.ipynb and .html); raises on a failing cell."""
    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    finally:
        out_dir.mkdir(parents=True, exist_ok=True)
        add_html_for_plotly(nb)
        nbformat.write(nb, out_dir / path.name)
        body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
        body = body.replace("<head>", '<head>\n<script src="../plotly.min.js"></script>', 1)
        (out_dir / path.with_suffix(".html").name).write_text(body, encoding="utf-8")
    return out_dir / path.name, time.perf_counter() - start


def _execute_in_worker(path: Path, out_dir: Path, timeout_s: int) -> tuple[Path, float]:
    """execute_notebook in a worker process. A failure comes back as a RuntimeError (nbclient's
    CellExecutionError cannot be rebuilt from its pickle in the parent) whose first line names the
    cell's error, e.g. "ValueError: bad shape", for the report's one-line status."""
    try:
        return execute_notebook(path, out_dir, timeout_s)
    except Exception as exc:
        first = f"{exc.ename}: {exc.evalue}" if getattr(exc, "ename", None) else type(exc).__name__
        raise RuntimeError(f"{first}\n{exc}") from None


def _write_plotly_js(out: Path) -> None:
    from plotly.offline import get_plotlyjs

    target = out / "plotly.min.js"
    if not target.exists():
        target.write_text(get_plotlyjs(), encoding="utf-8")


def _study_section(name: str, preset: str | None, out: Path, parts: ReportParts) -> None:
    from k3lab import bench, plots
    from k3lab.studies import load_study

    try:
        study = load_study(name)
    except (ImportError, ValueError) as exc:  # a study not built yet is reported, not hidden
        parts.sections.append(f"<h3>{html.escape(name)}</h3><p>not available here: {html.escape(str(exc))}</p>")
        return
    try:
        records = study.run(preset=preset)
        bench.save_records(records, root=str(out / "records"), overwrite=True)
        table = bench.compare(records)
        fig = plots.before_after(records, title=name)
        parts.sections.append(
            f"<h3>{html.escape(name)}</h3>" + table.to_html(index=False, float_format=lambda x: f"{x:.3g}")
            + fig.to_html(include_plotlyjs=False, full_html=False))
    except Exception:
        parts.failures.append(f"study {name}")
        parts.sections.append(f"<h3>{html.escape(name)}</h3><pre>FAILED\n{html.escape(traceback.format_exc())}</pre>")


def _reference_section() -> str:
    """Committed records from real GPU runs: per device and study, the comparison table and figure
    (graph-replay timings where a study has them: that is how a served decode step runs)."""
    from k3lab import bench, plots

    records = [r for r in bench.load_records() if r.backend != "cpu"]
    if not records:
        return "<p>No committed GPU records yet.</p>"
    parts = ["<p>Committed under profiles/ from real GPU runs (device, versions and commit are in each "
             "record; the issue notes say which session ran them).</p>"]
    groups: dict[tuple[str, str], list] = {}
    for r in records:
        groups.setdefault((r.device, r.study), []).append(r)
    for (device, study), recs in sorted(groups.items()):
        shown = [r for r in recs if r.mode == "graph"] or recs
        table = bench.compare(recs)
        fig = plots.before_after(shown, log=True, title=f"{study} on {device}"
                                 + (" (graph replay)" if shown[0].mode == "graph" else ""))
        parts.append(f"<h3>{html.escape(study)} on {html.escape(device)}</h3>"
                     + table.to_html(index=False, float_format=lambda x: f"{x:.3g}")
                     + fig.to_html(include_plotlyjs=False, full_html=False))
    return "\n".join(parts)


def build_report(out: Path = Path("build"), preset: str | None = None, run_studies: bool = True,
                 run_notebooks: bool = True, timeout_s: int = 1200, workers: int = 2,
                 notebooks: Path | None = None) -> Path:
    from tqdm import tqdm

    from k3lab import env
    from k3lab.studies import STUDIES

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _write_plotly_js(out)
    parts = ReportParts()
    machine = html.escape(env.describe())

    if run_studies:
        parts.sections.append("<h2>Studies run on this machine</h2>")
        if env.detect().backend == "cpu":
            parts.sections.append(
                "<p>No GPU here: Triton kernels run in Triton's interpreter and the fused HIP/CUDA kernels "
                "are not built, so these CPU timings show that before and after agree, not which is faster. "
                "The GPU records below show that.</p>")
        for name in tqdm(list(STUDIES), desc="studies", file=sys.stderr):
            _study_section(name, preset, out, parts)

    nb_rows = []
    if run_notebooks:
        paths = notebook_paths(notebooks)
        # one process per notebook, not threads of this one: with two notebooks run by nbclient in
        # threads, `make run` once hung for good after a notebook's last cell (both the client and the
        # idle kernel waiting; 2026-11-30). Kernel clients in separate processes share nothing.
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
        with pool, tqdm(total=len(paths), desc="notebooks", file=sys.stderr) as bar:
            futures = {p: pool.submit(_execute_in_worker, p, out / "notebooks", timeout_s) for p in paths}
            for p, fut in futures.items():
                try:
                    _, seconds = fut.result()
                    status = f"ran in {seconds:.0f} s"
                except Exception as exc:
                    parts.failures.append(f"notebook {p.name}")
                    status = "FAILED: " + html.escape(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
                bar.update(1)
                nb_rows.append(f'<li><a href="notebooks/{p.stem}.html">{p.stem}</a> '
                               f'(<a href="notebooks/{p.name}">ipynb</a>): {status}</li>')

    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>k3lab report</title>",
        '<script src="plotly.min.js"></script>',
        "<style>body{font-family:sans-serif;max-width:1200px;margin:auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}</style></head><body>",
        "<h1>k3lab report</h1>", f"<p><code>{machine}</code><br>{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}</p>",
    ]
    if parts.failures:
        page.append("<p style='color:#b00'><b>Failed:</b> " + html.escape(", ".join(parts.failures)) + "</p>")
    page.append("<h2>Notebooks</h2><ul>" + "".join(nb_rows) + "</ul>" if nb_rows else "")
    page += parts.sections
    page += ["<h2>Reference records from real GPU runs</h2>", _reference_section(), "</body></html>"]
    path = out / "report.html"
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(page), encoding="utf-8")
    tmp.replace(path)
    if parts.failures:
        raise SystemExit(f"k3lab report: written to {path}, but these failed: {', '.join(parts.failures)}")
    return path
