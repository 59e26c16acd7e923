"""Inputs and a side-by-side run shared by the tests of the few-token AttnRes kernels."""

import torch

from k3lab.ops import attn_res_norm as arn


def make_inputs(T, D, dtype=torch.bfloat16, seed=0, device="cpu", n_slots=9):
    """Fresh random AttnRes inputs: partial, delta, n_slots stored-block slots and the three weights."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(prefix=r(T, D).to(dtype), delta=r(T, D).to(dtype), blocks=r(n_slots, T, D).to(dtype),
             res_norm_w=1 + 0.1 * r(D), res_proj_w=0.05 * r(D), next_norm_w=1 + 0.1 * r(D))
    return {k: v.to(device) for k, v in x.items()}


def run_beside_before(kernel, x, n_blocks, push, with_delta, **kw):
    """kernel and arn.before on copies of the same inputs: (kernel out, before out, (kernel's partial,
    blocks), (before's partial, blocks))."""
    delta = x["delta"] if with_delta else None
    args = (n_blocks, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"])
    pa, ba, pb, bb = x["prefix"].clone(), x["blocks"].clone(), x["prefix"].clone(), x["blocks"].clone()
    ya = kernel(pa, delta, ba, *args, push_block=push, **kw)
    yb = arn.before(pb, delta, bb, *args, push_block=push)
    return ya, yb, (pa, ba), (pb, bb)
