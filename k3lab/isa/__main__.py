"""python -m k3lab.isa [--target gfx950,gfx942,sm90] [--case NAMES] [--json FILE] [--workers N] [--no-cache]

Prints one line per (case, kernel, target) and writes the whole report as JSON with --json. Exit code 1
when a kernel failed to compile, spilled, used scratch or asked for more LDS than the target has (AMD),
or when a jit function has no compile entry, unless every such problem is one k3lab/isa/known.py
lists; 0 otherwise."""

from __future__ import annotations

import argparse
import json
import sys

from k3lab.isa import problems, report, table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.isa", description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=None, help="comma-separated: gfx950,gfx942,sm90 (default: all)")
    ap.add_argument("--case", default=None, help="comma-separated entries or op names (default: all)")
    ap.add_argument("--json", default=None, help="write the full report here")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per compile")
    ap.add_argument("--no-cache", action="store_true")
    args = ap.parse_args(argv)
    try:
        rep = report(args.target, args.case, workers=args.workers, timeout_s=args.timeout, cache=
                     not args.no_cache)
    except ValueError as exc:
        print(f"k3lab.isa: {exc}", file=sys.stderr)
        return 2
    import pandas as pd

    with pd.option_context("display.max_rows", None, "display.max_columns", None, "display.width", 250,
                           "display.max_colwidth", 60):
        print(table(rep).to_string(index=False))
    bad = problems(rep)
    print(f"\n{len(rep['rows'])} compiles in {rep['seconds']} s (Triton {rep['triton']}; compiled only, "
          f"not run on AMD hardware); {len(bad)} problem(s)")
    for p in bad:
        print(f"  {p['text']}" + ("" if p["known"] else "  [not in k3lab/isa/known.py]"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep | {"problems": bad}, f, indent=1, default=str)
    return 1 if any(not p["known"] for p in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
