"""Record the Triton launches an op makes, and turn each into what `triton.compile` needs for a target.

`capture()` replaces `JITFunction.run` for the duration of a `with` block: a launch is recorded (the
kernel, its arguments and options) and nothing runs, so an op's own launch code can be called on CPU
tensors of the real shapes. `compile_spec(launch, target)` then does what Triton's JIT does on a launch
(its binder: argument types, constexprs, divisibility / pointer-range attributes, options) for the given
target, with no GPU and no driver. Must run with TRITON_INTERPRET=0 (interpreted kernels are not
JITFunctions); `k3lab.isa.runner` starts its workers that way.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field

import triton
from triton.runtime.jit import JITFunction, create_function_from_signature


@dataclass
class Launch:
    """One recorded launch: kernel, positional and keyword arguments (constexprs and options among the
    keywords, as the op passed them), and the grid (resolved when it was a callable of the meta)."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    grid: tuple | None = None
    note: str = ""

    @property
    def name(self) -> str:
        """module.function of the kernel (its qualified name in the source)."""
        return f"{self.kernel.fn.__module__}.{self.kernel.fn.__qualname__}"


@dataclass
class Spec:
    """What `triton.compile(ASTSource(fn, signature, constexprs, attrs), target, options)` takes."""

    kernel: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str = ""
    meta: dict = field(default_factory=dict)  # num_warps, num_stages, the constexprs by name: for the report


@contextlib.contextmanager
def capture(out: list):
    """Record every JITFunction launch made inside the block into `out` (a list of Launch); none runs."""
    original = JITFunction.run

    def record(self, *args, grid=None, warmup=False, **kwargs):
        g = grid
        if callable(g):
            try:
                g = g(dict(zip(self.arg_names, args)) | kwargs)
            except Exception:  # a grid the meta cannot resolve here: recorded as unknown
                g = None
        out.append(Launch(self, args, kwargs, tuple(g) if g is not None else None))
        return None

    JITFunction.run = record
    try:
        yield out
    finally:
        JITFunction.run = original


def _jsonable(x):
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (tuple, list)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    return str(x)


def compile_spec(launch: Launch, target) -> Spec:
    """The compile inputs Triton's JIT would derive from this launch on `target` (a targets.Target)."""
    from triton.compiler import make_backend

    fn = launch.kernel
    backend = make_backend(target.gpu_target())
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    kwargs.setdefault("debug", False)
    kwargs.setdefault("instrumentation_mode", "")
    # options this backend does not have (launch_pdl is NVIDIA's) are dropped, and said so
    known = set(backend.parse_options({}).__dict__) | set(fn.arg_names)
    dropped = sorted(k for k in kwargs if k not in known)
    for k in dropped:
        kwargs.pop(k)
    bound, specialization, options = binder(*launch.args, **kwargs)
    opts, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    opt_dict = {k: v for k, v in opts.__dict__.items() if k != "extern_libs"}
    names = list(fn.arg_names)
    meta = {"num_warps": opts.num_warps, "num_stages": opts.num_stages,
            "constexprs": {names[p[0]]: _jsonable(v) for p, v in constexprs.items() if len(p) == 1}}
    if launch.grid is not None:
        meta["grid"] = list(launch.grid)
    if dropped:
        meta["dropped_options"] = dropped
    blob = json.dumps([fn.cache_key, target.name, triton.__version__, _jsonable(signature),
                       sorted((str(k), _jsonable(v)) for k, v in constexprs.items()),
                       sorted((str(k), _jsonable(v)) for k, v in attrs.items()), _jsonable(opt_dict)],
                      sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:24]
    return Spec(fn, signature, constexprs, attrs, opts.__dict__, key, meta)


def compile_kernel(spec: Spec, target):
    """triton.compile of a Spec for `target`: the CompiledKernel (asm dict, metadata)."""
    from triton.compiler import ASTSource

    src = ASTSource(spec.kernel, spec.signature, spec.constexprs, spec.attrs)
    return triton.compile(src, target=target.gpu_target(), options=spec.options)
