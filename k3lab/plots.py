"""Plotly figures for notebooks and the report: plain go.Figure objects, no renderer set, no I/O.

A figure returned here shows in JupyterLab (plotly's mimetype renderer) and in exported HTML
(fig.to_html) the same way. k3lab.bench and k3lab.profile never import this module, so plotly is
only needed where figures are drawn.

- before_after(records or compare() frame): grouped bars per case, peers and floor as lines.
- size_sweep(records): time (or bytes/s) against a size, per variant, with the floor (log-log).
- kernel_bars({variant: kernel table}): per-kernel stacked bars per variant.
- timeline({variant: kernels}): a Gantt-like kernel timeline per variant.
- roofline(points): arithmetic intensity against achieved TFLOP/s under bandwidth and compute ceilings.
- study_roofline(study): a study's committed records on that roofline, with the device's measured ceilings.
- records_table(records): the records as a table figure.
- trend(history): a study's records over time (median and ratio to the floor).
- say_missing(frame, why): a DataFrame for display whose missing values say why they are missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import pandas as pd
import plotly.graph_objects as go

from k3lab import bench
from k3lab import env as _env

__all__ = ["before_after", "kernel_bars", "records_table", "roofline", "say_missing", "size_sweep",
           "study_roofline", "timeline", "trend"]

_VARIANT_COLORS = {"before": "#d62728", "after": "#2ca02c", "reference": "#7f7f7f"}
_PEER_COLORS = ["#1f77b4", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
_CATEGORY_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                    "#bcbd22", "#17becf"]


def _records_list(obj) -> list[bench.Record] | None:
    if isinstance(obj, pd.DataFrame):
        return None
    items = list(obj)
    if not all(isinstance(r, bench.Record) for r in items):
        raise ValueError("expected a list of bench.Record or a bench.compare() DataFrame")
    return items


def _case_label(row, multi_mode: bool, multi_device: bool) -> str:
    label = str(row["case"])
    if multi_mode:
        label += f" [{row['mode']}]"
    if multi_device:
        label += f" ({row['device']})"
    return label


def before_after(df_or_records, *, log: bool = False, title: str | None = None, unit: str = "us",
                 cases: list[str] | None = None) -> go.Figure:
    """Grouped bars of before / after / reference per case (20th-80th percentile whiskers when
    records are given), each peer as a line with markers, and the floor as a dashed line.

    df_or_records: list of bench.Record (any studies) or a bench.compare() DataFrame. log: log-scale
    time axis (for cases spanning orders of magnitude). cases: keep only these cases, in this order."""
    if unit not in ("us", "ms"):
        raise ValueError(f"unit must be 'us' or 'ms', got {unit!r}")
    records = _records_list(df_or_records)
    table = bench.compare(records) if records is not None else df_or_records.copy()
    needed = {"case", "mode", "device", "before_us", "after_us", "floor_us"}
    if not needed <= set(table.columns):
        raise ValueError(f"the DataFrame needs columns {sorted(needed)} (from bench.compare); "
                         f"got {list(table.columns)}")
    if cases is not None:
        order = {c: i for i, c in enumerate(cases)}
        table = table[table["case"].isin(order)]
        table = table.iloc[sorted(range(len(table)), key=lambda i: order[table["case"].iloc[i]])]
    scale = 1.0 if unit == "us" else 1e-3
    multi_mode = table["mode"].nunique() > 1
    multi_device = table["device"].nunique() > 1
    x = [_case_label(row, multi_mode, multi_device) for _, row in table.iterrows()]

    spread = {}
    if records is not None:
        for r in records:
            spread[(r.device, r.study, r.case, r.mode, r.variant)] = (r.p20_us, r.p80_us)

    def _mode_of(row, variant):
        # compare() labels mixed rows 'before:eager after:graph'
        label = str(row["mode"])
        pairs = dict(p.split(":", 1) for p in label.split() if ":" in p)
        return pairs.get(variant, label)

    fig = go.Figure()
    for variant in ("before", "after", "reference"):
        col = f"{variant}_us"
        if col not in table or table[col].isna().all():
            continue
        y = table[col] * scale
        err = None
        if spread:
            lo, hi = [], []
            for _, row in table.iterrows():
                p = spread.get((row["device"], row["study"], row["case"], _mode_of(row, variant), variant))
                med = row[col]
                lo.append((med - p[0]) * scale if p and not math.isnan(med) else 0.0)
                hi.append((p[1] - med) * scale if p and not math.isnan(med) else 0.0)
            err = {"type": "data", "symmetric": False, "array": hi, "arrayminus": lo, "thickness": 1}
        fig.add_trace(go.Bar(name=variant, x=x, y=y, error_y=err, marker_color=_VARIANT_COLORS[variant],
                             hovertemplate=f"%{{x}}<br>{variant}: %{{y:.3g}} {unit}<extra></extra>"))
    peer_cols = [c for c in table.columns if c.endswith("_us") and c not in
                 {"before_us", "after_us", "reference_us", "floor_us", "peer_us"}]
    for i, col in enumerate(peer_cols):
        if table[col].isna().all():
            continue
        peer = col[:-3]
        fig.add_trace(go.Scatter(name=f"peer: {peer}", x=x, y=table[col] * scale, mode="lines+markers",
                                 line={"color": _PEER_COLORS[i % len(_PEER_COLORS)], "width": 2},
                                 hovertemplate=f"%{{x}}<br>{peer}: %{{y:.3g}} {unit}<extra></extra>"))
    if not table["floor_us"].isna().all():
        fig.add_trace(
            go.Scatter(
                name="floor",
                x=x,
                y=table["floor_us"] * scale,
                mode="lines+markers",
                line={"color": "black", "dash": "dash", "width": 1.5},
                marker={"symbol": "line-ew-open", "size": 14},
                hovertemplate=f"%{{x}}<br>floor: %{{y:.3g}} {unit}<extra></extra>",
            )
        )
    fig.update_layout(barmode="group", title=title, xaxis_title="case", yaxis_title=f"time per call ({unit})",
                      legend_title_text="variant", template="plotly_white")
    if log:
        fig.update_yaxes(type="log")
    return fig


def size_sweep(records: Iterable[bench.Record], *, size_key: str = "bytes", throughput: bool = False,
               title: str | None = None) -> go.Figure:
    """Time per call (or achieved GB/s with throughput=True, from extra['bytes_moved'] or the size)
    against shape[size_key], one line per (variant, mode), with the floor; log-log axes. Records
    without shape[size_key] are left out."""
    rows = []
    for r in records:
        if size_key not in r.shape:
            continue
        moved = r.extra.get("bytes_moved", r.shape[size_key])
        rows.append({"size": r.shape[size_key], "series": f"{r.variant} ({r.mode})", "variant": r.variant,
                     "us": r.median_us, "p20": r.p20_us, "p80": r.p80_us, "floor": r.floor_us,
                     "gbs": moved / r.median_us / 1e3 if r.median_us > 0 else math.nan})
    if not rows:
        raise ValueError(f"no record has shape[{size_key!r}]; nothing to plot")
    df = pd.DataFrame(rows).sort_values("size")
    fig = go.Figure()
    for i, (series, sub) in enumerate(df.groupby("series", sort=True)):
        color = _VARIANT_COLORS.get(sub["variant"].iloc[0], _PEER_COLORS[i % len(_PEER_COLORS)])
        if throughput:
            fig.add_trace(go.Scatter(name=series, x=sub["size"], y=sub["gbs"], mode="lines+markers",
                                     line={"color": color}))
        else:
            fig.add_trace(go.Scatter(name=series, x=sub["size"], y=sub["us"], mode="lines+markers",
                                     line={"color": color},
                                     error_y={"type": "data", "symmetric": False, "array": sub["p80"]
                                              - sub["us"],
                                                  "arrayminus": sub["us"] - sub["p20"], "thickness": 1}))
    floors = df.dropna(subset=["floor"]).groupby("size", as_index=False)["floor"].max()
    if not floors.empty:
        if throughput:
            bw = _env.detect().peak.bandwidth_tbs * 1e3  # GB/s; flat ceiling
            fig.add_trace(
                go.Scatter(
                    name=f"bandwidth ({bw:.0f} GB/s)",
                    x=[df["size"].min(), df["size"].max()],
                    y=[bw, bw],
                    mode="lines",
                    line={"color": "black", "dash": "dash"},
                )
            )
        else:
            fig.add_trace(go.Scatter(name="floor", x=floors["size"], y=floors["floor"], mode="lines",
                                     line={"color": "black", "dash": "dash"}))
    fig.update_xaxes(type="log", title=f"{size_key}")
    fig.update_yaxes(type="log", title="achieved GB/s" if throughput else "time per call (us)")
    fig.update_layout(title=title, template="plotly_white")
    return fig


def _check_frames(frames: dict, needed: set, what: str) -> None:
    if not isinstance(frames, dict) or not frames:
        raise ValueError(f"{what} must be a non-empty dict variant -> DataFrame")
    for variant, df in frames.items():
        if not isinstance(df, pd.DataFrame):
            raise ValueError(f"{what}[{variant!r}] must be a DataFrame, got {type(df).__name__}")  # noqa: TRY004 - bad input is a ValueError here
        missing = needed - set(df.columns)
        if missing:
            raise ValueError(f"{what}[{variant!r}] lacks columns {sorted(missing)}")


def short_kernel_name(name: str, width: int = 48) -> str:
    """A legend-sized kernel name: C++ templates and argument lists dropped ('void at::native::
    elementwise_kernel<128, 2, ...>(int, ...)' -> 'at::native::elementwise_kernel')."""
    text = str(name)
    if text.startswith("void "):
        text = text[5:]
    for stop in ("<", "("):
        if stop in text and text.index(stop) > 0:
            text = text[: text.index(stop)]
    return text if len(text) <= width else text[: width - 1] + "…"


def kernel_bars(tables: dict[str, pd.DataFrame], *, by: str = "name", top: int = 12,
                title: str | None = None) -> go.Figure:
    """One stacked bar per variant, one segment per kernel (by='name') or per category
    (by='category'), height = total_us. The `top` largest kernels across variants keep their own
    segment; the rest are summed as 'other'. tables: variant -> profile kernel table (name, category,
    calls, total_us)."""
    if by not in ("name", "category"):
        raise ValueError(f"by must be 'name' or 'category', got {by!r}")
    _check_frames(tables, {"name", "category", "total_us"}, "tables")
    frames = []
    for variant, df in tables.items():
        agg_cols = {"total_us": "sum"} | ({"calls": "sum"} if "calls" in df else {})
        g = df.groupby(by, as_index=False).agg(agg_cols)
        g["variant"] = variant
        frames.append(g)
    allk = pd.concat(frames, ignore_index=True)
    if "calls" not in allk:
        allk["calls"] = math.nan
    ranking = allk.groupby(by)["total_us"].sum().sort_values(ascending=False)
    keep = list(ranking.index[:top])
    allk["segment"] = allk[by].where(allk[by].isin(keep), "other")
    seg = allk.groupby(["segment", "variant"], as_index=False).agg({"total_us": "sum", "calls": "sum"})
    order = keep + (["other"] if (seg["segment"] == "other").any() else [])
    variants = list(tables)
    fig = go.Figure()
    for i, name in enumerate(order):
        sub = seg[seg["segment"] == name].set_index("variant").reindex(variants)
        label = short_kernel_name(name) if by == "name" else str(name)
        fig.add_trace(go.Bar(name=label, x=variants, y=sub["total_us"].fillna(0.0),
                             customdata=sub["calls"].fillna(0).to_numpy(),
                             marker_color=_CATEGORY_COLORS[i % len(_CATEGORY_COLORS)] if name != "other"
                             else "#cccccc",
                             hovertemplate=f"{name}<br>%{{x}}: %{{y:.3g}} us in %{{customdata}} "
                                           f"calls<extra></extra>"))
    totals = seg.groupby("variant")["total_us"].sum().reindex(variants)
    fig.add_trace(
        go.Scatter(
            name="total",
            x=variants,
            y=totals,
            mode="text",
            text=[f"{v:.3g} us" for v in totals],
            textposition="top center",
            showlegend=False,
        )
    )
    fig.update_layout(barmode="stack", title=title, yaxis_title="GPU time per step (us)",
                      xaxis_title="variant",
                      legend_title_text="kernel" if by == "name" else "category", template="plotly_white")
    return fig


def timeline(kernels: dict[str, pd.DataFrame], *, title: str | None = None,
             max_kernels: int = 2000) -> go.Figure:
    """A Gantt-like timeline: one row per variant, one bar per kernel from start_us for dur_us
    (times relative to the variant's first kernel), coloured by category. kernels: variant -> profile
    kernel DataFrame (name, category, start_us, dur_us). At most `max_kernels` kernels per variant
    are drawn (the first ones); the title says when some were left out."""
    _check_frames(kernels, {"name", "category", "start_us", "dur_us"}, "kernels")
    parts = []
    cut = {}
    for variant, df in kernels.items():
        d = df.sort_values("start_us")
        if len(d) > max_kernels:
            cut[variant] = len(d) - max_kernels
            d = d.iloc[:max_kernels]
        d = d.assign(variant=variant, t0=d["start_us"] - (d["start_us"].min() if len(d) else 0.0))
        parts.append(d)
    allk = pd.concat(parts, ignore_index=True)
    cats = sorted(allk["category"].astype(str).unique())
    fig = go.Figure()
    for i, cat in enumerate(cats):
        sub = allk[allk["category"].astype(str) == cat]
        fig.add_trace(go.Bar(name=cat, orientation="h", y=sub["variant"], x=sub["dur_us"], base=sub["t0"],
                             customdata=sub[["name"]].to_numpy(),
                             marker_color=_CATEGORY_COLORS[i % len(_CATEGORY_COLORS)],
                             hovertemplate="%{customdata[0]}<br>start %{base:.2f} us, %{x:.2f} us<extra>"
                             + cat +
                             "</extra>"))
    note = "" if not cut else " (left out: " + ", ".join(f"{v}: {n}" for v, n in cut.items()) + " kernels)"
    fig.update_layout(barmode="overlay", title=(title or "kernel timeline") + note, xaxis_title="time (us)",
                      yaxis={"title": "variant", "categoryorder": "array",
                             "categoryarray": list(kernels)[::-1]},
                      legend_title_text="category", template="plotly_white")
    return fig


def _roofline_points(points) -> pd.DataFrame:
    if isinstance(points, pd.DataFrame):
        df = points.copy()
    else:
        items = list(points)
        if items and all(isinstance(p, bench.Record) for p in items):
            df = pd.DataFrame([{"name": f"{r.case} {r.variant}", "flops": r.extra.get("flops", 0),
                                "bytes": r.extra.get("bytes_moved", r.extra.get("bytes", 0)),
                                "time_us": r.median_us} for r in items])
        else:
            df = pd.DataFrame(items)
    needed = {"name", "flops", "bytes", "time_us"}
    if not needed <= set(df.columns):
        raise ValueError(f"roofline points need {sorted(needed)} (one per kernel or op); got "
                         f"{list(df.columns)}")
    return df


def _ceiling_traces(fig: go.Figure, pk, lo: float, hi: float, *, projected: bool = False) -> None:
    ridge = pk.bf16_tflops / pk.bandwidth_tbs  # flop/byte where the two ceilings meet
    style = {"color": "#888888", "dash": "dot"} if projected else {"color": "black", "dash": "dash"}
    tag = f"{pk.name}: " if projected else ""
    fig.add_trace(go.Scatter(name=f"{tag}bandwidth {pk.bandwidth_tbs:.3g} TB/s", x=[lo, ridge],
                             y=[lo * pk.bandwidth_tbs, pk.bf16_tflops], mode="lines", line=style))
    fig.add_trace(go.Scatter(name=f"{tag}matrix {pk.bf16_tflops:.4g} TFLOP/s", x=[ridge, hi],
                             y=[pk.bf16_tflops, pk.bf16_tflops], mode="lines",
                             line={**style, "dash": "dot" if projected else "solid"}))


def _source_note(pk) -> str:
    bw = getattr(pk, "bandwidth_source", None)
    mat = getattr(pk, "bf16_source", None) or getattr(pk, "matrix_source", None)
    return f"<br><sup>bandwidth: {bw}; matrix: {mat}</sup>" if bw and mat else ""


def _isa_traces(fig: go.Figure, df: pd.DataFrame, isa) -> str:
    """Draw profiling.isa_roofline.project's rows (aligned with `df`) as open diamonds at the TFLOP/s
    MI355X would need, each joined to its measured point by a dotted line; a legend entry counts the
    points without ISA facts. Returns the title's note."""
    from k3lab.profiling import isa_roofline as ir

    if not isinstance(isa, pd.DataFrame) or len(isa) != len(df) or "need_tflops" not in isa.columns:
        rows = f" of {len(isa)} rows" if isinstance(isa, pd.DataFrame) else ""
        raise ValueError(f"isa: expected profiling.isa_roofline.project(points), one row per point "
                         f"({len(df)}), got {type(isa).__name__}{rows}")
    has = isa["why_not"].isna().to_numpy() & (df["time_us"] > 0).to_numpy()
    got = isa[has].reset_index(drop=True)
    meas = df[has].reset_index(drop=True)
    if len(got):
        x = (got["flops"] / got["bytes"]).tolist()
        fig.add_trace(go.Scatter(name=ir.LABEL, x=x, y=got["need_tflops"].tolist(), mode="markers",
                                 marker={"symbol": "diamond-open", "size": 13, "color": "#444444",
                                         "line": {"width": 2}},
                                 text=[ir.hover(r) for _, r in got.iterrows()], legendgroup="isa",
                                 hovertemplate="%{text}<extra></extra>"))
        xs, ys = [], []
        for xi, m, n in zip(x, meas["flops"] / meas["time_us"] / 1e6, got["need_tflops"]):
            xs += [xi, xi, None]
            ys += [m, n, None]
        fig.add_trace(go.Scatter(name=ir.LABEL + ": from the measured point", x=xs, y=ys, mode="lines",
                                 line={"color": "#444444", "dash": "dot", "width": 1}, legendgroup="isa",
                                 showlegend=False, hoverinfo="skip"))
    missing = len(df) - len(got)
    if missing:
        fig.add_trace(go.Scatter(name=f"no gfx950 ISA facts, nothing drawn: {missing} of {len(df)} points",
                                 x=[None], y=[None], mode="markers", legendgroup="isa",
                                 marker={"symbol": "diamond-open", "color": "#bbbbbb"}))
    return f" · MI355X ISA projection for {len(got)} of {len(df)} points"


def roofline(points, *, peak=None, title: str | None = None, projected=None, isa=None) -> go.Figure:
    """Arithmetic intensity (flop/byte) against achieved TFLOP/s, log-log, under the bandwidth slope
    and the matrix ceiling of `peak` (an env.Peak or profiling.roofline.Ceilings; default:
    k3lab.env.detect().peak), the device's name and each ceiling's source in the title. points: a DataFrame
    or list of dicts with name, flops, bytes, time_us (and optionally variant: one marker colour per
    variant; work: where a point's bytes and flops come from, on its hover), or bench.Records carrying
    extra['flops'] and extra['bytes_moved']. `projected`: another device's ceilings
    (profiling.roofline.projected_ceilings), drawn dotted grey and labelled as such.
    `isa`: profiling.isa_roofline.project(points), one row per point: where a point's kernel has gfx950
    ISA facts, an open diamond at the TFLOP/s MI355X would need for its floor, labelled "projected (ISA,
    not measured)"; a legend entry counts the points without them. Points without flops or bytes cannot
    sit on a roofline; the title counts them."""
    df = _roofline_points(points)
    pk = peak if peak is not None else _env.detect().peak
    ok = (df["flops"] > 0) & (df["bytes"] > 0) & (df["time_us"] > 0)
    shown = df[ok].assign(intensity=lambda d: d["flops"] / d["bytes"],
                          tflops=lambda d: d["flops"] / d["time_us"] / 1e6)
    ridges = [pk.bf16_tflops / pk.bandwidth_tbs] + ([projected.bf16_tflops / projected.bandwidth_tbs]
                                                     if projected is not None else [])
    lo = min([min(ridges) / 100] + list(shown["intensity"] / 2))
    hi = max([max(ridges) * 100] + list(shown["intensity"] * 2))
    fig = go.Figure()
    _ceiling_traces(fig, pk, lo, hi)
    if projected is not None:
        _ceiling_traces(fig, projected, lo, hi, projected=True)
    groups = ([("measured", shown)] if "variant" not in shown.columns
              else list(shown.groupby("variant", sort=False)))
    for i, (label, sub) in enumerate(groups):
        color = _VARIANT_COLORS.get(label, _PEER_COLORS[i % len(_PEER_COLORS)])
        marker = {"size": 10, **({"color": color} if "variant" in shown.columns else {})}
        source = "work" in sub.columns and sub["work"].notna().any()
        hover = "%{text}<br>%{x:.3g} flop/B, %{y:.3g} TFLOP/s" + ("<br>bytes and flops: %{customdata}"
                                                                  if source else "")
        fig.add_trace(go.Scatter(name=str(label), x=sub["intensity"], y=sub["tflops"], mode="markers+text",
                                 text=sub["name"], textposition="top center",
                                 marker=marker,
                                 customdata=sub["work"].fillna("not given") if source else None,
                                 hovertemplate=hover + "<extra></extra>"))
    left_out = int((~ok).sum())
    note = f" ({left_out} points without flops/bytes not shown)" if left_out else ""
    if isa is not None:
        note += _isa_traces(fig, df.reset_index(drop=True), isa.reset_index(drop=True)
                            if isinstance(isa, pd.DataFrame) else isa)
    fig.update_xaxes(type="log", title="arithmetic intensity (flop / byte)")
    fig.update_yaxes(type="log", title="achieved TFLOP/s")
    fig.update_layout(title=(title or f"roofline: {pk.name}") + note + _source_note(pk),
                      template="plotly_white")
    return fig


def study_roofline(study: str, *, device: str = "nvidia-h200", cases=None, modes=None, records=None,
                   projected: str | None = None, title: str | None = None, isa: bool = True) -> go.Figure:
    """The roofline of a study's committed records on `device` (profiling.roofline: the problem's bytes
    and flops per case, this device's measured ceilings where records hold them). decode_step draws the
    parts of its attribution records (`cases`: which attribution cases). `projected`: a k3lab.env.PEAKS
    name (e.g. 'MI355X') whose datasheet ceilings are added, labelled projected; for 'MI355X' also (unless
    `isa=False`) what each point's kernel would need there from its gfx950 ISA facts
    (profiling.isa_roofline), where it has them."""
    from k3lab.profiling import isa_roofline as ir
    from k3lab.profiling import roofline as rl

    recs = list(records) if records is not None else bench.load_records(study, device=device)
    recs = [r for r in recs if r.study == study]
    if not recs:
        raise ValueError(f"study: no {study!r} records for device {device!r}")
    if study == "decode_step":
        att = [r for r in recs if "parts" in r.extra and (cases is None or r.case in cases)]
        pts = pd.concat([rl.step_points(r) for r in att], ignore_index=True) if att else rl.points([])
    else:
        pts = rl.points(recs, cases=cases, modes=modes)
    if not len(pts):
        raise ValueError(f"cases: none of {study!r}'s records on {device!r} has bytes and flops "
                         f"(cases asked: {cases})")
    ceil = rl.ceilings(device)
    proj = rl.projected_ceilings(projected) if projected else None
    facts = ir.project(pts) if isa and projected == "MI355X" else None
    return roofline(pts, peak=ceil, projected=proj, isa=facts,
                    title=title or f"{study} roofline on {ceil.device} (committed records)")


def trend(history: pd.DataFrame, *, title: str | None = None) -> go.Figure:
    """A study's records over time (profiling.trend.history): median_us (log) above, the ratio to the
    floor below, one line per device, variant and mode, each point hovering its case and the commit it
    measured. ValueError on an empty history."""
    from plotly.subplots import make_subplots

    need = {"date", "median_us", "floor_ratio", "device", "variant", "mode", "case", "record_commit"}
    if not isinstance(history, pd.DataFrame) or not need <= set(history.columns):
        raise ValueError(f"history: expected profiling.trend.history's DataFrame (columns {sorted(need)})")
    if history.empty:
        raise ValueError("history: no records to draw")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("median (us)", "median / floor"))
    groups = history.groupby(["device", "variant", "mode"], sort=False)
    for i, ((device, variant, mode), g) in enumerate(groups):
        color = _VARIANT_COLORS.get(variant, _PEER_COLORS[i % len(_PEER_COLORS)])
        label = f"{variant} {mode}" + (f" ({device})" if history["device"].nunique() > 1 else "")
        text = [f"{c} @ {str(k)[:9]}" for c, k in zip(g["case"], g["record_commit"])]
        dash = "dot" if mode == "graph" else "solid"
        fig.add_trace(go.Scatter(name=label, legendgroup=label, x=g["date"], y=g["median_us"], text=text,
                                 mode="lines+markers", line={"color": color, "dash": dash},
                                 hovertemplate="%{text}<br>%{y:.4g} us<extra></extra>"), row=1, col=1)
        ok = g["floor_ratio"].notna()
        if ok.any():
            fig.add_trace(go.Scatter(name=label, legendgroup=label, showlegend=False, x=g["date"][ok],
                                     y=g["floor_ratio"][ok], text=[t for t, k in zip(text, ok) if k],
                                     mode="lines+markers", line={"color": color, "dash": dash},
                                     hovertemplate="%{text}<br>%{y:.3g} x floor<extra></extra>"),
                          row=2, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    fig.update_yaxes(type="log", row=2, col=1)
    fig.update_xaxes(title="measured (record date)", row=2, col=1)
    fig.update_layout(title=title or "records over time", template="plotly_white")
    return fig


def records_table(records: Iterable[bench.Record], *, title: str | None = None) -> go.Figure:
    """The records as a table: study, case, variant, mode, device, median/p20/p80, floor, max_rel,
    commit, date."""
    df = bench.records_frame(list(records))
    if df.empty:
        raise ValueError("records is empty: nothing to tabulate")
    cols = ["study", "case", "variant", "mode", "device", "median_us", "p20_us", "p80_us", "floor_us",
            "max_rel",
            "commit", "date"]
    df = df[cols].copy()
    for c in ("median_us", "p20_us", "p80_us", "floor_us", "max_rel"):
        df[c] = [("" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3g}") for v in df[c]]
    df["commit"] = df["commit"].str.slice(0, 12) + df["commit"].str.endswith("-dirty").map({True: "-dirty",
                                                                                          False: ""})
    fig = go.Figure(go.Table(header={"values": cols, "align": "left"},
                             cells={"values": [df[c].tolist() for c in cols], "align": "left"}))
    fig.update_layout(title=title, template="plotly_white")
    return fig


def figure_output(fig) -> dict:
    """A plotly figure as one display_data output (the plotly mimetype JupyterLab draws), for an
    ipywidgets Output whose outputs are set from the kernel: nothing is captured, so stock nbclient
    (nbconvert, papermill) has nothing to echo and never waits on it."""
    import json

    return {"output_type": "display_data", "metadata": {},
            "data": {"application/vnd.plotly.v1+json": json.loads(fig.to_json()),
                     "text/plain": repr(fig)[:200]}}


def table_output(table) -> dict:
    """A DataFrame as one display_data output (HTML and text), for the same Output widgets."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"text/html": table.to_html(), "text/plain": table.to_string()}}


def say_missing(frame: pd.DataFrame, why: dict[str, str] | str, digits: int | None = None) -> pd.DataFrame:
    """`frame` for display: rounded to `digits` decimals where given, and every missing value (NaN,
    None, NA) replaced by the text that says why it is missing: `why[column]`, or `why` itself for every
    column when it is a string. A shown table never holds a bare NaN or None: a column with missing
    values and no reason raises ValueError naming it. The frame is not changed; computations should go on
    using it, not the returned copy, whose columns with reasons are text."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"frame must be a pandas DataFrame, got {type(frame).__name__}")
    if not isinstance(why, (str, dict)) or (isinstance(why, dict) and not all(
            isinstance(v, str) and v for v in why.values())) or why == "":
        raise TypeError(f"why must be a non-empty string or a dict of column -> non-empty string, "
                        f"got {why!r}")
    if digits is not None and (not isinstance(digits, int) or isinstance(digits, bool) or digits < 0):
        raise ValueError(f"digits must be a non-negative int or None, got {digits!r}")
    out = frame.round(digits) if digits is not None else frame.copy()
    missing = [c for c in out.columns if out[c].isna().any()]
    reasons = {c: why for c in missing} if isinstance(why, str) else {c: why.get(c) for c in missing}
    unsaid = [str(c) for c in missing if reasons[c] is None]
    if unsaid:
        raise ValueError(f"why gives no reason for the missing values of column(s) {', '.join(unsaid)} "
                         f"(it names {', '.join(map(str, why)) or 'no column'})")
    for c in missing:
        out[c] = out[c].astype(object).where(out[c].notna(), reasons[c])
    return out
