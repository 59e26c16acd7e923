"""The routed experts as two grouped Triton launches over tiles of expert-sorted rows.

    launch 1 (_up_kernel):   h = SiTU-GLU(z_rows @ w1[e]^T, z_rows @ w3[e]^T)   per tile, [m, F]
    launch 2 (_down_kernel): y_pair = weight_pair * (h @ w2[e]^T)              per tile, [m, L]
    then y = sum over each token's k pairs (one reduction in slot order)
    one token (decode at batch 1): launch 1 stores h by pair instead of by sorted row ([k, F]), and
    launch 2 is `_down_row_kernel`, a GEMV over the k pairs' columns laid end to end:
    y[cols] = sum over (j, f) of w2[idx[j]][cols, f] * weight[j] * h[j, f]
    (all pairs are the one token's, so the weights fold into h): no y_pair and no reduction kernel,
    and every load's address is known up front (no walk over tiles), the same order from run to run

A program owns one tile (block_m rows, all of one expert) and one column block of the output, so it
streams that expert's weight columns once for all its rows: at decode the cost is reading the chosen
experts' weights. The rows of a tile are gathered from z through the sort (no permuted copy of z).
Tiles past the ones in use (the grid is sized by a bound) return at once. Padding rows load zeros,
write h = 0 and skip the second store. Each pair's result gets its own row of y_pair, so the final sum
runs in a fixed order: the output is the same from run to run (atomic adds into y would not be).
Accumulation is fp32 (fp32 inputs multiply in full fp32: no TF32); h is rounded to the inputs' dtype, as the
reference's expert does between its two projections. launch_config's blocks and the sweep behind them:
docs/moe_sharding.md.
"""

from __future__ import annotations

import torch

from .inputs import ExpertSort, Shapes

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch loop still runs; the backend table says why this one does not
    triton = None


if triton is not None:
    from k3lab.ops.triton_math import launch_rows, tanh

    @triton.jit
    def _situ_glu(g, u):
        return 4.0 * tanh(g * 0.25) * tl.sigmoid(g) * (25.0 * tanh(u * 0.04))

    @triton.jit
    def _tile_rows(pair_ptr, tile_expert_ptr, tile, pairs, BLOCK_M: tl.constexpr):
        # the tile's expert, its padded rows, the pair each row holds and which rows are real
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pair_ptr + rows)
        return expert, rows, pair, pair < pairs

    @triton.jit
    def _up_kernel(z_ptr, w1_ptr, w3_ptr, h_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr,
                   pairs, L: tl.constexpr, F: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BY_PAIR: tl.constexpr = False):
        tile = tl.program_id(0)
        if tile >= tl.load(n_tiles_ptr):
            return
        expert, rows, pair, valid = _tile_rows(pair_ptr, tile_expert_ptr, tile, pairs, BLOCK_M)
        token = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < F
        ks = tl.arange(0, BLOCK_K)
        w_base = expert * F * L + cols[None, :].to(tl.int64) * L  # w[e, col, k] read as [k, col]
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, L, BLOCK_K):
            k_ok = (k0 + ks) < L
            zt = tl.load(z_ptr + token[:, None] * L + k0 + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                         other=0.0)
            w_off = w_base + k0 + ks[:, None]
            w_ok = k_ok[:, None] & col_ok[None, :]
            acc_g = tl.dot(zt, tl.load(w1_ptr + w_off, mask=w_ok, other=0.0), acc_g, input_precision="ieee")
            acc_u = tl.dot(zt, tl.load(w3_ptr + w_off, mask=w_ok, other=0.0), acc_u, input_precision="ieee")
        h = _situ_glu(acc_g, acc_u)
        if BY_PAIR:  # h [pairs, F] in pair order, padding rows not stored (the one-token down launch)
            out = h_ptr + pair[:, None].to(tl.int64) * F + cols[None, :]
            tl.store(out, h.to(h_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
        else:
            out = h_ptr + rows[:, None].to(tl.int64) * F + cols[None, :]
            tl.store(out, h.to(h_ptr.dtype.element_ty), mask=col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w2_ptr, weight_ptr, y_ptr, pair_ptr, tile_expert_ptr, n_tiles_ptr,
                     pairs, L: tl.constexpr, F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        tile = tl.program_id(0)
        if tile >= tl.load(n_tiles_ptr):
            return
        expert, rows, pair, valid = _tile_rows(pair_ptr, tile_expert_ptr, tile, pairs, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        ks = tl.arange(0, BLOCK_K)
        w_base = expert * L * F + cols[None, :].to(tl.int64) * F  # w2[e, col, k] read as [k, col]
        h_base = rows[:, None].to(tl.int64) * F
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, F, BLOCK_K):
            k_ok = (k0 + ks) < F
            ht = tl.load(h_ptr + h_base + k0 + ks[None, :], mask=k_ok[None, :], other=0.0)
            wt = tl.load(w2_ptr + w_base + k0 + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(ht, wt, acc, input_precision="ieee")
        rw = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        out = y_ptr + pair[:, None].to(tl.int64) * L + cols[None, :]
        tl.store(out, acc * rw[:, None], mask=valid[:, None] & col_ok[None, :])


    @triton.jit
    def _down_row_kernel(h_ptr, w2_ptr, weight_ptr, idx_ptr, y_ptr, L: tl.constexpr, F: tl.constexpr,
                         TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # y[0, cols] for one token: kk walks the TOP_K pairs' F columns end to end; column kk of the
        # gathered weight is w2[idx[kk // F]][:, kk % F], its input weight[kk // F] * h[kk]
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < L
        ks = tl.arange(0, BLOCK_K)
        row_base = cols[:, None].to(tl.int64) * F
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, TOP_K * F, BLOCK_K):
            kk = k0 + ks
            k_ok = kk < TOP_K * F
            j = kk // F
            expert = tl.load(idx_ptr + j, mask=k_ok, other=0).to(tl.int64)
            x = tl.load(h_ptr + kk, mask=k_ok, other=0.0).to(tl.float32) * \
                tl.load(weight_ptr + j, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + expert[None, :] * (L * F) + row_base + (kk - j * F)[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(y_ptr + cols, tl.sum(acc, axis=1), mask=col_ok)


# (columns of y, intermediate columns per step, warps) of the one-token down launch; on a GPU
# `triton.autotune` picks among them per (L, F) on its first call (before a graph is captured)
ROW_BLOCKS = ((2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 2048, 8), (8, 256, 4), (8, 512, 4), (8, 1024, 8),
              (16, 256, 8))

if triton is not None:
    _down_row_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in ROW_BLOCKS],
        key=["L", "F", "TOP_K"])(_down_row_kernel)


def down_row(h, w2, flat_w, flat_idx, L: int, F: int, blocks=None) -> torch.Tensor:
    """The one-token down launch (module docstring) on h [k, F] in pair order, the flat weights and
    expert ids [k]: y [1, L] fp32. blocks: one of ROW_BLOCKS, or None for the autotuner's choice on a
    GPU (the first of ROW_BLOCKS in the interpreter)."""
    y = torch.empty(1, L, dtype=torch.float32, device=h.device)
    args = (h, w2, flat_w, flat_idx, y)
    common = {"L": L, "F": F, "TOP_K": flat_idx.numel()}
    launch_rows(_down_row_tuned, _down_row_kernel, lambda bn: triton.cdiv(L, bn), args, common, blocks=blocks,
                fallback=ROW_BLOCKS[0], tune=h.device.type != "cpu")
    return y


def launch_config(shapes: Shapes, sort: ExpertSort) -> dict:
    """Column and reduction blocks and warps of both launches. With few tiles (one decode token's 16)
    the up launch takes long K steps (256) over 32-column blocks and the down launch short ones (64);
    with many, 128 for both: the best points of a sweep at 16-row tiles and 4 warps (docs/moe_sharding.md
    has the sweep and its figures). 8 warps for 64-row tiles is a first choice, not swept."""
    few = sort.max_tiles * triton.cdiv(shapes.intermediate, 64) < 256
    warps = 4 if sort.block_m < 64 else 8
    return {
        "up": {"BLOCK_N": 32, "BLOCK_K": 256 if few else 128, "num_warps": warps},
        "down": {"BLOCK_N": 64, "BLOCK_K": 64 if few else 128, "num_warps": warps},
    }


def grouped_experts(z, weights, idx, w1, w3, w2, shapes: Shapes, sort: ExpertSort) -> torch.Tensor:
    """Inputs already checked (inputs.check_inputs) and sorted (inputs.sort_by_expert); returns
    y [N, L] fp32, the weighted sum of each token's chosen experts."""
    N, k, L, F = shapes.n_tokens, shapes.top_k, shapes.latent, shapes.intermediate
    z, w1, w3, w2 = (t.contiguous() for t in (z, w1, w3, w2))
    flat_w = weights.reshape(-1).contiguous()
    cfg = launch_config(shapes, sort)
    one = N == 1  # h by pair, then the one-token down launch
    h = torch.empty(k if one else sort.max_tiles * sort.block_m, F, dtype=z.dtype, device=z.device)
    up, down = cfg["up"], cfg["down"]
    _up_kernel[(sort.max_tiles, triton.cdiv(F, up["BLOCK_N"]))](
        z, w1, w3, h, sort.pair_of_row, sort.tile_expert, sort.n_tiles, sort.pairs, L, F,
        TOP_K=k, BLOCK_M=sort.block_m, BLOCK_N=up["BLOCK_N"], BLOCK_K=up["BLOCK_K"],
        BY_PAIR=one, num_warps=up["num_warps"])
    if one:
        return down_row(h, w2, flat_w, idx.reshape(-1).contiguous(), L, F)
    y_pair = torch.empty(N * k, L, dtype=torch.float32, device=z.device)
    _down_kernel[(sort.max_tiles, triton.cdiv(L, down["BLOCK_N"]))](
        h, w2, flat_w, y_pair, sort.pair_of_row, sort.tile_expert, sort.n_tiles, sort.pairs, L, F,
        BLOCK_M=sort.block_m, BLOCK_N=down["BLOCK_N"], BLOCK_K=down["BLOCK_K"],
        num_warps=down["num_warps"])
    return y_pair.view(N, k, L).sum(1)
