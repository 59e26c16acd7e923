"""The report's first screen: one row per optimization of the seed article.

The rows follow the map (`k3lab.optimizations.OPTIMIZATIONS`): each `Optimization` takes the entry's
title, what it does, its lesson notebook and the studies whose live run checks it, and adds its headline
cases: committed H200 records (profiles/nvidia-h200/<study>/) read at report time. An optimization
whose notebook is not in the tree is shown as "not built yet", so the table follows the tree without edits
when a notebook lands.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from pathlib import Path

from k3lab import optimizations

HEADLINE_DEVICE = optimizations.RECORDS_DEVICE


@dataclass(frozen=True)
class Headline:
    """One committed record set: `study`'s `case` timed in `mode`, shown as `label`."""

    study: str
    case: str
    mode: str
    label: str


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


# the committed cases each optimization's row shows, by the map's entry name
HEADLINES: dict[str, tuple[Headline, ...]] = {
    "dcp": (Headline("dcp", "merge_N8_B1", "graph", "merge of 8 partial results, B = 1 (torch / Triton)"),),
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
# what the H200 columns say for an optimization with no headline timing, by entry name
NOTES: dict[str, str] = {
    "draft_depth": "host-side arithmetic, no kernel: 3.00 tokens per cycle at 3 drafts, 3.36 at 4",
    "decode_step": "whole-step times per switch, all four cases from the committed H200 records: notebook "
                   "08's waterfall",
}

OPTIMIZATIONS: tuple[Optimization, ...] = tuple(
    Optimization(e.title, e.does, e.notebooks[0], e.studies, HEADLINES.get(e.name, ()), NOTES.get(e.name, ""))
    for e in optimizations.OPTIMIZATIONS)


@dataclass
class Checks:
    """What this machine's run found: per study and per notebook stem, 'passed' or a reason."""

    studies: dict[str, str] = field(default_factory=dict)
    notebooks: dict[str, str] = field(default_factory=dict)


def notebook_for(opt: Optimization, root: Path) -> Path | None:
    found = sorted((root / "notebooks").glob(opt.notebook))
    return found[0] if found else None


def headline_rows(opt: Optimization, records) -> list[dict]:
    """One dict per headline found in `records` (bench.Record list): label, before, after, peer
    (name and time), floor in microseconds, after/before and after/peer. Missing headlines are left out."""
    from k3lab import bench

    rows = []
    for h in opt.headlines:
        recs = [r for r in records if r.study == h.study and r.case == h.case and r.mode == h.mode]
        if not recs:
            continue
        row = bench.compare(recs).iloc[0]
        after = row["after_us"]
        rows.append({"label": h.label, "before": row["before_us"], "after": after, "peer": row["peer"],
                     "peer_us": row["peer_us"], "floor": row["floor_us"], "mode": h.mode,
                     "after/before": after / row["before_us"] if row["before_us"] > 0 else math.nan,
                     "after/peer": after / row["peer_us"] if row["peer_us"] > 0 else math.nan})
    return rows


def _us(value: float) -> str:
    if value is None or not math.isfinite(value):
        return ""
    if value >= 1e4:
        return f"{value / 1e3:.3g} ms"
    return f"{value:.0f} us" if value >= 100 else f"{value:.3g} us"


def _ratio(value: float) -> str:
    return f"{value:.2f}" if value is not None and math.isfinite(value) else ""


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
            "<th>peer</th><th>floor</th><th>after/before</th><th>after/peer</th>"
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
            peer = html.escape(f"{_us(r['peer_us'])} {r['peer']}") if r["peer"] else ""
            nums = "".join(f"<td class='num'>{v}</td>" for v in (
                _us(r["before"]), _us(r["after"]), peer, _us(r["floor"]), _ratio(r["after/before"]),
                _ratio(r["after/peer"])))
            case = f"<td>{html.escape(r['label'])} ({r['mode']})</td>"
            body.append(f"<tr>{title if i == 0 else ''}{case}{nums}{tail if i == 0 else ''}</tr>")
    return "<table class='front'>" + head + "".join(body) + "</table>"
