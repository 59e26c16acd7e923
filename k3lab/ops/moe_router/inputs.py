"""The router's argument checks, shared by its backends and by the Triton launchers called directly
(`triton.route_sort`, `triton.topk_weights`): shapes, dtypes and the scalar options, never a tensor's
values (nothing is read back, so the checked call can still be captured in a CUDA graph)."""

from __future__ import annotations

import torch

from k3lab.nn.moe import check_scaling
from k3lab.ops import expect, int_arg
from k3lab.ops.moe_experts.inputs import check_block_m

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # fp64: torch only


def check_router(logits, bias, top_k, scaling, renormalize, num_experts=None,
                 block_m=None) -> tuple[int, int]:
    """Validate route_and_sort's inputs; returns (N, E). block_m None: not checked (`topk_weights` takes
    none). ValueError naming the argument: top_k and num_experts are ints (a bool is not a count),
    scaling a finite real number (an infinite one would make every weight inf or NaN)."""
    expect("logits", logits, shape=2, dtype=LOGIT_DTYPES, what="[N, E]")  # fp64: the torch backend only
    N, E = logits.shape
    if E < 1:
        raise ValueError("logits must have at least one expert column (E >= 1)")
    if num_experts is not None and int_arg("num_experts", num_experts, low=1) != E:
        raise ValueError(f"num_experts must equal logits' width E={E} (or be None), got {num_experts!r}")
    if bias is not None:
        expect("bias", bias, shape=(E,), dtype="float", device=logits.device, what=f"[E={E}] (or None)")
    int_arg("top_k", top_k, low=1, high=E)
    check_scaling(scaling)
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be a bool, got {renormalize!r}")
    if block_m is not None:
        check_block_m(block_m)
    return N, E
