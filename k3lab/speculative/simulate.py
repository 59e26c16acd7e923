"""Monte Carlo checks of the formula: cycle-level draws and token-level rejection sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from k3lab.speculative.inputs import count_arg, probabilities
from k3lab.speculative.acceptance import expected_committed


# --------------------------------------------------------------------------------------------
# Cycle-level Monte Carlo
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleStats:
    """What a simulation of draft-verify cycles measured."""

    depth: int
    cycles: int
    mean: float  # committed tokens per cycle
    stderr: float  # standard error of the mean
    counts: np.ndarray = field(repr=False)  # counts[c - 1] = cycles that committed c tokens

    def z_score(self, expected: float) -> float:
        """(mean - expected) / stderr; within +-3 for a correct formula 99.7% of the time."""
        if self.stderr == 0:
            return 0.0 if self.mean == expected else math.copysign(math.inf, self.mean - expected)
        return (self.mean - expected) / self.stderr


def _stats_from_counts(depth: int, counts: np.ndarray) -> CycleStats:
    cycles = int(counts.sum())
    committed = np.arange(1, depth + 2, dtype=np.float64)
    mean = float(counts @ committed) / cycles
    var = float(counts @ (committed - mean) ** 2) / max(cycles - 1, 1)
    return CycleStats(depth=depth, cycles=cycles, mean=mean, stderr=math.sqrt(var / cycles), counts=counts)


def simulate_cycles(acceptance, depth: int, cycles: int = 1_000_000, *, seed: int = 0,
                    chunk: int = 1 << 16) -> CycleStats:
    """Simulate ``cycles`` draft-verify cycles with per-position acceptance draws.

    Each cycle draws one uniform per drafted position, accepts position i when u[i] < a[i], stops at
    the first rejection, and commits the accepted drafts plus one recovery or bonus token. The
    cycles are processed in chunks of ``chunk`` rows (numpy, one core); 64K rows keep the working
    set in cache, which is what makes 10^6 cycles take tens of milliseconds.
    """
    a = probabilities("acceptance", acceptance)
    depth = count_arg("depth", depth, high=a.size)
    cycles = count_arg("cycles", cycles)
    chunk = count_arg("chunk", chunk)
    a = a[:depth]
    rng = np.random.default_rng(seed)
    counts = np.zeros(depth + 1, dtype=np.int64)
    for start in range(0, cycles, chunk):
        rows = min(chunk, cycles - start)
        rejected = rng.random((rows, depth)) >= a
        # drafts accepted before the first rejection (argmax finds the first True); depth if none
        accepted = np.where(rejected.any(axis=1), rejected.argmax(axis=1), depth)
        counts += np.bincount(accepted, minlength=depth + 1)
    return _stats_from_counts(depth, counts)


def simulate_cycles_loop(acceptance, depth: int, cycles: int = 1_000_000, *, seed: int = 0,
                         chunk: int = 1 << 16) -> CycleStats:
    """The same simulation written as a plain loop over cycles and positions (the "before").

    It reads the very same uniform draws as ``simulate_cycles`` (same seed, same chunks), so the two
    must give identical counts: this is the readable reference the vectorised version is checked
    against, and the benchmark shows what vectorising buys.
    """
    a = probabilities("acceptance", acceptance)
    depth = count_arg("depth", depth, high=a.size)
    cycles = count_arg("cycles", cycles)
    chunk = count_arg("chunk", chunk)
    probs = a[:depth].tolist()
    rng = np.random.default_rng(seed)
    counts = [0] * (depth + 1)
    for start in range(0, cycles, chunk):
        for row in rng.random((min(chunk, cycles - start), depth)).tolist():
            accepted = 0
            for u, p in zip(row, probs):
                if u >= p:  # first rejection: the recovery token replaces this draft
                    break
                accepted += 1
            counts[accepted] += 1  # accepted == depth: every draft kept, plus the bonus token
    return _stats_from_counts(depth, np.array(counts, dtype=np.int64))


# --------------------------------------------------------------------------------------------
# Token-level Monte Carlo: real rejection sampling
# --------------------------------------------------------------------------------------------


def _softmax_rows(name: str, logits) -> np.ndarray:
    """Logits of shape [V] (same distribution whatever came before) or [V, V] (row = previous
    token) -> probabilities of shape [V, V]."""
    try:
        x = np.asarray(logits, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be an array of logits of shape [V] or [V, V]") from exc
    if x.ndim == 1:
        x = np.broadcast_to(x, (x.size, x.size))
    if x.ndim != 2 or x.shape[0] != x.shape[1] or x.shape[0] < 2:
        raise ValueError(f"{name} must have shape [V] or [V, V] with V >= 2; got {np.shape(logits)}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name} must not contain NaN or infinity")
    z = np.exp(x - x.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def _context(context, vocab: int) -> np.ndarray:
    if context is None:
        return np.full(vocab, 1.0 / vocab)
    c = probabilities("context", context)
    if c.size != vocab or not math.isclose(c.sum(), 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"context must be a distribution over the {vocab} tokens (summing to 1); got {c}")
    return c


def acceptance_from_distributions(target_logits, draft_logits, depth: int, context=None) -> np.ndarray:
    """The exact conditional acceptance curve of rejection sampling for a draft/target pair.

    With m[t, x] = min(p(x | t), q(x | t)), the chance that a draft is accepted *and* is token x is
    m[t, x]; so P(first j drafts accepted, last one x) is (context @ m^j)[x], and the conditional
    acceptance of position j is S[j] / S[j - 1]. For context-free distributions every entry equals
    sum_x min(p(x), q(x)) = 1 - total-variation distance.
    """
    p = _softmax_rows("target_logits", target_logits)
    q = _softmax_rows("draft_logits", draft_logits)
    if p.shape != q.shape:
        raise ValueError(f"draft_logits must have the vocabulary of target_logits {p.shape}; got {q.shape}")
    depth = count_arg("depth", depth)
    m = np.minimum(p, q)
    mass = _context(context, p.shape[0])
    curve = np.empty(depth)
    for j in range(depth):
        nxt = mass @ m
        before, after = mass.sum(), nxt.sum()
        curve[j] = after / before if before > 0 else 0.0
        mass = nxt
    return np.clip(curve, 0.0, 1.0)


@dataclass(frozen=True)
class TokenStats(CycleStats):
    """A token-level simulation: cycle statistics plus what was committed."""

    transitions: np.ndarray = field(default=None, repr=False)  # [V, V] counts: previous -> committed
    target: np.ndarray = field(default=None, repr=False)  # [V, V] target probabilities
    acceptance: np.ndarray = field(default=None, repr=False)  # exact conditional acceptance curve
    expected: float = math.nan  # expected_committed(acceptance, depth)
    recovery: str = "residual"

    def chi_square(self) -> tuple[float, int, float]:
        """(statistic, degrees of freedom, p-value) of the committed tokens against the target."""
        return chi_square(self.transitions, self.target)


def _sample_rows(weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One index per row, drawn in proportion to that row's non-negative weights."""
    cdf = np.cumsum(weights, axis=1)
    u = rng.random((weights.shape[0], 1)) * cdf[:, -1:]
    return np.minimum((cdf <= u).sum(axis=1), weights.shape[1] - 1)


def simulate_tokens(target_logits, draft_logits, depth: int, cycles: int = 100_000, *, seed: int = 0,
                    context=None, recovery: str = "residual") -> TokenStats:
    """Simulate speculative sampling token by token over a small vocabulary.

    Each cycle starts after a token drawn from ``context`` (uniform by default), drafts ``depth``
    tokens from q(. | previous), then verifies left to right: draft x is accepted with probability
    min(1, p(x)/q(x)); at the first rejection a recovery token is drawn from the normalised
    max(0, p - q) and the cycle ends; if every draft is accepted a bonus token is drawn from p.
    This makes each committed token distributed exactly as p given what precedes it, which
    ``TokenStats.chi_square`` tests. ``recovery="target"`` (resample the rejected position from p
    itself) is the classic mistake, kept so the test and the notebook can show it failing.
    """
    p = _softmax_rows("target_logits", target_logits)
    q = _softmax_rows("draft_logits", draft_logits)
    if p.shape != q.shape:
        raise ValueError(f"draft_logits must have the vocabulary of target_logits {p.shape}; got {q.shape}")
    if recovery not in ("residual", "target"):
        raise ValueError(f"recovery must be 'residual' (correct) or 'target' (the biased shortcut); "
                         f"got {recovery!r}")
    depth = count_arg("depth", depth)
    cycles = count_arg("cycles", cycles)
    vocab = p.shape[0]
    ctx = _context(context, vocab)
    rng = np.random.default_rng(seed)
    rows = np.arange(cycles)

    # Draft: depth sequential samples from q, each conditioned on the token before it.
    prevs = np.empty((cycles, depth), dtype=np.int64)
    drafts = np.empty((cycles, depth), dtype=np.int64)
    prev = _sample_rows(np.broadcast_to(ctx, (cycles, vocab)), rng)
    for i in range(depth):
        prevs[:, i] = prev
        prev = drafts[:, i] = _sample_rows(q[prev], rng)

    # Verify: accept when u < p/q, written as u * q < p (q > 0: the draft was sampled from q).
    accepted = rng.random((cycles, depth)) * q[prevs, drafts] < p[prevs, drafts]
    rejected = ~accepted
    n_acc = np.where(rejected.any(axis=1), rejected.argmax(axis=1), depth)

    # Commit: the recovery token at the first rejection, or the bonus token after the last draft.
    final = np.empty(cycles, dtype=np.int64)
    final_prev = np.empty(cycles, dtype=np.int64)
    hit = n_acc < depth
    at = prevs[rows[hit], n_acc[hit]]
    if recovery == "residual":
        w = np.maximum(p[at] - q[at], 0.0)
        # A rejection needs p(x) < q(x) for the drafted x, so the residual has positive mass;
        # guard only against rounding leaving an all-zero row.
        empty = w.sum(axis=1) <= 0
        w[empty] = p[at[empty]]
    else:
        w = p[at]
    final[hit] = _sample_rows(w, rng)
    final_prev[hit] = at
    last = drafts[~hit, depth - 1]
    final[~hit] = _sample_rows(p[last], rng)
    final_prev[~hit] = last

    # Committed (previous, token) pairs: accepted drafts, then the final token.
    keep = np.arange(depth) < n_acc[:, None]
    pairs = np.concatenate((prevs[keep] * vocab + drafts[keep], final_prev * vocab + final))
    transitions = np.bincount(pairs, minlength=vocab * vocab).reshape(vocab, vocab)

    counts = np.bincount(n_acc, minlength=depth + 1).astype(np.int64)
    base = _stats_from_counts(depth, counts)
    curve = acceptance_from_distributions(target_logits, draft_logits, depth, context=ctx)
    return TokenStats(depth=depth, cycles=base.cycles, mean=base.mean, stderr=base.stderr, counts=counts,
                      transitions=transitions, target=p, acceptance=curve,
                      expected=expected_committed(curve, depth), recovery=recovery)


def chi_square(observed, probs) -> tuple[float, int, float]:
    """Pearson chi-square of count rows against probability rows: (statistic, dof, p-value).

    Rows with no counts are skipped; cells of probability zero must be empty (a count there is an
    impossible token: infinite statistic, p-value 0). The p-value is the chi-square survival
    function, Q(dof / 2, stat / 2), from torch's regularised incomplete gamma.
    """
    obs = np.atleast_2d(np.asarray(observed, dtype=np.float64))
    pr = np.atleast_2d(np.asarray(probs, dtype=np.float64))
    if obs.shape != pr.shape:
        raise ValueError(f"observed and probs must have the same shape; got {obs.shape} and {pr.shape}")
    if np.any(obs < 0) or not np.all(np.isfinite(obs)):
        raise ValueError("observed must hold finite, non-negative counts")
    if np.any(pr < 0) or not np.all(np.isfinite(pr)):
        raise ValueError("probs must hold finite, non-negative probabilities")
    stat, dof = 0.0, 0
    for o, p in zip(obs, pr):
        n = o.sum()
        if n == 0:
            continue
        p = p / p.sum()
        live = p > 0
        if np.any(o[~live] > 0):
            return math.inf, int(live.sum() - 1), 0.0
        e = n * p[live]
        stat += float(((o[live] - e) ** 2 / e).sum())
        dof += int(live.sum() - 1)
    if dof == 0:
        raise ValueError("observed has no row with counts over two or more possible tokens")
    import torch  # only here: the incomplete gamma function

    pval = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, pval
