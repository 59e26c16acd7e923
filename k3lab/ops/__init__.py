"""The optimized ops, one module or package per op (see each op's docstring for its contract).

The one backend contract every op follows:

* `Backend`: one implementation of an op, a row of the op's `BACKENDS` table: its name, its priority,
  `available()` -> (ok, why) for this machine, `verify(*inputs)` -> (ok, why) for one call's inputs,
  and `parts`, the op's callables this row provides, by name, read as attributes (`row.after(...)`).
  The names are one vocabulary over every op: `after` (the optimized form), `before` (the article's
  original kernel, with after's signature), `plan_after` / `plan_before` where the op binds once and
  launches many times, and an op's own further pieces (its docstring lists them). The plain-PyTorch
  reference is a row of its own (named 'torch' where it is one); it provides both `before` and
  `after`, since the reference computes what both compute.
* `Backends`: the table itself, with the one chooser. `select(backend, *inputs, need=)` -> (row,
  why): the row named by the caller's `backend=` argument, else by the op's environment variable
  K3LAB_<OP>_BACKEND (read here and nowhere else), which must run these inputs and provide the
  callable `need` (`BackendUnavailable` saying why not); else the first by priority that is available,
  provides `need` and takes the inputs (K3LAB_<OP>_BACKEND naming a row without `need` forces
  nothing for that callable). `pick(...)` is the row alone, `choose(...)` -> (name, why).
  A name outside the table is a ValueError naming the argument or the variable. A face calls the row
  it picked (`BACKENDS.pick(backend, x.device, need="after").after(x, w)`) and compares no names.

The ops read the process environment only here: `setting(name)` (a variable's value, as K3LAB_KERNEL_CACHE,
CUDA_HOME, K3LAB_KDA_VERIFY_PDL), `environment()` (a copy for a compiler's child process), and the
backend tables' K3LAB_<OP>_BACKEND; whether Triton is interpreted is `k3lab.env.triton_interpreted()`.

Also shared by the op packages: `triton_status`, `triton_runs_on` (Triton kernels on a device's tensors:
compiled on a GPU, the interpreter on a CPU), and the argument rules every op applies the same way:
`expect` (a tensor's type, shape, dtype, device and layout; `NotATensor` for a non-tensor),
`positive_finite` (scales and epsilons), `int_arg` (lengths, counts and indices: integers, never bools
or floats, within their range), `int_list` (a list of them, each by int_arg's rule) and `check_finite`
(tensors whose NaN or infinity an op would spread beyond the rows it belongs to; one device sync,
skipped under CUDA-graph capture, so a captured path checks when it is bound).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from k3lab import env
from k3lab.runtime.args import int_arg as int_arg, int_list as int_list  # the one rule, as ops.int_arg

FP32_TINY, FP32_MAX = 2.0 ** -126, (2.0 - 2.0 ** -23) * 2.0 ** 127  # fp32's normal range (kernel scalars)


def positive_finite(name: str, value) -> float:
    """`value` as a float; ValueError naming `name` unless it is a real number (not a bool, not a
    tensor, which would cost a host sync), finite and > 0, and a normal fp32 number (the kernels take
    it in fp32, where 1e39 is inf and 1e-45 is 0). The one rule for the scales and epsilons of every
    op and backend: a NaN scale gives an all-NaN output, a negative one a different softmax, a
    negative eps a NaN norm, and the references and the CUDA backends refuse them."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not FP32_TINY <= value <= FP32_MAX):
        raise ValueError(f"{name} must be a positive finite number within fp32's normal range "
                         f"[{FP32_TINY:.3g}, {FP32_MAX:.3g}], got {value!r}")
    return float(value)




def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no value can be read back then). A capture
    needs CUDA initialized in this process; asking nothing of CUDA before that keeps this safe to call
    on any machine."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_finite(why: str, tensors: Mapping[str, torch.Tensor], *, neg_inf_ok: tuple[str, ...] = ()) -> None:
    """ValueError naming the first of `tensors` (name -> tensor) that holds a NaN or an infinity (-inf is
    allowed for the names in `neg_inf_ok`), with the index of its first such value and `why` the op
    refuses it. Cost: one sum per tensor and one device sync for all of them together (an exact
    element-wise look only where a sum is not finite, which finite values rarely cause). Under CUDA-graph
    capture nothing can be read, so nothing is checked: a captured path checks when it is bound."""
    if capturing() or not tensors:
        return
    names = list(tensors)
    sums = []
    for name in names:
        t = tensors[name]
        if name in neg_inf_ok:
            t = t.masked_fill(t == -math.inf, 0)
        sums.append(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).double())
    finite = torch.isfinite(torch.stack([s.to(sums[0].device) for s in sums])).tolist()  # the one sync
    for name, ok in zip(names, finite):
        if ok:
            continue
        t = tensors[name]
        bad = torch.isnan(t) | (t == math.inf) if name in neg_inf_ok else ~torch.isfinite(t)
        where = bad.nonzero()
        if where.numel():
            kind = "NaN or +inf" if name in neg_inf_ok else "NaN or an infinity"
            raise ValueError(f"{name} holds {kind} (first at index {where[0].tolist()}): {why}")


def _dtype_names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


class NotATensor(TypeError, ValueError):
    """`expect`'s refusal of an argument that is not a tensor: a TypeError (the wrong type), and a
    ValueError too, for callers that take every refusal of a bad argument as one."""


def expect(name: str, t, *, shape=None, dtype=None, device=None, contiguous: bool | str = False,
           what: str = "") -> torch.Tensor:
    """`t`, checked: the one tensor check of every op. An error naming `name` and what was expected, at
    the first thing that differs (metadata only: no value is read, nothing waits for the device):
    `NotATensor` (a TypeError, and a ValueError) for what is not a tensor, ValueError for the rest.

    shape: an int (the number of dimensions) or a sequence of sizes, None for a free one; dtype: a dtype
    or a tuple of them, or 'float' for any floating-point dtype; device: the device t must be on;
    contiguous: True for t.is_contiguous(), 'last' for a stride-1 last dimension (a last dimension of
    size 1 passes); what: how the caller writes the expected shape in messages ("[N, H, LAT]")."""
    desc = f" {what}" if what else ""
    if not isinstance(t, torch.Tensor):
        raise NotATensor(f"{name} must be a torch.Tensor{desc}, got {type(t).__name__}")
    if isinstance(shape, int):
        if t.dim() != shape:
            raise ValueError(f"{name} must be a {shape}-D tensor{desc}, got shape {tuple(t.shape)}")
    elif shape is not None:
        want = tuple(shape)
        if t.dim() != len(want) or any(w is not None and w != n for w, n in zip(want, t.shape)):
            spec = what or "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
            raise ValueError(f"{name} must be {spec}, got {tuple(t.shape)}")
    if dtype == "float":
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    elif dtype is not None:
        dtypes = dtype if isinstance(dtype, (tuple, list, set, frozenset)) else (dtype,)
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must be {_dtype_names(dtypes)}, got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {torch.device(device)}, got {t.device}")
    if contiguous == "last":
        if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a stride-1 last dim, got strides {tuple(t.stride())}")
    elif contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(t.stride())} (call .contiguous())")
    return t


def setting(name: str, default: str | None = None) -> str | None:
    """The environment variable `name`, or `default` when it is unset or empty."""
    return os.environ.get(name) or default


def environment() -> dict[str, str]:
    """A copy of the process environment (for a child process such as a kernel compiler)."""
    return dict(os.environ)


class BackendUnavailable(ValueError, RuntimeError):
    """A backend asked for by name cannot run here, or none of an op's backends takes a call's inputs
    (the message says why). A ValueError (it is about the caller's choice) and, for callers that
    catch a machine's limits, a RuntimeError."""


def takes_all(*_inputs, **_options) -> tuple[bool, str]:
    """The verifier of a backend that takes every input its op validates."""
    return True, ""


@dataclass(frozen=True)
class Backend:
    """One implementation of an op (a row of its `BACKENDS` table).

    name: what `backend=` and K3LAB_<OP>_BACKEND take. priority: lower is tried first; an int, or a
    function of the call's inputs (the same arguments as `verify`) where the best choice differs
    between GPU and CPU tensors. available() -> (ok, why): whether it runs on this machine at all
    (installed, built, a device present). verify(*inputs, **options) -> (ok, why): whether it takes one
    call's (validated) inputs. parts: the op's own pieces this backend provides, by name."""

    name: str
    priority: int | Callable[..., int]
    available: Callable[[], tuple[bool, str]]
    verify: Callable[..., tuple[bool, str]] = takes_all
    parts: Mapping[str, Callable] = field(default_factory=dict, compare=False)

    def rank(self, *inputs, **options) -> int:
        return self.priority(*inputs, **options) if callable(self.priority) else self.priority

    def provides(self, name: str | None) -> bool:
        """Whether this row carries the callable `name` (None: any row does)."""
        return name is None or name in self.parts

    def __getattr__(self, name: str):
        # row.after, row.plan_before, ...: the row's callables (module docstring)
        parts = self.__dict__.get("parts") or {}
        if name in parts:
            return parts[name]
        raise AttributeError(f"backend {self.__dict__.get('name')!r} provides no {name!r} "
                             f"(it provides {sorted(parts)})")


class Backends:
    """An op's backend table (module docstring): rows by name, iterated in declaration order."""

    def __init__(self, op: str, *rows: Backend):
        names = tuple(b.name for b in rows)
        if not rows or len(set(names)) != len(names) or not all(isinstance(b, Backend) for b in rows):
            raise ValueError(f"{op}: a table needs Backend rows with distinct names, got {names}")
        self.op, self.rows, self.names = op, rows, names
        self.env = f"K3LAB_{op.upper()}_BACKEND"

    def __iter__(self) -> Iterator[Backend]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __contains__(self, name) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> Backend:
        if name not in self.names:
            raise KeyError(f"{self.op} has no backend {name!r}; backends: {self.names}")
        return self.rows[self.names.index(name)]

    def __repr__(self) -> str:
        return f"Backends({self.op!r}, {', '.join(self.names)})"

    def status(self) -> dict[str, tuple[bool, str]]:
        """name -> available() on this machine, in declaration order."""
        return {b.name: b.available() for b in self.rows}

    def check(self, name: str, *inputs, need: str | None = None, **options) -> tuple[bool, str]:
        """(ok, why) for backend `name`: providing the callable `need`, available here, then (with
        inputs) taking them."""
        b = self[name]
        if not b.provides(need):
            return False, f"backend {name!r} provides no {need} (it provides {sorted(b.parts)})"
        ok, why = b.available()
        if not ok:
            return False, why
        ok, refusal = b.verify(*inputs, **options)
        return ok, refusal or why

    def forced(self, backend: str | None = None, *, arg: str = "backend") -> tuple[str | None, str]:
        """(name, where): the name forced by the argument `backend`, else by K3LAB_<OP>_BACKEND, else
        None; where names the argument or the variable. ValueError naming it for a name not in the
        table."""
        name, where = backend, arg
        if name is None:
            name, where = setting(self.env), self.env
        if name is not None and name not in self.names:
            raise ValueError(f"{where} must be one of {self.names} or None, got {name!r}")
        return name, where

    def select(self, backend: str | None = None, *inputs, need: str | None = None, arg: str = "backend",
               **options) -> tuple[Backend, str]:
        """(row, why) of the backend that runs these inputs and provides the callable `need` (module
        docstring); `arg` names the caller's argument in errors."""
        name, where = self.forced(backend, arg=arg)
        if name is not None and backend is None and not self[name].provides(need):
            name = None  # the variable forces the rows that provide `need`; this one does not
        if name is not None:
            ok, why = self.check(name, *inputs, need=need, **options)
            if not ok:
                raise BackendUnavailable(f"{where}={name!r} cannot run here: {why}")
            return self[name], f"{why} (forced by {where})" if why else f"forced by {where}"
        refused = []
        for b in self.ranked(*inputs, need=need, **options):
            ok, why = self.check(b.name, *inputs, need=need, **options)
            if ok:
                return b, why + (f" (not {'; '.join(refused)})" if refused else "")
            refused.append(f"{b.name}: {why}")
        what = f" provides {need} and" if need else ""
        raise BackendUnavailable(f"no {self.op} backend{what} runs here: {'; '.join(refused) or 'none'}")

    def ranked(self, *inputs, need: str | None = None, **options) -> list[Backend]:
        """The rows that provide the callable `need`, in the order `select` tries them for these inputs
        (for a caller that names what runs in place of the first: `check` each in turn)."""
        return sorted((b for b in self.rows if b.provides(need)), key=lambda b: b.rank(*inputs, **options))

    def pick(self, backend: str | None = None, *inputs, need: str | None = None, arg: str = "backend",
             **options) -> Backend:
        """The row `select` chooses (what a face calls)."""
        return self.select(backend, *inputs, need=need, arg=arg, **options)[0]

    def choose(self, backend: str | None = None, *inputs, need: str | None = None, arg: str = "backend",
               **options) -> tuple[str, str]:
        """(name, why) of the row `select` chooses."""
        row, why = self.select(backend, *inputs, need=need, arg=arg, **options)
        return row.name, why


def triton_and_torch(op: str, triton_parts: Mapping[str, Callable], torch_parts: Mapping[str, Callable], *,
                     verify: Callable[..., tuple[bool, str]] | None = None, torch_why: str = "plain PyTorch",
                     priorities: tuple = (None, None)) -> Backends:
    """The table of an op with one Triton kernel and a plain-PyTorch reference: a 'triton' row (available
    where Triton runs, `verify` or `triton_runs_on` for the inputs) and a 'torch' row that is the
    reference and the before (its `after` is also its `before`: the unfused PyTorch ops the step runs
    without the kernel). priorities: the rows' (triton, torch) priorities; by default `gpu_first` /
    `cpu_first` (the first argument of verify is then the inputs' device)."""
    tri, ref = priorities
    reference = dict(torch_parts)
    if "after" in reference:
        reference.setdefault("before", reference["after"])
    return Backends(op, Backend("triton", gpu_first if tri is None else tri, triton_available,
                                verify or triton_runs_on, parts=dict(triton_parts)),
                    Backend("torch", cpu_first if ref is None else ref, lambda: (True, torch_why),
                            parts=reference))


def triton_status() -> tuple[bool, str]:
    """(True, Triton's version) when Triton imports here (GPU, or its interpreter on CPU), else (False,
    why)."""
    try:
        import triton
    except ImportError:
        return False, "Triton is not installed"
    return True, f"Triton {triton.__version__} kernels"


def triton_available() -> tuple[bool, str]:
    """(ok, why) for Triton kernels on this machine: installed, and a GPU or the interpreter."""
    ok, why = triton_status()
    if not ok:
        return ok, why
    if env.triton_interpreted():
        return True, f"{why} in Triton's interpreter (CPU)"
    if torch.cuda.is_available():
        return True, f"{why} compiled for this GPU"
    return False, "no GPU and Triton's interpreter is off (TRITON_INTERPRET=1 runs the kernels on CPU)"


def device_of(device=None) -> torch.device:
    """`device` as a torch.device; None: the GPU when there is one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_runs_on(device=None) -> tuple[bool, str]:
    """(ok, why) for Triton kernels on tensors of `device` (`device_of`): compiled on GPU tensors, in
    Triton's interpreter on CPU tensors (slow: small sizes, tests)."""
    ok, why = triton_status()
    if not ok:
        return ok, why
    dev = device_of(device)
    if dev.type == "cuda":
        return (True, f"{why} compiled for this GPU") if torch.cuda.is_available() else (False, "no GPU")
    if env.triton_interpreted():
        return True, "Triton's interpreter on CPU tensors (slow: small sizes only)"
    return False, (f"{dev.type} tensors and TRITON_INTERPRET is not 1 (the kernels run compiled on GPU "
                   "tensors)")


def gpu_first(device=None, *_inputs, **_options) -> int:
    """A Triton backend's priority where the plain-PyTorch one serves CPU tensors: first on GPU tensors,
    second on CPU tensors (Triton's interpreter there is for tests)."""
    return 0 if device_of(device).type == "cuda" else 1


def cpu_first(device=None, *_inputs, **_options) -> int:
    """The plain-PyTorch backend's priority beside a `gpu_first` Triton one."""
    return 1 - gpu_first(device)
