"""K3's routed experts over MXFP4 weights (the article's precision for them): the token-at-a-time GEMV
form the decode step runs at batch 1, reading E2M1 codes and E8M0 block scales
(mxfp4.py's packing, beside this file) and dequantizing in registers.

    w1q = quantize_experts(w1)          # [E, F, L] -> Mxfp4Weight, packed [E, F, L/2], scale_exp [E, F, L/32]
    y = mxfp4_experts(z, weights, idx, w1q, w3q, w2q)    # y [N, L] fp32, the same sum as routed_experts:
    y[n] = sum_j weights[n, j] * w2[e] @ SiTU-GLU(w1[e] @ z[n], w3[e] @ z[n]),   e = idx[n, j]

Two launches:
  _up_kernel    one program per (token, slot) pair and block of F columns: g, u = w1[e] z, w3[e] z,
                h = SiTU-GLU(g, u) stored fp32 in pair order, h [N * k, F]
  _down_kernel  one program per token and block of L columns: y[cols] = sum over the token's k pairs,
                in slot order, of weight_j * w2[e_j][cols, :] h_j
No atomics and a fixed order of every sum: the output is the same bits from run to run.
The down launch has a second form, `down_form="flat"` (`_down_flat_kernel`): the token's k pairs' F
values laid end to end as one product of k * F values (h is stored by pair, so the token's h is one
contiguous run), each 32-value block finding its expert and routing weight by a vector load, so a
program issues its weight loads without walking the pairs one after another. The bf16 experts' down
launch took 70.4 us a layer walking its tiles and 14.3 us end to end (docs/decode_step.md); which MXFP4
form wins is for the one-token sweep to say (DOWN_FORM: the default). The flat form is checked in the
interpreter and compiled for gfx950, gfx942 and sm90 (the ISA report), not yet run on a GPU.

Dequantization in registers: a byte holds the codes of columns 2i (low nibble) and 2i + 1 (high), so a
tile of bytes multiplies the even and the odd inputs; a code becomes fp32 by its bits (exponent and
mantissa from the E2M1 fields; code 1, the one subnormal, is 0.5 exactly), and each block of 32
products is summed first and then multiplied once by its 2^scale_exp. The reference is the fp64
product of `dequantize()`; the kernel accumulates in fp32 (h is kept fp32 between the launches, not
rounded to z's dtype as the bf16 experts' kernel does).

Cost: each launch streams the chosen experts' codes and scales once per token (4.25 bits a weight,
`expert_bytes`); z and h are small and re-read from cache. More tokens re-read their experts' weights
per token, so the form is for decode batches.

The grouped form (`mxfp4_experts_grouped`, for many tokens): tiles of expert-sorted rows
(k3lab.ops.moe_experts.sort_by_expert), each weight tile read once for all its rows, both products on
`tl.dot_scaled`: the activations (z, then h) are quantized in registers to MXFP8 (E4M3 values with one
E8M0 scale per 32 along K: 2^ceil(log2(amax / 448))) and multiplied with the MXFP4 weights as they are.
On gfx950 this is the scaled MFMA (v_mfma_scale_f32_16x16x128_f8f6f4, in the ISA report); on sm90 Triton
decomposes it into bf16 mma with the operands scaled in registers. Triton's interpreter has no
dot_scaled and gfx942 cannot lower it: there `grouped_runs_here` says no, the caller runs the GEMV form,
and `mxfp4_experts_grouped` refuses, naming it. L and F must be multiples of its K step (128). Its
reference (`reference(..., mx_activations=True)`) quantizes the activations the same way. The grouped
form's test is GPU-only; its gfx950 code is compiled only. Where both forms have run is
k3lab.studies.runs' part 'article_precisions'.

Shapes: z [N, L] fp32 / fp16 / bf16, weights [N, k] float, idx [N, k] int32 / int64 in [0, E),
w1, w3 Mxfp4Weight of [E, F, L], w2 of [E, L, F]; L and F multiples of 32. Bad input: ValueError /
TypeError naming the argument, before any kernel runs. Needs a GPU, or Triton's interpreter
(TRITON_INTERPRET=1) on a CPU.
"""

from __future__ import annotations

import torch

from k3lab.ops import expect, int_arg

from . import mxfp4
from .inputs import check_placed, check_routing
from .mxfp4 import BLOCK, Mxfp4Weight

try:
    import triton
    import triton.language as tl
except ImportError:  # mxfp4_experts then says so when called
    triton = None

Z_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (F columns, K values per step, warps) of the up launch and (L columns, F values per step, warps) of the
# down launch. At one token the grids are small (16 pairs x F / columns programs up, L / columns down),
# so few columns per program put more loads in flight; a down step of 128 divides the expert width at
# TP8 (384) where 256 masks half of its second step. Chosen launch by launch from the one-token sweep at
# K3's widths on an H100 (k3lab.studies.decode_step.glue.EXPERT_SWEEP), each the fastest choice of its
# launch with the other at the former default (32, 256, 4) / (16, 256, 4), then timed together as the
# sweep's first row (the fastest pair but one within 1%); the times are in docs/decode_step.md's
# experts table.
UP_BLOCKS = (8, 256, 4)
DOWN_BLOCKS = (4, 128, 4)
DOWN_FORMS = ("pairs", "flat")   # the down launch walking the pairs in turn, or their values end to end
DOWN_FORM = "pairs"


if triton is not None:
    from k3lab.ops.triton_math import situ

    @triton.jit
    def _e2m1(code):
        # an E2M1 code (int32, 0..15) as fp32: magnitude codes 2..7 are normal numbers whose fp32
        # exponent and mantissa are (code >> 1) + 126 and code & 1, i.e. bits (code + 252) << 22; code 1
        # is 0.5 (exponent 126, no mantissa: 252 << 22) and code 0 is zero; bit 3 is the sign
        mag = code & 7
        bits = tl.where(mag >= 2, mag + 252, mag * 252) << 22
        bits = bits | ((code & 8) << 28)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _block_dot(w_ptr, s_ptr, w_row, s_row, x_ptr, x_row, k0, col_ok, x_scale,
                   KB: tl.constexpr, NB: tl.constexpr):
        # sum over the blocks [k0 / 32, k0 / 32 + NB) of one row tile of an MXFP4 weight times x:
        # [BLOCK_N, NB] per-block sums already scaled by 2^scale_exp (w_row, s_row: [BLOCK_N, 1, 1] and
        # [BLOCK_N, 1] element offsets of each row's codes and scales; x_row: x's offset; KB: K / 32)
        blk = k0 // 32 + tl.arange(0, NB)
        blk_ok = blk < KB
        byte = blk[:, None] * 16 + tl.arange(0, 16)[None, :]                       # [NB, 16]
        x_at = x_ptr + x_row + 2 * byte
        x_even = tl.load(x_at, mask=blk_ok[:, None], other=0.0).to(tl.float32) * x_scale
        x_odd = tl.load(x_at + 1, mask=blk_ok[:, None], other=0.0).to(tl.float32) * x_scale
        ok = col_ok[:, None] & blk_ok[None, :]
        p = tl.load(w_ptr + w_row + byte[None, :, :], mask=ok[:, :, None], other=0).to(tl.int32)
        part = tl.sum(_e2m1(p & 15) * x_even[None, :, :] + _e2m1(p >> 4) * x_odd[None, :, :], axis=2)
        s = tl.load(s_ptr + s_row + blk[None, :], mask=ok, other=0).to(tl.float32)
        return part * tl.exp2(s)

    @triton.jit
    def _up_kernel(z_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, idx_ptr, h_ptr,
                   L: tl.constexpr, F: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        token = pair // TOP_K
        e = tl.load(idx_ptr + pair).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < F
        row = e * F + cols.to(tl.int64)                       # weight rows [E * F]
        w_row = (row * (L // 2))[:, None, None]
        s_row = (row * (L // 32))[:, None]
        NB: tl.constexpr = BLOCK_K // 32
        acc_g = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            acc_g += _block_dot(w1_ptr, s1_ptr, w_row, s_row, z_ptr, token * L, k0, col_ok, 1.0, L // 32, NB)
            acc_u += _block_dot(w3_ptr, s3_ptr, w_row, s_row, z_ptr, token * L, k0, col_ok, 1.0, L // 32, NB)
        h = situ(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), 4.0, 25.0)
        tl.store(h_ptr + pair.to(tl.int64) * F + cols, h, mask=col_ok)

    @triton.jit
    def _down_kernel(h_ptr, w2_ptr, s2_ptr, weight_ptr, idx_ptr, y_ptr,
                     L: tl.constexpr, F: tl.constexpr, TOP_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        NB: tl.constexpr = BLOCK_K // 32
        acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        for j in range(TOP_K):  # slot order: the same sum every run
            pair = n * TOP_K + j
            e = tl.load(idx_ptr + pair).to(tl.int64)
            rw = tl.load(weight_ptr + pair).to(tl.float32)
            row = e * L + cols.to(tl.int64)                   # weight rows [E * L]
            w_row = (row * (F // 2))[:, None, None]
            s_row = (row * (F // 32))[:, None]
            for k0 in range(0, F, BLOCK_K):
                acc += _block_dot(w2_ptr, s2_ptr, w_row, s_row, h_ptr, pair.to(tl.int64) * F, k0, col_ok, rw,
                                  F // 32, NB)
        tl.store(y_ptr + n.to(tl.int64) * L + cols, tl.sum(acc, axis=1), mask=col_ok)

    @triton.jit
    def _down_flat_kernel(h_ptr, w2_ptr, s2_ptr, weight_ptr, idx_ptr, y_ptr,
                          L: tl.constexpr, F: tl.constexpr, TOP_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # one token's y[cols]: its TOP_K * F h values (pair-major, contiguous) as one product; block b of
        # 32 values belongs to pair j = b // (F / 32) at block b % (F / 32) of that expert's row
        n = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        NB: tl.constexpr = BLOCK_K // 32
        FB: tl.constexpr = F // 32
        TB: tl.constexpr = TOP_K * FB
        acc = tl.zeros((BLOCK_N, NB), dtype=tl.float32)
        for b0 in range(0, TB, NB):
            blk = b0 + tl.arange(0, NB)
            blk_ok = blk < TB
            j = blk // FB
            fb = blk - j * FB
            pair = n * TOP_K + j
            e = tl.load(idx_ptr + pair, mask=blk_ok, other=0).to(tl.int64)
            rw = tl.load(weight_ptr + pair, mask=blk_ok, other=0.0).to(tl.float32)
            byte = blk[:, None] * 16 + tl.arange(0, 16)[None, :]                    # [NB, 16]
            x_at = h_ptr + n.to(tl.int64) * (TOP_K * F) + 2 * byte
            x_even = tl.load(x_at, mask=blk_ok[:, None], other=0.0) * rw[:, None]
            x_odd = tl.load(x_at + 1, mask=blk_ok[:, None], other=0.0) * rw[:, None]
            row = e[None, :] * L + cols[:, None].to(tl.int64)                       # [BLOCK_N, NB]
            ok = col_ok[:, None] & blk_ok[None, :]
            w_at = (row * (F // 2) + fb[None, :] * 16)[:, :, None] + tl.arange(0, 16)[None, None, :]
            p = tl.load(w2_ptr + w_at, mask=ok[:, :, None], other=0).to(tl.int32)
            part = tl.sum(_e2m1(p & 15) * x_even[None, :, :] + _e2m1(p >> 4) * x_odd[None, :, :], axis=2)
            s = tl.load(s2_ptr + row * FB + fb[None, :], mask=ok, other=0).to(tl.float32)
            acc += part * tl.exp2(s)
        tl.store(y_ptr + n.to(tl.int64) * L + cols, tl.sum(acc, axis=1), mask=col_ok)


if triton is not None:

    @triton.jit
    def _mx_fp8(x, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        # x [ROWS, BLOCK_K] fp32 as MXFP8: E4M3 values and E8M0 scales (uint8, exponent + 127) per 32
        NB: tl.constexpr = BLOCK_K // 32
        x3 = tl.reshape(x, (ROWS, NB, 32))
        amax = tl.max(tl.abs(x3), axis=2)
        e = tl.ceil(tl.log2(tl.where(amax > 0, amax, 1.0) / 448.0))
        e = tl.minimum(tl.maximum(tl.where(amax > 0, e, -127.0), -127.0), 127.0)
        q = tl.reshape(x3 / tl.exp2(e)[:, :, None], (ROWS, BLOCK_K))
        return tl.clamp(q, -448.0, 448.0).to(tl.float8e4nv), (e + 127.0).to(tl.uint8)

    @triton.jit
    def _scaled_product(x, w_ptr, s_ptr, row_base, k0, col_ok, acc, K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        # acc += MXFP8(x) @ W[rows, k0:k0 + BLOCK_K]^T on tl.dot_scaled; row_base [BLOCK_N] int64: the
        # weight rows (expert * N + column); codes read as [BLOCK_K / 2, BLOCK_N], scales as E8M0
        xq, xs = _mx_fp8(x, BLOCK_M, BLOCK_K)
        kb = tl.arange(0, BLOCK_K // 2)
        wp = tl.load(w_ptr + row_base[None, :] * (K // 2) + k0 // 2 + kb[:, None], mask=col_ok[None, :],
                     other=0)
        ks = tl.arange(0, BLOCK_K // 32)
        ws = tl.load(s_ptr + row_base[:, None] * (K // 32) + k0 // 32 + ks[None, :], mask=col_ok[:, None],
                     other=0)
        ws = (ws.to(tl.int32) + 127).to(tl.uint8)
        return tl.dot_scaled(xq, xs, "e4m3", wp, ws, "e2m1", acc)

    @triton.jit
    def _tile_of(tile, pair_ptr, tile_expert_ptr, pairs, N: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
        # what a grouped program works on: its tile's expert, the tile's padded rows, the (token, slot)
        # pair each row holds and whether it holds one (padding rows hold `pairs`), and its block of the
        # N output columns with their mask
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        return expert, rows, pair, pair < pairs, cols, cols < N

    @triton.jit
    def _scaled_up_kernel(z_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, h_ptr, pair_ptr, tile_expert_ptr,
                          n_tiles_ptr, pairs, L: tl.constexpr, F: tl.constexpr, TOP_K: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        if tile >= tl.load(n_tiles_ptr):
            return
        expert, rows, pair, valid, cols, col_ok = _tile_of(tile, pair_ptr, tile_expert_ptr, pairs, F, BLOCK_M,
                                                           BLOCK_N)
        token = (pair // TOP_K).to(tl.int64)
        row_base = expert * F + cols.to(tl.int64)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, L, BLOCK_K):
            x = tl.load(z_ptr + token[:, None] * L + k0 + ks[None, :], mask=valid[:, None], other=0.0)
            x = x.to(tl.float32)
            acc_g = _scaled_product(x, w1_ptr, s1_ptr, row_base, k0, col_ok, acc_g, L, BLOCK_M, BLOCK_K)
            acc_u = _scaled_product(x, w3_ptr, s3_ptr, row_base, k0, col_ok, acc_u, L, BLOCK_M, BLOCK_K)
        h = situ(acc_g, acc_u, 4.0, 25.0)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * F + cols[None, :], h, mask=col_ok[None, :])

    @triton.jit
    def _scaled_down_kernel(h_ptr, w2_ptr, s2_ptr, weight_ptr, y_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr,
                            pairs, L: tl.constexpr, F: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        if tile >= tl.load(n_tiles_ptr):
            return
        expert, rows, pair, valid, cols, col_ok = _tile_of(tile, pair_ptr, tile_expert_ptr, pairs, L, BLOCK_M,
                                                           BLOCK_N)
        row_base = expert * L + cols.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, F, BLOCK_K):
            x = tl.load(h_ptr + rows[:, None].to(tl.int64) * F + k0 + ks[None, :])
            acc = _scaled_product(x, w2_ptr, s2_ptr, row_base, k0, col_ok, acc, F, BLOCK_M, BLOCK_K)
        rw = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        tl.store(y_ptr + pair[:, None].to(tl.int64) * L + cols[None, :], acc * rw[:, None],
                 mask=valid[:, None] & col_ok[None, :])


def quantize_experts(w: torch.Tensor) -> Mxfp4Weight:
    """A stack of expert weights [E, N, K] (K a multiple of 32) in MXFP4 (mxfp4.quantize)."""
    if isinstance(w, torch.Tensor) and w.dim() != 3:
        raise ValueError(f"w must be a stack of expert weights [E, N, K], got shape {tuple(w.shape)}")
    return mxfp4.quantize(w)


def _experts(name: str, w, shape: tuple[int, int, int] | None = None) -> tuple[int, int, int]:
    if not isinstance(w, Mxfp4Weight):
        raise TypeError(f"{name} must be an Mxfp4Weight (quantize_experts of [E, N, K]), got "
                        f"{type(w).__name__}")
    expect(f"{name}.packed", w.packed, shape=3, dtype=torch.uint8, what="[E, N, K/2]")
    expect(f"{name}.scale_exp", w.scale_exp, dtype=torch.int8)
    E, N, K = w.shape
    if K % BLOCK or w.scale_exp.shape != (E, N, K // BLOCK):
        raise ValueError(f"{name}'s scale_exp must be [E={E}, N={N}, K/32={K // BLOCK}] with K={K} a "
                         f"multiple of {BLOCK}, got {tuple(w.scale_exp.shape)}")
    if shape is not None and (E, N, K) != shape:
        raise ValueError(f"{name} must be an expert stack of shape {shape}, got {(E, N, K)}")
    return E, N, K


def check_inputs(z, weights, idx, w1, w3, w2, *, check_values: bool = True) -> tuple[int, int, int, int, int]:
    """(N, k, L, F, E) of valid inputs (module docstring); ValueError / TypeError naming the argument.
    check_values reads idx back for its range (skipped while a CUDA graph is captured)."""
    N, k = check_routing(z, weights, idx, Z_DTYPES)
    E, F, L = _experts("w1", w1)
    _experts("w3", w3, (E, F, L))
    _experts("w2", w2, (E, L, F))
    expect("z", z, shape=(N, L), what=f"[N, L={L}] (w1's input width)")
    tensors = {"z": z, "weights": weights, "idx": idx, "w1": w1.packed, "w1.scale_exp": w1.scale_exp,
               "w3": w3.packed, "w3.scale_exp": w3.scale_exp, "w2": w2.packed, "w2.scale_exp": w2.scale_exp}
    check_placed(tensors, idx, E, check_values)
    return N, k, L, F, E


def _blocks(name: str, blocks) -> tuple[int, int, int]:
    def pow2(b) -> bool:
        return isinstance(b, int) and not isinstance(b, bool) and b > 0 and b & (b - 1) == 0

    if not (isinstance(blocks, tuple) and len(blocks) == 3 and all(map(pow2, blocks)) and blocks[1] >= BLOCK):
        raise ValueError(f"{name} must be (columns, values per step >= 32, warps), powers of two, got "
                         f"{blocks!r}")
    return blocks


def mxfp4_experts(z, weights, idx, w1: Mxfp4Weight, w3: Mxfp4Weight, w2: Mxfp4Weight, *,
                  check_values: bool = True, up_blocks=UP_BLOCKS, down_blocks=DOWN_BLOCKS,
                  down_form: str = DOWN_FORM) -> torch.Tensor:
    """y [N, L] fp32 = sum_j weights[n, j] * expert idx[n, j] of z[n] over MXFP4 weights (module
    docstring). up_blocks / down_blocks: (columns, values per step, warps) of the two launches;
    down_form: one of DOWN_FORMS, how the down launch walks the token's pairs."""
    if down_form not in DOWN_FORMS:
        raise ValueError(f"down_form: expected one of {DOWN_FORMS}, got {down_form!r}")
    N, k, L, F, _ = check_inputs(z, weights, idx, w1, w3, w2, check_values=check_values)
    bn_u, bk_u, warps_u = _blocks("up_blocks", up_blocks)
    bn_d, bk_d, warps_d = _blocks("down_blocks", down_blocks)
    if triton is None:
        raise RuntimeError("mxfp4_experts needs Triton (a GPU, or TRITON_INTERPRET=1 on a CPU); "
                           "k3lab.ops.moe_experts' torch loop runs bf16 weights without it")
    y = torch.empty(N, L, dtype=torch.float32, device=z.device)
    if N == 0:
        return y
    z = z.contiguous()
    flat_idx = idx.reshape(-1).contiguous()
    flat_w = weights.reshape(-1).contiguous()
    h = torch.empty(N * k, F, dtype=torch.float32, device=z.device)
    _up_kernel[(N * k, triton.cdiv(F, bn_u))](
        z, w1.packed, w1.scale_exp, w3.packed, w3.scale_exp, flat_idx, h, L=L, F=F, TOP_K=k,
        BLOCK_N=bn_u, BLOCK_K=bk_u, num_warps=warps_u)
    down = _down_flat_kernel if down_form == "flat" else _down_kernel
    down[(N, triton.cdiv(L, bn_d))](
        h, w2.packed, w2.scale_exp, flat_w, flat_idx, y, L=L, F=F, TOP_K=k,
        BLOCK_N=bn_d, BLOCK_K=bk_d, num_warps=warps_d)
    return y


GROUPED = (16, 64, 128, 4)  # (rows per tile, columns, K values per step, warps) of the grouped launches


def grouped_runs_here() -> tuple[bool, str]:
    """(ok, why) for the grouped dot_scaled form in this process: compiled Triton (on this GPU, or for
    the ISA tool's target), never the interpreter, and not on an AMD target without scaled MFMA; `why`
    is never empty (the Backends table shows it)."""
    from k3lab import env

    if triton is None:
        return False, "Triton is not installed"
    if env.triton_interpreted():
        return False, "Triton's interpreter has no tl.dot_scaled: the GEMV form (mxfp4_experts) runs"
    arch = env.detect().arch or ""
    if arch.startswith("gfx") and not arch.startswith("gfx95"):
        # Triton 3.6 fails to lower tl.dot_scaled for gfx942 ("Unsupported DotScaleOp"); 3.9 lowers it to
        # plain bf16 MFMA (not the scaled instruction the grouped form is for; its speed there is unmeasured)
        return False, f"{arch} has no scaled MFMA (Triton 3.6 cannot lower tl.dot_scaled there; later ones " \
            "emulate it with bf16 MFMA): the GEMV form runs"
    return True, f"Triton {triton.__version__}: expert-sorted tiles on tl.dot_scaled ({arch or 'this GPU'})"


def mxfp4_experts_grouped(z, weights, idx, w1: Mxfp4Weight, w3: Mxfp4Weight, w2: Mxfp4Weight, *,
                          check_values: bool = True, blocks=GROUPED) -> torch.Tensor:
    """y [N, L] fp32 through the grouped dot_scaled form (module docstring): activations as MXFP8, so
    it matches `reference(..., mx_activations=True)`. Where that form cannot run (`grouped_runs_here`)
    RuntimeError names the GEMV form. blocks: (rows per tile 16/32/64, columns, K step, warps)."""
    from k3lab.ops.moe_experts.inputs import sort_by_expert

    N, k, L, F, E = check_inputs(z, weights, idx, w1, w3, w2, check_values=check_values)
    bm, bn, bk, warps = blocks if isinstance(blocks, tuple) and len(blocks) == 4 else (0, 0, 0, 0)
    _blocks("blocks", (bn, bk, warps))
    if bm not in (16, 32, 64) or bk < 128 or L % bk or F % bk:
        raise ValueError(f"blocks must be (16, 32 or 64 rows, columns, a K step >= 128 dividing L={L} and "
                         f"F={F}, warps), got {blocks!r}")
    ok, why = grouped_runs_here()
    if not ok:
        raise RuntimeError(f"mxfp4_experts_grouped cannot run here: {why}")
    y_pair = torch.zeros(N * k, L, dtype=torch.float32, device=z.device)
    if N == 0:
        return y_pair.view(0, L)
    sort = sort_by_expert(idx, E, bm)
    h = torch.empty(sort.max_tiles * bm, F, dtype=torch.float32, device=z.device)
    z = z.contiguous()
    _scaled_up_kernel[(sort.max_tiles, triton.cdiv(F, bn))](
        z, w1.packed, w1.scale_exp, w3.packed, w3.scale_exp, h, sort.pair_of_row, sort.tile_expert,
        sort.n_tiles, sort.pairs, L=L, F=F, TOP_K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    _scaled_down_kernel[(sort.max_tiles, triton.cdiv(L, bn))](
        h, w2.packed, w2.scale_exp, weights.reshape(-1).contiguous(), y_pair, sort.pair_of_row,
        sort.tile_expert, sort.n_tiles, sort.pairs, L=L, F=F, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps)
    return y_pair.view(N, k, L).sum(1)


def mx_fp8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded as the grouped kernels quantize activations: E4M3 values
    with a power-of-two scale 2^ceil(log2(amax / 448)) per 32 along K; returned dequantized, fp64."""
    x = x.to(torch.float64)
    x3 = x.reshape(*x.shape[:-1], -1, BLOCK)
    amax = x3.abs().amax(-1, keepdim=True)
    e = torch.ceil(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)) / 448.0))
    scale = torch.pow(2.0, torch.where(amax > 0, e, torch.full_like(e, -127.0)).clamp(-127, 127))
    q = (x3 / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64)
    return (q * scale).reshape(x.shape)


def reference(z, weights, idx, w1: Mxfp4Weight, w3: Mxfp4Weight, w2: Mxfp4Weight, *,
              mx_activations: bool = False) -> torch.Tensor:
    """The fp64 product of the dequantized experts, [N, L] fp64: what mxfp4_experts is checked against.
    mx_activations: z and h rounded as MXFP8 first (`mx_fp8`), as the grouped form does."""
    from k3lab.nn.situ import situ_glu

    N, k, *_ = check_inputs(z, weights, idx, w1, w3, w2)
    d1, d3, d2 = (w.dequantize(torch.float64) for w in (w1, w3, w2))
    act = mx_fp8 if mx_activations else (lambda t: t.to(torch.float64))
    zd = act(z)
    y = torch.zeros(N, d2.shape[1], dtype=torch.float64, device=z.device)
    for n in range(N):
        for j in range(k):
            e = int(idx[n, j])
            h = act(situ_glu(d1[e] @ zd[n], d3[e] @ zd[n]))
            y[n] += float(weights[n, j]) * (d2[e] @ h)
    return y


def expert_bytes(tokens: int, top_k: int, latent: int, intermediate: int,
                 bytes_per_weight: float | None = None) -> int:
    """Bytes the routed experts stream for `tokens` tokens of `top_k` experts each, if every pair chose
    a different expert (decode at batch 1: the floor): three [intermediate, latent] matrices a pair
    (w1, w3, w2). bytes_per_weight: MXFP4's 4.25 bits (None), or 2 for bf16, 1 for fp8."""
    int_arg("tokens", tokens)
    int_arg("top_k", top_k, low=1)
    int_arg("latent", latent, low=1)
    int_arg("intermediate", intermediate, low=1)
    if bytes_per_weight is None:
        return tokens * top_k * 3 * mxfp4.nbytes(intermediate, latent)
    number = isinstance(bytes_per_weight, (int, float)) and not isinstance(bytes_per_weight, bool)
    if not number or bytes_per_weight <= 0:
        raise ValueError(f"bytes_per_weight must be a positive number, got {bytes_per_weight!r}")
    return int(round(tokens * top_k * 3 * intermediate * latent * bytes_per_weight))


__all__ = ["DOWN_BLOCKS", "GROUPED", "UP_BLOCKS", "check_inputs", "expert_bytes", "grouped_runs_here",
           "mx_fp8", "mxfp4_experts", "mxfp4_experts_grouped", "quantize_experts", "reference"]
