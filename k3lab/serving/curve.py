"""The serving curve: tokens/s/GPU against tokens/s/user (P90) for a node configuration, each optimization
added in the article's order (`RUNGS`), the value at an interactivity target, and each rung's share.

A configuration is (rung, GPU, DCP degree, draft depth, concurrency). For one, over an agent workload
(`Workload`: request input and output tokens, theoretical prefix reuse):

    cycle        one draft-verify step of the batch: depth x drafter + the verify step over depth + 1
                 positions (node.rank_step_us and node.verify_extra_us); depth 0 is plain decode
    R0           committed tokens per cycle (k3lab.speculative, the acceptance curve) / cycle time
    prefill      the uncached input of a request (input x (1 - hit rate), node.hits) x
                 node.prefill_us_per_token; it stalls the decode batch
    restore      the hits served from the host tier (node.hits), copied back over the GPU's host link
                 (node.restore_gb / GPU.host_gbs): the request waits for it (TTFT = restore + prefill),
                 the batch does not (a copy engine moves it); where the restores of the requests the
                 configuration serves per second would keep the link busy more than all the time, the
                 hits it cannot move are recomputed (prefilled) instead
    per user     R0 / (1 + C x R0 x prefill / output): the decode rate left after the prefills that the
                 batch's requests bring (C concurrent, each `output` tokens long)
    per GPU      C x per-user / output x (input + output) / 8: total tokens, input and output, as AgentX
                 counts them
    P90          the per-user rate that 90% of batches reach, over batches drawn from the workload's
                 request contexts (weighted by output tokens: a long answer stays in the batch longer)

The curve of a rung is the Pareto front (`front`) over every configuration that rung allows and whose
caches fit (node.max_concurrency).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from k3lab.ops import int_arg

from . import node
from .hardware import GPU, SEED

CONCURRENCY = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256)
DRAFT_LAYERS = 1  # the drafter as one layer of the target (modelled: K3's MTP-style drafter)
MAX_DEPTH = 7


@dataclass(frozen=True)
class Rung:
    """The optimizations on at one step of the article's order: step switches off, DCP degrees allowed,
    host tier (GB), MoE rows loaded only where owned, KDA chunk scan and verification tiles, depths."""

    name: str
    section: str
    off: frozenset
    dcp: tuple = (1,)
    host_gb: float = 0.0
    moe_rows_only: bool = False
    kda_scan: bool = False
    depths: tuple = (0,)


def _rungs() -> tuple[Rung, ...]:
    all_off = frozenset(node.SWITCH_ORDER)
    steps = [
        ("all off", "the article's befores", {}),
        ("+ DCP8", "1", {"dcp": (1, 8)}),
        ("+ CPU offload", "1", {"host_gb": SEED["host_cache_gb"]}),
        ("+ MoE output sharding", "2", {"off": {"moe_tail_sharded"}, "moe_rows_only": True}),
        ("+ copies and fusion", "3", {"off": {"kda_fused", "attn_res_fused", "pack_where_used"}}),
        ("+ MLA head padding", "4", {"off": {"mla_padded"}}),
        ("+ KDA scan and verify tiles", "5", {"kda_scan": True}),
        ("+ draft depth", "6", {"depths": tuple(range(MAX_DEPTH + 1))}),
        ("+ k3lab's fused glue (all on)", "not in the seed", {"off": {"glue_fused"}}),
    ]
    out, cur = (
        [],
        {
            "off": set(all_off),
            "dcp": (1,),
            "host_gb": 0.0,
            "moe_rows_only": False,
            "kda_scan": False,
            "depths": (0,),
        },
    )
    for name, section, change in steps:
        for key, value in change.items():
            cur[key] = cur[key] - value if key == "off" else value
        out.append(
            Rung(
                name,
                section,
                frozenset(cur["off"]),
                cur["dcp"],
                cur["host_gb"],
                cur["moe_rows_only"],
                cur["kda_scan"],
                cur["depths"],
            )
        )
    return tuple(out)


RUNGS = _rungs()


@dataclass(frozen=True)
class Workload:
    """Per request: input and output tokens; the theoretical prefix reuse; where it came from."""

    in_tokens: np.ndarray
    out_tokens: np.ndarray
    reuse: float
    source: str

    @property
    def mean_in(self) -> float:
        return float(self.in_tokens.mean())

    @property
    def mean_out(self) -> float:
        return float(self.out_tokens.mean())

    def scaled(self, context: float) -> Workload:
        """The same requests with every input `context` times as long (the what-if's context mix)."""
        if not context > 0:
            raise ValueError(f"context must be > 0, got {context!r}")
        return Workload(self.in_tokens * context, self.out_tokens, self.reuse,
                        f"{self.source}, inputs x {context:g}" if context != 1 else self.source)


@functools.lru_cache(maxsize=4)
def agent_workload(sessions: int = 40, seed: int = 42) -> Workload:
    """AgentX-like requests from k3lab.cache's generator (notebook 07), their reuse by an unbounded cache."""
    from k3lab.cache.generate import generate

    w = generate(sessions, seed=seed)
    return Workload(
        w.in_tokens.astype(float),
        w.out_tokens.astype(float),
        w.theoretical_reuse(),
        f"k3lab.cache.generate({sessions} sessions, seed {seed}): AgentX-like, not the dataset",
    )


@dataclass(frozen=True)
class Scenario:
    """What-if knobs over the model (defaults: the model as it stands). `hit_rate` replaces the modelled
    prefix-cache hit rate; `acceptance` scales the reference acceptance of every drafted position
    (clipped to 1); `step_scale` multiplies every cycle (a serving stack's host work per step over this
    model's graph-replayed step); `max_depth` caps the draft depth."""

    hit_rate: float | None = None
    acceptance: float = 1.0
    step_scale: float = 1.0
    max_depth: int = MAX_DEPTH

    def __post_init__(self):
        if self.hit_rate is not None and not 0 <= self.hit_rate <= 1:
            raise ValueError(f"hit_rate must be in [0, 1] or None, got {self.hit_rate!r}")
        if not (self.acceptance > 0 and self.step_scale > 0):
            raise ValueError(f"acceptance and step_scale must be > 0, got {self.acceptance!r}, "
                             f"{self.step_scale!r}")
        if not 0 <= self.max_depth <= MAX_DEPTH:
            raise ValueError(f"max_depth must be in [0, {MAX_DEPTH}], got {self.max_depth!r}")


MODEL = Scenario()


@functools.lru_cache(maxsize=16)
def _committed_all(acceptance: float = 1.0) -> tuple[float, ...]:
    from k3lab import speculative

    a = np.minimum(1.0, speculative.reference_acceptance(MAX_DEPTH) * acceptance)
    return (1.0, *map(float, speculative.expected_committed_all(a)))


def committed(depth: int, acceptance: float = 1.0) -> float:
    """Expected committed tokens per cycle at `depth` drafts (1 at depth 0): k3lab.speculative's reference
    acceptance curve (fitted to the seed's 3.00 and 3.36 tokens at three and four drafts), each
    position's acceptance times `acceptance` (clipped to 1)."""
    return _committed_all(float(acceptance))[int_arg("depth", depth, high=MAX_DEPTH)]


def cycle_us(
    inp: node.Inputs, rung: Rung, g: GPU, dcp: int, depth: int, batch: int, context_sum: float
) -> dict:
    """One cycle's parts (us): the verify (or decode) step term by term, the verification extras, the
    drafter."""
    terms = node.rank_step_us(
        inp, rung.off, batch, context_sum, batch * (depth + 1), dcp=dcp, g=g, q_len=depth + 1
    )
    if depth:
        terms["verify extra positions"] = node.verify_extra_us(inp, depth + 1, batch, rung.kda_scan)
        one = sum(node.rank_step_us(inp, rung.off, batch, context_sum, batch, dcp=dcp, g=g).values())
        terms["drafter"] = depth * one * DRAFT_LAYERS / node.tp_config().num_hidden_layers
    return terms


def evaluate(
    inp: node.Inputs,
    rung: Rung,
    g: GPU,
    *,
    dcp: int,
    depth: int,
    concurrency: int,
    work: Workload,
    memory_gb: float | None = None,
    draws: int = 48,
    seed: int = 0,
    scenario: Scenario = MODEL,
) -> dict | None:
    """The rates of one configuration (module docstring), or None when its caches do not fit; `scenario`
    applies the what-if knobs (Scenario)."""
    C = concurrency
    ctx = work.mean_in + work.mean_out / 2
    if C > node.max_concurrency(ctx, g, dcp=dcp, moe_rows_only=rung.moe_rows_only, memory_gb=memory_gb):
        return None
    terms = cycle_us(inp, rung, g, dcp, depth, C, C * ctx)
    if scenario.step_scale != 1.0:
        terms["serving stack (step_scale)"] = (scenario.step_scale - 1.0) * sum(terms.values())
    t = sum(terms.values())
    hist = sum(v for k, v in terms.items() if k in ("history", "history_waves", "off: mla_padded"))
    rng = np.random.default_rng(seed)
    p = work.out_tokens / work.out_tokens.sum()
    sums = rng.choice(work.in_tokens, size=(draws, C), p=p).sum(axis=1) + C * work.mean_out / 2
    t_draws = t + hist * (sums / (C * ctx) - 1.0)
    hit, host_hit = node.hits(
        work.reuse,
        C,
        ctx,
        g,
        dcp=dcp,
        host_gb=rung.host_gb,
        moe_rows_only=rung.moe_rows_only,
        memory_gb=memory_gb,
    )
    if scenario.hit_rate is not None:  # the what-if's rate, split between HBM and host as the model's
        host_hit = scenario.hit_rate * host_hit / hit if hit > 0 else 0.0
        hit = scenario.hit_rate
    pf_us = node.prefill_us_per_token(inp, ctx, g, rung.kda_scan)
    e = committed(depth, scenario.acceptance)

    def rates(hit, host_hit):
        prefill_s = work.mean_in * (1 - hit) * pf_us * 1e-6
        restore_s = node.restore_gb(work.mean_in, hit, host_hit, dcp=dcp) / g.host_gbs

        def per_user(t_us):
            r0 = e / (np.asarray(t_us) * 1e-6)
            return r0 / (1.0 + C * r0 * prefill_s / work.mean_out)

        mean = float(per_user(t))
        return prefill_s, restore_s, per_user, mean, C * mean / work.mean_out * restore_s

    prefill_s, restore_s, per_user, mean, busy = rates(hit, host_hit)
    if busy > 1.0:  # the host link cannot carry every restore: the hits it cannot move are recomputed
        cut = host_hit * (1.0 - 1.0 / busy)
        hit, host_hit = hit - cut, host_hit - cut
        prefill_s, restore_s, per_user, mean, busy = rates(hit, host_hit)
    return {
        "rung": rung.name,
        "gpu": g.key,
        "dcp": dcp,
        "depth": depth,
        "concurrency": C,
        "tokens_per_s_user": float(np.percentile(per_user(t_draws), 10)),
        "tokens_per_s_user_mean": mean,
        "tokens_per_s_gpu": C * mean / work.mean_out * (work.mean_in + work.mean_out) / node.TP,
        "cycle_ms": t / 1e3,
        "committed": e,
        "hit_rate": hit,
        "host_hit_rate": host_hit,
        "prefill_s": prefill_s,
        "restore_s": restore_s,
        "host_link_busy": busy,
        "terms_us": terms,
    }


def candidates(
    inp, rung: Rung, g: GPU, work: Workload, *, memory_gb=None, dcp=None, depths=None, scenario=MODEL
) -> list[dict]:
    """Every configuration the rung allows (DCP degrees, depths up to scenario.max_depth, CONCURRENCY)
    that fits."""
    out = []
    for d in rung.dcp if dcp is None else dcp:
        for k in rung.depths if depths is None else depths:
            if k > scenario.max_depth:
                continue
            for C in CONCURRENCY:
                r = evaluate(inp, rung, g, dcp=d, depth=k, concurrency=C, work=work, memory_gb=memory_gb,
                             scenario=scenario)
                if r is None:
                    break
                out.append(r)
    return out


def front(points: list[dict]) -> list[dict]:
    """The Pareto front: points no other point beats in both tokens/s/user and tokens/s/GPU, by
    rising tokens/s/user."""
    pts = sorted(points, key=lambda r: (-r["tokens_per_s_user"], -r["tokens_per_s_gpu"]))
    out, best = [], -1.0
    for r in pts:
        if r["tokens_per_s_gpu"] > best:
            out.append(r)
            best = r["tokens_per_s_gpu"]
    return out[::-1]


def at_interactivity(fr: list[dict], target: float = SEED["interactivity"]) -> float:
    """tokens/s/GPU of the front at `target` tokens/s/user: the best point at or above it (0 when none
    reaches it), as a served system would run the configuration that meets the target."""
    ok = [r["tokens_per_s_gpu"] for r in fr if r["tokens_per_s_user"] >= target]
    return max(ok) if ok else 0.0


def ladder(
    inp, g: GPU, work: Workload, *, memory_gb=None, target: float = SEED["interactivity"], scenario=MODEL
) -> list[dict]:
    """Per rung: its front, the tokens/s/GPU at `target`, the gain over the rung before (its share), and
    `kind`: 'modelled' on the H200 whose steps the model is fitted to, 'projected' on any other GPU."""
    rows, prev = [], 0.0
    kind = "modelled" if g.key == "h200" else "projected"
    for rung in RUNGS:
        fr = front(candidates(inp, rung, g, work, memory_gb=memory_gb, scenario=scenario))
        v = at_interactivity(fr, target)
        best = max(
            (r for r in fr if r["tokens_per_s_user"] >= target),
            key=lambda r: r["tokens_per_s_gpu"],
            default=None,
        )
        rows.append(
            {
                "rung": rung.name,
                "section": rung.section,
                "kind": kind,
                "front": fr,
                "at_target": v,
                "gain": v - prev,
                "config": {k: best[k] for k in ("dcp", "depth", "concurrency")} if best else None,
            }
        )
        prev = v
    return rows


def reachable_target(rows: list[dict]) -> float:
    """The highest tokens/s/user every rung's front reaches (the lowest of the rungs' best per-user rates,
    rounded down to a whole number): a target at which every rung has a share."""
    return float(np.floor(min(max(p["tokens_per_s_user"] for p in r["front"]) for r in rows)))


def shares_at(rows: list[dict], target: float) -> list[dict]:
    """Per rung of a `ladder`: tokens/s/GPU of its front at `target` and the gain over the rung before,
    read from the fronts already computed, with the ladder's `kind` (modelled or projected)."""
    out, prev = [], 0.0
    for r in rows:
        v = at_interactivity(r["front"], target)
        out.append({"rung": r["rung"], "section": r["section"], "kind": r.get("kind"), "target": target,
                    "at_target": v, "gain": v - prev})
        prev = v
    return out


def knee(concurrency, per_user, per_gpu) -> int:
    """Where a front bends: over points in rising concurrency, the first concurrency from which the next
    point gains less tokens/s/GPU (relative) than it costs each user in tokens/s/user (relative); the last
    concurrency when every step still pays. ValueError for lists of unequal length, fewer than two
    points, concurrency not rising, or a rate that is not positive."""
    c, u, g = list(concurrency), [float(v) for v in per_user], [float(v) for v in per_gpu]
    if not len(c) == len(u) == len(g) >= 2:
        raise ValueError(f"concurrency, per_user and per_gpu must be equal lists of >= 2 points, got "
                         f"{len(c)}, {len(u)}, {len(g)}")
    if any(b <= a for a, b in zip(c, c[1:])):
        raise ValueError(f"concurrency must rise, got {c}")
    if min(u + g) <= 0:
        raise ValueError("per_user and per_gpu must be positive rates")
    for i in range(len(c) - 1):
        if g[i + 1] / g[i] - 1.0 < 1.0 - u[i + 1] / u[i]:
            return int(c[i])
    return int(c[-1])
