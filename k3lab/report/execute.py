"""Execute notebooks headless for the report: one kernel per notebook, a per-cell timeout that fails.

`execute_notebook(path, out_dir, timeout_s)` runs every cell, writes the executed .ipynb and an .html
twin, and returns (path written, seconds, slowest cell's seconds). A cell that errors raises
`NotebookFailed` naming its error; a cell that reaches the per-cell timeout raises `CellTimedOut`
(a timeout is always a failure, never a slow success). Ctrl-C (KeyboardInterrupt, which the report's
workers raise on their stop signal) kills the kernel's process group, marks the notebook interrupted in its
saved .ipynb and .html (`mark_interrupted`: a banner on top and a marker after the cell that was
running) and raises `NotebookInterrupted`. Every file is written to a temp file and renamed.

Why a client of our own: nbclient mimics an ipywidgets `Output` for headless runs, and its mimic
echoes every captured output back to the kernel on the shell socket, from the task that reads iopub,
while another task of the same event loop waits on that shell socket for the cell's reply. Now and
then the reply's wake-up is lost in that overlap (the zmq socket's edge-triggered readiness), and the
client sits until its poll times out, then finds the reply and carries on as if nothing happened: an
explorer cell (interactive_output drawing into an Output) cost the full per-cell timeout about one run
in four. A headless run has no view to keep in sync with the kernel, so `_HeadlessOutput` keeps the
mimic (the outputs still land in the saved widget state) and drops the echo; nothing else sends on the
shell socket while a reply is awaited.

Pages that open offline (a workshop room without a network): the exported .html loads nothing from a
CDN. nbconvert's page would fetch require.js and MathJax; the first is not needed (plotly.js is the
report's local copy), and the formulas of the markdown cells are rendered to MathML before the export
(`math_to_mathml`, with latex2mathml; browsers draw MathML themselves), so every remote script is
left out (`drop_remote_scripts`). Without latex2mathml the formulas stay as their LaTeX source.
"""

from __future__ import annotations

import html
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

PLOTLY_MIME = "application/vnd.plotly.v1+json"
# The slowest cells of the suite take ~20-40 s on two busy CPU cores (a study's check-and-time cell);
# 240 s leaves a wide margin there and still ends a stall well inside `make run`'s budget.
CELL_TIMEOUT_S = 240
IOPUB_TIMEOUT_S = 30  # after a cell's reply, the rest of its output must arrive within this


class NotebookFailed(RuntimeError):
    """A notebook did not run to the end; the message's first line says why, in one line."""


class CellTimedOut(NotebookFailed):
    """A cell reached the per-cell timeout."""


class NotebookInterrupted(NotebookFailed):
    """Ctrl-C (or the report's stop) ended the run; the saved notebook and page say so."""


INTERRUPTED_STYLE = "border:2px solid #b00;color:#b00;padding:6px 10px"


def banner(cell_id: str, title: str, text: str) -> dict:
    """A markdown cell (a plain dict, valid nbformat 4.5) that shows `title`: `text` in a red box."""
    box = f"<div style='{INTERRUPTED_STYLE}'><b>{html.escape(title)}</b>: {html.escape(text)}</div>"
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": box}


def mark_interrupted(nb, running: int | None, why: str | None = None) -> str:
    """Mark `nb` (a notebook dict or NotebookNode, executed in place in part, or not at all) as
    interrupted: metadata['k3lab']['interrupted'], a banner as its first cell saying `why` (default: how
    far it ran) and, when `running` (the index of the cell that was running) is given, a marker right
    after that cell. Returns the one-line reason."""
    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    done = sum(1 for i in code if i != running and cells[i].get("execution_count") is not None)
    where = (f"while code cell {code.index(running) + 1} of {len(code)} ran" if running in code
             else "before its cells ran" if done == 0 else f"after {done} of {len(code)} code cells")
    reason = why or f"stopped {where}; {done} of {len(code)} code cells finished"
    nb["metadata"]["k3lab"] = {"interrupted": True, "code_cells": len(code), "finished": done,
                               "running": code.index(running) + 1 if running in code else None}
    def node(cell: dict):  # cell ids came with nbformat 4.5; a NotebookNode takes NotebookNode cells
        if nb.get("nbformat_minor", 0) < 5:
            cell.pop("id")
        return cell if type(nb) is dict else _node(cell)

    if running in code:
        cells.insert(running + 1, node(banner(
            "k3lab-interrupted-here", "Interrupted here",
            "this cell was running when the run was stopped, so its output above is partial, and no cell "
            "below it ran.")))
    cells.insert(0, node(banner("k3lab-interrupted", "Interrupted run",
                                f"this page is not a complete run of the notebook: {reason}.")))
    return reason


def _node(d: dict):
    import nbformat

    return nbformat.from_dict(d)


def _kill_kernel(client) -> None:
    """SIGKILL to the kernel's process group (the kernel and whatever it started), when it has one."""
    provisioner = getattr(getattr(client, "km", None), "provisioner", None)
    pgid = getattr(provisioner, "pgid", None)
    process = getattr(provisioner, "process", None)
    try:
        if pgid and hasattr(os, "killpg"):
            os.killpg(pgid, signal.SIGKILL)
        elif process is not None:
            process.kill()
    except OSError:
        pass  # already gone


def _client_class():
    from jupyter_client.manager import AsyncKernelManager
    from nbclient import NotebookClient
    from nbclient.output_widget import OutputWidget

    class _HeadlessOutput(OutputWidget):
        """nbclient's Output mimic without the echo to the kernel (see the module docstring)."""

        def send(self, data=None, metadata=None, buffers=None) -> None:
            return None

    class _Client(NotebookClient):
        def __init__(self, nb, *, socket_path: str, **kw):
            super().__init__(nb, **kw)
            self.socket_path = socket_path
            self.widget_registry = {"@jupyter-widgets/output": {"OutputModel": _HeadlessOutput}}
            self.cell_seconds: dict[int, float] = {}
            self._started: dict[int, float] = {}
            self.on_cell_execute = self._cell_began
            self.on_cell_executed = self._cell_ended

        def create_kernel_manager(self):
            # local sockets, not TCP: nothing listens on the network, and the kernel has no reason to warn
            self.km = AsyncKernelManager(kernel_name=self.kernel_name or "python3", transport="ipc",
                                         ip=self.socket_path)
            return self.km

        def _cell_began(self, cell, cell_index):
            self._started[cell_index] = time.perf_counter()

        def _cell_ended(self, cell, cell_index, execute_reply):
            seconds = time.perf_counter() - self._started.pop(cell_index, time.perf_counter())
            self.cell_seconds[cell_index] = seconds
            # nbclient's poll returns a reply it finds when its timeout fires as if it were on time
            if self.timeout and seconds >= self.timeout:
                raise CellTimedOut(f"cell {cell_index} reached the per-cell timeout of {self.timeout} s")

    return _Client


def add_html_for_plotly(nb) -> int:
    """Give every plotly output a text/html twin so nbconvert's HTML shows it; returns the count."""
    import plotly.io as pio

    count = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if PLOTLY_MIME in data and "text/html" not in data:
                value = data[PLOTLY_MIME]
                fig = pio.from_json(value if isinstance(value, str) else json.dumps(value), skip_invalid=True)
                data["text/html"] = pio.to_html(fig, include_plotlyjs=False, full_html=False)
                count += 1
    return count


_CODE = re.compile(r"(```.*?```|~~~.*?~~~|`[^`\n]*`)", re.S)
_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<![\\$])\$(?![\s$])([^$\n]+?)(?<![\s\\])\$(?!\d)")
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\ssrc=[\"']?(?:https?:)?//[^>]*>\s*</script>", re.I)


def math_to_mathml(markdown: str) -> str:
    """The $...$ and $$...$$ formulas of a markdown text as MathML (code spans and fences untouched);
    a formula latex2mathml cannot read stays as its source. Unchanged when latex2mathml is missing."""
    try:
        from latex2mathml.converter import convert
    except ImportError:
        return markdown

    def render(match, display: str) -> str:
        try:
            return convert(match.group(1).strip(), display=display)
        except Exception:  # noqa: BLE001 - an unreadable formula stays readable as LaTeX
            return html.escape(match.group(0))

    parts = _CODE.split(markdown)
    for i in range(0, len(parts), 2):  # the even parts lie outside code
        text = _DISPLAY_MATH.sub(lambda m: "\n\n" + render(m, "block") + "\n\n", parts[i])
        parts[i] = _INLINE_MATH.sub(lambda m: render(m, "inline"), text)
    return "".join(parts)


def drop_remote_scripts(page: str) -> str:
    """page without <script src="http(s)://..."> tags (nbconvert's require.js and MathJax)."""
    return _REMOTE_SCRIPT.sub("", page)


def export_html(nb) -> str:
    """The notebook as one HTML page that needs no network (module docstring); `nb` is not changed.
    plotly.js is expected beside the page's folder (../plotly.min.js, the report's copy)."""
    import copy

    from nbconvert import HTMLExporter

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = math_to_mathml(cell.source)
    body, _ = HTMLExporter(template_name="lab").from_notebook_node(nb)
    body = drop_remote_scripts(body)
    return body.replace("<head>", '<head>\n<script src="../plotly.min.js"></script>', 1)


def _write_outputs(nb, path: Path, out_dir: Path) -> None:
    import nbformat

    from k3lab.files import write_atomic

    add_html_for_plotly(nb)
    text = nbformat.writes(nb)
    write_atomic(out_dir / path.name, text if text.endswith("\n") else text + "\n")
    write_atomic(out_dir / path.with_suffix(".html").name, export_html(nb))


def execute_notebook(path: Path, out_dir: Path, timeout_s: int = CELL_TIMEOUT_S) -> tuple[Path, float, float]:
    """Execute one notebook into out_dir (.ipynb and .html, written even when a cell fails).

    Returns (executed .ipynb, seconds, slowest cell's seconds). Raises CellTimedOut when a cell
    reaches timeout_s, NotebookFailed when a cell errors or the kernel dies, NotebookInterrupted on
    KeyboardInterrupt (the kernel killed, the files marked; see the module docstring)."""
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="k3lab-kernel-") as sockets:
        client = _client_class()(nb, socket_path=str(Path(sockets) / "k"), kernel_name="python3",
                                 timeout=timeout_s, iopub_timeout=IOPUB_TIMEOUT_S,
                                 raise_on_iopub_timeout=True, shutdown_kernel="immediate",
                                 resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except CellTimedOut:
            raise
        except CellTimeoutError as exc:
            raise CellTimedOut(f"a cell reached the timeout of {timeout_s} s\n{exc}") from None
        except CellExecutionError as exc:
            raise NotebookFailed(f"{exc.ename}: {exc.evalue}\n{exc}") from None
        except DeadKernelError as exc:
            raise NotebookFailed(f"the kernel died: {exc}") from None
        except KeyboardInterrupt:
            _kill_kernel(client)
            running = next(iter(client._started), None)  # the cell whose reply never came
            raise NotebookInterrupted(mark_interrupted(nb, running)) from None
        finally:
            _write_outputs(nb, path, Path(out_dir))
    slowest = max(client.cell_seconds.values(), default=0.0)
    return Path(out_dir) / path.name, time.perf_counter() - start, slowest
