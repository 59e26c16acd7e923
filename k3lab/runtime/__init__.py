"""What the running library itself needs at run time, apart from measuring: checking a result against
its reference under a per-dtype error bound, and capturing work as a CUDA/HIP graph.

- `check`          compare a result with its fp32/fp64 reference under the dtype's relative error bound
                   (`TOLERANCES`, `tolerance_for`); NaN and Inf never pass (`CheckFailed`). `check_all`
                   does several outputs at once.
- `capture_graph`  capture successive calls of a function into a CUDA/HIP graph to replay.
- `args`           the one rule for integer arguments (`int_arg`, `int_list`; k3lab.ops re-exports them).

Why a room of its own: the engine (a captured decode step), parallel/ (a rank's result against the
single-rank layer) and the workshop's graders use these while they run, and none of them
measures. Keeping them out of `k3lab.bench` (timing, floors, records) lets those rooms import no
measuring code; bench imports from here, never the other way. A package rather than one module
because the two halves share nothing (checks need only torch tensors, graphs a GPU stream) and
`k3lab.runtime.checks` is the name the workshop's docs point learners to for the bounds.

Imports only torch and the standard library, so every room may import it.
"""

from k3lab.runtime.checks import TOLERANCES, CheckFailed, Tolerance, check, check_all, tolerance_for
from k3lab.runtime.graphs import capture_calls, capture_graph, indexed_call

__all__ = [
    "TOLERANCES",
    "CheckFailed",
    "Tolerance",
    "capture_calls",
    "capture_graph",
    "check",
    "check_all",
    "indexed_call",
    "tolerance_for",
]
