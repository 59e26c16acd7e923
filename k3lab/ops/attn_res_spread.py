"""AttnRes + RMSNorm for a few tokens, each token's row spread over several programs.

EXPERIMENTAL: not yet run successfully on a GPU by this project. An earlier version of its barrier
(per-program epoch slots laid out by the program count) did not finish on the H200 on 2026-11-30;
this version waits on a count-and-sense word pair per token, whose PTX for sm_90a was checked by
hand (one predicated atomic per program, the wait an acquire load re-read each turn), and it writes
NaN instead of hanging if a wait ever runs out. `attn_res_norm.after` does not use it. Why it exists:
at one token the fused kernel (`attn_res_norm`) runs on one SM, whose instruction issue bounds the
step (6.1 us for 9 sources on the H200, 9x the unfused sequence where 10x was asked); spreading the
row over P SMs divides that work by P at the cost of one exchange through memory.

What a program needs from the other columns is small: every source's w . v and the Gram matrix
G_ij = v_i . v_j of the sources (the partial sum is source n_blocks). From G come each source's RMS
(its diagonal) and the mixture's norm |h|^2 = p^T G p, so one exchange of partial sums behind one
barrier per token is all the step needs; each program then mixes and writes its own columns.
"""

from __future__ import annotations

import os

import torch

from k3lab.ops.attn_res_norm import _check, fold_mix_weight

try:
    import triton
    import triton.language as tl

    from k3lab.ops.attn_res_norm import _round_to, _update_partial
except ImportError:
    triton = None

MAX_PROGRAMS = 16  # per row
_SYNC: dict = {}  # device -> int32 barrier words [arrivals, sense] per token, left consistent by every launch


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    def _attn_res_norm_spread_kernel(prefix_ptr, delta_ptr, blocks_ptr, out_ptr, w_mix_ptr, w_next_ptr,
                                     part_ptr, sync_ptr, stride_block, eps, max_polls,
                                     D: tl.constexpr, N_BLOCKS: tl.constexpr, HAS_DELTA: tl.constexpr,
                                     PUSH: tl.constexpr, NS: tl.constexpr, CHUNK: tl.constexpr,
                                     P: tl.constexpr, P_POW2: tl.constexpr, INT_ROUND: tl.constexpr,
                                     EXACT_DOT: tl.constexpr):
        # grid (tokens, P): program (row, piece) owns columns [piece * CHUNK, (piece + 1) * CHUNK) of one row
        row = tl.program_id(0)
        piece = tl.program_id(1)
        cols = piece * CHUNK + tl.arange(0, CHUNK)
        mask = cols < D
        base = row.to(tl.int64) * D
        stride = stride_block.to(tl.int64)
        src = tl.arange(0, NS)
        tile = tl.load(blocks_ptr + src[:, None].to(tl.int64) * stride + base + cols[None, :],
                       mask=(src < N_BLOCKS)[:, None] & mask[None, :], other=0.0)
        w = tl.load(w_mix_ptr + cols, mask=mask, other=0.0)
        x = tl.load(prefix_ptr + base + cols, mask=mask, other=0.0)
        dx = x
        if HAS_DELTA:
            dx = tl.load(delta_ptr + base + cols, mask=mask, other=0.0)
        sync = sync_ptr + row * 2  # [arrivals, sense] of this token's barrier, whatever P is
        sense = tl.atomic_add(sync + 1, 0)  # read before arriving: it cannot flip before we arrive
        x = _update_partial(x, dx, prefix_ptr, blocks_ptr, base, cols, mask, N_BLOCKS * stride, HAS_DELTA, PUSH,
                            INT_ROUND)
        vs = tl.where((src == N_BLOCKS)[:, None], x[None, :], tile)  # the sources, in the storage dtype
        if EXACT_DOT:  # fp32 storage, or Triton's interpreter (whose bf16 dot is wrong): plain fp32 FMAs
            vf = vs.to(tl.float32)
            gram = tl.dot(vf, tl.trans(vf), input_precision="ieee")
        else:  # bf16/fp16 products are exact in the fp32 accumulator: the matrix units do it
            gram = tl.dot(vs, tl.trans(vs))
        v = vs.to(tl.float32)
        wdot = tl.sum(v * w[None, :], axis=1)
        stride_p = NS * NS + NS
        mine = part_ptr + (row * P + piece).to(tl.int64) * stride_p
        tl.store(mine + src[:, None] * NS + src[None, :], gram)
        tl.store(mine + NS * NS + src, wdot)
        # the barrier: the last program to arrive resets the count and flips the sense; the others
        # wait for the flip. (An earlier version had each program publish an epoch in its own slot,
        # laid out by P: runs with different P on the same rows left the slots unequal, and the
        # programs then waited for epochs that never came. The count and sense do not depend on P.)
        # The wait is bounded: a broken launch writes NaN, which fails every check, instead of
        # hanging the GPU.
        tl.debug_barrier()
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
        everyone = part_ptr + (row * P).to(tl.int64) * stride_p
        pr = tl.arange(0, P_POW2)
        g3 = tl.load(everyone + pr[:, None, None] * stride_p + src[None, :, None] * NS + src[None, None, :],
                     mask=(pr < P)[:, None, None], other=0.0, cache_modifier=".cg")
        gram = tl.sum(g3, axis=0)
        wdot = tl.sum(tl.load(everyone + pr[:, None] * stride_p + NS * NS + src[None, :],
                              mask=(pr < P)[:, None], other=0.0, cache_modifier=".cg"), axis=0)
        ss = tl.sum(tl.where(src[:, None] == src[None, :], gram, 0.0), axis=1)
        logits = tl.where(src <= N_BLOCKS, wdot * tl.rsqrt(ss / D + eps), float("-inf"))
        e = tl.exp(logits - tl.max(logits, axis=0))  # 0 on padding rows
        p = e / tl.sum(e, axis=0)
        hh = tl.sum(tl.sum(p[:, None] * gram * p[None, :], axis=1), axis=0)
        h = tl.sum(p[:, None] * v, axis=0)
        y = h * tl.rsqrt(hh / D + eps) * tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.where(polls < max_polls, y, float("nan"))
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
    if n_prog > 1 and _interpreted():
        raise ValueError(f"chunk={chunk} puts {n_prog} programs on each row, and they wait for each other; "
                         f"Triton's interpreter runs programs one after another: use chunk >= D={D} there")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    out = torch.empty_like(prefix)
    if T == 0:
        return out
    ns = max(16, 1 << n_blocks.bit_length())  # the sources (blocks + the partial), padded for tl.dot
    part = torch.empty(T * n_prog * (ns * ns + ns), dtype=torch.float32, device=prefix.device)
    exact = int(_interpreted() if int_round is None else bool(int_round))
    _attn_res_norm_spread_kernel[(T, n_prog)](
        prefix, delta if delta is not None else prefix, blocks, out, w_mix, next_norm_w.contiguous(), part,
        sync_words(prefix.device, T), blocks.stride(0), eps, 1 << 22, D=D, N_BLOCKS=n_blocks,
        HAS_DELTA=delta is not None, PUSH=push_block, NS=ns, CHUNK=chunk, P=n_prog,
        P_POW2=1 << (n_prog - 1).bit_length(), INT_ROUND=exact,
        EXACT_DOT=int(_interpreted() or prefix.dtype == torch.float32), num_warps=num_warps)
    return out
