"""Kimi Delta Attention (KDA) references in plain PyTorch.

The recurrence per head, state S in R^{K x V} (architecture.md section 3, step 5):

    S <- diag(exp(g_t)) S;  u = S^T k_t;  S <- S + k_t (beta_t (v_t - u))^T;  o_t = S^T (scale q_t)

`kda_recurrent` walks it token by token; `kda_chunked` computes the same thing 64 tokens at a time
with the within-chunk 64x64 unit lower-triangular inverse. Both compute in fp32 (fp64 when given
fp64) whatever the input dtype, return the output in q's dtype and the state in the compute dtype.
"""

from __future__ import annotations

import torch


def _check_kda_inputs(q, k, v, g, beta, initial_state):
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)} (per-channel log decay), got {tuple(g.shape)}")
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


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def kda_recurrent(q, k, v, g, beta, scale=None, initial_state=None):
    """Token-by-token KDA. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    initial_state: [B, H, K, V] fp32/fp64 or None (zeros). q and k are expected L2-normalised;
    scale defaults to K^-0.5. Returns (o [B, T, H, V] in q's dtype, final_state [B, H, K, V])."""
    B, T, H, K, V = _check_kda_inputs(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
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
    C = A_strict_lower.shape[-1]
    eye = torch.eye(C, dtype=A_strict_lower.dtype, device=A_strict_lower.device)
    return torch.linalg.solve_triangular(A_strict_lower + eye, eye.expand_as(A_strict_lower), upper=False,
                                         unitriangular=True)


def kda_chunked(q, k, v, g, beta, scale=None, initial_state=None, chunk_size=64):
    """KDA in chunks of `chunk_size` (any T: the last chunk is padded with no-op tokens).

    Per chunk, with G the in-chunk inclusive cumsum of g:
      Akk[i,j] = beta_i sum_d k_i k_j exp(G_i - G_j) (j < i);  Aqk[i,j] = scale sum_d q_i k_j exp(G_i - G_j) (j <= i)
      R = (I + Akk)^-1;  U = R diag(beta) V;  W = R diag(beta) (K * exp(G));  E = U - W S
      O = scale (Q * exp(G)) S + Aqk E;  S <- diag(exp(G_last)) S + (K * exp(G_last - G))^T E
    Same arguments and results as `kda_recurrent`."""
    B, T, H, K, V = _check_kda_inputs(q, k, v, g, beta, initial_state)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    scale = K ** -0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    C = chunk_size
    n = -(-T // C) if T else 0
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
