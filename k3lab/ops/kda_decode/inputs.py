"""Inputs of one KDA decode step, shared by every implementation: the layer's decode-time weights,
example inputs, and the argument checks (ValueError naming the argument, before any kernel runs)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from k3lab.nn import KDACache
from k3lab.ops import expect, positive_finite

HEAD_DIM = 128  # K = V = 128 in K3; the fused kernel is compiled for it
CONV_SIZE = 4
L2_EPS = 1e-6
STATE_LAYOUTS = ("kv", "vk")
TOKEN_INPUTS = ("q", "k", "v", "g_raw", "beta_raw", "gate")



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





def check_static(cache, weights, out, B, H, act, dev, state_layout, source="q") -> None:
    """The parts of a step that stay the same from token to token: cache, weights, output buffer."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if not isinstance(cache, KDACache):
        raise ValueError(f"cache must be a k3lab.nn.KDACache, got {type(cache).__name__}")  # noqa: TRY004
    if not isinstance(weights, KDADecodeWeights):
        raise ValueError(f"weights must be a KDADecodeWeights, got {type(weights).__name__}")  # noqa: TRY004
    K = HEAD_DIM
    for name in ("conv_q", "conv_k", "conv_v"):
        expect(f"cache.{name}", getattr(cache, name), shape=(B, H * K, CONV_SIZE - 1), dtype=act,
               what=f"[B={B}, H*K={H * K}, {CONV_SIZE - 1}]")  # {source}'s dtype: it stores past inputs
    dims = "K, V" if state_layout == "kv" else "V, K"
    S = expect("cache.state", cache.state, shape=(B, H, K, K),
               what=f"[B={B}, H={H}, {dims}] = {[B, H, K, K]} (head_dim {K})")
    expect("cache.state", S, dtype=(torch.float32, torch.float64))  # the recurrent state is kept in fp32
    w = weights
    expect("weights.A_log", w.A_log, shape=(H,), what=f"[H={H}]")
    for name in ("conv_q", "conv_k", "conv_v"):
        expect(f"weights.{name}", getattr(w, name), shape=(H * K, CONV_SIZE),
               what=f"[H*K={H * K}, {CONV_SIZE}] (KDADecodeWeights.from_layer converts K3's [C, 1, 4])")
    expect("weights.dt_bias", w.dt_bias, shape=(H * K,), what=f"[H*K={H * K}]")
    expect("weights.o_norm", w.o_norm, shape=(K,), what=f"[{K}]")
    positive_finite("weights.eps", w.eps)
    lb = w.lower_bound
    if isinstance(lb, bool) or not isinstance(lb, numbers.Real) or not math.isfinite(lb) or not lb < 0:
        raise ValueError(f"weights.lower_bound must be a negative finite number, got {w.lower_bound!r}")
    tensors = {"cache.conv_q": cache.conv_q, "cache.conv_k": cache.conv_k, "cache.conv_v": cache.conv_v,
               "cache.state": S, "weights.conv_q": w.conv_q, "weights.conv_k": w.conv_k,
               "weights.conv_v": w.conv_v, "weights.A_log": w.A_log, "weights.dt_bias": w.dt_bias,
               "weights.o_norm": w.o_norm}
    if out is not None:
        expect("out", out, shape=(B, H * K), dtype=act, what=f"[B={B}, H*V={H * K}]")  # {source}'s dtype
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
    expect("q", q)
    if q.dim() != 2 or q.shape[1] % K or q.shape[1] == 0:
        raise ValueError(f"q must be [B, H*{K}] (one token per sequence, head_dim {K}), got {tuple(q.shape)}")
    B, H = q.shape[0], q.shape[1] // K
    if B < 1:
        raise ValueError("q must hold at least one sequence (B >= 1)")
    act, dev = q.dtype, q.device
    if not act.is_floating_point:
        raise ValueError(f"q must be floating point, got {act}")
    wanted = {"k": (k, (B, H * K)), "v": (v, (B, H * K)), "g_raw": (g_raw, (B, H * K)),
              "beta_raw": (beta_raw, (B, H)), "gate": (gate, (B, H * K))}
    for name, (t, shape) in wanted.items():
        expect(name, t, shape=shape, dtype=act,  # q's dtype
               what=f"{list(shape)} (B={B}, H={H}, head_dim {K})")
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device} but q is on {dev}: all must be on one device")
    check_static(cache, weights, out, B, H, act, dev, state_layout)
    return B, H


def check_kernel_static(cache, weights, out) -> None:
    """What the compiled kernels additionally need from the static parts: packed conv states and
    state heads, a contiguous last dimension of `out` (the fused kernel: `check_fused_static` too)."""
    if out is not None and out.stride(1) != 1:
        raise ValueError(f"out must have a contiguous last dimension (stride 1), got strides {out.stride()}")
    for name in ("conv_q", "conv_k", "conv_v"):
        t = getattr(cache, name)
        if t.stride()[1:] != (CONV_SIZE - 1, 1):
            raise ValueError(f"cache.{name} must be packed per sequence (strides [*, 3, 1]), got "
                             f"{t.stride()}")
    S = cache.state
    if S.stride()[1:] != (HEAD_DIM * HEAD_DIM, HEAD_DIM, 1):
        raise ValueError(f"cache.state must have packed heads (strides [*, {HEAD_DIM ** 2}, {HEAD_DIM}, 1]), "
                         f"got {S.stride()}")


def check_fused_static(cache, weights) -> None:
    """What the fused kernel needs beyond `check_kernel_static`: bf16 activations, an fp32 state on a
    GPU, contiguous fp32 weights."""
    S = cache.state
    if cache.conv_q.dtype != torch.bfloat16:
        raise ValueError(f"the fused kernel takes bf16 activations (q, k, v, g_raw, beta_raw, gate, conv "
                         f"states), got {cache.conv_q.dtype}; use backend='torch' for other dtypes")
    if S.dtype != torch.float32:
        raise ValueError(f"cache.state must be float32 for the fused kernel, got {S.dtype}")
    for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias", "o_norm"):
        t = getattr(weights, name)
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"weights.{name} must be contiguous float32 (prepare weights once with "
                             f"KDADecodeWeights.from_layer), got {t.dtype}, contiguous={t.is_contiguous()}")
    if S.device.type != "cuda":
        raise ValueError(f"the fused kernel runs on a GPU; the cache is on {S.device}")
