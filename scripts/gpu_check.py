"""Run k3lab's test suite on the machine at hand and write a record of the run (what passed, failed and
was skipped, how long it took, on which device and versions), for the GPU check before anything that
touches notebooks, ops, engine or studies is called done.

    python scripts/gpu_check.py OUT [--workers N] [--label NAME] [PYTEST PATHS/ARGS ...]

Runs `pytest -q -p no:cacheprovider --junitxml OUT/junit.xml ARGS` (default ARGS: the whole suite as
`make test` runs it: `tests notebooks --nbval-lax --nbval-current-env`), with `-n N --dist loadfile` when
N > 1 (needs pytest-xdist; each file, so each notebook's cells, stays on one worker). Without --workers,
N comes from the GPU's free memory and the CPU count (`choose_workers`). Then it writes
OUT/gpu_check_<label>.json: device, backend, versions, commit (K3LAB_COMMIT when the tree carries no
usable .git), the command, the workers and why, wall seconds, counts, every failure's node id and first
line, the skip reasons grouped, the ten slowest tests, and the GPU memory the run's processes peaked at
(nvidia-smi, sampled). Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_ARGS = ["tests", "notebooks", "--nbval-lax", "--nbval-current-env"]
GIB = 2 ** 30
# GPU memory one xdist worker may need at once, all of them at their peak together. On an H100 (79 GiB
# free) the suite ran out of memory with 12 workers (so more than 6.6 GiB a worker at once) and not
# with 4; on an H200 (140 GiB free) not with 8 nor with 12 (profiles/nvidia-h200/gpu_check). 16 GiB
# gives 4 on the H100 and 8 on the H200, counts that ran within memory on each. The record's gpu_memory
# (the most one process held, sampled) is the measurement to revise it by.
PER_WORKER_BYTES = 16 * GIB


def choose_workers(free_bytes: int | None, cpu_count: int | None,
                   per_worker_bytes: int = PER_WORKER_BYTES) -> tuple[int, str]:
    """(workers, why) for a run of the suite: as many as the GPU's free memory holds at
    `per_worker_bytes` each, at most half the CPU cores (each worker also compiles kernels and runs the
    CPU children of interpreter tests), at least 1. No GPU (free_bytes None): 1, as `make test` runs."""
    for name, v, low, none_ok in (("free_bytes", free_bytes, 0, True), ("cpu_count", cpu_count, 1, True),
                                  ("per_worker_bytes", per_worker_bytes, 1, False)):
        if not (v is None and none_ok) and (isinstance(v, bool) or not isinstance(v, int) or v < low):
            raise ValueError(f"{name} must be an int >= {low}{' or None' if none_ok else ''}, got {v!r}")
    if free_bytes is None:
        return 1, "no GPU visible: one worker, as make test runs"
    by_memory = free_bytes // per_worker_bytes
    by_cpu = max(1, (cpu_count or 2) // 2)
    n = max(1, min(by_memory, by_cpu))
    return n, (f"{free_bytes / GIB:.1f} GiB free on the GPU / {per_worker_bytes / GIB:g} GiB a worker = "
               f"{by_memory}; {cpu_count} CPUs / 2 = {by_cpu}; so {n}")


def gpu_free_bytes() -> int | None:
    """Free memory of the GPU the workers will use (torch's current device), asked in a child process so
    that this one holds no GPU context during the run; None where torch sees no GPU."""
    code = ("import torch\nprint(torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 'none')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "none"
    if done.returncode != 0:
        print(f"gpu_check: could not ask torch for the GPU's free memory ({done.stderr.strip()[-300:]}); "
              "one worker", file=sys.stderr)
        return None
    return None if last == "none" else int(last)


class MemorySampler:
    """The GPU memory the run's processes hold, from nvidia-smi every `every_s` seconds: the largest total
    and the largest one process held. Nothing where nvidia-smi is missing."""

    QUERY = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]

    def __init__(self, every_s: float = 2.0):
        self.every_s, self.peak_total_mib, self.peak_process_mib, self.samples = every_s, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                out = subprocess.run(self.QUERY, capture_output=True, text=True, timeout=30).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            used = [int(f.split(",")[1]) for f in out.strip().splitlines() if f.count(",") == 1
                    and f.split(",")[1].strip().isdigit()]
            self.samples += 1
            self.peak_total_mib = max(self.peak_total_mib, sum(used))
            self.peak_process_mib = max([self.peak_process_mib, *used])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=40)

    def record(self) -> dict:
        return {"peak_total_mib": self.peak_total_mib, "peak_process_mib": self.peak_process_mib,
                "samples": self.samples, "every_s": self.every_s}


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
    p.add_argument("--workers", type=int, default=None,
                   help="pytest-xdist workers (1: no xdist); default: from the GPU's free memory and CPUs")
    p.add_argument("--label", default="suite", help="a name for this run in the record")
    args, rest = p.parse_known_args(argv)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.workers is None:
        args.workers, why = choose_workers(gpu_free_bytes(), os.cpu_count())
        print(f"gpu_check: {args.workers} worker(s): {why} (--workers N to choose)")
    else:
        why = "--workers"
    args.out.mkdir(parents=True, exist_ok=True)
    junit = args.out / f"junit_{args.label}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    # one file per worker: a notebook's cells share one kernel and must run in order on one worker
    cmd += ["-n", str(args.workers), "--dist", "loadfile"] if args.workers > 1 else []
    cmd += rest or DEFAULT_ARGS
    t0 = time.time()
    with MemorySampler() as memory:
        rc = subprocess.call(cmd)
    wall = time.time() - t0

    from k3lab import env
    from k3lab.bench import git_commit

    info = env.detect()
    record = {"label": args.label, "device": info.name, "backend": info.backend, "versions": env.versions(),
              "commit": os.environ.get("K3LAB_COMMIT") or git_commit(), "command": " ".join(cmd[1:]),
              "exit_status": rc, "wall_s": round(wall, 1), "cpu_count": os.cpu_count(),
              "workers": args.workers, "workers_why": why, "gpu_memory": memory.record(),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    record |= summarize(junit) if junit.exists() else {"counts": {}, "note": "pytest wrote no JUnit file"}
    path = args.out / f"gpu_check_{args.label}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    c = record.get("counts", {})
    print(f"{args.label}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} "
          f"skipped in {wall:.0f} s on {info.name} with {args.workers} worker(s) -> {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
