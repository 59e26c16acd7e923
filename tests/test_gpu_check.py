"""scripts/gpu_check.py: its choice of pytest-xdist workers from the GPU's free memory and the CPU count
(at the machines' own figures: torch.cuda.mem_get_info's free bytes on an idle card) and its refusals;
the split of the suite's files into shards (each file in one, the same every time, of similar expected
time), a shard's run and a run stopped at its time limit (serial, and with workers: which files
finished, the failures in those that did not), and the merge of shard records into one."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

GIB = 2 ** 30
H100_FREE, H200_FREE = int(79.1 * GIB), int(139.8 * GIB)  # idle: 81,559 and 143,771 MiB cards


@pytest.mark.parametrize("free, cpus, want", [
    (H100_FREE, 16, 5),  # the H100: a 49 GiB notebook cell beside 4 workers of 7 GiB fits, beside 5 not
    (H200_FREE, 16, 8),  # the H200: within memory with 8 and 12; half its 16 cores
    (H200_FREE, 64, 9),  # more cores do not raise it past the memory (140 GiB / 15)
    (H100_FREE, 4, 2),  # fewer cores lower it
    (int(14.9 * GIB), 16, 1),  # a nearly full card still runs, on one worker
    (0, 16, 1),
    (None, 16, 1),  # no GPU: as make test runs
    (H200_FREE, 1, 1),
    (H200_FREE, None, 1),  # CPU count unknown: taken as 2
])
def test_workers_fit_the_gpu_memory_and_half_the_cpus(free, cpus, want):
    n, why = gpu_check.choose_workers(free, cpus)
    assert n == want, why
    assert (f"so {want}" in why) if free is not None else ("no GPU" in why)


def test_twelve_workers_fit_neither_card_at_the_measured_figure():
    """The figure is safe where the H100 failed: 12 workers never come out of the H100's memory, and
    a per-worker figure of the H100's own failure (79 GiB / 12) would have allowed it."""
    assert gpu_check.choose_workers(H100_FREE, 128)[0] < 12
    assert gpu_check.choose_workers(H100_FREE, 128, per_worker_bytes=H100_FREE // 12)[0] == 12
    assert gpu_check.PER_WORKER_BYTES * 12 > H100_FREE


@pytest.mark.parametrize("kwargs, name", [
    (dict(free_bytes=-1, cpu_count=8), "free_bytes"),
    (dict(free_bytes=1.5 * GIB, cpu_count=8), "free_bytes"),
    (dict(free_bytes=True, cpu_count=8), "free_bytes"),
    (dict(free_bytes=GIB, cpu_count=0), "cpu_count"),
    (dict(free_bytes=GIB, cpu_count=8, per_worker_bytes=0), "per_worker_bytes"),
    (dict(free_bytes=GIB, cpu_count=8, per_worker_bytes=None), "per_worker_bytes"),
])
def test_bad_figures_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be an int"):
        gpu_check.choose_workers(**kwargs)


def test_workers_option_overrides_and_refuses_zero(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(gpu_check, "run_pytest", lambda cmd, env, stop: (seen.append(cmd) or 0, None))
    monkeypatch.setattr(gpu_check, "gpu_free_bytes", lambda: H200_FREE)
    monkeypatch.setattr(gpu_check.os, "cpu_count", lambda: 16)
    assert gpu_check.main([str(tmp_path), "--label", "x", "tests/test_config.py"]) == 0
    assert seen[-1][seen[-1].index("-n") + 1] == "8"  # chosen
    assert gpu_check.main([str(tmp_path), "--label", "y", "--workers", "1", "tests/test_config.py"]) == 0
    assert "-n" not in seen[-1]  # one worker: no xdist, as make test
    assert gpu_check.main([str(tmp_path), "--label", "z", "--workers", "3", "tests/test_config.py"]) == 0
    assert seen[-1][seen[-1].index("-n") + 1] == "3"
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--workers", "0"])
    assert "--workers must be >= 1" in capsys.readouterr().err


# ------------------------------------------------------------------------ shards

def _suite() -> list[str]:
    """The tree's suite now (read in each test: files may come while the run goes on)."""
    return gpu_check.suite_files(gpu_check.DEFAULT_ARGS, ROOT)


def test_the_suite_is_every_test_file_and_notebook():
    suite = _suite()
    tests = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    notebooks = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert suite == sorted(tests + notebooks) and len(notebooks) >= 12 and len(tests) >= 90


def test_suite_files_takes_what_pytest_collects_and_no_more(tmp_path):
    for rel in ("tests/test_a.py", "tests/helper.py", "tests/conftest.py", "tests/sub/test_b.py",
                "tests/sub/c_test.py", "tests/.hidden/test_c.py", "tests/__pycache__/test_d.py",
                "notebooks/x.ipynb", "notebooks/.ipynb_checkpoints/x-checkpoint.ipynb", "other/test_e.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    got = gpu_check.suite_files(["tests", "notebooks", "--nbval-lax", "other/test_e.py::test_one"], tmp_path)
    assert got == ["notebooks/x.ipynb", "other/test_e.py", "tests/sub/c_test.py", "tests/sub/test_b.py",
                   "tests/test_a.py"]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_every_file_is_in_exactly_one_shard_and_the_split_is_always_the_same(n):
    suite = _suite()
    cost, unit = gpu_check.weights(suite, ROOT)
    assert unit == "bytes" and set(cost) == set(suite)
    groups = gpu_check.split(cost, n)
    flat = [f for g in groups for f in g]
    assert len(groups) == n and sorted(flat) == suite and len(flat) == len(set(flat))
    shuffled = list(cost.items())
    random.Random(n).shuffle(shuffled)
    assert gpu_check.split(dict(shuffled), n) == groups  # the order files come in does not matter
    loads = [sum(cost[f] for f in g) for g in groups]
    assert max(loads) <= sum(loads) / n + max(cost.values())  # greedy's bound: within one file of even


def test_recorded_seconds_weigh_the_files_and_unknown_ones_scale_by_size(tmp_path):
    for name, size in (("a", 100), ("b", 100), ("c", 300), ("d", 100)):
        (tmp_path / f"test_{name}.py").write_text("x" * size)
    files = [f"test_{n}.py" for n in "abcd"]
    record = tmp_path / "gpu_check_serial.json"
    record.write_text(json.dumps({"file_seconds": {"test_a.py": 90.0, "test_b.py": 10.0, "gone.py": 5.0}}))
    cost, unit = gpu_check.weights(files, tmp_path, gpu_check.read_durations([record]))
    assert unit == "s"
    # a and b as recorded; c and d at the known files' 100 s / 200 bytes
    assert cost == {"test_a.py": 90.0, "test_b.py": 10.0, "test_c.py": 150.0, "test_d.py": 50.0}
    assert gpu_check.split(cost, 2) == [["test_c.py"], ["test_a.py", "test_b.py", "test_d.py"]]
    by_size = gpu_check.weights(files, tmp_path)[0]
    assert gpu_check.split(by_size, 2) == [["test_c.py"], ["test_a.py", "test_b.py", "test_d.py"]]
    (tmp_path / "plain.json").write_text("{}")
    with pytest.raises(ValueError, match="has no file_seconds"):
        gpu_check.read_durations([tmp_path / "plain.json"])


@pytest.mark.parametrize("n, match", [(0, "n must be an int >= 1"), (True, "n must be an int >= 1"),
                                      (5, "at most the number of files")])
def test_bad_shard_counts_are_refused(n, match):
    with pytest.raises(ValueError, match=match):
        gpu_check.split({"a": 1.0, "b": 2.0}, n)


@pytest.mark.parametrize("text", ["3", "0/3", "4/3", "a/b", "1/2/3"])
def test_bad_shard_text_is_refused(text):
    with pytest.raises(ValueError, match="--shard"):
        gpu_check.parse_shard(text)


def test_a_shard_runs_its_files_with_the_options_and_says_so(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(gpu_check, "run_pytest", lambda cmd, env, stop: (seen.append((cmd, env)) or 0, None))
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("K3LAB_PREDICTIONS", raising=False)
    suite = _suite()
    want = gpu_check.split(gpu_check.weights(suite, ROOT)[0], 3)[1]
    assert gpu_check.main([str(tmp_path), "--label", "s2", "--workers", "1", "--shard", "2/3"]) == 0
    cmd, env = seen[-1]
    rec = json.loads((tmp_path / "gpu_check_s2.json").read_text())
    if rec["shard"]["all_files"] != suite:
        pytest.skip("a test file came or went in the tree between the two reads: nothing to compare")
    assert cmd[-len(want) - 2:] == ["--nbval-lax", "--nbval-current-env", *want], cmd
    assert "tests" not in cmd and "notebooks" not in cmd and "-n" not in cmd
    assert env["K3LAB_PREDICTIONS"] == "off"  # as make test runs the notebooks
    assert rec["files"] == want and rec["shard"]["k"] == 2 and rec["shard"]["n"] == 3
    assert rec["shard"]["basis"] == "file sizes"


def test_with_workers_and_durations_the_longest_files_go_first(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(gpu_check, "run_pytest", lambda cmd, env, stop: (seen.append(cmd) or 0, None))
    monkeypatch.chdir(ROOT)
    files = ["tests/test_bench.py", "tests/test_cli.py", "tests/test_env.py", "tests/test_runs.py"]
    assert all((ROOT / f).exists() for f in files), files
    secs = {f: float(i + 1) for i, f in enumerate(files)}        # the last path the slowest
    record = tmp_path / "before.json"
    record.write_text(json.dumps({"file_seconds": secs}))
    for workers, want in ((2, files[::-1]), (1, files)):            # one worker runs in path order
        gpu_check.main([str(tmp_path / str(workers)), "--label", "o", "--workers", str(workers),
                        "--durations", str(record), "--co", *files])
        cmd = seen[-1]
        assert [a for a in cmd if a in files] == want, cmd
        reorder_off = "--no-loadscope-reorder" in cmd
        assert "--co" in cmd and reorder_off == (workers > 1 and gpu_check._xdist_reorders())
        rec = json.loads((tmp_path / str(workers) / "gpu_check_o.json").read_text())
        assert rec["files"] == sorted(files)                        # the record's files stay in path order
        assert rec["asked"] == files                                 # what was asked, beside what pytest got
    seen.clear()
    gpu_check.main([str(tmp_path / "whole"), "--label", "w", "--workers", "2", "--durations", str(record)])
    rec = json.loads((tmp_path / "whole" / "gpu_check_w.json").read_text())
    assert rec["asked"] == [a for a in gpu_check.DEFAULT_ARGS if not a.startswith("-")]
    assert "tests" not in seen[-1] and len(rec["files"]) > 100       # the command lists files, not tests/
    assert gpu_check.slowest_first({"b": 1.0, "a": 1.0, "c": 3.0}) == ["c", "a", "b"]


def test_two_real_workers_start_on_the_two_longest_files(tmp_path, monkeypatch):
    """pytest-xdist with two workers over four files: two long ones of one test each and two short ones of
    five (which xdist's own reordering would hand out first). With --durations each worker's first test
    is from one of the two long files."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: runs with workers are not checked")
    work = tmp_path / "work"
    work.mkdir()
    log = tmp_path / "starts.txt"
    body = ("import os, time\n\n{tests}")
    one = ("def test_{n}():\n    with open({log!r}, 'a') as f:\n        f.write(f\"{{os.environ.get("
           "'PYTEST_XDIST_WORKER')}} {file} {{time.time()}}\\n\")\n    time.sleep({sleep})\n\n")
    spec = {"test_a_short.py": (5, 0.0), "test_b_short.py": (5, 0.0), "test_c_long.py": (1, 1.0),
            "test_d_long.py": (1, 1.0)}
    for name, (n, sleep) in spec.items():
        tests = "".join(one.format(n=i, log=str(log), file=name, sleep=sleep) for i in range(n))
        (work / name).write_text(body.format(tests=tests))
    record = tmp_path / "durations.json"
    record.write_text(json.dumps({"file_seconds": {"test_a_short.py": 1.0, "test_b_short.py": 1.0,
                                                   "test_c_long.py": 50.0, "test_d_long.py": 40.0}}))
    monkeypatch.chdir(work)
    assert gpu_check.main([str(tmp_path / "out"), "--label", "o", "--workers", "2",
                           "--durations", str(record), *spec]) == 0
    first = {}
    for line in log.read_text().splitlines():
        worker, name, t = line.split()
        if worker not in first or float(t) < first[worker][1]:
            first[worker] = (name, float(t))
    assert sorted(name for name, _ in first.values()) == ["test_c_long.py", "test_d_long.py"], first


def test_a_run_stopped_at_its_limit_keeps_the_finished_files_only(tmp_path, monkeypatch):
    """A real pytest over three files, interrupted in the second: the first's tests are counted, the
    second (in flight) and third are listed as not run and none of their testcases are counted."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "test_a_fast.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    pass\n")
    (work / "test_b_slow.py").write_text("import time\n\ndef test_quick():\n    pass\n\n"
                                         "def test_slow():\n    time.sleep(120)\n")
    (work / "test_c_never.py").write_text("def test_never():\n    pass\n")
    monkeypatch.chdir(work)
    out = tmp_path / "out"
    rc = gpu_check.main([str(out), "--label", "cut", "--workers", "1", "--stop-after", "20",
                         "test_a_fast.py", "test_b_slow.py", "test_c_never.py"])
    rec = json.loads((out / "gpu_check_cut.json").read_text())
    assert rc != 0 and rec["stopped"].startswith("--stop-after 20 s reached"), rec
    assert rec["files_not_run"] == ["test_b_slow.py", "test_c_never.py"], rec
    assert rec["counts"] == {"passed": 2} and list(rec["file_seconds"]) == ["test_a_fast.py"], rec
    assert rec["wall_s"] < 100 and rec["failures_in_unfinished_files"] == []


def _fake_suite(work: Path) -> list[str]:
    """Three files for two workers: a parametrized one (ids with dots and slashes), one that fails at
    once and then sleeps (SLOW_S seconds; unset: 120) and one with a failing test in a class."""
    work.mkdir()
    (work / "test_a_params.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('x', [1, 2, 'a.b/c'])\ndef test_p(x):\n    pass\n")
    (work / "test_b_slow.py").write_text(
        "import os\nimport time\n\ndef test_fails_early():\n    assert False, 'early'\n\n"
        "def test_slow():\n    time.sleep(float(os.environ.get('SLOW_S', '120')))\n\n"
        "def test_after():\n    pass\n")
    (work / "test_c_class.py").write_text(
        "class TestK:\n    def test_fails(self):\n        assert 1 == 2, 'boom'\n\n"
        "    def test_ok(self):\n        pass\n")
    return ["test_a_params.py", "test_b_slow.py", "test_c_class.py"]


def test_a_run_with_workers_stopped_keeps_the_files_whose_tests_all_came(tmp_path, monkeypatch, capfd):
    """A real pytest with two workers, interrupted while one sleeps in the second file: the first and
    third files finished (all their collected items in the JUnit file) and are counted; the second is
    listed as not run, its testcases dropped, but its failure is reported apart, printed and fails the
    merge; the merge with a later run of that file is the whole suite."""
    pytest.importorskip("xdist", reason="pytest-xdist is not installed: runs with workers are not checked "
                        "here (the serial stop above is)")
    files = _fake_suite(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    monkeypatch.delenv("SLOW_S", raising=False)
    out = tmp_path / "out"
    rc = gpu_check.main([str(out), "--label", "cut", "--workers", "2", "--stop-after", "15", *files])
    rec = json.loads((out / "gpu_check_cut.json").read_text())
    printed = capfd.readouterr().out
    assert rc != 0 and rec["stopped"].startswith("--stop-after 15 s reached"), rec
    assert rec["collected"] == {"test_a_params.py": 3, "test_b_slow.py": 3, "test_c_class.py": 2}, rec
    assert rec["files_not_run"] == ["test_b_slow.py"], rec
    assert rec["counts"] == {"passed": 4, "failed": 1}, rec
    assert sorted(rec["file_seconds"]) == ["test_a_params.py", "test_c_class.py"], rec
    assert [f["test"] for f in rec["failures"]] == ["test_c_class.TestK::test_fails"], rec
    assert rec["failures_in_unfinished_files"] == [{"test": "test_b_slow::test_fails_early",
                                                    "message": "AssertionError: early"}], rec
    assert "gpu_check: FAILED test_b_slow.py::test_fails_early" in printed  # as it came
    assert "FAILED (file not finished) test_b_slow::test_fails_early" in printed  # and at the end
    assert rec["wall_s"] < 100
    assert gpu_check._status(rec) == 1
    # the next call runs the file not finished; the two records are the whole suite
    monkeypatch.setenv("SLOW_S", "0")
    gpu_check.main([str(out), "--label", "rest", "--workers", "1", *rec["files_not_run"]])
    rest = json.loads((out / "gpu_check_rest.json").read_text())
    assert rest["counts"] == {"passed": 2, "failed": 1}, rest
    m = gpu_check.merge_records([rec, rest], "whole")
    assert m["complete"] and m["files"] == files and m["files_not_run"] == [], m
    assert m["counts"] == {"passed": 6, "failed": 2} and m["exit_status"] == 1, m
    assert sorted(f["test"] for f in m["failures"]) == ["test_b_slow::test_fails_early",
                                                        "test_c_class.TestK::test_fails"], m
    assert m["failures_in_unfinished_files"] == rec["failures_in_unfinished_files"]


def test_a_file_is_finished_when_the_junit_file_holds_all_it_collected(tmp_path):
    """Parametrized ids, notebook cells (nbval's Cell N items) and a collection error (one testcase in
    the JUnit file) each count; a test reported twice counts once; nothing collected known: no file is
    taken as finished."""
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_x" name="test_p[a.b/c]" time="1"/>'
        '<testcase classname="tests.test_x" name="test_p[a.b/c]" time="1"><error message="teardown"/>'
        '</testcase><testcase classname="tests.test_x.TestK" name="test_q[1-2]" time="1"/>'
        '<testcase classname="notebooks.01_dcp.ipynb" name="Cell 0" time="1"/>'
        '<testcase classname="notebooks.01_dcp.ipynb" name="Cell 1" time="1"><failure message="nan"/>'
        '</testcase><testcase classname="notebooks.02_mla.ipynb" name="Cell 0" time="1"/>'
        '<testcase classname="" name="tests.test_broken" time="0"><error message="collection failure"/>'
        '</testcase><testcase time="0.000"/></testsuite></testsuites>')
    files = ["notebooks/01_dcp.ipynb", "notebooks/02_mla.ipynb", "tests/test_broken.py", "tests/test_x.py",
             "tests/test_y.py"]
    collected = tmp_path / "collected.json"
    collected.write_text(json.dumps({"ids": [
        "tests/test_x.py::test_p[a.b/c]", "tests/test_x.py::TestK::test_q[1-2]",
        "notebooks/01_dcp.ipynb::Cell 0", "notebooks/01_dcp.ipynb::Cell 1",
        "notebooks/02_mla.ipynb::Cell 0", "notebooks/02_mla.ipynb::Cell 1", "tests/test_y.py::test_z"],
        "errors": ["tests/test_broken.py"]}))
    counts = gpu_check.read_collected(collected, files)
    assert counts == {"notebooks/01_dcp.ipynb": 2, "notebooks/02_mla.ipynb": 2, "tests/test_broken.py": 1,
                      "tests/test_x.py": 2, "tests/test_y.py": 1}
    assert gpu_check.unfinished_files(junit, files, counts) == ["notebooks/02_mla.ipynb", "tests/test_y.py"]
    assert gpu_check.read_collected(tmp_path / "absent.json", files) is None  # stopped while collecting
    assert gpu_check.unfinished_files(junit, files, None) == files
    failures = gpu_check.summarize(junit, files)["failures"]
    assert [f["message"] for f in gpu_check.failures_in(failures, ["notebooks/01_dcp.ipynb",
                                                                   "tests/test_broken.py"])] == \
        ["nan", "collection failure"]


def test_summarize_gives_each_file_its_testcases(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.test_x" name="test_a" time="1.5"/>'
        '<testcase classname="tests.test_x.TestK" name="test_b" time="2.0"><failure message="boom"/>'
        '</testcase>'
        '<testcase classname="tests.test_xy" name="test_c" time="4.0"><skipped message="no GPU"/></testcase>'
        '<testcase classname="notebooks.01_dcp.ipynb" name="Cell 3" time="7.25"/>'
        '<testcase classname="" name="tests.test_broken" time="0"><error message="collection failure"/>'
        '</testcase><testcase time="0.000"/></testsuite></testsuites>')  # the interrupted test's
    files = ["tests/test_x.py", "tests/test_xy.py", "notebooks/01_dcp.ipynb", "tests/test_broken.py"]
    got = gpu_check.summarize(junit, files)
    assert got["counts"] == {"passed": 2, "failed": 2, "skipped": 1}
    assert got["file_seconds"] == {"notebooks/01_dcp.ipynb": 7.25, "tests/test_broken.py": 0.0,
                                   "tests/test_x.py": 3.5, "tests/test_xy.py": 4.0}
    assert [f["message"] for f in got["failures"]] == ["boom", "collection failure"]
    dropped = gpu_check.summarize(junit, files, drop={"tests/test_x.py"})
    assert dropped["counts"] == {"passed": 1, "failed": 1, "skipped": 1} and "tests/test_x.py" not in \
        dropped["file_seconds"]
    assert gpu_check.seen_files(junit, files) == ["tests/test_x.py", "tests/test_xy.py",
                                                  "notebooks/01_dcp.ipynb", "tests/test_broken.py"]


# ------------------------------------------------------------------------ merging shard records

ALL = [f"tests/test_{c}.py" for c in "abcdef"]
PLAN = {"n": 3, "all_files": ALL, "all_files_digest": gpu_check.digest(ALL)}
GROUPS = [ALL[0:2], ALL[2:4], ALL[4:6]]


def _record(k, files=None, not_run=(), **over):
    files = GROUPS[k - 1] if files is None else files
    ran = [f for f in files if f not in not_run]
    rec = {"label": f"serial_{k}", "device": "NVIDIA H100 80GB HBM3", "commit": "abc", "workers": 1,
           "shard": {**PLAN, "k": k} if k else None, "files": files, "files_not_run": list(not_run),
           "exit_status": 0, "wall_s": 100.0 * (k or 1), "counts": {"passed": 10 * len(ran), "skipped": 1},
           "failures": [], "skips": [{"reason": "no peer", "count": 1}],
           "slowest": [{"test": f"{f}::slow", "seconds": 10.0 + i} for i, f in enumerate(ran)],
           "file_seconds": {f: 5.0 for f in ran}, "gpu_memory": {"peak_total_mib": 100 * (k or 1),
                                                                 "peak_process_mib": 50}}
    return rec | over


def test_merge_adds_up_the_shards_into_the_whole_suite():
    recs = [_record(1), _record(2, counts={"passed": 15, "failed": 1, "skipped": 1}, exit_status=1,
                                failures=[{"test": "tests.test_c::t", "message": "boom"}]), _record(3)]
    m = gpu_check.merge_records(recs, "serial")
    assert m["counts"] == {"passed": 55, "failed": 1, "skipped": 3}
    assert m["failures"] == [{"test": "tests.test_c::t", "message": "boom"}] and m["exit_status"] == 1
    assert m["wall_s"] == 600.0 and m["complete"] and m["files_not_run"] == [] and m["files"] == ALL
    assert m["skips"] == [{"reason": "no peer", "count": 3}] and m["workers"] == [1]
    assert m["gpu_memory"]["peak_total_mib"] == 300
    assert m["file_seconds"] == {f: 5.0 for f in ALL}
    assert [s["seconds"] for s in m["slowest"]][:2] == [11.0, 11.0] and len(m["slowest"]) == 6
    assert [r["shard"] for r in m["merged_from"]] == ["1/3", "2/3", "3/3"]
    # and the merged record weighs the next split
    assert gpu_check.read_durations([m]) == {f: 5.0 for f in ALL}


def test_merge_of_a_missing_shard_or_a_stopped_one_is_not_complete_until_covered(tmp_path):
    m = gpu_check.merge_records([_record(1), _record(3)], "serial")
    assert not m["complete"] and m["missing_shards"] == [2] and m["files_not_run"] == GROUPS[1]
    cut = _record(2, not_run=[ALL[3]], stopped="--stop-after 540 s reached: pytest was interrupted",
                  exit_status=2)
    m = gpu_check.merge_records([_record(1), cut, _record(3)], "serial")
    assert not m["complete"] and m["missing_shards"] == [] and m["files_not_run"] == [ALL[3]]
    rest = _record(0, files=[ALL[3]], label="serial_rest")
    m = gpu_check.merge_records([_record(1), cut, _record(3), rest], "serial")
    assert m["complete"] and m["counts"]["passed"] == 60 and m["files"] == ALL
    assert m["exit_status"] == 0  # the interruption was made good by the rest's run
    # a failure in a file the stopped run did not finish fails the merge, though the rest's run passed it
    flaky = cut | {"failures_in_unfinished_files": [{"test": "tests.test_d::t", "message": "boom"}]}
    m = gpu_check.merge_records([_record(1), flaky, _record(3), rest], "serial")
    assert m["complete"] and m["exit_status"] == 1 and m["counts"].get("failed") is None
    assert m["failures_in_unfinished_files"] == flaky["failures_in_unfinished_files"]
    for i, rec in enumerate([_record(1), _record(3)]):
        (tmp_path / f"r{i}.json").write_text(json.dumps(rec))
    assert gpu_check.main(["merge", str(tmp_path / "out"), "--label", "part", str(tmp_path / "r0.json"),
                           str(tmp_path / "r1.json")]) == 1  # not complete: not a pass
    assert json.loads((tmp_path / "out" / "gpu_check_part.json").read_text())["missing_shards"] == [2]


@pytest.mark.parametrize("records, match", [
    ([_record(1), _record(1)], "shard 1 comes twice"),
    ([_record(1), _record(0, files=[ALL[0]])], "tests/test_a.py ran in two records"),
    ([_record(1), _record(2, device="NVIDIA H200")], "different devices"),
    ([_record(1), _record(2, commit="def")], "different commits"),
    ([_record(1), _record(2, shard={**PLAN, "k": 2, "n": 4})], "different splits"),
    ([_record(1), {k: v for k, v in _record(2).items() if k != "files"}], "has no files list"),
    ([], "at least one"),
])
def test_merge_refuses_records_that_are_not_one_suite(records, match):
    with pytest.raises(ValueError, match=match):
        gpu_check.merge_records(records, "serial")
