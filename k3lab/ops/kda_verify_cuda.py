"""Binding for kernels/kda_verify.cu, the hand-written KDA verification kernel (one job: pack the
arguments, pick the compiled config, launch on the current stream).

`k3lab.ops.kda_verify.kda_verify` calls `launch` for its 'cuda', 'cuda_chunk' and 'cuda_warp' forms
('cuda_warp' is its default 'after' on CUDA devices) after its own argument checks; this module only
checks what the kernel itself needs (value head dim 128, dtypes, 16-byte alignment of the inputs and
of the states buffer) and decides the programmatic dependent launch (`pdl_default`). The library is built once by k3lab.ops._build (nvcc for the device's own
architecture) and loaded with ctypes; `status()` says whether it can run here and, if not, why.
The kernel source also compiles as HIP, but that build is not yet run on AMD hardware by this
project, so `available()` answers True only on CUDA devices.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from k3lab.ops import _build

NAME = "kda_verify"
HEAD_DIM = 128  # K and V compiled into the kernel (K3's KDA head)
# form name in k3lab.ops.kda_verify -> the launcher's form: step and chunk (a block of 4 or 8 warps
# shares a tile's key rows), warp (each warp owns 8 whole columns; kernels/kda_verify.cu FORM 2)
FORMS = {"cuda": 0, "cuda_chunk": 1, "cuda_warp": 2}
# Programmatic dependent launch (PDL): the kernel is launched with CUDA's programmatic stream
# serialization attribute, so its blocks can be placed while the stream's previous kernel finishes;
# each block waits (griddepcontrol.wait) for that kernel's completion and memory before its first
# access, so results are the same, only the launch latency is hidden. On by default where the
# instruction exists (compute capability 9.0+); K3LAB_KDA_VERIFY_PDL=0 turns it off, =1 insists.
# On the H200 it took B = 1, T = 4 from 3.96 to 3.19 us (graph replay; profiles/nvidia-h200/kda_verify).
PDL_ENV = "K3LAB_KDA_VERIFY_PDL"
PDL_DEFAULT = True
PDL_MIN_CAPABILITY = (9, 0)
_ERRORS = {-1: "no compiled kernel for this (tile_v, warps, form)", -4: "bad sizes (T in 1..8, N and H <= 65535)"}


class Args(ctypes.Structure):
    """kernels/kda_verify.cu's k3kv::Args, field by field (its size is checked against the library's)."""

    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("g", ctypes.c_void_p),
                ("beta", ctypes.c_void_p), ("h0", ctypes.c_void_p), ("o", ctypes.c_void_p), ("hs", ctypes.c_void_p),
                ("seq_info", ctypes.c_void_p), ("beta_numel", ctypes.c_longlong),
                ("n_seq", ctypes.c_int), ("T", ctypes.c_int), ("H", ctypes.c_int), ("mode", ctypes.c_int),
                ("seq64", ctypes.c_int), ("all_states", ctypes.c_int), ("in_bf16", ctypes.c_int),
                ("g_bf16", ctypes.c_int), ("beta_bf16", ctypes.c_int), ("scale", ctypes.c_float),
                ("pdl", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the exported launchers' signatures and check the Args layout; returns lib."""
    lib.k3_kda_verify.restype = ctypes.c_int
    lib.k3_kda_verify.argtypes = [ctypes.POINTER(Args), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.k3_kda_verify_configs.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    return _build.check_library(lib, NAME, Args, ("k3_kda_verify_configs",), supported=False)


def configs_of(lib: ctypes.CDLL) -> set[tuple[int, int, str]]:
    """(tile_v, warps, form name) triples compiled into the library."""
    buf = (ctypes.c_int * 96)()
    n = lib.k3_kda_verify_configs(buf, 32)
    names = {v: k for k, v in FORMS.items()}
    return {(buf[3 * i], buf[3 * i + 1], names[buf[3 * i + 2]]) for i in range(min(n, 32))}


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


def status() -> tuple[bool, str]:
    """(True, what runs) when the kernel can run here; else (False, why). Builds on first call."""
    return _build.cuda_status(NAME, _library, instead="the Triton kernels run instead")


@functools.cache
def available() -> bool:
    return status()[0]


def configs() -> set[tuple[int, int, str]]:
    return configs_of(_library())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_supported(index: int | None = None) -> bool:
    """True on a CUDA (not HIP) device of compute capability 9.0 or later, where the kernel's
    griddepcontrol instructions exist."""
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None):
        return False
    return _capability(torch.cuda.current_device() if index is None else index) >= PDL_MIN_CAPABILITY


def pdl_default(index: int | None = None) -> bool:
    """Whether launches are programmatic dependents when the caller does not say: K3LAB_KDA_VERIFY_PDL
    ('1' yes, '0' no), else PDL_DEFAULT where `pdl_supported`."""
    import os

    value = os.environ.get(PDL_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    if value:
        return value == "1"
    return PDL_DEFAULT and pdl_supported(index)


def supports(q, k, v, g, beta, initial_state, tile_v: int, num_warps: int, form: str, states=None) -> str | None:
    """None when the kernel can take these tensors (and the `states` buffer, when given) and launch
    choices; else why not (a sentence)."""
    if form not in FORMS:
        return f"form {form!r} is not one of {tuple(FORMS)}"
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if v.shape[-1] != HEAD_DIM:
        return f"the kernel is compiled for V = {HEAD_DIM} value columns, got V = {v.shape[-1]}"
    if q.dtype not in (torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v must share one dtype, bf16 or fp32 (got {q.dtype}, {k.dtype}, {v.dtype})"
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            return f"{name} must be bf16 or fp32, got {t.dtype}"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state), ("states", states)):
        if t is not None and t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned (the kernel reads 16 bytes at a time)"
    if beta.data_ptr() % 4:
        return "beta is not 4-byte aligned"
    if (tile_v, num_warps, form) not in configs():
        return f"(tile_v={tile_v}, num_warps={num_warps}, form={form!r}) is not compiled; have {sorted(configs())}"
    return None


def launch(q, k, v, g, beta, h0, o, hs, seq_info, *, n_seq: int, positions: int, heads: int, mode: int,
           all_states: bool, tile_v: int, num_warps: int, form: str, scale: float, pdl: bool | None = None) -> None:
    """One launch on the current stream (capturable in a CUDA graph). Tensors contiguous, already
    checked by k3lab.ops.kda_verify; raises RuntimeError with the kernel's reason if it refuses.
    `pdl`: launch as a programmatic dependent of the stream's previous kernel (None reads
    K3LAB_KDA_VERIFY_PDL)."""
    lib = _library()
    idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
    pdl = pdl_default(idx) if pdl is None else bool(pdl)
    if pdl and not pdl_supported(idx):
        raise ValueError(f"a programmatic dependent launch needs compute capability "
                         f"{'.'.join(map(str, PDL_MIN_CAPABILITY))} or later (CUDA); got {_capability(idx)}")
    a = Args(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), h0.data_ptr(),
             o.data_ptr(), hs.data_ptr(), seq_info.data_ptr() if mode else 0, beta.numel(),
             n_seq, positions, heads, mode, int(mode and seq_info.dtype == torch.int64), int(all_states),
             int(q.dtype == torch.bfloat16), int(g.dtype == torch.bfloat16), int(beta.dtype == torch.bfloat16),
             float(scale), int(pdl))
    stream = _build.stream_handle(idx)
    rc = lib.k3_kda_verify(ctypes.byref(a), tile_v, num_warps, FORMS[form], ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"kda_verify.cu refused the launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")
