"""Run k3lab's test suite on the machine at hand and write a record of the run (what passed, failed and
was skipped, how long it took, on which device and versions), for the GPU check before anything that
touches notebooks, ops, engine or studies is called done.

    python scripts/gpu_check.py OUT [--workers N] [--label NAME] [--shard K/N] [--durations RECORD]
                                    [--stop-after S] [PYTEST PATHS/ARGS ...]
    python scripts/gpu_check.py plan N [--durations RECORD] [PATHS ...]
    python scripts/gpu_check.py merge OUT --label NAME RECORD ...

Runs `pytest -q -p no:cacheprovider --junitxml OUT/junit_<label>.xml ARGS` (default ARGS: the whole
suite as `make test` runs it: `tests notebooks --nbval-lax --nbval-current-env`, with
K3LAB_PREDICTIONS=off unless set), with `-n N --dist loadfile` when N > 1 (needs pytest-xdist; each
file, so each notebook's cells, stays on one worker). Without --workers, N comes from the GPU's free
memory and the CPU count (`choose_workers`). Then it writes OUT/gpu_check_<label>.json: device, backend,
versions, commit (K3LAB_COMMIT when the tree carries no usable .git), the command, the workers and why,
wall seconds, counts, every failure's node id and first line, the skip reasons grouped, the ten slowest
tests, each file's seconds, and the GPU memory the run's processes peaked at (nvidia-smi, sampled).
Exit status: pytest's.

`--shard K/N` runs the K-th of N groups of the test files and notebooks the paths name (a notebook
whole), split by expected time (`split`: each file's seconds in the --durations records, else its size),
so a suite longer than one sitting runs as N calls; `plan` prints the groups without running them, and
`merge` combines the N records into one record of the whole suite (`merge_records`).

With several workers and `--durations`, the files go to pytest slowest first (`slowest_first`) with
pytest-xdist's own reordering off (by default it hands out the files with the most tests first), so
its loadfile scheduler gives them out in that order: eight workers then end within about one short
file of each other instead of waiting on a long file that started last.

`--stop-after S` interrupts the run after S seconds (as Ctrl-C: pytest, and pytest-xdist's controller,
end the session and write the JUnit file), so a call with a time limit always leaves a record: it keeps
the files that finished and lists the rest (`files_not_run`), which a later run of those files covers
before the merge. Serially a file is finished when a later one has begun. With several workers this
module is loaded into pytest as a plugin (`-p gpu_check`): the controller writes the node ids the
workers collected (OUT/collected_<label>.json; no collection pass of its own) and prints each failure's
node id the moment it is reported; a file is finished when the JUnit file holds as many testcases for it
as were collected (each parametrized id, each notebook cell, a collection error as one). The testcases
of files not finished are dropped from the counts, but their failures are kept apart in
`failures_in_unfinished_files` and printed: a stopped run hides no failure, and such a failure fails
the merge even where the later run passes it.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

DEFAULT_ARGS = ["tests", "notebooks", "--nbval-lax", "--nbval-current-env"]
GIB = 2 ** 30
# GPU memory one xdist worker may need at once, all of them at their peak together. Each test and each
# notebook cell gives its cached memory back when it ends (tests/conftest.py, k3lab/_cells.py), so a
# worker holds only what its current test or cell has live. The most any one process then held on an
# H100 was 48-49 GiB (one notebook cell at K3's shapes), while the other workers held 5-7 GiB each
# (profiles/nvidia-h100-80gb-hbm3/gpu_check: gpu_check_workers_2_2b4119a.json, the probe record). 15 GiB
# a worker gives 5 on the H100 (79 GiB free: 49 + 4 x 7 fits, 49 + 5 x 7 would not) and 8 (half its 16
# cores) on the H200, which ran within memory with 8 and 12. The record's gpu_memory (the most one
# process held, sampled) is the measurement to revise it by.
PER_WORKER_BYTES = 15 * GIB


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


def file_key(path: str) -> str:
    """The dotted name pytest's JUnit file gives a file's tests (their classname starts with it):
    tests/test_x.py -> tests.test_x, notebooks/01_dcp.ipynb -> notebooks.01_dcp.ipynb."""
    return (path[:-3] if path.endswith(".py") else path).replace("/", ".")


def file_of(classname: str, files) -> str | None:
    """Which of `files` a JUnit testcase's classname (or a collection error's name) belongs to."""
    best = None
    for f in files:
        key = file_key(f)
        if (classname == key or classname.startswith(key + ".")) and (best is None or len(f) > len(best)):
            best = f
    return best


def summarize(junit: Path, files=(), drop=()) -> dict:
    """Counts, failures, skip reasons, the slowest tests and each of `files`' seconds (its testcases'
    times) of a JUnit XML file pytest wrote, leaving out the testcases of the files in `drop`."""
    root = ET.parse(junit).getroot()
    counts = collections.Counter()
    failures, skips, times = [], collections.Counter(), []
    file_seconds: dict[str, float] = collections.defaultdict(float)
    for c in root.iter("testcase"):
        if not (c.get("classname") or c.get("name")):
            continue  # the entry pytest leaves for a test it was interrupted in
        owner = file_of(c.get("classname") or c.get("name") or "", files) if files else None
        if owner is not None and owner in drop:
            continue
        node = f"{c.get('classname', '')}::{c.get('name', '')}"
        t = float(c.get("time") or 0.0)
        times.append((t, node))
        if owner is not None:
            file_seconds[owner] += t
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
            "skips": [{"reason": r, "count": n} for r, n in skips.most_common()], "slowest": slowest,
            "file_seconds": {f: round(v, 2) for f, v in sorted(file_seconds.items())}}


def seen_files(junit: Path, files) -> list[str]:
    """Those of `files` with at least one testcase in the JUnit file, in the order their first one came."""
    order: list[str] = []
    for c in ET.parse(junit).getroot().iter("testcase"):
        owner = file_of(c.get("classname") or c.get("name") or "", files)
        if owner is not None and owner not in order:
            order.append(owner)
    return order


def testcase_files(junit: Path, files) -> collections.Counter:
    """How many distinct testcases (classname and name: each parametrized id and each notebook cell its
    own, a collection error one) the JUnit file holds for each of `files`."""
    seen: set[tuple[str, str]] = set()
    have: collections.Counter = collections.Counter()
    for c in ET.parse(junit).getroot().iter("testcase"):
        key = (c.get("classname") or "", c.get("name") or "")
        owner = file_of(key[0] or key[1], files) if any(key) else None
        if owner is not None and key not in seen:
            seen.add(key)
            have[owner] += 1
    return have


def read_collected(path: Path, files) -> dict[str, int] | None:
    """Each of `files`' count of collected items from the file the run's plugin wrote (node ids the
    workers collected, and collection errors, which JUnit records as one testcase each); None where the
    run ended before its workers finished collecting."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    counts = collections.Counter({f: 0 for f in files})
    for node in [*data["ids"], *data["errors"]]:
        owner = file_of(file_key(node.split("::", 1)[0]), files)
        if owner is not None:
            counts[owner] += 1
    return dict(counts)


def unfinished_files(junit: Path, files, collected: dict[str, int] | None) -> list[str]:
    """Those of `files` whose tests a run stopped with several workers did not all report: fewer
    testcases in the JUnit file than pytest collected for it. Nothing collected known: all of them."""
    if collected is None:
        return list(files)
    have = testcase_files(junit, files)
    return [f for f in files if have[f] < collected.get(f, 0)]


def failures_in(failures, files) -> list[dict]:
    """Those of `failures` (summarize's) whose test belongs to one of `files`."""
    return [f for f in failures if file_of(f["test"].split("::", 1)[0] or f["test"].split("::", 1)[1],
                                           files) is not None]


# ------------------------------------------------------------------------ splitting the suite into shards

def suite_files(args, root: Path) -> list[str]:
    """The test files and notebooks that pytest would collect from the path arguments among `args`
    (options are left out), relative to `root`, sorted: under a folder, test_*.py and *_test.py files
    and notebooks (nbval collects every .ipynb), hidden folders and checkpoints passed over."""
    found: set[str] = set()
    for a in args:
        if a.startswith("-"):
            continue
        path = (root / a.split("::", 1)[0])
        if path.is_file():
            found.add(path.relative_to(root).as_posix())
            continue
        if not path.is_dir():
            continue
        for f in path.rglob("*"):
            rel = f.relative_to(root)
            if any(part.startswith(".") or part in ("__pycache__", "build") for part in rel.parts[:-1]):
                continue
            if f.is_file() and (f.suffix == ".ipynb" or (f.suffix == ".py" and (
                    f.name.startswith("test_") or f.stem.endswith("_test")))):
                found.add(rel.as_posix())
    return sorted(found)


def read_durations(records) -> dict[str, float]:
    """Each file's seconds from gpu_check records (`file_seconds`; a later record's figure wins)."""
    seconds: dict[str, float] = {}
    for rec in records:
        data = json.loads(Path(rec).read_text()) if not isinstance(rec, dict) else rec
        if not isinstance(data.get("file_seconds"), dict):
            raise ValueError(f"durations record {rec} has no file_seconds (a record gpu_check.py wrote)")
        seconds.update({f: float(v) for f, v in data["file_seconds"].items()})
    return seconds


def weights(files, root: Path, durations: dict[str, float] | None = None) -> tuple[dict[str, float], str]:
    """(each file's expected cost, its unit): the recorded seconds where `durations` has the file, else
    its size in bytes times the recorded seconds per byte (the files both know); no durations: bytes."""
    size = {f: float((root / f).stat().st_size) for f in files}
    known = {f: durations[f] for f in files if durations and f in durations}
    if not known:
        return size, "bytes"
    per_byte = sum(known.values()) / max(1.0, sum(size[f] for f in known))
    return {f: known.get(f, size[f] * per_byte) for f in files}, "s"


def slowest_first(cost: dict[str, float]) -> list[str]:
    """`cost`'s files, the costliest first (path order on a tie): the order pytest-xdist's loadfile
    scheduler hands files out in, so the longest file starts first and no worker ends on a long tail."""
    return sorted(cost, key=lambda f: (-cost[f], f))


def split(cost: dict[str, float], n: int) -> list[list[str]]:
    """`cost`'s files in `n` groups of similar total: the costliest first, each to the group with the
    least so far (the first such group on a tie); each group keeps the files in path order. The same
    files and costs always give the same groups, whatever order they come in."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1, got {n!r}")
    if n > len(cost):
        raise ValueError(f"n must be at most the number of files ({len(cost)}), got {n}")
    groups: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for f in slowest_first(cost):
        i = min(range(n), key=lambda j: (load[j], j))
        groups[i].append(f)
        load[i] += cost[f]
    return [sorted(g) for g in groups]


def _xdist_reorders() -> bool:
    """Whether the installed pytest-xdist reorders --dist loadfile's files by their test counts (3.6 and
    later, unless --no-loadscope-reorder); older ones keep the collection order."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major, minor = (int(x) for x in version("pytest-xdist").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (3, 6)


def parse_shard(text: str) -> tuple[int, int]:
    """'K/N' -> (K, N), 1 <= K <= N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must be K/N with whole numbers, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard K/N needs 1 <= K <= N, got {text!r}")
    return k, n


def digest(files) -> str:
    return hashlib.sha256("\n".join(sorted(files)).encode()).hexdigest()[:16]


# ------------------------------------------------------------------------ combining shard records

def _status(record: dict) -> int:
    """A record's exit status for the merge: a run stopped at --stop-after counts by its failures alone
    (pytest's status says it was interrupted; the files it did not finish are listed and run elsewhere),
    those in the files it did not finish included: their tests' counts are the later run's, but a failure
    seen once fails the merge even where that run passes (a flaky test is still a failing one)."""
    if record.get("stopped"):
        return 1 if record.get("counts", {}).get("failed") or record.get("failures_in_unfinished_files") \
            else 0
    return record.get("exit_status") or 0


def merge_records(records: list[dict], label: str) -> dict:
    """One record of the whole suite from the records of its shards (and of runs that covered a shard's
    files_not_run): counts and skips summed, failures and files joined, wall seconds summed (the suite's
    time run one shard after another), the slowest tests and the GPU memory peak over all. Refused with
    a ValueError: records without a files list, of other devices or commits, of different splits, a
    shard twice, or a file run in two records. A file of the split that no record ran is listed in
    files_not_run and the merged record is not complete."""
    if not records:
        raise ValueError("records must name at least one gpu_check record")
    for r in records:
        if not isinstance(r.get("files"), list):
            raise ValueError(f"record {r.get('label')!r} has no files list: rerun it with this gpu_check.py")
    for field in ("device", "commit"):
        values = sorted({str(r.get(field)) for r in records})
        if len(values) > 1:
            raise ValueError(f"records of different {field}s cannot be one suite's: {', '.join(values)}")
    shards = [r["shard"] for r in records if r.get("shard")]
    if len({(s["n"], s["all_files_digest"]) for s in shards}) > 1:
        raise ValueError("the shard records come from different splits (N or the suite's files differ): "
                         + ", ".join(f"{s['k']}/{s['n']} of {s['all_files_digest']}" for s in shards))
    ks = collections.Counter(s["k"] for s in shards)
    if any(c > 1 for c in ks.values()):
        raise ValueError(f"shard {min(k for k, c in ks.items() if c > 1)} comes twice")
    ran: dict[str, int] = {}  # file -> the record that ran it
    for i, r in enumerate(records):
        for f in r["files"]:
            if f in r.get("files_not_run", []):
                continue
            if f in ran:
                raise ValueError(f"{f} ran in two records ({records[ran[f]].get('label')!r} and "
                                 f"{r.get('label')!r}): its tests would be counted twice")
            ran[f] = i
    everything = set(shards[0]["all_files"]) if shards else set()
    everything |= {f for r in records for f in r["files"]}
    missing_shards = sorted(set(range(1, shards[0]["n"] + 1)) - set(ks)) if shards else []
    counts = collections.Counter()
    skips = collections.Counter()
    for r in records:
        counts.update({k: v for k, v in r.get("counts", {}).items() if v})
        skips.update({s["reason"]: s["count"] for s in r.get("skips", [])})
    slowest = sorted((s for r in records for s in r.get("slowest", [])), key=lambda s: -s["seconds"])[:10]
    not_run = sorted(everything - set(ran))
    first = records[0]
    return {
        "label": label, "device": first.get("device"), "backend": first.get("backend"),
        "versions": first.get("versions"), "commit": first.get("commit"),
        "merged_from": [{"label": r.get("label"), "shard": (f"{r['shard']['k']}/{r['shard']['n']}"
                                                             if r.get("shard") else None),
                         "command": r.get("command"), "exit_status": r.get("exit_status"),
                         "wall_s": r.get("wall_s"), "counts": r.get("counts"), "date": r.get("date"),
                         "stopped": r.get("stopped")} for r in records],
        "exit_status": next((st for st in map(_status, records) if st), 0),
        "complete": not not_run and not missing_shards, "missing_shards": missing_shards,
        "files_not_run": not_run, "wall_s": round(sum(r.get("wall_s") or 0.0 for r in records), 1),
        "workers": sorted({r.get("workers") for r in records}, key=str),
        "gpu_memory": {k: max((r.get("gpu_memory") or {}).get(k, 0) for r in records)
                       for k in ("peak_total_mib", "peak_process_mib")},
        "counts": dict(counts), "failures": [f for r in records for f in r.get("failures", [])],
        "failures_in_unfinished_files": [f for r in records
                                         for f in r.get("failures_in_unfinished_files", [])],
        "skips": [{"reason": k, "count": v} for k, v in skips.most_common()], "slowest": slowest,
        "files": sorted(ran),
        "file_seconds": {f: records[i].get("file_seconds", {}).get(f) for f, i in sorted(ran.items())
                         if f in records[i].get("file_seconds", {})},
    }


def merge_main(argv) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py merge", description=merge_records.__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("records", nargs="+", type=Path)
    p.add_argument("--label", default="merged")
    args = p.parse_args(argv)
    try:
        merged = merge_records([json.loads(r.read_text()) for r in args.records], args.label)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        p.exit(2, f"gpu_check merge: {e}\n")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu_check_{args.label}.json"
    path.write_text(json.dumps(merged, indent=1) + "\n")
    c = merged["counts"]
    print(f"{args.label}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} "
          f"skipped in {merged['wall_s']:.0f} s over {len(args.records)} record(s)"
          + ("" if merged["complete"] else f"; NOT complete: shards {merged['missing_shards']} missing, "
             f"{len(merged['files_not_run'])} file(s) not run") + f" -> {path}")
    say_failures(merged)
    return 0 if merged["complete"] and not merged["exit_status"] else 1


def plan_main(argv) -> int:
    p = argparse.ArgumentParser(prog="gpu_check.py plan", description="print the N shards of the suite")
    p.add_argument("n", type=int)
    p.add_argument("--durations", type=Path, action="append", default=[])
    args, rest = p.parse_known_args(argv)
    root = Path.cwd()
    files = suite_files(rest or DEFAULT_ARGS, root)
    cost, unit = weights(files, root, read_durations(args.durations) if args.durations else None)
    try:
        groups = split(cost, args.n)
    except ValueError as e:
        p.exit(2, f"gpu_check plan: {e}\n")
    for k, g in enumerate(groups, 1):
        print(f"shard {k}/{args.n}: {len(g)} files, {sum(cost[f] for f in g):,.0f} {unit}: {' '.join(g)}")
    return 0


# ------------------------------------------------------------------------ inside pytest (-p gpu_check)
# With several workers pytest loads this module as a plugin (scripts/ on PYTHONPATH). In the controller
# it writes the node ids the workers collected, and the collection errors, to $GPU_CHECK_COLLECTED (so a
# stopped run knows each file's count without a collection pass of its own), and prints each failure
# the moment a worker reports it. Nothing in the workers, nor where the variable is unset.
_LIVE: dict = {}


def pytest_configure(config) -> None:
    if os.environ.get("GPU_CHECK_COLLECTED") and not hasattr(config, "workerinput"):
        _LIVE.update(config=config, path=Path(os.environ["GPU_CHECK_COLLECTED"]), ids=None, errors=[])


def _write_collected() -> None:
    if _LIVE.get("ids") is not None:
        _LIVE["path"].write_text(json.dumps({"ids": _LIVE["ids"], "errors": _LIVE["errors"]}))


def _say(text: str) -> None:
    reporter = _LIVE["config"].pluginmanager.get_plugin("terminalreporter")
    reporter.write_line(text) if reporter is not None else print(text, flush=True)


def pytest_xdist_node_collection_finished(node, ids) -> None:
    if _LIVE and _LIVE["ids"] is None:  # with --dist loadfile every worker collects the same ids
        _LIVE["ids"] = list(ids)
        _write_collected()


def pytest_collectreport(report) -> None:
    if _LIVE and report.failed and report.nodeid not in _LIVE["errors"]:
        _LIVE["errors"].append(report.nodeid)
        _write_collected()
        _say(f"gpu_check: ERROR collecting {report.nodeid}")


def pytest_runtest_logreport(report) -> None:
    if _LIVE and report.failed:
        _say(f"gpu_check: FAILED {report.nodeid}" + ("" if report.when == "call" else f" ({report.when})"))


def say_failures(record: dict, most: int = 30) -> None:
    """Print a record's failures by node id (at most `most` of each kind; the record has them all)."""
    for field, tag in (("failures", "FAILED"),
                       ("failures_in_unfinished_files", "FAILED (file not finished)")):
        items = record.get(field) or []
        for f in items[:most]:
            print(f"  {tag} {f['test']}" + (f": {f['message']}" if f.get("message") else ""))
        if len(items) > most:
            print(f"  ... and {len(items) - most} more {tag} (the record's {field})")


# ------------------------------------------------------------------------ running pytest

def run_pytest(cmd: list[str], env: dict[str, str], stop_after: float | None) -> tuple[int, str | None]:
    """(pytest's exit status, why it was stopped or None). After `stop_after` seconds it is interrupted
    as Ctrl-C would (pytest then ends the session and writes its JUnit file), and killed 120 s later."""
    # SIGINT back to its default in the child: a shell's background job (`nohup ... &`) starts with it
    # ignored, and a Python started so never turns it into KeyboardInterrupt, so pytest would not stop
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        return proc.wait(timeout=stop_after), None
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=120), f"--stop-after {stop_after:g} s reached: pytest was interrupted"
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(), f"--stop-after {stop_after:g} s reached: pytest did not end, so it was killed"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return merge_main(argv[1:])
    if argv[:1] == ["plan"]:
        return plan_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--workers", type=int, default=None,
                   help="pytest-xdist workers (1: no xdist); default: from the GPU's free memory and CPUs")
    p.add_argument("--label", default="suite", help="a name for this run in the record")
    p.add_argument("--shard", default=None,
                   help="K/N: run the K-th of N groups of the files (`plan N` lists them)")
    p.add_argument("--durations", type=Path, action="append", default=[],
                   help="a gpu_check record whose file_seconds weigh the files for --shard and, with "
                        "several workers, order them slowest first (repeatable)")
    p.add_argument("--stop-after", type=float, default=None,
                   help="seconds: interrupt the run then, keeping the finished files in the record")
    args, rest = p.parse_known_args(argv)
    if args.workers is not None and args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
    if args.stop_after is not None and not args.stop_after > 0:
        p.error(f"--stop-after must be > 0 seconds, got {args.stop_after}")
    root = Path.cwd()
    pytest_args = rest or DEFAULT_ARGS
    files = suite_files(pytest_args, root)
    shard = None
    if args.shard is not None:
        try:
            k, n = parse_shard(args.shard)
            cost, unit = weights(files, root, read_durations(args.durations) if args.durations else None)
            groups = split(cost, n)
        except (ValueError, OSError) as e:
            p.error(str(e))
        shard = {"k": k, "n": n, "expected": round(sum(cost[f] for f in groups[k - 1]), 1), "unit": unit,
                 "basis": ("durations: " + ", ".join(map(str, args.durations))) if args.durations
                 else "file sizes", "all_files": files, "all_files_digest": digest(files)}
        files = groups[k - 1]
        # the options stay, the paths give way to this shard's files
        pytest_args = [a for a in pytest_args if a.startswith("-")] + files
    if args.workers is None:
        args.workers, why = choose_workers(gpu_free_bytes(), os.cpu_count())
        print(f"gpu_check: {args.workers} worker(s): {why} (--workers N to choose)")
    else:
        why = "--workers"
    args.out.mkdir(parents=True, exist_ok=True)
    junit = args.out / f"junit_{args.label}.xml"
    collected_path = args.out / f"collected_{args.label}.json"
    collected_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    env = {**os.environ}
    env.setdefault("K3LAB_PREDICTIONS", "off")  # as make test: the notebooks' guesses are not a learner's
    if args.workers > 1:
        # one file per worker: a notebook's cells share one kernel and must run in order on one worker
        cmd += ["-n", str(args.workers), "--dist", "loadfile", "-p", "gpu_check"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                          env.get("PYTHONPATH")]))
        env["GPU_CHECK_COLLECTED"] = str(collected_path.resolve())
    if args.workers > 1 and args.durations:
        # the workers take files in the order pytest collects them, once pytest-xdist's own reordering
        # (files with the most tests first, its default since 3.6) is off: hand the longest out first
        cost, _ = weights(files, root, read_durations(args.durations))
        pytest_args = [a for a in pytest_args if a.startswith("-")] + slowest_first(cost)
        if _xdist_reorders():
            cmd.append("--no-loadscope-reorder")
    cmd += pytest_args
    t0 = time.time()
    with MemorySampler() as memory:
        rc, stopped = run_pytest(cmd, env, args.stop_after)
    wall = time.time() - t0

    from k3lab import env as k3env
    from k3lab.bench import git_commit

    info = k3env.detect()
    record = {"label": args.label, "device": info.name, "backend": info.backend,
              "versions": k3env.versions(), "commit": os.environ.get("K3LAB_COMMIT") or git_commit(),
              "command": " ".join(cmd[1:]), "exit_status": rc, "wall_s": round(wall, 1),
              "cpu_count": os.cpu_count(), "workers": args.workers, "workers_why": why,
              "gpu_memory": memory.record(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "shard": shard, "stopped": stopped, "files": files, "files_not_run": [],
              # the paths as asked ('tests' for the whole suite): `command` may list files instead, in
              # the order they were handed out or as one shard's
              "asked": [a for a in (rest or DEFAULT_ARGS) if not a.startswith("-")]}
    if junit.exists():
        not_run = []
        if stopped and args.workers > 1:  # a file is finished when all its collected items are reported
            collected = read_collected(collected_path, files)
            not_run = unfinished_files(junit, files, collected)
            record["collected"] = collected
        elif stopped:  # the file in flight and those after it; the finished ones stay
            seen = seen_files(junit, files)
            not_run = [f for f in files if f not in seen[:-1]]
        everything = summarize(junit, files)
        record |= summarize(junit, files, drop=set(not_run)) | {"files_not_run": not_run}
        # their counts are the later run's, but their failures are real: never hidden by the stop
        record["failures_in_unfinished_files"] = failures_in(everything["failures"], not_run)
    else:
        record |= {"counts": {}, "note": "pytest wrote no JUnit file", "files_not_run": files}
    path = args.out / f"gpu_check_{args.label}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    c = record.get("counts", {})
    print(f"{args.label}: {c.get('passed', 0)} passed, {c.get('failed', 0)} failed, {c.get('skipped', 0)} "
          f"skipped in {wall:.0f} s on {info.name} with {args.workers} worker(s)"
          + (f", shard {args.shard} ({len(files)} files)" if shard else "")
          + (f"; {stopped}, {len(record['files_not_run'])} file(s) not run" if stopped else "")
          + (f", {len(record['failures_in_unfinished_files'])} failure(s) in them"
             if record.get("failures_in_unfinished_files") else "")
          + f" -> {path}")
    say_failures(record)
    return rc


if __name__ == "__main__":
    sys.exit(main())
