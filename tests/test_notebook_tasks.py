"""The notebooks hold the workshop's tasks and ladders as the library defines them, in the non-halting form:
for each task of a notebook, a code cell equal to `workshop.stub(name)` and, below it, the one-line check
`fn = workshop.task(name, fn)` (no assert, no SOLVE parameter); for each ladder puzzle, its stub cell and a
`ladder.check(name, ...)` cell; and no cell above a task's check shows (show_source / read_kernel) a
function that answers it (`Task.forbidden`). Static: the notebooks are not run here (nbval and the
report run them, unsolved and graded on the solutions)."""

import json
import re
from pathlib import Path

import pytest

from k3lab import workshop
from k3lab.workshop import ladder

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _cells(stem: str) -> list[tuple[str, str]]:
    (path,) = NOTEBOOKS.glob(f"{stem}.ipynb")
    nb = json.loads(path.read_text())
    return [(c["cell_type"], "".join(c["source"])) for c in nb["cells"]]


def _index(cells, pred, what: str) -> int:
    found = [i for i, (kind, src) in enumerate(cells) if kind == "code" and pred(src)]
    assert found, what
    return found[0]


@pytest.mark.parametrize("name", sorted(workshop.TASKS))
def test_a_task_stub_then_its_non_halting_check(name):
    task = workshop.TASKS[name]
    cells = _cells(task.notebook)
    stub = _index(cells, lambda s: s.strip() == workshop.stub(name).strip(),
                  f"{task.notebook}: no code cell equals workshop.stub({name!r})")
    check = _index(cells, lambda s: re.search(rf"workshop\.task\(\s*[\"']{name}[\"']", s) is not None,
                   f"{task.notebook}: no `workshop.task({name!r}, ...)` check cell")
    assert stub < check, f"{task.notebook}: the check of {name} comes before its stub"
    assert "assert" not in cells[check][1], f"{task.notebook}: the check cell of {name} must not assert"
    assert not any("SOLVE" in src for kind, src in cells if kind == "code"), f"{task.notebook}: SOLVE left"
    leaks = _leaks(cells[:check], task)
    assert not leaks, f"{task.notebook}: cells above the check of {name} show what answers it: {leaks}"


def _leaks(cells, task) -> list[str]:
    """The forbidden functions of `task` that a show_source / read_kernel cell among `cells` shows."""
    shown = [src for kind, src in cells
             if kind == "code" and ("show_source(" in src or "read_kernel(" in src)]
    return [path for path in task.forbidden for src in shown
            if re.search(rf"\b{re.escape(path.rsplit('.', 1)[1])}\b", src)]


@pytest.mark.parametrize("name", sorted(p for ps in ladder.by_notebook().values() for p in ps))
def test_a_ladder_puzzle_stub_then_its_check(name):
    stem = next(nb for nb, ps in ladder.by_notebook().items() if name in ps)
    cells = _cells(stem)
    stub = _index(cells, lambda s: ladder.stub(name).strip() in s,
                  f"{stem}: no code cell holds ladder.stub({name!r})")
    check = _index(cells, lambda s: re.search(rf"ladder\.check\(\s*[\"']{name}[\"']", s) is not None,
                   f"{stem}: no `ladder.check({name!r}, ...)` cell")
    assert stub < check
    task_checks = [i for i, (kind, src) in enumerate(cells) if kind == "code" and "workshop.task(" in src]
    assert task_checks and check < task_checks[0], f"{stem}: the ladder comes before the lesson's task"


def test_the_checker_sees_a_leak():
    """The leak check above can fail: the PyTorch merge shown above 01's check is caught, a read of
    another function is not."""
    task = workshop.TASKS["dcp_merge"]
    assert _leaks([("code", "lesson.show_source(merge_op.lse_weights)")], task) == [task.forbidden[1]]
    assert _leaks([("code", "read.read_kernel(dcp.shard_cache, [])")], task) == []
