"""The check that keeps CPU-tensor interpreter tests from breaking the GPU suite.

On a GPU machine Triton kernels run compiled, and a test that sends CPU tensors through one fails
there ("cpu tensors and TRITON_INTERPRET is not 1", or Triton's own pointer error), unless it is marked
`@on_a_cpu` (`cpu_child.py`) and so runs in a child that sees no GPU. Where a test's tensors live on a
GPU machine cannot be seen on a CPU, where every tensor is a CPU tensor; what can be seen is:

- that the test launched Triton kernels in the interpreter on CPU tensors (Triton's interpreter calls
  one function per launch, `GridExecutor.__call__`, which this module counts), in its body or in the
  fixtures set up or torn down for it (a module-scoped fixture's setup counts for the first test that
  takes it, its teardown for the file's last), and
- whether the test's code asks whether there is a GPU: a call of `torch.cuda.is_available()`,
  `torch.cuda.device_count()`, `env.detect()` or `device_of()` in the test function, its decorators
  (a skipif), its class, the fixtures it takes, or any module-level name, function or class of its
  file (or of a helper module of tests/ it imports) that these name, followed through the names they
  name in turn. A test whose tensors follow the device (`DEV = "cuda" if torch.cuda.is_available()
  else "cpu"`) or that is skipped on a GPU asks; one written for CPU tensors only does not.

So, on every run where kernels are interpreted (CPU machines and CI, and the CPU children), a test that
launched interpreted kernels on CPU tensors fails unless it is marked `on_a_cpu`, or asks for the GPU as
above, or is marked `follows_gpu` (its tensors are put on the GPU by library code, e.g. a study that
picks its device itself). A new test file written for CPU tensors alone therefore fails here, on the CPU,
naming what to add, before it can fail on a GPU. What this cannot see: a test that asks for the GPU yet
makes CPU tensors anyway, and kernels launched in another process (those tests start their own process
and choose what it sees).
"""

from __future__ import annotations

import ast
import collections
import functools
import os
from pathlib import Path

import pytest
import torch

from cpu_child import MARK as CHILD_MARK

FOLLOWS_MARK = "follows_gpu"
GPU_QUESTIONS = ("cuda.is_available", "cuda.device_count", "env.detect", "device_of")
LAUNCHES: collections.Counter = collections.Counter()  # kernel name -> interpreted launches on CPU tensors
PHASES: collections.Counter = collections.Counter()  # the test's phase (setup, call, teardown) -> launches
NOW = {"phase": "call"}  # the phase the launches are counted in (set by the hooks below)
PHASE_WORDS = {"setup": "its fixtures' setup", "call": "its body", "teardown": "its fixtures' teardown"}


# ------------------------------------------------------------------------ counting interpreted launches

def count_interpreted_launches() -> bool:
    """Wrap Triton's interpreter launch so that each launch with a CPU tensor argument is counted in
    LAUNCHES (once per process). False where kernels are not interpreted or Triton is not installed.

    Triton fixes interpreted or compiled for its own helpers when it is imported, so this imports
    k3lab first (which sets TRITON_INTERPRET=1 where there is no GPU) and leaves Triton alone where
    kernels run compiled."""
    try:
        import k3lab  # noqa: F401
    except ImportError:  # a broken install: the tests say so themselves
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    grid = interpreter.GridExecutor
    if getattr(grid.__call__, "_k3lab_counted", False):
        return True
    launch = grid.__call__

    def counted(self, *args, **kwargs):
        if any(isinstance(a, torch.Tensor) and a.device.type == "cpu" for a in (*args, *kwargs.values())):
            LAUNCHES[getattr(self.fn, "__name__", "kernel")] += 1
            PHASES[NOW["phase"]] += 1
        return launch(self, *args, **kwargs)

    counted._k3lab_counted = True
    grid.__call__ = counted
    return True


# ------------------------------------------------------------------------ does the test ask for the GPU?

def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _asks_gpu(call: ast.Call) -> bool:
    name = _dotted(call.func)
    return any(name == q or name.endswith("." + q) for q in GPU_QUESTIONS)


def _bound_names(node: ast.AST) -> set[str]:
    """Names a top-level statement binds (a compound one: all bound anywhere in it)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


class Source:
    """A test module's top-level definitions by name, and the names it imports from helper modules of
    its own folder (kda_cases.py and the like)."""

    def __init__(self, path: Path):
        self.path = path
        tree = ast.parse(path.read_text(), str(path))
        self.defs: dict[str, list[ast.AST]] = collections.defaultdict(list)
        self.imports: dict[str, tuple[Path, str | None]] = {}  # local name -> (helper file, name or None)
        for stmt in tree.body:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                self._imports(stmt)
                continue
            for name in _bound_names(stmt):
                self.defs[name].append(stmt)

    def _imports(self, stmt) -> None:
        if isinstance(stmt, ast.ImportFrom):
            helper = self.path.parent / f"{stmt.module}.py" if stmt.module and not stmt.level else None
            if helper is not None and helper.exists():
                for a in stmt.names:
                    self.imports[a.asname or a.name] = (helper, a.name)
            return
        for a in stmt.names:
            helper = self.path.parent / f"{a.name}.py"
            if "." not in a.name and helper.exists():
                self.imports[a.asname or a.name] = (helper, None)

    def lookup(self, name: str, attr: str | None = None) -> list[tuple[Source, ast.AST]]:
        """The definitions `name` (or `name.attr`, for an imported helper module) refers to."""
        if name in self.imports:
            helper, inner = self.imports[name]
            if inner is None and attr is None:
                return []
            other = source(helper)
            return [(other, d) for d in other.defs.get(inner or attr, [])]
        return [(self, d) for d in self.defs.get(name, [])] if attr is None else []


@functools.lru_cache(maxsize=None)
def source(path: Path) -> Source:
    return Source(path)


def asks_for_gpu(path: Path, function: str, cls: str | None = None, fixtures=()) -> bool:
    """Whether the test `function` (a method of `cls`) of the file at `path`, with these fixture names,
    asks whether there is a GPU anywhere in the code it names (module docstring)."""
    src = source(Path(path))
    roots: list[tuple[Source, ast.AST]] = []
    if cls is not None:
        for c in src.defs.get(cls, []):
            roots += [(src, n) for n in c.body if not (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                                                       and n.name != function)]
            roots += [(src, d) for d in c.decorator_list]
    else:
        roots += src.lookup(function)
    conftest = Path(path).parent / "conftest.py"
    for name in fixtures:
        roots += src.lookup(name)
        if conftest.exists():
            roots += source(conftest).lookup(name)
    seen: set[int] = set()
    while roots:
        mod, node = roots.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call) and _asks_gpu(sub):
                return True
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                roots += mod.lookup(sub.id)
            elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                roots += mod.lookup(sub.value.id, sub.attr)
    return False


# ------------------------------------------------------------------------ the verdict on one test

def verdict(item) -> str | None:
    """None when the test is safe on a GPU machine as far as a CPU run can tell, else why not and what
    to do (the test then fails with it)."""
    launched = sum(LAUNCHES.values())
    if not launched or not isinstance(item, pytest.Function):  # a notebook cell's kernels run elsewhere
        return None
    if item.get_closest_marker(CHILD_MARK) or item.get_closest_marker(FOLLOWS_MARK):
        return None
    fn = getattr(item, "originalname", None) or item.name
    cls = item.cls.__name__ if getattr(item, "cls", None) is not None else None
    if asks_for_gpu(item.path, fn, cls, tuple(getattr(item, "fixturenames", ()))):
        return None
    kernels = ", ".join(f"{k} x{n}" for k, n in LAUNCHES.most_common(4))
    where = " and ".join(f"{n} in {PHASE_WORDS.get(p, p)}" for p, n in PHASES.items() if n)
    return (f"{item.nodeid} ran {launched} Triton launch(es) in the interpreter on CPU tensors ({kernels}; "
            f"{where}) "
            "and nothing in it asks whether there is a GPU: on a GPU machine these kernels run compiled and "
            "refuse CPU tensors, so this test would fail there. Mark it @on_a_cpu (from cpu_child import "
            "on_a_cpu; a file: pytestmark = on_a_cpu) to run it in a child that sees no GPU there; or make "
            "its tensors on the GPU where there is one (DEV = 'cuda' if torch.cuda.is_available() else "
            "'cpu'); or, where library code already puts them there, mark it @pytest.mark.follows_gpu. "
            "See tests/cpu_guard.py.")


# ------------------------------------------------------------------------ the hooks conftest.py takes in

def configure(config) -> None:
    config.addinivalue_line("markers", f"{FOLLOWS_MARK}: its tensors are made on the GPU where there is "
                            "one by code outside the test (tests/cpu_guard.py)")
    count_interpreted_launches()


def _enter(phase: str) -> None:
    NOW["phase"] = phase


def runtest_setup() -> None:
    """Before the test's fixtures are set up: from here its launches (its fixtures' too) are counted."""
    count_interpreted_launches()  # a no-op once done; here in case triton came in after configure
    LAUNCHES.clear()
    PHASES.clear()
    _enter("setup")


def runtest_call_start() -> None:
    _enter("call")


def runtest_call(item) -> None:
    """After the test's call passed: fail it if it (or a fixture it set up) needs the CPU child on a GPU
    machine and lacks it."""
    why = verdict(item)
    if why:
        pytest.fail(why, pytrace=False)


def runtest_teardown_start() -> None:
    """Before the test's fixtures are torn down: the launches judged after the call are not judged again."""
    LAUNCHES.clear()
    PHASES.clear()
    _enter("teardown")


def runtest_teardown(item) -> None:
    """After teardown: launches in a fixture's teardown (after its yield; a module-scoped one's at its
    file's last test) are judged as the call's are; the test then errors in teardown."""
    why = verdict(item)
    _enter("call")
    if why:
        pytest.fail(why, pytrace=False)
