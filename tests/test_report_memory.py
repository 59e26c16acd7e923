"""The report's notebooks share a GPU's memory: each kernel notes its peak (k3lab._cells), the timings keep
it, the next run starts no notebook its neighbours' peaks leave no room for, and a notebook that runs out
of GPU memory beside others runs again alone, said in the log and the timings. Real workers and kernels
run tiny notebooks here (a CPU is enough: the peaks are given, the out-of-memory error is raised)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from k3lab import _cells
from k3lab.report import eta
from k3lab.report import workers as pool


def _notebook(path: Path, *sources: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def _span(flags: Path, stem: str, seconds: float) -> str:
    """A cell that writes its start and end times to flags/<stem>.json, sleeping `seconds` between."""
    return (f"import json, time\nt0 = time.time()\ntime.sleep({seconds})\n"
            f"open({str(flags / stem)!r} + '.json', 'w').write(json.dumps([t0, time.time()]))")


def _overlap(flags: Path, a: str, b: str) -> bool:
    (a0, a1), (b0, b1) = (json.loads((flags / f"{s}.json").read_text()) for s in (a, b))
    return a0 < b1 and b0 < a1


def test_no_notebook_starts_where_its_neighbours_peaks_leave_no_room(tmp_path):
    flags, out = tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    paths = [_notebook(tmp_path / f"{s}.ipynb", _span(flags, s, 6)) for s in ("big_a", "big_b", "small")]
    peaks = dict(zip(paths, (6.0, 6.0, 1.0)))
    got, stopped = pool.run_notebooks(paths, out, 120, 3, memory=(peaks, 10.0))
    assert not stopped and all(o.status == "passed" for o in got.values()), got
    assert not _overlap(flags, "big_a", "big_b")  # 6 + 6 > 10: the second waited
    assert _overlap(flags, "big_a", "small")      # 6 + 1 fits: the third in order started beside it
    assert all(o.gpu_peak_gib is None for o in got.values())  # no kernel used a GPU


def test_without_a_memory_plan_the_workers_alone_bound_it(tmp_path):
    flags, out = tmp_path / "flags", tmp_path / "out"
    flags.mkdir()
    paths = [_notebook(tmp_path / f"{s}.ipynb", _span(flags, s, 6)) for s in ("big_a", "big_b")]
    got, _ = pool.run_notebooks(paths, out, 120, 2)
    assert all(o.status == "passed" for o in got.values()) and _overlap(flags, "big_a", "big_b")


def test_out_of_memory_beside_others_reruns_alone_and_says_so(tmp_path):
    busy, out = tmp_path / "busy", tmp_path / "out"
    hog = _notebook(tmp_path / "01_hog.ipynb", f"import time, pathlib\np = pathlib.Path({str(busy)!r})\n"
                    "p.touch()\ntime.sleep(10)\np.unlink()")
    oom = ("import pathlib, time, torch\ntime.sleep(2)\n"
           f"if pathlib.Path({str(busy)!r}).exists():\n"
           "    raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 3 GiB (planted)')\n"
           "print('ran')")
    victim = _notebook(tmp_path / "02_victim.ipynb", oom)
    retried = []
    got, _ = pool.run_notebooks([hog, victim], out, 120, 2, retried=lambda p, o: retried.append((p, o)))
    assert [(p.stem, o.status, o.rerun_alone) for p, o in retried] == [("02_victim", "failed", ["01_hog"])]
    assert "OutOfMemoryError" in retried[0][1].message
    assert got[victim].status == "passed" and got[victim].rerun_alone == ["01_hog"]
    assert got[hog].status == "passed" and got[hog].rerun_alone == []


def test_out_of_memory_alone_is_a_result(tmp_path):
    oom = "import torch\nraise torch.cuda.OutOfMemoryError('CUDA out of memory (planted)')"
    nb = _notebook(tmp_path / "03_alone.ipynb", oom)
    retried = []
    got, _ = pool.run_notebooks([nb], tmp_path / "out", 120, 2, retried=lambda p, o: retried.append(p))
    assert retried == [] and got[nb].status == "failed" and pool.out_of_memory(got[nb])
    assert not pool.out_of_memory(pool.Outcome("failed", message="ValueError: bad input"))
    assert not pool.out_of_memory(pool.Outcome("passed", message="OutOfMemoryError in a printed table"))


def test_a_kernel_notes_its_peak_where_the_worker_asks(tmp_path, monkeypatch):
    monkeypatch.delenv(_cells.PEAK_ENV, raising=False)
    _cells.note_peak(3 << 30)  # unset: nothing is written anywhere
    target = tmp_path / "peak"
    monkeypatch.setenv(_cells.PEAK_ENV, str(target))
    _cells.note_peak(3 << 30)
    assert _cells.read_peak(target) == pytest.approx(3 + _cells.CONTEXT_GIB)
    assert _cells.read_peak(tmp_path / "absent") is None
    target.write_text("not a number")
    assert _cells.read_peak(target) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a kernel's GPU peak needs a GPU")
def test_a_notebook_on_the_gpu_reports_its_peak(tmp_path):
    nb = _notebook(tmp_path / "gpu.ipynb", "import torch, k3lab\nx = torch.empty(1 << 30, dtype=torch.uint8, "
                   "device='cuda')\ndel x", "print('after the cache went back')")
    got, _ = pool.run_notebooks([nb], tmp_path / "out", 300, 1)
    assert got[nb].status == "passed" and got[nb].gpu_peak_gib >= 1.0 + _cells.CONTEXT_GIB


def test_the_timings_keep_each_peak_and_the_next_run_reads_them(tmp_path):
    path = tmp_path / "timings.json"
    path.write_text(json.dumps({"steps": {"notebook:08_all": {"seconds": 9, "gpu_peak_gib": 48.2},
                                          "notebook:00_a": {"seconds": 3},
                                          "notebook:01_b": {"seconds": 3, "gpu_peak_gib": "48"},
                                          "notebook:02_c": {"seconds": 3, "gpu_peak_gib": float("nan")},
                                          "study:dcp": {"seconds": 12}}}))
    assert eta.measured_peaks(path) == {"notebook:08_all": 48.2}
    assert eta.measured_peaks(None) == {} and eta.measured_peaks(tmp_path / "absent.json") == {}
    path.write_text("[1, 2]")
    assert eta.measured_peaks(path) == {}


def test_a_worker_writes_the_peak_its_kernel_noted(tmp_path):
    """The worker's process passes its peak file to the kernel by the environment and reads it back."""
    cell = f"import os\nopen(os.environ[{_cells.PEAK_ENV!r}], 'w').write('7.5')"
    nb = _notebook(tmp_path / "n.ipynb", cell)
    result = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "k3lab.report.workers", str(nb), str(tmp_path / "out"), "120",
                    str(result), str(os.getpid())], check=True, timeout=180)
    assert json.loads(result.read_text())["gpu_peak_gib"] == 7.5


def test_the_timings_keep_the_peak_and_a_rerun_s_own_seconds(tmp_path):
    from k3lab import report

    plan = eta.Plan(workers=2)
    for key in ("notebook:04_x", "notebook:08_y"):
        plan.add(key, 30.0, parallel=True)
        plan.start(key, 100.0)
        plan.finish(key, 190.0)  # 04's step spans its failed try, the wait and the rerun
    outcomes = {"04_x": pool.Outcome("passed", seconds=41.0, gpu_peak_gib=3.5, rerun_alone=["08_y"]),
                "08_y": pool.Outcome("passed", seconds=90.0, gpu_peak_gib=48.2)}
    report._write_timings(tmp_path, plan, "gpu", "quick", 200.0, notebooks=outcomes)
    steps = json.loads((tmp_path / "timings.json").read_text())["steps"]
    assert steps["notebook:04_x"]["seconds"] == 41.0 and steps["notebook:08_y"]["seconds"] == 90.0
    assert steps["notebook:04_x"]["rerun_alone_after_running_out_of_memory_beside"] == ["08_y"]
    assert eta.measured_peaks(tmp_path / "timings.json") == {"notebook:04_x": 3.5, "notebook:08_y": 48.2}


def _one_step_plan(key: str, seconds: float) -> eta.Plan:
    plan = eta.Plan(workers=1)
    plan.add(key, 5.0)
    plan.start(key, 100.0)
    plan.finish(key, 100.0 + seconds)
    return plan


def test_the_two_halves_in_one_folder_leave_one_timings_file(tmp_path):
    """--skip-notebooks then --skip-studies with one --out: the second timings.json holds the first's study
    steps too, named as carried; a file of another machine kind, form or an interrupted run carries
    nothing, and a half that ran is never replaced by the earlier file's."""
    from k3lab import report

    path = tmp_path / "timings.json"
    report._write_timings(tmp_path, _one_step_plan("study:kda_scan", 7.0), "cpu", "quick", 8.0,
                          skipped="notebook:")
    first = json.loads(path.read_text())
    assert set(first["steps"]) == {"study:kda_scan"} and "carried" not in first
    report._write_timings(tmp_path, _one_step_plan("notebook:05_kda_scan", 42.0), "cpu", "quick", 43.0,
                          skipped="study:")
    both = json.loads(path.read_text())
    assert both["steps"]["study:kda_scan"]["seconds"] == 7.0
    assert both["steps"]["notebook:05_kda_scan"]["seconds"] == 42.0 and both["total_s"] == 43.0
    assert both["carried"]["steps"] == ["study:kda_scan"] and both["carried"]["total_s"] == 8.0
    measured, source = eta.measured_seconds(eta.machine_kind("cpu"), "quick", [path])
    assert measured == {"study:kda_scan": 7.0, "notebook:05_kda_scan": 42.0} and source == path
    # the notebooks again, alone: the studies carried again, the notebook step this run's own
    report._write_timings(tmp_path, _one_step_plan("notebook:05_kda_scan", 40.0), "cpu", "quick", 41.0,
                          skipped="study:")
    again = json.loads(path.read_text())["steps"]
    assert again["notebook:05_kda_scan"]["seconds"] == 40.0 and again["study:kda_scan"]["seconds"] == 7.0
    for change in ({"form": "full"}, {"status": "interrupted"},
                   {"machine_kind": {**eta.machine_kind("cpu"), "cpus": 999}}):
        path.write_text(json.dumps({**first, **change}))
        report._write_timings(tmp_path, _one_step_plan("notebook:05_kda_scan", 42.0), "cpu", "quick", 43.0,
                              skipped="study:")
        kept = json.loads(path.read_text())
        assert set(kept["steps"]) == {"notebook:05_kda_scan"} and "carried" not in kept, change
    path.write_text("not json")
    report._write_timings(tmp_path, _one_step_plan("study:kda_scan", 7.0), "cpu", "quick", 8.0,
                          skipped="notebook:")
    assert set(json.loads(path.read_text())["steps"]) == {"study:kda_scan"}
