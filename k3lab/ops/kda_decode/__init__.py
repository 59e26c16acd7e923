"""KDA decode, one token per sequence: the unfused chain and the fused kernel (seed section 3).

Per sequence and head, a KDA decode step (docs/k3.md) is

    q, k, v = SiLU(causal conv4(projections))        the conv states keep the last 3 inputs
    q, k    = x / sqrt(sum x^2 + 1e-6); q *= K^-0.5
    g       = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias));  beta = sigmoid(b_raw)
    S <- diag(exp g) S;  u = S^T k;  S <- S + k (beta (v - u))^T;  o = S^T q      (S fp32, K x V)
    out     = RMSNorm_V(o) * o_norm * sigmoid(gate)

Three implementations, the backends of one entry point `kda_decode(..., backend=...)` (`BACKENDS`,
k3lab.ops' contract; K3LAB_KDA_DECODE_BACKEND forces one too):

* 'torch', `reference`: k3lab.nn pieces (short_conv, l2_normalize, kda_gate, kda_beta, kda_recurrent,
  gated_rms_norm) in fp32 or fp64. `handoff_dtype=torch.bfloat16` rounds the conv outputs and o
  where the unfused chain stores them in memory, which is what that chain computes exactly.
* 'triton', `before`: the chain the seed describes, in k3lab's own Triton kernels: a conv kernel, a
  kernel that fuses the q/k norm, both gates and the recurrent update, the output norm, and the two
  copies between them: 3 compute launches + 2 copies, every handoff through device memory in bf16.
* 'cuda', `after`: kernels/kda_decode.cu (`k3lab.ops.kda_decode.cuda`), one launch, intermediates kept
  on chip in fp32, the output written straight into the caller's buffer; only the conv states and S go
  back to memory.

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
from k3lab.ops import Backend, Backends, triton_status
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
    check_kernel_static,
    check_static,
    clone_cache,
    make_example,
    tensor_arg,
    validate,
)
from k3lab.ops.kda_decode.reference import reference, write_back

__all__ = [
    "BACKENDS", "BACKEND_ENV", "CONFIGS", "CONV_SIZE", "HEAD_DIM", "HINT_PREFETCH_L2", "HINT_STREAM_LOADS",
    "HINT_STREAM_STORES", "L2_EPS", "SPLIT_MODES", "SPLIT_TILE", "SPLIT_TILE_FINE", "STATE_LAYOUTS",
    "TOKEN_INPUTS",
    "KDADecodeStep",
    "KDADecodeWeights", "after", "before", "choose_config", "choose_split", "clone_cache", "default_hints",
    "fused_status", "kda_decode", "make_example", "reference", "validate",
]

def _fused_verify(device=None, dtype=None) -> tuple[bool, str]:
    if device is not None and torch.device(device).type != "cuda":
        return False, f"the fused kernel runs on a GPU; the tensors are on {torch.device(device).type}"
    if dtype is not None and dtype != torch.bfloat16:
        return False, f"the fused kernel takes bf16 activations, got {dtype}"
    return True, ""


# verify: (device, dtype) of the activations. The Triton chain is last: it runs only when asked for.
BACKENDS = Backends(
    "kda_decode",
    Backend("cuda", 0, cuda.status, _fused_verify),
    Backend("torch", 1, lambda: (True, "the PyTorch reference (k3lab.nn pieces in fp32)")),
    Backend("triton", 2, triton_status),
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
                 split=None):
        """backend: a name of BACKENDS, None to choose (module docstring). tile_v/hints/split
        (backend='cuda' only) override what `cuda.choose_config`, `cuda.default_hints` and
        `cuda.choose_split` pick from the device."""
        if not isinstance(cache, KDACache):
            raise ValueError(f"cache must be a k3lab.nn.KDACache, got {type(cache).__name__}")  # noqa: TRY004
        S = tensor_arg("cache.state", cache.state)
        if S.dim() != 4:
            raise ValueError(f"cache.state must be [B, H, {HEAD_DIM}, {HEAD_DIM}], got {tuple(S.shape)}")
        B, H = S.shape[0], S.shape[1]
        act = tensor_arg("cache.conv_q", cache.conv_q).dtype
        check_static(cache, weights, out, B, H, act, S.device, state_layout, source="cache.conv_q")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS.names} or None, got {backend!r}")
        if any(x is not None for x in (tile_v, hints, split)) and backend != "cuda":
            raise ValueError("tile_v, hints and split apply to backend='cuda' only")
        backend, _ = BACKENDS.choose(backend, S.device, act)
        if backend != "torch":
            check_kernel_static(cache, weights, out, backend)
        self.cache, self.weights, self.backend, self.state_layout = cache, weights, backend, state_layout
        self.batch, self.heads, self.dtype, self.device = B, H, act, S.device
        self.out = out if out is not None else torch.empty(B, H * HEAD_DIM, device=S.device, dtype=act)
        hk = torch.Size((B, H * HEAD_DIM))
        self._shapes = (hk, hk, hk, hk, torch.Size((B, H)), hk)
        self.fused = (cuda.FusedStep(cache, weights, self.out, state_layout=state_layout, tile_v=tile_v,
                                     hints=hints, split=split) if backend == "cuda" else None)

    def _bad_token(self, name, t, shape):
        tensor_arg(name, t)
        if t.shape != shape:
            raise ValueError(f"{name} must be {list(shape)} (B={self.batch}, H={self.heads}, head_dim "
                             f"{HEAD_DIM}), got {tuple(t.shape)}")
        if t.dtype != self.dtype:
            raise ValueError(f"{name} must have the cache's dtype {self.dtype}, got {t.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")

    def __call__(self, q, k, v, g_raw, beta_raw, gate) -> torch.Tensor:
        toks = (q, k, v, g_raw, beta_raw, gate)
        dtype, device = self.dtype, self.device
        for name, t, shape in zip(TOKEN_INPUTS, toks, self._shapes):
            try:
                ok = t.shape == shape and t.dtype is dtype and t.device == device and t.stride(-1) == 1
            except AttributeError:
                ok = False
            if not ok:
                self._bad_token(name, t, shape)
        if self.fused is not None:
            self.fused(q, k, v, g_raw, beta_raw, gate)
            return self.out
        if self.backend == "triton":
            return triton.launch(q, k, v, g_raw, beta_raw, gate, self.cache, self.weights, self.out,
                                  self.state_layout, self.batch, self.heads)
        fp64 = self.cache.state.dtype == torch.float64
        res, new = reference(q, k, v, g_raw, beta_raw, gate, self.cache, self.weights,
                             state_layout=self.state_layout,
                             compute_dtype=torch.float64 if fp64 else torch.float32)
        write_back(self.cache, new)
        self.out.copy_(res)
        return self.out


def before(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, state_layout="kv") -> torch.Tensor:
    """The unfused chain: conv kernel -> norm/gates/recurrence kernel -> copy -> output-norm kernel ->
    copy into `out`. Intermediates go through memory in the activation dtype."""
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    return KDADecodeStep(cache, weights, out=out, backend="triton", state_layout=state_layout)(
        q, k, v, g_raw, beta_raw, gate)


def after(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, state_layout="kv", tile_v=None,
          hints=None, split=None) -> torch.Tensor:
    """The fused kernel: one launch per step. tile_v overrides the width chosen from the device
    (`cuda.choose_config`); split: 'atomic' or 'cluster' for split heads (`cuda.choose_split`); hints:
    a mix of HINT_STREAM_LOADS, HINT_STREAM_STORES, HINT_PREFETCH_L2 (`cuda.default_hints`).
    Checks everything on every call; a serving loop binds a `KDADecodeStep` once instead."""
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    return KDADecodeStep(cache, weights, out=out, backend="cuda", state_layout=state_layout, tile_v=tile_v,
                         hints=hints, split=split)(
        q, k, v, g_raw, beta_raw, gate)


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
    if kernel_options and backend != "cuda":
        raise ValueError(f"{sorted(kernel_options)} apply to backend='cuda' only")
    backend, _ = BACKENDS.choose(backend, getattr(q, "device", None), getattr(q, "dtype", None))
    if backend == "cuda":
        return after(q, k, v, g_raw, beta_raw, gate, cache, weights, out=out, state_layout=state_layout,
                     **kernel_options)
    if backend == "triton":
        return before(q, k, v, g_raw, beta_raw, gate, cache, weights, out=out, state_layout=state_layout)
    fp64 = (
        isinstance(cache, KDACache)
        and isinstance(cache.state, torch.Tensor)
        and cache.state.dtype == torch.float64
    )
    res, new = reference(q, k, v, g_raw, beta_raw, gate, cache, weights, state_layout=state_layout,
                         compute_dtype=torch.float64 if fp64 else torch.float32)
    write_back(cache, new)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
