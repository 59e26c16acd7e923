"""What each Triton kernel of k3lab compiles to on MI355X (gfx950), MI300X (gfx942) and the H200 (sm90),
proven on a CPU: no GPU, no ROCm, no CUDA driver.

Every kernel is compiled by Triton's own backends (its AMD backend bundles an LLVM that knows gfx950;
its NVIDIA backend bundles ptxas) at the launch configuration its op picks at K3's TP8 shapes on that
device (`cases`: the ops' own launch code, captured). Per kernel and target the report gives matrix
instructions by kind (MFMA / wgmma / mma.sync), vector FMAs, LDS or shared memory against the budget of
one compute unit, registers (VGPR / AGPR / SGPR, or per thread), spills, scratch and occupancy (waves per
SIMD, or blocks per SM). Counts are static (instructions in the code, not executed). What this cannot
show: speed, numbers, or that the code loads on a device; nothing here has run on AMD hardware.

    python -m k3lab.isa [--target gfx950,gfx942,sm90] [--case mla_decode.after_32k,...] [--json FILE]

`report()` is the same from Python; `table(report)` its rows as a DataFrame; `coverage.uncovered()`
lists jit functions no compile entry reaches. HIP C++ (kernels/*.cu) is `k3lab.isa.hip`.
"""

from __future__ import annotations

import time

from k3lab.isa.targets import DEFAULT_TARGETS, TARGETS, Target, parse_targets

__all__ = ["DEFAULT_TARGETS", "TARGETS", "Target", "case_names", "parse_targets", "problems", "report",
           "table"]


def case_names() -> list[str]:
    """Names of the compile entries (op.case), in report order."""
    from k3lab.isa.cases import CASES

    return list(CASES)


def _parse_cases(spec) -> list[str]:
    names = case_names()
    if spec is None:
        return names
    wanted = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else list(spec)
    picked = [n for n in names if any(n == w or n.startswith(w + ".") for w in wanted)]
    bad = [w for w in wanted if not any(n == w or n.startswith(w + ".") for n in names)]
    if bad or not picked:
        raise ValueError(f"cases must name entries (or ops) among {names}, got {spec!r}")
    return picked


def report(targets=None, cases=None, *, workers: int = 2, timeout_s: float = 240, cache: bool = True) -> dict:
    """Compile the entries `cases` (None: all; an op name takes all its cases) for `targets` (None:
    gfx950, gfx942, sm90) and return {"triton", "targets", "rows", "uncovered", "seconds"}. rows: one per
    (target, case, launch) with the figures (see asm.py) or ok=False and the error."""
    import triton

    from k3lab.isa import coverage
    from k3lab.isa.runner import compile_all

    tlist = parse_targets(targets)
    clist = _parse_cases(cases)
    t0 = time.perf_counter()
    rows = compile_all([t.name for t in tlist], clist, workers=workers, timeout_s=timeout_s, use_cache=cache)
    launched = {r["kernel"] for r in rows if r.get("kernel")}
    return {
        "triton": triton.__version__,
        "targets": {t.name: {"device": t.device, "compute_units": t.compute_units, "warp_size": t.warp_size,
                             "shared_budget": t.shared_budget, "budget": t.budget_label} for t in tlist},
        "rows": rows,
        "uncovered": coverage.uncovered(launched) if cases is None else [],
        "seconds": round(time.perf_counter() - t0, 1),
    }


def problems(rep: dict) -> list[dict]:
    """What CI holds against the report: a jit function no entry reaches; on every target a kernel that
    does not compile; on AMD targets also spills, scratch and LDS over budget. One dict per problem:
    case, kernel (function name), target, kind ('coverage', 'compile', 'spill', 'scratch', 'lds'), text,
    and known (its k3lab/isa/known.py entry, or None)."""
    from k3lab.isa.known import explain

    out = [{"case": None, "kernel": name, "target": None, "kind": "coverage", "known": None,
            "text": f"{name}: a @triton.jit function no compile entry reaches (add a case to "
                    f"k3lab/isa/cases.py)"}
           for name in rep.get("uncovered", [])]
    for r in rep["rows"]:
        kernel = (r.get("kernel") or "?").rsplit(".", 1)[-1]
        where = f"{r['case']} {kernel} on {r['target']}"
        found = []
        if not r.get("ok"):
            found.append(("compile", f"{where}: {r.get('error')}"))
        elif TARGETS[r["target"]].is_amd:
            if r.get("spills"):
                found.append(("spill", f"{where}: {r['spills']} registers spilled"))
            if r.get("scratch_bytes"):
                found.append(("scratch", f"{where}: {r['scratch_bytes']} bytes of scratch"))
            if not r.get("shared_ok"):
                found.append(("lds", f"{where}: LDS {r['shared_bytes']} B over the {r['shared_budget']} B "
                                     f"budget"))
        for kind, text in found:
            out.append(
                {
                    "case": r["case"],
                    "kernel": kernel,
                    "target": r["target"],
                    "kind": kind,
                    "text": text,
                    "known": explain(r["case"], kernel, r["target"], kind),
                }
            )
    return out


def _kinds(d: dict | None) -> str:
    if not d:
        return "-"
    return ", ".join(f"{n} {k.removeprefix('v_')}" for k, n in d.items())


def table(rep: dict):
    """The report's rows as a DataFrame, one per (case, kernel launch, target), the columns a reader
    compares: matrix instructions, vector FMAs, LDS / shared memory, registers, spills, occupancy."""
    import pandas as pd

    out = []
    for r in rep["rows"]:
        amd = TARGETS[r["target"]].is_amd
        base = {"case": r["case"], "kernel": (r.get("kernel") or "?").rsplit(".", 1)[-1],
                "target": r["target"],
                "warps/stages": f"{r.get('num_warps', '?')}/{r.get('num_stages', '?')}"}
        if not r.get("ok"):
            out.append(base | {"error": r.get("error", "?")})
            continue
        regs = (f"{r.get('vgprs')} v + {r.get('agprs')} a, {r.get('sgprs')} s" if amd else f"{r.get('regs')}")
        out.append(base | {
            "matrix": _kinds(r.get("matrix")), "vector FMA": r.get("fma_lanes_ops"),
            "shared KiB": round(r["shared_bytes"] / 1024, 1),
            "of budget": f"{100 * r['shared_bytes'] / r['shared_budget']:.0f}%",
            "registers": regs, "spills": r.get("spills"), "scratch B": r.get("scratch_bytes"),
            "occupancy": f"{r.get('occupancy')} {'waves/SIMD' if amd else 'blocks/SM'}", "error": "",
        })
    df = pd.DataFrame(out).astype(object)
    return df.where(df.notna(), "")
