"""Figures and tables of the draft_depth study (notebook 06): the formula against the simulation, the
z-scores, the token-level check, the break-even and rate curves, and the depth explorer. They read
`k3lab.speculative`'s results and launch nothing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from k3lab import plots
from k3lab import speculative as spec

MAX_Z = 3.0  # a simulation within 3 standard errors of the formula agrees with it


def agreement_figure(acceptance, sims: list[spec.CycleStats], *, title: str | None = None):
    """The formula for every depth (line) and simulated means with +-3 standard errors (points)."""
    import plotly.graph_objects as go

    formula = spec.expected_committed_all(acceptance)
    depths = np.arange(1, formula.size + 1)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=depths, y=formula, mode="lines+markers", name="formula",
                             line=dict(color="#7f7f7f")))
    fig.add_trace(go.Scatter(
        x=[s.depth for s in sims], y=[s.mean for s in sims], mode="markers", name="simulated (+-3 SE)",
        marker=dict(color="#2ca02c", size=9, symbol="x"),
        error_y=dict(type="data", array=[3 * s.stderr for s in sims], visible=True),
        customdata=[[s.cycles, s.z_score(formula[s.depth - 1])] for s in sims],
        hovertemplate="depth %{x}: %{y:.4f} committed<br>%{customdata[0]:,} cycles, z = "
                      "%{customdata[1]:+.2f}"))
    fig.update_layout(title=title or "Expected committed tokens per cycle: formula and simulation",
                      xaxis_title="drafted tokens per cycle (depth)",
                      yaxis_title="committed tokens per cycle (incl. recovery/bonus)",
                      template="plotly_white")
    return fig


def z_figure(z_scores: Sequence[float], depths: Sequence[int] | None = None, *, title: str | None = None):
    """One bar per random curve: (simulated - formula) / standard error, inside the +-3 band."""
    import plotly.graph_objects as go

    labels = [f"curve {i + 1}" + (f" (k={depths[i]})" if depths is not None else "") for i
              in range(len(z_scores))]
    fig = go.Figure(go.Bar(x=labels, y=list(z_scores), marker_color="#1f77b4", name="z"))
    for y in (-MAX_Z, MAX_Z):
        fig.add_hline(y=y, line=dict(color="#d62728", dash="dash"))
    fig.update_layout(title=title or "Simulation minus formula, in standard errors (random curves)",
                      yaxis_title="z", yaxis_range=[-4, 4], template="plotly_white")
    return fig


def token_figure(stats: Mapping[str, spec.TokenStats], previous_token: int = 0, *, title: str | None = None):
    """What followed ``previous_token`` in the committed output, per simulation, beside the target."""
    import plotly.graph_objects as go

    first = next(iter(stats.values()))
    vocab = first.target.shape[0]
    if not 0 <= previous_token < vocab:
        raise ValueError(f"previous_token must be in [0, {vocab}); got {previous_token}")
    fig = go.Figure(go.Bar(x=list(range(vocab)), y=first.target[previous_token], name="target p(x | prev)",
                           marker_color="#7f7f7f"))
    colors = ["#2ca02c", "#d62728", "#1f77b4", "#9467bd"]
    for (label, s), color in zip(stats.items(), colors):
        row = s.transitions[previous_token]
        _, _, pval = s.chi_square()
        fig.add_trace(go.Bar(x=list(range(vocab)), y=row / max(row.sum(), 1), marker_color=color,
                             name=f"{label} (all rows: chi-square p = {pval:.2g})"))
    fig.update_layout(barmode="group", template="plotly_white",
                      title=title or f"Committed tokens after token {previous_token}: observed vs target",
                      xaxis_title="token", yaxis_title="frequency", xaxis_dtick=1)
    return fig


def breakeven_figure(acceptance, *, title: str | None = None):
    """For each step k -> k + 1: how much longer the cycle may get before the deeper draft loses."""
    import plotly.graph_objects as go

    growth = spec.break_even_growth(acceptance)
    committed = spec.expected_committed_all(acceptance)
    steps = [f"{k} -> {k + 1}" for k in range(1, growth.size + 1)]
    fig = go.Figure(go.Bar(
        x=steps, y=100 * growth,
        marker_color=["#d62728" if k == 3 else "#1f77b4" for k in range(1, growth.size + 1)],
        text=[f"{100 * g:.1f}%" for g in growth], textposition="outside",
        customdata=np.stack([committed[:-1], committed[1:]], axis=1),
        hovertemplate="%{x} drafts: %{customdata[0]:.2f} -> %{customdata[1]:.2f} committed<br>"
                      "break-even cycle growth %{y:.1f}%"))
    fig.update_layout(title=title or "Break-even cycle growth for one more draft",
                      xaxis_title="drafts per cycle", yaxis_title="allowed cycle growth (%)",
                      template="plotly_white")
    return fig


def rate_figure(acceptance, profiles: Mapping[str, spec.CycleCosts], *, max_depth: int | None = None,
                title: str | None = None):
    """Committed tokens per second (per sequence) against depth, one line per cost profile, the
    best depth of each marked; dotted: plain decode (no speculation) for that profile."""
    import plotly.graph_objects as go

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    fig = go.Figure()
    plain_drawn: set[float] = set()
    for (name, costs), color in zip(profiles.items(), colors):
        choice = spec.best_depth(acceptance, costs, max_depth=max_depth)
        t = choice.table
        fig.add_trace(go.Scatter(
            x=t["depth"], y=t["tokens_per_s"], mode="lines+markers", name=name, line=dict(color=color),
            customdata=np.stack([t["committed"], t["cycle_us"]], axis=1),
            hovertemplate="depth %{x}: %{y:,.1f} tokens/s<br>%{customdata[0]:.2f} committed per "
                          "%{customdata[1]:,.0f} us cycle"))
        fig.add_trace(go.Scatter(x=[choice.depth], y=[choice.tokens_per_s], mode="markers", showlegend=False,
                                 marker=dict(symbol="star", size=16, color=color),
                                 hovertemplate=f"best for {name}: depth {choice.depth}"))
        if isinstance(costs, spec.CycleCosts):
            plain = round(1e6 / costs.plain_decode_us(), 6)
            label = {} if plain in plain_drawn else {"annotation_text": "plain decode",
                                                     "annotation_position": "bottom right"}
            fig.add_hline(y=plain, line=dict(color=color, dash="dot", width=1), **label)
            plain_drawn.add(plain)
    fig.update_layout(title=title or "Committed tokens per second against draft depth (stars: best)",
                      xaxis_title="drafted tokens per cycle (depth)",
                      yaxis_title="committed tokens / s per sequence", template="plotly_white")
    return fig


EXPLORER_DEFAULTS = dict(first=0.835, decay=0.951, draft_step_us=400.0, verify_one_us=10_000.0,
                         verify_extra_position_us=150.0, commit_us=150.0, max_depth=8)


# the growth columns compare a depth with the next one, which the deepest depth of a table does not have
_NO_DEEPER = "— (the deepest depth: none after it)"


def depth_table(choice: spec.DepthChoice):
    """`choice.table` (speculative.best_depth) as the notebook and the explorer show it: rounded to three
    decimals, the deepest depth's growth columns saying why they are empty instead of NaN."""
    return plots.say_missing(choice.table, {"break_even_growth": _NO_DEEPER, "cycle_growth": _NO_DEEPER},
                             digits=3)


def explorer_costs(*, draft_step_us: float, verify_one_us: float, verify_extra_position_us: float,
                   commit_us: float, max_depth: int) -> spec.CycleCosts:
    return spec.linear_costs(draft_step_us=draft_step_us, verify_one_us=verify_one_us,
                             verify_extra_position_us=verify_extra_position_us, commit_us=commit_us,
                             max_depth=max_depth, source="explorer sliders (user-given)")


def explorer_figure(*, first: float, decay: float, max_depth: int, **costs):
    """The explorer's figure for one set of slider values (also drawn statically in the notebook)."""
    curve = spec.geometric_acceptance(first, decay, max_depth)
    choice = spec.best_depth(curve, explorer_costs(max_depth=max_depth, **costs))
    title = (f"a[i] = {first:.3f} x {decay:.3f}^i: best depth {choice.depth}, "
             f"{choice.table['speedup_vs_plain'].iloc[choice.depth - 1]:.2f}x plain decode")
    return rate_figure(curve, {"sliders": explorer_costs(max_depth=max_depth, **costs)}, title=title), choice


def explorer(**defaults):
    """Sliders for the acceptance curve (first, decay) and the cycle costs; the figure and the
    per-depth table follow them. Needs ipywidgets (a JupyterLab front end to move the sliders)."""
    import ipywidgets as w

    v = {**EXPLORER_DEFAULTS, **defaults}
    style = dict(description_width="180px")
    layout = w.Layout(width="520px")

    def slider(cls, name, lo, hi, step, label):
        return cls(value=v[name], min=lo, max=hi, step=step, description=label, style=style, layout=layout,
                   continuous_update=False)

    controls = dict(
        first=slider(w.FloatSlider, "first", 0.05, 1.0, 0.005, "acceptance of draft 1"),
        decay=slider(w.FloatSlider, "decay", 0.5, 1.0, 0.005, "decay per position"),
        draft_step_us=slider(w.FloatSlider, "draft_step_us", 0.0, 5_000.0, 50.0, "drafter step (us)"),
        verify_one_us=slider(w.FloatSlider, "verify_one_us", 1_000.0, 50_000.0, 500.0,
                             "target step, 1 position (us)"),
        verify_extra_position_us=slider(w.FloatSlider, "verify_extra_position_us", 0.0, 5_000.0, 50.0,
                                        "each extra position (us)"),
        commit_us=slider(w.FloatSlider, "commit_us", 0.0, 2_000.0, 10.0, "commit overhead (us)"),
        max_depth=slider(w.IntSlider, "max_depth", 2, 12, 1, "deepest draft shown"),
    )
    out = w.Output()

    def redraw(_change=None):
        # The figure and the table become the Output's state, set from the kernel in one update. Nothing
        # is captured from the cell's messages (no `with out:`, no interactive_output, which draws inside
        # an Output of its own): a headless executor's Output mimic (nbclient's, under stock `jupyter
        # nbconvert --execute` and papermill) echoes each captured output back to the kernel on the shell
        # socket while it awaits the cell's reply, and then sat on that reply until its per-cell timeout.
        fig, choice = explorer_figure(**{name: c.value for name, c in controls.items()})
        out.outputs = (plots.figure_output(fig), plots.table_output(depth_table(choice)))

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return w.VBox([w.VBox(list(controls.values())), out])
