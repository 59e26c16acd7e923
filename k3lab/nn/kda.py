"""Kimi Delta Attention (KDA) references in plain PyTorch.

The recurrence per head, state S in R^{K x V} (docs/k3.md):

    S <- diag(exp(g_t)) S;  u = S^T k_t;  S <- S + k_t (beta_t (v_t - u))^T;  o_t = S^T (scale q_t)

`kda_recurrent` walks it token by token; `kda_chunked` computes the same thing 64 tokens at a time
with the within-chunk 64x64 unit lower-triangular inverse. Both compute in fp32 (fp64 when given
fp64) whatever the input dtype, return the output in q's dtype and the state in the compute dtype.

Around the recurrence, the layer (`KimiDeltaAttention`, steps 1-6 in docs/k3.md):
`short_conv` (causal depthwise conv + SiLU, with the decode conv state), `l2_normalize` on q and k,
`kda_gate` (the lower-bounded per-channel log decay), `kda_beta`, and the gated output RMSNorm.
`KDACache` holds what a sequence carries from one step to the next: three conv histories and the
fp32 recurrent state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from k3lab.config import KDA_CHUNK_SIZES

from .norms import RMSNorm, check_hidden_states, compute_dtype, gated_rms_norm, l2_normalize


def _check_kda_inputs(q, k, v, g, beta, initial_state):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)} (per-channel log decay), got "
                         f"{tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B={B}, T={T}, H={H}], got {tuple(beta.shape)}")
    V = v.shape[-1]
    if initial_state is not None:
        if initial_state.shape != (B, H, K, V):
            raise ValueError(
                f"initial_state must be [B={B}, H={H}, K={K}, V={V}], got {tuple(initial_state.shape)}")
        if initial_state.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"initial_state must be float32 or float64, got {initial_state.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    return B, T, H, K, V


def _check_scale(scale, K: int) -> float:
    """The query scale: K^-0.5 when None, else a positive finite number (ValueError otherwise)."""
    if scale is None:
        return K ** -0.5
    if (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float))
        or not math.isfinite(scale)
        or scale <= 0
    ):
        raise ValueError(f"scale must be a positive finite number (or None for K^-0.5), got {scale!r}")
    return float(scale)


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t
                                in tensors) else torch.float32


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token KDA. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    initial_state: [B, H, K, V] fp32/fp64 or None (zeros). q and k are expected L2-normalised;
    scale defaults to K^-0.5. Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V])."""
    B, T, H, K, V = _check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = _check_scale(scale, K)
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    S = (torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None
         else initial_state.to(dt).clone())
    o = torch.empty(B, T, H, V, dtype=dt, device=q.device)
    for t in range(T):
        S = S * g[:, t].exp().unsqueeze(-1)
        u = torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + k[:, t].unsqueeze(-1) * (beta[:, t].unsqueeze(-1) * (v[:, t] - u)).unsqueeze(-2)
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale)
    return o.to(q.dtype if q.dtype != dt else dt), S


def chunk_inverse(A_strict_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for a strictly lower-triangular A [..., C, C], by forward substitution.

    Its intermediates grow and cancel, so give it fp32 (or fp64) inputs: rounding them to bf16
    first loses what the result needs (the seed's 256.5 - 256 example)."""
    shape = tuple(getattr(A_strict_lower, "shape", ()))
    if len(shape) < 2 or shape[-1] != shape[-2] or not A_strict_lower.is_floating_point():
        raise ValueError(f"A_strict_lower must be a floating-point [..., C, C] tensor, got "
                         f"{getattr(A_strict_lower, 'dtype', type(A_strict_lower).__name__)} {shape}")
    C = A_strict_lower.shape[-1]
    eye = torch.eye(C, dtype=A_strict_lower.dtype, device=A_strict_lower.device)
    return torch.linalg.solve_triangular(A_strict_lower + eye, eye.expand_as(A_strict_lower), upper=False,
                                         unitriangular=True)


def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64):
    """KDA in chunks of `chunk_size` (any T: the last chunk is padded with no-op tokens).

    Per chunk, with G the in-chunk inclusive cumsum of g:
      Akk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j) (j < i);  Aqk[i,j] = scale sum_d q_i k_j exp(G_i - G_j)
      (j <= i)
      R = (I + Akk)^-1;  U = R diag(beta) V;  W = R diag(beta) (K * exp(G));  E = U - W S
      O = scale (Q * exp(G)) S + Aqk E;  S <- diag(exp(G_last)) S + (K * exp(G_last - G))^T E
    Same arguments and results as `kda_recurrent`; chunk_size must be one of
    `k3lab.config.KDA_CHUNK_SIZES` (powers of two up to 256; K3 uses 64)."""
    B, T, H, K, V = _check_kda_inputs(q, k, v, g, beta, initial_state)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size not in KDA_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {KDA_CHUNK_SIZES} (K3 uses 64), got {chunk_size!r}")
    scale = _check_scale(scale, K)
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    C = chunk_size
    if T == 0:  # nothing to process: the state passes through
        S = (torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None
             else initial_state.to(dt).clone())
        return torch.empty(B, 0, H, V, dtype=q.dtype if q.dtype != dt else dt, device=q.device), S
    n = -(-T // C)
    pad = n * C - T

    def prep(t):  # [B, T, H, X] -> [B, H, n, C, X] in the compute dtype, padded with zeros
        t = t.to(dt)
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))
        return t.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    # padded tokens: k = 0, g = 0, beta = 0 leave the state untouched; their outputs are dropped
    qc, kc, vc, gc = prep(q), prep(k), prep(v), prep(g)
    bc = prep(beta.unsqueeze(-1)).squeeze(-1)
    S = (torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None
         else initial_state.to(dt).clone())
    out = torch.empty(B, H, n, C, V, dtype=dt, device=q.device)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(0)
    for c in range(n):
        Q, Kc, Vc, bt = qc[:, :, c], kc[:, :, c], vc[:, :, c], bc[:, :, c]
        G = gc[:, :, c].cumsum(-2)  # [B, H, C, K]
        # pairwise decay exp(G_i - G_j) kept as a [C, C, K] tensor: never forms exp(-G), which overflows
        diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B, H, C(i), C(j), K]
        decay = torch.where(incl[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        kk = torch.einsum("bhik,bhjk,bhijk->bhij", Kc, Kc, decay)
        Akk = (bt.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
        Aqk = scale * torch.einsum("bhik,bhjk,bhijk->bhij", Q, Kc, decay)
        R = chunk_inverse(Akk)
        U = R @ (bt.unsqueeze(-1) * Vc)
        W = R @ (bt.unsqueeze(-1) * Kc * G.exp())
        E = U - W @ S
        out[:, :, c] = scale * (Q * G.exp()) @ S + Aqk @ E
        G_last = G[:, :, -1:]  # [B, H, 1, K]
        S = G_last.squeeze(-2).exp().unsqueeze(-1) * S + (Kc * (G_last - G).exp()).transpose(-1, -2) @ E
    o = out.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(q.dtype if q.dtype != dt else dt), S


# ------------------------------------------------------------------ the pieces around the recurrence
def short_conv(x, weight, conv_state=None, activation=True):
    """Causal depthwise convolution over time, then SiLU (KDA step 1).

    x: [B, T, C]; weight: [C, W] (or K3's stored [C, 1, W]); conv_state: [B, C, W-1], the last W-1
    inputs of the previous step (None: zeros, the start of a sequence).
    y[t, c] = sum_j weight[c, j] * xs[t + j, c] over xs = [conv_state | x], so weight[:, -1] multiplies
    the current token. Computes in fp32 (fp64 for fp64 x); returns (y in x's dtype,
    new_state [B, C, W-1] in x's dtype: the last W-1 inputs, what the next step needs)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"x must be [B, T, C], got {tuple(getattr(x, 'shape', ()))}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    B, T, C = x.shape
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C={C}, W] or [C={C}, 1, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if conv_state is None:
        conv_state = torch.zeros(B, C, W - 1, dtype=x.dtype, device=x.device)
    elif conv_state.shape != (B, C, W - 1):
        raise ValueError(f"conv_state must be [B={B}, C={C}, W-1={W - 1}], got {tuple(conv_state.shape)}")
    dt = compute_dtype(x, weight, conv_state)
    xs = torch.cat([conv_state.transpose(1, 2).to(dt), x.to(dt)], dim=1)  # [B, W-1+T, C]
    w = weight.to(dt)
    y = sum(w[:, j] * xs[:, j:j + T] for j in range(W))
    if activation:
        y = torch.nn.functional.silu(y)
    new_state = xs[:, xs.shape[1] - (W - 1):].transpose(1, 2).to(x.dtype).contiguous()
    return y.to(x.dtype), new_state


def kda_gate(raw, A_log, dt_bias, lower_bound=-5.0):
    """KDA's per-channel log decay (step 3): g = lower_bound * sigmoid(exp(A_log[h]) * (raw + dt_bias)).

    raw: [..., H*K], the low-rank projection f_b(f_a(x)); A_log: [H] (K3 stores it padded to 128:
    pass the first H); dt_bias: [H*K]. Returns g [..., H, K] in fp32 (fp64 for fp64 raw), in
    (lower_bound, 0): exp(g) is the fraction of the state each channel keeps per token."""
    if not isinstance(raw, torch.Tensor) or not raw.is_floating_point() or raw.dim() < 1:
        raise ValueError(f"raw must be a floating-point tensor [..., H*K], got {getattr(raw, 'shape', raw)}")
    if A_log.dim() != 1:
        raise ValueError(f"A_log must be [H], got {tuple(A_log.shape)}")
    H = A_log.shape[0]
    HK = raw.shape[-1]
    if HK % H:
        raise ValueError(f"raw's last dimension {HK} must be H*K with H = len(A_log) = {H}")
    if dt_bias.shape != (HK,):
        raise ValueError(f"dt_bias must be [H*K={HK}], got {tuple(dt_bias.shape)}")
    if not lower_bound < 0:
        raise ValueError(f"lower_bound must be negative, got {lower_bound}")
    dt = compute_dtype(raw)
    z = (raw.to(dt) + dt_bias.to(dt)).unflatten(-1, (H, HK // H))
    return lower_bound * torch.sigmoid(A_log.to(dt).exp().unsqueeze(-1) * z)


def kda_beta(raw):
    """KDA's per-head write strength (step 4): beta = sigmoid(b_proj(x)), in fp32."""
    if not isinstance(raw, torch.Tensor) or not raw.is_floating_point():
        raise ValueError(f"raw must be a floating-point tensor [..., H], got {getattr(raw, 'dtype', raw)}")
    return torch.sigmoid(raw.to(compute_dtype(raw)))


# ------------------------------------------------------------------ the layer and its cache
@dataclass
class KDACache:
    """What one KDA layer carries between steps, per sequence.

    conv_q, conv_k, conv_v: [B, C, W-1], the last W-1 projected inputs of each conv (C = H*K, W = 4);
    state: [B, H, K, V], the recurrent state, fp32 (fp64 in fp64 runs). Its size does not grow with
    the conversation: K3 holds 96 x 128 x 128 x 4 B = 6 MiB of state per sequence per KDA layer."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    state: torch.Tensor

    def entries(self) -> dict[str, torch.Tensor]:
        return {"conv_q": self.conv_q, "conv_k": self.conv_k, "conv_v": self.conv_v, "state": self.state}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.entries().values())


class KimiDeltaAttention(nn.Module):
    """One KDA layer (docs/k3.md), weights [out, in] under K3's names.

    forward(x [B, T, hidden], cache=None) -> (out [B, T, hidden], new_cache). x is the pre-normed
    hidden state. Prefill (T > 1) runs `kda_chunked`, decode (T = 1) `kda_recurrent`; both continue
    from `cache` when one is given. The input cache is never modified."""

    def __init__(self, config, *, device=None, dtype=None):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        h, H, K = config.hidden_size, config.kda_num_heads, config.kda_head_dim
        C, W = H * K, config.kda_conv_size
        self.num_heads, self.head_dim, self.conv_size = H, K, W
        self.hidden_size, self.chunk_size = h, config.kda_chunk_size
        self.lower_bound, self.eps = config.kda_gate_lower_bound, config.rms_norm_eps
        self.q_proj = nn.Linear(h, C, bias=False, **f)
        self.k_proj = nn.Linear(h, C, bias=False, **f)
        self.v_proj = nn.Linear(h, C, bias=False, **f)
        # depthwise convs, stored as K3 does ([C, 1, W]); `short_conv` applies them
        self.q_conv = nn.Conv1d(C, C, W, groups=C, bias=False, **f)
        self.k_conv = nn.Conv1d(C, C, W, groups=C, bias=False, **f)
        self.v_conv = nn.Conv1d(C, C, W, groups=C, bias=False, **f)
        self.f_a = nn.Linear(h, config.kda_gate_rank, bias=False, **f)
        self.f_b = nn.Linear(config.kda_gate_rank, C, bias=False, **f)
        # the gate's parameters stay fp32 whatever the model dtype, as in the release
        self.dt_bias = nn.Parameter(torch.zeros(C, device=device, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(H, device=device, dtype=torch.float32))
        self.b_proj = nn.Linear(h, H, bias=False, **f)
        self.g_proj = nn.Linear(h, C, bias=False, **f)
        self.o_norm = RMSNorm(K, eps=config.rms_norm_eps, **f)
        self.o_proj = nn.Linear(C, h, bias=False, **f)

    @property
    def width(self) -> int:
        return self.num_heads * self.head_dim

    def empty_cache(self, batch: int, *, state_dtype=torch.float32) -> KDACache:
        """The cache of `batch` sequences that have seen no token yet (all zeros)."""
        w = self.q_proj.weight
        conv = (batch, self.width, self.conv_size - 1)
        return KDACache(*(torch.zeros(conv, device=w.device, dtype=w.dtype) for _ in range(3)),
                        torch.zeros(batch, self.num_heads, self.head_dim, self.head_dim, device=w.device,
                                    dtype=state_dtype))

    def check_cache(self, cache: KDACache, batch: int) -> None:
        if not isinstance(cache, KDACache):
            raise ValueError(f"cache must be a KDACache or None, got {type(cache).__name__}")  # noqa: TRY004
        conv = (batch, self.width, self.conv_size - 1)
        for name in ("conv_q", "conv_k", "conv_v"):
            t = getattr(cache, name)
            if t.shape != conv:
                raise ValueError(f"cache.{name} must be [B={batch}, C={self.width}, "
                                 f"W-1={self.conv_size - 1}], got {tuple(t.shape)}")
        st = (batch, self.num_heads, self.head_dim, self.head_dim)
        if cache.state.shape != st:
            raise ValueError(f"cache.state must be [B={batch}, H={self.num_heads}, K={self.head_dim}, "
                             f"V={self.head_dim}], got {tuple(cache.state.shape)}")
        if cache.state.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"cache.state must be float32 (or float64), got {cache.state.dtype}")

    def forward(self, x, cache=None, algorithm=None):
        """algorithm: None (chunked for T > 1, recurrent for T = 1), 'chunked' or 'recurrent'."""
        B, T = check_hidden_states(x, self.hidden_size, self.q_proj.weight.dtype)
        if cache is not None:
            self.check_cache(cache, B)
        if algorithm not in (None, "chunked", "recurrent"):
            raise ValueError(f"algorithm must be None, 'chunked' or 'recurrent', got {algorithm!r}")
        H, K = self.num_heads, self.head_dim
        prev = cache if cache is not None else KDACache(None, None, None, None)
        # 1. projections, causal conv + SiLU (the conv state carries the last W-1 inputs)
        q, conv_q = short_conv(self.q_proj(x), self.q_conv.weight, prev.conv_q)
        k, conv_k = short_conv(self.k_proj(x), self.k_conv.weight, prev.conv_k)
        v, conv_v = short_conv(self.v_proj(x), self.v_conv.weight, prev.conv_v)
        # 2. per-head L2 norm of q and k (the 128^-0.5 scale is applied inside the recurrence)
        q = l2_normalize(q.view(B, T, H, K))
        k = l2_normalize(k.view(B, T, H, K))
        v = v.view(B, T, H, K)
        # 3-4. decay gate and write strength
        g = kda_gate(self.f_b(self.f_a(x)), self.A_log, self.dt_bias, self.lower_bound)
        beta = kda_beta(self.b_proj(x))
        # 5. the recurrence
        use_recurrent = algorithm == "recurrent" or (algorithm is None and T == 1)
        if use_recurrent:
            o, state = kda_recurrent(q, k, v, g, beta, scale=K ** -0.5, initial_state=prev.state)
        else:
            o, state = kda_chunked(q, k, v, g, beta, scale=K ** -0.5, initial_state=prev.state,
                                   chunk_size=self.chunk_size)
        # 6. gated output norm per head, then the output projection
        gate = self.g_proj(x).view(B, T, H, K)
        o = gated_rms_norm(o.to(x.dtype), gate, self.o_norm.weight, self.eps)
        out = self.o_proj(o.reshape(B, T, H * K))
        return out, KDACache(conv_q, conv_k, conv_v, state)
