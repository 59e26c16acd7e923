"""Every record as a trend, and the check that a deterministic figure has not worsened.

`history(study)` reads every version of profiles/<device>/<study>/*.json that git has (each commit that
touched them, and the working tree), so a record later overwritten still counts: one row per distinct
record with the commit it measured, its date, median_us, floor_us, the ratio to the floor and, where the
record has it, its launches per step. `plots.trend` draws it; `k3lab records trend STUDY [CASE]` prints and
draws it.

`regressions(current, committed, tolerances)` compares deterministic figures (the same on every run of
the same code) figure by figure and names each case that got worse by more than its tolerance. Three
sources of such figures are wired here, all computed on a CPU:
  - `isa_figures(report)`: registers and spills per kernel and target from a k3lab.isa report (the
    committed one is profiles/isa/report.json; the current tree's is `k3lab.isa.report(...)`);
  - `step_bytes_figures(records)`: the bytes per decode step the committed decode_step records were
    floored with, against k3lab.studies.decode_step.measure.step_bytes for the same case now;
  - `step_launch_figures()`: launches per decode step, counted on a CPU (`count_launches`: every
    torch operator that runs a kernel and every Triton launch one `DecodeStep.run()` makes) at
    `launch_config()` for each LAUNCH_CASES case, against the committed baseline STEP_LAUNCHES
    (profiles/cpu/step_launches.json, records written by `write_step_launches`).
The GPU records' own launches (extra['launches'] of a profiled run) are drawn by the trend; the CPU count
is the one CI can make: it counts the calls the step's program and its bound rows make on the CPU, so a
change that adds a launch to the program or to a row the CPU binds shows there, while a change to a
GPU-only kernel row (a CUDA backend) shows only in the GPU records.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
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
# Launches are counted exactly (the same code makes the same calls): one more launch per step fails.
STEP_LAUNCH_TOLERANCE = {"launches": 0, "triton": 0, "aten": 0}
STEP_LAUNCHES = Path(PROFILES) / "cpu" / "step_launches.json"
# case -> the step's settings; '.after' is every switch on, '.before' every switch off.
LAUNCH_CASES = {"decode.after": {"optimizations": "all"}, "decode.before": {"optimizations": "none"},
                "verify_q3.after": {"optimizations": "all", "q_len": 3}}
LAUNCH_BATCH, LAUNCH_CONTEXT = 1, 4
# aten operators that launch no kernel: metadata and allocation, profiler marks, dtype arithmetic.
NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
                       "alias", "lift_fresh", "promote_types", "result_type", "_record_function_enter_new",
                       "_record_function_exit", "set_", "resize_"})


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


# ------------------------------------------------------------------------------ launches per step
def launch_config():
    """The two-layer model the launches are counted at: K3Config.tiny()'s widths, layer 0 a KDA layer
    with the dense MLP, layer 1 an MLA layer with the MoE (mla_layer_period 2), each layer its own
    AttnRes block. The step is embed + per layer (mix, the attention part of the layer's kind, mix, the
    MLP part of its kind) + the final mix and lm_head, and a part's launches depend on its kind, not on
    the widths or the layer's place, so these two layers hold one of every part: K3's step makes the same
    parts' launches, repeated by its layer counts. A launch added to any part shows here, at about 3 s
    of Triton's interpreter on a CPU instead of the minutes of a full-depth step."""
    from k3lab.config import K3Config

    return dataclasses.replace(K3Config.tiny(), num_hidden_layers=2, mla_layer_period=2,
                               attn_res_block_size=1, name="launches-2-layer")


@contextlib.contextmanager
def count_launches():
    """A Counter, filled while the block runs, of the kernels this process launches: 'triton.<kernel>'
    per Triton launch (compiled or in the interpreter, a launch inside another counted once) and
    '<namespace>.<op>' ('aten.mm', or a library's own operator) per call of a torch operator that runs
    a kernel (views and NO_KERNEL left out; the torch calls a Triton launch makes inside the interpreter
    are not counted)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter, jit

    counts, inside = collections.Counter(), [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if not inside[0] and not func.is_view and name not in NO_KERNEL:
                counts[f"{func.namespace}.{name}"] += 1
            return func(*args, **(kwargs or {}))

    def counting(original):
        def run(self, *args, **kwargs):
            if not inside[0]:
                counts["triton." + getattr(getattr(self, "fn", None), "__name__", type(self).__name__)] += 1
            inside[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                inside[0] -= 1
        return run

    patched = [(cls, cls.run) for cls in (interpreter.InterpretedFunction, jit.JITFunction)]
    try:
        for cls, original in patched:
            cls.run = counting(original)
        with torch.no_grad(), _Count():
            yield counts
    finally:
        for cls, original in patched:
            cls.run = original


def launch_step(case: str, config=None):
    """The DecodeStep of `case` (a LAUNCH_CASES key) at `config` (default `launch_config()`), on the CPU
    in fp32, batch LAUNCH_BATCH over LAUNCH_CONTEXT cached positions, its tokens set."""
    import torch

    from k3lab.engine import DecodeStep

    if case not in LAUNCH_CASES:
        raise ValueError(f"case: expected one of {sorted(LAUNCH_CASES)}, got {case!r}")
    kw = LAUNCH_CASES[case]
    step = DecodeStep(config or launch_config(), LAUNCH_BATCH, LAUNCH_CONTEXT, device="cpu",
                      dtype=torch.float32, **kw)
    step.set_tokens(torch.arange(1, kw.get("q_len", 1) + 1).reshape(1, -1).repeat(LAUNCH_BATCH, 1))
    return step


def step_launches(step) -> dict:
    """Launches of one `step.run()` after one warm run: {'launches': all, 'triton': Triton launches,
    'aten': torch operators' kernels, 'kernels': {name: count}}."""
    step.run()  # first-call work (plans, caches) is not the step's
    with count_launches() as counts:
        step.run()
    triton = sum(v for k, v in counts.items() if k.startswith("triton."))
    return {"launches": sum(counts.values()), "triton": triton, "aten": sum(counts.values()) - triton,
            "kernels": dict(sorted(counts.items()))}


def committed_step_launches(path=None) -> dict[str, dict]:
    """The committed baseline (STEP_LAUNCHES, or `path`) as LAUNCH_CASES case -> figures (the records'
    extra; a record of case 'launches.decode', variant 'after' is the case 'decode.after')."""
    recs = [Record.from_dict(d) for d in json.loads(Path(path or STEP_LAUNCHES).read_text())]
    return {f"{r.case.removeprefix('launches.')}.{r.variant}": {k: r.extra[k] for k in
                                                               (*STEP_LAUNCH_TOLERANCE, "kernels")}
            for r in recs}


def step_launch_figures(cases=None, *, path=None, steps=None) -> tuple[dict, dict]:
    """(current, committed) launches per step per case (`cases`: LAUNCH_CASES keys, default all);
    `steps`: case -> a built step to count instead of `launch_step(case)` (a test plants one)."""
    committed = committed_step_launches(path)
    current = {}
    for case in cases or LAUNCH_CASES:
        current[case] = step_launches((steps or {}).get(case) or launch_step(case))
    return current, committed


def launch_changes(current: dict, committed: dict) -> list[str]:
    """Per case, the kernels whose count per step differs: 'case: name committed -> current'."""
    out = []
    for case in sorted(set(current) & set(committed)):
        now, then = current[case].get("kernels", {}), committed[case].get("kernels", {})
        out += [f"{case}: {k} {then.get(k, 0)} -> {now.get(k, 0)}" for k in sorted(set(now) | set(then))
                if now.get(k, 0) != then.get(k, 0)]
    return out


def write_step_launches(path=None) -> list[Record]:
    """Count every LAUNCH_CASES case now and write them to STEP_LAUNCHES (or `path`) as records (study
    'decode_step', case 'launches.<case>', the step's CPU eager time as the timing; the figures in
    extra): the baseline the CI check compares with. Run after a change that is meant to change the
    launches, and commit the file."""
    import torch

    recs = []
    for case in LAUNCH_CASES:
        step = launch_step(case)
        figures = step_launches(step)
        t = bench.time_fn(step.run, warmup=0, repeats=3, calls_per_sample=1, device="cpu")
        name, variant = case.rsplit(".", 1)
        cfg = step.config
        recs.append(bench.make_record(
            "decode_step", f"launches.{name}", variant, t, dtype=torch.float32,
            shape={"batch": LAUNCH_BATCH, "context_len": LAUNCH_CONTEXT, "q_len": step.q_len,
                   "layers": cfg.num_hidden_layers},
            config=cfg.name, optimizations=LAUNCH_CASES[case]["optimizations"], **figures,
            how="trend.count_launches around one DecodeStep.run() on the CPU (aten kernels and Triton "
                "launches); the timing is the CPU eager step, not a figure the check reads"))
    out = Path(path or STEP_LAUNCHES)
    out.write_text(json.dumps([r.to_dict() for r in recs], indent=1, sort_keys=True) + "\n")
    return recs
