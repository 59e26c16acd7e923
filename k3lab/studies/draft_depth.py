"""Study: how many tokens to draft (seed section 6), and how fast the simulator behind it runs.

The lesson lives in `k3lab.speculative` (expected committed tokens, cycle costs, best depth); what this
study measures is the machinery that backs the formula up:

- `cycles_depth<k>` (k = 3, 4, 7): 10^6 draft-verify cycles on the reference acceptance curve.
  'before' = the plain loop over cycles and positions, 'after' = the vectorised numpy simulator;
  both read the same uniform draws, so their counts must be identical (checked first), and the
  mean must lie within 3 standard errors of the formula. Timed with k3lab.bench's CPU timer; numpy
  runs this on one core. Each record carries the process CPU seconds per wall second of its timing
  run (at most 1.0 shows one core; well below 1.0 means other processes shared it and the wall
  figures are inflated) and the CPU time per call, which such sharing does not inflate.
- `random_curves`: 20 random acceptance curves of depth 1..8, 10^5 cycles each: the largest
  |z| between simulator and formula (must be < 3) and the time of the whole sweep.
- `tokens_v8_depth4`: token-level rejection sampling over an 8-token vocabulary with random
  target and draft logits (each conditioned on the previous token): the chi-square p-value of the
  committed tokens against the target distribution and the |z| of the mean against the exact
  curve derived from the two distributions.

Everything here runs on the host CPU whatever the machine has; the model preset does not change
this study (it is accepted so every study has the same signature).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from k3lab import bench, plots
from k3lab import speculative as spec
from k3lab.studies import select_cases

NAME = "draft_depth"

CYCLES = 1_000_000
DEPTHS = (3, 4, 7)
CURVE_DEPTH = 8
RANDOM_CURVES = 20
RANDOM_CYCLES = 100_000
TOKEN_VOCAB = 8
TOKEN_DEPTH = 4
TOKEN_CYCLES = 200_000
MAX_Z = 3.0
MIN_P_VALUE = 1e-3
_SEED = 20261201


def case_names(preset=None) -> list[str]:
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    return [f"cycles_depth{k}" for k in DEPTHS] + ["random_curves",
                                                   f"tokens_v{TOKEN_VOCAB}_depth{TOKEN_DEPTH}"]


def _time_on_cpu(fn: Callable[[], object], repeats: int) -> tuple[bench.Timing, dict]:
    """bench's CPU timer around fn, plus two figures from the process CPU clock over the whole
    timing run: cpu_per_wall (CPU seconds per wall second: about 1.0 when one core did the work,
    well below 1.0 when other processes shared the core, which inflates the wall-clock figures) and
    cpu_us_per_call (mean CPU time of one call, which such sharing does not inflate)."""
    warmup = 1
    c0, w0 = time.process_time(), time.perf_counter()
    timing = bench.time_fn(fn, warmup=warmup, repeats=repeats, device="cpu")
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    calls = warmup + timing.repeats
    return timing, {"cpu_per_wall": cpu / wall, "cpu_us_per_call": cpu / calls * 1e6}


def _cycles_case(case: str, depth: int) -> list[bench.Record]:
    curve = spec.reference_acceptance(CURVE_DEPTH)
    expected = spec.expected_committed(curve, depth)
    fast = spec.simulate_cycles(curve, depth, CYCLES, seed=_SEED)
    slow = spec.simulate_cycles_loop(curve, depth, CYCLES, seed=_SEED)
    if not np.array_equal(fast.counts, slow.counts):
        raise bench.CheckFailed(f"{case}: the vectorised and loop simulators counted different cycles: "
                                f"{fast.counts.tolist()} vs {slow.counts.tolist()}")
    z = fast.z_score(expected)
    if not abs(z) < MAX_Z:
        raise bench.CheckFailed(f"{case}: simulated {fast.mean:.5f} +- {fast.stderr:.5f} committed tokens, "
                                f"formula {expected:.5f}: {z:+.2f} standard errors")
    error = {"formula": expected, "simulated": fast.mean, "stderr": fast.stderr, "z": z,
             "counts_identical": True}
    shape = {"cycles": CYCLES, "depth": depth, "curve": "reference (geometric fit to 3.00 / 3.36)"}
    out = []
    for variant, fn, repeats in (("before", lambda: spec.simulate_cycles_loop(curve, depth, CYCLES), 2),
                                 ("after", lambda: spec.simulate_cycles(curve, depth, CYCLES), 20)):
        timing, cpu = _time_on_cpu(fn, repeats)
        out.append(bench.make_record(
            NAME, case, variant, timing, shape=shape, dtype="float64", error=error,
            cycles_per_s=CYCLES / (timing.median_us * 1e-6), **cpu,
            runs_on="host CPU, numpy (single-threaded)",
            implementation="python loop over cycles" if variant == "before" else "numpy, 64K-cycle chunks",
            floor_note="no hardware floor: a host-side simulation"))
    return out


def _random_curves() -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(_SEED)
    curves = []
    for _ in range(RANDOM_CURVES):
        depth = int(rng.integers(1, CURVE_DEPTH + 1))
        curves.append((rng.uniform(0.0, 1.0, size=depth), depth))
    return curves


def _random_curves_case(case: str) -> list[bench.Record]:
    curves = _random_curves()

    def sweep():
        return [spec.simulate_cycles(a, k, RANDOM_CYCLES, seed=_SEED + i) for i, (a, k) in enumerate(curves)]

    zs = [s.z_score(spec.expected_committed(a, k)) for s, (a, k) in zip(sweep(), curves)]
    worst = int(np.argmax(np.abs(zs)))
    if not abs(zs[worst]) < MAX_Z:
        a, k = curves[worst]
        raise bench.CheckFailed(f"{case}: curve {np.round(a, 3).tolist()} (depth {k}) is {zs[worst]:+.2f} "
                                f"standard errors from the formula")
    timing, cpu = _time_on_cpu(sweep, 5)
    error = {"max_abs_z": float(abs(zs[worst])), "z": [float(z) for z in zs], "curves": RANDOM_CURVES}
    return [bench.make_record(NAME, case, "after", timing,
                              shape={"curves": RANDOM_CURVES, "cycles_each": RANDOM_CYCLES,
                                     "depths": [k for _, k in curves]},
                              dtype="float64", error=error, **cpu,
                              runs_on="host CPU, numpy (single-threaded)")]


def token_logits(vocab: int = TOKEN_VOCAB, spread: float = 0.8, seed: int = _SEED):
    """Random target logits [V, V] (row = previous token) and draft logits = target + noise."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(vocab, vocab))
    return target, target + spread * rng.normal(size=(vocab, vocab))


def _tokens_case(case: str) -> list[bench.Record]:
    target, draft = token_logits()

    def run_once():
        return spec.simulate_tokens(target, draft, TOKEN_DEPTH, TOKEN_CYCLES, seed=_SEED)

    stats = run_once()
    stat, dof, pval = stats.chi_square()
    z = stats.z_score(stats.expected)
    if not (pval > MIN_P_VALUE and abs(z) < MAX_Z):
        raise bench.CheckFailed(f"{case}: committed tokens vs target: chi-square {stat:.1f} on {dof} dof "
                                f"(p = {pval:.2e}); mean {stats.mean:.4f} vs exact {stats.expected:.4f} "
                                f"({z:+.2f} standard errors)")
    timing, cpu = _time_on_cpu(run_once, 5)
    error = {"chi_square": stat, "dof": dof, "p_value": pval, "z": z, "simulated": stats.mean,
             "formula": stats.expected, "acceptance": [float(x) for x in stats.acceptance]}
    return [bench.make_record(NAME, case, "after", timing,
                              shape={"cycles": TOKEN_CYCLES, "depth": TOKEN_DEPTH, "vocab": TOKEN_VOCAB},
                              dtype="float64", error=error, **cpu,
                              runs_on="host CPU, numpy (single-threaded)")]


def run(preset=None, cases=None) -> list[bench.Record]:
    """Check each case (counts identical, |z| < 3, chi-square p > 1e-3; CheckFailed otherwise),
    then time it. Returns the records; saves nothing."""
    cases = select_cases(case_names(preset), cases)
    records: list[bench.Record] = []
    for case in cases:
        if case.startswith("cycles_depth"):
            records += _cycles_case(case, int(case.removeprefix("cycles_depth")))
        elif case == "random_curves":
            records += _random_curves_case(case)
        else:
            records += _tokens_case(case)
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """One simulator step per variant: 10^6 cycles at depth 4 on the reference curve."""
    case_names(preset)
    curve = spec.reference_acceptance(CURVE_DEPTH)
    return {"before": lambda: spec.simulate_cycles_loop(curve, 4, CYCLES),
            "after": lambda: spec.simulate_cycles(curve, 4, CYCLES)}


# --------------------------------------------------------------------------------------------
# Figures and the explorer for notebook 06 (plotly and ipywidgets are imported only here)
# --------------------------------------------------------------------------------------------


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
