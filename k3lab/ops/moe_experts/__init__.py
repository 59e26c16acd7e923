"""K3's routed experts at one rank's shapes: sorted by expert, two grouped launches (Triton).

    y[n] = sum_j weights[n, j] * w2[e] @ SiTU-GLU(w1[e] @ z[n], w3[e] @ z[n]),   e = idx[n, j]

z [N, L] is the latent (routed_expert_down_proj(x)); w1, w3 [E, F, L] and w2 [E, L, F] hold every
expert's slice of the intermediate (F = 384 of 3072 at TP8, so y is this rank's partial sum, the
"latent" that the TP layer all-reduces). y is fp32. Shapes and errors: inputs.py.

Backends (`BACKENDS`, k3lab.ops' contract: `routed_experts(..., backend=)` or K3LAB_MOE_EXPERTS_BACKEND
forces one):
  triton  the grouped kernels (triton.py): launch 1 = w1/w3 + SiTU-GLU, launch 2 = w2 with the
          routing weights; tiles of 16/32/64 rows of one expert. Needs a GPU, or Triton's
          interpreter (TRITON_INTERPRET=1, small sizes: tests) on a CPU.
  torch   the per-expert loop (loop.py): the reference, and the before; runs anywhere.
With none forced, the triton backend runs on GPU tensors (fp64 on the loop) and the torch loop on CPU
tensors (the interpreter is too slow for more than tests). `padding.py` measures the tile padding at
decode batches. Records of both: profiles/<device>/moe_sharding/ and profiles/<device>/decode_step/.

The layer's tail, `latent_tail` (tail.py: RMSNorm of the latent, rows of up_proj, added into an
output in place), has the same two backends: triton = one Triton norm launch and one in-place addmm_
into the output's columns; torch = the plain reference ops.

The experts over MXFP4 weights (the article's precision; w1, w3, w2 `mxfp4.Mxfp4Weight`) are three more
rows, each providing the callable `mxfp4(z, weights, idx, w1, w3, w2, check_values)` -> y [N, L] fp32
(and no `after`: the bf16 face never picks them), chosen by `mxfp4_routed_experts(..., backend=)`:
  mxfp4_grouped  expert-sorted tiles on tl.dot_scaled, activations as MXFP8 (mxfp4_kernels); first for
                 more than one token, where Triton lowers tl.dot_scaled (not its interpreter, not gfx942)
  mxfp4_gemv     the token-at-a-time GEMV launches, dequantizing in registers (mxfp4_kernels); first for
                 one token (each chosen expert is read once anyway)
  mxfp4_torch    the per-expert PyTorch loop over each chosen expert dequantized (loop.py): runs anywhere,
                 reads the chosen experts back to the host (no CUDA graph); the before of the two above
"""

from __future__ import annotations

import torch

from k3lab.ops import Backend, Backends, triton_and_torch, triton_available, triton_runs_on

from . import loop as _loop
from . import mxfp4_kernels as _mx
from . import triton as _triton
from .inputs import TILE_HEIGHTS, ExpertSort, check_block_m, check_inputs, default_block_m, max_tiles, \
    sort_by_expert, stack_experts
from .padding import decode_padding, padding_of, random_router_idx
from .tail import check_tail, norm_rows, tail_torch, tail_triton


def _triton_verify(device=None, dtype=None) -> tuple[bool, str]:
    if dtype == torch.float64:
        return False, "z: the triton backend takes fp32, fp16 or bf16 (fp64 runs on backend='torch')"
    return triton_runs_on(device)


def _after_triton(z, weights, idx, w1, w3, w2, shapes, sort, block_m):
    if sort is None:
        sort = sort_by_expert(idx, shapes.num_experts,
                              block_m or default_block_m(shapes.n_tokens, shapes.top_k, shapes.num_experts))
    return _triton.grouped_experts(z, weights, idx, w1, w3, w2, shapes, sort)


def _after_torch(z, weights, idx, w1, w3, w2, shapes, sort, block_m):
    return _loop.expert_loop(z, weights, idx, w1, w3, w2, shapes)


# callables (on checked inputs): after(z, weights, idx, w1, w3, w2, shapes, sort or None, block_m or None)
# -> y; tail(y_lat, norm_w, eps, up_rows, out, col0) -> out. The torch row is the reference and the
# before (the per-expert loop).
_BF16 = triton_and_torch("moe_experts", {"after": _after_triton, "tail": tail_triton},
                         {"after": _after_torch, "tail": tail_torch}, verify=_triton_verify)


def _mxfp4_verify(device=None, dtype=None, tokens=None) -> tuple[bool, str]:
    if dtype is not None and dtype not in _mx.Z_DTYPES:
        return False, f"z: the MXFP4 kernels take fp32, fp16 or bf16, got {dtype}"
    return triton_runs_on(device)


def _mxfp4_rank(first_at_one_token: bool):
    # after the bf16 rows (a choice with no callable named stays theirs); among the MXFP4 Triton forms the
    # GEMV one first for one token, the grouped one first otherwise
    return lambda device=None, dtype=None, tokens=None: 2 if (tokens == 1) == first_at_one_token else 3


_MXFP4 = (
    Backend("mxfp4_grouped", _mxfp4_rank(False), _mx.grouped_runs_here, _mxfp4_verify,
            parts={"mxfp4": _mx.mxfp4_experts_grouped}),
    Backend("mxfp4_gemv", _mxfp4_rank(True), triton_available, _mxfp4_verify,
            parts={"mxfp4": _mx.mxfp4_experts}),
    Backend("mxfp4_torch", 4, lambda: (True, "plain PyTorch: the per-expert loop over each chosen expert "
                                            "dequantized"), parts={"mxfp4": _loop.mxfp4_expert_loop}),
)
BACKENDS = Backends("moe_experts", *_BF16.rows, *_MXFP4)
BACKEND_ENV = BACKENDS.env


def routed_experts(z, weights, idx, w1, w3, w2, *, backend: str | None = None, block_m: int | None = None,
                   check_values: bool = True, sort: ExpertSort | None = None) -> torch.Tensor:
    """y [N, L] fp32 (see the module docstring). block_m: tile height of the triton backend (16, 32
    or 64; default from the batch: default_block_m). sort: the expert sort of `idx` if the caller
    built it already (k3lab.ops.moe_router.route_and_sort); the triton backend then uses it instead of
    sorting again (the torch loop does not need one). Raises ValueError on bad input before any kernel."""
    shapes = check_inputs(z, weights, idx, w1, w3, w2, check_values=check_values)
    if block_m is not None:
        check_block_m(block_m)
    if sort is not None and (not isinstance(sort, ExpertSort) or sort.pairs != shapes.n_tokens * shapes.top_k
                             or (block_m is not None and sort.block_m != block_m)):
        raise ValueError(f"sort must be the ExpertSort of idx's {shapes.n_tokens * shapes.top_k} pairs"
                         + (f" with block_m={block_m}" if block_m is not None else "")
                         + f", got {sort!r:.120}")
    row = BACKENDS.pick(backend, z.device, z.dtype, need="after")
    if shapes.n_tokens == 0:
        return torch.zeros(0, shapes.latent, dtype=torch.float32, device=z.device)
    return row.after(z, weights, idx, w1, w3, w2, shapes, sort, block_m)


def grouped_experts(z, weights, idx, w1, w3, w2, *, block_m: int | None = None) -> torch.Tensor:
    """The grouped Triton kernels (the triton row's after)."""
    return routed_experts(z, weights, idx, w1, w3, w2, backend="triton", block_m=block_m)


def expert_loop(z, weights, idx, w1, w3, w2) -> torch.Tensor:
    """The per-expert torch loop (the torch row: the reference and the before)."""
    return routed_experts(z, weights, idx, w1, w3, w2, backend="torch")


def mxfp4_routed_experts(z, weights, idx, w1, w3, w2, *, backend: str | None = None,
                         check_values: bool = True) -> torch.Tensor:
    """y [N, L] fp32 over MXFP4 experts (w1, w3, w2 `mxfp4.Mxfp4Weight`; the module docstring's MXFP4
    rows, chosen for z's device and dtype and its number of tokens). Bad input: ValueError / TypeError
    naming the argument (mxfp4_kernels.check_inputs), before any kernel runs."""
    _mx.check_inputs(z, weights, idx, w1, w3, w2, check_values=False)
    row = BACKENDS.pick(backend, z.device, z.dtype, z.shape[0], need="mxfp4")
    return row.mxfp4(z, weights, idx, w1, w3, w2, check_values=check_values)


def latent_tail(y_lat, norm_w, eps, up_rows, out, col0: int = 0, *, backend: str | None = None):
    """out[:, col0 : col0 + R] += rms_norm(y_lat) @ up_rows^T in place (tail.py); returns out."""
    check_tail(y_lat, norm_w, up_rows, out, col0, eps)
    return BACKENDS.pick(backend, y_lat.device, need="tail").tail(y_lat, norm_w, eps, up_rows, out, col0)


__all__ = [
    "BACKENDS", "BACKEND_ENV", "TILE_HEIGHTS", "ExpertSort", "check_inputs", "decode_padding",
    "default_block_m", "expert_loop", "grouped_experts", "latent_tail", "max_tiles", "mxfp4_routed_experts",
    "norm_rows",
    "padding_of", "random_router_idx", "routed_experts", "sort_by_expert", "stack_experts",
    "tail_torch", "tail_triton",
]
