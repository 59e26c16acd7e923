"""The MoE output sharding study (notebook 02) in the study contract, so `k3lab bench moe_sharding`
runs it: the latent MoE tail replicated vs sharded and the routed experts' grouped kernels against the
per-expert loop, at TP8 shapes on a GPU (`measure` does the work; notebook 02's tables and figures are
in `figures`). GPU only: the timings are of compiled kernels."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from k3lab.studies import select_cases

from . import measure as bench_moe

NAME = bench_moe.STUDY


def case_names(preset=None) -> list[str]:
    return [f"tail_N{n}" for n in bench_moe.TAIL_TOKENS] + [f"experts_N{n}" for n in bench_moe.EXPERT_TOKENS]


def run(preset=None, cases=None) -> list:
    """Every case (cases: a subset of case_names()); checks each variant against the reference first."""
    if not torch.cuda.is_available():
        raise RuntimeError("moe_sharding times compiled kernels at TP8 shapes and needs a GPU; on a CPU "
                           "tests/test_moe_*.py and notebook 02 check the same code in Triton's interpreter")
    cases = select_cases(case_names(), cases or None)
    tail = tuple(int(c[6:]) for c in cases if c.startswith("tail_N"))
    experts = tuple(int(c[9:]) for c in cases if c.startswith("experts_N"))
    res = bench_moe.run(tail_tokens=tail, expert_tokens=experts)
    if res["memory"]:  # not records: up_proj's memory under each tail, printed for the run's README
        print("memory (one layer, rank 0):", json.dumps(res["memory"], indent=1))
    return res["records"]


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    return {}
