"""Checks and timings of the agent_cache study (the package docstring says what it measures): its cases
(the simulator's replays, the host<->device copies and one request's state through `h2d`) and the
study contract.
"""

from __future__ import annotations

import time
from collections.abc import Callable


from k3lab import bench
from k3lab.cache import generate as gen
from k3lab.cache import sim
from k3lab.cache.traces import Workload
from k3lab.studies import select_cases

from .tables import HOUR, NAME, hbm_budget_gb, workload

H2D_CASES = ("copies", "state")  # the host <-> device cases (`h2d`)


# ------------------------------------------------------------------ study interface
def case_names(preset=None) -> list[str]:
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    return ["sim_small", "sim_hour", *H2D_CASES]


def _sim_record(case: str, w: Workload, cc: sim.CacheConfig, repeats: int) -> bench.Record:
    result = sim.simulate(w, cc)
    c0, w0 = time.process_time(), time.perf_counter()
    timing = bench.time_fn(lambda: sim.simulate(w, cc), warmup=0, repeats=repeats, calls_per_sample=1,
                           device="cpu")
    cpu_per_wall = (time.process_time() - c0) / (time.perf_counter() - w0)
    return bench.make_record(
        NAME, case, "after", timing, shape={"requests": len(w), "blocks": w.n_blocks,
                                            "block_refs": int(w.n_full.sum()), "hbm_gb": cc.hbm_bytes / 1e9},
        dtype="int64", error={"token_hit_rate": result.token_hit_rate}, cpu_per_wall=cpu_per_wall,
        runs_on="host CPU, numpy (single-threaded)", floor_note="no hardware floor: a host-side simulation")


def run(preset=None, cases=None) -> list[bench.Record]:
    """Each case checked (the simulator: with an unbounded HBM the hit rate is the workload's theoretical
    reuse less at most one checkpoint interval per request; copies and state: `h2d`, whose summary is
    printed), then timed."""
    from . import h2d

    cases = select_cases(case_names(preset), cases)
    records: list[bench.Record] = []
    parts = [c for c in cases if c in H2D_CASES]
    if parts:
        result = h2d.run(parts=parts)
        h2d.print_summary(result)
        by_part = {p: [r for r in result["records"] if (r.case.startswith("state_") == (p == "state"))]
                   for p in parts}
    for case in cases:
        if case.startswith("sim_"):
            w = workload() if case == "sim_small" else gen.generate(HOUR["sessions"], seed=HOUR["seed"])
            cc = sim.CacheConfig.for_k3(1e9)
            got, want = sim.simulate(w, cc).token_hit_rate, w.theoretical_reuse()
            loss = cc.checkpoint_interval * len(w) / int(w.in_tokens.sum())  # < one interval per request
            if not want - loss <= got <= want:
                raise bench.CheckFailed(f"{case}: unbounded hit rate {got:.4f}, theoretical reuse {want:.4f} "
                                        f"(the grid may lose up to {loss:.4f})")
            records.append(_sim_record(case, w, cc, 5 if case == "sim_small" else 1))
        else:
            records += by_part[case]
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """One replay of the notebook's workload under an 80 GB budget (eviction included)."""
    case_names(preset)
    w = workload()
    cc = sim.CacheConfig.for_k3(hbm_budget_gb())
    return {"after": lambda: sim.simulate(w, cc)}


def replay_hour(sessions: int = HOUR["sessions"], seed: int = HOUR["seed"],
                configs: dict | None = None) -> list[dict]:
    """Replay a one-hour AgentX-like workload (`generate(sessions, seed=seed)`: 2,600 sessions give
    about 1.3e5 requests and 1e7 distinct blocks) under each CacheConfig of `configs` (name -> config;
    default: an unbounded HBM, and 100 GB of HBM with the AMD recipe's 224.875 GB host tier). One row
    per config: requests, distinct blocks, block references, wall and process CPU seconds, hit rate."""
    w = gen.generate(sessions, seed=seed)
    configs = configs or {"unbounded": sim.CacheConfig.for_k3(1e9),
                          "hbm100_host224.875": sim.CacheConfig.for_k3(100, host_gb=224.875)}
    rows = []
    for name, cc in configs.items():
        c0, t0 = time.process_time(), time.perf_counter()
        r = sim.simulate(w, cc)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rows.append(
            {
                "config": name,
                "requests": len(w),
                "blocks": w.n_blocks,
                "block_refs": int(w.n_full.sum()),
                "seconds": wall,
                "cpu_seconds": cpu,
                "token_hit_rate": r.token_hit_rate,
                "evictions": r.evictions,
            }
        )
    return rows


