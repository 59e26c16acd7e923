"""Scratch traces leave nothing in the temp folder even when their process is killed: nbval (`make test`)
and Jupyter kill a notebook's kernel at shutdown, so no exit code runs there. A one-cell notebook under
pytest --nbval-lax captures with `profile.capture_diff` and `profile.capture` into the default folder;
once pytest has ended, no trace is left under its TMPDIR."""

import json
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("nbval")
nbformat = pytest.importorskip("nbformat")

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
