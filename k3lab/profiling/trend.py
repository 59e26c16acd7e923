"""Every record as a trend, and the check that a deterministic figure has not worsened.

`history(study)` reads every version of profiles/<device>/<study>/*.json that git has (each commit that
touched them, and the working tree), so a record later overwritten still counts: one row per distinct
record with the commit it measured, its date, median_us, floor_us, the ratio to the floor and, where the
record has it, its launches per step. `plots.trend` draws it; `k3lab records trend STUDY [CASE]` prints and
draws it.

`regressions(current, committed, tolerances)` compares deterministic figures (the same on every run of
the same code) figure by figure and names each case that got worse by more than its tolerance. Two
sources of such figures are wired here, both computed on a CPU:
  - `isa_figures(report)`: registers and spills per kernel and target from a k3lab.isa report (the
    committed one is profiles/isa/report.json; the current tree's is `k3lab.isa.report(...)`);
  - `step_bytes_figures(records)`: the bytes per decode step the committed decode_step records were
    floored with, against k3lab.studies.decode_step.measure.step_bytes for the same case now.
Kernels per step are GPU figures (the records' launches); they are drawn by the trend, not checked on a
CPU.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pandas as pd

from k3lab import bench
from k3lab.bench.records import PROFILES, Record

TREND_COLUMNS = ("date", "record_commit", "git_commit", "device", "case", "variant", "mode", "median_us",
                 "floor_us", "floor_ratio", "launches")
# Per figure, how much worse the current tree may be before CI fails (absolute units of the figure).
ISA_TOLERANCE = {"registers": 8, "sgprs": 8, "spills": 0, "scratch_bytes": 0}
STEP_BYTES_TOLERANCE = {"weights_dense": 0.0, "mla_cache": 0.0, "kda_state": 0.0, "kda_conv": 0.0}


def _git(args: list[str], cwd: Path, stdin: str | None = None) -> str:
    done = subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, text=True, check=False,
                          timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:3])}: {done.stderr.strip()[:300]}")
    return done.stdout


def _versions(folder_glob: str, repo: Path) -> list[tuple[str, str, str, str]]:
    """(git commit, commit date, path, text) of every version of the files matching `folder_glob` that a
    commit changed, oldest first."""
    log = _git(["log", "--reverse", "--format=@%H %cI", "--name-only", "--", folder_glob], repo)
    wanted, commit, date = [], None, None
    for line in log.splitlines():
        if line.startswith("@"):
            commit, date = line[1:].split(" ", 1)
        elif line.endswith(".json"):
            wanted.append((commit, date, line))
    if not wanted:
        return []
    batch = "".join(f"{c}:{p}\n" for c, _, p in wanted)
    out = subprocess.run(["git", "cat-file", "--batch"], cwd=repo, input=batch.encode(), capture_output=True,
                         check=False, timeout=300).stdout
    texts, i = [], 0
    for _ in wanted:
        header_end = out.index(b"\n", i)
        parts = out[i:header_end].split()
        if len(parts) < 3 or parts[1] == b"missing":  # the file was deleted in that commit
            texts.append(None)
            i = header_end + 1
            continue
        size = int(parts[2])
        texts.append(out[header_end + 1:header_end + 1 + size].decode(errors="replace"))
        i = header_end + 1 + size + 1
    return [(c, d, p, t) for (c, d, p), t in zip(wanted, texts) if t is not None]


def _records_of(text: str) -> list[Record]:
    try:
        data = json.loads(text)
        return [Record.from_dict(d) for d in (data if isinstance(data, list) else [data])]
    except (ValueError, TypeError, AttributeError):
        return []  # not a record file (a study's extra/ tables, a README's JSON)


def history(study: str, case: str | None = None, *, device: str | None = None, root=None) -> pd.DataFrame:
    """Every distinct record of `study` (and `case`, when given) that git history or the working tree of
    profiles/ holds, one row each (TREND_COLUMNS), oldest measurement first. `device`: a folder name
    ('nvidia-h200'), default every device. `git_commit` is the commit that first committed the record
    ('working tree' for one not committed yet). A projected or modelled record (extra.projected, or
    measured_or_modelled 'projected' or 'modelled ...') is left out: it is no measurement of the device it is
    filed under."""
    if not isinstance(study, str) or not study:
        raise ValueError(f"study: expected a study name, got {study!r}")
    profiles = Path(PROFILES if root is None else root)
    repo = profiles.parent
    pattern = f"{profiles.name}/{device or '*'}/{study}/*.json"
    seen: dict[str, dict] = {}
    try:
        versions = _versions(pattern, repo)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        versions = []  # no git here (a copied tree): the working tree's records alone
    current = [("working tree", None, str(p.relative_to(repo)), p.read_text())
               for p in sorted(profiles.glob(f"{device or '*'}/{study}/*.json"))]
    for commit, _, _, text in versions + current:
        for r in _records_of(text):
            if r.study != study or (case is not None and r.case != case):
                continue
            label = str(r.extra.get("measured_or_modelled", ""))
            if r.extra.get("projected") is True or label.startswith(("projected", "modelled")):
                continue  # the model's output: no timing of the device (git history has some here)
            key = json.dumps(r.to_dict(), sort_keys=True)
            if key in seen:
                continue
            launches = r.extra.get("launches")
            seen[key] = {"date": r.date, "record_commit": r.commit, "git_commit": commit, "device": r.device,
                         "case": r.case, "variant": r.variant, "mode": r.mode, "median_us": r.median_us,
                         "floor_us": r.floor_us,
                         "floor_ratio": r.median_us / r.floor_us if r.floor_us else math.nan,
                         "launches": launches if isinstance(launches, (int, float)) else math.nan}
    df = pd.DataFrame(list(seen.values()), columns=list(TREND_COLUMNS))
    return df.sort_values(["date", "case", "variant"], kind="stable").reset_index(drop=True)


def regressions(current: dict, committed: dict, tolerances: dict[str, float], *, what: str) -> list[str]:
    """One line per (case, figure) where `current[case][figure]` exceeds `committed[case][figure]` by more
    than `tolerances[figure]`: '<what> <case>: <figure> <committed> -> <current> (tolerance +t)'. Cases or
    figures missing on either side are not compared (a new kernel has no baseline yet)."""
    out = []
    for case in sorted(set(current) & set(committed)):
        for fig, tol in tolerances.items():
            now, then = current[case].get(fig), committed[case].get(fig)
            if now is None or then is None:
                continue
            if now > then + tol:
                out.append(f"{what} {case}: {fig} {then:g} -> {now:g} (tolerance +{tol:g})")
    return out


def isa_figures(report: dict) -> dict[str, dict[str, float]]:
    """Per '<target> <case> <kernel>#<index>' of a k3lab.isa report's compiled rows: registers (VGPRs
    with AGPRs on AMD, registers per thread on NVIDIA), sgprs (AMD), spills, scratch_bytes."""
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise ValueError("report: expected a k3lab.isa report (a dict with a rows list)")
    out = {}
    for r in report["rows"]:
        if not r.get("ok"):
            continue
        key = f"{r['target']} {r['case']} {str(r.get('kernel', '?')).rsplit('.', 1)[-1]}#{r.get('index', 0)}"
        regs = r.get("vgprs_total", r.get("regs"))
        figures = (("registers", regs), ("sgprs", r.get("sgprs")), ("spills", r.get("spills")),
                   ("scratch_bytes", r.get("scratch_bytes")))
        out[key] = {k: float(v) for k, v in figures if isinstance(v, (int, float))}
    return out


def committed_isa_report(path=None) -> dict:
    """profiles/isa/report.json (or `path`)."""
    return json.loads(Path(path or Path(PROFILES) / "isa" / "report.json").read_text())


def step_bytes_figures(records=None, config=None) -> tuple[dict, dict]:
    """(current, committed) bytes per decode step per case: the committed decode_step records that carry
    extra['bytes'] (bf16 projections: a case named '...fp8' carries other dense bytes and is left out),
    and step_bytes for the same batch, context and q_len from the current tree (K3Config.tp_slice(8),
    the records' model)."""
    from k3lab.config import K3Config
    from k3lab.studies.decode_step.measure import step_bytes

    recs = list(bench.load_records("decode_step", device="nvidia-h200") if records is None else records)
    config = config or K3Config.tp_slice(8)
    current, committed = {}, {}
    for r in recs:
        b = r.extra.get("bytes")
        if not isinstance(b, dict) or "fp8" in r.case or not {"batch", "context_len"} <= set(r.shape):
            continue
        key = f"{r.case} {r.variant} {r.mode}"
        committed[key] = {k: float(b[k]) for k in STEP_BYTES_TOLERANCE if k in b}
        now = step_bytes(config, r.shape["batch"], r.shape["context_len"], r.shape.get("q_len", 1))
        current[key] = {k: float(now[k]) for k in STEP_BYTES_TOLERANCE}
    return current, committed
