"""Validation and the expert sort shared by every routed-expert backend.

Shapes at one rank (K3 at TP8: L = 3584 latent, F = 384 of the 3072 expert intermediate, E = 896):

    z        [N, L]     the latent input (routed_expert_down_proj(x)), fp32 / fp16 / bf16 (fp64: loop)
    weights  [N, k]     routing weights (fp32 from the router; any float dtype accepted)
    idx      [N, k]     chosen experts, integers in [0, E)
    w1, w3   [E, F, L]  gate and up projections of every expert (nn.Linear layout [out, in])
    w2       [E, L, F]  down projection of every expert

The grouped kernels work on (token, slot) pairs sorted by expert and padded per expert to a multiple of
the tile height: a tile of `block_m` rows belongs to one expert, so one weight tile serves every row.
`sort_by_expert` builds that order with device-side torch ops only (no read-back), so the whole grouped
call can be captured in a CUDA graph; the grid is sized by `max_tiles`, a bound that needs no read-back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3lab.ops import expect, int_arg

TILE_HEIGHTS = (16, 32, 64)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # fp64: the torch loop only


@dataclass(frozen=True)
class Shapes:
    n_tokens: int
    top_k: int
    latent: int
    intermediate: int
    num_experts: int


def check_routing(z, weights, idx, z_dtypes) -> tuple[int, int]:
    """(N, k) of the routing inputs every expert form takes alike (bf16 or MXFP4 weights): z [N, L] in
    one of `z_dtypes`, weights [N, k] float, idx [N, k] int32 / int64, k >= 1. Metadata only."""
    for name, t in (("z", z), ("weights", weights), ("idx", idx)):
        expect(name, t, shape=2)
    expect("z", z, dtype=z_dtypes)
    N, k = z.shape[0], idx.shape[1]
    if idx.shape[0] != N or weights.shape != idx.shape or k < 1:
        raise ValueError(f"idx and weights must both be [N={N}, k >= 1] (at least one expert per token), "
                         f"got {tuple(idx.shape)} and {tuple(weights.shape)}")
    expect("idx", idx, dtype=(torch.int32, torch.int64))
    expect("weights", weights, dtype="float")
    return N, k


def check_placed(tensors: dict, idx, num_experts: int, check_values: bool) -> None:
    """`tensors` (name -> tensor, the call's every input) on one device, and (check_values) idx's
    values expert numbers in [0, num_experts): one read-back, skipped while a CUDA graph is captured (a
    read-back cannot be captured), so a captured call trusts the router."""
    devices = {str(t.device) for t in tensors.values()}
    if len(devices) != 1:
        *first, last = tensors
        raise ValueError(f"{', '.join(first)} and {last} must be on one device, got {sorted(devices)}")
    capturing = idx.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"idx values must be expert numbers in [0, E={num_experts}), got the range "
                             f"[{lo}, {hi}]")


def check_inputs(z, weights, idx, w1, w3, w2, *, check_values: bool = True) -> Shapes:
    """Validate the routed-expert inputs (see the module docstring); returns their sizes.

    check_values reads idx back to check its range (`check_placed`)."""
    N, k = check_routing(z, weights, idx, DTYPES)
    for name, w in (("w1", w1), ("w3", w3), ("w2", w2)):
        expect(name, w, shape=3, dtype=z.dtype)  # z's dtype
    L = z.shape[1]
    E, F, _ = w1.shape
    expect("w1", w1, shape=(None, None, L), what=f"[E, F, L={L}] (z's width)")
    expect("w3", w3, shape=tuple(w1.shape), what=f"w1's shape {tuple(w1.shape)}")
    expect("w2", w2, shape=(E, L, F), what=f"[E={E}, L={L}, F={F}]")
    check_placed({"z": z, "weights": weights, "idx": idx, "w1": w1, "w3": w3, "w2": w2}, idx, E, check_values)
    return Shapes(N, k, L, F, E)


def check_block_m(block_m) -> int:
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m not in TILE_HEIGHTS:
        raise ValueError(f"block_m must be one of {TILE_HEIGHTS} (rows per expert tile), got {block_m!r}")
    return block_m


def default_block_m(n_tokens: int, top_k: int, num_experts: int) -> int:
    """The smallest tile height that holds the expected rows per chosen expert under uniform routing
    (decode batches on K3's 896 experts expect fewer than 16: the 16-row tile)."""
    int_arg("n_tokens", n_tokens)
    int_arg("num_experts", num_experts, low=1)
    int_arg("top_k", top_k, low=1, high=num_experts)
    pairs = n_tokens * top_k
    chosen = num_experts * (1.0 - (1.0 - top_k / num_experts) ** n_tokens) if n_tokens else 1.0
    rows = pairs / max(chosen, 1.0)
    return next((h for h in TILE_HEIGHTS if rows <= h), TILE_HEIGHTS[-1])


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Most tiles `pairs` (token, slot) rows can need: each chosen expert rounds its rows up to a tile,
    sum_e ceil(c_e / m) <= (pairs + (m - 1) * min(E, pairs)) / m."""
    int_arg("pairs", pairs)
    int_arg("num_experts", num_experts, low=1)
    check_block_m(block_m)
    return (pairs + (block_m - 1) * min(num_experts, pairs)) // block_m


@dataclass(frozen=True)
class ExpertSort:
    """(token, slot) pairs sorted by expert, padded per expert to whole tiles of `block_m` rows.

    pair_of_row [max_tiles * block_m] int32: the flat pair n * k + j each padded row holds, or
        `pairs` (one past the last) on padding rows;
    tile_expert [max_tiles] int32: the expert of each tile (tiles past `n_tiles` are unused);
    n_tiles     [1] int32: tiles in use, on the device (the kernels read it; no read-back);
    counts      [E] int64: rows (pairs) per expert."""

    pair_of_row: torch.Tensor
    tile_expert: torch.Tensor
    n_tiles: torch.Tensor
    counts: torch.Tensor
    block_m: int
    max_tiles: int
    pairs: int


def sort_by_expert(idx: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """Sort the pairs of idx [N, k] by expert (stable: token order within an expert) and pad each
    expert's run to whole tiles. Device-side ops only, so it can be captured in a CUDA graph: idx's
    values are not read (the router's output; `check_inputs` reads them where a read is allowed)."""
    expect("idx", idx, dtype=(torch.int32, torch.int64), what="(expert numbers)")
    num_experts = int_arg("num_experts", num_experts, low=1)
    check_block_m(block_m)
    flat = idx.reshape(-1).long()
    P, dev = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount reads back its max on a GPU
    tiles_per = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per, 0)
    padded_start = (tile_end - tiles_per) * block_m
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    dest = padded_start[expert_of] + torch.arange(P, device=dev) - start[expert_of]
    T = max_tiles(P, num_experts, block_m)
    pair_of_row = torch.full((T * block_m,), P, dtype=torch.int32, device=dev)
    pair_of_row[dest] = order.to(torch.int32)
    tiles = torch.arange(T, device=dev)
    tile_expert = torch.searchsorted(tile_end, tiles, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    n_tiles = tile_end[-1:].to(torch.int32)
    return ExpertSort(pair_of_row, tile_expert, n_tiles, counts, block_m, T, P)


def stack_experts(experts, lo: int = 0, hi: int | None = None):
    """(w1, w3, w2) of an nn.ModuleList of RoutedExpert, stacked to [E, F', L], [E, F', L], [E, L, F'],
    keeping the intermediate rows [lo, hi) (one rank's slice under TP; the whole width by default)."""
    if len(experts) == 0:
        raise ValueError("experts must hold at least one RoutedExpert")
    F = experts[0].w1.weight.shape[0]
    hi = F if hi is None else hi
    if not 0 <= lo < hi <= F:
        raise ValueError(f"the intermediate slice [lo, hi) must lie in [0, {F}], got [{lo}, {hi})")
    with torch.no_grad():
        w1 = torch.stack([e.w1.weight[lo:hi] for e in experts])
        w3 = torch.stack([e.w3.weight[lo:hi] for e in experts])
        w2 = torch.stack([e.w2.weight[:, lo:hi] for e in experts])
    return w1.contiguous(), w3.contiguous(), w2.contiguous()
