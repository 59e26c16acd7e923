"""Chunked KDA prefill in Triton: the plain chunk walk ("before") and the group scan ("after").

The problem (seed, section 5): KDA's state after a chunk depends on the state before it, so a
prefill walks its chunks one after another. With few sequences and heads (B = 1 at TP8: 12 heads,
two 64-wide value tiles each = 24 programs) most of the GPU's 132 SMs (256 CUs on MI355X) sit idle
while 24 programs each walk 256 chunks of a 16K-token prompt.

Both variants start with the same chunk-local prologue (every chunk in parallel): per chunk and
head, the in-chunk cumulative log-decay G, Akk and Aqk, the 64 x 64 unit lower-triangular inverse
R = (I + Akk)^-1 in fp32, and from it W = R diag(beta) (K e^G), U = R diag(beta) V,
Qg = scale Q e^G, Kd^T = (K e^(G_last - G))^T and d = e^(G_last) (the
`k3lab.ops.kda_scan_math.ChunkQuantities`, written to memory in the inputs' dtype). The default
'rows' prologue takes three launches (the A's, the inverse, W/U: `prologue_launches`); 'fused' does
the same work in one, 'flat' computes the A's by 64-row products, run 2's 'split' and run 1's
'persistent' are kept for comparison. Below,
"launch 1" means the prologue however many launches it takes.

* before (`kda_chunk_before`, prologue + 1 launch): the walk. One program per (sequence, head, value tile)
  keeps its state tile S [128 x BV] fp32 on chip and, chunk after chunk, computes
  E = U - W S, O = Qg S + Aqk E, S = diag(d) S + Kd^T E.
* after (`kda_chunk_after`, prologue + 3 launches): the group scan.
  1. the same prologue;
  2. summaries: every group of `group_size` chunks composes its chunk maps
     S_out = A_c S_in + B_c (A_c = diag(d) - Kd^T W, B_c = Kd^T U) into one map
     S_out = (D + N) S_in + b. D = the product of the chunks' d (a diagonal, kept exact in fp32);
     N and b come from the same walk as above run on the wider state [N | b] (K + V columns):
     N starts at 0 with right-hand side -W diag(D_so_far), b starts at 0 with right-hand side U;
  3. the scan: one program per (sequence, head, value tile) walks the groups in order,
     S <- D S + N S + b, writing every group's starting state (n_groups steps, not n_chunks);
  4. replay: every group walks its own chunks from its starting state, all groups in parallel,
     writing O (and the final state from each sequence's last group). It is the "before" kernel
     with more, shorter walks.
  The extra work is the summary walk on K + V = 256 columns (about as many matrix flops as the
  replay itself) and the scan; it pays only while the plain walk leaves the GPU idle.
  `choose_group_size` makes that call from sequences x heads against the device's compute units,
  and falls back to the plain walk (one group per sequence) when there is enough parallel work.

Inputs: q, k [B, T, H, 128], v [B, T, H, 128] (bf16, fp16 or fp32, one dtype), g [B, T, H, 128]
fp32 log-decay (<= 0), beta [B, T, H] fp32, an optional fp32 initial state [N, H, 128, 128];
variable-length batches are packed as B = 1 with cu_seqlens [N + 1] (FlashAttention's convention).
Outputs: o like v's layout in q's dtype, final state [N, H, 128, 128] fp32.

Precision: the inverse and its intermediates stay fp32 (Akk from fp32 operands, "tf32x3" on NVIDIA,
exact fp32 elsewhere), and only the finished R is rounded to the input dtype for W and U (seed,
technical note). The walks use the input dtype's matrix units with an fp32 state and fp32
accumulation, as fla does. With fp32 inputs every product is an fp32 one ("ieee"): that is what the
CPU tests check in Triton's interpreter, where bf16 dots are wrong.

The decay factors: e^(G_i - G_j) is split around the cumulative decay before a 16-row block so
that every factor is <= 1 except inside a diagonal block, where one factor reaches e^(spread of the
block), at most e^(16 max|g|): within fp32 for K3's gate (g in (-5, 0), architecture.md). A block
whose spread is wider than SAFE_SPREAD takes an exact column-by-column path instead (slower, same
result), so no input overflows.

Measured (H200, bf16, fla-core 0.6.0 in the same run; profiles/nvidia-h200/kda_scan): every
variant matches the fp64 reference as closely as fla does (rel. L2 4.4e-3 on o, 3.7e-3 on the
state). Run 3: at 12 heads x 16K tokens the 'rows' prologue took 544 us (its A launch 387), against
778 for run 2's 'split' (A launch 632), 712 for 'fused' and 1493 for run 1's 'persistent'. Run 5
(issue 6): with the inverse's products in tf32x3 (49 us instead of 68: no register spills) and the
scan on 16 columns x 8 warps (36 us instead of 80) the after takes 844 us, the before 1001, fla's
chunk_kda 1055 in the same run: 1.25x, short of issue 6's 2x. 'flat' (64-row products) and 'inv_wu'
(inverse and W / U in one launch) measured slower (prologue 650 and 630 us against 529). With the
rows prologue's exact path for wide decays moved to a fix-up launch (now the default: A 277 us
against 381, the prologue 406 against 524) the after takes 723 us, the before 884 and fla 992 in
one run (1.37x; 64K: 2611 / 3419 / 3847, 1.47x). With 8 sequences the GPU is full: the after walks
plainly, level with the before, and both beat fla by 1.36x (16K) and 1.37x (64K). The before
fits 0.21 us per chunk and head plus 1.55 us per chunk step on the critical path (run 3), within 5%.
Run 6 (this file's 'cuda' prologue, kernels/kda_prologue.cu, the default for bf16 on NVIDIA GPUs): the
prologue in one hand-written launch, 242 us against 410 for 'rows' in the same run; the after 561 us,
the before 728, fla 999 at 12 heads x 16K (1.78x, short of issue 6's 2x); 64K: 1988 / 2818 / 3866
(1.94x); every other crossover point 1.8-2.0x faster than fla, the 96-head ones included.

ROCm: the Triton kernels are plain Triton and read unit counts from the device; they have not yet been
run on AMD hardware by this project. The 'cuda' prologue has no AMD kernel (its HIP build is a stub):
on ROCm 'rows' runs, also not yet run on AMD hardware.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from k3lab import env

HEAD_DIM = 128  # K = V = 128 for K3's KDA; the kernels hold whole 128-row state tiles
CHUNK = 64
SUB = 16  # the inverse works on 16 x 16 blocks
SAFE_SPREAD = 64.0  # largest in-block decay spread (natural log) the factored path accepts
_SLOTS_PER_UNIT = 2  # prologue programs per compute unit (each owns a 64 KB scratch slot)
# Triton's interpreter (CPU) turns a run-time loop bound into a 1-element array that numpy >= 2.3 will not
# convert to an int; the kernels then loop with `while`, which it handles (compiled code keeps `for`).
_WHILE = env.triton_interpreted()
# one-instruction exponentials by inline PTX: compiled for NVIDIA only (the interpreter runs no PTX)
_FAST_EXP = not env.triton_interpreted() and env.detect().backend == "cuda"


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit(do_not_specialize=["n_items", "nprog", "n_iter", "H"])
def _prologue_kernel(
    q,
    k,
    v,
    g,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    u_out,
    qg_out,
    kdt_out,
    aqk_out,
    d_out,
    scratch,
    n_items,
    nprog,
    n_iter,
    H,
    scale,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    SPREAD: tl.constexpr,
    AKK_PREC: tl.constexpr,
    AQK_PREC: tl.constexpr,
    INV_PREC: tl.constexpr,
    OUT_PREC: tl.constexpr,
    WHILE: tl.constexpr,
):
    """Persistent: program p handles items p, p + P, ... (item = chunk * H + head) and keeps its
    G / Akk / R in its own scratch slot, so the slots stay in L2 instead of streaming to memory.
    WHILE (Triton's interpreter) uses while loops: its `for` cannot take run-time bounds here."""
    pid = tl.program_id(0)
    s_g = scratch + pid.to(tl.int64) * (C * K + 2 * C * C)
    if WHILE:
        it = 0
        while it < n_iter:
            item = pid + it * nprog
            if item < n_items:
                _prologue_item(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    chunk_tok,
                    chunk_len,
                    w_out,
                    u_out,
                    qg_out,
                    kdt_out,
                    aqk_out,
                    d_out,
                    s_g,
                    item,
                    H,
                    scale,
                    K,
                    V,
                    C,
                    BC,
                    SPREAD,
                    AKK_PREC,
                    AQK_PREC,
                    INV_PREC,
                    OUT_PREC,
                )
            it += 1
    else:
        for it in range(n_iter):
            item = pid + it * nprog
            if item < n_items:
                _prologue_item(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    chunk_tok,
                    chunk_len,
                    w_out,
                    u_out,
                    qg_out,
                    kdt_out,
                    aqk_out,
                    d_out,
                    s_g,
                    item,
                    H,
                    scale,
                    K,
                    V,
                    C,
                    BC,
                    SPREAD,
                    AKK_PREC,
                    AQK_PREC,
                    INV_PREC,
                    OUT_PREC,
                )


@triton.jit
def _prologue_item(
    q,
    k,
    v,
    g,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    u_out,
    qg_out,
    kdt_out,
    aqk_out,
    d_out,
    s_g,
    item,
    H,
    scale,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    SPREAD: tl.constexpr,
    AKK_PREC: tl.constexpr,
    AQK_PREC: tl.constexpr,
    INV_PREC: tl.constexpr,
    OUT_PREC: tl.constexpr,
):
    """One chunk of one head: G, Akk, Aqk, R = (I + Akk)^-1, W, U, Qg, Kd^T, d."""
    rc = tl.arange(0, C)
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    rb = tl.arange(0, BC)
    s_a = s_g + C * K
    s_r = s_a + C * C
    INTER = w_out.dtype.element_ty
    c = item // H
    h = item % H
    tok0 = tl.load(chunk_tok + c).to(tl.int64)
    L = tl.load(chunk_len + c)
    rmask = rc < L
    row_qk = ((tok0 + rc) * H + h) * K
    kf = tl.load(k + row_qk[:, None] + rk[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    qf = tl.load(q + row_qk[:, None] + rk[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    gf = tl.load(g + row_qk[:, None] + rk[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    bt = tl.load(beta + (tok0 + rc) * H + h, mask=rmask, other=0.0).to(tl.float32)
    # padded rows: g = 0 keeps G at G_last, k = 0 and beta = 0 make them no-ops
    G = tl.cumsum(gf, axis=0)
    tl.store(s_g + rc[:, None] * K + rk[None, :], G)
    tl.debug_barrier()
    out = c.to(tl.int64) * H + h
    aqk_base = aqk_out + out * C * C
    # --- Akk, Aqk by 16-column blocks, around the block's first row s: e^(G_i - G_s) e^(G_s - G_j)
    for J in tl.static_range(C // BC):
        jj = J * BC + rb
        G_s = tl.load(s_g + J * BC * K + rk)
        G_J = tl.load(s_g + jj[:, None] * K + rk[None, :])
        k_J = tl.load(
            k + ((tok0 + jj) * H + h)[:, None] * K + rk[None, :], mask=(jj < L)[:, None], other=0.0
        ).to(tl.float32)
        spread = tl.max(tl.max(G_s[None, :] - G_J, axis=1), axis=0)
        if spread <= SPREAD:
            col = k_J * tl.exp(G_s[None, :] - G_J)  # <= e^SPREAD
            row = tl.exp(tl.where(rc[:, None] >= J * BC, G - G_s[None, :], float("-inf")))  # <= 1
            akk = tl.dot(kf * row, tl.trans(col), input_precision=AKK_PREC)
            aqk = tl.dot(qf * row, tl.trans(col), input_precision=AQK_PREC)
        else:  # wide decay inside the block: exact pairwise decays, one key column at a time
            akk = tl.zeros([C, BC], dtype=tl.float32)
            aqk = tl.zeros([C, BC], dtype=tl.float32)
            for cc in range(BC):
                j = J * BC + cc
                k_j = tl.load(k + ((tok0 + j) * H + h) * K + rk, mask=(rk < K) & (j < L), other=0.0).to(
                    tl.float32
                )
                G_j = tl.load(s_g + j * K + rk)
                e = tl.exp(tl.where(rc[:, None] >= j, G - G_j[None, :], float("-inf")))
                ke = k_j[None, :] * e
                akk = tl.where(rb[None, :] == cc, tl.sum(kf * ke, axis=1)[:, None], akk)
                aqk = tl.where(rb[None, :] == cc, tl.sum(qf * ke, axis=1)[:, None], aqk)
        akk = tl.where(rc[:, None] > jj[None, :], akk * bt[:, None], 0.0)
        aqk = tl.where(rc[:, None] >= jj[None, :], aqk * scale, 0.0)
        tl.store(s_a + rc[:, None] * C + jj[None, :], akk)
        tl.store(aqk_base + rc[:, None] * C + jj[None, :], aqk.to(INTER))
    tl.debug_barrier()
    # --- R = (I + Akk)^-1: the four diagonal 16 x 16 blocks by forward substitution, side by side
    b3 = tl.arange(0, C // BC)[:, None, None]
    i3 = rb[None, :, None]
    j3 = rb[None, None, :]
    diag = (b3 * BC + i3) * C + b3 * BC + j3
    L3 = tl.load(s_a + diag)
    X3 = tl.zeros([C // BC, BC, BC], dtype=tl.float32)  # R - I, filled row by row
    for i in range(1, BC):
        a = -tl.sum(tl.where(i3 == i, L3, 0.0), axis=1)  # row i of -L, every block
        x = a + tl.sum(a[:, :, None] * X3, axis=1)
        X3 = tl.where(i3 == i, x[:, None, :], X3)
    R3 = X3 + tl.where(i3 == j3, 1.0, 0.0)
    tl.store(s_r + diag, R3)
    tl.debug_barrier()
    # --- off-diagonal blocks: R_IJ = -R_II sum_{J <= M < I} L_IM R_MJ, fp32 products
    r00 = _blk(s_r, 0, 0, C, BC)
    r11 = _blk(s_r, 1, 1, C, BC)
    r22 = _blk(s_r, 2, 2, C, BC)
    r33 = _blk(s_r, 3, 3, C, BC)
    r10, r21, r32, r20, r31, r30 = _inverse_below_diagonal(s_a, r00, r11, r22, r33, C, BC, INV_PREC)
    _blk_store(s_r, 1, 0, r10, C, BC)
    _blk_store(s_r, 2, 1, r21, C, BC)
    _blk_store(s_r, 3, 2, r32, C, BC)
    _blk_store(s_r, 2, 0, r20, C, BC)
    _blk_store(s_r, 3, 1, r31, C, BC)
    _blk_store(s_r, 3, 0, r30, C, BC)
    tl.debug_barrier()
    R = tl.load(
        s_r + rc[:, None] * C + rc[None, :], mask=(rc[:, None] // BC) >= (rc[None, :] // BC), other=0.0
    )
    # --- W, U from the finished inverse (rounded to the input dtype only now, as the seed does)
    eG = tl.exp(G)
    Rb = R.to(INTER)
    W = tl.dot(Rb, (kf * eG * bt[:, None]).to(INTER), input_precision=OUT_PREC)
    vf = tl.load(v + ((tok0 + rc) * H + h)[:, None] * V + rv[None, :], mask=rmask[:, None], other=0.0).to(
        tl.float32
    )
    U = tl.dot(Rb, (vf * bt[:, None]).to(INTER), input_precision=OUT_PREC)
    tl.store(w_out + out * C * K + rc[:, None] * K + rk[None, :], W.to(INTER))
    tl.store(u_out + out * C * V + rc[:, None] * V + rv[None, :], U.to(INTER))
    tl.store(qg_out + out * C * K + rc[:, None] * K + rk[None, :], (qf * eG * scale).to(INTER))
    G_last = tl.load(s_g + (C - 1) * K + rk)
    kd_t = tl.trans(kf * tl.exp(G_last[None, :] - G))  # [K, C]
    tl.store(kdt_out + out * K * C + rk[:, None] * C + rc[None, :], kd_t.to(INTER))
    tl.store(d_out + out * K + rk, tl.exp(G_last))
    tl.debug_barrier()  # the next item reuses this program's scratch slot


# ----------------------------------------------------------------------------------------------
# prologue, split form: three launches, each with few live tiles (the register pressure of the
# one-kernel forms capped them at two programs per SM, measured on the H200):
#   1. A's: one program per (chunk, head[, row block]). Row block I runs its own pass over the key
#      slices and holds only its own <= 4 Akk and <= 4 Aqk blocks; it rebuilds the earlier blocks'
#      key factors c_J = k e^(E_J - G_J) (L1/L2-hot re-reads) instead of keeping them. It also
#      writes Qg, W's right factor, Kd^T and d. Akk (fp32) goes to the R buffer.
#   2. the inverse, fp32, in place in the R buffer (16 x 16 tiles: few warps suffice).
#   3. W and U from the finished inverse rounded to the input dtype (matrix units).
# Factoring of the decays (every factor <= 1 except on the diagonal):
#   off-diagonal (I > J):  e^(G_i - G_j) = e^(G_i - P_I) e^(P_I - E_J) e^(E_J - G_j)
#   diagonal:              e^(G_i - G_j) = e^(G_i - P_I) e^(P_I - G_j)      (<= e^spread)
# with P_I the cumulative log-decay before block I's first row and E_J the one at block J's last.


@triton.jit
def _row_of(x, r, BC: tl.constexpr):
    """Row r of a [BC, N] tile as an [N] vector (exact: one nonzero term per column)."""
    rb = tl.arange(0, BC)
    return tl.sum(tl.where(rb[:, None] == r, x, 0.0), axis=0)


@triton.jit
def _fwd_subst_row(x, base, i, BI: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    """One forward-substitution row of diagonal block BI: X[i] = -A[i] - A[i] X (A's row read back)."""
    rb = tl.arange(0, BC)
    a = -tl.load(base + (BI * BC + i) * C + BI * BC + rb)
    return tl.where(rb[:, None] == i, (a + tl.sum(a[:, None] * x, axis=0))[None, :], x)


@triton.jit
def _sp_load(q, k, g, beta, tok0, L, h, H, col, BI: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    rb = tl.arange(0, BC)
    rows = BI * BC + rb
    m = (rows < L)[:, None]
    off = ((tok0 + rows) * H + h)[:, None] * K + col[None, :]
    kb = tl.load(k + off, mask=m, other=0.0).to(tl.float32)
    qb = tl.load(q + off, mask=m, other=0.0).to(tl.float32)
    gb = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    return kb, qb, gb


@triton.jit
def _sp_diag(acc_k, acc_q, kb, qb, a_k, a_q, Gw, SPREAD: tl.constexpr, AKK_PREC: tl.constexpr,
             AQK_PREC: tl.constexpr, BC: tl.constexpr):
    """This slice's share of the diagonal block: factored while the block's spread fits fp32 (K3's
    gate, g > -5, always does), exact pairwise decays one key at a time otherwise."""
    rb = tl.arange(0, BC)
    spread = -tl.min(tl.min(Gw, axis=1), axis=0)
    if spread <= SPREAD:
        right = tl.trans(kb * tl.exp(-Gw))  # <= e^SPREAD
        acc_k += tl.dot(a_k, right, input_precision=AKK_PREC)
        acc_q += tl.dot(a_q, right, input_precision=AQK_PREC)
    else:
        for cc in range(BC):
            k_c = _row_of(kb, cc, BC)
            G_c = _row_of(Gw, cc, BC)
            ke = k_c[None, :] * tl.exp(tl.where(rb[:, None] >= cc, Gw - G_c[None, :], float("-inf")))
            acc_k += tl.where(rb[None, :] == cc, tl.sum(kb * ke, axis=1)[:, None], 0.0)
            acc_q += tl.where(rb[None, :] == cc, tl.sum(qb * ke, axis=1)[:, None], 0.0)
    return acc_k, acc_q


@triton.jit
def _sp_pair(acc_k, acc_q, a_k, a_q, scl, c_j, AKK_PREC: tl.constexpr, AQK_PREC: tl.constexpr):
    """Row block I against an earlier column block J: a = x e^(G - P_I), scl = e^(P_I - E_J),
    c_j = k e^(E_J - G_j), all <= 1."""
    ct = tl.trans(c_j)
    acc_k += tl.dot(a_k * scl[None, :], ct, input_precision=AKK_PREC)
    acc_q += tl.dot(a_q * scl[None, :], ct, input_precision=AQK_PREC)
    return acc_k, acc_q


@triton.jit
def _sp_rows_out(qg_out, w_out, a_q, a_k, P, bt, scale, out, col, BI: tl.constexpr, K: tl.constexpr,
                 C: tl.constexpr, BC: tl.constexpr):
    """Qg = scale q e^G and W's right factor beta k e^G for block I's rows of this slice."""
    rb = tl.arange(0, BC)
    eP = tl.exp(P)[None, :]
    tile = out * C * K + (BI * BC + rb)[:, None] * K + col[None, :]
    tl.store(qg_out + tile, (a_q * eP * scale).to(qg_out.dtype.element_ty))
    tl.store(w_out + tile, (a_k * eP * bt[:, None]).to(w_out.dtype.element_ty))


@triton.jit
def _sp_kdt(kdt_out, c_j, fac, out, col, J: tl.constexpr, K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    rb = tl.arange(0, BC)
    x = tl.trans(c_j * fac[None, :])
    tl.store(kdt_out + out * K * C + col[:, None] * C + (J * BC + rb)[None, :], x.to(kdt_out.dtype.element_ty))


@triton.jit
def _sp_store_aqk(aqk_base, x, BI: tl.constexpr, BJ: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    rb = tl.arange(0, BC)
    tl.store(aqk_base + (BI * BC + rb)[:, None] * C + BJ * BC + rb[None, :], x.to(aqk_base.dtype.element_ty))


@triton.jit
def _sp_cfactor(k, g, tok0, L, h, H, col, P, BJ: tl.constexpr, K: tl.constexpr, BC: tl.constexpr):
    """Block BJ of this key slice: c = k e^(E - G) (<= 1) and E, the cumulative log-decay at the
    block's last row, given P, the one before its first row."""
    rb = tl.arange(0, BC)
    rows = BJ * BC + rb
    m = (rows < L)[:, None]
    off = ((tok0 + rows) * H + h)[:, None] * K + col[None, :]
    kb = tl.load(k + off, mask=m, other=0.0).to(tl.float32)
    gb = tl.load(g + off, mask=m, other=0.0).to(tl.float32)
    Gw = tl.cumsum(gb, axis=0)
    Eb = tl.sum(gb, axis=0)
    return kb * tl.exp(Eb[None, :] - Gw), P + Eb


@triton.jit
def _sp_rowblock(
    q,
    k,
    g,
    beta,
    tok0,
    L,
    h,
    H,
    out,
    scale,
    qg_out,
    w_out,
    kdt_out,
    d_out,
    aqk_base,
    r_base,
    BI: tl.constexpr,
    K: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    SPREAD: tl.constexpr,
    AKK_PREC: tl.constexpr,
    AQK_PREC: tl.constexpr,
):
    """Row block BI of Akk and Aqk (blocks J <= BI), and its rows of Qg and W's right factor; the
    last row block also writes Kd^T and d for the whole chunk."""
    rb = tl.arange(0, BC)
    rs = tl.arange(0, BK)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    akd, aqd, ak0, aq0, ak1, aq1, ak2, aq2 = z, z, z, z, z, z, z, z
    rows = BI * BC + rb
    bt = tl.load(beta + (tok0 + rows) * H + h, mask=rows < L, other=0.0)
    for s in range(K // BK):
        col = s * BK + rs
        P = tl.zeros([BK], dtype=tl.float32)
        c0 = tl.zeros([BC, BK], dtype=tl.float32)
        c1 = c0
        c2 = c0
        E0 = P
        E1 = P
        E2 = P
        if BI >= 1:
            c0, E0 = _sp_cfactor(k, g, tok0, L, h, H, col, P, 0, K, BC)
            P = E0
        if BI >= 2:
            c1, E1 = _sp_cfactor(k, g, tok0, L, h, H, col, P, 1, K, BC)
            P = E1
        if BI >= 3:
            c2, E2 = _sp_cfactor(k, g, tok0, L, h, H, col, P, 2, K, BC)
            P = E2
        kb, qb, gb = _sp_load(q, k, g, beta, tok0, L, h, H, col, BI, K, BC)
        Gw = tl.cumsum(gb, axis=0)
        e_in = tl.exp(Gw)
        a_k = kb * e_in
        a_q = qb * e_in
        akd, aqd = _sp_diag(akd, aqd, kb, qb, a_k, a_q, Gw, SPREAD, AKK_PREC, AQK_PREC, BC)
        if BI >= 1:
            ak0, aq0 = _sp_pair(ak0, aq0, a_k, a_q, tl.exp(P - E0), c0, AKK_PREC, AQK_PREC)
        if BI >= 2:
            ak1, aq1 = _sp_pair(ak1, aq1, a_k, a_q, tl.exp(P - E1), c1, AKK_PREC, AQK_PREC)
        if BI >= 3:
            ak2, aq2 = _sp_pair(ak2, aq2, a_k, a_q, tl.exp(P - E2), c2, AKK_PREC, AQK_PREC)
        _sp_rows_out(qg_out, w_out, a_q, a_k, P, bt, scale, out, col, BI, K, C, BC)
        if BI == 3:  # Kd^T = (k e^(G_last - G))^T, G_last = E3; d = e^(G_last)
            Eb = tl.sum(gb, axis=0)
            E3 = P + Eb
            _sp_kdt(kdt_out, c0, tl.exp(E3 - E0), out, col, 0, K, C, BC)
            _sp_kdt(kdt_out, c1, tl.exp(E3 - E1), out, col, 1, K, C, BC)
            _sp_kdt(kdt_out, c2, tl.exp(E3 - E2), out, col, 2, K, C, BC)
            _sp_kdt(kdt_out, kb * tl.exp(Eb[None, :] - Gw), tl.full([BK], 1.0, tl.float32), out, col, 3, K, C, BC)
            tl.store(d_out + out * K + col, tl.exp(E3))
    # Akk: strictly lower on the diagonal, rows x beta (fp32, for the inverse); Aqk: lower x scale
    _sp_store_aqk(aqk_base, tl.where(rb[:, None] >= rb[None, :], aqd * scale, 0.0), BI, BI, C, BC)
    _blk_store(r_base, BI, BI, tl.where(rb[:, None] > rb[None, :], akd * bt[:, None], 0.0), C, BC)
    if BI >= 1:
        _sp_store_aqk(aqk_base, aq0 * scale, BI, 0, C, BC)
        _blk_store(r_base, BI, 0, ak0 * bt[:, None], C, BC)
    if BI >= 2:
        _sp_store_aqk(aqk_base, aq1 * scale, BI, 1, C, BC)
        _blk_store(r_base, BI, 1, ak1 * bt[:, None], C, BC)
    if BI >= 3:
        _sp_store_aqk(aqk_base, aq2 * scale, BI, 2, C, BC)
        _blk_store(r_base, BI, 2, ak2 * bt[:, None], C, BC)
    if BI <= 2:
        _sp_store_aqk(aqk_base, z, BI, 3, C, BC)
    if BI <= 1:
        _sp_store_aqk(aqk_base, z, BI, 2, C, BC)
    if BI == 0:
        _sp_store_aqk(aqk_base, z, BI, 1, C, BC)


@triton.jit(do_not_specialize=["H"])
def _split_a_kernel(
    q,
    k,
    g,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    qg_out,
    kdt_out,
    aqk_out,
    d_out,
    r_buf,
    H,
    scale,
    K: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    SPREAD: tl.constexpr,
    AKK_PREC: tl.constexpr,
    AQK_PREC: tl.constexpr,
    PER_BLOCK: tl.constexpr,
):
    """Launch 1 of the split prologue. PER_BLOCK: grid (chunks, heads, 4), one row block per
    program; else grid (chunks, heads) and the four row blocks one after another."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok0 = tl.load(chunk_tok + c).to(tl.int64)
    L = tl.load(chunk_len + c)
    out = c * H + h
    aqk_base = aqk_out + out * C * C
    r_base = r_buf + out * C * C
    # the row block is a compile-time argument of _sp_rowblock: one unrolled call per block
    if PER_BLOCK:
        bi = tl.program_id(2)
        for b in tl.static_range(C // BC):
            if bi == b:
                _sp_rowblock(
                    q, k, g, beta, tok0, L, h, H, out, scale, qg_out, w_out, kdt_out, d_out, aqk_base, r_base,
                    b, K, C, BC, BK, SPREAD, AKK_PREC, AQK_PREC,
                )  # fmt: skip
    else:
        for b in tl.static_range(C // BC):
            _sp_rowblock(
                q, k, g, beta, tok0, L, h, H, out, scale, qg_out, w_out, kdt_out, d_out, aqk_base, r_base,
                b, K, C, BC, BK, SPREAD, AKK_PREC, AQK_PREC,
            )  # fmt: skip


@triton.jit
def _split_inverse_kernel(r_buf, C: tl.constexpr, BC: tl.constexpr, INV_PREC: tl.constexpr):
    """Launch 2: R = (I + Akk)^-1 in fp32, in place, one program per (chunk, head)."""
    _inverse_in_place(r_buf + tl.program_id(0).to(tl.int64) * C * C, C, BC, INV_PREC)


@triton.jit(do_not_specialize=["H"])
def _inv_wu_kernel(
    v,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    u_out,
    r_buf,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    INV_PREC: tl.constexpr,
    OUT_PREC: tl.constexpr,
):
    """Launches 2 and 3 in one (option inv_wu): the fp32 inverse in place, then W and U from it in the
    same program, so R is read back from L1 / L2 instead of a second launch's reads."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok0 = tl.load(chunk_tok + c).to(tl.int64)
    L = tl.load(chunk_len + c)
    out = c * H + h
    r_base = r_buf + out * C * C
    _inverse_in_place(r_base, C, BC, INV_PREC)
    tl.debug_barrier()  # R is written by the whole program before W / U read it
    _wu_chunk(v, beta, tok0, L, h, H, out, w_out, u_out, r_base, K, V, C, BC, BK, OUT_PREC)


@triton.jit(do_not_specialize=["H"])
def _split_wu_kernel(
    v,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    u_out,
    r_buf,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    OUT_PREC: tl.constexpr,
):
    """Launch 3: W = R (beta K e^G) in place over its right factor, U = R (beta V)."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok0 = tl.load(chunk_tok + c).to(tl.int64)
    L = tl.load(chunk_len + c)
    out = c * H + h
    _wu_chunk(v, beta, tok0, L, h, H, out, w_out, u_out, r_buf + out * C * C, K, V, C, BC, BK, OUT_PREC)


# ----------------------------------------------------------------------------------------------
# prologue, 'rows' / 'fused' forms: one program per (chunk, head) holds a slice of BK key channels
# of the whole chunk as [4 blocks, 16 rows, BK] (the decays are per channel; only the dots sum over
# channels, so the slices accumulate). In that shape every per-block quantity is a broadcast:
#   Gw = within-block cumulative log-decay, bs = block sums, E = cumsum(bs) (G at each block's last
#   row), P = E - bs (G before its first row). For row block I and column block J:
#   e^(G_i - G_j) = e^(G_i - P_I) e^(P_I - E_J) e^(E_J - G_j), left factor <= 1, the middle one <= 1
#   below the diagonal and e^(-bs_I) (<= e^SAFE_SPREAD, else an exact path) on it, c = k e^(E_J - G)
#   <= 1. The four row blocks are one batched dot against c scaled by the [4, 4] middle factors.
#   Akk goes to the fp32 R buffer; the inverse stays fp32, and only the finished R is rounded to the
#   input dtype for W and U. 'rows' stops there and runs split's inverse and W / U launches;
#   'fused' does them in the same program (slower on the H200: 712 against 544 us, see the README).


@triton.jit
def _exp(x, FAST: tl.constexpr):
    """e^x. FAST (compiled for NVIDIA): one ex2.approx.ftz, without the subnormal fix-up sequence
    plain tl.exp compiles to (results below 2^-126 flush to 0: a factor that small adds nothing to
    a sum of factors <= 1). Else tl.exp (the interpreter, other backends)."""
    if FAST:
        y = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x * 1.4426950408889634], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _fz3_a_phase(q, k, g, beta, tok0, L, h, H, out, scale, qg_out, w_out, kdt_out, d_out, aqk_base, r_base,
                 K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, SPREAD: tl.constexpr,
                 AKK_PREC: tl.constexpr, AQK_PREC: tl.constexpr, FAST: tl.constexpr, EXACT: tl.constexpr = True):
    """Akk (fp32, R buffer), Aqk, Qg, W's right factor (in W's buffer), Kd^T and d of one chunk, one
    slice of BK key channels at a time (decays are per channel; only the dots sum over them), with
    the chunk held as [4 blocks, 16 rows, BK] so that every per-block factor is a broadcast.
    Returns 1 if a block's decay spread exceeds SPREAD (else 0). EXACT: such blocks take the exact
    path here; without it their diagonal blocks are left out and the caller must redo the chunk."""
    NB: tl.constexpr = C // BC
    ib = tl.arange(0, NB)
    rb = tl.arange(0, BC)
    rs = tl.arange(0, BK)
    rc = tl.arange(0, C)
    b3 = ib[:, None, None]
    r3 = rb[None, :, None]
    rows3 = b3 * BC + r3  # [NB, BC, 1]
    m3 = rows3 < L
    tok3 = ((tok0 + rows3) * H + h) * K
    bt3 = tl.load(beta + (tok0 + rows3) * H + h, mask=m3, other=0.0)  # [NB, BC, 1]
    acc_k = tl.zeros([NB, BC, C], dtype=tl.float32)
    acc_q = tl.zeros([NB, BC, C], dtype=tl.float32)
    # F[I, J] = e^(P_I - E_J): I row block, J column block (broadcast shapes [NB, NB, 1, BK])
    I4 = tl.arange(0, NB)[:, None, None, None]
    J4 = tl.arange(0, NB)[None, :, None, None]
    wide = 0
    for s in tl.static_range(K // BK):
        col3 = (s * BK + rs)[None, None, :]
        off = tok3 + col3
        g3 = tl.load(g + off, mask=m3, other=0.0)
        k3 = tl.load(k + off, mask=m3, other=0.0).to(tl.float32)
        q3 = tl.load(q + off, mask=m3, other=0.0).to(tl.float32)
        Gw = tl.cumsum(g3, axis=1)  # G - P_b within each block, <= 0
        bs = tl.sum(g3, axis=1)  # [NB, BK] block decay sums
        E = tl.cumsum(bs, axis=0)  # cumulative log-decay at each block's last row
        P = E - bs  # ... and before its first row
        e_in = _exp(Gw, FAST)
        c3 = k3 * _exp(bs[:, None, :] - Gw, FAST)  # k e^(E_J - G) <= 1
        e_g = e_in * _exp(P, FAST)[:, None, :]  # e^G
        tl.store(qg_out + out * C * K + rows3 * K + col3, (q3 * e_g * scale).to(qg_out.dtype.element_ty))
        tl.store(w_out + out * C * K + rows3 * K + col3, (k3 * e_g * bt3).to(w_out.dtype.element_ty))
        E_last = tl.sum(bs, axis=0)  # [BK]
        kd = c3 * _exp(E_last[None, :] - E, FAST)[:, None, :]  # k e^(G_last - G)
        tl.store(kdt_out + out * K * C + col3 * C + rows3, kd.to(kdt_out.dtype.element_ty))
        tl.store(d_out + out * K + s * BK + rs, _exp(E_last, FAST))
        # right operand of row block I: c scaled per column block by F[I, J]; the diagonal factor
        # e^(-bs_I) is the only one > 1 (a block wider than SPREAD takes the exact path below)
        spread = tl.max(-bs, axis=1)  # [NB]
        P4 = P[:, None, None, :]
        E4 = E[None, :, None, :]
        bs4 = bs[:, None, None, :]
        narrow4 = spread[:, None, None, None] <= SPREAD
        arg = tl.where(J4 < I4, P4 - E4, tl.where((J4 == I4) & narrow4, tl.minimum(-bs4, SPREAD), float("-inf")))
        F = _exp(arg, FAST)  # [NB, NB, 1, BK]
        right = tl.reshape(c3[None, :, :, :] * F, [NB, C, BK])
        rt = tl.permute(right, (0, 2, 1))
        acc_k = tl.dot(k3 * e_in, rt, acc_k, input_precision=AKK_PREC)
        acc_q = tl.dot(q3 * e_in, rt, acc_q, input_precision=AQK_PREC)
        if EXACT:
            if tl.max(spread, axis=0) > SPREAD:  # wide decay inside a block: exact pairwise decays
                acc_k, acc_q = _fz3_exact_diag(acc_k, acc_q, k3, q3, Gw, spread, SPREAD, NB, BC, C)
        else:
            wide = tl.maximum(wide, (tl.max(spread, axis=0) > SPREAD).to(tl.int32))
    rows = b3 * BC + r3
    col = rc[None, None, :]
    tile = rows * C + col
    tl.store(r_base + tile, tl.where(col < rows, acc_k * bt3, 0.0))
    tl.store(aqk_base + tile, tl.where(col <= rows, acc_q * scale, 0.0).to(aqk_base.dtype.element_ty))
    return wide


@triton.jit
def _fz3_exact_diag(acc_k, acc_q, k3, q3, Gw, spread, SPREAD: tl.constexpr, NB: tl.constexpr, BC: tl.constexpr,
                    C: tl.constexpr):
    """The diagonal blocks whose decay spreads beyond SPREAD, one key row at a time with exact
    pairwise decays e^(G_i - G_j) <= 1 (slow; never taken for K3's gate)."""
    ib = tl.arange(0, NB)
    rb = tl.arange(0, BC)
    rc = tl.arange(0, C)
    wide = (spread > SPREAD)[:, None, None]  # [NB, 1, 1]
    r3 = rb[None, :, None]
    for cc in range(BC):
        sel = r3 == cc
        k_c = tl.sum(tl.where(sel, k3, 0.0), axis=1)  # [NB, BK]: row cc of every block
        G_c = tl.sum(tl.where(sel, Gw, 0.0), axis=1)
        ke = k_c[:, None, :] * tl.exp(tl.where(r3 >= cc, Gw - G_c[:, None, :], float("-inf")))
        hit = wide & (rc[None, None, :] == ib[:, None, None] * BC + cc)
        acc_k = tl.where(hit, acc_k + tl.sum(k3 * ke, axis=2)[:, :, None], acc_k)
        acc_q = tl.where(hit, acc_q + tl.sum(q3 * ke, axis=2)[:, :, None], acc_q)
    return acc_k, acc_q


@triton.jit
def _inverse_in_place(r_base, C: tl.constexpr, BC: tl.constexpr, INV_PREC: tl.constexpr):
    """R = (I + Akk)^-1 in fp32, in place: the four diagonal blocks side by side ([4, 16, 16]) by
    forward substitution (row i of every block read back, one reduction per row), then
    R_IJ = -R_II sum_{J <= M < I} L_IM R_MJ."""
    NB: tl.constexpr = C // BC
    rb = tl.arange(0, BC)
    b3 = tl.arange(0, NB)[:, None, None]
    m3 = rb[None, :, None]
    j3 = rb[None, None, :]
    X = tl.zeros([NB, BC, BC], dtype=tl.float32)  # R_bb - I, filled row by row
    for i in range(1, BC):
        row = r_base + (b3 * BC + i) * C + b3 * BC
        a_m = -tl.load(row + m3)  # [NB, BC, 1]: row i of -L_bb, along the summed index
        a_j = -tl.load(row + j3)  # [NB, 1, BC]: the same row along the output index
        x = a_j + tl.sum(a_m * X, axis=1, keep_dims=True)
        X = tl.where(m3 == i, x, X)
    R3 = X + tl.where(m3 == j3, 1.0, 0.0)
    diag = (b3 * BC + m3) * C + b3 * BC + j3
    r00 = _diag_block(R3, 0, NB)
    r11 = _diag_block(R3, 1, NB)
    r22 = _diag_block(R3, 2, NB)
    r33 = _diag_block(R3, 3, NB)
    r10, r21, r32, r20, r31, r30 = _inverse_below_diagonal(r_base, r00, r11, r22, r33, C, BC, INV_PREC)
    tl.debug_barrier()  # every thread has read Akk before R overwrites it
    tl.store(r_base + diag, R3)
    _blk_store(r_base, 1, 0, r10, C, BC)
    _blk_store(r_base, 2, 1, r21, C, BC)
    _blk_store(r_base, 3, 2, r32, C, BC)
    _blk_store(r_base, 2, 0, r20, C, BC)
    _blk_store(r_base, 3, 1, r31, C, BC)
    _blk_store(r_base, 3, 0, r30, C, BC)


@triton.jit
def _diag_block(R3, b: tl.constexpr, NB: tl.constexpr):
    """Block b of a [NB, BC, BC] stack as a [BC, BC] tile (exact: one nonzero term per entry)."""
    return tl.sum(tl.where(tl.arange(0, NB)[:, None, None] == b, R3, 0.0), axis=0)


@triton.jit
def _wu_chunk(v, beta, tok0, L, h, H, out, w_out, u_out, r_base, K: tl.constexpr, V: tl.constexpr,
              C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, OUT_PREC: tl.constexpr):
    """W = R (beta K e^G) in place over its right factor, U = R (beta V), R rounded to the input
    dtype only here (the seed's rule)."""
    rc = tl.arange(0, C)
    rs = tl.arange(0, BK)
    INTER = w_out.dtype.element_ty
    rmask = rc < L
    R = tl.load(
        r_base + rc[:, None] * C + rc[None, :], mask=(rc[:, None] // BC) >= (rc[None, :] // BC), other=0.0
    ).to(INTER)
    bt = tl.load(beta + (tok0 + rc) * H + h, mask=rmask, other=0.0)
    for s in tl.static_range(K // BK):
        tile = out * C * K + rc[:, None] * K + s * BK + rs[None, :]
        tl.store(w_out + tile, tl.dot(R, tl.load(w_out + tile), input_precision=OUT_PREC).to(INTER))
    for s in tl.static_range(V // BK):
        col = s * BK + rs
        vs = tl.load(v + ((tok0 + rc) * H + h)[:, None] * V + col[None, :], mask=rmask[:, None], other=0.0)
        vb = (vs.to(tl.float32) * bt[:, None]).to(INTER)
        tl.store(
            u_out + out * C * V + rc[:, None] * V + col[None, :], tl.dot(R, vb, input_precision=OUT_PREC).to(INTER)
        )


@triton.jit(do_not_specialize=["H"])
def _fused_prologue_kernel(
    q,
    k,
    v,
    g,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    u_out,
    qg_out,
    kdt_out,
    aqk_out,
    d_out,
    r_buf,
    flags,
    H,
    scale,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    A_BK: tl.constexpr,
    SPREAD: tl.constexpr,
    AKK_PREC: tl.constexpr,
    AQK_PREC: tl.constexpr,
    INV_PREC: tl.constexpr,
    OUT_PREC: tl.constexpr,
    FUSE: tl.constexpr,
    FAST: tl.constexpr,
    EXACT_MODE: tl.constexpr = 0,
):
    """The 'fused' prologue, one program per (chunk, head). FUSE=False stops after the A's (the
    'rows' prologue: the split form's inverse and W / U launches follow).
    EXACT_MODE (rows): 0 = the exact path for wide decays compiled in; 1 = left out (a smaller kernel),
    each item's 'needs the exact path' flag written to `flags`; 2 = the fix-up launch after it: only
    flagged items run, with the exact path (the others read one flag and stop)."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    out = c * H + h
    run = True
    if EXACT_MODE == 2:
        run = tl.load(flags + out) != 0
    if run:
        tok0 = tl.load(chunk_tok + c).to(tl.int64)
        L = tl.load(chunk_len + c)
        r_base = r_buf + out * C * C
        wide = _fz3_a_phase(q, k, g, beta, tok0, L, h, H, out, scale, qg_out, w_out, kdt_out, d_out,
                            aqk_out + out * C * C, r_base, K, C, BC, A_BK, SPREAD, AKK_PREC, AQK_PREC, FAST,
                            EXACT_MODE != 1)  # fmt: skip
        if EXACT_MODE == 1:
            tl.store(flags + out, wide)
        if FUSE:
            tl.debug_barrier()  # Akk and W's right factor are written by the whole program
            _inverse_in_place(r_base, C, BC, INV_PREC)
            tl.debug_barrier()
            _wu_chunk(v, beta, tok0, L, h, H, out, w_out, u_out, r_base, K, V, C, BC, BK, OUT_PREC)


# ----------------------------------------------------------------------------------------------
# prologue, 'flat' form: the A launch on 2-D [64 rows, BK channels] matrix products.
# Same factoring as 'rows' (every per-block quantity a broadcast of the [4 blocks, 16 rows, BK]
# view), but the four row blocks are not a batched 16-row product: row block I is one [64 x BK] @
# [BK x 64] product whose left operand keeps only block I's rows (the others are zero) and whose right
# operand is c scaled by F[I, J]. Four products of 64 rows do 4x the useful multiply-adds, but 64-row
# products are what Hopper's warpgroup instructions (wgmma) take: asynchronous, operands staged once
# in shared memory, no per-block layout shuffles. Aqk's operands may be bf16 (fp32 accumulation, as
# fla does: aqk='bf16'); Akk's stay tf32-or-better, because the fp32 inverse needs fp32-class inputs.
# The next slice's loads are issued before the current slice is computed (registers double-buffered).


@triton.jit
def _flat_load(q, k, g, tok3, m3, col3, PART: tl.constexpr):
    off = tok3 + col3
    g3 = tl.load(g + off, mask=m3, other=0.0)
    k3 = tl.load(k + off, mask=m3, other=0.0)
    if PART != 1:
        q3 = tl.load(q + off, mask=m3, other=0.0)
    else:
        q3 = k3
    return g3, k3, q3


@triton.jit(do_not_specialize=["H"])
def _flat_a_kernel(
    q,
    k,
    g,
    beta,
    chunk_tok,
    chunk_len,
    w_out,
    qg_out,
    kdt_out,
    aqk_out,
    d_out,
    r_buf,
    H,
    scale,
    K: tl.constexpr,
    C: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    SPREAD: tl.constexpr,
    AKK_PREC: tl.constexpr,
    AQK_PREC: tl.constexpr,
    AQK_BF16: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT3: tl.constexpr,
    SPLIT: tl.constexpr,
    FAST: tl.constexpr,
):
    """Akk (fp32, into the R buffer), Aqk, Qg, W's right factor, Kd^T and d of one (chunk, head).
    SPLIT: two programs per item (grid axis 2), one for Akk, W's right factor, Kd^T and d, one for
    Aqk and Qg, each with a single accumulator (fewer registers, more programs per SM)."""
    args = (q, k, g, beta, chunk_tok, chunk_len, w_out, qg_out, kdt_out, aqk_out, d_out, r_buf, H, scale)
    if SPLIT:
        if tl.program_id(2) == 0:
            _flat_a_item(*args, K, C, BC, BK, SPREAD, AKK_PREC, AQK_PREC, AQK_BF16, PREFETCH, DOT3, 1, FAST)
        else:
            _flat_a_item(*args, K, C, BC, BK, SPREAD, AKK_PREC, AQK_PREC, AQK_BF16, PREFETCH, DOT3, 2, FAST)
    else:
        _flat_a_item(*args, K, C, BC, BK, SPREAD, AKK_PREC, AQK_PREC, AQK_BF16, PREFETCH, DOT3, 0, FAST)


@triton.jit
def _flat_dot(acc, left3, c3, F, b3, I4, AQK_BF16: tl.constexpr, PREC: tl.constexpr, DOT3: tl.constexpr,
              NB: tl.constexpr, BC: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """acc += left (row block I) . (c scaled by F[I, J])^T for every row block I."""
    if DOT3:
        rt = tl.permute(tl.reshape(c3[None, :, :, :] * F, [NB, C, BK]), (0, 2, 1))
        if AQK_BF16:
            acc = tl.dot(left3.to(tl.bfloat16), rt.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(left3, rt, acc, input_precision=PREC)
    else:
        for bi in tl.static_range(NB):
            fI = tl.sum(tl.where(I4 == bi, F, 0.0), axis=0)  # [NB (J), 1, BK]
            rt = tl.trans(tl.reshape(c3 * fI, [C, BK]))  # [BK, C]
            lft = tl.reshape(tl.where(b3 == bi, left3, 0.0), [C, BK])
            if AQK_BF16:
                acc = tl.dot(lft.to(tl.bfloat16), rt.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(lft, rt, acc, input_precision=PREC)
    return acc


@triton.jit
def _flat_a_item(q, k, g, beta, chunk_tok, chunk_len, w_out, qg_out, kdt_out, aqk_out, d_out, r_buf, H, scale,
                 K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, SPREAD: tl.constexpr,
                 AKK_PREC: tl.constexpr, AQK_PREC: tl.constexpr, AQK_BF16: tl.constexpr, PREFETCH: tl.constexpr,
                 DOT3: tl.constexpr, PART: tl.constexpr, FAST: tl.constexpr):
    """PART 0: every output; 1: Akk, W's right factor, Kd^T, d; 2: Aqk, Qg."""
    NB: tl.constexpr = C // BC
    NS: tl.constexpr = K // BK
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok0 = tl.load(chunk_tok + c).to(tl.int64)
    L = tl.load(chunk_len + c)
    out = c * H + h
    ib = tl.arange(0, NB)
    rb = tl.arange(0, BC)
    rs = tl.arange(0, BK)
    rc = tl.arange(0, C)
    b3 = ib[:, None, None]
    r3 = rb[None, :, None]
    rows3 = b3 * BC + r3  # [NB, BC, 1]
    m3 = rows3 < L
    tok3 = ((tok0 + rows3) * H + h) * K
    bt3 = tl.load(beta + (tok0 + rows3) * H + h, mask=m3, other=0.0)
    I4 = tl.arange(0, NB)[:, None, None, None]
    J4 = tl.arange(0, NB)[None, :, None, None]
    if DOT3:
        acc_k = tl.zeros([NB, BC, C], dtype=tl.float32)
    else:
        acc_k = tl.zeros([C, C], dtype=tl.float32)
    acc_q = acc_k
    g3, k3, q3 = _flat_load(q, k, g, tok3, m3, rs[None, None, :], PART)
    for s in tl.static_range(NS):
        col3 = (s * BK + rs)[None, None, :]
        if PREFETCH:  # the next slice's loads go out before this slice's arithmetic
            g3n, k3n, q3n = _flat_load(q, k, g, tok3, m3, (min(s + 1, NS - 1) * BK + rs)[None, None, :], PART)
        kf = k3.to(tl.float32)
        Gw = tl.cumsum(g3, axis=1)  # G - P_b within each block, <= 0
        bs = tl.sum(g3, axis=1)  # [NB, BK]
        E = tl.cumsum(bs, axis=0)  # G at each block's last row
        P = E - bs  # ... and before its first row
        e_in = _exp(Gw, FAST)
        c3 = kf * _exp(bs[:, None, :] - Gw, FAST)  # k e^(E_J - G) <= 1
        if PART != 1:
            qf = q3.to(tl.float32)
            e_g = e_in * _exp(P, FAST)[:, None, :]
            tl.store(qg_out + out * C * K + rows3 * K + col3, (qf * e_g * scale).to(qg_out.dtype.element_ty))
        else:
            qf = kf
        if PART != 2:
            e_g = e_in * _exp(P, FAST)[:, None, :]
            tl.store(w_out + out * C * K + rows3 * K + col3, (kf * e_g * bt3).to(w_out.dtype.element_ty))
            E_last = tl.sum(bs, axis=0)
            kd = c3 * _exp(E_last[None, :] - E, FAST)[:, None, :]
            tl.store(kdt_out + out * K * C + col3 * C + rows3, kd.to(kdt_out.dtype.element_ty))
            tl.store(d_out + out * K + s * BK + rs, _exp(E_last, FAST))
        spread = tl.max(-bs, axis=1)  # [NB]
        narrow4 = spread[:, None, None, None] <= SPREAD
        arg = tl.where(
            J4 < I4,
            P[:, None, None, :] - E[None, :, None, :],
            tl.where((J4 == I4) & narrow4, tl.minimum(-bs[:, None, None, :], SPREAD), float("-inf")),
        )
        F = _exp(arg, FAST)  # [NB (I), NB (J), 1, BK]
        if PART != 2:
            acc_k = _flat_dot(acc_k, kf * e_in, c3, F, b3, I4, False, AKK_PREC, DOT3, NB, BC, C, BK)
        if PART != 1:
            acc_q = _flat_dot(acc_q, qf * e_in, c3, F, b3, I4, AQK_BF16, AQK_PREC, DOT3, NB, BC, C, BK)
        if tl.max(spread, axis=0) > SPREAD:  # wide decay inside a block: exact pairwise decays
            if DOT3:
                acc_k, acc_q = _fz3_exact_diag(acc_k, acc_q, kf, qf, Gw, spread, SPREAD, NB, BC, C)
            else:
                ak3, aq3 = _fz3_exact_diag(tl.reshape(acc_k, [NB, BC, C]), tl.reshape(acc_q, [NB, BC, C]), kf, qf,
                                           Gw, spread, SPREAD, NB, BC, C)  # fmt: skip
                acc_k = tl.reshape(ak3, [C, C])
                acc_q = tl.reshape(aq3, [C, C])
        if PREFETCH:
            g3, k3, q3 = g3n, k3n, q3n
        else:
            g3, k3, q3 = _flat_load(q, k, g, tok3, m3, (min(s + 1, NS - 1) * BK + rs)[None, None, :], PART)
    if DOT3:
        row = rows3
        col = rc[None, None, :]
        bt = bt3
    else:
        row = rc[:, None]
        col = rc[None, :]
        bt = tl.load(beta + (tok0 + rc) * H + h, mask=rc < L, other=0.0)[:, None]
    tile = out * C * C + row * C + col
    if PART != 2:
        tl.store(r_buf + tile, tl.where(col < row, acc_k * bt, 0.0))
    if PART != 1:
        tl.store(aqk_out + tile, tl.where(col <= row, acc_q * scale, 0.0).to(aqk_out.dtype.element_ty))

@triton.jit
def _blk(base, BI: tl.constexpr, BJ: tl.constexpr, C: tl.constexpr, BC: tl.constexpr):
    r = tl.arange(0, BC)
    return tl.load(base + (BI * BC + r)[:, None] * C + BJ * BC + r[None, :])


@triton.jit
def _blk_store(base, BI: tl.constexpr, BJ: tl.constexpr, x, C: tl.constexpr, BC: tl.constexpr):
    r = tl.arange(0, BC)
    tl.store(base + (BI * BC + r)[:, None] * C + BJ * BC + r[None, :], x)


@triton.jit
def _inverse_below_diagonal(l_base, r00, r11, r22, r33, C: tl.constexpr, BC: tl.constexpr, INV_PREC: tl.constexpr):
    """The six blocks of R = (I + L)^-1 below its diagonal from the four inverted diagonal blocks:
    R_IJ = -R_II sum_{J <= M < I} L_IM R_MJ (fp32 products); l_base holds L's off-diagonal blocks."""
    l10 = _blk(l_base, 1, 0, C, BC)
    l21 = _blk(l_base, 2, 1, C, BC)
    l32 = _blk(l_base, 3, 2, C, BC)
    l20 = _blk(l_base, 2, 0, C, BC)
    l31 = _blk(l_base, 3, 1, C, BC)
    l30 = _blk(l_base, 3, 0, C, BC)
    r10 = -_mm(r11, _mm(l10, r00, INV_PREC), INV_PREC)
    r21 = -_mm(r22, _mm(l21, r11, INV_PREC), INV_PREC)
    r32 = -_mm(r33, _mm(l32, r22, INV_PREC), INV_PREC)
    r20 = -_mm(r22, _mm(l20, r00, INV_PREC) + _mm(l21, r10, INV_PREC), INV_PREC)
    r31 = -_mm(r33, _mm(l31, r11, INV_PREC) + _mm(l32, r21, INV_PREC), INV_PREC)
    r30 = -_mm(r33, _mm(l30, r00, INV_PREC) + _mm(l31, r10, INV_PREC) + _mm(l32, r20, INV_PREC), INV_PREC)
    return r10, r21, r32, r20, r31, r30


@triton.jit
def _mm(a, b, PREC: tl.constexpr):
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _walk_step(
    S,
    cidx,
    h,
    w,
    u,
    qg,
    kdt,
    aqk,
    dd,
    chunk_tok,
    chunk_len,
    o,
    H,
    v0,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """One chunk: E = U - W S; O = Qg S + Aqk E (stored); returns diag(d) S + Kd^T E."""
    rc = tl.arange(0, C)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    INTER = w.dtype.element_ty
    base = cidx * H + h
    W = tl.load(w + base * C * K + rc[:, None] * K + rk[None, :])
    U = tl.load(u + base * C * V + rc[:, None] * V + v0 + rbv[None, :]).to(tl.float32)
    Qg = tl.load(qg + base * C * K + rc[:, None] * K + rk[None, :])
    KdT = tl.load(kdt + base * K * C + rk[:, None] * C + rc[None, :])
    A = tl.load(aqk + base * C * C + rc[:, None] * C + rc[None, :])
    d = tl.load(dd + base * K + rk)
    Sb = S.to(INTER)
    E = U - tl.dot(W, Sb, input_precision=PREC)
    Eb = E.to(INTER)
    out = tl.dot(Qg, Sb, input_precision=PREC) + tl.dot(A, Eb, input_precision=PREC)
    tok0 = tl.load(chunk_tok + cidx).to(tl.int64)
    L = tl.load(chunk_len + cidx)
    tl.store(
        o + ((tok0 + rc) * H + h)[:, None] * V + v0 + rbv[None, :],
        out.to(o.dtype.element_ty),
        mask=(rc < L)[:, None],
    )
    return d[:, None] * S + tl.dot(KdT, Eb, input_precision=PREC)


@triton.jit(do_not_specialize=["H"])
def _walk_kernel(
    w,
    u,
    qg,
    kdt,
    aqk,
    dd,
    chunk_tok,
    chunk_len,
    grp_chunk0,
    grp_nchunks,
    grp_seq,
    grp_sin,
    grp_last,
    s_in,
    o,
    s_final,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    HAS_SIN: tl.constexpr,
    PREC: tl.constexpr,
    WHILE: tl.constexpr,
):
    """One program per (value tile, head, group): walk the group's chunks keeping S [K, BV] on chip.
    The 'before' launches it with one group per sequence; the 'after' replay with many groups."""
    iv = tl.program_id(0)
    h = tl.program_id(1)
    gi = tl.program_id(2)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    v0 = iv * BV
    c0 = tl.load(grp_chunk0 + gi).to(tl.int64)
    nch = tl.load(grp_nchunks + gi)
    if HAS_SIN:
        sidx = tl.load(grp_sin + gi).to(tl.int64)
        S = tl.load(s_in + ((sidx * H + h) * K + rk)[:, None] * V + v0 + rbv[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if WHILE:
        t = 0
        while t < nch:
            S = _walk_step(
                S, c0 + t, h, w, u, qg, kdt, aqk, dd, chunk_tok, chunk_len, o, H, v0, K, V, C, BV, PREC
            )
            t += 1
    else:
        for t in range(nch):
            S = _walk_step(
                S, c0 + t, h, w, u, qg, kdt, aqk, dd, chunk_tok, chunk_len, o, H, v0, K, V, C, BV, PREC
            )
    if tl.load(grp_last + gi) != 0:
        n = tl.load(grp_seq + gi).to(tl.int64)
        tl.store(s_final + ((n * H + h) * K + rk)[:, None] * V + v0 + rbv[None, :], S)


@triton.jit
def _summary_step(
    X,
    Dc,
    cidx,
    h,
    w,
    u,
    kdt,
    dd,
    H,
    is_n,
    not_n,
    col0,
    vcol0,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    rc = tl.arange(0, C)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    INTER = w.dtype.element_ty
    base = cidx * H + h
    W = tl.load(w + base * C * K + rc[:, None] * K + rk[None, :])
    KdT = tl.load(kdt + base * K * C + rk[:, None] * C + rc[None, :])
    d = tl.load(dd + base * K + rk)
    # program-uniform masks instead of a branch: the loop stays one straight body the compiler can
    # software-pipeline; a masked-off load costs no memory traffic
    Wc = tl.load(w + base * C * K + rc[:, None] * K + col0 + rbv[None, :], mask=is_n, other=0.0).to(
        tl.float32
    )
    Uc = tl.load(u + base * C * V + rc[:, None] * V + vcol0 + rbv[None, :], mask=not_n, other=0.0).to(
        tl.float32
    )
    rhs = Uc - Wc * Dc[None, :]
    Dc = Dc * tl.load(dd + base * K + col0 + rbv, mask=is_n, other=1.0)
    E = rhs - tl.dot(W, X.to(INTER), input_precision=PREC)
    X = d[:, None] * X + tl.dot(KdT, E.to(INTER), input_precision=PREC)
    return X, Dc


@triton.jit(do_not_specialize=["H"])
def _summary_kernel(
    w,
    u,
    kdt,
    dd,
    grp_chunk0,
    grp_nchunks,
    sum_grp,
    sum_n,
    sum_b,
    sum_d,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    C: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    WHILE: tl.constexpr,
):
    """One program per (column tile of [N | b], head, summarised group). Tiles below K // BV build
    N (right-hand side -W diag(D so far), D tracked exactly); the others build b (right-hand side U).
    Both walk X <- diag(d) X + Kd^T (rhs - W X) from X = 0."""
    it = tl.program_id(0)
    h = tl.program_id(1)
    si = tl.program_id(2)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    gi = tl.load(sum_grp + si)
    c0 = tl.load(grp_chunk0 + gi).to(tl.int64)
    nch = tl.load(grp_nchunks + gi)
    is_n = it < K // BV
    not_n = it >= K // BV
    col0 = (it % (K // BV)) * BV  # N: columns of M (b tiles keep an in-range, masked-off offset)
    vcol0 = (it % (K // BV)) * BV  # b: value columns
    X = tl.zeros([K, BV], dtype=tl.float32)
    Dc = tl.full([BV], 1.0, dtype=tl.float32)
    if WHILE:
        t = 0
        while t < nch:
            X, Dc = _summary_step(
                X, Dc, c0 + t, h, w, u, kdt, dd, H, is_n, not_n, col0, vcol0, K, V, C, BV, PREC
            )
            t += 1
    else:
        for t in range(nch):
            X, Dc = _summary_step(
                X, Dc, c0 + t, h, w, u, kdt, dd, H, is_n, not_n, col0, vcol0, K, V, C, BV, PREC
            )
    sbase = si.to(tl.int64) * H + h
    if is_n:
        tl.store(sum_n + (sbase * K + rk)[:, None] * K + col0 + rbv[None, :], X)
        tl.store(sum_d + sbase * K + col0 + rbv, Dc)
    else:
        tl.store(sum_b + (sbase * K + rk)[:, None] * V + vcol0 + rbv[None, :], X)


@triton.jit
def _scan_step(
    S,
    gi,
    h,
    sum_n,
    sum_b,
    sum_d,
    grp_sum,
    s_in,
    H,
    v0,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """Store group gi's starting state, then apply its summary: S <- D S + N S + b."""
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    tl.store(s_in + ((gi * H + h) * K + rk)[:, None] * V + v0 + rbv[None, :], S)
    sb = tl.load(grp_sum + gi).to(tl.int64) * H + h
    D = tl.load(sum_d + sb * K + rk)
    N = tl.load(sum_n + (sb * K + rk)[:, None] * K + rk[None, :])
    b = tl.load(sum_b + (sb * K + rk)[:, None] * V + v0 + rbv[None, :])
    return D[:, None] * S + tl.dot(N, S, input_precision=PREC) + b


@triton.jit(do_not_specialize=["H"])
def _scan_kernel(
    sum_n,
    sum_b,
    sum_d,
    grp_sum,
    seq_grp0,
    seq_ngrp,
    s_init,
    s_in,
    H,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    HAS_INIT: tl.constexpr,
    PREC: tl.constexpr,
    WHILE: tl.constexpr,
):
    """One program per (value tile, head, sequence): S <- D S + N S + b over the sequence's groups,
    storing each group's starting state. The last group needs no summary (replay writes the end);
    the loop body has no branch, so the compiler may fetch the next summary early (num_stages)."""
    iv = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2).to(tl.int64)
    rk = tl.arange(0, K)
    rbv = tl.arange(0, BV)
    v0 = iv * BV
    g0 = tl.load(seq_grp0 + n).to(tl.int64)
    ng = tl.load(seq_ngrp + n)
    if HAS_INIT:
        S = tl.load(s_init + ((n * H + h) * K + rk)[:, None] * V + v0 + rbv[None, :])
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if WHILE:
        j = 0
        while j < ng - 1:
            S = _scan_step(S, g0 + j, h, sum_n, sum_b, sum_d, grp_sum, s_in, H, v0, K, V, BV, PREC)
            j += 1
    else:
        for j in range(ng - 1):
            S = _scan_step(S, g0 + j, h, sum_n, sum_b, sum_d, grp_sum, s_in, H, v0, K, V, BV, PREC)
    gl = g0 + ng - 1
    tl.store(s_in + ((gl * H + h) * K + rk)[:, None] * V + v0 + rbv[None, :], S)


# ----------------------------------------------------------------------------------------------
# plan: chunk and group tables built once on the host (no device sync in the timed call)


@dataclass
class KdaPlan:
    """Where every chunk and group lies in the packed token stream. Build with `make_plan`, reuse
    across calls with the same lengths (building needs the lengths on the host)."""

    lengths: list[int]
    heads: int
    group_size: int | None  # chunks per group; None = one group per sequence (the plain walk)
    n_chunks: int
    chunk_tok: torch.Tensor
    chunk_len: torch.Tensor
    n_groups: int
    grp_chunk0: torch.Tensor
    grp_nchunks: torch.Tensor
    grp_seq: torch.Tensor
    grp_last: torch.Tensor
    grp_sum: torch.Tensor  # summary slot of a group, -1 for a sequence's last group
    sum_grp: torch.Tensor  # group of each summary slot
    n_summaries: int
    seq_grp0: torch.Tensor
    seq_ngrp: torch.Tensor
    seq_index: torch.Tensor  # arange(N): the 'before' reads initial_state[n] for group n

    @property
    def n_seqs(self) -> int:
        return len(self.lengths)

    @property
    def uses_scan(self) -> bool:
        return self.n_summaries > 0


def make_plan(lengths, heads: int, group_size: int | None = None, device=None) -> KdaPlan:
    """Tables for sequences of `lengths` tokens (packed one after the other) and `group_size` chunks
    per group (None: the whole sequence, i.e. no scan)."""
    lengths = [int(x) for x in lengths]
    if not lengths or any(x < 0 for x in lengths):
        raise ValueError(f"lengths must be a non-empty list of non-negative ints, got {lengths[:8]}")
    if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
        raise ValueError(f"group_size must be a positive int or None, got {group_size!r}")
    chunk_tok, chunk_len = [], []
    grp_chunk0, grp_nchunks, grp_seq, grp_last, grp_sum, sum_grp = [], [], [], [], [], []
    seq_grp0, seq_ngrp = [], []
    bos = 0
    for n, length in enumerate(lengths):
        nc = -(-length // CHUNK)
        c_first = len(chunk_tok)
        for i in range(nc):
            chunk_tok.append(bos + i * CHUNK)
            chunk_len.append(min(CHUNK, length - i * CHUNK))
        gs = nc if (group_size is None or nc == 0) else min(group_size, nc)
        ng = max(1, -(-nc // gs)) if gs else 1
        seq_grp0.append(len(grp_chunk0))
        seq_ngrp.append(ng)
        for j in range(ng):
            gidx = len(grp_chunk0)
            grp_chunk0.append(c_first + j * gs)
            grp_nchunks.append(min(gs, nc - j * gs) if gs else 0)
            grp_seq.append(n)
            last = j == ng - 1
            grp_last.append(int(last))
            if last:
                grp_sum.append(-1)
            else:
                grp_sum.append(len(sum_grp))
                sum_grp.append(gidx)
        bos += length

    def it(xs):
        return torch.tensor(xs if xs else [0], dtype=torch.int32, device=device)

    return KdaPlan(
        lengths=lengths,
        heads=heads,
        group_size=group_size,
        n_chunks=len(chunk_tok),
        chunk_tok=it(chunk_tok),
        chunk_len=it(chunk_len),
        n_groups=len(grp_chunk0),
        grp_chunk0=it(grp_chunk0),
        grp_nchunks=it(grp_nchunks),
        grp_seq=it(grp_seq),
        grp_last=it(grp_last),
        grp_sum=it(grp_sum),
        sum_grp=it(sum_grp),
        n_summaries=len(sum_grp),
        seq_grp0=it(seq_grp0),
        seq_ngrp=it(seq_ngrp),
        seq_index=it(list(range(len(lengths)))),
    )


def walk_programs(n_seqs: int, heads: int, block_v: int = 64, v_dim: int = HEAD_DIM) -> int:
    """Programs the plain walk launches: one per (sequence, head, value tile)."""
    return n_seqs * heads * (v_dim // block_v)


def choose_block_v(n_seqs: int, heads: int, compute_units: int | None = None) -> int:
    """Value-tile width of the plain walk: 64 columns once that gives every compute unit a program,
    else 32 (twice the programs on an idle GPU). Measured on the H200 (profiles/nvidia-h200/kda_scan):
    with 24 programs at 64 columns (B = 1, 12 heads) 32-column tiles were 7% faster at 4K tokens
    (run 2) and the walk 18% faster at 16K (run 1); with >= 192 programs 64-column tiles were 4-8%
    faster (B = 8 or 96 heads, run 2)."""
    units = compute_units if compute_units is not None else env.detect().compute_units
    return 64 if walk_programs(n_seqs, heads, 64) >= units else 32


def choose_group_size(
    lengths,
    heads: int,
    compute_units: int | None = None,
    block_v: int = 64,
    fill: float = 2.0,
    min_group: int = 4,
    min_chunks: int = 96,
) -> int | None:
    """Chunks per group for the group scan, or None for the plain walk.

    The rule: the plain walk has P = sequences x heads x (V / block_v) programs. If P already gives
    every compute unit one program (P >= units), the GPU is busy and the scan's extra passes (a
    summary walk over K + V columns, a scan, 2 more launches) cost more than they save: plain walk.
    Otherwise split each sequence into about fill x units / P groups, so the replay has ~fill
    programs per unit, but never groups shorter than the depth-optimal sqrt(n_chunks / 2) (the
    critical path is 2 x group + n_groups chunk steps) nor than `min_group` chunks.

    `min_chunks`: a sequence shorter than this walks plainly even on an idle GPU. Measured on the
    H200 (profiles/nvidia-h200/kda_scan, 12 heads, B = 1): the scan lost 6% at 64 chunks (4K
    tokens), won 9% at 256 and 14% at 1024; the break-even lies near 90 chunks."""
    units = compute_units if compute_units is not None else env.detect().compute_units
    lengths = [int(x) for x in lengths]
    n_chunks = max((-(-x // CHUNK) for x in lengths), default=0)
    P = walk_programs(len(lengths), heads, block_v)
    if P >= units or n_chunks < max(min_chunks, 2 * min_group + 1):
        return None
    want_groups = max(1, math.ceil(fill * units / P))
    gs = max(min_group, math.ceil(math.sqrt(n_chunks / 2)), math.ceil(n_chunks / want_groups))
    return None if gs >= n_chunks else gs


# ----------------------------------------------------------------------------------------------
# entry points


def _precisions(dtype: torch.dtype) -> dict:
    """dot precisions: fp32 inputs -> exact fp32 everywhere; 16-bit inputs -> the matrix units for
    the walks and the output products, near-fp32 ('tf32x3' on NVIDIA) for Akk and the scan."""
    backend = env.detect().backend
    exact = "ieee"
    if dtype == torch.float32 or backend != "cuda":
        near = exact
        fast = exact if dtype == torch.float32 else "tf32"
    else:
        near = "tf32x3"
        fast = "tf32"
    return {
        "AKK_PREC": near,
        "AQK_PREC": fast if dtype != torch.float32 else exact,
        "INV_PREC": exact,
        "OUT_PREC": exact if dtype == torch.float32 else "tf32",
        "SCAN_PREC": near,
        "WALK_PREC": exact if dtype == torch.float32 else "tf32",
    }


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, scale):
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, T, H, K] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    B, T, H, K = q.shape
    if K != HEAD_DIM:
        raise ValueError(f"q's head dim K must be {HEAD_DIM} (the kernels hold 128-row state tiles), got {K}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != q.dtype:
            raise ValueError(
                f"{name} must have q's dtype {q.dtype}, got {getattr(t, 'dtype', type(t).__name__)}"
            )
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape != (B, T, H, HEAD_DIM):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V={HEAD_DIM}], got {tuple(v.shape)}")
    if not isinstance(g, torch.Tensor) or g.shape != q.shape or g.dtype != torch.float32:
        raise ValueError(
            f"g must be a float32 log-decay tensor of q's shape {tuple(q.shape)}, got "
            f"{getattr(g, 'dtype', None)} {tuple(getattr(g, 'shape', ()))}"
        )
    if not isinstance(beta, torch.Tensor) or beta.shape != (B, T, H) or beta.dtype != torch.float32:
        raise ValueError(
            f"beta must be a float32 tensor [B={B}, T={T}, H={H}], got "
            f"{getattr(beta, 'dtype', None)} {tuple(getattr(beta, 'shape', ()))}"
        )
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")
    if cu_seqlens is None:
        lengths = [T] * B
    else:
        if B != 1:
            raise ValueError(f"with cu_seqlens, q must be packed as B = 1, got B = {B}")
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if isinstance(cu_seqlens, torch.Tensor) and (cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point()):
            raise ValueError(
                f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens.dtype} "
                f"{tuple(cu_seqlens.shape)}"
            )
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in itertools.pairwise(cu)):
            raise ValueError(
                f"cu_seqlens must start at 0, never decrease and end at T = {T}, got "
                f"{cu[:4]}...{cu[-2:]} ({len(cu)} entries)"
            )
        lengths = [b - a for a, b in itertools.pairwise(cu)]
    N = len(lengths)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype != torch.float32:
            raise ValueError(
                f"initial_state must be a float32 tensor, got {getattr(initial_state, 'dtype', None)}"
            )
        if initial_state.shape != (N, H, HEAD_DIM, HEAD_DIM):
            raise ValueError(
                f"initial_state must be [N={N}, H={H}, {HEAD_DIM}, {HEAD_DIM}], got "
                f"{tuple(initial_state.shape)}"
            )
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    return lengths, H


@dataclass
class _Work:
    """Prologue outputs and scratch, reused between calls of the same shape (allocation is not part
    of what the study times). The scratch each prologue kind needs is allocated on its first use."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kdt: torch.Tensor
    aqk: torch.Tensor
    d: torch.Tensor
    slots: int
    scratch: torch.Tensor | None = None  # 'persistent': one [C*K + 2*C*C] fp32 slot per program
    r: torch.Tensor | None = None  # 'split': Akk, then R in place, fp32 [n, H, C, C]
    flags: torch.Tensor | None = None  # rows with exact='fixup': int32 [n, H], 1 = redo with the exact path

    def r_buffer(self) -> torch.Tensor:
        if self.r is None:
            self.r = torch.empty(*self.w.shape[:2], CHUNK, CHUNK, dtype=torch.float32, device=self.w.device)
        return self.r

    def flag_buffer(self) -> torch.Tensor:
        if self.flags is None:
            self.flags = torch.zeros(*self.w.shape[:2], dtype=torch.int32, device=self.w.device)
        return self.flags

    def scratch_slots(self) -> torch.Tensor:
        if self.scratch is None:
            per = CHUNK * HEAD_DIM + 2 * CHUNK * CHUNK
            self.scratch = torch.empty(self.slots * per, dtype=torch.float32, device=self.w.device)
        return self.scratch


def _alloc_work(n_chunks: int, H: int, dtype, device) -> _Work:
    n = max(1, n_chunks)
    C, K = CHUNK, HEAD_DIM
    info = env.detect()
    return _Work(
        w=torch.empty(n, H, C, K, dtype=dtype, device=device),
        u=torch.empty(n, H, C, K, dtype=dtype, device=device),
        qg=torch.empty(n, H, C, K, dtype=dtype, device=device),
        kdt=torch.empty(n, H, K, C, dtype=dtype, device=device),
        aqk=torch.empty(n, H, C, C, dtype=dtype, device=device),
        d=torch.empty(n, H, K, dtype=torch.float32, device=device),
        slots=max(1, min(n * H, info.compute_units * _SLOTS_PER_UNIT)),
    )


PROLOGUES = ("persistent", "split", "rows", "fused", "flat", "cuda")
DEFAULT_PROLOGUE = "rows"  # the Triton default; H200, 12 heads x 16K tokens (run 3): rows 544 us, fused 712, split 778
# 'cuda': kernels/kda_prologue.cu (k3lab.ops.kda_prologue_cuda), the whole prologue in one hand-written
# launch (tf32 mma for the A's, an exact fp32 inverse, bf16 mma for W and U). `choose_prologue` makes it
# the default where `prologue_status` allows (bf16 on an NVIDIA GPU), 'rows' elsewhere.
# each prologue kind's launch options (`options=` / `prologue_options=` override them):
#   split (run 2's default): key slice and warps of the A launch, one row block per program (else four
#     per program), warps of the inverse, slice and warps of W / U; each the fastest that
#     `k3lab.studies.kda_scan.calibrate` timed on the H200 in run 2.
#   fused: one launch per (chunk, head): warps; block_k, the key channels per pass of the A phase
#     (for sm_90a 6.3K instructions per thread at 32 on the path K3's gates take, not counting the
#     compiled-in exact path for wide decays; 255 registers, no spills: 2 programs per SM);
#     akk_prec, Akk's dot: 'fast' = one tf32 pass (fp32 accumulation; Akk stays fp32 for the fp32
#     inverse), 'near' = tf32x3 (fp32 inputs are always exact); maxnreg, an optional register cap
#     (more programs per SM, some spills); wu_block_k, W / U's column slice.
#   rows: the fused kernel's A phase alone (a_warps), then the split form's inverse and W / U launches;
#     exact: 'inline' (the exact path for wide decays compiled into the A kernel) or 'fixup' (left
#     out of it: 6.3K instructions per thread and no spills instead of 8.5K and 80 bytes, and a second
#     launch redoes the flagged items with it; not yet run on the H200); inv_prec: the inverse's
#     off-diagonal products, 'tf32x3' (three tf32 passes, fp32-class; on 1 warp without spills: 49 us
#     against 68 for 'ieee', same errors, issue 6 run 5) or 'ieee'; inv_wu: the inverse and W / U in
#     one launch (630 us whole against 540: the inverse then runs at W / U's 4 warps).
#   flat: the A's as four [64 x BK] @ [BK x 64] products per key slice (row block I's left operand
#     keeps only its rows; wgmma-shaped), aqk='bf16' operands for Aqk (fp32 accumulation), the next
#     slice's loads issued first (prefetch), dot3 = batched 16-row products instead, split = two
#     programs per item (Akk / Aqk); measured slower than rows on the H200 (A 472-1007 us against 386).
# Why one tf32 pass is enough for Akk: its operands are factors <= 1 (e^spread on the diagonal),
# rounded to 10 mantissa bits. Emulated in fp64 (8-16 chunks), it moves o and the state by 5e-5
# (rel. L2) on K3-like gates (condition <= 2) and by at most 1.7e-4 on nearly parallel keys (condition
# up to 50); the bf16 pipeline itself is at 4.4e-3 (runs 2 and 3). Rounding the same operands to bf16
# costs 4e-4 to 1.7e-3: the seed's point (fp32-class inputs for the inverse) holds, tf32 keeps ~8x
# more of it.
# (tests/test_kda_chunk.py::test_tf32_akk_operands_cost_little repeats the emulation.) On the H200
# tf32x3 made the fused prologue 1237 us against 712.
# rows' exact path for wide decays in a fix-up launch ('fixup') is the default since issue 6's third
# H200 call: prologue 406 us against 524 with it inline (A 277 against 381), errors unchanged
# (profiles/nvidia-h200/kda_scan/run5_call3_log.txt).
PROLOGUE_DEFAULTS = {
    "persistent": {"warps": 8},
    "split": {"block_k": 32, "a_warps": 2, "per_block": True, "inv_warps": 1, "wu_block_k": 64, "wu_warps": 4},
    "rows": {
        "a_warps": 4, "block_k": 32, "akk_prec": "fast", "maxnreg": None, "exact": "fixup", "inv_warps": 1,
        "inv_prec": "tf32x3", "inv_wu": False, "wu_block_k": 64, "wu_warps": 4,
    },  # fmt: skip
    "fused": {"warps": 4, "block_k": 32, "akk_prec": "fast", "wu_block_k": 64, "maxnreg": None},
    "cuda": {},
    "flat": {
        "a_warps": 4, "block_k": 32, "akk_prec": "fast", "aqk": "bf16", "dot3": False, "split": False,
        "prefetch": True, "maxnreg": None, "inv_warps": 1, "inv_prec": "ieee", "inv_wu": False, "wu_block_k": 64,
        "wu_warps": 4,
    },  # fmt: skip
}


def kda_chunk_prologue(
    q,
    k,
    v,
    g,
    beta,
    plan: KdaPlan,
    scale: float,
    work: _Work | None = None,
    num_warps: int | None = None,
    prologue: str | None = None,
    options: dict | None = None,
) -> _Work:
    """Launch(es) 1 of both variants: the per-chunk quantities, written into `work`.

    prologue='rows' (the default): one program per (chunk, head) computes the A's from [4 blocks,
    16 rows, key slice] tiles (one batched dot per slice), then split's fp32 inverse and W / U
    launches; on the H200 0.18 us of GPU time per chunk and head, 0.13 of them in its A launch
    (profiles/nvidia-h200/kda_scan, run 3). 'fused': the same three stages in one program (0.23 us:
    the inverse runs at the A phase's register pressure). 'split' (run 2's): three launches, its A
    launch one program per 16-row block: 0.25 us. 'flat': the A's as 64-row products (0.21 us,
    issue 6 run 5).
    'persistent' (run 1's): one launch on a persistent grid whose programs keep G, Akk and R in an
    L2-resident scratch slot; its whole [64, 128] tiles take 255 registers and spill: 0.49 us per
    chunk and head. `options` overrides PROLOGUE_DEFAULTS[prologue]; `num_warps` the first launch's
    warps."""
    H = q.shape[2]
    work = work or _alloc_work(plan.n_chunks, H, q.dtype, q.device)
    launches = prologue_launches(q, k, v, g, beta, plan, scale, work, num_warps, options, prologue)
    if plan.n_chunks * H:
        for launch in launches.values():
            launch()
    return work


def prologue_launches(
    q, k, v, g, beta, plan: KdaPlan, scale: float, work: _Work, num_warps=None, options=None, prologue=None
) -> dict:
    """A prologue's launches as callables on fixed buffers, in order (for timing each on its own):
    split / rows: 'a' (Akk, Aqk, Qg, W's right factor, Kd^T, d), 'inverse' (R in place of Akk, fp32),
    'wu' (W, U); fused: 'fused'; persistent: 'persistent'."""
    prologue = prologue or choose_prologue(q, k, v, g, beta)
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue must be one of {PROLOGUES}, got {prologue!r}")
    if prologue == "cuda":
        return {"cuda": _cuda_prologue(q, k, v, g, beta, plan, scale, work, num_warps, options)}
    defaults = PROLOGUE_DEFAULTS[prologue]
    unknown = set(options or {}) - set(defaults)
    if unknown:
        raise ValueError(f"{prologue} prologue options must be among {sorted(defaults)}, got {sorted(unknown)}")
    opts = {**defaults, **(options or {})}
    if "akk_prec" in opts and opts["akk_prec"] not in ("near", "fast"):
        raise ValueError(f"akk_prec must be 'near' or 'fast', got {opts['akk_prec']!r}")
    if "aqk" in opts and opts["aqk"] not in ("bf16", "tf32"):
        raise ValueError(f"aqk must be 'bf16' or 'tf32', got {opts['aqk']!r}")
    if "exact" in opts and opts["exact"] not in ("inline", "fixup"):
        raise ValueError(f"exact must be 'inline' or 'fixup', got {opts['exact']!r}")
    if "inv_prec" in opts and opts["inv_prec"] not in ("ieee", "tf32x3"):
        raise ValueError(f"inv_prec must be 'ieee' or 'tf32x3', got {opts['inv_prec']!r}")
    H = q.shape[2]
    n_items = plan.n_chunks * H
    p = _precisions(q.dtype)
    # 'fast' (one tf32 pass) is an NVIDIA choice; elsewhere Akk keeps exact fp32 products, as the
    # seed's MI355X kernel does with its fp32 matrix instructions (not yet run on AMD hardware here)
    fast_akk = opts.get("akk_prec", "near") == "fast" and env.detect().backend == "cuda"
    akk_prec = p["AQK_PREC"] if fast_akk else p["AKK_PREC"]
    if prologue == "persistent":
        return {"persistent": lambda: _launch_persistent(q, k, v, g, beta, plan, scale, work, num_warps or opts["warps"])}
    r_buf = work.r_buffer()

    # a register cap (more programs per SM, some spills) only where a compiler takes it
    cap = {"maxnreg": opts["maxnreg"]} if opts.get("maxnreg") and not env.triton_interpreted() else {}

    def blocks(fuse, warps, mode=0, **launch):
        return lambda: _fused_prologue_kernel[(plan.n_chunks, H)](
            q, k, v, g, beta, plan.chunk_tok, plan.chunk_len, work.w, work.u, work.qg, work.kdt, work.aqk, work.d,
            r_buf, work.flag_buffer() if mode else r_buf, H, float(scale), K=HEAD_DIM, V=HEAD_DIM, C=CHUNK, BC=SUB,
            BK=opts["wu_block_k"], A_BK=opts["block_k"], SPREAD=SAFE_SPREAD, AKK_PREC=akk_prec, AQK_PREC=p["AQK_PREC"],
            INV_PREC=p["INV_PREC"], OUT_PREC=p["OUT_PREC"], FUSE=fuse, FAST=_FAST_EXP, EXACT_MODE=mode,
            num_warps=warps, num_stages=1, **launch,
        )  # fmt: skip

    # the inverse's products: exact fp32 FMAs, or 'tf32x3' (three tf32 passes, fp32-class; NVIDIA only)
    tf32x3_inv = opts.get("inv_prec") == "tf32x3" and q.dtype != torch.float32 and env.detect().backend == "cuda"
    inv_prec = "tf32x3" if tf32x3_inv else p["INV_PREC"]
    if prologue == "fused":
        return {"fused": blocks(True, num_warps or opts["warps"], **cap)}
    fixup = None
    if prologue == "rows" and opts["exact"] == "fixup":
        main = blocks(False, num_warps or opts["a_warps"], 1, **cap)
        fixup = blocks(False, num_warps or opts["a_warps"], 2)

        def a():
            main()
            fixup()

    elif prologue == "rows":
        a = blocks(False, num_warps or opts["a_warps"], **cap)
    elif prologue == "flat":
        # bf16 operands for Aqk only with 16-bit inputs on NVIDIA (the interpreter's bf16 dots are wrong)
        aqk_bf16 = opts["aqk"] == "bf16" and q.dtype != torch.float32 and env.detect().backend == "cuda"
        grid_f = (plan.n_chunks, H, 2 if opts["split"] else 1)

        def a():
            _flat_a_kernel[grid_f](
                q, k, g, beta, plan.chunk_tok, plan.chunk_len, work.w, work.qg, work.kdt, work.aqk, work.d, r_buf,
                H, float(scale), K=HEAD_DIM, C=CHUNK, BC=SUB, BK=opts["block_k"], SPREAD=SAFE_SPREAD,
                AKK_PREC=akk_prec, AQK_PREC=p["AQK_PREC"], AQK_BF16=aqk_bf16, PREFETCH=bool(opts["prefetch"]),
                DOT3=bool(opts["dot3"]), SPLIT=bool(opts["split"]), FAST=_FAST_EXP,
                num_warps=num_warps or opts["a_warps"], num_stages=1, **cap,
            )  # fmt: skip
    else:
        grid_a = (plan.n_chunks, H, 4) if opts["per_block"] else (plan.n_chunks, H)

        def a():
            _split_a_kernel[grid_a](
                q, k, g, beta, plan.chunk_tok, plan.chunk_len, work.w, work.qg, work.kdt, work.aqk, work.d, r_buf,
                H, float(scale), K=HEAD_DIM, C=CHUNK, BC=SUB, BK=opts["block_k"], SPREAD=SAFE_SPREAD,
                AKK_PREC=akk_prec, AQK_PREC=p["AQK_PREC"], PER_BLOCK=opts["per_block"],
                num_warps=num_warps or opts["a_warps"], num_stages=1,
            )  # fmt: skip

    def inverse():
        _split_inverse_kernel[(n_items,)](
            r_buf, C=CHUNK, BC=SUB, INV_PREC=inv_prec, num_warps=opts["inv_warps"], num_stages=1
        )

    if opts.get("inv_wu"):

        def inv_wu():
            _inv_wu_kernel[(plan.n_chunks, H)](
                v, beta, plan.chunk_tok, plan.chunk_len, work.w, work.u, r_buf, H, K=HEAD_DIM, V=HEAD_DIM, C=CHUNK,
                BC=SUB, BK=opts["wu_block_k"], INV_PREC=inv_prec, OUT_PREC=p["OUT_PREC"], num_warps=opts["wu_warps"],
                num_stages=1,
            )  # fmt: skip

        return {"a": a, "inv_wu": inv_wu}

    def wu():
        _split_wu_kernel[(plan.n_chunks, H)](
            v, beta, plan.chunk_tok, plan.chunk_len, work.w, work.u, r_buf, H, K=HEAD_DIM, V=HEAD_DIM, C=CHUNK,
            BC=SUB, BK=opts["wu_block_k"], OUT_PREC=p["OUT_PREC"], num_warps=opts["wu_warps"], num_stages=1,
        )  # fmt: skip

    return {"a": a, "inverse": inverse, "wu": wu}


def prologue_status(q, k, v, g, beta) -> tuple[bool, str]:
    """Whether the CUDA prologue (kernels/kda_prologue.cu) runs for these tensors: (True, what is
    built) or (False, why not; the Triton 'rows' prologue runs instead)."""
    from k3lab.ops.kda_chunk import cuda as kda_prologue_cuda

    if _WHILE:
        return False, "Triton's interpreter (no GPU): the Triton 'rows' prologue runs"
    if not kda_prologue_cuda.available():  # cached: this runs on every call of the prefill
        return False, kda_prologue_cuda.status()[1]
    reason = kda_prologue_cuda.supports(q, k, v, g, beta)
    return (False, reason) if reason else (True, f"kernels/{kda_prologue_cuda.NAME}.cu")


def choose_prologue(q, k, v, g, beta) -> str:
    """'cuda' where `prologue_status` allows, else DEFAULT_PROLOGUE ('rows'). K3LAB_KDA_PROLOGUE names
    one kind for every call instead (to compare them end to end)."""
    import os

    forced = os.environ.get("K3LAB_KDA_PROLOGUE", "")
    if forced:
        if forced not in PROLOGUES:
            raise ValueError(f"K3LAB_KDA_PROLOGUE must be one of {PROLOGUES}, got {forced!r}")
        return forced
    return "cuda" if prologue_status(q, k, v, g, beta)[0] else DEFAULT_PROLOGUE


def _cuda_prologue(q, k, v, g, beta, plan, scale, work, num_warps, options):
    from k3lab.ops.kda_chunk import cuda as kda_prologue_cuda

    if num_warps not in (None, 8) or options:
        raise ValueError(f"the cuda prologue takes no options (8 warps, fixed); got num_warps={num_warps}, "
                         f"options={options}")
    ok, why = prologue_status(q, k, v, g, beta)
    if not ok:
        raise ValueError(f"prologue='cuda' cannot run here: {why}")
    H = q.shape[2]
    return lambda: kda_prologue_cuda.launch(
        q, k, v, g, beta, plan.chunk_tok, plan.chunk_len, work, n_chunks=plan.n_chunks, heads=H, scale=scale,
        spread=SAFE_SPREAD,
    )


def _launch_persistent(q, k, v, g, beta, plan, scale, work, num_warps):
    p = _precisions(q.dtype)
    n_items = plan.n_chunks * q.shape[2]
    scratch = work.scratch_slots()
    nprog = min(n_items, work.slots)
    _prologue_kernel[(nprog,)](
        q,
        k,
        v,
        g,
        beta,
        plan.chunk_tok,
        plan.chunk_len,
        work.w,
        work.u,
        work.qg,
        work.kdt,
        work.aqk,
        work.d,
        scratch,
        n_items,
        nprog,
        triton.cdiv(n_items, nprog),
        q.shape[2],
        float(scale),
        K=HEAD_DIM,
        V=HEAD_DIM,
        C=CHUNK,
        BC=SUB,
        SPREAD=SAFE_SPREAD,
        AKK_PREC=p["AKK_PREC"],
        AQK_PREC=p["AQK_PREC"],
        INV_PREC=p["INV_PREC"],
        OUT_PREC=p["OUT_PREC"],
        WHILE=_WHILE,
        num_warps=num_warps,
        num_stages=1,
    )


def _prologue_kw(prologue, warps, options) -> dict:
    return {"prologue": prologue, "num_warps": warps, "options": options}


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, plan, group_size, variant):
    lengths, H = _validate(q, k, v, g, beta, initial_state, cu_seqlens, scale)
    if plan is None:
        if variant == "after" and group_size is None:
            group_size = choose_group_size(lengths, H)
        plan = make_plan(lengths, H, group_size if variant == "after" else None, device=q.device)
    elif plan.lengths != lengths or plan.heads != H:
        raise ValueError(
            f"plan was made for lengths {plan.lengths[:4]}... and {plan.heads} heads, not for "
            f"these inputs (lengths {lengths[:4]}..., {H} heads)"
        )
    scale = HEAD_DIM**-0.5 if scale is None else float(scale)
    return plan, H, scale


def _outputs(q, plan, H):
    o = torch.empty(q.shape[0], q.shape[1], H, HEAD_DIM, dtype=q.dtype, device=q.device)
    s_final = torch.empty(plan.n_seqs, H, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=q.device)
    return o, s_final


WALKS = ("cuda", "triton")
# 'cuda': kernels/kda_walk.cu (k3lab.ops.kda_walk_cuda), the summaries and the replay / plain walk with
# the next chunk's operands copied in while the current one is computed (bf16, 64-column tiles);
# 'triton': _summary_kernel and _walk_kernel, whose tiles, warps and stages are launch options.
TRITON_WALK_OPTIONS = ("num_warps", "num_stages", "summary_warps", "summary_stages")


@dataclass
class WalkOptions:
    """How the walking launches run: the kind, and the Triton kernels' launch options."""

    kind: str
    block_v: int
    num_warps: int = 4
    num_stages: int = 2
    summary_block: int = 64
    summary_warps: int | None = None
    summary_stages: int | None = None


def walk_status(q, items: int = 1) -> tuple[bool, str]:
    """Whether the CUDA walks (kernels/kda_walk.cu) run for inputs like q and `items` groups: (True,
    what is built) or (False, why not; the Triton walks run instead)."""
    from k3lab.ops.kda_chunk import cuda_walk as kda_walk_cuda

    if _WHILE:
        return False, "Triton's interpreter (no GPU): the Triton walks run"
    if not kda_walk_cuda.available():
        return False, kda_walk_cuda.status()[1]
    reason = kda_walk_cuda.supports(q, items)
    return (False, reason) if reason else (True, f"kernels/{kda_walk_cuda.NAME}.cu")


def choose_walk(q, items: int = 1, plan: KdaPlan | None = None) -> str:
    """'cuda' where `walk_status` allows, else 'triton'; for a plan without groups (the plain walk)
    'triton': its few long walks ran slower in the CUDA kernel's 64-column blocks than in the Triton
    walk's 32-column programs (H200, 12 heads x 16K tokens, 24 or 12 blocks: 686 us against 480,
    profiles/nvidia-h200/kda_scan/extra/walk_bench_*). K3LAB_KDA_WALK names one kind for every call
    instead (to compare them end to end)."""
    import os

    forced = os.environ.get("K3LAB_KDA_WALK", "")
    if forced:
        if forced not in WALKS:
            raise ValueError(f"K3LAB_KDA_WALK must be one of {WALKS}, got {forced!r}")
        return forced
    if plan is not None and not plan.uses_scan:
        return "triton"
    return "cuda" if walk_status(q, items)[0] else "triton"


def _walk_options(q, plan, walk, block_v=None, summary_block=None, **triton) -> WalkOptions:
    """Resolve the walk kind and its options. walk=None: the Triton walks when any Triton-only option
    (TRITON_WALK_OPTIONS, or tiles other than 64 columns) is given, else `choose_walk`. walk='cuda'
    refuses Triton-only options by name (its tiles are fixed at 64 columns)."""
    given = {k: v for k, v in triton.items() if v is not None}
    unknown = set(given) - set(TRITON_WALK_OPTIONS)
    if unknown:
        raise ValueError(f"unknown walk options {sorted(unknown)}; expected {TRITON_WALK_OPTIONS}")
    for name, b in (("block_v", block_v), ("summary_block", summary_block)):
        if b is not None:
            _check_block_v(b, name)
            if b != 64:
                given[name] = b  # tiles the CUDA walks do not have
    items = max(plan.n_groups, plan.n_summaries)
    if walk is None:
        walk = "triton" if given else choose_walk(q, items, plan)
    elif walk == "cuda":
        if given:
            raise ValueError(f"walk='cuda' has fixed 64-column tiles and no Triton launch options; got {given}")
        ok, why = walk_status(q, items)
        if not ok:
            raise ValueError(f"walk='cuda' cannot run here: {why}")
    elif walk != "triton":
        raise ValueError(f"walk must be one of {WALKS} or None, got {walk!r}")
    if walk == "cuda":
        return WalkOptions("cuda", 64)
    if block_v is None:  # the replay (programs per group) or, without groups, the plain walk's rule
        block_v = 64 if plan.uses_scan else choose_block_v(plan.n_seqs, plan.heads)
    _check_walk_stages(q, given.get("num_stages"), given.get("summary_stages"))
    return WalkOptions("triton", block_v, given.get("num_warps", 4), given.get("num_stages", 2),
                       summary_block or 64, given.get("summary_warps"), given.get("summary_stages"))


def _walk(work, plan, o, s_final, s_in, sin_index, H, dtype, wo: WalkOptions):
    if wo.kind == "cuda":
        from k3lab.ops.kda_chunk import cuda_walk as kda_walk_cuda

        kda_walk_cuda.replay(work, plan, o, s_final, s_in, sin_index, H)
        return
    p = _precisions(dtype)
    grid = (HEAD_DIM // wo.block_v, H, plan.n_groups)
    _walk_kernel[grid](
        work.w,
        work.u,
        work.qg,
        work.kdt,
        work.aqk,
        work.d,
        plan.chunk_tok,
        plan.chunk_len,
        plan.grp_chunk0,
        plan.grp_nchunks,
        plan.grp_seq,
        sin_index,
        plan.grp_last,
        s_in if s_in is not None else s_final,
        o,
        s_final,
        H,
        K=HEAD_DIM,
        V=HEAD_DIM,
        C=CHUNK,
        BV=wo.block_v,
        HAS_SIN=s_in is not None,
        PREC=p["WALK_PREC"],
        WHILE=_WHILE,
        num_warps=wo.num_warps,
        num_stages=wo.num_stages,
    )


def kda_chunk_before(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    *,
    plan: KdaPlan | None = None,
    work: _Work | None = None,
    walk: str | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prologue_warps: int | None = None,
    prologue: str | None = None,
    prologue_options: dict | None = None,
):
    """Chunked KDA prefill, plain walk (2 launches: prologue, walk). Returns (o, final_state).

    q, k [B, T, H, 128]; v [B, T, H, 128] (one 16/32-bit float dtype); g [B, T, H, 128] fp32
    log-decay; beta [B, T, H] fp32; initial_state [N, H, 128, 128] fp32 or None (zeros);
    cu_seqlens [N + 1] for packed variable-length batches (B = 1), else N = B.
    walk: 'cuda' / 'triton' / None (`_walk_options`: CUDA where it runs unless Triton options are
    given); block_v / num_warps / num_stages: the Triton walk's tiles (default `choose_block_v`),
    warps (4) and stages (2)."""
    if plan is not None and plan.uses_scan:
        raise ValueError("plan uses groups (a scan plan); kda_chunk_before needs a plan with group_size=None")
    plan, H, scale = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, plan, None, "before")
    wo = _walk_options(q, plan, walk, block_v, num_warps=num_warps, num_stages=num_stages)
    return _plain_walk(q, k, v, g, beta, scale, initial_state, plan, work, wo,
                       _prologue_kw(prologue, prologue_warps, prologue_options))


def _plain_walk(q, k, v, g, beta, scale, initial_state, plan, work, wo, prologue_kw):
    """The before's two launches on validated inputs (the after without groups calls this too, so
    that validation, whose cu_seqlens read waits for the GPU, runs once per call)."""
    H = q.shape[2]
    o, s_final = _outputs(q, plan, H)
    if plan.n_chunks:
        work = kda_chunk_prologue(q, k, v, g, beta, plan, scale, work, **prologue_kw)
    else:
        work = work or _alloc_work(0, H, q.dtype, q.device)
    _walk(work, plan, o, s_final, initial_state, plan.seq_index, H, q.dtype, wo)
    return o, s_final


def _check_walk_stages(q, num_stages, summary_stages):
    """One-stage summaries or replay (num_stages / summary_stages = 1) hit an illegal memory access
    on the H200 (issue 6's second call, calibration candidates sb32s1_bv64s1 and sb64s1_bv32s1,
    profiles/nvidia-h200/kda_scan/run5_call2_log.txt): refused by name on CUDA devices until that is
    understood. The interpreter and other backends run them (the CPU tests check them there)."""
    if q.is_cuda and not _WHILE and not getattr(torch.version, "hip", None):
        for name, st in (("num_stages", num_stages), ("summary_stages", summary_stages)):
            if st == 1:
                raise ValueError(f"{name}=1 is refused on NVIDIA GPUs: the one-stage walk kernels faulted on the "
                                 "H200 (illegal memory access, issue 6 run 5); use 2")


def kda_chunk_after(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    *,
    group_size: int | None = None,
    plan: KdaPlan | None = None,
    work: _Work | None = None,
    walk: str | None = None,
    block_v: int | None = None,
    summary_block: int | None = None,
    summary_warps: int | None = None,
    summary_stages: int | None = None,
    scan_block: int = 16,
    scan_stages: int = 2,
    scan_warps: int = 8,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prologue_warps: int | None = None,
    prologue: str | None = None,
    prologue_options: dict | None = None,
):
    """Chunked KDA prefill by the group scan (4 launches: prologue, summaries, scan, replay), or the
    plain walk when `choose_group_size` (or the plan) says the GPU is already full. Same arguments
    and results as `kda_chunk_before`, plus `group_size` (chunks per group; None = chosen here).

    walk: the summaries' and replay's kernels, as in `kda_chunk_before`. Triton launch options:
    summary_block / summary_warps / summary_stages (the summaries; 64 columns, warps and stages
    default to num_warps / num_stages), block_v / num_warps / num_stages (the replay). The scan
    (Triton for both walks): scan_block / scan_warps / scan_stages; its defaults (16 columns, 8 warps)
    are issue 6's H200 measurement: 36 us against 80 for 32 columns on 4 warps, which needed 255
    registers and spilled."""
    plan, H, scale = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, plan, group_size, "after")
    wo = _walk_options(q, plan, walk, block_v, summary_block, num_warps=num_warps, num_stages=num_stages,
                       summary_warps=summary_warps, summary_stages=summary_stages)
    _check_block_v(scan_block, "scan_block")
    if not plan.uses_scan:  # the plain walk (validated once: run 9 timed 643 us against 607 when the
        # ragged case's cu_seqlens were read twice)
        return _plain_walk(q, k, v, g, beta, scale, initial_state, plan, work, wo,
                           _prologue_kw(prologue, prologue_warps, prologue_options))
    o, s_final = _outputs(q, plan, H)
    work = kda_chunk_prologue(
        q, k, v, g, beta, plan, scale, work, **_prologue_kw(prologue, prologue_warps, prologue_options)
    )
    sums, s_in = _scan_buffers(plan, H, q.device)
    _launch_summaries(work, plan, sums, H, q.dtype, wo)
    _launch_scan(plan, sums, s_in, initial_state, H, q.dtype, scan_block, scan_stages, scan_warps)
    _walk(work, plan, o, s_final, s_in, _arange_groups(plan), H, q.dtype, wo)
    return o, s_final


def _scan_buffers(plan: KdaPlan, H: int, device):
    K = HEAD_DIM
    sums = (
        torch.empty(plan.n_summaries, H, K, K, dtype=torch.float32, device=device),
        torch.empty(plan.n_summaries, H, K, K, dtype=torch.float32, device=device),
        torch.empty(plan.n_summaries, H, K, dtype=torch.float32, device=device),
    )
    return sums, torch.empty(plan.n_groups, H, K, K, dtype=torch.float32, device=device)


def _launch_summaries(work, plan, sums, H, dtype, wo: WalkOptions):
    """Launch 2 of the after: every non-last group's (D, N, b)."""
    if wo.kind == "cuda":
        from k3lab.ops.kda_chunk import cuda_walk as kda_walk_cuda

        kda_walk_cuda.summaries(work, plan, sums, H)
        return
    K = HEAD_DIM
    sum_n, sum_b, sum_d = sums
    _summary_kernel[(2 * K // wo.summary_block, H, plan.n_summaries)](
        work.w,
        work.u,
        work.kdt,
        work.d,
        plan.grp_chunk0,
        plan.grp_nchunks,
        plan.sum_grp,
        sum_n,
        sum_b,
        sum_d,
        H,
        K=K,
        V=K,
        C=CHUNK,
        BV=wo.summary_block,
        PREC=_precisions(dtype)["WALK_PREC"],
        WHILE=_WHILE,
        num_warps=wo.summary_warps or wo.num_warps,
        num_stages=wo.summary_stages or wo.num_stages,
    )


def _launch_scan(plan, sums, s_in, initial_state, H, dtype, scan_block, scan_stages=1, scan_warps=4):
    """Launch 3 of the after: the ordered scan over each sequence's groups."""
    K = HEAD_DIM
    sum_n, sum_b, sum_d = sums
    _scan_kernel[(K // scan_block, H, plan.n_seqs)](
        sum_n,
        sum_b,
        sum_d,
        plan.grp_sum,
        plan.seq_grp0,
        plan.seq_ngrp,
        initial_state if initial_state is not None else s_in,
        s_in,
        H,
        K=K,
        V=K,
        BV=scan_block,
        HAS_INIT=initial_state is not None,
        PREC=_precisions(dtype)["SCAN_PREC"],
        WHILE=_WHILE,
        num_warps=scan_warps,
        num_stages=scan_stages,
    )


def after_launches(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    cu_seqlens=None,
    *,
    plan: KdaPlan,
    work: _Work | None = None,
    walk: str | None = None,
    block_v: int | None = None,
    summary_block: int | None = None,
    summary_warps: int | None = None,
    summary_stages: int | None = None,
    scan_block: int = 16,
    scan_stages: int = 2,
    scan_warps: int = 8,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prologue_warps: int | None = None,
    prologue: str | None = None,
    prologue_options: dict | None = None,
) -> dict:
    """The after's launches as separate callables on fixed buffers (for timing each one and for
    profiling): {'prologue', 'summaries', 'scan', 'replay'} (or {'prologue', 'walk'} for a plan
    without groups), and 'result' (o, final state). Run them in that order; each reads what the
    previous wrote. Options as in `kda_chunk_after`."""
    plan, H, scale = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, plan, None, "after")
    wo = _walk_options(q, plan, walk, block_v, summary_block, num_warps=num_warps, num_stages=num_stages,
                       summary_warps=summary_warps, summary_stages=summary_stages)
    _check_block_v(scan_block, "scan_block")
    o, s_final = _outputs(q, plan, H)
    work = work or _alloc_work(plan.n_chunks, H, q.dtype, q.device)
    out = {
        "prologue": lambda: kda_chunk_prologue(
            q, k, v, g, beta, plan, scale, work, **_prologue_kw(prologue, prologue_warps, prologue_options)
        )
    }
    if not plan.uses_scan:
        out["walk"] = lambda: _walk(work, plan, o, s_final, initial_state, plan.seq_index, H, q.dtype, wo)
    else:
        sums, s_in = _scan_buffers(plan, H, q.device)
        out["summaries"] = lambda: _launch_summaries(work, plan, sums, H, q.dtype, wo)
        out["scan"] = lambda: _launch_scan(plan, sums, s_in, initial_state, H, q.dtype, scan_block, scan_stages,
                                           scan_warps)
        out["replay"] = lambda: _walk(work, plan, o, s_final, s_in, _arange_groups(plan), H, q.dtype, wo)
    out["result"] = lambda: (o, s_final)
    return out


def _arange_groups(plan: KdaPlan) -> torch.Tensor:
    cached = getattr(plan, "_grp_index", None)
    if cached is None:
        cached = torch.arange(plan.n_groups, dtype=torch.int32, device=plan.grp_chunk0.device)
        plan._grp_index = cached
    return cached


def _check_block_v(b, name="block_v"):
    if b not in (16, 32, 64, 128):
        raise ValueError(f"{name} must be 16, 32, 64 or 128 (a power-of-two tile of V = 128), got {b!r}")


def kda_chunk(
    q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, *, variant: str = "after", **kw
):
    """One entry point: variant 'before' (plain walk) or 'after' (group scan when it pays)."""
    if variant == "before":
        return kda_chunk_before(q, k, v, g, beta, scale, initial_state, cu_seqlens, **kw)
    if variant == "after":
        return kda_chunk_after(q, k, v, g, beta, scale, initial_state, cu_seqlens, **kw)
    raise ValueError(f"variant must be 'before' or 'after', got {variant!r}")
