"""Absorbed MLA decode over the 576-wide latent cache: the 12-head "before" and the padded,
split-history "after" (seed section 4), plus the plain-PyTorch peers and, on ROCm, AITER.

Every query head attends to the same latent rows (MQA over the latent): keys are the whole 576-wide
row [c 512 | k_pe 64], values its first 512 columns, softmax scale 192^-0.5. Each function returns
`(o [B, Tq, H, 512], lse [B, Tq, H])`, where lse is the **natural-log** log-sum-exp of the scaled
scores (kernels work in base 2 inside and convert once at the end), the figure by which partial
results are merged. The reference is `k3lab.nn.mla.latent_attention`.

Two launch policies compute the same thing:

* **before** (`mla_decode_before`): the conservative policy, one program per query row (request x
  verify token x head) walking the request's whole history. At TP8 decode (B = 1, 12 heads) that is
  12 programs on a GPU of 132 SMs or 256 CUs, however long the conversation is. Twelve rows cannot
  feed the matrix units: Triton's `tl.dot` needs at least 16 rows (NVIDIA mma and AMD MFMA tiles are
  16 rows tall), and this kernel may not pad, so every score and value product runs as a broadcast
  multiply and a reduction on the vector units (CUDA cores / VALU), one head per program. The latent
  row is re-read once per head (from L2 when it fits there). On NVIDIA GPUs with bf16 inputs
  `plan_before` runs the same policy as a CUDA-core kernel (k3lab.ops.mla_before_cuda), 9-10x faster
  than this Triton one on the H200, so that before / after measures the policy.

* **after** (`mla_decode_after`): the query is padded to 16 heads (rows past the real heads are
  masked loads of zero, computed and never written: each head's softmax is its own, so the 12 real
  heads are unchanged), which lets `tl.dot` put both products on the matrix units and read each
  latent tile once for all heads. The history is split into `num_splits` pieces handled by separate
  programs; each writes a partial output and its log-sum-exp, and a second, small kernel merges the
  pieces: lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s. `choose_num_splits` picks the
  split count from the device's compute units, the batch and the context length. With one split the
  first kernel writes the final result and the merge is skipped. `pad="copy"` instead builds the
  seed's explicit 16-head query buffer (vLLM PR 50578) and slices the 16-head output: same result,
  two extra small copies.

Both take a contiguous cache [B, L, 576] or a paged one (a pool [num_pages, page_size, 576] with a
block table [B, max_pages]), per-request context lengths, and multi-token verification (q_len 1..8,
causal inside the verification group: token t of request b sits at position lengths[b] - q_len + t).

Bad input raises ValueError before any kernel runs. Validation reads `lengths` and the block table
on the host (one device sync), so it is done once per `plan_*` call; a plan then launches with no
checks and no host sync (CUDA-graph capturable). Contents that change after planning are not
re-checked. A paged cache needs `lengths` (the pool does not say where a request ends).

Which kernel runs the after. For one-token bf16 decodes on NVIDIA sm_90 with nvcc, `plan_after`
returns a plan of the hand-written CUDA kernel (k3lab/ops/mla_decode_cuda.py, kernels/mla_decode.cu:
mma.sync on the 16 padded heads, bulk copies into a 5-deep ring): on the H200 20.0 / 47.6 us at
32K / 128K against this module's Triton kernel's 21.9 / 52.3 in the same run (44% / 75% of the copy
bandwidth, commit 1a77c32). `cuda_after_status` says whether it runs here and why not. It also
takes verification groups of 2 to 8 tokens (on a paged cache: each token a one-token request
over the same pages, `mla_decode_cuda.plan_verify`; CUDA_VERIFY_Q_LENS says which and why); everywhere
else (CPU interpreter, ROCm, longer verification groups, fp32/fp16, pages under 32 rows) the Triton
kernels below run. kernel='split' asks for the Triton kernel by name. The CUDA plan merges its
pieces with a second kernel; its fused form (one cooperative launch merging after a grid barrier)
is opt-in through K3LAB_MLA_MERGE=auto (mla_decode_cuda.choose_merge): right on the H200 but not
faster there (19.97 against 19.80 us at 32K, commit a13fe58).

Status on GPUs (the Triton kernels). Both versions ran on an H200 and were correct in every case. The after kernel at
32K / 128K (B = 1, graph replay, share of the 4.25 TB/s copy bandwidth): 26% / 38% in the first
version (64-row tiles, 2 stages, block table read in the loop; eaaa8f9); 38% / 67% with 3 stages of
32 rows and the block table in registers (38cd806); 41% / 68% now (21.9 / 52.5 us against floors of
8.9 / 35.5 us: pieces sized at plan time so the first tiles wait one memory round trip, a one-shot
merge over 16-column slices, the merge launched early by programmatic dependent launch; c65c81d).

What bounds it (ncu and the sweeps in profiles/nvidia-h200/mla_padding, cases '.r1.', '.r2.'): the
split kernel is latency- and issue-bound, not bandwidth-bound. Shared memory allows 2 programs of 4
warps per SM (12.5% occupancy); each warp runs ~1,000 instructions and 9 block-wide barriers per
32-row tile (the softmax max and sum across warps, the p tile through shared memory for wgmma, the
copy waits) at 5.5 cycles per issued instruction, so one program alone takes ~2.3 us per tile
(ctx1k.s1, ctx32k.s1), and DRAM runs at 42% of peak during a 32K split kernel. Triton lowers the
score product of a 32-row tile to mma.sync (mma v2: wgmma wants M a multiple of 64) and the value
product to wgmma (M = 512 value columns); the 16 padded heads are N, so M is never padded to 64.
Tried and measured: 64-row wgmma tiles (one program per SM) 6% slower at 32K and 16% at 128K; 8
warps 22-41% slower; 16-row tiles 26% slower; independent 4 x 128-column score products 4% slower
at 32K and 128K (14% faster at 1K); 132 pieces instead of 256 equal at 32K, 19% slower at 128K.

Not yet run on a GPU by this project: the opt-in launch tuning (tune=True, K3LAB_MLA_TUNE=1), the
direct relaunch (fast_launch=True, K3LAB_MLA_FAST_LAUNCH=1) and K3LAB_MLA_AFTER_CONFIG. Caution:
64-row tiles fault on the H200. Round 4 (profiles/nvidia-h200/mla_padding/traces/round4_result.json,
each configuration in its own process at 32K) found the configurations (64,4,1) and (64,8,1) hit an
illegal memory access, while (32,8,3), (32,4,2), (16,4,3) and (128,8,1) are right; every 64-row
form of the bulk kernel below faults too and its 32-row form is right. None fails in Triton's
interpreter. The common factor is a 64-row score product, the shape Triton lowers to wgmma here;
not yet traced further. The default (32, 4, 3) and the verify defaults are checked on a GPU.
The AITER path is not yet run on AMD hardware by this project.

The bulk-copy kernel (kernel='bulk', `_page_split_kernel`; opt-in, NOT YET CORRECT ON A GPU). Same
split and merge, but a tile is 64 latent rows inside one page, fetched by the Hopper copy engine (TMA)
from a host-side descriptor over the pool's rows, so both products run on wgmma and a tile costs
~570 instructions per warp for sm_90 (compiled here) against ~820 per 32-row tile for the split
kernel: 2.9x fewer per byte, no spills, 108 KB of shared memory (two programs per SM). The rope
columns and the block-table entries are prefetched into registers a tile early, the running sum is
kept per element, and only a request's last partial tile takes masked 16-row steps (rows past a
length are never read: NaN there cannot leak). Triton's interpreter matches the fp32 reference in
every form (BULK_OPTIONS). On the H200 (round 3, commit e7931ef, profiles/nvidia-h200/mla_padding/
traces/round3_result.json) it gave wrong bf16 outputs on a paged cache (rel_l2 3.7 at 1 x 4096) and an
illegal memory access on a contiguous one; its graph time alone (one kernel, L2 flushed, ~4.6 us of
graph launch included) was 21.5 us at 32K and 53.1 us at 128K against 23.1 / 55.9 us for the split
kernel: even once right, ~9% / 5% faster, because with 2 tiles per program at 32K all programs wait
for their tile, compute, then wait again in step (a program's next copy is issued after its current
tile's products: Triton does not overlap an unpipelined copy, and two copy buffers leave room for one
program per SM). Round 4 (round4.py, each form in its own process) then showed every 64-row form
faulting and the 32-row form ('bn32') right but slower than the split kernel: 24.4 vs 21.9 us at
32K, 60.6 vs 52.1 us at 128K (records '<case>.bulk').
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import os
import warnings
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from k3lab import env
from k3lab.nn.mla import latent_attention

try:  # host-side bulk-copy (TMA) descriptors, Triton 3.3+
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: the bulk kernel is not offered (see bulk_status)
    TensorDescriptor = None

try:  # grid dependency control (programmatic dependent launch), NVIDIA sm_90+ only
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the plans never ask for it (see _pdl_wanted)
    gdc_launch_dependents = gdc_wait = None

LATENT_DIM = 576  # [c 512 | k_pe 64] per position (architecture.md section 3)
VALUE_DIM = 512  # values are the first 512 latent columns
ROPE_DIM = LATENT_DIM - VALUE_DIM
DEFAULT_SCALE = 192 ** -0.5  # K3's qk head dim (128 nope + 64 rope); absorption does not change it
MMA_ROWS = 16  # the fewest rows tl.dot accepts: the padded head count
MAX_Q_LEN = 8  # verification group: the draft tokens plus one
TOKENS_PER_PROGRAM = 4  # after: verify tokens sharing one program (4 x 16 = 64 rows of accumulator)
MAX_SPLITS = 512
# q_len the CUDA kernel takes by default (plan_after): 1, and verification groups of 2 to 8 as one-token
# requests over the same pages (mla_decode_cuda.plan_verify), two tokens per block in one product (a tile
# read once per pair; an odd group padded by one token whose query reads as zeros, as 12 heads are padded to 16).
# On the H200 against the Triton kernel in the same call, us: 32K 19.5 / 38.9 for 2 positions, 25.2 /
# 37.1 for 4, 40.7 / 59.9 for 8; 8 x 8K 30.4 / 68.5 for 2, 44.4 / 65.8 for 4; 128K 72.4 / 104.1 for 4
# (21566bb, extra/verify_pairs_21566bb.json); 32K 33.3 / 58.3 for 6 (9d21e9e); padded, 25.2 / 35.9 for 3,
# 33.3 / 57.4 for 5, 40.6 / 59.1 for 7; 8 x 8K 44.4 / 62.1 for 3, 65.6 / 108.8 for 5, 79.9 / 113.7 for 7;
# 128K 131.3 / 196.1 for 7 (5519d66, extra/verify_padded_5519d66.json): a padded group costs what the even
# group one longer does (the padded token's query lies outside the kernel's query map and reads zeros).
CUDA_VERIFY_Q_LENS = (1, 2, 3, 4, 5, 6, 7, 8)
BULK_BLOCK_N = 64  # bulk kernel: latent rows per tile (a page of 64; M = 64 is what wgmma wants)
# The bulk kernel is opt-in (kernel='bulk' or K3LAB_MLA_KERNEL=bulk) until a GPU run checks it: on the
# H200 (round 3, commit e7931ef) it computed wrong outputs (bf16, paged) and hit an illegal memory
# access (contiguous cache), while Triton's interpreter matches the reference on the same shapes.
BULK_DEFAULT = os.environ.get("K3LAB_MLA_BULK_DEFAULT", "0") == "1"
TAIL_ROWS = 16  # bulk kernel: rows per masked step over a request's last, partial tile
MERGE_DV = 16  # value columns per merge program: 12 heads x 32 programs at B = 1 (H200 sweep: 16 beat 32 and 64)
MERGE_TILE_ELEMS = 8192  # partial values one merge program loads at once (fp32: 32 KB)
_LN2 = math.log(2.0)
_LOG2E = 1.0 / _LN2

__all__ = [
    "LATENT_DIM", "VALUE_DIM", "DEFAULT_SCALE", "MMA_ROWS", "MAX_Q_LEN",
    "DecodePlan", "plan_before", "plan_after", "mla_decode_before", "mla_decode_after",
    "choose_num_splits", "split_cost", "launch_config", "after_groups",
    "einsum_decode", "sdpa_decode", "to_paged", "gather_paged", "reference",
    "aiter_status", "aiter_decode", "bulk_status",
]


# ----------------------------------------------------------------------------------------------
# input checks


@dataclass(frozen=True)
class _Inputs:
    """What the kernels need to know about one validated call."""

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


def _validate(q, cache, lengths, block_table, *, max_heads: int | None = None) -> _Inputs:
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a tensor [B, q_len, H, {LATENT_DIM}], got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
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
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q.dtype must be float32, float16 or bfloat16, got {q.dtype}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3:
        raise ValueError(f"cache must be [B, L, {LATENT_DIM}] (contiguous) or [num_pages, page_size, "
                         f"{LATENT_DIM}] (paged), got "
                         f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__}")
    if cache.shape[2] != LATENT_DIM:
        raise ValueError(f"cache width (cache.shape[2]) must be {LATENT_DIM} to match q, got {cache.shape[2]}")
    if cache.dtype != q.dtype:
        raise ValueError(f"cache.dtype ({cache.dtype}) must equal q.dtype ({q.dtype})")
    if cache.device != q.device:
        raise ValueError(f"cache is on {cache.device} but q is on {q.device}")
    if cache.stride(2) != 1 or q.stride(3) != 1:
        raise ValueError("q and cache must be contiguous in their last (latent) dim")
    dev = q.device
    if block_table is None:
        if cache.shape[0] != B:
            raise ValueError(f"contiguous cache must be [B={B}, L, {LATENT_DIM}], got {tuple(cache.shape)} "
                             "(pass block_table= for a paged pool)")
        paged, page_size, capacity = False, cache.shape[1], cache.shape[1]
        bt = torch.arange(B, dtype=torch.int32, device=dev)[:, None]
    else:
        if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != B:
            raise ValueError(f"block_table must be an integer tensor [B={B}, max_pages], got "
                             f"{tuple(block_table.shape) if isinstance(block_table, torch.Tensor) else block_table!r}")
        if block_table.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_table.dtype must be int32 or int64, got {block_table.dtype}")
        if block_table.device != dev:
            raise ValueError(f"block_table is on {block_table.device} but q is on {dev}")
        page_size = cache.shape[1]
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page size (cache.shape[1]) must be a power of two, got {page_size}")
        paged, capacity = True, block_table.shape[1] * page_size
        bt = block_table.to(torch.int32).contiguous()
    if lengths is None and paged:
        raise ValueError("lengths is required with a paged cache (block_table=...): the pool does not say where "
                         "each request's history ends")
    if lengths is None:
        lens_host = (capacity,) * B
        lens = torch.full((B,), capacity, dtype=torch.int32, device=dev)
    else:
        lens = torch.as_tensor(lengths, device=dev)
        if lens.shape != (B,) or lens.dtype.is_floating_point or lens.dtype == torch.bool:
            raise ValueError(f"lengths must be integers [B={B}], got shape {tuple(lens.shape)} dtype {lens.dtype}")
        lens_host = tuple(int(x) for x in lens.tolist())  # the one host sync, at plan time
        lens = lens.to(torch.int32).contiguous()
    too_long = [(b, n) for b, n in enumerate(lens_host) if n > capacity]
    if too_long:
        b, n = too_long[0]
        raise ValueError(f"lengths[{b}] = {n} is longer than the cache holds ({capacity} positions"
                         f"{' = max_pages x page_size' if paged else ''})")
    too_short = [(b, n) for b, n in enumerate(lens_host) if n < Tq]
    if too_short:
        b, n = too_short[0]
        raise ValueError(f"lengths[{b}] = {n} is shorter than q_len {Tq} (the new tokens are in the cache)")
    if paged:
        used = (torch.tensor(lens_host, device=dev) + page_size - 1) // page_size
        mask = torch.arange(bt.shape[1], device=dev)[None, :] < used[:, None]
        pages = bt[mask]
        if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= cache.shape[0]):
            raise ValueError(f"block_table holds page ids outside the pool [0, {cache.shape[0]}) for positions "
                             f"in use: min {int(pages.min())}, max {int(pages.max())}")
    return _Inputs(B, Tq, H, cache, paged, page_size, bt, lens, lens_host, capacity)


# ----------------------------------------------------------------------------------------------
# the split-count rule


def split_cost(splits: int, batch: int, context_len: int, compute_units: int, *, groups_per_request: int = 1,
               block_n: int = 64, programs_per_unit: int = 1, overhead_blocks: float = 2.0, merge_blocks: float = 6.0,
               merge_blocks_per_split: float = 0.01) -> float:
    """Modelled time of the split-history decode, in units of "one program reading one tile of
    block_n latent rows".

    Programs run in waves of compute_units x programs_per_unit (how many fit on one unit at once);
    each program reads its share of the tiles plus a fixed
    cost (loading the query, writing a fp32 partial) worth `overhead_blocks` tiles. Splitting (s > 1)
    adds the merge launch (`merge_blocks`) and a merge read that grows with s."""
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
    """How many pieces to cut each request's history into: the split count with the lowest
    `split_cost` (ties go to fewer splits).

    The rule fills the machine: with few requests (B = 1 at TP8 decode) and a long history, the
    programs B x groups x s should cover the compute units once (programs_per_unit programs each,
    when that many fit on a unit at once); each piece must still be worth its
    fixed cost, so a short history gets few splits, and a batch that already fills the machine gets
    one (no merge). `compute_units` defaults to `env.detect().compute_units` (132 SMs on an H200,
    256 CUs on an MI355X).

    Peers, for comparison: AITER's non-persistent path (aiter/mla.py, get_meta_param) scores split
    counts 1..16 by CU occupancy x avg_kv / (avg_kv + 84.1 x s), a similar fill-the-units rule
    capped at 16 splits; FlashMLA's scheduler (get_mla_metadata) instead cuts the whole batch's
    tiles, plus a fixed overhead per request, into one equal share per SM part (SMs / ceil(rows/64)),
    so a piece may end inside one request and start in the next."""
    for label, v in (("batch", batch), ("context_len", context_len), ("groups_per_request", groups_per_request),
                     ("block_n", block_n), ("programs_per_unit", programs_per_unit), ("max_splits", max_splits)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{label} must be a positive integer, got {v!r}")
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


def _piece_len(max_len: int, splits: int, block_n: int) -> int:
    """Positions per history piece: the longest request cut into `splits`, rounded up to whole tiles.
    Shorter requests of a ragged batch fill fewer pieces (their last pieces are empty programs that
    write a zero-weight partial); the kernel's time is the longest piece either way."""
    return -(-(-(-max_len // splits)) // block_n) * block_n


def _page_groups(max_len: int, splits: int, block_n: int, page_size: int) -> int:
    """Block-table entries the split kernel holds in registers at once: enough for one piece of the
    longest request (a piece need not start on a page boundary: one page more), 16 to 64."""
    piece = _piece_len(max_len, splits, block_n)
    return max(16, min(64, triton.next_power_of_2(-(-piece // page_size) + 1)))


def _token_tile(q_len: int) -> int:
    """Verify tokens one after-program holds (a power of two, at most TOKENS_PER_PROGRAM)."""
    return min(triton.next_power_of_2(q_len), TOKENS_PER_PROGRAM)


def after_groups(heads: int, q_len: int = 1) -> int:
    """Programs the after kernel launches per request and split: 16-head groups x verify-token groups."""
    return -(-heads // MMA_ROWS) * -(-q_len // _token_tile(q_len))


# ----------------------------------------------------------------------------------------------
# launch configuration, from the device


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int  # latent rows per tile
    num_warps: int
    num_stages: int


def _shared_memory_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    for name in ("shared_memory_per_block_optin", "shared_memory_per_multiprocessor"):
        v = getattr(props, name, None)
        if v:
            return int(v)
    return None


def _measured_after_config(rows: int, block_n, num_warps, num_stages) -> LaunchConfig | None:
    """The one-token (16-row) after launch configuration chosen by a measurement, from
    K3LAB_MLA_AFTER_CONFIG ('block_n,num_warps,num_stages', e.g. "64,8,1"; recorded with every record),
    where nothing was asked explicitly; None otherwise."""
    env_cfg = os.environ.get("K3LAB_MLA_AFTER_CONFIG", "")
    if not env_cfg or rows != MMA_ROWS or block_n is not None or num_warps is not None or num_stages is not None:
        return None
    try:
        return LaunchConfig(*(int(x) for x in env_cfg.split(",")))
    except (TypeError, ValueError):
        raise ValueError(f"K3LAB_MLA_AFTER_CONFIG must be 'block_n,num_warps,num_stages', got {env_cfg!r}") from None


def launch_config(variant: str, dtype: torch.dtype = torch.bfloat16, rows: int = MMA_ROWS,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, kernel: str = "split") -> LaunchConfig:
    """Tile size, warps and pipeline depth for a variant. The pipeline depth is as many latent tiles
    as fit in the device's shared memory (LDS on AMD) per program, at most 3; warps follow the rows
    held (16 rows: 4 warps, 64 rows: 8)."""
    if variant not in ("before", "after"):
        raise ValueError(f"variant must be 'before' or 'after', got {variant!r}")
    if variant == "before":
        bn = block_n or 32
        return LaunchConfig(bn, num_warps or 8, num_stages or 2)
    # 32-position tiles, 3 stages: two tiles in flight, no spills, two programs per H200 SM (~91 KB
    # shared memory each). Timed on the H200 against 64-row wgmma tiles with 2 stages (one program
    # per SM: 6% slower at 32K, 16% at 128K), 8 warps and 16-row tiles (slower still): see the
    # module docstring.
    # 64 rows (a verify group): the 64 x 512 fp32 accumulator needs 8 warps.
    measured = _measured_after_config(rows, block_n, num_warps, num_stages)
    if measured is not None:
        if (measured.block_n, measured.num_stages) == (64, 1) and kernel == "split" and not env.triton_interpreted() \
                and torch.cuda.is_available():
            raise ValueError(f"K3LAB_MLA_AFTER_CONFIG={os.environ['K3LAB_MLA_AFTER_CONFIG']!r}: 64-row tiles in one "
                             "stage hit an illegal memory access on the H200 (round 4, "
                             "profiles/nvidia-h200/mla_padding/traces/round4_result.json)")
        return measured
    if kernel == "bulk":
        # 64-row tiles (both products on wgmma), one copy buffer: ~110 KB of shared memory, so two
        # programs share an SM and one computes while the other waits for its tile (Triton issues a
        # pipelined loop's next copy only after the current tile's products, so a second buffer
        # would overlap nothing and leave room for one program). 64 rows (verify): 8 warps.
        return LaunchConfig(block_n or BULK_BLOCK_N, num_warps or (4 if rows <= 16 else 8), num_stages or 1)
    bn = block_n or 32
    warps = num_warps or (4 if rows <= 16 else 8)
    if num_stages is None:
        smem = _shared_memory_bytes()
        elem = torch.tensor([], dtype=dtype).element_size()
        tile = bn * LATENT_DIM * elem
        reserve = rows * LATENT_DIM * elem + 16384  # the query tile and the p tile live there too
        num_stages = 3 if smem is None else max(1, min(3, (smem - reserve) // tile))
    return LaunchConfig(bn, warps, num_stages)


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _row_offsets(bt_ptr, b, pos, pmask, stride_kvp, stride_kvr, stride_btb,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Element offsets of latent rows `pos` of request b (paged: one block-table lookup per row)."""
    if PAGED:
        page = tl.load(bt_ptr + b * stride_btb + pos // PAGE_SIZE, mask=pmask, other=0).to(tl.int64)
        return page * stride_kvp + (pos % PAGE_SIZE).to(tl.int64) * stride_kvr
    else:
        return b.to(tl.int64) * stride_kvp + pos.to(tl.int64) * stride_kvr


@triton.jit
def _before_load(kv_ptr, bt_ptr, b, n0, end, stride_kvp, stride_kvr, stride_btb,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    pos = n0 + tl.arange(0, BLOCK_N)
    pmask = pos < end
    rows = _row_offsets(bt_ptr, b, pos, pmask, stride_kvp, stride_kvr, stride_btb, PAGED, PAGE_SIZE)
    k_c = tl.load(kv_ptr + rows[:, None] + tl.arange(0, DV)[None, :], mask=pmask[:, None], other=0.0)
    k_pe = tl.load(kv_ptr + rows[:, None] + DV + tl.arange(0, DR)[None, :], mask=pmask[:, None], other=0.0)
    return k_c, k_pe, pmask


@triton.jit
def _before_update(k_c, k_pe, pmask, q_c, q_pe, m_i, l_i, acc, scale_log2):
    """One tile for one query row on the vector units: broadcast multiply and reduce (no tl.dot)."""
    k_c = k_c.to(tl.float32)
    s = tl.sum(k_c * q_c[None, :], axis=1) + tl.sum(k_pe.to(tl.float32) * q_pe[None, :], axis=1)
    s = tl.where(pmask, s * scale_log2, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: the tile's first position is always visible
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha + tl.sum(p[:, None] * k_c, axis=0)
    return m_new, l_i, acc


@triton.jit
def _before_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr,
                   q_len,
                   stride_qb, stride_qt, stride_qh,
                   stride_kvp, stride_kvr, stride_btb,
                   stride_ob, stride_ot, stride_oh,
                   stride_lb, stride_lt,
                   scale_log2,
                   PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    # One program = one query row (head h of verify token t of request b), whole history, no tl.dot.
    # The next tile is loaded before the current one is reduced, so one load is always in flight.
    h = tl.program_id(0)
    t = tl.program_id(1)
    b = tl.program_id(2)
    offs_v = tl.arange(0, DV)
    q_row = q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt + h * stride_qh
    q_c = tl.load(q_row + offs_v).to(tl.float32)
    q_pe = tl.load(q_row + DV + tl.arange(0, DR)).to(tl.float32)
    end = tl.load(len_ptr + b) - q_len + t + 1  # causal: positions <= this token's own
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([DV], dtype=tl.float32)
    k_c, k_pe, pmask = _before_load(kv_ptr, bt_ptr, b, 0, end, stride_kvp, stride_kvr, stride_btb, PAGED, PAGE_SIZE,
                                    DV, DR, BLOCK_N)
    if INTERPRET:  # Triton's interpreter cannot range() over a run-time scalar
        n0 = 0
        while n0 < end:
            nk_c, nk_pe, npmask = _before_load(kv_ptr, bt_ptr, b, n0 + BLOCK_N, end, stride_kvp, stride_kvr,
                                               stride_btb, PAGED, PAGE_SIZE, DV, DR, BLOCK_N)
            m_i, l_i, acc = _before_update(k_c, k_pe, pmask, q_c, q_pe, m_i, l_i, acc, scale_log2)
            k_c, k_pe, pmask = nk_c, nk_pe, npmask
            n0 += BLOCK_N
    else:
        for n0 in range(0, end, BLOCK_N):
            nk_c, nk_pe, npmask = _before_load(kv_ptr, bt_ptr, b, n0 + BLOCK_N, end, stride_kvp, stride_kvr,
                                               stride_btb, PAGED, PAGE_SIZE, DV, DR, BLOCK_N)
            m_i, l_i, acc = _before_update(k_c, k_pe, pmask, q_c, q_pe, m_i, l_i, acc, scale_log2)
            k_c, k_pe, pmask = nk_c, nk_pe, npmask
    o = acc / l_i
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + offs_v,
             o.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + b * stride_lb + t * stride_lt + h, (m_i + tl.log2(l_i)) * 0.6931471805599453)


@triton.jit
def _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                DV: tl.constexpr, DR: tl.constexpr, IEEE: tl.constexpr):
    """One tile of latent rows (element offsets `rows` of positions `pos`) for all query rows of
    the program, both products on tl.dot.

    Transposed: positions are the M dimension (64-row tiles are what Hopper's wgmma wants) and the 16
    padded heads the N dimension, so the latent tile feeds both products straight from shared memory.
    s^T [BLOCK_N, rows] = K q^T;  acc^T [DV, rows] += K_v^T p^T."""
    pmask = pos < end
    k_c = tl.load(kv_ptr + rows[:, None] + tl.arange(0, DV)[None, :], mask=pmask[:, None], other=0.0)
    k_pe = tl.load(kv_ptr + rows[:, None] + DV + tl.arange(0, DR)[None, :], mask=pmask[:, None], other=0.0)
    if IEEE:  # fp32 inputs: no tf32 rounding
        s = tl.dot(k_c, q_t, input_precision="ieee")
        s = tl.dot(k_pe, qpe_t, s, input_precision="ieee")
    else:
        s = tl.dot(k_c, q_t)
        s = tl.dot(k_pe, qpe_t, s)
    visible = (pos[:, None] <= qpos[None, :]) & pmask[:, None]
    s = tl.where(visible, s * scale_log2, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    if IEEE:
        acc = tl.dot(tl.trans(k_c), p.to(k_c.dtype), acc * alpha[None, :], input_precision="ieee")
    else:
        acc = tl.dot(tl.trans(k_c), p.to(k_c.dtype), acc * alpha[None, :])
    return m_new, l_i, acc


@triton.jit
def _load_query(q_ptr, b, tg, hg, heads, q_len, length, stride_qb, stride_qt, stride_qh,
                DV: tl.constexpr, DR: tl.constexpr, TOK_TILE: tl.constexpr, HEAD_TILE: tl.constexpr):
    """A program's TOK_TILE x HEAD_TILE query rows, transposed ([DV, M] and [DR, M]), with each row's
    token, head, whether it is real, and its last visible position (causal inside a verify group)."""
    r = tl.arange(0, TOK_TILE * HEAD_TILE)
    t = tg * TOK_TILE + r // HEAD_TILE
    h = hg * HEAD_TILE + r % HEAD_TILE
    row_ok = (t < q_len) & (h < heads)  # rows past the real heads are the padding: zero query, never stored
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + t * stride_qt + h * stride_qh
    q_t = tl.load(q_rows[None, :] + tl.arange(0, DV)[:, None], mask=row_ok[None, :], other=0.0)
    qpe_t = tl.load(q_rows[None, :] + DV + tl.arange(0, DR)[:, None], mask=row_ok[None, :], other=0.0)
    qpos = tl.where(row_ok, length - q_len + t, -1)
    return t, h, row_ok, q_t, qpe_t, qpos


@triton.jit
def _store_piece(m_i, l_i, acc, o_ptr, lse_ptr, op_ptr, lsep_ptr, b, t, h, row_ok, split, heads, q_len, num_splits,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV: tl.constexpr, WRITE_FINAL: tl.constexpr):
    """A piece's normalised output and log-sum-exp: the result itself when the history is one piece
    (natural log), else a partial for the merge ([B, q_len * heads, num_splits, DV] fp32 and
    [B, q_len * heads, num_splits], base 2)."""
    offs_v = tl.arange(0, DV)
    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[None, :]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), -float("inf"))
    if WRITE_FINAL:
        o_rows = o_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh
        tl.store(o_rows[None, :] + offs_v[:, None], o.to(o_ptr.dtype.element_ty), mask=row_ok[None, :])
        tl.store(lse_ptr + b * stride_lb + t * stride_lt + h, lse2 * 0.6931471805599453, mask=row_ok)
    else:
        prow = (b * q_len * heads + t * heads + h).to(tl.int64) * num_splits + split
        tl.store(op_ptr + prow[None, :] * DV + offs_v[:, None], o, mask=row_ok[None, :])
        tl.store(lsep_ptr + prow, lse2, mask=row_ok)


@triton.jit
def _split_kernel(q_ptr, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, op_ptr, lsep_ptr,
                  heads, q_len, num_splits, head_groups, chunk, table_pages,
                  stride_qb, stride_qt, stride_qh,
                  stride_kvp, stride_kvr, stride_btb,
                  stride_ob, stride_ot, stride_oh,
                  stride_lb, stride_lt,
                  scale_log2,
                  PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, PAGE_GROUPS: tl.constexpr,
                  DV: tl.constexpr, DR: tl.constexpr,
                  HEAD_TILE: tl.constexpr, TOK_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                  WRITE_FINAL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                  INTERPRET: tl.constexpr):
    # One program = one piece of one request's history, for TOK_TILE verify tokens x HEAD_TILE heads.
    # PDL: let the merge kernel launch now; its programs wait (gdc_wait) until this grid is done,
    # so its launch and set-up overlap this kernel instead of following it.
    if PDL:
        gdc_launch_dependents()
    # Pieces are `chunk` positions (a multiple of BLOCK_N, from the batch's longest request, set at
    # plan time), so a program knows where its piece starts without reading anything: its first
    # block-table entries, the request's length and the query are all requested at once, and the
    # first latent tiles wait for one memory round trip, not a chain of three (length -> block
    # table -> tile). On the H200 that chain was most of a 32K decode's fixed cost.
    split = tl.program_id(0)
    b = tl.program_id(1)
    grp = tl.program_id(2)
    hg = grp % head_groups
    tg = grp // head_groups
    start = split * chunk
    offs_n = tl.arange(0, BLOCK_N)
    if PAGE_GROUPS > 0:
        gidx = tl.arange(0, PAGE_GROUPS)
        pg = start // PAGE_SIZE
        pages = tl.load(bt_ptr + b * stride_btb + pg + gidx, mask=pg + gidx < table_pages, other=0).to(tl.int64)
    length = tl.load(len_ptr + b)
    M: tl.constexpr = TOK_TILE * HEAD_TILE
    t, h, row_ok, q_t, qpe_t, qpos = _load_query(q_ptr, b, tg, hg, heads, q_len, length, stride_qb, stride_qt,
                                                 stride_qh, DV, DR, TOK_TILE, HEAD_TILE)
    end = tl.minimum(start + chunk, length)
    m_i = tl.full([M], -float("inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([DV, M], dtype=tl.float32)
    if PAGE_GROUPS > 0:
        # Paged, tiles inside pages: the block table is held PAGE_GROUPS entries at a time in
        # registers (a group sized to cover a whole piece, so this loop usually runs once), so the
        # tile loop's addresses need no memory read and the pipeliner can fetch tiles ahead.
        last_page = tl.cdiv(end, PAGE_SIZE)
        while pg < last_page:
            g_start = tl.maximum(start, pg * PAGE_SIZE)
            g_end = tl.minimum(end, (pg + PAGE_GROUPS) * PAGE_SIZE)
            if INTERPRET:
                n0 = g_start
                while n0 < g_end:
                    page = tl.sum(tl.where(gidx == n0 // PAGE_SIZE - pg, pages, 0))
                    rows = page * stride_kvp + ((n0 % PAGE_SIZE) + offs_n).to(tl.int64) * stride_kvr
                    m_i, l_i, acc = _split_tile(kv_ptr, rows, n0 + offs_n, end, qpos, q_t, qpe_t, m_i, l_i, acc,
                                                scale_log2, DV, DR, IEEE)
                    n0 += BLOCK_N
            else:
                for n0 in range(g_start, g_end, BLOCK_N):
                    page = tl.sum(tl.where(gidx == n0 // PAGE_SIZE - pg, pages, 0))
                    rows = page * stride_kvp + ((n0 % PAGE_SIZE) + offs_n).to(tl.int64) * stride_kvr
                    m_i, l_i, acc = _split_tile(kv_ptr, rows, n0 + offs_n, end, qpos, q_t, qpe_t, m_i, l_i, acc,
                                                scale_log2, DV, DR, IEEE)
            pg += PAGE_GROUPS
            pages = tl.load(bt_ptr + b * stride_btb + pg + gidx, mask=pg + gidx < table_pages, other=0).to(tl.int64)
    else:
        if INTERPRET:  # Triton's interpreter cannot range() over a run-time scalar
            n0 = start
            while n0 < end:
                pos = n0 + offs_n
                rows = _row_offsets(bt_ptr, b, pos, pos < end, stride_kvp, stride_kvr, stride_btb, PAGED, PAGE_SIZE)
                m_i, l_i, acc = _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                                            DV, DR, IEEE)
                n0 += BLOCK_N
        else:
            for n0 in range(start, end, BLOCK_N):
                pos = n0 + offs_n
                rows = _row_offsets(bt_ptr, b, pos, pos < end, stride_kvp, stride_kvr, stride_btb, PAGED, PAGE_SIZE)
                m_i, l_i, acc = _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                                            DV, DR, IEEE)
    _store_piece(m_i, l_i, acc, o_ptr, lse_ptr, op_ptr, lsep_ptr, b, t, h, row_ok, split, heads, q_len, num_splits,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV, WRITE_FINAL)


@triton.jit
def _page_split_kernel(q_ptr, kc_desc, kpe_desc, kv_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, op_ptr, lsep_ptr,
                       heads, q_len, num_splits, head_groups, chunk, table_pages,
                       stride_qb, stride_qt, stride_qh,
                       stride_kvp, stride_kvr, stride_btb,
                       stride_ob, stride_ot, stride_oh,
                       stride_lb, stride_lt,
                       scale_log2,
                       PAGE_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                       HEAD_TILE: tl.constexpr, TOK_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                       TAIL_N: tl.constexpr, CAUSAL: tl.constexpr,
                       WRITE_FINAL: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                       INTERPRET: tl.constexpr, KC_BULK: tl.constexpr = True, KPE_MODE: tl.constexpr = 0,
                       ROW_SUM: tl.constexpr = False):
    # The split kernel with whole-tile bulk copies (Hopper TMA). The cache is described once, on the
    # host, as a [rows, 576] tensor (pool pages laid end to end, or requests end to end), so a tile of
    # BLOCK_N latent rows inside one page is one rectangle at row page x PAGE_SIZE + offset: the copy
    # engine fetches it into shared memory (no per-thread address arithmetic or copy instructions, no
    # registers for addresses), and both products read it from there: with BLOCK_N = 64 both run
    # on wgmma (positions are the M dimension).
    # Whole tiles of the piece take that path. Only a request's last, partial tile (rows past its
    # length may hold anything, NaN included) is read with masked loads, TAIL_N rows at a time
    # (_split_tile), after the loop. The running sum is kept per score element (no cross-warp
    # reduction for it inside the loop) and reduced once after it.
    # Options (BULK_OPTIONS; the default is the fast form, the others isolate one piece each for a
    # GPU check): KC_BULK=False reads the value columns with plain loads instead of the bulk copy;
    # KPE_MODE 0 = rope columns prefetched into registers one tile early, 1 = by a second bulk copy,
    # 2 = plain loads in the tile; ROW_SUM keeps the running sum per row (a reduction per tile).
    if PDL:
        gdc_launch_dependents()
    split = tl.program_id(0)
    b = tl.program_id(1)
    grp = tl.program_id(2)
    hg = grp % head_groups
    tg = grp // head_groups
    start = split * chunk
    # The first two block-table entries of the piece are requested before anything else (they do
    # not wait for the length: entries past the table are masked, past the length unused), then the
    # length and the query: the first bulk copy waits for the table, the rope prefetch and its own
    # round trip, not for the query's as well.
    bt_row = bt_ptr + b * stride_btb
    page_0 = tl.load(bt_row + start // PAGE_SIZE, mask=start // PAGE_SIZE < table_pages, other=0)
    page_nn = tl.load(bt_row + (start + BLOCK_N) // PAGE_SIZE, mask=(start + BLOCK_N) // PAGE_SIZE < table_pages,
                      other=0)
    length = tl.load(len_ptr + b)
    M: tl.constexpr = TOK_TILE * HEAD_TILE
    t, h, row_ok, q_t, qpe_t, qpos = _load_query(q_ptr, b, tg, hg, heads, q_len, length, stride_qb, stride_qt,
                                                 stride_qh, DV, DR, TOK_TILE, HEAD_TILE)
    end = tl.minimum(start + chunk, length)
    main_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N  # whole tiles, all rows < length
    m_i = tl.full([M], -float("inf"), dtype=tl.float32)
    l_e = tl.zeros([BLOCK_N, M], dtype=tl.float32)
    l_v = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([DV, M], dtype=tl.float32)
    # Software prefetch across iterations (the loop is not pipelined by Triton: at this tile size
    # its copy buffers would not leave room for a second program per SM): the block-table entry
    # two tiles ahead and the 64 rope columns of the next tile are requested one iteration early
    # and kept in registers, so a tile waits only for its own bulk copy.
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, DR)
    row_n = page_0 * PAGE_SIZE + start % PAGE_SIZE
    kpe_n = tl.load(kv_ptr + row_n.to(tl.int64) * stride_kvr + DV + offs_n[:, None] * stride_kvr + offs_r[None, :],
                    mask=(offs_n < main_end - start)[:, None] & (KPE_MODE == 0), other=0.0)
    if INTERPRET:  # Triton's interpreter cannot range() over a run-time scalar
        n0 = start
        while n0 < main_end:
            m_i, l_e, l_v, acc, row_n, page_nn, kpe_n = _bulk_tile(
                kc_desc, kpe_desc, kv_ptr, stride_kvr, bt_row, n0, main_end, row_n, page_nn, kpe_n, qpos, q_t,
                qpe_t, m_i, l_e, l_v, acc, scale_log2, PAGE_SIZE, DV, BLOCK_N, CAUSAL, IEEE, KC_BULK, KPE_MODE,
                ROW_SUM)
            n0 += BLOCK_N
    else:
        for n0 in range(start, main_end, BLOCK_N):
            m_i, l_e, l_v, acc, row_n, page_nn, kpe_n = _bulk_tile(
                kc_desc, kpe_desc, kv_ptr, stride_kvr, bt_row, n0, main_end, row_n, page_nn, kpe_n, qpos, q_t,
                qpe_t, m_i, l_e, l_v, acc, scale_log2, PAGE_SIZE, DV, BLOCK_N, CAUSAL, IEEE, KC_BULK, KPE_MODE,
                ROW_SUM)
    if ROW_SUM:
        l_i = l_v
    else:
        l_i = tl.sum(l_e, axis=0)
    # the request's last, partial tile: masked loads (nothing past the length is read)
    offs_t = tl.arange(0, TAIL_N)
    if INTERPRET:
        n0 = main_end
        while n0 < end:
            pos = n0 + offs_t
            rows = _row_offsets(bt_ptr, b, pos, pos < end, stride_kvp, stride_kvr, stride_btb, True, PAGE_SIZE)
            m_i, l_i, acc = _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                                        DV, DR, IEEE)
            n0 += TAIL_N
    else:
        for n0 in tl.range(main_end, end, TAIL_N, num_stages=1):
            pos = n0 + offs_t
            rows = _row_offsets(bt_ptr, b, pos, pos < end, stride_kvp, stride_kvr, stride_btb, True, PAGE_SIZE)
            m_i, l_i, acc = _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                                        DV, DR, IEEE)
    _store_piece(m_i, l_i, acc, o_ptr, lse_ptr, op_ptr, lsep_ptr, b, t, h, row_ok, split, heads, q_len, num_splits,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV, WRITE_FINAL)


@triton.jit
def _bulk_tile(kc_desc, kpe_desc, kv_ptr, stride_kvr, bt_row, n0, main_end, row, page_nn, k_pe, qpos, q_t, qpe_t,
               m_i, l_e, l_v, acc, scale_log2, PAGE_SIZE: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, IEEE: tl.constexpr, KC_BULK: tl.constexpr, KPE_MODE: tl.constexpr,
               ROW_SUM: tl.constexpr):
    """One whole tile (every row below the request's length) at pool row `row`: the 512 value
    columns by bulk copy, both products on tl.dot, the running sum kept per element (l_e [BLOCK_N,
    rows]; per row in l_v with ROW_SUM). KPE_MODE 0: the tile's rope columns k_pe came in registers
    a tile early, and the next tile's are requested here with the block-table entry after it.
    CAUSAL (verify groups): a row sees positions up to its own."""
    DR: tl.constexpr = k_pe.shape[1]
    offs_n = tl.arange(0, BLOCK_N)
    nxt = n0 + BLOCK_N
    row_n = page_nn * PAGE_SIZE + nxt % PAGE_SIZE
    page_nn = tl.load(bt_row + (nxt + BLOCK_N) // PAGE_SIZE, mask=nxt + BLOCK_N < main_end, other=0)
    if KPE_MODE == 0:
        kpe_n = tl.load(kv_ptr + row_n.to(tl.int64) * stride_kvr + DV + offs_n[:, None] * stride_kvr
                        + tl.arange(0, DR)[None, :], mask=(offs_n < main_end - nxt)[:, None], other=0.0)
    else:
        kpe_n = k_pe
    if KC_BULK:
        k_c = kc_desc.load([row, 0])  # [BLOCK_N, DV]
    else:
        k_c = tl.load(kv_ptr + row.to(tl.int64) * stride_kvr + offs_n[:, None] * stride_kvr
                      + tl.arange(0, DV)[None, :])
    if KPE_MODE == 1:
        k_pe = kpe_desc.load([row, DV])
    elif KPE_MODE == 2:
        k_pe = tl.load(kv_ptr + row.to(tl.int64) * stride_kvr + DV + offs_n[:, None] * stride_kvr
                       + tl.arange(0, DR)[None, :])
    if IEEE:
        s = tl.dot(k_c, q_t, input_precision="ieee")
        s = tl.dot(k_pe, qpe_t, s, input_precision="ieee")
    else:
        s = tl.dot(k_c, q_t)
        s = tl.dot(k_pe, qpe_t, s)
    s = s * scale_log2
    if CAUSAL:
        pos = n0 + offs_n
        s = tl.where(pos[:, None] <= qpos[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that sees nothing yet stays at zero
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=0))  # finite: every position of the tile is visible
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[None, :])
    if ROW_SUM:
        l_v = l_v * alpha + tl.sum(p, axis=0)
    else:
        l_e = l_e * alpha[None, :] + p
    if IEEE:
        acc = tl.dot(tl.trans(k_c), p.to(k_c.dtype), acc * alpha[None, :], input_precision="ieee")
    else:
        acc = tl.dot(tl.trans(k_c), p.to(k_c.dtype), acc * alpha[None, :])
    return m_new, l_e, l_v, acc, row_n, page_nn, kpe_n


@triton.jit
def _merge_kernel(op_ptr, lsep_ptr, o_ptr, lse_ptr,
                  heads, q_len, num_splits,
                  stride_ob, stride_ot, stride_oh,
                  stride_lb, stride_lt,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_P2: tl.constexpr, SPLIT_TILE: tl.constexpr,
                  PDL: tl.constexpr):
    # One program = one (request, row) and BLOCK_DV value columns: lse-weighted sum of the pieces.
    # The merge is latency-bound (a few MB over few programs): the partials and their log-sum-exps
    # are requested together, so it waits for one memory round trip (SPLIT_TILE = SPLITS_P2, the
    # usual case) rather than one for the weights and another for the partials.
    b = tl.program_id(0)
    row = tl.program_id(1)
    dv0 = tl.program_id(2) * BLOCK_DV
    t = row // heads
    h = row % heads
    base = (b * q_len * heads + row).to(tl.int64) * num_splits
    offs_v = dv0 + tl.arange(0, BLOCK_DV)
    if PDL:  # launched early (programmatic dependent launch): wait for the split kernel's partials
        gdc_wait()
    if SPLIT_TILE == SPLITS_P2:
        ss = tl.arange(0, SPLITS_P2)
        smask = ss < num_splits
        part = tl.load(op_ptr + (base + ss)[:, None] * DV + offs_v[None, :], mask=smask[:, None], other=0.0)
        lse_all = tl.load(lsep_ptr + base + ss, mask=smask, other=-float("inf"))
        m = tl.max(lse_all, axis=0)
        m_use = tl.where(m == -float("inf"), 0.0, m)
        w = tl.exp2(lse_all - m_use)
        denom = tl.sum(w, axis=0)
        acc = tl.sum(w[:, None] * part, axis=0)
    else:
        offs_s = tl.arange(0, SPLITS_P2)
        lse_all = tl.load(lsep_ptr + base + offs_s, mask=offs_s < num_splits, other=-float("inf"))
        m = tl.max(lse_all, axis=0)
        m_use = tl.where(m == -float("inf"), 0.0, m)
        denom = tl.sum(tl.exp2(lse_all - m_use), axis=0)
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for s0 in range(0, SPLITS_P2, SPLIT_TILE):  # compile-time bounds: the interpreter needs them
            ss = s0 + tl.arange(0, SPLIT_TILE)
            smask = ss < num_splits
            part = tl.load(op_ptr + (base + ss)[:, None] * DV + offs_v[None, :], mask=smask[:, None], other=0.0)
            w = tl.exp2(tl.load(lsep_ptr + base + ss, mask=smask, other=-float("inf")) - m_use)
            acc += tl.sum(w[:, None] * part, axis=0)
    seen = denom > 0
    o = acc / tl.where(seen, denom, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + offs_v,
             o.to(o_ptr.dtype.element_ty))
    if dv0 == 0:
        lse = tl.where(seen, (m_use + tl.log2(tl.where(seen, denom, 1.0))) * 0.6931471805599453, -float("inf"))
        tl.store(lse_ptr + b * stride_lb + t * stride_lt + h, lse)


# ----------------------------------------------------------------------------------------------
# plans: validated once, launched many times


class _Launch:
    """One kernel launch with fixed arguments. The first call goes through Triton's JIT (binding,
    specialisation, cache lookup: ~20 us of host time per call on the H200 machine); after
    `enable_fast()` the compiled kernel is relaunched directly with the same arguments."""

    def __init__(self, kernel, grid, args: tuple, consts: dict):
        self.kernel, self.grid, self.args, self.consts = kernel, grid, args, consts
        self.compiled = None
        self._fast = None

    def __call__(self):
        if self._fast is not None:
            self._fast(*self._all_args)
        else:
            ck = self.kernel[self.grid](*self.args, **self.consts)
            if self.compiled is None and ck is not None and not isinstance(ck, (int, float, tuple)):
                self.compiled = ck  # a CompiledKernel on a GPU; None in the interpreter

    def enable_fast(self) -> bool:
        if self.compiled is None or not hasattr(self.compiled, "__getitem__"):
            return False
        names = self.kernel.arg_names
        values = dict(zip(names, self.args))
        values.update({k: v for k, v in self.consts.items() if k in names})
        self._all_args = [values[n] for n in names]
        self._fast = self.compiled[self.grid]
        return True

    def disable_fast(self):
        self._fast = None


@dataclass
class DecodePlan:
    """A validated decode, ready to launch: `plan()` runs it and returns (o, lse) (the plan's own
    output buffers, overwritten by each call).

    programs: programs of the main kernel (the figure to hold against the compute units);
    programs_per_unit: how many of them fit on one compute unit at once (from the compiled kernel's
    registers and shared memory); launches: kernels per call; num_splits: history pieces per
    request (before: 1); tuning: us per candidate launch configuration when one was picked by timing."""

    variant: str
    grid: tuple[int, int, int]
    num_splits: int
    launches: int
    config: LaunchConfig
    heads: int
    rows_per_program: int
    pad: str
    out: torch.Tensor
    lse: torch.Tensor
    _launch: object = field(repr=False)
    programs_per_unit: int = 1
    tuning: dict | None = None
    fast_launch: bool = False
    pdl: bool = False  # the merge is launched early (programmatic dependent launch)
    kernel: str = "split"  # after: 'bulk' (whole tiles by bulk copy, _page_split_kernel) or 'split' (_split_kernel)
    bulk_options: dict | None = None  # the bulk kernel's form (BULK_OPTIONS / K3LAB_MLA_BULK_OPTIONS)
    _kernels: list = field(default_factory=list, repr=False)
    _outputs: list = field(default_factory=list, repr=False)  # every buffer the kernels write

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._launch()
        return self.out, self.lse

    def facts(self) -> dict:
        return {"num_splits": self.num_splits, "programs": self.programs, "programs_per_unit": self.programs_per_unit,
                "launches": self.launches, "block_n": self.config.block_n, "num_warps": self.config.num_warps,
                "num_stages": self.config.num_stages, "rows_per_program": self.rows_per_program, "pad": self.pad,
                "fast_launch": self.fast_launch, "pdl": self.pdl, "tuning": self.tuning, "kernel": self.kernel,
                "bulk_options": self.bulk_options}


def _kv_strides(inp: _Inputs) -> tuple[int, int]:
    return inp.kv.stride(0), inp.kv.stride(1)


def _occupancy(compiled, num_warps: int) -> int:
    """Programs of a compiled kernel that fit on one compute unit at once, from its registers and
    shared memory (LDS) against the device's per-unit limits; 1 when any figure is unknown."""
    if compiled is None or not torch.cuda.is_available():
        return 1
    try:
        compiled._init_handles()
        shared, regs = int(compiled.metadata.shared), int(getattr(compiled, "n_regs", 0) or 0)
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        wave = env.detect().wave_width or 32
        fits = []
        smem_unit = getattr(props, "shared_memory_per_multiprocessor", None)
        if smem_unit:
            fits.append(int(smem_unit) // (shared + 1024))  # the driver reserves 1 KiB per program
        regs_unit = getattr(props, "regs_per_multiprocessor", None)
        if regs_unit and regs:
            fits.append(int(regs_unit) // (regs * wave * num_warps))
        threads_unit = getattr(props, "max_threads_per_multi_processor", None)
        if threads_unit:
            fits.append(int(threads_unit) // (wave * num_warps))
        return max(1, min(fits)) if fits else 1
    except Exception:  # a figure the runtime does not expose: assume one program per unit
        return 1


def _enable_fast_launch(plan: DecodePlan) -> bool:
    """Relaunch the compiled kernels directly, after checking once that this gives bit-identical
    results to the JIT launch (it should: same kernels, same arguments). GPU only."""
    if not _on_gpu():
        return False
    try:
        o_ref, l_ref = (t.clone() for t in plan())
        if not all(k.enable_fast() for k in plan._kernels):
            for k in plan._kernels:
                k.disable_fast()
            return False
        for t in plan._outputs:  # so that a relaunch that does nothing cannot pass
            t.fill_(float("nan"))
        o, lse = plan()
        torch.cuda.synchronize()
        if torch.equal(o, o_ref) and torch.equal(lse, l_ref):
            return True
        warnings.warn("mla_decode: direct relaunch differs from the JIT launch; using the JIT launch")
    except Exception as exc:  # the relaunch API differs in this Triton: keep the JIT launch
        warnings.warn(f"mla_decode: direct relaunch unavailable ({type(exc).__name__}: {exc}); using the JIT launch")
    for k in plan._kernels:
        k.disable_fast()
    return False


def _build_before(inp: _Inputs, q, cfg: LaunchConfig, scale, fast_launch: bool) -> DecodePlan:
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    out = torch.empty(B, Tq, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)
    scale_log2 = (DEFAULT_SCALE if scale is None else float(scale)) * _LOG2E
    grid = (H, Tq, B)
    skvp, skvr = _kv_strides(inp)
    kv, bt, lens = inp.kv, inp.block_table, inp.lengths
    consts = dict(PAGED=inp.paged, PAGE_SIZE=inp.page_size, DV=VALUE_DIM, DR=ROPE_DIM, BLOCK_N=cfg.block_n,
                  INTERPRET=env.triton_interpreted(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch = _Launch(_before_kernel, grid, (q, kv, bt, lens, out, lse, Tq, q.stride(0), q.stride(1), q.stride(2),
                                            skvp, skvr, bt.stride(0), out.stride(0), out.stride(1), out.stride(2),
                                            lse.stride(0), lse.stride(1), scale_log2), consts)
    plan = DecodePlan("before", grid, 1, 1, cfg, H, 1, "none", out, lse, launch, _kernels=[launch],
                      _outputs=[out, lse])
    if torch.cuda.is_available() and not env.triton_interpreted():
        plan()  # compile, and read how many programs fit on one unit
        plan.programs_per_unit = _occupancy(launch.compiled, cfg.num_warps)
        if fast_launch:
            plan.fast_launch = _enable_fast_launch(plan)
    return plan


# Launch configurations the before kernel is timed with on a GPU: (block_n, num_warps, num_stages).
BEFORE_CANDIDATES = ((32, 8, 2), (16, 4, 2), (16, 8, 2), (64, 8, 2))


def plan_before(q, cache, lengths=None, *, block_table=None, scale=None, block_n=None, num_warps=None,
                num_stages=None, tune: bool | None = None, fast_launch: bool | None = None,
                kernel: str | None = None) -> DecodePlan:
    """Validate once and return a launchable plan of the conservative kernel (see module docstring).

    kernel: 'cuda' (k3lab.ops.mla_before_cuda: the same policy as a CUDA-core kernel, bf16 on NVIDIA
    GPUs; the default there), 'triton' (`_before_kernel`) or None = 'cuda' where it runs with no
    launch configuration asked for, else 'triton'. plan.kernel says which runs.

    Launch configuration (Triton): block_n / num_warps / num_stages fix it; otherwise, on a GPU, the
    candidates of BEFORE_CANDIDATES are timed once per shape class when tuning is on (tune=True or
    K3LAB_MLA_TUNE=1), as `plan_after` does, so the conservative kernel gets the same tuning as the
    fast one. fast_launch (or K3LAB_MLA_FAST_LAUNCH=1): relaunch the compiled kernel directly after
    one bit-exact comparison with the JIT launch. Both are not yet run on a GPU by this project."""
    if kernel not in (None, "cuda", "triton"):
        raise ValueError(f"kernel must be 'cuda', 'triton' or None, got {kernel!r}")
    fixed = block_n is not None or num_warps is not None or num_stages is not None
    if kernel == "cuda" or (kernel is None and not fixed and not tune and getattr(q, "dtype", None) == torch.bfloat16
                            and _on_gpu()):
        from k3lab.ops import mla_before_cuda as mb

        if kernel == "cuda" or mb.status()[0]:
            if fixed:
                raise ValueError("kernel='cuda' takes no block_n / num_warps / num_stages")
            return mb.plan(q, cache, lengths, block_table=block_table, scale=scale)  # validates the inputs itself
    inp = _validate(q, cache, lengths, block_table)
    fast_launch = _fast_launch_wanted(fast_launch)
    if fixed or not _tuning_wanted(tune) or not _on_gpu():
        cfg = launch_config("before", q.dtype, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
        return _build_before(inp, q, cfg, scale, fast_launch)
    cfg, table = _autotune(("before",) + _tuning_key(inp, q, "none"), BEFORE_CANDIDATES,
                           lambda c: _build_before(inp, q, c, scale, False), smem_need=None)
    plan = _build_before(inp, q, cfg, scale, fast_launch)
    plan.tuning = table
    return plan


def _on_gpu() -> bool:
    return torch.cuda.is_available() and not env.triton_interpreted()


def _tuning_wanted(tune: bool | None) -> bool:
    """tune=None: K3LAB_MLA_TUNE=1 turns launch tuning on; off by default (static launch_config).

    Launch tuning and the direct relaunch are compiled and unit-checked here, but NOT YET RUN ON A
    GPU BY THIS PROJECT: they stay opt-in until a GPU run has validated them."""
    if tune is None:
        return os.environ.get("K3LAB_MLA_TUNE", "0") == "1"
    return bool(tune)


def _pdl_wanted(pdl: bool | None) -> bool:
    """Programmatic dependent launch of the merge: NVIDIA compute capability 9.0+ (Hopper) with a
    Triton that has grid dependency control; pdl=None means on where available (K3LAB_MLA_PDL=0
    turns it off), pdl=True where unavailable is an error, not a silent fallback."""
    usable = (_on_gpu() and torch.version.cuda is not None and gdc_wait is not None
              and torch.cuda.get_device_capability()[0] >= 9)
    if pdl is None:
        return usable and os.environ.get("K3LAB_MLA_PDL", "1") != "0"
    if pdl and not usable:
        raise ValueError("pdl=True needs an NVIDIA GPU of compute capability 9.0+ (Hopper) and a Triton with "
                         "triton.language.extra.cuda.gdc_wait; pass pdl=None to use it only where available")
    return bool(pdl)


def _fast_launch_wanted(fast_launch: bool | None) -> bool:
    """fast_launch=None: K3LAB_MLA_FAST_LAUNCH=1 turns the checked direct relaunch on; off by default."""
    if fast_launch is None:
        return os.environ.get("K3LAB_MLA_FAST_LAUNCH", "0") == "1"
    return bool(fast_launch)


def _autotune(key: tuple, candidates, build, smem_need) -> tuple[LaunchConfig, dict]:
    """Time each candidate configuration once per key (5 calls, L2 flushed, median) and keep the
    fastest. smem_need(cfg) -> bytes skips candidates that cannot fit in the device's shared memory."""
    if key in _TUNED:
        return _TUNED[key]
    smem = _shared_memory_bytes()
    table, best = {}, None
    for bn, warps, stages in candidates:
        cfg = LaunchConfig(bn, warps, stages)
        name = f"bn{bn}w{warps}s{stages}"
        if smem is not None and smem_need is not None and smem_need(cfg) > smem:
            table[name] = "shared memory"
            continue
        try:
            us = _time_plan(build(cfg))
        except Exception as exc:  # out of resources on this device: that candidate is skipped
            table[name] = type(exc).__name__
            continue
        table[name] = round(us, 2)
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is None:
        raise RuntimeError(f"mla_decode: no launch configuration ran on this device: {table}")
    _TUNED[key] = (best[1], table)
    return _TUNED[key]


# Launch configurations the after kernel is timed with on a GPU, per rows held (16 = one decode
# token, 32 = two verify tokens, 64 = four to eight): (block_n, num_warps, num_stages).
AFTER_CANDIDATES = {
    # 16 rows: only configurations that ran correctly on the H200 ((64,4,1) and (64,8,1) hit an
    # illegal memory access there: module docstring)
    16: ((32, 4, 3), (64, 4, 2)),
    32: ((32, 8, 3), (32, 4, 3), (64, 8, 2), (16, 8, 4)),
    64: ((32, 8, 3), (32, 8, 2), (16, 8, 4), (64, 8, 2)),
}
# The bulk kernel's candidates: one copy buffer (two programs per SM) or two (one), 4 or 8 warps.
BULK_CANDIDATES = {
    16: ((64, 4, 1), (64, 4, 2), (64, 8, 1)),
    32: ((64, 8, 1), (64, 4, 1)),
    64: ((64, 8, 1), (32, 8, 1)),
}
_TUNED: dict[tuple, tuple[LaunchConfig, dict]] = {}


# The bulk kernel's form (see _page_split_kernel): the fast one by default; K3LAB_MLA_BULK_OPTIONS
# or plan_after(bulk_options=...) (e.g. "kc_bulk=0,kpe=bulk,sum=row") picks another, one piece
# changed at a time, to find on a GPU which one goes wrong there (round 3: wrong outputs on the H200,
# right in the interpreter). tail=64 reads a request's last partial tile in one 64-row masked step
# (the same operand layouts as the loop: no second copy of the query in shared memory, which is what
# lets three 64-row copy buffers fit, num_stages=3) instead of 16-row steps.
BULK_OPTIONS = {"kc_bulk": True, "kpe": "prefetch", "sum": "element", "tail": TAIL_ROWS}
_KPE_MODES = {"prefetch": 0, "bulk": 1, "load": 2}


def _bulk_options(extra: str | None = None) -> dict:
    """The bulk kernel's form constexprs: BULK_OPTIONS, then K3LAB_MLA_BULK_OPTIONS, then `extra`."""
    opts = dict(BULK_OPTIONS)
    items = os.environ.get("K3LAB_MLA_BULK_OPTIONS", "").split(",") + (extra or "").split(",")
    for item in filter(None, (x.strip() for x in items)):
        key, _, val = item.partition("=")
        if key == "kc_bulk" and val in ("0", "1"):
            opts["kc_bulk"] = val == "1"
        elif key == "kpe" and val in _KPE_MODES:
            opts["kpe"] = val
        elif key == "sum" and val in ("element", "row"):
            opts["sum"] = val
        elif key == "tail" and val in ("16", "32", "64"):
            opts["tail"] = int(val)
        else:
            raise ValueError(f"bulk options (K3LAB_MLA_BULK_OPTIONS / bulk_options): unknown item {item!r} "
                             "(kc_bulk=0|1, kpe=prefetch|bulk|load, sum=element|row, tail=16|32|64)")
    return {"KC_BULK": opts["kc_bulk"], "KPE_MODE": _KPE_MODES[opts["kpe"]], "ROW_SUM": opts["sum"] == "row",
            "TAIL_N": opts["tail"]}


def bulk_status(cache: torch.Tensor | None = None, page_size: int | None = None,
                block_n: int = BULK_BLOCK_N) -> tuple[bool, str]:
    """(usable, why) for the bulk-copy kernel: a Triton with host-side tensor descriptors; an
    NVIDIA GPU of compute capability 9.0+ (the Hopper copy engine, TMA) or Triton's interpreter (which
    emulates the descriptors); and, when given, a cache whose rows lie end to end (a pool
    [pages, page_size, 576] or a contiguous [B, L, 576], 16-byte aligned) with whole tiles inside a page."""
    if TensorDescriptor is None:
        return False, "this Triton has no triton.tools.tensor_descriptor (Triton 3.3+): the per-thread split kernel runs"
    if not env.triton_interpreted():
        if not torch.cuda.is_available() or torch.version.cuda is None:
            return False, "bulk copies (TMA) need an NVIDIA GPU: the per-thread split kernel runs"
        if torch.cuda.get_device_capability()[0] < 9:
            return False, "bulk copies (TMA) need compute capability 9.0+ (Hopper): the per-thread split kernel runs"
    if cache is not None:
        if cache.stride(2) != 1 or cache.stride(1) != LATENT_DIM or cache.stride(0) != cache.shape[1] * LATENT_DIM:
            return False, "the cache's rows are not laid end to end ([*, *, 576] contiguous): the split kernel runs"
        if cache.data_ptr() % 16:
            return False, "the cache does not start on a 16-byte boundary: the split kernel runs"
        if page_size is not None and page_size % block_n:
            return False, f"a {block_n}-row tile would cross a page of {page_size}: the split kernel runs"
    if block_n >= 64 and not env.triton_interpreted():
        return False, ("64-row bulk tiles hit an illegal memory access on the H200 in every form tried (round 4, "
                       "profiles/nvidia-h200/mla_padding/traces/round4_result.json); block_n=32 runs correctly")
    return True, "bulk-copy kernel (whole tiles by TMA)"


def cuda_after_status(q=None, cache=None, lengths=None, block_table=None) -> tuple[bool, str]:
    """Whether `plan_after` runs the hand-written CUDA kernel (k3lab.ops.mla_decode_cuda) by default
    here and, if not, why (with inputs: for these inputs). It does for one-token decodes (q_len 1,
    <= 16 heads, bf16) on NVIDIA compute capability 9.0+ with nvcc, and for verification groups of
    2 to 8 (paged) as one-token requests (CUDA_VERIFY_Q_LENS); everywhere else the Triton
    split kernel runs (ROCm included: the CUDA kernel has no AMD path)."""
    from k3lab.ops import mla_decode_cuda as mc  # here: mla_decode_cuda imports this module

    if os.environ.get("K3LAB_MLA_KERNEL") not in (None, "", "cuda"):
        return False, f"K3LAB_MLA_KERNEL={os.environ['K3LAB_MLA_KERNEL']} asks for the Triton kernel"
    ok, why = mc.status()
    if not ok:
        return False, why
    if q is None:
        return True, why
    try:
        mc.check(q, cache, lengths, block_table=block_table)
    except ValueError as exc:
        return False, f"the CUDA kernel does not take these inputs ({exc}); the Triton split kernel runs"
    return True, why


def _after_kernel(kernel: str | None, inp: _Inputs, block_n: int | None) -> str:
    """The after kernel for these inputs: an explicit choice (checked), K3LAB_MLA_KERNEL, else the
    split kernel; with BULK_DEFAULT (K3LAB_MLA_BULK_DEFAULT=1; off until a GPU run checks the bulk
    kernel) bulk where `bulk_status` allows it for a one-token decode (16 rows per program). Verify
    groups (32 or 64 rows) keep the split kernel even then: with 64 rows the bulk kernel's query tile
    alone is 64 KB of shared memory and it spills for sm_90 (compiled here)."""
    if kernel is None:
        kernel = os.environ.get("K3LAB_MLA_KERNEL") or None
    if kernel not in (None, "bulk", "split", "cuda"):
        raise ValueError(f"kernel must be 'cuda', 'bulk', 'split' or None (K3LAB_MLA_KERNEL likewise), got {kernel!r}")
    if kernel in ("split", "cuda"):
        return kernel
    bn = block_n or (min(BULK_BLOCK_N, inp.page_size) if inp.paged else BULK_BLOCK_N)
    ok, why = bulk_status(inp.kv, inp.page_size if inp.paged else None, bn)
    if kernel == "bulk" and not ok:
        raise ValueError(f"kernel='bulk' cannot run here: {why}")
    if kernel is None and (_token_tile(inp.q_len) > 1 or not BULK_DEFAULT):
        return "split"
    return "bulk" if ok else "split"


def _build_after(inp: _Inputs, q, *, pad, pad_fill, cfg: LaunchConfig, num_splits, compute_units, scale,
                 fast_launch: bool, merge_dv: int = MERGE_DV, pdl: bool = False, kernel: str = "split",
                 bulk_options: str | None = None) -> DecodePlan:
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    head_groups = -(-H // MMA_ROWS)
    tok_tile = _token_tile(Tq)
    tok_groups = -(-Tq // tok_tile)
    rows = tok_tile * MMA_ROWS
    dev = q.device
    units = env.detect().compute_units if compute_units is None else compute_units
    scale_log2 = (DEFAULT_SCALE if scale is None else float(scale)) * _LOG2E
    out = torch.empty(B, Tq, H, VALUE_DIM, dtype=q.dtype, device=dev)
    lse = torch.empty(B, Tq, H, dtype=torch.float32, device=dev)
    if pad == "copy":
        kq = torch.full((B, Tq, MMA_ROWS, LATENT_DIM), pad_fill, dtype=q.dtype, device=dev)
        k_out = torch.empty(B, Tq, MMA_ROWS, VALUE_DIM, dtype=q.dtype, device=dev)
        k_lse = torch.empty(B, Tq, MMA_ROWS, dtype=torch.float32, device=dev)
        k_heads = MMA_ROWS
    else:
        kq, k_out, k_lse, k_heads = q, out, lse, H
    tiles_in_pages = inp.paged and inp.page_size % cfg.block_n == 0
    skvp, skvr = _kv_strides(inp)
    kv, bt, lens = inp.kv, inp.block_table, inp.lengths

    def build(splits: int, ppu: int) -> DecodePlan:
        if splits > 1:
            o_part = torch.empty(B * Tq * k_heads * splits, VALUE_DIM, dtype=torch.float32, device=dev)
            l_part = torch.empty(B * Tq * k_heads * splits, dtype=torch.float32, device=dev)
        else:
            o_part = l_part = k_lse  # unused: the split kernel writes the result itself
        grid = (splits, B, head_groups * tok_groups)
        # Tiles inside pages: the block table is read a group of pages at a time, a group sized to
        # cover one piece of the longest request (16 to 64 pages), so the tile loop usually runs once.
        page_groups = _page_groups(inp.max_len, splits, cfg.block_n, inp.page_size) if tiles_in_pages else 0
        consts = dict(PAGED=inp.paged, PAGE_SIZE=inp.page_size, PAGE_GROUPS=page_groups, DV=VALUE_DIM, DR=ROPE_DIM,
                      HEAD_TILE=MMA_ROWS, TOK_TILE=tok_tile, BLOCK_N=cfg.block_n, WRITE_FINAL=splits == 1,
                      INTERPRET=env.triton_interpreted(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        use_pdl = pdl and splits > 1  # only the merge is launched early
        consts.update(IEEE=q.dtype == torch.float32, PDL=use_pdl)
        chunk = _piece_len(inp.max_len, splits, cfg.block_n)
        if kernel == "bulk":
            # the cache as one [rows, 576] tensor (pages, or requests, end to end): one bulk copy per tile
            consts = {k: v for k, v in consts.items() if k not in ("PAGED", "PAGE_GROUPS")}
            consts.update(_bulk_options(bulk_options), CAUSAL=Tq > 1)
            consts["TAIL_N"] = min(consts["TAIL_N"], cfg.block_n)
            rows2d = kv.view(kv.shape[0] * kv.shape[1], LATENT_DIM)
            desc = TensorDescriptor(rows2d, list(rows2d.shape), [LATENT_DIM, 1], [cfg.block_n, VALUE_DIM])
            desc_pe = TensorDescriptor(rows2d, list(rows2d.shape), [LATENT_DIM, 1], [cfg.block_n, ROPE_DIM])
            split = _Launch(_page_split_kernel, grid,
                            (kq, desc, desc_pe, kv, bt, lens, k_out, k_lse, o_part, l_part, k_heads, Tq, splits, head_groups,
                             chunk, bt.shape[1], kq.stride(0), kq.stride(1), kq.stride(2), skvp, skvr, bt.stride(0),
                             k_out.stride(0), k_out.stride(1), k_out.stride(2), k_lse.stride(0), k_lse.stride(1),
                             scale_log2), consts)
        else:
            split = _Launch(_split_kernel, grid, (kq, kv, bt, lens, k_out, k_lse, o_part, l_part, k_heads, Tq, splits,
                                                  head_groups, chunk, bt.shape[1], kq.stride(0), kq.stride(1),
                                                  kq.stride(2), skvp, skvr, bt.stride(0), k_out.stride(0),
                                                  k_out.stride(1), k_out.stride(2), k_lse.stride(0), k_lse.stride(1),
                                                  scale_log2), consts)
        kernels = [split]
        if splits > 1:
            sp2 = triton.next_power_of_2(splits)
            merge = _Launch(_merge_kernel, (B, Tq * k_heads, VALUE_DIM // merge_dv),
                            (o_part, l_part, k_out, k_lse, k_heads, Tq, splits, k_out.stride(0), k_out.stride(1),
                             k_out.stride(2), k_lse.stride(0), k_lse.stride(1)),
                            dict(DV=VALUE_DIM, BLOCK_DV=merge_dv, SPLITS_P2=sp2,
                                 SPLIT_TILE=min(sp2, MERGE_TILE_ELEMS // merge_dv), PDL=use_pdl, num_warps=4,
                                 **({"launch_pdl": True} if use_pdl else {})))
            kernels.append(merge)

        def launch():
            if pad == "copy":
                kq[:, :, :H].copy_(q)
            for k in kernels:
                k()
            if pad == "copy":
                out.copy_(k_out[:, :, :H])  # the padded heads' outputs are dropped here
                lse.copy_(k_lse[:, :, :H])

        launches = len(kernels) + (3 if pad == "copy" else 0)
        written = [out, lse] + ([o_part, l_part] if splits > 1 else []) + ([k_out, k_lse] if pad == "copy" else [])
        plan = DecodePlan("after", grid, splits, launches, cfg, H, rows, pad, out, lse, launch, programs_per_unit=ppu,
                          _kernels=kernels, _outputs=written)
        plan.pdl = use_pdl
        plan.kernel = kernel
        plan.bulk_options = ({k: consts[k] for k in ("KC_BULK", "KPE_MODE", "ROW_SUM", "TAIL_N")}
                             if kernel == "bulk" else None)
        if pad == "copy":
            plan.padded_query, plan.padded_out = kq, k_out  # what the padding holds, for the notebook and tests
        return plan

    groups = head_groups * tok_groups

    def rule(ppu: int) -> int:
        return choose_num_splits(B, inp.max_len, units, groups_per_request=groups, block_n=cfg.block_n,
                                 programs_per_unit=ppu)

    splits = num_splits if num_splits is not None else rule(1)
    plan = build(splits, 1)
    if _on_gpu():
        plan()  # compile (and run once) to read the kernel's registers and shared memory
        ppu = _occupancy(plan._kernels[0].compiled, cfg.num_warps)
        plan.programs_per_unit = ppu
        if num_splits is None and ppu > 1 and rule(ppu) != splits:
            plan = build(rule(ppu), ppu)
            plan()
        if fast_launch:
            plan.fast_launch = _enable_fast_launch(plan)
    return plan


def _time_plan(plan: DecodePlan, reps: int = 5) -> float:
    """Median us of one plan call, replayed from a CUDA/HIP graph (no host launch cost inside the
    events) with the L2 flushed before each replay."""
    flush = _l2_flush_buffer()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan()
    times = []
    for _ in range(reps):
        flush.zero_()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop) * 1e3)
    del graph
    return sorted(times)[len(times) // 2]


_FLUSH: list = []


def _l2_flush_buffer() -> torch.Tensor:
    if not _FLUSH:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or (64 << 20)
        _FLUSH.append(torch.empty(2 * l2, dtype=torch.int8, device="cuda"))
    return _FLUSH[0]


def _tuning_key(inp: _Inputs, q, pad: str) -> tuple:
    bucket = triton.next_power_of_2(inp.max_len)
    return (torch.cuda.current_device(), q.dtype, inp.paged, inp.page_size, inp.heads > MMA_ROWS,
            -(-inp.heads // MMA_ROWS), _token_tile(inp.q_len), -(-inp.q_len // _token_tile(inp.q_len)),
            inp.batch, bucket, pad)


def plan_after(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, fold_heads=False,
               pad="registers", compute_units=None, block_n=None, num_warps=None, num_stages=None,
               pad_fill: float = 0.0, tune: bool | None = None, fast_launch: bool | None = None,
               merge_dv: int | None = None, pdl: bool | None = None, kernel: str | None = None,
               bulk_options: str | None = None) -> DecodePlan:
    """Validate once and return a launchable plan of the padded split-history decode.

    num_splits: None = `choose_num_splits` for this batch, the longest context, the device's compute
    units and how many programs fit on one unit; an int forces it (the study's sweep).
    fold_heads: allow H > 16 as groups of 16. pad: 'registers' (masked loads of the 16-row tile;
    nothing extra in memory) or 'copy' (the seed's adapter: an explicit [B, q_len, 16, 576] query
    buffer whose extra heads are filled with `pad_fill`, a 16-head output whose extra heads are
    dropped).

    Launch configuration: block_n / num_warps / num_stages fix it; by default the static
    `launch_config`. With tune=True (or K3LAB_MLA_TUNE=1) on a GPU, each candidate of
    AFTER_CANDIDATES is built and timed on these inputs (CUDA-graph replay, L2 flushed, 5 calls,
    median), once per shape class (batch, context rounded up to a power of two, rows, layout) per
    process; the fastest is kept and `plan.tuning` lists every candidate's time. fast_launch=True
    (or K3LAB_MLA_FAST_LAUNCH=1) relaunches the compiled kernels directly after one bit-exact
    comparison with the JIT launch. Tuning and the direct relaunch are NOT YET RUN ON A GPU BY THIS
    PROJECT (compiled for sm_90 and unit-checked only), hence opt-in.

    merge_dv: value columns per merge program (default MERGE_DV = 16). pdl: launch the merge with
    programmatic dependent launch (its programs start while the split kernel runs and wait for it
    with griddepcontrol.wait); None = on for NVIDIA compute capability 9.0+, K3LAB_MLA_PDL=0 turns it
    off. On the H200 it saved 0.1-0.4 us per decode (ctx*.r2.bn32w4s3_nopdl records).

    kernel: 'cuda' (k3lab.ops.mla_decode_cuda: the hand-written kernel, one-token bf16 decodes on
    sm_90; the default there, see `cuda_after_status`; it returns that module's plan, which answers
    to the same attribute names), 'bulk' (`_page_split_kernel`: whole tiles by bulk copy, Hopper TMA;
    see `bulk_status`), 'split' (`_split_kernel`: per-thread copies) or None = K3LAB_MLA_KERNEL if
    set, else 'cuda' where it runs and 'split' elsewhere (see `_after_kernel`: the bulk kernel is opt-in, NOT YET CORRECT ON A GPU: wrong outputs on the
    H200 in its first run, right in Triton's interpreter). plan.kernel says which one runs.
    bulk_options: the bulk kernel's form, e.g. "tail=64" (see BULK_OPTIONS)."""
    if pad not in ("registers", "copy"):
        raise ValueError(f"pad must be 'registers' or 'copy', got {pad!r}")
    inp = _validate(q, cache, lengths, block_table, max_heads=None if fold_heads else MMA_ROWS)
    H = inp.heads
    if pad == "copy" and H > MMA_ROWS:
        raise ValueError(f"pad='copy' builds one 16-head buffer; heads = {H} needs pad='registers' with folding")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an integer in 1..{MAX_SPLITS}, got {num_splits!r}")
    rows = _token_tile(inp.q_len) * MMA_ROWS
    merge_dv = MERGE_DV if merge_dv is None else merge_dv
    if merge_dv not in (16, 32, 64, 128):
        raise ValueError(f"merge_dv must be 16, 32, 64 or 128 value columns per merge program, got {merge_dv!r}")
    kw = dict(pad=pad, pad_fill=pad_fill, num_splits=num_splits, compute_units=compute_units, scale=scale,
              fast_launch=_fast_launch_wanted(fast_launch), merge_dv=merge_dv, pdl=_pdl_wanted(pdl))
    fixed = block_n is not None or num_warps is not None or num_stages is not None
    asked = kernel == "cuda" or (kernel is None and os.environ.get("K3LAB_MLA_KERNEL") == "cuda")
    by_default = (kernel is None and not os.environ.get("K3LAB_MLA_KERNEL") and not fixed and pad == "registers"
                  and bulk_options is None and merge_dv == MERGE_DV and inp.q_len in CUDA_VERIFY_Q_LENS
                  and H <= MMA_ROWS
                  and _on_gpu() and cuda_after_status()[0])
    if asked or by_default:
        from k3lab.ops import mla_decode_cuda as mc  # the default where it runs (cuda_after_status)

        if fixed or pad != "registers" or bulk_options is not None:
            raise ValueError("kernel='cuda' takes no block_n / num_warps / num_stages / pad='copy' / bulk_options")
        cuda_pdl = os.environ.get("K3LAB_MLA_PDL", "1") != "0" if pdl is None else bool(pdl)
        try:
            if inp.q_len > 1:  # a verification group: each token a one-token request over the same pages
                return mc.plan_verify(q, cache, lengths, block_table=block_table, scale=scale,
                                      num_splits=num_splits, compute_units=compute_units, pdl=cuda_pdl)
            return mc.plan(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                           compute_units=compute_units, pdl=cuda_pdl)
        except ValueError:
            if asked:
                raise
            # inputs outside the CUDA kernel (cuda_after_status(q, cache, ...) names why): Triton runs
    # the bulk kernel is checked against the tile rows the launch will use: block_n, or a measured
    # one-token configuration (K3LAB_MLA_AFTER_CONFIG), else the kernel's default
    measured = _measured_after_config(rows, block_n, num_warps, num_stages)
    kernel = _after_kernel(kernel, inp, block_n or (measured.block_n if measured else None))
    kw["kernel"] = kernel
    if bulk_options is not None:
        if kernel != "bulk":
            raise ValueError(f"bulk_options applies to kernel='bulk', not {kernel!r}")
        _bulk_options(bulk_options)  # bad items are refused here, before any kernel runs
        kw["bulk_options"] = bulk_options
    if fixed or not _tuning_wanted(tune) or not _on_gpu():
        cfg = launch_config("after", q.dtype, rows=rows, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                            kernel=kernel)
        from_env = bool(os.environ.get("K3LAB_MLA_AFTER_CONFIG")) and rows == MMA_ROWS
        if kernel == "bulk" and block_n is None and not from_env and inp.paged and cfg.block_n > inp.page_size:
            cfg = LaunchConfig(inp.page_size, cfg.num_warps, cfg.num_stages)  # a tile never crosses a page
        if kernel == "bulk" and inp.paged and inp.page_size % cfg.block_n:
            raise ValueError(f"kernel='bulk' cannot run here: a {cfg.block_n}-row tile would cross a page of "
                             f"{inp.page_size} (K3LAB_MLA_AFTER_CONFIG or block_n)")
        return _build_after(inp, q, cfg=cfg, **kw)
    elem = q.element_size()
    candidates = BULK_CANDIDATES[rows] if kernel == "bulk" else AFTER_CANDIDATES[rows]
    if kernel == "bulk" and inp.paged:
        candidates = tuple(c for c in candidates if inp.page_size % c[0] == 0) or ((inp.page_size, 4, 1),)
    cfg, table = _autotune(_tuning_key(inp, q, pad) + (kernel,), candidates,
                           lambda c: _build_after(inp, q, cfg=c, **dict(kw, fast_launch=False)),
                           smem_need=lambda c: (c.num_stages * c.block_n + rows) * LATENT_DIM * elem)
    plan = _build_after(inp, q, cfg=cfg, **kw)
    plan.tuning = table
    return plan


def mla_decode_before(q, cache, lengths=None, *, block_table=None, scale=None):
    """The conservative decode: one program per (request, verify token, head) walking the whole
    history on the vector units (12 rows cannot use tl.dot). Returns (o, lse), lse in natural log."""
    o, lse = plan_before(q, cache, lengths, block_table=block_table, scale=scale)()
    return o.clone(), lse.clone()


def mla_decode_after(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, fold_heads=False,
                     pad="registers"):
    """The padded, split-history decode (query padded to 16 heads for tl.dot; history split over
    `num_splits` programs per request, merged by log-sum-exp). Returns (o, lse), lse in natural log."""
    o, lse = plan_after(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                        fold_heads=fold_heads, pad=pad)()
    return o.clone(), lse.clone()


# ----------------------------------------------------------------------------------------------
# caches: paged <-> contiguous


def to_paged(cache: torch.Tensor, page_size: int = 64, *, shuffle: bool = True, seed: int = 0,
             spare_pages: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged copy of a contiguous cache [B, L, 576]: (pool [num_pages, page_size, 576], block_table
    [B, ceil(L / page_size)] int32). With shuffle, pages sit in the pool in a random order, as they
    do in a server after many requests come and go; `spare_pages` adds unused pages to the pool."""
    if cache.dim() != 3:
        raise ValueError(f"cache must be [B, L, D], got {tuple(cache.shape)}")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    B, L, D = cache.shape
    per = -(-L // page_size)
    n_pages = B * per + spare_pages
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_pages, generator=gen) if shuffle else torch.arange(n_pages)
    block_table = order[: B * per].view(B, per).to(torch.int32).to(cache.device)
    pool = torch.empty(n_pages, page_size, D, dtype=cache.dtype, device=cache.device)
    pool.normal_() if pool.is_floating_point() else pool.zero_()  # unused slots hold garbage, never zeros
    padded = torch.zeros(B, per * page_size, D, dtype=cache.dtype, device=cache.device)
    padded[:, :L] = cache
    pool[block_table.long().flatten()] = padded.view(B * per, page_size, D)
    return pool, block_table


def gather_paged(pool: torch.Tensor, block_table: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """The contiguous [B, L, 576] view of a paged cache (L = max_pages x page_size, or `length`)."""
    B, per = block_table.shape
    rows = pool[block_table.long().flatten()].view(B, per * pool.shape[1], pool.shape[2])
    return rows if length is None else rows[:, :length]


def reference(q, cache, lengths=None, *, block_table=None, scale=None):
    """k3lab.nn.mla.latent_attention in fp32 (fp64 for fp64 inputs) on the same cache (a paged cache
    is gathered first)."""
    if block_table is not None:
        cache = gather_paged(cache, block_table)
    return latent_attention(q, cache, lengths=lengths, scale=scale, value_dim=VALUE_DIM)


# ----------------------------------------------------------------------------------------------
# plain PyTorch peers


def _visible_mask(lengths, q_len: int, L: int, device) -> torch.Tensor:
    pos = torch.arange(L, device=device)
    qpos = lengths[:, None] - q_len + torch.arange(q_len, device=device)[None, :]
    return pos[None, None, :] <= qpos[:, :, None]  # [B, Tq, L]


def einsum_decode(q, cache, lengths=None, *, scale=None):
    """Plain PyTorch decode in the inputs' dtype: einsum scores, masked softmax (fp32), einsum
    values. Contiguous cache [B, L, 576] only (gather a paged one first). Returns (o, lse)."""
    B, Tq, H, D = q.shape
    L = cache.shape[1]
    scale = DEFAULT_SCALE if scale is None else scale
    scores = torch.einsum("bthd,bld->bthl", q, cache).float() * scale
    if lengths is not None or Tq > 1:
        lens = torch.full((B,), L, device=q.device) if lengths is None else torch.as_tensor(lengths, device=q.device)
        vis = _visible_mask(lens, Tq, L, q.device)
        scores = scores.masked_fill(~vis[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    p = torch.exp(scores - lse[..., None]).to(cache.dtype)
    o = torch.einsum("bthl,blv->bthv", p, cache[..., :VALUE_DIM])
    return o, lse


def sdpa_decode(q, cache, lengths=None, *, scale=None):
    """torch.nn.functional.scaled_dot_product_attention on the same latent cache: keys the whole row,
    values its first 512 columns, one KV head shared by all query heads (enable_gqa). SDPA returns
    no log-sum-exp: lse is None. Contiguous cache only."""
    B, Tq, H, D = q.shape
    L = cache.shape[1]
    scale = DEFAULT_SCALE if scale is None else scale
    mask = None
    if lengths is not None or Tq > 1:
        lens = torch.full((B,), L, device=q.device) if lengths is None else torch.as_tensor(lengths, device=q.device)
        mask = _visible_mask(lens, Tq, L, q.device)[:, None]  # [B, 1, Tq, L]
    k = cache[:, None]  # [B, 1, L, 576]
    v = cache[:, None, :, :VALUE_DIM]
    o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                                         enable_gqa=True)
    return o.transpose(1, 2), None


# ----------------------------------------------------------------------------------------------
# AITER (ROCm) -- not yet run on AMD hardware by this project


def aiter_status() -> tuple[bool, str]:
    """(usable, why): AITER's MLA decode needs a ROCm torch with a device and the amd-aiter package."""
    info = env.detect()
    if info.backend != "rocm":
        return False, f"backend is {info.backend}, AITER runs on ROCm only: k3lab's own kernel is used"
    if importlib.util.find_spec("aiter") is None:
        return False, "aiter is not installed (amd-aiter for this ROCm): k3lab's own kernel is used"
    try:
        from aiter import mla as _mla  # noqa: F401
    except Exception as exc:  # a broken install is reported, not fatal
        return False, f"aiter.mla failed to import ({type(exc).__name__}: {exc}): k3lab's own kernel is used"
    return True, "aiter.mla.mla_decode_fwd (not yet run on AMD hardware by this project)"


def aiter_decode(q, cache, lengths=None, *, block_table=None, scale=None):
    """AITER's padded 16-head assembly decode, called the way the seed's adapter does (vLLM PR 50578):
    copy the real heads into a 16-head query, run aiter.mla.mla_decode_fwd, drop the extra heads.

    NOT YET RUN ON AMD HARDWARE BY THIS PROJECT. The cache is described to AITER token by token
    (page_size 1: kv_indices lists each position's row in the pool), the layout every AITER version
    accepts. Returns (o, lse) with lse in natural log as AITER returns it (checked by the study)."""
    ok, why = aiter_status()
    if not ok:
        raise RuntimeError(f"aiter_decode unavailable: {why}")
    from aiter import mla as aiter_mla

    inp = _validate(q, cache, lengths, block_table, max_heads=MMA_ROWS)
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    dev = q.device
    q16 = torch.zeros(B, Tq, MMA_ROWS, LATENT_DIM, dtype=q.dtype, device=dev)
    q16[:, :, :H] = q
    lens = torch.tensor(inp.lengths_host, device=dev, dtype=torch.int64)
    if inp.paged:
        ps = inp.page_size
        idx = [inp.block_table[b, torch.arange(n, device=dev) // ps].long() * ps + torch.arange(n, device=dev) % ps
               for b, n in enumerate(inp.lengths_host)]
        kv_rows = cache.reshape(-1, 1, 1, LATENT_DIM)
    else:
        L = cache.shape[1]
        idx = [b * L + torch.arange(n, device=dev) for b, n in enumerate(inp.lengths_host)]
        kv_rows = cache.reshape(B * L, 1, 1, LATENT_DIM)
    kv_indices = torch.cat(idx).to(torch.int32)
    kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(lens, 0).to(torch.int32)
    qo_indptr = torch.arange(0, (B + 1) * Tq, Tq, dtype=torch.int32, device=dev)
    last_page = torch.ones(B, dtype=torch.int32, device=dev)
    o16 = torch.empty(B * Tq, MMA_ROWS, VALUE_DIM, dtype=q.dtype, device=dev)
    kwargs = dict(sm_scale=DEFAULT_SCALE if scale is None else float(scale))
    params = inspect.signature(aiter_mla.mla_decode_fwd).parameters
    if "return_lse" in params:
        kwargs["return_lse"] = True
    if "page_size" in params:
        kwargs["page_size"] = 1
    res = aiter_mla.mla_decode_fwd(q16.view(B * Tq, MMA_ROWS, LATENT_DIM), kv_rows, o16, qo_indptr, kv_indptr,
                                   kv_indices, last_page, Tq, **kwargs)
    lse16 = res[1] if isinstance(res, tuple) and len(res) > 1 else None
    o = o16.view(B, Tq, MMA_ROWS, VALUE_DIM)[:, :, :H].contiguous()
    lse = None if lse16 is None else lse16.reshape(B, Tq, MMA_ROWS)[:, :, :H].float().contiguous()
    return o, lse
