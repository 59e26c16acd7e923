"""Study packages: one per notebook topic, so a notebook, the CLI and the tests run the same code.

Every study is a package of one shape:
- `<study>/__init__.py`: the docstring (what the study measures, its variants and cases) and the names
  the notebooks, the CLI and the report read, imported from the parts below (`__all__` lists them);
  it computes nothing itself.
- `<study>/measure.py`: the cases, their inputs, each variant checked against the reference and then
  timed into `bench.Record`s, and the study contract below (run, case_names, profile_targets).
- `<study>/tables.py`: records (fresh or committed under profiles/) to tables, figures and the text
  `k3lab bench` prints, and the models predicted before measuring; it runs nothing on a device.
  measure.py and tables.py import each other in one direction only, and the names both need (NAME,
  shared constants) live in the one imported.
- further modules where a study has a part of its own (decode_step/attribution.py, agent_cache/h2d.py).
`k3lab.studies.peers` says whether each public peer (fla, FlashMLA, AITER) runs here, and
`k3lab.studies.runs` where each part has run, from the committed records.

`PROBES` are studies of the device itself rather than of an optimization (the ceilings a roofline is
drawn under): the same package shape and contract, run by their own command (`python -m
k3lab.studies.<name> --save`) where a device has no records of them yet, not by `k3lab report` (no
notebook topic, no entry in k3lab.optimizations, no quick form in the report's time budget).

Each study module exposes NAME, case_names(preset=None), run(preset=None, cases=None) -> list[Record]
(checks every variant against the reference first, then times) and profile_targets(preset=None); it
may expose summary_text(records) -> str, which `k3lab bench` prints after its common table.
`STUDIES` maps each name to its module, in notebook order; `ABOUT` says in one line what each measures;
`load_study(name)` imports one only when asked, so a study that is slow to import (Triton kernels, fla)
costs nothing to the others. `GPU_ONLY` studies need a GPU to run at all; `HOST_SIDE` studies time host
code, so their CPU timings mean what they say.

What `k3lab report` runs of each study (`report_form`): by default a quick form, on a CPU `CPU_CASES`
(with `CPU_KWARGS`) and on a GPU `GPU_QUICK`; with `--full`, every case. The quick forms still check
every variant of the study against its reference at least once, and time the cases the notebooks and
the report's first page show; the rest (sweeps, the grid of shapes) is left to `--full`, and the page
shows the committed records for it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from types import ModuleType

STUDIES: dict[str, str] = {
    "launch_overhead": "k3lab.studies.launch_overhead",
    "copy_removal": "k3lab.studies.copy_removal",
    "kda_decode": "k3lab.studies.kda_decode",
    "mla_padding": "k3lab.studies.mla_padding",
    "kda_scan": "k3lab.studies.kda_scan",
    "kda_verify": "k3lab.studies.kda_verify",
    "kda_precision": "k3lab.studies.kda_precision",
    "occupancy": "k3lab.studies.occupancy",
    "draft_depth": "k3lab.studies.draft_depth",
    "decode_step": "k3lab.studies.decode_step",
    "agent_cache": "k3lab.studies.agent_cache",
    "dcp": "k3lab.studies.dcp",
    "moe_sharding": "k3lab.studies.moe_sharding",
    "serving": "k3lab.studies.serving",
    "serving_run": "k3lab.studies.serving_run",
}

ABOUT: dict[str, str] = {
    "launch_overhead": "what a launch costs: tiny copies and empty kernels, eager against graph replay",
    "copy_removal": "AttnRes + RMSNorm fused, and packing only where the kernel reads it (notebook 03)",
    "kda_decode": "the KDA decode step in one launch against the five-launch chain and fla (notebook 03)",
    "mla_padding": "MLA decode: 12 heads padded to 16, history split across the GPU (notebook 04)",
    "kda_scan": "KDA chunked prefill: chunk summaries scanned, then replayed in parallel (notebook 05)",
    "kda_verify": "KDA verification of a few positions with narrow value tiles (notebook 05)",
    "kda_precision": "the chunk inverse's error with fp32 against bf16 inputs (notebook 05)",
    "occupancy": "the KDA prologue's binary relaunched with shared memory reserved, fewer programs per unit "
                 "each level (notebook 05b)",
    "draft_depth": "speculative decoding: committed tokens per cycle, simulated and by formula (notebook 06)",
    "decode_step": "one TP8 rank's whole decode step, each optimization switched off alone (notebook 08)",
    "agent_cache": "cache reuse across agent turns: a prefix-cache simulator over AgentX-like traces, "
                   "host<->device copies (notebook 07)",
    "dcp": "decode context parallelism on one GPU: local attention at TP8 / DCP8 shapes, the merge (notebook "
           "01)",
    "moe_sharding": "the MoE tail replicated vs sharded, the routed experts' grouped kernels (notebook 02)",
    "serving": "tokens/s/GPU against tokens/s/user on 8 GPUs from the fitted decode step (notebook 09)",
    "serving_run": "a measured serving run: requests timed (TTFT, TPOT, ITL) under continuous batching and "
                   "chunked prefill, the prefix cache in a rank's memory, per concurrency (notebook 09)",
}
GPU_ONLY = frozenset({"kda_decode", "dcp", "moe_sharding"})
PROBES: dict[str, str] = {"ceilings": "k3lab.studies.ceilings"}
# What `k3lab report` checks on a CPU, where Triton runs in its interpreter: the smallest cases that
# still run every kernel of the study (the notebooks check the rest); None runs every case.
CPU_CASES: dict[str, list[str] | None] = {
    "launch_overhead": None,
    "copy_removal": ["attn_res_t1_s2"],
    "mla_padding": ["ctx96", "b3_ctx96"],
    "kda_scan": ["h1_ragged"],
    "kda_verify": ["b1_t4"],
    "kda_precision": ["k3_gate"],
    "occupancy": None,  # nothing launched on a CPU: the levels each target would take, from the ISA report
    "draft_depth": ["cycles_depth4", "tokens_v8_depth4"],
    "decode_step": ["tiny_b1_ctx8"],
    "agent_cache": ["sim_small"],
    "serving": ["validation", "curve_mi355x"],
    "serving_run": None,  # its CPU cases: the tiny preset, eight requests a run, seconds in all
}
# run() keywords of the CPU form: there a timing in the interpreter says nothing, so one sample will do
# and no profiler pass (the whole-step variants take seconds each in the interpreter)
CPU_KWARGS: dict[str, dict] = {
    "mla_padding": {"repeats": 1},
    "kda_scan": {"repeats": 1},
    "kda_verify": {"repeats": 1},
    "decode_step": {"repeats": 1, "profile": False},
}


@dataclass(frozen=True)
class QuickForm:
    """One study's quick form on a GPU: `cases` (None: every case) and `kwargs` for its run(), and
    `budget_s`, the seconds it may take on the reference GPU with the kernels already built (the
    report's ETA starts from it and the progress line says when a study overran it); `why` says what it
    keeps."""

    cases: tuple[str, ...] | None
    budget_s: float
    why: str
    kwargs: dict = field(default_factory=dict)


# `k3lab report` on a GPU by default: the quick forms' budgets, the kernel builds and the notebooks must
# add up to a report within 10 minutes on a fresh machine (tests/test_report_forms.py adds them up from
# these budgets and report.eta's table). Each budget is the seconds the reference GPU's run took, rounded
# up, once the .cu kernels are built (the report builds them first, in parallel): the run is
# profiles/nvidia-h200/gpu_check/report_timings_*.json, and report.eta's table holds both forms' seconds.
GPU_QUICK: dict[str, QuickForm] = {
    "launch_overhead": QuickForm(
        None, 10, "every case: a few hundred microsecond copies and launches per size, seconds in all"),
    "copy_removal": QuickForm(
        ("attn_res_t1_s5", "attn_res_t1_s9", "attn_res_t8192_s9", "packing"), 85,
        "AttnRes + RMSNorm at the first page's shapes (1 and 8192 tokens, 9 sources) and at the 5 sources "
        "notebook 08's per-op arithmetic reads; packing (its pack/where-used check at full depth). The fused "
        "KDA decode cases are the kda_decode study's (the same code and batches); the rest of the shape "
        "grid is --full's"),
    "kda_decode": QuickForm(
        ("B1_H12", "B128_H12"), 40,
        "B = 1 (the first page) and B = 128 (notebook 03's live pair); both state layouts checked"),
    "mla_padding": QuickForm(
        ("ctx32k", "b64_8k", "ragged8_8k", "verify4_32k", "ctx32k.triton"), 30,
        "the first page's 32K and B = 64 / 8K, and one case of each path those leave out: ragged lengths, "
        "a verification group, the Triton kernel where the default is the CUDA one; the other contexts, "
        "the split-count sweep and the other backend points are --full's (notebook 04 runs its own main "
        "cases and sweep)"),
    "kda_scan": QuickForm(
        ("h12_b1_t16384",), 75,
        "12 heads x 16K, the first page's and notebook 05's case: before, after (the group scan) and fla "
        "checked in fp64 and timed; the B = 8, 64K and 96-head grid is --full's"),
    "kda_verify": QuickForm(
        ("b1_t4", "b1_t4.final_only", "b1_t4.narrow_only", "b1_t4.narrow_1wave", "b1_t4.ragged"), 5,
        "B = 1, 4 positions (the first page and notebook 05) with every ablation's kernel path; the "
        "batch and tile sweeps are --full's"),
    "kda_precision": QuickForm(
        ("k3_gate",), 5,
        "K3's gates, fp32 against bf16 inverses: a host-side emulation, the same as on a CPU (notebooks "
        "05 and 05b run every case themselves)"),
    "occupancy": QuickForm(
        None, 15,
        "its one case: the KDA prologue's main pass compiled once, each level checked bit-identical and "
        "timed (50 launches of a few hundred microseconds each)"),
    "draft_depth": QuickForm(
        ("cycles_depth4", "tokens_v8_depth4"), 10,
        "depth 4 (the seed's pick) and the token-level check, host-side as on a CPU; the depth 3 and 7 "
        "loops and the random curves (which notebook 06 runs itself) are --full's"),
    "decode_step": QuickForm(
        ("b1_1k",), 50,
        "B = 1, 1K: all on, all off and each switch off alone, checked and timed eager and as one graph "
        "(3 samples, no profiler pass); 32K, 128K and B = 64 / 8K (whose eager all-off step alone takes "
        "13 s) are --full's, and notebook 08 and the first page show their committed records; the "
        "default-projections and article-precision variants too (variants='waterfall')",
        {"repeats": 3, "profile": False, "variants": "waterfall"}),
    "agent_cache": QuickForm(
        ("sim_small", "copies", "state"), 10,
        "the host<->device copies and the state save / restore the first page shows, and the small "
        "simulation; the hour-long simulated workload is --full's"),
    "dcp": QuickForm(None, 15, "its one case: local attention at TP8 / DCP8 shapes and the merge"),
    "moe_sharding": QuickForm(
        ("tail_N8", "experts_N64"), 40,
        "the first page's two cases: the MoE tail at 8 tokens, the routed experts at 64"),
    "serving": QuickForm(
        ("validation",), 2,
        "the step model's held-out points from committed records (host-side arithmetic); the curves are "
        "notebook 09's, the measured grid (7 minutes) --full's"),
    # the budget is a cap (the study starts no run past kwargs' budget_s, the first aside); the brief form
    # took 52 s of the report on an H100 (profiles/nvidia-h100-80gb-hbm3/gpu_check/report_timings_*.json)
    "serving_run": QuickForm(
        ("c1.dcp1.host", "c4.dcp1.host", "c16.dcp1.host"), 55,
        "c1, c4 and c16 at DCP1 with the host tier, 6 s of serving clock each (the brief form), started "
        "only while the 45 s budget lasts (the first always), then the step model beside each; the quick "
        "form's seven runs (DCP8 and no host tier at c16) are `python -m k3lab.studies.serving_run --form "
        "quick`'s and the full sweep --full's",
        {"form": "brief", "budget_s": 45.0}),
}
HOST_SIDE = frozenset({"draft_depth", "agent_cache"})

_REQUIRED = ("NAME", "case_names", "run", "profile_targets")


class StudyNotAvailable(ImportError):
    """A registered study whose module is not in this tree (not written yet)."""


def canonical(name: str) -> str:
    """`name` itself when it is a registered study; ValueError naming the known studies for anything
    else (a study's former name included: only the names in STUDIES are accepted)."""
    if name not in STUDIES:
        raise ValueError(f"unknown study {name!r}; known studies: {', '.join(STUDIES)}")
    return name


def load_study(name: str) -> ModuleType:
    """Import and return the study module `name` (a key of STUDIES).

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


@dataclass(frozen=True)
class ReportForm:
    """What `k3lab report` runs of one study: `cases` (None: every case) and `kwargs` for run();
    `form` is 'quick' or 'full'; `why` says what the quick form keeps ('' for the full one)."""

    cases: list[str] | None
    kwargs: dict
    form: str
    why: str = ""


def report_form(name: str, gpu: bool, full: bool = False) -> ReportForm:
    """The form `k3lab report` runs of study `name`: every case with `full`, else on a GPU its
    GPU_QUICK entry, on a CPU its CPU_CASES and CPU_KWARGS entries. ValueError for an unknown study or
    one that has no quick form for this kind of machine (every registered study must have one)."""
    name = canonical(name)
    if full:
        return ReportForm(None, {}, "full")
    if gpu:
        if name not in GPU_QUICK:
            raise ValueError(f"study {name!r} has no GPU quick form in GPU_QUICK")
        q = GPU_QUICK[name]
        return ReportForm(None if q.cases is None else list(q.cases), dict(q.kwargs), "quick", q.why)
    if name not in CPU_CASES and name not in GPU_ONLY:
        raise ValueError(f"study {name!r} has no CPU form in CPU_CASES")
    cases = CPU_CASES.get(name)
    return ReportForm(None if cases is None else list(cases), dict(CPU_KWARGS.get(name, {})), "quick",
                      "the smallest cases that run every kernel, one timed sample, in Triton's interpreter")
