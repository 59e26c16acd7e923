"""Notebook 09's task: predict where the serving curve bends (k3lab.serving.curve.knee)."""

from __future__ import annotations

import numpy as np

from ._core import EXACT, Case, Task


def _fronts(seed: int, device) -> list[Case]:
    """Fronts of a step that costs `fixed + per_seq x C` (us) at concurrency C: per user 1 / step, per
    GPU C / step; fresh random costs and concurrency grids, one with a flat tail, one that never bends."""
    rng = np.random.default_rng(seed)
    out = []
    for label, fixed, per_seq, n in (("launch-bound step", 15_000.0, 300.0, 10),
                                     ("bytes-bound step", 4_000.0, 2_500.0, 8),
                                     ("random step", float(rng.uniform(2e3, 3e4)),
                                      float(rng.uniform(50, 4e3)), 12),
                                     ("never bends on this grid", 50_000.0, 10.0, 6)):
        conc = np.unique(np.round(np.geomspace(1, 256, n) * rng.uniform(0.9, 1.1, n)).astype(int))
        step = fixed + per_seq * conc
        out.append(Case(label, {"concurrency": conc.tolist(), "per_user": (1e6 / step).tolist(),
                                "per_gpu": (conc * 1e6 / step / 8).tolist()}, EXACT))
    return out


def _reference(case: Case) -> int:
    from k3lab.serving.curve import knee

    return knee(**case.inputs)


def bend_solution(concurrency, per_user, per_gpu):
    """The first concurrency whose next step gains less per GPU (relative) than it costs per user."""
    for i in range(len(concurrency) - 1):
        gain = per_gpu[i + 1] / per_gpu[i] - 1
        loss = 1 - per_user[i + 1] / per_user[i]
        if gain < loss:
            return int(concurrency[i])
    return int(concurrency[-1])


STUB = '''\
def bend(concurrency, per_user, per_gpu):
    """A serving front in rising concurrency: tokens/s/user and tokens/s/GPU at each concurrency. Return
    the concurrency where the curve bends: the first point from which one more step of concurrency
    gains less tokens/s/GPU (relative) than it costs each user (relative); the last concurrency if
    every step still pays."""
    # TODO: walk the steps; compare per_gpu[i + 1] / per_gpu[i] - 1 with 1 - per_user[i + 1] / per_user[i]
    raise NotImplementedError("find the bend")
'''

BEND = Task(
    name="curve_bend", notebook="09_serving_curve", minutes=10,
    statement="""\
**Task: where the curve bends.** Adding users to a batch raises tokens/s/GPU while the step is mostly
fixed cost (launches, the weights every token shares) and lowers each user's rate once the per-sequence
bytes take over. Write `bend(concurrency, per_user, per_gpu)` returning the first concurrency from which
the next step gains less tokens/s/GPU, relatively, than it costs each user in tokens/s/user; the last
concurrency when every step still pays. `check` compares with `k3lab.serving.curve.knee` on fronts of
steps that cost `fixed + per_sequence x concurrency`.""",
    signature="bend(concurrency: list[int], per_user: list[float], per_gpu: list[float]) -> int",
    outputs=("concurrency",), cases=_fronts, reference=_reference, solution=bend_solution, stub=STUB,
    forbidden=("k3lab.serving.curve.knee",),
    hints=(
        "Walk the front from low to high concurrency and ask, at each step to the next point: what does "
        "the GPU gain, and what does each user lose?",
        "Compare relative changes: the GPU's gain per_gpu[i + 1] / per_gpu[i] - 1 against each user's loss "
        "1 - per_user[i + 1] / per_user[i]. The bend is the first concurrency whose next step gains less "
        "than it loses; when every step pays, it is the last concurrency.",
        "`for i in range(len(concurrency) - 1):` compute gain and loss as above and "
        "`return int(concurrency[i])` when `gain < loss`; after the loop `return int(concurrency[-1])`.",
    ))
