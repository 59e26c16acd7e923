"""The per-rank decode step time as a sum of its parts, fitted to measured whole-step records.

    t_us = fixed + k_weights * weight_bytes / bw + k_history * history_bytes / bw
                 + k_waves * history_of_one_sequence * waves / bw + k_state * state_bytes / bw

`bw` is the copy bandwidth measured in the run (TB/s, so bytes / (bw * 1e6) is microseconds at the floor);
each k says how far above its bytes floor that part runs, `fixed` holds the launches and the rest that does
not grow with the batch. The bytes are the decode_step study's parts (`extra['bytes']` of a record):
weights read once (the routed experts: the distinct ones the batch's tokens choose, `distinct_experts`),
the MLA history, the KDA states and conv histories.

Why each column:
- history_waves: a decode that gives one program to each (sequence, position, head) and walks that
  sequence's whole history in it (the unpadded MLA decode) takes one history-walk per wave of programs,
  `waves` = ceil(programs / compute units), whatever the batch's total bytes;
- state: KDA states are read and written once per sequence, and at one position per sequence a
  per-token column (activations, router, the grouped experts' rows) is this column again, so it holds both;
- the routed experts' bytes: a step reads the distinct experts its tokens chose. The measured steps use
  random router weights, whose choices are correlated: they pick from a smaller effective pool of
  experts than uniform routing would (`routing_pool`, solved from a step that counted the experts it read).
  The fit uses the bytes the measured steps read; the served step (k3lab.serving.node) uses uniform
  routing over all experts, as a balanced trained router would.

Why two forms: the full form needs steps that differ in batch and in context separately; with only a few
whole-step cases (three contexts at B = 1 and one point at B = 64) three numbers can be told apart, so
`fit` uses the reduced form (k_state = k_weights, no waves term) until a grid of at least three batches
and three contexts exists. Coefficients are non-negative (a part cannot make the step faster); the fit
is least squares on relative error, so short and long steps count alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3lab.ops import int_arg

FULL = ("fixed", "weights", "history", "history_waves", "state")
REDUCED = ("fixed", "weights+state", "history")


@dataclass(frozen=True)
class StepPoint:
    """One measured step: variant, batch, context, tokens (batch x q_len), its bytes parts (keys
    weights_dense, weights_experts, mla_cache, kda_state, kda_conv), the bandwidth (TB/s), the time (us),
    the record it came from and the waves of a one-program-per-(token, head) decode (`waves`)."""

    variant: str
    batch: int
    context: int
    tokens: int
    parts: dict
    bandwidth_tbs: float
    us: float
    source: str = ""
    waves: int = 1


def waves(tokens: int, heads: int, units: int) -> int:
    """ceil(tokens x heads / units): the waves of a kernel with one program per (token, head) on a GPU of
    `units` compute units at one program per unit. ValueError for an argument that is not an int > 0."""
    tokens, heads, units = (int_arg(n, v, low=1) for n, v in (("tokens", tokens), ("heads", heads),
                                                             ("units", units)))
    return -(-tokens * heads // units)


def distinct_experts(tokens: float, pool: float, per_token: int) -> float:
    """Expected distinct experts per MoE layer when `tokens` tokens each choose `per_token` of `pool`
    experts independently and uniformly: pool x (1 - (1 - per_token / pool) ** tokens)."""
    if not pool >= per_token > 0:
        raise ValueError(f"pool must be >= per_token > 0, got pool={pool!r}, per_token={per_token!r}")
    if not 0 <= tokens < np.inf:
        raise ValueError(f"tokens must be a finite count >= 0, got {tokens!r}")
    return pool * (1.0 - (1.0 - per_token / pool) ** tokens)


def routing_pool(read_per_layer: float, tokens: int, per_token: int, experts: int) -> float:
    """The effective pool of experts uniform routing would need to read `read_per_layer` distinct experts
    on average for `tokens` tokens (bisection on `distinct_experts`, between per_token and `experts`).
    ValueError when the count is not between per_token and what uniform routing over `experts` reads."""
    top = distinct_experts(tokens, experts, per_token)
    if tokens < 2 or not per_token < read_per_layer <= top + 1e-9:
        raise ValueError(f"read_per_layer must lie in ({per_token}, {top:.1f}] for {tokens} tokens, got "
                         f"{read_per_layer!r} (tokens must be >= 2)")
    lo, hi = float(per_token), float(experts)
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if distinct_experts(tokens, mid, per_token) < read_per_layer else (lo, mid)
    return 0.5 * (lo + hi)


def features(
    parts: dict,
    tokens: float,
    bandwidth_tbs: float,
    form: tuple[str, ...] = FULL,
    batch: int = 1,
    waves: int = 1,
) -> np.ndarray:
    """The model's columns for one step: 1, each bytes part over the bandwidth (us), the history of one
    sequence times `waves` over the bandwidth (the unpadded MLA decode: module docstring), and the
    tokens."""
    if not bandwidth_tbs > 0:
        raise ValueError(f"bandwidth_tbs must be > 0, got {bandwidth_tbs!r}")
    us = 1.0 / (bandwidth_tbs * 1e6)
    w = (parts["weights_dense"] + parts["weights_experts"]) * us
    s = (parts["kda_state"] + parts["kda_conv"]) * us
    m = parts["mla_cache"] * us
    cols = {
        "fixed": 1.0,
        "weights": w,
        "history": m,
        "history_waves": m / batch * waves,
        "state": s,
        "tokens": float(tokens),
        "weights+state": w + s,
    }
    return np.array([cols[name] for name in form])


@dataclass(frozen=True)
class StepFit:
    """A fitted variant: `coef` per name of `form`, the points it was fitted to and held out."""

    variant: str
    form: tuple[str, ...]
    coef: dict
    fitted: tuple = ()
    held_out: tuple = ()
    notes: list = field(default_factory=list)

    def terms(
        self, parts: dict, tokens: float, bandwidth_tbs: float, batch: int = 1, waves: int = 1
    ) -> dict[str, float]:
        """Microseconds per part of the step (the model's sum, term by term)."""
        x = features(parts, tokens, bandwidth_tbs, self.form, batch, waves)
        return {name: float(self.coef[name] * v) for name, v in zip(self.form, x)}

    def predict(
        self, parts: dict, tokens: float, bandwidth_tbs: float, batch: int = 1, waves: int = 1
    ) -> float:
        return sum(self.terms(parts, tokens, bandwidth_tbs, batch, waves).values())

    def predict_point(self, p: StepPoint) -> float:
        """The predicted time (us) of a measured step."""
        return self.predict(p.parts, p.tokens, p.bandwidth_tbs, p.batch, p.waves)


def _nnls_rel(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    from k3lab.serving.nnls import nnls  # numpy's own (Lawson-Hanson): no scipy needed

    return nnls(X / y[:, None], np.ones_like(y))[0]


def choose_form(points: list[StepPoint]) -> tuple[str, ...]:
    """FULL when the points span at least three batches and three contexts, else REDUCED."""
    return FULL if len({p.batch for p in points}) >= 3 and len({p.context for p in points}) >= 3 else REDUCED


def held_out_of(points: list[StepPoint], every: int = 4) -> list[StepPoint]:
    """The held-out points: every `every`-th measured shape (batch, context) in sorted order, starting from
    the second, with every point measured at that shape (a grid record and a decode_step record of one
    shape are two measurements of one step, so both leave the fit: the held-out shapes are disjoint from
    the fitted ones). A shape is held out only while the rest still determine the form's coefficients
    (full column rank) and outnumber them."""
    shapes = sorted({(p.batch, p.context) for p in points})
    out: list[StepPoint] = []
    for i in range(1, len(shapes), every):
        at = [p for p in points if (p.batch, p.context) == shapes[i]]
        gone = {id(p) for p in out + at}
        rest = [p for p in points if id(p) not in gone]
        if not rest:
            continue
        form = choose_form(rest)
        X = np.array([features(p.parts, p.tokens, p.bandwidth_tbs, form, p.batch, p.waves) for p in rest])
        if len(rest) >= len(form) and np.linalg.matrix_rank(X / np.abs(X).max(axis=0).clip(1e-30)) == len(
            form
        ):
            out += at
    return out


def fit(points: list[StepPoint], held_out: list[StepPoint] | None = None) -> StepFit:
    """Fit one variant's points (all of one variant), leaving `held_out` out (default: `held_out_of`).
    ValueError when the points are of several variants or too few to fit."""
    if not points:
        raise ValueError("points must hold at least one measured step")
    variants = {p.variant for p in points}
    if len(variants) != 1:
        raise ValueError(f"points must be of one variant, got {sorted(variants)}")
    held = held_out_of(points) if held_out is None else list(held_out)
    train = [p for p in points if p not in held]
    form = choose_form(train)
    if len(train) < len(form) - 1:
        raise ValueError(f"{len(train)} points cannot fit the {len(form)} coefficients of {form}")
    X = np.array([features(p.parts, p.tokens, p.bandwidth_tbs, form, p.batch, p.waves) for p in train])
    y = np.array([p.us for p in train])
    coef = _nnls_rel(X, y)
    notes = (
        []
        if form == FULL
        else [
            f"reduced form: {len(train)} points over {len({p.batch for p in train})} batches and "
            f"{len({p.context for p in train})} contexts cannot tell the state, weights and per-token terms "
            "apart"
        ]
    )
    return StepFit(variants.pop(), form, dict(zip(form, map(float, coef))), tuple(train), tuple(held), notes)


def validation(fits: dict[str, StepFit]) -> list[dict]:
    """One row per held-out point of every fit: variant, batch, context, measured and predicted ms,
    rel_err (predicted / measured - 1) and the record."""
    rows = []
    for name, f in fits.items():
        for p in f.held_out:
            pred = f.predict_point(p)
            rows.append(
                {
                    "variant": name,
                    "batch": p.batch,
                    "context": p.context,
                    "measured_ms": p.us / 1e3,
                    "predicted_ms": pred / 1e3,
                    "rel_err": pred / p.us - 1.0,
                    "source": p.source,
                }
            )
    return rows


def residuals(f: StepFit) -> list[dict]:
    """The fitted points' rel_err (how closely the form can follow what it was fitted to)."""
    return [
        {
            "variant": f.variant,
            "batch": p.batch,
            "context": p.context,
            "measured_ms": p.us / 1e3,
            "rel_err": f.predict_point(p) / p.us - 1.0,
        }
        for p in f.fitted
    ]
