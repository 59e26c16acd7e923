"""The model's MI355X figure at the article's interactivity against the article's own, term by term.

The article's 7,567 total tokens/s/GPU at 50 tokens/s/user (P90) is a measurement of a whole serving
stack on AgentX; the model's figure is a projection of k3lab's graph-replayed step. `steps` walks from
one to the other, changing one assumption at a time to what the article reports, and gives the
tokens/s/GPU after each change; `terms` sets the quantities that differ side by side. Every row says
what kind of figure each side is: measured (k3lab's H200 records), modelled, projected (another GPU),
or the article's (hardware.SEED).
"""

from __future__ import annotations


from . import curve, node
from .hardware import GPU, SEED, gpu as gpu_of


def _best(inp, rung, g: GPU, work, target: float, scenario) -> dict | None:
    fr = curve.front(curve.candidates(inp, rung, g, work, scenario=scenario))
    ok = [p for p in fr if p["tokens_per_s_user"] >= target]
    return max(ok, key=lambda p: p["tokens_per_s_gpu"], default=None)


def step_c1_ms(inp: node.Inputs, g: GPU, context: int, rung: curve.Rung | None = None) -> float:
    """The model's plain decode step at concurrency one on `g` (ms), DCP1, for `rung` (default: the
    article's stack, every rung but k3lab's own glue)."""
    rung = rung or curve.RUNGS[-2]
    return sum(node.rank_step_us(inp, rung.off, 1, context, 1, g=g).values()) / 1e3


def steps(inp: node.Inputs, work: curve.Workload, *, gpu: str = "mi355x",
          target: float = SEED["interactivity"]) -> list[dict]:
    """From the model's figure to the article's assumptions, one change at a time (cumulative): each row
    the change, its kind, the scenario, the best configuration at `target` and its tokens/s/GPU, users
    per node and prefix hit rate. The last row is the article's figure."""
    g = gpu_of(gpu)
    article_rung = curve.RUNGS[-2]
    hit = SEED["hit_rate_reported"][1]
    scale = SEED["tpot_ms_c1"][1024] / step_c1_ms(inp, g, 1024)
    plan = [
        ("the model, all on (k3lab's fused glue included)", "projected", curve.RUNGS[-1], curve.MODEL),
        ("without k3lab's fused glue (the article's stack has none)", "projected", article_rung, curve.MODEL),
        (f"prefix hits at the article's reported {hit:.1%} instead of the modelled rate", "the article's",
         article_rung, curve.Scenario(hit_rate=hit)),
        (f"every step {scale:.2f}x as long: the article's concurrency-one step over the model's (1K)",
         "the article's", article_rung, curve.Scenario(hit_rate=hit, step_scale=scale)),
    ]
    rows = []
    for change, kind, rung, sc in plan:
        b = _best(inp, rung, g, work, target, sc)
        rows.append({
            "change": change, "kind": kind, "scenario": sc,
            "tokens_per_s_gpu": b["tokens_per_s_gpu"] if b else 0.0,
            "config": {k: b[k] for k in ("dcp", "depth", "concurrency")} if b else None,
            "users_per_node": b["concurrency"] if b else 0,
            "hit_rate": b["hit_rate"] if b else None,
        })
    lo, hi = SEED["hit_rate_reported"][1], max(r["hit_rate"] or 0.0 for r in rows[:2])
    for _ in range(7):  # the hit rate at which the model meets the article's figure (bisection)
        mid = 0.5 * (lo + hi)
        b = _best(inp, article_rung, g, work, target, curve.Scenario(hit_rate=mid, step_scale=scale))
        lo, hi = (lo, mid) if b and b["tokens_per_s_gpu"] >= SEED["mi355x_tokens_per_s_gpu"] else (mid, hi)
    b = _best(inp, article_rung, g, work, target, curve.Scenario(hit_rate=hi, step_scale=scale))
    rows.append({"change": f"prefix hits at {hi:.1%}: where the model meets the article's figure",
                 "kind": "implied", "scenario": curve.Scenario(hit_rate=hi, step_scale=scale),
                 "tokens_per_s_gpu": b["tokens_per_s_gpu"] if b else 0.0,
                 "config": {k: b[k] for k in ("dcp", "depth", "concurrency")} if b else None,
                 "users_per_node": b["concurrency"] if b else 0, "hit_rate": hi})
    rows.append({"change": "the article's figure (8x MI355X, AgentX, measured by its authors)",
                 "kind": "the article's", "scenario": None,
                 "tokens_per_s_gpu": SEED["mi355x_tokens_per_s_gpu"], "config": None,
                 "users_per_node": None, "hit_rate": None})
    return rows


def terms(inp: node.Inputs, work: curve.Workload, *, gpu: str = "mi355x",
          target: float = SEED["interactivity"]) -> list[dict]:
    """The quantities behind the two figures, side by side: term, the model's value, what the article
    reports or its figure implies (None where it publishes nothing), and the kind of each side."""
    g = gpu_of(gpu)
    b = _best(inp, curve.RUNGS[-1], g, work, target, curve.MODEL)
    per_out = (work.mean_in + work.mean_out) / work.mean_out
    seed_out_node = SEED["mi355x_tokens_per_s_gpu"] * node.TP / per_out
    rows = [
        ("total tokens/s/GPU at the target", b and b["tokens_per_s_gpu"], SEED["mi355x_tokens_per_s_gpu"],
         "projected", "the article's"),
        ("tokens counted per output token ((input + output) / output)", per_out, None,
         "modelled (AgentX-like generator)", "AgentX counts input and output; its mix is not published"),
        ("output tokens/s per node", b and b["concurrency"] * b["tokens_per_s_user_mean"], seed_out_node,
         "projected", "implied by the article's figure at the model's mix"),
        ("users decoding per node at the target", b and b["concurrency"], seed_out_node / target,
         "projected", "implied (at most: P90 >= target means a mean above it)"),
        ("prefix-cache hit rate", b and b["hit_rate"], SEED["hit_rate_reported"][1], "modelled",
         "the article's (reported in the MoE-rows AgentX experiment, 74.8% before it)"),
        ("decode step at concurrency one, 1K (ms)", step_c1_ms(inp, g, 1024), SEED["tpot_ms_c1"][1024],
         "projected", "the article's (PR-reported, whole stack)"),
        ("decode step at concurrency one, 32K (ms)", step_c1_ms(inp, g, 32768), SEED["tpot_ms_c1"][32768],
         "projected", "the article's (PR-reported, whole stack)"),
        ("draft depth at the target", b and b["depth"], "{} to {}".format(*SEED["depths_at_50"]), "modelled",
         "the article's recipe"),
        ("prefill of one request's uncached input (s)", b and b["prefill_s"], None, "modelled", None),
    ]
    return [{"term": t, "model": m, "article": a, "model_kind": mk, "article_kind": ak}
            for t, m, a, mk, ak in rows]


__all__ = ["step_c1_ms", "steps", "terms"]
