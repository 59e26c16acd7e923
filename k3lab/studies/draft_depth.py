"""Study: how many tokens to draft (seed section 6), and how fast the simulator behind it runs.

The lesson lives in `k3lab.spec` (expected committed tokens, cycle costs, best depth); what this
study measures is the machinery that backs the formula up:

- `cycles_depth<k>` (k = 3, 4, 7): 10^6 draft-verify cycles on the reference acceptance curve.
  'before' = the plain loop over cycles and positions, 'after' = the vectorised numpy simulator;
  both read the same uniform draws, so their counts must be identical (checked first), and the
  mean must lie within 3 standard errors of the formula. Timed with k3lab.bench's CPU timer; numpy
  runs this on one core (each record carries the process CPU seconds per wall second of its timing
  run: at most 1.0 shows one core; well below 1.0 means other processes shared it, so re-run).
- `random_curves`: 20 random acceptance curves of depth 1..8, 10^5 cycles each: the largest
  |z| between simulator and formula (must be < 3) and the time of the whole sweep.
- `tokens_v8_depth4`: token-level rejection sampling over an 8-token vocabulary with random
  target and draft logits (each conditioned on the previous token): the chi-square p-value of the
  committed tokens against the target distribution and the |z| of the mean against the exact
  curve derived from the two distributions.

Everything here runs on the host CPU whatever the machine has; the model preset does not change
this study (it is accepted so every study has the same signature).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from k3lab import bench, spec

NAME = "draft_depth"

CYCLES = 1_000_000
DEPTHS = (3, 4, 7)
CURVE_DEPTH = 8
RANDOM_CURVES = 20
RANDOM_CYCLES = 100_000
TOKEN_VOCAB = 8
TOKEN_DEPTH = 4
TOKEN_CYCLES = 200_000
MAX_Z = 3.0
MIN_P_VALUE = 1e-3
_SEED = 20261201


def case_names(preset=None) -> list[str]:
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    return [f"cycles_depth{k}" for k in DEPTHS] + ["random_curves", f"tokens_v{TOKEN_VOCAB}_depth{TOKEN_DEPTH}"]


def _time_on_cpu(fn: Callable[[], object], repeats: int) -> tuple[bench.Timing, float]:
    """bench's CPU timer around fn, and the process CPU seconds per wall second over the whole
    timing run: about 1.0 when one core did the work (below 1 when other processes took the core)."""
    c0, w0 = time.process_time(), time.perf_counter()
    timing = bench.time_fn(fn, warmup=1, repeats=repeats, device="cpu")
    return timing, (time.process_time() - c0) / (time.perf_counter() - w0)


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
        timing, cpu_per_wall = _time_on_cpu(fn, repeats)
        out.append(bench.make_record(
            NAME, case, variant, timing, shape=shape, dtype="float64", error=error,
            cycles_per_s=CYCLES / (timing.median_us * 1e-6), cpu_per_wall=cpu_per_wall,
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
    timing, cpu_per_wall = _time_on_cpu(sweep, 5)
    error = {"max_abs_z": float(abs(zs[worst])), "z": [float(z) for z in zs], "curves": RANDOM_CURVES}
    return [bench.make_record(NAME, case, "after", timing,
                              shape={"curves": RANDOM_CURVES, "cycles_each": RANDOM_CYCLES,
                                     "depths": [k for _, k in curves]},
                              dtype="float64", error=error, cpu_per_wall=cpu_per_wall,
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
    timing, cpu_per_wall = _time_on_cpu(run_once, 5)
    error = {"chi_square": stat, "dof": dof, "p_value": pval, "z": z, "simulated": stats.mean,
             "formula": stats.expected, "acceptance": [float(x) for x in stats.acceptance]}
    return [bench.make_record(NAME, case, "after", timing,
                              shape={"cycles": TOKEN_CYCLES, "depth": TOKEN_DEPTH, "vocab": TOKEN_VOCAB},
                              dtype="float64", error=error, cpu_per_wall=cpu_per_wall,
                              runs_on="host CPU, numpy (single-threaded)")]


def run(preset=None, cases=None) -> list[bench.Record]:
    """Check each case (counts identical, |z| < 3, chi-square p > 1e-3; CheckFailed otherwise),
    then time it. Returns the records; saves nothing."""
    known = case_names(preset)
    cases = known if cases is None else list(cases)
    unknown = [c for c in cases if c not in known]
    if unknown:
        raise ValueError(f"cases must be among {known}; got unknown {unknown}")
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
