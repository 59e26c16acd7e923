"""The CUDA backend of AttnRes + RMSNorm: binding for kernels/attn_res_norm.cu, one token's row over a
thread-block cluster of ceil(hidden / 1024) <= 8 blocks (CUDA, compute capability 9.0+), the blocks
exchanging their partial sums through distributed shared memory. Chosen by `launch_config` for a few
tokens and 5+ sources, where it builds (`cluster_pieces`). The source compiles as HIP too (no cluster
kernel there; not yet run on AMD hardware by this project)."""


from __future__ import annotations

import ctypes
import functools

import torch

from k3lab.ops import _build
from k3lab.ops.attn_res_norm.inputs import check, fold_mix_weight

KERNEL = "attn_res_norm"
PIECE = 1024  # columns per block in cluster mode
MAX_BLOCKS = 8  # stored blocks (9 sources)
MAX_PIECES = 8  # a portable cluster


class Args(ctypes.Structure):  # kernels/attn_res_norm.cu, k3arn::Args
    _fields_ = [("prefix", ctypes.c_void_p), ("delta", ctypes.c_void_p), ("blocks", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("w_mix", ctypes.c_void_p), ("w_next", ctypes.c_void_p),
                ("stride_block", ctypes.c_longlong), ("T", ctypes.c_int), ("D", ctypes.c_int),
                ("n_blocks", ctypes.c_int), ("push", ctypes.c_int), ("eps", ctypes.c_float)]


@functools.cache
def _library() -> ctypes.CDLL:
    lib = _build.load(KERNEL)
    lib.k3_attn_res_norm.restype = ctypes.c_int
    lib.k3_attn_res_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    size = lib.k3_attn_res_args_size()
    if size != ctypes.sizeof(Args):
        raise _build.KernelUnavailable(f"{KERNEL}.cu's Args is {size} bytes but the Python packing is "
                                       f"{ctypes.sizeof(Args)}")
    return lib


@functools.cache
def cluster_build(device_index: int) -> tuple[bool, str]:
    ok, why = _build.clusters_available(device_index)
    if not ok:
        return False, why
    ok, why = _build.status(KERNEL)
    return ok, why


def cluster_pieces(*tensors: torch.Tensor | None) -> tuple[int, str]:
    """(blocks per row, why) for the cluster kernel on rows like tensors[0] (prefix; then delta,
    blocks): ceil(D / 1024) when it can run on them here, else 0 and the reason (the caller then
    uses the Triton kernel). The first call per GPU builds kernels/attn_res_norm.cu (then cached)."""
    prefix = tensors[0]
    if prefix.device.type != "cuda":
        return 0, f"tensors on {prefix.device.type}: the cluster kernel runs on a CUDA GPU"
    if prefix.dtype != torch.bfloat16:
        return 0, f"dtype {prefix.dtype}: the cluster kernel takes bfloat16"
    D = prefix.shape[-1]
    if D % 8 or -(-D // PIECE) > MAX_PIECES:
        return 0, f"hidden size {D}: the cluster kernel takes multiples of 8 up to {MAX_PIECES * PIECE}"
    for t in tensors:
        if t is not None and (not t.is_contiguous() or t.data_ptr() % 16):
            return 0, "a tensor is not contiguous or not 16-byte aligned"
    ok, why = cluster_build(prefix.device.index if prefix.device.index is not None
                            else torch.cuda.current_device())
    if not ok:
        return 0, f"cluster kernel unavailable: {why}"
    return -(-D // PIECE), f"cluster kernel: {why}"


def cuda_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5,
               push_block=False,
               mix_weight=None):
    """Same arguments, effects and result as `attn_res_norm.before` (bf16 tensors on one GPU, hidden
    size a multiple of 8)."""
    T, D = check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block, eps)
    if prefix.dtype != torch.bfloat16:
        raise ValueError(f"prefix must be bfloat16 (the kernel stores bf16), got {prefix.dtype}")
    if D % 8:
        raise ValueError(f"the hidden size D must be a multiple of 8 (16-byte rows), got {D}")
    if n_blocks > MAX_BLOCKS:
        raise ValueError(f"n_blocks must be at most {MAX_BLOCKS}, got {n_blocks}")
    if -(-D // PIECE) > MAX_PIECES:
        raise ValueError(f"the cluster kernel takes rows of at most {MAX_PIECES * PIECE} columns, got D={D}")
    for name, t in (("prefix", prefix), ("blocks", blocks)) + ((("delta", delta),) if delta is not None
                                                               else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary (the kernel moves 8 bf16 at a time)")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    if w_mix.shape != (D,) or w_mix.dtype != torch.float32 or not w_mix.is_contiguous():
        raise ValueError(f"mix_weight must be contiguous fp32 [D={D}], got {w_mix.dtype} "
                         f"{tuple(w_mix.shape)}")
    w_next = next_norm_w.float().contiguous()  # no copy when it is fp32 already
    ok, why = _build.clusters_available(prefix.device)
    if not ok:
        raise _build.KernelUnavailable(f"the cluster kernel cannot run here: {why}")
    lib = _library()
    out = torch.empty_like(prefix)
    args = Args(prefix.data_ptr(), delta.data_ptr() if delta is not None else None, blocks.data_ptr(),
                 out.data_ptr(), w_mix.data_ptr(), w_next.data_ptr(), blocks.stride(0), T, D, n_blocks,
                 int(push_block), float(eps))
    stream = _build.stream_handle(prefix.device.index if prefix.device.index is not None
                                  else torch.cuda.current_device())
    rc = lib.k3_attn_res_norm(ctypes.byref(args), ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"{KERNEL}.cu returned {rc} (T={T}, D={D}, n_blocks={n_blocks})")
    return out
