"""How many rows each expert gets at decode, and how much of the grouped kernel's tiles is padding.

A tile holds `block_m` rows of one expert, so an expert chosen by c pairs costs ceil(c / m) tiles:
the rows past c are padding (loaded as zeros, multiplied, discarded). With 16 of 896 experts per
token, a decode batch of N tokens spreads N x 16 pairs over up to 896 experts: even N = 256 leaves
about 4.6 rows per chosen expert, so most of every tile is padding. At decode this costs little
time (the kernels are bound by reading the chosen experts' weights, once per tile column), but it is
why a big batch does not turn the experts into large matmuls.

`decode_padding` routes real-sized tokens through K3's router shape (hidden 7168 -> 896 scores,
top-16) with RANDOM router weights and inputs (no trained K3 weights here): random routing is close
to uniform; a trained router prefers some experts, which gives those more rows and others fewer.
"""

from __future__ import annotations

import torch

from k3lab.ops import expect

from .inputs import TILE_HEIGHTS, check_block_m


def padding_of(idx: torch.Tensor, num_experts: int, block_m: int) -> dict:
    """Rows per expert and the tile padding of one routing idx [N, k] at tile height block_m.

    Returns rows (pairs), chosen experts, tiles, padded rows (tiles x m), padding share
    (1 - rows / padded rows), and the mean and max rows per chosen expert."""
    check_block_m(block_m)
    expect("idx", idx, shape=2, what="[N, k]")
    counts = torch.bincount(idx.reshape(-1).long().cpu(), minlength=num_experts)
    chosen = counts[counts > 0]
    tiles = int(((chosen + block_m - 1) // block_m).sum())
    rows = int(chosen.sum())
    padded = tiles * block_m
    return {
        "rows": rows, "experts_chosen": int(chosen.numel()), "tiles": tiles, "padded_rows": padded,
        "padding_share": 1.0 - rows / padded if padded else 0.0,
        "rows_per_expert_mean": rows / max(int(chosen.numel()), 1),
        "rows_per_expert_max": int(chosen.max()) if chosen.numel() else 0,
    }


def random_router_idx(n_tokens: int, *, hidden: int = 7168, num_experts: int = 896, top_k: int = 16,
                      seed: int = 0) -> torch.Tensor:
    """idx [n_tokens, top_k] from K3's router at its real shape with random weights and inputs:
    gate ~ N(0, 1/hidden), x ~ N(0, 1), a small random correction bias (fp32, CPU)."""
    from k3lab.nn.moe import MoEGate

    gen = torch.Generator().manual_seed(seed)
    gate = MoEGate(hidden, num_experts, top_k)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(num_experts, hidden, generator=gen) / hidden**0.5)
        gate.e_score_correction_bias.copy_(0.01 * torch.randn(num_experts, generator=gen))
        x = torch.randn(n_tokens, hidden, generator=gen)
        _, idx, _ = gate(x)
    return idx


def decode_padding(batches=range(1, 257), heights=TILE_HEIGHTS, *, num_experts: int = 896, top_k: int = 16,
                   hidden: int = 7168, seed: int = 0) -> list[dict]:
    """padding_of for each decode batch N in `batches` and tile height in `heights`, one row each
    (with 'batch' and 'block_m'). Batch N routes the first N tokens of one random batch of max(batches)
    tokens (random router weights: see the module docstring)."""
    batches = list(batches)
    if not batches or min(batches) < 1:
        raise ValueError(f"batches must be positive token counts, got {batches[:5]}...")
    for h in heights:
        check_block_m(h)
    idx = random_router_idx(max(batches), hidden=hidden, num_experts=num_experts, top_k=top_k, seed=seed)
    return [{"batch": n, "block_m": m, **padding_of(idx[:n], num_experts, m)} for n in batches for m
            in heights]
