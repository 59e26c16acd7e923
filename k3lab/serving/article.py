"""The model's MI355X projection and the article's measured figure: what each is made of, never one set
against the other as comparable.

The article's 7,567 total tokens/s/GPU at 50 tokens/s/user (P90) is a measurement of a whole serving stack
on AgentX; the model's figure is a projection of k3lab's graph-replayed H200 step. `steps` changes the
projection one input at a time where the input is measured by k3lab or cited by the article for this
configuration (DROPPED lists the changes left out and why); `terms` lists the quantities behind each
side with the article's over the model's as a ratio; bands.calibration states the article's figure over
the projection as a calibration factor. Every row says what kind each side is: measured (k3lab's
records), modelled, projected (another GPU), or the article's (hardware.SEED), and every row with a
modelled or projected figure carries the step model's measured error (`error`, validate.model_error's
dict; by default the committed records'), or says the row does not rest on the step model.
"""

from __future__ import annotations


from . import curve, node, validate
from .hardware import GPU, SEED, gpu as gpu_of


def error_text(error: dict | None) -> str:
    """The step model's measured error as a row states it: its kind and worst abs(rel_err); `error` None
    reads validate.model_error() on the committed records."""
    error = error if error is not None else validate.model_error()
    return f"{error['kind']}, worst {error['worst']:.0%}"


def _best(inp, rung, g: GPU, work, target: float, scenario) -> dict | None:
    fr = curve.front(curve.candidates(inp, rung, g, work, scenario=scenario))
    ok = [p for p in fr if p["tokens_per_s_user"] >= target]
    return max(ok, key=lambda p: p["tokens_per_s_gpu"], default=None)


def step_c1_ms(inp: node.Inputs, g: GPU, context: int, rung: curve.Rung | None = None) -> float:
    """The model's plain decode step at concurrency one on `g` (ms), DCP1, for `rung` (default: the
    article's stack, every rung but k3lab's own glue)."""
    rung = rung or curve.RUNGS[-2]
    return sum(node.rank_step_us(inp, rung.off, 1, context, 1, g=g).values()) / 1e3


# Steps an earlier walk took and this one does not: their inputs are neither measured by k3lab nor cited
# by the article for the configuration the walk is at (8x MI355X at 50 tokens/s/user). What each input
# can still say is said elsewhere: the hit rate as one end of the band (bands.SOURCES), the c1 step as a
# ratio in `terms`, the article's figure as a calibration (bands.calibration).
DROPPED = (
    ("prefix hits at the article's reported 80.1%", "reported by a separate AgentX experiment (the MoE-rows "
     "change) at another concurrency, not for this configuration"),
    ("every step scaled to the article's concurrency-one step", "the article cites its step at concurrency "
     "one only; scaling the steps of every concurrency by it extrapolates"),
    ("the hit rate at which the model meets the article's figure", "solved from the figure, not an input"),
    ("the article's figure at the end of the walk", "a measurement of another stack: stated as a "
     "calibration ratio (bands.calibration), not as the walk's last step"),
)


def steps(inp: node.Inputs, work: curve.Workload, *, gpu: str = "mi355x",
          target: float = SEED["interactivity"], error: dict | None = None) -> list[dict]:
    """The model's projected figure on `gpu` at `target`, then one change at a time whose input is
    measured (k3lab's records) or cited for this configuration: each row the change, its kind, the
    scenario, the best configuration at `target` and its tokens/s/GPU, users per node, prefix hit rate and
    the step model's measured error (`error_text(error)`). Every row is a projection; the steps left out
    and why are in DROPPED."""
    g = gpu_of(gpu)
    err = error_text(error)
    plan = [
        ("the model, all on (k3lab's fused glue included)", "projected", curve.RUNGS[-1]),
        ("without k3lab's fused glue (the article's stack has none; its cost measured on the H200)",
         "projected", curve.RUNGS[-2]),
    ]
    rows = []
    for change, kind, rung in plan:
        b = _best(inp, rung, g, work, target, curve.MODEL)
        rows.append({
            "change": change, "kind": kind, "scenario": curve.MODEL,
            "tokens_per_s_gpu": b["tokens_per_s_gpu"] if b else 0.0,
            "config": {k: b[k] for k in ("dcp", "depth", "concurrency")} if b else None,
            "users_per_node": b["concurrency"] if b else 0,
            "hit_rate": b["hit_rate"] if b else None,
            "step_model_error": err,
        })
    return rows


def terms(inp: node.Inputs, work: curve.Workload, *, gpu: str = "mi355x",
          target: float = SEED["interactivity"], error: dict | None = None) -> list[dict]:
    """The quantities behind the model's projection and the article's measurement: term, the model's value,
    what the article reports or its figure implies (None where it publishes nothing), the kind of each
    side, the article's value over the model's (a calibration ratio, not a check: the stacks differ) and
    the step model's measured error where the model's value rests on it (`error_text(error)`). The total
    tokens/s/GPU is bands.calibration's."""
    g = gpu_of(gpu)
    err = error_text(error)
    b = _best(inp, curve.RUNGS[-1], g, work, target, curve.MODEL)
    per_out = (work.mean_in + work.mean_out) / work.mean_out
    seed_out_node = SEED["mi355x_tokens_per_s_gpu"] * node.TP / per_out
    rows = [
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
    def ratio(m, a):
        ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (m, a))
        return a / m if ok and m else None

    # the rows whose model value rests on no step time; every other one does (the configuration chosen
    # at the target included)
    apart = {rows[0][0]: "none: the generator's mix, no step time in it",
             rows[-1][0]: "not known: the prefill is modelled apart from the step model, not validated"}
    return [{"term": t, "model": m, "article": a, "model_kind": mk, "article_kind": ak,
             "ratio_article_over_model": ratio(m, a), "model_error": apart.get(t, err)}
            for t, m, a, mk, ak in rows]


__all__ = ["error_text", "step_c1_ms", "steps", "terms"]
