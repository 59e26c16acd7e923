"""Decode context parallelism (DCP) for MLA: the latent history split by position across ranks.

Under TP8 each GPU computes 12 of K3's 96 query heads but keeps the whole 576-wide latent of every
position. Under DCP over N ranks each rank keeps only the positions it owns; at decode the ranks
gather each other's queries, each rank attends with all heads over its own positions (the MLA op's
own decode, `k3lab.ops.mla_decode`), and the partial outputs are merged by their log-sum-exp so
that every rank ends with exactly its own heads' attention over the whole history.

Layout: position p lives on rank (p // interleave) % N. With interleave 1 (the seed's layout)
rank r holds r, r + N, r + 2N, ...; a block interleave of I deals out runs of I positions. A rank
stores its positions in order, contiguously: local row j of rank r is global position
(j // I) * N * I + r * I + j % I.

Queries and causality. `lengths` [B] are the global context lengths, the Tq new tokens included;
token t of request b sits at global position lengths[b] - Tq + t and sees every position up to its
own. On a shard the visible prefix grows by 0 or 1 row per token (a new position lives on one
rank), which the op's causal rule (one row per token) cannot express, so a rank runs its local
attention in two parts: the op over the rows every token sees, with the Tq tokens folded into the
head dimension (one read of the shard for all heads and tokens), and a masked product over the at
most Tq - 1 newest local rows that only later tokens see; the two are merged by lse. A request of
which a rank holds no visible row gets o = 0, lse = -inf from that rank (the op is not asked for a
zero-length history).

Merges (per layer and rank; `exchange_bytes` counts the bytes):
- "ag_rs": all-gather the queries; local attention for all N*H heads; all-gather the lse [N*H];
  rescale each partial by exp(lse_local - lse_global); reduce-scatter over heads (3 collectives).
- "a2a": all-gather the queries; local attention; one all-to-all of the partial outputs with their
  lse packed into the same rows; a local `merge_partials` over the N pieces (2 collectives).

Inputs are checked before the first collective that depends on them: every rank checks its own
arguments, then one all-gather of a small vector (the shapes, the layout, a hash of `lengths` and,
on a refusal, its message) makes every rank raise the same ValueError naming the rank and the
argument, instead of some ranks waiting in a collective that never completes.

Checked on gloo (CPU ranks) only; the NCCL / RCCL paths are not yet run on a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from k3lab.ops import int_arg, int_list
from k3lab.ops.mla_decode.merge import lse_weights, merge_partials  # merge_partials is re-exported

LATENT_DIM = 576
VALUE_DIM = 512
MAX_Q_LEN = 8
DEFAULT_SCALE = 192 ** -0.5
MERGES = ("ag_rs", "a2a")
LOCAL_OPS = ("after", "before", "reference")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
LSE_BYTES = 4  # the lse travels in float32


# ------------------------------------------------------------------------------------------ layout
def _check_layout(world_size, interleave, rank=None):
    for name, v in (("world_size", world_size), ("interleave", interleave)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank
                             < world_size):
        raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")


def _positions(name: str, x):
    """x, a position or count: an int >= 0 or an integer tensor of them (read once to check: a host sync
    for a GPU tensor). Never a bool or a float (2.5 positions has no owner), never negative (a count of
    -5 positions would come back as a negative local count)."""
    if not isinstance(x, torch.Tensor):
        return int_arg(name, x)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor (not bool or floating point), got {x.dtype}")
    if x.numel() and int(x.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got a minimum of {int(x.min())}")
    return x


def owner(position, world_size: int, interleave: int = 1):
    """The rank holding `position` (an int >= 0 or an integer tensor): (position // interleave) %
    world_size."""
    _check_layout(world_size, interleave)
    position = _positions("position", position)
    return (position // interleave) % world_size


def owned_count(n, world_size: int, rank: int, interleave: int = 1):
    """How many of the positions 0..n-1 live on `rank` (n an int >= 0 or an integer tensor)."""
    _check_layout(world_size, interleave, rank)
    n = _positions("n", n)
    cycle = world_size * interleave
    rem = n % cycle - rank * interleave
    if isinstance(rem, torch.Tensor):
        part = rem.clamp(0, interleave)
    else:
        part = min(max(rem, 0), interleave)
    return (n // cycle) * interleave + part


def global_positions(count: int, world_size: int, rank: int, interleave: int = 1,
                     device=None) -> torch.Tensor:
    """The global positions of local rows 0..count-1 of `rank`, int64 [count]."""
    _check_layout(world_size, interleave, rank)
    j = torch.arange(int_arg("count", count), device=device)
    return (j // interleave) * world_size * interleave + rank * interleave + j % interleave


def shard_cache(cache: torch.Tensor, lengths, world_size: int, rank: int, interleave: int = 1, *,
                capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of a contiguous cache [B, L, 576]: (local_cache [B, C, 576], local_lengths [B]).

    local_cache holds, in order, the positions below lengths[b] that `rank` owns; rows past
    local_lengths[b] are zero. C is the rank's share of `capacity` global positions (default L), so
    that `append` has room for the tokens still to come. local_lengths is int64 on cache's device.
    A paged shard: `k3lab.ops.mla_decode.to_paged(local_cache, page_size)`.
    """
    _check_layout(world_size, interleave, rank)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.shape[2] != LATENT_DIM:
        raise ValueError(f"cache must be a tensor [B, L, {LATENT_DIM}], got "
                         f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__}")
    B, L, _ = cache.shape
    lens = int_list("lengths", lengths, size=B)
    if capacity is None:
        capacity = L
    int_arg("capacity", capacity, low=L, what="a number of positions (at least the cache length): an int")
    if max(lens, default=0) > L:
        raise ValueError(f"lengths must be <= the cache length {L}, got max {max(lens)}")
    local_cap = owned_count(capacity, world_size, rank, interleave)
    local_lens = [owned_count(n, world_size, rank, interleave) for n in lens]
    local = empty_shard(B, capacity, world_size, rank, interleave, dtype=cache.dtype, device=cache.device)
    pos = global_positions(min(local_cap, owned_count(L, world_size, rank, interleave)), world_size, rank,
                           interleave, device=cache.device)
    rows = cache[:, pos]
    keep = (
        torch.arange(pos.numel(), device=cache.device)[None, :]
        < torch.tensor(local_lens, device=cache.device)[:, None]
    )
    local[:, :pos.numel()] = torch.where(keep[..., None], rows,
                                         torch.zeros((), dtype=cache.dtype, device=cache.device))
    return local, torch.tensor(local_lens, dtype=torch.int64, device=cache.device)


def empty_shard(batch: int, capacity: int, world_size: int, rank: int, interleave: int = 1, *,
                dtype=torch.bfloat16, device=None) -> torch.Tensor:
    """A zeroed local cache [batch, owned_count(capacity), 576]: what one MLA layer of a rank allocates."""
    _check_layout(world_size, interleave, rank)
    rows = owned_count(int_arg("capacity", capacity), world_size, rank, interleave)
    return torch.zeros(int_arg("batch", batch, low=1), rows, LATENT_DIM, dtype=dtype, device=device)


def append(local_cache: torch.Tensor, local_lengths, new_rows: torch.Tensor, lengths, world_size: int,
           rank: int,
           interleave: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the latent rows of the Tq new tokens that this rank owns; skip the others.

    new_rows [B, Tq, 576]: the rows of global positions lengths[b] - Tq + t; lengths are the global
    lengths with the new tokens; local_lengths [B] the rank's counts before them. Writes in place
    into local_cache [B, C, 576] and returns (local_cache, the new local_lengths int64 [B]).
    """
    _check_layout(world_size, interleave, rank)
    if (
        not isinstance(local_cache, torch.Tensor)
        or local_cache.dim() != 3
        or local_cache.shape[2] != LATENT_DIM
    ):
        raise ValueError(
            f"local_cache must be [B, C, {LATENT_DIM}], got "
            f"{tuple(local_cache.shape) if isinstance(local_cache, torch.Tensor) else local_cache!r}"
        )
    B, C, _ = local_cache.shape
    if not isinstance(new_rows, torch.Tensor) or new_rows.dim() != 3 or new_rows.shape[0] != B \
            or new_rows.shape[2] != LATENT_DIM:
        raise ValueError(f"new_rows must be [B={B}, Tq, {LATENT_DIM}], got "
                         f"{tuple(new_rows.shape) if isinstance(new_rows, torch.Tensor) else new_rows!r}")
    Tq = new_rows.shape[1]
    lens = int_list("lengths", lengths, size=B)
    before = int_list("local_lengths", local_lengths, size=B)
    for b, n in enumerate(lens):
        if n < Tq:
            raise ValueError(f"lengths[{b}] = {n} is shorter than the {Tq} new tokens it includes")
        want = owned_count(n - Tq, world_size, rank, interleave)
        if before[b] != want:
            raise ValueError(f"local_lengths[{b}] = {before[b]}, but rank {rank} owns {want} of the "
                             f"{n - Tq} positions before the new tokens (interleave {interleave})")
        if owned_count(n, world_size, rank, interleave) > C:
            raise ValueError(f"local_cache holds {C} rows per request; request {b} needs "
                             f"{owned_count(n, world_size, rank, interleave)} after the append")
    # the owned new rows, written with one indexed store
    b_idx, t_idx, rows = [], [], []
    for b, n in enumerate(lens):
        for t in range(Tq):
            p = n - Tq + t
            if owner(p, world_size, interleave) == rank:
                b_idx.append(b)
                t_idx.append(t)
                rows.append(owned_count(p, world_size, rank, interleave))
    if b_idx:
        dev = local_cache.device
        bi, ti, ri = (torch.tensor(v, device=dev) for v in (b_idx, t_idx, rows))
        local_cache[bi, ri] = new_rows.to(device=dev, dtype=local_cache.dtype)[bi, ti]
    after = [owned_count(n, world_size, rank, interleave) for n in lens]
    return local_cache, torch.tensor(after, dtype=torch.int64, device=local_cache.device)


# ------------------------------------------------------------------------------- local attention
def _local_fn(local: str):
    """The MLA op's decode for a rank's shard; the Tq tokens arrive folded into the heads."""
    from k3lab.ops import mla_decode

    if local == "after":
        return lambda q, c, n, bt, s: mla_decode.mla_decode_after(q, c, n, block_table=bt, scale=s,
                                                                  fold_heads=True)
    if local == "before":
        return lambda q, c, n, bt, s: mla_decode.mla_decode_before(q, c, n, block_table=bt, scale=s)
    return lambda q, c, n, bt, s: mla_decode.reference(q, c, n, block_table=bt, scale=s)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(local_cache, block_table, idx):
    """Local rows idx [B, J] of each request, from a contiguous or a paged shard."""
    B = idx.shape[0]
    if block_table is None:
        return local_cache[torch.arange(B, device=idx.device)[:, None], idx]
    page = local_cache.shape[1]
    pages = torch.gather(block_table.long(), 1, idx // page)
    return local_cache[pages, idx % page]


def local_attention(q, local_cache, local_lengths, lengths, world_size: int, rank: int, interleave: int = 1,
                    *,
                    block_table=None, scale=None, local: str = "after"):
    """Attention of q [B, Tq, HH, 576] over this rank's rows only: the partial (o, lse) that DCP merges.

    o [B, Tq, HH, 512] in q's dtype, lse [B, Tq, HH] in float32 (float64 for float64 q); o = 0 and
    lse = -inf where the rank holds no row a token sees. The inputs get `dcp_decode`'s own checks on
    this rank (lengths and local_lengths integers, local_lengths what the layout gives this rank and
    within the shard's rows, page ids in the pool), before anything runs; no collective.
    """
    lens, held = _check_inputs(q, local_cache, local_lengths, lengths, world_size, rank, interleave, "ag_rs",
                               block_table, scale, local, None)
    return _attend(q, local_cache, held, lens, world_size, rank, interleave, block_table=block_table,
                   scale=scale, local=local)


def _attend(q, local_cache, held, lens, world_size, rank, interleave, *, block_table, scale, local):
    """`local_attention` on checked inputs: held and lens are the host lists `_check_inputs` returns."""
    B, Tq, HH, D = q.shape
    acc = _acc_dtype(q.dtype)
    scale = DEFAULT_SCALE if scale is None else scale
    seen = [owned_count(n - Tq + 1, world_size, rank, interleave) for n in lens]  # rows every token sees
    dev = q.device
    o = torch.zeros(B, Tq, HH, VALUE_DIM, dtype=acc, device=dev)
    lse = torch.full((B, Tq, HH), float("-inf"), dtype=acc, device=dev)
    if max(seen) > 0:
        n_op = torch.tensor([max(n, 1) for n in seen], dtype=torch.int32, device=dev)
        o_p, lse_p = _local_fn(local)(q.reshape(B, 1, Tq * HH, D), local_cache, n_op, block_table, scale)
        some = torch.tensor(seen, device=dev)[:, None, None] > 0
        o = torch.where(some[..., None], o_p.reshape(B, Tq, HH, VALUE_DIM).to(acc), o)
        lse = torch.where(some, lse_p.reshape(B, Tq, HH).to(acc), lse)
    extra = [h - s for h, s in zip(held, seen)]  # newest local rows only later tokens see (< Tq)
    if Tq > 1 and max(extra) > 0:
        J = max(extra)
        j = torch.arange(J, device=dev)
        idx = (torch.tensor(seen, device=dev)[:, None] + j[None, :]).clamp(max=max(held) - 1)
        rows = _rows(local_cache, block_table, idx).to(acc)  # [B, J, 576]
        gpos = (idx // interleave) * world_size * interleave + rank * interleave + idx % interleave
        qpos = torch.tensor(lens, device=dev)[:, None] - Tq + torch.arange(Tq, device=dev)[None, :]
        vis = (j[None, None, :] < torch.tensor(extra, device=dev)[:, None, None]) & \
            (gpos[:, None, :] <= qpos[:, :, None])  # [B, Tq, J]
        scores = torch.einsum("bthd,bjd->bthj", q.to(acc), rows) * scale
        scores = scores.masked_fill(~vis[:, :, None, :], float("-inf"))
        lse_t = torch.logsumexp(scores, dim=-1)
        p = torch.exp(scores - torch.where(torch.isfinite(lse_t), lse_t, torch.zeros_like(lse_t))[..., None])
        o_t = torch.einsum("bthj,bjv->bthv", p, rows[..., :VALUE_DIM])
        o, lse = merge_partials(torch.stack([o, o_t]), torch.stack([lse, lse_t]), "torch", check_values=False)
    return o.to(q.dtype), lse


# ------------------------------------------------------------------------------------- checking
def _shape(x) -> str:
    return str(list(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _check_inputs(q, local_cache, local_lengths, lengths, world_size, rank, interleave, merge, block_table,
                  scale, local, merge_impl):
    """This rank's own checks; raises ValueError naming the argument. Returns (lengths, local_lengths)."""
    _check_layout(world_size, interleave, rank)
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if local not in LOCAL_OPS:
        raise ValueError(f"local must be one of {LOCAL_OPS}, got {local!r}")
    if local == "after":  # AITER is taken only when forced; its decode gives no lse to merge by
        from k3lab.ops.mla_decode import BACKENDS, peers

        peers.require_lse(BACKENDS.forced()[0] or "", "DCP")
    if merge_impl not in (None, "torch", "triton"):
        raise ValueError(f"merge_impl must be None, 'torch' or 'triton', got {merge_impl!r}")
    if scale is not None and (not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"scale must be a positive number or None, got {scale!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[3] != LATENT_DIM:
        raise ValueError(f"q must be a tensor [B, Tq, H, {LATENT_DIM}] (this rank's heads), got {_shape(q)}")
    B, Tq, H, _ = q.shape
    if not 1 <= Tq <= MAX_Q_LEN or B < 1 or H < 1:
        raise ValueError(f"q [B, Tq, H, 576] needs B >= 1, H >= 1 and Tq in 1..{MAX_Q_LEN}, got {_shape(q)}")
    if q.dtype not in DTYPES:
        raise ValueError(f"q.dtype must be one of {DTYPES}, got {q.dtype}")
    if (
        not isinstance(local_cache, torch.Tensor)
        or local_cache.dim() != 3
        or local_cache.shape[2] != LATENT_DIM
    ):
        raise ValueError(f"local_cache must be [B, C, {LATENT_DIM}] (or a paged pool with block_table), "
                         f"got {_shape(local_cache)}")
    if local_cache.dtype != q.dtype or local_cache.device != q.device:
        raise ValueError(f"local_cache ({local_cache.dtype}, {local_cache.device}) must match q "
                         f"({q.dtype}, {q.device})")
    if block_table is None:
        if local_cache.shape[0] != B:
            raise ValueError(f"local_cache must be [B={B}, C, {LATENT_DIM}], got {_shape(local_cache)}")
        capacity = local_cache.shape[1]
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B \
                or block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_table must be an integer tensor [B={B}, max_pages], got "
                             f"{_shape(block_table)}")
        capacity = block_table.shape[1] * local_cache.shape[1]
    lens = int_list("lengths", lengths, size=B)
    held = int_list("local_lengths", local_lengths, size=B)
    for b, n in enumerate(lens):
        if n < Tq:
            raise ValueError(f"lengths[{b}] = {n} is shorter than q_len {Tq} (lengths include the new "
                             f"tokens)")
        want = owned_count(n, world_size, rank, interleave)
        if held[b] != want:
            raise ValueError(f"local_lengths[{b}] = {held[b]}, but rank {rank} of {world_size} owns {want} "
                             f"of lengths[{b}] = {n} positions (interleave {interleave})")
        if want > capacity:
            raise ValueError(f"local_cache holds {capacity} rows per request; request {b} needs {want}")
    if block_table is not None and max(held) > 0:
        used = torch.tensor(held, device=block_table.device)[:, None] > \
            torch.arange(block_table.shape[1], device=block_table.device)[None, :] * local_cache.shape[1]
        ids = block_table[used]
        if int(ids.min()) < 0 or int(ids.max()) >= local_cache.shape[0]:
            raise ValueError(f"block_table holds page ids outside the pool [0, {local_cache.shape[0]})")
    return lens, held


_AGREE_FIELDS = ("problem", "B", "Tq", "H", "D", "dtype", "interleave", "merge", "local", "lengths", "scale",
                 "paged", "world")
_MSG_BYTES = 384


def _lengths_text(lens) -> str:
    """The lengths as a mismatch message shows them, cut to fit the gathered message."""
    text = str([int(n) for n in lens])
    return text if len(text) <= _MSG_BYTES else text[:_MSG_BYTES - 5] + " ...]"


def _lengths_hash(lens) -> int:
    h = 1469598103934665603
    for n in lens:
        h = ((h ^ (n + 1)) * 1099511628211) % (1 << 61)
    return h


def _agree(fields: dict, problem: str | None, group, device, lengths_text: str = ""):
    """One all-gather of every rank's fields (and refusal message, or else its lengths as text, shown
    when they differ); the same ValueError on every rank."""
    N = dist.get_world_size(group)
    head = torch.tensor([int(fields.get(k, 0)) for k in _AGREE_FIELDS], dtype=torch.int64)
    msg = (problem or lengths_text).encode()[:_MSG_BYTES].ljust(_MSG_BYTES, b"\0")
    body = torch.frombuffer(bytearray(msg), dtype=torch.uint8).view(torch.int64)
    mine = torch.cat([head, body]).to(device)
    every = torch.empty((N,) + mine.shape, dtype=torch.int64, device=device)
    _all_gather(every, mine, group)
    every = every.cpu()
    heads = every[:, :len(_AGREE_FIELDS)].tolist()
    texts = [bytes(every[j, len(_AGREE_FIELDS):].view(torch.uint8).tolist()).rstrip(b"\0")
             .decode(errors="replace") for j in range(N)]
    for j, h in enumerate(heads):
        if h[0]:
            raise ValueError(f"dcp_decode: rank {j} of {N} refused its inputs: {texts[j]}")
    names = {("B", "Tq", "H", "D"): "q's shape [B, Tq, H, 576]", ("dtype",): "q.dtype",
             ("interleave",): "interleave", ("merge",): "merge", ("local",): "local",
             ("lengths",): "lengths (the global context lengths)", ("scale",): "scale",
             ("paged",): "the cache layout (paged or not)"}
    for keys, label in names.items():
        cols = [_AGREE_FIELDS.index(k) for k in keys]
        vals = [tuple(h[c] for c in cols) for h in heads]
        if len(set(vals)) > 1:
            if keys == ("lengths",):  # compared by a hash; shown by value
                vals = [(t,) for t in texts]
            shown = ", ".join(f"rank {j}: {list(v) if len(v) > 1 else v[0]}" for j, v in enumerate(vals))
            raise ValueError(f"dcp_decode: {label} differs across ranks ({shown}); every rank must pass the "
                             f"same")


# ------------------------------------------------------------------------------------ collectives
# Every collective runs on flat views (rank-major along the one dim): the form gloo and NCCL both take.
# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor to *_single; either is used.
def _all_gather(out, inp, group):
    """out [N, *inp.shape] <- every rank's inp, in rank order."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out.view(-1), inp.contiguous().view(-1), group=group)


def _reduce_scatter(out, inp, group):
    """out [*] <- the sum over ranks of inp [N, *] at this rank's index."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out.view(-1), inp.contiguous().view(-1), group=group)


def _all_to_all(out, inp, group):
    """out [N, *] <- inp[rank] of every rank, in rank order."""
    dist.all_to_all_single(out, inp.contiguous(), group=group)


def _lse_width(dtype: torch.dtype) -> int:
    """Elements of an o row that carry its lse in the a2a merge: the float32 bits, or one wide element."""
    size = torch.empty((), dtype=dtype).element_size()
    return 1 if size >= LSE_BYTES else LSE_BYTES // size


def _pack_lse(lse, dtype):
    if _lse_width(dtype) == 1:
        return lse.to(dtype)[..., None]
    return lse.to(torch.float32).contiguous()[..., None].view(dtype)


def _unpack_lse(cols, lse_dtype):
    if cols.shape[-1] == 1:
        return cols[..., 0].to(lse_dtype)
    return cols.view(torch.float32)[..., 0].to(lse_dtype)


def _gather_queries(q, N, group):
    B, Tq, H, D = q.shape
    buf = torch.empty((N, B, Tq, H, D), dtype=q.dtype, device=q.device)
    _all_gather(buf, q.contiguous(), group)
    return buf.permute(1, 2, 0, 3, 4).reshape(B, Tq, N * H, D)


def _merge_ag_rs(o_loc, lse_loc, N, rank, H, group):
    B, Tq = o_loc.shape[:2]
    every = torch.empty((N,) + tuple(lse_loc.shape), dtype=lse_loc.dtype, device=lse_loc.device)
    _all_gather(every, lse_loc.contiguous(), group)
    weights, total = lse_weights(every, check_values=False)  # the op's own lse
    factor = weights[rank]  # exp(lse_local - lse_global); 0 for an empty shard
    scaled = (o_loc.to(factor.dtype) * factor[..., None]).to(o_loc.dtype)
    send = scaled.view(B, Tq, N, H, VALUE_DIM).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty((B, Tq, H, VALUE_DIM), dtype=o_loc.dtype, device=o_loc.device)
    _reduce_scatter(out, send, group)
    return out, total[..., rank * H:(rank + 1) * H].contiguous()


def _merge_a2a(o_loc, lse_loc, N, H, group, impl):
    B, Tq = o_loc.shape[:2]
    k = _lse_width(o_loc.dtype)
    send = torch.empty((N, B, Tq, H, VALUE_DIM + k), dtype=o_loc.dtype, device=o_loc.device)
    send[..., :VALUE_DIM] = o_loc.view(B, Tq, N, H, VALUE_DIM).permute(2, 0, 1, 3, 4)
    send[..., VALUE_DIM:] = _pack_lse(lse_loc.view(B, Tq, N, H).permute(2, 0, 1, 3), o_loc.dtype)
    recv = torch.empty_like(send)
    _all_to_all(recv, send, group)
    return merge_partials(recv[..., :VALUE_DIM], _unpack_lse(recv[..., VALUE_DIM:], lse_loc.dtype), impl,
                          check_values=False)


# ---------------------------------------------------------------------------------------- decode
def dcp_decode(q, local_cache, local_lengths, lengths, *, group=None, interleave: int = 1,
               merge: str = "ag_rs",
               block_table=None, scale=None, local: str = "after", merge_impl: str | None = None,
               check: bool = True):
    """This rank's heads' MLA attention over the whole history, of which it holds one shard.

    q [B, Tq, H, 576]: this rank's H query heads (12 at TP8). local_cache [B, C, 576] (or a paged
    pool with block_table [B, max_pages]) and local_lengths [B]: the shard from `shard_cache` /
    `append`. lengths [B]: global context lengths including the Tq new tokens, the same on every
    rank. merge: "ag_rs" or "a2a" (module docstring). local: the op's decode run on the shard,
    "after" (default), "before" or "reference". merge_impl: the a2a merge's `merge_partials` impl,
    default "triton" on a GPU and "torch" on a CPU. check: agree the inputs across ranks first (one
    small all-gather); False skips it when the caller has checked the same shapes before.

    Returns (o [B, Tq, H, 512] in q's dtype, lse [B, Tq, H] float32, natural log), equal to
    single-rank attention over the whole history, on every rank for its own heads.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("dcp_decode needs an initialized process group (k3lab.parallel.spawn or "
                           "init_from_env)")
    N, rank = dist.get_world_size(group), dist.get_rank(group)
    problem, fields = None, {"world": N}
    try:
        lens, held = _check_inputs(q, local_cache, local_lengths, lengths, N, rank, interleave, merge,
                                   block_table,
                                   scale, local, merge_impl)
        fields.update(B=q.shape[0], Tq=q.shape[1], H=q.shape[2], D=q.shape[3], dtype=DTYPES.index(q.dtype),
                      interleave=interleave, merge=MERGES.index(merge), local=LOCAL_OPS.index(local),
                      lengths=_lengths_hash(lens), paged=block_table is not None,
                      scale=int(torch.tensor(float(scale or 0.0), dtype=torch.float64).view(torch.int64)))
    except ValueError as exc:
        if not check or N == 1:
            raise
        problem = str(exc)
    if check and N > 1:
        from k3lab.parallel.launch import rank_device

        device = q.device if isinstance(q, torch.Tensor) else rank_device()
        text = _lengths_text(lens) if problem is None else ""
        _agree({**fields, "problem": problem is not None}, problem, group, device, text)
    H = q.shape[2]
    q_all = _gather_queries(q, N, group) if N > 1 else q
    o_loc, lse_loc = _attend(q_all, local_cache, held, lens, N, rank, interleave, block_table=block_table,
                             scale=scale, local=local)
    if N == 1:
        return o_loc, lse_loc
    if merge == "ag_rs":
        return _merge_ag_rs(o_loc, lse_loc, N, rank, H, group)
    return _merge_a2a(o_loc, lse_loc, N, H, group, merge_impl)  # None: merge's own chooser


# ------------------------------------------------------------------------------ bytes and memory
def exchange_bytes(batch: int, q_len: int, heads: int, world_size: int, merge: str = "ag_rs",
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """Collective calls and bytes of one `dcp_decode` per layer and rank, by formula (check=False).

    heads: the rank's own heads (12 at DCP8 over TP8); dtype: q's and o's dtype (the lse travels
    as float32). Each collective lists the bytes of its input tensor and the bytes the rank sends
    to the others (ring accounting: an all-gather sends (N - 1) x its input; a reduce-scatter and an
    all-to-all send (N - 1) / N of theirs). World size 1: no collective.
    """
    _check_layout(world_size, 1)
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    for name, v in (("batch", batch), ("q_len", q_len), ("heads", heads)):
        int_arg(name, v, low=1)
    e = torch.empty((), dtype=dtype).element_size()
    N, rows = world_size, batch * q_len * heads
    lse_e = 8 if dtype == torch.float64 else LSE_BYTES
    colls = []
    if N > 1:
        colls.append(("all_gather", "q", rows * LATENT_DIM * e))
        if merge == "ag_rs":
            colls.append(("all_gather", "lse", rows * N * lse_e))
            colls.append(("reduce_scatter", "o", N * rows * VALUE_DIM * e))
        else:
            colls.append(("all_to_all", "o+lse", N * rows * (VALUE_DIM + _lse_width(dtype)) * e))
    out = []
    for op, what, nbytes in colls:
        sent = (N - 1) * nbytes if op == "all_gather" else nbytes * (N - 1) // N
        out.append({"op": op, "what": what, "input_bytes": nbytes, "sent_bytes": sent})
    return {"merge": merge, "world_size": N, "calls": len(out),
            "sent_bytes": sum(c["sent_bytes"] for c in out),
            "collectives": out}


def cache_bytes_per_rank(config, tokens: int, world_size: int = 1, *, dtype_bytes: float = 1, rank: int = 0,
                         interleave: int = 1) -> float:
    """MLA history one rank holds for a `tokens`-long conversation, all MLA layers (FP8: dtype_bytes 1).

    world_size 1 is TP alone (every GPU keeps every position); rank 0 is the busiest rank.
    """
    int_arg("tokens", tokens)
    rows = owned_count(tokens, world_size, rank, interleave)
    return config.num_mla_layers * rows * config.mla_latent_bytes_per_position(dtype_bytes)


ALLOCATOR_PAGE = 2 * 1024 * 1024  # torch's caching allocator: large segments in whole 2 MiB pages


def measure_shard_bytes(config, tokens: int, world_size: int = 1, *, dtype=torch.bfloat16, device=None,
                        rank: int = 0, interleave: int = 1) -> dict:
    """Allocate one rank's cache for all MLA layers and measure its bytes.

    The layers' shards are views of one pool [layers, 1, rows, 576], as a server allocates its cache:
    torch's CUDA allocator hands out large blocks in 2 MiB pages, so 24 separate ~10 MB shards would
    each carry up to a page of rounding, one pool at most one page. On a GPU: the change of
    torch.cuda.memory_allocated (what the allocator handed out); on a
    CPU: the pool's storage bytes. Returns {"formula", "measured", "how", "slack", "agrees", ...}; the
    pool is freed again.

    slack is what the measurement may add to the formula by how it measures: 0 for storage bytes; on a
    GPU one allocator page (ALLOCATOR_PAGE, 2 MiB), because torch's caching allocator (CUDA and ROCm)
    rounds a large segment up to whole pages and splits a block only when more than 1 MiB would be left,
    so memory_allocated counts up to about a page beyond the request. That slack is a fixed number of
    bytes, not a share: under 1% of K3's 245 MB DCP8 shard, but 2.6% of the `tiny` preset's 20 MB.
    agrees: formula <= measured <= formula + slack, the check every caller makes.
    """
    device = torch.device(device) if device is not None else torch.device("cpu")
    e = torch.empty((), dtype=dtype).element_size()
    formula = cache_bytes_per_rank(config, tokens, world_size, dtype_bytes=e, rank=rank,
                                   interleave=interleave)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
    _check_layout(world_size, interleave, rank)
    rows = owned_count(tokens, world_size, rank, interleave)
    pool = torch.zeros(config.num_mla_layers, 1, rows, LATENT_DIM, dtype=dtype, device=device)
    if cuda:
        torch.cuda.synchronize(device)
        measured, how = torch.cuda.memory_allocated(device) - start, "torch.cuda.memory_allocated"
    else:
        measured, how = pool.untyped_storage().nbytes(), "storage bytes"
    del pool
    slack = ALLOCATOR_PAGE if cuda else 0
    return {"formula": formula, "measured": measured, "how": how, "slack": slack,
            "agrees": formula <= measured <= formula + slack, "dtype": str(dtype).replace("torch.", ""),
            "tokens": tokens, "world_size": world_size}


