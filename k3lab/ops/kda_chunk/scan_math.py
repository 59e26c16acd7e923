"""The algebra behind KDA's group scan, in plain PyTorch (fp32, or fp64 when given fp64).

Chunked KDA (docs/k3.md) turns each chunk of 64 tokens into a few matrices that
do not depend on the state: W, U, Qg = scale Q e^G, Kd = K e^(G_last - G), Aqk and d = e^(G_last).
Only the state then walks from chunk to chunk:

    E = U - W S_in;   O = Qg S_in + Aqk E;   S_out = diag(d) S_in + Kd^T E.

Substituting E gives S_out as an affine map of S_in that is known before S_in is:

    S_out = A_c S_in + B_c,   A_c = diag(d) - Kd^T W   [K x K],   B_c = Kd^T U   [K x V].

Affine maps compose ("halve it and add two, then halve it and add one" = "take a quarter and add
two", seed section 5): applying (A1, B1) then (A2, B2) is (A2 A1, A2 B1 + B2). So a group of chunks
has one summary (M, b); an ordered scan over the summaries gives every group its starting state;
and the groups replay their chunks in parallel. This module writes each of those steps on its own
so a test or a notebook can check that composing equals applying one chunk after the other, and
that the whole path equals `k3lab.nn.kda.kda_chunked` / `kda_recurrent`.

Tensors here are [B, H, n_chunks, ...] (one B x H batch of independent recurrences), computed in the
inputs' precision promoted to at least fp32 (fp64 when any input is fp64). It is the readable version:
the kernels of `k3lab.ops.kda_chunk` compute the same quantities for 64-token chunks; the algebra holds
for any chunk size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3lab.nn.kda import chunk_inverse
from k3lab.ops import expect

from .inputs import check_positive_int


def _check_inputs(q, k, v, g, beta, initial_state):
    """(B, T, H, K, V) of KDA's inputs (kda_chunked's shapes); ValueError naming a wrong one."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        expect(name, t, dtype="float")
    expect("q", q, shape=4, what="[B, T, H, K]")
    B, T, H, K = q.shape
    for name, t in (("k", k), ("g", g)):
        expect(name, t, shape=q.shape, what=f"of q's shape {tuple(q.shape)}")
    expect("v", v, shape=(B, T, H, None), what=f"[B={B}, T={T}, H={H}, V]")
    expect("beta", beta, shape=(B, T, H), what=f"[B={B}, T={T}, H={H}]")
    V = v.shape[-1]
    if initial_state is not None:
        expect("initial_state", initial_state, shape=(B, H, K, V), dtype=(torch.float32, torch.float64),
               what=f"[B={B}, H={H}, K={K}, V={V}]")
    return B, T, H, K, V


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t
                                in tensors) else torch.float32


@dataclass
class ChunkQuantities:
    """Per-chunk, state-independent matrices; every field is [B, H, n, ...]."""

    W: torch.Tensor  # [B, H, n, C, K]  R diag(beta) (K e^G)
    U: torch.Tensor  # [B, H, n, C, V]  R diag(beta) V
    Qg: torch.Tensor  # [B, H, n, C, K]  scale Q e^G
    Kd: torch.Tensor  # [B, H, n, C, K]  K e^(G_last - G)
    Aqk: torch.Tensor  # [B, H, n, C, C]  scale (q_i . k_j e^(G_i - G_j)), j <= i
    d: torch.Tensor  # [B, H, n, K]     e^(G_last)
    T: int  # tokens before padding

    @property
    def n_chunks(self) -> int:
        return self.W.shape[2]


def chunk_products(Q: torch.Tensor, Kc: torch.Tensor, G: torch.Tensor, bt: torch.Tensor, scale: float):
    """The in-chunk products of chunked tensors [B, H, n, C, K] (G the in-chunk cumulative log-decay,
    bt = beta [B, H, n, C, 1]): Akk[i, j] = beta_i sum_c k_ic k_jc e^(G_ic - G_jc) for j < i (zero
    elsewhere) and Aqk[i, j] = scale sum_c q_ic k_jc e^(G_ic - G_jc) for j <= i, each [B, H, n, C, C].
    The pairwise decay is formed as e^(G_i - G_j) (never e^(-G), which overflows), one chunk at a time."""
    B, H, n, C, _ = Q.shape
    strict = torch.ones(C, C, dtype=torch.bool, device=Q.device).tril(-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=Q.device).tril(0)
    Akk = torch.empty(B, H, n, C, C, dtype=Q.dtype, device=Q.device)
    Aqk = torch.empty_like(Akk)
    for c in range(n):  # the pairwise decay is [B, H, C, C, K]
        Gi = G[:, :, c]
        diff = Gi.unsqueeze(-2) - Gi.unsqueeze(-3)
        decay = torch.where(incl[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        kk = torch.einsum("bhik,bhjk,bhijk->bhij", Kc[:, :, c], Kc[:, :, c], decay)
        Akk[:, :, c] = (bt[:, :, c] * kk).masked_fill(~strict, 0.0)
        Aqk[:, :, c] = scale * torch.einsum("bhik,bhjk,bhijk->bhij", Q[:, :, c], Kc[:, :, c], decay)
    return Akk, Aqk


def chunk_quantities(q, k, v, g, beta, scale=None, chunk_size: int = 64) -> ChunkQuantities:
    """The prologue of every chunk (no state needed). Same inputs as `kda_chunked`; the last chunk is
    padded with no-op tokens (k = 0, g = 0, beta = 0)."""
    B, T, H, K, _ = _check_inputs(q, k, v, g, beta, None)
    check_positive_int("chunk_size", chunk_size)
    scale = K**-0.5 if scale is None else scale
    dt = _compute_dtype(q, k, v, g, beta)
    C = chunk_size
    n = -(-T // C)
    pad = n * C - T

    def prep(t):  # [B, T, H, X] -> [B, H, n, C, X]
        t = t.to(dt)
        if pad:
            t = torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad))
        return t.reshape(B, n, C, H, -1).permute(0, 3, 1, 2, 4)

    Q, Kc, Vc, Gc = prep(q), prep(k), prep(v), prep(g)
    bt = prep(beta.unsqueeze(-1))  # [B, H, n, C, 1]
    G = Gc.cumsum(-2)
    G_last = G[..., -1:, :]
    Akk, Aqk = chunk_products(Q, Kc, G, bt, scale)
    R = chunk_inverse(Akk)
    U = R @ (bt * Vc)
    W = R @ (bt * Kc * G.exp())
    return ChunkQuantities(
        W=W, U=U, Qg=scale * Q * G.exp(), Kd=Kc * (G_last - G).exp(), Aqk=Aqk, d=G_last.squeeze(-2).exp(), T=T
    )


def chunk_step(cq: ChunkQuantities, c: int, S: torch.Tensor):
    """Walk one chunk c from state S [B, H, K, V] (the sequential step): returns (O [B, H, C, V], S_out)."""
    E = cq.U[:, :, c] - cq.W[:, :, c] @ S
    o_c = cq.Qg[:, :, c] @ S + cq.Aqk[:, :, c] @ E
    S_out = cq.d[:, :, c].unsqueeze(-1) * S + cq.Kd[:, :, c].transpose(-1, -2) @ E
    return o_c, S_out


def chunk_affine(cq: ChunkQuantities):
    """Every chunk's map S_out = A S_in + B: A [B, H, n, K, K], B [B, H, n, K, V]."""
    KdT = cq.Kd.transpose(-1, -2)
    A = torch.diag_embed(cq.d) - KdT @ cq.W
    Bc = KdT @ cq.U
    return A, Bc


def compose(first, second):
    """The map 'apply `first`, then `second`': (A2 A1, A2 B1 + B2). Maps are (A, B) pairs of any
    matching leading shape."""
    A1, B1 = first
    A2, B2 = second
    return A2 @ A1, A2 @ B1 + B2


def apply(affine, S: torch.Tensor) -> torch.Tensor:
    A, Bc = affine
    return A @ S + Bc


def group_bounds(n_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """[start, end) chunk ranges of consecutive groups of `group_size` chunks (the last may be shorter)."""
    check_positive_int("group_size", group_size)
    return [(s, min(s + group_size, n_chunks)) for s in range(0, n_chunks, group_size)] or [(0, 0)]


def group_summaries(A: torch.Tensor, Bc: torch.Tensor, group_size: int):
    """Compose each group's chunk maps into one (M, b): M [B, H, n_groups, K, K], b [B, H, n_groups, K, V].
    All groups are independent: this loop runs over chunks within a group, vectorised over groups."""
    n = A.shape[2]
    bounds = group_bounds(n, group_size)
    K = A.shape[-1]
    eye = torch.eye(K, dtype=A.dtype, device=A.device)
    Ms, bs = [], []
    for s, e in bounds:
        M = eye.expand(*A.shape[:2], K, K).clone()
        b = torch.zeros(*Bc.shape[:2], *Bc.shape[-2:], dtype=Bc.dtype, device=Bc.device)
        for c in range(s, e):
            M, b = compose((M, b), (A[:, :, c], Bc[:, :, c]))
        Ms.append(M)
        bs.append(b)
    return torch.stack(Ms, 2), torch.stack(bs, 2)


def scan_starts(M: torch.Tensor, b: torch.Tensor, S0: torch.Tensor) -> torch.Tensor:
    """The ordered scan: the starting state of every group, [B, H, n_groups, K, V]. It walks groups,
    not chunks: n_groups sequential steps instead of n_chunks."""
    starts = []
    S = S0
    for j in range(M.shape[2]):
        starts.append(S)
        S = M[:, :, j] @ S + b[:, :, j]
    return torch.stack(starts, 2)


def replay(cq: ChunkQuantities, starts: torch.Tensor, group_size: int):
    """Every group walks its own chunks from its starting state, all groups at once (the loop runs
    group_size times, not n_chunks times). Returns (o [B, T, H, V], S_final [B, H, K, V])."""
    n = cq.n_chunks
    bounds = group_bounds(n, group_size)
    B, H, _, C, V = cq.U.shape
    out = torch.zeros(B, H, n, C, V, dtype=cq.U.dtype, device=cq.U.device)
    S = starts.clone()  # [B, H, n_groups, K, V]
    for t in range(group_size):
        for j, (s, e) in enumerate(bounds):  # independent groups: a GPU runs them side by side
            c = s + t
            if c >= e:
                continue
            o_c, S_j = chunk_step(cq, c, S[:, :, j])
            out[:, :, c] = o_c
            S[:, :, j] = S_j
    S_final = S[:, :, -1]
    o = out.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, : cq.T]
    return o, S_final


def kda_group_scan(
    q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64, group_size: int = 4
):
    """KDA by the group scan: prologue, per-chunk maps, group summaries, scan, parallel replay.
    Same arguments and results as `k3lab.nn.kda.kda_chunked` (o in q's dtype, state in the compute
    dtype), plus `group_size` (chunks per group)."""
    B, _, H, K, V = _check_inputs(q, k, v, g, beta, initial_state)
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    cq = chunk_quantities(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
    S0 = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    A, Bc = chunk_affine(cq)
    M, b = group_summaries(A, Bc, group_size)
    starts = scan_starts(M, b, S0)
    o, S = replay(cq, starts, group_size)
    return o.to(q.dtype if q.dtype != dt else dt), S


def kda_chunk_walk(q, k, v, g, beta, scale=None, initial_state=None, chunk_size: int = 64):
    """The plain sequential walk over the same chunk quantities (the 'before' algebra)."""
    B, T, H, K, V = _check_inputs(q, k, v, g, beta, initial_state)
    dt = _compute_dtype(q, k, v, g, beta, initial_state)
    cq = chunk_quantities(q, k, v, g, beta, scale=scale, chunk_size=chunk_size)
    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    n, C = cq.n_chunks, chunk_size
    out = torch.zeros(B, H, n, C, V, dtype=dt, device=q.device)
    for c in range(n):
        out[:, :, c], S = chunk_step(cq, c, S)
    o = out.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V)[:, :T]
    return o.to(q.dtype if q.dtype != dt else dt), S


def sequential_depth(n_chunks: int, group_size: int | None) -> int:
    """Dependent chunk steps on the critical path: n_chunks for the plain walk; for the group scan,
    group_size (summaries) + n_groups - 1 (scan) + group_size (replay)."""
    check_positive_int("group_size", group_size, allow_none=True)
    if group_size is None or group_size >= n_chunks:
        return n_chunks
    n_groups = -(-n_chunks // group_size)
    return 2 * group_size + n_groups - 1


__all__ = ["ChunkQuantities", "apply", "chunk_affine", "chunk_products", "chunk_quantities", "chunk_step",
           "compose", "group_bounds",
           "group_summaries", "kda_chunk_walk", "kda_group_scan", "replay", "scan_starts", "sequential_depth"]
