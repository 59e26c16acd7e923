"""One profiler per call: `k3lab profile STUDY --tool torch|ncu|nsys|rocprofv3`, read into the kernel frame.

torch       torch.profiler in this process (k3lab.profiling.capture), everywhere.
ncu         Nsight Compute on a CUDA GPU: the variant's steps run in a child process
            (`python -m k3lab.profiling.child`), every kernel inside the first `k3lab.step.0` NVTX range is
            profiled (`--nvtx --nvtx-include k3lab.step.0/`), and the CSV becomes one row per launch
            (`ncu_frame`: duration from gpu__time_duration, bytes from DRAM reads + writes).
nsys        Nsight Systems on a CUDA GPU: the child runs under `nsys profile --trace cuda,nvtx`, then
            `nsys stats --report cuda_gpu_trace --format csv` gives one row per kernel / copy / memset
            (`read_cuda_gpu_trace`).
rocprofv3   ROCm: the child under rocprofv3 (k3lab.profiling.rocprofv3_run.capture_rocprofv3).

`missing(tool)` says, before anything runs, why a tool cannot run here (not on PATH, no GPU of its
vendor), so the command refuses in one line. A named variant is checked before that, against the
profile targets built here (the names the child process would accept), so a wrong name is one line on
any machine, never a traceback from the child once the profiler has started.

Studies with nothing for these tools to record are refused in one line naming what to run instead
(NO_KERNELS): occupancy and the serving studies, whose kernels are other studies' targets, and
draft_depth and agent_cache, whose targets are simulators in numpy and plain Python on the host. Those
run no PyTorch op and launch no device kernel, so torch.profiler's table of them is empty (notebook 06
shows it) and ncu, nsys and rocprofv3 find nothing; what a user wants there is their time on the CPU,
which `k3lab bench` measures (CPU seconds per wall second included).

The ncu path has run on an NVIDIA H100 (its captures of the fused KDA decode and the MLA split kernel:
profiles/nvidia-h100-80gb-hbm3/ncu); the nsys path has not yet been run on a GPU by this project through
this module (NOT_YET_RUN says which). The readers are tested on real files (tests/fixtures/profiles/ncu,
.../nsys, and the H100's ncu captures).
"""

from __future__ import annotations

import csv
import io
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from k3lab.profiling.capture import Capture
from k3lab.profiling.frame import NoKernelsRecorded, make_frame
from k3lab.profiling.ncu import ncu_command, parse_ncu_csv

TOOLS = ("torch", "ncu", "nsys", "rocprofv3")
NOT_YET_RUN = {"nsys": "k3lab profile --tool nsys: not yet run on a GPU by this project",
               "rocprofv3": "k3lab profile --tool rocprofv3: not yet run on AMD hardware by this project"}
_VENDOR = {"ncu": ("cuda", "Nsight Compute"), "nsys": ("cuda", "Nsight Systems"),
           "rocprofv3": ("rocm", "ROCm")}
# The studies with no kernels of their own (their profile_targets return {}, or run host code only), each
# with what to run instead: `k3lab profile` refuses them in one line (`no_targets`) instead of writing a
# trace with an empty table.
NO_KERNELS = {
    "occupancy": "its one kernel is kda_scan's chunk prologue, relaunched at each shared-memory reserve by "
                 "`k3lab bench occupancy`; `k3lab profile kda_scan` traces that kernel",
    "serving": "its grid's steps are decode_step's; `k3lab profile decode_step` traces them",
    "serving_run": "its decode step is decode_step's and its chunked prefill kda_scan's; `k3lab profile "
                   "decode_step` and `k3lab profile kda_scan` trace them",
    "draft_depth": "its simulators are numpy and plain Python on the host CPU (no PyTorch op, no device "
                   "kernel); `k3lab bench draft_depth` times both variants there",
    "agent_cache": "its prefix-cache simulator is plain Python on the host CPU (no PyTorch op, no device "
                   "kernel); `k3lab bench agent_cache` times it and its host<->device copies",
}


def _backend() -> str:
    from k3lab import env

    return env.detect().backend


def _check_tool(tool) -> None:
    if tool not in TOOLS:
        raise ValueError(f"--tool: expected one of {', '.join(TOOLS)}, got {tool!r}")


def missing(tool: str, *, backend: str | None = None, which=shutil.which) -> str | None:
    """Why `tool` cannot profile here (one line), or None when it can. ValueError for an unknown tool.
    `backend` ('cuda', 'rocm', 'cpu'; default: this machine's) and `which` are for tests."""
    _check_tool(tool)
    if tool == "torch":
        return None
    backend = _backend() if backend is None else backend
    vendor, suite = _VENDOR[tool]
    lacking = []
    if which(tool) is None:
        lacking.append(f"{tool} is not on PATH (it comes with {suite})")
    if backend != vendor:
        lacking.append(f"it profiles {'NVIDIA (CUDA)' if vendor == 'cuda' else 'AMD (ROCm)'} GPUs and this "
                       f"machine's backend is {backend}")
    if not lacking:
        return None
    return f"--tool {tool}: " + "; ".join(lacking) + "; --tool torch (torch.profiler) runs here"


def no_targets(study: str) -> str | None:
    """The one-line refusal for a study with no kernels to profile (NO_KERNELS), naming the study, why, and
    the studies that have profile targets; None for the others. ValueError for an unknown study."""
    from k3lab.studies import canonical

    name = canonical(study)
    if name not in NO_KERNELS:
        return None
    return _nothing_line(name, NO_KERNELS[name])


def _nothing_line(name: str, why: str) -> str:
    from k3lab.studies import STUDIES

    profiled = [s for s in STUDIES if s not in NO_KERNELS]
    return f"{name} has no kernels to profile: {why}. Studies with kernels to profile: {', '.join(profiled)}"


def child_command(study: str, variant: str, *, preset: str | None, steps: int, warmup: int = 1) -> list[str]:
    """The command that runs one variant's steps in a child process, each in a `k3lab.step.N` range."""
    cmd = [sys.executable, "-m", "k3lab.profiling.child", study, variant, "--steps", str(steps),
           "--warmup", str(warmup)]
    return cmd + (["--preset", preset] if preset else [])


def _run(cmd: list[str], timeout_s: float | None, what: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited with {done.returncode}: {' '.join(cmd)}\n{done.stderr[-4000:]}")
    return done


# ------------------------------------------------------------------------------------------ ncu

_DURATION = ("gpu__time_duration.sum", "Duration")
_DRAM = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def ncu_frame(long: pd.DataFrame) -> pd.DataFrame:
    """A kernel frame (one row per profiled launch) from `parse_ncu_csv`'s long table: dur_ns from
    gpu__time_duration.sum (the details page's 'Duration'), bytes = DRAM bytes read + written where both
    were collected. ncu serializes launches and gives no timestamps: start_ns is the running sum of the
    durations, so the rows keep ncu's launch order. ValueError when no duration metric is present."""
    if not {"id", "kernel", "metric", "value_base"} <= set(long.columns):
        raise ValueError("long: pass the DataFrame parse_ncu_csv returns")
    metric = next((m for m in _DURATION if (long["metric"] == m).any()), None)
    if metric is None:
        raise ValueError(f"the ncu CSV has no duration metric ({' or '.join(_DURATION)}): add "
                         "gpu__time_duration.sum to --metrics")
    rows, t = [], 0
    for (ident, kernel), g in long.groupby(["id", "kernel"], sort=False):
        m = dict(zip(g["metric"], g["value_base"]))
        dur = int(round(m[metric])) if metric in m and not math.isnan(m[metric]) else 0
        read, write = (m.get(k) for k in _DRAM)
        nbytes = int(read + write) if read is not None and write is not None \
            and not (math.isnan(read) or math.isnan(write)) else None
        rows.append({"name": kernel, "kind": "kernel", "start_ns": t, "dur_ns": dur, "bytes": nbytes,
                     "device": "gpu", "correlation": int(ident)})
        t += dur
    return make_frame(rows, source="ncu")


def capture_ncu(study: str, variant: str, *, preset: str | None, out_dir, steps: int = 1,
                timeout_s: float | None = None) -> Capture:
    """Every kernel of the variant's first marked step under ncu (a child process), as a Capture whose
    trace_path is ncu's CSV. Run on an NVIDIA H100 (profiles/nvidia-h100-80gb-hbm3/ncu); ncu selects the
    marked step by its NVTX range (k3lab.step.0)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = ncu_command(child_command(study, variant, preset=preset, steps=steps), kernel_name=".*", regex=True,
                      launch_count=100000, extra_args=("--nvtx", "--nvtx-include", "k3lab.step.0/"))
    done = _run(cmd, timeout_s, "ncu")
    csv_path = out_dir / f"{study}-{variant}.ncu.csv"
    csv_path.write_text(done.stdout)
    kernels = ncu_frame(parse_ncu_csv(done.stdout))
    return Capture(kernels=kernels, steps=1, trace_path=csv_path, backend="ncu", device="cuda",
                   name=f"{study}-{variant}", files=[csv_path])


# ----------------------------------------------------------------------------------------- nsys

def _columns(header: list[str]) -> dict[str, int]:
    return {h.strip().lower(): i for i, h in enumerate(header)}


def read_cuda_gpu_trace(source) -> pd.DataFrame:
    """A kernel frame from `nsys stats --report cuda_gpu_trace --format csv` (text or a path): kernels,
    '[CUDA memcpy ...]' copies (bytes from 'Bytes (MB)', decimal megabytes) and '[CUDA memset]' rows.
    Columns are found by name; lines before the header (nsys's notices) are skipped."""
    text = Path(source).read_text() if isinstance(source, Path) or (
        isinstance(source, str) and "\n" not in source and Path(source).is_file()) else str(source)
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Start (ns)")), None)
    if start is None:
        raise ValueError("not an nsys cuda_gpu_trace CSV: no 'Start (ns),Duration (ns),...' header line")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    col = _columns(rows[0])
    need = ("start (ns)", "duration (ns)", "name")
    if not all(c in col for c in need):
        raise ValueError(f"nsys cuda_gpu_trace CSV: expected columns {need}, got {rows[0]}")
    size = next((c for c in ("bytes (mb)", "size (mb)") if c in col), None)
    stream = next((c for c in ("strm", "stream") if c in col), None)

    def cell(r, c):
        i = col.get(c) if c else None
        return r[i].strip() if i is not None and i < len(r) else ""

    out = []
    for r in rows[1:]:
        if not r or not cell(r, "start (ns)"):
            continue
        name = cell(r, "name")
        kind = "memcpy" if name.startswith("[CUDA memcpy") else "memset" if name.startswith("[CUDA memset") \
            else "kernel"
        mb = cell(r, size)
        out.append({"name": name, "kind": kind, "start_ns": int(cell(r, "start (ns)")),
                    "dur_ns": int(cell(r, "duration (ns)")),
                    "bytes": round(float(mb) * 1e6) if kind != "kernel" and mb else None,
                    "device": cell(r, "device") or "gpu",
                    "stream": int(cell(r, stream)) if cell(r, stream) else None,
                    "correlation": int(cell(r, "corrid")) if cell(r, "corrid") else None})
    return make_frame(out, source="nsys")


def capture_nsys(study: str, variant: str, *, preset: str | None, out_dir, steps: int = 3,
                 timeout_s: float | None = None) -> Capture:
    """The variant's steps under Nsight Systems (a child process), read back through `nsys stats`. The
    frame holds every GPU row of the run, warm-up and input setup included (nsys traces the whole
    process; the step ranges are in the report for its own GUI). Not yet run on a GPU by this project."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"{study}-{variant}"
    _run(["nsys", "profile", "--trace", "cuda,nvtx", "--force-overwrite", "true", "--output", str(base),
          *child_command(study, variant, preset=preset, steps=steps)], timeout_s, "nsys profile")
    rep = base.with_suffix(".nsys-rep")
    done = _run(["nsys", "stats", "--report", "cuda_gpu_trace", "--format", "csv", str(rep)], timeout_s,
                "nsys stats")
    csv_path = base.with_suffix(".cuda_gpu_trace.csv")
    csv_path.write_text(done.stdout)
    kernels = read_cuda_gpu_trace(done.stdout)
    if len(kernels) == 0:
        raise NoKernelsRecorded(f"nsys recorded no GPU row for {study}/{variant} (report {rep})")
    return Capture(kernels=kernels, steps=steps, trace_path=rep, backend="nsys", device="cuda",
                   name=f"{study}-{variant}", note=NOT_YET_RUN["nsys"], files=[rep, csv_path])


def capture_tool(tool: str, study: str, variant: str, *, preset: str | None, out_dir, steps: int = 3,
                 timeout_s: float | None = None) -> Capture:
    """Profile one variant of a study with `tool` (not 'torch': that one runs in this process). Raises
    ValueError with `missing(tool)`'s line when the tool cannot run here, before anything runs."""
    why = missing(tool)
    if why is not None:
        raise ValueError(why)
    if tool == "ncu":
        return capture_ncu(study, variant, preset=preset, out_dir=out_dir, timeout_s=timeout_s)
    if tool == "nsys":
        return capture_nsys(study, variant, preset=preset, out_dir=out_dir, steps=steps, timeout_s=timeout_s)
    if tool == "rocprofv3":
        from k3lab.profiling.rocprofv3_run import capture_rocprofv3

        return capture_rocprofv3(child_command(study, variant, preset=preset, steps=steps), steps=steps,
                                 trace_dir=out_dir, name=f"{study}-{variant}", timeout_s=timeout_s)
    raise ValueError(f"--tool: {tool!r} runs in this process; use k3lab.profile.capture")


def check_variants(study: str, names, variants) -> list[str]:
    """`variants` (names, in order, repeats dropped) when each is one of `names` (the study's profile
    targets built here); ValueError naming --variant, the study's variants and the unknown ones."""
    if isinstance(variants, str) or not all(isinstance(v, str) for v in variants):
        raise ValueError(f"--variant: expected a list of variant names, got {variants!r}")
    names = list(names)
    unknown = [v for v in variants if v not in names]
    if unknown or not variants:
        raise ValueError(f"--variant: {study} profiles {', '.join(names)} here; not "
                         f"{', '.join(map(repr, unknown)) or 'an empty list'}")
    return list(dict.fromkeys(variants))


def _targets(study: str, preset: str | None) -> dict:
    from k3lab.studies import load_study

    targets = load_study(study).profile_targets(preset=preset)
    if not targets:  # a study outside NO_KERNELS that built nothing here: refused, never a silent no-op
        raise ValueError(_nothing_line(study, "its profile_targets built none on this machine"))
    return targets


def _release(targets: dict) -> None:
    """Drop the targets built here (a child process builds its own) and their device memory with them."""
    targets.clear()
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def profile_study(study: str, *, tool: str = "torch", variants=None, preset: str | None = None,
                  steps: int = 3, out_dir, timeout_s: float | None = None) -> dict[str, Capture]:
    """Profile each of `variants` (default: every profile target of the study) with `tool`, files under
    `out_dir`. torch: per variant `<variant>.trace.json` (Chrome/Perfetto, with the step and part ranges)
    and an HTA folder `hta/<variant>/rank-0.json.gz` (k3lab.profiling.export). Other tools: their own
    files (`capture_tool`), from a child process.

    ValueError naming what is wrong before anything is profiled, in this order: an unknown tool, steps
    below 1, a study with no kernels to profile (NO_KERNELS), a variant the study does not profile here
    (its targets are built here to know their names, so this holds whether or not the tool is present),
    then a tool that cannot run here."""
    from k3lab.profiling.capture import capture
    from k3lab.profiling.export import write_hta_folder

    _check_tool(tool)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"--steps: expected an int >= 1, got {steps!r}")
    why = no_targets(study)
    if why is not None:
        raise ValueError(why)
    targets = None
    if variants is not None:
        targets = _targets(study, preset)
        variants = check_variants(study, targets, variants)
    why = missing(tool)
    if why is not None:
        raise ValueError(why)
    if targets is None:
        targets = _targets(study, preset)
    variants = list(variants or targets)
    out_dir = Path(out_dir)
    out: dict[str, Capture] = {}
    if tool != "torch":
        _release(targets)
        for v in variants:
            out[v] = capture_tool(tool, study, v, preset=preset, out_dir=out_dir, steps=steps,
                                  timeout_s=timeout_s)
        return out
    for v in variants:
        cap = capture(targets[v], steps=steps, warmup=1, trace_path=out_dir / f"{v}.trace.json",
                      overwrite=True, name=f"{study}-{v}")
        cap.files.append(write_hta_folder(cap.trace_path, out_dir / "hta" / v, overwrite=True))
        out[v] = cap
    return out
