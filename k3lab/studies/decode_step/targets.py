"""The decode step's targets as data, the one run that measures them, and its pass/miss table.

    python -m k3lab.studies.decode_step.targets --json $OUT/decode_step_targets.json --budget-s 540

`TARGETS` is where the targets the step is judged by are written (read by `target_rows`, and by any
notebook or doc that states them, through `TARGETS` or `OF_FLOOR`): the step at its default settings
(`all_on_default`: the one-row GEMV at B = 1, the matrix library above) at B = 1 within 60% of its
bytes floor at 1K, 32K and 128K and at B = 64, 8K within 80%; the article's precisions
(`all_on_article`) at B = 1, 1K within 70% of their own floor and faster than FP8 projections
(`all_on_fp8`). A share of the floor is floor / step time, the floor being the record's
(`measure.case_floor` at the variant's precision with the routed experts its checked step read,
`measure.variant_floor`); the step time is the graph replay where the step was captured, else eager
(said in the row).

The run (`run`) measures only the (case, variant) pairs the targets name (`units`), each exactly as the
whole-step study does (`measure.measure_variant`: the logits checked against the variant's reference
before any timing, eager then graph timing with the study's warm-up and repeats, no profiler pass), so
its records are the study's and `k3lab import` files them under profiles/<device>/decode_step/. The
pairs run case by case (the case's reference logits computed once), B = 1, 1K first. With `budget_s`
a pair whose estimate (`UNIT_S`, scaled up by how much slower than their estimates the pairs before it
ran) would end past the budget is not started; the run goes on with the next pairs, and every pair left
out is named with why (in the log and in the table); so is a pair that raised (out of memory, a kernel
that failed: its traceback logged), and the run goes on. The records go to --json after each pair, so a
run cut short keeps what it measured; the table is printed last.

Estimate (`estimate_s`): `SETUP_S` plus `UNIT_S` summed, from the committed H200 records' medians at
the study's counts (per pair about ten eager steps: the checked one, one warm-up and five timed ones,
three more around the two graph captures; seven graph replays; the case's reference step: 0.65-0.71 s
all off at B = 1, 10.4 s at B = 64, 8K) plus what a machine with cold Triton and kernel caches spends
compiling (the H100 report logs: 20-30 s for the first variant of a kind). H100: the steps about 1.3x
longer, the compiling the same.

On a CPU the pairs of B = 1, 1K run at the study's CPU case (`measure.CPU_CASES`, the tiny config with
Triton in its interpreter), the article step left out as the study leaves it out there
(`measure.CPU_SKIPPED`) and the other cases named as GPU cases: a check that the run and its table work,
whose times are not speeds (the rows say so instead of pass or miss). On a GPU the run has been made
on an H100 only (its records under profiles/nvidia-h100-80gb-hbm3/decode_step/, the table in
docs/decode_step.md): the four default pairs and the FP8 one in 50 s from a warm kernel cache, under the
estimates above; B = 1, 1K's three pairs, the article's included, in 82 s on a fresh machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from k3lab import bench
from k3lab.ops import int_arg

from . import measure, tables
from .tables import DEVICE, NOT_MEASURED


@dataclass(frozen=True)
class Target:
    """One target: `variant` (a `measure.variants()` name) at `case` (a `measure.GPU_CASES` name) reaches
    at least `of_floor` of its bytes floor (floor / step time), or is faster than `faster_than` (another
    variant of the same case); exactly one of the two. `what` says what it is about."""

    case: str
    variant: str
    of_floor: float | None = None
    faster_than: str | None = None
    what: str = ""

    def __post_init__(self):
        if self.case not in measure.GPU_CASES:
            raise ValueError(f"case must be among {list(measure.GPU_CASES)}, got {self.case!r}")
        for label in ("variant", "faster_than"):
            v = getattr(self, label)
            if (v is not None or label == "variant") and v not in measure.variants():
                raise ValueError(f"{label} must be a decode_step variant, got {v!r}")
        if (self.of_floor is None) == (self.faster_than is None):
            raise ValueError("a target takes exactly one of of_floor and faster_than")
        if self.of_floor is not None and not 0 < self.of_floor <= 1:
            raise ValueError(f"of_floor must be a share in (0, 1], got {self.of_floor!r}")

    def text(self) -> str:
        """The target as the table prints it."""
        if self.of_floor is not None:
            return f">= {self.of_floor:.0%} of floor"
        return f"faster than {self.faster_than}"


DEFAULT_STEP = "the default step (the one-row GEMV at B = 1, the matrix library above)"
ARTICLE = "the article's precisions (FP8 projections, MXFP4 experts, FP8 MLA cache)"
TARGETS: tuple[Target, ...] = (
    Target("b1_1k", "all_on_default", of_floor=0.60, what=DEFAULT_STEP),
    Target("b1_1k", "all_on_article", of_floor=0.70, what=ARTICLE),
    Target("b1_1k", "all_on_article", faster_than="all_on_fp8", what=ARTICLE + " against FP8 projections"),
    Target("b1_32k", "all_on_default", of_floor=0.60, what=DEFAULT_STEP),
    Target("b1_128k", "all_on_default", of_floor=0.60, what=DEFAULT_STEP),
    Target("b64_8k", "all_on_default", of_floor=0.80, what=DEFAULT_STEP),
)
# the share-of-floor targets by '<case>.<variant>' (what prose binds a figure to)
OF_FLOOR: dict[str, float] = {f"{t.case}.{t.variant}": t.of_floor for t in TARGETS if t.of_floor is not None}
CASES = tuple(dict.fromkeys(t.case for t in TARGETS))  # the cases the targets name, in order
# on a CPU: the study's CPU case stands in for these GPU cases (the others are not run there)
CPU_STANDS_FOR = {"b1_1k": next(iter(measure.CPU_CASES))}

# Seconds on an H200 from a cold start (see the module docstring): the run's setup (imports, the .cu
# kernels built in parallel, the weights drawn, the copy bandwidth timed), then each pair with what it
# compiles and, for the first pair of a case, the case's reference step.
SETUP_S = 30.0
UNIT_S = {("b1_1k", "all_on_default"): 45.0,  # reference 0.65 s, the step's Triton kernels, GEMV tuning
          ("b1_1k", "all_on_article"): 60.0,  # two quantizations, MXFP4 / FP8-cache kernels, its reference
          ("b1_1k", "all_on_fp8"): 35.0,      # the W8A16 GEMV tuned per width
          ("b1_32k", "all_on_default"): 15.0,
          ("b1_128k", "all_on_default"): 20.0,
          ("b64_8k", "all_on_default"): 45.0}  # reference 10.4 s (all off at B = 64), B = 64 kernels
# a pair at the CPU case: about four interpreted steps of ~3 s (the article step is left out there)
CPU_UNIT_S = {"all_on_default": 12.0, "all_on_fp8": 12.0}


FAILED = "failed:"  # how a pair that raised is named among those left out (its error follows)


def units(cases=None) -> list[tuple[str, str]]:
    """The (case, variant) pairs the targets of `cases` (default: every target case, `CASES`) need,
    grouped by case in `CASES` order: each target's variant, then the one it must beat."""
    chosen = check_cases(cases)
    out = []
    for case in CASES:
        if case in chosen:
            for t in TARGETS:
                if t.case == case:
                    out += [(case, t.variant)] + ([(case, t.faster_than)] if t.faster_than else [])
    return list(dict.fromkeys(out))


def estimate_s(cases=None) -> float:
    """The run's estimated seconds on an H200 (SETUP_S plus UNIT_S of `units(cases)`)."""
    return SETUP_S + sum(UNIT_S[u] for u in units(cases))


def check_cases(cases, label: str = "cases") -> list[str]:
    """`cases` (None: all of CASES) as a list; ValueError naming the argument (`label`) for an unknown
    case."""
    if cases is None:
        return list(CASES)
    if isinstance(cases, str) or not all(isinstance(c, str) for c in cases):
        raise ValueError(f"{label} must be a list of case names among {list(CASES)}, got {cases!r}")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"{label} must be among {list(CASES)}, got unknown {unknown}")
    return list(cases)


def check_budget(budget_s, label: str = "budget_s") -> float | None:
    """budget_s: None (no budget) or a positive finite number of seconds; ValueError naming it
    (`label`)."""
    if budget_s is None:
        return None
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not math.isfinite(budget_s) \
            or budget_s <= 0:
        raise ValueError(f"{label} must be a positive number of seconds or None, got {budget_s!r}")
    return float(budget_s)


def plan(cases=None) -> tuple[list[tuple[str, str, str]], dict[tuple[str, str], str]]:
    """(runs, left out) on this machine: runs = (target case, case run here, variant) for each pair of
    `units(cases)` this machine runs; left out = {(target case, variant): why} for the others (on a CPU,
    the GPU cases and `measure.CPU_SKIPPED`'s variants)."""
    gpu = measure.on_gpu()
    runs, left = [], {}
    for case, variant in units(cases):
        here = case if gpu else CPU_STANDS_FOR.get(case)
        if here is None:
            left[case, variant] = (f"a GPU case: on a CPU only {', '.join(CPU_STANDS_FOR)} runs (as "
                                   f"{', '.join(CPU_STANDS_FOR.values())})")
        elif not gpu and variant in measure.CPU_SKIPPED:
            left[case, variant] = f"left out on a CPU: {measure.CPU_SKIPPED[variant]}"
        else:
            runs.append((case, here, variant))
    return runs, left


def run(cases=None, *, budget_s: float | None = None, repeats: int = 5, distinct_layers: int = 3,
        log=print, on_record=None) -> tuple[list[bench.Record], dict[tuple[str, str], str]]:
    """Measure the pairs of `plan(cases)` (module docstring): (records, left out), left out =
    {(target case, variant): why} for every pair not measured (not run here, past `budget_s`, or
    FAILED: a pair that raised is named with its error, its traceback logged, and the run goes on).
    on_record(records so far) is called after each pair. Every argument is checked before anything
    runs: ValueError naming it."""
    check_cases(cases)
    budget_s = check_budget(budget_s)
    int_arg("repeats", repeats, low=1, what="a positive integer")
    int_arg("distinct_layers", distinct_layers, low=1, what="a positive integer")
    t0 = time.perf_counter()
    runs, left = plan(cases)
    for (case, variant), why in left.items():
        log(f"targets: {case} {variant} not run: {why}")
    gpu = measure.on_gpu()
    if gpu and runs:
        from k3lab.report.kernels import build_all

        built, note = build_all()
        log(f"targets: kernels ({note}): " + ", ".join(f"{n} {s}" for n, _, s in built)
            + f" in {time.perf_counter() - t0:.0f} s")
    records: list[bench.Record] = []
    if not runs:
        return records, left
    weights = measure.bench_weights(distinct_layers, log)
    bandwidth = measure.measured_bandwidth_tbs()
    log(f"targets: copy bandwidth {bandwidth[0]:.2f} TB/s ({bandwidth[1]}); setup took "
        f"{time.perf_counter() - t0:.0f} s")
    spent = guessed = 0.0  # seconds the pairs run so far took, and what UNIT_S estimated for them
    refs: dict = {}
    refs_case = None
    with tempfile.TemporaryDirectory() as trace_dir:
        for case, here, variant in runs:
            base = UNIT_S[case, variant] if gpu else CPU_UNIT_S[variant]
            est = base * max(1.0, spent / guessed if guessed else 1.0)  # a slower machine: scaled up
            elapsed = time.perf_counter() - t0
            if budget_s is not None and elapsed + est > budget_s:
                left[case, variant] = (f"past the budget: {elapsed:.0f} s spent, about {est:.0f} s more for "
                                       f"it, budget {budget_s:.0f} s")
                log(f"targets: {case} {variant} not run: {left[case, variant]}")
                continue
            if here != refs_case:  # a new case: the last one's reference logits go
                refs, refs_case = {}, here
            start = time.perf_counter()
            try:
                recs = measure.measure_variant(here, variant, weights, refs, bandwidth, repeats=repeats,
                                               profile=False, trace_dir=trace_dir)
            except Exception as exc:  # noqa: BLE001 - named in the table as failed; the other pairs still run
                first = (str(exc).splitlines() or [""])[0][:200]
                left[case, variant] = f"{FAILED} {type(exc).__name__}: {first}"
                log(traceback.format_exc().rstrip())
                log(f"targets: {case} {variant} {left[case, variant]}")
                refs, refs_case = {}, None
                measure._free()
                continue
            took = time.perf_counter() - start
            spent, guessed = spent + took, guessed + base
            records += recs
            log(f"  {here} {variant}: " + ", ".join(f"{r.mode} {r.median_us / 1e3:.2f} ms" for r in recs)
                + f"  in {took:.0f} s (estimate {est:.0f} s)  [{time.perf_counter() - t0:.0f} s]")
            if on_record is not None:
                on_record(records)
    return records, left


def _share(x: float) -> str:
    return f"{x:.0%}"


def target_rows(records=None, *, left=None, stands_for=None, device: str = DEVICE) -> list[dict]:
    """One row per target (TARGETS), then one per variant a target is compared with that has no target
    of its own: case (the case of the records, with the target's case beside it where another stands
    for it), variant, ms, mode, floor_ms, of_floor, target, verdict, note. records: a run's (default: the
    committed ones of `device`); left: {(target case, variant): why not measured} (`run`'s); stands_for:
    {target case: case of the records} (a CPU run's `CPU_STANDS_FOR`). A pair without a record reads
    NOT_MEASURED with why in note; verdict is 'pass' or 'miss' for GPU records, 'n/a' for CPU ones (their
    times are not speeds), 'not measured' without a record, 'check failed' where the logits were not
    finite."""
    idx = tables._index(tables.load(records, device))
    left, stands_for = dict(left or {}), dict(stands_for or {})

    def lookup(case: str, variant: str):
        here = stands_for.get(case, case)
        rec = idx.get((here, variant, "graph")) or idx.get((here, variant, "eager"))
        label = here if here == case else f"{here} (for {case})"
        why = left.get((case, variant), f"no record of {here}.{variant}")
        return rec, label, why

    def measured(rec) -> dict:
        ms = rec.median_us / 1e3
        of = rec.floor_us / rec.median_us if rec.floor_us else None
        chk = (rec.error or {}).get("logits_vs_reference")
        note = (f"logits vs {chk['reference']}: rel_l2 {chk['rel_l2']:.3g}" if isinstance(chk, dict)
                else "the reference" if chk else "no check recorded")
        if rec.mode == "eager" and rec.backend != "cpu":
            note += "; eager: the step was not captured as a graph"
        return {"ms": ms, "mode": rec.mode, "floor_ms": rec.floor_us / 1e3 if rec.floor_us else NOT_MEASURED,
                "of_floor": of if of is not None else NOT_MEASURED, "note": note,
                "finite": not isinstance(chk, dict) or chk.get("finite", True)}

    def verdict(rec, ok: bool) -> str:
        if rec.mode == "cpu" or rec.backend == "cpu":
            return "n/a (CPU times are not speeds)"
        return "pass" if ok else "miss"

    rows = []
    missing = {"ms": NOT_MEASURED, "mode": NOT_MEASURED, "floor_ms": NOT_MEASURED, "of_floor": NOT_MEASURED}
    for t in TARGETS:
        rec, label, why = lookup(t.case, t.variant)
        row = {"case": label, "variant": t.variant, "target": t.text()}
        if rec is None:
            rows.append({**row, **missing, "verdict": "not measured", "note": why})
            continue
        m = measured(rec)
        finite = m.pop("finite")
        if t.of_floor is not None:
            ok = isinstance(m["of_floor"], float) and m["of_floor"] >= t.of_floor
        else:
            other, _, owhy = lookup(t.case, t.faster_than)
            if other is None:
                rows.append({**row, **m, "verdict": "not measured",
                             "note": f"{t.faster_than} not measured: {owhy}"})
                continue
            ok = rec.median_us < other.median_us
            m["note"] = f"{t.faster_than} {other.median_us / 1e3:.2f} ms ({other.mode}); " + m["note"]
        rows.append({**row, **m, "verdict": verdict(rec, ok) if finite else
                     "check failed (logits not finite)"})
    targeted = {(t.case, t.variant) for t in TARGETS}
    for t in TARGETS:
        if t.faster_than and (t.case, t.faster_than) not in targeted:
            targeted.add((t.case, t.faster_than))
            rec, label, why = lookup(t.case, t.faster_than)
            row = {"case": label, "variant": t.faster_than, "target": f"none (compared with {t.variant})",
                   "verdict": "-"}
            if rec is None:
                rows.append({**row, **missing, "verdict": "not measured", "note": why})
            else:
                m = measured(rec)
                m.pop("finite")
                rows.append({**row, **m})
    return rows


COLUMNS = (("case", "case"), ("variant", "variant"), ("ms", "ms"), ("floor_ms", "floor ms"),
           ("of_floor", "% of floor"), ("target", "target"), ("verdict", "pass/miss"), ("note", "note"))


NOTE_CHARS = 100  # a note longer than this is cut in the printed table (the run's log holds it whole)


def _cell(key: str, v) -> str:
    """One figure of a target row as the tables write it: ms to two decimals, shares in percent, '-' for
    NOT_MEASURED (the verdict column says so in words)."""
    if isinstance(v, float):
        return _share(v) if key == "of_floor" else f"{v:.2f}"
    if v == NOT_MEASURED and key != "verdict":
        return "-"
    return str(v)


def table_text(rows: list[dict]) -> str:
    """`target_rows` as a plain-text table: ms to two decimals, shares in percent, '-' for a figure
    NOT_MEASURED (the pass/miss column says so), notes cut at NOTE_CHARS."""
    def cell(key: str, v) -> str:
        v = _cell(key, v)
        return v if key != "note" or len(v) <= NOTE_CHARS else v[:NOTE_CHARS - 3] + "..."

    body = [[cell(k, r.get(k, "")) for k, _ in COLUMNS] for r in rows]
    head = [h for _, h in COLUMNS]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [head, *body]]
    return "\n".join(lines)


DOC_BEGIN = ("<!-- targets table: python -c \"from k3lab.studies.decode_step import targets; "
             "targets.write_doc()\" (k3lab/studies/decode_step/targets.py) -->")
DOC_END = "<!-- end of targets table -->"


def doc_markdown(device: str = "nvidia-h100-80gb-hbm3", root=None) -> str:
    """docs/decode_step.md's targets table: `target_rows` of `device`'s committed records as markdown,
    with the device and the copy bandwidth they measured; every figure from the records (root: default
    the tree's profiles/)."""
    from k3lab import bench

    recs = bench.load_records(study="decode_step", device=device, root=root)
    rows = target_rows(recs, device=device)
    pairs = {(row["case"], row["variant"]) for row in rows if row["ms"] != NOT_MEASURED}
    named = [r for r in recs if tuple(r.case.split(".")[:2]) in pairs]
    if not named:
        return f"No decode-step target of {device} is committed.\n"
    bws = sorted({round((r.extra or {}).get("bandwidth_tbs") or 0, 2) for r in named} - {0})
    head = (f"On {named[0].device}, graph replay where captured; records under profiles/{device}/"
            f"decode_step/ (each names its tree; copy bandwidth measured in the runs "
            f"{' and '.join(f'{b:.2f}' for b in bws)} TB/s).")
    out = [head, "", "| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        out.append("| " + " | ".join(_cell(k, r.get(k, "")) for k, _ in COLUMNS) + " |")
    return "\n".join(out) + "\n"


def write_doc(path: Path | None = None, device: str = "nvidia-h100-80gb-hbm3") -> bool:
    """Put doc_markdown(device) between DOC_BEGIN and DOC_END in docs/decode_step.md; True if it changed."""
    from k3lab.studies.runs import REPO, write_between

    return write_between(path or REPO / "docs" / "decode_step.md", DOC_BEGIN, DOC_END, doc_markdown(device))


def _write(path: Path, records: list) -> None:
    """All `records` to `path` as one JSON list (what `k3lab import` reads), replaced atomically."""
    from k3lab.files import write_atomic

    write_atomic(path, json.dumps([r.to_dict() for r in records], indent=1) + "\n")


def main(argv=None) -> int:
    """The CLI (module docstring). Exit status 2 with one line on stderr for a bad argument (before
    anything runs), 1 when nothing was measured or a pair failed (the table is printed all the same),
    else 0 (a missed target is a result, not an error)."""
    from k3lab.files import check_output_file

    ap = argparse.ArgumentParser(prog="python -m k3lab.studies.decode_step.targets",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="file the records go to (rewritten after each pair)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no pair that would end past this")
    ap.add_argument("--cases", nargs="+", default=None, help=f"target cases (default: {' '.join(CASES)})")
    ap.add_argument("--repeats", type=int, default=5, help="timed samples per variant (the study's 5)")
    ap.add_argument("--distinct-layers", type=int, default=3,
                    help="weight sets per layer kind (the study's 3)")
    args = ap.parse_args(argv)
    try:
        check_cases(args.cases, "--cases")
        check_budget(args.budget_s, "--budget-s")
        int_arg("--repeats", args.repeats, low=1, what="a positive integer")
        int_arg("--distinct-layers", args.distinct_layers, low=1, what="a positive integer")
        path = check_output_file(args.json, "--json")
    except ValueError as exc:
        print(f"targets: {exc}", file=sys.stderr)
        return 2
    out = lambda m: print(m, flush=True)  # noqa: E731 - the log, unbuffered
    if args.budget_s is not None and measure.on_gpu():
        out(f"targets: estimate {estimate_s(args.cases):.0f} s on an H200 from a cold start, budget "
            f"{args.budget_s:.0f} s")
    records, left = run(args.cases, budget_s=args.budget_s, repeats=args.repeats,
                        distinct_layers=args.distinct_layers, log=out, on_record=lambda rs: _write(path, rs))
    if records:
        _write(path, records)
        out(f"wrote {len(records)} records to {path} (k3lab import {path} --overwrite files them)")
    stands = {} if measure.on_gpu() else CPU_STANDS_FOR
    out(table_text(target_rows(records, left=left, stands_for=stands)))
    return 0 if records and not any(why.startswith(FAILED) for why in left.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
