"""Tables and figures of the agent_cache study (notebook 07): the AgentX-like workload, the seed's resume
example, hit rate and recomputed tokens against the HBM budget and the checkpoint interval (the simulator
replayed on the host), restore against recompute, and the seed's headline arithmetic, labelled."""

from __future__ import annotations

import numpy as np
import pandas as pd

from k3lab import agentx, bench
from k3lab.cache import generate as gen
from k3lab.cache import resume, sim
from k3lab.cache.traces import Workload
from k3lab.config import GiB, K3Config
from k3lab.model import component_table

NAME = "agent_cache"

WORKLOAD = {"sessions": 72, "duration_s": 900.0, "seed": 3}  # about 70 sessions active at once
HOUR = {"sessions": 2600, "seed": 1}
MOE_FREED_GB = 3.85 * GiB / 1e9  # seed section 2: rows of the routed output projection no rank needs
HOST_GB = 224.875                # the AMD recipe's host cache per GPU
SEED_CONCURRENCY = 70
PUBLIC_H2D = 50e9                # H100, one way (vLLM's offloading blog): used only without a record
AGENTX_PUBLIC = {"turns per session (median)": 43, "prompt tokens (median)": 142_000,
                 "output tokens (median)": 444, "prefix reuse, unlimited cache": 0.95,
                 "subagent sessions per root session": "44% of sessions start subagents"}


# ------------------------------------------------------------------ the workload
def workload(**overrides) -> Workload:
    """The notebook's generated workload (WORKLOAD, overridable)."""
    kw = {**WORKLOAD, **overrides}
    return gen.generate(kw.pop("sessions"), **kw)


def workload_table(w: Workload) -> pd.DataFrame:
    """The generated workload's medians beside the public AgentX figures (which it was drawn to match;
    sessions still running at the window's end are cut there, so a short window lowers the turns)."""
    roots = np.unique(w.session[w.kind == 0])
    turns = np.bincount(w.session)[roots]
    subs = np.unique(w.session[w.kind == 2])
    t = np.linspace(0.2, 0.8, 61) * w.t.max()
    got = {"turns per session (median)": float(np.median(turns)),
           "prompt tokens (median)": float(np.median(w.in_tokens)),
           "output tokens (median)": float(np.median(w.out_tokens)),
           "prefix reuse, unlimited cache": w.theoretical_reuse(),
           "subagent sessions per root session": len(subs) / max(1, len(roots))}
    rows = [{"quantity": k, "generated": v, "public AgentX": AGENTX_PUBLIC[k]} for k, v in got.items()]
    rows.append(
        {
            "quantity": "sessions active at once (median)",
            "generated": float(np.median(w.active_sessions(t))),
            "public AgentX": f"{SEED_CONCURRENCY} (the seed's highest concurrency)",
        }
    )
    rows.append({"quantity": "requests", "generated": len(w), "public AgentX": "393 traces, runs >= 900 s"})
    return pd.DataFrame(rows)


def workload_figure(w: Workload):
    """Turns per session, prompt lengths, reuse per request, and sessions active over time."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=2, subplot_titles=(
        "turns per session", "prompt tokens per request", "share of each prompt seen before",
        "sessions active"))
    fig.add_trace(go.Histogram(x=np.bincount(w.session)[np.unique(w.session[w.kind == 0])], nbinsx=30,
                               name="root sessions", marker_color="#1f77b4"), 1, 1)
    fig.add_trace(go.Histogram(x=np.bincount(w.session)[np.unique(w.session[w.kind == 2])], nbinsx=30,
                               name="subagents", marker_color="#ff7f0e"), 1, 1)
    fig.add_trace(go.Histogram(x=w.in_tokens, nbinsx=40, name="prompt", marker_color="#2ca02c"), 1, 2)
    fig.add_trace(go.Histogram(x=w.reuse_per_request() / w.in_tokens, nbinsx=40, name="reuse",
                               marker_color="#9467bd"), 2, 1)
    t = np.linspace(0, w.t.max(), 200)
    fig.add_trace(go.Scatter(x=t, y=w.active_sessions(t), mode="lines", name="active", line_color="#d62728"),
                  2, 2)
    fig.update_xaxes(title_text="seconds", row=2, col=2)
    fig.update_layout(height=560, title="the generated workload", barmode="overlay", showlegend=False)
    return fig


# ------------------------------------------------------------------ resume points
def resume_example(mla_reach: int = 3072, checkpoints=(1024, 2048), prompt_end: int = 3100,
                   mla_block: int = 1024) -> pd.DataFrame:
    """The seed's example computed by k3lab.cache.resume: MLA history to 3,072 (in blocks of
    `mla_block`), KDA checkpoints at 1,024 and 2,048, and the last turn's end at 3,100, without and
    with its tail saved beside a checkpoint there."""
    rows = []
    for tail in (False, True):
        ck = list(checkpoints) + ([prompt_end] if tail else [])
        reach = prompt_end if tail else mla_reach
        at = resume.resume_point(reach, ck, mla_block=mla_block, tail_saved=tail)
        rows.append({"tail saved": tail, "MLA stored to": resume.stored_mla_reach(reach, mla_block=mla_block,
                                                                               tail_saved=tail),
                     "KDA checkpoints": ck, "resume at": at, "recomputed": prompt_end - at})
    return pd.DataFrame(rows)


def resume_figure(table: pd.DataFrame | None = None, prompt_end: int = 3100):
    """Per row of `resume_example`: the MLA history held, the checkpoints, where it resumes, and the
    recomputed span."""
    import plotly.graph_objects as go

    table = resume_example() if table is None else table
    fig = go.Figure()
    for k, row in table.iterrows():
        y = "tail saved with the checkpoint" if row["tail saved"] else "blocks only (the seed's example)"
        fig.add_trace(go.Bar(y=[y], x=[row["MLA stored to"]], orientation="h", name="MLA history stored",
                             marker_color="#1f77b4", opacity=0.5, showlegend=k == 0, width=0.5))
        fig.add_trace(go.Bar(y=[y], x=[row["recomputed"]], base=[row["resume at"]], orientation="h",
                             name="recomputed", marker_color="#d62728", showlegend=k == 0, width=0.25))
        fig.add_trace(
            go.Scatter(
                y=[y] * len(row["KDA checkpoints"]),
                x=row["KDA checkpoints"],
                mode="markers",
                marker=dict(symbol="diamond", size=14, color="#2ca02c"),
                name="KDA checkpoint",
                showlegend=k == 0,
            )
        )
        fig.add_annotation(y=y, x=row["resume at"], text=f"resume at {row['resume at']:,}", yshift=24,
                           showarrow=False)
    fig.add_vline(x=prompt_end, line_dash="dot", annotation_text=f"prompt end {prompt_end:,}")
    fig.update_layout(barmode="overlay", height=300, xaxis_title="position",
                      title="where a returning turn resumes")
    return fig


# ------------------------------------------------------------------ the simulator's sweeps
VARIANTS = {  # label -> CacheConfig fields
    "grid 2,048, no tail, LRU": dict(checkpoint_interval=2048, tail_aligned=False, policy="lru"),
    "grid 2,048, no tail, resume-aware": dict(checkpoint_interval=2048, tail_aligned=False,
                                              policy="resume_aware"),
    "tail only, LRU": dict(checkpoint_interval=0, tail_aligned=True, policy="lru"),
    "tail only, resume-aware": dict(checkpoint_interval=0, tail_aligned=True, policy="resume_aware"),
}


def hbm_budget_gb(memory_gb: float = 288.0, reserve_gb: float = 13.0) -> float:
    """Cache budget per GPU: HBM less one TP8 rank's weights (MXFP4 experts, BF16 rest: k3lab.model)
    and a reserve for activations and graphs (an assumption). 288 GB (MI355X) gives 80 GB."""
    weights = sum(r["bytes"] for r in component_table(K3Config.full())) / 8 / 1e9
    return round(memory_gb - weights - reserve_gb)


def _row(w: Workload, cc: sim.CacheConfig, **labels) -> dict:
    r = sim.simulate(w, cc)
    return {**labels, "hit_rate": r.token_hit_rate, "mla_hit_rate": r.mla_hit_rate,
            "recomputed_tokens": r.recomputed_tokens, "host_hit_tokens": r.host_hit_tokens,
            "restore_s": r.restore_s, "recompute_s": r.recompute_s, "host_recompute_s": r.host_recompute_s}


def budget_sweep(w: Workload, budgets=(40, 60, 80, 100, 140, 200), variants=None, **kw) -> pd.DataFrame:
    """Hit rate and recomputed tokens per HBM budget (GB per GPU, TP8) and variant (VARIANTS)."""
    variants = VARIANTS if variants is None else variants
    return pd.DataFrame([_row(w, sim.CacheConfig.for_k3(g, **{**v, **kw}), budget_gb=g, variant=name)
                         for name, v in variants.items() for g in budgets])


def budget_figure(df: pd.DataFrame, *, mark: float | None = None):
    """Token hit rate and recomputed tokens against the budget, one line per variant."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("token hit rate", "recomputed tokens"))
    colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c"]
    for k, (name, part) in enumerate(df.groupby("variant", sort=False)):
        dash = "dot" if "LRU" in name else "solid"
        for col, y in ((1, "hit_rate"), (2, "recomputed_tokens")):
            fig.add_trace(go.Scatter(x=part["budget_gb"], y=part[y], mode="lines+markers", name=name,
                                     line=dict(color=colors[k % 4], dash=dash), showlegend=col == 1), 1, col)
    if mark is not None:
        fig.add_vline(x=mark, line_dash="dash", line_color="#999", annotation_text=f"{mark:g} GB")
    fig.update_xaxes(title_text="HBM cache budget per GPU (GB, TP8)")
    fig.update_layout(height=420, title="what the budget buys (one GPU's cache, ~70 sessions)")
    return fig


def interval_sweep(w: Workload, hbm_gb: float, intervals=(0, 1024, 2048, 4096, 8192, 16384),
                   policy: str = "resume_aware") -> pd.DataFrame:
    """Hit rate per checkpoint interval (0: prompt ends only), tail alignment off and on."""
    return pd.DataFrame([_row(w, sim.CacheConfig.for_k3(hbm_gb, checkpoint_interval=iv, tail_aligned=tail,
                                                         policy=policy),
                              interval=iv, tail_aligned=tail) for tail in (False, True) for iv in intervals])


def interval_figure(df: pd.DataFrame, hbm_gb: float):
    import plotly.graph_objects as go

    fig = go.Figure()
    for tail, part in df.groupby("tail_aligned"):
        fig.add_trace(
            go.Scatter(
                x=[str(v) if v else "ends only" for v in part["interval"]],
                y=part["hit_rate"],
                mode="lines+markers",
                name="tail saved" if tail else "whole blocks only",
                line_color="#2ca02c" if tail else "#d62728",
            )
        )
    fig.update_layout(height=380, xaxis_title="KDA checkpoint interval (positions)",
                      yaxis_title="token hit rate",
                      title=f"checkpoint interval and tail alignment at {hbm_gb:g} GB")
    return fig


def layout_table(w: Workload, hbm_gb: float, **kw) -> pd.DataFrame:
    """TP8 against DCP8 (an eighth of the MLA rows per GPU), each with and without MoE sharding's
    3.85 GiB, and with the recipe's host tier."""
    kw = {**VARIANTS["tail only, resume-aware"], **kw}
    rows = []
    for layout in ("tp8", "dcp8"):
        for extra, what in ((0.0, "HBM budget"), (MOE_FREED_GB, "+ 3.85 GiB (MoE rows)")):
            rows.append(_row(w, sim.CacheConfig.for_k3(hbm_gb + extra, layout=layout, **kw), layout=layout,
                             hbm=what, host_gb=0.0))
        rows.append(
            _row(
                w,
                sim.CacheConfig.for_k3(hbm_gb, layout=layout, host_gb=HOST_GB, **kw),
                layout=layout,
                hbm="HBM budget",
                host_gb=HOST_GB,
            )
        )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ restore against recompute
def h2d_rate(records=None) -> tuple[float, str]:
    """(bytes/s, label): the best pinned H2D median at 2 MiB and up from the committed H200 records
    (profiles/nvidia-h200/agent_cache), else the public ~50 GB/s H100 figure, labelled as such."""
    records = bench.load_records(NAME, "nvidia-h200") if records is None else records
    rates = [r.extra["gb_per_s"] for r in records if r.case.startswith("h2d_") and r.variant == "after"
             and r.shape.get("bytes", 0) >= 2 << 20]
    if rates:
        return max(rates) * 1e9, f"measured on the H200 (pinned, best block >= 2 MiB): {max(rates):.1f} GB/s"
    return PUBLIC_H2D, "public H100 figure (vLLM's offloading blog), not measured here: 50 GB/s"


def prefill_rate(tokens_per_s: float | None = None, *, peak_tflops: float | None = None,
                 efficiency: float = 0.4, config: K3Config | None = None) -> tuple[float, str]:
    """(tokens/s, label) of prefill per GPU: given, or modelled as peak x efficiency over 2 FLOP per
    active parameter of one TP8 rank (attention's context-dependent work left out). Defaults: the H200's
    bf16 matrix rate as k3lab.env.PEAKS holds it (and labels it) at 40%, both assumptions."""
    if peak_tflops is None:
        from k3lab.env import PEAKS

        peak_tflops = PEAKS["H200"].bf16_tflops
    if tokens_per_s is not None:
        return float(tokens_per_s), f"given: {tokens_per_s:,.0f} tokens/s per GPU"
    if not (peak_tflops > 0 and 0 < efficiency <= 1):
        raise ValueError(f"peak_tflops must be > 0 and efficiency in (0, 1], got {peak_tflops}, {efficiency}")
    active = (config or K3Config.tp_slice(8)).param_counts()[1]
    rate = peak_tflops * 1e12 * efficiency / (2 * active)
    return rate, (f"modelled: {active / 1e9:.1f}B active parameters per rank x 2 FLOP over {peak_tflops:g} "
                  f"TFLOP/s x {efficiency:.0%} = {rate:,.0f} tokens/s per GPU")


def break_even(h2d_bytes_per_s: float, prefill_tokens_per_s: float, *, layout: str = "tp8",
               tokens=(64, 256, 1024, 4096, 16384, 65536, 142_000)) -> pd.DataFrame:
    """Restoring n tokens' state from the host (their MLA rows and one KDA checkpoint) against
    recomputing them, per GPU; `break_even_tokens` is where the two times meet."""
    cc = sim.CacheConfig.for_k3(1, layout=layout)
    per_token = cc.mla_bytes_per_block / cc.block_size
    n = np.asarray(tokens, dtype=float)
    restore_s = (cc.kda_checkpoint_bytes + n * per_token) / h2d_bytes_per_s
    recompute_s = n / prefill_tokens_per_s
    gain = 1 / prefill_tokens_per_s - per_token / h2d_bytes_per_s
    even = cc.kda_checkpoint_bytes / h2d_bytes_per_s / gain if gain > 0 else np.inf
    return pd.DataFrame(
        {
            "tokens": n.astype(int),
            "restore_ms": restore_s * 1e3,
            "recompute_ms": recompute_s * 1e3,
            "recompute_over_restore": recompute_s / restore_s,
            "break_even_tokens": even,
        }
    )


def break_even_figure(df: pd.DataFrame, h2d_label: str, prefill_label: str):
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_trace(go.Scatter(x=df["tokens"], y=df["restore_ms"], mode="lines+markers", name="restore from "
                                                                                            "host",
                             line_color="#2ca02c"))
    fig.add_trace(go.Scatter(x=df["tokens"], y=df["recompute_ms"], mode="lines+markers", name="recompute "
                                                                                              "(prefill)",
                             line_color="#d62728"))
    fig.add_vline(x=float(df["break_even_tokens"].iloc[0]), line_dash="dot",
                  annotation_text=f"break-even {df['break_even_tokens'].iloc[0]:,.0f} tokens")
    fig.update_layout(height=400, xaxis_type="log", yaxis_type="log", xaxis_title="tokens resumed",
                      yaxis_title="ms per GPU",
                      title=f"restore vs recompute<br><sup>{h2d_label}; {prefill_label}</sup>")
    return fig


# ------------------------------------------------------------------ the headline arithmetic
def headline_table() -> pd.DataFrame:
    """The seed's figures recomputed from the seed's inputs (k3lab.agentx.SEED); nothing measured here."""
    a, b = agentx.SEED["mi355x"], agentx.SEED["b300"]
    r = agentx.compare(a, b)
    return pd.DataFrame([
        {"quantity": f"{a.name}: tokens/s/GPU, $/GPU-hour (the seed's inputs)",
         "value": f"{a.tokens_per_s_gpu:,.0f}, ${a.usd_per_gpu_hour:.2f}"},
        {"quantity": f"{b.name}: tokens/s/GPU, $/GPU-hour (the seed's inputs)",
         "value": f"{b.tokens_per_s_gpu:,.0f}, ${b.usd_per_gpu_hour:.2f}"},
        {"quantity": "MI355X tokens per dollar", "value": f"{r['tokens_per_dollar_a'] / 1e6:.2f} M"},
        {"quantity": "B300 tokens per dollar", "value": f"{r['tokens_per_dollar_b'] / 1e6:.2f} M"},
        {"quantity": "more tokens per dollar", "value": f"{100 * r['tokens_per_dollar_gain']:.1f}%"},
        {"quantity": "more throughput per GPU", "value": f"{100 * r['throughput_gain']:.1f}%"},
        {"quantity": "lower cost per token", "value": f"{100 * r['cost_per_token_lower']:.1f}%"},
    ])
