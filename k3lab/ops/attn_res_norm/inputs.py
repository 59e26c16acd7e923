"""Inputs and launch policy shared by the AttnRes + RMSNorm backends: argument checks, the folded mix
weight, and `launch_config` (which kernel, and the Triton kernel's options, for a shape)."""

from __future__ import annotations

import torch

from k3lab import env
from k3lab.ops import expect, positive_finite

CLUSTER_MIN_BLOCKS = 4  # 5+ sources: below that one Triton program is faster than a cluster


def check(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, push_block, eps):
    """(T, D) for one step's arguments; ValueError naming the first bad one, the same for every
    backend and for `before`: shapes, dtypes, one device, n_blocks in the slots, eps positive and
    finite (a negative eps makes the norm NaN, which nn's rms_norm refuses)."""
    tensors = {"prefix": prefix, "delta": delta, "blocks": blocks, "res_norm_w": res_norm_w,
               "res_proj_w": res_proj_w, "next_norm_w": next_norm_w}
    expect("prefix", prefix, shape=2, what="[T, D]")
    for name, t in tensors.items():
        if t is None and name == "delta":
            continue
        expect(name, t, dtype="float", device=prefix.device)  # prefix's: all on one device
    T, D = prefix.shape
    if delta is not None:
        expect("delta", delta, shape=(T, D), what=f"prefix's [T={T}, D={D}]")
    expect("blocks", blocks, shape=(None, T, D), dtype=prefix.dtype, what=f"[max_blocks, T={T}, D={D}]")
    slots = blocks.shape[0] - (1 if push_block else 0)
    if isinstance(n_blocks, bool) or not isinstance(n_blocks, int) or not 0 <= n_blocks <= slots:
        raise ValueError(f"n_blocks must be an int in [0, {slots}] for {blocks.shape[0]} block slots "
                         f"(push_block={push_block}), got {n_blocks!r}")
    for name, w in (("res_norm_w", res_norm_w), ("res_proj_w", res_proj_w), ("next_norm_w", next_norm_w)):
        expect(name, w, shape=(D,), what=f"[D={D}]")
    positive_finite("eps", eps)
    return T, D


def rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fold_mix_weight(res_norm_w, res_proj_w):
    """The AttnRes logit weight norm_w * proj_w as one fp32 vector: folded once when weights load."""
    return (res_norm_w.float() * res_proj_w.float()).contiguous()


def cluster_pays(tokens: int, n_blocks: int, cluster_pieces: int, compute_units: int | None = None) -> bool:
    """Whether the CUDA cluster kernel is the one to run (`launch_config`'s rule): it can run here
    (cluster_pieces > 0), every block of every row gets an SM of its own and there are at least
    CLUSTER_MIN_BLOCKS stored blocks."""
    if compute_units is None:
        compute_units = env.detect().compute_units or 1
    return (bool(cluster_pieces) and n_blocks >= CLUSTER_MIN_BLOCKS
            and tokens * cluster_pieces <= compute_units)


# Keys of a Triton launch configuration (what `launch_config` returns for the Triton kernel)
TRITON_CONFIG_KEYS = ("group", "num_warps", "prefetch", "w_reload", "stages")


# Launch configuration, chosen per call by `launch_config` (the rule and the H200 sweep behind it are
# documented there). Fields: group (blocks per tile step), num_warps, prefetch (the next group's loads
# issued before this group is reduced), w_reload (re-read the logit weight each step instead of
# keeping it in registers), stages (0: the loop over groups is unrolled; k > 0: a rolled loop that
# the compiler software-pipelines k deep through shared memory).
def launch_config(tokens: int, n_blocks: int, compute_units: int | None = None, cluster_pieces: int = 0,
                  wave_width: int | None = None) -> dict:
    """The kernel configuration for `tokens` tokens and `n_blocks` stored blocks: {"kernel":
    "cuda_cluster"} or {"kernel": "triton", and the Triton kernel's options}.

    cluster_pieces: blocks per row of the CUDA cluster kernel (ceil(hidden / 1024)) when it can run
    here, else 0. It is chosen when every block of every row gets an SM of its own (tokens x pieces
    <= compute units) and there are at least CLUSTER_MIN_BLOCKS stored blocks: with fewer sources the
    cluster launch and its barriers cost more than one program's work (docs/copy_removal.md).

    The rule, from the launch-configuration sweep (docs/copy_removal.md has the table and records):
    - tokens <= compute units: one program per token and at most one per unit, so one SM does all
      of a token's work with nothing beside it: the step is bound by latency and by that SM's
      instruction issue. Every stored block is loaded as one tile in a single step ("tile8": group
      = all blocks, 8 warps), faster than walking the blocks; 16 and 32 warps are not: the work per
      SM is the same (about 2,750 instructions per thread at 8 warps for 9 sources, in the compiled
      code), more warps only add cross-warp reduction, and 32 spill registers.
    - more tokens, 2+ stored blocks: bandwidth-bound. One block at a time in a rolled loop that the
      compiler software-pipelines 3 deep through shared memory ("pipe8s3"): the loads in flight
      cost no registers, 128 registers per thread leave room for two programs of 8 warps per unit.
    - more tokens, 0-1 stored blocks: a loop of one step has nothing to pipeline; the block is
      prefetched in registers with 4 warps ("walk4").
    The switch at one token per unit follows from the reasoning above; the sweep brackets it (tile8
    best at 64 tokens, pipe8s3 at 512) but did not time the tokens in between. On AMD GPUs the same
    rule applies untuned (not yet run on AMD hardware by this project), except that tile8 takes 16
    waves of 64 lanes: at 8 the compiler spills 14 VGPRs (gfx950 and gfx942), at 16 it needs 105
    and none (k3lab.isa).
    compute_units, wave_width: the device's SM/CU count and lanes per wave (read from the device
    when None).
    """
    if compute_units is None:
        compute_units = env.detect().compute_units or 1
    if wave_width is None:
        wave_width = env.detect().wave_width or 32
    if cluster_pays(tokens, n_blocks, cluster_pieces, compute_units):
        return {"kernel": "cuda_cluster"}
    all_blocks = 1 << max(n_blocks - 1, 0).bit_length()  # next power of two
    if tokens <= compute_units:
        warps = 16 if wave_width == 64 else 8
        return {"kernel": "triton", "group": all_blocks, "num_warps": warps, "prefetch": 1, "w_reload": 0,
                "stages": 0}
    if n_blocks >= 2:
        return {"kernel": "triton", "group": 1, "num_warps": 8, "prefetch": 0, "w_reload": 0, "stages": 3}
    return {"kernel": "triton", "group": 1, "num_warps": 4, "prefetch": 1, "w_reload": 0, "stages": 0}
