"""The Triton ladder: short kernel puzzles before each kernel lesson, growing in size, each ending in
(a simplified form of) the lesson's own kernel. The learner writes `@triton.jit` kernels; the check
launches them.

    PUZZLES                name -> Puzzle (statement, stub kernel, wrapper, solution, cases, fp64 reference)
    ladder(notebook)       the puzzles of one lesson, in order (by_notebook() for all)
    check(name, kernel)    True when `kernel` passes every case; prints one line either way, saying whose
                           code it graded and how it ran: "pass", or "not solved yet" with the first case
                           that differs and why; when the kernel does not compile or run, the whole error
                           follows that line. Never raises for what the kernel does; a plain Python
                           function fails as "no Triton kernel launched"
    launch_solutions()     every solution launched once (the ISA report compiles them for AMD and NVIDIA)
    show(name, kernel)     the elements of each tensor argument a kernel loads and stores on the first case,
                           drawn from Triton's interpreter
    stub(name)             the stub cell's code: imports, the kernel with TODOs, the puzzle's wrapper
    statement(name)        the statement cell's markdown
    cells(name)            (statement, stub cell, check cell): what a notebook holds for one puzzle
    solution(name)         the solution kernel

The lessons: 01 (DCP merge), 02 (MoE tail), 03 (fused AttnRes + RMSNorm), 04 (padded MLA decode tile),
05 (KDA group scan); docs/ladder.md lists every puzzle and why the ladder is built this way.

Where it runs: on a GPU the kernel is compiled and runs on GPU tensors; on a CPU (no GPU, or
TRITON_INTERPRET=1 set before triton was imported, as `import k3lab` does without a GPU) it runs in
Triton's interpreter on small CPU tensors, where a load or store outside every tensor argument stops the
launch with the learner's line instead of corrupting memory. Cases are fresh random inputs from `seed`.
The workshop's one setting, K3LAB_WORKSHOP_GRADE=solutions (`k3lab.workshop.grading`), makes check grade
the puzzle's solution instead of the kernel it is given (CI, `make run`, nbval), and a solution that fails
there raises SolutionFailed, as a task's reference does; every line says whose code it graded.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

from k3lab.workshop.grading import GRADE_ENV, SolutionFailed, grading

from . import _trace, epilogue, merge, padded, scan, tail
from ._grade import Puzzle, device, error_text, grade, how, is_kernel, mode_problem

PUZZLES: dict[str, Puzzle] = {p.name: p for p in (
    *merge.PUZZLES,      # 01
    *tail.PUZZLES,       # 02
    *epilogue.PUZZLES,   # 03
    *padded.PUZZLES,     # 04
    *scan.PUZZLES,       # 05
)}

IMPORTS = "import torch\nimport triton\nimport triton.language as tl\n"
CONTINUE = "edit the kernel above, run its cell and this one again (the lesson goes on either way)"


def _puzzle(name) -> Puzzle:
    if not isinstance(name, str) or name not in PUZZLES:
        raise ValueError(f"name must be one of the ladder's puzzles {sorted(PUZZLES)}, got {name!r}")
    return PUZZLES[name]


@functools.lru_cache(maxsize=64)
def _cases(name: str, seed: int, where: str):
    """A puzzle's cases, made once per (seed, device); grading hands the wrapper deep copies."""
    return tuple(PUZZLES[name].cases(seed, where))


def _seed(seed) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return seed


def check(name: str, kernel, *, seed: int = 0, verbose: bool = True) -> bool:
    """Grade `kernel` (the @triton.jit kernel of puzzle `name`'s stub) through the puzzle's wrapper on
    fresh random cases from `seed`, against the fp64 reference; the solution instead under
    K3LAB_WORKSHOP_GRADE=solutions, where a failing solution raises SolutionFailed. Prints the verdict
    when verbose; returns True when every case passes. Unknown names and bad seeds are a ValueError (the
    notebook's mistake, not the learner's); nothing the learner's kernel does raises."""
    p = _puzzle(name)
    seed = _seed(seed)
    solutions = grading() == "solutions"
    graded = p.solution if solutions else kernel
    with _trace.watch(graded) if is_kernel(graded) else contextlib.nullcontext():
        ok, detail = grade(p, graded, list(_cases(name, seed, device())))
    if solutions:
        who = f"{name}, graded the solution ({GRADE_ENV}=solutions, {how()})"
        if not ok:
            raise SolutionFailed(f"{who}: FAILED: {detail}")
        line = f"{who}: {detail}"
    elif kernel is p.solution:
        line = f"{name}, graded the solution, not your kernel ({how()}): {detail}"
    elif ok:
        line = f"{name}, graded your kernel ({how()}): {detail}"
    else:
        first, _, rest = detail.partition("\n")
        line = f"{name}, graded your kernel ({how()}): not solved yet: {first.rstrip(':')} \u2014 {CONTINUE}"
        line += f". The whole error:\n{rest}" if rest else ""
    if verbose:
        print(line)
    return ok


def show(name: str, kernel=None, *, seed: int = 0) -> None:
    """Run `kernel` (default: the solution) on puzzle `name`'s first case in Triton's interpreter and
    print, per tensor argument, which program loaded and which stored each element. Needs the interpreter
    (a CPU, or TRITON_INTERPRET=1); elsewhere it says so and runs nothing. Returns nothing, so a cell
    that ends in the call shows the map once."""
    p = _puzzle(name)
    kernel = p.solution if kernel is None else kernel
    ok, why = _trace.available()
    if not is_kernel(kernel):
        text = f"{name}: show takes the @triton.jit kernel ({p.kernel_name}), got {type(kernel).__name__}"
    elif not ok:
        text = f"{name}: no access map: {why}"
    elif mode_problem(kernel):
        text = f"{name}: the kernel cannot run here: {mode_problem(kernel)}"
    elif device() != "cpu" or not isinstance(kernel, _trace.InterpretedFunction):
        text = (f"{name}: the access map is drawn by Triton's interpreter, which is off in this process "
                "(kernels compile for the GPU here); run the puzzle on a CPU or in a process started "
                "with TRITON_INTERPRET=1")
    else:
        case = _cases(name, _seed(seed), "cpu")[0]
        try:
            with _trace.watch(kernel, record=True) as tr:
                p.wrapper(kernel, **copy.deepcopy(case.inputs))
            text = f"{name}, case 1 ({case.label}):\n{tr.text()}"
        except Exception as exc:  # noqa: BLE001 - shown, as check shows it
            text = f"{name}: the kernel failed on case 1 ({case.label}):\n{error_text(exc)}"
    print(text)


def launch_solutions(seed: int = 0) -> None:
    """Launch every puzzle's solution once, through its wrapper, on its first case's CPU tensors: what the
    ISA report captures to compile the ladder for each GPU target (`k3lab.isa.cases`, where no kernel
    runs)."""
    for p in PUZZLES.values():
        p.wrapper(p.solution, **copy.deepcopy(_cases(p.name, _seed(seed), "cpu")[0].inputs))


def stub(name: str) -> str:
    """The stub cell: imports, the kernel with TODOs, and the puzzle's complete wrapper."""
    p = _puzzle(name)
    return f"{IMPORTS}\n\n{p.stub}\n\n{inspect.getsource(p.wrapper)}"


def statement(name: str) -> str:
    """The statement cell's markdown."""
    return _puzzle(name).statement


def check_cell(name: str) -> str:
    """The check cell's code (the semicolon keeps the returned bool off the cell's output)."""
    p = _puzzle(name)
    return f'from k3lab.workshop import ladder\n\nladder.check("{p.name}", {p.kernel_name});'


def cells(name: str) -> tuple[str, str, str]:
    """(statement markdown, stub code, check code): one puzzle's three notebook cells."""
    return statement(name), stub(name), check_cell(name)


def solution(name: str):
    """The solution kernel of puzzle `name` (`inspect.getsource(solution(name).fn)` shows it)."""
    return _puzzle(name).solution


def ladder(notebook: str) -> list[str]:
    """The names of one lesson's puzzles, in order."""
    names = sorted((p for p in PUZZLES.values() if p.notebook == notebook), key=lambda p: p.step)
    if not names:
        books = sorted({p.notebook for p in PUZZLES.values()})
        raise ValueError(f"notebook must be one of {books}, got {notebook!r}")
    return [p.name for p in names]


def by_notebook() -> dict[str, list[str]]:
    """notebook stem -> its puzzles' names, in order."""
    return {nb: ladder(nb) for nb in sorted({p.notebook for p in PUZZLES.values()})}


__all__ = ["CONTINUE", "PUZZLES", "Puzzle", "SolutionFailed", "by_notebook", "cells", "check", "check_cell",
           "ladder", "launch_solutions", "show", "solution", "statement", "stub"]
