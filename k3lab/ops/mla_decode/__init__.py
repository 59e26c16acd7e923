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

Backends (`BACKENDS`, k3lab.ops' contract: tried in priority order; the first that is available here
and takes the inputs runs, `plan.backend` says which; `backend=` or K3LAB_MLA_DECODE_BACKEND forces one
by name, and so does a CUDA `form=`). Each verifies (variant, q, cache, lengths, block_table, pad=,
fold_heads=, form=) and provides the callables 'plan_before' and 'plan_after' (aiter: 'plan_after'):

* 'cuda' (cuda.py): NVIDIA sm_90 with nvcc, bf16, <= 16 heads, pad='registers'; the after for one
  token, and for verification groups over a paged cache (each token a request over the same pages);
  the before for bf16 on any CUDA GPU.
* 'triton' (triton.py): everywhere else (other GPUs, fp32 / fp16, pad='copy', fold_heads, and on a
  CPU through Triton's interpreter).
* 'aiter' (peers.aiter_decode, ROCm with amd-aiter): the seed's padded assembly decode; after Triton
  in priority because it is not yet run on AMD hardware by this project, so it runs only when forced.
* 'torch' (torch_plan.py): the plain-PyTorch reference as a plan, before and after alike; any
  device, last in priority (it runs when forced, or where nothing else does).

Where the figures behind each choice are: docs/mla_padding.md.
"""

from __future__ import annotations

import torch

from k3lab.ops import Backend, Backends, BackendUnavailable, triton_available
from k3lab.ops.mla_decode import cuda, torch_plan, triton
from k3lab.ops.mla_decode.inputs import (DEFAULT_SCALE, LATENT_DIM, MAX_Q_LEN, MMA_ROWS, VALUE_DIM,
                                         LaunchConfig,
                                         check_scale, choose_num_splits, choose_splits, decode_flops,
                                         gather_paged, split_cost, to_paged)
from k3lab.ops.mla_decode.triton import DecodePlan, after_groups

CUDA_VERIFY_Q_LENS = cuda.VERIFY_Q_LENS
_PEER_NAMES = ("reference", "einsum_decode", "sdpa_decode", "aiter_status", "aiter_decode", "flashmla_status",
               "flashmla_plan")

__all__ = [
    "LATENT_DIM", "VALUE_DIM", "DEFAULT_SCALE", "MMA_ROWS", "MAX_Q_LEN", "CUDA_VERIFY_Q_LENS", "BACKENDS",
    "BACKEND_ENV", "BackendUnavailable", "VARIANTS", "DecodePlan", "LaunchConfig", "plan_before",
    "plan_after",
    "mla_decode_before", "mla_decode_after", "choose_num_splits", "choose_splits", "split_cost",
    "decode_flops", "after_groups", "to_paged", "gather_paged", *_PEER_NAMES,
]


def __getattr__(name: str):
    # The peers load on first use, so that `python -m k3lab.ops.mla_decode.peers` runs that module once.
    if name in _PEER_NAMES:
        from k3lab.ops.mla_decode import peers

        return getattr(peers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _cuda_available() -> tuple[bool, str]:
    ok, why = cuda.status()
    return (True, why) if ok else cuda.before_status()


def _cuda_verify_before(q=None, cache=None, lengths=None, block_table=None, **opts) -> tuple[bool, str]:
    ok, why = cuda.before_status()
    if not ok or q is None:
        return ok, why
    try:
        cuda.check_before(q, cache, lengths, block_table=block_table)
    except ValueError as exc:
        return False, str(exc)
    return True, why


def _cuda_verify_after(q=None, cache=None, lengths=None, block_table=None, **opts) -> tuple[bool, str]:
    ok, why = cuda.status()
    if not ok:
        return ok, why
    if opts.get("pad", "registers") != "registers":
        return False, "pad='copy' (the explicit 16-head buffer) runs on the Triton backend"
    refused = cuda.after_refusal(q, cache, lengths, block_table) if q is not None else None
    return refused is None, refused or why


def _cuda_verify(variant, *inputs, **opts) -> tuple[bool, str]:
    return {"before": _cuda_verify_before, "after": _cuda_verify_after}[variant](*inputs, **opts)


def _cuda_plan_before(q, cache, lengths, *, block_table, scale):
    return cuda.plan_before(q, cache, lengths, block_table=block_table, scale=scale)


def _cuda_plan_after(q, cache, lengths, *, block_table, scale, num_splits=None, form=None, pad_fill=0.0,
                     **opts):
    if opts.get("pad", "registers") != "registers":
        raise ValueError("backend 'cuda' takes pad='registers' only (pad='copy' runs on the Triton backend)")
    # a verification group (q_len > 1) runs each token as a request over the same pages
    plan = cuda.plan_verify if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1 else cuda.plan
    return plan(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits, form=form)


def _triton_verify(variant, *inputs, form=None, **opts) -> tuple[bool, str]:
    if form not in (None, "auto"):
        return False, f"form={form!r} names a CUDA split kernel; the Triton backend has one form"
    return True, ""


def _triton_plan_before(q, cache, lengths, *, block_table, scale):
    return triton.plan_before(q, cache, lengths, block_table=block_table, scale=scale)


def _triton_plan_after(q, cache, lengths, *, block_table, scale, num_splits=None, form=None, **opts):
    return triton.plan_after(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                             **opts)


def _aiter_available() -> tuple[bool, str]:
    from k3lab.ops.mla_decode import peers  # see __getattr__

    return peers.aiter_status()


def _aiter_plan_after(q, cache, lengths, *, block_table, scale, num_splits=None, form=None, pad_fill=0.0,
                      **opts):
    from k3lab.ops.mla_decode import peers  # see __getattr__

    if num_splits is not None or opts.get("pad", "registers") != "registers" or form:
        raise ValueError("backend 'aiter' runs the after with its own split choice, padding and form only")
    return peers.AiterPlan(q, cache, lengths, block_table=block_table, scale=scale)


def _torch_verify(variant, *inputs, form=None, **opts) -> tuple[bool, str]:
    if form not in (None, "auto"):
        return False, f"form={form!r} names a CUDA split kernel; the reference has none"
    return True, ""


# verify: (variant, q, cache, lengths, block_table, pad=, fold_heads=, form=) -> (ok, why); callables:
# plan_before(q, cache, lengths, *, block_table, scale) and plan_after(..., num_splits, pad, fold_heads,
# form, pad_fill) -> a launchable plan. AITER has no before (its decode is the padded one), and is last:
# it is not yet run on AMD hardware by this project, so it runs only when forced. 'torch' is the
# plain-PyTorch reference (torch_plan), the before and the after alike; on any device, last.
BACKENDS = Backends(
    "mla_decode",
    Backend("cuda", 0, _cuda_available, _cuda_verify,
            parts={"plan_before": _cuda_plan_before, "plan_after": _cuda_plan_after}),
    Backend("triton", 1, triton_available, _triton_verify,
            parts={"plan_before": _triton_plan_before, "plan_after": _triton_plan_after}),
    Backend("aiter", 2, _aiter_available, parts={"plan_after": _aiter_plan_after}),
    Backend("torch", 3, lambda: (True, "the PyTorch reference (k3lab.nn.mla.latent_attention in fp32)"),
            _torch_verify, parts={"plan_before": torch_plan.plan, "plan_after": torch_plan.plan}),
)
BACKEND_ENV = BACKENDS.env


def _choose(variant, q, cache, lengths, block_table, backend, **opts) -> Backend:
    """The row of a plan of `variant`: BACKENDS' choice among the rows with its plan, where a CUDA
    `form` (none forced) asks for 'cuda'."""
    arg = "backend"
    if backend is None and opts.get("form") not in (None, "auto") and BACKENDS.forced()[0] is None:
        backend, arg = "cuda", f"backend (form={opts['form']!r} is a CUDA kernel's)"
    return BACKENDS.pick(backend, variant, q, cache, lengths, block_table, arg=arg, need=f"plan_{variant}",
                         **opts)


def plan_before(q, cache, lengths=None, *, block_table=None, scale=None, backend=None):
    """Validate once and return a launchable plan of the conservative decode (one program per
    query row, whole history, no matrix units). `plan()` returns (o, lse); plan.backend says which
    backend runs."""
    check_scale(scale)  # one rule for every backend: positive and finite
    row = _choose("before", q, cache, lengths, block_table, backend)
    return row.plan_before(q, cache, lengths, block_table=block_table, scale=scale)


def plan_after(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, pad="registers",
               fold_heads=False, form=None, backend=None, pad_fill: float = 0.0):
    """Validate once and return a launchable plan of the padded split-history decode.

    num_splits: None = the backend's split policy (inputs.choose_num_splits for Triton,
    inputs.choose_splits for CUDA); an int forces it (the study's sweep). pad: 'registers' (masked
    loads of the 16-row tile) or 'copy' (the seed's adapter: an explicit 16-head query buffer whose
    extra heads hold `pad_fill`, and a 16-head output sliced back; Triton). fold_heads: H > 16 as
    groups of 16 (Triton). form: the CUDA split kernel, 'mma', 'wgmma' or None / 'auto' (by piece
    length; asking for one selects the CUDA backend). backend: a name of BACKENDS, None to choose."""
    if pad not in ("registers", "copy"):
        raise ValueError(f"pad must be 'registers' or 'copy', got {pad!r}")
    check_scale(scale)  # one rule for every backend: positive and finite
    row = _choose("after", q, cache, lengths, block_table, backend, pad=pad, fold_heads=fold_heads, form=form)
    return row.plan_after(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits,
                          pad=pad, fold_heads=fold_heads, form=form, pad_fill=pad_fill)


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


# the one before/after axis: the decode in one call, by variant
VARIANTS = {"before": mla_decode_before, "after": mla_decode_after}
