"""The `k3lab` command: info, bench, profile, report.

    k3lab info                         backend, device, versions, preset, optional backends
    k3lab bench STUDY [--preset P] [--cases A B] [--save-profiles] [--json FILE]
    k3lab import FILE... [--overwrite]  records from a remote run into profiles/<device>/<study>/
    k3lab profile STUDY [--tool torch|ncu|nsys|rocprofv3] [--variant V...]   traces and kernel tables
    k3lab report [--full] [--skip-notebooks] [--skip-studies]   this machine's run -> build/report.html
    k3lab records trend STUDY [CASE]   a study's records over commits (median_us, ratio to floor)
    k3lab isa [--target gfx950,gfx942,sm90] [--json F]  compile every Triton kernel, report ISA facts
    k3lab workshop room FILES... [--out F] [--png DIR]   the room's predictions, a histogram each

Every argument is checked before anything runs (a study name, --preset, --cases, --timeout and the
other counts, every field of the records to import, the output paths --out, --json and --save-profiles):
a bad one is one line on stderr naming it, and exit status 2. An --out never holds files git tracks (a
report writes pages and notebooks by fixed names). A run's traces stay under its --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from k3lab.report.execute import CELL_TIMEOUT_S


def _cmd_info(args) -> int:
    from k3lab import env
    from k3lab.config import K3Config

    print(env.describe())
    info = env.detect()
    v = env.versions()
    print(f"  device: {info.name} ({info.compute_units} compute units"
          + (f", {info.memory_gb:.0f} GB" if info.memory_gb else "") + ")")
    print(f"  peaks used for floors: {info.peak.bandwidth_tbs} TB/s ({info.peak.bandwidth_source}), "
          f"{info.peak.bf16_tflops} TFLOP/s bf16 ({info.peak.bf16_source})")
    print("  versions: " + ", ".join(f"{k}={val}" for k, val in v.items() if val))
    print(f"  preset: {env.default_preset(info)}  ({K3Config.preset(env.default_preset(info)).summary()})")
    for name, status in env.optional_backends().items():
        print(f"  {name}: {status}")
    return 0


def _studies_help() -> str:
    from k3lab.studies import ABOUT, STUDIES

    width = max(map(len, STUDIES))
    lines = [f"  {name:<{width}}  {ABOUT.get(name, '')}" for name in STUDIES]
    return "studies:\n" + "\n".join(lines)


def _cmd_bench(args) -> int:
    from k3lab.report.tables import compact
    from k3lab import env
    from k3lab.studies import GPU_ONLY, load_study

    if args.study in GPU_ONLY and env.detect().backend == "cpu" and not args.smoke:
        print(f"{args.study}: needs a GPU (its kernels and peer run only there); nothing timed on this CPU. "
              "Its notebook checks the references here and shows the committed GPU records.")
        return 0
    study = load_study(args.study)
    records = study.run(preset=args.preset, cases=args.cases, **run_options(study, args))  # checked before
    if not records:
        print(f"{args.study}: no records (nothing to time here)")
        return 0
    with _pandas_wide():
        print(compact(records).to_string(index=False, na_rep="", float_format=lambda x: f"{x:.3g}"))
    if hasattr(study, "summary_text"):  # a study's own summary of its records, after the common table
        print(study.summary_text(records))
    return _keep_records(args, records)


def _records_json(records) -> str:
    import json

    return json.dumps([r.to_dict() for r in records], indent=1) + "\n"


def _keep_records(args, records) -> int:
    """Write a finished run's records (--json, then the records folder). The paths were checked before
    the run; should a write still fail (a disk filled, a file committed meanwhile), one line says why and
    the records go to a file in the temp folder, named, so the run's results are never lost."""
    import tempfile
    import time

    from k3lab import bench
    from k3lab.files import write_atomic

    root = None if args.save_profiles else str(Path(args.out) / "records")
    try:
        if args.json:  # one file holding every record: what a remote run brings back
            write_atomic(Path(args.json), _records_json(records))  # an interrupted write keeps the old file
            print(f"wrote {len(records)} records to {args.json}")
        paths = bench.save_records(records, root=root, overwrite=args.overwrite)
    except (OSError, ValueError) as exc:
        keep = Path(tempfile.gettempdir()) / f"k3lab-{args.study}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        write_atomic(keep, _records_json(records))
        print(f"k3lab bench: records not saved: {exc}; all {len(records)} kept in {keep} "
              f"(k3lab import {keep})", file=sys.stderr)
        return 2
    print(f"saved {len(paths)} records under {root or bench.PROFILES}/")
    return 0


# `k3lab bench` options that become keywords of a study's run(): (flag, run() keyword)
RUN_OPTIONS = (("--repeats", "repeats"), ("--distinct-layers", "distinct_layers"),
               ("--no-profile", "profile"), ("--smoke", "smoke"), ("--backend", "backend"))


def run_options(study, args) -> dict:
    """The run() keywords the command line set (RUN_OPTIONS; None means not given). ValueError naming the
    flag when the study's run() does not take that keyword, and for a --backend that is not a row of the
    op table the study forces (its `BACKENDS`) or whose row cannot run on this machine."""
    import inspect

    params = inspect.signature(study.run).parameters
    out = {}
    for flag, key in RUN_OPTIONS:
        value = getattr(args, key, None)
        if value is None:
            continue
        if key not in params:
            raise ValueError(f"study {study.NAME!r} takes no {flag} option")
        if key == "backend":
            _check_backend(study, value)
        out[key] = value
    return out


def _check_backend(study, name: str) -> None:
    """--backend NAME of a study whose run() takes backend: a row of the study's `BACKENDS` (the op table
    it forces) that is available here; ValueError naming --backend otherwise."""
    table = getattr(study, "BACKENDS", None)
    if table is None:  # a study that takes backend= must say whose: tests/test_cli.py checks every study
        raise ValueError(f"--backend: study {study.NAME!r} names no backend table (BACKENDS)")
    table.forced(name, arg="--backend")
    ok, why = table[name].available()
    if not ok:
        raise ValueError(f"--backend {name!r} cannot run on this machine: {why}")


def _pandas_wide():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 20)


def _read_import(path: str) -> list:
    """The records in one file to import; ValueError naming the file and what is wrong with it."""
    import json

    from k3lab.bench.records import record_from_import
    from k3lab.profiling.roofline import PROBE_STUDY
    from k3lab.studies import STUDIES

    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"import: {path}: cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"import: {path}: not JSON ({exc})") from None
    rows = data if isinstance(data, list) else [data]
    if not rows or not all(isinstance(d, dict) for d in rows):
        raise ValueError(f"import: {path}: expected a record or a list of records (k3lab bench --json)")
    out = []
    for i, d in enumerate(rows):
        try:
            # a study's records, or the ceilings probe's (k3lab.studies.ceilings)
            out.append(record_from_import(d, studies=(*STUDIES, PROBE_STUDY)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"import: {path}: not a record file: record {i}: {exc}") from None
    return out


def _cmd_import(args) -> int:
    """Save records from a JSON list (k3lab bench --json) under profiles/<device>/<study>/."""
    from k3lab import bench

    read = getattr(args, "records", None) or {f: _read_import(f) for f in args.files}  # main read them
    records = [r for f in args.files for r in read[f]]
    try:
        paths = bench.save_records(records, root=args.root, overwrite=args.overwrite)
    except FileExistsError as exc:
        print(f"k3lab import: {exc}", file=sys.stderr)
        return 2
    print(f"saved {len(records)} records in {len(paths)} files under {args.root or bench.PROFILES}/")
    return 0


def _cmd_profile(args) -> int:
    """Each chosen variant under the chosen profiler (k3lab.profiling.tools.profile_study), which refuses
    in one line, before anything is profiled, a study with nothing to profile, a variant the study does
    not profile here and a tool that cannot run here."""
    from k3lab.profiling import tools

    out = Path(args.out) / "traces" / args.study
    try:
        caps = tools.profile_study(args.study, tool=args.tool, variants=args.variant, preset=args.preset,
                                   steps=args.steps, out_dir=out)
    except ValueError as exc:
        print(f"k3lab profile: {exc}", file=sys.stderr)
        return 2
    for variant, cap in caps.items():
        print(f"== {args.study} / {variant} ({cap.backend}): {cap.counts()}")
        for f in cap.files:
            print(f"   {f}")
        if cap.note:
            print(f"   note: {cap.note}")
        print(cap.table.head(args.top).to_string(index=False))
    return 0


def _cmd_records(args) -> int:
    """`k3lab records trend STUDY [CASE]`: every committed version of the study's records (git history of
    profiles/), printed per device, variant and mode, and drawn to an HTML figure under --out."""
    from k3lab import plots
    from k3lab.files import write_atomic
    from k3lab.profiling import trend

    hist = trend.history(args.study, args.case, device=args.device)
    if hist.empty:
        print(f"k3lab records trend: no {args.study} records" + (f" of case {args.case}" if args.case else "")
              + (f" on {args.device}" if args.device else ""), file=sys.stderr)
        return 2
    cols = ["date", "record_commit", "device", "case", "variant", "mode", "median_us", "floor_ratio",
            "launches"]
    shown = hist[cols].assign(date=hist["date"].str.slice(0, 16),
                              record_commit=hist["record_commit"].str.slice(0, 9))
    with _pandas_wide():
        print(shown.to_string(index=False, na_rep="", float_format=lambda x: f"{x:.4g}"))
    name = f"trend-{args.study}" + (f"-{args.case}" if args.case else "") + ".html"
    path = Path(args.out) / name
    title = f"{args.study}" + (f" {args.case}" if args.case else "") + ": records over time"
    write_atomic(path, plots.trend(hist, title=title).to_html(include_plotlyjs=True, full_html=True))
    print(f"{len(hist)} records; figure: {path}")
    return 0


REPORT_TRACES = Path("traces") / "report"  # under --out: the traces of the report's last run


def _cmd_report(args) -> int:
    """Build the report with every trace its studies and notebooks capture under --out (REPORT_TRACES,
    through K3LAB_TRACE_DIR, which the notebook kernels inherit): the folder holds the last run's traces
    only, so repeated reports take no more room, and nothing is left in the temp folder."""
    import os
    import shutil

    from k3lab.report import build_report

    traces = Path(args.out) / REPORT_TRACES
    shutil.rmtree(traces, ignore_errors=True)
    before = os.environ.get("K3LAB_TRACE_DIR")
    os.environ["K3LAB_TRACE_DIR"] = str(traces.absolute())
    try:
        path = build_report(out=Path(args.out), preset=args.preset, run_studies=not args.skip_studies,
                            run_notebooks=not args.skip_notebooks, timeout_s=args.timeout, full=args.full,
                            workers=args.workers)
    finally:
        if before is None:
            os.environ.pop("K3LAB_TRACE_DIR", None)
        else:
            os.environ["K3LAB_TRACE_DIR"] = before
    print(f"report: {path}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line on stderr (the command, the argument, what was wrong)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message}\n")


def _preset(text: str) -> str:
    """A preset name K3Config knows (full, tiny, tpN whose N divides K3's heads and widths)."""
    from k3lab.config import K3Config

    try:
        K3Config.preset(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _check_args(args) -> None:
    """What argparse cannot check alone, before anything runs: the study's case names (for its preset),
    the output paths and the files to import. ValueError naming the argument."""
    from k3lab.files import check_output_dir, check_output_file

    if getattr(args, "cases", None):
        from k3lab.studies import load_study, select_cases

        study = load_study(args.study)
        try:  # a study whose run() takes names beyond case_names() (kda_scan's sweeps) checks its own
            if callable(getattr(study, "check_cases", None)):
                study.check_cases(args.cases, args.preset)
            else:
                select_cases(study.case_names(args.preset), args.cases)
        except ValueError as exc:
            raise ValueError(f"--cases: {exc}") from None
    if args.command == "bench":
        from k3lab.studies import load_study

        study = load_study(args.study)
        run_options(study, args)  # before a GPU-only study's note on a CPU, too
        if args.backend is None and getattr(study, "BACKENDS", None) is not None:
            study.BACKENDS.forced(None)  # its K3LAB_<OP>_BACKEND, if set, must name a row too
        if args.json:
            check_output_file(args.json, "--json")
        if args.save_profiles:
            _check_save_profiles(args)
        else:
            check_output_dir(args.out)
    elif args.command in ("profile", "report", "records"):
        check_output_dir(args.out)
    elif args.command == "import":
        if args.root is not None:
            check_output_dir(args.root, "--root", tracked_ok=True)
        args.records = {f: _read_import(f) for f in args.files}


def _check_save_profiles(args) -> None:
    """--save-profiles without --overwrite: refuse, before the study runs, when a record file of a chosen
    case on this device is a committed reference (the save at the end would refuse it, after the run)."""
    from k3lab import env
    from k3lab.bench import records
    from k3lab.files import check_output_dir
    from k3lab.studies import load_study, select_cases

    check_output_dir(records.PROFILES, "--save-profiles", tracked_ok=True)
    if args.overwrite:
        return
    info = env.detect()
    # this device's folder, and cpu/: a study's host-clock timings are filed as the CPU's on any machine
    slugs = dict.fromkeys((records.device_slug(info.name, info.backend), "cpu"))
    cases = set(select_cases(load_study(args.study).case_names(args.preset), args.cases))
    files = [f for s in slugs for f in sorted((Path(records.PROFILES) / s / args.study).glob("*__*.json"))]
    for f in files:
        why = records.committed_reason(f) if f.name.rsplit("__", 1)[0] in cases else None
        if why is not None:
            raise ValueError(f"--save-profiles: {f} is a committed reference ({why}); add --overwrite to "
                             f"replace it, or leave out --save-profiles (records then go under --out)")


def _add_workshop(sub) -> None:
    """`k3lab workshop room FILES...`: the room's predictions files as one histogram per prediction
    (k3lab.workshop.room)."""
    w = sub.add_parser("workshop", help="workshop tools for the instructor (room: the predictions)")
    wsub = w.add_subparsers(dest="workshop_command", required=True)
    from k3lab.workshop.room import add_arguments

    add_arguments(wsub.add_parser("room", help="predictions files -> one histogram per prediction (HTML)"))


def _cmd_workshop(args) -> int:
    from k3lab.workshop import room

    return room.run(args)


def build_parser() -> argparse.ArgumentParser:
    studies = _studies_help()
    raw = argparse.RawTextHelpFormatter
    p = _Parser(prog="k3lab", description=__doc__, epilog=studies, formatter_class=raw)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device, versions, preset, optional backends")
    b = sub.add_parser("bench", help="run a study's cases: checks, timings, floors, records", epilog=studies,
                       formatter_class=raw,
                       description="Check every variant of a study against its reference, "
                       "then time it; prints case, before, after, peer, floor, after/before, after/peer.")
    b.add_argument("study", help="a study name (below)")
    b.add_argument("--preset", type=_preset, default=None,
                   help="full, tiny or tpN (default: tp8 on a GPU, tiny on CPU)")
    b.add_argument("--cases", nargs="+", default=None, help="case names (default: every case)")
    b.add_argument("--out", default="build")
    b.add_argument("--save-profiles", action="store_true",
                   help="save records under profiles/ (committed results)")
    b.add_argument("--overwrite", action="store_true", help="replace committed records")
    b.add_argument("--json", default=None, help="also write every record to this one JSON file")
    b.add_argument("--repeats", type=_positive_int, default=None,
                   help="timed samples per variant (studies whose run() takes repeats)")
    b.add_argument("--distinct-layers", type=_positive_int, default=None,
                   help="decode_step: weight sets per layer kind rotated through the layers")
    b.add_argument("--no-profile", dest="profile", action="store_const", const=False, default=None,
                   help="skip the profiler passes (studies whose run() takes profile)")
    b.add_argument("--backend", default=None,
                   help="force one backend of the study's op for its k3lab variants (studies whose run() "
                        "takes backend: kda_scan)")
    b.add_argument("--smoke", action="store_const", const=True, default=None,
                   help="tiny sizes, on a CPU too: checks a GPU study's code, times nothing that matters "
                        "(dcp)")
    im = sub.add_parser("import", help="save records from JSON files (k3lab bench --json) under profiles/")
    im.add_argument("files", nargs="+")
    im.add_argument("--root", default=None, help="default: the repository's profiles/")
    im.add_argument("--overwrite", action="store_true", help="replace committed records")
    pr = sub.add_parser("profile", help="trace each variant of a study and print its kernel table",
                        epilog=studies, formatter_class=raw)
    pr.add_argument("study", help="a study name (below)")
    pr.add_argument("--preset", type=_preset, default=None)
    pr.add_argument("--steps", type=_positive_int, default=3)
    pr.add_argument("--top", type=_positive_int, default=15)
    pr.add_argument("--out", default="build")
    pr.add_argument("--tool", default="torch", choices=("torch", "ncu", "nsys", "rocprofv3"),
                    help="torch.profiler here (default), or Nsight Compute / Nsight Systems / rocprofv3 on a "
                         "child process where the tool and its GPU are present")
    pr.add_argument("--variant", nargs="+", default=None, help="variants to profile (default: every one)")
    rec = sub.add_parser("records", help="the committed records: trend (every version in git's history)")
    rsub = rec.add_subparsers(dest="records_command", required=True)
    tr = rsub.add_parser("trend", help="a study's records over commits: median_us and ratio to the floor",
                         epilog=studies, formatter_class=raw)
    tr.add_argument("study", help="a study name (below)")
    tr.add_argument("case", nargs="?", default=None, help="one case (default: every case)")
    tr.add_argument("--device", default=None, help="a device folder under profiles/, e.g. nvidia-h200")
    tr.add_argument("--out", default="build")
    sub.add_parser("isa", help="compile every Triton kernel for gfx950 / gfx942 / sm90 and report ISA facts "
                         "(python -m k3lab.isa --help)", add_help=False)
    _add_workshop(sub)
    r = sub.add_parser("report",
                       help="run what this machine can, execute the notebooks, write build/report.html")
    r.add_argument("--out", default="build")
    r.add_argument("--preset", type=_preset, default=None)
    r.add_argument("--full", action="store_true",
                   help="every case of every study (default: each study's quick form, which still checks "
                        "every variant; k3lab.studies.GPU_QUICK / CPU_CASES say which cases)")
    r.add_argument("--skip-studies", action="store_true",
                   help="the notebooks only (timings.json keeps the study steps of an earlier run in --out)")
    r.add_argument("--skip-notebooks", action="store_true",
                   help="the studies only (timings.json keeps the notebook steps of an earlier run in --out)")
    r.add_argument("--workers", type=_positive_int, default=None,
                   help="notebooks executed at a time (default: 4 on a GPU machine, 2 on a CPU)")
    r.add_argument("--timeout", type=_positive_int, default=CELL_TIMEOUT_S,
                   help=f"seconds per notebook cell; a cell that reaches it fails the report (default "
                        f"{CELL_TIMEOUT_S})")
    return p


def main(argv: list[str] | None = None) -> int:
    from k3lab.studies import canonical

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["isa"]:  # its options are k3lab.isa's own: hand them over untouched
        from k3lab.isa.__main__ import main as isa_main
        return isa_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "study", None) is not None:
            args.study = canonical(args.study)
        _check_args(args)
    except ValueError as exc:
        print(f"k3lab: {exc}", file=sys.stderr)
        return 2
    handler = {"info": _cmd_info, "bench": _cmd_bench, "profile": _cmd_profile, "report": _cmd_report,
               "import": _cmd_import, "workshop": _cmd_workshop, "records": _cmd_records}
    try:
        return handler[args.command](args)
    except KeyboardInterrupt:
        print(f"k3lab {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
