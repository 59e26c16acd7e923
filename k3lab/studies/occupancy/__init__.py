"""The seed's occupancy experiment: the same kernel binary launched with more shared memory (LDS)
reserved than it uses, so that fewer of its programs fit on one compute unit; does the time change?

Case `prologue_16k`: the KDA chunk prologue's main pass (`_a_kernel`) at 12 heads x 16K, the first
launch of the ISA report's case `kda_chunk.after_16k` (`k3lab.isa.cases`), compiled once by Triton's JIT
on this GPU. Each level relaunches that compiled binary with its dynamic shared-memory request raised
by a reserve (nothing reads it), the smallest that lets shared memory hold 1, 2, ... programs per unit,
up to what the kernel reaches unreserved (`reserve_levels`). Each level's outputs are first checked
bit-identical to the unreserved launch's on the same inputs (fresh random values in [-0.05, 0]), then
the launch is timed (`k3lab.bench.time_fn`, device events, eager): one record per level, variant
'after', case `<case>_<programs>_per_unit`.

On a machine without a GPU nothing is launched: `run` says so and prints the levels each target
(sm90, gfx950, gfx942) would take, from the committed ISA report's compile of the same launch
(`planned_levels`), and returns no records.

    k3lab bench occupancy [--json FILE]
"""

from .measure import case_names, CPU_NOTE, measure_case, profile_targets, run
from .tables import (blocks_by_shared, CASES, ISA_REPORT, level_case, levels_table, NAME, planned_levels,
    reserve_levels, summary_text)

__all__ = [
    "blocks_by_shared", "case_names", "CASES", "CPU_NOTE", "ISA_REPORT", "level_case", "levels_table",
    "measure_case", "NAME", "planned_levels", "profile_targets", "reserve_levels", "run", "summary_text"
]
