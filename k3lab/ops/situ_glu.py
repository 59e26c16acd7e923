"""SiTU-GLU on the stacked gate|up projection: one read of gu, one write of out.

    out = situ_glu(g, u),   g, u = gu.chunk(2, dim=-1)
        = 4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)          (k3lab.nn.situ)

Contract: `situ_glu_stacked(gu, *, out=None, backend=None)`. gu [..., 2F] (any leading dims; the
last dim must have stride 1 and the leading dims must collapse to one row stride, as any row slice of
a contiguous buffer does: gu.view(-1, 2F) must work). fp32, fp16 or bf16 (fp64 on backend 'torch'
only). Returns [..., F] in gu's dtype; the math is fp32 (fp64 for fp64 input) with the bounds of
k3lab.nn.situ. out: a preallocated [..., F] tensor of gu's dtype and device (stride-1 last dim; it
must not overlap gu), written and returned. Bad input is a ValueError naming the argument, raised
before any kernel; nothing reads a value back to the host, so the call can be captured in a CUDA graph.

Backends (`BACKENDS`, k3lab.ops' contract: `backend=` or K3LAB_SITU_GLU_BACKEND forces one; a forced one
that cannot run here is a ValueError):
  triton  one launch, program = (row, column block): loads g and u, computes in fp32 registers,
          stores out. Compiled on GPU tensors; Triton's interpreter on CPU tensors when
          TRITON_INTERPRET=1 (tests; there bf16 is rounded with integer arithmetic, since the
          interpreter's cast truncates; both round to nearest even, as torch does).
  torch   k3lab.nn.situ.situ_glu on the two halves (the reference, ~12 elementwise kernels).
Default: triton on GPU tensors (fp64 on torch), torch on CPU tensors.

Why: the decode step runs this activation 93 times (92 shared experts + layer 0's dense MLP), each a
chain of small elementwise kernels; fused it is one small kernel.
`k3lab bench decode_step --cases glue` times both paths under a CUDA graph
(k3lab.studies.decode_step.glue).
"""

from __future__ import annotations


import torch

from k3lab import env
from k3lab.config import K3Config
from k3lab.nn.situ import GATE_BOUND, UP_BOUND, situ_glu
from k3lab.ops import expect, triton_and_torch, triton_runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still runs; BACKENDS says why this one does not
    triton = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 1024

if triton is not None:
    from k3lab.ops.triton_math import round_to, situ

    @triton.jit
    def _situ_glu_kernel(gu_ptr, out_ptr, gu_row_stride, out_row_stride, F,
                         GATE: tl.constexpr, UP: tl.constexpr, BLOCK: tl.constexpr, INT_ROUND: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        src = gu_ptr + row * gu_row_stride + cols
        g = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(src + F, mask=mask, other=0.0).to(tl.float32)
        y = situ(g, u, GATE, UP)
        tl.store(out_ptr + row * out_row_stride + cols, round_to(y, out_ptr.dtype.element_ty, INT_ROUND),
                 mask=mask)


def _triton_verify(device=None, dtype=None) -> tuple[bool, str]:
    if dtype is not None and dtype not in TRITON_DTYPES:
        return False, (f"gu: the triton backend takes fp32, fp16 or bf16, got {dtype} "
                       "(fp64 runs on backend='torch')")
    return triton_runs_on(device)


def _after_torch(gu: torch.Tensor, out: torch.Tensor | None, f: int) -> torch.Tensor:
    g, u = gu.chunk(2, dim=-1)
    y = situ_glu(g, u)
    return y if out is None else out.copy_(y)


def _after_triton(gu: torch.Tensor, out: torch.Tensor | None, f: int) -> torch.Tensor:
    if out is None:
        out = torch.empty((*gu.shape[:-1], f), dtype=gu.dtype, device=gu.device)
    return launch(gu, out, f)


# callables (on checked inputs): after(gu, out or None, F) -> out. The torch row is the reference and the
# before (the chain of elementwise kernels the step runs unfused).
BACKENDS = triton_and_torch("situ_glu", {"after": _after_triton}, {"after": _after_torch},
                            verify=_triton_verify, torch_why="plain PyTorch (k3lab.nn.situ.situ_glu)")
BACKEND_ENV = BACKENDS.env


def _rows(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """t as a [rows, width] view (same storage); ValueError when no such view exists."""
    expect(name, t, contiguous="last")
    try:
        return t.view(-1, width)
    except RuntimeError:
        raise ValueError(f"{name}'s leading dims must collapse to one row stride, got shape {tuple(t.shape)} "
                         f"strides {tuple(t.stride())} (call .contiguous())") from None


def check(gu, out=None) -> int:
    """Validate gu (and out) for every backend alike; returns F. Reads only metadata (no host sync)."""
    expect("gu", gu, what="[..., 2F]")
    if gu.dim() < 1 or gu.shape[-1] % 2:
        raise ValueError(f"gu must be [..., 2F] (an even last dim: gate | up), got shape {tuple(gu.shape)}")
    expect("gu", gu, dtype=DTYPES)
    f = gu.shape[-1] // 2
    if out is not None:  # gu's leading dims and F, gu's dtype and device
        want = (*gu.shape[:-1], f)
        expect("out", out, shape=want, dtype=gu.dtype, device=gu.device,
               what=f"{want} (gu's leading dims, F = {f})")
    for name, t, width in (("gu", gu, 2 * f), ("out", out, f)):
        if t is not None and t.numel():
            _rows(name, t, width)
    return f


def situ_glu_stacked(gu: torch.Tensor, *, out: torch.Tensor | None = None,
                     backend: str | None = None) -> torch.Tensor:
    """SiTU-GLU of gu = [g | u] along the last dim: [..., 2F] -> [..., F] in gu's dtype (module docstring)."""
    f = check(gu, out)
    return BACKENDS.pick(backend, gu.device, gu.dtype, need="after").after(gu, out, f)


def launch(gu: torch.Tensor, out: torch.Tensor, f: int) -> torch.Tensor:
    """The Triton launch on checked inputs (`check`; gu's dtype in TRITON_DTYPES): out = SiTU-GLU(gu)."""
    if out.numel() == 0:
        return out
    src, dst = _rows("gu", gu, 2 * f), _rows("out", out, f)
    block = min(MAX_BLOCK, max(128, triton.next_power_of_2(f)))
    grid = (src.shape[0], triton.cdiv(f, block))
    _situ_glu_kernel[grid](src, dst, src.stride(0), dst.stride(0), f, GATE=GATE_BOUND, UP=UP_BOUND,
                           BLOCK=block, INT_ROUND=int(env.triton_interpreted()), num_warps=4)
    return out


# ---------------------------------------------------------------- the step's widths

def widths() -> dict[str, int]:
    """The TP8 widths this activation runs at: the shared experts' and layer 0's dense MLP's F."""
    cfg = K3Config.tp_slice(8)
    return {"shared_expert": cfg.shared_intermediate_size, "dense_mlp": cfg.intermediate_size}
