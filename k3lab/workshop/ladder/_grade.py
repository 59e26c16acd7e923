"""The puzzle type of the Triton ladder and the grader behind `k3lab.workshop.ladder.check`.

A `Puzzle` is one rung: a statement (what to compute, shapes), the stub kernel the learner starts from
(source text with TODOs; it runs and gives a wrong answer), a complete wrapper `wrapper(kernel, **inputs)`
that launches a kernel of the stub's signature and returns the outputs, the solution kernel, fresh random
cases and a plain PyTorch fp64 reference.

`grade` launches the learner's kernel through the puzzle's own wrapper on every case, so what is graded is
what the kernel computes: the wrapper is fixed, and a launch counter between the wrapper and the kernel
must see at least one launch, so a plain PyTorch function (or anything that is not a Triton kernel)
cannot pass. Inputs are on the GPU where Triton compiles for one, on the CPU under Triton's interpreter
(`device()`). Results are held to `k3lab.runtime.checks`' bounds for the case's dtype against the fp64
reference. The verdict is one line; when the kernel does not compile (or fails in the interpreter) the
whole error follows it, every message of the chain and the lines of the learner's own source it points
at, never cut to its first line. Nothing the learner's kernel does makes `grade` raise.

Whose code is graded: the learner's kernel, unless the workshop's one setting says to grade the solutions
(K3LAB_WORKSHOP_GRADE=solutions, read by `k3lab.workshop.grading.grading`, as the tasks read it); the
ladder's `check` says which in every line.
"""

from __future__ import annotations

import copy
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton

from k3lab import env
from k3lab.runtime.checks import CheckFailed, check as check_tensor
from k3lab.workshop._core import Case

try:
    from triton.compiler.errors import CompilationError
except ImportError:  # pragma: no cover - every Triton 3.x has it
    CompilationError = ()
from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, KernelInterface

def device() -> str:
    """Where a ladder's inputs live: 'cuda' where Triton compiles for a GPU, 'cpu' under the interpreter
    (a machine without a GPU, or a process started with TRITON_INTERPRET=1)."""
    return "cuda" if torch.cuda.is_available() and not env.triton_interpreted() else "cpu"


def how() -> str:
    """How kernels run here, for the verdict line."""
    if device() == "cuda":
        return f"compiled for {env.detect().name}"
    return "in Triton's interpreter on the CPU"


@dataclass(frozen=True)
class Puzzle:
    """One rung of a lesson's ladder (see the module docstring).

    name: the puzzle's key; notebook: the lesson it precedes; step: its place in that lesson's ladder
    (1 first); minutes: what it takes a learner; kernel_name: the stub kernel's name (what the check
    cell passes); stub: that kernel's source with TODOs (a @triton.jit helper may come before it);
    wrapper: wrapper(kernel, **inputs) -> one output or a tuple, named by `outputs`; its source is shown
    to the learner verbatim, so it uses only torch, triton and triton.language; solution: the solution
    kernel; cases(seed, device) -> list of Case; reference(case) -> fp64 tensors, one per output."""

    name: str
    notebook: str
    step: int
    minutes: int
    title: str
    statement: str
    kernel_name: str
    stub: str
    wrapper: Callable
    solution: Any
    cases: Callable[[int, str], list[Case]]
    reference: Callable[[Case], Any]
    outputs: tuple[str, ...]

    def __post_init__(self):
        if not 2 <= self.minutes <= 12:
            raise ValueError(f"minutes must be 2-12 (one rung of a ladder), got {self.minutes}")
        if self.kernel_name not in self.stub:
            raise ValueError(f"the stub must define {self.kernel_name!r}")


class _Counted:
    """Stands where the wrapper expects the kernel: `k[grid](...)` launches the real kernel and counts
    the launches that returned (a launch over an empty grid is not counted)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            out = launch(*args, **kwargs)
            size = 1
            for g in grid if isinstance(grid, tuple) else (grid,):
                size *= int(g) if isinstance(g, int) else 1
            self.launches += size > 0
            return out

        return run


def is_kernel(obj) -> bool:
    """True for a Triton kernel: @triton.jit (compiled or interpreted), also under autotune/heuristics."""
    return isinstance(obj, KernelInterface)


def mode_problem(kernel) -> str:
    """'' when `kernel` can run here; else why not, and what to do. Triton picks interpreted or compiled
    when a kernel is defined, from TRITON_INTERPRET as it was when triton was imported (k3lab sets it on a
    machine without a GPU), so a notebook that imported triton before k3lab mixes the two."""
    if device() != "cpu":
        return ""
    fix = ("restart the kernel and run the setup cell (which imports k3lab) before anything imports triton, "
           "or start Jupyter with TRITON_INTERPRET=1")
    if not isinstance(kernel, InterpretedFunction) and isinstance(kernel, JITFunction):
        return f"your kernel was defined for a GPU, and there is none here to compile it for: {fix}"
    import triton.language as tl

    if isinstance(kernel, InterpretedFunction) and not isinstance(tl.standard.max, InterpretedFunction):
        return ("triton was imported before its interpreter was switched on (TRITON_INTERPRET=1), so its own "
                f"functions (tl.max, tl.sum, ...) cannot run in the interpreter: {fix}")
    return ""


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a Tensor {tuple(obj.shape)}"
    if callable(obj):
        return f"the plain Python function {getattr(obj, '__name__', type(obj).__name__)!r}"
    return f"a value of type {type(obj).__name__}"


_LIBRARY_DIRS = tuple(str(Path(p).resolve()) for p in (
    Path(triton.__file__).parent, Path(torch.__file__).parent, Path(__file__).parents[2],
    sysconfig.get_paths()["stdlib"]))


def _learner_frame(filename: str) -> bool:
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return True
    return not path.startswith(_LIBRARY_DIRS) and "site-packages" not in path


def error_text(exc: BaseException) -> str:
    """The whole error of a kernel that did not compile or failed to run: every message of the exception
    chain (outermost first, a message already contained in the one before it left out), then the
    lines of the learner's own source it passed through, innermost last."""
    chain, seen = [], set()
    e = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    lines: list[str] = []
    for e in chain:
        text = str(e).strip()
        if isinstance(e, InterpreterError) and e.__cause__ is not None:
            continue  # the interpreter's wrapper: its text is the repr of its cause, shown next
        if text and any(text in kept for kept in lines):
            continue  # a compile error's cause, already quoted in the compile error
        name = type(e).__name__
        lines.append(text if text.startswith(name) else f"{name}: {text}".rstrip(": "))
    where = []
    for e in chain:
        for fs in traceback.extract_tb(e.__traceback__):
            if _learner_frame(fs.filename) and fs.line:
                entry = f"line {fs.lineno} of {fs.name}: {fs.line.strip()}"
                if entry not in where:
                    where.append(entry)
    if where:
        lines.append("in your code:\n" + "\n".join("  " + w for w in where))
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


# Triton's interpreter turns a run-time loop bound into a 1-element array, which numpy >= 2.3 will not
# convert to an int: `for i in range(n)` with n a run-time value fails there with this message.
RUNTIME_BOUND = "only 0-dimensional arrays can be converted to Python scalars"
RUNTIME_BOUND_HINT = ("hint: Triton's interpreter (with numpy 2.3 or later) cannot run `for ... in "
                      "range(...)` to a bound known only at run time; make the bound a tl.constexpr, or "
                      "write the loop as `while i < n: ...; i += step` (compiled Triton takes either)")


def _failed_launch(exc: BaseException) -> str:
    if CompilationError and isinstance(exc, CompilationError):
        what = "your kernel did not compile"
    elif device() == "cpu":
        what = "your kernel failed in Triton's interpreter"
    else:
        what = "your kernel failed to compile or run"
    text = error_text(exc)
    if RUNTIME_BOUND in text:
        text += f"\n{RUNTIME_BOUND_HINT}"
    return f"{what}:\n{_indent(text)}"


def grade(p: Puzzle, kernel, cases: list[Case]) -> tuple[bool, str]:
    """(passed, detail): `pass (N cases; dtypes)`, or why not: the first case that differs and by how
    much, or that no Triton kernel launched, or (on lines after the first) the whole error of a kernel
    that did not compile or run. Never raises for what the kernel does."""
    if not is_kernel(kernel):
        return False, (f"no Triton kernel launched: check takes the @triton.jit kernel ({p.kernel_name}) and "
                       f"launches it through the puzzle's wrapper; got {_describe(kernel)}")
    problem = mode_problem(kernel)
    if problem:
        return False, f"your kernel cannot run here: {problem}"
    for i, case in enumerate(cases, start=1):
        where = f"case {i} of {len(cases)} ({case.label})"
        counted = _Counted(kernel)
        try:
            got = p.wrapper(counted, **copy.deepcopy(case.inputs))
            if device() == "cuda":
                torch.cuda.synchronize()  # a launch's fault surfaces here, inside the try
        except Exception as exc:  # noqa: BLE001 - the learner's failure is reported, never raised
            return False, f"{where}: {_failed_launch(exc)}"
        if counted.launches == 0:
            return False, f"{where}: no Triton kernel launched"
        ref = p.reference(case)
        ref, got = ((ref,), (got,)) if len(p.outputs) == 1 else (tuple(ref), tuple(got))
        for name, g, r in zip(p.outputs, got, ref):
            try:
                check_tensor(g.detach().cpu(), r.detach().cpu(), dtype=case.dtype, name=name)
            except CheckFailed as exc:
                return False, f"{where}: {exc}"
    dts = sorted({str(c.dtype).removeprefix("torch.") for c in cases})
    return True, f"pass ({len(cases)} cases; {', '.join(dts)})"
