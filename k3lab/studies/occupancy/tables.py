"""The occupancy study's arithmetic and tables: the levels of resident programs a shared-memory reserve
gives on each target, the levels planned from the committed ISA report (what a CPU shows), and the
measured levels as a table. It launches nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from k3lab.isa.targets import DEFAULT_TARGETS, TARGETS, Target

NAME = "occupancy"
# study case -> (ISA-report case whose launches are captured, which of its launches is relaunched)
CASES: dict[str, tuple[str, int]] = {"prologue_16k": ("kda_chunk.after_16k", 0)}
ISA_REPORT = Path(__file__).resolve().parents[3] / "profiles" / "isa" / "report.json"


def _overhead(target: Target) -> int:
    return 0 if target.is_amd else 1024  # NVIDIA's driver reserves 1 KiB of shared memory per block


def blocks_by_shared(target: Target, shared: int) -> int:
    """Programs per compute unit that `shared` bytes of shared memory / LDS per program allow."""
    return target.shared_budget // (shared + _overhead(target)) if shared else 1 << 30


def reserve_levels(target: Target, shared: int, natural: int) -> list[tuple[int, int]]:
    """(programs per unit, extra bytes) from `natural` (unreserved) down to 1: the smallest reserve that
    brings shared memory's limit to each count, within the per-program maximum."""
    out = [(natural, 0)]
    for b in range(natural - 1, 0, -1):
        need = target.shared_budget // (b + 1) + 1 - _overhead(target)  # per-program bytes just past b + 1
        extra = max(0, need - shared)
        if shared + extra > target.shared_per_block:
            break
        out.append((min(b, blocks_by_shared(target, shared + extra)), extra))
    return out


def level_case(case: str, programs: int) -> str:
    """The record case of one level of study case `case` (no '.', so the report's tables show it)."""
    return f"{case}_{programs}_per_unit"


def planned_levels(case: str, report: dict | None = None, targets=DEFAULT_TARGETS) -> pd.DataFrame:
    """The levels `case` would take on each target, from the committed ISA report's compile of its
    launch (`ISA_REPORT`: shared bytes, warps, the compiler's occupancy): what runs on a machine without
    a GPU. Programs per unit unreserved are the fewer of what registers (the report's occupancy: blocks
    per SM, or waves per SIMD over the program's waves) and shared memory allow. ValueError for an
    unknown case; KeyError naming the target the report lacks."""
    if case not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {case!r}")
    isa_case, index = CASES[case]
    rows = (report or json.loads(ISA_REPORT.read_text()))["rows"]
    out = []
    for name in targets:
        found = [r for r in rows if r.get("target") == name and r.get("case") == isa_case
                 and r.get("index") == index and r.get("ok")]
        if not found:
            raise KeyError(f"the ISA report has no compiled {isa_case} launch {index} for {name}")
        r, t = found[0], TARGETS[name]
        by_regs = (r["occupancy"] * t.simds // r["num_warps"] if r["occupancy_unit"] == "waves per SIMD"
                   else r["occupancy"])
        natural = min(by_regs, blocks_by_shared(t, r["shared_bytes"]))
        for programs, extra in reserve_levels(t, r["shared_bytes"], natural):
            out.append({"target": name, "kernel": r["kernel"], "programs_per_unit": programs,
                        "reserve_bytes": extra, "shared_bytes": r["shared_bytes"] + extra})
    return pd.DataFrame(out)


def levels_table(records) -> pd.DataFrame:
    """One row per measured level: programs per unit, the reserve, the time and its ratio to the
    unreserved level of the same case and device."""
    rows = [{"device": r.device, "case": r.extra.get("study_case", r.case),
             "programs_per_unit": r.extra["programs_per_unit"], "reserve_bytes": r.extra["reserve_bytes"],
             "shared_bytes": r.extra["shared_bytes"], "median_us": r.median_us,
             "outputs_identical": r.extra.get("outputs_identical")} for r in records]
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table = table.sort_values(["device", "case", "programs_per_unit"], ascending=[True, True, False],
                              ignore_index=True)
    base = table[table.reserve_bytes == 0].set_index(["device", "case"]).median_us
    table["vs_unreserved"] = [m / base.get((d, c), float("nan"))
                              for d, c, m in zip(table.device, table.case, table.median_us)]
    return table


def summary_text(records) -> str:
    """The levels of `records`, one line each, after `k3lab bench occupancy`'s common table."""
    table = levels_table(records)
    return "\n".join(f"{r.device} {r.case}: {r.programs_per_unit} per unit, reserve {r.reserve_bytes} B: "
                     f"{r.median_us:.2f} us ({r.vs_unreserved:.2f}x unreserved)" for r in table.itertuples())
