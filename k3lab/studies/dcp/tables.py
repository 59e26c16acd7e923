"""Tables, figures and models of the dcp study (notebook 01): the MLA history per GPU under TP8 and DCP8,
which rank holds each position, the merge worked by hand, the bytes each merge exchanges, and the
per-layer cost model (attention: a line fitted to the committed H200 records, with its held-out error;
collectives from public figures, labelled, no measured error). They read records and launch nothing."""


from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.parallel import dcp

NAME = "dcp"
WORLD = 8
CONVERSATION = 142_000
# Public figures for the cost model (labelled in every table and figure that uses them).
PUBLIC = {
    "collective_latency_us": (7.0, 25.0),  # small-message NCCL collective on one node, per call (docs/k3.md)
    "link_GBps": 450.0,  # H200 NVLink 4: 900 GB/s per GPU both ways, half of it each way (datasheet)
}
_RANK_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


# ---------------------------------------------------------------------------------------- memory
def memory_table(tokens=(1_000, 8_000, 32_000, 64_000, 128_000, CONVERSATION, 256_000), *, world: int = WORLD,
                 dtype_bytes: float = 1, config: K3Config | None = None) -> pd.DataFrame:
    """MLA history per GPU of one conversation under TP alone and under DCP (all MLA layers), and the
    per-sequence KDA state of one TP rank (which DCP does not divide), in bytes."""
    cfg = config or K3Config.full()
    kda = (
        K3Config.tp_slice(world).kda_state_bytes_all_layers()
        if config is None
        else cfg.kda_state_bytes_all_layers()
    )
    rows = [{"tokens": n, "tp_bytes": dcp.cache_bytes_per_rank(cfg, n, 1, dtype_bytes=dtype_bytes),
             "dcp_bytes": dcp.cache_bytes_per_rank(cfg, n, world, dtype_bytes=dtype_bytes),
             "kda_state_bytes": kda} for n in tokens]
    return pd.DataFrame(rows)


def memory_figure(table: pd.DataFrame, *, world: int = WORLD, mark: int = CONVERSATION) -> go.Figure:
    fig = go.Figure()
    gb = 1e9
    fig.add_scatter(x=table.tokens, y=table.tp_bytes / gb, name=f"TP{world}: every position on every GPU",
                    mode="lines+markers")
    fig.add_scatter(x=table.tokens, y=table.dcp_bytes / gb, name=f"DCP{world}: 1/{world} of the positions",
                    mode="lines+markers")
    fig.add_scatter(x=table.tokens, y=table.kda_state_bytes / gb, name="KDA state per sequence (not sharded)",
                    mode="lines", line=dict(dash="dot"))
    hit = table[table.tokens == mark]
    if len(hit):
        r = hit.iloc[0]
        for y, label in ((r.tp_bytes, f"{r.tp_bytes / gb:.2f} GB"),
                         (r.dcp_bytes, f"{r.dcp_bytes / 1e6:.0f} MB")):
            fig.add_annotation(x=mark, y=y / gb, text=label, showarrow=True, arrowhead=2)
        fig.add_vline(x=mark, line_dash="dash", line_color="gray")
    fig.update_layout(title=f"MLA history of one conversation per GPU (FP8, 24 layers): TP{world} vs "
                            f"DCP{world}",
                      xaxis_title="conversation length (tokens)", yaxis_title="GB per GPU")
    return fig


# ---------------------------------------------------------------------------------------- layout
def layout_table(positions: int = 40, world: int = 4, interleave: int = 1) -> pd.DataFrame:
    """For each position: the rank that holds it and its row in that rank's shard."""
    pos = torch.arange(positions)
    own = dcp.owner(pos, world, interleave)
    local = torch.tensor([dcp.owned_count(int(p), world, int(r), interleave) for p, r in zip(pos, own)])
    return pd.DataFrame({"position": pos.numpy(), "rank": own.numpy(), "local_row": local.numpy()})


def layout_figure(positions: int = 48, world: int = 4, interleaves=(1, 16)) -> go.Figure:
    z = [layout_table(positions, world, i)["rank"].tolist() for i in interleaves]
    scale = [[k / max(1, world - 1), _RANK_COLORS[k % len(_RANK_COLORS)]] for k in range(world)]
    fig = go.Figure(go.Heatmap(z=z, x=list(range(positions)), y=[f"interleave {i}" for i in interleaves],
                               colorscale=scale if world > 1 else "Blues", zmin=0, zmax=world - 1,
                               colorbar=dict(title="rank", tickvals=list(range(world))), xgap=1, ygap=4))
    fig.update_layout(title=f"Which of {world} ranks holds each position", xaxis_title="position",
                      height=260)
    return fig


# ------------------------------------------------------------------------------- merge by hand
def two_shard_example(positions: int = 7, dim: int = 4, seed: int = 0) -> dict:
    """One query over a tiny history split between two ranks (interleave 1), step by step, fp64.

    Returns the scores, each shard's (lse, o), the weights exp(lse_r - lse), the merged o and lse,
    and the direct softmax over the whole history for comparison.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(dim, generator=g, dtype=torch.float64)
    # values = keys (MQA over the latent)
    keys = torch.randn(positions, dim, generator=g, dtype=torch.float64)
    s = keys @ q
    shards = {}
    for r in range(2):
        idx = torch.arange(r, positions, 2)
        lse_r = torch.logsumexp(s[idx], 0)
        shards[r] = {"positions": idx.tolist(), "lse": lse_r.item(),
                     "o": (torch.softmax(s[idx], 0) @ keys[idx]).tolist()}
    lse = math.log(sum(math.exp(v["lse"]) for v in shards.values()))
    weights = {r: math.exp(v["lse"] - lse) for r, v in shards.items()}
    merged = sum(weights[r] * torch.tensor(v["o"], dtype=torch.float64) for r, v in shards.items())
    direct = torch.softmax(s, 0) @ keys
    return {"scores": s.tolist(), "shards": shards, "lse": lse, "weights": weights, "o": merged.tolist(),
            "direct_o": direct.tolist(), "direct_lse": torch.logsumexp(s, 0).item(),
            "max_diff": (merged - direct).abs().max().item()}


# ------------------------------------------------------------------------------------ exchange
def bytes_table(batches=(1, 8, 64), *, q_len: int = 1, heads: int = 12, world: int = WORLD,
                dtype=torch.bfloat16) -> pd.DataFrame:
    """Collectives and bytes per layer and rank of each merge (`dcp.exchange_bytes`)."""
    rows = []
    for B in batches:
        for merge in dcp.MERGES:
            x = dcp.exchange_bytes(B, q_len, heads, world, merge, dtype)
            rows.append({"batch": B, "merge": merge, "calls": x["calls"], "sent_KB": x["sent_bytes"] / 1e3,
                         "per call": ", ".join(f"{c['op']}({c['what']}) {c['input_bytes'] / 1e3:.1f} KB"
                                               for c in x["collectives"])})
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------- cost model
ATTENTION_FIT = ("ctx32k", "ctx128k")  # the committed records the attention line passes through
COLLECTIVES = "public figures, not measured here"


def _after_points(records=None) -> dict:
    """The after's graph-replay records at TP8's decode shape (12 heads, one query position), one per
    case (the last read wins), as case -> {batch, context, positions, measured_us}. Variant cases
    (`<case>.<variant>`: contiguous cache, split sweeps, the Triton after) are left out."""
    recs = records if records is not None else bench.load_records("mla_padding", "nvidia-h200")
    out = {}
    for r in recs:
        s = r.shape or {}
        if (r.variant == "after" and r.mode == "graph" and "." not in r.case and s.get("heads") == 12
                and s.get("q_len") == 1 and s.get("lengths_sum")):
            out[r.case] = {"batch": s["batch"], "context": s["context"], "positions": s["lengths_sum"],
                           "measured_us": r.median_us}
    return out


def attention_fit_error(records=None, *, fit=ATTENTION_FIT) -> pd.DataFrame:
    """The attention line's measured error: the line t0 + us_per_position x positions through the
    records named by `fit` (least squares when more than two), set against every committed after record
    at TP8's shape. One row per record: case, batch, context, positions (the history read, B x context
    or a ragged batch's sum), measured_us, model_us, rel_error ((model - measured) / measured) and role:
    'fit' (the line was fitted to it: with two points it passes through both, so the residual is zero
    by construction) or 'held out' (not used by the fit, the model's measured error). Raises ValueError
    when a fit case has no record or the fit cases do not span two history lengths."""
    if isinstance(fit, str) or not all(isinstance(c, str) for c in fit):
        raise TypeError(f"fit must be a tuple of case names, got {fit!r}")
    points = _after_points(records)
    missing = [c for c in fit if c not in points]
    if missing:
        raise ValueError(f"fit: no committed H200 mla_padding after record (graph, 12 heads, one position) "
                         f"for {missing}; have {sorted(points)}")
    xs = [points[c]["positions"] for c in fit]
    if len(set(xs)) < 2:
        raise ValueError(f"fit must name records of at least two history lengths, got {list(fit)} ({xs})")
    n, mx, my = len(fit), sum(xs) / len(fit), sum(points[c]["measured_us"] for c in fit) / len(fit)
    slope = (sum((x - mx) * (points[c]["measured_us"] - my) for x, c in zip(xs, fit))
             / sum((x - mx) ** 2 for x in xs))
    t0 = my - slope * mx
    rows = []
    for case, p in sorted(points.items(), key=lambda kv: (kv[1]["positions"], kv[0])):
        model = t0 + slope * p["positions"]
        rows.append({"case": case, **p, "model_us": model,
                     "rel_error": (model - p["measured_us"]) / p["measured_us"],
                     "role": "fit" if case in fit else "held out"})
    table = pd.DataFrame(rows)
    table.attrs.update(t0_us=t0, us_per_position=slope, fit=tuple(fit), points=n)
    return table


def attention_model(records=None, *, fit=ATTENTION_FIT) -> dict:
    """t(positions) = t0 + positions x bytes_per_position / bw for the after at TP8's shape (12 heads,
    bf16, graph replay), fitted to the committed H200 records `fit` (32K and 128K, B = 1), with its
    measured error from `attention_fit_error`: fit_worst_rel (residual on the fitting points),
    heldout_worst_rel / heldout_case (the worst |relative error| on the records the fit did not use) and
    the range of history lengths the records cover (measured_positions). {} when a fit record is
    missing."""
    try:
        err = attention_fit_error(records, fit=fit)
    except ValueError:
        return {}
    held, fitted = err[err.role == "held out"], err[err.role == "fit"]
    worst = held.rel_error.abs().idxmax() if len(held) else None
    per_pos_us = err.attrs["us_per_position"]
    return {"t0_us": err.attrs["t0_us"], "us_per_position": per_pos_us,
            "bw_TBps": 576 * 2 / (per_pos_us * 1e-6) / 1e12,
            "source": f"H200 records {' / '.join(fit)} (after)",
            "fit_worst_rel": float(fitted.rel_error.abs().max()),
            "heldout_worst_rel": float(held.rel_error.abs().max()) if len(held) else float("nan"),
            "heldout_case": held.case[worst] if len(held) else None, "heldout_points": len(held),
            "measured_positions": (int(err.positions.min()), int(err.positions.max()))}


def _positive_ints(name: str, values) -> tuple:
    vals = tuple(values) if not isinstance(values, (str, bytes)) else ()
    if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in vals):
        raise ValueError(f"{name} must be a non-empty sequence of positive ints, got {values!r}")
    return vals


def cost_model(contexts=(1_000, 4_000, 16_000, 32_000, 64_000, 128_000, 256_000), batches=(1, 64), *,
               world: int = WORLD, attention: dict | None = None, merge: str = "a2a") -> pd.DataFrame:
    """Per-layer MLA decode time on one GPU: TP alone against DCP over `world` GPUs (model, not measured).

    TP: the after over the whole history of B requests. DCP: the after over 1/world of it (the seed:
    96 heads over 1/8 cost about what 12 heads over all of it cost per position, which
    `measure` times) plus the merge's collectives at the public latency range and link
    bandwidth (`PUBLIC`, not measured here). Returns rows with dcp_low_us / dcp_high_us for the latency
    range and, on every row, what it is: kind 'model', attention_error_pct (the attention line's worst
    held-out error on the committed records, `attention_model`), beyond_records (a history length, TP's
    or one DCP rank's, outside the lengths the records cover: the line is extrapolated there) and
    collectives (COLLECTIVES: no measured error). `attention` must come from `attention_model`."""
    contexts, batches = _positive_ints("contexts", contexts), _positive_ints("batches", batches)
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if merge not in dcp.MERGES:
        raise ValueError(f"merge must be one of {dcp.MERGES}, got {merge!r}")
    att = attention if attention is not None else attention_model()
    if not att:
        raise ValueError("no attention model: the H200 mla_padding records ctx32k / ctx128k are missing")
    need = ("t0_us", "us_per_position", "heldout_worst_rel", "measured_positions")
    if not isinstance(att, dict) or any(k not in att for k in need):
        raise ValueError(f"attention must be attention_model()'s dict (with its measured error: {need}), "
                         f"got {att!r}")
    lat_lo, lat_hi = PUBLIC["collective_latency_us"]
    lo_pos, hi_pos = att["measured_positions"]
    rows = []
    for B in batches:
        x = dcp.exchange_bytes(B, 1, 12, world, merge, torch.bfloat16)
        wire_us = x["sent_bytes"] / (PUBLIC["link_GBps"] * 1e9) * 1e6
        for L in contexts:
            tp_pos, local_pos = B * L, B * math.ceil(L / world)
            tp = att["t0_us"] + att["us_per_position"] * tp_pos
            local = att["t0_us"] + att["us_per_position"] * local_pos
            rows.append({"kind": "model", "batch": B, "context": L, "tp_us": tp, "dcp_local_us": local,
                         "dcp_low_us": local + x["calls"] * lat_lo + wire_us,
                         "dcp_high_us": local + x["calls"] * lat_hi + wire_us, "calls": x["calls"],
                         "wire_us": wire_us, "attention_error_pct": 100 * att["heldout_worst_rel"],
                         "beyond_records": not (lo_pos <= local_pos and tp_pos <= hi_pos),
                         "collectives": COLLECTIVES})
    return pd.DataFrame(rows)


def cost_figure(table: pd.DataFrame, *, world: int = WORLD) -> go.Figure:
    """`cost_model`'s rows drawn as what they are: a model for `world` GPUs, with the attention line's
    held-out error and the collectives' source in the title. No measurement is drawn beside them."""
    need = {"kind", "batch", "context", "tp_us", "dcp_low_us", "dcp_high_us", "attention_error_pct",
            "beyond_records"}
    if not isinstance(table, pd.DataFrame) or need - set(table.columns) or not len(table):
        raise ValueError(f"table must be cost_model()'s non-empty rows (columns {sorted(need)})")
    if set(table.kind) != {"model"}:
        raise ValueError(f"table must hold model rows only, got kinds {sorted(set(table.kind))}")
    err = table.attention_error_pct.abs().max()
    lo, hi = PUBLIC["collective_latency_us"]
    fig = go.Figure()
    for k, (B, part) in enumerate(table.groupby("batch")):
        c = _RANK_COLORS[k % len(_RANK_COLORS)]
        fig.add_scatter(x=part.context, y=part.tp_us, name=f"model: TP{world}, B={B}", line=dict(color=c))
        fig.add_scatter(x=part.context, y=part.dcp_high_us, line=dict(color=c, dash="dash"),
                        name=f"model: DCP{world}, B={B} ({hi:g} us per collective, public figure)")
        fig.add_scatter(x=part.context, y=part.dcp_low_us, line=dict(color=c, dash="dot"),
                        name=f"model: DCP{world}, B={B} ({lo:g} us per collective, public figure)")
    fig.update_layout(title=dict(text=(
        f"Model, projected for {world} GPUs (not measured): one MLA layer's decode per GPU, TP{world} vs "
        f"DCP{world}<br><sup>attention: a line fitted to H200 records, held-out error up to {err:.1f}%; "
        f"collectives: {COLLECTIVES}; "
        f"{int(table.beyond_records.sum())} of {len(table)} points extrapolate past the records' "
        "history lengths</sup>")),
        xaxis_title="context per request (tokens)", yaxis_title="us per layer (model)",
        xaxis_type="log", yaxis_type="log")
    return fig


def capacity_table(contexts=(4_000, 32_000, 128_000, CONVERSATION), *, cache_budget_gb: float = 60.0,
                   world: int = WORLD) -> pd.DataFrame:
    """Requests whose MLA history (FP8) and KDA state fit a per-GPU cache budget, TP vs DCP.

    The budget is an assumption to vary (what is left beside the weights and activations)."""
    full, kda = K3Config.full(), K3Config.tp_slice(world).kda_state_bytes_all_layers()
    rows = []
    for L in contexts:
        tp = dcp.cache_bytes_per_rank(full, L, 1) + kda
        dc = dcp.cache_bytes_per_rank(full, L, world) + kda
        budget = cache_budget_gb * 1e9
        rows.append({"context": L, "tp_requests": int(budget // tp), "dcp_requests": int(budget // dc),
                     "gain": (budget // dc) / max(1, budget // tp), "kda_share_under_dcp": kda / dc})
    return pd.DataFrame(rows)


def h200_records() -> list:
    """The committed one-GPU DCP records (profiles/nvidia-h200/dcp), empty until the benchmark ran there."""
    return bench.load_records("dcp", "nvidia-h200")
