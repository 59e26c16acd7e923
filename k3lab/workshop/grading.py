"""Whose code a notebook's task cell grades, what the lesson runs on afterwards, and the hint ladder.

    fn = workshop.task("dcp_merge", merge)   # one line: whose code was graded and how it went
    fn(o_parts, lse_parts)                    # the learner's merge if it passed, else the reference
    workshop.hint("dcp_merge")                # the next of three hints: a nudge, the idea, nearly the code

The learner's function is graded by default, and nothing halts: an unsolved task (the untouched stub
raises NotImplementedError, or returns the skeleton's wrong answer) or a failing one prints "not solved
yet" with the first failing case, and `task` hands back the reference solution, labelled, so the
predictions, reveals and figures below still run. One setting in the environment,
K3LAB_WORKSHOP_GRADE=solutions, makes CI, `make run`, the report and nbval grade the reference solutions
instead; there a failing solution raises `SolutionFailed`, so a broken reference cannot pass unnoticed.

While the learner's function runs, the library functions that compute the task's answer refuse to run
(`Task.forbidden`, see `guard`): a one-line call of `merge_partials` does not solve the merge.

Why the library's own grader and not nbgrader or otter-grader: those generate a student and an
instructor copy of each notebook from one annotated source and grade submitted copies afterwards. The
workshop needs the opposite: one notebook that runs top to bottom in either role (the role is the
environment setting), feedback in the cell the moment it runs, fresh random cases with the fp64
references and dtype tolerances k3lab already has, and the library functions refused while a task is
graded. None of that needs a second copy of any notebook to keep in step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from k3lab import env

from . import guard
from ._core import Case, Task, grade

GRADE_ENV = "K3LAB_WORKSHOP_GRADE"
GRADE_MODES = ("learner", "solutions")
HINT_LEVELS = ("a nudge", "the idea", "nearly the code")
CONTINUE = "edit the cell above and run it again; the lesson continues on the reference solution"


class SolutionFailed(AssertionError):
    """A reference solution failed its task under K3LAB_WORKSHOP_GRADE=solutions: the library is broken."""


def grading() -> str:
    """'learner' (the default: K3LAB_WORKSHOP_GRADE unset or empty) or 'solutions'. Any other value is a
    ValueError naming the variable."""
    value = os.environ.get(GRADE_ENV, "").strip().lower() or "learner"
    if value not in GRADE_MODES:
        raise ValueError(f"{GRADE_ENV} must be one of {list(GRADE_MODES)} (or unset), got "
                         f"{os.environ[GRADE_ENV]!r}")
    return value


def _task(tasks: dict[str, Task], name) -> Task:
    if not isinstance(name, str) or name not in tasks:
        raise ValueError(f"name must be one of {sorted(tasks)}, got {name!r}")
    return tasks[name]


_CASES: dict[tuple[str, int, str], tuple[Case, ...]] = {}


def cases(task: Task, seed: int) -> list[Case]:
    """A task's cases, made once per (seed, device): grading never writes into them (the learner gets
    copies), so a second attempt reuses them."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    key = (task.name, seed, str(env.detect().device) if task.on_device else "cpu")
    if key not in _CASES:
        _CASES[key] = tuple(task.cases(seed, key[2]))
    return list(_CASES[key])


def refusing(task: Task):
    """The guard of a learner's attempt at `task`: its forbidden library functions, its solution and its
    reference refuse to run (a context manager)."""
    return guard.refusing(task.name, task.forbidden,
                          also={f"workshop.solution({task.name!r})": task.solution,
                                f"the reference of {task.name!r}": task.reference})


def grade_function(task: Task, fn: Callable, seed: int = 0, *, who: str = "your function"
                   ) -> tuple[bool, str]:
    """(passed, one line) for `fn` on `task`; the guard is on unless fn is the task's own solution."""
    on = None if fn is task.solution else (lambda: refusing(task))
    return grade(task, fn, cases(task, seed), guard=on, who=who)


@dataclass
class Attempt:
    """What a task cell hands the rest of the lesson: callable as the function the lesson runs on.

    passed: the graded function passed every case. graded: whose code was graded ('your code' or 'the
    reference solution ...'). uses: 'yours' or 'the reference solution'. line: the one line printed."""

    name: str
    passed: bool
    graded: str
    uses: str
    fn: Callable = field(repr=False)
    line: str = field(repr=False)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.name}: {'passed' if self.passed else 'not solved'}; the lesson runs on {self.uses}>"

    def _ipython_display_(self):
        """Nothing more: the call printed its one line already."""


def attempt(tasks: dict[str, Task], name: str, fn: Callable | None = None, *, seed: int = 0) -> Attempt:
    """Grade a notebook's task and say whose code it graded (one printed line); see the module docstring.
    Under the learner setting nothing the learner writes makes this raise; under
    K3LAB_WORKSHOP_GRADE=solutions a failing reference raises SolutionFailed."""
    task = _task(tasks, name)
    if grading() == "solutions":
        who = f"the reference solution ({GRADE_ENV}=solutions)"
        ok, line = grade_function(task, task.solution, seed, who="the reference solution")
        detail = line.removeprefix(f"{task.name}: ")
        if not ok:
            raise SolutionFailed(f"{task.name}, graded {who}: FAILED: {detail}")
        out = Attempt(task.name, True, who, "the reference solution", task.solution,
                      f"{task.name}, graded {who}: {detail}")
    elif fn is task.solution:
        ok, line = grade_function(task, fn, seed, who="the reference solution")
        out = Attempt(task.name, ok, "the reference solution (passed in place of your code)",
                      "the reference solution", fn, f"{task.name}, graded the reference solution, not your "
                      f"code: {line.removeprefix(f'{task.name}: ')}")
    else:
        if fn is None or not callable(fn):
            ok, detail = False, (f"no function given (got {type(fn).__name__}): run the cell that defines it"
                                 if fn is not None else "no function given: run the cell that defines it")
        else:
            try:
                ok, line = grade_function(task, fn, seed)
            except Exception as exc:  # noqa: BLE001 - e.g. a result the comparison cannot handle
                ok, line = False, f"{task.name}: grading your result raised {type(exc).__name__}: {exc}"
            detail = line.removeprefix(f"{task.name}: ")
        if ok:
            out = Attempt(task.name, True, "your code", "yours", fn,
                          f"{task.name}, graded your code: {detail}")
        else:
            out = Attempt(task.name, False, "your code", "the reference solution", task.solution,
                          f"{task.name}, graded your code: not solved yet: {detail} \u2014 {CONTINUE}")
    print(out.line)
    return out


# ---------------------------------------------------------------------------------------------- hints
_HINTS_SHOWN: dict[str, int] = {}


def hint(tasks: dict[str, Task], name: str, level: int | None = None) -> None:
    """Print the next hint of task `name` (1, 2, 3, then the last again), or hint `level` (1-3); the ladder
    position is kept for this session (the Python process). Returns nothing, so a notebook cell that ends
    in the call shows the hint once."""
    task = _task(tasks, name)
    if level is None:
        level = min(_HINTS_SHOWN.get(name, 0) + 1, len(task.hints))
    elif isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(task.hints):
        raise ValueError(f"level must be an int 1-{len(task.hints)} or None (the next hint), got {level!r}")
    _HINTS_SHOWN[name] = max(_HINTS_SHOWN.get(name, 0), level)
    text = f"{name}, hint {level} of {len(task.hints)} ({HINT_LEVELS[level - 1]}): {task.hints[level - 1]}"
    if level == len(task.hints):
        text += f" [the last hint; the answer: inspect.getsource(workshop.solution({name!r}))]"
    print(text)


def reset_hints() -> None:
    """Start every hint ladder again (a fresh kernel does the same)."""
    _HINTS_SHOWN.clear()


HINTS_BEGIN = "<!-- hints: generated by `python -m k3lab.workshop.hints docs/instructor.md`; do not edit -->"
HINTS_END = "<!-- end of hints -->"


def hints_markdown(tasks: dict[str, Task]) -> str:
    """docs/instructor.md's hints section: one subsection per task, its three hints in order."""
    out = [HINTS_BEGIN, "", "## Hints: `workshop.hint(name)`", "",
           "Each call shows the next hint of the ladder, a nudge, the idea, then nearly the code (the "
           "position is kept for the kernel's session; `workshop.hint(name, 2)` shows one again). The texts "
           "live in the task definitions (`TASKS[name].hints`); this section is generated from them.", ""]
    for t in tasks.values():
        out += [f"### {t.notebook}: `{t.name}`", ""]
        out += [f"{i}. *{HINT_LEVELS[i - 1]}*: {h}" for i, h in enumerate(t.hints, start=1)]
        out.append("")
    out.append(HINTS_END)
    return "\n".join(out)


def with_hints(doc: str, tasks: dict[str, Task]) -> str:
    """`doc` with its hints section replaced by the generated one (appended when it has none)."""
    from .sections import replace_section

    return replace_section(doc, hints_markdown(tasks), HINTS_BEGIN, HINTS_END)


__all__ = ["CONTINUE", "GRADE_ENV", "GRADE_MODES", "HINT_LEVELS", "Attempt", "SolutionFailed", "attempt",
           "cases", "grade_function", "grading", "hint", "hints_markdown", "refusing", "reset_hints",
           "with_hints"]
