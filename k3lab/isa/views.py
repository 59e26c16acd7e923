"""Tables and figures of the ISA facts for the notebooks (04: MLA on MI355X and AITER's kernels; 05: the KDA
prologue's LDS). Each compiles what it shows (k3lab.isa.report, cached) or reads the committed AITER
inventory (profiles/isa). Compiled only: no AMD timing, nothing run on AMD hardware."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import plotly.graph_objects as go

from k3lab import plots
from k3lab.isa import TARGETS, report

PROFILES = Path(__file__).resolve().parents[2] / "profiles" / "isa"
SEED_PROLOGUE_LDS_KIB = 79.5  # the seed's fused HIP prologue on MI355X (of 160 KiB per CU)


def _shown(rows: list[dict]) -> pd.DataFrame:
    """`rows` as a table whose empty cells say why: a build that does not compile has no figures (its
    error says why), one that compiles has no error."""
    frame = pd.DataFrame(rows).astype(object)
    return plots.say_missing(frame, {c: "none: compiles" if c == "error" else "n/a: does not compile"
                                     for c in frame.columns})


def _rows(rep: dict, label) -> pd.DataFrame:
    out = []
    for r in rep["rows"]:
        t = TARGETS[r["target"]]
        row = {"what": label(r), "kernel": (r.get("kernel") or "?").rsplit(".", 1)[-1], "target": r["target"]}
        if not r.get("ok"):
            out.append(row | {"compiles": False, "error": r.get("error", "")[:90]})
            continue
        grid = r.get("grid") or []
        programs = 1
        for g in grid:
            programs *= g
        out.append(row | {
            "compiles": True, "matrix instructions": ", ".join(f"{n} {k.removeprefix('v_')}" for k, n in
                                                               r["matrix"].items()) or "none",
            "vector FMAs": r["fma_lanes_ops"], "LDS KiB": round(r["shared_bytes"] / 1024, 1),
            "LDS of CU": f"{100 * r['shared_bytes'] / t.shared_budget:.0f}%",
            "VGPR + AGPR": f"{r.get('vgprs')} + {r.get('agprs')}" if t.is_amd else f"{r.get('regs')} regs",
            "spills": r["spills"], "occupancy": f"{r['occupancy']} {r['occupancy_unit']}",
            "programs": programs, "of units": f"{programs / t.compute_units:.2f}x {t.compute_units}"})
    return _shown(out)


def mla_mi355x(targets: str = "gfx950") -> pd.DataFrame:
    """Before (12 heads, vector units) and after (16 padded heads, MFMA, split history) at one token and a
    32K context, as compiled for `targets`: matrix instructions, vector FMAs, LDS, registers, occupancy
    and the programs each launches at B = 1 against the CUs."""
    rep = report(targets, "mla_decode.before,mla_decode.after_32k,mla_decode.verify_4")
    names = {"mla_decode.before": "before", "mla_decode.after_32k": "after (32K)",
             "mla_decode.verify_4": "after, verify 4"}
    return _rows(rep, lambda r: names[r["case"]])


def aiter_inventory(arch: str = "gfx950") -> pd.DataFrame:
    """AITER's prebuilt MLA decode code objects for `arch` (the committed inventory)."""
    inv = json.loads((PROFILES / "aiter_mla_inventory.json").read_text())
    rows = [{"file": k["file"], "query heads": k["query_heads"], "q / cache": f"{k['q_dtype']} / "
                                                                              f"{k['kv_dtype']}",
             "verify length": k["q_len"] or "any", "persistent": k["persistent"],
             "LDS KiB": k["lds_bytes"] // 1024, "VGPRs": k["vgprs"], "threads": k["workgroup_threads"]}
            for k in inv["kernels"] if k["arch"] == arch and k["family"] == "decode"]
    return pd.DataFrame(rows).sort_values(["query heads", "file"]).reset_index(drop=True)


def aiter_provenance() -> str:
    p = json.loads((PROFILES / "aiter_mla_inventory.json").read_text())["provenance"]
    return f"{p['wheel']} (sha256 {p['sha256'][:16]}...), read with {p['extracted_with']}"


def aiter_heads_figure(arch: str = "gfx950") -> go.Figure:
    """Decode code objects per query-head count: none for 12, so 12 heads cannot reach the assembly path."""
    inv = aiter_inventory(arch)
    counts = inv["query heads"].value_counts()
    heads = [12, 16, 128]
    fig = go.Figure(go.Bar(x=[str(h) for h in heads], y=[int(counts.get(h, 0)) for h in heads],
                           text=[int(counts.get(h, 0)) for h in heads], textposition="outside"))
    fig.update_layout(title=f"AITER's {arch} MLA decode kernels by query heads (amd-aiter wheel)",
                      xaxis_title="query heads per cache head (TP8: 12; padded: 16; DCP8 view: 128)",
                      yaxis_title="code objects", height=360)
    return fig


def kda_prologue_lds() -> pd.DataFrame:
    """The KDA chunk prologue's LDS / shared memory per program beside one compute unit's budget: the seed's
    HIP prologue on MI355X, k3lab's Triton prologue as the op launches it (gfx950, gfx942, H200) and the
    gfx950 what-if with exact fp32 products (what it needs to compile there)."""
    rep = report("gfx950,gfx942,sm90", "kda_chunk.before_16k,kda_chunk.prologue_fp32_products")
    rows = [{"kernel": "seed's fused HIP prologue", "target": "gfx950", "as": "the seed (MI355X)",
             "compiles": True, "KiB per program": SEED_PROLOGUE_LDS_KIB, "budget KiB": 160.0,
             "programs per unit by LDS": int(160 // 80)}]  # the request rounds to 80 KiB
    for r in rep["rows"]:
        if (
            not (r.get("kernel") or "").endswith(("_a_kernel", "_wu_kernel", "_inverse_kernel"))
            or r.get("index") == 1
        ):
            continue
        t = TARGETS[r["target"]]
        what = "what-if: fp32 products" if r["case"].endswith("fp32_products") else "op's launch"
        if what != "op's launch" and not t.is_amd:
            continue
        row = {"kernel": r["kernel"].rsplit(".", 1)[-1], "target": r["target"], "as": what,
               "compiles": r["ok"],
               "budget KiB": round(t.shared_budget / 1024, 1)}
        if r.get("ok"):
            kib = r["shared_bytes"] / 1024
            row |= {"KiB per program": round(kib, 1),
                    "programs per unit by LDS": int(t.shared_budget
                                                    // max(r["shared_bytes"] + (0 if t.is_amd else 1024), 1))}
        else:
            row["error"] = r.get("error", "")[:80]
        rows.append(row)
    return _shown(rows)


def lds_figure(table: pd.DataFrame) -> go.Figure:
    """Bars of KiB per program against each target's per-unit budget (the table of kda_prologue_lds)."""
    ok = table[table["compiles"] == True]  # noqa: E712 (an object column)
    labels = [f"{k} · {t} · {a}" for k, t, a in zip(ok["kernel"], ok["target"], ok["as"])]
    fig = go.Figure(
        [
            go.Bar(name="LDS / shared per program", y=labels, x=ok["KiB per program"], orientation="h"),
            go.Bar(
                name="budget per compute unit", y=labels, x=ok["budget KiB"], orientation="h", opacity=0.35
            ),
        ]
    )
    fig.update_layout(barmode="overlay", title="KDA prologue: on-chip memory per program vs one compute unit",
                      xaxis_title="KiB", height=420, margin={"l": 330})
    return fig
