"""Timing, correctness checks, floors and result records: the measuring API of k3lab.

One place for each of these, used by the studies, notebooks, the CLI and the tests:

- `time_fn`      time GPU work with device events (eager or CUDA/HIP graph replay) or CPU work with
                 perf_counter; median with 20th/80th percentiles and the timer's own overhead.
- `check`        compare a result with its reference under a per-dtype relative error bound
                 (`TOLERANCES`); NaN and Inf never pass. `check_all` does several outputs at once.
- `floor_us`     the time the hardware cannot beat: bytes over bandwidth, flops over matrix rate,
                 launches over launch cost (measured here once per process on a GPU).
- `Record`       one measured (study, case, variant); `save_records` / `load_records` keep them as JSON
                 under profiles/<device>/<study>/, `compare` lines before, after, peer and floor up.

Checking a result is part of measuring it (a study checks each variant before it times it), so the
measuring API names `check`, its bounds and `capture_graph` too; they live in `k3lab.runtime`, which the
engine, parallel/ and the workshop import instead of this package (they check and capture while
they run, but measure nothing). bench imports runtime, never the other way.

No dependency on triton.testing (its do_bench needs a GPU driver and hides its choices); plotly is
never imported here.

Modules: `timing`, `floors`, `records`; every public name is importable from here
(`from k3lab import bench; bench.time_fn`).
"""

from k3lab.bench.floors import floor_breakdown, floor_us, launch_cost_us
from k3lab.bench.records import (
    PEERS,
    PROFILES,
    VARIANTS,
    Record,
    compare,
    device_slug,
    git_commit,
    load_records,
    make_record,
    provenance,
    records_frame,
    save_records,
    validate_variant,
)
from k3lab.bench.timing import (
    AUTO_SAMPLE_US,
    MAX_CALLS_PER_SAMPLE,
    Timing,
    rotation_count,
    rotation_sets,
    time_fn,
)
from k3lab.runtime import TOLERANCES, CheckFailed, Tolerance, capture_graph, check, check_all, tolerance_for

__all__ = [
    "AUTO_SAMPLE_US",
    "MAX_CALLS_PER_SAMPLE",
    "PEERS",
    "PROFILES",
    "TOLERANCES",
    "VARIANTS",
    "CheckFailed",
    "Record",
    "Timing",
    "Tolerance",
    "capture_graph",
    "check",
    "check_all",
    "compare",
    "device_slug",
    "floor_breakdown",
    "floor_us",
    "git_commit",
    "provenance",
    "launch_cost_us",
    "load_records",
    "make_record",
    "records_frame",
    "rotation_count",
    "rotation_sets",
    "save_records",
    "time_fn",
    "tolerance_for",
    "validate_variant",
]
