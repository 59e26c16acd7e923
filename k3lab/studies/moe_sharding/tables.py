"""Tables and figures of the moe_sharding study (notebook 02): who computes what, the tail's bytes and
FLOPs, the memory freed and the cache it buys, the expert-tile padding, the one-GPU records as text.

Plain pandas frames and plotly go.Figure objects, no renderer set and no I/O.
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from k3lab import bench
from k3lab import env as _env
from k3lab.config import GiB
from k3lab.parallel import moe_tail as mt

NAME = "moe_sharding"

# The seed's own figures (vLLM PR 59591's AgentX experiment on eight MI355X): not measured here.
SEED_CACHE_RUN = {"concurrency": 70, "hit_rate_before": 0.748, "hit_rate_after": 0.801,
                  "throughput_gain": 0.289, "gain_at_32_and_48": "< 1%"}
CONVERSATION_TOKENS = 142_000  # the AgentX median input (docs/k3.md)


def ownership_figure(world_size: int = 8, hidden: int = 7168) -> go.Figure:
    """Two panels, ranks x output coordinates of up_proj: before, every rank computes every
    coordinate (the same numbers world_size times); after, rank r computes only its slice."""
    check = mt.check_world_size(world_size, hidden=hidden)
    cols = [f"{b * hidden // check}-{(b + 1) * hidden // check - 1}" for b in range(world_size)]
    ranks = [f"rank {r}" for r in range(world_size)]
    before = [[2] * world_size for _ in range(world_size)]
    after = [[1 if b == r else 0 for b in range(world_size)] for r in range(world_size)]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=(
        f"before: replicated up_proj ({hidden} rows on every rank)",
        f"after: sharded ({hidden // world_size} rows per rank)"))
    scale = [[0, "#f2f2f2"], [0.33, "#f2f2f2"], [0.33, "#2ca02c"], [0.66, "#2ca02c"], [0.66, "#d62728"],
             [1, "#d62728"]]
    labels = {0: "not computed here", 1: "computed once, summed in by the shared all-reduce",
              2: f"computed on all {world_size} ranks (the same numbers)"}
    for i, z in enumerate((before, after), start=1):
        text = [[labels[v] for v in row] for row in z]
        fig.add_trace(go.Heatmap(z=z, x=cols, y=ranks, zmin=0, zmax=2, colorscale=scale, showscale=False,
                                 text=text, hovertemplate="%{y}, outputs %{x}: %{text}<extra></extra>",
                                 xgap=2, ygap=2), row=1, col=i)
    fig.update_yaxes(autorange="reversed")
    fig.update_xaxes(title_text="output coordinates (hidden)", tickangle=-45)
    fig.update_layout(height=380,
                      title="Who computes the routed output projection (red: repeated, green: once)")
    return fig


def tail_table(config, tp: int = 8, tokens=(1, 8, 64, 256), dtype="bf16", peak=None) -> pd.DataFrame:
    """Bytes, FLOPs and bytes/bandwidth floor of one rank's tail per layer and per decode step
    (all MoE layers), for each tail and token count; peak: an env.Peak (the H200's by default)."""
    pk = peak or _env.PEAKS["H200"]
    rows = []
    for n in tokens:
        for tail in mt.TAILS:
            c = mt.tail_cost(config, tp, tail, n, dtype)
            floor = bench.floor_us(bytes=c["bytes"], flops=c["flops"], peak=pk)
            rows.append(
                {
                    "tokens": n,
                    "tail": tail,
                    "up_proj rows": c["rows"],
                    "MB per layer": c["bytes"] / 1e6,
                    "MFLOP per layer": c["flops"] / 1e6,
                    f"floor us per layer ({pk.name})": floor,
                    "MB per step": c["bytes"] * config.num_moe_layers / 1e6,
                    "GFLOP per step": c["flops"] * config.num_moe_layers / 1e9,
                    "floor us per step": floor * config.num_moe_layers,
                }
            )
    return pd.DataFrame(rows)


def memory_table(config, tp: int = 8, dtype="bf16", kv_bytes: float = 1) -> pd.DataFrame:
    """up_proj per rank over all MoE layers for each tail, the freed memory, and the MLA cache
    positions (and 142K-token conversations under TP alone) it holds."""
    per_pos = config.num_mla_layers * config.mla_latent_bytes_per_position(kv_bytes)
    freed = mt.freed_bytes(config, tp, dtype)
    conv = config.conversation_bytes_per_gpu(CONVERSATION_TOKENS, dtype_bytes=kv_bytes)
    rows = [("up_proj, replicated tail", mt.tail_bytes(config, tp, "replicated", dtype) / GiB, "GiB per GPU"),
            ("up_proj, sharded tail", mt.tail_bytes(config, tp, "sharded", dtype) / GiB, "GiB per GPU"),
            ("freed", freed / GiB, "GiB per GPU"),
            (f"MLA cache positions it holds ({per_pos:,.0f} B each)",
             mt.cache_positions(config, freed, kv_bytes),
             "positions per GPU"),
            (f"{CONVERSATION_TOKENS:,}-token conversations it holds (TP alone)", freed / conv,
             "conversations")]
    return pd.DataFrame(rows, columns=["what", "value", "unit"])


def memory_figure(config, tps=(1, 2, 4, 8), dtype="bf16") -> go.Figure:
    """up_proj GiB per GPU over all MoE layers by TP size, replicated vs sharded."""
    fig = go.Figure()
    for tail, color in zip(mt.TAILS, ("#d62728", "#2ca02c")):
        fig.add_bar(name=tail, x=[f"TP{t}" for t in tps], marker_color=color,
                    y=[mt.tail_bytes(config, t, tail, dtype) / GiB for t in tps])
    fig.update_layout(barmode="group", yaxis_title="GiB per GPU", height=340,
                      title=f"routed_expert_up_proj over {config.num_moe_layers} MoE layers ({dtype})")
    return fig


def hit_rate_effect(before: float = SEED_CACHE_RUN["hit_rate_before"],
                    after: float = SEED_CACHE_RUN["hit_rate_after"]) -> dict[str, float]:
    """What a prefix-cache hit rate change means for the prefill work still done: the missed share
    falls from 1 - before to 1 - after (arithmetic on the seed's rates, not a measurement)."""
    if not 0 <= before <= 1 or not 0 <= after <= 1:
        raise ValueError(f"hit rates must lie in [0, 1], got {before} and {after}")
    miss_b, miss_a = 1 - before, 1 - after
    return {"missed_before": miss_b, "missed_after": miss_a,
            "recomputed_prefill_change": miss_a / miss_b - 1 if miss_b else 0.0}


def padding_figure(rows: list[dict]) -> go.Figure:
    """Share of tile rows that are padding against the decode batch, one line per tile height, and
    the mean rows per chosen expert (second axis); rows from moe_experts.decode_padding."""
    df = pd.DataFrame(rows)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for m, color in zip(sorted(df.block_m.unique()), ("#1f77b4", "#ff7f0e", "#9467bd")):
        d = df[df.block_m == m]
        fig.add_scatter(x=d.batch, y=d.padding_share, name=f"padding share, {m}-row tiles", line_color=color)
    d = df[df.block_m == df.block_m.min()]
    fig.add_scatter(x=d.batch, y=d.rows_per_expert_mean, name="rows per chosen expert (mean)",
                    line={"dash": "dot", "color": "#444"}, secondary_y=True)
    fig.update_xaxes(title_text="decode batch (tokens)", type="log")
    fig.update_yaxes(title_text="padding share of tile rows", range=[0, 1], secondary_y=False)
    fig.update_yaxes(title_text="rows per chosen expert", secondary_y=True)
    fig.update_layout(height=380, title="Expert tiles at decode: top-16 of 896, random router weights")
    return fig


def check_frame(rows: list[dict]) -> pd.DataFrame:
    """check_rank's rows as a frame (rank, tail, error figures, all-reduce count, up_proj bytes)."""
    cols = ["rank", "tail", "ok", "max_rel", "rel_l2", "all_reduce", "other_collectives", "up_proj_bytes"]
    return pd.DataFrame(rows)[cols].sort_values(["tail", "rank"]).reset_index(drop=True)


def table(records) -> str:
    """One line per record; 'launches' / 'copies' are one call's GPU operations (tail records on a GPU)."""
    lines = [f"{'case':<14} {'variant':<7} {'mode':<6} {'median us':>10} {'floor us':>9} "
             f"{'floor/median':>12} {'launches':>8} {'copies':>6}"]
    for r in records:
        frac = r.floor_us / r.median_us if r.floor_us else float("nan")
        launches, copies = (r.extra.get(k, "") for k in ("launches", "copies"))
        lines.append(f"{r.case:<14} {r.variant:<7} {r.mode:<6} {r.median_us:>10.2f} {r.floor_us or 0:>9.2f} "
                     f"{frac:>12.2f} {launches:>8} {copies:>6}")
    return "\n".join(lines)
