"""Tables of the kda_scan study for the notebook and logs, and the readers of its committed H200 records
(`k3lab.studies.kda_scan` re-exports every name here)."""

from __future__ import annotations

from pathlib import Path

from k3lab import bench

NAME = "kda_scan"


def crossover_table(records):
    """Per case (heads, batch, T): before / after / fla medians, the group size the rule chose, and
    after/before and after/fla (< 1: the scan wins). Takes Records or their dicts."""
    import pandas as pd

    rows = {}
    for r in records:
        r = r if isinstance(r, dict) else r.to_dict()
        if "." in r["case"]:
            continue  # group-size sweep points
        key = r["case"]
        row = rows.setdefault(
            key,
            {
                "case": key,
                "heads": r["shape"].get("heads"),
                "batch": r["shape"].get("batch"),
                "T": r["shape"].get("T"),
            },
        )
        row[f"{r['variant']}_us"] = r["median_us"]
        if r["variant"] == "after":
            row["group_size"] = r.get("extra", {}).get("group_size")
            row["floor_us"] = r.get("floor_us")
    df = pd.DataFrame(list(rows.values()))
    if df.empty:
        return df
    if {"after_us", "before_us"} <= set(df.columns):
        df["after/before"] = df["after_us"] / df["before_us"]
    if {"after_us", "fla_us"} <= set(df.columns):
        df["after/fla"] = df["after_us"] / df["fla_us"]
    return df.sort_values(["heads", "batch", "T"]).reset_index(drop=True)


def sweep_table(records):
    """Group-size sweep records -> DataFrame (case, group_size, median_us, sequential_steps)."""
    import pandas as pd

    rows = []
    for r in records:
        r = r if isinstance(r, dict) else r.to_dict()
        base, _, tag = r["case"].partition(".")
        if not (tag.startswith("gs") or tag == "walk"):
            continue
        rows.append(
            {
                "case": base,
                "group_size": r["extra"].get("group_size"),
                "median_us": r["median_us"],
                "sequential_steps": r["extra"].get("sequential_steps"),
                "chosen": r["extra"].get("chosen_group_size"),
            }
        )
    return pd.DataFrame(rows)


def reference_records(device: str = "nvidia-h200", root="profiles"):
    """The committed GPU records of this study (for a CPU reader)."""
    return bench.load_records(NAME, device=device, root=root)


PROLOGUE_PROBE = "extra/prologue_probe_80064e7.csv.gz"  # one launch of the CUDA prologue, 12 heads x 16K
# the probe's stages, in the order of its stamps (the timeline-probe build of kernels/kda_prologue.cu that
# wrote it is described in docs/kda_scan.md)
PROLOGUE_PROBE_STAGES = ("load g", "load q k v + G scan", "Qg Kd", "A's", "W/U factors", "inverse diag",
                         "inverse rest", "W U products", "stores")


def prologue_stages(path=None, device: str = "nvidia-h200", root=None):
    """Where the CUDA prologue's time goes, from a committed timeline probe of one launch (global-timer
    stamps per block after each stage): one row per stage with the median and p90 over the launch's
    blocks (us per block) and its share of a block's median lifetime."""
    import pandas as pd

    if path is None:
        path = Path(bench.PROFILES if root is None else root) / device / NAME / PROLOGUE_PROBE
    frame = pd.read_csv(path)
    stages = [c for c in PROLOGUE_PROBE_STAGES if c in frame.columns]
    if not stages or "total_us" not in frame.columns:
        raise ValueError(f"{path} is not a prologue probe (expected the columns {PROLOGUE_PROBE_STAGES})")
    total = float(frame["total_us"].median())
    return pd.DataFrame(
        {
            "stage": stages,
            "median_us": [float(frame[c].median()) for c in stages],
            "p90_us": [float(frame[c].quantile(0.9)) for c in stages],
            "share_of_block": [float(frame[c].median()) / total for c in stages],
        }
    )


WALK_BENCH = "extra/walk_bench_8464a89.json"  # each walking launch timed alone, 12 heads x 16K tokens


def walk_launches(path=None, device: str = "nvidia-h200", root=None):
    """The after's walking launches by kind, from a committed walk bench (each launch timed alone on the
    same prologue outputs, eager device events): one row per launch ('summaries', 'scan', 'replay',
    and 'after' for the whole call) with its 'triton' and 'cuda' times (us) and triton / cuda."""
    import json

    import pandas as pd

    if path is None:
        path = Path(bench.PROFILES if root is None else root) / device / NAME / WALK_BENCH
    rows = json.loads(Path(path).read_text()).get("rows_us", {})
    keys = {"summaries": "{}.scan.summaries", "scan": "{}.scan.scan", "replay": "{}.scan.replay",
            "after": "{}.after"}
    missing = [k.format(kind) for k in keys.values() for kind in ("triton", "cuda") if k.format(kind)
               not in rows]
    if missing:
        raise ValueError(f"{path} is not a walk bench (missing {missing[:4]})")
    frame = pd.DataFrame({"launch": list(keys),
                          "triton": [rows[k.format("triton")] for k in keys.values()],
                          "cuda": [rows[k.format("cuda")] for k in keys.values()]})
    frame["speedup"] = frame["triton"] / frame["cuda"]
    return frame


def summary_text(records) -> str:
    """What `k3lab bench kda_scan` prints after its records: before / after / fla per case with the
    after's errors, then the group-size sweep's table where the records hold one ('' for neither)."""
    parts = []
    rows = crossover_table(records).to_dict("records")
    if rows:
        lines = [f"{'case':16s} {'before':>8s} {'after':>8s} {'fla':>8s} {'floor':>6s}  gs  "
                 "o/S rel_l2 (after)"]
        for row in rows:
            err = next((r.error for r in records if r.case == row["case"] and r.variant == "after"), {}) or {}
            e = (
                f"{err['o']['rel_l2']:.1e}/{err['state']['rel_l2']:.1e}"
                if "o" in err
                else err.get("failed", "")[:40]
            )
            lines.append(
                f"{row['case']:16s} {row.get('before_us', float('nan')):8.0f} "
                f"{row.get('after_us', float('nan')):8.0f} {row.get('fla_us', float('nan')):8.0f} "
                f"{row.get('floor_us', float('nan')):6.0f}  {row.get('group_size')}  {e}"
            )
        parts.append("\n".join(lines))
    sweep = sweep_table(records)
    if len(sweep):
        sweep = sweep.sort_values(["case", "group_size"], na_position="last")  # the plain walk last
        whole = {"group_size": "{:.0f}".format, "median_us": "{:.0f}".format}
        table = sweep.to_string(index=False, na_rep="walk", formatters=whole)
        parts.append("group-size sweep (after):\n" + table)
    return "\n".join(parts)