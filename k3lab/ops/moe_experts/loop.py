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
