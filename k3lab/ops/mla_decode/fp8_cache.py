"""An FP8 (E4M3) MLA latent cache: the writer that quantizes new rows, the absorbed decode that reads it
(Triton), and its bytes. The article serves K3 with "FP8 KV": 576 one-byte values a position a layer,
half of bf16's 1,152.

    scale = scale_for(rows.abs().amax())            # fp32 [1] on the device: amax / 448
    write_rows(cache, rows, scale, pos)             # cache[:, pos:pos + T] = fp8(rows / scale)
    o, lse = plan_fp8(q, cache, scale, lengths)()   # as plan_after over dequantize(cache, scale)

The scale: one per tensor (per layer's cache), as vLLM's FP8 KV cache keeps one scale per layer,
rather than one per page. Why: a decode step adds one row to a page at a time, so a page's scale
would have to be fixed before the rows that set its range arrive (or the page re-quantized when a
larger row comes, reading and rewriting it); a per-tensor scale is fixed once (from a calibration or
the prefill's largest value, `scale_for`) and costs 4 bytes a layer, not a read per page in the decode's
inner loop. The price: a row past 448 x scale saturates (the writer clamps, as the hardware's saturating
conversion does), so the scale wants headroom over the values it was taken from. The latent is
kv_a_layernorm's output next to the un-normalised k_pe, both of moderate range, which is what keeps one
scale workable (checked here on random rows only; the tiny model's logits at this precision are
issue work, not done here).

Decode (`plan_fp8`): the padded split-history form of the bf16 decode (16 query rows a program, so
both products run on the matrix units; the history cut into pieces run in parallel, then merged by
log-sum-exp). Each latent tile is loaded as FP8 and converted to q's dtype in the load (exact: every
E4M3 value is a bf16 / fp16 / fp32 value); the per-tensor scale multiplies the scores (folded into the
softmax scale) and the output once, so no tile is ever multiplied by it. Contract as the bf16 decode:
q [B, q_len 1..8, H, 576] fp32 / fp16 / bf16, cache fp8 [B, L, 576] or a paged pool [pages,
page_size, 576] with block_table and lengths; returns (o [B, q_len, H, 512] in q's dtype, lse
[B, q_len, H] fp32, natural log), the plan's own buffers. Verification groups are causal inside the
group. So the DCP merge of partial (o, lse) is unchanged. The partials of a split history use the bf16
decode's layout ([B * q_len * H * splits, 512] fp32, base-2 lse) and are merged by its merge kernel
(one launch; PyTorch ops here took about 16 small launches a layer in the step's attribution).

Bad input raises ValueError / TypeError naming the argument before any kernel runs (the bf16 decode's
own validation of q, lengths and block table, plus the cache's dtype and the scale). Needs a GPU, or
Triton's interpreter (TRITON_INTERPRET=1) on a CPU (small shapes: tests). Where its tests and the step
that binds it have run is k3lab.studies.runs' part 'article_precisions' (its bf16 tl.dot path runs only
on a GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from k3lab import env
from k3lab.ops import expect, int_arg
from k3lab.ops.mla_decode.inputs import (DEFAULT_SCALE, LATENT_DIM, LOG2E, MAX_SPLITS, MMA_ROWS, ROPE_DIM,
                                         VALUE_DIM, check_num_splits, check_scale, choose_num_splits,
                                         piece_len, validate)

try:
    import triton
    import triton.language as tl

    # the bf16 split decode's pieces: the query tile, the walk over a piece (its tile step converts the
    # FP8 codes in the load), the piece's store
    from k3lab.ops.mla_decode.triton import MERGE_DV, _load_query, _merge_kernel, _store_piece, walk_piece
except ImportError:  # plan_fp8 then says so
    triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0          # E4M3's largest finite value
SCALE_BYTES = 4          # one fp32 scale per cache tensor (per layer)
BLOCK_N = 32             # latent rows per tile
TOKENS_PER_PROGRAM = 2   # verify tokens sharing one program (2 x 16 rows); 1 on 64-lane AMD devices, where
                         # 32 accumulator rows spill (k3lab.isa); 4 x 16 rows spill on sm90 too

# the article's figures (docs/k3.md section 5): 24 MLA layers, a 142,000-token conversation, DCP8
ARTICLE_LAYERS, ARTICLE_POSITIONS, ARTICLE_RANKS = 24, 142_000, 8


# ---------------------------------------------------------------------------------------------- bytes


def bytes_per_position(dtype: torch.dtype = FP8) -> int:
    """Bytes one cached position takes in one layer: 576 values at the element size of `dtype`
    (FP8: 576; bf16: 1,152). The FP8 cache's scale is per tensor: `cache_bytes` adds it."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    return LATENT_DIM * torch.tensor([], dtype=dtype).element_size()


def cache_bytes(positions: int, layers: int = 1, ranks: int = 1, dtype: torch.dtype = FP8) -> int:
    """Bytes of MLA latent cache one rank holds: `positions` positions over `layers` layers, dealt out
    across `ranks` DCP ranks (position t on rank t mod ranks: the busiest rank's ceil(positions / ranks)),
    plus one fp32 scale a layer for FP8. The article's 24 x 142,000 x 576 B = 1.96 GB per GPU, 245 MB
    under DCP8: cache_bytes(142_000, 24) and cache_bytes(142_000, 24, 8)."""
    int_arg("positions", positions)
    int_arg("layers", layers)
    int_arg("ranks", ranks, low=1)
    mine = -(-positions // ranks)
    scales = SCALE_BYTES if dtype == FP8 else 0
    return layers * (mine * bytes_per_position(dtype) + scales)


# ---------------------------------------------------------------------------------------------- writer


def check_kv_scale(kv_scale, device) -> None:
    """kv_scale must be an fp32 tensor of one element on `device`: a device tensor, so a captured step
    reads a scale set later (no host value baked into a graph). Its value is read once here: positive
    and finite."""
    expect("kv_scale", kv_scale, dtype=torch.float32, what="(an fp32 tensor of one element)")
    if kv_scale.numel() != 1:
        raise ValueError(f"kv_scale must be an fp32 tensor of one element, got {tuple(kv_scale.shape)}")
    expect("kv_scale", kv_scale, device=device)  # the cache's
    if not (kv_scale.is_cuda and torch.cuda.is_current_stream_capturing()):
        v = float(kv_scale.reshape(()))
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"kv_scale must be positive and finite, got {v}")


def scale_for(amax, headroom: float = 1.0) -> torch.Tensor:
    """The per-tensor scale that maps `amax` (a tensor or number: the largest magnitude to hold) times
    `headroom` onto E4M3's 448: fp32 [1] (1.0 where amax is 0)."""
    if not (isinstance(headroom, (int, float)) and not isinstance(headroom, bool) and headroom >= 1
            and math.isfinite(headroom)):
        raise ValueError(f"headroom must be a finite number >= 1, got {headroom!r}")
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(-1)
    if a.numel() != 1 or not bool(torch.isfinite(a).all()) or bool((a < 0).any()):
        raise ValueError(f"amax must be one finite non-negative value, got {amax!r:.80}")
    return torch.where(a > 0, a * headroom / FP8_MAX, torch.ones_like(a))


def quantize_rows(rows: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    """rows [..., 576] as E4M3 codes of rows / kv_scale, saturated at +-448, nearest even rounding
    (torch's conversion; device ops only, so a captured step can run it)."""
    x = rows.to(torch.float32) / kv_scale.reshape(())
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_rows(cache: torch.Tensor, rows: torch.Tensor, kv_scale: torch.Tensor, pos: int) -> torch.Tensor:
    """The cache writer: cache[:, pos:pos + T] = quantize_rows(rows, kv_scale) for new latent rows
    [B, T, 576] of a contiguous FP8 cache [B, L, 576]; returns cache. ValueError / TypeError naming the
    argument before anything is written."""
    T = _check_write(cache, rows, kv_scale, pos,
                     (torch.float32, torch.float16, torch.bfloat16, torch.float64))
    cache[:, pos:pos + T] = quantize_rows(rows, kv_scale)
    return cache


def _check_write(cache, rows, kv_scale, pos, dtypes, contiguous: bool | str = False) -> int:
    """The writers' checks (ValueError / TypeError naming the argument); T, the new rows a sequence."""
    check_cache(cache)
    expect("rows", rows, dtype=dtypes)
    expect("rows", rows, shape=(cache.shape[0], None, LATENT_DIM), device=cache.device, contiguous=contiguous,
           what=f"[B={cache.shape[0]}, T, {LATENT_DIM}]")  # the cache's batch and device
    int_arg("pos", pos, high=cache.shape[1] - rows.shape[1])
    check_kv_scale(kv_scale, cache.device)
    return rows.shape[1]


def row_writer(cache: torch.Tensor, rows: torch.Tensor, kv_scale: torch.Tensor, pos: int):
    """write() -> cache: the writer as one launch, validated once (the decode step binds it per layer):
    cache[:, pos:pos + T] = quantize_rows(rows, kv_scale), the same values (tests; Triton's interpreter
    writes a negative value that rounds to zero as +0 where torch writes -0), read from wherever
    rows [B, T, 576] sits (strided rows; the last dimension contiguous). PyTorch's form takes five small
    launches (the casts, the division, the clamp, the copy). Needs Triton (a GPU, or its interpreter);
    ValueError / TypeError naming the argument as write_rows. Run on an H100 (its tests, and the article
    step's attribution: k3lab.studies.runs, part 'fp8_cache_one_launch'); not yet run on an H200."""
    T = _check_write(cache, rows, kv_scale, pos, (torch.float32, torch.float16, torch.bfloat16), "last")
    if triton is None:
        raise RuntimeError("row_writer needs Triton (a GPU, or TRITON_INTERPRET=1 on a CPU); write_rows "
                           "runs without it")
    grid = (rows.shape[0], T)
    args = (rows, kv_scale, cache, pos, rows.stride(0), rows.stride(1), cache.stride(0), cache.stride(1))

    def write():
        if T:
            _write_kernel[grid](*args, D=LATENT_DIM, BLOCK_D=triton.next_power_of_2(LATENT_DIM), num_warps=4)
        return cache

    return write


def dequantize(cache: torch.Tensor, kv_scale: torch.Tensor,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The values the cache stands for, cache x kv_scale, in `dtype` (the decode's reference)."""
    check_cache(cache)
    return (cache.to(torch.float64) * kv_scale.to(torch.float64).reshape(())).to(dtype)


def check_cache(cache) -> None:
    expect("cache", cache, dtype=FP8, what="(E4M3 codes)")
    expect("cache", cache, shape=(None, None, LATENT_DIM), contiguous="last",
           what=f"[B, L, {LATENT_DIM}] or [pages, page_size, {LATENT_DIM}]")


# ---------------------------------------------------------------------------------------------- kernel


if triton is not None:

    @triton.jit
    def _write_kernel(rows_ptr, scale_ptr, cache_ptr, pos, stride_rb, stride_rt, stride_cb, stride_ct,
                      D: tl.constexpr, BLOCK_D: tl.constexpr):
        # one program = one (sequence, new row): cache[b, pos + t] = e4m3(clamp(rows[b, t] / scale, +-448))
        b = tl.program_id(0)
        t = tl.program_id(1)
        offs = tl.arange(0, BLOCK_D)
        ok = offs < D
        x = tl.load(rows_ptr + b.to(tl.int64) * stride_rb + t * stride_rt + offs, mask=ok, other=0.0)
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
        # round to E4M3's grid in fp32 first (nearest, ties to even: the 1.5 x 2^23 add and subtract), so
        # the cast is exact: Triton's interpreter rounds fp32 -> e4m3 wrongly where the mantissa carries
        # into the exponent (127.97 -> 64); the hardware's conversion needs none of it
        e = tl.maximum(((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)   # subnormals below 2^-6
        quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)               # 3 mantissa bits
        r = ((tl.abs(x) / quantum + 12582912.0) - 12582912.0) * quantum  # on |x|: a tiny x < 0 gives -0
        x = tl.where(x < 0, -r, r)
        tl.store(cache_ptr + b.to(tl.int64) * stride_cb + (pos + t).to(tl.int64) * stride_ct + offs,
                 x.to(tl.float8e4nv), mask=ok)

    @triton.jit
    def _fp8_split_kernel(q_ptr, kv_ptr, kv_scale_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, op_ptr, lsep_ptr,
                          heads, q_len, num_splits, head_groups, chunk, sm_scale_log2,
                          stride_qb, stride_qt, stride_qh, stride_kvp, stride_kvr, stride_btb,
                          stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
                          PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                          HEAD_TILE: tl.constexpr, TOK_TILE: tl.constexpr, BLOCK_N: tl.constexpr,
                          WRITE_FINAL: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
        # One program = one piece [split * chunk, (split + 1) * chunk) of request b's history for
        # TOK_TILE verify tokens x HEAD_TILE heads (rows past the real heads / tokens: zero queries,
        # computed, never stored)
        split = tl.program_id(0)
        b = tl.program_id(1)
        grp = tl.program_id(2)
        hg = grp % head_groups
        tg = grp // head_groups
        kv_scale = tl.load(kv_scale_ptr)
        score_scale = sm_scale_log2 * kv_scale
        length = tl.load(len_ptr + b)
        t, h, row_ok, q_t, qpe_t, qpos = _load_query(q_ptr, b, tg, hg, heads, q_len, length, stride_qb,
                                                     stride_qt, stride_qh, DV, DR, TOK_TILE, HEAD_TILE)
        if IEEE:  # fp32 products (fp32 queries, and every query in the interpreter: see plan_fp8)
            q_t = q_t.to(tl.float32)
            qpe_t = qpe_t.to(tl.float32)
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        M: tl.constexpr = TOK_TILE * HEAD_TILE
        m_i = tl.full([M], -float("inf"), dtype=tl.float32)
        l_i = tl.zeros([M], dtype=tl.float32)
        acc = tl.zeros([DV, M], dtype=tl.float32)
        m_i, l_i, acc = walk_piece(kv_ptr, bt_ptr, b, start, end, qpos, q_t, qpe_t, m_i, l_i, acc,
                                   score_scale, stride_kvp, stride_kvr, stride_btb, PAGED, PAGE_SIZE, DV, DR,
                                   BLOCK_N, IEEE, INTERPRET)
        # the values' scale, applied once to the sums; the result, or a partial for the merge
        _store_piece(m_i, l_i, acc * kv_scale, o_ptr, lse_ptr, op_ptr, lsep_ptr, b, t, h, row_ok, split,
                     heads, q_len, num_splits, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV,
                     WRITE_FINAL)


# ---------------------------------------------------------------------------------------------- plan


@dataclass
class Fp8DecodePlan:
    """A validated FP8-cache decode, ready to launch: `plan()` returns (o, lse), its own buffers,
    overwritten by each call. grid: the split kernel's; num_splits: history pieces per request;
    launches: kernels per call (the split kernel, plus the merge kernel when split)."""

    grid: tuple[int, int, int]
    num_splits: int
    out: torch.Tensor
    lse: torch.Tensor
    _launch: object = field(repr=False)
    launches: int = 1

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._launch()
        return self.out, self.lse


def plan_fp8(q, cache, kv_scale, lengths=None, *, block_table=None, scale=None, num_splits=None,
             compute_units=None, num_warps=None) -> Fp8DecodePlan:
    """Validate once and return a launchable plan of the decode over the FP8 cache (module docstring).

    kv_scale: the cache's fp32 [1] scale on the device; scale: the softmax scale (default 192^-0.5);
    num_splits: None = inputs.choose_num_splits for this batch and the longest request on the device's
    compute units (`compute_units` overrides them), or an int to force it."""
    if triton is None:
        raise RuntimeError("plan_fp8 needs Triton (a GPU, or TRITON_INTERPRET=1 on a CPU)")
    check_cache(cache)
    expect("q", q, what=f"[B, q_len, H, {LATENT_DIM}]")
    expect("cache", cache, device=q.device)  # q's
    sm_scale = check_scale(scale)
    check_num_splits(num_splits, MAX_SPLITS)
    # the bf16 decode's own checks of q, lengths and the block table, on a stand-in of the cache's
    # shape in q's dtype (a broadcast view: no memory)
    stand_in = q.new_empty(1, 1, LATENT_DIM).expand(cache.shape) if q.dim() == 4 else cache
    inp = validate(q, stand_in, lengths, block_table, max_heads=None)
    check_kv_scale(kv_scale, q.device)
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    tok = min(triton.next_power_of_2(Tq), TOKENS_PER_PROGRAM if env.detect().wave_width != 64 else 1)
    head_groups = -(-H // MMA_ROWS)
    groups = head_groups * -(-Tq // tok)
    units = env.detect().compute_units if compute_units is None else compute_units
    splits = num_splits or choose_num_splits(B, inp.max_len, units, groups_per_request=groups,
                                             block_n=BLOCK_N)
    warps = num_warps or (4 if tok == 1 else 8)
    out = torch.empty(B, Tq, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)
    if splits > 1:
        o_part = torch.empty(B * Tq * H * splits, VALUE_DIM, dtype=torch.float32, device=q.device)
        l_part = torch.empty(B * Tq * H * splits, dtype=torch.float32, device=q.device)
    else:
        o_part = l_part = lse  # unused: the kernel writes the result itself
    grid = (splits, B, groups)
    kv_scale = kv_scale.reshape(1)
    # Triton's interpreter multiplies bf16 / fp16 tiles in tl.dot wrongly (Triton 3.6): there every
    # product runs in fp32; a GPU multiplies in q's dtype
    interpreted = env.triton_interpreted()
    bt = inp.block_table
    args = (q, cache, kv_scale, bt, inp.lengths, out, lse, o_part, l_part, H, Tq, splits, head_groups,
            piece_len(inp.max_len, splits, BLOCK_N), sm_scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2), cache.stride(0), cache.stride(1), bt.stride(0),
            out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    consts = dict(PAGED=inp.paged, PAGE_SIZE=inp.page_size, DV=VALUE_DIM, DR=ROPE_DIM, HEAD_TILE=MMA_ROWS,
                  TOK_TILE=tok, BLOCK_N=BLOCK_N, WRITE_FINAL=splits == 1,
                  IEEE=q.dtype == torch.float32 or interpreted,
                  INTERPRET=interpreted, num_warps=warps)

    merge_grid = (B, Tq * H, VALUE_DIM // MERGE_DV)
    merge_args = (o_part, l_part, out, lse, H, Tq, splits, out.stride(0), out.stride(1), out.stride(2),
                  lse.stride(0), lse.stride(1))
    merge_consts = dict(DV=VALUE_DIM, BLOCK_DV=MERGE_DV, SPLITS_P2=triton.next_power_of_2(splits), PDL=False,
                        num_warps=4)

    def launch():
        _fp8_split_kernel[grid](*args, **consts)
        if splits > 1:
            _merge_kernel[merge_grid](*merge_args, **merge_consts)

    return Fp8DecodePlan(grid, splits, out, lse, launch, launches=1 if splits == 1 else 2)


def mla_decode_fp8(q, cache, kv_scale, lengths=None, *, block_table=None, scale=None, num_splits=None):
    """The FP8-cache decode in one call: (o, lse) as new tensors (see `plan_fp8`)."""
    o, lse = plan_fp8(q, cache, kv_scale, lengths, block_table=block_table, scale=scale,
                      num_splits=num_splits)()
    return o.clone(), lse.clone()


def reference(q, cache, kv_scale, lengths=None, *, block_table=None, scale=None):
    """fp64 attention over the dequantized cache (the values the FP8 codes stand for): (o [B, Tq, H, 512],
    lse [B, Tq, H]) in fp64, causal inside a verify group; for checks at small shapes."""
    check_cache(cache)
    kv = dequantize(cache, kv_scale)
    B, Tq, H, _ = q.shape
    sm = DEFAULT_SCALE if scale is None else float(scale)
    lens = [kv.shape[1]] * B if lengths is None else [int(n) for n in lengths]
    o = torch.zeros(B, Tq, H, VALUE_DIM, dtype=torch.float64)
    lse = torch.full((B, Tq, H), -math.inf, dtype=torch.float64)
    for b in range(B):
        if block_table is None:
            rows = kv[b, :lens[b]]
        else:
            pages = block_table[b].long().cpu()
            rows = kv[pages].reshape(-1, LATENT_DIM)[:lens[b]]
        rows = rows.cpu()
        for t in range(Tq):
            visible = rows[:lens[b] - Tq + t + 1]
            s = (q[b, t].to(torch.float64).cpu() @ visible.T) * sm       # [H, n]
            lse[b, t] = torch.logsumexp(s, dim=-1)
            o[b, t] = torch.softmax(s, dim=-1) @ visible[:, :VALUE_DIM]
    return o, lse


__all__ = ["ARTICLE_LAYERS", "ARTICLE_POSITIONS", "ARTICLE_RANKS", "FP8", "FP8_MAX", "Fp8DecodePlan",
           "bytes_per_position", "cache_bytes", "check_cache", "check_kv_scale", "dequantize",
           "mla_decode_fp8", "plan_fp8", "quantize_rows", "reference", "row_writer", "scale_for",
           "write_rows"]
