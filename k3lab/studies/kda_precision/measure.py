"""Checks and timings of the kda_precision study (the package docstring says what it measures): its cases,
each variant checked against the fp64 reference before it is timed into records.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from k3lab import bench
from k3lab.nn.kda import chunk_inverse, kda_chunked
from k3lab.ops.kda_chunk.scan_math import chunk_products

from .tables import BLOCK, CHUNK

NAME = "kda_precision"

# precision name -> (dtype of every product's inputs, dtype of its accumulation)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "fp64": (torch.float64, torch.float64),
    "fp32": (torch.float32, torch.float32),
    "bf16_in": (torch.bfloat16, torch.float32),
    "bf16": (torch.bfloat16, torch.bfloat16),
}
KINDS = ("k3_gate", "adversarial")
DEFAULT_CHUNKS = 32
DEFAULT_HEADS = 2


# ----------------------------------------------------------------------------------------------
# the 256.5 - 256 example


def subtraction_example(a: float = 256.5, b: float = 256.0) -> list[dict]:
    """a - b with both inputs kept in fp32, and with both rounded to bf16 first; the subtraction itself
    is done in fp32 both times (torch computes it; nothing is typed in)."""
    x32 = torch.tensor(a, dtype=torch.float32)
    y32 = torch.tensor(b, dtype=torch.float32)
    xb, yb = x32.to(torch.bfloat16).float(), y32.to(torch.bfloat16).float()
    return [
        {"inputs": "fp32", "a": float(x32), "b": float(y32), "a - b (fp32)": float(x32 - y32)},
        {"inputs": "bf16", "a": float(xb), "b": float(yb), "a - b (fp32)": float(xb - yb)},
    ]


# ----------------------------------------------------------------------------------------------
# the blocked inverse in a chosen precision


def _work_dtype(precision: str) -> torch.dtype:
    return torch.float64 if precision == "fp64" else torch.float32


def _round(x: torch.Tensor, dtype: torch.dtype, work: torch.dtype) -> torch.Tensor:
    return x.to(dtype).to(work)


def _mm(a, b, in_dt, acc_dt, work):
    """a @ b with a and b rounded to in_dt; accumulation in acc_dt (bf16 accumulation rounds every
    partial sum, one inner index at a time)."""
    a, b = _round(a, in_dt, work), _round(b, in_dt, work)
    if acc_dt in (torch.float32, torch.float64):
        return a @ b  # products of bf16 values are exact in fp32; the sum rounds in fp32
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=work)
    for i in range(a.shape[-1]):
        acc = _round(acc + _round(a[..., :, i:i + 1] * b[..., i:i + 1, :], acc_dt, work), acc_dt, work)
    return acc


def blocked_inverse(A: torch.Tensor, precision: str = "fp32", block: int = BLOCK):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], built from block x block tiles:
    diagonal tiles by forward substitution (row r: R[r, :r] = -A[r, :r] R[:r, :r]), then tile rows
    R_ij = -R_ii (sum_{k=j}^{i-1} A_ik R_kj). Every product takes its inputs in the precision's input
    dtype and accumulates in its accumulation dtype. Returns R in the working dtype (fp32; fp64 for
    'fp64'), not yet rounded to bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    C = A.shape[-1]
    if A.shape[-2] != C or C % block:
        raise ValueError(f"A must be [..., C, C] with C a multiple of block={block}, got {tuple(A.shape)}")
    in_dt, acc_dt = PRECISIONS[precision]
    work = _work_dtype(precision)
    A = _round(A.to(torch.float64), in_dt, work)  # the inverse's inputs, in the input precision
    R = torch.zeros_like(A)
    nb = C // block
    eye = torch.eye(block, dtype=work)

    def tile(M, i, j):
        return M[..., i * block:(i + 1) * block, j * block:(j + 1) * block]

    for i in range(nb):
        Aii, Rii = tile(A, i, i), eye.expand_as(tile(A, i, i)).clone()
        for r in range(1, block):
            Rii[..., r:r + 1, :r] = -_mm(Aii[..., r:r + 1, :r], Rii[..., :r, :r], in_dt, acc_dt, work)
        tile(R, i, i).copy_(Rii)
    for i in range(1, nb):
        for j in range(i):
            acc = torch.zeros_like(tile(A, i, j))
            for k in range(j, i):
                acc = _round(acc + _mm(tile(A, i, k), tile(R, k, j), in_dt, acc_dt, work), acc_dt, work)
            tile(R, i, j).copy_(-_mm(tile(R, i, i), acc, in_dt, acc_dt, work))
    return R


# ----------------------------------------------------------------------------------------------
# inputs


def make_inputs(kind: str, *, n_chunks: int = DEFAULT_CHUNKS, heads: int = DEFAULT_HEADS, seed: int = 0,
                K: int = 128, V: int = 128) -> dict:
    """fp32 KDA inputs [1, n_chunks * 64, H, .] and a random fp32 initial state.

    k3_gate: random unit q, k; g = -5 sigmoid(2 x - 2) (K3's gate form, lower bound -5); beta = sigmoid(x).
    adversarial: half the channels barely decay (g ~ -0.002) and half decay hard (g ~ -4.9); the
    keys are nearly parallel (one direction, mostly in the slow channels, plus 2% noise); beta ~ 0.99.
    Then A_ij ~ 1 for every j < i: the substitution's partial sums grow with i and cancel."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    gen = torch.Generator().manual_seed(seed * 1000 + zlib.crc32(kind.encode()) % 1000)
    T = n_chunks * CHUNK

    def rn(*shape):
        return torch.randn(*shape, generator=gen)

    norm = torch.nn.functional.normalize
    q = norm(rn(1, T, heads, K), dim=-1)
    v = rn(1, T, heads, V)
    if kind == "k3_gate":
        k = norm(rn(1, T, heads, K), dim=-1)
        g = -5.0 * torch.sigmoid(2.0 * rn(1, T, heads, K) - 2.0)
        beta = torch.sigmoid(rn(1, T, heads))
    else:
        slow = torch.arange(K) < K // 2
        logits = torch.where(slow, torch.full((K,), -8.0), torch.full((K,), 4.0)) + 0.5 * rn(1, T, heads, K)
        g = -5.0 * torch.sigmoid(logits)
        direction = torch.where(slow, 1.0, 0.1) * rn(1, 1, heads, K)
        k = norm(norm(direction, dim=-1) + 0.02 * rn(1, T, heads, K), dim=-1)
        beta = torch.sigmoid(5.0 + 0.2 * rn(1, T, heads))
    S0 = 0.5 * rn(1, heads, K, V)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": S0}


# ----------------------------------------------------------------------------------------------
# chunked KDA with a chosen inverse


@dataclass
class Chunks:
    """Everything about the chunks that does not involve the inverse, [B, H, n, ...] in one dtype:
    A (strictly lower, the inverse's input), Aqk, Qg = scale Q e^G, bV = beta V, bKg = beta K e^G,
    Kd = K e^(G_last - G), d = e^(G_last)."""

    A: torch.Tensor
    Aqk: torch.Tensor
    Qg: torch.Tensor
    bV: torch.Tensor
    bKg: torch.Tensor
    Kd: torch.Tensor
    d: torch.Tensor


def prepare_chunks(q, k, v, g, beta, *, dtype=torch.float32, scale=None) -> Chunks:
    """The per-chunk matrices of KDA (same equations as k3lab.nn.kda.kda_chunked), for T a multiple
    of 64, computed once in `dtype` so that every inverse variant sees identical inputs."""
    B, T, H, K = q.shape
    if T % CHUNK:
        raise ValueError(f"T must be a multiple of {CHUNK}, got {T}")
    n = T // CHUNK
    scale = K ** -0.5 if scale is None else scale

    def split(x):  # [B, T, H, X] -> [B, H, n, C, X]
        return x.to(dtype).reshape(B, n, CHUNK, H, -1).permute(0, 3, 1, 2, 4)

    Q, Kc, Vc, Gc = split(q), split(k), split(v), split(g)
    bt = split(beta.unsqueeze(-1))
    G = Gc.cumsum(-2)
    A, Aqk = chunk_products(Q, Kc, G, bt, scale)
    G_last = G[..., -1:, :]
    return Chunks(A=A, Aqk=Aqk, Qg=scale * Q * G.exp(), bV=bt * Vc, bKg=bt * Kc * G.exp(),
                  Kd=Kc * (G_last - G).exp(), d=G_last.squeeze(-2).exp())


def walk(ch: Chunks, R: torch.Tensor, initial_state: torch.Tensor):
    """Carry the state through the chunks with the given inverses R [B, H, n, C, C]:
    U = R bV; W = R bKg; E = U - W S; O = Qg S + Aqk E; S <- diag(d) S + Kd^T E.
    Returns (o [B, n * 64, H, V], final state [B, H, K, V]) in the chunks' dtype."""
    dt = ch.A.dtype
    R = R.to(dt)
    U, W = R @ ch.bV, R @ ch.bKg
    S = initial_state.to(dt).clone()
    outs = []
    for c in range(ch.A.shape[2]):
        E = U[:, :, c] - W[:, :, c] @ S
        outs.append(ch.Qg[:, :, c] @ S + ch.Aqk[:, :, c] @ E)
        S = ch.d[:, :, c].unsqueeze(-1) * S + ch.Kd[:, :, c].transpose(-1, -2) @ E
    o = torch.stack(outs, dim=2)  # [B, H, n, C, V]
    B, H, n, C, V = o.shape
    return o.permute(0, 2, 3, 1, 4).reshape(B, n * C, H, V), S


def inverse_for(ch: Chunks, precision: str, *, round_inverse: bool = True) -> torch.Tensor:
    """R for every chunk in one precision; rounded to bf16 at the end when round_inverse (the seed:
    only the finished inverse goes to bf16 for the products that follow)."""
    R = blocked_inverse(ch.A, precision)
    return R.to(torch.bfloat16).to(R.dtype) if round_inverse else R


@functools.lru_cache(maxsize=8)
def _case_data(kind: str, n_chunks: int, heads: int, seed: int):
    inputs = make_inputs(kind, n_chunks=n_chunks, heads=heads, seed=seed)
    return inputs, prepare_chunks(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"]), \
        reference(inputs)


def reference(inputs: dict):
    """fp64 outputs and final state from k3lab.nn.kda.kda_chunked (its own inverse), independent of
    everything above."""
    x = {n: t.to(torch.float64) for n, t in inputs.items()}
    return kda_chunked(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"])


def errors(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """max_rel (against the rms of ref, bench's convention), rel_l2 and max_abs; never raises."""
    g, r = got.to(torch.float64), ref.to(torch.float64)
    d = (g - r).abs()
    rms = float(r.pow(2).mean().sqrt())
    return {"max_rel": float((d / r.abs().clamp(min=max(rms, 1e-30))).max()),
            "rel_l2": float(torch.linalg.vector_norm(g - r) / torch.linalg.vector_norm(r)),
            "max_abs": float(d.max())}


def condition(A: torch.Tensor) -> float:
    """Largest infinity-norm condition number of (I + A) over the chunks: how much a relative error
    in the inverse's inputs can grow in R (1 for A = 0; 2 x 64 = 128 for A = all ones below the
    diagonal, the nearly-parallel-keys limit)."""
    A64 = A.to(torch.float64)
    eye = torch.eye(A.shape[-1], dtype=torch.float64)
    R = chunk_inverse(A64)
    norm = lambda M: M.abs().sum(-1).amax(-1)  # noqa: E731 - the infinity norm, per chunk
    return float((norm(eye + A64) * norm(R)).max())


def measure(kind: str, precision: str, *, round_inverse: bool = True, n_chunks: int = DEFAULT_CHUNKS,
            heads: int = DEFAULT_HEADS, seed: int = 0) -> dict:
    """Errors of the outputs and final state after n_chunks, and of R itself (before rounding), against
    fp64, for one precision of the inverse."""
    inputs, ch, (ref_o, ref_S) = _case_data(kind, n_chunks, heads, seed)
    R = inverse_for(ch, precision, round_inverse=False)
    R_ref = chunk_inverse(ch.A.to(torch.float64))
    o, S = walk(ch, R.to(torch.bfloat16).to(R.dtype) if round_inverse else R, inputs["initial_state"])
    return {"o": errors(o, ref_o), "state": errors(S, ref_S), "inverse": errors(R, R_ref),
            "condition": condition(ch.A)}


# ----------------------------------------------------------------------------------------------
# the study contract


def case_names(preset=None) -> list[str]:
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    return [name for kind in KINDS for name in (kind, f"{kind}.all_bf16", f"{kind}.unrounded")]


def _case_variants(case: str) -> tuple[str, list[tuple[str, str]], bool]:
    kind, _, tail = case.partition(".")
    if tail == "all_bf16":
        return kind, [("before", "bf16")], True
    if tail == "unrounded":  # the inverse's own effect, without the final bf16 rounding
        return kind, [("before", "bf16_in"), ("after", "fp32")], False
    return kind, [("before", "bf16_in"), ("after", "fp32")], True


def check_pipeline(kind: str = "adversarial", *, n_chunks: int = 4, heads: int = 1, seed: int = 0) -> dict:
    """The chunk walk itself, with an fp64 inverse and no rounding, must equal k3lab.nn.kda in fp64:
    then every error this study reports comes from the inverse's precision alone."""
    inputs = make_inputs(kind, n_chunks=n_chunks, heads=heads, seed=seed)
    ch = prepare_chunks(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"],
                        dtype=torch.float64)
    o, S = walk(ch, blocked_inverse(ch.A, "fp64"), inputs["initial_state"])
    ref_o, ref_S = reference(inputs)
    return bench.check_all({"o": (o, ref_o), "state": (S, ref_S)}, dtype=torch.float64)


def run(preset=None, cases=None, *, n_chunks: int = DEFAULT_CHUNKS, heads: int = DEFAULT_HEADS,
        seed: int = 0) -> list[bench.Record]:
    """Every case's variants: errors against fp64 (in `error`) and the CPU time of one blocked
    inverse over all chunks (an emulation: the time says nothing about a GPU). First checks the
    pipeline (`check_pipeline`)."""
    valid = case_names(preset)
    chosen = valid if cases is None else list(cases)
    unknown = [c for c in chosen if c not in valid]
    if unknown:
        raise ValueError(f"cases must be among {valid}, got unknown {unknown}")
    check_pipeline()
    records = []
    for case in chosen:
        kind, variants, rounded = _case_variants(case)
        _, ch, _ = _case_data(kind, n_chunks, heads, seed)
        for label, precision in variants:
            err = measure(kind, precision, round_inverse=rounded, n_chunks=n_chunks, heads=heads, seed=seed)
            t = bench.time_fn(lambda: blocked_inverse(ch.A, precision), warmup=0, repeats=3, device="cpu")
            records.append(bench.make_record(
                NAME, case, label, t, shape={"B": 1, "T": n_chunks * CHUNK, "H": heads, "K": 128, "V": 128,
                                             "chunks": n_chunks},
                dtype=precision, error=err, precision=precision, inverse_inputs=str(PRECISIONS[precision][0]),
                inverse_accumulation=str(PRECISIONS[precision][1]), inverse_rounded_to_bf16=rounded,
                kind=kind, seed=seed, timed="blocked_inverse over all chunks, CPU emulation"))
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """The 64 x 64 inverse of one adversarial chunk in each precision (CPU work)."""
    x = make_inputs("adversarial", n_chunks=1, heads=1)
    A = prepare_chunks(x["q"], x["k"], x["v"], x["g"], x["beta"]).A
    return {p: (lambda _p=p: blocked_inverse(A, _p)) for p in ("fp32", "bf16_in", "bf16")}


# ----------------------------------------------------------------------------------------------
# on-chip memory of the inverse tile


