"""Chunked KDA prefill (seed section 5): the plain chunk walk ("before") and the group scan ("after").

KDA's state after a chunk depends on the state before it, so a prefill walks its chunks one after
another. With few sequences and heads (B = 1 at TP8: 12 heads, two 64-wide value tiles each) most of a
GPU's units idle while a few programs each walk the 256 chunks of a 16K-token prompt. Both variants start
with the chunk prologue, every (chunk, head) in parallel: the state-independent W, U, Qg, Kd^T, Aqk, d
(`scan_math.ChunkQuantities`; the 64 x 64 inverse inside it in fp32, as the seed asks).

* before (`kda_chunk_before`, 2 launches): prologue, then the walk: one program per (sequence, head,
  value tile) keeps its state tile on chip and computes E = U - W S, O = Qg S + Aqk E,
  S = diag(d) S + Kd^T E chunk after chunk.
* after (`kda_chunk_after`, 4 launches): prologue; summaries (every group of `group_size` chunks composes
  its affine chunk maps S_out = A_c S_in + B_c into one map, all groups in parallel); the scan (the
  groups' maps applied in order: every group's starting state in n_groups steps, not n_chunks); the
  replay (every group walks its own chunks from its starting state, in parallel). The extra work pays
  only while the plain walk leaves the GPU idle: `choose_group_size` decides, and falls back to the
  plain walk when the GPU is already full.

Contract: q, k [B, T, H, 128] and v [B, T, H, 128] of one dtype (bf16, fp16 or fp32), contiguous;
g [B, T, H, 128] fp32 log-decay (<= 0); beta [B, T, H] fp32; initial_state [N, H, 128, 128] fp32 or
None (zeros); cu_seqlens [N + 1] packs variable-length sequences as B = 1 (FlashAttention's convention),
else N = B. Returns (o [B, T, H, 128] in q's dtype, final state [N, H, 128, 128] fp32). Bad arguments
raise ValueError before any kernel runs, a NaN or infinity in k, v, g or beta included (in chunks it
would reach the earlier tokens of its chunk: `inputs`), at one device sync per call. Precision:
`inputs.dot_precisions`.

Backends (`BACKENDS`, k3lab.ops' contract: tried in priority order; `backend=` or K3LAB_KDA_CHUNK_BACKEND
forces one by name; each provides 'before' and 'after', the whole prefill, and the kernel rows the
launches 'prologue', 'summaries' and 'replay'):
  'cuda'   kernels/kda_chunk_prologue.cu and kda_chunk_walk.cu (`cuda`): the prologue in one launch, the
           summaries and the replay; bf16 on NVIDIA GPUs. The scan and the plain walk stay Triton (why:
           docs/kda_scan.md).
  'triton' the Triton 'rows' prologue (`prologue`), walks (`walk`) and scan (`scan`): any GPU Triton
           compiles for, and the CPU through Triton's interpreter (fp32 there: its bf16 dots are wrong).
  'torch'  the plain-PyTorch reference (k3lab.nn.kda.kda_chunked in fp32), before and after alike; any
           device, last in priority; no launches of its own, so `after_launches` and
           `kda_chunk_prologue` take the kernel rows only.
On ROCm the Triton backend runs; it has not yet been run on AMD hardware by this project.
Figures and the forms that lost: docs/kda_scan.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from k3lab.nn.kda import kda_chunked
from k3lab.ops import Backend, Backends, triton_available

from . import cuda, prologue, scan, walk
from .inputs import CHUNK, HEAD_DIM, SAFE_SPREAD, validate
from .plan import (KdaPlan, Work, alloc_work, check_plan, check_work, choose_block_v, choose_group_size,
                   make_plan, walk_programs)



def _cuda_prologue(q, k, v, g, beta, plan, scale, work) -> dict[str, Callable[[], None]]:
    return {"prologue": lambda: cuda.prologue(q, k, v, g, beta, plan, scale, work)}


def _triton_replay(work, plan, o, s_final, s_in) -> None:
    walk.walk(work, plan, o, s_final, s_in, plan.grp_index)


def _kernels(q, k, v, g, beta, initial_state, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    # a kernel row's before and after alike: the call's plan says walk (no groups) or group scan
    return _run(_launches(q, k, v, g, beta, initial_state, call))


def _reference(q, k, v, g, beta, initial_state, call: _Call) -> tuple[torch.Tensor, torch.Tensor]:
    """The 'torch' row: k3lab.nn.kda.kda_chunked in fp32, sequence by sequence (the plan's bounds), into
    the call's o and final state; an empty sequence hands its initial state back."""
    bos = 0  # B > 1: sequence n is row n; B = 1: the sequences follow one another (cu_seqlens)
    for n, length in enumerate(call.plan.lengths):
        rows, toks = (slice(n, n + 1), slice(0, length)) if q.shape[0] > 1 else (slice(0, 1),
                                                                                   slice(bos, bos + length))
        bos += length
        s0 = None if initial_state is None else initial_state[n:n + 1].float()
        if not length:
            call.s_final[n] = 0 if s0 is None else s0[0]
            continue
        o, s = kda_chunked(*(t[rows, toks].float() for t in (q, k, v, g, beta)), scale=call.scale,
                           initial_state=s0)
        call.o[rows, toks] = o.to(call.o.dtype)
        call.s_final[n] = s[0]
    return call.o, call.s_final


# parts: 'prologue' (q, k, v, g, beta, plan, scale, work) -> {name: launch}; 'summaries' (work, plan, sums);
# 'replay' (work, plan, o, s_final, s_in); 'before' / 'after' (q, k, v, g, beta, initial_state, call) ->
# (o, final state), the whole prefill on a prepared call. verify: (q, k, v, g, beta, plan) -> (ok, why).
# 'torch' is the plain-PyTorch reference (k3lab.nn.kda.kda_chunked in fp32), before and after alike, on
# any device, last in priority; it has no launches (after_launches and the prologue alone need a kernel row).
BACKENDS = Backends(
    "kda_chunk",
    Backend("cuda", 0, cuda.available, cuda.verify,
            parts={"prologue": _cuda_prologue, "summaries": cuda.summaries, "replay": cuda.replay,
                   "before": _kernels, "after": _kernels}),
    Backend("triton", 1, triton_available,
            parts={"prologue": prologue.launches, "summaries": walk.summaries, "replay": _triton_replay,
                   "before": _kernels, "after": _kernels}),
    Backend("torch", 2, lambda: (True, "the PyTorch reference (k3lab.nn.kda.kda_chunked in fp32)"),
            parts={"before": _reference, "after": _reference}),
)
BACKEND_ENV = BACKENDS.env


@dataclass
class _Call:
    plan: KdaPlan
    work: Work
    row: Backend  # the chosen backend's row
    scale: float
    o: torch.Tensor | None  # None for the prologue alone
    s_final: torch.Tensor | None


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, *, scan_groups: bool, group_size, plan, work,
             backend, need: str, check_values=True, outputs=True) -> _Call:
    """Validate once per call (reading cu_seqlens and the values waits for the GPU), build or check plan
    and work, pick the backend and allocate the outputs. scan_groups: the after (a plan with groups
    where `choose_group_size` says they pay) rather than the before (a plan without groups); outputs:
    allocate o and the final state (not for the prologue alone); need: the callable the caller will
    call on the chosen row ('before', 'after', or 'prologue' for launches)."""
    lengths, H, scale = validate(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                 check_values=check_values)
    if plan is None:
        if scan_groups and group_size is None:
            group_size = choose_group_size(lengths, H)
        plan = make_plan(lengths, H, group_size if scan_groups else None, device=q.device)
    else:
        if group_size is not None:
            raise ValueError("give group_size or plan, not both: the plan fixes the groups")
        check_plan(plan, lengths, H, q.device)
        if not scan_groups and plan.uses_scan:
            raise ValueError("plan uses groups (a scan plan); kda_chunk_before needs a plan with "
                             "group_size=None")
    row = BACKENDS.pick(backend, q, k, v, g, beta, plan, need=need)
    if work is None and row.provides("prologue"):  # the reference row launches nothing: no work buffers
        work = alloc_work(plan.n_chunks, H, q.dtype, q.device)
    elif work is not None:
        check_work(work, plan, q.dtype, q.device)
    if not outputs:
        return _Call(plan, work, row, scale, None, None)
    o = torch.empty(q.shape[0], q.shape[1], H, HEAD_DIM, dtype=q.dtype, device=q.device)
    s_final = torch.empty(plan.n_seqs, H, HEAD_DIM, HEAD_DIM, dtype=torch.float32, device=q.device)
    return _Call(plan, work, row, scale, o, s_final)


def launches(row, q, k, v, g, beta, initial_state, plan: KdaPlan, scale: float, work: Work, o, s_final
             ) -> dict[str, Callable]:
    """The launches of backend `row` (a row of BACKENDS) on checked inputs and fixed buffers, in order:
    'prologue', then 'walk' (a plan without groups) or 'summaries', 'scan', 'replay', and 'result' ->
    (o, s_final). Nothing is checked here (`after_launches` checks, then calls this)."""
    pro = row.prologue(q, k, v, g, beta, plan, scale, work) if plan.n_chunks else {}

    def run_prologue():
        for launch in pro.values():
            launch()

    out = {"prologue": run_prologue}
    if not plan.uses_scan:
        out["walk"] = lambda: walk.walk(work, plan, o, s_final, initial_state, plan.seq_index)
    else:
        sums, s_in = scan.buffers(plan, q.device)
        out["summaries"] = lambda: row.summaries(work, plan, sums)
        out["scan"] = lambda: scan.scan(plan, sums, s_in, initial_state, q.dtype)
        out["replay"] = lambda: row.replay(work, plan, o, s_final, s_in)
    out["result"] = lambda: (o, s_final)
    return out


def _launches(q, k, v, g, beta, initial_state, call: _Call) -> dict[str, Callable]:
    return launches(call.row, q, k, v, g, beta, initial_state, call.plan, call.scale, call.work, call.o,
                    call.s_final)


def _run(launches: dict) -> tuple[torch.Tensor, torch.Tensor]:
    *steps, result = launches.values()  # 'result' is last
    for launch in steps:
        launch()
    return result()


def kda_chunk_before(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, *,
                     plan: KdaPlan | None = None, work: Work | None = None, backend: str | None = None,
                     check_values: bool = True):
    """Chunked KDA prefill by the plain walk (2 launches: prologue, walk). Returns (o, final state).
    plan: `make_plan(lengths, H)` (group_size None) to reuse across calls; work: `alloc_work` buffers to
    reuse; backend: a name in BACKENDS, None for the first that runs here. check_values: refuse a NaN or
    infinity in k, v, g or beta (one device sync); False where the caller made them (a study's inputs)."""
    call = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, scan_groups=False, group_size=None,
                    plan=plan, work=work, backend=backend, need="before", check_values=check_values)
    return call.row.before(q, k, v, g, beta, initial_state, call)


def kda_chunk_after(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, *,
                    group_size: int | None = None, plan: KdaPlan | None = None, work: Work | None = None,
                    backend: str | None = None, check_values: bool = True):
    """Chunked KDA prefill by the group scan (4 launches: prologue, summaries, scan, replay), or the plain
    walk when the plan has no groups (`choose_group_size` says the GPU is already full). Same arguments and
    results as `kda_chunk_before`, plus group_size (chunks per group; None: `choose_group_size`; give it
    or a plan, not both)."""
    call = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, scan_groups=True,
                    group_size=group_size,
                    plan=plan, work=work, backend=backend, need="after", check_values=check_values)
    return call.row.after(q, k, v, g, beta, initial_state, call)


def after_launches(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, *, plan: KdaPlan,
                   work: Work | None = None, backend: str | None = None) -> dict[str, Callable]:
    """The after's launches as callables on fixed buffers, for timing or profiling each one: 'prologue',
    then 'summaries', 'scan', 'replay' (or 'walk' for a plan without groups), and 'result' -> (o, final
    state). Run them in that order: each reads what the previous wrote. The arguments, values included,
    are checked here, when the launches are bound; the callables (and a CUDA graph of them) do not check
    again, so what is later written into the same tensors is the caller's to keep finite."""
    call = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens, scan_groups=True, group_size=None,
                    plan=plan, work=work, backend=backend, need="prologue")
    return _launches(q, k, v, g, beta, initial_state, call)


def kda_chunk_prologue(q, k, v, g, beta, plan: KdaPlan, scale: float | None = None, work: Work | None = None,
                       *,
                       backend: str | None = None) -> Work:
    """The chunk prologue alone, into `work` (allocated when None): W, U, Qg, Kd^T, Aqk, d per (chunk,
    head), layout [n_chunks, H, ...] (`Work`). For checks and timing; the prefill functions run it."""
    if plan is None:
        raise ValueError("the prologue needs a plan (make_plan)")
    call = _prepare(q, k, v, g, beta, scale, None, None, scan_groups=True, group_size=None, plan=plan,
                    work=work, backend=backend, need="prologue", outputs=False)
    if plan.n_chunks:
        for launch in call.row.prologue(q, k, v, g, beta, plan, call.scale, call.work).values():
            launch()
    return call.work


VARIANTS = {"before": kda_chunk_before, "after": kda_chunk_after}


def kda_chunk(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, *, variant: str = "after",
              group_size: int | None = None, plan: KdaPlan | None = None, work: Work | None = None,
              backend: str | None = None, check_values: bool = True):
    """One entry point: variant 'before' (plain walk) or 'after' (group scan where it pays)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {tuple(VARIANTS)}, got {variant!r}")
    fn = VARIANTS[variant]
    options = {"plan": plan, "work": work, "backend": backend, "check_values": check_values}
    if group_size is not None:
        if fn is kda_chunk_before:
            raise ValueError("group_size is an option of variant='after'; the before walks whole sequences")
        options["group_size"] = group_size
    return fn(q, k, v, g, beta, scale, initial_state, cu_seqlens, **options)


__all__ = [
    "BACKENDS", "BACKEND_ENV", "CHUNK", "HEAD_DIM", "SAFE_SPREAD", "VARIANTS", "KdaPlan", "Work",
    "after_launches", "alloc_work", "choose_block_v", "choose_group_size",
    "kda_chunk", "kda_chunk_after", "kda_chunk_before", "kda_chunk_prologue", "launches", "make_plan",
    "walk_programs",
]
