"""Learner tasks for the notebooks, the checker that grades them, and their solutions.

    TASKS                      name -> Task (statement, signature, stub, cases, fp64 reference, ...)
    check(name, fn)            True when fn passes every case; prints one line either way: "pass", or the
                               first failing case with the error measured and allowed (or the learner's
                               exception, type and first line), never a traceback from the library
    solution(name)             the reference solution (a function with the task's signature)
    stub(name)                 the source the learner starts from (it raises NotImplementedError, or,
                               for the Triton task, runs and returns a wrong answer)
    skeleton(name)             the Triton task's kernel with holes, and its complete wrapper
    mma16(a, b)                the 16-row "matrix unit" of the MLA padding task

One task per notebook, 01 to 08, each 10-20 minutes on that notebook's idea (`Task.notebook`,
`Task.minutes`; docs/instructor.md has the answers and the common mistakes). Inputs are fresh random
tensors or numbers from a fixed seed (`check(..., seed=)`), small enough for Triton's interpreter on a
CPU. The kernel task (`on_device`) gets GPU tensors where there is a GPU, so it runs compiled there.

In a notebook: a statement cell (`TASKS[name].statement`), the learner's cell from `stub(name)`, and a
check cell that grades the learner's function, or the solution when the parameter SOLVE is True (CI):

    fn = solution("dcp_merge") if SOLVE else merge
    assert check("dcp_merge", fn)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from k3lab import env

from . import attention, curve, epilogue, kda, moe, serving
from ._core import EXACT, Case, Mismatch, Task, grade
from .attention import mma16

TASKS: dict[str, Task] = {t.name: t for t in (
    attention.MERGE,       # 01
    moe.TASK,              # 02
    epilogue.TASK,         # 03
    attention.PAD,         # 04
    kda.TASK,              # 05
    serving.DEPTH,         # 06
    serving.RESUME,        # 07
    serving.FLOOR,         # 08
    curve.BEND,            # 09
)}


def _task(name) -> Task:
    if not isinstance(name, str) or name not in TASKS:
        raise ValueError(f"name must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


@functools.lru_cache(maxsize=64)
def _cases(name: str, seed: int, device: str) -> tuple[Case, ...]:
    """A task's cases, made once per (seed, device): grading never writes into them (the learner gets
    copies), so a second check of the same task (a learner's next attempt) reuses them."""
    return tuple(TASKS[name].cases(seed, device))


def check(name: str, fn: Callable, *, seed: int = 0, verbose: bool = True) -> bool:
    """Grade `fn` on task `name`'s cases (fresh random inputs from `seed`) against the fp64 reference.
    Prints one line when verbose; returns True when every case passes. Unknown names are a ValueError."""
    task = _task(name)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    device = str(env.detect().device) if task.on_device else "cpu"
    ok, line = grade(task, fn, list(_cases(name, seed, device)))
    if verbose:
        print(line)
    return ok


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


__all__ = ["EXACT", "TASKS", "Case", "Mismatch", "Task", "by_notebook", "check", "grade", "mma16", "skeleton",
           "solution", "stub"]
