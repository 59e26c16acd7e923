"""Binding for kernels/kda_prologue.cu, the hand-written chunk prologue of chunked KDA (one job: pack
the arguments, launch on the current stream).

`k3lab.ops.kda_chunk` runs it as its 'cuda' prologue: the same per-chunk quantities as the Triton
'rows' prologue (Qg, Kd^T, d, Aqk, W, U), in one launch instead of three. `status()` says whether it
can run here and, if not, why; `supports()` whether it takes given tensors (bf16 q, k, v with
K = V = 128, fp32 g and beta, contiguous, on an NVIDIA GPU of compute capability 8.0 or later).
The source also compiles as HIP, where it is a stub (AMD would need its own MFMA kernel): not yet
run on AMD hardware by this project.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from k3lab.ops import _build

NAME = "kda_prologue"
HEAD_DIM = 128
MIN_CAPABILITY = (8, 0)  # cp.async and tf32 mma.sync
_ERRORS = {-3: "needs more shared memory per block than the device allows", -4: "bad sizes (n_chunks >= 1, H <= 65535)",
           -5: "this build has no kernel (HIP or an unsupported target)"}


class Args(ctypes.Structure):
    """kernels/kda_prologue.cu's k3kp::Args, field by field (its size is checked against the library's)."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("q", "k", "v", "g", "beta", "chunk_tok", "chunk_len", "w", "u", "qg", "kdt", "aqk", "d")] + [
        ("n_chunks", ctypes.c_int), ("H", ctypes.c_int), ("scale", ctypes.c_float), ("spread", ctypes.c_float),
        ("probe", ctypes.c_void_p)]
# the timeline probe's stages, in the order of its stamps (kernels/kda_prologue.cu, Args.probe)
PROBE_STAGES = ("load g", "load q k v + G scan", "Qg Kd", "A's", "W/U factors", "inverse diag", "inverse rest",
                "W U products", "stores")


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.k3_kda_prologue.restype = ctypes.c_int
    lib.k3_kda_prologue.argtypes = [ctypes.POINTER(Args), ctypes.c_int, ctypes.c_void_p]
    _build.check_library(lib, NAME, Args, ("k3_kda_prologue_smem", "k3_kda_prologue_regs", "k3_kda_prologue_probe_words"))
    return lib


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


def status() -> tuple[bool, str]:
    """(True, what runs) when the kernel can run here; else (False, why). Builds on first call."""
    return _build.cuda_status(NAME, _library, instead="the Triton prologue runs instead",
                              min_capability=MIN_CAPABILITY, needs=" (cp.async, tf32 mma)",
                              hip_note=f"has no AMD kernel (a stub, {_build.NOT_RUN_ON_AMD})")


@functools.cache
def available() -> bool:
    return status()[0]


def registers() -> int:
    """Registers per thread of the compiled kernel (for the notebook's occupancy sums)."""
    return _library().k3_kda_prologue_regs()


def shared_bytes() -> int:
    return _library().k3_kda_prologue_smem()


def supports(q, k, v, g, beta) -> str | None:
    """None when the kernel takes these tensors; else why not (a sentence)."""
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if q.dtype != torch.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v must be bf16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"the kernel is compiled for K = V = {HEAD_DIM}"
    if g.dtype != torch.float32 or beta.dtype != torch.float32:
        return f"g and beta must be fp32 (got {g.dtype}, {beta.dtype})"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_contiguous():
            return f"{name} is not contiguous"
        if t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned (the kernel copies 16 bytes at a time)"
    return None


def launch(q, k, v, g, beta, chunk_tok, chunk_len, work, *, n_chunks: int, heads: int, scale: float,
           spread: float, probe: torch.Tensor | None = None) -> None:
    """One launch on the current stream (capturable in a CUDA graph) writing work.w, u, qg, kdt, aqk, d
    (kda_chunk's _Work). `probe` (diagnostics): an int64 [n_chunks * heads, probe_words()] tensor the
    timeline-probe build fills (see `timeline`). Raises RuntimeError with the kernel's reason if it
    refuses."""
    lib = _library()
    idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
    ptr = [t.data_ptr() for t in (q, k, v, g, beta, chunk_tok, chunk_len, work.w, work.u, work.qg, work.kdt,
                                  work.aqk, work.d)]
    if probe is not None and (probe.dtype != torch.int64 or probe.shape != (n_chunks * heads, probe_words())):
        raise ValueError(f"probe must be int64 [{n_chunks * heads}, {probe_words()}], got {probe.dtype} "
                         f"{tuple(probe.shape)}")
    a = Args(*ptr, int(n_chunks), int(heads), float(scale), float(spread), probe.data_ptr() if probe is not None else 0)
    max_shared = _build.max_shared_optin(idx)
    stream = _build.stream_handle(idx)
    rc = lib.k3_kda_prologue(ctypes.byref(a), max_shared, ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"kda_prologue.cu refused the launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")


def probe_words() -> int:
    return _library().k3_kda_prologue_probe_words()


def timeline(probe: torch.Tensor):
    """Per-block stage durations from a filled probe: a pandas DataFrame, one row per block, columns
    'sm', 'start_us' (from the first block's start), PROBE_STAGES (us each) and 'total_us'."""
    import pandas as pd

    p = probe.cpu().numpy()
    t = p[:, :-1].astype("float64") / 1e3
    frame = pd.DataFrame({"sm": p[:, -1], "start_us": t[:, 0] - t[:, 0].min()})
    for i, name in enumerate(PROBE_STAGES):
        frame[name] = t[:, i + 1] - t[:, i]
    frame["total_us"] = t[:, -1] - t[:, 0]
    return frame
