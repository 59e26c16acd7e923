"""The CUDA backend of KDA verification: binding for kernels/kda_verify.cu (pack the arguments, launch
on the current stream). The kernel is one configuration: 8-column tiles, 4 warps per tile; the
library is built once by k3lab.ops._build (nvcc for the device's own architecture) and loaded with
ctypes. `status()` says whether it can run here and, if not, why; `verify()` whether it takes
given tensors. The source also compiles as HIP, but that build is not yet run on AMD hardware by this
project, so the backend is available only on CUDA devices.

Programmatic dependent launch (PDL): on compute capability 9.0+ the kernel is launched with CUDA's
programmatic stream serialization attribute, so its blocks are placed while the stream's previous
kernel finishes and wait (griddepcontrol.wait) for it before their first memory access: the results
are the same, the launch latency is hidden. K3LAB_KDA_VERIFY_PDL=0 turns it off for a run, =1 insists.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from k3lab.ops import _build, setting
from k3lab.ops.kda_verify.inputs import HEAD_DIM

NAME = "kda_verify"
TILE_V = 8  # value columns per block, compiled in
NUM_WARPS = 4  # warps per tile, compiled in
PDL_ENV = "K3LAB_KDA_VERIFY_PDL"
PDL_MIN_CAPABILITY = (9, 0)
_ERRORS = {-4: "bad sizes (T in 1..8, N and H <= 65535)"}


class Args(ctypes.Structure):
    """kernels/kda_verify.cu's k3kv::Args, field by field (its size is checked against the library's)."""

    _fields_ = [("q", ctypes.c_void_p), ("k", ctypes.c_void_p), ("v", ctypes.c_void_p),
                ("g", ctypes.c_void_p),
                ("beta", ctypes.c_void_p), ("h0", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("hs", ctypes.c_void_p),
                ("seq_info", ctypes.c_void_p), ("n_seq", ctypes.c_int), ("T", ctypes.c_int),
                ("H", ctypes.c_int),
                ("mode", ctypes.c_int), ("seq64", ctypes.c_int), ("all_states", ctypes.c_int),
                ("in_bf16", ctypes.c_int), ("g_bf16", ctypes.c_int), ("beta_bf16", ctypes.c_int),
                ("scale", ctypes.c_float), ("pdl", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the launcher's signature and check the Args layout; returns lib."""
    lib.k3_kda_verify.restype = ctypes.c_int
    lib.k3_kda_verify.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p]
    return _build.check_library(lib, NAME, Args, supported=False)


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


@functools.cache
def status() -> tuple[bool, str]:
    """(True, what runs) when the kernel can run here; else (False, why). Builds on first call."""
    return _build.cuda_status(NAME, _library, instead="the Triton kernels run instead")


def available() -> tuple[bool, str]:
    return status()


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
    ('1' yes, '0' no), else yes where `pdl_supported`."""
    value = setting(PDL_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    if value:
        return value == "1"
    return pdl_supported(index)


def verify(q, k, v, g, beta, initial_state, tile_v: int, states=None) -> tuple[bool, str]:
    """(True, '') when the kernel can take these tensors (and the `states` buffer, when given) at this
    tile width; else (False, why) (k3lab.ops' verifier shape)."""
    why = _refusal(q, k, v, g, beta, initial_state, tile_v, states)
    return why is None, why or ""


def _refusal(q, k, v, g, beta, initial_state, tile_v: int, states) -> str | None:
    if tile_v != TILE_V:
        return f"the kernel is compiled for {TILE_V}-column tiles, got tile_v={tile_v}"
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if v.shape[-1] != HEAD_DIM:
        return f"the kernel is compiled for V = {HEAD_DIM} value columns, got V = {v.shape[-1]}"
    if q.dtype not in (torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q, k and v must share one dtype, bf16 or fp32 (got {q.dtype}, {k.dtype}, {v.dtype})"
    for name, t in (("g", g), ("beta", beta)):
        if t.dtype not in (torch.bfloat16, torch.float32):
            return f"{name} must be bf16 or fp32, got {t.dtype}"
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", initial_state),
                    ("states", states)):
        if t is not None and t.data_ptr() % 16:
            return f"{name} is not 16-byte aligned (the kernel reads 16 bytes at a time)"
    if beta.data_ptr() % 4:
        return "beta is not 4-byte aligned"
    return None


def launch(q, k, v, g, beta, h0, o, hs, seq_info, *, n_seq: int, positions: int, heads: int, mode: int,
           all_states: bool, scale: float, pdl: bool | None = None) -> None:
    """One launch on the current stream (capturable in a CUDA graph). Tensors contiguous, already
    checked by k3lab.ops.kda_verify; raises RuntimeError with the kernel's reason if it refuses.
    `pdl`: launch as a programmatic dependent of the stream's previous kernel (None: `pdl_default`)."""
    lib = _library()
    idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
    pdl = pdl_default(idx) if pdl is None else bool(pdl)
    if pdl and not pdl_supported(idx):
        raise ValueError(f"a programmatic dependent launch needs compute capability "
                         f"{'.'.join(map(str, PDL_MIN_CAPABILITY))} or later (CUDA); got {_capability(idx)}")
    a = Args(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), h0.data_ptr(),
             o.data_ptr(), hs.data_ptr(), seq_info.data_ptr() if mode else 0,
             n_seq, positions, heads, mode, int(mode and seq_info.dtype == torch.int64), int(all_states),
             int(q.dtype == torch.bfloat16), int(g.dtype == torch.bfloat16),
             int(beta.dtype == torch.bfloat16),
             float(scale), int(pdl))
    rc = lib.k3_kda_verify(ctypes.byref(a), ctypes.c_void_p(_build.stream_handle(idx)))
    if rc != 0:
        raise RuntimeError(f"kda_verify.cu refused the launch ({rc}: "
                           f"{_ERRORS.get(rc, 'CUDA runtime error')})")
