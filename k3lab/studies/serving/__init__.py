"""Study: the serving curve, tokens/s/GPU against tokens/s/user on one node of 8 GPUs (notebook 09).

Cases: 'grid' (GPU) measures the decode step over batch x context (`grid.measure_grid`); the model's
cases are added beside it.
"""

from __future__ import annotations

from . import grid

NAME = "serving"


def case_names(preset=None) -> list[str]:
    """'grid' (the step-time grid: a tiny one on a CPU)."""
    return ["grid"]


def run(preset=None, cases=None, *, repeats: int = 5) -> list:
    """The records of `cases` (see case_names)."""
    from k3lab.studies import select_cases

    out = []
    for case in select_cases(case_names(preset), cases):
        if case == "grid":
            out += grid.measure_grid(repeats=repeats)
    return out


def profile_targets(preset=None) -> dict:
    """Nothing to profile: the grid's steps are the decode_step study's (`k3lab profile decode_step`)."""
    return {}
