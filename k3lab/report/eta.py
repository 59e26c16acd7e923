"""The report's overall progress: one bar with an ETA over every step of `k3lab report` (the kernel
builds, each study, each notebook), on top of the per-step lines.

`Plan` holds the steps and their expected seconds and computes the ETA; `Progress` shows it: on a
terminal that has a size, a tqdm bar redrawn every second (the per-step lines print above it); anywhere
else (CI, a pipe, a file, a terminal that reports no size) a plain line every PLAIN_INTERVAL_S seconds
and one as each step ends, e.g. "[   120 s] overall: 5/23 done, ETA 4 min 10 s", so a log stays
readable and never goes quiet. `say(t0, message)` prints a per-step line through whichever is active.

How the ETA is made, and why:
- Each step starts from seconds measured on this kind of machine (`expected_seconds`): first the last
  report's out/timings.json when it ran on the same kind of machine (kind, device and core count,
  `machine_kind`) in the same form, else a committed report timings file of that kind
  (profiles/*/report_timings_*.json and profiles/*/gpu_check/report_timings_*.json), else the table
  `EXPECTED_S` (the GPU's quick studies take their budgets from `studies.GPU_QUICK`). So the first
  estimate, shown from the first second, is already the machine's and not a guess from rates.
- As steps finish, the rest are scaled by how the finished ones compared with theirs: (seconds taken
  + PRIOR_S) / (seconds expected + PRIOR_S), clamped to SCALE_LIMITS. PRIOR_S keeps one short step from
  swinging the whole estimate. (Only finished steps: a scale that grew with a running step's overrun
  could cancel that step's own countdown and hold the ETA still.)
- A running step counts what is left of its scaled estimate; within OVERRUN_FLOOR_S of it and past it,
  OVERRUN_FLOOR_S plus OVERRUN_SHARE of its overrun so far: a step that overruns is assumed to need a
  share more of what it overran, so the ETA keeps moving (down a second a second on schedule, up half
  a second a second past it) while a long cell runs, instead of freezing at a step that counts as done.
- Steps run one after another, except notebooks, which run `workers` at a time: their part is the end
  of a greedy schedule (each pending notebook, in order, goes to the slot that frees first), from the
  running notebooks' remaining seconds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PRIOR_S = 60.0
SCALE_LIMITS = (1 / 3, 3.0)
# a running step past its estimate has OVERRUN_FLOOR_S + OVERRUN_SHARE x its overrun so far left
OVERRUN_FLOOR_S = 1.0
OVERRUN_SHARE = 0.5
PLAIN_INTERVAL_S = 10.0  # the plain lines' interval off a terminal
BAR_INTERVAL_S = 1.0  # the bar's redraw on a terminal
REPO = Path(__file__).resolve().parent.parent.parent
KERNELS = "kernels"  # the step that builds every kernels/*.cu (GPU)
DEFAULT_S = {"gpu": 30.0, "cpu": 60.0}  # a step the table does not list (a new study or notebook)
# Seconds per step. gpu: the H200 (16 cores): each notebook's wall time as nbval measured it with six
# notebooks running at once on the one GPU (the sum of its cells in
# profiles/nvidia-h200/gpu_check/notebooks_e547f7b.json; on the slow side for the report's four at a
# time); full studies as the default report measured them (copy_removal, kda_scan and decode_step from
# `k3lab report`, the others' ~260 s spread by their number of cases). cpu: a 2-core machine that other
# jobs shared, `k3lab report`'s default form (6 minutes in all; notebook 08's, which failed early there,
# from the run before), rounded up. The table serves only a machine kind with no measured run: a report's
# out/timings.json or a committed report_timings file of the same kind comes first (`expected_seconds`).
# Notebooks at a time (`default_workers`): four on a GPU machine (six at once ran clean on one H200 in
# the record above), two on a CPU, whose cores the kernels and the interpreter already fill.
WORKERS = {"gpu": 4, "cpu": 2}
EXPECTED_S: dict[str, dict[str, float]] = {
    "gpu": {
        KERNELS: 10,
        "notebook:00_k3_anatomy": 30, "notebook:01_dcp": 17, "notebook:02_moe_sharding": 15,
        "notebook:03_copy_removal": 86, "notebook:04_mla_padding": 61, "notebook:04b_mla_deep_dive": 13,
        "notebook:05_kda_scan": 112, "notebook:05b_kda_deep_dive": 86, "notebook:06_draft_depth": 22,
        "notebook:07_agent_cache": 48, "notebook:08_all_together": 25, "notebook:09_serving_curve": 18,
    },
    "gpu-full": {
        "study:launch_overhead": 20, "study:copy_removal": 176, "study:kda_decode": 20,
        "study:mla_padding": 80, "study:kda_scan": 212, "study:kda_verify": 50, "study:kda_precision": 15,
        "study:draft_depth": 30, "study:decode_step": 397, "study:agent_cache": 25, "study:dcp": 20,
        "study:moe_sharding": 25, "study:serving": 420,
        # estimated, the full form never having run: its 28 runs of 40 s of serving clock (at most 20 s more
        # each to finish what is in flight) and the engine for 64 sequences
        "study:serving_run": 1500,
    },
    "cpu": {
        KERNELS: 0, "study:launch_overhead": 2, "study:copy_removal": 2, "study:mla_padding": 6,
        "study:kda_scan": 15, "study:kda_verify": 3, "study:kda_precision": 7, "study:draft_depth": 8,
        "study:decode_step": 105, "study:agent_cache": 1, "study:serving": 2, "study:serving_run": 13,
        "notebook:00_k3_anatomy": 25,
        "notebook:01_dcp": 20, "notebook:02_moe_sharding": 15, "notebook:03_copy_removal": 30,
        "notebook:04_mla_padding": 55, "notebook:04b_mla_deep_dive": 10, "notebook:05_kda_scan": 60,
        "notebook:05b_kda_deep_dive": 75, "notebook:06_draft_depth": 60, "notebook:07_agent_cache": 70,
        "notebook:08_all_together": 15, "notebook:09_serving_curve": 35,
    },
}


def default_workers(kind: str) -> int:
    """Notebooks executed at a time by default on a `kind` ('gpu' or 'cpu') machine (WORKERS)."""
    if kind not in WORKERS:
        raise ValueError(f"kind must be 'gpu' or 'cpu', got {kind!r}")
    return WORKERS[kind]


def machine_kind(kind: str) -> dict:
    """This machine as report timings are matched to it: {'kind': 'gpu' or 'cpu', 'device': the GPU's
    or CPU's name (k3lab.env), 'cpus': its core count}."""
    from k3lab import env

    if kind not in ("gpu", "cpu"):
        raise ValueError(f"kind must be 'gpu' or 'cpu', got {kind!r}")
    return {"kind": kind, "device": env.detect().name, "cpus": os.cpu_count() or 1}


def _file_machine(data: dict) -> dict:
    """The machine kind a timings file was measured on: its 'machine_kind', or for a file written before
    it was kept, what its 'machine' and 'environment' line say (no core count)."""
    if isinstance(data.get("machine_kind"), dict):
        return data["machine_kind"]
    env_line = str(data.get("environment", ""))
    device = env_line.split(" device=", 1)[1].split(" units=", 1)[0] if " device=" in env_line else None
    return {"kind": data.get("machine"), "device": device}


def same_kind(a: dict, b: dict) -> bool:
    """Whether two machine kinds match: kind and device equal, and the core counts where both have one."""
    if a.get("kind") != b.get("kind") or a.get("device") != b.get("device"):
        return False
    return a.get("cpus") is None or b.get("cpus") is None or a.get("cpus") == b.get("cpus")


def measured_at(path: Path) -> float:
    """When a timings file was measured, in seconds since the epoch: its 'finished_at' (written by every
    report since it was kept), else the time of the commit that added it (git, where the tree is a
    clone), else 0.0 (unknown: such a file sorts last)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return 0.0
    stamp = data.get("finished_at") if isinstance(data, dict) else None
    if isinstance(stamp, (int, float)) and not isinstance(stamp, bool) and math.isfinite(stamp):
        return float(stamp)
    import subprocess

    try:
        got = subprocess.run(["git", "log", "--diff-filter=A", "-1", "--format=%ct", "--", Path(path).name],
                             cwd=Path(path).parent, capture_output=True, text=True, timeout=10)
        lines = got.stdout.split() if got.returncode == 0 else []
        return float(lines[0]) if lines else 0.0
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0.0


def timing_files(out: Path | None = None, root: Path | None = None) -> list[Path]:
    """Where measured report timings are looked for, in order: out/timings.json (the last report written
    there), then the committed ones under root/profiles (default: the tree's), newest first
    (`measured_at`; by path among equals), so the ETA reads the latest run of a machine kind, not the
    first file name."""
    base = Path(root if root is not None else REPO) / "profiles"
    committed = sorted([*base.glob("*/report_timings_*.json"),
                        *base.glob("*/gpu_check/report_timings_*.json")])
    committed.sort(key=measured_at, reverse=True)  # stable: equal times keep the path order
    return ([Path(out) / "timings.json"] if out is not None else []) + committed


def _non_negative(x) -> bool:
    """Whether a timings file's value is a finite number >= 0 (not a bool, a string or NaN)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def measured_seconds(machine: dict, form: str, files: list[Path]) -> tuple[dict[str, float], Path | None]:
    """Each step's seconds from the first of `files` measured on this kind of machine (`same_kind`) in
    report form `form`, and that file (({}, None) when none is). Steps that were interrupted or failed are
    left out (their seconds are not a whole step's); one that timed out keeps its seconds (a lower bound,
    and the next run is likely to take as long again)."""
    for path in files:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or data.get("form") != form:
            continue
        if not same_kind(_file_machine(data), machine):
            continue
        steps = {}
        for key, step in (data.get("steps") or {}).items():
            seconds = step.get("seconds") if isinstance(step, dict) else None
            if _non_negative(seconds) and step.get("status") not in ("interrupted", "failed"):
                steps[key] = float(seconds)
        if steps:
            return steps, Path(path)
    return {}, None


def measured_peaks(path: Path | None) -> dict[str, float]:
    """Each notebook step's GPU memory peak in GiB ('gpu_peak_gib', k3lab._cells) in the timings file
    `path` (the one `measured_seconds` chose; {} for None or a file without them)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    steps = data.get("steps") if isinstance(data, dict) else None
    out = {}
    for key, step in (steps if isinstance(steps, dict) else {}).items():
        peak = step.get("gpu_peak_gib") if isinstance(step, dict) else None
        if _non_negative(peak):
            out[key] = float(peak)
    return out


def expected_seconds(kind: str, form: str, step: str, measured: dict[str, float] | None = None) -> float:
    """Expected seconds of `step` ('kernels', 'study:<name>' or 'notebook:<stem>') on a `kind`
    ('gpu' or 'cpu') machine in report form `form` ('quick' or 'full'): `measured[step]` when the
    measurements of this machine kind have it (`measured_seconds`), else the table: a GPU's quick studies
    take their budget from studies.GPU_QUICK; full studies on a CPU take the quick form's figure (the
    refinement corrects it); a step nowhere listed takes DEFAULT_S[kind]."""
    if kind not in ("gpu", "cpu"):
        raise ValueError(f"kind must be 'gpu' or 'cpu', got {kind!r}")
    if form not in ("quick", "full"):
        raise ValueError(f"form must be 'quick' or 'full', got {form!r}")
    if measured and step in measured:
        return float(measured[step])
    if kind == "gpu" and step.startswith("study:"):
        if form == "full":
            return float(EXPECTED_S["gpu-full"].get(step, DEFAULT_S[kind]))
        from k3lab.studies import GPU_QUICK

        quick = GPU_QUICK.get(step.split(":", 1)[1])
        return float(quick.budget_s) if quick else DEFAULT_S[kind]
    return float(EXPECTED_S[kind].get(step, DEFAULT_S[kind]))


def fmt_duration(seconds: float) -> str:
    """'45 s', '4 min 10 s', '1 h 02 min'."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


@dataclass
class _Step:
    key: str
    expected: float
    parallel: bool
    started: float | None = None
    finished: float | None = None


@dataclass
class Plan:
    """The report's steps in the order they run, with expected seconds; notebooks (parallel=True)
    run `workers` at a time after every other step. Times are seconds on any one clock."""

    workers: int = 1
    steps: list[_Step] = field(default_factory=list, init=False)

    def __post_init__(self):
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        self._index: dict[str, _Step] = {}

    def add(self, key: str, expected_s: float, parallel: bool = False) -> None:
        if key in self._index:
            raise ValueError(f"step {key!r} is already in the plan")
        if not (isinstance(expected_s, (int, float)) and math.isfinite(expected_s) and expected_s >= 0):
            raise ValueError(f"expected_s of {key!r} must be a finite number >= 0, got {expected_s!r}")
        step = _Step(key, float(expected_s), parallel)
        self.steps.append(step)
        self._index[key] = step

    def get(self, key: str) -> _Step | None:
        """The step `key` (its expected seconds, start and end), or None when the plan has none."""
        return self._index.get(key)

    def _step(self, key: str) -> _Step:
        if key not in self._index:
            raise KeyError(f"no step {key!r} in the plan (steps: {', '.join(self._index)})")
        return self._index[key]

    def start(self, key: str, now: float) -> None:
        step = self._step(key)
        if step.started is None:
            step.started = now

    def finish(self, key: str, now: float) -> None:
        step = self._step(key)
        if step.started is None:
            step.started = now
        step.finished = now

    @property
    def done(self) -> int:
        return sum(s.finished is not None for s in self.steps)

    @property
    def total(self) -> int:
        return len(self.steps)

    def scale(self) -> float:
        """How much longer (> 1) or shorter than expected the finished steps took, shrunk toward 1 by
        PRIOR_S and clamped to SCALE_LIMITS."""
        fin = [s for s in self.steps if s.finished is not None]
        taken = sum(s.finished - s.started for s in fin)
        expected = sum(s.expected for s in fin)
        lo, hi = SCALE_LIMITS
        return min(hi, max(lo, (taken + PRIOR_S) / (expected + PRIOR_S)))

    def left(self, key: str, now: float, k: float | None = None) -> float:
        """Seconds `key` still needs at `now` (module docstring), its estimate scaled by `k` (default:
        the plan's scale)."""
        s = self._step(key)
        k = self.scale() if k is None else k
        if s.finished is not None:
            return 0.0
        if s.started is None:
            return s.expected * k
        ran, due = max(0.0, now - s.started), s.expected * k
        return max(due - ran, OVERRUN_FLOOR_S + OVERRUN_SHARE * max(0.0, ran - due))

    def eta(self, now: float) -> float:
        """Seconds until every step has finished (see the module docstring)."""
        k = self.scale()

        def left(s: _Step) -> float:
            return self.left(s.key, now, k)

        serial = sum(left(s) for s in self.steps if not s.parallel)
        running = sorted(left(s) for s in self.steps
                         if s.parallel and s.started is not None and s.finished is None)
        pending = [left(s) for s in self.steps if s.parallel and s.started is None]
        slots = (running + [0.0] * self.workers)[: max(self.workers, len(running))]
        for p in pending:
            i = min(range(len(slots)), key=slots.__getitem__)
            slots[i] += p
        return serial + (max(slots) if slots else 0.0)

    def summary(self, now: float, elapsed: float) -> str:
        """'5/23 done, ETA 4 min 10 s' (or 'all 23 done' at the end)."""
        if self.done == self.total:
            return f"all {self.total} done in {fmt_duration(elapsed)}"
        return f"{self.done}/{self.total} done, ETA {fmt_duration(self.eta(now))}"


def _bar_class():
    """tqdm with one more field for bar_format, {overall}: the plan's own count and ETA (tqdm's ETA
    assumes a steady rate, which steps of such different lengths do not have)."""
    from tqdm import tqdm

    class _Bar(tqdm):
        overall = ""

        @property
        def format_dict(self):
            return {**super().format_dict, "overall": self.overall}

    return _Bar


_ACTIVE: Progress | None = None
_PRINT_LOCK = threading.Lock()


def say(t0: float, message: str) -> None:
    """One per-step line on stderr: seconds since the report began, then the message; above the bar
    when one is shown."""
    line = f"[{time.time() - t0:6.0f} s] {message}"
    active = _ACTIVE
    if active is not None:
        active.write(line)
    else:
        with _PRINT_LOCK:
            print(line, file=sys.stderr, flush=True)


def has_terminal(stream) -> bool:
    """Whether a bar can be drawn on `stream`: a terminal that reports a size (a pseudo-terminal of no
    size, as some CI runners and `script` give, shows nothing of a bar redrawn in place) and is not
    TERM=dumb."""
    try:
        if not stream.isatty():
            return False
        columns = os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return False
    return columns > 0 and os.environ.get("TERM", "") != "dumb"


class Progress:
    """Shows a Plan's progress while the report runs: a tqdm bar on a terminal with a size (`tty`,
    default `has_terminal`), else a plain overall line every `interval_s` and at each step's end. Use
    as a context manager; `start(key)` and `finish(key)` mark steps (wall clock), `write(line)` prints
    a per-step line."""

    def __init__(self, plan: Plan, t0: float, *, stream=None, tty: bool | None = None,
                 interval_s: float | None = None):
        self.plan, self.t0 = plan, t0
        self.stream = stream if stream is not None else sys.stderr
        self.tty = has_terminal(self.stream) if tty is None else tty
        self.interval_s = interval_s if interval_s is not None else (BAR_INTERVAL_S if self.tty
                                                                    else PLAIN_INTERVAL_S)
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._bar = None
        self._thread: threading.Thread | None = None
        self._ended = False

    # -- the display
    def _elapsed(self) -> float:
        return time.time() - self.t0

    def _overall(self) -> str:
        return self.plan.summary(time.time(), self._elapsed())

    def _redraw(self) -> None:
        if self._bar is None:
            return
        elapsed = self._elapsed()
        eta = self.plan.eta(time.time()) if self.plan.done < self.plan.total else 0.0
        total = elapsed + eta
        self._bar.n = int(1000 * elapsed / total) if total > 0 else 1000
        self._bar.overall = f"{self._overall()} [{fmt_duration(elapsed)} elapsed]"
        self._bar.refresh()

    def _plain(self) -> None:
        end = self.plan.done == self.plan.total
        if end and self._ended:
            return  # the end, said once
        self._ended = end
        text = self._overall()
        with _PRINT_LOCK:
            print(f"[{self._elapsed():6.0f} s] overall: {text}", file=self.stream, flush=True)

    def _tick(self) -> None:
        while not self._stop.wait(self.interval_s):
            with self._lock:
                self._redraw() if self.tty else self._plain()

    def write(self, line: str) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.clear()
            with _PRINT_LOCK:
                print(line, file=self.stream, flush=True)
            if self._bar is not None:
                self._redraw()

    # -- the steps
    def start(self, key: str) -> None:
        with self._lock:
            self.plan.start(key, time.time())
            self._redraw()

    def finish(self, key: str) -> None:
        with self._lock:
            self.plan.finish(key, time.time())
            self._redraw() if self.tty else self._plain()

    # -- the context
    def __enter__(self) -> Progress:
        global _ACTIVE
        if self.tty:
            self._bar = _bar_class()(total=1000, file=self.stream, desc="k3lab report", leave=True,
                                     bar_format="{desc}: {percentage:3.0f}%|{bar:30}| {overall}")
            self._redraw()
        else:
            self._plain()
        _ACTIVE = self
        self._thread = threading.Thread(target=self._tick, name="k3lab-report-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        global _ACTIVE
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            _ACTIVE = None
            if self._bar is not None:
                self._redraw()
                self._bar.close()
                self._bar = None
            else:
                self._plain()
