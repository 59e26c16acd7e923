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


def _setting_text(dcp, host: bool, depths) -> str:
    dcps = " or ".join(f"DCP{d}" for d in dcp)
    lo, hi = depths
    drafts = f"{lo} drafts" if lo == hi else f"{lo} to {hi} drafts"
    return f"{dcps}, {drafts}, {'host tier on' if host else 'GPU only'}"


def settings(inp: node.Inputs, work: curve.Workload, *, gpu: str = "mi355x", targets=None,
             error: dict | None = None) -> list[dict]:
    """At each of the article's comparison targets (tokens/s/user P90; default its `SEED['settings']`
    keys), the configuration the model picks for `gpu` on the article's stack (every rung but k3lab's own
    glue): the best point of its front at or above the target, beside the article's setting there. Each
    row: target, model (its DCP degree, draft depth, concurrency, hit rate, tokens/s/GPU, 'projected' on
    any GPU but the one whose steps are fitted), the caches that configuration's live sessions need
    against the HBM left after the weights and whether the host tier holds any of them (with the restores
    it costs over the host link: curve.evaluate's `restore_s` and `host_link_busy`), the article's
    setting, whether the two agree on DCP and on the host tier, `why` they differ, computed from those
    figures, and the step model's error. A target no configuration reaches has model None and says so."""
    g = gpu_of(gpu)
    err = error_text(error)
    targets = tuple(SEED["settings"]) if targets is None else tuple(targets)
    for t in targets:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t != t:
            raise ValueError(f"targets must be tokens/s/user > 0, got {t!r}")
        if float(t) not in SEED["settings"]:
            raise ValueError(f"targets must be among the article's ({sorted(SEED['settings'])}), got {t!r}")
    rung = curve.RUNGS[-2]
    every = curve.candidates(inp, rung, g, work)
    fr = curve.front(every)
    ctx = work.mean_in + work.mean_out / 2
    free = node.free_gb(g, moe_rows_only=rung.moe_rows_only)
    rows = []
    for t in targets:
        art = SEED["settings"][float(t)]
        ok = [p for p in fr if p["tokens_per_s_user"] >= t]
        b = max(ok, key=lambda p: p["tokens_per_s_gpu"], default=None)
        row = {"target": float(t), "article": _setting_text(art["dcp"], art["host"], art["depths"]),
               "model_error": err, "kind": "modelled" if g.key == "h200" else "projected"}
        if b is None:
            top = max(fr, key=lambda p: p["tokens_per_s_user"])
            row.update(model=None, agrees_dcp=False, agrees_host=False,
                       why=(f"no configuration of the model reaches it: its fastest point is "
                            f"{top['tokens_per_s_user']:.0f} tokens/s/user (DCP{top['dcp']}, depth "
                            f"{top['depth']}, concurrency {top['concurrency']})"))
            rows.append(row)
            continue
        need = b["concurrency"] * (1 + node.THINK_SHARE) * node.sequence_gb(ctx, b["dcp"])
        host_used = need > free
        row.update(model=_setting_text((b["dcp"],), host_used, (b["depth"], b["depth"])),
                   dcp=b["dcp"], depth=b["depth"], concurrency=b["concurrency"], hit_rate=b["hit_rate"],
                   tokens_per_s_gpu=b["tokens_per_s_gpu"], cache_need_gb=need, hbm_free_gb=free,
                   agrees_dcp=b["dcp"] in art["dcp"], agrees_host=host_used == art["host"])
        why, live = [], f"the live sessions' caches ({need:.0f} GB at concurrency {b['concurrency']})"
        if not host_used and art["host"]:
            why.append(f"{live} fit in the {free:.0f} GB of HBM left, so the host tier holds nothing and the "
                       f"hit rate is the workload's theoretical {b['hit_rate']:.1%}")
        if host_used:
            other = [p for p in every if p["dcp"] != b["dcp"] and p["tokens_per_s_user"] >= t]
            alt = max(other, key=lambda p: p["tokens_per_s_gpu"], default=None)
            alt_text = (f"DCP{alt['dcp']}'s best there gives {alt['tokens_per_s_gpu']:,.0f} tokens/s/GPU"
                        if alt else "no configuration at another DCP degree reaches the target")
            why.append(f"{live} pass the {free:.0f} GB of HBM left and the host tier holds the rest: "
                       f"{b['host_hit_rate']:.1%} of the input is restored from the host, "
                       f"{b['restore_s'] * 1e3:.1f} ms per request over the host link "
                       f"({g.host_gbs:g} GB/s, busy {b['host_link_busy']:.1%} of the time), so a smaller "
                       f"history per GPU saves little ({alt_text})")
        if not row["agrees_dcp"]:
            why.append(f"with capacity not binding, DCP{b['dcp']} beats "
                       f"{' or '.join(f'DCP{d}' for d in art['dcp'] if d != b['dcp'])} on step time")
        lo, hi = art["depths"]
        if not lo <= b["depth"] <= hi:
            why.append(f"depth {b['depth']} lies outside the article's {lo} to {hi}: the depth comes from "
                       f"the model's acceptance curve and a drafter costed as one layer of the step (both "
                       f"modelled)")
        row["why"] = "; ".join(why) or "agrees on the DCP degree, the draft depth and the host tier"
        rows.append(row)
    return rows


def settings_markdown(inp: node.Inputs, work: curve.Workload, error: dict, *, gpu: str = "mi355x") -> str:
    """docs/serving.md's settings section, generated: `settings` as a table, labelled projected."""
    rows = settings(inp, work, gpu=gpu, error=error)
    g = gpu_of(gpu)
    out = [f"The model's choice on {g.name} ({rows[0]['kind']}; step-model error carried: "
           f"{rows[0]['model_error']}) beside the article's setting at each of its comparison targets.",
           "",
           "| tokens/s/user (P90) | the article's setting (its runs' configuration) | the model's choice | "
           "concurrency | caches needed / HBM left (GB) | total tokens/s/GPU (projected) | why they differ |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["model"] is None:
            out.append(f"| {r['target']:.0f} | {r['article']} | none reaches it | n/a: no configuration | "
                       f"n/a: no configuration | n/a: no configuration | {r['why']} |")
            continue
        out.append(f"| {r['target']:.0f} | {r['article']} | {r['model']} | {r['concurrency']} | "
                   f"{r['cache_need_gb']:.0f} / {r['hbm_free_gb']:.0f} | {r['tokens_per_s_gpu']:,.0f} | "
                   f"{r['why']} |")
    return "\n".join(out)


__all__ = ["error_text", "settings", "settings_markdown", "step_c1_ms", "steps", "terms"]
