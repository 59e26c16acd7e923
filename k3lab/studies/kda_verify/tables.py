"""Tables of the kda_verify study (notebook 05): the workgroups each tile width launches, the bytes and
floors predicted before measuring, and the committed and fresh records as sweep and ablation tables.
They read records and launch nothing."""

from __future__ import annotations

import re

from k3lab import bench
from k3lab import env as _env
from k3lab.ops import kda_verify as kv

NAME = "kda_verify"


def bytes_moved(B: int, T: int, H: int, in_bytes: int, *, final_only: bool = False,
                V: int = kv.HEAD_DIM) -> int:
    """Memory traffic one call cannot avoid: read the state once, write it T times (or once), read q,
    k (in_bytes each), g (fp32), v and beta, write o (in_bytes)."""
    K = kv.HEAD_DIM
    state = B * H * K * V * 4
    writes = state if final_only else T * state
    inputs = B * T * H * (K * (2 * in_bytes + 4) + V * in_bytes + in_bytes)
    out = B * T * H * V * in_bytes
    return state + writes + inputs + out


def summary(records: list[bench.Record]):
    """One row per (case, mode): before / after / fla / floor and the ratios (bench.compare)."""
    return bench.compare(records)


UNITS = {"MI355X": 256, "H200": 132}  # CUs / SMs (seed; docs/k3.md)


UNIT_BACKEND = {"MI355X": "rocm", "H200": "cuda"}


def workgroup_table(batch: int = 1, heads: int = 12, v_dim: int = kv.HEAD_DIM) -> list[dict]:
    """Programs per launch for each tile width (heads x batch x V / width) against the compute
    units of an MI355X (256 CUs) and an H200 (132 SMs), and the width `choose_tile_v` picks there."""
    rows = []
    for width in kv.TILE_WIDTHS:
        n = kv.workgroups(batch, heads, width, v_dim)
        row = {"tile_v": width, "workgroups": n}
        for dev, units in UNITS.items():
            row[f"per {dev} unit"] = n / units
            row[f"{dev} units busy"] = min(n, units) / units
            row[f"{dev} picks"] = kv.choose_tile_v(batch, heads, v_dim, compute_units=units,
                                                  backend=UNIT_BACKEND[dev]) == width
        rows.append(row)
    return rows


def launch_floor_us(device: str = "nvidia-h200") -> float | None:
    """One empty kernel's time inside a CUDA graph on `device`: its committed launch_overhead record
    (case empty_kernel, graph mode); None where there is none."""
    recs = [r for r in bench.load_records("launch_overhead", device=device)
            if r.case == "empty_kernel" and r.mode == "graph"]
    return recs[0].median_us if recs else None


def predict(batch: int, positions: int, heads: int = 12, *, peak=None, launch_us: float | None = None,
            in_bytes: int = 2) -> dict:
    """Before measuring: bytes one verify call must move (state read, T state writes, inputs,
    outputs), the memory floor on `peak` (default: the H200's copy bandwidth, env.PEAKS), the launch
    floor (default: `launch_floor_us()`, the committed record of one empty kernel inside a CUDA graph;
    0 without one), and the same for the final-state-only mode fla implements."""
    pk = peak or _env.PEAKS["H200"]
    launch = (launch_floor_us() or 0.0) if launch_us is None else launch_us
    out = {"batch": batch, "positions": positions, "heads": heads}
    for label, final in (("all states", False), ("final state", True)):
        b = bytes_moved(batch, positions, heads, in_bytes, final_only=final)
        mem = b / (pk.bandwidth_tbs * 1e6)
        out[f"MB ({label})"] = b / 1e6
        out[f"memory floor us ({label})"] = mem
        out[f"floor us ({label})"] = max(mem, launch)
    out["launch floor us"] = launch
    return out


def reference_records(device: str = "nvidia-h200", root=None) -> list[bench.Record]:
    """The committed GPU records of this study (found from any working directory)."""
    return bench.load_records(NAME, device=device, root=root or bench.PROFILES)


def _is_sweep(case: str) -> bool:
    """A tile x waves sweep point of the Triton kernels (narrow, stream)."""
    return re.fullmatch(r"b\d+_t\d+\.(narrow|stream)\d+_w\d+", case) is not None


def sweep_table(records) -> "pandas.DataFrame":  # noqa: F821
    """The tile-width x waves sweep (graph replay): one row per (batch, kernel, tile, waves)."""
    import pandas as pd

    rows = []
    for r in records:
        if not _is_sweep(r.case) or r.mode != "graph":
            continue
        rows.append({"batch": r.shape["B"], "kernel": r.extra["kernel"], "tile_v": r.extra["tile_v"],
                     "num_warps": r.extra["num_warps"], "workgroups": r.extra["workgroups"],
                     "median_us": r.median_us, "floor_us": r.floor_us})
    return pd.DataFrame(rows).sort_values(["batch", "kernel", "tile_v", "num_warps"]).reset_index(drop=True)


def ablation_table(records, batch: int = 1, positions: int = 4) -> "pandas.DataFrame":  # noqa: F821
    """before -> narrow tiles -> + one wave -> + uniform length and hoisting (the Triton narrow kernel) ->
    the hand-written CUDA kernel -> + programmatic dependent launch (the recorded 'after'), graph replay,
    then the ragged (dynamic) path and fla. Each row names the kernel it timed and whether its launch
    was a programmatic dependent; rows whose record is missing are left out."""
    import pandas as pd

    base = f"b{batch}_t{positions}"
    steps = [("before (32 columns, 128 threads, per-token loads)", base, "before"),
             ("narrow tiles", f"{base}.narrow_only", "after"),
             ("+ one wave per program", f"{base}.narrow_1wave", "after"),
             ("+ compile-time length, hoisted loads and work (Triton narrow kernel)", f"{base}.narrow8_w1",
              "after"),
             ("hand-written CUDA kernel (lane pairs, 4 warps per tile)", f"{base}.cudawarp8_w4", "after"),
             ("after: kda_verify's default (+ programmatic dependent launch on NVIDIA)", base, "after"),
             ("ragged (cu_seqlens) path", f"{base}.ragged", "after"),
             ("fla fused_recurrent_kda (final state only)", base, "fla")]
    got = {(r.case, r.variant): r for r in records if r.mode == "graph"}
    rows = []
    for label, case, variant in steps:
        r = got.get((case, variant))
        if r is not None:
            rows.append({"step": label, "median_us": r.median_us, "kernel": r.extra.get("kernel"),
                         "pdl": bool(r.extra.get("pdl")), "tile_v": r.extra.get("tile_v"),
                         "num_warps": r.extra.get("num_warps"), "workgroups": r.extra.get("workgroups")})
    df = pd.DataFrame(rows)
    if not df.empty:
        df["vs before"] = df["median_us"].iloc[0] / df["median_us"]
    return df


def best_config(records, batch: int, positions: int = 4):
    """The fastest sweep point at one batch (graph replay): a Record, or None without a sweep."""
    pts = [r for r in records if r.mode == "graph" and r.shape["B"] == batch and r.shape["T"] == positions
           and _is_sweep(r.case)]
    return min(pts, key=lambda r: r.median_us) if pts else None
