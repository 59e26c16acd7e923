"""Tables of the launch_overhead study: its records as one row per case, and the text `k3lab bench
launch_overhead` prints after them. They read records and launch nothing."""

from __future__ import annotations

from k3lab import bench

NAME = "launch_overhead"
SEED_COPY_BYTES = 1792  # one KDA layer's needless copy (seed, section 3)
SEED_COPIES_PER_STEP = 69  # one per KDA layer
GRAPH_COPIES = 100  # calls per captured graph (docs/k3.md: "100 of them replayed in one CUDA graph")


def size_label(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def summary(records: list[bench.Record]):
    """One row per case (launch cases first, then copies by size): eager and graph time per call, the
    lone-call latency where recorded, the bandwidth floor, achieved GB/s of each, eager / graph, the
    timer overheads, and floor / eager (the share of the eager time a floor-speed copy would keep)."""
    import pandas as pd

    rows: dict[str, dict] = {}
    for r in records:
        if r.study != NAME:
            continue
        row = rows.setdefault(r.case, {"case": r.case, "bytes": r.shape.get("bytes")})
        row["floor_us"] = r.floor_us
        key = "eager" if r.variant == "before" else "graph"
        row[f"{key}_us"] = r.median_us
        row[f"{key}_gbs"] = r.extra.get("achieved_gbs")
        row[f"{key}_timer_overhead_us"] = r.extra.get("overhead_us")
        if key == "eager" and r.extra.get("lone_call_us") is not None:
            row["lone_call_us"] = r.extra["lone_call_us"]
    order = {"tiny_op": 0, "empty_kernel": 1, "empty_triton": 2}
    ranked = sorted(rows.values(), key=lambda w: (order.get(w["case"], 3), w["bytes"] or 0))
    cols = ["case", "bytes", "eager_us", "graph_us", "lone_call_us", "floor_us", "eager_gbs", "graph_gbs",
            "eager_timer_overhead_us", "graph_timer_overhead_us"]
    df = pd.DataFrame(ranked)
    df = df[[c for c in cols if c in df.columns]]
    if "graph_us" in df:
        df["eager_over_graph"] = df["eager_us"] / df["graph_us"]
    if "eager_us" in df:
        df["floor_over_eager"] = df["floor_us"] / df["eager_us"]
    return df


def summary_text(records: list[bench.Record]) -> str:
    """What `k3lab bench launch_overhead` prints after its records: the launch costs the records carry
    (or that a CPU does not model them), the `summary` table, and the seed's per-step copies eager
    against their bandwidth floor."""
    mine = [r for r in records if r.study == NAME]
    if not mine:
        return ""
    first = mine[0].extra
    if first.get("launch_eager_us") is not None:
        lines = [f"empty kernel launch: {first['launch_eager_us']:.2f} us eager, "
                 f"{first['launch_graph_us']:.2f} us per kernel inside a {GRAPH_COPIES}-kernel graph"]
    else:
        lines = ["launch cost is not modelled on CPU: figures below are PyTorch host overhead"]
    lines.append(summary(mine).to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.4g}"))
    seed_case = f"copy_{size_label(SEED_COPY_BYTES)}"
    seed = next((r for r in mine if r.case == seed_case and r.variant == "before"), None)
    if seed is not None:
        lines.append(f"{SEED_COPIES_PER_STEP} copies of {SEED_COPY_BYTES} B per decode step: "
                     f"{seed.extra['per_decode_step_us']:.1f} us eager; at the bandwidth floor they would "
                     f"take {SEED_COPIES_PER_STEP * (seed.floor_us or 0):.2f} us")
    return "\n".join(lines)
