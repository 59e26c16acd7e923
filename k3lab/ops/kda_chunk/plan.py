"""Where the chunks and groups of a prefill lie (built once on the host), the buffers the launches share,
and the two policies every backend follows: how many chunks per group (or no groups) and how wide the
plain walk's value tiles are."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from k3lab import env
from k3lab.ops import int_arg

from .inputs import CHUNK, HEAD_DIM, MAX_GRID, check_positive_int, int_list


@dataclass
class KdaPlan:
    """Chunk and group tables of sequences packed one after the other (int32 tensors on one device).
    Build with `make_plan`; reuse across calls with the same lengths (no device sync in the timed call)."""

    lengths: list[int]
    heads: int
    group_size: int | None  # chunks per group; None = one group per sequence (the plain walk)
    n_chunks: int
    chunk_tok: torch.Tensor  # [n_chunks] first token of each chunk
    chunk_len: torch.Tensor  # [n_chunks] its tokens (1..64)
    n_groups: int
    grp_chunk0: torch.Tensor  # [n_groups] first chunk of each group
    grp_nchunks: torch.Tensor
    grp_seq: torch.Tensor  # sequence of each group
    grp_last: torch.Tensor  # 1 for a sequence's last group (it writes the final state)
    grp_sum: torch.Tensor  # summary slot of a group, -1 for a sequence's last group
    sum_grp: torch.Tensor  # group of each summary slot
    n_summaries: int
    seq_grp0: torch.Tensor  # [N] first group of each sequence
    seq_ngrp: torch.Tensor
    seq_index: torch.Tensor  # arange(N): the plain walk reads initial_state[n] for group n
    grp_index: torch.Tensor  # arange(n_groups): the replay reads its group's starting state

    @property
    def n_seqs(self) -> int:
        return len(self.lengths)

    @property
    def uses_scan(self) -> bool:
        return self.n_summaries > 0

    @property
    def device(self) -> torch.device:
        return self.chunk_tok.device


def _tables(lengths: list[int], group_size: int | None) -> dict[str, list[int]]:
    t = {name: [] for name in ("chunk_tok", "chunk_len", "grp_chunk0", "grp_nchunks", "grp_seq", "grp_last",
                               "grp_sum", "sum_grp", "seq_grp0", "seq_ngrp")}
    bos = 0
    for n, length in enumerate(lengths):
        nc = -(-length // CHUNK)
        c_first = len(t["chunk_tok"])
        for i in range(nc):
            t["chunk_tok"].append(bos + i * CHUNK)
            t["chunk_len"].append(min(CHUNK, length - i * CHUNK))
        gs = nc if (group_size is None or nc == 0) else min(group_size, nc)
        ng = max(1, -(-nc // gs)) if gs else 1
        t["seq_grp0"].append(len(t["grp_chunk0"]))
        t["seq_ngrp"].append(ng)
        for j in range(ng):
            gidx = len(t["grp_chunk0"])
            t["grp_chunk0"].append(c_first + j * gs)
            t["grp_nchunks"].append(min(gs, nc - j * gs) if gs else 0)
            t["grp_seq"].append(n)
            last = j == ng - 1
            t["grp_last"].append(int(last))
            t["grp_sum"].append(-1 if last else len(t["sum_grp"]))
            if not last:
                t["sum_grp"].append(gidx)
        bos += length
    return t


def make_plan(lengths, heads: int, group_size: int | None = None, device=None) -> KdaPlan:
    """Tables for sequences of `lengths` tokens (packed one after the other), `heads` heads and
    `group_size` chunks per group (None: the whole sequence, i.e. the plain walk, no scan)."""
    lengths = int_list("lengths", lengths)
    check_positive_int("heads", heads)
    check_positive_int("group_size", group_size, allow_none=True)
    t = _tables(lengths, group_size)
    if len(t["grp_chunk0"]) > MAX_GRID:
        raise ValueError(f"{len(t['grp_chunk0'])} groups: the launch grids take at most {MAX_GRID} "
                         f"(a larger group_size or fewer sequences)")

    def it(xs):
        return torch.tensor(xs if xs else [0], dtype=torch.int32, device=device)

    n_groups = len(t["grp_chunk0"])
    return KdaPlan(
        lengths=lengths, heads=heads, group_size=group_size, n_chunks=len(t["chunk_tok"]),
        chunk_tok=it(t["chunk_tok"]), chunk_len=it(t["chunk_len"]), n_groups=n_groups,
        grp_chunk0=it(t["grp_chunk0"]), grp_nchunks=it(t["grp_nchunks"]), grp_seq=it(t["grp_seq"]),
        grp_last=it(t["grp_last"]), grp_sum=it(t["grp_sum"]), sum_grp=it(t["sum_grp"]),
        n_summaries=len(t["sum_grp"]), seq_grp0=it(t["seq_grp0"]), seq_ngrp=it(t["seq_ngrp"]),
        seq_index=it(list(range(len(lengths)))), grp_index=it(list(range(n_groups))),
    )


def check_plan(plan: KdaPlan, lengths: list[int], heads: int, device: torch.device) -> None:
    """ValueError unless `plan` was made for these sequence lengths, heads and device."""
    if not isinstance(plan, KdaPlan):
        raise ValueError(f"plan must be a KdaPlan (make_plan), got {type(plan).__name__}")
    if plan.lengths != lengths or plan.heads != heads:
        raise ValueError(f"plan was made for lengths {plan.lengths[:4]}... and {plan.heads} heads, not for "
                         f"these inputs (lengths {lengths[:4]}..., {heads} heads)")
    if plan.device != device:
        raise ValueError(f"plan's tables are on {plan.device} but q is on {device} (make_plan(device=...))")


@dataclass
class Work:
    """The prologue's outputs, which the walks read; reused between calls of one shape (allocation is
    not part of what the study times). Layout [n_chunks, H, ...], the inputs' dtype except d (fp32).
    r and flags are the Triton prologue's scratch (Akk then R in fp32; which chunks need the exact path)."""

    w: torch.Tensor  # [n, H, 64, 128]  R diag(beta) (K e^G)
    u: torch.Tensor  # [n, H, 64, 128]  R diag(beta) V
    qg: torch.Tensor  # [n, H, 64, 128]  scale Q e^G
    kdt: torch.Tensor  # [n, H, 128, 64]  (K e^(G_last - G))^T
    aqk: torch.Tensor  # [n, H, 64, 64]
    d: torch.Tensor  # [n, H, 128]  e^(G_last), fp32
    r: torch.Tensor | None = None
    flags: torch.Tensor | None = None

    def r_buffer(self) -> torch.Tensor:
        if self.r is None:
            self.r = torch.empty(*self.w.shape[:2], CHUNK, CHUNK, dtype=torch.float32, device=self.w.device)
        return self.r

    def flag_buffer(self) -> torch.Tensor:
        if self.flags is None:
            self.flags = torch.zeros(*self.w.shape[:2], dtype=torch.int32, device=self.w.device)
        return self.flags


def alloc_work(n_chunks: int, heads: int, dtype: torch.dtype, device) -> Work:
    n, C, K = max(1, n_chunks), CHUNK, HEAD_DIM
    return Work(
        w=torch.empty(n, heads, C, K, dtype=dtype, device=device),
        u=torch.empty(n, heads, C, K, dtype=dtype, device=device),
        qg=torch.empty(n, heads, C, K, dtype=dtype, device=device),
        kdt=torch.empty(n, heads, K, C, dtype=dtype, device=device),
        aqk=torch.empty(n, heads, C, C, dtype=dtype, device=device),
        d=torch.empty(n, heads, K, dtype=torch.float32, device=device),
    )


def check_work(work: Work, plan: KdaPlan, dtype: torch.dtype, device: torch.device) -> None:
    """ValueError unless `work` holds at least the plan's chunks and heads in this dtype and device."""
    if not isinstance(work, Work):
        raise ValueError(f"work must be a Work (alloc_work), got {type(work).__name__}")
    n, H = work.w.shape[:2]
    if n < max(1, plan.n_chunks) or H != plan.heads or work.w.dtype != dtype or work.w.device != device:
        raise ValueError(f"work holds {n} chunks x {H} heads of {work.w.dtype} on {work.w.device}; this call "
                         f"needs {plan.n_chunks} x {plan.heads} of {dtype} on {device}")


def walk_programs(n_seqs: int, heads: int, block_v: int = 64, v_dim: int = HEAD_DIM) -> int:
    """Programs the plain walk launches: one per (sequence, head, value tile)."""
    int_arg("n_seqs", n_seqs)
    for name, v in (("heads", heads), ("block_v", block_v), ("v_dim", v_dim)):
        check_positive_int(name, v)
    return n_seqs * heads * (v_dim // block_v)


def choose_block_v(n_seqs: int, heads: int, compute_units: int | None = None) -> int:
    """Value-tile width of the Triton plain walk: 64 columns once that gives every compute unit a
    program, else 32 (twice the programs on an idle GPU). The figures are in docs/kda_scan.md."""
    units = compute_units if compute_units is not None else env.detect().compute_units
    return 64 if walk_programs(n_seqs, heads, 64) >= units else 32


def choose_group_size(lengths, heads: int, compute_units: int | None = None, block_v: int = 64,
                      fill: float = 2.0, min_group: int = 4, min_chunks: int = 96) -> int | None:
    """Chunks per group for the group scan, or None for the plain walk.

    The plain walk has P = sequences x heads x (V / block_v) programs. If P already gives every compute
    unit one program (P >= units), the GPU is busy and the scan's extra passes (a summary walk over K + V
    columns, the scan, two more launches) cost more than they save: plain walk. Otherwise split each
    sequence into about fill x units / P groups, so that the replay has ~fill programs per unit, but
    never into groups shorter than the depth-optimal sqrt(n_chunks / 2) (the critical path is
    2 x group + n_groups chunk steps) nor than `min_group` chunks. A sequence shorter than `min_chunks`
    walks plainly even on an idle GPU (the break-even: docs/kda_scan.md)."""
    units = compute_units if compute_units is not None else env.detect().compute_units
    lengths = int_list("lengths", lengths)
    n_chunks = max((-(-x // CHUNK) for x in lengths), default=0)
    P = walk_programs(len(lengths), heads, block_v)
    if P >= units or n_chunks < max(min_chunks, 2 * min_group + 1):
        return None
    want_groups = max(1, math.ceil(fill * units / P))
    gs = max(min_group, math.ceil(math.sqrt(n_chunks / 2)), math.ceil(n_chunks / want_groups))
    return None if gs >= n_chunks else gs
