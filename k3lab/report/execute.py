"""Execute notebooks headless for the report: one kernel per notebook, a per-cell timeout that fails.

`execute_notebook(path, out_dir, timeout_s)` runs every cell, writes the executed .ipynb and an .html
twin (`pages.export_html`: a page that opens offline, its widgets drawn), and returns (path written,
seconds, slowest cell's seconds). A cell that errors raises `NotebookFailed`; a cell that reaches the
per-cell timeout raises `CellTimedOut` (a timeout is always a failure, never a slow success); Ctrl-C
(KeyboardInterrupt, which the report's workers raise on their stop signal) kills the kernel's process
group and raises `NotebookInterrupted`. In all three the first line of the message names the cell that
stopped the run (its place among the code cells, its index in the file, its first source line) and
the reason, and the saved .ipynb and .html are marked (`mark_stopped`): a banner on top saying the same,
with the cell's first lines, and a marker right after that cell. Every file is written to a temp file
and renamed; the widget state of the cells that ran is saved whether or not the run finished.

Why a client of our own: nbclient mimics an ipywidgets `Output` for headless runs, and its mimic
echoes every captured output back to the kernel on the shell socket, from the task that reads iopub,
while another task of the same event loop waits on that shell socket for the cell's reply. Now and
then the reply's wake-up is lost in that overlap (the zmq socket's edge-triggered readiness), and the
client sits until its poll times out, then finds the reply and carries on as if nothing happened: an
explorer cell (interactive_output drawing into an Output) cost the full per-cell timeout about one run
in four. A headless run has no view to keep in sync with the kernel, so `_HeadlessOutput` keeps the
mimic (the outputs still land in the saved widget state) and drops the echo; nothing else sends on the
shell socket while a reply is awaited.
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

from k3lab.report.pages import drop_remote_scripts, export_html, math_to_mathml

__all__ = ["CELL_TIMEOUT_S", "PLOTLY_MIME", "CellTimedOut", "NotebookFailed", "NotebookInterrupted",
           "add_html_for_plotly", "drop_remote_scripts", "execute_notebook", "export_html",
           "mark_interrupted", "mark_stopped", "math_to_mathml"]

PLOTLY_MIME = "application/vnd.plotly.v1+json"
# The slowest cells of the suite take ~20-40 s on two busy CPU cores (a study's check-and-time cell);
# 240 s leaves a wide margin there and still ends a stall well inside `make run`'s budget.
CELL_TIMEOUT_S = 240
IOPUB_TIMEOUT_S = 30  # after a cell's reply, the rest of its output must arrive within this
SOURCE_LINES = 3  # the first lines of the stopping cell that its banner shows


class NotebookFailed(RuntimeError):
    """A notebook did not run to the end; the message's first line says where and why, in one line.
    `cell`: the cell that stopped it (`where`'s dict), None when no code cell was running."""

    def __init__(self, message: str, cell: dict | None = None):
        super().__init__(message)
        self.cell = cell


class CellTimedOut(NotebookFailed):
    """A cell reached the per-cell timeout."""


class NotebookInterrupted(NotebookFailed):
    """Ctrl-C (or the report's stop) ended the run; the saved notebook and page say so."""


INTERRUPTED_STYLE = "border:2px solid #b00;color:#b00;padding:6px 10px"
# how each kind of stop is titled on the page, and what its marker after the cell says
STOPS = {
    "interrupted": ("Interrupted run", "Interrupted here",
                    "this cell was running when the run was stopped, so its output above is partial, and no "
                    "cell below it ran."),
    "timeout": ("Timed out", "Timed out here",
                "this cell reached the per-cell timeout and was stopped, so its output above is partial, "
                "and no cell below it ran."),
    "failed": ("Failed run", "Failed here",
               "this cell raised the error shown above, and no cell below it ran."),
}


def banner(cell_id: str, title: str, text: str, code: str = "") -> dict:
    """A markdown cell (a plain dict, valid nbformat 4.5) that shows `title`: `text` in a red box, and
    `code` (lines of source) under it. One line of HTML: a blank line would end markdown's HTML block."""
    lines = "<br>".join(html.escape(ln) for ln in code.splitlines())
    shown = (f"<pre style='margin:6px 0 0;color:#333;white-space:pre-wrap'><code>{lines}</code></pre>"
             if lines else "")
    said = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))  # the cell's line, as code
    box = (f"<div id='{cell_id}' style='{INTERRUPTED_STYLE}'><b>{html.escape(title)}</b>: "
           f"{said}{shown}</div>")
    return {"cell_type": "markdown", "id": cell_id, "metadata": {}, "source": box}


def _source_head(cell) -> str:
    """The first SOURCE_LINES non-empty lines of a cell's source, each cut at 100 characters."""
    src = cell.get("source", "")
    text = "".join(src) if isinstance(src, list) else src
    lines = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    head = [ln if len(ln) <= 100 else ln[:99] + "\u2026" for ln in lines[:SOURCE_LINES]]
    return "\n".join(head + (["..."] if len(lines) > SOURCE_LINES else []))


def where(nb, index: int | None) -> dict | None:
    """The cell at file index `index` as the report names it: {'index', 'code_cell' (1-based place among
    the code cells), 'code_cells', 'id', 'source' (its first lines), 'text'}; None without a code cell."""
    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    if index not in code:
        return None
    head = _source_head(cells[index])
    first = head.splitlines()[0] if head else ""
    first = first if len(first) <= 60 else first[:59] + "\u2026"
    text = (f"code cell {code.index(index) + 1} of {len(code)} (index {index} in the file"
            + (f": `{first}`" if first else "") + ")")
    return {"index": index, "code_cell": code.index(index) + 1, "code_cells": len(code),
            "id": cells[index].get("id"), "source": head, "text": text}


def mark_stopped(nb, index: int | None, kind: str, why: str | None = None) -> str:
    """Mark `nb` (a notebook dict or NotebookNode, executed in place in part, or not at all) as a run that
    stopped (`kind`: 'interrupted', 'timeout' or 'failed') at the cell of file index `index` (None: before
    any code cell ran): metadata['k3lab'], a banner as its first cell naming the cell (`where`), its first
    lines and the reason (`why`, default: how far it ran), and, when the cell is known, a marker right
    after it. Returns the one-line reason the report shows: where it stopped, why, and how far it got."""
    if kind not in STOPS:
        raise ValueError(f"kind must be one of {', '.join(STOPS)}, got {kind!r}")
    cells = nb["cells"]
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"]
    done = sum(1 for i in code if i != index and cells[i].get("execution_count") is not None)
    cell = where(nb, index)
    ran = f"{done} of {len(code)} code cells ran before it"
    if cell is None:
        reason = why or ("stopped before its cells ran" if done == 0 else
                         f"stopped after {done} of {len(code)} code cells")
    else:
        default = {"interrupted": "was running when the run was stopped", "timeout": "reached the per-cell "
                   "timeout", "failed": "raised an error"}[kind]
        reason = f"{cell['text']} {why or default}; {ran}"
    title, here, here_text = STOPS[kind]
    nb["metadata"]["k3lab"] = {"stopped": kind, "interrupted": kind == "interrupted", "reason": reason,
                               "code_cells": len(code), "finished": done,
                               "cell": {k: v for k, v in cell.items() if k != "text"} if cell else None,
                               "running": cell["code_cell"] if cell else None}

    def node(c: dict):  # cell ids came with nbformat 4.5; a NotebookNode takes NotebookNode cells
        if nb.get("nbformat_minor", 0) < 5:
            c.pop("id")
        return c if type(nb) is dict else _node(c)

    if cell is not None:
        cells.insert(index + 1, node(banner("k3lab-stopped-here", here, here_text)))
    cells.insert(0, node(banner("k3lab-stopped", title, f"this page is not a complete run of the notebook: "
                                f"{reason}.", cell["source"] if cell else "")))
    return reason


def mark_interrupted(nb, running: int | None, why: str | None = None) -> str:
    """`mark_stopped` for Ctrl-C: `running` is the file index of the cell that was running (or None)."""
    return mark_stopped(nb, running, "interrupted", why)


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
            self.last: int | None = None  # the file index of the last cell that began
            self.on_cell_execute = self._cell_began
            self.on_cell_executed = self._cell_ended

        def create_kernel_manager(self):
            # local sockets, not TCP: nothing listens on the network, and the kernel has no reason to warn
            self.km = AsyncKernelManager(kernel_name=self.kernel_name or "python3", transport="ipc",
                                         ip=self.socket_path)
            return self.km

        def _cell_began(self, cell, cell_index):
            self._started[cell_index] = time.perf_counter()
            self.last = cell_index

        def _cell_ended(self, cell, cell_index, execute_reply):
            seconds = time.perf_counter() - self._started.pop(cell_index, time.perf_counter())
            self.cell_seconds[cell_index] = seconds
            # nbclient's poll returns a reply it finds when its timeout fires as if it were on time
            if self.timeout and seconds >= self.timeout:
                raise CellTimedOut(f"cell {cell_index} reached the per-cell timeout of {self.timeout} s")

        def stopped_cell_seconds(self) -> None:
            """The seconds of a cell that never got its reply (timed out, interrupted), so far."""
            for index, began in self._started.items():
                self.cell_seconds[index] = time.perf_counter() - began

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


def _write_outputs(nb, path: Path, out_dir: Path) -> None:
    import nbformat

    from k3lab.files import write_atomic

    add_html_for_plotly(nb)
    text = nbformat.writes(nb)
    write_atomic(out_dir / path.name, text if text.endswith("\n") else text + "\n")
    write_atomic(out_dir / path.with_suffix(".html").name, export_html(nb))


def _first_line(text: str) -> str:
    line = (str(text).strip().splitlines() or [""])[0]
    return line if len(line) <= 200 else line[:199] + "\u2026"


def execute_notebook(path: Path, out_dir: Path, timeout_s: int = CELL_TIMEOUT_S,
                     cell_seconds: dict | None = None) -> tuple[Path, float, float]:
    """Execute one notebook into out_dir (.ipynb and .html, written even when a cell fails).

    Returns (executed .ipynb, seconds, slowest cell's seconds). Raises CellTimedOut when a cell
    reaches timeout_s, NotebookFailed when a cell errors or the kernel dies, NotebookInterrupted on
    KeyboardInterrupt (the kernel killed); each names the cell and the reason, and the files are marked
    (module docstring). cell_seconds, when given, is filled with each code cell's seconds by its cell id
    (its file index as text where it has none; a stopped cell's seconds so far), whether or not the run
    finished."""
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    ids = [c.get("id") or str(i) for i, c in enumerate(nb.cells)]  # before a banner shifts the cells
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="k3lab-kernel-") as sockets:
        client = _client_class()(nb, socket_path=str(Path(sockets) / "k"), kernel_name="python3",
                                 timeout=timeout_s, iopub_timeout=IOPUB_TIMEOUT_S,
                                 raise_on_iopub_timeout=True, shutdown_kernel="immediate",
                                 resources={"metadata": {"path": str(path.parent)}})
        timeout = f"reached the per-cell timeout of {timeout_s:g} s"
        try:
            client.execute()
        except (CellTimedOut, CellTimeoutError) as exc:
            cell = where(nb, client.last)
            raise CellTimedOut(mark_stopped(nb, client.last, "timeout", timeout) + f"\n{exc}", cell) from None
        except CellExecutionError as exc:
            cell, why = where(nb, client.last), f"raised {exc.ename}: {_first_line(exc.evalue)}"
            raise NotebookFailed(mark_stopped(nb, client.last, "failed", why) + f"\n{exc}", cell) from None
        except DeadKernelError as exc:
            cell, why = where(nb, client.last), f"was running when the kernel died ({_first_line(exc)})"
            raise NotebookFailed(mark_stopped(nb, client.last, "failed", why), cell) from None
        except KeyboardInterrupt:
            _kill_kernel(client)
            running = next(iter(client._started), None)  # the cell whose reply never came
            cell = where(nb, running)
            raise NotebookInterrupted(mark_interrupted(nb, running), cell) from None
        finally:
            client.stopped_cell_seconds()
            if cell_seconds is not None:
                cell_seconds.update({ids[i]: sec for i, sec in client.cell_seconds.items()})
            client.set_widgets_metadata()  # nbclient saves it only at the end of a whole run
            _write_outputs(nb, path, Path(out_dir))
    slowest = max(client.cell_seconds.values(), default=0.0)
    return Path(out_dir) / path.name, time.perf_counter() - start, slowest
