"""Notebook 09's figures and its what-if explorer: the fronts of a ladder, one configuration's front under
a Scenario, and the sliders that redraw it.

The explorer sets its figure and table as the Output widget's state from the kernel (no capture of cell
output: see k3lab.studies.draft_depth.explorer for why), and `whatif` is the same computation as a plain
call for a reader without widgets.
"""

from __future__ import annotations

import pandas as pd

from k3lab import plots
from k3lab.serving import article, curve, hardware

WHATIF_DEFAULTS = dict(gpu="mi355x", context=1.0, hit_rate=None, acceptance=1.0, max_depth=curve.MAX_DEPTH,
                       dcp="1 or 8")
DCP_CHOICES = {"1 or 8": None, "1": (1,), "8": (8,)}


def curve_figure(rows: list[dict], target: float, title: str):
    """One line per rung (its Pareto front), tokens/s/GPU against tokens/s/user, the target dotted."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for row in rows:
        fr = row["front"]
        fig.add_trace(go.Scatter(x=[p["tokens_per_s_user"] for p in fr],
                                 y=[p["tokens_per_s_gpu"] for p in fr], mode="lines+markers",
                                 name=row["rung"]))
    fig.add_vline(x=target, line_dash="dot")
    fig.update_layout(title=title, xaxis_title="tokens/s/user (P90)", yaxis_title="total tokens/s/GPU",
                      xaxis_type="log", height=460)
    return fig


def band_figure(bands: list[dict], target: float, title: str):
    """Projected fronts as bands (k3lab.serving.bands.band): per band its central front (a line) and the
    region between its low and high fronts (filled), named 'projected' with the error the band carries;
    tokens/s/GPU against tokens/s/user, the target dotted."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for b in bands:
        hi, lo = b["high"], b["low"]
        xs = [p["tokens_per_s_user"] for p in hi] + [p["tokens_per_s_user"] for p in lo[::-1]]
        ys = [p["tokens_per_s_gpu"] for p in hi] + [p["tokens_per_s_gpu"] for p in lo[::-1]]
        name = f"{b['gpu']}, {b['memory_gb']:g} GB (projected)"
        fig.add_trace(go.Scatter(x=xs, y=ys, fill="toself", mode="none", opacity=0.25, name=f"{name}: band",
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=[p["tokens_per_s_user"] for p in b["central"]],
                                 y=[p["tokens_per_s_gpu"] for p in b["central"]], mode="lines+markers",
                                 name=name))
    if bands:
        fig.add_annotation(text=f"band: step model error ({bands[0]['error_kind']}, worst "
                                f"{bands[0]['error_worst']:.0%}), hit rate, acceptance, call latency",
                           xref="paper", yref="paper", x=0, y=1.08, showarrow=False, font=dict(size=10))
    fig.add_vline(x=target, line_dash="dot")
    fig.update_layout(title=title, xaxis_title="tokens/s/user (P90)", yaxis_title="total tokens/s/GPU",
                      xaxis_type="log", height=460)
    return fig


GENERATED = "<!-- generated: "
END = "<!-- end generated -->"


def docs_sections(root=None) -> dict[str, str]:
    """docs/serving.md's generated sections, by the expression their marker names: the step model's
    errors (serving.validate.report_markdown), the projections' bands and calibration
    (serving.bands.report_markdown) and the model's choice at the article's targets
    (serving.article.settings_markdown), computed from the committed records under `root`."""
    from k3lab.serving import article, bands, inputs, validate

    inp, work = inputs.node_inputs(root=root), curve.agent_workload()
    err = validate.model_error(root=root)
    return {"k3lab.serving.validate.report_markdown()": validate.report_markdown(root=root),
            "k3lab.serving.bands.report_markdown(inputs.node_inputs(), curve.agent_workload(), "
            "validate.model_error())": bands.report_markdown(inp, work, err),
            "k3lab.serving.article.settings_markdown(inputs.node_inputs(), curve.agent_workload(), "
            "validate.model_error())": article.settings_markdown(inp, work, err)}


def update_docs(path=None, root=None) -> list[str]:
    """Rewrite the generated sections of docs/serving.md (between '<!-- generated: EXPR -->' and
    '<!-- end generated -->') from the committed records, after new records (an H100 grid, a refit);
    returns the expressions whose section changed. ValueError when a marker the page names is unknown."""
    from pathlib import Path

    from k3lab import bench

    path = Path(path) if path else Path(bench.PROFILES).parent / "docs" / "serving.md"
    text = path.read_text()
    sections = docs_sections(root)
    changed, out, pos = [], [], 0
    while (i := text.find(GENERATED, pos)) >= 0:
        head_end = text.index(" -->", i) + len(" -->")
        expr = text[i + len(GENERATED):head_end - len(" -->")]
        if expr not in sections:
            raise ValueError(f"{path} names an unknown generated section: {expr!r}")
        j = text.index(END, head_end)
        new = "\n" + sections[expr] + "\n"
        if text[head_end:j] != new:
            changed.append(expr)
        out.append(text[pos:head_end] + new)
        pos = j
    path.write_text("".join(out) + text[pos:])
    return changed


def whatif(inp, work, *, gpu: str = "mi355x", context: float = 1.0, hit_rate: float | None = None,
           acceptance: float = 1.0, max_depth: int = curve.MAX_DEPTH, dcp: str = "1 or 8",
           target: float = hardware.SEED["interactivity"], error: dict | None = None):
    """The all-on front under a what-if (inputs `context` times as long, a fixed prefix `hit_rate` or
    None for the modelled one, acceptance scaled, depth capped, DCP '1', '8' or '1 or 8') on `gpu`:
    (figure, table of the front). The title labels the figure modelled (the H200) or projected (another
    GPU) with the step model's measured error (`error`, default validate.model_error() on the committed
    records). ValueError naming a bad argument before anything is computed."""
    if dcp not in DCP_CHOICES:
        raise ValueError(f"dcp must be one of {list(DCP_CHOICES)}, got {dcp!r}")
    g = hardware.gpu(gpu)
    sc = curve.Scenario(hit_rate=hit_rate, acceptance=acceptance, max_depth=int(max_depth))
    w = work.scaled(context)
    from k3lab.studies.serving import H200_MEMORY_GB

    mem = H200_MEMORY_GB if gpu == "h200" else None
    fr = curve.front(curve.candidates(inp, curve.RUNGS[-1], g, w, memory_gb=mem, dcp=DCP_CHOICES[dcp],
                                      scenario=sc))
    at = curve.at_interactivity(fr, target)
    hits = "modelled hits" if hit_rate is None else f"hits {hit_rate:.0%}"
    kind = "modelled" if gpu == "h200" else "projected"
    fig = curve_figure([{"rung": f"all on (what-if, {kind})", "front": fr}], target,
                       f"{g.name}, {kind}: inputs x {context:g}, {hits}, acceptance x {acceptance:g}, DCP "
                       f"{dcp}: {at:,.0f} tokens/s/GPU at {target:g} tokens/s/user<br><sup>step model error: "
                       f"{article.error_text(error)}</sup>")
    cols = ["dcp", "depth", "concurrency", "tokens_per_s_user", "tokens_per_s_gpu", "hit_rate", "cycle_ms"]
    return fig, pd.DataFrame(fr)[cols].round(3) if fr else pd.DataFrame(columns=cols)


def explorer(inp, work, **defaults):
    """Sliders and menus for `whatif`'s knobs; the figure and table follow them. Needs ipywidgets."""
    import ipywidgets as w


    v = {**WHATIF_DEFAULTS, **defaults}
    style, layout = dict(description_width="160px"), w.Layout(width="480px")
    controls = dict(
        gpu=w.Dropdown(options=list(hardware.GPUS), value=v["gpu"], description="GPU", style=style),
        context=w.FloatSlider(value=v["context"], min=0.25, max=1.5, step=0.05, description="inputs x",
                              style=style, layout=layout, continuous_update=False),
        hit_rate=w.FloatSlider(value=v["hit_rate"] if v["hit_rate"] is not None else 0.96, min=0.5, max=0.99,
                               step=0.01, description="prefix hit rate", style=style, layout=layout,
                               continuous_update=False),
        acceptance=w.FloatSlider(value=v["acceptance"], min=0.5, max=1.15, step=0.05,
                                 description="acceptance x", style=style, layout=layout,
                                 continuous_update=False),
        max_depth=w.IntSlider(value=v["max_depth"], min=0, max=curve.MAX_DEPTH, description="draft depth <=",
                              style=style, layout=layout, continuous_update=False),
        dcp=w.Dropdown(options=list(DCP_CHOICES), value=v["dcp"], description="DCP", style=style),
    )
    out = w.Output()

    def redraw(_change=None):
        fig, table = whatif(inp, work, **{name: c.value for name, c in controls.items()})
        out.outputs = (plots.figure_output(fig), plots.table_output(table))

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.VBox(list(controls.values())), out])
