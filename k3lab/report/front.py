"""The report's first screen: one row per optimization of the seed article.

The rows follow the map (`k3lab.optimizations.OPTIMIZATIONS`): each `Optimization` takes the entry's
title, what it does, its lesson notebook and the studies whose live run checks it, and adds its headline
cases: committed H200 records (profiles/nvidia-h200/<study>/) read at report time. An optimization
whose notebook is not in the tree is shown as "not built yet", so the table follows the tree without edits
when a notebook lands.

The table reads as speedups: before / after and peer / after ("13.2x": the after is 13.2 times faster),
each row's times in one unit (us, or ms where the row's largest is 10 ms or more) as plain numbers. A
headline may set a case's time against another case's (`after_case`: DCP8's local attention against
TP8's, the whole step with every optimization on against every one off), and DCP's row adds the memory
it frees: the MLA history a GPU keeps for a long conversation under TP8 and DCP8 (K3's config and
`dcp.cache_bytes_per_rank`, which the committed H200 run measured to the byte).

The serving section below the table (`serving_section`) shows notebook 09's curve on 8x MI355X, every
figure labelled a projection with the step model's measured error and the all-on band; the article's
measured figures only as calibration ratios (`k3lab.report.readme` puts the same figures in the README).
"""

from __future__ import annotations

import functools
import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from k3lab import optimizations

HEADLINE_DEVICE = optimizations.RECORDS_DEVICE


@dataclass(frozen=True)
class Headline:
    """One committed record set: `study`'s `case` timed in `mode`, shown as `label`; its before and after
    variants, or, with `after_case`, this case's time (its before, else its after) against that case's
    after timed in `after_mode` (default `mode`)."""

    study: str
    case: str
    mode: str
    label: str
    after_case: str = ""
    after_mode: str = ""


@dataclass(frozen=True)
class Optimization:
    """One row of the first screen: the map's entry (`k3lab.optimizations`) with the report's headlines.

    notebook: the lesson's glob under notebooks/ (the entry's first); studies: the entry's studies,
    whose live runs the row reports."""

    title: str
    does: str
    notebook: str  # glob under notebooks/, e.g. "03_*.ipynb"
    studies: tuple[str, ...] = ()
    headlines: tuple[Headline, ...] = ()
    note: str = ""  # what the H200 columns say where there is no timing to show
    memory: object = None  # () -> (label, before bytes, after bytes): the memory the optimization frees


# the committed cases each optimization's row shows, by the map's entry name
HEADLINES: dict[str, tuple[Headline, ...]] = {
    "dcp": (Headline("dcp", "local_tp8_B1_L131072", "graph",
                     "local attention kept, B = 1, 128K: TP8 12 heads over all / DCP8 96 heads over 1/8",
                     after_case="local_dcp8_B1_L131072"),
            Headline("dcp", "merge_N8_B1", "graph", "merge of 8 partial results, B = 1 (torch / Triton)")),
    "moe_sharding": (
        Headline("moe_sharding", "tail_N8", "graph", "latent MoE tail, 8 tokens (7168 / 896 rows)"),
        Headline("moe_sharding", "experts_N64", "eager",
                 "routed experts, 64 tokens (per-expert loop / grouped kernels; eager: the loop reads "
                 "counts)")),
    "copy_removal": (
        Headline("kda_decode", "B1_H12", "graph", "KDA decode, B = 1"),
        Headline("copy_removal", "attn_res_t1_s9_graph", "graph", "AttnRes + RMSNorm, 1 token"),
        Headline("copy_removal", "attn_res_t8192_s9_graph", "graph", "AttnRes + RMSNorm, 8192 tokens")),
    "mla_padding": (
        Headline("mla_padding", "ctx32k", "graph", "B = 1, 32K context"),
        Headline("mla_padding", "b64_8k", "graph", "B = 64, 8K context")),
    "kda_scan": (
        Headline("kda_scan", "h12_b1_t16384", "eager", "prefill, 12 heads x 16K"),
        Headline("kda_verify", "b1_t4", "graph", "verification, B = 1, 4 positions")),
    "agent_cache": (
        Headline("agent_cache", "h2d_2MiB", "eager", "host -> device copy of 2 MiB (pageable / pinned)"),
        Headline("agent_cache", "state_restore_ctx32768", "eager",
                 "restore a request's state, 5 layers at 32K (pageable / pinned)")),
}
HEADLINES["decode_step"] = (
    Headline("decode_step", "b1_32k.all_off", "eager", "whole step, B = 1, 32K: all off / all on (eager)",
             after_case="b1_32k.all_on"),
    Headline("decode_step", "b1_32k.all_on", "eager",
             "whole step, B = 1, 32K, all on: eager / CUDA-graph replay", after_case="b1_32k.all_on.graph",
             after_mode="graph"))
# what the H200 columns say for an optimization with no headline timing, by entry name
NOTES: dict[str, str] = {
    "draft_depth": "host-side arithmetic, no kernel: 3.00 tokens per cycle at 3 drafts, 3.36 at 4",
}
# the memory an optimization frees, by entry name: (label, before bytes, after bytes) from a function
CONVERSATION = 142_000  # tokens: the seed's long agent conversation


def dcp_memory() -> tuple[str, float, float]:
    """The MLA history one GPU keeps for a CONVERSATION-token conversation, FP8, TP8 vs DCP8."""
    from k3lab.config import K3Config
    from k3lab.parallel.dcp import cache_bytes_per_rank

    full = K3Config.full()
    return (f"MLA history per GPU, {CONVERSATION:,}-token conversation, FP8 (TP8 / DCP8)",
            cache_bytes_per_rank(full, CONVERSATION, 1), cache_bytes_per_rank(full, CONVERSATION, 8))


MEMORY = {"dcp": dcp_memory}

OPTIMIZATIONS: tuple[Optimization, ...] = tuple(
    Optimization(e.title, e.does, e.notebooks[0], e.studies, HEADLINES.get(e.name, ()), NOTES.get(e.name, ""),
                 MEMORY.get(e.name))
    for e in optimizations.OPTIMIZATIONS)


@dataclass
class Checks:
    """What this machine's run found: per study and per notebook stem, 'passed' or a reason."""

    studies: dict[str, str] = field(default_factory=dict)
    notebooks: dict[str, str] = field(default_factory=dict)


def notebook_for(opt: Optimization, root: Path) -> Path | None:
    found = sorted((root / "notebooks").glob(opt.notebook))
    return found[0] if found else None


def _median(records, study: str, case: str, mode: str, variants: tuple[str, ...]):
    for v in variants:
        for r in records:
            if r.study == study and r.case == case and r.mode == mode and r.variant == v:
                return r
    return None


def headline_rows(opt: Optimization, records) -> list[dict]:
    """One dict per headline found in `records` (bench.Record list): label, mode, before, after, peer
    (name and time) and floor in microseconds, speedup = before / after and vs_peer = peer / after (> 1:
    the after is faster); unit 'time'. Then the optimization's memory row, unit 'bytes' (before and after
    in bytes). Missing headlines are left out."""
    from k3lab import bench

    rows = []
    for h in opt.headlines:
        if h.after_case:
            first = _median(records, h.study, h.case, h.mode, ("before", "after"))
            second = _median(records, h.study, h.after_case, h.after_mode or h.mode, ("after",))
            if first is None or second is None:
                continue
            mode = h.mode if not h.after_mode or h.after_mode == h.mode else f"{h.mode} / {h.after_mode}"
            floor = second.floor_us if second.floor_us is not None else math.nan
            row = {"before_us": first.median_us, "after_us": second.median_us, "peer": None,
                   "peer_us": math.nan, "floor_us": floor}
        else:
            recs = [r for r in records if r.study == h.study and r.case == h.case and r.mode == h.mode]
            if not recs:
                continue
            row, mode = bench.compare(recs).iloc[0], h.mode
        before, after, peer_us = row["before_us"], row["after_us"], row["peer_us"]
        rows.append({"label": h.label, "before": before, "after": after, "peer": row["peer"],
                     "peer_us": peer_us, "floor": row["floor_us"], "mode": mode, "unit": "time",
                     "speedup": before / after if after > 0 else math.nan,
                     "vs_peer": peer_us / after if after > 0 else math.nan})
    if opt.memory is not None:
        label, before, after = opt.memory()
        rows.append({"label": label, "before": before, "after": after, "peer": None, "peer_us": math.nan,
                     "floor": math.nan, "mode": "", "unit": "bytes",
                     "speedup": before / after if after > 0 else math.nan, "vs_peer": math.nan})
    return rows


def plain(value: float) -> str:
    """A number as people write it: 1,963 / 42.9 / 4.21 (three figures, never an exponent)."""
    if value is None or not math.isfinite(value):
        return ""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def times(value: float) -> str:
    """A speedup: '13.2x' (before / after, or peer / after)."""
    return f"{plain(value)}x" if value is not None and math.isfinite(value) else ""


def row_unit(values) -> tuple[str, float]:
    """One unit for a row of times in microseconds: ('ms', 1e3) when its largest is 10 ms or more."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return ("ms", 1e3) if finite and max(finite) >= 1e4 else ("us", 1.0)


def row_cells(r: dict) -> list[str]:
    """before, after, speedup, peer, after vs peer, floor: one unit across the row."""
    if r["unit"] == "bytes":
        mb = [plain(v / 1e6) + " MB" for v in (r["before"], r["after"])]
        return [mb[0], mb[1], times(r["speedup"]) + " less", "", "", ""]
    unit, scale = row_unit((r["before"], r["after"], r["peer_us"], r["floor"]))

    def t(v):
        text = plain(v / scale) if v is not None else ""
        return f"{text} {unit}" if text else ""

    peer = f"{t(r['peer_us'])} {r['peer']}" if r["peer"] else ""
    return [t(r["before"]), t(r["after"]), times(r["speedup"]), peer, times(r["vs_peer"]), t(r["floor"])]


def _status(opt: Optimization, nb: Path | None, checks: Checks) -> list[str]:
    """One line per check: each study's live run, then the notebook's."""
    lines = [f"{s}: {checks.studies[s]}" for s in opt.studies if s in checks.studies]
    if nb is not None:
        lines.append(f"notebook: {checks.notebooks.get(nb.stem, 'skipped (notebooks not run)')}")
    return lines or ["skipped (nothing run)"]


def front_table(root: Path, checks: Checks) -> str:
    """The first screen's table as HTML: one row per optimization, split into one line per headline
    case (the optimization's own cells span them)."""
    from k3lab import bench

    records = bench.load_records(device=HEADLINE_DEVICE, root=root / "profiles")
    head = ("<tr><th>optimization</th><th>what it does</th><th>H200 case</th><th>before</th><th>after</th>"
            "<th>speedup (before / after)</th><th>peer</th><th>after vs peer (peer / after)</th>"
            "<th>floor</th>"
            "<th>checked on this machine</th><th>notebook</th></tr>")
    body = []
    for opt in OPTIMIZATIONS:
        nb = notebook_for(opt, root)
        title = f"<td><b>{html.escape(opt.title)}</b></td><td>{html.escape(opt.does)}</td>"
        if nb is None:
            body.append(f"<tr class='planned'>{title}<td colspan='9'><i>not built yet</i></td></tr>")
            continue
        rows = headline_rows(opt, records)
        span = f" rowspan='{len(rows)}'" if len(rows) > 1 else ""
        title = title.replace("<td>", f"<td{span}>")
        status = "<br>".join(map(html.escape, _status(opt, nb, checks)))
        link = f"<a href='notebooks/{nb.stem}.html'>{html.escape(nb.stem)}</a>"
        tail = f"<td{span}>{status}</td><td{span}>{link}</td>"
        if not rows:
            note = html.escape(opt.note or "no H200 record yet")
            body.append(f"<tr>{title}<td colspan='7'><i>{note}</i></td>{tail}</tr>")
            continue
        for i, r in enumerate(rows):
            nums = "".join(f"<td class='num'>{html.escape(v)}</td>" for v in row_cells(r))
            mode = f" ({r['mode']})" if r["mode"] else ""
            case = f"<td>{html.escape(r['label'] + mode)}</td>"
            body.append(f"<tr>{title if i == 0 else ''}{case}{nums}{tail if i == 0 else ''}</tr>")
    return "<table class='front'>" + head + "".join(body) + "</table>" + serving_section(root)


# ------------------------------------------------------------------ the serving curve (notebook 09)
def _svg_fronts(rows: list[dict], target: float, band: dict | None = None, width: int = 560,
                height: int = 300) -> str:
    """The rungs' fronts as one inline SVG: log tokens/s/user across, tokens/s/GPU up, the target dashed;
    with `band` (bands.band of the all-on rung) the area between its low and high fronts shaded."""
    ring = ((band or {}).get("low") or []) + ((band or {}).get("high") or [])[::-1]
    pts = [p for r in rows for p in r["front"]] + ring
    if not pts:
        return ""
    xs = [math.log10(max(p["tokens_per_s_user"], 1e-3)) for p in pts]
    x0, x1 = min(xs + [math.log10(target)]), max(xs + [math.log10(target)])
    y1 = max(p["tokens_per_s_gpu"] for p in pts) or 1.0
    m = 36

    def xy(u, g):
        x = m + (math.log10(max(u, 1e-3)) - x0) / max(x1 - x0, 1e-9) * (width - 2 * m)
        return f"{x:.1f},{height - m - g / y1 * (height - 2 * m):.1f}"

    def line(name: str, front: list[dict], color: str) -> str:
        return (f"<polyline fill='none' stroke='{color}' stroke-width='1.5' points='"
                + " ".join(xy(p["tokens_per_s_user"], p["tokens_per_s_gpu"]) for p in front)
                + f"'><title>{html.escape(name)}</title></polyline>")

    colors = ["#7f7f7f", "#8c564b", "#e377c2", "#bcbd22", "#17becf", "#9467bd", "#d62728", "#ff7f0e",
              "#1f77b4"]
    lines = [line(r["rung"], r["front"], colors[i % len(colors)]) for i, r in enumerate(rows) if r["front"]]
    if ring:
        lines.insert(0, "<polygon fill='#1f77b4' fill-opacity='0.15' stroke='none' points='"
                     + " ".join(xy(p["tokens_per_s_user"], p["tokens_per_s_gpu"]) for p in ring)
                     + "'><title>all on, projected band</title></polygon>")
    tx = xy(target, 0).split(",")[0]
    return (f"<svg width='{width}' height='{height}' role='img'>"
            "<rect width='100%' height='100%' fill='white'/>"
            f"<line x1='{tx}' x2='{tx}' y1='{m}' y2='{height - m}' stroke='#999' stroke-dasharray='4'/>"
            + "".join(lines)
            + f"<text x='{m}' y='{height - 8}' font-size='11'>tokens/s/user (P90, log) &#8594;</text>"
            + "<text x='4' y='14' font-size='11'>projected total tokens/s/GPU "
            + f"(up to {plain(y1)})</text></svg>")


def _tokens(v: float) -> str:
    return plain(v) if v else "none reaches it"


def band_phrase(low: float, high: float, fmt=None) -> str:
    """'band L to H', or, where no configuration reaches the target at the band's low end (low 0),
    'band up to H, with none reaching the target at its low end'; `fmt` writes a figure (default plain)."""
    fmt = fmt or plain
    if not low:
        return f"band up to {fmt(high)}, with none reaching the target at its low end"
    return f"band {fmt(low)} to {fmt(high)}"


def _ratio(v: float | None) -> str:
    return "unbounded" if v is None else f"{v:.2f}"


@functools.lru_cache(maxsize=2)
def _serving_numbers(root: Path) -> dict:
    """What the serving section shows, from the committed records through the serving study: the MI355X
    ladder, the step model's measured error (validate.model_error), the all-on band and the calibration
    ratios (bands), and the serving model's error against the measured serving runs (readme.run_error).
    Computed once per root and process (a few seconds; the committed records do not change
    while a report is built). LookupError, ImportError or ValueError when the records are missing."""
    from k3lab import bench
    from k3lab.report.readme import run_error
    from k3lab.serving import bands, curve, hardware, inputs, validate

    inp = inputs.node_inputs(root=root / "profiles")
    work = curve.agent_workload()
    target = hardware.SEED["interactivity"]
    err = validate.model_error(root=root / "profiles")
    return {
        "target": target, "rows": curve.ladder(inp, hardware.gpu("mi355x"), work, target=target),
        "checks": [r for r in bench.load_records("serving", device=HEADLINE_DEVICE, root=root / "profiles")
                   if r.case.startswith("validate.")],
        "steps": len(inputs.step_points(root=root / "profiles")), "error": err,
        "band": bands.band(inp, "mi355x", work, error=err, target=target, per_source=False),
        "calibration": bands.calibration(inp, work, error=err, target=target),
        "run_error": run_error(root),
    }


def serving_section(root: Path) -> str:
    """The serving curve on the first screen: each rung's front on 8x MI355X, projected, and its
    tokens/s/GPU at the article's interactivity and at a target every rung reaches, with what is measured
    (the H200 step records, the held-out error of their fit), modelled and projected told apart. Every
    figure of the table is labelled a projection and carries the step model's measured error
    (`serving.validate.model_error`) and the all-on band (`serving.bands.band`); the article's measured
    figures appear only as calibration ratios (article over projection, `serving.bands.calibration`), never
    beside a projection. Reads the committed records through the serving study; a 'not drawn' line when
    they are missing."""
    try:
        return serving_html(_serving_numbers(root))
    except (LookupError, ImportError, ValueError) as exc:
        return f"<h2>The serving curve</h2><p><i>not drawn: {html.escape(str(exc))}</i></p>"


def serving_html(n: dict) -> str:
    """The serving section's HTML from `_serving_numbers`' dict (split out so a test can plant a figure)."""
    from k3lab.serving import curve

    rows, target, err, b = n["rows"], n["target"], n["error"], n["band"]
    reach = curve.reachable_target(rows)
    low = {r["rung"]: r for r in curve.shares_at(rows, reach)}
    worst = max((abs(r.extra["rel_err"]) for r in n["checks"]), default=float("nan"))
    body = "".join(
        f"<tr><td>{html.escape(r['rung'])}</td><td class='num'>{plain(r['at_target'])}</td>"
        f"<td class='num'>{plain(r['gain'])}</td><td class='num'>{plain(low[r['rung']]['at_target'])}</td>"
        f"<td class='num'>{plain(low[r['rung']]['gain'])}</td></tr>" for r in rows)
    a = b["at_target"]
    cal = "; ".join(f"{html.escape(c['gpu'])} {_ratio(c['ratio_central'])} (over the band: "
                    f"{_ratio(c['ratio_range'][0])} to {_ratio(c['ratio_range'][1])})"
                    for c in n["calibration"])
    return (
        "<h2>The serving curve (8x MI355X, projected; notebook 09)</h2>"
        f"<p><b>Measured:</b> one TP8 rank's decode step on the H200 ({n['steps']} graph-replayed steps), "
        f"fitted per variant; its {len(n['checks'])} held-out steps are within {worst:.1%} (validate.* "
        "records). <b>Modelled:</b> collectives over the published links, DCP's exchange, the drafter, "
        "prefill, the prefix hit rate. <b>Projected:</b> the MI355X (its bandwidth, matrix rate, memory, "
        "link): every tokens/s figure below is a projection, not a measurement.</p>"
        f"<p class='projection'><b>The projection's measured error:</b> the step model's, "
        f"{html.escape(err['kind'])}: up to {err['worst']:.0%} (serving.validate.model_error, "
        f"{err['points']} points). All on, projected at {plain(target)} tokens/s/user: "
        f"{_tokens(a['central'])} tokens/s/GPU, {band_phrase(a['low'], a['high'])} (that "
        "error, the prefix hit rate, acceptance and call latency at their ends; serving.bands; shaded "
        "below).</p>"
        + (f"<p class='run-error'>{html.escape(n['run_error'])}</p>" if n.get("run_error") else "")
        + _svg_fronts(rows, target, b)
        + "<table class='front'><tr><th>rung (the article's order)</th>"
        f"<th>projected tokens/s/GPU at {plain(target)} tokens/s/user (error up to {err['worst']:.0%})</th>"
        f"<th>its share (projected)</th><th>projected tokens/s/GPU at {plain(reach)} tokens/s/user, which "
        f"every rung reaches (error up to {err['worst']:.0%})</th>"
        "<th>its share (projected)</th></tr>" + body + "</table>"
        f"<p class='calibration'><b>Calibration, not a comparison:</b> the article's measured tokens/s/GPU "
        f"at {plain(target)} tokens/s/user over the model's projection of the article's stack on the same "
        f"GPU: {cal}. A factor for reading a projection, not a check of the model: the stacks, the "
        "workload and the hit rates differ (serving.bands.calibration; docs/serving.md).</p>")

