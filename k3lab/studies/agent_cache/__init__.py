"""Study: cache reuse across agent turns (seed section 1): notebook 07's tables and figures, and the
simulator's benchmark.

The lesson lives in k3lab.cache (state save/restore, resume points, traces, the prefix-cache
simulator) and k3lab.agentx (the seed's headline arithmetic). Here:
- the workload: a generated AgentX-like trace sized to about 70 concurrent sessions (the seed's
  highest concurrency, where cache pressure showed), its turns, prompt lengths and reuse;
- the seed's 3,072 / 2,048 resume example, computed by k3lab.cache.resume and drawn;
- hit rate and recomputed tokens against the HBM budget, the checkpoint interval and tail alignment,
  for both eviction policies; what DCP8's eighth and MoE sharding's 3.85 GiB per GPU buy;
- restore against recompute: the H2D rate (the committed H200 record when there is one, else the
  public H100 figure, labelled) against a prefill rate (modelled from active parameters, labelled);
- the headline arithmetic with the seed's inputs, labelled as the seed's.

Study cases (`k3lab bench agent_cache`): `sim_small` (the notebook's workload, one replay, host CPU),
`sim_hour` (the one-hour trace of ~1.3e5 requests and ~1e7 blocks, no eviction), `copies` and `state`
(`h2d`: host <-> device copies and one request's state; on a CPU at tiny sizes). The simulator cases time
host code: their figures are what a CPU core does (each record carries CPU seconds per wall second: well
below 1 means a shared core).
"""

from .measure import (case_names, H2D_CASES, profile_targets, replay_hour, run)
from .tables import (AGENTX_PUBLIC, break_even, break_even_figure, budget_figure, budget_sweep, h2d_rate,
    hbm_budget_gb, headline_table, HOST_GB, HOUR, interval_figure, interval_sweep, layout_table,
    MOE_FREED_GB, NAME, prefill_rate, PUBLIC_H2D, resume_example, resume_figure, SEED_CONCURRENCY, VARIANTS,
    WORKLOAD, workload, workload_figure, workload_table)

__all__ = [
    "AGENTX_PUBLIC", "break_even", "break_even_figure", "budget_figure", "budget_sweep", "case_names",
    "H2D_CASES", "h2d_rate", "hbm_budget_gb", "headline_table", "HOST_GB", "HOUR", "interval_figure",
    "interval_sweep", "layout_table", "MOE_FREED_GB", "NAME", "prefill_rate", "profile_targets",
    "PUBLIC_H2D", "replay_hour", "resume_example", "resume_figure", "run", "SEED_CONCURRENCY", "VARIANTS",
    "WORKLOAD", "workload", "workload_figure", "workload_table"
]
