"""The serving curve: tokens/s/GPU against tokens/s/user (P90) for a node configuration, each optimization
added in the article's order (`RUNGS`), the value at an interactivity target, and each rung's share.

A configuration is (rung, GPU, DCP degree, draft depth, concurrency). For one, over an agent workload
(`Workload`: request input and output tokens, theoretical prefix reuse):

    cycle        one draft-verify step of the batch: depth x drafter + the verify step over depth + 1
                 positions (node.rank_step_us and node.verify_extra_us); depth 0 is plain decode
    R0           committed tokens per cycle (k3lab.speculative, the acceptance curve) / cycle time
    prefill      the uncached input of a request (input x (1 - hit rate), node.hit_rate) x
                 node.prefill_us_per_token; it stalls the decode batch
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

from . import node
from .hardware import GPU, SEED

CONCURRENCY = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
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


@functools.lru_cache(maxsize=1)
def _committed_all() -> tuple[float, ...]:
    from k3lab import speculative

    return (1.0, *map(float, speculative.expected_committed_all(speculative.reference_acceptance(MAX_DEPTH))))


def committed(depth: int) -> float:
    """Expected committed tokens per cycle at `depth` drafts (1 at depth 0): k3lab.speculative's reference
    acceptance curve (fitted to the seed's 3.00 and 3.36 tokens at three and four drafts)."""
    return _committed_all()[depth]


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
) -> dict | None:
    """The rates of one configuration (module docstring), or None when its caches do not fit."""
    C = concurrency
    ctx = work.mean_in + work.mean_out / 2
    if C > node.max_concurrency(ctx, g, dcp=dcp, moe_rows_only=rung.moe_rows_only, memory_gb=memory_gb):
        return None
    terms = cycle_us(inp, rung, g, dcp, depth, C, C * ctx)
    t = sum(terms.values())
    hist = sum(v for k, v in terms.items() if k in ("history", "history_waves", "off: mla_padded"))
    rng = np.random.default_rng(seed)
    p = work.out_tokens / work.out_tokens.sum()
    sums = rng.choice(work.in_tokens, size=(draws, C), p=p).sum(axis=1) + C * work.mean_out / 2
    t_draws = t + hist * (sums / (C * ctx) - 1.0)
    hit = node.hit_rate(
        work.reuse,
        C,
        ctx,
        g,
        dcp=dcp,
        host_gb=rung.host_gb,
        moe_rows_only=rung.moe_rows_only,
        memory_gb=memory_gb,
    )
    prefill_s = work.mean_in * (1 - hit) * node.prefill_us_per_token(inp, ctx, g, rung.kda_scan) * 1e-6
    e = committed(depth)

    def per_user(t_us):
        r0 = e / (np.asarray(t_us) * 1e-6)
        return r0 / (1.0 + C * r0 * prefill_s / work.mean_out)

    mean = float(per_user(t))
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
        "prefill_s": prefill_s,
        "terms_us": terms,
    }


def candidates(
    inp, rung: Rung, g: GPU, work: Workload, *, memory_gb=None, dcp=None, depths=None
) -> list[dict]:
    """Every configuration the rung allows (DCP degrees, depths, CONCURRENCY) that fits."""
    out = []
    for d in rung.dcp if dcp is None else dcp:
        for k in rung.depths if depths is None else depths:
            for C in CONCURRENCY:
                r = evaluate(inp, rung, g, dcp=d, depth=k, concurrency=C, work=work, memory_gb=memory_gb)
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
    inp, g: GPU, work: Workload, *, memory_gb=None, target: float = SEED["interactivity"]
) -> list[dict]:
    """Per rung: its front, the tokens/s/GPU at `target`, the gain over the rung before (its share)."""
    rows, prev = [], 0.0
    for rung in RUNGS:
        fr = front(candidates(inp, rung, g, work, memory_gb=memory_gb))
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
                "front": fr,
                "at_target": v,
                "gain": v - prev,
                "config": {k: best[k] for k in ("dcp", "depth", "concurrency")} if best else None,
            }
        )
        prev = v
    return rows
