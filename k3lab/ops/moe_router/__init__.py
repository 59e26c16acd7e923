"""K3's MoE router and the expert sort in one launch (two beyond decode sizes): `route_and_sort`.

    weights, idx = k3lab.nn.moe.route(logits, bias, top_k, scaling, renormalize)[:2]
    sort = k3lab.ops.moe_experts.sort_by_expert(idx, E, block_m)

logits [N, E] are the router logits (the gate matmul stays a cuBLAS matmul; fp32, or bf16 / fp16 that
are read as fp32, as route's .float() does); bias [E] (or None) is e_score_correction_bias. Selection
is by sigmoid(logits) + bias, the weights come from the sigmoid scores alone, renormalised over the
chosen and times `scaling`. The sort is the ExpertSort that the grouped expert kernels read
(moe_experts.inputs): pairs by expert, padded per expert to tiles of block_m rows, sized by max_tiles.

Why: in plain PyTorch these are ~25 small launches per MoE layer (sigmoid, add, topk, gather, sum, div,
mul; scatter_add_, cumsums, a radix argsort, searchsorted, index arithmetic). The triton backend does
them in one launch at decode sizes, two beyond (triton.py), with no read-back, so the call can be
captured in a CUDA graph.

Backends (`BACKENDS`, k3lab.ops' contract: `backend=` or K3LAB_MOE_ROUTER_BACKEND forces one by name; a
forced one that cannot run these logits is a ValueError):
  triton  up to FUSED_PAIRS (32) pairs N * top_k, one program routes every token and sorts
          (triton.route_sort); beyond, launch 1 = top-k and weights (a program per token), launch 2 =
          the counting sort (triton.topk_weights, sort_pairs). For N * top_k <= MAX_PAIRS (2048,
          decode sizes): a single program sorts, so larger batches raise when it is forced. Runs on a
          GPU, or in Triton's interpreter (TRITON_INTERPRET=1: tests) on CPU tensors.
  torch   route + sort_by_expert: the reference (and the before: what the step runs unfused); any
          size, fp64 too.
With none forced: triton for GPU tensors when N * top_k <= MAX_PAIRS and logits are not fp64, else
torch (CPU tensors too: the interpreter is for tests).

Results equal the torch path's: the same experts in the same order (descending score + bias, as
torch.topk's sorted output), weights to fp32 rounding, and the same ExpertSort (the order within an
expert is the flat token-slot order of the stable argsort). Ties: the triton path takes the lowest
expert index first; torch.topk does not document its order among equal values, so the paths may
choose differently only on exact ties. NaN logits are chosen last by the triton path (torch.topk
ranks NaN highest); its indices stay in [0, E) either way.

Checks: tests/test_moe_router.py; per-call times: profiles/<device>/decode_step/glue/.
"""

from __future__ import annotations

import torch

from k3lab.nn.moe import route
from k3lab.ops import triton_and_torch, triton_runs_on
from k3lab.ops.moe_experts.inputs import ExpertSort, sort_by_expert

from . import triton
from .inputs import LOGIT_DTYPES, check_router
from .triton import FUSED_PAIRS, MAX_PAIRS, route_sort, sort_pairs, topk_weights


def _triton_verify(device=None, tokens: int | None = None, top_k: int = 1, dtype=None) -> tuple[bool, str]:
    """The single-program sort takes at most MAX_PAIRS (token, expert) pairs (decode sizes), and no fp64."""
    if dtype == torch.float64:
        return False, "logits: the triton backend takes fp32, bf16 or fp16 (fp64 runs on backend='torch')"
    if tokens is not None and tokens * top_k > MAX_PAIRS:
        return False, (f"logits: N={tokens} tokens x top_k={top_k} = {tokens * top_k} pairs is more than the "
                       f"triton backend's single-program sort takes (MAX_PAIRS={MAX_PAIRS}, decode sizes); "
                       "use backend='torch' (or none forced) for larger batches")
    return triton_runs_on(device)


def _after_triton(logits, bias, top_k, scaling, renormalize, E, block_m):
    if logits.shape[0] * top_k <= FUSED_PAIRS:  # checked: the launchers' own checks are not repeated
        return triton.launch_route_sort(logits, bias, top_k, scaling, renormalize, block_m)
    weights, idx = triton.launch_topk_weights(logits, bias, top_k, scaling, renormalize)
    return weights, idx, sort_pairs(idx, E, block_m)


def _after_torch(logits, bias, top_k, scaling, renormalize, E, block_m):
    weights, idx, _ = route(logits, bias, top_k, scaling, renormalize)
    return weights, idx, sort_by_expert(idx, E, block_m)


# callables (on checked inputs): after(logits, bias, top_k, scaling, renormalize, E, block_m) -> (weights,
# idx, sort). The torch row is the reference and the before (route + sort_by_expert, ~25 launches).
BACKENDS = triton_and_torch("moe_router", {"after": _after_triton}, {"after": _after_torch},
                            verify=_triton_verify)
BACKEND_ENV = BACKENDS.env


def route_and_sort(logits, bias, top_k, *, scaling=1.0, renormalize=True, num_experts=None, block_m,
                   backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor, ExpertSort]:
    """(weights [N, top_k] fp32 (fp64 for fp64 logits, torch path), idx [N, top_k] int64, sort:
    ExpertSort) for logits [N, E] (see the module docstring). block_m: the grouped kernels' tile height (16,
    32 or 64; moe_experts.
    default_block_m picks one from the batch). ValueError on bad input before any kernel."""
    N, E = check_router(logits, bias, top_k, scaling, renormalize, num_experts, block_m)
    top_k = int(top_k)  # a numpy or 0-d tensor integer, as the launchers and nn's route take it
    row = BACKENDS.pick(backend, logits.device, N, top_k, logits.dtype, need="after")
    return row.after(logits, bias, top_k, scaling, renormalize, E, block_m)


__all__ = ["BACKENDS", "BACKEND_ENV", "FUSED_PAIRS", "LOGIT_DTYPES", "MAX_PAIRS", "check_router",
           "route_and_sort",
           "route_sort", "sort_pairs", "topk_weights"]
