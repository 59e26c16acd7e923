"""KDA decode, one token per sequence: the unfused chain and the fused kernel (seed section 3).

Per sequence and head, a KDA decode step (docs/k3.md) is

    q, k, v = SiLU(causal conv4(projections))        the conv states keep the last 3 inputs
    q, k    = x / sqrt(sum x^2 + 1e-6); q *= K^-0.5
    g       = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias));  beta = sigmoid(b_raw)
    S <- diag(exp g) S;  u = S^T k;  S <- S + k (beta (v - u))^T;  o = S^T q      (S fp32, K x V)
    out     = RMSNorm_V(o) * o_norm * sigmoid(gate)

Three implementations, the rows of one table (`BACKENDS`, k3lab.ops' contract; `backend=` or
K3LAB_KDA_DECODE_BACKEND forces one), each carrying the bound step of the variant it implements
(`plan_before`, `plan_after`: (cache, weights, out, state_layout, B, H) -> step):

* 'torch' (both; `reference`): k3lab.nn pieces (short_conv, l2_normalize, kda_gate, kda_beta,
  kda_recurrent, gated_rms_norm) in fp32 or fp64. `handoff_dtype=torch.bfloat16` rounds the conv
  outputs and o where the unfused chain stores them in memory, which is what that chain computes exactly.
* 'triton' (plan_before; `before`): the chain the seed describes, in k3lab's own Triton kernels: a conv
  kernel, a kernel that fuses the q/k norm, both gates and the recurrent update, the output norm, and
  the two copies between them: 3 compute launches + 2 copies, every handoff through device memory in bf16.
* 'cuda' (plan_after; `after`): kernels/kda_decode.cu (`k3lab.ops.kda_decode.cuda`), one launch,
  intermediates kept on chip in fp32, the output written straight into the caller's buffer; only the
  conv states and S go back to memory.

All three update `cache` (a k3lab.nn.KDACache: conv_q, conv_k, conv_v [B, H*K, 3], state) in place
and return out [B, H*V]. State layout 'kv' is [B, H, K, V] (fla's default); 'vk' is [B, H, V, K].
Unforced (backend=None), 'cuda' runs on bf16 GPU tensors where the fused kernel can be built here,
else 'torch'; the Triton chain runs only when asked for (it is the seed's "before"). `fused_status()`
says whether the fused kernel runs and why. A serving loop binds
`KDADecodeStep(cache, weights, backend=...)` once per layer and calls it with the six per-token inputs
(q, k, v, g_raw, beta_raw, gate).

Values are not read (the step is captured in the decode graph): a NaN or infinity in one sequence's
inputs, conv states or state reaches that sequence's output and saved state (so its later tokens) and
never another sequence's or head's (tests/test_bad_inputs_values.py checks this on every backend).

Modules: `inputs` (weights, examples, checks), `reference`, `triton` (before), `cuda` (after: the
binding, the launch configuration chosen from the device). Figures: profiles/<device>/kda_decode/;
the configurations that lost: docs/kda_decode.md.
"""

from __future__ import annotations

import torch

from k3lab.nn import KDACache
from k3lab.ops import Backend, Backends, expect, triton_status
from k3lab.ops.kda_decode import cuda, triton
from k3lab.ops.kda_decode.cuda import (
    CONFIGS,
    HINT_PREFETCH_L2,
    HINT_STREAM_LOADS,
    HINT_STREAM_STORES,
    SPLIT_MODES,
    SPLIT_TILE,
    SPLIT_TILE_FINE,
    choose_config,
    choose_split,
    default_hints,
)
from k3lab.ops.kda_decode.inputs import (
    CONV_SIZE,
    HEAD_DIM,
    L2_EPS,
    STATE_LAYOUTS,
    TOKEN_INPUTS,
    KDADecodeWeights,
    check_fused_static,
    check_kernel_static,
    check_static,
    clone_cache,
    make_example,
    validate,
)
from k3lab.ops.kda_decode.reference import reference, write_back

__all__ = [
    "BACKENDS", "BACKEND_ENV", "CONFIGS", "CONV_SIZE", "HEAD_DIM", "HINT_PREFETCH_L2", "HINT_STREAM_LOADS",
    "HINT_STREAM_STORES", "L2_EPS", "SPLIT_MODES", "SPLIT_TILE", "SPLIT_TILE_FINE", "STATE_LAYOUTS",
    "TOKEN_INPUTS",
    "VARIANTS", "KDADecodeStep",
    "KDADecodeWeights", "after", "before", "choose_config", "choose_split", "clone_cache", "default_hints",
    "fused_status", "kda_decode", "make_example", "reference", "validate",
]

def _fused_verify(device=None, dtype=None) -> tuple[bool, str]:
    if device is not None and torch.device(device).type != "cuda":
        return False, f"the fused kernel runs on a GPU; the tensors are on {torch.device(device).type}"
    if dtype is not None and dtype != torch.bfloat16:
        return False, f"the fused kernel takes bf16 activations, got {dtype}"
    return True, ""


def _no_options(name: str, options: dict) -> None:
    if options:
        raise ValueError(f"{sorted(options)} (tile_v, hints and split) apply to backend='cuda' only, "
                         f"not {name!r}")


def _bind_fused(cache, weights, out, state_layout, B, H, **kernel_options):
    check_kernel_static(cache, weights, out)
    check_fused_static(cache, weights)
    return cuda.FusedStep(cache, weights, out, state_layout=state_layout, **kernel_options)


def _bind_chain(cache, weights, out, state_layout, B, H, **kernel_options):
    _no_options("triton", kernel_options)
    check_kernel_static(cache, weights, out)

    def chain(q, k, v, g_raw, beta_raw, gate):
        triton.launch(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout, B, H)
    return chain


def _bind_reference(cache, weights, out, state_layout, B, H, **kernel_options):
    _no_options("torch", kernel_options)
    compute = torch.float64 if cache.state.dtype == torch.float64 else torch.float32

    def run(q, k, v, g_raw, beta_raw, gate):
        res, new = reference(q, k, v, g_raw, beta_raw, gate, cache, weights, state_layout=state_layout,
                             compute_dtype=compute)
        write_back(cache, new)
        out.copy_(res)
    return run


# verify: (device, dtype) of the activations. Callables: plan_after / plan_before (cache, weights, out,
# state_layout, B, H, **kernel_options) -> step(q, k, v, g_raw, beta_raw, gate), which updates the cache
# and fills out. The fused kernel is the after, the Triton chain the before (it runs only when asked
# for), the torch row the reference (both).
BACKENDS = Backends(
    "kda_decode",
    Backend("cuda", 0, cuda.status, _fused_verify, parts={"plan_after": _bind_fused}),
    Backend("torch", 1, lambda: (True, "the PyTorch reference (k3lab.nn pieces in fp32)"),
            parts={"plan_after": _bind_reference, "plan_before": _bind_reference}),
    Backend("triton", 2, triton_status, parts={"plan_before": _bind_chain}),
)
BACKEND_ENV = BACKENDS.env


def fused_status() -> tuple[bool, str]:
    """(True, what runs) when the fused kernel can run here; else (False, why, and what an unforced
    backend uses instead)."""
    ok, why = cuda.status()
    if not ok:
        return False, f"fused KDA decode unavailable ({why}); backend=None uses the PyTorch reference"
    return True, why


class KDADecodeStep:
    """One KDA layer's decode step bound to its cache, weights and output buffer, as a serving engine
    holds it: everything that does not change from token to token is checked (and, for the fused
    kernel, packed into its argument block) once here; a call checks only the six per-token inputs.

        step = KDADecodeStep(cache, weights, backend="cuda")   # or "triton", "torch"; None chooses
        out = step(q, k, v, g_raw, beta_raw, gate)           # updates cache in place, fills step.out
    """

    def __init__(self, cache, weights, *, out=None, backend=None, state_layout="kv", tile_v=None, hints=None,
                 split=None, variant=None):
        """backend: a name of BACKENDS, None to choose (module docstring). variant: 'after' or 'before'
        (None: the row's own: its after where it has one, else its before: the Triton chain).
        tile_v/hints/split (backend='cuda' only) override what `cuda.choose_config`,
        `cuda.default_hints` and `cuda.choose_split` pick from the device."""
        if not isinstance(cache, KDACache):
            raise ValueError(f"cache must be a k3lab.nn.KDACache, got {type(cache).__name__}")  # noqa: TRY004
        S = expect("cache.state", cache.state, shape=4, what=f"[B, H, {HEAD_DIM}, {HEAD_DIM}]")
        B, H = S.shape[0], S.shape[1]
        act = expect("cache.conv_q", cache.conv_q).dtype
        check_static(cache, weights, out, B, H, act, S.device, state_layout, source="cache.conv_q")
        if variant is not None and variant not in VARIANTS:
            raise ValueError(f"variant must be one of {tuple(VARIANTS)} or None, got {variant!r}")
        options = {k: v for k, v in (("tile_v", tile_v), ("hints", hints), ("split", split)) if v is not None}
        row, _ = BACKENDS.select(backend, S.device, act, need=None if variant is None else f"plan_{variant}")
        bind = row.parts.get(f"plan_{variant or 'after'}") or row.plan_before
        self.cache, self.weights, self.backend, self.state_layout = cache, weights, row.name, state_layout
        self.batch, self.heads, self.dtype, self.device = B, H, act, S.device
        self.out = out if out is not None else torch.empty(B, H * HEAD_DIM, device=S.device, dtype=act)
        hk = torch.Size((B, H * HEAD_DIM))
        self._shapes = (hk, hk, hk, hk, torch.Size((B, H)), hk)
        self._run = bind(cache, weights, self.out, state_layout, B, H, **options)
        self.fused = self._run if isinstance(self._run, cuda.FusedStep) else None

    def _bad_token(self, name, t, shape):
        expect(name, t, shape=shape, dtype=self.dtype, device=self.device, contiguous="last",
               what=f"{list(shape)} (B={self.batch}, H={self.heads}, head_dim {HEAD_DIM})")
        raise AssertionError(f"{name} passed expect but not the bound step's check")  # the two agree

    def __call__(self, q, k, v, g_raw, beta_raw, gate) -> torch.Tensor:
        toks = (q, k, v, g_raw, beta_raw, gate)
        dtype, device = self.dtype, self.device
        for name, t, shape in zip(TOKEN_INPUTS, toks, self._shapes):
            try:
                ok = (t.shape == shape and t.dtype is dtype and t.device == device
                      and (t.stride(-1) == 1 or t.shape[-1] == 1))  # expect's contiguous="last"
            except AttributeError:
                ok = False
            if not ok:
                self._bad_token(name, t, shape)
        self._run(q, k, v, g_raw, beta_raw, gate)
        return self.out


def before(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, state_layout="kv", backend=None
           ) -> torch.Tensor:
    """The unfused chain: conv kernel -> norm/gates/recurrence kernel -> copy -> output-norm kernel ->
    copy into `out`. Intermediates go through memory in the activation dtype. backend: 'triton' (the
    chain) unless named ('torch': the reference)."""
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    step = KDADecodeStep(cache, weights, out=out, backend=backend or "triton", state_layout=state_layout,
                         variant="before")
    return step(q, k, v, g_raw, beta_raw, gate)


def after(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, state_layout="kv", tile_v=None,
          hints=None, split=None, backend=None) -> torch.Tensor:
    """The fused kernel: one launch per step. tile_v overrides the width chosen from the device
    (`cuda.choose_config`); split: 'atomic' or 'cluster' for split heads (`cuda.choose_split`); hints:
    a mix of HINT_STREAM_LOADS, HINT_STREAM_STORES, HINT_PREFETCH_L2 (`cuda.default_hints`).
    backend: 'cuda' unless named ('torch': the reference). Checks everything on every call; a serving
    loop binds a `KDADecodeStep` once instead."""
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    step = KDADecodeStep(cache, weights, out=out, backend=backend or "cuda", state_layout=state_layout,
                         tile_v=tile_v, hints=hints, split=split, variant="after")
    return step(q, k, v, g_raw, beta_raw, gate)


# the one before/after axis: the step in one call, by variant
VARIANTS = {"before": before, "after": after}


# ----------------------------------------------------------------------------------------------
# the entry point


def kda_decode(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, backend=None, state_layout="kv",
               **kernel_options) -> torch.Tensor:
    """One KDA decode step. Updates `cache` in place and returns out [B, H*V] (written into `out`
    when given). backend: 'cuda' (the fused kernel, `after`), 'triton' (the unfused chain, `before`),
    'torch' (k3lab.nn pieces in fp32, results cast back) or None (the module docstring's choice);
    kernel_options (tile_v, hints, split) go to the fused kernel."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS.names} or None, got {backend!r}")
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    if out is None:  # the step's buffer, in q's dtype
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return KDADecodeStep(cache, weights, out=out, backend=backend, state_layout=state_layout,
                         **kernel_options)(q, k, v, g_raw, beta_raw, gate)
