"""Run k3lab's test suite on the machine at hand and write a record of the run (what passed, failed and
was skipped, how long it took, on which device and versions), for the GPU check before anything that
touches notebooks, ops, engine or studies is called done.

    python scripts/gpu_check.py OUT [--workers N] [--label NAME] [PYTEST PATHS/ARGS ...]

Runs `pytest -q -p no:cacheprovider --junitxml OUT/junit.xml ARGS` (default ARGS: the whole suite as
`make test` runs it: `tests notebooks --nbval-lax --nbval-current-env`), with `-n N --dist loadfile` when N > 1
(needs pytest-xdist; each file, so each notebook's cells, stays on one worker), then writes OUT/gpu_check.json: device, backend, versions, commit (K3LAB_COMMIT when the
tree carries no usable .git), the command, wall seconds, counts, every failure's node id and first line,
the skip reasons grouped, and the ten slowest tests. Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_ARGS = ["tests", "notebooks", "--nbval-lax", "--nbval-current-env"]


def summarize(junit: Path) -> dict:
    """Counts, failures, skip reasons and the slowest tests of a JUnit XML file pytest wrote."""
    root = ET.parse(junit).getroot()
    cases = root.iter("testcase")
    counts = collections.Counter()
    failures, skips, times = [], collections.Counter(), []
    for c in cases:
        node = f"{c.get('classname', '')}::{c.get('name', '')}"
        t = float(c.get("time") or 0.0)
        times.append((t, node))
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            counts["failed"] += 1
            failures.append({"test": node, "message": (bad.get("message") or "").splitlines()[0][:300]
                             if bad.get("message") else ""})
        elif c.find("skipped") is not None:
            counts["skipped"] += 1
            skips[(c.find("skipped").get("message") or "").splitlines()[0][:200] if
                  c.find("skipped").get("message") else "no reason given"] += 1
        else:
            counts["passed"] += 1
    slowest = [{"test": n, "seconds": round(t, 1)} for t, n in sorted(times, reverse=True)[:10]]
    return {"counts": dict(counts), "failures": failures,
            "skips": [{"reason": r, "count": n} for r, n in skips.most_common()], "slowest": slowest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--workers", type=int, default=1, help="pytest-xdist workers (1: no xdist)")
    p.add_argument("--label", default="suite", help="a name for this run in the record")
    args, rest = p.parse_known_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    args.out.mkdir(parents=True, exist_ok=True)
    junit = args.out / f"junit_{args.label}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    # one file per worker: a notebook's cells share one kernel and must run in order on one worker
    cmd += (["-n", str(args.workers), "--dist", "loadfile"] if args.workers > 1 else []) + (rest or DEFAULT_ARGS)
    t0 = time.time()
    rc = subprocess.call(cmd)
    wall = time.time() - t0

    from k3lab import env
    from k3lab.bench import git_commit

    info = env.detect()
    record = {"label": args.label, "device": info.name, "backend": info.backend, "versions": env.versions(),
              "commit": os.environ.get("K3LAB_COMMIT") or git_commit(), "command": " ".join(cmd[1:]),
              "exit_status": rc, "wall_s": round(wall, 1), "cpu_count": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    record |= summarize(junit) if junit.exists() else {"counts": {}, "note": "pytest wrote no JUnit file"}
    path = args.out / f"gpu_check_{args.label}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    c = record.get("counts", {})
    print(f"{args.label}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} skipped "
          f"in {wall:.0f} s on {info.name} -> {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
