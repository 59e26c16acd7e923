"""Speculative decoding: how many tokens to draft (seed section 6).

A cycle drafts ``k`` tokens with a cheap model, verifies them with one target forward over
``k + 1`` positions, and commits the accepted prefix plus one token from the target: the recovery
token at the first rejection, or the bonus token when every draft was accepted. The useful rate is

    committed tokens per cycle / time of the whole draft-verify-commit cycle,

so a deeper draft pays only when its extra committed tokens grow faster than its cycle time.

What is here, in the order a reader meets it:

- acceptance curves: per-position *conditional* acceptance ``a[i]`` = P(draft i accepted | drafts
  before it were); constant, geometric decay, and a reference curve fitted to the seed's figures;
- the formula: ``expected_committed`` = sum over j = 0..k of a[0]...a[j-1] (the empty product is the
  recovery/bonus token that every cycle commits);
- two Monte Carlo checks of it: cycle-level (one uniform draw per drafted position) and token-level
  (real rejection sampling between a draft and a target distribution over a small vocabulary, which
  also shows that the committed tokens follow the target distribution);
- a cycle cost model (user-given, illustrative, or built from k3lab's measured verification records)
  and ``best_depth``, which picks the depth with the most committed tokens per second and tabulates
  the break-even cycle growth for each extra draft.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "constant_acceptance",
    "geometric_acceptance",
    "fit_geometric_acceptance",
    "reference_acceptance",
    "REFERENCE_COMMITTED",
    "expected_committed",
    "expected_committed_all",
    "committed_distribution",
    "break_even_growth",
    "CycleStats",
    "simulate_cycles",
    "simulate_cycles_loop",
    "TokenStats",
    "acceptance_from_distributions",
    "simulate_tokens",
    "chi_square",
    "CycleCosts",
    "linear_costs",
    "illustrative_costs",
    "ILLUSTRATIVE_PROFILES",
    "costs_from_records",
    "verify_records_summary",
    "NoVerifyRecords",
    "VERIFY_STUDIES",
    "DepthChoice",
    "best_depth",
]

# The seed (section 6): AgentX's fixed acceptance reference commits 3.00 tokens per cycle with
# three drafts and 3.36 with four, counting the recovery or bonus token.
REFERENCE_COMMITTED: dict[int, float] = {3: 3.00, 4: 3.36}


# --------------------------------------------------------------------------------------------
# Input checks: every public function validates before computing, naming the bad argument.
# --------------------------------------------------------------------------------------------


def _probabilities(name: str, values) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a sequence of probabilities in [0, 1]; got {values!r}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence of probabilities; got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must not contain NaN or infinity; got {arr.tolist()}")
    if np.any(arr < 0) or np.any(arr > 1):
        raise ValueError(f"{name} must lie in [0, 1]; got {arr.tolist()}")
    return arr


def _probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a probability in [0, 1]; got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or value > 1:
        raise ValueError(f"{name} must be a probability in [0, 1]; got {value!r}")
    return value


def _count(name: str, value, *, low: int = 1, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high} (the length of the acceptance curve or cost table); "
                         f"got {value}")
    return value


def _cost(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a non-negative time in microseconds; got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite, non-negative time in microseconds; got {value!r}")
    return value


# --------------------------------------------------------------------------------------------
# Acceptance curves
# --------------------------------------------------------------------------------------------


def constant_acceptance(rate: float, depth: int) -> np.ndarray:
    """Every drafted position is accepted with the same conditional probability ``rate``."""
    rate = _probability("rate", rate)
    depth = _count("depth", depth)
    return np.full(depth, rate)


def geometric_acceptance(first: float, decay: float, depth: int) -> np.ndarray:
    """a[i] = first * decay**i: later drafts are accepted less often (the drafter drifts further
    from the target the more of its own tokens it conditions on)."""
    first = _probability("first", first)
    decay = _probability("decay", decay)
    depth = _count("depth", depth)
    return first * decay ** np.arange(depth, dtype=np.float64)


def _bisect(f, lo: float, hi: float, iters: int = 200) -> float:
    """Root of an increasing function f on [lo, hi] (f(lo) <= 0 <= f(hi))."""
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_geometric_acceptance(targets: Mapping[int, float] = REFERENCE_COMMITTED) -> tuple[float, float]:
    """(first, decay) of the geometric curve whose expected committed tokens hit two targets.

    ``targets`` maps two depths k1 < k2 to expected committed tokens per cycle. For a fixed decay,
    committed(k1) rises with ``first``, so ``first`` is found by bisection; the outer bisection then
    moves the decay until committed(k2) matches as well.
    """
    if not isinstance(targets, Mapping) or len(targets) != 2:
        raise ValueError(f"targets must map exactly two depths to committed tokens; got {targets!r}")
    (k1, e1), (k2, e2) = sorted((_count("targets depth", k), float(e)) for k, e in targets.items())
    if k1 == k2:
        raise ValueError(f"targets must name two different depths; got {targets!r}")
    if not (1 <= e1 <= k1 + 1 and e1 < e2 <= e1 + (k2 - k1)):
        raise ValueError(f"targets are not reachable by any acceptance curve: {targets!r}")

    def committed(first: float, decay: float, k: int) -> float:
        return float(1.0 + np.cumprod(first * decay ** np.arange(k)).sum())

    def first_for(decay: float) -> float:
        return _bisect(lambda a: committed(a, decay, k1) - e1, 0.0, 1.0)

    # Slower decay (larger `decay`) with committed(k1) held fixed gives a larger committed(k2).
    lo, hi = 1e-6, 1.0
    if committed(first_for(hi), hi, k2) < e2 or committed(first_for(lo), lo, k2) > e2:
        raise ValueError(f"targets need a rising acceptance curve, which a geometric decay cannot give: "
                         f"{targets!r}")
    decay = _bisect(lambda d: committed(first_for(d), d, k2) - e2, lo, hi)
    return first_for(decay), decay


def reference_acceptance(depth: int = 8) -> np.ndarray:
    """A stand-in for AgentX's fixed acceptance reference, ``depth`` positions long.

    AgentX's own curve file is not public here. This is a geometric decay a[i] = first * decay**i
    with its two parameters fitted so that 3 drafts commit 3.00 and 4 drafts commit 3.36 tokens per
    cycle, the two figures the seed quotes (first ~ 0.835, decay ~ 0.951). It reproduces those two
    numbers and nothing else about the real curve: positions beyond the fourth are extrapolation.
    """
    depth = _count("depth", depth)
    first, decay = fit_geometric_acceptance(REFERENCE_COMMITTED)
    return first * decay ** np.arange(depth, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# The formula
# --------------------------------------------------------------------------------------------


def _survival(acceptance: np.ndarray) -> np.ndarray:
    """S[j] = P(the first j drafts are all accepted), j = 0..len; S[0] = 1."""
    return np.concatenate(([1.0], np.cumprod(acceptance)))


def expected_committed_all(acceptance) -> np.ndarray:
    """Expected committed tokens per cycle for every depth k = 1..len(acceptance) (entry k - 1).

    A cycle commits token j + 1 (j = 1..k) exactly when the first j drafts are accepted, and always
    commits one token from the target (recovery or bonus); by linearity of expectation
    E[committed | k] = S[0] + S[1] + ... + S[k] with S[j] = a[0] * ... * a[j-1].
    """
    a = _probabilities("acceptance", acceptance)
    return np.cumsum(_survival(a))[1:]


def expected_committed(acceptance, depth: int) -> float:
    """Expected committed tokens per cycle when drafting ``depth`` tokens (recovery/bonus counted)."""
    a = _probabilities("acceptance", acceptance)
    depth = _count("depth", depth, high=a.size)
    return float(_survival(a[:depth]).sum())


def committed_distribution(acceptance, depth: int) -> np.ndarray:
    """P(a cycle commits c tokens) for c = 1..depth + 1 (entry c - 1).

    c <= depth: the first c - 1 drafts accepted, draft c rejected; c = depth + 1: all accepted.
    """
    a = _probabilities("acceptance", acceptance)
    depth = _count("depth", depth, high=a.size)
    s = _survival(a[:depth])
    return np.concatenate((s[:-1] * (1.0 - a[:depth]), s[-1:]))


def break_even_growth(acceptance) -> np.ndarray:
    """committed(k + 1) / committed(k) - 1 for k = 1..len - 1 (entry k - 1): going from k to k + 1
    drafts raises the rate only if the whole cycle grows by less than this fraction."""
    e = expected_committed_all(acceptance)
    return e[1:] / e[:-1] - 1.0


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
    a = _probabilities("acceptance", acceptance)
    depth = _count("depth", depth, high=a.size)
    cycles = _count("cycles", cycles)
    chunk = _count("chunk", chunk)
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
    a = _probabilities("acceptance", acceptance)
    depth = _count("depth", depth, high=a.size)
    cycles = _count("cycles", cycles)
    chunk = _count("chunk", chunk)
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
    c = _probabilities("context", context)
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
    depth = _count("depth", depth)
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
    depth = _count("depth", depth)
    cycles = _count("cycles", cycles)
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


# --------------------------------------------------------------------------------------------
# Cycle cost model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleCosts:
    """Time of one draft-verify-commit cycle, in microseconds, as a function of the depth k.

    cycle(k) = draft_fixed_us + k * draft_step_us      (the drafter runs k steps in sequence)
             + verify_us[k]                             (one target forward over k + 1 positions)
             + commit_us                                (sampling, cache and KDA-state bookkeeping)

    ``verify_us[n - 1]`` is the target forward over n positions, n = 1..len; n = 1 is plain decode.
    ``source`` says where the numbers come from: user-given, illustrative, or measured (device).
    """

    draft_step_us: float
    verify_us: tuple[float, ...]
    commit_us: float = 0.0
    draft_fixed_us: float = 0.0
    source: str = "user-given"

    def __post_init__(self):
        _cost("draft_step_us", self.draft_step_us)
        _cost("commit_us", self.commit_us)
        _cost("draft_fixed_us", self.draft_fixed_us)
        try:
            verify = tuple(float(v) for v in self.verify_us)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"verify_us must be a sequence of times in microseconds; got "
                             f"{self.verify_us!r}") from exc
        if len(verify) < 2:
            raise ValueError(f"verify_us must give the target forward for n = 1 and at least n = 2 "
                             f"positions; got {self.verify_us!r}")
        for n, v in enumerate(verify, start=1):
            _cost(f"verify_us[{n - 1}] (verification of {n} positions)", v)
        object.__setattr__(self, "verify_us", verify)

    @property
    def max_depth(self) -> int:
        return len(self.verify_us) - 1

    def draft(self, depth: int) -> float:
        depth = _count("depth", depth, high=self.max_depth)
        return self.draft_fixed_us + depth * self.draft_step_us

    def verify(self, positions: int) -> float:
        positions = _count("positions", positions, high=len(self.verify_us))
        return self.verify_us[positions - 1]

    def cycle_us(self, depth: int) -> float:
        depth = _count("depth", depth, high=self.max_depth)
        return self.draft(depth) + self.verify(depth + 1) + self.commit_us

    def cycle_all(self) -> np.ndarray:
        """cycle_us(k) for k = 1..max_depth (entry k - 1)."""
        return np.array([self.cycle_us(k) for k in range(1, self.max_depth + 1)])

    def plain_decode_us(self) -> float:
        """One target forward over one position: the step speculation has to beat."""
        return self.verify_us[0]


def linear_costs(*, draft_step_us: float, verify_one_us: float, verify_extra_position_us: float,
                 commit_us: float = 0.0, draft_fixed_us: float = 0.0, max_depth: int = 8,
                 source: str = "user-given") -> CycleCosts:
    """Costs with verification growing linearly: verify(n) = verify_one_us + (n - 1) * extra.

    Memory-bound verification (few requests: the weights are read once whatever n is) has a small
    ``verify_extra_position_us``; compute-bound verification (many requests) a large one.
    """
    one = _cost("verify_one_us", verify_one_us)
    extra = _cost("verify_extra_position_us", verify_extra_position_us)
    max_depth = _count("max_depth", max_depth)
    verify = tuple(one + extra * (n - 1) for n in range(1, max_depth + 2))
    return CycleCosts(draft_step_us=draft_step_us, verify_us=verify, commit_us=commit_us,
                      draft_fixed_us=draft_fixed_us, source=source)


# Illustrative profiles: made-up but plausible proportions (a target step of 10 ms, a drafter
# step of a few percent of it), chosen to show how the best depth moves. Not measurements.
ILLUSTRATIVE_PROFILES: dict[str, dict[str, float]] = {
    "memory-bound verify (few requests)": dict(draft_step_us=400.0, verify_one_us=10_000.0,
                                               verify_extra_position_us=150.0, commit_us=150.0),
    "compute-bound verify (many requests)": dict(draft_step_us=400.0, verify_one_us=10_000.0,
                                                 verify_extra_position_us=1_600.0, commit_us=150.0),
    "slow drafter": dict(draft_step_us=1_500.0, verify_one_us=10_000.0,
                         verify_extra_position_us=300.0, commit_us=150.0),
}


def illustrative_costs(name: str = "memory-bound verify (few requests)", max_depth: int = 8) -> CycleCosts:
    """One of ``ILLUSTRATIVE_PROFILES``, labelled as illustrative (not measured)."""
    if name not in ILLUSTRATIVE_PROFILES:
        raise ValueError(f"name must be one of {sorted(ILLUSTRATIVE_PROFILES)}; got {name!r}")
    return linear_costs(**ILLUSTRATIVE_PROFILES[name], max_depth=max_depth,
                        source=f"illustrative ({name}): chosen numbers, not measured")


# --------------------------------------------------------------------------------------------
# Best depth
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DepthChoice:
    """The depth with the most committed tokens per second, and the table it was read from."""

    depth: int
    tokens_per_s: float
    table: object  # pandas.DataFrame, one row per depth
    source: str

    def __str__(self) -> str:
        return (f"best depth {self.depth}: {self.tokens_per_s:,.0f} committed tokens/s per sequence "
                f"(costs: {self.source})")


def best_depth(acceptance, costs: CycleCosts | Sequence[float], *, max_depth: int | None = None) -> DepthChoice:
    """The draft depth that maximises committed tokens per second.

    ``costs`` is a ``CycleCosts`` or a sequence of whole-cycle times in microseconds for depths
    1..n. The table has, per depth k: expected committed tokens, cycle time, committed tokens per
    second, ``break_even_growth`` (committed(k + 1) / committed(k) - 1: how much longer the cycle
    of k + 1 drafts may take before it stops paying), the actual ``cycle_growth`` and whether the
    next depth pays; with a ``CycleCosts``, also the speed-up over plain decode.
    """
    import pandas as pd  # only here: the rest of the module needs numpy alone

    a = _probabilities("acceptance", acceptance)
    if isinstance(costs, CycleCosts):
        cycle = costs.cycle_all()
        source = costs.source
        plain = costs.plain_decode_us()
    else:
        try:
            cycle = np.array([float(c) for c in costs])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"costs must be CycleCosts or a sequence of cycle times (us); got {costs!r}") from exc
        if cycle.size == 0:
            raise ValueError("costs must give the cycle time of at least depth 1")
        for k, c in enumerate(cycle, start=1):
            _cost(f"costs[{k - 1}] (cycle time at depth {k})", c)
        source, plain = "user-given cycle times", None
    if np.any(cycle <= 0):
        raise ValueError(f"costs must give a positive cycle time at every depth; got {cycle.tolist()}")
    limit = min(a.size, cycle.size)
    n = limit if max_depth is None else _count("max_depth", max_depth, high=limit)

    committed = expected_committed_all(a[:n])
    cycle = cycle[:n]
    rate = committed / cycle * 1e6
    gain = np.append(committed[1:] / committed[:-1] - 1.0, np.nan)
    growth = np.append(cycle[1:] / cycle[:-1] - 1.0, np.nan)
    table = pd.DataFrame({
        "depth": np.arange(1, n + 1),
        "committed": committed,
        "cycle_us": cycle,
        "tokens_per_s": rate,
        "break_even_growth": gain,
        "cycle_growth": growth,
        "deeper_pays": np.append(growth[:-1] < gain[:-1], False),
    })
    if plain is not None:
        table["speedup_vs_plain"] = rate / (1e6 / plain)
    best = int(np.argmax(rate))
    return DepthChoice(depth=best + 1, tokens_per_s=float(rate[best]), table=table, source=source)


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------

# Study names and shape keys of k3lab's verification records (k3lab.studies.kda_verify and
# k3lab.studies.mla_padding). A record's shape names the positions verified per sequence.
VERIFY_STUDIES: dict[str, str] = {"kda": "kda_verify", "mla": "mla_padding"}
_POSITION_KEYS = ("T", "q_len", "Tq", "positions", "tokens")
_BATCH_KEYS = ("B", "batch")


class NoVerifyRecords(LookupError):
    """k3lab has no usable measured verification records for the asked device (none yet, or none
    covering 1 and 2 positions): use user-given or illustrative costs, and say so."""


def _shape_value(shape: dict, keys: Sequence[str]):
    for key in keys:
        if key in shape:
            return shape[key]
    return None


def _per_position_table(records, variant: str, batch: int, where: Mapping | None = None):
    """positions -> median us of one layer, from the records of one study on one device.

    Graph-replay timings are preferred (the cost of a kernel inside the served graph); eager ones
    are used only when the study recorded no graph timing. ``where`` keeps only records whose shape
    has those values (e.g. {"L": 32768} for one MLA context length). Returns (table, mode,
    ambiguous): ``ambiguous`` names the other shape keys that still take several values at one
    position count (two context lengths, say), which a median would silently mix."""
    where = dict(where or {})
    # a case name with a '.' is a sweep or ablation point of its case (b1_t4.narrow8_w1), not the
    # case as the library runs it: those would skew the median
    picked = [r for r in records if "." not in r.case and r.variant == variant
              and _shape_value(r.shape, _BATCH_KEYS) in (batch, None)
              and _shape_value(r.shape, _POSITION_KEYS) is not None
              and all(r.shape.get(k, v) == v for k, v in where.items())]
    modes = {r.mode for r in picked}
    mode = "graph" if "graph" in modes else ("eager" if "eager" in modes else next(iter(modes), ""))
    table: dict[int, list[float]] = {}
    seen: dict[int, dict[str, set]] = {}
    for r in picked:
        if r.mode != mode:
            continue
        n = int(_shape_value(r.shape, _POSITION_KEYS))
        table.setdefault(n, []).append(float(r.median_us))
        for key, value in r.shape.items():
            if key not in _POSITION_KEYS and key not in _BATCH_KEYS:
                seen.setdefault(n, {}).setdefault(key, set()).add(repr(value))
    ambiguous = sorted({key for per_n in seen.values() for key, values in per_n.items() if len(values) > 1})
    return {n: float(np.median(v)) for n, v in sorted(table.items())}, mode, ambiguous


def verify_records_summary(device: str | None = None, root=None, *, variant: str = "after",
                           batch: int = 1, where: Mapping[str, Mapping] | None = None) -> dict[str, dict]:
    """What k3lab has measured for verification: {device slug: {'device': name, 'kda': {positions:
    us}, 'mla': {...}, 'modes': {...}, 'ambiguous': {...}}}; ``where`` = {'kda': {...}, 'mla': {...}}
    filters shapes per part. Empty when no records exist (nothing has been run on a GPU yet)."""
    from k3lab import bench

    where = dict(where or {})
    unknown = set(where) - set(VERIFY_STUDIES)
    if unknown:
        raise ValueError(f"where must map parts among {sorted(VERIFY_STUDIES)} to shape values; got {sorted(unknown)}")
    out: dict[str, dict] = {}
    for study in VERIFY_STUDIES.values():
        for r in bench.load_records(study=study, device=device, root=root):
            out.setdefault(bench.device_slug(r.device, r.backend), {"device": r.device})
    for slug, entry in out.items():
        entry["modes"], entry["ambiguous"] = {}, {}
        for part, study in VERIFY_STUDIES.items():
            recs = bench.load_records(study=study, device=slug, root=root)
            entry[part], entry["modes"][part], entry["ambiguous"][part] = _per_position_table(
                recs, variant, batch, where.get(part))
    return out


def costs_from_records(*, draft_step_us: float, commit_us: float = 0.0, rest_one_us: float = 0.0,
                       rest_extra_position_us: float = 0.0, device: str | None = None, root=None,
                       variant: str = "after", batch: int = 1, kda_layers: int | None = None,
                       mla_layers: int | None = None, draft_fixed_us: float = 0.0,
                       where: Mapping[str, Mapping] | None = None) -> CycleCosts:
    """Cycle costs whose verification part comes from k3lab's measured kernel records.

    verify(n) = kda_layers * KDA verification of n positions (study kda_verify)
              + mla_layers * MLA decode with q_len = n (study mla_padding)
              + rest_one_us + (n - 1) * rest_extra_position_us   (the rest of the forward: MoE,
                projections, norms, collectives; not measured here, so user-given)

    One layer's records are per GPU at the shapes the studies ran (the TP8 slice on a GPU); layer
    counts default to K3's 69 KDA and 24 MLA layers. Between measured position counts the time is
    interpolated linearly; outside them nothing is invented: the depth stops at the last position
    count both studies measured. Raises NoVerifyRecords when no device has records covering one and
    two positions (the message says what exists), or whose records mix shapes at one position
    count (two MLA context lengths, say): pick one with ``where={"mla": {"L": 32768}}``. The
    returned ``source`` names the device.
    """
    from k3lab import bench as _bench

    from k3lab.config import K3Config

    full = K3Config.full()
    kda_layers = full.num_kda_layers if kda_layers is None else _count("kda_layers", kda_layers, low=0)
    mla_layers = full.num_mla_layers if mla_layers is None else _count("mla_layers", mla_layers, low=0)
    rest_one = _cost("rest_one_us", rest_one_us)
    rest_extra = _cost("rest_extra_position_us", rest_extra_position_us)
    _cost("draft_step_us", draft_step_us)
    _cost("commit_us", commit_us)
    batch = _count("batch", batch)

    found = verify_records_summary(device=device, root=root, variant=variant, batch=batch, where=where)
    usable = {}
    for slug, entry in found.items():
        kda, mla = entry["kda"], entry["mla"]
        if kda_layers and not kda or mla_layers and not mla:
            continue
        if any(entry["ambiguous"][part] for part, layers in (("kda", kda_layers), ("mla", mla_layers)) if layers):
            continue
        tables = [t for t, layers in ((kda, kda_layers), (mla, mla_layers)) if layers]
        lo = max(min(t) for t in tables)
        hi = min(max(t) for t in tables)
        if lo == 1 and hi >= 2:
            usable[slug] = (entry, hi)
    if not usable:
        place = f"device {device!r}" if device else "any device"
        have = {slug: {part: sorted(e[part]) for part in VERIFY_STUDIES} for slug, e in found.items()}
        mixed = {slug: {p: k for p, k in e["ambiguous"].items() if k} for slug, e in found.items()
                 if any(e["ambiguous"].values())}
        raise NoVerifyRecords(
            f"no measured verification records for {place} under {root or _bench.PROFILES}/ (variant {variant!r}, batch "
            f"{batch}) cover 1 and 2 positions in both {VERIFY_STUDIES['kda']} and {VERIFY_STUDIES['mla']}; "
            f"measured position counts found: {have or 'none'}"
            + (f"; records mixing several values of {mixed} at one position count: choose one with where=" if mixed
               else "")
            + ". Use linear_costs(...) or illustrative_costs(...) and label them as such.")
    slug = min(usable, key=lambda s: (s == "cpu", s))  # a GPU's records before a CPU's
    entry, hi = usable[slug]

    def per_layer(table: dict[int, float], n: int) -> float:
        xs = np.array(sorted(table), dtype=np.float64)
        return float(np.interp(n, xs, [table[int(x)] for x in xs]))

    verify = []
    for n in range(1, hi + 1):
        t = rest_one + rest_extra * (n - 1)
        if kda_layers:
            t += kda_layers * per_layer(entry["kda"], n)
        if mla_layers:
            t += mla_layers * per_layer(entry["mla"], n)
        verify.append(t)
    parts = []
    if kda_layers:
        parts.append(f"{kda_layers} x KDA verify ({entry['modes']['kda']}, n = {sorted(entry['kda'])})")
    if mla_layers:
        parts.append(f"{mla_layers} x MLA q_len = n ({entry['modes']['mla']}, n = {sorted(entry['mla'])})")
    chosen = f", shapes {dict(where)}" if where else ""
    source = (f"measured on {entry['device']} (k3lab records, variant {variant!r}, batch {batch}{chosen}): "
              + " + ".join(parts) + f"; rest of the forward {rest_one:g} us + {rest_extra:g} us per extra "
              f"position and drafter {draft_step_us:g} us per token: user-given")
    return CycleCosts(draft_step_us=draft_step_us, verify_us=tuple(verify), commit_us=commit_us,
                      draft_fixed_us=draft_fixed_us, source=source)
