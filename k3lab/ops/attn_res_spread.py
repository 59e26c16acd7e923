"""AttnRes + RMSNorm for a few tokens, each token's row spread over several programs.

EXPERIMENTAL: not yet run successfully on a GPU by this project; `attn_res_norm.after` does not use
it. Why it exists: at one token the fused kernel (`attn_res_norm`) runs on one SM, whose instruction
issue bounds the step (6.1 us for 9 sources on the H200, 9x the unfused sequence where 10x was
asked; 2,450 instructions per thread at 8 warps for sm_90a, against 760 for 2 sources, 4.15 us).
Spread over P programs (P SMs), each program handles D / P columns: for 9 sources, 1024 columns x 7
programs at 8 warps compile to 954 instructions per thread, 512 x 14 at 4 warps to 945 (sm_90a,
with a launch's 16-byte alignment; ptxas and cuobjdump), at the price of two exchanges through memory:
  1. each source's partial (w . v, v . v) over the program's columns -> every program forms the
     logits and the softmax weights, and mixes its own columns;
  2. each program's partial h . h -> every program normalises and writes its columns.
Each exchange waits on a count-and-sense word pair per token (the last program to arrive resets the
count and flips the sense; the others wait for the flip). A wait that runs out writes NaN instead of
hanging the GPU. History: a first version with a Gram-matrix exchange and per-program epoch slots
laid out by P did not finish on the H200 (slots left unequal by runs with different P); its Gram
exchange also compiled to more instructions per program than it saved.
"""

from __future__ import annotations

import torch

from k3lab import env
from k3lab.ops.attn_res_norm import _check, fold_mix_weight

try:
    import triton
    import triton.language as tl

    from k3lab.ops.attn_res_norm import _round_to, _update_partial
except ImportError:
    triton = None

MAX_PROGRAMS = 16  # per row
_SYNC: dict = {}  # device -> int32 barrier words [arrivals, sense] per token, left consistent by every launch


def sync_words(device, tokens: int) -> torch.Tensor:
    """The barrier words for `tokens` tokens on `device`, made once (zeros) and reused: every launch
    leaves each count at 0, so graph replays need no reset launch. One stream at a time per device."""
    have = _SYNC.get(device)
    if have is None or have.numel() < 2 * tokens:
        have = torch.zeros(2 * max(tokens, 256), dtype=torch.int32, device=device)
        _SYNC[device] = have
    return have


if triton is not None:

    @triton.jit
    def _row_barrier(sync, sense, ok, max_polls, P: tl.constexpr):
        # Every program of the row arrives; the last one resets the count and flips the sense, the
        # others wait for the flip. `sense` is the value before this barrier (it flips once per
        # barrier, so the caller knows the next one). The wait is bounded: ok turns False instead of
        # hanging the GPU, and the caller writes NaN.
        tl.debug_barrier()  # every thread's stores are issued before the arrival below
        arrived = tl.atomic_add(sync, 1, sem="acq_rel")
        polls = 0
        if arrived == P - 1:
            tl.atomic_xchg(sync, 0)
            tl.atomic_xchg(sync + 1, 1 - sense, sem="release")
        else:
            flag = tl.atomic_add(sync + 1, 0, sem="acquire")
            while (flag == sense) & (polls < max_polls):
                flag = tl.atomic_add(sync + 1, 0, sem="acquire")
                polls += 1
        return ok & (polls < max_polls)

    @triton.jit
    def _attn_res_norm_spread_kernel(prefix_ptr, delta_ptr, blocks_ptr, out_ptr, w_mix_ptr, w_next_ptr,
                                     part_ptr, sync_ptr, stride_block, eps, max_polls,
                                     D: tl.constexpr, N_BLOCKS: tl.constexpr, HAS_DELTA: tl.constexpr,
                                     PUSH: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr,
                                     P: tl.constexpr, P_POW2: tl.constexpr, INT_ROUND: tl.constexpr):
        # grid (tokens, P): program (row, piece) owns columns [piece * CHUNK, (piece + 1) * CHUNK) of a
        # row. Two exchanges through memory: each source's (w . v, v . v) over its columns, then the
        # mixture's h . h; partial sums in `part`, [row, piece] -> 2 NB + 3 floats.
        row = tl.program_id(0)
        piece = tl.program_id(1)
        cols = piece * CHUNK + tl.arange(0, CHUNK)
        mask = cols < D
        base = row.to(tl.int64) * D
        stride = stride_block.to(tl.int64)
        src = tl.arange(0, NB)  # the stored blocks (NB: their count padded to a power of two)
        tile = tl.load(blocks_ptr + src[:, None].to(tl.int64) * stride + base + cols[None, :],
                       mask=(src < N_BLOCKS)[:, None] & mask[None, :], other=0.0)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0)
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        dx = x
        if HAS_DELTA:
            dx = tl.load(delta_ptr + base + cols, mask=mask, other=0.0)
        sync = sync_ptr + row * 2  # [arrivals, sense] of this row's barrier, whatever P is
        sense = tl.atomic_add(sync + 1, 0)  # read before arriving: it cannot flip before we arrive
        x = _update_partial(x, dx, prefix_ptr, blocks_ptr, base, cols, mask, N_BLOCKS * stride, HAS_DELTA, PUSH,
                            INT_ROUND)
        v = tile.to(tl.float32)
        xf = x.to(tl.float32)
        WIDTH: tl.constexpr = 2 * NB + 3
        mine = part_ptr + (row * P + piece).to(tl.int64) * WIDTH
        tl.store(mine + src, tl.sum(v * w[None, :], axis=1))
        tl.store(mine + NB + src, tl.sum(v * v, axis=1))
        tl.store(mine + 2 * NB, tl.sum(xf * w, axis=0))
        tl.store(mine + 2 * NB + 1, tl.sum(xf * xf, axis=0))
        ok = _row_barrier(sync, sense, True, max_polls, P)
        # every program now sums the row's partials (read from L2: .cg skips a stale L1 line)
        everyone = part_ptr + (row * P).to(tl.int64) * WIDTH
        pr = tl.arange(0, P_POW2)
        pm = pr < P
        wdot = tl.sum(tl.load(everyone + pr[:, None] * WIDTH + src[None, :], mask=pm[:, None], other=0.0,
                              cache_modifier=".cg"), axis=0)
        ss = tl.sum(tl.load(everyone + pr[:, None] * WIDTH + NB + src[None, :], mask=pm[:, None], other=0.0,
                            cache_modifier=".cg"), axis=0)
        wdot_x = tl.sum(tl.load(everyone + pr * WIDTH + 2 * NB, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
        ss_x = tl.sum(tl.load(everyone + pr * WIDTH + 2 * NB + 1, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
        logits = tl.where(src < N_BLOCKS, wdot * tl.rsqrt(ss / D + eps), float("-inf"))
        logit_x = wdot_x * tl.rsqrt(ss_x / D + eps)
        m = tl.maximum(tl.max(logits, axis=0), logit_x)
        e = tl.exp(logits - m)  # 0 on padding rows
        e_x = tl.exp(logit_x - m)
        h = (e_x * xf + tl.sum(e[:, None] * v, axis=0)) / (tl.sum(e, axis=0) + e_x)
        tl.store(mine + 2 * NB + 2, tl.sum(h * h, axis=0))
        ok = _row_barrier(sync, 1 - sense, ok, max_polls, P)
        hh = tl.sum(tl.load(everyone + pr * WIDTH + 2 * NB + 2, mask=pm, other=0.0, cache_modifier=".cg"), axis=0)
        y = h * tl.rsqrt(hh / D + eps) * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(ok, y, float("nan"))
        tl.store(out_ptr + base + cols, _round_to(y, out_ptr.dtype.element_ty, INT_ROUND), mask=mask)


def spread_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5,
                 push_block=False, mix_weight=None, chunk=1024, num_warps=8, int_round=None):
    """Same arguments, effects and result as `attn_res_norm.before`, with each token's row spread over
    ceil(D / chunk) programs (chunk: a power of two >= 16). EXPERIMENTAL (see the module docstring)."""
    T, D = _check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block)
    if triton is None:
        raise RuntimeError("spread_after needs Triton, which is not installed; use attn_res_norm.before()")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16 (columns per program), got {chunk}")
    for name, t in (("prefix", prefix), ("blocks", blocks)) + ((("delta", delta),) if delta is not None else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    n_prog = -(-D // chunk)
    if n_prog > MAX_PROGRAMS:
        raise ValueError(f"chunk={chunk} needs {n_prog} programs per row for D={D}; at most {MAX_PROGRAMS}")
    if n_prog > 1 and env.triton_interpreted():
        raise ValueError(f"chunk={chunk} puts {n_prog} programs on each row, and they wait for each other; "
                         f"Triton's interpreter runs programs one after another: use chunk >= D={D} there")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    out = torch.empty_like(prefix)
    if T == 0:
        return out
    nb = 1 << max(n_blocks - 1, 0).bit_length()  # the stored blocks, padded to a power of two (>= 1)
    part = torch.empty(T * n_prog * (2 * nb + 3), dtype=torch.float32, device=prefix.device)
    exact = int(env.triton_interpreted() if int_round is None else bool(int_round))
    _attn_res_norm_spread_kernel[(T, n_prog)](
        prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous(), part,
        sync_words(prefix.device, T), blocks.stride(0), eps, 1 << 22, D=D, N_BLOCKS=n_blocks,
        HAS_DELTA=delta is not None, PUSH=push_block, NB=nb, CHUNK=chunk, P=n_prog,
        P_POW2=1 << (n_prog - 1).bit_length(), INT_ROUND=exact, num_warps=num_warps)
    return out
