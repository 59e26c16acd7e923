"""Learner tasks for the notebooks, the grader, their solutions and hints.

    TASKS                      name -> Task (statement, signature, stub, cases, fp64 reference, forbidden
                               library functions, three hints)
    task(name, fn)             the notebook's check: grades the learner's fn (or, under
                               K3LAB_WORKSHOP_GRADE=solutions, the reference), prints one line saying whose
                               code it graded, never raises for the learner's code, and returns what the
                               lesson runs on: fn when it passed, else the reference solution (labelled)
    check(name, fn)            True when fn passes every case; prints one line either way: "pass", or the
                               first failing case with the error measured and allowed (or the learner's
                               exception, type and first line), never a traceback from the library
    hint(name)                 the next of the task's three hints (a nudge, the idea, nearly the code)
    solution(name)             the reference solution (a function with the task's signature)
    stub(name)                 the source the learner starts from (it raises NotImplementedError, or,
                               for the Triton task, runs and returns a wrong answer)
    skeleton(name)             the Triton task's kernel with holes, and its complete wrapper
    mma16(a, b)                the 16-row "matrix unit" of the MLA padding task

One task per notebook, 01 to 09, each 10-20 minutes on that notebook's idea (`Task.notebook`,
`Task.minutes`; docs/instructor.md has the answers, the common mistakes and the hints). Inputs are fresh
random tensors or numbers from a fixed seed (`seed=`), small enough for Triton's interpreter on a CPU.
The kernel task (`on_device`) gets GPU tensors where there is a GPU, so it runs compiled there. While
a learner's function is graded (by `task` or `check`), the library functions that compute its answer,
the task's solution and its reference refuse to run (`guard`).

In a notebook: a statement cell (`TASKS[name].statement`), the learner's cell from `stub(name)`, and
one task cell (the grading module's docstring says why this grader and not nbgrader or otter-grader):

    merge = workshop.task("dcp_merge", merge)   # the rest of the lesson calls merge(...)
"""

from __future__ import annotations

from collections.abc import Callable

from . import attention, curve, epilogue, grading, kda, moe, serving
from ._core import EXACT, Case, Mismatch, Task, grade
from .attention import mma16
from .grading import GRADE_ENV, Attempt, SolutionFailed, grading as grade_mode
from .guard import Refused

TASKS: dict[str, Task] = {t.name: t for t in (
    attention.MERGE,       # 01
    moe.TASK,              # 02
    epilogue.TASK,         # 03
    attention.PAD,         # 04
    kda.TASK,              # 05
    serving.DEPTH,         # 06
    serving.RESUME,        # 07
    serving.FIX,           # 08
    curve.BEND,            # 09
)}


def _task(name) -> Task:
    return grading._task(TASKS, name)


def task(name: str, fn: Callable | None = None, *, seed: int = 0) -> Attempt:
    """Grade task `name` in a notebook: the learner's `fn` by default, the reference solution under
    K3LAB_WORKSHOP_GRADE=solutions. Prints one line saying whose code it graded and how it went; returns
    an Attempt, callable as the function the lesson goes on with (fn when it passed, else the reference,
    labelled). Never raises for the learner's code; a reference that fails under the solutions setting
    raises SolutionFailed. Unknown names are a ValueError."""
    return grading.attempt(TASKS, name, fn, seed=seed)


def check(name: str, fn: Callable, *, seed: int = 0, verbose: bool = True) -> bool:
    """Grade `fn` on task `name`'s cases (fresh random inputs from `seed`) against the fp64 reference, with
    the task's forbidden library functions refused (unless fn is the task's own solution). Prints one line
    when verbose; returns True when every case passes. Unknown names are a ValueError. (Notebooks use
    `task`, which also says whose code it graded and goes on when it fails.)"""
    ok, line = grading.grade_function(_task(name), fn, seed)
    if verbose:
        print(line)
    return ok


def hint(name: str, level: int | None = None) -> None:
    """Print the next of task `name`'s three hints (a nudge, the idea, nearly the code); `level` 1-3 shows
    that one. The position on the ladder is kept for this session."""
    grading.hint(TASKS, name, level)


def solution(name: str) -> Callable:
    """The reference solution of task `name`: `inspect.getsource(solution(name))` shows it."""
    return _task(name).solution


def stub(name: str) -> str:
    """The source text the learner starts from (valid Python with TODOs)."""
    return _task(name).stub


def skeleton(name: str) -> str:
    """The kernel with holes of a Triton task (with its complete wrapper)."""
    task = _task(name)
    if task.skeleton is None:
        kernels = sorted(n for n, t in TASKS.items() if t.skeleton is not None)
        raise ValueError(f"task {name!r} has no Triton skeleton; the tasks with one: {kernels}")
    return task.skeleton


def by_notebook() -> dict[str, list[str]]:
    """notebook stem -> the names of its tasks."""
    out: dict[str, list[str]] = {}
    for t in TASKS.values():
        out.setdefault(t.notebook, []).append(t.name)
    return out


__all__ = ["EXACT", "GRADE_ENV", "TASKS", "Attempt", "Case", "Mismatch", "Refused", "SolutionFailed", "Task",
           "by_notebook", "check", "grade", "grade_mode", "hint", "mma16", "skeleton", "solution", "stub",
           "task"]
