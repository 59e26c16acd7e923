"""The Triton backend of the MLA decode: the conservative "before" and the padded, split-history
"after", for every GPU Triton compiles for and, on a CPU, Triton's interpreter.

* before (`plan_before`): one program per query row (request x verify token x head) walking the
  request's whole history. Twelve rows cannot feed the matrix units (`tl.dot` needs at least 16
  rows, the height of an NVIDIA mma or AMD MFMA tile), so every score and value product runs as a
  broadcast multiply and a reduction on the vector units, one head per program.
* after (`plan_after`): the query padded to 16 heads (rows past the real heads are masked loads of
  zero, computed and never written: each head's softmax is its own), so `tl.dot` puts both products
  on the matrix units and reads each latent tile once for all heads. The history is split into
  `num_splits` pieces (`inputs.choose_num_splits`), each program writes a partial output and its
  base-2 log-sum-exp, and `_merge_kernel` combines them: lse = log sum_s exp(lse_s),
  o = sum_s exp(lse_s - lse) o_s. With one piece the split kernel writes the result itself.
  pad='copy' instead builds the seed's explicit 16-head query buffer and slices the 16-head output.

Contract: q [B, q_len 1..8, H, 576] fp32 / fp16 / bf16, a contiguous [B, L, 576] or paged cache
(inputs.validate); returns (o [B, q_len, H, 512] in q's dtype, lse [B, q_len, H] fp32, natural
log), the plan's own buffers. Verification groups are causal inside the group. Launch choices:
32-row tiles, 4 warps for one token (8 for verify groups of 64 rows; one token per program on
64-lane AMD devices), as many pipeline stages as the shared memory holds (at most 3); why this shape,
and the shapes that lost: docs/mla_padding.md ("Design choices").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from k3lab import env
from k3lab.ops.mla_decode.inputs import (DEFAULT_SCALE, LATENT_DIM, LOG2E, MAX_SPLITS, MMA_ROWS, ROPE_DIM,
                                         VALUE_DIM,
                                         Inputs, LaunchConfig, check_num_splits, choose_num_splits, piece_len,
                                         validate)

try:  # grid dependency control (programmatic dependent launch), NVIDIA sm_90+ only
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: the plans never ask for it (see pdl_usable)
    gdc_launch_dependents = gdc_wait = None

NAME = "triton"
TOKENS_PER_PROGRAM = 4  # after: verify tokens sharing one program (4 x 16 = 64 rows of accumulator)
# wave64 (AMD): one token per program; 32 or 64 accumulator rows spill 135-510 VGPRs there (k3lab.isa)
TOKENS_PER_PROGRAM_WAVE64 = 1
MERGE_DV = 16  # value columns per merge program: 12 heads x 32 programs at B = 1


def token_tile(q_len: int, wave_width: int | None = None) -> int:
    """Verify tokens one after-program holds (a power of two): at most TOKENS_PER_PROGRAM, or
    TOKENS_PER_PROGRAM_WAVE64 on a device of 64-lane waves. wave_width: read from the device when None."""
    wave = wave_width if wave_width is not None else env.detect().wave_width
    cap = TOKENS_PER_PROGRAM_WAVE64 if wave == 64 else TOKENS_PER_PROGRAM
    return min(triton.next_power_of_2(q_len), cap)


def after_groups(heads: int, q_len: int = 1, wave_width: int | None = None) -> int:
    """Programs the after kernel launches per request and split: 16-head groups x verify-token groups."""
    return -(-heads // MMA_ROWS) * -(-q_len // token_tile(q_len, wave_width))


def page_groups(max_len: int, splits: int, block_n: int, page_size: int) -> int:
    """Block-table entries the split kernel holds in registers at once: enough for one piece of the
    longest request (a piece need not start on a page boundary: one page more), 16 to 64."""
    piece = piece_len(max_len, splits, block_n)
    return max(16, min(64, triton.next_power_of_2(-(-piece // page_size) + 1)))


def _shared_memory_bytes() -> int | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    for name in ("shared_memory_per_block_optin", "shared_memory_per_multiprocessor"):
        v = getattr(props, name, None)
        if v:
            return int(v)
    return None


def _before_config(dtype, rows, block_n, num_warps, num_stages) -> LaunchConfig:
    return LaunchConfig(block_n or 32, num_warps or 8, num_stages or 2)


def _after_config(dtype, rows, block_n, num_warps, num_stages) -> LaunchConfig:
    bn = block_n or 32
    warps = num_warps or (4 if rows <= 16 else 8)
    if num_stages is None:
        smem = _shared_memory_bytes()
        elem = torch.tensor([], dtype=dtype).element_size()
        reserve = rows * LATENT_DIM * elem + 16384  # the query tile and the p tile live there too
        num_stages = 3 if smem is None else max(1, min(3, (smem - reserve) // (bn * LATENT_DIM * elem)))
    return LaunchConfig(bn, warps, num_stages)


_CONFIGS = {"before": _before_config, "after": _after_config}


def launch_config(variant: str, dtype: torch.dtype = torch.bfloat16, rows: int = MMA_ROWS,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None) -> LaunchConfig:
    """Tile rows, warps and pipeline depth for 'before' or 'after' (explicit values win).

    after: 32-row tiles; 4 warps for 16 rows, 8 for 64 (the 64 x 512 fp32 accumulator of a verify
    group); as many stages as fit in the device's shared memory (LDS on AMD) beside the query and p
    tiles, at most 3 (two tiles in flight, two programs per H200 SM). before: 32 rows, 8 warps, 2."""
    if variant not in _CONFIGS:
        raise ValueError(f"variant must be 'before' or 'after', got {variant!r}")
    return _CONFIGS[variant](dtype, rows, block_n, num_warps, num_stages)


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
    k_c, k_pe, pmask = _before_load(kv_ptr, bt_ptr, b, 0, end, stride_kvp, stride_kvr, stride_btb, PAGED,
                                    PAGE_SIZE,
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
    the program, both products on tl.dot. Every split decode runs it, whatever its cache stores: the
    loads convert to q's dtype (nothing to do for a bf16 cache; fp8_cache's E4M3 codes widen exactly).

    Transposed: positions are the M dimension (64-row tiles are what Hopper's wgmma wants) and the 16
    padded heads the N dimension, so the latent tile feeds both products straight from shared memory.
    s^T [BLOCK_N, rows] = K q^T;  acc^T [DV, rows] += K_v^T p^T."""
    pmask = pos < end
    k_c = tl.load(kv_ptr + rows[:, None] + tl.arange(0, DV)[None, :], mask=pmask[:, None], other=0.0)
    k_pe = tl.load(kv_ptr + rows[:, None] + DV + tl.arange(0, DR)[None, :], mask=pmask[:, None], other=0.0)
    k_c, k_pe = k_c.to(q_t.dtype), k_pe.to(q_t.dtype)
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
def _page_group_tile(kv_ptr, pages, gidx, pg, n0, offs_n, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                     stride_kvp, stride_kvr, PAGE_SIZE: tl.constexpr, DV: tl.constexpr, DR: tl.constexpr,
                     IEEE: tl.constexpr):
    """The tile at n0 inside a page whose id is among the block-table entries held in registers
    (`pages`, entries pg + gidx): no memory read for its address."""
    page = tl.sum(tl.where(gidx == n0 // PAGE_SIZE - pg, pages, 0))
    rows = page * stride_kvp + ((n0 % PAGE_SIZE) + offs_n).to(tl.int64) * stride_kvr
    return _split_tile(kv_ptr, rows, n0 + offs_n, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2, DV, DR,
                       IEEE)


@triton.jit
def walk_piece(kv_ptr, bt_ptr, b, start, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
               stride_kvp, stride_kvr, stride_btb, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr,
               DV: tl.constexpr, DR: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Positions [start, end) of request b, tile by tile, each tile's rows addressed through the block
    table (paged) or the request's rows (contiguous), one lookup per row. Returns (m, l, acc). The bf16
    split decode (pieces that cross its register-held page groups) and fp8_cache's decode walk with it."""
    offs_n = tl.arange(0, BLOCK_N)
    if INTERPRET:  # Triton's interpreter cannot range() over a run-time scalar
        n0 = start
        while n0 < end:
            pos = n0 + offs_n
            rows = _row_offsets(bt_ptr, b, pos, pos < end, stride_kvp, stride_kvr, stride_btb, PAGED,
                                PAGE_SIZE)
            m_i, l_i, acc = _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                                        DV, DR, IEEE)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            rows = _row_offsets(bt_ptr, b, pos, pos < end, stride_kvp, stride_kvr, stride_btb, PAGED,
                                PAGE_SIZE)
            m_i, l_i, acc = _split_tile(kv_ptr, rows, pos, end, qpos, q_t, qpe_t, m_i, l_i, acc, scale_log2,
                                        DV, DR, IEEE)
    return m_i, l_i, acc


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
def _store_piece(m_i, l_i, acc, o_ptr, lse_ptr, op_ptr, lsep_ptr, b, t, h, row_ok, split, heads, q_len,
                 num_splits,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV: tl.constexpr,
                 WRITE_FINAL: tl.constexpr):
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
    # table -> tile): the chain is a decode's fixed cost at long context (docs/mla_padding.md).
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
        pages = tl.load(bt_ptr + b * stride_btb + pg + gidx, mask=pg + gidx < table_pages,
                        other=0).to(tl.int64)
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
                    m_i, l_i, acc = _page_group_tile(kv_ptr, pages, gidx, pg, n0, offs_n, end, qpos, q_t,
                                                     qpe_t, m_i, l_i, acc, scale_log2, stride_kvp, stride_kvr,
                                                     PAGE_SIZE, DV, DR, IEEE)
                    n0 += BLOCK_N
            else:
                for n0 in range(g_start, g_end, BLOCK_N):
                    m_i, l_i, acc = _page_group_tile(kv_ptr, pages, gidx, pg, n0, offs_n, end, qpos, q_t,
                                                     qpe_t, m_i, l_i, acc, scale_log2, stride_kvp, stride_kvr,
                                                     PAGE_SIZE, DV, DR, IEEE)
            pg += PAGE_GROUPS
            pages = tl.load(bt_ptr + b * stride_btb + pg + gidx, mask=pg + gidx < table_pages,
                            other=0).to(tl.int64)
    else:
        m_i, l_i, acc = walk_piece(kv_ptr, bt_ptr, b, start, end, qpos, q_t, qpe_t, m_i, l_i, acc,
                                   scale_log2, stride_kvp, stride_kvr, stride_btb, PAGED, PAGE_SIZE, DV, DR,
                                   BLOCK_N, IEEE, INTERPRET)
    _store_piece(m_i, l_i, acc, o_ptr, lse_ptr, op_ptr, lsep_ptr, b, t, h, row_ok, split, heads, q_len,
                 num_splits,
                 stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV, WRITE_FINAL)


@triton.jit
def _merge_kernel(op_ptr, lsep_ptr, o_ptr, lse_ptr,
                  heads, q_len, num_splits,
                  stride_ob, stride_ot, stride_oh,
                  stride_lb, stride_lt,
                  DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_P2: tl.constexpr, PDL: tl.constexpr):
    # One program = one (request, row) and BLOCK_DV value columns: lse-weighted sum of the pieces.
    # The merge is latency-bound (a few MB over few programs): the partials and their log-sum-exps
    # are requested together, so it waits for one memory round trip, not one for the weights and
    # another for the partials.
    b = tl.program_id(0)
    row = tl.program_id(1)
    dv0 = tl.program_id(2) * BLOCK_DV
    t = row // heads
    h = row % heads
    base = (b * q_len * heads + row).to(tl.int64) * num_splits
    offs_v = dv0 + tl.arange(0, BLOCK_DV)
    if PDL:  # launched early (programmatic dependent launch): wait for the split kernel's partials
        gdc_wait()
    ss = tl.arange(0, SPLITS_P2)
    smask = ss < num_splits
    part = tl.load(op_ptr + (base + ss)[:, None] * DV + offs_v[None, :], mask=smask[:, None], other=0.0)
    lse_all = tl.load(lsep_ptr + base + ss, mask=smask, other=-float("inf"))
    m = tl.max(lse_all, axis=0)
    m_use = tl.where(m == -float("inf"), 0.0, m)
    w = tl.exp2(lse_all - m_use)
    denom = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None] * part, axis=0)
    seen = denom > 0
    o = acc / tl.where(seen, denom, 1.0)
    tl.store(o_ptr + b.to(tl.int64) * stride_ob + t * stride_ot + h * stride_oh + offs_v,
             o.to(o_ptr.dtype.element_ty))
    if dv0 == 0:
        lse = tl.where(seen, (m_use + tl.log2(tl.where(seen, denom, 1.0))) * 0.6931471805599453,
                       -float("inf"))
        tl.store(lse_ptr + b * stride_lb + t * stride_lt + h, lse)


# ----------------------------------------------------------------------------------------------
# plans: validated once, launched many times


class _Launch:
    """One kernel launch with fixed arguments (through Triton's JIT; the first call compiles)."""

    def __init__(self, kernel, grid, args: tuple, consts: dict):
        self.kernel, self.grid, self.args, self.consts = kernel, grid, args, consts
        self.compiled = None

    def __call__(self):
        ck = self.kernel[self.grid](*self.args, **self.consts)
        if self.compiled is None and ck is not None and not isinstance(ck, (int, float, tuple)):
            self.compiled = ck  # a CompiledKernel on a GPU; None in the interpreter


@dataclass
class DecodePlan:
    """A validated Triton decode, ready to launch: `plan()` runs it and returns (o, lse), the plan's
    own output buffers, overwritten by each call.

    grid / programs: the main kernel's grid and its size (the figure to hold against the compute
    units); programs_per_unit: how many fit on one compute unit at once (from the compiled kernel's
    registers and shared memory); launches: kernels per call; num_splits: history pieces per request
    (before: 1); pdl: the merge is launched early (programmatic dependent launch)."""

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
    pdl: bool = False
    backend: str = NAME
    _kernels: list = field(default_factory=list, repr=False)
    padded_query: torch.Tensor | None = field(default=None, repr=False)  # pad='copy': the 16-head buffers
    padded_out: torch.Tensor | None = field(default=None, repr=False)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._launch()
        return self.out, self.lse

    def facts(self) -> dict:
        return {"backend": self.backend, "num_splits": self.num_splits, "programs": self.programs,
                "programs_per_unit": self.programs_per_unit, "launches": self.launches,
                "block_n": self.config.block_n, "num_warps": self.config.num_warps,
                "num_stages": self.config.num_stages, "rows_per_program": self.rows_per_program,
                "pad": self.pad,
                "pdl": self.pdl}


def on_gpu() -> bool:
    return torch.cuda.is_available() and not env.triton_interpreted()


def pdl_usable() -> bool:
    """Programmatic dependent launch of the merge: NVIDIA compute capability 9.0+ (Hopper) with a
    Triton that has grid dependency control. Where usable it is always on (it hides the merge's launch
    behind the split kernel)."""
    return (on_gpu() and torch.version.cuda is not None and gdc_wait is not None
            and torch.cuda.get_device_capability()[0] >= 9)


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


def plan_before(q, cache, lengths=None, *, block_table=None, scale=None, block_n=None, num_warps=None,
                num_stages=None) -> DecodePlan:
    """Validate once and return a launchable plan of the conservative kernel `_before_kernel`.
    block_n / num_warps / num_stages override `launch_config('before')`."""
    inp = validate(q, cache, lengths, block_table)
    cfg = launch_config("before", q.dtype, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    out = torch.empty(B, Tq, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)
    scale_log2 = (DEFAULT_SCALE if scale is None else float(scale)) * LOG2E
    grid = (H, Tq, B)
    kv, bt, lens = inp.kv, inp.block_table, inp.lengths
    consts = dict(PAGED=inp.paged, PAGE_SIZE=inp.page_size, DV=VALUE_DIM, DR=ROPE_DIM, BLOCK_N=cfg.block_n,
                  INTERPRET=env.triton_interpreted(), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    launch = _Launch(
        _before_kernel,
        grid,
        (
            q,
            kv,
            bt,
            lens,
            out,
            lse,
            Tq,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            kv.stride(0),
            kv.stride(1),
            bt.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            lse.stride(0),
            lse.stride(1),
            scale_log2,
        ),
        consts,
    )
    plan = DecodePlan("before", grid, 1, 1, cfg, H, 1, "none", out, lse, launch, _kernels=[launch])
    if on_gpu():
        plan()  # compile, and read how many programs fit on one unit
        plan.programs_per_unit = _occupancy(launch.compiled, cfg.num_warps)
    return plan


def _split_launch(inp: Inputs, kq, k_out, k_lse, k_heads: int, cfg: LaunchConfig, splits: int,
                  scale_log2: float,
                  pdl: bool):
    """The split kernel's launch (and, for splits > 1, the merge's) on the (possibly padded) buffers."""
    B, Tq = inp.batch, inp.q_len
    head_groups = -(-inp.heads // MMA_ROWS)
    tok = token_tile(Tq)
    dev = kq.device
    if splits > 1:
        o_part = torch.empty(B * Tq * k_heads * splits, VALUE_DIM, dtype=torch.float32, device=dev)
        l_part = torch.empty(B * Tq * k_heads * splits, dtype=torch.float32, device=dev)
    else:
        o_part = l_part = k_lse  # unused: the split kernel writes the result itself
    grid = (splits, B, head_groups * -(-Tq // tok))
    # Tiles inside pages: the block table is read a group of pages at a time, a group sized to
    # cover one piece of the longest request (16 to 64 pages), so the tile loop usually runs once.
    tiles_in_pages = inp.paged and inp.page_size % cfg.block_n == 0
    groups = page_groups(inp.max_len, splits, cfg.block_n, inp.page_size) if tiles_in_pages else 0
    use_pdl = pdl and splits > 1  # only the merge is launched early
    consts = dict(PAGED=inp.paged, PAGE_SIZE=inp.page_size, PAGE_GROUPS=groups, DV=VALUE_DIM, DR=ROPE_DIM,
                  HEAD_TILE=MMA_ROWS, TOK_TILE=tok, BLOCK_N=cfg.block_n, WRITE_FINAL=splits == 1,
                  IEEE=kq.dtype == torch.float32, PDL=use_pdl, INTERPRET=env.triton_interpreted(),
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    kv, bt, lens = inp.kv, inp.block_table, inp.lengths
    kernels = [
        _Launch(
            _split_kernel,
            grid,
            (
                kq,
                kv,
                bt,
                lens,
                k_out,
                k_lse,
                o_part,
                l_part,
                k_heads,
                Tq,
                splits,
                head_groups,
                piece_len(inp.max_len, splits, cfg.block_n),
                bt.shape[1],
                kq.stride(0),
                kq.stride(1),
                kq.stride(2),
                kv.stride(0),
                kv.stride(1),
                bt.stride(0),
                k_out.stride(0),
                k_out.stride(1),
                k_out.stride(2),
                k_lse.stride(0),
                k_lse.stride(1),
                scale_log2,
            ),
            consts,
        )
    ]
    if splits > 1:
        kernels.append(_Launch(_merge_kernel, (B, Tq * k_heads, VALUE_DIM // MERGE_DV),
                               (o_part, l_part, k_out, k_lse, k_heads, Tq, splits, k_out.stride(0),
                                k_out.stride(1),
                                k_out.stride(2), k_lse.stride(0), k_lse.stride(1)),
                               dict(DV=VALUE_DIM, BLOCK_DV=MERGE_DV, SPLITS_P2=triton.next_power_of_2(splits),
                                    PDL=use_pdl, num_warps=4, **({"launch_pdl": True} if use_pdl else {}))))
    return grid, kernels, use_pdl


def _build_after(inp: Inputs, q, cfg: LaunchConfig, splits: int, ppu: int, *, pad: str, pad_fill: float,
                 scale) -> DecodePlan:
    B, Tq, H = inp.batch, inp.q_len, inp.heads
    out = torch.empty(B, Tq, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Tq, H, dtype=torch.float32, device=q.device)
    if pad == "copy":  # the seed's adapter: explicit 16-head buffers around the kernel
        kq = torch.full((B, Tq, MMA_ROWS, LATENT_DIM), pad_fill, dtype=q.dtype, device=q.device)
        k_out = torch.empty(B, Tq, MMA_ROWS, VALUE_DIM, dtype=q.dtype, device=q.device)
        k_lse = torch.empty(B, Tq, MMA_ROWS, dtype=torch.float32, device=q.device)
    else:
        kq, k_out, k_lse = q, out, lse
    scale_log2 = (DEFAULT_SCALE if scale is None else float(scale)) * LOG2E
    grid, kernels, use_pdl = _split_launch(inp, kq, k_out, k_lse, kq.shape[2], cfg, splits, scale_log2,
                                           pdl_usable())

    def launch():
        if pad == "copy":
            kq[:, :, :H].copy_(q)
        for k in kernels:
            k()
        if pad == "copy":
            out.copy_(k_out[:, :, :H])  # the padded heads' outputs are dropped here
            lse.copy_(k_lse[:, :, :H])

    launches = len(kernels) + (3 if pad == "copy" else 0)
    plan = DecodePlan("after", grid, splits, launches, cfg, H, token_tile(Tq) * MMA_ROWS, pad, out, lse,
                      launch,
                      programs_per_unit=ppu, pdl=use_pdl, _kernels=kernels)
    if pad == "copy":
        plan.padded_query, plan.padded_out = kq, k_out
    return plan


def plan_after(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, pad="registers",
               pad_fill: float = 0.0, fold_heads=False, compute_units=None, block_n=None, num_warps=None,
               num_stages=None) -> DecodePlan:
    """Validate once and return a launchable plan of the padded split-history decode.

    num_splits: None = `choose_num_splits` for this batch, the longest context, the device's compute
    units (`compute_units` overrides them) and how many programs fit on one unit; an int forces it.
    pad: 'registers' (masked loads of the 16-row tile; nothing extra in memory) or 'copy' (the seed's
    adapter: an explicit [B, q_len, 16, 576] query buffer whose extra heads hold `pad_fill`, and a
    16-head output whose extra heads are dropped). fold_heads: allow H > 16 as groups of 16.
    block_n / num_warps / num_stages override `launch_config('after')`."""
    if pad not in ("registers", "copy"):
        raise ValueError(f"pad must be 'registers' or 'copy', got {pad!r}")
    inp = validate(q, cache, lengths, block_table, max_heads=None if fold_heads else MMA_ROWS)
    if pad == "copy" and inp.heads > MMA_ROWS:
        raise ValueError(f"pad='copy' builds one 16-head buffer; heads = {inp.heads} needs pad='registers' "
                         "with fold_heads=True")
    check_num_splits(num_splits, MAX_SPLITS)
    rows = token_tile(inp.q_len) * MMA_ROWS
    cfg = launch_config("after", q.dtype, rows=rows, block_n=block_n, num_warps=num_warps,
                        num_stages=num_stages)
    units = env.detect().compute_units if compute_units is None else compute_units
    groups = after_groups(inp.heads, inp.q_len)

    def rule(ppu: int) -> int:
        return choose_num_splits(inp.batch, inp.max_len, units, groups_per_request=groups,
                                 block_n=cfg.block_n,
                                 programs_per_unit=ppu)

    kw = dict(pad=pad, pad_fill=pad_fill, scale=scale)
    splits = num_splits if num_splits is not None else rule(1)
    plan = _build_after(inp, q, cfg, splits, 1, **kw)
    if on_gpu():
        plan()  # compile (and run once) to read the kernel's registers and shared memory
        ppu = _occupancy(plan._kernels[0].compiled, cfg.num_warps)
        plan.programs_per_unit = ppu
        if num_splits is None and ppu > 1 and rule(ppu) != splits:
            plan = _build_after(inp, q, cfg, rule(ppu), ppu, **kw)
            plan()
    return plan
