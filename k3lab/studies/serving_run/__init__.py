"""Study: a measured serving run, continuous batching over AgentX-like sessions on one TP8 rank, with the
prefix cache in the memory a rank would have (k3lab.serving.run; docs/serving_run.md).

    python -m k3lab.studies.serving_run --form quick --json $OUT/serving_run.json --budget-s 230

Cases, one run each: 'c{C}.dcp{D}.{host|gpu_only}' = concurrency C (agent sessions at once, closed loop),
DCP degree D, with or without the host tier. On a GPU: K3Config.tp_slice(8), bf16, random weights
(`DISTINCT_LAYERS` sets per layer kind), every switch on, decode steps as CUDA graphs; the workload's
prompts x 1/16, outputs and think times x 1/8 (`GPU_SCALE`); the cache budget is what one rank of the
article's 8 x MI355X node has left after K3's weights at the served precision (k3lab.serving.node.free_gb:
59.9 GB) and its host tier (224.875 GB per rank), both x the context scale, so that as many sessions'
histories fit as would at full length (the fixed KDA checkpoints aside). No H100 or H200 rank can hold
K3's weights (205 GB per rank at MXFP4 experts), so no budget of this device's own would be one a
server has. On a CPU: the tiny preset with the switches whose "on" form is PyTorch there, prompts x 1/512,
a 6 MB device budget and 3 MB host tier (stated in the records), four short runs: a check that the
whole run works and the shape of its curve, not a speed.

Forms: QUICK (c1, c2, c4, c8, c16 at DCP1 with the host tier, then c16 at DCP8 and c16 without the host
tier: where capacity binds, what DCP8 and offload change), each run 15 s of serving clock plus at most 10 s
to finish the requests in flight; FULL (c1 .. c64, DCP1 and DCP8, with and without host, 40 s each); BRIEF
(`k3lab report`'s quick form on a GPU: c1, c4 and c16 at DCP1 with the host tier, 6 s each plus at most
4 s, under the report's budget). With `budget_s` a run that would end past it is not started, except
the first: a budget always measures one run. On a CPU every form but CAPACITY runs the CPU cases (c1,
c2, c3 at DCP1 with the host tier: a curve of three points; c3 at DCP8 without it), eight requests each.

CAPACITY (`--form capacity`, `CAPACITY_WHY`): c16 at DCP1 without and with the host tier, c16 at DCP8,
and c4 at DCP1 without it (where nothing binds), 75 s of serving clock each, KDA checkpoints at prompt
ends only; a scaled workload and budget (the quick form's), labelled in each record; on a CPU its own
cases at c3 and c1, twelve requests each (`CPU_CAPACITY`). `plan(case, form)`
is the arithmetic behind a form: turns per session expected in its clock, the cache its sessions hold
against the budget, whether capacity binds.

This machine's records: `measured(root)` loads the committed ones (profiles/<device>/serving_run/);
`curve_rows(records)` gives one row per run (percentiles, tokens/s, the decode step at the batch the run
held, the gaps between tokens), the table notebook 09 opens with.

Records: study 'serving_run', variant 'after', mode 'graph' (GPU) or 'cpu'; median_us / p20_us / p80_us
= the requests' TPOT percentiles; extra['summary'] holds TTFT / TPOT / ITL / E2E mean and P50 / P90 / P99
(ms), output and total tokens/s/GPU (the TP8 group's over its 8 GPUs), tokens/s/user, decode step time per
batch size, prefill tokens/s, hit rate and the cache's counters; extra['describe'] what ran (switches,
collectives as labelled stand-ins, kernels, budget and its source, scale); extra['requests'] one row per
request (arrival, prompt, output, resumed position, TTFT, TPOT, E2E in seconds).
"""

from .measure import (BRIEF, budget, CAPACITY, CAPACITY_CPU_BUDGET, CAPACITY_CPU_REQUESTS, CAPACITY_CPU_TURNS,
    CAPACITY_LABEL, CAPACITY_WHY, case_names, CHECKPOINT_INTERVAL, CPU_BUDGET, CPU_CAPACITY, CPU_CASES,
    CPU_SCALE, DISTINCT_LAYERS, engine_costs, FORM_CASES, form_setup, FULL, GPU_SCALE, main,
    MAX_BATCHED_TOKENS, model_rows, plan, PLAN_DEVICE, profile_targets, QUICK, run, RUN_S, run_with_costs)
from .tables import (curve_figure, curve_rows, FORM_PREFIX, measured, MODEL_COLUMNS, NAME, parse_case,
    REPORT_COLUMNS, REPORT_NOTE, report_records, report_table, summary_text)

__all__ = [
    "BRIEF", "budget", "CAPACITY", "CAPACITY_CPU_BUDGET", "CAPACITY_CPU_REQUESTS", "CAPACITY_CPU_TURNS",
    "CAPACITY_LABEL", "CAPACITY_WHY", "case_names", "CHECKPOINT_INTERVAL", "CPU_BUDGET", "CPU_CAPACITY",
    "CPU_CASES", "CPU_SCALE", "curve_figure", "curve_rows", "DISTINCT_LAYERS", "engine_costs", "FORM_CASES",
    "FORM_PREFIX", "form_setup", "FULL", "GPU_SCALE", "main", "MAX_BATCHED_TOKENS", "measured",
    "MODEL_COLUMNS", "model_rows", "NAME", "parse_case", "plan", "PLAN_DEVICE", "profile_targets", "QUICK",
    "REPORT_COLUMNS", "REPORT_NOTE", "report_records", "report_table", "run", "RUN_S", "run_with_costs",
    "summary_text"
]
