"""What a kernel loads and stores, seen from Triton's interpreter: a bounds guard for grading and an
access map for learners.

While `watch(kernel)` is active, every load and store an interpreted launch of `kernel` makes is
checked against the memory of the launch's tensor arguments: a lane whose mask is on and whose address
lies in none of them stops the launch with an `OutOfBounds` error naming the access (load or store), the
nearest argument and how far outside it lies, which the grader shows with the learner's line. Without
it a missing mask reads or writes past a small CPU tensor and may corrupt the notebook's memory.
With `record=True` the watch also notes, per argument element, which program loaded it and which stored
it (`Trace`), and `Trace.text()` draws both as character maps: the picture of which elements each of a
puzzle's programs touches.

It works by wrapping two methods of the interpreter's builder (`InterpreterBuilder.create_masked_load`
and `create_masked_store`, through which every pointer load and store passes) and a pre-run hook of the
interpreted kernel (which sees the launch's host tensors); both are restored when the watch ends. On a
Triton whose interpreter lacks them, `available()` says so and the watch checks nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

try:
    from triton.runtime.interpreter import InterpretedFunction, InterpreterBuilder
except ImportError:  # pragma: no cover - a Triton without the interpreter
    InterpretedFunction = InterpreterBuilder = None

MAP_ROWS, MAP_COLS = 24, 64  # the largest map drawn in full; larger tensors are drawn in part
PROGRAM_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
NONE, SHARED, MANY = -1, -2, -3  # an element no program touched, touched by several, by a program >= 62


class OutOfBounds(IndexError):
    """A load or store lane (mask on) whose address is outside every tensor argument of the launch."""


def available() -> tuple[bool, str]:
    """(ok, why): whether this Triton's interpreter has the hooks the watch uses."""
    if InterpreterBuilder is None:
        return False, "this Triton has no interpreter (triton.runtime.interpreter)"
    for name in ("create_masked_load", "create_masked_store"):
        if not hasattr(InterpreterBuilder, name):
            return False, f"this Triton's interpreter has no InterpreterBuilder.{name}"
    if not hasattr(InterpretedFunction, "add_pre_run_hook"):
        return False, "this Triton's interpreted kernels take no pre-run hook"
    return True, "the interpreter's loads and stores are watched"


@dataclass
class _Arg:
    name: str
    tensor: torch.Tensor
    lo: int  # first byte of its storage
    hi: int  # one past its last byte
    loaded: np.ndarray | None = None  # per element: the program that loaded it (or NONE, SHARED, MANY)
    stored: np.ndarray | None = None
    stored_twice: int = 0  # elements stored more than once (by one program or several)
    _stores: np.ndarray | None = None


@dataclass
class Trace:
    """The launches' tensor arguments and, when recorded, which program loaded and stored each element."""

    args: list[_Arg] = field(default_factory=list)
    launches: int = 0

    def text(self) -> str:
        """Per tensor argument: shape, dtype, elements loaded and stored, and two maps of its elements
        (1-D tensors wrapped at 64, others as [leading dims collapsed, last dim]): each element is the
        program that loaded (stored) it, 0-9 a-z A-Z for programs 0-61, '*' when several programs did,
        '.' when none did."""
        if not self.args:
            return "no launch was traced"
        lines = [f"{self.launches} launch(es). Maps: each element shows the program (0-9, a-z, A-Z: program "
                 "ids 0-61 in launch order) that touched it, '*' several programs, '.' none"]
        for a in self.args:
            t = a.tensor
            n = t.numel()
            dt = str(t.dtype).removeprefix("torch.")
            if a.loaded is None:
                lines.append(f"\n{a.name}: {list(t.shape)} {dt}")
                continue
            ld, st = int((a.loaded != NONE).sum()), int((a.stored != NONE).sum())
            note = f"; {a.stored_twice} element(s) stored more than once" if a.stored_twice else ""
            lines.append(f"\n{a.name}: {list(t.shape)} {dt}: loaded {ld} of {n}, stored {st} of {n}{note}")
            for what, owners, count in (("loaded by", a.loaded, ld), ("stored by", a.stored, st)):
                if count:
                    lines.append(f"  {what}:")
                    lines.extend(_char_map(owners, t))
        return "\n".join(lines)


def _char_map(owners: np.ndarray, t: torch.Tensor) -> list[str]:
    cols = MAP_COLS if t.dim() <= 1 else t.shape[-1]
    rows = -(-owners.size // cols)
    grid = np.full(rows * cols, " ", dtype="<U1")
    chars = np.array(list(PROGRAM_CHARS))
    own = owners
    grid[:own.size] = np.where(own >= 0, chars[np.clip(own, 0, len(chars) - 1)],
                               np.where(own == NONE, ".", np.where(own == SHARED, "*", "#")))
    grid = grid.reshape(rows, cols)
    more = " ..." if cols > MAP_COLS else ""
    out = ["    " + "".join(r[:MAP_COLS]).rstrip() + more for r in grid[:MAP_ROWS]]
    if rows > MAP_ROWS:
        out.append(f"    ... {rows - MAP_ROWS} more rows")
    return out


def _note(owners: np.ndarray, idx: np.ndarray, pid: int) -> None:
    """Mark elements idx as touched by program pid."""
    cur = owners[idx]
    mark = pid if pid < len(PROGRAM_CHARS) else MANY
    owners[idx] = np.where(cur == NONE, mark, np.where(cur == mark, mark, SHARED))


def _element_size(ptrs) -> int:
    ty = ptrs.get_element_ty()
    return max(1, ty.primitive_bitwidth // 8)


class _Watch:
    def __init__(self, record: bool):
        self.record = record
        self.trace = Trace()
        self.live: list[_Arg] = []

    def hook(self, names):
        def on_launch(*args, **kwargs):
            self.trace.launches += 1
            self.live = []
            values = list(zip(names, args)) + list(kwargs.items())
            for name, v in values:
                if isinstance(v, torch.Tensor):
                    st = v.untyped_storage()
                    arg = _Arg(name, v, st.data_ptr(), st.data_ptr() + st.nbytes())
                    known = next((a for a in self.trace.args if a.name == name and a.lo == arg.lo), None)
                    if known is None:
                        if self.record:
                            arg.loaded = np.full(v.numel(), NONE, dtype=np.int64)
                            arg.stored = np.full(v.numel(), NONE, dtype=np.int64)
                            arg._stores = np.zeros(v.numel(), dtype=np.int64)
                        self.trace.args.append(arg)
                        known = arg
                    self.live.append(known)
        return on_launch

    def access(self, builder, kind: str, ptrs, mask) -> None:
        addr = np.asarray(ptrs.data, dtype=np.int64).ravel()
        on = np.asarray(mask.data, dtype=bool).ravel()
        if on.size == 1 and addr.size > 1:
            on = np.broadcast_to(on, addr.shape)
        addr = addr[on]
        if addr.size == 0:
            return
        size = _element_size(ptrs)
        inside = np.zeros(addr.shape, dtype=bool)
        for a in self.live:
            hit = (addr >= a.lo) & (addr + size <= a.hi)
            inside |= hit
            if self.record and a.loaded is not None and hit.any() and a.tensor.is_contiguous():
                t = a.tensor
                rel = (addr[hit] - t.data_ptr()) // t.element_size()
                rel = rel[(rel >= 0) & (rel < t.numel())]
                x, y, z = builder.grid_idx
                gx, gy, _ = builder.grid_dim
                pid = x + gx * (y + gy * z)
                _note(a.loaded if kind == "load" else a.stored, rel, pid)
                if kind == "store":
                    np.add.at(a._stores, rel, 1)
                    a.stored_twice = int((a._stores > 1).sum())
        if not inside.all():
            raise OutOfBounds(self._explain(kind, addr[~inside], int(addr.size)))

    def _explain(self, kind: str, bad: np.ndarray, lanes: int) -> str:
        first = int(bad[0])
        near, gap = None, None
        for a in self.live:
            d = first - (a.hi - 1) if first >= a.hi else a.lo - first
            if gap is None or d < gap:
                near, gap = a, d
        where = ""
        if near is not None:
            size = near.tensor.element_size()
            if first >= near.hi:
                n = (first - near.hi) // size + 1
                where = f"; the first lies {n} element(s) past the end of {near.name}"
            else:
                n = (near.lo - first + size - 1) // size
                where = f"; the first lies {n} element(s) before {near.name}"
        return (f"a {kind} reaches outside every tensor argument: {bad.size} of its {lanes} active lanes"
                f"{where} (is a mask missing, or an offset wrong?)")


@contextlib.contextmanager
def watch(kernel, record: bool = False):
    """Check (and with record=True, count) the loads and stores of interpreted launches of `kernel`
    inside the block; yields the Trace. A kernel that is not interpreted, or a Triton without the
    hooks, is run unwatched (the Trace stays empty)."""
    ok, _ = available()
    if not ok or not isinstance(kernel, InterpretedFunction):
        yield Trace()
        return
    w = _Watch(record)
    hook = w.hook(list(kernel.arg_names))
    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store

    def masked_load(self, ptrs, mask, other, *args, **kwargs):
        w.access(self, "load", ptrs, mask)
        return load(self, ptrs, mask, other, *args, **kwargs)

    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        w.access(self, "store", ptrs, mask)
        return store(self, ptrs, value, mask, *args, **kwargs)

    kernel.add_pre_run_hook(hook)
    InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = masked_load, masked_store
    try:
        yield w.trace
    finally:
        InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store = load, store
        kernel.pre_run_hooks.remove(hook)
