"""Tables and figures of the MLA padding study (k3lab.studies.mla_padding) from records: the study's own
(`summary`, `sweep_table`, `targets`, `verify_table`, `peer_table`) and the committed H200 runs of
device scripts under profiles/nvidia-h200/mla_padding/extra/ (timeline probes, read floors, the
decode's time broken down, stage and wave runs, peer kernels, target bounds). No GPU needed.
Everything here is importable from `k3lab.studies.mla_padding`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from k3lab import bench
from k3lab.ops import mla_decode as mla

NAME = "mla_padding"
# Targets set for this study on the H200 (bf16, B = 1): checked by `targets()`.
TARGETS = {"bw_32k": 0.70, "bw_128k": 0.80, "speedup_32k": 1.8, "ratio_1k_band": 0.15, "vs_einsum_32k": 5.0}


def _main_name(case: str) -> str:
    return case.split(".")[0]


def summary(records):
    """One row per (device, main case, mode): before, after, the peers and AITER, the floor, and
    the ratios (speedup = before / after; bw_fraction = floor / after = share of the copy bandwidth)."""

    keyed: dict[tuple, dict] = {}
    for r in records:
        if (
            r.study != NAME
            or r.case.startswith("tune.")
            or ".s" in r.case
            and r.case.split(".")[-1][1:].isdigit()
        ):
            continue
        base = _main_name(r.case)
        suffix = r.case[len(base) + 1:] if r.case != base else ""
        col = {("", "before"): "before_us", ("", "after"): "after_us", ("", "torch"): "einsum_us",
               ("sdpa", "torch"): "sdpa_us", ("padcopy", "after"): "after_padcopy_us",
               ("contig", "after"): "after_contig_us", ("", "aiter"): "aiter_us",
               ("", "flashmla"): "flashmla_us"}.get((suffix, r.variant))
        if col is None:
            continue
        row = keyed.setdefault((r.device, base, r.mode), {"device": r.device, "case": base, "mode": r.mode,
                                                          "batch": r.shape.get("batch"),
                                                          "context": r.shape.get("context"),
                                                          "q_len": r.shape.get("q_len"),
                                                          "floor_us": r.floor_us})
        row[col] = r.median_us
        if col == "after_us":
            row["splits"] = r.extra.get("num_splits")
            row["programs"] = r.extra.get("programs")
    df = pd.DataFrame(list(keyed.values()))
    if df.empty:
        return df
    for c in ("before_us", "after_us", "einsum_us", "sdpa_us", "after_padcopy_us", "after_contig_us",
              "aiter_us",
              "flashmla_us"):
        if c not in df:
            df[c] = math.nan
    df["speedup"] = df["before_us"] / df["after_us"]
    df["bw_fraction"] = df["floor_us"] / df["after_us"]
    df["vs_einsum"] = df["einsum_us"] / df["after_us"]
    df["vs_sdpa"] = df["sdpa_us"] / df["after_us"]
    df["vs_flashmla"] = df["flashmla_us"] / df["after_us"]
    return df


def sweep_table(records, compute_units: int | None = None):
    """The split-count sweep: context, splits, time (graph replay), and the split count the rule picks."""

    rows = []
    for r in records:
        if r.study != NAME or r.case.startswith("tune.") or "." not in r.case:
            continue
        base, tail = r.case.split(".", 1)
        if not (tail.startswith("s") and tail[1:].isdigit()):
            continue
        rows.append({"device": r.device, "case": base, "context": r.shape["context"], "splits": int(tail[1:]),
                     "mode": r.mode, "median_us": r.median_us, "floor_us": r.floor_us,
                     "bw_fraction": r.floor_us / r.median_us if r.floor_us else math.nan})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    units = {}
    for r in records:
        units.setdefault(r.device, r.extra.get("compute_units"))
    df["rule_choice"] = [mla.choose_num_splits(1, int(c), compute_units or units.get(d) or 1)
                         for d, c in zip(df["device"], df["context"])]
    return df.sort_values(["device", "context", "splits"]).reset_index(drop=True)


def sweep_figure(table, title: str | None = None):
    """Time against split count per context, the rule's choice marked."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for (dev, case), sub in table.groupby(["device", "case"]):
        fig.add_trace(
            go.Scatter(x=sub["splits"], y=sub["median_us"], mode="lines+markers", name=f"{case} ({dev})")
        )
        choice = int(sub["rule_choice"].iloc[0])
        hit = sub[sub["splits"] == choice]
        if not hit.empty:
            fig.add_trace(go.Scatter(x=hit["splits"], y=hit["median_us"], mode="markers", showlegend=False,
                                     marker=dict(symbol="star", size=14, color="black"),
                                     hovertext=f"rule's choice: {choice}"))
    fig.update_layout(template="plotly_white", xaxis_title="history pieces per request (num_splits)",
                      yaxis_title="time per decode step (us)", xaxis_type="log", yaxis_type="log",
                      title=title or "Split-count sweep (star: choose_num_splits)")
    return fig


def targets(records, device: str = "NVIDIA H200"):
    """The study's H200 targets against the records: name, target, measured, met (graph replay and
    eager both shown where the target depends on the timing mode)."""

    df = summary([r for r in records if r.device == device])
    rows = []
    if df.empty:
        return pd.DataFrame(rows)
    for mode in sorted(df["mode"].unique()):
        sub = df[df["mode"] == mode].set_index("case")

        def get(case, col):
            return float(sub.loc[case, col]) if case in sub.index and col in sub else math.nan

        checks = [
            ("after share of copy bandwidth, 32K", ">= 0.70", get("ctx32k", "bw_fraction"), lambda v: v
             >= 0.70),
            ("after share of copy bandwidth, 128K", ">= 0.80", get("ctx128k", "bw_fraction"), lambda v: v
             >= 0.80),
            ("before / after, 32K", ">= 1.8", get("ctx32k", "speedup"), lambda v: v >= 1.8),
            ("before / after, 1K", "0.85 .. 1.15", get("ctx1k", "speedup"), lambda v: 0.85 <= v <= 1.15),
            ("einsum / after, 32K", ">= 5", get("ctx32k", "vs_einsum"), lambda v: v >= 5.0),
        ]
        for name, target, value, ok in checks:
            rows.append({"mode": mode, "target": name, "wanted": target, "measured": value,
                         "met": bool(ok(value)) if not math.isnan(value) else None})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------
# the CUDA kernel's timeline probe (committed H200 runs of scripts/device_mla_probe.py)

PROBE_PHASES = ("first tile", "tile loop", "write piece", "merge")


def probe_runs(device: str = "nvidia-h200") -> dict[str, dict]:
    """The committed timeline-probe runs (profiles/<device>/mla_padding/extra/probe_*.json), by file
    stem; each maps '<form>.<case>' to that case's graph time, splits and last timeline (under 'rows'
    in runs that also name their device, versions and commit)."""
    base = bench.PROFILES / device / NAME / "extra"
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(base.glob("probe_*.json"))}
    return {k: r["rows"] if "rows" in r else r for k, r in runs.items()}


def probe_frames(run: dict) -> dict[str, pd.DataFrame]:
    """One probe run as kernel-like frames for `plots.timeline`: per '<form>.<case>' one row whose
    bars are every block's phases (waiting for its first tile, the tile loop, writing its piece)
    and the merge blocks' spans, in us from the first block's start."""
    out = {}
    for key, rec in run.items():
        tl = rec["last_timeline"]
        rows = []
        for b in tl["blocks"]:
            first = b["start"] if b["first"] is None else b["first"]
            rows += [(PROBE_PHASES[0], b["start"], first - b["start"]),
                     (PROBE_PHASES[1], first, b["loop_end"] - first),
                     (PROBE_PHASES[2], b["loop_end"], b["end"] - b["loop_end"])]
        rows += [(PROBE_PHASES[3], m["start"], m["end"] - m["start"]) for m in tl["merge"]]
        label = key if "." in key else f"split.{key}"  # records without a form name are the split kernel
        out[f"{label} ({rec['graph_us']:.1f} us)"] = pd.DataFrame(
            [{"name": n, "category": n, "start_us": t, "dur_us": d} for n, t, d in rows])
    return out


# ----------------------------------------------------------------------------------------------
# how fast a plain read of the same bytes goes (committed H200 run of scripts/device_copy_floor.py)

READ_FLOORS = "extra/copy_floor_d498419.json"


def read_floors(records=None, device: str = "nvidia-h200", path=None) -> pd.DataFrame:
    """A device copy and a PyTorch sum of each case's cache bytes, timed like the decode (graph replay),
    as shares of the measured copy bandwidth: one row per case with 'copy_share' and 'sum_share', and,
    given this study's records, 'decode_share' (the after's bw_fraction in graph mode)."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / READ_FLOORS
    rows = json.loads(Path(path).read_text()).get("rows")
    if not isinstance(rows, dict) or not rows or any("sum_share" not in r for r in rows.values()):
        raise ValueError(f"{path} is not a read-floor run of scripts/device_copy_floor.py")
    df = pd.DataFrame([{"case": case, **vals} for case, vals in rows.items()])
    if records:
        s = summary(records)
        share = s[s["mode"] == "graph"].set_index("case")["bw_fraction"]
        df["decode_share"] = df["case"].map(share)
    return df


# ----------------------------------------------------------------------------------------------
# where the decode's time goes: readers of the same bytes and the wgmma form with its arithmetic
# removed (committed H200 runs of scripts/device_mla_read_probe.py and scripts/device_mla_wgmma.py)

READ_PROBE = "extra/read_probe_20255de.json"
WGMMA_RUN = "extra/merge_cost_20255de.json"
MERGE_RUN = WGMMA_RUN  # the same run holds the builds with the merge kernel emptied
# (file, key in it) -> label, in the order of the figure: from the plainest read to the full decode
BREAKDOWN_STEPS = (
    ("probe", "ldg 528 blocks", "plain 16-byte loads"),
    ("probe", "ring split 128 (decode path)", "the decode's tile ring, no arithmetic"),
    ("probe", "ring split 128 +tail", "... + an empty second kernel"),
    ("merge", "wgmma-dme-data-only", "wgmma form, no arithmetic, empty merge"),
    ("wgmma", "wgmma-data-only", "wgmma form, no arithmetic, + merge"),
    ("merge", "wgmma-me-no-merge", "wgmma form, empty merge"),
    ("wgmma", "wgmma", "wgmma form (the after from 8K up)"),
    ("wgmma", "split", "mma.sync split kernel"),
)


def read_breakdown(device: str = "nvidia-h200", probe_path=None, wgmma_path=None,
                   merge_path=None) -> pd.DataFrame:
    """One row per (case, step) of BREAKDOWN_STEPS: its graph-replay time and share of the measured
    copy bandwidth, from the committed read-probe, wgmma and merge-cost runs (cases present in all)."""
    base = bench.PROFILES / device / NAME
    runs = {"probe": json.loads(Path(probe_path or base / READ_PROBE).read_text()),
            "wgmma": json.loads(Path(wgmma_path or base / WGMMA_RUN).read_text()),
            "merge": json.loads(Path(merge_path or base / MERGE_RUN).read_text())}
    keys = {"probe": "variants", "wgmma": "forms", "merge": "forms"}
    for src, run in runs.items():
        if not isinstance(run.get("rows"), dict) or any(keys[src] not in r for r in run["rows"].values()):
            raise ValueError(f"the {src} run's file has no rows of {keys[src]!r}")
    rows = []
    for case in [c for c in runs["probe"]["rows"] if all(c in r["rows"] for r in runs.values())]:
        for src, key, label in BREAKDOWN_STEPS:
            vals = runs[src]["rows"][case][keys[src]]
            if key not in vals:
                raise ValueError(f"{case}: no {key!r} in the committed {src} run")
            rows.append({"case": case, "step": label, "us": vals[key]["us"], "share": vals[key]["share"],
                         "commit": runs[src]["commit"]})
    return pd.DataFrame(rows)


def arithmetic_per_tile(device: str = "nvidia-h200", path=None, key: str = "wgmma-co-unchecked",
                        short: str = "ctx32k", long: str = "ctx128k") -> pd.DataFrame:
    """The warpgroup-MMA form's arithmetic per 64-row tile beside the tile's share of DRAM time, from
    the committed run with the compute-only build (`key`: one tile loaded, every tile's products run
    on it): the difference between the `long` and `short` cases over their difference in tiles per
    piece, against 72 KB at the copy bandwidth shared by the pieces that stream at once."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / WGMMA_RUN
    run = json.loads(Path(path).read_text())
    rows = run.get("rows", {})
    try:
        a, b = rows[short]["forms"][key], rows[long]["forms"][key]
        nbytes = {short: rows[short]["bytes"], long: rows[long]["bytes"]}
    except (KeyError, TypeError):
        raise ValueError(f"{path} has no {key!r} times and bytes for {short!r} and {long!r}") from None
    if a["splits"] != b["splits"]:
        raise ValueError(f"{path}: {short} and {long} ran with different piece counts ({a['splits']}, "
                         f"{b['splits']})")
    tile_bytes = 64 * mla.LATENT_DIM * 2  # 64 rows of bf16
    tiles = {c: n / a["splits"] / tile_bytes for c, n in nbytes.items()}  # per piece
    arith = (b["us"] - a["us"]) / (tiles[long] - tiles[short])
    dram = tile_bytes * a["splits"] / (run["copy_bandwidth_tbs"] * 1e12) * 1e6
    return pd.DataFrame([{"commit": run["commit"], "pieces": a["splits"], "arithmetic_us_per_tile": arith,
                          "dram_us_per_tile": dram, "arithmetic_share_of_dram_time": arith / dram}])


def breakdown_figure(df: pd.DataFrame, title: str | None = None):
    """Grouped bars of read_breakdown's shares of the copy bandwidth, with the issue's targets."""
    import plotly.express as px

    fig = px.bar(df, x="case", y="share", color="step", barmode="group", text_auto=".0%",
                 title=title or "Where the MLA decode's time goes (H200, graph replay)",
                 labels={"share": "share of copy bandwidth"})
    for level, label in ((0.7, "target 32K"), (0.8, "target 128K")):
        fig.add_hline(y=level, line_dash="dot", annotation_text=label)
    return fig


# ----------------------------------------------------------------------------------------------
# a third stage: without its rope box a tile is 64 KB and three fit beside the query; the rope must
# then reach the arithmetic another way (committed H200 runs of scripts/device_mla_wgmma.py, each
# timing the two-stage default and one three-stage build, with and without arithmetic)

STAGE_RUNS = (("rope loaded into registers", "extra/rope_regs_07e1932.json", "wgmma-rope-regs"),
              ("rope in a ring of two boxes", "extra/ring3_7691e31.json", "wgmma-r3"))
STAGE_BUILDS = (("wgmma-data-only", "two 72 KB stages, no arithmetic"),
                ("{key}-data-only", "three 64 KB stages, no arithmetic"),
                ("wgmma", "two 72 KB stages (the after)"), ("{key}", "three 64 KB stages"))


def stage_table(device: str = "nvidia-h200", runs=STAGE_RUNS) -> pd.DataFrame:
    """One row per (run, case, build) of the committed three-stage runs: graph-replay time and share
    of the copy bandwidth of the two-stage default and of the three-stage build, each with and without
    its arithmetic, all timed in that run. `runs`: (label, path under the study's profiles, key)."""
    base = bench.PROFILES / device / NAME
    rows = []
    for label, path, key in runs:
        path = Path(path) if Path(path).is_absolute() else base / path
        run = json.loads(path.read_text())
        if not isinstance(run.get("rows"), dict) or not run["rows"]:
            raise ValueError(f"{path} has no rows of forms")
        for case, row in run["rows"].items():
            for form, build in STAGE_BUILDS:
                v = row.get("forms", {}).get(form.format(key=key))
                if v is None:
                    raise ValueError(f"{path}: {case} has no {form.format(key=key)!r} time")
                rows.append({"run": label, "commit": run["commit"], "case": case, "build": build,
                             "us": v["us"], "share": v["share"]})
    return pd.DataFrame(rows)


def stage_figure(df: pd.DataFrame, title: str | None = None):
    """Grouped bars of stage_table's shares of the copy bandwidth, one panel per run."""
    import plotly.express as px

    return px.bar(df, x="case", y="share", color="build", facet_col="run", barmode="group", text_auto=".0%",
                  title=title or "A third stage (H200, graph replay): the stream gains, the decode does not",
                  labels={"share": "share of copy bandwidth"})


# ----------------------------------------------------------------------------------------------
# waves: the same 64 x 8K decode with 3 pieces per request (192 blocks on 132 SMs: a full wave and a
# 45% one) and with 2 (128 blocks, one wave), each form timed in one run of scripts/device_mla_wgmma.py

WAVE_RUNS = ("extra/forms_b2e4c25.json", "extra/forms_083abc8.json")
H200_SMS = 132


def wave_table(device: str = "nvidia-h200", paths=None, case: str = "b64_8k", batch: int = 64,
               sms: int = H200_SMS) -> pd.DataFrame:
    """One row per (run, form) of `case` (`batch` requests): pieces per request, blocks, waves (blocks /
    sms), graph-replay time and share of the copy bandwidth, from the committed form runs."""
    base = bench.PROFILES / device / NAME
    rows = []
    for path in paths or [base / p for p in WAVE_RUNS]:
        run = json.loads(Path(path).read_text())
        row = run.get("rows", {}).get(case)
        if not isinstance(row, dict) or "forms" not in row:
            raise ValueError(f"{path} has no {case!r} row of forms")
        for form, v in row["forms"].items():
            blocks = batch * v["splits"]
            rows.append({"commit": run["commit"], "form": form, "pieces": v["splits"], "blocks": blocks,
                         "waves": blocks / sms, "us": v["us"], "share": v["share"]})
    return pd.DataFrame(rows)


def wave_figure(df: pd.DataFrame, title: str | None = None):
    """Bars of wave_table: each form's time with the grid spilling into a second wave and without."""
    import plotly.express as px

    df = df.assign(
        grid=[
            f"{p} pieces: {b} blocks ({w:.2f} waves)"
            for p, b, w in zip(df["pieces"], df["blocks"], df["waves"])
        ]
    )
    return px.bar(df, x="form", y="us", color="grid", barmode="group", text_auto=".0f",
                  title=title or "64 requests x 8K on the H200: a second, partial wave costs a whole piece",
                  labels={"us": "us per decode (graph replay)"})


# ----------------------------------------------------------------------------------------------
# a public Hopper kernel in the same run: FlashMLA's dense decode (variant 'flashmla'), and its two
# kernels beside ours (committed H200 run of scripts/device_mla_kernel_times.py, FORMS=wgmma,flashmla)

PEER_KERNELS = "extra/flashmla_kernels_ae5fec0.json"


def peer_table(records, peer: str = "flashmla", mode: str = "graph") -> pd.DataFrame:
    """Per case that has the peer: the after, the peer, the floor, both shares of the copy bandwidth
    and peer / after (above 1: the after is faster), from one run's records."""
    df = summary(records)
    col = f"{peer}_us"
    if df.empty or col not in df or df[col].isna().all():
        raise ValueError(f"no {peer!r} records among these {len(records)} records")
    df = df[(df["mode"] == mode) & df[col].notna()].copy()
    df["after_share"] = df["bw_fraction"]
    df[f"{peer}_share"] = df["floor_us"] / df[col]
    df[f"{peer}_over_after"] = df[col] / df["after_us"]
    keep = ["case", "batch", "context", "q_len", "after_us", col, "floor_us", "after_share", f"{peer}_share",
            f"{peer}_over_after"]
    return df[keep].sort_values(["q_len", "batch", "context"]).reset_index(drop=True)


def peer_figure(df: pd.DataFrame, peer: str = "flashmla", title: str | None = None):
    """Grouped bars of peer_table: the after, the peer and the floor per case (log scale)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for col, name in (("after_us", "after (k3lab)"), (f"{peer}_us", peer),
                      ("floor_us", "floor (bytes / copy bw)")):
        fig.add_trace(go.Bar(x=df["case"], y=df[col], name=name, text=[f"{v:.1f}" for v in df[col]]))
    fig.update_layout(template="plotly_white", barmode="group", yaxis_type="log",
                      yaxis_title="us per decode step (graph replay)",
                      title=title or f"H200: k3lab's after against {peer} in the same run")
    return fig


def peer_kernels(device: str = "nvidia-h200", path=None) -> pd.DataFrame:
    """Per case and form of the committed kernel-times run: the time per call of a graph replay and
    each kernel's mean device duration (split kernel, merge kernel)."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / PEER_KERNELS
    rows = json.loads(Path(path).read_text()).get("rows")
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"{path} is not a run of scripts/device_mla_kernel_times.py")
    out = []
    for key, v in rows.items():
        case, form = key.split(".", 1)
        kernels = list(v["kernels"].items())
        if len(kernels) != 2:
            raise ValueError(f"{path}: {key} has {len(kernels)} kernels, expected a split and a merge kernel")
        (split_name, split), (merge_name, merge) = kernels
        out.append({"case": case, "form": form, "per_call_us": v["per_call_us"], "split_kernel": split_name,
                    "split_us": split["mean_us"], "merge_kernel": merge_name, "merge_us": merge["mean_us"]})
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------------------------
# what bounds the three missed targets: the data path of each policy alone, timed beside the after,
# the before and the einsum peer (committed H200 run of scripts/device_mla_bounds.py)

BOUNDS = "extra/bounds_c72bac9.json"
# target, the kernel it judges, (case, what that kernel's time must be at most, from the run's times),
# (case, the reader whose time bounds that kernel), what the reader is
BOUND_ROWS = (
    ("after share of copy bandwidth, 32K >= 70%", "after",
     ("ctx32k", lambda v, floor: floor / TARGETS["bw_32k"]),
     ("ctx32k", "ring split 128 +tail"), "the after's data path: the tile ring and an empty second kernel"),
    ("einsum / after, 32K >= 5x (graph replay)", "after",
     ("ctx32k", lambda v, floor: v["einsum (PyTorch)"] / TARGETS["vs_einsum_32k"]),
     ("ctx32k", "ring split 128 +tail"), "the after's data path: the tile ring and an empty second kernel"),
    ("before / after, 1K within 15%", "before",
     ("ctx1k", lambda v, floor: (1 + TARGETS["ratio_1k_band"]) * v["after (default)"]),
     ("ctx1k", "each: ring, 1 block, 1 copy/tile"),
     "the before policy's data path: one block reading the whole history"),
)
_KERNEL_KEY = {"after": "after (default)", "before": "before (default)"}


def target_bounds(device: str = "nvidia-h200", path=None) -> pd.DataFrame:
    """One row per missed target: the kernel it judges and its time, the time that kernel would need
    (`needed_us`), the time of the data path alone that bounds it (`bound_us`: a reader that moves the
    same bytes the same way and computes nothing), and `reachable` = bound_us <= needed_us, with the
    margin left for everything else. All times from one graph-replay run of
    scripts/device_mla_bounds.py."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / BOUNDS
    run = json.loads(Path(path).read_text())
    rows = run.get("rows")
    if not isinstance(rows, dict) or any("variants" not in r or "floor_us" not in r for r in rows.values()):
        raise ValueError(f"{path} is not a run of scripts/device_mla_bounds.py")
    out = []
    for target, kernel, (case, need), (bcase, reader), what in BOUND_ROWS:
        if case not in rows or bcase not in rows:
            raise ValueError(f"{path} has no {case!r} row")
        us = {k: v["us"] for k, v in rows[case]["variants"].items()}
        missing = {_KERNEL_KEY[kernel], "after (default)", "einsum (PyTorch)"} - set(us)
        if missing or reader not in rows[bcase]["variants"]:
            raise ValueError(f"{path}: {case} lacks {sorted(missing) or [reader]}")
        needed = need(us, rows[case]["floor_us"])
        bound = rows[bcase]["variants"][reader]["us"]
        out.append(
            {
                "target": target,
                "kernel": kernel,
                "kernel_us": us[_KERNEL_KEY[kernel]],
                "needed_us": needed,
                "bound": what,
                "bound_us": bound,
                "margin_us": needed - bound,
                "reachable": bound <= needed,
                "commit": run["commit"],
            }
        )
    return pd.DataFrame(out)


def bounds_figure(df: pd.DataFrame, title: str | None = None):
    """Horizontal bars per target of target_bounds: the kernel now, the time the target needs, and the
    data path alone."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for col, name in (("kernel_us", "the kernel now"), ("needed_us", "what the target needs"),
                      ("bound_us", "its data path alone (no arithmetic)")):
        fig.add_trace(go.Bar(y=df["target"], x=df[col], name=name, orientation="h",
                             text=[f"{v:.2f}" for v in df[col]], textposition="outside"))
    fig.update_layout(template="plotly_white", barmode="group", xaxis_type="log",
                      xaxis_title="us (graph replay)",
                      title=title or "H200: the missed targets against the data path that bounds them",
                      legend={"orientation": "h", "y": -0.2}, height=420)
    return fig


# ----------------------------------------------------------------------------------------------
# the cost of a verification group by its length (the after at 32K, B = 1, graph replay): what the
# draft-depth study's measured cost profile reads (k3lab.speculative.costs_from_records)


def verify_table(records, context: int = 32768, mode: str = "graph") -> pd.DataFrame:
    """Per verification length q_len (1 = a plain decode): the after's time at `context` (B = 1, the
    case as the library runs it, no '.' variants), its ratio to one token, the Triton kernel's time
    where a '<case>.triton' record exists, and the commit of each record."""
    after, triton = {}, {}
    for r in records:
        if (r.study != NAME or r.mode != mode or r.variant != "after" or r.shape.get("context") != context
                or r.shape.get("batch") != 1 or r.shape.get("ragged")):
            continue
        q = int(r.shape.get("q_len", 1))
        if "." not in r.case:
            after[q] = r
        elif r.case.endswith(".triton"):
            triton[q] = r
    if 1 not in after:
        raise ValueError(f"no one-token after record at context {context} ({mode}) among {len(records)} "
                         f"records")
    one = after[1].median_us
    rows = [{"q_len": q, "after_us": r.median_us, "per_token_ratio": r.median_us / one, "commit": r.commit,
             "triton_us": triton[q].median_us if q in triton else math.nan,
             "triton_commit": triton[q].commit if q in triton else None}
            for q, r in sorted(after.items())]
    return pd.DataFrame(rows)


def verify_figure(df: pd.DataFrame, title: str | None = None):
    """Bars of verify_table: the after's time per group length, the Triton kernel's where recorded."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_trace(go.Bar(x=df["q_len"], y=df["after_us"], name="after (CUDA, two tokens per block)",
                         text=[f"{v:.1f}" for v in df["after_us"]]))
    t = df[df["triton_us"].notna()]
    fig.add_trace(
        go.Bar(
            x=t["q_len"], y=t["triton_us"], name="Triton kernel", text=[f"{v:.1f}" for v in t["triton_us"]]
        )
    )
    fig.update_layout(template="plotly_white", barmode="group", xaxis_title="positions verified (q_len)",
                      yaxis_title="us per MLA layer (graph replay)",
                      title=title or "H200, 1 x 32K: an odd group costs what the next even one does")
    return fig
