"""Absorbed MLA decode over the 576-wide latent cache (seed section 4): the 12-head "before" and the
padded, split-history "after", with a small table of backends.

Every query head attends to the same latent rows (MQA over the latent): keys are the whole 576-wide
row [c 512 | k_pe 64], values its first 512 columns, softmax scale 192^-0.5. Every decode returns
`(o [B, Tq, H, 512], lse [B, Tq, H])`, lse the natural-log log-sum-exp of the scaled scores (the
figure by which partial results merge). The reference is `k3lab.nn.mla.latent_attention`
(`reference` here).

* before (`plan_before`): one program per query row (request x verify token x head) walking the
  whole history on the vector units: at TP8 decode (B = 1, 12 heads) 12 programs on a GPU of 132
  SMs or 256 CUs, however long the conversation.
* after (`plan_after`): the query padded to 16 heads so both products run on the matrix units, and
  the history split into pieces run in parallel, merged by log-sum-exp.

Inputs (`inputs.validate`): q [B, q_len 1..8, H, 576] fp32 / fp16 / bf16; a contiguous cache
[B, L, 576] or a paged pool [num_pages, page_size, 576] with block_table [B, max_pages] and lengths
[B] (needed when paged); verification groups are causal inside the group (token t of request b sits
at position lengths[b] - q_len + t). Bad input raises ValueError before any kernel runs. A plan is
validated once (one host sync) and then launches with no checks and no sync (CUDA-graph capturable);
its outputs are its own buffers, overwritten by each call.

Backends (`BACKENDS`, tried in priority order; the first that is available here and takes the
inputs runs, `plan.backend` says which; `backend=` or K3LAB_MLA_BACKEND forces one by name):

* 'cuda' (cuda.py): NVIDIA sm_90 with nvcc, bf16, <= 16 heads, pad='registers'; the after for one
  token, and for verification groups over a paged cache (each token a request over the same pages);
  the before for bf16 on any CUDA GPU.
* 'triton' (triton.py): everywhere else (other GPUs, fp32 / fp16, pad='copy', fold_heads, and on a
  CPU through Triton's interpreter).
* 'aiter' (peers.aiter_decode, ROCm with amd-aiter): the seed's padded assembly decode; last in
  priority because it is not yet run on AMD hardware by this project, so it runs only when forced.

Where the figures behind each choice are: docs/mla_padding.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

from k3lab.ops.mla_decode import cuda, triton
from k3lab.ops.mla_decode.inputs import (DEFAULT_SCALE, LATENT_DIM, MAX_Q_LEN, MMA_ROWS, VALUE_DIM,
                                         LaunchConfig,
                                         check_scale, choose_num_splits, choose_splits, gather_paged,
                                         split_cost, to_paged)
from k3lab.ops.mla_decode.triton import DecodePlan, after_groups

BACKEND_ENV = "K3LAB_MLA_BACKEND"
CUDA_VERIFY_Q_LENS = cuda.VERIFY_Q_LENS
_PEER_NAMES = ("reference", "einsum_decode", "sdpa_decode", "aiter_status", "aiter_decode", "flashmla_status",
               "flashmla_plan")

__all__ = [
    "LATENT_DIM", "VALUE_DIM", "DEFAULT_SCALE", "MMA_ROWS", "MAX_Q_LEN", "CUDA_VERIFY_Q_LENS", "BACKENDS",
    "Backend", "BackendUnavailable", "DecodePlan", "LaunchConfig", "plan_before", "plan_after",
    "mla_decode_before",
    "mla_decode_after", "choose_backend", "cuda_after_status", "choose_num_splits", "choose_splits",
    "split_cost",
    "after_groups", "to_paged", "gather_paged", *_PEER_NAMES,
]


def __getattr__(name: str):
    # The peers load on first use, so that `python -m k3lab.ops.mla_decode.peers` runs that module once.
    if name in _PEER_NAMES:
        from k3lab.ops.mla_decode import peers

        return getattr(peers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class BackendUnavailable(RuntimeError):
    """A backend asked for by name cannot run on this machine (the message says why)."""


@dataclass(frozen=True)
class Backend:
    """One implementation of the decode. available(variant) -> (ok, why) says whether it runs on this
    machine; refusal(variant, q, cache, lengths, block_table, opts) -> None or why it does not take
    these inputs; plan(variant, ...) builds the plan. Lower priority numbers are tried first."""

    name: str
    priority: int
    available: Callable[..., tuple[bool, str]]
    refusal: Callable[..., str | None]
    plan: Callable


def _cuda_available(variant: str = "after") -> tuple[bool, str]:
    return cuda.before_status() if variant == "before" else cuda.status()


def _cuda_refusal(variant, q, cache, lengths, block_table, opts) -> str | None:
    if variant == "before":
        try:
            cuda.check_before(q, cache, lengths, block_table=block_table)
        except ValueError as exc:
            return str(exc)
        return None
    if opts.get("pad", "registers") != "registers":
        return "pad='copy' (the explicit 16-head buffer) runs on the Triton backend"
    return cuda.after_refusal(q, cache, lengths, block_table)


def _cuda_plan(variant, q, cache, lengths, *, block_table, scale, num_splits=None, form=None, pad_fill=0.0,
               **opts):
    if variant == "before":
        return cuda.plan_before(q, cache, lengths, block_table=block_table, scale=scale)
    if opts.get("pad", "registers") != "registers":
        raise ValueError("backend 'cuda' takes pad='registers' only (pad='copy' runs on the Triton backend)")
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1:
        return cuda.plan_verify(q, cache, lengths, block_table=block_table, scale=scale,
                                num_splits=num_splits,
                                form=form)
    return cuda.plan(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                     form=form)


def _triton_plan(variant, q, cache, lengths, *, block_table, scale, num_splits=None, form=None, **opts):
    if form not in (None, "auto"):
        raise ValueError(f"form={form!r} names a CUDA split kernel; the Triton backend has one form")
    if variant == "before":
        return triton.plan_before(q, cache, lengths, block_table=block_table, scale=scale)
    return triton.plan_after(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                             **opts)


def _aiter_available(variant: str = "after") -> tuple[bool, str]:
    from k3lab.ops.mla_decode import peers  # see __getattr__

    if variant == "before":
        return False, "AITER has no before (its decode is the padded one)"
    return peers.aiter_status()


def _aiter_plan(variant, q, cache, lengths, *, block_table, scale, num_splits=None, form=None, pad_fill=0.0,
                **opts):
    from k3lab.ops.mla_decode import peers  # see __getattr__

    if variant == "before" or num_splits is not None or opts.get("pad", "registers") != "registers" or form:
        raise ValueError("backend 'aiter' runs the after with its own split choice, padding and form only")
    return peers.AiterPlan(q, cache, lengths, block_table=block_table, scale=scale)


BACKENDS: dict[str, Backend] = {
    "cuda": Backend("cuda", 0, _cuda_available, _cuda_refusal, _cuda_plan),
    "triton": Backend("triton", 1,
                      lambda variant="after": (True, "Triton kernels (the interpreter on a CPU)"),
                      lambda *a: None, _triton_plan),
    "aiter": Backend("aiter", 2, _aiter_available, lambda *a: None, _aiter_plan),
}


def choose_backend(variant: str, q=None, cache=None, lengths=None, block_table=None, *, backend: str
                   | None = None,
                   **opts) -> tuple[str, str]:
    """(name, why) of the backend a plan of `variant` ('before' or 'after') takes for these inputs:
    `backend` or K3LAB_MLA_BACKEND if set (BackendUnavailable if it cannot run here), else the first
    of BACKENDS by priority that is available and takes the inputs (without inputs: the first
    available). A form other than 'auto' asks for the CUDA backend."""
    if variant not in ("before", "after"):
        raise ValueError(f"variant must be 'before' or 'after', got {variant!r}")
    forced = backend if backend is not None else (os.environ.get(BACKEND_ENV) or None)
    if forced is None and opts.get("form") not in (None, "auto"):
        forced = "cuda"
    if forced is not None:
        if forced not in BACKENDS:
            src = "backend" if backend is not None else BACKEND_ENV
            raise ValueError(f"{src} must be one of {sorted(BACKENDS)}, got {forced!r}")
        ok, why = BACKENDS[forced].available(variant)
        if not ok:
            raise BackendUnavailable(f"backend {forced!r} cannot run here: {why}")
        return forced, f"asked for by name ({why})"
    reasons = []
    for b in sorted(BACKENDS.values(), key=lambda b: b.priority):
        ok, why = b.available(variant)
        if ok and q is not None:
            refused = b.refusal(variant, q, cache, lengths, block_table, opts)
            ok, why = refused is None, refused or why
        if ok:
            return b.name, why + (f" (not {'; '.join(reasons)})" if reasons else "")
        reasons.append(f"{b.name}: {why}")
    raise BackendUnavailable(f"no MLA decode backend runs here: {'; '.join(reasons)}")


def cuda_after_status(q=None, cache=None, lengths=None, block_table=None) -> tuple[bool, str]:
    """Whether `plan_after` runs the CUDA backend by default here (with inputs: for these inputs)
    and, if not, why."""
    ok, why = cuda.status()
    if ok and q is not None:
        refused = cuda.after_refusal(q, cache, lengths, block_table)
        ok, why = refused is None, refused or why
    return ok, why


def plan_before(q, cache, lengths=None, *, block_table=None, scale=None, backend=None):
    """Validate once and return a launchable plan of the conservative decode (one program per
    query row, whole history, no matrix units). `plan()` returns (o, lse); plan.backend says which
    backend runs."""
    check_scale(scale)  # one rule for every backend: positive and finite
    name, _ = choose_backend("before", q, cache, lengths, block_table, backend=backend)
    return BACKENDS[name].plan("before", q, cache, lengths, block_table=block_table, scale=scale)


def plan_after(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, pad="registers",
               fold_heads=False, form=None, backend=None, pad_fill: float = 0.0):
    """Validate once and return a launchable plan of the padded split-history decode.

    num_splits: None = the backend's split policy (inputs.choose_num_splits for Triton,
    inputs.choose_splits for CUDA); an int forces it (the study's sweep). pad: 'registers' (masked
    loads of the 16-row tile) or 'copy' (the seed's adapter: an explicit 16-head query buffer whose
    extra heads hold `pad_fill`, and a 16-head output sliced back; Triton). fold_heads: H > 16 as
    groups of 16 (Triton). form: the CUDA split kernel, 'mma', 'wgmma' or None / 'auto' (by piece
    length; asking for one selects the CUDA backend). backend: see `choose_backend`."""
    if pad not in ("registers", "copy"):
        raise ValueError(f"pad must be 'registers' or 'copy', got {pad!r}")
    check_scale(scale)  # one rule for every backend: positive and finite
    name, _ = choose_backend("after", q, cache, lengths, block_table, backend=backend, pad=pad,
                             fold_heads=fold_heads, form=form)
    return BACKENDS[name].plan("after", q, cache, lengths, block_table=block_table, scale=scale,
                               num_splits=num_splits, pad=pad, fold_heads=fold_heads, form=form,
                               pad_fill=pad_fill)


def mla_decode_before(q, cache, lengths=None, *, block_table=None, scale=None, backend=None):
    """The conservative decode in one call: (o, lse) as new tensors (see `plan_before`)."""
    o, lse = plan_before(q, cache, lengths, block_table=block_table, scale=scale, backend=backend)()
    return o.clone(), lse.clone()


def mla_decode_after(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None,
                     fold_heads=False,
                     pad="registers", backend=None):
    """The padded, split-history decode in one call: (o, lse) as new tensors (see `plan_after`)."""
    o, lse = plan_after(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                        fold_heads=fold_heads, pad=pad, backend=backend)()
    return o.clone(), lse.clone()
