"""Bindings for the hand-written NVIDIA kernels of KDA prefill (each call packs the arguments and launches
on the current stream, so it can be captured in a CUDA graph):

* kernels/kda_chunk_prologue.cu: the whole chunk prologue in one launch (`prologue`), the same quantities as
  the Triton 'rows' prologue's three launches;
* kernels/kda_chunk_walk.cu: the group scan's two walking launches, the summaries (`summaries`) and the replay
  (`replay`), the same work as the Triton walks with the next chunk's operands copied in while the
  current one is computed.

They take bf16 q, k, v with K = V = 128, fp32 g and beta, contiguous and 16-byte aligned, on an NVIDIA
GPU of compute capability 8.0 or later (cp.async, tf32 and bf16 mma.sync). `available()` says whether
both kernels build and load here, `verify()` whether they take a call's tensors (k3lab.ops' contract).
Their HIP builds are stubs (AMD would need its own MFMA kernels): not yet run on AMD hardware by this
project.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from k3lab import env
from k3lab.ops import _build

from .inputs import MAX_GRID, SAFE_SPREAD, WHILE
from .plan import KdaPlan, Work

PROLOGUE, WALK = "kda_chunk_prologue", "kda_chunk_walk"
MIN_CAPABILITY = (8, 0)
_ERRORS = {-3: "needs more shared memory per block than the device allows", -4: "bad sizes",
           -5: "this build has no kernel (HIP or an unsupported target)", -6: "no such form built"}
_WORK = ("w", "u", "qg", "kdt", "aqk", "d")
_WALK_POINTERS = (*_WORK, "chunk_tok", "chunk_len", "grp_chunk0", "grp_nchunks", "grp_seq", "grp_sin",
                  "grp_last",
                  "sum_grp", "s_in", "o", "s_final", "sum_n", "sum_b", "sum_d")


class PrologueArgs(ctypes.Structure):
    """kernels/kda_chunk_prologue.cu's k3kp::Args, field by field (its size is checked against the
    library's)."""

    _fields_ = [
        (name, ctypes.c_void_p) for name in ("q", "k", "v", "g", "beta", "chunk_tok", "chunk_len", *_WORK)
    ] + [
        ("n_chunks", ctypes.c_int),
        ("H", ctypes.c_int),
        ("scale", ctypes.c_float),
        ("spread", ctypes.c_float),
    ]


class WalkArgs(ctypes.Structure):
    """kernels/kda_chunk_walk.cu's k3kw::Args, field by field (its size is checked against the library's)."""

    _fields_ = [(name, ctypes.c_void_p) for name in _WALK_POINTERS] + [("n_items", ctypes.c_int),
                                                                       ("H", ctypes.c_int)]


@functools.cache
def _prologue_library() -> ctypes.CDLL:
    lib = _build.load(PROLOGUE)
    lib.k3_kda_chunk_prologue.restype = ctypes.c_int
    lib.k3_kda_chunk_prologue.argtypes = [ctypes.POINTER(PrologueArgs), ctypes.c_int, ctypes.c_void_p]
    return _build.check_library(lib, PROLOGUE, PrologueArgs)


@functools.cache
def _walk_library() -> ctypes.CDLL:
    lib = _build.load(WALK)
    lib.k3_kda_chunk_walk.restype = ctypes.c_int
    lib.k3_kda_chunk_walk.argtypes = [ctypes.POINTER(WalkArgs), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                ctypes.c_void_p]
    return _build.check_library(lib, WALK, WalkArgs)


@functools.cache
def available() -> tuple[bool, str]:
    """(True, what runs) when both kernels build and load for this machine's GPU; else (False, why).
    Builds on first call (tens of seconds), then reads the cache."""
    instead = "the Triton prologue and walks run instead"
    if WHILE:
        return False, f"Triton's interpreter (no GPU): {instead}"
    note = f"has no AMD kernel (a stub, {_build.NOT_RUN_ON_AMD})"
    why = []
    for name, lib in ((PROLOGUE, _prologue_library), (WALK, _walk_library)):
        ok, msg = _build.cuda_status(name, lib, instead=instead, min_capability=MIN_CAPABILITY,
                                     needs=" (cp.async, tf32 and bf16 mma)", hip_note=note)
        if not ok:
            return False, msg
        why.append(msg)
    return True, "; ".join(why)


def verify(q, k, v, g, beta, plan: KdaPlan) -> tuple[bool, str]:
    """(True, '') when the kernels take these (validated) tensors and plan; else (False, why)."""
    if not q.is_cuda:
        return False, "the tensors are not on a CUDA device"
    if q.dtype != torch.bfloat16:
        return False, f"the kernels take bf16 q, k, v (got {q.dtype}: the Triton backend takes it)"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.data_ptr() % 16:
            return False, f"{name} is not 16-byte aligned (the kernels copy 16 bytes at a time)"
    if max(plan.n_groups, plan.n_summaries) > MAX_GRID:
        groups = max(plan.n_groups, plan.n_summaries)
        return False, f"{groups} groups: the walk kernel takes at most {MAX_GRID}"
    return True, ""


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{name}.cu refused the launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")


def prologue(q, k, v, g, beta, plan: KdaPlan, scale: float, work: Work) -> None:
    """The chunk prologue into work (w, u, qg, kdt, aqk, d), one launch, grid (n_chunks, H)."""
    ptr = [t.data_ptr() for t in (q, k, v, g, beta, plan.chunk_tok, plan.chunk_len)]
    ptr += [getattr(work, name).data_ptr() for name in _WORK]
    a = PrologueArgs(*ptr, int(plan.n_chunks), int(plan.heads), float(scale), float(SAFE_SPREAD))
    idx = _device_index(q)
    rc = _prologue_library().k3_kda_chunk_prologue(ctypes.byref(a), _build.max_shared_optin(idx),
                                             ctypes.c_void_p(_build.stream_handle(idx)))
    _check(rc, PROLOGUE)


def replay_tiles(blocks_with_two: int) -> int:
    """State tiles per replay block: two (W, Qg, Aqk and Kd^T read once for both 64-column halves, twice
    the work between barriers) once that still gives every compute unit a block, else one (twice the
    blocks). Figures: docs/kda_scan.md."""
    return 2 if blocks_with_two >= env.detect().compute_units else 1


def _walk(ptrs: dict, items: int, heads: int, replay: bool, device: torch.device) -> None:
    tiles = replay_tiles(items * heads) if replay else 1
    a = WalkArgs(*(ptrs.get(name, 0) for name in _WALK_POINTERS), int(items), int(heads))
    idx = device.index if device.index is not None else torch.cuda.current_device()
    rc = _walk_library().k3_kda_chunk_walk(ctypes.byref(a), int(replay), tiles, _build.max_shared_optin(idx),
                                     ctypes.c_void_p(_build.stream_handle(idx)))
    _check(rc, WALK)


def replay(work: Work, plan: KdaPlan, o: torch.Tensor, s_final: torch.Tensor, s_in: torch.Tensor) -> None:
    """Walk every group of `plan` from its starting state s_in[group] (the scan's output), writing o
    [tokens, H, 128] bf16 and, from each sequence's last group, s_final. One launch."""
    ptrs = {name: getattr(work, name).data_ptr() for name in _WORK}
    for name, t in (("chunk_tok", plan.chunk_tok), ("chunk_len", plan.chunk_len),
                    ("grp_chunk0", plan.grp_chunk0),
                    ("grp_nchunks", plan.grp_nchunks), ("grp_seq", plan.grp_seq), ("grp_sin", plan.grp_index),
                    ("grp_last", plan.grp_last), ("o", o), ("s_final", s_final), ("s_in", s_in)):
        ptrs[name] = t.data_ptr()
    _walk(ptrs, plan.n_groups, plan.heads, True, o.device)


def summaries(work: Work, plan: KdaPlan, sums: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Every non-last group's summary into sums = (N, b, D) (`scan.buffers`' layout). One launch."""
    ptrs = {name: getattr(work, name).data_ptr() for name in _WORK}
    for name, t in (("grp_chunk0", plan.grp_chunk0), ("grp_nchunks", plan.grp_nchunks),
                    ("sum_grp", plan.sum_grp),
                    ("sum_n", sums[0]), ("sum_b", sums[1]), ("sum_d", sums[2])):
        ptrs[name] = t.data_ptr()
    _walk(ptrs, plan.n_summaries, plan.heads, False, sums[0].device)
