"""Binding for kernels/mla_before.cu, the conservative MLA decode ("before") on CUDA cores (one job:
check what the kernel needs, pack the arguments, launch on the current stream).

`k3lab.ops.mla_decode.plan_before` returns this module's plan for bf16 inputs on NVIDIA GPUs where the
library builds (`status()` says whether it does, and why not); elsewhere its Triton `_before_kernel`
runs the same policy. Both are one program per query row (request x verify token x head) walking the
whole history with no matrix units; this one is written so that the before measures the policy rather
than a slow kernel (on the H200, 32K: see profiles/nvidia-h200/mla_padding). Returns (o [B, T, H, 512]
bf16, lse [B, T, H] fp32, natural log). The HIP build compiles but is not yet run on AMD hardware by
this project, so it is not used on ROCm.
"""

from __future__ import annotations

import ctypes
import functools
import math

import torch

from k3lab.ops import _build
from k3lab.ops import mla_decode as mla

NAME = "mla_before"
WARPS = 16  # kernels/mla_before.cu: warps per block


class Args(ctypes.Structure):
    """kernels/mla_before.cu's k3mb::Args, field by field (its size is checked against the library's)."""

    _fields_ = [("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("lengths", ctypes.c_void_p), ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p)] + \
               [(n, ctypes.c_longlong) for n in ("q_sb", "q_st", "q_sh", "kv_sp", "kv_sr", "bt_sb", "o_sb", "o_st",
                                                 "o_sh", "l_sb", "l_st")] + \
               [(n, ctypes.c_int) for n in ("B", "T", "H", "page_shift")] + [("scale_log2", ctypes.c_float),
                                                                              ("ring", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the launcher's signature and check the Args layout; returns lib."""
    lib.k3_mla_before.restype = ctypes.c_int
    lib.k3_mla_before.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p]
    lib.k3_mla_before_has_ring.restype = ctypes.c_int
    return _build.check_library(lib, NAME, Args, supported=False)


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


def status() -> tuple[bool, str]:
    """(True, what runs) when the kernel can run here; else (False, why). Builds on first call."""
    return _build.cuda_status(NAME, _library, instead="the Triton before kernel runs instead")


def check(q, cache, lengths=None, *, block_table=None):
    """mla_decode's checks plus this kernel's own (bf16, 4-byte aligned rows); ValueError by name.
    Returns the validated inputs."""
    inp = mla._validate(q, cache, lengths, block_table)
    if q.dtype != torch.bfloat16:
        raise ValueError(f"q.dtype must be bfloat16 for the CUDA before kernel, got {q.dtype}")
    if cache.stride(1) % 2 or cache.stride(0) % 2 or cache.data_ptr() % 4:
        raise ValueError("cache rows must start on 4-byte boundaries (even strides): the kernel reads bf16 pairs")
    if q.stride(0) % 2 or q.stride(1) % 2 or q.stride(2) % 2 or q.data_ptr() % 4:
        raise ValueError("q rows must start on 4-byte boundaries (even strides): the kernel reads bf16 pairs")
    return inp


def ring_ok(cache) -> bool:
    """Whether the ring kernel can bring this cache's rows in: a CUDA build, rows dense (576 elements
    apart) and every page or request starting on a 16-byte boundary (what bulk copies need). Else
    the direct kernel loads them, whatever their layout."""
    return (bool(_library().k3_mla_before_has_ring()) and cache.stride(-2) == mla.LATENT_DIM
            and cache.stride(0) % 8 == 0 and cache.data_ptr() % 16 == 0)


class BeforePlan:
    """A checked before decode, ready to launch; calling it returns (o, lse), the plan's own buffers
    (no host sync, no allocation: capturable in a CUDA graph)."""

    variant = "before"
    kernel = "cuda"

    def __init__(self, args: Args, out, lse, keep: tuple, device: int, lib: ctypes.CDLL):
        self._args, self.out, self.lse, self._keep, self._device, self._lib = args, out, lse, keep, device, lib

    @property
    def programs(self) -> int:
        return self._args.B * self._args.T * self._args.H

    @property
    def rows_via(self) -> str:
        """'ring' (the history streams through shared memory by bulk copies) or 'direct' (loads)."""
        return "ring" if self._args.ring else "direct"

    def facts(self) -> dict:
        return {"kernel": "cuda", "programs": self.programs, "num_warps": WARPS, "rows_per_program": 1,
                "rows_via": self.rows_via}

    def __call__(self):
        rc = self._lib.k3_mla_before(ctypes.byref(self._args), ctypes.c_void_p(_build.stream_handle(self._device)))
        if rc != 0:
            raise RuntimeError(f"{NAME}.cu refused the launch ({rc})")
        return self.out, self.lse


def plan(q, cache, lengths=None, *, block_table=None, scale=None, ring: bool | None = None) -> BeforePlan:
    """Check once (ValueError by name), then a launchable plan on the GPU (KernelUnavailable where the
    kernel cannot run). ring: None = the ring kernel where `ring_ok(cache)`, else the direct one;
    False = the direct kernel; True = the ring kernel or a ValueError saying why it cannot."""
    if ring not in (None, True, False):
        raise ValueError(f"ring must be None, True or False, got {ring!r}")
    inp = check(q, cache, lengths, block_table=block_table)
    ok, why = status()
    if not ok:
        raise _build.KernelUnavailable(why)
    use_ring = ring_ok(cache) if ring is None else ring
    if ring and not ring_ok(cache):
        raise ValueError("ring=True needs cache rows 576 elements apart and pages (or requests) on 16-byte "
                         f"boundaries; got strides {tuple(cache.stride())}, data_ptr % 16 = {cache.data_ptr() % 16}")
    s = mla.DEFAULT_SCALE if scale is None else float(scale)
    B, T, H = inp.batch, inp.q_len, inp.heads
    out = torch.empty(B, T, H, mla.VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    bt = inp.block_table if inp.paged else None
    args = Args(q.data_ptr(), cache.data_ptr(), bt.data_ptr() if bt is not None else None, inp.lengths.data_ptr(),
                out.data_ptr(), lse.data_ptr(), q.stride(0), q.stride(1), q.stride(2), cache.stride(0),
                cache.stride(1), bt.stride(0) if bt is not None else 0, out.stride(0), out.stride(1), out.stride(2),
                lse.stride(0), lse.stride(1), B, T, H, int(math.log2(inp.page_size)) if inp.paged else 0,
                s * mla._LOG2E, int(use_ring))
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return BeforePlan(args, out, lse, (q, cache, bt, inp.lengths, out, lse), dev, _library())
