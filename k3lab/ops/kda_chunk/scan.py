"""The ordered scan of KDA's group scan (Triton): one program per (value tile, head, sequence) walks the
sequence's groups, S <- D S + N S + b, writing every group's starting state: n_groups dependent steps
instead of n_chunks. Its products run in three tf32 passes on NVIDIA (fp32-class: the composed maps keep
fp32 precision), exact fp32 elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .inputs import HEAD_DIM, WHILE, dot_precisions, pipeline_stages
from .plan import KdaPlan
from .walk import state_tile

BLOCK = 16  # 16 columns on 8 warps: no spills (32 columns on 4 warps needed 255 registers)
WARPS = 8
STAGES = 2
TWO_STAGE_LDS = 72 * 1024  # what two stages ask for (Triton 3.6, gfx942): over CDNA3's 64 KiB


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
    rk,
    rbv,
    v0,
    K: tl.constexpr,
    V: tl.constexpr,
    PREC: tl.constexpr,
):
    """Store group gi's starting state, then apply its summary: S <- D S + N S + b (rk, rbv: the
    program's row and column ranges, `state_tile`'s)."""
    tl.store(state_tile(s_in, gi * H + h, rk, rbv, v0, K, V), S)
    sb = tl.load(grp_sum + gi).to(tl.int64) * H + h
    D = tl.load(sum_d + sb * K + rk)
    N = tl.load(sum_n + (sb * K + rk)[:, None] * K + rk[None, :])
    b = tl.load(state_tile(sum_b, sb, rk, rbv, v0, K, V))
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
        S = tl.load(state_tile(s_init, n * H + h, rk, rbv, v0, K, V))
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    if WHILE:
        j = 0
        while j < ng - 1:
            S = _scan_step(S, g0 + j, h, sum_n, sum_b, sum_d, grp_sum, s_in, H, rk, rbv, v0, K, V, PREC)
            j += 1
    else:
        for j in range(ng - 1):
            S = _scan_step(S, g0 + j, h, sum_n, sum_b, sum_d, grp_sum, s_in, H, rk, rbv, v0, K, V, PREC)
    gl = g0 + ng - 1
    tl.store(state_tile(s_in, gl * H + h, rk, rbv, v0, K, V), S)


def buffers(plan: KdaPlan, device) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The summaries (N, b, D) and the groups' starting states [n_groups, H, K, V], fp32."""
    K, H = HEAD_DIM, plan.heads
    sums = (
        torch.empty(plan.n_summaries, H, K, K, dtype=torch.float32, device=device),
        torch.empty(plan.n_summaries, H, K, K, dtype=torch.float32, device=device),
        torch.empty(plan.n_summaries, H, K, dtype=torch.float32, device=device),
    )
    return sums, torch.empty(plan.n_groups, H, K, K, dtype=torch.float32, device=device)


def scan(plan: KdaPlan, sums, s_in: torch.Tensor, initial_state: torch.Tensor | None,
         dtype: torch.dtype) -> None:
    """Every group's starting state into s_in, from the summaries and the initial state (zeros when None).
    `dtype`: the inputs' (it picks the products' precision). One launch."""
    K, H = HEAD_DIM, plan.heads
    sum_n, sum_b, sum_d = sums
    _scan_kernel[(K // BLOCK, H, plan.n_seqs)](
        sum_n, sum_b, sum_d, plan.grp_sum, plan.seq_grp0, plan.seq_ngrp,
        initial_state if initial_state is not None else s_in, s_in, H, K=K, V=K, BV=BLOCK,
        HAS_INIT=initial_state is not None, PREC=dot_precisions(dtype)["scan"], WHILE=WHILE, num_warps=WARPS,
        num_stages=min(STAGES, pipeline_stages(TWO_STAGE_LDS)),
    )  # fmt: skip
