"""The task type and the grader behind `k3lab.workshop.check`.

A `Task` is what a learner sees (statement, signature, stub, for Triton a skeleton) and what grades
them: `cases(seed, device)` makes fresh random inputs (never zeros; small, so the CPU interpreter is
fast), `reference(case)` computes the expected result from k3lab's own fp64 references, and `run`
applies the learner's function to a case (by default `fn(**inputs)` on copies of the inputs, so a
function that writes into its arguments cannot change what the reference sees).

`grade` compares result and reference case by case and stops at the first case that differs. Tensors
are held to the relative error bounds of `k3lab.runtime.checks` for the case's dtype (the dtype the
inputs come in, so a fp16 case allows what fp16 rounding allows); ints must be equal; floats get
the case dtype's max_rel. Whatever goes wrong is one line: the learner's exception (type and the
first line of its message), a wrong type or shape, the error measured against the error allowed, or
the library function it called that the task forbids (`Task.forbidden`, refused by `guard` while the
learner's function runs).

A task also carries its hint ladder (`hints`: a nudge, the idea, nearly the code), which
`k3lab.workshop.hint` shows one step at a time and docs/instructor.md mirrors.

`kernel_launches()` records the Triton kernels launched inside a block (the kernel task's grader and the
Triton ladder use it to refuse an answer in which no Triton kernel of the learner's ran).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from k3lab.runtime.checks import CheckFailed, check as check_tensor, tolerance_for

from .guard import Refused, refusal

EXACT = "exact"  # a case dtype for integer results: equal or wrong


class Mismatch(Exception):
    """A learner's result that cannot be compared (wrong type, shape or count); its message is the
    one line `grade` prints."""


@dataclass(frozen=True)
class Case:
    """One graded call: `inputs` are the learner's keyword arguments; `dtype` sets the tolerance
    (a torch dtype, a name of k3lab.runtime.checks.TOLERANCES, or EXACT); `extra` holds what the
    harness or the reference needs beyond the inputs; `out_dtype` (output name -> torch dtype)
    states the dtype a tensor result must come back in."""

    label: str
    inputs: dict[str, Any]
    dtype: Any
    extra: dict[str, Any] = field(default_factory=dict)
    out_dtype: dict[str, torch.dtype] = field(default_factory=dict)


@dataclass(frozen=True)
class Task:
    """One learner task (see the module docstring). `outputs` names the results in order (one name:
    the function returns one value; several: a tuple). `skeleton` is the Triton source with holes,
    for kernel tasks; `stub` is what the learner starts from in every task. `forbidden`: dotted paths of
    the library functions that compute the answer (refused while the learner's function is graded);
    `hints`: three distinct hints, a nudge, the idea, nearly the code."""

    name: str
    notebook: str
    minutes: int
    statement: str
    signature: str
    outputs: tuple[str, ...]
    cases: Callable[[int, torch.device], list[Case]]
    reference: Callable[[Case], Any]
    solution: Callable
    stub: str
    run: Callable[[Callable, Case], Any] | None = None
    skeleton: str | None = None
    on_device: bool = False  # inputs on the GPU where there is one (kernel tasks); else on the CPU
    forbidden: tuple[str, ...] = ()
    hints: tuple[str, ...] = ()

    def __post_init__(self):
        if (len(self.hints) != 3 or not all(isinstance(h, str) and h.strip() for h in self.hints)
                or len(set(self.hints)) != 3):
            raise ValueError(f"{self.name}: hints must be three distinct non-empty strings (a nudge, the "
                             f"idea, nearly the code), got {len(self.hints)}")
        if not all(isinstance(p, str) and "." in p for p in self.forbidden):
            raise ValueError(f"{self.name}: forbidden must hold dotted paths 'module.function', got "
                             f"{self.forbidden!r}")
        if not 10 <= self.minutes <= 20:
            raise ValueError(f"minutes must be 10-20 (a task of one notebook segment), got {self.minutes}")
        if not self.outputs:
            raise ValueError("outputs must name at least one result")

    def call(self, fn: Callable, case: Case) -> Any:
        """The learner's result for `case` (inputs deep-copied first)."""
        if self.run is not None:
            return self.run(fn, case)
        return fn(**copy.deepcopy(case.inputs))


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor {tuple(x.shape)} {x.dtype}"
    return type(x).__name__


def _as_tuple(task: Task, value, what: str) -> tuple:
    n = len(task.outputs)
    if n == 1:
        return (value,)
    if not isinstance(value, (tuple, list)) or len(value) != n:
        raise Mismatch(f"{what} must be a tuple ({', '.join(task.outputs)}), got {_describe(value)}"
                       + (f" of {len(value)}" if isinstance(value, (tuple, list)) else ""))
    return tuple(value)


def _compare_one(name: str, got, ref, case: Case) -> str:
    """'' when got matches ref under the case's bound, else the one-line reason (error measured and
    allowed)."""
    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{name}: expected a Tensor {tuple(ref.shape)}, got {_describe(got)}"
        if tuple(got.shape) != tuple(ref.shape):
            return f"{name}: expected shape {tuple(ref.shape)}, got {tuple(got.shape)}"
        want = case.out_dtype.get(name)
        if want is not None and got.dtype != want:
            return f"{name}: expected dtype {want}, got {got.dtype}"
        if not (got.is_floating_point() or got.dtype in (torch.int32, torch.int64)):
            return f"{name}: expected a floating-point tensor, got {got.dtype}"
        try:
            check_tensor(got.detach().cpu(), ref.detach().cpu(), dtype=case.dtype, name=name)
        except CheckFailed as exc:
            return str(exc)
        return ""
    if isinstance(ref, str):  # a choice by name (e.g. which part of a table): equal or wrong
        if not isinstance(got, str):
            return f"{name}: expected a str (a name such as {ref!r}), got {_describe(got)}"
        return "" if got == ref else f"{name}: expected {ref!r}, got {got!r}"
    if isinstance(ref, bool) or not isinstance(ref, (int, float)):
        raise TypeError(f"a task's reference must give tensors, ints, floats or strs, got "
                        f"{type(ref).__name__}")
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = got.item()
    try:
        import numpy as np  # numpy scalars (np.int64, np.float64) are plain numbers here

        if isinstance(got, np.generic):
            got = got.item()
    except ImportError:  # pragma: no cover - numpy comes with torch
        pass
    if isinstance(ref, int):
        if isinstance(got, bool) or not isinstance(got, int):
            return f"{name}: expected an int ({ref} here), got {_describe(got)}"
        return "" if got == ref else f"{name}: expected {ref}, got {got}"
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        return f"{name}: expected a number, got {_describe(got)}"
    _, tol = tolerance_for(case.dtype if case.dtype != EXACT else torch.float64)
    rel = abs(got - ref) / max(abs(ref), 1e-300)
    if not rel <= tol.max_rel:  # NaN fails too
        return (f"{name}: expected {ref:.6g}, got {got:.6g} "
                f"(relative error {rel:.2e} > allowed {tol.max_rel:.0e})")
    return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def grade(task: Task, fn: Callable, cases: list[Case], *, guard=None, who: str = "your function"
          ) -> tuple[bool, str]:
    """(passed, one line): the first failing case and why, or a summary of the passing run. `guard`: a
    context manager factory entered around each call of `fn` (the refusal of the task's forbidden
    functions; the cases and references are made outside it); `who` names fn in the line."""
    if not callable(fn):
        return False, f"{task.name}: expected a function, got {type(fn).__name__}"
    for i, case in enumerate(cases, start=1):
        where = f"{task.name}: case {i} of {len(cases)} ({case.label})"
        ref = _as_tuple(task, task.reference(case), "the reference")
        try:
            with (guard() if guard is not None else contextlib.nullcontext()):
                got = task.call(fn, case)
        except Mismatch as exc:
            return False, f"{where}: {exc}"
        except Refused as exc:  # the call that gives the answer away, named
            return False, f"{where}: {who} called {exc}"
        except Exception as exc:  # noqa: BLE001 - a learner's failure is one line, never a traceback
            return False, f"{where}: {who} raised {_first_line(exc)}"
        try:
            got = _as_tuple(task, got, "your result")
        except Mismatch as exc:
            return False, f"{where}: {exc}"
        for name, g, r in zip(task.outputs, got, ref):
            why = _compare_one(name, g, r, case)
            if why:
                return False, f"{where}: {why}"
    dts = sorted({str(c.dtype).removeprefix("torch.") for c in cases})
    return True, f"{task.name}: pass ({len(cases)} cases; {', '.join(dts)})"


# ------------------------------------------------------------------------------ Triton launches
@dataclass(frozen=True)
class Launch:
    """One Triton launch seen by `kernel_launches`: the kernel object (a JITFunction, or an
    InterpretedFunction under TRITON_INTERPRET=1), its Python function's name and module ('__main__' for
    a notebook cell), the grid as given, and the programs it ran (None when the grid is a function of the
    meta-parameters)."""

    kernel: Any
    name: str
    module: str
    grid: Any
    programs: int | None


class LaunchLog:
    """The Triton launches of one `kernel_launches()` block, in launch order (`launches`)."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __len__(self) -> int:
        return len(self.launches)

    def __iter__(self):
        return iter(self.launches)

    def names(self) -> list[str]:
        return [x.name for x in self.launches]

    def outside(self, package: str = "k3lab") -> list[Launch]:
        """The launches of kernels defined outside `package`: in a grader, the learner's own kernels (a
        notebook cell's module is '__main__'), not the library's."""
        return [x for x in self.launches if x.module != package and not x.module.startswith(package + ".")]


_LAUNCH_LOCK = threading.Lock()
_LOGS: list[LaunchLog] = []
_RUNS: dict[type, Callable | None] = {}  # kernel class -> its own `run` (None: inherited), while open


def _kernel_classes() -> list[type]:
    """The classes whose `run` a launch goes through: `kernel[grid](...)` is `kernel.run(..., grid=grid,
    warmup=False)` for a compiled JITFunction and for the interpreter's InterpretedFunction alike (an
    autotuned or heuristics-wrapped kernel ends in one of them)."""
    classes = []
    try:
        from triton.runtime.jit import JITFunction

        classes.append(JITFunction)
    except ImportError:  # no Triton: nothing can launch
        return []
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - every Triton 3.x has it
        pass
    return classes


def _programs(grid) -> int | None:
    if callable(grid):
        return None
    dims = grid if isinstance(grid, (tuple, list)) else (grid,)
    n = 1
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int):
            return None
        n *= d
    return n


def _counting(run: Callable) -> Callable:
    def run_counted(self, *args, **kwargs):
        why = refusal(self)  # a kernel that answers the graded task refuses to launch, whoever launches it
        if why:
            raise Refused(why)
        out = run(self, *args, **kwargs)
        grid = kwargs.get("grid")
        programs = _programs(grid)
        if not kwargs.get("warmup") and programs != 0:
            fn = getattr(self, "fn", None)
            launch = Launch(self, getattr(fn, "__name__", type(self).__name__),
                            getattr(fn, "__module__", None) or "", grid, programs)
            for log in list(_LOGS):
                log.launches.append(launch)
        return out

    run_counted.__wrapped__ = run
    return run_counted


@contextlib.contextmanager
def kernel_launches():
    """Record every Triton kernel launched inside the block; yields a `LaunchLog`.

        with kernel_launches() as seen:
            out = learner_fn(x)
        if not seen.outside("k3lab"):
            ...  # "no Triton kernel launched": plain PyTorch (or only the library's kernels) ran

    A launch is a `kernel[grid](...)` call that returned, compiled on a GPU or in Triton's interpreter on a
    CPU; a warm-up (`kernel.warmup`), a launch over an empty grid and a launch that raised are not counted,
    and neither is a @triton.jit function called from inside another kernel (that is part of the caller's
    launch). An autotuned kernel counts every launch its tuner makes. While a block is open, a kernel that
    `guard.refusal` names (the graded task's own kernel) raises Refused at launch, by whatever path it is
    launched. How: the `run` of Triton's kernel classes is wrapped while any block is open and put back
    when the last one closes; blocks nest (each sees the launches of its own span); like the guard, the
    wrap is process-wide, so another thread's launches in the span are recorded too."""
    log = LaunchLog()
    with _LAUNCH_LOCK:
        if not _LOGS:
            for cls in _kernel_classes():
                _RUNS[cls] = cls.__dict__.get("run")
                cls.run = _counting(cls.run)
        _LOGS.append(log)
    try:
        yield log
    finally:
        with _LAUNCH_LOCK:
            _LOGS.remove(log)
            if not _LOGS:
                for cls, run in _RUNS.items():
                    if run is None:
                        del cls.run
                    else:
                        cls.run = run
                _RUNS.clear()


# ------------------------------------------------------------------------------ cases that name a pitfall
def cases_exposing(rng, steps, answer: Callable, *, tries: int = 5000) -> list[tuple[str, Any]]:
    """Random cases ordered so that each common mistake first fails on the case named for it.

    steps: [(mistakes, draw)], in case order: `draw(rng)` -> (label, inputs) makes a random candidate;
    `answer(inputs, mistake)` -> the answer (hashable) that `mistake` gives (None: the right one), or None
    when it is not decided (a near-tie the learner's rounding could flip). A candidate for step i is kept
    when the right answer is decided, every mistake of step i gives another (decided) answer, and every
    mistake of the later steps gives the right one: so a learner who makes mistake m passes the cases before
    m's and fails on m's, whose label names what m misses. RuntimeError after `tries` candidates (the draw
    cannot expose the mistake: a bug of the task, not of the learner)."""
    later = [m for ms, _ in steps for m in ms]
    out = []
    for mistakes, draw in steps:
        later = later[len(mistakes):]
        for _ in range(tries):
            label, inputs = draw(rng)
            right = answer(inputs, None)
            if right is None or any(answer(inputs, m) in (None, right) for m in mistakes):
                continue
            if all(answer(inputs, m) == right for m in later):
                out.append((label, inputs))
                break
        else:
            raise RuntimeError(f"no case in {tries} draws exposes {mistakes} alone")
    return out
