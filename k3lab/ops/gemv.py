"""One-row products y = x @ w^T for a decode step's dense projections: one Triton launch (x [1, K]).

    y = gemv(x, w)            # x [1, K], w [N, K] (row-major, contiguous rows) -> y [1, N] in x's dtype
    y = gemv(x, wq, scale=s)  # wq [N, K] float8_e4m3fn, s [N] fp32 row scales: y = (x @ wq^T) * s
    ys = gemv_stack(x, [(w0, None), (wq, s)])  # several weights that read one x, in one launch
    y = gemv(gu, w, glu=True)  # gu [1, 2K] = gate | up: y = SiTU-GLU(gu) @ w^T, the activation in-kernel
    GemvWeight(w)(x)          # the kernel for one row, torch.matmul for more (what the step holds)

Why: at B = 1 a projection reads its whole weight to make one row, so it is a pure weight stream,
and a matrix library's one-row products stream the narrow matrices (the 896-row router and sharded
up_proj, MLA's q_b) far below the copy bandwidth (figures: docs/decode_step.md).
A program here owns BLOCK_N whole rows of w, streams them in BLOCK_K columns with one fp32
accumulator tile, and reduces once at the end; there is no split of K, so no second launch or
atomics, and each output is one fixed-order sum (the same from run to run).

FP8 weights (W8A16): with `scale`, w is float8_e4m3fn (k3lab.engine.fp8's per-row quantization) and the
kernel reads a byte per weight, widens it to fp32 in registers and applies the row's scale to the sum;
the activation stays in its dtype. At one row the product is a weight stream, so half the bytes is what
the FP8 form buys; the W8A8 alternative (quantize the activation, then an FP8 matmul) adds the
activation's quantization launches to every projection, which at one row cost more than they save.

SiTU-GLU input (`glu=True`): x is a gate|up row [1, 2K] and each program computes SiTU-GLU of its K
block as it loads it (k3lab.ops.triton_math.situ, rounded to x's dtype as the SiTU-GLU kernel rounds
its output), so the MLP's activation and its down projection are one launch with the same result
as the two (the shared expert's down_proj at B = 1).

Block shapes: on a GPU `triton.autotune` picks them per (N, K) among `gpu_blocks()` on the first call (so
call once before capturing a CUDA graph; K is a compile-time constant: one build per width); in
Triton's interpreter (CPU tensors, tests) one small shape runs. fp32 accumulation whatever the dtype;
bf16 rounded to nearest even, also in the interpreter. How it compares with cuBLAS per projection:
docs/decode_step.md and the probe.gemv.* records under profiles/<device>/decode_step/. On AMD targets
it is compiled by the ISA report, not yet run on AMD hardware by this project.
Backends (`BACKENDS`, k3lab.ops' contract): 'triton' (this kernel, also on CPU tensors in Triton's
interpreter) and 'torch' (`reference`: x @ w.t(), FP8 weights widened to fp32); backend= or
K3LAB_GEMV_BACKEND forces one.
"""

from __future__ import annotations

import torch

from k3lab import env
from k3lab.nn.situ import situ_glu
from k3lab.ops import expect, triton_and_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still runs; available() says why this one does not
    triton = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8 = getattr(torch, "float8_e4m3fn", None)


# Triton's interpreter (CPU): one fixed shape, wide enough that a step-sized product takes seconds, not
# minutes (the interpreter pays per program and per loop step); the tests' shapes still mask rows and
# columns and loop over K twice
INTERPRETER_BLOCKS = {"BLOCK_N": 64, "BLOCK_K": 128}


# (BLOCK_N, BLOCK_K, warps) the autotuner tries on a GPU: from one row per program with long K
# strides (few, tall matrices) to 16 rows with short ones; a small set keeps the first call short
# (FP8 weights are half the bytes per column, so the widest K blocks serve them)
GPU_BLOCKS = ((1, 2048, 4), (2, 1024, 4), (2, 2048, 4), (4, 1024, 4), (4, 2048, 8), (8, 512, 4), (8, 1024, 8),
              (16, 512, 8), (2, 4096, 8), (4, 4096, 8))
# 64-lane AMD targets (gfx942, gfx950): the shapes whose accumulator tiles compile without spilling
# there under Triton 3.6 and 3.9 (the ISA report; wider ones spill on gfx942); not yet run on AMD
# hardware by this project
AMD_BLOCKS = ((1, 2048, 4), (2, 1024, 4), (4, 1024, 4), (4, 2048, 8))


def gpu_blocks() -> tuple:
    """The block shapes the autotuner tries on this machine's GPU: AMD_BLOCKS on ROCm, else GPU_BLOCKS."""
    from k3lab import env

    return AMD_BLOCKS if env.detect().backend == "rocm" else GPU_BLOCKS


def _configs():
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in gpu_blocks()]


if triton is not None:
    from k3lab.nn.situ import GATE_BOUND, UP_BOUND
    from k3lab.ops.triton_math import launch_rows, round_to, situ

    _GATE, _UP = tl.constexpr(GATE_BOUND), tl.constexpr(UP_BOUND)

    @triton.jit
    def _rows(x_ptr, w_ptr, scale_ptr, y_ptr, N, K: tl.constexpr, stride_w, block, HAS_SCALE: tl.constexpr,
              INT_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              GLU: tl.constexpr = False):
        # rows [block * BLOCK_N, +BLOCK_N) of y = x @ w^T (times their scales)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            kmask = kk < K
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + kk[None, :],
                        mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_ptr + kk, mask=kmask, other=0.0)
            if GLU:  # x holds gate | up: the input is SiTU-GLU of the pair, rounded to x's dtype
                u = tl.load(x_ptr + K + kk, mask=kmask, other=0.0)
                x = round_to(situ(x.to(tl.float32), u.to(tl.float32), _GATE, _UP),
                             x_ptr.dtype.element_ty, INT_ROUND)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_SCALE:
            y *= tl.load(scale_ptr + rn, mask=nmask, other=0.0)
        tl.store(y_ptr + rn, round_to(y, y_ptr.dtype.element_ty, INT_ROUND), mask=nmask)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, scale_ptr, y_ptr, N, K: tl.constexpr, stride_w, HAS_SCALE: tl.constexpr,
                     INT_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GLU: tl.constexpr):
        _rows(x_ptr, w_ptr, scale_ptr, y_ptr, N, K, stride_w, tl.program_id(0), HAS_SCALE, INT_ROUND,
              BLOCK_N, BLOCK_K, GLU)

    @triton.jit
    def _stack_kernel(x_ptr, w0, s0, y0, N0, st0, w1, s1, y1, N1, st1, w2, s2, y2, N2, st2,
                      K: tl.constexpr, SCALE0: tl.constexpr, SCALE1: tl.constexpr, SCALE2: tl.constexpr,
                      INT_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # up to three weights read by one x, one after the other in the grid: each program one's rows
        pid = tl.program_id(0)
        b0 = tl.cdiv(N0, BLOCK_N)
        b1 = tl.cdiv(N1, BLOCK_N)
        if pid < b0:
            _rows(x_ptr, w0, s0, y0, N0, K, st0, pid, SCALE0, INT_ROUND, BLOCK_N, BLOCK_K)
        elif pid < b0 + b1:
            _rows(x_ptr, w1, s1, y1, N1, K, st1, pid - b0, SCALE1, INT_ROUND, BLOCK_N, BLOCK_K)
        else:
            _rows(x_ptr, w2, s2, y2, N2, K, st2, pid - b0 - b1, SCALE2, INT_ROUND, BLOCK_N, BLOCK_K)

    _gemv_tuned = triton.autotune(configs=_configs(), key=["N", "K"])(_gemv_kernel)
    _stack_tuned = triton.autotune(configs=_configs(), key=["N0", "N1", "N2", "K"])(_stack_kernel)


def _after_triton(x, w, scale, glu, N, K):
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    if N and K:
        launch(x, w, y, None, scale=scale, glu=glu)
    elif N:
        y.zero_()
    return y


def _stack_triton(x, parts):
    ys = [torch.empty(1, w.shape[0], dtype=x.dtype, device=x.device) for w, _ in parts]
    if not sum(w.shape[0] for w, _ in parts):
        return ys
    if not x.shape[1]:
        return [y.zero_() for y in ys]
    launch_stack(x, parts, ys)
    return ys


def _after_torch(x, w, scale, glu, N, K):
    return reference(situ_glu(*x.chunk(2, dim=-1)) if glu else x, w, scale)


def _stack_torch(x, parts):
    return [reference(x, w, sc) for w, sc in parts]


# callables (on checked inputs): after(x, w, scale, glu, N, K) -> y; stack(x, parts) -> [y_i]. The torch
# row is the reference and the before (a matrix library's one-row product, what the step runs without
# this kernel).
BACKENDS = triton_and_torch("gemv", {"after": _after_triton, "stack": _stack_triton},
                            {"after": _after_torch, "stack": _stack_torch}, torch_why="torch.matmul",
                            priorities=(0, 1))
BACKEND_ENV = BACKENDS.env


def _check(x, w, scale=None, glu: bool = False) -> tuple[int, int]:
    expect("x", x, shape=2, dtype=DTYPES, what="[1, K]")
    expect("w", w, shape=2, dtype=DTYPES if scale is None else FP8, what="[N, K]")  # FP8 with a scale
    if x.shape[0] != 1:
        raise ValueError(f"x must hold one row [1, K], got {tuple(x.shape)} (GemvWeight takes more rows)")
    N, K = w.shape
    what = f"[1, 2 x {K}] (gate | up, glu=True)" if glu else f"[1, {K}]"
    expect("x", x, shape=(1, K * (2 if glu else 1)), dtype=w.dtype if scale is None else None,
           device=w.device, what=what)  # w's K, dtype and device
    if scale is not None:
        expect("scale", scale, dtype=torch.float32, device=w.device, contiguous=True)
        if scale.numel() < N:
            raise ValueError(f"scale must be a contiguous fp32 tensor of at least N={N} row scales, got "
                             f"{tuple(scale.shape)}")
    expect("w", w, contiguous="last")
    expect("x", x, contiguous="last")
    return N, K


def gemv(x: torch.Tensor, w: torch.Tensor, *, scale: torch.Tensor | None = None, glu: bool = False,
         backend: str | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ w[N, K]^T in x's dtype, times scale[n] per output where `scale` is given
    (w then float8_e4m3fn: module docstring); glu=True: x is [1, 2K] (gate | up) and the product's
    input is its SiTU-GLU. ValueError before any kernel."""
    N, K = _check(x, w, scale, glu)
    return BACKENDS.pick(backend, x.device, need="after").after(x, w, scale, glu, N, K)


def gemv_stack(x: torch.Tensor, parts, *, backend: str | None = None) -> list[torch.Tensor]:
    """[x @ w_i^T (times scale_i)] for parts = [(w_i, scale_i or None), ...] (one to three weights of
    x's width; bf16 / fp16 / fp32 ones of x's dtype, or float8_e4m3fn with their row scales, mixed
    freely) in ONE launch: the programs of all parts in one grid, each streaming its part's rows, so
    projections that read the same activation cost one launch and fill the GPU together. Outputs [1,
    N_i] in x's dtype; ValueError before any kernel."""
    parts = list(parts)
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"parts must hold one to three (weight, scale) pairs, got {len(parts)}")
    for i, part in enumerate(parts):
        if not (isinstance(part, tuple) and len(part) == 2):
            raise ValueError(f"parts[{i}] must be a (weight, scale or None) pair, got {type(part).__name__}")
        _check(x, *part)
    return BACKENDS.pick(backend, x.device, need="stack").stack(x, parts)


def _interpreted() -> bool:
    return env.triton_interpreted()  # Triton's interpreter: one fixed shape, bf16 rounded with integers


INTERPRETER_SHAPE = (INTERPRETER_BLOCKS["BLOCK_N"], INTERPRETER_BLOCKS["BLOCK_K"], 1)


def launch_stack(x, parts, ys, blocks: tuple[int, int, int] | None = None, *,
                 int_round: bool | None = None) -> None:
    """One launch of the stacked kernel on checked inputs (`gemv_stack`): autotuned (blocks None, a GPU),
    with fixed (BLOCK_N, BLOCK_K, warps), or the interpreter's shape (blocks None, CPU tensors).
    int_round: None rounds bf16 with integers where interpreted."""
    full = list(parts) + [(parts[0][0][:0], None)] * (3 - len(parts))  # absent parts: no rows, no programs
    ys_full = list(ys) + [ys[0][:, :0]] * (3 - len(ys))
    args = [x]
    for (w, sc), y in zip(full, ys_full):
        args += [w, w if sc is None else sc, y, w.shape[0], w.stride(0)]
    common = {f"SCALE{i}": sc is not None for i, (_, sc) in enumerate(full)}
    common["INT_ROUND"] = _interpreted() if int_round is None else int_round
    programs = lambda bn: sum(triton.cdiv(w.shape[0], bn) for w, _ in full)  # noqa: E731
    launch_rows(_stack_tuned, _stack_kernel, programs, (*args, x.shape[1]), common, blocks=blocks,
                fallback=INTERPRETER_SHAPE, tune=not _interpreted())


def reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The torch backend: x @ w.t(), or for FP8 weights the fp32 product of the widened weight times
    the row scales, cast to x's dtype."""
    if scale is None:
        return x @ w.t()
    return ((x.float() @ w.float().t()) * scale.reshape(-1)[:w.shape[0]]).to(x.dtype)


def launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, blocks: tuple[int, int, int] | None, *,
           int_round: bool | None = None, scale: torch.Tensor | None = None, glu: bool = False) -> None:
    """One launch of the kernel on checked inputs: autotuned (blocks None, a GPU), with fixed (BLOCK_N,
    BLOCK_K, warps), one of `gpu_blocks()` on a GPU (what the autotuner picks among), or the
    interpreter's shape (blocks None, CPU tensors). int_round: None rounds bf16 with integers where
    interpreted."""
    N, K = w.shape
    common = {"HAS_SCALE": scale is not None, "GLU": glu,
              "INT_ROUND": _interpreted() if int_round is None else int_round}
    launch_rows(_gemv_tuned, _gemv_kernel, lambda bn: triton.cdiv(N, bn),
                (x, w, w if scale is None else scale, y, N, K, w.stride(0)), common, blocks=blocks,
                fallback=INTERPRETER_SHAPE, tune=not _interpreted())


class GemvWeight:
    """A projection weight [N, K] for the decode step: one-row inputs run `gemv`, more rows
    torch.matmul. `shape`, `dtype`, `device` and `t()` are the weight's, so code that reads them
    still works."""

    def __init__(self, weight: torch.Tensor):
        expect("weight", weight, shape=2, dtype=DTYPES, what="[N, K]")
        self.weight = weight.contiguous()

    shape = property(lambda self: self.weight.shape)
    dtype = property(lambda self: self.weight.dtype)
    device = property(lambda self: self.weight.device)

    def t(self) -> torch.Tensor:
        return self.weight.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1:
            return gemv(x, self.weight, backend="triton")
        return x @ self.weight.t()


__all__ = ["BACKENDS", "BACKEND_ENV", "GemvWeight", "gemv", "gemv_stack", "launch_stack", "reference"]
