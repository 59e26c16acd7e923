"""Tests that check CPU tensors through Triton's interpreter, on any machine.

k3lab turns Triton's interpreter on at import only where torch sees no GPU (`k3lab/__init__.py`), and
Triton decides interpreted or compiled when a kernel is defined, so in one process Triton kernels on
CPU tensors run only on a machine without a GPU. A test marked `@on_a_cpu` (or a class or module with
`pytestmark = on_a_cpu`) runs as it is there; on a GPU machine it is not called in the run's process:
the marked tests of its file run together in one child pytest that sees no GPU (CUDA_VISIBLE_DEVICES
and HIP_VISIBLE_DEVICES empty, TRITON_INTERPRET=1), started when the first of them comes up, and each
test passes, fails (with the child's report of it) or skips as it did there. Its fixtures are set up
there too, not in the run's process (`runtest_setup`), so a fixture may build CPU steps. So the same
facts are checked wherever `make test` runs, for the price of one child start per file.

The check that every test needing this has it is in `cpu_guard.py`; `conftest.py` wires both in.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHILD_TIMEOUT_S = 600  # run_as_on_a_cpu's limit for one test
CHILD_WAIT_S = 600  # the longest the child may report nothing (under pytest-timeout's 900 s a test)
MARK = "on_a_cpu"
RESULTS_ENV = "K3LAB_CPU_CHILD_RESULTS"  # set in the child: where it writes one JSON line per test
IN_CHILD_ENV = "K3LAB_CPU_CHILD"  # "1" in the child, so it never starts one of its own
FORCE_ENV = "K3LAB_CPU_CHILD_FORCE"  # "1": take the child path without a GPU (tests of this module)

on_a_cpu = getattr(pytest.mark, MARK)


def needs_child() -> bool:
    """Whether marked tests run in a child here: not in a child already; FORCE_ENV set (the tests of this
    module, on a CPU), or a GPU visible and Triton's interpreter off in this process."""
    if os.environ.get(IN_CHILD_ENV) == "1":
        return False
    if os.environ.get(FORCE_ENV) == "1":
        return True
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()


def child_env(results: Path | None = None) -> dict[str, str]:
    """The child's environment: this one without a visible GPU, with the interpreter on, and without
    what would make it distribute or re-spawn (xdist's worker id, PYTEST_ADDOPTS, FORCE_ENV)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1",
           IN_CHILD_ENV: "1"}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_ADDOPTS", FORCE_ENV,
                 RESULTS_ENV):
        env.pop(name, None)
    if results is not None:
        env[RESULTS_ENV] = str(results)
    return env


def child_command(nodeids: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *nodeids]


def run_as_on_a_cpu(nodeid: str, timeout_s: float = CHILD_TIMEOUT_S,
                    cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run one test (a pytest node id relative to `cwd`, or a path) in a child pytest that sees no GPU.
    Returns the finished process; TimeoutExpired propagates (the test then fails, named)."""
    return subprocess.run(child_command([nodeid]), cwd=cwd, env=child_env(), capture_output=True, text=True,
                          timeout=timeout_s)


# ------------------------------------------------------------------------ in the child: one line per test

class ResultWriter:
    """A plugin for the child: each test's outcome (passed, failed, skipped, xfailed, xpassed), the phase
    that decided it and pytest's text of it, as one JSON line written when the test's teardown ends."""

    def __init__(self, path: Path):
        self.path, self.open = Path(path), {}

    def pytest_runtest_logreport(self, report):
        rec = self.open.setdefault(report.nodeid, {"nodeid": report.nodeid, "outcome": "passed", "phase": "",
                                                   "text": ""})
        xfail = hasattr(report, "wasxfail")
        if report.failed and rec["outcome"] != "failed":
            rec.update(outcome="failed", phase=report.when, text=report.longreprtext)
        elif report.skipped and rec["outcome"] == "passed":
            reason = report.wasxfail if xfail else (report.longrepr[2] if isinstance(report.longrepr, tuple)
                                                    else report.longreprtext)
            rec.update(outcome="xfailed" if xfail else "skipped", phase=report.when, text=str(reason))
        elif report.when == "call" and report.passed and xfail:
            rec.update(outcome="xpassed", phase="call", text=report.wasxfail)
        if report.when == "teardown":
            with self.path.open("a") as f:
                f.write(json.dumps(self.open.pop(report.nodeid)) + "\n")


# ------------------------------------------------------------------------ in the parent: one child per file

class ChildRun:
    """One child pytest running `nodeids` (relative to `cwd`) in the background, in their order;
    `result(nodeid)` waits for that test's line. A child that reports no test for `wait_s` seconds is
    stopped (a hang in it would otherwise hold every later test), and its remaining tests fail."""

    def __init__(self, nodeids: list[str], cwd: Path, wait_s: float = CHILD_WAIT_S):
        self.nodeids, self.wait_s = list(nodeids), wait_s
        self.dir = Path(tempfile.mkdtemp(prefix="k3lab-cpu-child-"))
        self.results_path, self.log_path = self.dir / "results.jsonl", self.dir / "output.txt"
        self.results: dict[str, dict] = {}
        self.broken = ""
        self._offset = 0
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(child_command(self.nodeids), cwd=cwd,
                                         env=child_env(self.results_path), stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _read(self) -> None:
        if not self.results_path.exists():
            return
        with self.results_path.open("rb") as f:
            f.seek(self._offset)
            for line in iter(f.readline, b""):
                if not line.endswith(b"\n"):
                    break  # a line still being written: read it next time
                self._offset += len(line)
                rec = json.loads(line)
                self.results[rec["nodeid"]] = rec

    def output_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no output)"

    def result(self, nodeid: str) -> dict:
        deadline = time.monotonic() + self.wait_s
        while True:
            seen = len(self.results)
            self._read()
            if len(self.results) > seen:  # the child moves on: give it wait_s more
                deadline = time.monotonic() + self.wait_s
            if nodeid in self.results:
                return self.results[nodeid]
            if self.broken:
                return {"nodeid": nodeid, "outcome": "failed", "phase": "child", "text": self.broken}
            rc = self.proc.poll()
            if rc is not None:
                self._read()
                if nodeid in self.results:
                    return self.results[nodeid]
                self.broken = (f"the CPU child exited with status {rc} without reporting this test; "
                               f"its output ends:\n{self.output_tail()}")
            elif time.monotonic() > deadline:
                self.stop()
                self.broken = (f"the CPU child reported nothing for {self.wait_s:.0f} s, so it was stopped; "
                               f"its output ends:\n{self.output_tail()}")
            else:
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Children:
    """The session's child runs, one per test file, each started (when the first comes up) for the file's
    marked tests among the session's selected items. Under xdist every worker collects every test, so a
    file's child runs all its marked tests: with `--dist loadfile` (scripts/gpu_check.py) one worker
    runs the file and there is one child; with `--dist load` each worker that gets one starts its own."""

    def __init__(self):
        self.runs: dict[Path, ChildRun] = {}

    def result(self, item) -> dict:
        run = self.runs.get(item.path)
        if run is None:
            same_file = [i.nodeid for i in getattr(item.session, "items", [item])
                         if i.path == item.path and i.get_closest_marker(MARK) is not None]
            run = self.runs[item.path] = ChildRun(same_file or [item.nodeid], cwd=item.config.rootpath)
        if item.nodeid not in run.nodeids:  # not among the session's items (a plugin ran it on its own)
            run = ChildRun([item.nodeid], cwd=item.config.rootpath)
            try:
                return run.result(item.nodeid)
            finally:
                run.close()
        return run.result(item.nodeid)

    def close(self) -> None:
        for run in self.runs.values():
            run.close()
        self.runs.clear()


def replay(rec: dict) -> None:
    """Raise in the parent what the child's record says (return for a pass)."""
    where = "its CPU child (no GPU visible, TRITON_INTERPRET=1)"
    outcome, text = rec["outcome"], rec.get("text", "")
    if outcome == "failed":
        pytest.fail(f"{rec['nodeid']} failed in {where}, in {rec['phase']}:\n{text[-6000:]}", pytrace=False)
    if outcome == "skipped":
        pytest.skip(f"skipped in {where}: {text.removeprefix('Skipped: ')}")
    if outcome == "xfailed":
        pytest.xfail(text)
    if outcome not in ("passed", "xpassed"):
        pytest.fail(f"{rec['nodeid']}: unknown outcome {outcome!r} from {where}", pytrace=False)


CHILDREN = Children()


# ------------------------------------------------------------------------ for the tests of these hooks

def hooked_folder(folder: Path) -> None:
    """Write a conftest.py into `folder` that takes in tests/conftest.py's hooks (the same functions), so
    pytest run there on temporary test files behaves as on the suite's (the tests of these hooks)."""
    (folder / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "_spec = importlib.util.spec_from_file_location('k3lab_tests_conftest',\n"
        f"                                               {str(HERE / 'conftest.py')!r})\n"
        "_mod = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(_mod)\n"
        "globals().update({k: v for k, v in vars(_mod).items() if k.startswith('pytest_')})\n")


def run_pytest(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """pytest -q -rA in `folder`, in a fresh process with `env` over this one's (less the child's own
    variables)."""
    full = dict(os.environ)
    for name in (IN_CHILD_ENV, RESULTS_ENV, FORCE_ENV, "PYTEST_ADDOPTS"):
        full.pop(name, None)
    full.update(env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *args],
                          cwd=folder, env=full, capture_output=True, text=True, timeout=600)


# ------------------------------------------------------------------------ the hooks conftest.py takes in

def configure(config) -> None:
    config.addinivalue_line("markers", f"{MARK}: checks CPU tensors through Triton's interpreter; on a GPU "
                            "machine it runs in a child process that sees no GPU (tests/cpu_child.py)")
    if os.environ.get(RESULTS_ENV):
        config.pluginmanager.register(ResultWriter(Path(os.environ[RESULTS_ENV])), "k3lab-cpu-child-results")


class SetUpInTheChild:
    """What a marked test's fixture names hold in the parent on the child path: the fixtures themselves
    are set up in the child, which runs the test."""

    def __repr__(self) -> str:
        return "<set up in the CPU child>"


SET_UP_IN_THE_CHILD = SetUpInTheChild()


def runtest_setup(item) -> None:
    """On the child path, leave a marked test's fixtures (module-scoped, autouse, its own) to the child:
    each name of its fixture closure is filled with a placeholder before pytest's setup, which then sets
    up none of them here (it fills only names it does not have yet). A fixture that builds CPU steps
    would refuse here on a GPU machine; in the child it is built where the test runs. Unmarked tests of
    the same file set up theirs here as usual, a module-scoped one the first time one of them needs it."""
    if not isinstance(item, pytest.Function) or item.get_closest_marker(MARK) is None or not needs_child():
        return
    for name in item.fixturenames:
        item.funcargs.setdefault(name, SET_UP_IN_THE_CHILD)


def pyfunc_call(pyfuncitem):
    """True (called) when the test ran in its file's child; None: call it here as usual."""
    if pyfuncitem.get_closest_marker(MARK) is None or not needs_child():
        return None
    replay(CHILDREN.result(pyfuncitem))
    return True


def sessionfinish() -> None:
    CHILDREN.close()
