"""What every MLA decode backend shares: the shapes, input validation, the split policies and the
cache layouts.

Validation reads `lengths` and the block table on the host (one device sync), so each backend calls
`validate` once per plan; a plan then launches with no checks and no host sync (CUDA-graph
capturable). Bad input raises ValueError naming the argument, before any kernel runs.

Two split policies cut a request's history into pieces run by separate programs:
`choose_num_splits` (the Triton kernel: the split count with the lowest modelled time) and
`choose_splits` (the CUDA kernels: fill the SMs once, never spill into a second wave).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3lab import env
from k3lab.ops import expect, int_arg, int_list, positive_finite

LATENT_DIM = 576  # [c 512 | k_pe 64] per position (docs/k3.md)
VALUE_DIM = 512  # values are the first 512 latent columns
ROPE_DIM = LATENT_DIM - VALUE_DIM
DEFAULT_SCALE = 192 ** -0.5  # K3's qk head dim (128 nope + 64 rope); absorption does not change it
MMA_ROWS = 16  # the fewest rows a matrix-unit tile takes (mma.sync, MFMA, tl.dot): the padded head count
MAX_Q_LEN = 8  # verification group: the draft tokens plus one
MAX_SPLITS = 512  # Triton policy's upper bound on pieces per request
LOG2E = 1.0 / math.log(2.0)  # kernels work in base 2 and convert the lse once at the end


def decode_flops(positions: int, heads: int, q_len: int = 1, *, latent: int = LATENT_DIM,
                 value: int = VALUE_DIM) -> int:
    """Matrix flops of one absorbed decode over `positions` cached rows (summed over the batch): every
    query row (`q_len` a sequence) of every head scores each row over the `latent`-wide key and adds its
    `value`-wide slice to the output, 2 (latent + value) flops a row (a multiply and an add each; the
    softmax's few exp/max a row left out). The one count the rooflines, the mla_padding study's
    padding cost and the dcp study's local attention use; `latent`/`value` default to the op's widths
    (576 and 512) and take a config's. ValueError naming the argument for a non-integer or one below 1."""
    n, h, t, lat, val = (int_arg(k, v, low=1) for k, v in (("positions", positions), ("heads", heads),
                                                            ("q_len", q_len), ("latent", latent),
                                                            ("value", value)))
    return 2 * t * h * n * (lat + val)


@dataclass(frozen=True)
class LaunchConfig:
    """Latent rows per tile, warps per program and pipeline depth (tiles in flight) of a kernel."""

    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Inputs:
    """One validated call: what the kernels need to know."""

    batch: int
    q_len: int
    heads: int
    kv: torch.Tensor  # [B, L, 576] or [num_pages, page_size, 576]
    paged: bool
    page_size: int  # paged: the page size; contiguous: L (one "page" per request)
    block_table: torch.Tensor  # int32 [B, max_pages] (contiguous: a [B, 1] dummy)
    lengths: torch.Tensor  # int32 [B] on the device
    lengths_host: tuple[int, ...]
    capacity: int  # positions a request can hold

    @property
    def max_len(self) -> int:
        return max(self.lengths_host)


def _check_query(q, max_heads: int | None) -> None:
    expect("q", q, shape=4, what=f"[B, q_len, H, {LATENT_DIM}]")
    B, Tq, H, D = q.shape
    if D != LATENT_DIM:
        raise ValueError(f"q's last dim must be the latent width {LATENT_DIM} (512 absorbed nope + 64 rope), "
                         f"got {D}")
    if not 1 <= Tq <= MAX_Q_LEN:
        raise ValueError(f"q_len (q.shape[1]) must be in 1..{MAX_Q_LEN} (one decode token or a verification "
                         f"group), got {Tq}")
    if B < 1 or H < 1:
        raise ValueError(f"q must have at least one request and one head, got shape {tuple(q.shape)}")
    if max_heads is not None and H > max_heads:
        raise ValueError(f"heads (q.shape[2]) = {H} exceeds {max_heads}: the padded path runs one 16-row "
                         f"tile of heads per program; pass fold_heads=True to run {H} heads as "
                         f"{-(-H // MMA_ROWS)} folded groups of 16")
    expect("q", q, dtype=(torch.float32, torch.float16, torch.bfloat16))


def _check_cache(q, cache) -> None:
    expect("cache", cache, shape=3,
           what=f"[B, L, {LATENT_DIM}] (contiguous) or [num_pages, page_size, {LATENT_DIM}] (paged)")
    if cache.shape[2] != LATENT_DIM:
        raise ValueError(f"cache width (cache.shape[2]) must be {LATENT_DIM} to match q, got "
                         f"{cache.shape[2]}")
    expect("cache", cache, dtype=q.dtype, device=q.device, contiguous="last")  # q's dtype and device
    expect("q", q, contiguous="last")


def _check_table(block_table, cache, B: int, dev) -> tuple[bool, int, int, torch.Tensor]:
    """(paged, page_size, capacity, block table) for a block table or None (contiguous). The table
    comes back in its own dtype: `validate` range-checks the page ids before narrowing them to int32
    (an int64 id of 2**32 + 1 would otherwise wrap to page 1)."""
    if block_table is None:
        if cache.shape[0] != B:
            raise ValueError(f"contiguous cache must be [B={B}, L, {LATENT_DIM}], got {tuple(cache.shape)} "
                             "(pass block_table= for a paged pool)")
        return False, cache.shape[1], cache.shape[1], torch.arange(B, dtype=torch.int32, device=dev)[:, None]
    expect("block_table", block_table, shape=(B, None), dtype=(torch.int32, torch.int64), device=dev,
           what=f"[B={B}, max_pages]")  # q's batch and device
    page_size = cache.shape[1]
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page size (cache.shape[1]) must be a power of two, got {page_size}")
    return True, page_size, block_table.shape[1] * page_size, block_table


def validate(q, cache, lengths=None, block_table=None, *, max_heads: int | None = None) -> Inputs:
    """Check one decode call and return what the kernels need (ValueError naming the argument).

    q [B, q_len 1..8, H, 576]; cache [B, L, 576] (contiguous) or a pool [num_pages, page_size, 576]
    with block_table [B, max_pages] (int32/int64, page ids in the pool) and lengths [B] (required
    when paged; default: the whole cache). Token t of a verification group of request b sits at
    position lengths[b] - q_len + t, so lengths[b] >= q_len. One host sync (lengths, page ids)."""
    _check_query(q, max_heads)
    _check_cache(q, cache)
    B, Tq, H, _ = q.shape
    dev = q.device
    paged, page_size, capacity, bt = _check_table(block_table, cache, B, dev)
    if lengths is None and paged:
        raise ValueError("lengths is required with a paged cache (block_table=...): the pool does not say "
                         "where each request's history ends")
    if lengths is None:
        lens_host = (capacity,) * B
        lens = torch.full((B,), capacity, dtype=torch.int32, device=dev)
    else:
        lens_host = tuple(int_list("lengths", lengths, size=B))  # the one host sync, at plan time
        lens = lengths if isinstance(lengths, torch.Tensor) else torch.tensor(lens_host)
        lens = lens.to(device=dev, dtype=torch.int32).contiguous()
    for b, n in enumerate(lens_host):
        if n > capacity:
            raise ValueError(f"lengths[{b}] = {n} is longer than the cache holds ({capacity} positions"
                             f"{' = max_pages x page_size' if paged else ''})")
        if n < Tq:
            raise ValueError(f"lengths[{b}] = {n} is shorter than q_len {Tq} (the new tokens are in the "
                             f"cache)")
    if paged:
        used = (torch.tensor(lens_host, device=dev) + page_size - 1) // page_size
        pages = bt[torch.arange(bt.shape[1], device=dev)[None, :] < used[:, None]].long()
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= cache.shape[0]):
            raise ValueError(f"block_table holds page ids outside the pool [0, {cache.shape[0]}) for "
                             f"positions in use: min {int(pages.min())}, max {int(pages.max())}")
    # Narrowed only now, every id in use checked: ids past a request's length are never read. An
    # int32 table stays the caller's tensor, so a plan sees the caller's later page assignments.
    bt = bt.to(torch.int32).contiguous()
    return Inputs(B, Tq, H, cache, paged, page_size, bt, lens, lens_host, capacity)


def check_scale(scale) -> float:
    """The softmax scale as a float (default 192^-0.5); ValueError unless positive and finite."""
    return DEFAULT_SCALE if scale is None else positive_finite("scale", scale)


def check_num_splits(num_splits, upper: int) -> None:
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or not 1 <= num_splits <= upper):
        raise ValueError(f"num_splits must be an integer in 1..{upper}, got {num_splits!r}")


def _positive(**values) -> None:
    for label, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{label} must be a positive integer, got {v!r}")


# ----------------------------------------------------------------------------------------------
# split policies


def split_cost(splits: int, batch: int, context_len: int, compute_units: int, *, groups_per_request: int = 1,
               block_n: int = 64, programs_per_unit: int = 1, overhead_blocks: float = 2.0,
               merge_blocks: float = 6.0,
               merge_blocks_per_split: float = 0.01) -> float:
    """Modelled time of the split-history decode, in units of "one program reading one tile of
    block_n latent rows".

    Programs run in waves of compute_units x programs_per_unit (how many fit on one unit at once);
    each program reads its share of the tiles plus a fixed cost (loading the query, writing a fp32
    partial) worth `overhead_blocks` tiles. Splitting (s > 1) adds the merge launch (`merge_blocks`)
    and a merge read that grows with s."""
    blocks = max(1, -(-context_len // block_n))
    programs = batch * groups_per_request * splits
    waves = -(-programs // max(1, compute_units * programs_per_unit))
    cost = waves * (-(-blocks // splits) + overhead_blocks)
    if splits > 1:
        cost += merge_blocks + merge_blocks_per_split * splits
    return float(cost)


def choose_num_splits(batch: int, context_len: int, compute_units: int | None = None, *,
                      groups_per_request: int = 1, block_n: int = 64, programs_per_unit: int = 1,
                      max_splits: int = MAX_SPLITS, **cost_terms) -> int:
    """How many pieces the Triton kernel cuts each request's history into: the split count with
    the lowest `split_cost` (ties go to fewer splits).

    The rule fills the machine: with few requests (B = 1 at TP8 decode) and a long history, the
    programs B x groups x s should cover the compute units once; each piece must still be worth its
    fixed cost, so a short history gets few splits, and a batch that already fills the machine gets
    one (no merge). `compute_units` defaults to `env.detect().compute_units` (132 SMs on an H200,
    256 CUs on an MI355X).

    Peers, for comparison: AITER's non-persistent path scores split counts 1..16 by CU occupancy x
    avg_kv / (avg_kv + 84.1 x s), a similar fill-the-units rule capped at 16 splits; FlashMLA's
    scheduler instead cuts the whole batch's tiles, plus a fixed overhead per request, into one equal
    share per SM part, so a piece may end inside one request and start in the next."""
    _positive(batch=batch, context_len=context_len, groups_per_request=groups_per_request, block_n=block_n,
              programs_per_unit=programs_per_unit, max_splits=max_splits)
    units = env.detect().compute_units if compute_units is None else compute_units
    if not isinstance(units, int) or units < 1:
        raise ValueError(f"compute_units must be a positive integer, got {units!r}")
    blocks = -(-context_len // block_n)
    best, best_cost = 1, math.inf
    for s in range(1, min(max_splits, blocks) + 1):
        c = split_cost(s, batch, context_len, units, groups_per_request=groups_per_request, block_n=block_n,
                       programs_per_unit=programs_per_unit, **cost_terms)
        if c < best_cost - 1e-9:
            best, best_cost = s, c
    return best


def choose_splits(batch: int, max_len: int, compute_units: int, *, blocks_per_unit: int = 1,
                  num_splits: int | None = None, block_n: int = 32,
                  max_splits: int = 65535) -> tuple[int, int]:
    """(pieces per request, positions per piece) for the CUDA kernels: at most one wave. The batch's
    blocks cover the compute units once (blocks_per_unit each) and never spill into a second wave,
    each piece a whole number of block_n-row tiles. Why never spill: a second, partial wave's blocks
    start only when the first's end, so the time is two pieces long either way, and the fuller wave
    streams faster (docs/mla_padding.md). The piece length comes from the
    longest request; shorter requests leave their last pieces empty (zero-weight partials).
    num_splits forces the count (rounded the same way)."""
    _positive(batch=batch, max_len=max_len, compute_units=compute_units, blocks_per_unit=blocks_per_unit,
              block_n=block_n)
    check_num_splits(num_splits, max_splits)
    tiles = -(-max_len // block_n)
    want = max(1, compute_units * blocks_per_unit // batch) if num_splits is None else num_splits
    chunk_tiles = -(-tiles // min(want, tiles))
    return -(-tiles // chunk_tiles), chunk_tiles * block_n


def piece_len(max_len: int, splits: int, block_n: int) -> int:
    """Positions per history piece: the longest request cut into `splits`, rounded up to whole tiles.
    Shorter requests of a ragged batch fill fewer pieces (their last pieces are empty programs that
    write a zero-weight partial); the kernel's time is the longest piece either way."""
    return -(-(-(-max_len // splits)) // block_n) * block_n


# ----------------------------------------------------------------------------------------------
# caches: paged <-> contiguous


def to_paged(cache: torch.Tensor, page_size: int = 64, *, shuffle: bool = True, seed: int = 0,
             spare_pages: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged copy of a contiguous cache [B, L, 576]: (pool [num_pages, page_size, 576], block_table
    [B, ceil(L / page_size)] int32). With shuffle, pages sit in the pool in a random order, as they
    do in a server after many requests come and go; `spare_pages` adds unused pages to the pool.
    Unused rows hold random values, never zeros."""
    expect("cache", cache, shape=3, what="[B, L, D]")
    page_size = int_arg("page_size", page_size, low=1, what="a power of two: an int")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    spare_pages = int_arg("spare_pages", spare_pages)
    B, L, D = cache.shape
    per = -(-L // page_size)
    n_pages = B * per + spare_pages
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_pages, generator=gen) if shuffle else torch.arange(n_pages)
    block_table = order[: B * per].view(B, per).to(torch.int32).to(cache.device)
    pool = torch.empty(n_pages, page_size, D, dtype=cache.dtype, device=cache.device)
    pool.normal_() if pool.is_floating_point() else pool.zero_()
    padded = torch.zeros(B, per * page_size, D, dtype=cache.dtype, device=cache.device)
    padded[:, :L] = cache
    pool[block_table.long().flatten()] = padded.view(B * per, page_size, D)
    return pool, block_table


def gather_paged(pool: torch.Tensor, block_table: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """The contiguous [B, L, 576] view of a paged cache (L = max_pages x page_size, or `length`)."""
    expect("block_table", block_table, shape=2, dtype=(torch.int32, torch.int64), what="[B, max_pages]")
    if length is not None:
        length = int_arg("length", length, high=block_table.shape[1] * pool.shape[1])
    B, per = block_table.shape
    rows = pool[block_table.long().flatten()].view(B, per * pool.shape[1], pool.shape[2])
    return rows if length is None else rows[:, :length]
