"""AttnRes + RMSNorm in one pass (seed section 3, "AttnRes mixes earlier layer-block outputs...").

Between two sublayers K3 does, per token:

    prefix <- bf16(prefix + delta)                      the running partial sum keeps its bf16 rounding
    sources = [block_0, ..., block_{n-1}, prefix]       completed block sums, then the partial
    logit_i = sum_d RMSNorm(V_i)[d] * res_norm_w[d] * res_proj_w[d]
    h = sum_i softmax(logit)_i V_i                      fp32
    out = RMSNorm(h) * next_norm_w                      the next sublayer's input norm
    at a block boundary: blocks[n] <- prefix; prefix <- 0

`before` is that sequence in plain PyTorch (a dozen kernels, every intermediate through memory).
`after` is one kernel launch. Backends (`BACKENDS`, k3lab.ops' contract; `backend=` or
K3LAB_ATTN_RES_NORM_BACKEND forces one; unforced, `launch_config` decides between them):

* 'triton' (`k3lab.ops.attn_res_norm.triton`): one program per token reads every source once, takes
  the stored blocks a group at a time as one tile with an online softmax between groups, keeps the
  fp32 mixture in registers through the norm and writes only the persistent updates and the output;
  its group size, warps and pipelining come from `launch_config` (token count against compute units);
* 'cuda_cluster' (`k3lab.ops.attn_res_norm.cuda`, kernels/attn_res_norm.cu): for a few tokens and 5+
  sources on a GPU with thread-block clusters (compute capability 9.0+), one token's row over a
  cluster of 7 blocks, where it builds (`kernel_status` says which kernel runs and why);
* 'torch': `before`, the reference row (its after is the same sequence); it runs only when forced.

Both update `prefix` / `blocks` in place and return the normed output. Figures and the launch
configurations that lost: docs/copy_removal.md.
"""

from __future__ import annotations

import torch

from k3lab.ops import Backend, Backends, triton_status
from k3lab.ops.attn_res_norm import cuda, triton
from k3lab.ops.attn_res_norm.inputs import (CLUSTER_MIN_BLOCKS, TRITON_CONFIG_KEYS, check, cluster_pays,
                                            fold_mix_weight, launch_config, rms)

__all__ = ["BACKENDS", "BACKEND_ENV", "CLUSTER_MIN_BLOCKS", "VARIANTS", "after", "attn_res_norm", "before",
           "fold_mix_weight", "kernel_status", "launch_config"]


def _cluster_available() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        return False, "no GPU visible to torch: the cluster kernel runs on a CUDA GPU"
    return cuda.cluster_build(torch.cuda.current_device())


def _cluster_verify(prefix, delta=None, blocks=None, n_blocks=0) -> tuple[bool, str]:
    pieces, why = kernel_status(prefix, delta, blocks)
    return pieces > 0, why


def _cluster_rank(prefix, delta=None, blocks=None, n_blocks=0) -> int:
    """First where `launch_config`'s rule picks the cluster kernel for these tensors, else after Triton."""
    pieces = kernel_status(prefix, delta, blocks)[0] if prefix.shape[0] else 0
    return 0 if cluster_pays(prefix.shape[0], n_blocks, pieces) else 2


def _cluster_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block,
                   w_mix, config, int_round):
    if config is not None:
        raise ValueError("config is a Triton launch_config result; backend 'cuda_cluster' takes none")
    return cuda.cuda_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=eps,
                           push_block=push_block, mix_weight=w_mix)


def _triton_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block,
                  w_mix, config, int_round):
    config = launch_config(prefix.shape[0], n_blocks) if config is None else config
    return triton.launch(prefix, delta, blocks, n_blocks, w_mix, next_norm_w, eps, push_block, config,
                         int_round=int_round)


def _torch_after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block,
                 w_mix, config, int_round):
    return _reference(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block)


# callables (on checked inputs): after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w,
# eps, push_block, mix_weight, config, int_round) -> out. The torch row is the reference and the before
# (the unfused sequence); it runs only when forced.
BACKENDS = Backends("attn_res_norm",
                    Backend("cuda_cluster", _cluster_rank, _cluster_available, _cluster_verify,
                            parts={"after": _cluster_after}),
                    Backend("triton", 1, triton_status, parts={"after": _triton_after}),
                    Backend("torch", 3, lambda: (True, "plain PyTorch (the unfused sequence)"),
                            parts={"before": _torch_after, "after": _torch_after}))
BACKEND_ENV = BACKENDS.env


def before(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False):
    """The unfused sequence in plain PyTorch (the seed's "before", and the reference). Updates
    prefix/blocks in place."""
    check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block, eps)
    return _reference(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block)


def _reference(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block):
    if delta is not None:
        prefix.copy_((prefix.float() + delta.float()).to(prefix.dtype))
    sources = torch.cat([blocks[:n_blocks], prefix.unsqueeze(0)]).float()  # [S, T, D]
    w = res_norm_w.float() * res_proj_w.float()
    logits = (rms(sources, eps) * w).sum(-1)  # [S, T]
    p = torch.softmax(logits, dim=0)
    h = (p.unsqueeze(-1) * sources).sum(0)
    out = (rms(h, eps) * next_norm_w.float()).to(prefix.dtype)
    if push_block:
        blocks[n_blocks].copy_(prefix)
        prefix.zero_()
    return out


def kernel_status(prefix: torch.Tensor, delta: torch.Tensor | None = None, blocks: torch.Tensor | None = None
                  ) -> tuple[int, str]:
    """(cluster pieces per row, why): how many blocks per row the CUDA cluster kernel would use for
    these tensors (0 when it cannot run on them here: then `after` uses the Triton kernel, and `why`
    says why). The first call on a GPU builds kernels/attn_res_norm.cu (tens of seconds, then cached)."""
    return cuda.cluster_pieces(prefix, delta, blocks)


def after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps=1e-5, push_block=False,
          mix_weight=None, backend=None, config=None, int_round=None):
    """One kernel launch for the whole step. Same arguments, effects and result as `before`;
    pass `mix_weight=fold_mix_weight(...)` (folded at load time) to keep the step at one launch.
    backend: 'triton', 'cuda_cluster', or None (K3LAB_ATTN_RES_NORM_BACKEND, else `launch_config`
    chooses; see `kernel_status`). config: a Triton `launch_config(...)` result to run instead of the
    one chosen for this device's unit count (implies backend='triton').
    int_round: round bf16 with integer arithmetic (default: only under Triton's interpreter)."""
    T, D = check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block, eps)
    for name, t in (("prefix", prefix), ("blocks", blocks)) + ((("delta", delta),) if delta is not None
                                                               else ()):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    w_mix = fold_mix_weight(res_norm_w, res_proj_w) if mix_weight is None else mix_weight
    if w_mix.shape != (D,) or w_mix.dtype != torch.float32:
        raise ValueError(f"mix_weight must be fp32 [D={D}], got {w_mix.dtype} {tuple(w_mix.shape)}")
    if config is not None:
        if not isinstance(config, dict) or not all(key in config for key in TRITON_CONFIG_KEYS):
            raise ValueError(f"config must be a Triton launch_config result, got {config}")
        backend = "triton" if backend is None else backend
    row = BACKENDS.pick(backend, prefix, delta, blocks, n_blocks, need="after")
    return row.after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block,
                     w_mix, config, int_round)


VARIANTS = {"before": before, "after": after}


def attn_res_norm(*args, impl: str = "after", **kwargs):
    """Entry point: impl 'after' (one fused kernel) or 'before' (plain PyTorch sequence)."""
    if impl not in VARIANTS:
        raise ValueError(f"impl must be 'after' or 'before', got {impl!r}")
    return VARIANTS[impl](*args, **kwargs)
