"""The child run that lets interpreter tests pass on a GPU machine: it sees no GPU, runs the named
tests of a file in one process, reports each one's outcome, and a marked test in the parent passes,
fails or skips with it. On this CPU the child path is forced (K3LAB_CPU_CHILD_FORCE=1) in a pytest run
of its own, over test files in a temporary folder that take tests/conftest.py's hooks."""

from __future__ import annotations

import json
import time

import pytest

import cpu_child
from cpu_child import ChildRun, hooked_folder, run_as_on_a_cpu, run_pytest


def test_the_child_sees_no_gpu_and_runs_the_interpreter(tmp_path):
    t = tmp_path / "test_probe.py"
    t.write_text("import os, torch\n\ndef test_probe():\n"
                 "    assert not torch.cuda.is_available()\n"
                 "    assert os.environ['TRITON_INTERPRET'] == '1'\n")
    done = run_as_on_a_cpu(str(t), timeout_s=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


def test_a_failing_test_fails_in_the_child(tmp_path):
    t = tmp_path / "test_bad.py"
    t.write_text("def test_bad():\n    assert 1 == 2\n")
    done = run_as_on_a_cpu(str(t), timeout_s=300)
    assert done.returncode == 1 and "1 failed" in done.stdout, done.stdout + done.stderr


def test_child_run_reports_each_outcome_and_a_crash(tmp_path):
    hooked_folder(tmp_path)  # the child's result lines come from the hooks' configure
    t = tmp_path / "test_outcomes.py"
    t.write_text("import os, pytest\n\n"
                 "def test_ok():\n    pass\n\n"
                 "def test_skip():\n    pytest.skip('nothing to see')\n\n"
                 "def test_bad():\n    assert 1 == 2, 'one is not two'\n\n"
                 "@pytest.mark.xfail(reason='known')\ndef test_known():\n    assert False\n\n"
                 "def test_crash():\n    os._exit(3)\n\n"
                 "def test_after():\n    pass\n")
    names = ["ok", "skip", "bad", "known", "crash", "after"]
    run = ChildRun([f"test_outcomes.py::test_{n}" for n in names], cwd=tmp_path, wait_s=300)
    try:
        got = {n: run.result(f"test_outcomes.py::test_{n}") for n in names}
    finally:
        run.close()
    assert {n: r["outcome"] for n, r in got.items()} == {
        "ok": "passed", "skip": "skipped", "bad": "failed", "known": "xfailed", "crash": "failed",
        "after": "failed"}
    assert "one is not two" in got["bad"]["text"] and got["bad"]["phase"] == "call"
    assert "nothing to see" in got["skip"]["text"] and got["known"]["text"] == "known"
    for n in ("crash", "after"):  # neither was reported: the child ended in test_crash
        assert "exited with status 3 without reporting this test" in got[n]["text"], got[n]
    assert not run.dir.exists()  # close() removed its folder


def test_child_run_stops_a_child_that_reports_nothing_in_time(tmp_path):
    hooked_folder(tmp_path)
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hang():\n    time.sleep(120)\n")
    run = ChildRun(["test_hang.py::test_hang"], cwd=tmp_path, wait_s=20)
    t0 = time.monotonic()
    try:
        rec = run.result("test_hang.py::test_hang")
        assert rec["outcome"] == "failed" and "reported nothing for 20 s" in rec["text"], rec
        assert run.proc.poll() is not None  # stopped, not left running
        assert run.result("test_hang.py::test_hang")["text"] == rec["text"]  # and said at once after
    finally:
        run.close()
    assert time.monotonic() - t0 < 90


def test_marked_tests_of_a_file_run_in_one_child_and_report_there(tmp_path):
    """With the child path forced (as a GPU machine takes it), the marked tests run in one child that
    sees no GPU, each with its own outcome; unmarked ones run in the parent."""
    hooked_folder(tmp_path)
    log = tmp_path / "pids.jsonl"
    (tmp_path / "test_marked.py").write_text(
        "import json, os, pytest, torch\nfrom cpu_child import on_a_cpu\n\n"
        "def _log(name):\n"
        f"    with open({str(log)!r}, 'a') as f:\n"
        "        f.write(json.dumps([name, os.getpid(), os.environ.get('K3LAB_CPU_CHILD')]) + '\\n')\n\n"
        "@on_a_cpu\n@pytest.mark.parametrize('k', [1, 2])\ndef test_in_child(k):\n"
        "    _log(f'in_child{k}')\n    assert not torch.cuda.is_available()\n"
        "    assert os.environ['TRITON_INTERPRET'] == '1'\n\n"
        "@on_a_cpu\ndef test_fails_in_child():\n"
        "    _log('fails')\n    assert 2 + 2 == 5, 'arithmetic broke'\n\n"
        "@on_a_cpu\ndef test_skips_in_child():\n    pytest.skip('not here')\n\n"
        "def test_in_parent():\n    _log('parent')\n")
    done = run_pytest(tmp_path, **{cpu_child.FORCE_ENV: "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    # pytest's last line on stdout (plugins such as pytest-benchmark may warn on stderr after it)
    summary = done.stdout.strip().splitlines()[-1]
    assert all(f"{n} {what}" in summary for n, what in ((3, "passed"), (1, "failed"), (1, "skipped"))), out
    assert "arithmetic broke" in out and "failed in its CPU child" in out, out
    assert "skipped in its CPU child" in out and "not here" in out, out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    where = {name: (pid, child) for name, pid, child in rows}
    assert where["in_child1"][1] == where["in_child2"][1] == where["fails"][1] == "1", rows
    assert where["in_child1"][0] == where["in_child2"][0] == where["fails"][0], rows  # one child
    assert where["parent"][1] is None and where["parent"][0] != where["in_child1"][0], rows


def test_without_a_gpu_marked_tests_run_in_place(tmp_path):
    hooked_folder(tmp_path)
    (tmp_path / "test_here.py").write_text(
        "import os\nfrom cpu_child import on_a_cpu\n\n"
        "@on_a_cpu\ndef test_here():\n    assert os.environ.get('K3LAB_CPU_CHILD') is None\n")
    done = run_pytest(tmp_path, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("env, want", [
    ({"TRITON_INTERPRET": "1"}, False),  # this process interprets already
    ({"TRITON_INTERPRET": "1", cpu_child.FORCE_ENV: "1"}, True),
    ({cpu_child.FORCE_ENV: "1", cpu_child.IN_CHILD_ENV: "1"}, False),  # a child never starts another
])
def test_needs_child_never_in_a_child(monkeypatch, env, want):
    for name in (cpu_child.FORCE_ENV, cpu_child.IN_CHILD_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cpu_child.needs_child() is want
    child = cpu_child.child_env()
    assert child[cpu_child.IN_CHILD_ENV] == "1" and cpu_child.FORCE_ENV not in child
    assert child["CUDA_VISIBLE_DEVICES"] == "" and child["TRITON_INTERPRET"] == "1"


FIXTURES = '''
import json, os, pytest
from cpu_child import on_a_cpu


def _log(name):
    with open(LOG, 'a') as f:
        f.write(json.dumps([name, os.getpid(), os.environ.get('K3LAB_CPU_CHILD')]) + '\\n')


def _only_in_the_child(what):
    _log(what)
    if os.environ.get('K3LAB_CPU_CHILD') != '1':  # as a CPU step refuses to be built on a GPU machine
        raise ValueError(f"{what} set up outside the CPU child")


@pytest.fixture(scope='module')
def cpu_engine():
    _only_in_the_child('cpu_engine')
    return 'engine'


@pytest.fixture(autouse=True)
def every_test(request):
    if request.node.get_closest_marker('on_a_cpu') is not None:
        _only_in_the_child('autouse')
    yield
    _log('autouse-teardown')


@pytest.fixture
def plain():
    _log('plain')
    return 3


@on_a_cpu
def test_marked_takes_the_module_fixture(cpu_engine):
    assert cpu_engine == 'engine'


@on_a_cpu
@pytest.mark.parametrize('k', [1, 2])
def test_marked_parametrized(cpu_engine, k):
    assert cpu_engine == 'engine' and k in (1, 2)


def test_unmarked_between(plain):
    assert plain == 3


@on_a_cpu
class TestMarkedClass:
    def test_method(self, cpu_engine, plain):
        assert (cpu_engine, plain) == ('engine', 3)
'''


def test_marked_tests_set_up_their_fixtures_in_the_child_only(tmp_path):
    """On the child path a marked test's fixtures (module-scoped, autouse, plain) are set up in the child
    alone: a fixture that refuses to be built outside it (as a CPU step does on a GPU machine) passes, and
    the unmarked tests around them (another file too) set up theirs in the parent as usual."""
    hooked_folder(tmp_path)
    log = tmp_path / "fixtures.jsonl"
    (tmp_path / "test_a_fixtures.py").write_text(f"LOG = {str(log)!r}\n" + FIXTURES)
    (tmp_path / "test_b_after.py").write_text(
        "import pytest\n\n@pytest.fixture(scope='module')\ndef here():\n    return 5\n\n"
        "def test_after(here):\n    assert here == 5\n")
    done = run_pytest(tmp_path, **{cpu_child.FORCE_ENV: "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert done.stdout.strip().splitlines()[-1].startswith("6 passed"), out
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    child = {pid for name, pid, flag in rows if flag == "1"}
    parent = {pid for name, pid, flag in rows if flag is None}
    assert len(child) == 1 and len(parent) == 1, rows
    in_parent = [name for name, pid, flag in rows if flag is None]
    # the parent set up only the unmarked test's fixtures (plain and the autouse one, with its teardown)
    assert sorted(in_parent) == ["autouse-teardown", "plain"], rows
    in_child = [name for name, pid, flag in rows if flag == "1"]
    assert in_child.count("cpu_engine") == 1 and in_child.count("autouse") == 4, rows


def test_without_the_child_path_a_refusing_fixture_fails_in_setup(tmp_path):
    """The same file with the child path off and the fixture run in this process: the refusal shows as a
    setup error, so the test above passes because the parent skipped the setup, not by accident."""
    hooked_folder(tmp_path)
    log = tmp_path / "fixtures.jsonl"
    (tmp_path / "test_a_fixtures.py").write_text(f"LOG = {str(log)!r}\n" + FIXTURES)
    done = run_pytest(tmp_path, CUDA_VISIBLE_DEVICES="", HIP_VISIBLE_DEVICES="")
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "set up outside the CPU child" in out, out
    assert "1 passed, 4 errors" in done.stdout.strip().splitlines()[-1], out
