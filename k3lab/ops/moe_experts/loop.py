"""The routed experts as a per-expert torch loop: the "before" of the grouped kernels.

One sort of the pairs by expert (one read-back of the counts), then for every chosen expert three
matmuls, the activation and a weighted add into y: 5+ kernel launches per chosen expert (a decode
token chooses 16), each reading its weights once with a handful of rows. It cannot be captured in a
CUDA graph (the loop bound comes from the read-back).
"""

from __future__ import annotations

import torch

from k3lab.nn.situ import situ_glu

from .inputs import Shapes
from .mxfp4 import Mxfp4Weight
from .mxfp4_kernels import check_inputs as check_mxfp4


def expert_loop(z, weights, idx, w1, w3, w2, shapes: Shapes) -> torch.Tensor:
    """Inputs already checked (inputs.check_inputs); returns y [N, L] fp32 (fp64 for fp64 inputs)."""
    N, k, L = shapes.n_tokens, shapes.top_k, shapes.latent
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    y = torch.zeros(N, L, dtype=acc, device=z.device)
    flat = idx.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=shapes.num_experts).tolist()
    token = order // k
    w = weights.reshape(-1)[order].to(acc)
    start = 0
    for e, c in enumerate(counts):
        if not c:
            continue
        rows = token[start:start + c]
        zr = z[rows]
        out = situ_glu(zr @ w1[e].t(), zr @ w3[e].t()) @ w2[e].t()
        y.index_add_(0, rows, out.to(acc) * w[start:start + c, None])
        start += c
    return y


def mxfp4_expert_loop(z, weights, idx, w1, w3, w2, *, check_values: bool = True) -> torch.Tensor:
    """y [N, L] fp32 over MXFP4 experts (w1, w3, w2 `mxfp4.Mxfp4Weight`; mxfp4_kernels' shapes and
    refusals): for every chosen expert, its three matrices dequantized to fp32 and the same sum as
    `expert_loop`. The PyTorch form of the MXFP4 experts (the 'mxfp4_torch' row): it reads the chosen
    experts back to the host, so it cannot be captured in a CUDA graph."""
    N, _, L, _, _ = check_mxfp4(z, weights, idx, w1, w3, w2, check_values=check_values)
    y = torch.zeros(N, L, dtype=torch.float32, device=z.device)
    zf = z.float()
    for e in torch.unique(idx).tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        d1, d3, d2 = (Mxfp4Weight(t.packed[e], t.scale_exp[e]).dequantize(torch.float32)
                      for t in (w1, w3, w2))
        x = zf[tok]
        h = situ_glu(x @ d1.t(), x @ d3.t())
        y.index_add_(0, tok, (h @ d2.t()) * weights[tok, slot, None].float())
    return y
