"""While a learner's function is graded, the library functions that compute the task's answer refuse to run.

    with refusing("resume_point", ["k3lab.cache.resume.resume_point"], also={...}):
        learner_fn(...)            # a call of resume_point in here raises Refused, one line

A task lists the library functions that answer it (`Task.forbidden`, dotted import paths; a method as
'module.Class.method'); the grader refuses those, the task's own solution and its reference for as long
as the learner's function runs, and nothing else: the cases and the reference are computed before, and
the same functions work again the moment the learner's function returns.

How: Python binds a name to a function object, wherever it was imported (`from k3lab.cache.resume
import resume_point` in a notebook and the module's own attribute are one object), so the refusal swaps
that object's `__code__` for a body that raises `Refused`, and puts the original back on the way out
(also when the learner's function raises or is interrupted). A call from any module, by any name, is
refused; nothing is slowed when no task is graded. The swap is process-wide: a call from another thread
while the learner's function runs is refused too. Objects that are not Python functions (a Triton
kernel) cannot be swapped: code that launches them asks `refusal(obj)` and raises it itself. A path
whose module cannot be imported on this machine (an optional backend) is skipped, since nothing can call
it; tests/test_workshop_grading.py checks that every path resolves, so a renamed function fails there.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from collections.abc import Iterable, Mapping

__all__ = ["Refused", "refusal", "refusing", "resolve", "target"]


class Refused(RuntimeError):
    """A library function called from a learner's function while the task it answers is graded."""


# id(function) -> (function, its own code); id(object) -> the refusal message, while a task is graded
_SWAPPED: dict[int, tuple[object, object]] = {}
_MESSAGES: dict[int, str] = {}


def resolve(path: str):
    """The object a dotted path names: the longest importable module prefix, then attributes (so
    'k3lab.speculative.costs.CycleCosts.cycle_us' works). ValueError naming the path otherwise."""
    if not isinstance(path, str) or "." not in path:
        raise ValueError(f"a forbidden function must be a dotted path 'module.name', got {path!r}")
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return obj
    raise ValueError(f"forbidden function {path!r} does not resolve to an object")


def target(obj):
    """The Python function whose code a call of `obj` runs (a method's function), or None for objects
    that have none to swap (a Triton kernel, a builtin)."""
    if isinstance(obj, (staticmethod, classmethod)) or inspect.ismethod(obj):
        obj = obj.__func__
    return obj if inspect.isfunction(obj) else None


def _refusing_code(fn, message: str):
    """A code object that raises Refused(message), with as many free variables as fn's code (a function's
    code can only be replaced by one with the same number)."""
    return _code(len(fn.__code__.co_freevars), message, fn.__qualname__)


@functools.lru_cache(maxsize=256)
def _code(n: int, message: str, qualname: str):
    names = [f"_v{i}" for i in range(n)]
    lines = ["def _outer():"] + [f"    {v} = None" for v in names] + ["    def refused(*args, **kwargs):"]
    if names:
        lines.append(f"        ({', '.join(names)},)")  # makes them free variables of refused
    # __import__ is a builtin, so the body needs nothing from the module whose function it replaces
    lines += [f"        raise __import__({__name__!r}, fromlist=['Refused']).Refused({message!r})",
              "    return refused"]
    scope: dict = {}
    exec(compile("\n".join(lines), f"<refused {qualname}>", "exec"), scope)  # noqa: S102 - our own text
    return scope["_outer"]().__code__


def refusal(obj) -> str | None:
    """The refusal message for `obj` while a task that forbids it is graded, else None."""
    return _MESSAGES.get(id(obj))


def message(task: str, label: str) -> str:
    return (f"{label}, refused while {task!r} is graded: it computes the task's answer; solve the task "
            f"without it (workshop.hint({task!r}) helps)")


@contextlib.contextmanager
def refusing(task: str, paths: Iterable[str] = (), also: Mapping[str, object] | None = None):
    """Within the block, calling any function named in `paths` (dotted) or given in `also` (label ->
    object) raises Refused with a one-line message naming it and `task`. Re-entrant: an object already
    refused by an outer block is left to it."""
    objects = []
    for p in paths:
        try:
            objects.append((p, resolve(p)))
        except ValueError:  # not importable here: nothing can call it (see the module docstring)
            continue
    objects += list((also or {}).items())
    mine: list[int] = []
    try:
        for label, obj in objects:
            key = id(obj)
            if key in _MESSAGES:
                continue
            text = message(task, label)
            fn = target(obj)
            if fn is not None:
                if id(fn) in _SWAPPED:
                    continue
                _SWAPPED[id(fn)] = (fn, fn.__code__)
                fn.__code__ = _refusing_code(fn, text)
                mine.append(id(fn))
            _MESSAGES[key] = text
            mine.append(key)
        yield
    finally:
        for key in reversed(mine):
            if key in _SWAPPED:
                fn, code = _SWAPPED.pop(key)
                fn.__code__ = code
            _MESSAGES.pop(key, None)
