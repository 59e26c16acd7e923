"""Run a workload in a child process under rocprofv3 and read what it wrote.

rocprofv3 instruments a process from its start, so the workload runs as a child (a script or
a command such as `python -m k3lab.cli profile kda`); it never attaches to the notebook's own
process. Not yet run on AMD hardware by this project: the command line follows the rocprofv3
documentation and the parser is tested on real rocprofv3 files from other projects
(tests/fixtures/profiles/).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from k3lab.profiling.capture import Capture, _slug, default_trace_dir, unique_trace_path, write_chrome_trace
from k3lab.profiling.frame import NoKernelsRecorded
from k3lab.profiling.ncu import child_command
from k3lab.profiling.read import read_rocprofv3_dir

NOT_RUN_ON_AMD = "rocprofv3 backend: not yet run on AMD hardware by this project"


def rocprofv3_available() -> bool:
    return shutil.which("rocprofv3") is not None


def rocprofv3_command(script_or_cmd, *, out_dir, name: str, extra_args: tuple[str, ...] = (),
                      rocprofv3: str = "rocprofv3") -> list[str]:
    """`rocprofv3 --kernel-trace --memory-copy-trace --stats -d DIR -o NAME --output-format csv json
    -- <child command>`. CSV and JSON are asked for explicitly because the ROCm 7 default is a
    rocpd database only."""
    if not isinstance(name, str) or not name or _slug(name) != name:
        raise ValueError(f"name: expected a file-name-safe string (letters, digits, _ . -), got {name!r}")
    return [rocprofv3, "--kernel-trace", "--memory-copy-trace", "--stats", "-d", str(out_dir), "-o", name,
            "--output-format", "csv", "json", *extra_args, "--", *child_command(script_or_cmd)]


def capture_rocprofv3(script_or_cmd, *, steps: int = 1, trace_dir=None, name: str | None = None,
                      timeout_s: float | None = None, env: dict | None = None,
                      extra_args: tuple[str, ...] = ()) -> Capture:
    """Run `script_or_cmd` under rocprofv3 and return its Capture. `steps` is how many steps the
    child runs (for per-step counts). The rocprofv3 files stay in a new folder under `trace_dir`;
    `trace_path` is a Perfetto-readable Chrome trace converted from them.
    Not yet run on AMD hardware by this project."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
    cmd_preview = child_command(script_or_cmd)  # validates before anything runs
    if not rocprofv3_available():
        raise FileNotFoundError("rocprofv3 is not on PATH (it ships with ROCm in /opt/rocm/bin); "
                                "use k3lab.profile.capture(fn), which uses torch.profiler")
    name = _slug(name or Path(cmd_preview[-1]).stem)
    out_dir = unique_trace_path(trace_dir or default_trace_dir(), name, "rocprofv3", suffix="")
    out_dir.mkdir(parents=True)
    cmd = rocprofv3_command(script_or_cmd, out_dir=out_dir, name=name, extra_args=extra_args)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RuntimeError(f"rocprofv3 exited with {done.returncode}: {' '.join(cmd)}\n"
                           f"{done.stderr[-4000:]}")
    kernels = read_rocprofv3_dir(out_dir)
    if len(kernels) == 0:
        raise NoKernelsRecorded(f"rocprofv3 recorded no kernel or copy for {' '.join(cmd)} "
                                f"(files in {out_dir})")
    trace_path = write_chrome_trace(kernels, out_dir / f"{name}.perfetto.json", meta={"command": cmd})
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return Capture(kernels=kernels, steps=steps, trace_path=trace_path, backend="rocprofv3", device="rocm",
                   name=name, note=NOT_RUN_ON_AMD, files=files)
