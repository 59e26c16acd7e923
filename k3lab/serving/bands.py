"""Projected serving curves drawn as bands: the model's front on a GPU k3lab has not measured, with the
measured error of the step model and the sensitivity to the inputs nobody measured for that configuration.

    err = validate.model_error()                         # cross-GPU when two grids exist, else held-out
    b = bands.band(inp, "mi355x", work, error=err)       # central front, low and high fronts, per source
    bands.calibration(inp, work, error=err)              # the article's measured figure / the projection

A band's sources, each moved to both ends (`SOURCES`):
- step model: every step x 1/(1 + e) for e in [-E, +E], E the largest abs(rel_err) of the error it is given
  (`error['kind']` says which: cross-GPU, else held-out and extrapolation, the band is labelled with it);
- prefix hit rate: from the lowest the article's stack reported on AgentX (hardware.SEED, 74.8%) to the
  modelled rate (node.hits);
- acceptance: each position's acceptance x 0.8 to x 1.1 (k3lab's curve is fitted to the seed's two figures;
  the range is an assumption, stated);
- call latency: 7 to 25 us per collective call (anchors.md's range; the model's 8 us is its low end).
Every knob moves the figure one way, so the band's low front has all four at their low ends and its high
front all at their high ends (the envelope of every combination); `per_source` moves one at a time.

Beside total tokens/s/GPU every point carries output tokens/s/GPU (C x mean per-user rate / 8), TPOT P90
(1 / the P90 per-user rate) and the modelled TTFT (one request's restore of its hits from the host tier,
if any, then the prefill of its uncached input).

`calibration` states the article's measured tokens/s/GPU over the model's projection for the same GPU at
the same interactivity (MI355X 7,567, B300 6,083), with the band's range: a calibration factor for
reading a projection, not a check of the model (the stacks, the workload and the hit rates differ).
"""

from __future__ import annotations

import dataclasses

from . import curve
from .hardware import SEED, GPU, gpu as gpu_of

ACCEPTANCE = (0.8, 1.1)
CALL_LATENCY_US = (7.0, 25.0)
SOURCES = ("step model", "prefix hit rate", "acceptance", "call latency")
# the projected configurations: GPU, memory per GPU (None: the GPU's own), the article's measured figure
PROJECTIONS = {
    "mi355x": ("mi355x", None, SEED["mi355x_tokens_per_s_gpu"]),
    "b300": ("b300", None, SEED["b300_tokens_per_s_gpu"]),
    "h200_288gb": ("h200", 288.0, None),
}


def _with_latency(g: GPU, us: float) -> GPU:
    return dataclasses.replace(g, link=dataclasses.replace(g.link, call_latency_us=float(us)))


def _point(p: dict, work: curve.Workload) -> dict:
    """A front point with output tokens/s/GPU, TPOT P90 (ms) and the modelled TTFT (s) beside it."""
    return {**{k: p[k] for k in ("dcp", "depth", "concurrency", "tokens_per_s_user", "tokens_per_s_gpu",
                                 "hit_rate", "cycle_ms")},
            "output_tokens_per_s_gpu": p["concurrency"] * p["tokens_per_s_user_mean"] / 8,
            "tpot_p90_ms": 1e3 / p["tokens_per_s_user"], "ttft_s_modelled": p["prefill_s"] + p["restore_s"]}


def _front(inp, rung, g, work, memory_gb, scenario) -> list[dict]:
    return [_point(p, work) for p in curve.front(curve.candidates(inp, rung, g, work, memory_gb=memory_gb,
                                                                  scenario=scenario))]


def _ends(error: dict) -> dict:
    """Per source, the (low, high) settings: step_scale, hit rate (None: modelled), acceptance, latency."""
    E = float(error["worst"])
    if not 0 <= E < 1:
        raise ValueError(f"error['worst'] must be in [0, 1), got {E!r}")
    return {"step model": (1 / (1 - E), 1 / (1 + E)), "prefix hit rate": (SEED["hit_rate_reported"][0], None),
            "acceptance": ACCEPTANCE, "call latency": CALL_LATENCY_US[::-1]}


def _setting(ends: dict, pick: dict) -> tuple[curve.Scenario, float]:
    """The Scenario and call latency for `pick` (source -> 0 low end, 1 high end, absent: central)."""
    step, hit, acc, lat = 1.0, None, 1.0, None
    for src, i in pick.items():
        v = ends[src][i]
        if src == "step model":
            step = v
        elif src == "prefix hit rate":
            hit = v
        elif src == "acceptance":
            acc = v
        else:
            lat = v
    return curve.Scenario(hit_rate=hit, acceptance=acc, step_scale=step), lat


def band(inp, key: str, work: curve.Workload, *, error: dict, rung: curve.Rung | None = None,
         target: float = SEED["interactivity"], per_source: bool = True) -> dict:
    """The projected front of `key` (PROJECTIONS: 'mi355x', 'b300', 'h200_288gb') for `rung` (default: all
    on) with its band (module docstring): 'central', 'low', 'high' fronts (lists of points), 'at_target'
    (tokens/s/GPU of each at `target` tokens/s/user, with output tokens/s/GPU and TPOT P90 of the central
    point), 'per_source' (source -> (low, high) at the target), 'error_kind' and 'label' ('projected').
    ValueError for an unknown key."""
    if key not in PROJECTIONS:
        raise ValueError(f"key must be one of {sorted(PROJECTIONS)}, got {key!r}")
    gkey, mem, _ = PROJECTIONS[key]
    g = gpu_of(gkey)
    rung = rung or curve.RUNGS[-1]
    ends = _ends(error)

    def front(pick: dict) -> list[dict]:
        sc, lat = _setting(ends, pick)
        return _front(inp, rung, g if lat is None else _with_latency(g, lat), work, mem, sc)

    central = front({})
    low = front(dict.fromkeys(SOURCES, 0))
    high = front(dict.fromkeys(SOURCES, 1))
    at = lambda fr: curve.at_interactivity(fr, target)  # noqa: E731
    best = max((p for p in central if p["tokens_per_s_user"] >= target), key=lambda p: p["tokens_per_s_gpu"],
               default=None)
    out = {"key": key, "gpu": g.name, "memory_gb": mem or g.memory_gb, "rung": rung.name,
           "label": "projected", "error_kind": error["kind"], "error_worst": error["worst"],
           "central": central, "low": low, "high": high, "target": target,
           "at_target": {"central": at(central), "low": at(low), "high": at(high),
                         "output_tokens_per_s_gpu": best["output_tokens_per_s_gpu"] if best else 0.0,
                         "tpot_p90_ms": best["tpot_p90_ms"] if best else None,
                         "ttft_s_modelled": best["ttft_s_modelled"] if best else None,
                         "config": {k: best[k] for k in ("dcp", "depth", "concurrency")} if best else None},
           "ends": {s: ends[s] for s in SOURCES}, "per_source": {}}
    if per_source:
        for s in SOURCES:
            out["per_source"][s] = (at(front({s: 0})), at(front({s: 1})))
    return out


def calibration(inp, work: curve.Workload, *, error: dict, target: float = SEED["interactivity"],
                bands_by_key: dict | None = None) -> list[dict]:
    """For each projection the article measured (MI355X, B300): the article's tokens/s/GPU at `target`
    over the model's projected figure for the article's stack (every rung but k3lab's own glue), central
    and over the band (`ratio_range`: article / high end, article / low end; None where the low end
    reaches no configuration at the target), labelled a calibration. `bands_by_key` reuses bands already
    computed for that rung."""
    rows = []
    for key, (gkey, _, measured) in PROJECTIONS.items():
        if measured is None:
            continue
        b = (bands_by_key or {}).get(key) or band(inp, key, work, error=error, rung=curve.RUNGS[-2],
                                                    target=target, per_source=False)
        a = b["at_target"]
        ratio = lambda v: measured / v if v else None  # noqa: E731
        rows.append({"gpu": b["gpu"], "article_measured": measured, "projection_central": a["central"],
                     "projection_low": a["low"], "projection_high": a["high"],
                     "ratio_central": ratio(a["central"]),
                     "ratio_range": (ratio(a["high"]), ratio(a["low"])), "rung": b["rung"],
                     "error_kind": b["error_kind"],
                     "use": "calibration: the article's measured figure over the model's projection for the "
                            "same GPU; the stacks, workload and hit rates differ, so it is not a check"})
    return rows


def _tok(v) -> str:
    return "none reaches it" if not v else f"{round(v, -1):,.0f}"


def _ratio(v) -> str:
    return "unbounded" if v is None else f"{v:.2f}"


def report_markdown(inp, work: curve.Workload, error: dict, *, target: float = SEED["interactivity"],
                    bands_by_key: dict | None = None) -> str:
    """docs/serving.md's projection section, generated: per projection its band at `target` (all on),
    the per-source ranges, output tokens/s/GPU, TPOT P90 and modelled TTFT of the central point, then the
    calibration ratios (the test compares the page to this). `bands_by_key`: the all-on bands (with
    per_source) already computed for every key of PROJECTIONS."""
    bs = bands_by_key or {k: band(inp, k, work, error=error, target=target) for k in PROJECTIONS}
    lines = [f"Step-model error carried: {error['kind']}, worst {error['worst']:.0%}.", "",
             f"| projection (all on) | memory/GPU | total tokens/s/GPU at {target:g} tokens/s/user: central "
             "[band] | output tokens/s/GPU | TPOT P90 (ms) | TTFT (s, modelled) | "
             + " | ".join(SOURCES) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(SOURCES)]
    for b in bs.values():
        a = b["at_target"]
        src = " | ".join(f"{_tok(lo)} to {_tok(hi)}" for lo, hi in (b["per_source"][s] for s in SOURCES))
        tpot = "-" if a["tpot_p90_ms"] is None else f"{a['tpot_p90_ms']:.1f}"
        ttft = "-" if a["ttft_s_modelled"] is None else f"{a['ttft_s_modelled']:.2f}"
        lines.append(f"| {b['gpu']} (projected) | {b['memory_gb']:g} GB | {_tok(a['central'])} "
                     f"[{_tok(a['low'])}, {_tok(a['high'])}] | {a['output_tokens_per_s_gpu']:,.0f} | "
                     f"{tpot} | {ttft} | {src} |")
    lines += ["", "| calibration | the article's measured tokens/s/GPU | over the projection of the "
              "article's stack: central [over the band's high, low end] |", "|---|---|---|"]
    for r in calibration(inp, work, error=error, target=target):
        lo, hi = r["ratio_range"]
        lines.append(f"| {r['gpu']} | {r['article_measured']:,.0f} | {_ratio(r['ratio_central'])} "
                     f"[{_ratio(lo)}, {_ratio(hi)}] |")
    return "\n".join(lines)


__all__ = ["ACCEPTANCE", "CALL_LATENCY_US", "PROJECTIONS", "SOURCES", "band", "calibration",
           "report_markdown"]
