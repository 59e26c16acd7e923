"""The report's notebook workers: one process per notebook, started in file order `workers` at a time,
each leading a session of its own; Ctrl-C stops them all within seconds.

Why not a process pool: a pool's shutdown lets every queued task start and run to its end, and a
terminal's Ctrl-C reaches every process of the terminal's group at once, each acting on its own (a
kernel takes it as an error in its cell, and the worker then starts the next notebook). Here only the
report's process sees Ctrl-C: every worker leads its own session, and jupyter_client starts every kernel
in a session of its own. On KeyboardInterrupt `run_notebooks` starts nothing more and sends STOP (SIGUSR1)
to the running workers; each one kills its kernel's process group, marks its notebook interrupted
(`execute.mark_interrupted`) and writes the .ipynb and .html. (Not SIGINT or SIGTERM: nbclient takes
those two for itself while a notebook runs, shuts the kernel down and carries on as if it had died.)
After GRACE_S whatever is left of each
worker's process tree gets SIGKILL, process group by process group (`kill_tree`, which reads /proc;
without /proc, the worker's own group). A notebook that never started, or whose worker died before
writing, gets a short page saying so (`placeholder`), so no page of an earlier run looks current.

A worker ends with the report too: it asks the kernel for STOP when its parent dies (Linux prctl), and
gives up at once when its parent is no longer the process that started it.

`python -m k3lab.report.workers NOTEBOOK OUT_DIR TIMEOUT_S RESULT PARENT_PID` runs one worker: it
writes its `Outcome` as JSON to RESULT and exits 0, or 130 when it was interrupted.
"""

from __future__ import annotations

import ctypes
import dataclasses
import html
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

GRACE_S = 5.0  # a stopped worker's time to kill its kernel and write its page, before SIGKILL
STOP = getattr(signal, "SIGUSR1", signal.SIGTERM)  # what asks a worker to stop (module docstring)
STATUSES = ("passed", "failed", "timeout", "interrupted", "not started")


@dataclass
class Outcome:
    """How one notebook's run ended: status (one of STATUSES), its seconds and slowest cell's, the
    first line of why it did not pass (the cell that stopped it and the reason), whether its page was
    written, the stopping cell (`execute.where`'s dict, None when none was running) and each code
    cell's seconds as [cell id, seconds] pairs, in the order they ran."""

    status: str
    seconds: float = 0.0
    slowest: float = 0.0
    message: str = ""
    page: bool = False
    cell: dict | None = None
    cells: list = field(default_factory=list)
    gpu_peak_gib: float | None = None
    rerun_alone: list = field(default_factory=list)


# -- processes -------------------------------------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, process group, start time in clock ticks) of every process /proc shows
    ({} without /proc)."""
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if fields[0] != b"Z":  # a zombie has ended already; only its parent's wait is left
            table[int(entry)] = (int(fields[1]), int(fields[2]), int(fields[19]))
    return table


def descendants(pid: int, since: int | None = None) -> list[int]:
    """The live processes below `pid` (children, theirs, ...); with `since`, only those started at or
    after that /proc start time (clock ticks since boot, `start_ticks`)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return [p for p in found if since is None or table[p][2] >= since]


def start_ticks(pid: int | None = None) -> int | None:
    """When `pid` (default: this process) started, in /proc's clock ticks since boot (None without)."""
    entry = _proc_table().get(os.getpid() if pid is None else pid)
    return entry[2] if entry else None


def kill_tree(pids: list[int]) -> None:
    """SIGKILL to each process in `pids` and to each of their process groups, this process's own
    group left out (so a tree is ended with what its members started in their groups)."""
    own = os.getpgrp() if hasattr(os, "getpgrp") else None
    groups = set()
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except (OSError, AttributeError):
            pass
    for g in groups - {own}:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# -- the parent's side -----------------------------------------------------------------------------

@dataclass
class _Running:
    proc: subprocess.Popen
    result: Path


def _start(path: Path, out_dir: Path, timeout_s: int, result: Path) -> _Running:
    cmd = [sys.executable, "-m", "k3lab.report.workers", str(path), str(out_dir), str(timeout_s),
           str(result), str(os.getpid())]
    return _Running(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True), result)


def _outcome(w: _Running, interrupted: bool = False) -> Outcome:
    """The worker's result; without one, 'interrupted' after a stop, else 'failed' with its exit."""
    try:
        return Outcome(**json.loads(w.result.read_text()))
    except (OSError, ValueError, TypeError):
        code = w.proc.returncode
        why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        if interrupted:
            return Outcome("interrupted", message=f"stopped before its page could be written ({why})")
        return Outcome("failed", message=f"the worker ended without a result ({why})")


def placeholder(path: Path, out_dir: Path, reason: str) -> None:
    """Write out_dir's .ipynb and .html of `path` as a notebook that did not run to its end: its source
    with the interrupted banner (`execute.mark_interrupted`) and a plain page that says `reason`. Plain
    JSON, no nbformat: importing it costs seconds (jsonschema's format checkers) that Ctrl-C cannot wait."""
    from k3lab.files import write_atomic
    from k3lab.report.execute import INTERRUPTED_STYLE, mark_interrupted

    path = Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    mark_interrupted(nb, None, why=reason)
    write_atomic(out_dir / path.name, json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    write_atomic(out_dir / path.with_suffix(".html").name,
                 f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(path.stem)}</title>"
                 f"</head><body><h1>{html.escape(path.stem)}</h1><p style=\"{INTERRUPTED_STYLE}\">"
                 f"<b>Not a complete run</b>: {html.escape(reason)}.</p><p>Its source: "
                 f"<a href='{html.escape(path.name)}'>{html.escape(path.name)}</a>.</p></body></html>\n")


def _stop(running: dict[Path, _Running], grace_s: float) -> None:
    """STOP to each running worker, up to grace_s for them to end (a second Ctrl-C cuts it short), then
    SIGKILL to what is left of their trees (as seen before the STOP, and after)."""
    trees = {p: [w.proc.pid, *descendants(w.proc.pid)] for p, w in running.items()}
    for w in running.values():
        try:
            w.proc.send_signal(STOP)
        except OSError:
            pass  # ended already
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline and any(w.proc.poll() is None for w in running.values()):
            time.sleep(0.05)
    except KeyboardInterrupt:
        pass
    for p, w in running.items():
        kill_tree(trees[p] + descendants(w.proc.pid))
        w.proc.wait()


def out_of_memory(got: Outcome) -> bool:
    """Whether a notebook failed for want of GPU memory (torch's OutOfMemoryError in its message)."""
    return got.status == "failed" and ("OutOfMemoryError" in got.message or "out of memory" in got.message)


def run_notebooks(paths: list[Path], out_dir: Path, timeout_s: int, workers: int,
                  started: Callable[[Path], None] | None = None,
                  ended: Callable[[Path, Outcome], None] | None = None,
                  grace_s: float = GRACE_S, memory: tuple[dict, float] | None = None,
                  retried: Callable[[Path, Outcome], None] | None = None) -> tuple[dict[Path, Outcome], bool]:
    """Execute `paths` into out_dir, up to `workers` at a time in the order given; started(path) as each
    worker starts, ended(path, outcome) as each ends (interrupted ones included). Returns (outcome per
    path, whether Ctrl-C stopped the run); a KeyboardInterrupt here stops the run (module docstring) and
    does not propagate.

    GPU memory. memory = (peaks, room_gib): each notebook's expected peak in GiB (its last measured
    `Outcome.gpu_peak_gib`; one without a figure counts 0) and the GiB the notebooks share. A notebook
    starts only while the running ones' peaks and its own fit in room_gib (the first in order that fits;
    with none running, the next in order starts whatever its peak). A notebook that fails for want of
    GPU memory (`out_of_memory`) while others ran beside it is not a result: it goes back to the end of
    the queue and reruns alone (nothing else starts while it runs), retried(path, outcome) says so, and
    its final outcome names them (`rerun_alone`). A second failure is its result."""
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    peaks, room = memory if memory is not None else ({}, None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    queue, running, outcomes = [Path(p) for p in paths], {}, {}
    beside: dict[Path, set] = {}   # the notebooks that ran at some time during each running one
    alone: dict[Path, list] = {}   # notebook -> what it ran out of memory beside, for its rerun alone

    def fits(p: Path) -> bool:
        if not running:
            return True
        if p in alone or running.keys() & alone.keys():
            return False
        return room is None or sum(peaks.get(q, 0.0) for q in running) + peaks.get(p, 0.0) <= room

    with tempfile.TemporaryDirectory(prefix="k3lab-report-") as tmp:
        try:
            n_started = 0
            while queue or running:
                while queue and len(running) < workers:
                    p = next((q for q in queue if fits(q)), None)
                    if p is None:
                        break
                    n_started += 1
                    for q in running:
                        beside[q].add(p)
                    beside[p] = set(running)
                    running[p] = _start(p, out_dir, timeout_s, Path(tmp) / f"{n_started}.json")
                    queue.remove(p)
                    if started is not None:
                        started(p)
                for p, w in list(running.items()):
                    if w.proc.poll() is not None:
                        got = _outcome(running.pop(p))
                        if p not in alone and beside[p] and out_of_memory(got):
                            alone[p] = got.rerun_alone = sorted(q.stem for q in beside[p])
                            queue.append(p)
                            if retried is not None:
                                retried(p, got)
                            continue
                        got.rerun_alone = alone.get(p, [])
                        outcomes[p] = got
                        if ended is not None:
                            ended(p, outcomes[p])
                time.sleep(0.1)
            return outcomes, False
        except KeyboardInterrupt:
            _stop(running, grace_s)
            for p, w in running.items():
                got = _outcome(w, interrupted=True)  # one that ended just before the stop keeps its result
                if not got.page:
                    placeholder(p, out_dir, f"the report was interrupted while it ran ({got.message})")
                outcomes[p] = got
                if ended is not None:
                    ended(p, got)
            for p in queue:
                placeholder(p, out_dir, "the report was interrupted before this notebook started")
                outcomes[p] = Outcome("not started", message="the report was interrupted before it started")
            return outcomes, True


# -- the worker's side -----------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent: int) -> None:
    """STOP to this process when its parent dies (Linux); exit now if it has died already."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, STOP, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(130)


def _interrupt(signum, frame) -> None:
    """Stop once: a later STOP is ignored while the kernel is killed and the page written."""
    signal.signal(STOP, signal.SIG_IGN)
    raise KeyboardInterrupt


def _warm_up() -> None:
    """Export a two-cell notebook, so that an interrupted run writes its page at once: the first export
    of a process loads nbconvert's templates and the formula renderer (seconds), the next take little."""
    import nbformat

    from k3lab.report.execute import export_html

    export_html(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("$x$"),
                                                nbformat.v4.new_code_cell("1")]))


def run_one(path: Path, out_dir: Path, timeout_s: int) -> Outcome:
    """execute_notebook's result or failure as an Outcome (never raises for the notebook's sake)."""
    from k3lab.report.execute import CellTimedOut, NotebookFailed, NotebookInterrupted, execute_notebook

    def first(exc: BaseException) -> str:
        return (str(exc).splitlines() or [type(exc).__name__])[0]

    timings: dict[str, float] = {}

    def cells() -> list:
        return [[cell_id, round(s, 2)] for cell_id, s in timings.items()]

    def stopped(status: str, exc: NotebookFailed) -> Outcome:
        return Outcome(status, message=first(exc), page=True, cell=exc.cell, cells=cells())

    try:
        _, seconds, slowest = execute_notebook(path, out_dir, timeout_s, cell_seconds=timings)
        return Outcome("passed", seconds, slowest, page=True, cells=cells())
    except NotebookInterrupted as exc:
        return stopped("interrupted", exc)
    except CellTimedOut as exc:
        return stopped("timeout", exc)
    except NotebookFailed as exc:
        return stopped("failed", exc)
    except KeyboardInterrupt:
        return Outcome("interrupted", message="stopped before its first cell ran")
    except Exception as exc:  # noqa: BLE001 - a broken notebook file, nbconvert: one line too
        return Outcome("failed", message=f"{type(exc).__name__}: {first(exc)}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 5:
        print("usage: python -m k3lab.report.workers NOTEBOOK OUT_DIR TIMEOUT_S RESULT PARENT_PID",
              file=sys.stderr)
        return 2
    from k3lab._cells import PEAK_ENV, read_peak

    signal.signal(STOP, _interrupt)
    _end_with_parent(int(args[4]))
    result = Path(args[3])  # in the parent's private temp folder: written whole, then renamed
    os.environ[PEAK_ENV] = str(result.with_suffix(".peak"))  # the kernel inherits it (k3lab._cells)
    try:
        _warm_up()
        outcome = run_one(Path(args[0]), Path(args[1]), int(args[2]))
    except KeyboardInterrupt:
        outcome = Outcome("interrupted", message="stopped before its first cell ran")
    outcome.gpu_peak_gib = read_peak(result.with_suffix(".peak"))
    result.with_suffix(".tmp").write_text(json.dumps(dataclasses.asdict(outcome)), encoding="utf-8")
    os.replace(result.with_suffix(".tmp"), result)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if outcome.status == "interrupted" else 0)  # nothing left to clean: the kernel is gone


if __name__ == "__main__":
    sys.exit(main())
