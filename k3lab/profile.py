"""Profile a region and read any profiler's trace into one kernel table.

    cap = k3lab.profile.capture(step, steps=3)      # torch.profiler: CUPTI / roctracer / CPU ops
    cap.table                                       # per kernel name: calls, total_us, mean_us, share
    cap.counts()                                    # per step: launches, copies, bytes_copied
    cap.trace_path                                  # Chrome/Perfetto JSON (ui.perfetto.dev)

Where traces go: `trace_dir=` or `trace_path=`; else $K3LAB_TRACE_DIR; else a temp folder whose traces
are removed when the process exits (`default_trace_dir`). `k3lab report` keeps each run's under its --out.

    df = k3lab.profile.read_trace("run_results.db")  # rocprofv3 CSV/JSON/rocpd, rocprof v1, torch
    k3lab.profile.kernel_table(df)
    k3lab.profile.trace_diff(before_df, after_df)  # kernels gone, new, changed; time per category
    k3lab.profile.capture_diff(before_fn, after_fn)  # capture both here, then the same diff

rocprofv3 (ROCm) runs a workload in a child process: `capture_rocprofv3("study.py")`.
ncu (NVIDIA) reads hardware counters of one kernel: `ncu_command(...)` + `parse_ncu_csv(...)`.
`k3lab profile STUDY --tool ncu|nsys|rocprofv3` runs a study's variant under that tool (profiling.tools).
Traces for HTA and Perfetto: `write_hta_folder(cap.trace_path, folder)`, `label(name)` for named ranges.
`python -m k3lab.profile` captures a small known workload here and checks the table (selfcheck).
The implementation lives in k3lab/profiling/, one module per format.
"""

import sys

from k3lab.profiling.capture import (
    BACKENDS,
    Capture,
    capture,
    default_trace_dir,
    device_time_us,
    sort_key,
    write_chrome_trace,
)
from k3lab.profiling.categories import CATEGORIES, categorize
from k3lab.profiling.diff import TraceDiff, capture_diff, short_name, trace_diff
from k3lab.profiling.export import (
    hta_kernel_breakdown,
    hta_status,
    hta_trace_diff,
    label,
    with_step_marks,
    write_hta_folder,
)
from k3lab.profiling.frame import (
    COLUMNS,
    KINDS,
    TABLE_COLUMNS,
    NoKernelsRecorded,
    category_table,
    counts,
    kernel_table,
)
from k3lab.profiling.ncu import DEFAULT_NCU_METRICS, ncu_command, ncu_metrics, parse_ncu_csv
from k3lab.profiling.read import FORMATS, detect_format, read_rocprofv3_dir, read_stats, read_trace
from k3lab.profiling.rocprofv3_run import (
    NOT_RUN_ON_AMD,
    capture_rocprofv3,
    rocprofv3_available,
    rocprofv3_command,
)
from k3lab.profiling.selfcheck import main as _selfcheck_main
from k3lab.profiling.selfcheck import selfcheck
from k3lab.profiling.torch_trace import kernels_from_trace

__all__ = [
    "BACKENDS", "CATEGORIES", "COLUMNS", "DEFAULT_NCU_METRICS", "FORMATS", "KINDS", "NOT_RUN_ON_AMD",
    "TABLE_COLUMNS", "Capture", "NoKernelsRecorded", "TraceDiff", "capture", "capture_diff",
    "capture_rocprofv3", "categorize", "hta_kernel_breakdown", "hta_status", "hta_trace_diff", "label",
    "with_step_marks",
    "write_hta_folder",
    "category_table", "counts", "default_trace_dir", "detect_format", "device_time_us",
    "kernel_table", "kernels_from_trace", "ncu_command", "ncu_metrics", "parse_ncu_csv",
    "read_rocprofv3_dir", "read_stats", "read_trace", "rocprofv3_available", "rocprofv3_command",
    "selfcheck", "short_name", "sort_key", "trace_diff", "write_chrome_trace",
]

if __name__ == "__main__":
    sys.exit(_selfcheck_main())
