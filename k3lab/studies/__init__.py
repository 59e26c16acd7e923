"""Study modules: one per notebook topic, so a notebook, the CLI and the tests run the same code.

Each study module exposes NAME, case_names(preset=None), run(preset=None, cases=None) -> list[Record]
(checks every variant against the reference first, then times) and profile_targets(preset=None).
`STUDIES` maps each name to its module, in notebook order; `ABOUT` says in one line what each measures;
`load_study(name)` imports one only when asked, so a study that is slow to import (Triton kernels, fla)
costs nothing to the others. `GPU_ONLY` studies need a GPU to run at all; `HOST_SIDE` studies time host
code, so their CPU timings mean what they say; `CPU_CASES` is what the report checks on a CPU.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

STUDIES: dict[str, str] = {
    "launch_overhead": "k3lab.studies.launch_overhead",
    "copy_removal": "k3lab.studies.copy_removal",
    "kda_decode": "k3lab.studies.kda_decode_bench",
    "mla_padding": "k3lab.studies.mla_padding",
    "kda_scan": "k3lab.studies.kda_scan",
    "kda_verify": "k3lab.studies.kda_verify",
    "kda_precision": "k3lab.studies.kda_precision",
    "draft_depth": "k3lab.studies.draft_depth",
    "decode_step": "k3lab.studies.decode_step",
    "agent_cache": "k3lab.studies.agent_cache",
    "dcp": "k3lab.studies.dcp",
    "moe_sharding": "k3lab.studies.moe_sharding",
}
ALIASES: dict[str, str] = {"kda_decode_bench": "kda_decode"}

ABOUT: dict[str, str] = {
    "launch_overhead": "what a launch costs: tiny copies and empty kernels, eager against graph replay",
    "copy_removal": "AttnRes + RMSNorm fused, and packing only where the kernel reads it (notebook 03)",
    "kda_decode": "the KDA decode step in one launch against the five-launch chain and fla (notebook 03)",
    "mla_padding": "MLA decode: 12 heads padded to 16, history split across the GPU (notebook 04)",
    "kda_scan": "KDA chunked prefill: chunk summaries scanned, then replayed in parallel (notebook 05)",
    "kda_verify": "KDA verification of a few positions with narrow value tiles (notebook 05)",
    "kda_precision": "the chunk inverse's error with fp32 against bf16 inputs (notebook 05)",
    "draft_depth": "speculative decoding: committed tokens per cycle, simulated and by formula (notebook 06)",
    "decode_step": "one TP8 rank's whole decode step, each optimization switched off alone (notebook 08)",
    "agent_cache": "cache reuse across agent turns: a prefix-cache simulator over AgentX-like traces, host<->device "
                   "copies (notebook 07)",
    "dcp": "decode context parallelism on one GPU: local attention at TP8 / DCP8 shapes, the merge (notebook 01)",
    "moe_sharding": "the MoE tail replicated vs sharded, the routed experts' grouped kernels (notebook 02)",
}
GPU_ONLY = frozenset({"kda_decode", "dcp", "moe_sharding"})
# What `k3lab report` checks on a CPU, where Triton runs in its interpreter: the smallest cases that
# still run every kernel of the study (the notebooks check the rest); None runs every case.
CPU_CASES: dict[str, list[str] | None] = {
    "launch_overhead": None,
    "copy_removal": ["attn_res_t1_s2"],
    "mla_padding": ["ctx96", "b3_ctx96"],
    "kda_scan": ["h1_ragged"],
    "kda_verify": ["b1_t4"],
    "kda_precision": ["k3_gate"],
    "draft_depth": ["cycles_depth4", "tokens_v8_depth4"],
    "decode_step": ["tiny_b1_ctx8"],
    "agent_cache": ["sim_small"],
}
HOST_SIDE = frozenset({"draft_depth", "agent_cache"})

_REQUIRED = ("NAME", "case_names", "run", "profile_targets")


class StudyNotAvailable(ImportError):
    """A registered study whose module is not in this tree (not written yet)."""


def canonical(name: str) -> str:
    """The registered name for `name` (an alias such as kda_decode_bench gives kda_decode).
    ValueError naming the known studies for anything else."""
    name = ALIASES.get(name, name)
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; known studies: {', '.join(STUDIES)}")
    return name


def load_study(name: str) -> ModuleType:
    """Import and return the study module `name` (a key of STUDIES or an alias).

    ValueError for a name not in STUDIES; StudyNotAvailable (an ImportError) when the module does not
    exist yet; ImportError from the module itself is left as is (a real bug, not an absence)."""
    path = STUDIES[canonical(name)]
    if importlib.util.find_spec(path) is None:
        raise StudyNotAvailable(f"study {name!r} is registered but its module {path} does not exist yet")
    module = importlib.import_module(path)
    missing = [attr for attr in _REQUIRED if not hasattr(module, attr)]
    if missing:
        raise StudyNotAvailable(f"study module {path} lacks {', '.join(missing)} (the study contract: "
                                f"{', '.join(_REQUIRED)})")
    return module


def available() -> list[str]:
    """Registered studies whose modules exist in this tree."""
    return [n for n, p in STUDIES.items() if importlib.util.find_spec(p) is not None]


def select_cases(known: list[str], cases=None) -> list[str]:
    """The cases a study's run() takes: all of `known` when `cases` is None, else `cases` in the given
    order; ValueError naming the unknown ones (before anything runs)."""
    chosen = list(known) if cases is None else list(cases)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        raise ValueError(f"cases must be among {list(known)}, got unknown {unknown}")
    return chosen
