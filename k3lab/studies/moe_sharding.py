"""The MoE output sharding study (notebook 02) in the study contract, so `k3lab bench moe_sharding`
runs it: the latent MoE tail replicated vs sharded and the routed experts' grouped kernels against the
per-expert loop, at TP8 shapes on a GPU (k3lab.parallel.bench_moe does the work; notebook 02's tables
and figures are in k3lab.parallel.moe_figures). GPU only: the timings are of compiled kernels."""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3lab.parallel import bench_moe
from k3lab.studies import select_cases

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
    return bench_moe.run(tail_tokens=tail, expert_tokens=experts)["records"]


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    return {}
