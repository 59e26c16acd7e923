"""What MI355X would need for a roofline point whose kernel has gfx950 ISA facts: projected, never measured.

A roofline point (profiling.roofline.points) is one (study, case, variant) at the problem's bytes and
flops. Where the op's gfx950 launch for that case was compiled by the ISA report (the committed
profiles/isa/report.json, k3lab.isa; read by profiling.trend.committed_isa_report) and `CASES` pairs
the two at the same shape, `project()` derives:

- the compute rate the kernel's own instructions can reach: the published MI355X rate of the fastest
  matrix instruction kind in its code (bf16/f16, fp8, fp32 MFMA), or the fp32 vector rate where the code
  has no matrix instruction (the 12-head MLA before stays on the vector units);
- scaled by the share of the 4 x 256 SIMDs its launch can keep busy: a program (workgroup) runs on one
  CU and spreads its waves over that CU's 4 SIMDs, so programs x min(waves per program, 4), at most
  all of them; each SIMD has its own matrix unit and vector lanes, so 12 programs of 8 waves reach 48
  SIMDs' worth at most. A launch whose occupancy (waves per SIMD, from its VGPRs, AGPRs and LDS) is 0
  does not fit a CU and is not projected. Of several launches the fastest rate is kept, so the floor
  below stays a lower bound;
- the floor on MI355X at the study's bytes and flops: max(bytes / 8 TB/s, flops / that rate), and
  the TFLOP/s the kernel would need to reach it (flops / floor). That height, at the point's own
  intensity, is what plots.roofline draws, as an open marker labelled "projected (ISA, not measured)";
- where `CASES` names the launch that moves the study's bytes: the bandwidth each CU that launch keeps
  busy would need to pull for the floor, against an even 1/256 share of the 8 TB/s.

Nothing here ran on AMD hardware: the ISA facts are compile-time (instructions in the code, registers,
LDS), the peaks are AMD's published ones, and the floor says what the kernel would need, not what it
would get. A point without a `CASES` entry, or whose entry's report rows are missing or did not compile,
is not projected; `project()` returns it with the reason in `why_not`.

MI355X peaks (AMD Instinct MI355X product page and data sheet, amd.com/en/products/accelerators/instinct/
mi350/mi355x.html; AMD CDNA 4 architecture whitepaper; 2.4 GHz peak engine clock):
  HBM3E bandwidth          8.0 TB/s (k3lab.env.PEAKS['MI355X']; public runs measured about 7.2 TB/s)
  dense bf16 / fp16 matrix 2.5 PFLOP/s (k3lab.env.PEAKS['MI355X'] takes 2,500 TFLOP/s)
  dense fp8 matrix         5.0 PFLOP/s
  fp32 matrix              157.3 TFLOP/s (CDNA 4 has no xf32 matrix instructions)
  fp32 vector              157.3 TFLOP/s (packed FMA counted)
  256 compute units of 4 SIMDs, wave64 (k3lab.isa.targets.TARGETS['gfx950'])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from k3lab import env as _env
from k3lab.isa.targets import TARGETS
from k3lab.profiling.trend import committed_isa_report

TARGET = "gfx950"
LABEL = "MI355X: projected (ISA, not measured)"
_PEAK = _env.PEAKS["MI355X"]
BANDWIDTH_TBS = _PEAK.bandwidth_tbs
# TFLOP/s by the input type of a matrix instruction (the mnemonic's last field), and the vector rate
MATRIX_TFLOPS = {"bf16": _PEAK.bf16_tflops, "f16": _PEAK.bf16_tflops, "fp8": 5000.0, "bf8": 5000.0,
                 "f32": 157.3}
VECTOR_TFLOPS = 157.3
PEAK_SOURCE = ("AMD Instinct MI355X data sheet: 8 TB/s HBM3E, 2.5 PFLOP/s dense bf16, 5.0 dense fp8, "
               "157.3 fp32 matrix and vector")
PROJECTION_COLUMNS = ("name", "study", "case", "variant", "bytes", "flops", "isa_case", "launches",
                      "programs", "waves_per_program", "occupancy", "vgprs", "spills", "rate_kind",
                      "compute_tflops", "bandwidth_tbs", "floor_us", "need_tflops", "bound", "busy_cus",
                      "per_cu_gbs", "why_not")


@dataclass(frozen=True)
class IsaCase:
    """The ISA report's compile of one variant of a study case. `isa_case`: the report's case name;
    `kernel`: the launch that moves the study's bytes (None where several launches share them); `shape`:
    the record's shape fields the compile was made at (tests/test_isa_roofline.py holds them against the
    committed records)."""

    isa_case: str
    kernel: str | None
    shape: dict


def _mla(isa_case: str, ctx: int, q_len: int = 1, batch: int = 1, kernel: str = "_split_kernel") -> IsaCase:
    shape = {"batch": batch, "lengths_sum": batch * ctx, "q_len": q_len, "heads": 12}
    return IsaCase(isa_case, kernel, shape)


def _attn(tokens: int) -> dict:
    case = IsaCase(f"attn_res_norm.t{tokens}", "_attn_res_norm_kernel",
                   {"tokens": tokens, "sources": 9, "hidden": 7168})
    return {f"attn_res_t{tokens}_s9": {"after": case}, f"attn_res_t{tokens}_s9_graph": {"after": case}}


_KDA16K = {"batch": 1, "T": 16384, "heads": 12, "K": 128, "V": 128}
# (study, case) -> {variant: IsaCase}: only where the report compiled the op's launch at the record's shape
CASES: dict[tuple[str, str], dict[str, IsaCase]] = {
    ("mla_padding", "ctx32k"): {"before": _mla("mla_decode.before", 32768, kernel="_before_kernel"),
                                "after": _mla("mla_decode.after_32k", 32768)},
    ("mla_padding", "ctx1k"): {"after": _mla("mla_decode.after_1k", 1024)},
    ("mla_padding", "ctx128k"): {"after": _mla("mla_decode.after_128k", 131072)},
    ("mla_padding", "b64_8k"): {"after": _mla("mla_decode.after_64x8k", 8192, batch=64)},
    ("mla_padding", "verify2_32k"): {"after": _mla("mla_decode.verify_2", 32768, q_len=2)},
    ("mla_padding", "verify4_32k"): {"after": _mla("mla_decode.verify_4", 32768, q_len=4)},
    **{("copy_removal", c): v for t in (1, 64, 8192) for c, v in _attn(t).items()},
    ("kda_scan", "h12_b1_t16384"): {"before": IsaCase("kda_chunk.before_16k", None, _KDA16K),
                                    "after": IsaCase("kda_chunk.after_16k", None, _KDA16K)},
    ("kda_verify", "b1_t4"): {
        "after": IsaCase("kda_verify.after_b1_t4", "verify_narrow_kernel", {"B": 1, "T": 4, "H": 12}),
        "before": IsaCase("kda_verify.before_b1_t4", "verify_stream_kernel", {"B": 1, "T": 4, "H": 12})},
    ("kda_decode", "B1_H12"): {"before": IsaCase("kda_decode.before_b1", None, {"B": 1, "H": 12})},
    ("kda_decode", "B128_H12"): {"before": IsaCase("kda_decode.before_b128", None, {"B": 128, "H": 12})},
}


def _kind(mnemonic: str) -> str:
    """'v_mfma_f32_16x16x32_bf16' -> 'bf16': a matrix instruction's input type."""
    return mnemonic.rsplit("_", 1)[-1]


def launch_rate(row: dict, target=None) -> tuple[float, str, int]:
    """(TFLOP/s, what sets it, SIMDs busy) one launch of the report can reach on MI355X: the fastest
    matrix kind in its code (else the vector rate) times the share of the SIMDs its programs keep busy
    (programs x min(waves per program, SIMDs per CU), at most all). ValueError naming `row` for a launch
    that did not compile, does not fit a CU (occupancy 0) or whose matrix kind has no published rate."""
    t = target or TARGETS[TARGET]
    if not isinstance(row, dict) or not row.get("ok"):
        raise ValueError(f"row: expected a compiled ISA report row, got {row!r:.120}")
    kinds = {_kind(m) for m in row.get("matrix") or {}}
    unknown = sorted(k for k in kinds if k not in MATRIX_TFLOPS)
    if unknown:
        raise ValueError(f"row: no published MI355X rate for matrix kind(s) {unknown} "
                         f"(known: {sorted(MATRIX_TFLOPS)})")
    if kinds:
        kind = max(kinds, key=lambda k: MATRIX_TFLOPS[k])
        rate, what = MATRIX_TFLOPS[kind], f"{kind} matrix"
    else:
        rate, what = VECTOR_TFLOPS, "fp32 vector (no matrix instruction)"
    if int(row.get("occupancy") or 0) < 1:
        raise ValueError(f"row: {row.get('kernel')} has occupancy {row.get('occupancy')}: no wave fits "
                         "a SIMD")
    simds = t.simds * t.compute_units
    busy = min(simds, math.prod(row["grid"]) * min(int(row["num_warps"]), t.simds))
    return rate * busy / simds, what, busy


def _need(nbytes: float, flops: float, entry: IsaCase, rows: list[dict]) -> dict:
    t = TARGETS[TARGET]
    rates = [launch_rate(r, t) for r in rows]
    best = max(range(len(rows)), key=lambda i: rates[i][0])
    tflops, what, busy_simds = rates[best]
    mem_us, comp_us = nbytes / (BANDWIDTH_TBS * 1e6), flops / (tflops * 1e6)
    floor = max(mem_us, comp_us)
    main = [r for r in rows if entry.kernel and r["kernel"].rsplit(".", 1)[-1] == entry.kernel]
    out = {"launches": len(rows), "occupancy": min(int(r["occupancy"]) for r in rows),
           "vgprs": max(int(r.get("vgprs") or 0) for r in rows),
           "spills": sum(int(r["spills"]) for r in rows),
           "rate_kind": f"{what}, {busy_simds} of {t.simds * t.compute_units} SIMDs",
           "compute_tflops": tflops, "bandwidth_tbs": BANDWIDTH_TBS, "floor_us": floor,
           "need_tflops": flops / floor / 1e6,
           "bound": "bandwidth" if mem_us >= comp_us else "compute",
           "programs": None, "waves_per_program": None, "busy_cus": None, "per_cu_gbs": None}
    if main:
        r = main[0]
        programs = math.prod(r["grid"])
        busy_cus = min(t.compute_units, programs)
        out |= {"programs": programs, "waves_per_program": int(r["num_warps"]), "busy_cus": busy_cus,
                "per_cu_gbs": nbytes / (floor * 1e-6) / busy_cus / 1e9}
    return out


def project(points: pd.DataFrame, report: dict | None = None, cases=None) -> pd.DataFrame:
    """One row per point of `points` (profiling.roofline.points: name, study, case, variant, bytes,
    flops) with PROJECTION_COLUMNS: the MI355X floor and the TFLOP/s it needs (see the module
    docstring), or NaN there and `why_not` saying why the point is not projected. `report`: an ISA
    report dict (default: the committed one); `cases`: a CASES-like mapping (default CASES).
    ValueError naming the argument for a points frame without those columns, or a report without rows."""
    if not isinstance(points, pd.DataFrame):
        raise ValueError(f"points: expected a DataFrame of roofline points, got {type(points).__name__}")
    need = {"name", "study", "case", "variant", "bytes", "flops"}
    if not need <= set(points.columns):
        raise ValueError(f"points: need columns {sorted(need)}, got {list(points.columns)}")
    rep = committed_isa_report() if report is None else report
    if not isinstance(rep, dict) or not isinstance(rep.get("rows"), list):
        raise ValueError("report: expected an ISA report dict with a 'rows' list (k3lab.isa.report)")
    table = CASES if cases is None else cases
    by_case: dict[str, list[dict]] = {}
    for r in rep["rows"]:
        if r.get("target") == TARGET:
            by_case.setdefault(r["case"], []).append(r)
    out = []
    for p in points.itertuples(index=False):
        row = {c: None for c in PROJECTION_COLUMNS} | {"name": p.name, "study": p.study, "case": p.case,
                                                         "variant": p.variant, "bytes": p.bytes,
                                                         "flops": p.flops}
        entry = table.get((p.study, p.case), {}).get(p.variant)
        rows = by_case.get(entry.isa_case, []) if entry else []
        if entry is None:
            row["why_not"] = "no gfx950 ISA facts for this case and variant"
        elif not rows or not all(r.get("ok") for r in rows):
            row |= {"isa_case": entry.isa_case,
                    "why_not": f"{entry.isa_case}: {'not in the report' if not rows else 'did not compile'}"}
        elif not (p.bytes > 0 and p.flops > 0):
            row |= {"isa_case": entry.isa_case, "why_not": "no bytes or flops"}
        else:
            try:
                row |= {"isa_case": entry.isa_case} | _need(float(p.bytes), float(p.flops), entry, rows)
            except ValueError as e:
                row |= {"isa_case": entry.isa_case, "why_not": str(e)}
        out.append(row)
    return pd.DataFrame(out, columns=list(PROJECTION_COLUMNS))


def hover(row) -> str:
    """The hover text of one projected point: what the ISA says and what the floor needs."""
    text = (f"{row['name']}: {LABEL}<br>gfx950 compile {row['isa_case']}: {int(row['launches'])} launch(es), "
            f"{int(row['occupancy'])} waves/SIMD at least, {int(row['vgprs'])} VGPRs at most, "
            f"{int(row['spills'])} spills"
            f"<br>rate: {row['rate_kind']} = {row['compute_tflops']:.4g} TFLOP/s"
            f"<br>floor at {BANDWIDTH_TBS:g} TB/s: {row['floor_us']:.3g} us ({row['bound']}-bound), "
            f"needs {row['need_tflops']:.3g} TFLOP/s")
    if row.get("per_cu_gbs") is not None and not pd.isna(row["per_cu_gbs"]):
        even = BANDWIDTH_TBS * 1e3 / TARGETS[TARGET].compute_units
        text += (f"<br>{int(row['programs'])} programs keep {int(row['busy_cus'])} CUs busy: each must pull "
                 f"{row['per_cu_gbs']:.3g} GB/s ({row['per_cu_gbs'] / even:.3g}x an even share)")
    return text
