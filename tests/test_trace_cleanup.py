"""Scratch traces leave nothing in the temp folder even when their process is killed: nbval (`make test`)
and Jupyter kill a notebook's kernel at shutdown, so no exit code runs there. A one-cell notebook under
pytest --nbval-lax captures with `profile.capture_diff` and `profile.capture` into the default folder;
once pytest has ended, no trace is left under its TMPDIR. What dead processes left in <tmp>/k3lab-traces
(pid folders, older versions' trace files there) is swept when a new scratch folder is made."""

import json
import os
import subprocess
import sys
import time

import pytest

from k3lab.profiling import capture

_CELL = """
import json, torch
from k3lab import profile
a = torch.ones(16, 16, device="cuda" if torch.cuda.is_available() else "cpu")  # a GPU capture needs kernels
d = profile.capture_diff(lambda: a @ a, lambda: a + a, steps=1)
c = profile.capture(lambda: a @ a, steps=1)
paths = [str(p) for p in d.paths.values()] + [str(c.trace_path)]
assert all(__import__("os").path.exists(p) for p in paths), paths
open({record!r}, "w").write(json.dumps(paths))
"""


def _traces(folder):
    return sorted(str(p) for p in folder.rglob("*.json"))


def test_a_killed_notebook_kernel_leaves_no_trace_in_the_temp_folder(tmp_path):
    pytest.importorskip("nbval")
    nbformat = pytest.importorskip("nbformat")
    tmp, record = tmp_path / "tmp", tmp_path / "paths.json"
    tmp.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell(_CELL.format(record=str(record))))
    nbformat.write(nb, tmp_path / "one_cell.ipynb")
    env = {k: v for k, v in os.environ.items() if k != "K3LAB_TRACE_DIR"}
    env["TMPDIR"] = str(tmp)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--nbval-lax", "--nbval-current-env",
                          "-p", "no:cacheprovider", "one_cell.ipynb"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    paths = json.loads(record.read_text())
    assert len(paths) == 3 and all(p.startswith(str(tmp / "k3lab-traces")) for p in paths), paths
    deadline = time.monotonic() + 20  # the watcher acts once the killed kernel's pipe closes
    while _traces(tmp) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _traces(tmp), f"traces left in the temp folder: {_traces(tmp)}"
    assert not (tmp / "k3lab-traces").exists()


def _reaped() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process
    return child.pid


def test_a_new_scratch_folder_sweeps_what_dead_processes_left(tmp_path, monkeypatch):
    """Made in a fresh temp folder, this process's scratch folder removes a dead process's pid folder and
    the trace files and rocprofv3 folder older versions wrote straight into k3lab-traces for a dead pid;
    a live process's pid folder and traces, other names, a digits-named file and a link stay."""
    root = tmp_path / "k3lab-traces"
    root.mkdir()
    dead = _reaped()
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        for pid in (dead, live.pid):
            (root / str(pid)).mkdir()
            (root / str(pid) / f"x-cpu-20261201-120000-{pid}-0.trace.json").write_text("{}")
            (root / f"diff_a-cpu-20261201-120000-{pid}-3.trace.json").write_text("{}")
            (root / f"step.v2-cuda-20261130-235959-{pid}-12.trace.json.gz").write_bytes(b"")
            (root / f"run-rocprofv3-20261130-235959-{pid}-1").mkdir()
            (root / f"run-rocprofv3-20261130-235959-{pid}-1" / "results.db").write_text("")
        # not k3lab's: other names, a file named with digits, a link to a folder, near-miss trace names
        keep = [root / "notes.txt", root / "cache", root / str(dead + 100000), root / str(dead + 200000),
                root / f"x-cpu-20261201-{dead}-0.trace.json", root / f"x-cpu-20261201-120000-{dead}-0.txt"]
        keep[0].write_text("x")
        keep[1].mkdir()
        keep[2].write_text("x")
        target = tmp_path / "elsewhere"
        target.mkdir()
        (target / "kept.json").write_text("{}")
        keep[3].symlink_to(target)
        keep[4].write_text("x")
        keep[5].write_text("x")
        before = set(root.iterdir())

        monkeypatch.setattr(capture.tempfile, "gettempdir", lambda: str(tmp_path))
        monkeypatch.setattr(capture, "_scratch", {})
        monkeypatch.delenv("K3LAB_TRACE_DIR", raising=False)
        mine = capture.default_trace_dir()
        assert mine == root / str(os.getpid()) and mine.is_dir()
        gone = before - set(root.iterdir())
        assert gone == {root / str(dead), root / f"diff_a-cpu-20261201-120000-{dead}-3.trace.json",
                        root / f"step.v2-cuda-20261130-235959-{dead}-12.trace.json.gz",
                        root / f"run-rocprofv3-20261130-235959-{dead}-1"}
        pid = live.pid  # a live process's folder and traces stay
        assert (root / str(pid) / f"x-cpu-20261201-120000-{pid}-0.trace.json").is_file()
        assert (root / f"diff_a-cpu-20261201-120000-{pid}-3.trace.json").is_file()
        assert (root / f"run-rocprofv3-20261130-235959-{pid}-1" / "results.db").is_file()
        assert all(p.exists() for p in keep) and (target / "kept.json").is_file()
        assert capture.sweep_scratch(root) == []  # nothing more to sweep; this process's folder stays
        assert mine.is_dir()
    finally:
        live.stdin.close()
        live.wait(timeout=10)
        entry = capture._scratch.get(os.getpid())
        if entry is not None and entry[1] is not None:  # let this test's watcher go now
            entry[1].stdin.close()
            entry[1].wait(timeout=10)
