"""Ctrl-C ends `k3lab report` within seconds: nothing queued starts, no kernel or worker is left, the
interrupted notebooks and the report say so, and the older report never looks current."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="finds the run's processes through /proc (Linux)")


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


def _tagged(mark: str) -> list[int]:
    """Live processes whose environment holds `mark` (the run's, its workers', their kernels')."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in env and state != "Z":
            found.append(int(entry))
    return found


def _wait(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.2)


def test_ctrl_c_ends_the_report_within_seconds_and_marks_what_it_stopped(tmp_path):
    src, out, flags = tmp_path / "nbs", tmp_path / "out", tmp_path / "flags"
    for d in (src, out, flags):
        d.mkdir()
    for stem in ("01_sleepy", "02_sleepy", "03_queued"):  # two run at a time: 03 waits for a free worker
        _notebook(src / f"{stem}.ipynb", f"open({str(flags / stem)!r}, 'w').close()\nprint('began')",
                  "import time\ntime.sleep(600)", "print('never')")
    (out / "report.html").write_text("<html>the previous run's report</html>")
    mark = f"k3lab-test-{uuid.uuid4().hex}"
    code = ("from pathlib import Path; from k3lab.report import build_report; "
            f"build_report(out=Path({str(out)!r}), run_studies=False, notebooks=Path({str(src)!r}), "
            "timeout_s=900, workers=2, tty=False)")
    log = tmp_path / "log.txt"
    with open(log, "w") as err:
        run = subprocess.Popen([sys.executable, "-c", code], stdout=err, stderr=err, start_new_session=True,
                               env={**os.environ, "K3LAB_TEST_MARK": mark})
    try:
        _wait(lambda: (flags / "01_sleepy").exists() and (flags / "02_sleepy").exists(), 600,
              f"both notebooks' first cells ({log.read_text()[-2000:]})")
        assert "not finished" in (out / "report.html").read_text()  # the old page no longer looks current
        time.sleep(1)  # each kernel is in its sleeping cell
        os.killpg(run.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        start = time.monotonic()
        rc = run.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    text = log.read_text()
    assert rc == 130 and took < 10, f"exit {rc} after {took:.1f} s\n{text[-3000:]}"
    try:  # SIGKILL is asynchronous: give the last ones a moment to go
        _wait(lambda: not _tagged(mark), 3, "the run's processes to end")
    except AssertionError:
        raise AssertionError(f"left running after Ctrl-C: {_tagged(mark)}") from None
    assert not (flags / "03_queued").exists() and "notebook 03_queued: started" not in text

    page = (out / "report.html").read_text()
    assert "<h1>k3lab report (interrupted)</h1>" in page and "Interrupted</b> (Ctrl-C)" in page
    assert "01_sleepy</a> (<a href=\"notebooks/01_sleepy.ipynb\">ipynb</a>): INTERRUPTED" in page
    assert "03_queued" in page and "NOT RUN: the report was interrupted before it started" in page
    assert (out / "report.previous.html").read_text() == "<html>the previous run's report</html>"
    for stem in ("01_sleepy", "02_sleepy"):
        ran = json.loads((out / "notebooks" / f"{stem}.ipynb").read_text())
        assert ran["metadata"]["k3lab"]["interrupted"] is True
        sources = ["".join(c["source"]) for c in ran["cells"]]
        assert "Interrupted run" in sources[0] and "Interrupted here" in sources[3]  # after the sleep
        assert "began" in json.dumps(ran["cells"][1]["outputs"])  # what finished is kept
        html_page = (out / "notebooks" / f"{stem}.html").read_text()
        assert "Interrupted run" in html_page and "Interrupted here" in html_page
    queued = json.loads((out / "notebooks" / "03_queued.ipynb").read_text())
    assert queued["metadata"]["k3lab"]["interrupted"] is True
    assert "before this notebook started" in (out / "notebooks" / "03_queued.html").read_text()
    timings = json.loads((out / "timings.json").read_text())
    assert timings["status"] == "interrupted"
    assert timings["interrupted"]["not_started"] == ["notebook:03_queued"]
    # (on a GPU machine the kernel-build step comes first and finished before the notebooks started)
    assert {k: v.get("status") for k, v in timings["steps"].items() if k.startswith("notebook:")} == {
        "notebook:01_sleepy": "interrupted", "notebook:02_sleepy": "interrupted"}


def test_ctrl_c_in_a_study_writes_an_interrupted_report_and_starts_nothing_more(tmp_path, monkeypatch):
    from k3lab import report
    from k3lab.report.sections import LiveRun

    src, out = tmp_path / "nbs", tmp_path / "out"
    src.mkdir()
    _notebook(src / "01_never.ipynb", "print('should not run')")
    out.mkdir()
    (out / "report.html").write_text("old")
    seen = []

    def run_study(name, *a, **k):  # the first study passes, Ctrl-C arrives in the second
        seen.append(name)
        if len(seen) == 2:
            raise KeyboardInterrupt
        return LiveRun(name, status="passed", seconds=0.1, form="quick")

    monkeypatch.setattr(report, "run_study", run_study)
    names = ["launch_overhead", "copy_removal", "kda_verify"]
    with pytest.raises(SystemExit) as exc:
        report.build_report(out=out, notebooks=src, studies=names, tty=False)
    assert exc.value.code == report.INTERRUPTED_EXIT == 130
    assert seen == names[:2]  # the third never started
    page = (out / "report.html").read_text()
    assert "<h1>k3lab report (interrupted)</h1>" in page and "while study copy_removal ran" in page
    assert "<li>launch_overhead: passed</li>" in page and "<li>copy_removal: INTERRUPTED</li>" in page
    assert "<li>kda_verify: not run (the report was interrupted)</li>" in page
    assert "01_never" in page and "NOT RUN" in page
    assert "before this notebook started" in (out / "notebooks" / "01_never.html").read_text()
    assert (out / "report.previous.html").read_text() == "old"
    timings = json.loads((out / "timings.json").read_text())
    assert timings["status"] == "interrupted" and timings["interrupted"]["while"] == "study copy_removal"
    assert timings["steps"]["study:copy_removal"]["status"] == "interrupted"
    assert "status" not in timings["steps"]["study:launch_overhead"]
    assert timings["interrupted"]["not_started"] == ["study:kda_verify", "notebook:01_never"]


def test_a_finished_report_is_complete_and_keeps_the_previous_one(tmp_path):
    from k3lab import report

    out = tmp_path / "out"
    out.mkdir()
    (out / "report.html").write_text("old")
    report.build_report(out=out, run_studies=False, run_notebooks=False, tty=False)
    assert "(interrupted)" not in (out / "report.html").read_text()
    assert "not finished" not in (out / "report.html").read_text()
    assert (out / "report.previous.html").read_text() == "old"
    assert json.loads((out / "timings.json").read_text())["status"] == "complete"
