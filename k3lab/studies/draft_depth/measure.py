"""Checks and timings of the draft_depth study (the package docstring says what it measures): its cases,
each variant checked against the formula before it is timed into records.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from k3lab import bench
from k3lab import speculative as spec
from k3lab.studies import select_cases

from .tables import MAX_Z

NAME = "draft_depth"

CYCLES = 1_000_000
DEPTHS = (3, 4, 7)
CURVE_DEPTH = 8
RANDOM_CURVES = 20
RANDOM_CYCLES = 100_000
TOKEN_VOCAB = 8
TOKEN_DEPTH = 4
TOKEN_CYCLES = 200_000
MIN_P_VALUE = 1e-3
_SEED = 20261201


def case_names(preset=None) -> list[str]:
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    return [f"cycles_depth{k}" for k in DEPTHS] + ["random_curves",
                                                   f"tokens_v{TOKEN_VOCAB}_depth{TOKEN_DEPTH}"]


def _time_on_cpu(fn: Callable[[], object], repeats: int) -> tuple[bench.Timing, dict]:
    """bench's CPU timer around fn, plus two figures from the process CPU clock over the whole
    timing run: cpu_per_wall (CPU seconds per wall second: about 1.0 when one core did the work,
    well below 1.0 when other processes shared the core, which inflates the wall-clock figures) and
    cpu_us_per_call (mean CPU time of one call, which such sharing does not inflate)."""
    warmup = 1
    c0, w0 = time.process_time(), time.perf_counter()
    timing = bench.time_fn(fn, warmup=warmup, repeats=repeats, device="cpu")
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    calls = warmup + timing.repeats
    return timing, {"cpu_per_wall": cpu / wall, "cpu_us_per_call": cpu / calls * 1e6}


def _cycles_case(case: str, depth: int) -> list[bench.Record]:
    curve = spec.reference_acceptance(CURVE_DEPTH)
    expected = spec.expected_committed(curve, depth)
    fast = spec.simulate_cycles(curve, depth, CYCLES, seed=_SEED)
    slow = spec.simulate_cycles_loop(curve, depth, CYCLES, seed=_SEED)
    if not np.array_equal(fast.counts, slow.counts):
        raise bench.CheckFailed(f"{case}: the vectorised and loop simulators counted different cycles: "
                                f"{fast.counts.tolist()} vs {slow.counts.tolist()}")
    z = fast.z_score(expected)
    if not abs(z) < MAX_Z:
        raise bench.CheckFailed(f"{case}: simulated {fast.mean:.5f} +- {fast.stderr:.5f} committed tokens, "
                                f"formula {expected:.5f}: {z:+.2f} standard errors")
    error = {"formula": expected, "simulated": fast.mean, "stderr": fast.stderr, "z": z,
             "counts_identical": True}
    shape = {"cycles": CYCLES, "depth": depth, "curve": "reference (geometric fit to 3.00 / 3.36)"}
    out = []
    for variant, fn, repeats in (("before", lambda: spec.simulate_cycles_loop(curve, depth, CYCLES), 2),
                                 ("after", lambda: spec.simulate_cycles(curve, depth, CYCLES), 20)):
        timing, cpu = _time_on_cpu(fn, repeats)
        out.append(bench.make_record(
            NAME, case, variant, timing, shape=shape, dtype="float64", error=error,
            cycles_per_s=CYCLES / (timing.median_us * 1e-6), **cpu,
            runs_on="host CPU, numpy (single-threaded)",
            implementation="python loop over cycles" if variant == "before" else "numpy, 64K-cycle chunks",
            floor_note="no hardware floor: a host-side simulation"))
    return out


def _random_curves() -> list[tuple[np.ndarray, int]]:
    rng = np.random.default_rng(_SEED)
    curves = []
    for _ in range(RANDOM_CURVES):
        depth = int(rng.integers(1, CURVE_DEPTH + 1))
        curves.append((rng.uniform(0.0, 1.0, size=depth), depth))
    return curves


def _random_curves_case(case: str) -> list[bench.Record]:
    curves = _random_curves()

    def sweep():
        return [spec.simulate_cycles(a, k, RANDOM_CYCLES, seed=_SEED + i) for i, (a, k) in enumerate(curves)]

    zs = [s.z_score(spec.expected_committed(a, k)) for s, (a, k) in zip(sweep(), curves)]
    worst = int(np.argmax(np.abs(zs)))
    if not abs(zs[worst]) < MAX_Z:
        a, k = curves[worst]
        raise bench.CheckFailed(f"{case}: curve {np.round(a, 3).tolist()} (depth {k}) is {zs[worst]:+.2f} "
                                f"standard errors from the formula")
    timing, cpu = _time_on_cpu(sweep, 5)
    error = {"max_abs_z": float(abs(zs[worst])), "z": [float(z) for z in zs], "curves": RANDOM_CURVES}
    return [bench.make_record(NAME, case, "after", timing,
                              shape={"curves": RANDOM_CURVES, "cycles_each": RANDOM_CYCLES,
                                     "depths": [k for _, k in curves]},
                              dtype="float64", error=error, **cpu,
                              runs_on="host CPU, numpy (single-threaded)")]


def token_logits(vocab: int = TOKEN_VOCAB, spread: float = 0.8, seed: int = _SEED):
    """Random target logits [V, V] (row = previous token) and draft logits = target + noise."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(vocab, vocab))
    return target, target + spread * rng.normal(size=(vocab, vocab))


def _tokens_case(case: str) -> list[bench.Record]:
    target, draft = token_logits()

    def run_once():
        return spec.simulate_tokens(target, draft, TOKEN_DEPTH, TOKEN_CYCLES, seed=_SEED)

    stats = run_once()
    stat, dof, pval = stats.chi_square()
    z = stats.z_score(stats.expected)
    if not (pval > MIN_P_VALUE and abs(z) < MAX_Z):
        raise bench.CheckFailed(f"{case}: committed tokens vs target: chi-square {stat:.1f} on {dof} dof "
                                f"(p = {pval:.2e}); mean {stats.mean:.4f} vs exact {stats.expected:.4f} "
                                f"({z:+.2f} standard errors)")
    timing, cpu = _time_on_cpu(run_once, 5)
    error = {"chi_square": stat, "dof": dof, "p_value": pval, "z": z, "simulated": stats.mean,
             "formula": stats.expected, "acceptance": [float(x) for x in stats.acceptance]}
    return [bench.make_record(NAME, case, "after", timing,
                              shape={"cycles": TOKEN_CYCLES, "depth": TOKEN_DEPTH, "vocab": TOKEN_VOCAB},
                              dtype="float64", error=error, **cpu,
                              runs_on="host CPU, numpy (single-threaded)")]


def run(preset=None, cases=None) -> list[bench.Record]:
    """Check each case (counts identical, |z| < 3, chi-square p > 1e-3; CheckFailed otherwise),
    then time it. Returns the records; saves nothing."""
    cases = select_cases(case_names(preset), cases)
    records: list[bench.Record] = []
    for case in cases:
        if case.startswith("cycles_depth"):
            records += _cycles_case(case, int(case.removeprefix("cycles_depth")))
        elif case == "random_curves":
            records += _random_curves_case(case)
        else:
            records += _tokens_case(case)
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """One simulator step per variant: 10^6 cycles at depth 4 on the reference curve."""
    case_names(preset)
    curve = spec.reference_acceptance(CURVE_DEPTH)
    return {"before": lambda: spec.simulate_cycles_loop(curve, 4, CYCLES),
            "after": lambda: spec.simulate_cycles(curve, 4, CYCLES)}


# --------------------------------------------------------------------------------------------
# Figures and the explorer for notebook 06 (plotly and ipywidgets are imported only here)
# --------------------------------------------------------------------------------------------


