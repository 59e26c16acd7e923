"""KDA decode, one token per sequence: the unfused chain and the fused kernel (seed section 3).

Per sequence and head, a KDA decode step (architecture.md section 3) is

    q, k, v = SiLU(causal conv4(projections))        the conv states keep the last 3 inputs
    q, k    = x / sqrt(sum x^2 + 1e-6); q *= K^-0.5
    g       = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias));  beta = sigmoid(b_raw)
    S <- diag(exp g) S;  u = S^T k;  S <- S + k (beta (v - u))^T;  o = S^T q      (S fp32, K x V)
    out     = RMSNorm_V(o) * o_norm * sigmoid(gate)

Three implementations, one entry point `kda_decode(..., impl=...)`:

* `reference`: k3lab.nn pieces (short_conv, l2_normalize, kda_gate, kda_beta, kda_recurrent,
  gated_rms_norm) in fp32 or fp64. `handoff_dtype=torch.bfloat16` rounds the conv outputs and o
  where the unfused chain stores them in memory, which is what that chain computes exactly.
* `before`: the chain the seed describes, in k3lab's own Triton kernels: a conv kernel, a kernel that
  fuses the q/k norm, both gates and the recurrent update, the output norm, and the two copies
  between them: 3 compute launches + 2 copies, every handoff through device memory in bf16.
* `after`: kernels/kda_decode.cu, one launch, intermediates kept on chip in fp32, the output written
  straight into the caller's buffer; only the conv states and S go back to memory.

All three update `cache` (a k3lab.nn.KDACache: conv_q, conv_k, conv_v [B, H*K, 3], state) in place
and return out [B, H*V]. State layout 'kv' is [B, H, K, V] (fla's default); 'vk' is [B, H, V, K].
`impl='auto'` runs `after` where the fused kernel can be built here, else `reference`;
`fused_status()` says which and why. A serving loop binds `KDADecodeStep(cache, weights, impl=...)`
once per layer and calls it with the six per-token inputs (q, k, v, g_raw, beta_raw, gate).

Measured (H200, TP8 slice of 12 heads, CUDA-graph replay, profiles/nvidia-h200/kda_decode/):
B = 1: before 8.58 us, after 3.83 us, fla-core 11.2 us; B = 128: 74.0 / 53.7 / 87.7 us, the fused
kernel moving its 201 MB of state at 3.75 TB/s (88% of the 4.25 TB/s device copy).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from k3lab.nn import KDACache
from k3lab.nn.kda import kda_beta, kda_gate, kda_recurrent, short_conv
from k3lab.nn.norms import gated_rms_norm, l2_normalize
from k3lab.ops import _build

try:
    import triton
    import triton.language as tl
except ImportError:  # `before` needs Triton; the reference and the fused kernel do not
    triton = None

HEAD_DIM = 128  # K = V = 128 in K3; the fused kernel is compiled for it
CONV_SIZE = 4
L2_EPS = 1e-6
IMPLS = ("auto", "after", "before", "reference")
STATE_LAYOUTS = ("kv", "vk")


# ----------------------------------------------------------------------------------------------
# weights and example inputs


@dataclass
class KDADecodeWeights:
    """A KDA layer's decode-time parameters, in the form the kernels read (prepared once at load).

    conv_q, conv_k, conv_v: [H*K, 4] fp32 (column 3 multiplies the current token); A_log [H] fp32;
    dt_bias [H*K] fp32; o_norm [V] fp32; lower_bound and eps (the output RMSNorm's)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm: torch.Tensor
    lower_bound: float = -5.0
    eps: float = 1e-5

    @property
    def num_heads(self) -> int:
        return self.A_log.shape[0]

    @classmethod
    def from_layer(cls, layer, dtype=torch.float32) -> KDADecodeWeights:
        """From a k3lab.nn.KimiDeltaAttention (weights converted once, here; fp32 for the kernels,
        fp64 for an fp64 reference)."""
        f32 = {"dtype": dtype, "memory_format": torch.contiguous_format}
        return cls(layer.q_conv.weight.detach()[:, 0].to(**f32), layer.k_conv.weight.detach()[:, 0].to(**f32),
                   layer.v_conv.weight.detach()[:, 0].to(**f32), layer.A_log.detach().to(**f32),
                   layer.dt_bias.detach().to(**f32), layer.o_norm.weight.detach().to(**f32),
                   float(layer.lower_bound), float(layer.eps))

    @classmethod
    def random(cls, num_heads: int, *, device="cpu", generator: torch.Generator | None = None,
               dtype=torch.float32) -> KDADecodeWeights:
        """Fresh random weights of plausible size (never zeros), for tests and benchmarks."""
        H, K = num_heads, HEAD_DIM
        r = {"generator": generator, "dtype": dtype}

        def rnd(*shape, scale=1.0, shift=0.0):
            return (torch.randn(*shape, **r) * scale + shift).to(device)

        return cls(rnd(H * K, CONV_SIZE, scale=0.5), rnd(H * K, CONV_SIZE, scale=0.5),
                   rnd(H * K, CONV_SIZE, scale=0.5),
                   torch.log(torch.rand(H, **r) * 15 + 1).to(device),  # exp(A_log) in [1, 16]
                   rnd(H * K, scale=0.5), rnd(K, scale=0.1, shift=1.0))


def make_example(batch: int, num_heads: int, *, device="cpu", dtype=torch.bfloat16, state_layout="kv",
                 seed: int = 0) -> tuple[dict, KDACache, KDADecodeWeights]:
    """(inputs, cache, weights) for one decode step on fresh random data: inputs holds q, k, v
    [B, H*K] (projections before the conv), g_raw [B, H*K], beta_raw [B, H], gate [B, H*V] in
    `dtype`; the cache holds random conv states in `dtype` and a random fp32 state (never zeros)."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    gen = torch.Generator().manual_seed(seed)
    B, H, K = batch, num_heads, HEAD_DIM

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)

    inputs = {"q": rnd(B, H * K), "k": rnd(B, H * K), "v": rnd(B, H * K), "g_raw": rnd(B, H * K),
              "beta_raw": rnd(B, H), "gate": rnd(B, H * K)}
    cache = KDACache(rnd(B, H * K, CONV_SIZE - 1), rnd(B, H * K, CONV_SIZE - 1), rnd(B, H * K, CONV_SIZE - 1),
                     rnd(B, H, K, K, scale=0.1, dt=torch.float32))
    return inputs, cache, KDADecodeWeights.random(H, device=device, generator=gen)


def clone_cache(cache: KDACache) -> KDACache:
    return KDACache(*(t.clone() for t in (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)))


# ----------------------------------------------------------------------------------------------
# input validation (before any kernel runs)


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    return t


TOKEN_INPUTS = ("q", "k", "v", "g_raw", "beta_raw", "gate")


def _check_static(cache, weights, out, B, H, act, dev, state_layout, source="q") -> None:
    """The parts of a step that stay the same from token to token: cache, weights, output buffer."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if not isinstance(cache, KDACache):
        raise ValueError(f"cache must be a k3lab.nn.KDACache, got {type(cache).__name__}")  # noqa: TRY004
    if not isinstance(weights, KDADecodeWeights):
        raise ValueError(f"weights must be a KDADecodeWeights, got {type(weights).__name__}")  # noqa: TRY004
    K = HEAD_DIM
    for name in ("conv_q", "conv_k", "conv_v"):
        t = _tensor(f"cache.{name}", getattr(cache, name))
        if tuple(t.shape) != (B, H * K, CONV_SIZE - 1):
            raise ValueError(f"cache.{name} must be [B={B}, H*K={H * K}, {CONV_SIZE - 1}], got {tuple(t.shape)}")
        if t.dtype != act:
            raise ValueError(f"cache.{name} must have {source}'s dtype {act} (it stores past inputs), got {t.dtype}")
    S = _tensor("cache.state", cache.state)
    if tuple(S.shape) != (B, H, K, K):
        dims = "K, V" if state_layout == "kv" else "V, K"
        raise ValueError(f"cache.state must be [B={B}, H={H}, {dims}] = {[B, H, K, K]} (head_dim {K}), "
                         f"got {tuple(S.shape)}")
    if S.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"cache.state must be float32 (the recurrent state is kept in fp32), got {S.dtype}")
    w = weights
    if tuple(_tensor("weights.A_log", w.A_log).shape) != (H,):
        raise ValueError(f"weights.A_log must be [H={H}], got {tuple(w.A_log.shape)}")
    for name in ("conv_q", "conv_k", "conv_v"):
        t = _tensor(f"weights.{name}", getattr(w, name))
        if tuple(t.shape) != (H * K, CONV_SIZE):
            raise ValueError(f"weights.{name} must be [H*K={H * K}, {CONV_SIZE}], got {tuple(t.shape)} "
                             "(KDADecodeWeights.from_layer converts K3's [C, 1, 4])")
    if tuple(_tensor("weights.dt_bias", w.dt_bias).shape) != (H * K,):
        raise ValueError(f"weights.dt_bias must be [H*K={H * K}], got {tuple(w.dt_bias.shape)}")
    if tuple(_tensor("weights.o_norm", w.o_norm).shape) != (K,):
        raise ValueError(f"weights.o_norm must be [{K}], got {tuple(w.o_norm.shape)}")
    if not w.lower_bound < 0:
        raise ValueError(f"weights.lower_bound must be negative, got {w.lower_bound}")
    if not w.eps > 0:
        raise ValueError(f"weights.eps must be positive, got {w.eps}")
    tensors = {"cache.conv_q": cache.conv_q, "cache.conv_k": cache.conv_k, "cache.conv_v": cache.conv_v,
               "cache.state": S, "weights.conv_q": w.conv_q, "weights.conv_k": w.conv_k,
               "weights.conv_v": w.conv_v, "weights.A_log": w.A_log, "weights.dt_bias": w.dt_bias,
               "weights.o_norm": w.o_norm}
    if out is not None:
        _tensor("out", out)
        if tuple(out.shape) != (B, H * K) or out.dtype != act:
            raise ValueError(f"out must be [B={B}, H*V={H * K}] of {source}'s dtype {act}, got "
                             f"{tuple(out.shape)} {out.dtype}")
        tensors["out"] = out
    for name, t in tensors.items():
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but {source} is on {dev}: all must be on one device")


def validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out=None, state_layout="kv") -> tuple[int, int]:
    """Check shapes, dtypes, devices and layouts; returns (B, H). ValueError names the argument."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if not isinstance(cache, KDACache):
        raise ValueError(f"cache must be a k3lab.nn.KDACache, got {type(cache).__name__}")  # noqa: TRY004
    K = HEAD_DIM
    _tensor("q", q)
    if q.dim() != 2 or q.shape[1] % K or q.shape[1] == 0:
        raise ValueError(f"q must be [B, H*{K}] (one token per sequence, head_dim {K}), got {tuple(q.shape)}")
    B, H = q.shape[0], q.shape[1] // K
    if B < 1:
        raise ValueError("q must hold at least one sequence (B >= 1)")
    act, dev = q.dtype, q.device
    if not act.is_floating_point:
        raise ValueError(f"q must be floating point, got {act}")
    expect = {"k": (k, (B, H * K)), "v": (v, (B, H * K)), "g_raw": (g_raw, (B, H * K)),
              "beta_raw": (beta_raw, (B, H)), "gate": (gate, (B, H * K))}
    for name, (t, shape) in expect.items():
        _tensor(name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} (B={B}, H={H}, head_dim {K}), got {tuple(t.shape)}")
        if t.dtype != act:
            raise ValueError(f"{name} must have q's dtype {act}, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but q is on {dev}: all must be on one device")
    _check_static(cache, weights, out, B, H, act, dev, state_layout)
    return B, H


def _check_kernel_static(cache, weights, out, impl) -> None:
    """What the compiled kernels additionally need from the static parts: packed conv states and
    state heads, contiguous fp32 weights (fused kernel), a contiguous last dimension of `out`."""
    if out is not None and out.stride(1) != 1:
        raise ValueError(f"out must have a contiguous last dimension (stride 1), got strides {out.stride()}")
    for name in ("conv_q", "conv_k", "conv_v"):
        t = getattr(cache, name)
        if t.stride()[1:] != (CONV_SIZE - 1, 1):
            raise ValueError(f"cache.{name} must be packed per sequence (strides [*, 3, 1]), got {t.stride()}")
    S = cache.state
    if S.stride()[1:] != (HEAD_DIM * HEAD_DIM, HEAD_DIM, 1):
        raise ValueError(f"cache.state must have packed heads (strides [*, {HEAD_DIM ** 2}, {HEAD_DIM}, 1]), "
                         f"got {S.stride()}")
    if impl != "after":
        return
    if cache.conv_q.dtype != torch.bfloat16:
        raise ValueError(f"the fused kernel takes bf16 activations (q, k, v, g_raw, beta_raw, gate, conv "
                         f"states), got {cache.conv_q.dtype}; use impl='reference' for other dtypes")
    if S.dtype != torch.float32:
        raise ValueError(f"cache.state must be float32 for the fused kernel, got {S.dtype}")
    for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias", "o_norm"):
        t = getattr(weights, name)
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"weights.{name} must be contiguous float32 (prepare weights once with "
                             f"KDADecodeWeights.from_layer), got {t.dtype}, contiguous={t.is_contiguous()}")
    if S.device.type != "cuda":
        raise ValueError(f"the fused kernel runs on a GPU; the cache is on {S.device}")


# ----------------------------------------------------------------------------------------------
# reference


def reference(q, k, v, g_raw, beta_raw, gate, cache, weights, *, state_layout="kv",
              compute_dtype=torch.float32, handoff_dtype=None) -> tuple[torch.Tensor, KDACache]:
    """The decode step from k3lab.nn pieces, in `compute_dtype` (fp32 or fp64). Pure: returns
    (out [B, H*V], new cache), both in compute_dtype (conv states too: they hold past inputs exactly),
    and leaves `cache` untouched. handoff_dtype (e.g. bf16) rounds the conv outputs and o to it, where
    the unfused chain stores them in memory."""
    B, H = validate(q, k, v, g_raw, beta_raw, gate, cache, weights, None, state_layout)
    if compute_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"compute_dtype must be float32 or float64, got {compute_dtype}")
    dt, K, w = compute_dtype, HEAD_DIM, weights

    def handoff(x):
        return x if handoff_dtype is None else x.to(handoff_dtype).to(dt)

    def conv(x, weight, state):  # short_conv on one token: [B, C] -> [B, C], new state [B, C, 3]
        y, new_state = short_conv(x.to(dt)[:, None], weight.to(dt), state.to(dt))
        return handoff(y[:, 0]), new_state

    yq, cq = conv(q, w.conv_q, cache.conv_q)
    yk, ck = conv(k, w.conv_k, cache.conv_k)
    yv, cv = conv(v, w.conv_v, cache.conv_v)
    qn = l2_normalize(yq.view(B, 1, H, K), eps=L2_EPS)
    kn = l2_normalize(yk.view(B, 1, H, K), eps=L2_EPS)
    g = kda_gate(g_raw.to(dt), w.A_log.to(dt), w.dt_bias.to(dt), w.lower_bound)  # [B, H, K]
    beta = kda_beta(beta_raw.to(dt))  # [B, H]
    S0 = cache.state.to(dt)
    if state_layout == "vk":
        S0 = S0.transpose(-1, -2)
    o, S = kda_recurrent(qn, kn, yv.view(B, 1, H, K), g[:, None], beta[:, None], scale=K ** -0.5,
                         initial_state=S0)
    o = handoff(o)
    out = gated_rms_norm(o, gate.to(dt).view(B, 1, H, K), w.o_norm.to(dt), w.eps)
    if state_layout == "vk":
        S = S.transpose(-1, -2)
    return out.reshape(B, H * K), KDACache(cq, ck, cv, S.contiguous())


def _write_back(cache: KDACache, new: KDACache) -> None:
    for name in ("conv_q", "conv_k", "conv_v", "state"):
        getattr(cache, name).copy_(getattr(new, name))


# ----------------------------------------------------------------------------------------------
# before: the unfused chain, in Triton (3 compute kernels + 2 copies)

if triton is not None:

    @triton.jit
    def _conv_silu_kernel(xq, xk, xv, rs_q, rs_k, rs_v, cq, ck, cv, bs_q, bs_k, bs_v, wq, wk, wv, y, C,
                          BC: tl.constexpr):
        """Short conv + SiLU of q, k, v for one sequence and BC channels; rolls the conv states and
        writes y [B, 3, C] (the first handoff through memory)."""
        b = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        offs = tl.program_id(2) * BC + tl.arange(0, BC)
        m = offs < C
        if which == 0:
            x_row = xq + b * rs_q
            st = cq + b * bs_q
            w = wq
        elif which == 1:
            x_row = xk + b * rs_k
            st = ck + b * bs_k
            w = wk
        else:
            x_row = xv + b * rs_v
            st = cv + b * bs_v
            w = wv
        x = tl.load(x_row + offs, mask=m, other=0.0)
        s0 = tl.load(st + offs * 3, mask=m, other=0.0)
        s1 = tl.load(st + offs * 3 + 1, mask=m, other=0.0)
        s2 = tl.load(st + offs * 3 + 2, mask=m, other=0.0)
        acc = tl.load(w + offs * 4, mask=m, other=0.0) * s0.to(tl.float32)
        acc += tl.load(w + offs * 4 + 1, mask=m, other=0.0) * s1.to(tl.float32)
        acc += tl.load(w + offs * 4 + 2, mask=m, other=0.0) * s2.to(tl.float32)
        acc += tl.load(w + offs * 4 + 3, mask=m, other=0.0) * x.to(tl.float32)
        acc = acc * tl.sigmoid(acc)
        tl.store(y + (b * 3 + which) * C + offs, acc.to(y.dtype.element_ty), mask=m)
        tl.store(st + offs * 3, s1, mask=m)
        tl.store(st + offs * 3 + 1, s2, mask=m)
        tl.store(st + offs * 3 + 2, x, mask=m)

    @triton.jit
    def _norm_gates_recurrence_kernel(y, g_raw, rs_g, A_log, dt_bias, b_raw, rs_b, state, bs_state, o, H, C,
                                      scale, lower_bound, stride_k, stride_v,
                                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
        """The seed's middle kernel: q/k L2 norm, decay and beta gates and the recurrent update for one
        (sequence, head, BV value columns); writes o (the second handoff) and the state."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = bh % H
        ok = tl.arange(0, K)
        ov = tl.program_id(1) * BV + tl.arange(0, BV)
        row = y + b * 3 * C
        q = tl.load(row + h * K + ok).to(tl.float32)
        k = tl.load(row + C + h * K + ok).to(tl.float32)
        v = tl.load(row + 2 * C + h * V + ov).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        z = tl.load(g_raw + b * rs_g + h * K + ok).to(tl.float32) + tl.load(dt_bias + h * K + ok)
        g = lower_bound * tl.sigmoid(tl.exp(tl.load(A_log + h)) * z)
        beta = tl.sigmoid(tl.load(b_raw + b * rs_b + h).to(tl.float32))
        ptrs = state + b * bs_state + h * K * V + ok[:, None] * stride_k + ov[None, :] * stride_v
        S = tl.load(ptrs) * tl.exp(g)[:, None]
        u = tl.sum(S * k[:, None], 0)
        S = S + k[:, None] * (beta * (v - u))[None, :]
        out = tl.sum(S * q[:, None], 0)
        tl.store(o + bh * V + ov, out.to(o.dtype.element_ty))
        tl.store(ptrs, S)

    @triton.jit
    def _gated_rms_norm_kernel(x, gate, rs_gate, w, y, H, eps, V: tl.constexpr):
        """RMSNorm_V(o) * o_norm * sigmoid(gate) for one (sequence, head)."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = bh % H
        ov = tl.arange(0, V)
        xv = tl.load(x + bh * V + ov).to(tl.float32)
        gv = tl.load(gate + b * rs_gate + h * V + ov).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / V + eps)
        tl.store(y + bh * V + ov, (xv * r * tl.load(w + ov) * tl.sigmoid(gv)).to(y.dtype.element_ty))


BEFORE_CONV_BLOCK = 256
BEFORE_TILE_V = 32  # value columns per program of the recurrence kernel (the original's 4 tiles per head)


def _before_launch(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout, B, H) -> torch.Tensor:
    K, C, act = HEAD_DIM, H * HEAD_DIM, q.dtype
    S, cq, ck, cv = cache.state, cache.conv_q, cache.conv_k, cache.conv_v
    y = torch.empty(B, 3, C, device=q.device, dtype=act)
    _conv_silu_kernel[(B, 3, triton.cdiv(C, BEFORE_CONV_BLOCK))](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), cq, ck, cv, cq.stride(0), ck.stride(0), cv.stride(0),
        weights.conv_q, weights.conv_k, weights.conv_v, y, C, BC=BEFORE_CONV_BLOCK)
    o_tmp = torch.empty(B, H, K, device=q.device, dtype=act)
    sk, sv = (K, 1) if state_layout == "kv" else (1, K)
    _norm_gates_recurrence_kernel[(B * H, K // BEFORE_TILE_V)](
        y, g_raw, g_raw.stride(0), weights.A_log, weights.dt_bias, beta_raw, beta_raw.stride(0), S, S.stride(0),
        o_tmp, H, C, K ** -0.5, float(weights.lower_bound), sk, sv, K=K, V=K, BV=BEFORE_TILE_V)
    core = torch.empty(B, H * K, device=q.device, dtype=act)
    core.view(B, H, K).copy_(o_tmp)  # copy 1: into the attention-output buffer
    normed = torch.empty(B * H, K, device=q.device, dtype=act)
    _gated_rms_norm_kernel[(B * H,)](core, gate, gate.stride(0), weights.o_norm, normed, H, float(weights.eps),
                                     V=K)
    out.copy_(normed.view(B, H * K))  # copy 2: into the caller's buffer
    return out


# ----------------------------------------------------------------------------------------------
# after: the fused kernel (kernels/kda_decode.cu)

# (tile_v value columns per block, threads per block) compiled into the library, widest first.
CONFIGS = ((128, 256), (64, 128), (32, 128), (16, 128), (16, 64))
# kernels/kda_decode.cu's Args, field by field (checked against the library's sizeof at load)
_ARGS_FORMAT = "<" + "Q" * 6 + "q" * 6 + "Q" * 3 + "q" * 3 + "Q" * 6 + "Qq" + "Qq" + "QQ" + "ii" + "fff" + "iii"
_TOKEN_FORMAT = "<" + "Q" * 6 + "q" * 6  # the leading per-token fields, rewritten every step
_ARGS_SIZE = struct.calcsize(_ARGS_FORMAT)
HINT_STREAM_LOADS, HINT_STREAM_STORES, HINT_PREFETCH_L2 = 1, 2, 4
# How the blocks of a split head exchange their partial sums for the output norm.
SPLIT_MODES = {"whole": 0, "atomic": 1, "cluster": 2}
_LAUNCH_ERRORS = {-1: "no compiled kernel for this (tile_v, threads)", -2: "warp width does not fit the block",
                  -3: "the config needs more shared memory than the device has", -4: "bad sizes",
                  -5: "this split mode is not compiled for this tile width"}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher uses


@dataclass
class _Fused:
    lib: ctypes.CDLL
    configs: dict  # (tile_v, threads) -> static shared bytes
    split_modes: set  # names of the split modes this build has
    clusters: bool  # the device runs thread-block clusters (compute capability >= 9)
    warp_size: int
    max_shared: int
    units: int
    l2_bytes: int

    def occupancy(self, tile_v: int, threads: int, state_vk: int, mode: int) -> int:
        return self.lib.k3_kda_decode_occupancy(tile_v, threads, state_vk, mode)


_fused_cache: dict = {}
_workspaces: dict = {}


def _load_fused(device) -> _Fused:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    f = _fused_cache.get(idx)
    if f is not None:
        return f
    lib = _build.load("kda_decode")
    lib.k3_kda_decode.restype = ctypes.c_int
    lib.k3_kda_decode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p]
    size = lib.k3_kda_decode_args_size()
    if size != _ARGS_SIZE:
        raise _build.KernelUnavailable(f"kda_decode.cu's Args is {size} bytes but the Python packing is "
                                       f"{_ARGS_SIZE}: the two disagree, rebuild or fix _ARGS_FORMAT")
    buf = (ctypes.c_int * 96)()
    n = lib.k3_kda_decode_configs(buf, 32)
    configs = {(buf[3 * i], buf[3 * i + 1]): buf[3 * i + 2] for i in range(min(n, 32))}
    bits = lib.k3_kda_decode_split_modes()
    modes = {name for name, m in SPLIT_MODES.items() if m and bits & (1 << m)}
    props = torch.cuda.get_device_properties(idx)
    warp = int(getattr(props, "warp_size", 0) or 0)
    if warp <= 0:
        raise _build.KernelUnavailable("torch does not report this GPU's warp/wavefront width")
    max_shared = int(getattr(props, "shared_memory_per_block", 0) or 48 * 1024)
    clusters = _build.clusters_available(idx)[0]
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    f = _Fused(lib, configs, modes, clusters, warp, max_shared, props.multi_processor_count, l2)
    _fused_cache[idx] = f
    return f


def fused_status() -> tuple[bool, str]:
    """(True, what runs) when the fused kernel can run here; else (False, why, and what impl='auto'
    uses instead)."""
    ok, why = _build.status("kda_decode")
    if not ok:
        return False, f"fused KDA decode unavailable ({why}); impl='auto' uses the PyTorch reference"
    return True, why


SPLIT_TILE = (32, 128)  # a split head: 4 blocks of 32 value columns, 128 threads each
SPLIT_TILE_FINE = (16, 128)  # 8 blocks of 16 columns: where even 8 blocks per head fit on the units


def choose_config(batch: int, heads: int, units: int, warp_size: int = 32, clusters: bool = True
                  ) -> tuple[int, int]:
    """(tile_v, threads) for `batch` x `heads` heads on a device with `units` compute units.

    One head per block (no exchange for the output norm) once the heads alone give half the units
    a block; below that, each head is split over a cluster of blocks so the state moves through
    more units: 8 blocks of 16 value columns when they all fit on the units at once, else 4 of 32.
    Without clusters (the split then needs an atomic exchange through memory) whole heads always.
    Measured on the H200 (132 SMs, 12 heads, graph replay, every step's state read from memory:
    profiles/nvidia-h200/kda_decode/ and its extra/sweep.json, 2026-11-30 third session): B = 1, split
    clusters 16 columns x 128 threads 4.10 us, 32 x 128 4.37, 16 x 64 4.45, 64 x 128 4.69, whole
    heads 5.06, atomic exchange 5.00 at best; B = 8 (96 heads): whole heads 7.47 us, the best split
    7.57; B = 32 and 128: whole heads. (With the state hot in L2, as an earlier sweep timed it,
    32 x 128 led at B = 1: 3.71 vs 3.76 us.)"""
    whole = (HEAD_DIM, 256)
    if not clusters or batch * heads * 2 >= units:
        tile_v, threads = whole
    elif batch * heads * (HEAD_DIM // SPLIT_TILE_FINE[0]) <= units:
        tile_v, threads = SPLIT_TILE_FINE
    else:
        tile_v, threads = SPLIT_TILE
    if threads % warp_size:
        raise ValueError(f"block size {threads} is not a multiple of the warp width {warp_size}")
    return tile_v, threads


def choose_split(f: _Fused, tile_v: int) -> str:
    """'whole' for a head per block; else clusters where the device and build have them and the
    head's blocks fit a portable cluster (<= 8), else the portable atomic exchange."""
    if tile_v == HEAD_DIM:
        return "whole"
    if "cluster" in f.split_modes and f.clusters and HEAD_DIM // tile_v <= 8:
        return "cluster"
    return "atomic"


def default_hints(batch: int, heads: int, l2_bytes: int) -> int:
    """The L2 prefetch of a later block's state always; streaming (evict-first) loads and stores of S
    once the step's states (B x H x 64 KiB) exceed L2, where keeping them would only evict the
    per-token inputs and weights. H200, graph replay: B = 128 53.6 us with both, 54.4 prefetch only,
    55.2 streaming only; B = 1 and 8 (states in L2): prefetch alone 0.5-1.5% faster than both."""
    hints = HINT_PREFETCH_L2
    if batch * heads * HEAD_DIM * HEAD_DIM * 4 > l2_bytes:
        hints |= HINT_STREAM_LOADS | HINT_STREAM_STORES
    return hints


def _workspace(device, n_heads_total: int):
    """Counters (left at zero by every launch) and o slices for heads split across blocks (atomic
    mode); one per device, grown as needed. Launches sharing it must be ordered (one stream/graph)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ws = _workspaces.get(idx)
    if ws is None or ws[0].numel() < n_heads_total:
        n = max(n_heads_total, 1024)
        ws = (torch.zeros(n, dtype=torch.int32, device=device), torch.empty(n * HEAD_DIM, device=device))
        _workspaces[idx] = ws
    return ws


class KDADecodeStep:
    """One KDA layer's decode step bound to its cache, weights and output buffer, as a serving engine
    holds it: everything that does not change from token to token is checked (and, for the fused
    kernel, packed into its argument block) once here; a call checks only the six per-token inputs.

        step = KDADecodeStep(cache, weights, impl="after")   # or "before", "reference"
        out = step(q, k, v, g_raw, beta_raw, gate)           # updates cache in place, fills step.out
    """

    def __init__(self, cache, weights, *, out=None, impl="after", state_layout="kv", tile_v=None, threads=None,
                 hints=None, split=None, prefetch_ahead=None):
        """tile_v/threads/hints/split (impl='after' only) override what `choose_config`,
        `default_hints` and `choose_split` pick from the device; prefetch_ahead (blocks, with
        HINT_PREFETCH_L2) overrides the default of one block per compute unit."""
        if impl not in ("after", "before", "reference"):
            raise ValueError(f"impl must be 'after', 'before' or 'reference', got {impl!r}")
        if not isinstance(cache, KDACache):
            raise ValueError(f"cache must be a k3lab.nn.KDACache, got {type(cache).__name__}")  # noqa: TRY004
        S = _tensor("cache.state", cache.state)
        if S.dim() != 4:
            raise ValueError(f"cache.state must be [B, H, {HEAD_DIM}, {HEAD_DIM}], got {tuple(S.shape)}")
        B, H = S.shape[0], S.shape[1]
        act = _tensor("cache.conv_q", cache.conv_q).dtype
        _check_static(cache, weights, out, B, H, act, S.device, state_layout, source="cache.conv_q")
        if impl != "reference":
            _check_kernel_static(cache, weights, out, impl)
        if impl == "before" and triton is None:
            raise _build.KernelUnavailable("impl='before' needs Triton, which is not installed")
        tuning = (tile_v, threads, hints, split, prefetch_ahead)
        if any(x is not None for x in tuning) and impl != "after":
            raise ValueError("tile_v, threads, hints, split and prefetch_ahead apply to impl='after' only")
        self.cache, self.weights, self.impl, self.state_layout = cache, weights, impl, state_layout
        self.batch, self.heads, self.dtype, self.device = B, H, act, S.device
        self.out = out if out is not None else torch.empty(B, H * HEAD_DIM, device=S.device, dtype=act)
        hk = torch.Size((B, H * HEAD_DIM))
        self._shapes = (hk, hk, hk, hk, torch.Size((B, H)), hk)
        if impl == "after":
            self._init_fused(tile_v, threads, hints, split, prefetch_ahead)

    def _init_fused(self, tile_v, threads, hints, split, prefetch_ahead):
        f = _load_fused(self.device)
        B, H = self.batch, self.heads
        if tile_v is None:
            tile_v, threads = choose_config(B, H, f.units, f.warp_size,
                                            clusters=f.clusters and "cluster" in f.split_modes)
        elif threads is None:
            threads = dict(CONFIGS).get(tile_v)
        if (tile_v, threads) not in f.configs:
            raise ValueError(f"(tile_v, threads) must be one of {sorted(f.configs)}, got {(tile_v, threads)}")
        split = choose_split(f, tile_v) if split is None else split
        if split not in SPLIT_MODES or (split == "whole") != (tile_v == HEAD_DIM):
            raise ValueError(f"split must be 'whole' (tile_v={HEAD_DIM}), 'atomic' or 'cluster' (tile_v < "
                             f"{HEAD_DIM}), got {split!r} with tile_v={tile_v}")
        if split == "cluster" and not (f.clusters and "cluster" in f.split_modes and HEAD_DIM // tile_v <= 8):
            raise ValueError("split='cluster' needs a CUDA GPU of compute capability >= 9.0 and tile_v >= 16")
        hints = default_hints(B, H, f.l2_bytes) if hints is None else int(hints)
        vk = int(self.state_layout == "vk")
        ahead = 0
        if hints & HINT_PREFETCH_L2:
            # One block per unit ahead in launch order: on the H200 at B = 128 that beat two and four
            # per unit (53.6 vs 56.5 vs 65.5 us); further ahead, prefetched lines are evicted unused.
            ahead = int(prefetch_ahead) if prefetch_ahead is not None else f.units
        self.prefetch_ahead = ahead
        self.tile_v, self.threads, self.hints, self.split = tile_v, threads, hints, split
        counters, o_part = _workspace(self.device, B * H) if split == "atomic" else (None, None)
        self._workspace = (counters, o_part)  # held, so it outlives a regrown shared one
        w, c, S, out = self.weights, self.cache, self.cache.state, self.out
        self._args = ctypes.create_string_buffer(_ARGS_SIZE)
        struct.pack_into(
            _ARGS_FORMAT, self._args, 0, *([0] * 12),
            c.conv_q.data_ptr(), c.conv_k.data_ptr(), c.conv_v.data_ptr(),
            c.conv_q.stride(0), c.conv_k.stride(0), c.conv_v.stride(0),
            w.conv_q.data_ptr(), w.conv_k.data_ptr(), w.conv_v.data_ptr(), w.A_log.data_ptr(),
            w.dt_bias.data_ptr(), w.o_norm.data_ptr(), S.data_ptr(), S.stride(0), out.data_ptr(), out.stride(0),
            counters.data_ptr() if counters is not None else 0, o_part.data_ptr() if o_part is not None else 0,
            B, H, float(w.lower_bound), float(w.eps), HEAD_DIM ** -0.5, f.warp_size, hints, ahead)
        self._launch = f.lib.k3_kda_decode
        self._launch_tail = (tile_v, threads, vk, SPLIT_MODES[split], f.max_shared)
        self._dev_index = self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _bad_token(self, name, t, shape):
        _tensor(name, t)
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
        if self.impl == "after":
            struct.pack_into(_TOKEN_FORMAT, self._args, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                             g_raw.data_ptr(), beta_raw.data_ptr(), gate.data_ptr(), q.stride(0), k.stride(0),
                             v.stride(0), g_raw.stride(0), beta_raw.stride(0), gate.stride(0))
            stream = (_raw_stream(self._dev_index) if _raw_stream is not None
                      else torch.cuda.current_stream(self.device).cuda_stream)
            rc = self._launch(self._args, *self._launch_tail, stream)
            if rc != 0:
                raise RuntimeError(f"kda_decode launch failed: {_LAUNCH_ERRORS.get(rc, f'runtime error {rc}')}")
            return self.out
        if self.impl == "before":
            return _before_launch(q, k, v, g_raw, beta_raw, gate, self.cache, self.weights, self.out,
                                  self.state_layout, self.batch, self.heads)
        fp64 = self.cache.state.dtype == torch.float64
        res, new = reference(q, k, v, g_raw, beta_raw, gate, self.cache, self.weights, state_layout=self.state_layout,
                             compute_dtype=torch.float64 if fp64 else torch.float32)
        _write_back(self.cache, new)
        self.out.copy_(res)
        return self.out


def before(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, state_layout="kv") -> torch.Tensor:
    """The unfused chain: conv kernel -> norm/gates/recurrence kernel -> copy -> output-norm kernel ->
    copy into `out`. Intermediates go through memory in the activation dtype."""
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    return KDADecodeStep(cache, weights, out=out, impl="before", state_layout=state_layout)(
        q, k, v, g_raw, beta_raw, gate)


def after(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, state_layout="kv", tile_v=None,
          threads=None, hints=None, split=None, prefetch_ahead=None) -> torch.Tensor:
    """The fused kernel: one launch per step. tile_v/threads override the choice from the device
    (`choose_config`); split: 'atomic' or 'cluster' for split heads (`choose_split`); hints: a mix of
    HINT_STREAM_LOADS, HINT_STREAM_STORES, HINT_PREFETCH_L2 (`default_hints`).
    Checks everything on every call; a serving loop binds a `KDADecodeStep` once instead."""
    validate(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout)
    return KDADecodeStep(cache, weights, out=out, impl="after", state_layout=state_layout, tile_v=tile_v,
                         threads=threads, hints=hints, split=split, prefetch_ahead=prefetch_ahead)(
        q, k, v, g_raw, beta_raw, gate)


# ----------------------------------------------------------------------------------------------
# the entry point


def kda_decode(q, k, v, g_raw, beta_raw, gate, cache, weights, *, out=None, impl="auto", state_layout="kv",
               **kernel_options) -> torch.Tensor:
    """One KDA decode step. Updates `cache` in place and returns out [B, H*V] (written into `out`
    when given). impl: 'after' (fused kernel), 'before' (the unfused chain), 'reference' (k3lab.nn
    pieces in fp32, results cast back) or 'auto' ('after' where `fused_status()` says it can run,
    else 'reference')."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "after" if q.device.type == "cuda" and q.dtype == torch.bfloat16 and fused_status()[0] else "reference"
    if impl == "after":
        return after(q, k, v, g_raw, beta_raw, gate, cache, weights, out=out, state_layout=state_layout,
                     **kernel_options)
    if kernel_options:
        raise ValueError(f"{sorted(kernel_options)} apply to impl='after' only")
    if impl == "before":
        return before(q, k, v, g_raw, beta_raw, gate, cache, weights, out=out, state_layout=state_layout)
    fp64 = isinstance(cache, KDACache) and isinstance(cache.state, torch.Tensor) and cache.state.dtype == torch.float64
    res, new = reference(q, k, v, g_raw, beta_raw, gate, cache, weights, state_layout=state_layout,
                         compute_dtype=torch.float64 if fp64 else torch.float32)
    _write_back(cache, new)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
