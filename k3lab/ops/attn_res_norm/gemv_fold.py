"""The AttnRes + RMSNorm mix folded into the one-row GEMV that reads its output: one launch for both.

At batch 1 every mix of the decode step feeds exactly one one-row product launch (k3lab.ops.gemv: a
KDA or MLA layer's stacked input projection, the dense MLP's gate|up, or the MoE layer's router +
down_proj + shared gate|up stack). The fold runs that launch's grid with program 0 doing the mix first:

    program 0:   the mix of `attn_res_norm.before` (partial update, block push, softmax over the
                 sources, RMSNorm, next norm weight) -> x [1, D] written once, then a release flag
    programs 1+: load their first weight tile, wait for the flag (acquire), then stream their rows
    every program: y_i[rows] = x @ w_i[rows]^T (times FP8 row scales), as `gemv_stack`

Outputs and state are those of `attn_res_norm.after` followed by `gemv.gemv_stack` on its output: x,
the products, `prefix` / `blocks` updated in place. The mixed row x is written out (the step keeps it
for the few readers beside the product, e.g. the MoE layer's zeros where it has no shared expert).

Why this fold and not the others (TP8 widths, D = 7,168 bf16, S <= 9 sources: 8 stored blocks + the
partial, plus the delta; the GEMV's programs own BLOCK_N rows, e.g. 4, of the KDA input projection's
6,284 rows: 1,571 programs):
* every program recomputing the mix from the sources (they sit in L2) reads per program the S sources
  and the delta once for the logits and once more for the mixture in its K loop: 2 x 10 x 7,168 x 2 B
  = 287 KB of extra L2 reads, against its own 4 x 7,168 x 2 B = 57 KB of weights; 1,571 programs ->
  450 MB of L2 reads per mix (the projection streams 90 MB of weights), tens of microseconds to save
  the mix's one (about 1 us of launch). Even a persistent grid of 132 programs reads 38 MB. It loses
  by one to two orders of magnitude, at every block shape.
* the producer's epilogue: between the producer of the mix's delta (o_proj, the MoE tail) and the mix
  sits the tensor-parallel all-reduce (NCCL at TP8; a copy stand-in on one GPU), so the mix can only
  follow it; it cannot sit in the producer.
* one mix program inside the consumer (this module): the sources are read once, by program 0, as the
  standalone kernel reads them; extra bytes are a 4-byte flag per fold and a D-wide fp32 scratch row
  (28 KB written and read back, L2) plus the polls of the waiting programs (one thread each, 4-byte
  acquire loads of the flag, L2).
  Per step (186 folds: two per layer; the final mix feeds lm_head, a matrix-library product, and
  stays a mix launch): 186 x (28,672 x 2 + 4) B = 10.7 MB of L2 traffic, and at most the scratch
  rows' 186 x 28,672 B = 5.3 MB of DRAM writes where the weight stream evicts them from L2; against
  186 launches of about 1 us saved, and the waiting programs' first weight tiles loaded while the mix
  runs.
What it costs instead: the kernel's registers and shared memory are the max of the mix path and the
product path, which lowers the products' occupancy (the ISA report on sm90 at the router's shape, the
shapes of FOLD_BLOCKS: 64-90 registers a thread and 8-12 KiB of shared memory, 4-7 blocks per SM,
against the plain GEMV's 45-72 registers and 4-10 blocks at the same shapes), and program 0's mix
walks the row in MIX_CHUNK-wide chunks (three passes: logits, mixture, norm) where the standalone
kernel holds every source in registers.
Unmeasured: k3lab.studies.decode_step.measure.run(cases=["b1_1k"],
variants=["all_on_gemv", "all_on_mixfold"]) times the step without and with it (the setting
`mix_fold` of k3lab.engine.switches, off unless asked); tests/test_attn_res_gemv_fold.py checks it
against the plain PyTorch sequence.

Grid order: the waiting programs rely on program 0 running (it is dispatched first, and a GPU runs a
grid's first programs before later ones; Triton's interpreter runs programs in order). The flag
counts itself back to 0 (program 0 sets it to the number of waiters, each waiter takes one), so a
captured CUDA graph replays it; the flag and scratch row are per device, for launches on one stream.
"""

from __future__ import annotations

import torch

from k3lab import env
from k3lab.ops.gemv import _check as check_product
from k3lab.ops.gemv import gpu_blocks

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch row still runs; triton_status says why this one does not
    triton = None

MIX_CHUNK = 256  # columns program 0 takes per step of its three passes: a [8, 256] tile is 16 values
                 # a thread at 4 warps; 512 doubles that and costs the products occupancy (ISA report)
MIX_STAGES = 2   # the mix passes' loops software-pipelined this deep (loads through shared memory)
INTERPRETER_SHAPE = (64, 128, 1)  # (BLOCK_N, BLOCK_K, warps) in Triton's interpreter, as k3lab.ops.gemv

_SCRATCH: dict = {}  # (device, D) -> (fp32 [D] mixture row, int32 [1] flag)
# the one-row GEMV's block shapes the fold's autotuner tries (those of `gemv.gpu_blocks()` on this
# machine): the 4-warp shapes that keep the most programs per SM beside the mix's registers (ISA report,
# sm90: 70-90 registers a thread, 5-7 blocks per SM) and AMD's 8-warp one; few, because every (weight
# set, GROUP) of a step compiles each shape on its first call
FOLD_BLOCKS = ((1, 2048, 4), (2, 1024, 4), (4, 1024, 4), (8, 512, 4), (4, 2048, 8))


def fold_blocks() -> tuple:
    """The (BLOCK_N, BLOCK_K, warps) candidates of the fold's autotuner on this machine."""
    return tuple(b for b in gpu_blocks() if b in FOLD_BLOCKS)


if triton is not None:
    from k3lab.ops.triton_math import round_to

    @triton.jit
    def _mix_row(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, w_mix_ptr, w_next_ptr, stride_block, eps,
                 n_blocks, has_delta, push, D: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr,
                 STAGES: tl.constexpr, INT_ROUND: tl.constexpr):
        # the mix of one row in three passes over CHUNK-wide column chunks (GROUP >= n_blocks rows of
        # stored blocks per chunk): logits, then the mixture (kept in the fp32 scratch row h), then the
        # norm. n_blocks, has_delta and push are run-time values: one compiled kernel serves every site
        # of a step whose stored blocks round up to the same GROUP
        cols = tl.arange(0, CHUNK)
        g = tl.arange(0, GROUP)
        gvalid = g < n_blocks
        stride = stride_block.to(tl.int64)
        g_off = g[:, None].to(tl.int64) * stride
        push_off = n_blocks * stride
        dot_p = tl.zeros([CHUNK], dtype=tl.float32)
        ss_p = tl.zeros([CHUNK], dtype=tl.float32)
        dot_b = tl.zeros([GROUP], dtype=tl.float32)
        ss_b = tl.zeros([GROUP], dtype=tl.float32)
        for c0 in tl.range(0, D, CHUNK, num_stages=STAGES):
            kk = c0 + cols
            m = kk < D
            w = tl.load(w_mix_ptr + kk, mask=m, other=0.0)
            x = tl.load(prefix_ptr + kk, mask=m, other=0.0)
            if has_delta:
                dx = tl.load(delta_ptr + kk, mask=m, other=0.0)
                x = round_to(x.to(tl.float32) + dx.to(tl.float32), prefix_ptr.dtype.element_ty, INT_ROUND)
            tl.debug_barrier()  # every thread holding these columns has read them before any writes
            if push:
                tl.store(blocks_ptr + push_off + kk, x, mask=m)
                tl.store(prefix_ptr + kk, tl.zeros_like(x), mask=m)
            elif has_delta:
                tl.store(prefix_ptr + kk, x, mask=m)
            xf = x.to(tl.float32)
            dot_p += xf * w
            ss_p += xf * xf
            v = tl.load(blocks_ptr + g_off + kk[None, :], mask=gvalid[:, None] & m[None, :],  # none: no bytes
                        other=0.0).to(tl.float32)
            dot_b += tl.sum(v * w[None, :], axis=1)
            ss_b += tl.sum(v * v, axis=1)
        logit_p = tl.sum(dot_p, axis=0) * tl.rsqrt(tl.sum(ss_p, axis=0) / D + eps)
        logit_b = tl.where(gvalid, dot_b * tl.rsqrt(ss_b / D + eps), float("-inf"))
        top = tl.maximum(logit_p, tl.max(logit_b, axis=0))
        e_p = tl.exp(logit_p - top)
        e_b = tl.exp(logit_b - top)  # 0 on padding rows
        total = e_p + tl.sum(e_b, axis=0)
        p_p = e_p / total
        p_b = e_b / total
        tl.debug_barrier()  # the partial's new value (prefix, or the pushed block) is written
        hss = tl.zeros([CHUNK], dtype=tl.float32)
        for c0 in tl.range(0, D, CHUNK, num_stages=STAGES):
            kk = c0 + cols
            m = kk < D
            if push:
                x = tl.load(blocks_ptr + push_off + kk, mask=m, other=0.0).to(tl.float32)
            else:
                x = tl.load(prefix_ptr + kk, mask=m, other=0.0).to(tl.float32)
            v = tl.load(blocks_ptr + g_off + kk[None, :], mask=gvalid[:, None] & m[None, :],
                        other=0.0).to(tl.float32)
            h = p_p * x + tl.sum(p_b[:, None] * v, axis=0)
            hss += h * h
            tl.store(h_ptr + kk, h, mask=m)
        r = tl.rsqrt(tl.sum(hss, axis=0) / D + eps)
        tl.debug_barrier()
        for c0 in range(0, D, CHUNK):
            kk = c0 + cols
            m = kk < D
            h = tl.load(h_ptr + kk, mask=m, other=0.0)
            y = h * r * tl.load(w_next_ptr + kk, mask=m, other=0.0).to(tl.float32)
            tl.store(x_ptr + kk, round_to(y, x_ptr.dtype.element_ty, INT_ROUND), mask=m)

    @triton.jit
    def _fold_rows(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, ready_ptr, w_mix_ptr, w_next_ptr,
                   stride_block, eps, n_blocks, has_delta, push, w_ptr, scale_ptr, y_ptr, N, stride_w, block,
                   pid, K: tl.constexpr, GROUP: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
                   HAS_SCALE: tl.constexpr, INT_ROUND: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, FIRST_PART: tl.constexpr):
        # rows [block * BLOCK_N, +BLOCK_N) of y = x @ w^T; the first weight tile is loaded before the mix
        # is waited for (program 0, in the first part, runs the mix and releases the others)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        nmask = rn < N
        w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w
        w0 = tl.load(w_rows + rk[None, :], mask=nmask[:, None] & (rk < K)[None, :], other=0.0)
        if FIRST_PART and pid == 0:
            _mix_row(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, w_mix_ptr, w_next_ptr, stride_block,
                     eps, n_blocks, has_delta, push, K, GROUP, CHUNK, STAGES, INT_ROUND)
            tl.debug_barrier()  # all of x is stored before the flag says so
            tl.atomic_xchg(ready_ptr, tl.num_programs(0) - 1, sem="release", scope="gpu")
        else:
            seen = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
            while seen == 0:
                seen = tl.atomic_add(ready_ptr, 0, sem="acquire", scope="gpu")
            tl.atomic_add(ready_ptr, -1, sem="relaxed", scope="gpu")  # the last waiter leaves it at 0
        x = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        acc = w0.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            kk = k0 + rk
            kmask = kk < K
            w = tl.load(w_rows + kk[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            x = tl.load(x_ptr + kk, mask=kmask, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_SCALE:
            y *= tl.load(scale_ptr + rn, mask=nmask, other=0.0)
        tl.store(y_ptr + rn, round_to(y, y_ptr.dtype.element_ty, INT_ROUND), mask=nmask)

    # n_blocks, has_delta and push stay run-time values (not specialized on 0 / 1): one build for them all
    @triton.jit(do_not_specialize=["n_blocks", "has_delta", "push"])
    def _mix_gemv_kernel(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, ready_ptr, w_mix_ptr, w_next_ptr,
                         stride_block, eps, n_blocks, has_delta, push,
                         w0, s0, y0, N0, st0, w1, s1, y1, N1, st1, w2, s2, y2, N2, st2, K: tl.constexpr,
                         GROUP: tl.constexpr, CHUNK: tl.constexpr, STAGES: tl.constexpr,
                         SCALE0: tl.constexpr, SCALE1: tl.constexpr, SCALE2: tl.constexpr,
                         INT_ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # up to three weights read by the mixed row, their programs one after the other in the grid
        # (as k3lab.ops.gemv's stacked kernel); program 0 is the first part's first block
        pid = tl.program_id(0)
        b0 = tl.cdiv(N0, BLOCK_N)
        b1 = tl.cdiv(N1, BLOCK_N)
        if pid < b0:
            _fold_rows(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, ready_ptr, w_mix_ptr, w_next_ptr,
                       stride_block, eps, n_blocks, has_delta, push, w0, s0, y0, N0, st0, pid, pid, K, GROUP,
                       CHUNK, STAGES, SCALE0, INT_ROUND, BLOCK_N, BLOCK_K, True)
        elif pid < b0 + b1:
            _fold_rows(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, ready_ptr, w_mix_ptr, w_next_ptr,
                       stride_block, eps, n_blocks, has_delta, push, w1, s1, y1, N1, st1, pid - b0, pid, K,
                       GROUP, CHUNK, STAGES, SCALE1, INT_ROUND, BLOCK_N, BLOCK_K, False)
        else:
            _fold_rows(prefix_ptr, delta_ptr, blocks_ptr, x_ptr, h_ptr, ready_ptr, w_mix_ptr, w_next_ptr,
                       stride_block, eps, n_blocks, has_delta, push, w2, s2, y2, N2, st2, pid - b0 - b1, pid,
                       K, GROUP, CHUNK, STAGES, SCALE2, INT_ROUND, BLOCK_N, BLOCK_K, False)

    # the autotuner runs the kernel once per candidate shape: the in-place state is put back after; tuned
    # once per set of weights (the mix's sites share the pick), among fold_blocks()
    _mix_gemv_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w) for bn, bk, w in fold_blocks()],
        key=["N0", "N1", "N2", "K"], restore_value=["prefix_ptr", "blocks_ptr"])(_mix_gemv_kernel)


def check_parts(prefix: torch.Tensor, parts) -> list:
    """parts as a list of one to three (weight [N_i, D], row scales or None) pairs that a one-row product
    of the mixed row (prefix's dtype and width) takes (`gemv.gemv_stack`'s rules); ValueError naming the
    bad part."""
    if isinstance(parts, (str, bytes)) or not hasattr(parts, "__iter__"):
        raise ValueError(f"parts must be a list of (weight, scale or None) pairs, got {type(parts).__name__}")
    parts = list(parts)
    if not 1 <= len(parts) <= 3:
        raise ValueError(f"parts must hold one to three (weight, scale) pairs, got {len(parts)}")
    x = prefix[:1]
    for i, part in enumerate(parts):
        if not (isinstance(part, tuple) and len(part) == 2):
            raise ValueError(f"parts[{i}] must be a (weight, scale or None) pair, got {type(part).__name__}")
        try:
            check_product(x, *part)
        except ValueError as e:
            raise ValueError(f"parts[{i}]: {e} (x is the mixed row: prefix's width and dtype)") from None
        if not part[0].shape[0] or not part[0].shape[1]:  # program 0, the mixer, is the first part's
            raise ValueError(f"parts[{i}]: the weight must have rows and columns, got {tuple(part[0].shape)}")
    return parts


def scratch(device: torch.device, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fold's fp32 [D] mixture row and int32 [1] flag on `device` (allocated once; call once before
    capturing a CUDA graph)."""
    key = (str(device), D)
    if key not in _SCRATCH:
        _SCRATCH[key] = (torch.empty(D, dtype=torch.float32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device))
    return _SCRATCH[key]


def launch(prefix, delta, blocks, n_blocks, w_mix, next_norm_w, eps, push_block, parts, blocks_shape=None,
           int_round=None):
    """One launch on checked inputs (`attn_res_norm.mix_gemv`): (x [1, D], [y_i [1, N_i]]).
    blocks_shape: (BLOCK_N, BLOCK_K, warps) to run instead of the autotuner's pick (a GPU) or the
    interpreter's shape (CPU tensors)."""
    D = prefix.shape[1]
    x = torch.empty_like(prefix)
    ys = [torch.empty(1, w.shape[0], dtype=prefix.dtype, device=prefix.device) for w, _ in parts]
    h, ready = scratch(prefix.device, D)
    full = list(parts) + [(parts[0][0][:0], None)] * (3 - len(parts))  # absent parts: no rows, no programs
    ys_full = ys + [ys[0][:, :0]] * (3 - len(ys))
    args = [prefix, delta if delta is not None else prefix, blocks, x, h, ready, w_mix,
            next_norm_w.contiguous(), blocks.stride(0), eps, n_blocks, int(delta is not None),
            int(push_block)]
    for (w, sc), y in zip(full, ys_full):
        args += [w, w if sc is None else sc, y, w.shape[0], w.stride(0)]
    interpreted = env.triton_interpreted()
    common = {"K": D, "GROUP": triton.next_power_of_2(max(n_blocks, 1)),
              "CHUNK": min(MIX_CHUNK, triton.next_power_of_2(D)),
              "STAGES": MIX_STAGES, "INT_ROUND": interpreted if int_round is None else bool(int_round),
              **{f"SCALE{i}": sc is not None for i, (_, sc) in enumerate(full)}}
    programs = lambda bn: sum(triton.cdiv(w.shape[0], bn) for w, _ in full)  # noqa: E731
    if blocks_shape is None and not interpreted:
        _mix_gemv_tuned[lambda meta: (programs(meta["BLOCK_N"]),)](*args, **common)
    else:
        bn, bk, warps = INTERPRETER_SHAPE if blocks_shape is None else blocks_shape
        _mix_gemv_kernel[(programs(bn),)](*args, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **common)
    return x, ys


def reference(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block, parts,
              mix):
    """The plain sequence: `mix` (attn_res_norm's reference) then each product (gemv.reference)."""
    from k3lab.ops.gemv import reference as product

    x = mix(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block)
    return x, [product(x, w, sc) for w, sc in parts]


__all__ = ["FOLD_BLOCKS", "MIX_CHUNK", "MIX_STAGES", "check_parts", "fold_blocks", "launch", "reference",
           "scratch"]
