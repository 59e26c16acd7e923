"""Binding for kernels/kda_walk.cu, the hand-written walks of the group scan (one job: pack the
arguments, launch on the current stream).

`k3lab.ops.kda_chunk` runs it as its 'cuda' walk: the summaries (every non-last group's D, N, b)
and the replay (each group's chunks from its starting state, writing o and the final state), the
same work as its Triton `_summary_kernel` and `_walk_kernel`, with the next chunk's operands copied
in while the current one is computed. `status()` says whether it can run here and, if not, why;
`supports()` whether it takes a call's tensors (bf16 prologue outputs, K = V = 128, an NVIDIA GPU of
compute capability 8.0 or later). The source also compiles as HIP, where it is a stub (AMD would
need its own MFMA kernel): not yet run on AMD hardware by this project.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from k3lab import env
from k3lab.ops import _build

NAME = "kda_walk"
HEAD_DIM = 128
MIN_CAPABILITY = (8, 0)  # cp.async and bf16 mma.sync
MAX_ITEMS = 65535  # groups or summary slots: the grid's third dimension
# the launch forms, {replay: value}: chunks in shared memory at once (2; 3 with one tile; summaries with
# one tile also 4) and 64-column state tiles per block (1 or 2; None: `replay_tiles`). H200, 12 heads x
# 16K tokens, group scan of 24-chunk groups (profiles/nvidia-h200/kda_scan/extra/walk_bench_*): replay
# 115 us with two tiles against 137 with one; summaries 124 with one against 126 with two; a third
# stage did not help either (147 and 137).
STAGES = {True: 2, False: 2}
TILES = {True: None, False: 1}

_ERRORS = {-3: "needs more shared memory per block than the device allows", -6: "no such form (stages, tiles) built",
           -4: f"bad sizes (1 <= items <= {MAX_ITEMS}, 1 <= H <= 65535)",
           -5: "this build has no kernel (HIP or an unsupported target)"}
_POINTERS = ("w", "u", "qg", "kdt", "aqk", "d", "chunk_tok", "chunk_len", "grp_chunk0", "grp_nchunks", "grp_seq",
             "grp_sin", "grp_last", "sum_grp", "s_in", "o", "s_final", "sum_n", "sum_b", "sum_d")


class Args(ctypes.Structure):
    """kernels/kda_walk.cu's k3kw::Args, field by field (its size is checked against the library's)."""

    _fields_ = [(name, ctypes.c_void_p) for name in _POINTERS] + [("n_items", ctypes.c_int), ("H", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.k3_kda_walk.restype = ctypes.c_int
    lib.k3_kda_walk.argtypes = [ctypes.POINTER(Args)] + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    lib.k3_kda_walk_smem.argtypes = [ctypes.c_int] * 3
    _build.check_library(lib, NAME, Args, ("k3_kda_walk_smem", "k3_kda_walk_regs"))
    return lib


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


def status() -> tuple[bool, str]:
    """(True, what runs) when the kernel can run here; else (False, why). Builds on first call."""
    return _build.cuda_status(NAME, _library, instead="the Triton walks run instead",
                              min_capability=MIN_CAPABILITY, needs=" (cp.async, bf16 mma)",
                              hip_note=f"has no AMD kernel (a stub, {_build.NOT_RUN_ON_AMD})")


@functools.cache
def available() -> bool:
    return status()[0]


def registers(replay: bool) -> int:
    """Registers per thread of the compiled replay (or summaries) kernel."""
    return _library().k3_kda_walk_regs(int(replay))


def shared_bytes(replay: bool, tiles: int = 2) -> int:
    return _library().k3_kda_walk_smem(int(replay), STAGES[bool(replay)], TILES[bool(replay)] or tiles)


def supports(q, items: int) -> str | None:
    """None when the kernel walks for inputs like q (the prologue outputs share its dtype) and `items`
    groups or summary slots; else why not (a sentence)."""
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if q.dtype != torch.bfloat16:
        return f"the kernel walks bf16 prologue outputs (inputs are {q.dtype}: the Triton walks take those)"
    if q.shape[-1] != HEAD_DIM:
        return f"the kernel is compiled for K = V = {HEAD_DIM}"
    if not 1 <= items <= MAX_ITEMS:
        return f"{items} groups or summaries: the kernel takes 1 to {MAX_ITEMS}"
    return None


def replay_tiles(blocks_with_two: int) -> int:
    """State tiles per replay block: two (the A operands read once for both halves, twice the work
    between barriers) once that still gives every compute unit a block, else one (twice the blocks:
    the plain walk of 12 heads, 12 blocks, took 1139 us with two tiles against 686 with one)."""
    return 2 if blocks_with_two >= env.detect().compute_units else 1


def _launch(ptrs: dict, items: int, heads: int, replay: bool, device: torch.device) -> None:
    lib = _library()
    tiles = TILES[replay] or replay_tiles(items * heads)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    a = Args(*(ptrs.get(name, 0) for name in _POINTERS), int(items), int(heads))
    rc = lib.k3_kda_walk(ctypes.byref(a), int(replay), STAGES[replay], tiles,
                         _build.max_shared_optin(idx),
                         ctypes.c_void_p(_build.stream_handle(idx)))
    if rc != 0:
        raise RuntimeError(f"kda_walk.cu refused the launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")


def _work_ptrs(work) -> dict:
    return {name: getattr(work, name).data_ptr() for name in ("w", "u", "qg", "kdt", "aqk", "d")}


def replay(work, plan, o, s_final, s_in, sin_index, heads: int) -> None:
    """Walk every group of `plan` from its starting state (s_in[sin_index[group]], zeros when s_in is
    None), writing o [tokens, H, 128] bf16 and, for each sequence's last group, s_final. One launch on
    the current stream (capturable in a CUDA graph)."""
    ptrs = _work_ptrs(work)
    for name, t in (("chunk_tok", plan.chunk_tok), ("chunk_len", plan.chunk_len), ("grp_chunk0", plan.grp_chunk0),
                    ("grp_nchunks", plan.grp_nchunks), ("grp_seq", plan.grp_seq), ("grp_sin", sin_index),
                    ("grp_last", plan.grp_last), ("o", o), ("s_final", s_final)):
        ptrs[name] = t.data_ptr()
    if s_in is not None:
        if s_in.dtype != torch.float32 or not s_in.is_contiguous():
            raise ValueError(f"s_in must be a contiguous fp32 tensor, got {s_in.dtype}")
        ptrs["s_in"] = s_in.data_ptr()
    _launch(ptrs, plan.n_groups, heads, True, o.device)


def summaries(work, plan, sums, heads: int) -> None:
    """Every non-last group's summary (sums = (N, b, D), kda_chunk's layout). One launch."""
    sum_n, sum_b, sum_d = sums
    ptrs = _work_ptrs(work)
    for name, t in (("grp_chunk0", plan.grp_chunk0), ("grp_nchunks", plan.grp_nchunks), ("sum_grp", plan.sum_grp),
                    ("sum_n", sum_n), ("sum_b", sum_b), ("sum_d", sum_d)):
        ptrs[name] = t.data_ptr()
    _launch(ptrs, plan.n_summaries, heads, False, sum_n.device)
