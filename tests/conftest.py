"""Test-session hooks: tests marked `on_a_cpu` run in a CPU child on a GPU machine (`cpu_child.py`); on
a run that interprets Triton kernels, a test that launches them on CPU tensors without that mark or a
device that follows the GPU fails (`cpu_guard.py`); after each test the GPU memory a worker has cached
goes back to the device (`k3lab._cells`: an xdist worker that once ran a test at K3's full shapes
would hold that peak for the rest of the run and starve the others); the skipped tests are grouped by
reason at the end of the run (one line a reason)."""

from __future__ import annotations

import pytest

import cpu_child
import cpu_guard


def pytest_configure(config):
    cpu_child.configure(config)
    cpu_guard.configure(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    cpu_child.runtest_setup(item)
    cpu_guard.runtest_setup()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    cpu_guard.runtest_call_start()
    result = yield
    cpu_guard.runtest_call(item)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    cpu_guard.runtest_teardown_start()
    result = yield
    cpu_guard.runtest_teardown(item)
    # imported here, not at the top: k3lab's import decides TRITON_INTERPRET
    from k3lab._cells import give_back_gpu_cache

    give_back_gpu_cache()
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    return cpu_child.pyfunc_call(pyfuncitem)


def pytest_sessionfinish(session):
    cpu_child.sessionfinish()


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip() or "no reason given"


def skip_groups(reports) -> list[tuple[str, int, list[str]]]:
    """(reason, count, files) for skipped test reports, the most frequent reason first."""
    groups: dict[str, list[str]] = {}
    for rep in reports:
        groups.setdefault(_reason(rep), []).append(rep.nodeid.split("::", 1)[0])
    rows = [(reason, len(files), sorted(set(files))) for reason, files in groups.items()]
    return sorted(rows, key=lambda r: (-r[1], r[0]))


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, count, files in skip_groups(skipped):
        where = ", ".join(f.rsplit("/", 1)[-1] for f in files[:3])
        if len(files) > 3:
            where += f", +{len(files) - 3} more"
        terminalreporter.write_line(f"{count:5d}  {reason}  [{where}]")
