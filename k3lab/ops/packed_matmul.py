"""A matmul dispatcher that packs its input, before and after the seed's fix (seed section 3,
"Copy inputs only for kernels that use them").

The ROCm dispatcher in the seed packed the activation before choosing a kernel; when it chose the
fallback, the fallback read the original input and the packed copy went unused: one copy per KDA
layer, 69 per decode step, each a few microseconds of launch for a tiny transfer. The fix moves the
packing into the branch whose kernel reads it.

Here the "specialized" kernel is a stand-in that wants its own copy of the input and a reduction
dimension that is a multiple of 256; anything else takes the fallback
(`torch.nn.functional.linear` on the original input). Both branches compute the same product, so
the two dispatchers differ only in the copy. `install(model, policy)` routes every KDA layer's
gate up-projection `f_b` (128 -> H*128: K = 128 sends it to the fallback) through a dispatcher,
without touching `k3lab.nn`.
"""

from __future__ import annotations

import torch
from torch import nn

from k3lab.ops import Backend, Backends

SPECIALIZED_K_MULTIPLE = 256


def specialized_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The stand-in specialized kernel takes reduction sizes that are multiples of 256."""
    return weight.shape[1] % SPECIALIZED_K_MULTIPLE == 0


def pack(x: torch.Tensor) -> torch.Tensor:
    """The specialized kernel's private input buffer: one device copy of the [M, K] activation."""
    with torch.profiler.record_function("k3lab::pack_activation"):
        return x.reshape(-1, x.shape[-1]).clone()


def specialized_matmul(packed: torch.Tensor, weight: torch.Tensor, out_shape) -> torch.Tensor:
    return (packed @ weight.t()).reshape(out_shape)


def _out_shape(x, weight):
    return (*x.shape[:-1], weight.shape[0])


def dispatch_before(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The seed's bug: pack first, then choose; the fallback ignores the packed copy."""
    packed = pack(x)
    if specialized_applies(x, weight):
        return specialized_matmul(packed, weight, _out_shape(x, weight))
    return torch.nn.functional.linear(x, weight)


def dispatch_after(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The fix: only the branch whose kernel reads the packed input packs it."""
    if specialized_applies(x, weight):
        return specialized_matmul(pack(x), weight, _out_shape(x, weight))
    return torch.nn.functional.linear(x, weight)


def _reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight)


# k3lab.ops' contract: the 'dispatch' row carries the two dispatchers (before: pack first; after: pack
# where used); the 'torch' row is the reference (the plain product, no dispatcher). K3LAB_PACKED_MATMUL_
# BACKEND forces one.
BACKENDS = Backends("packed_matmul",
                    Backend("dispatch", 0, lambda: (True, "the stand-in dispatcher (plain PyTorch)"),
                            parts={"before": dispatch_before, "after": dispatch_after}),
                    Backend("torch", 1, lambda: (True, "torch.nn.functional.linear"),
                            parts={"before": _reference, "after": _reference}))
BACKEND_ENV = BACKENDS.env
# the one before/after axis: variant -> the dispatcher (what a DispatchedLinear calls as its policy)
VARIANTS = {name: getattr(BACKENDS["dispatch"], name) for name in ("before", "after")}


def packed_linear(x: torch.Tensor, weight: torch.Tensor, *, variant: str = "after",
                  backend: str | None = None) -> torch.Tensor:
    """x @ weight^T through the row `backend` picks (None: the dispatcher) as `variant`: 'before' (pack,
    then choose) or 'after' (pack where used)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    return getattr(BACKENDS.pick(backend, need=variant), variant)(x, weight)


class DispatchedLinear(nn.Module):
    """A bias-free Linear whose product goes through a dispatcher policy ('before' or 'after')."""

    def __init__(self, linear: nn.Linear, policy: str):
        super().__init__()
        if policy not in VARIANTS:
            raise ValueError(f"policy must be one of {sorted(VARIANTS)}, got {policy!r}")
        if linear.bias is not None:
            raise ValueError("DispatchedLinear wraps bias-free Linear layers only")
        self.weight = linear.weight
        self.policy = policy

    def forward(self, x):
        return VARIANTS[self.policy](x, self.weight)


def install(model: nn.Module, policy: str, attribute: str = "f_b") -> int:
    """Route `attribute` of every KDA layer in `model` through the dispatcher; returns the count.

    Layers already dispatched get the new policy. Works on K3Model, a DecoderLayer list or any
    module whose KDA layers expose `attribute` as an nn.Linear (or DispatchedLinear)."""
    from k3lab.nn.kda import KimiDeltaAttention

    if policy not in VARIANTS:
        raise ValueError(f"policy must be one of {sorted(VARIANTS)}, got {policy!r}")
    count = 0
    for module in model.modules():
        if isinstance(module, KimiDeltaAttention):
            current = getattr(module, attribute)
            if isinstance(current, DispatchedLinear):
                current.policy = policy
            elif isinstance(current, nn.Linear):
                setattr(module, attribute, DispatchedLinear(current, policy))
            else:
                raise ValueError(f"KDA layer attribute {attribute!r} is a {type(current).__name__}, not a "
                                 f"Linear")
            count += 1
    return count
