"""Task of notebook 03 (copy removal and fusion): KDA's output epilogue, RMSNorm(o) * w * sigmoid(gate),
as one Triton kernel written from a skeleton.

In the unfused KDA decode this epilogue is its own kernel: the recurrence writes o to memory and the
norm reads it back. As one small kernel (one program per row, the row in registers) it is the piece a
fused decode folds in. The learner fills the holes of `SKELETON`; the wrapper beside the kernel is
complete. Rows are [rows, D] with D = 128 (KDA's head dim) and widths that are not a power of two, so
the column mask and the mean over D (not over the padded BLOCK) both matter. It runs compiled on GPU
tensors and in Triton's interpreter on CPU tensors (fp32 and fp16; bf16 casts truncate there).
Graded against `k3lab.nn.norms.gated_rms_norm` in fp64, and only when a Triton kernel of the learner's
launched during the call (`_core.kernel_launches`): the same numbers from plain PyTorch, or from a
kernel of k3lab's own, do not solve it.
"""

from __future__ import annotations

import copy

import torch
import triton
import triton.language as tl

from k3lab.nn.norms import gated_rms_norm

from ._core import Case, Mismatch, Task, kernel_launches
from .guard import Refused, refusal

EPS = 1e-5


@triton.jit
def _gated_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D                               # BLOCK is D rounded up to a power of two
    base = row * D
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(x * x, axis=0) / D                # padded columns are 0: they add nothing; divide by D
    rstd = 1.0 / tl.sqrt(ms + eps)
    y = x * rstd * w * tl.sigmoid(g)
    tl.store(out_ptr + base + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch(kernel, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = EPS
           ) -> torch.Tensor:
    """Run `kernel` (the skeleton's signature) over the rows of x [rows, D]: one program per row.
    Contiguous inputs of one dtype and device; returns out [rows, D] in x's dtype."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [rows, D] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(gate, torch.Tensor) or gate.shape != x.shape:
        raise ValueError(f"gate must have x's shape {tuple(x.shape)}, got {getattr(gate, 'shape', gate)}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got {getattr(weight, 'shape', weight)}")
    refused = refusal(kernel)  # a Triton kernel has no Python code to swap: the launch refuses it
    if refused:
        raise Refused(refused)
    x, gate, weight = x.contiguous(), gate.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    kernel[(x.shape[0],)](x, gate, weight, out, x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def gated_norm_solution(x, gate, weight, eps=EPS):
    """The reference solution: the kernel above through `launch`."""
    return launch(_gated_norm_kernel, x, gate, weight, eps)


SKELETON = '''\
import torch
import triton
import triton.language as tl


@triton.jit
def gated_norm_kernel(x_ptr, gate_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)                         # one program per row of D values
    cols = tl.arange(0, BLOCK)
    mask = cols < D                                # BLOCK is D rounded up to a power of two
    base = row * D
    x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
    # TODO 1: load this row's gate (laid out like x) and the weight w [D], as fp32
    # TODO 2: rstd = 1 / sqrt(mean of x * x over the D real columns + eps)
    # TODO 3: y = x * rstd * w * sigmoid(gate)
    y = x                                          # placeholder: replace with TODO 3's y
    tl.store(out_ptr + base + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_norm(x, gate, weight, eps=1e-5):
    """x, gate [rows, D]; weight [D]. One program per row; out [rows, D] in x's dtype."""
    x, gate, weight = x.contiguous(), gate.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    gated_norm_kernel[(x.shape[0],)](x, gate, weight, out, x.shape[1], eps,
                                     BLOCK=triton.next_power_of_2(x.shape[1]))
    return out
'''


def _cases(seed: int, device) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    specs = [  # (label, rows, D, dtype)
        ("6 rows of KDA's 128 value columns", 6, 128, torch.float32),
        ("D = 100: BLOCK 128 holds 28 padded columns", 5, 100, torch.float32),
        ("D = 48, fp16", 4, 48, torch.float16),
        ("one row, D = 128, rows far from unit scale", 1, 128, torch.float32),
    ]
    out = []
    for label, rows, D, dt in specs:
        scale = 40.0 if rows == 1 else 1.0
        x = scale * torch.randn(rows, D, generator=gen, dtype=torch.float64)
        g = 2.0 * torch.randn(rows, D, generator=gen, dtype=torch.float64)
        w = 1.0 + 0.2 * torch.randn(D, generator=gen, dtype=torch.float64)
        inputs = {"x": x.to(device=device, dtype=dt), "gate": g.to(device=device, dtype=dt),
                  "weight": w.to(device=device, dtype=dt), "eps": EPS}
        out.append(Case(label, inputs, dt, out_dtype={"out": dt}))
    return out


def _reference(case: Case):
    x = case.inputs
    x64 = {k: x[k].double().cpu() for k in ("x", "gate", "weight")}
    return gated_rms_norm(x64["x"], x64["gate"], x64["weight"], x["eps"])


def _run(fn, case: Case):
    """The learner's gated_norm on a copy of the case, refused unless a Triton kernel of theirs launched (the
    reference solution's own kernel for the reference)."""
    with kernel_launches() as seen:
        out = fn(**copy.deepcopy(case.inputs))
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize()  # a launch's fault surfaces here, as the learner's error
    ran = ([x for x in seen if x.kernel is _gated_norm_kernel] if fn is gated_norm_solution  # the reference
           else seen.outside("k3lab"))
    if not ran:
        library = sorted(set(seen.names()))
        raise Mismatch("no Triton kernel launched" + (f" of yours (only k3lab's own: {', '.join(library)})"
                                                      if library else "")
                       + ": gated_norm must launch your @triton.jit kernel, gated_norm_kernel[grid](...); "
                       "the same numbers from PyTorch do not count")
    return out


STUB = SKELETON

TASK = Task(
    name="gated_norm_kernel", notebook="03_copy_removal", minutes=20,
    statement="""\
**Task: KDA's output epilogue as one Triton kernel.** Unfused, KDA's decode writes its output `o` to
memory and a separate kernel reads it back to apply `RMSNorm(o) * w * sigmoid(gate)`. Fill the three
TODOs of `gated_norm_kernel` (one program per row, the whole row in registers): load the gate and the
weight, take the mean of `x*x` over the **D** real columns (BLOCK is D rounded up to a power of two, and
one case has D = 100), and write `y = x * rstd * w * sigmoid(gate)`. The wrapper `gated_norm` is
complete. `check` runs it compiled on a GPU, in Triton's interpreter on a CPU, against
`k3lab.nn.norms.gated_rms_norm` in fp64, and refuses an answer in which no Triton kernel of yours
launched.""",
    signature="gated_norm(x: Tensor[rows, D], gate: Tensor[rows, D], weight: Tensor[D], eps: float = 1e-5) "
              "-> Tensor[rows, D] (x's dtype)",
    outputs=("out",), cases=_cases, reference=_reference, solution=gated_norm_solution, stub=STUB,
    run=_run, skeleton=SKELETON, on_device=True,
    forbidden=("k3lab.nn.norms.gated_rms_norm", "k3lab.workshop.epilogue._gated_norm_kernel"),
    hints=(
        "One program holds one row in registers and x is already loaded. The gate is laid out like x "
        "(the same base + cols); the weight is one vector of D that every row shares (no row offset).",
        "The mean of x*x must be over the D real columns: the masked columns load as 0 and add nothing to "
        "the sum, but dividing by BLOCK instead of D shrinks the mean whenever D is not a power of two "
        "(the D = 100 case). Then y = x * rstd * w * sigmoid(gate), all in fp32; the store casts.",
        "`g = tl.load(gate_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)`; "
        "`w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)`; "
        "`rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)`; then TODO 3's y from x, rstd, w and "
        "`tl.sigmoid(g)`.",
    ))
