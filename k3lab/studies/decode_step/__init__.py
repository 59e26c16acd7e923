"""Study: one TP8 rank's whole decode step, every optimization a switch (notebook 08, the report's first
page).

The run itself is `measure` (the waterfall, and the study contract: NAME, case_names, run,
profile_targets), `bounds` (the probes of what bounds the step above its floor), `glue` (the router and
SiTU-GLU kernels alone) and `attribution` (where the batch-1 steps' time goes), all run by `k3lab bench
decode_step`; `tables` reads their records back into the tables the notebook and the report show: the
waterfall (all on, each switched off alone, all off), the MLA padding's whole-step effect beside the
seed's per-token figures, the AttnRes fusion's and the MoE tail's shares beside the seed's throughput
gains, launches per step, and what the per-op records predict (Amdahl). Seed figures are labelled as
the seed's (MI355X, their serving stack); nothing here is mixed with them.
"""

from .measure import (ATTRIBUTION, ATTRIBUTION_CASE, bench_config, case_floor, case_names, cases, CPU_CASES,
    CPU_CONFIG, CPU_SKIPPED, chosen_variants, expert_bytes, EXTRA_CASES, first_step, GLUE, GLUE_CASE,
    GPU_CASES, measured_bandwidth_tbs, NAME, part_bytes, PRECISION_OF, PROBE, PROBE_CASE, probe_records,
    profile_targets, PROFILED, PROJECTIONS_OF, reference_logits, reference_of, REFERENCES, run, run_cases,
    run_variant, SETTING_VARIANTS, SLOW_STEP_S, step_bytes, step_settings, TOP_KERNELS, variant_floor,
    variants, WATERFALL)
from .tables import (amdahl, attribution_figure, attribution_rows, attributions, best_us, checks, DEVICE,
    floor_rows, front_page_rows, gain, gemv_rows, headroom, launches, load, MLA_CASE, mla_rows, NOT_MEASURED,
    PER_OP, precision_rows, predicted_floor_us, probes, SEED, seed_headline, SETTING_ROWS, UNCHECKED,
    variant_precision, waterfall, waterfall_figure, where_figure, where_time_goes)

__all__ = [
    "amdahl", "ATTRIBUTION", "ATTRIBUTION_CASE", "attribution_figure", "attribution_rows", "attributions",
    "bench_config", "best_us", "case_floor", "case_names", "cases", "checks", "chosen_variants", "CPU_CASES",
    "CPU_CONFIG", "CPU_SKIPPED", "DEVICE", "expert_bytes", "EXTRA_CASES", "first_step", "floor_rows",
    "front_page_rows", "gain", "gemv_rows", "GLUE", "GLUE_CASE", "GPU_CASES", "headroom", "launches", "load",
    "measured_bandwidth_tbs", "MLA_CASE", "mla_rows", "NAME", "NOT_MEASURED", "part_bytes", "PER_OP",
    "PRECISION_OF", "precision_rows", "predicted_floor_us", "PROBE", "PROBE_CASE", "probe_records", "probes",
    "profile_targets", "PROFILED", "PROJECTIONS_OF", "reference_logits", "reference_of", "REFERENCES", "run",
    "run_cases", "run_variant", "SEED", "seed_headline", "SETTING_ROWS", "SETTING_VARIANTS", "SLOW_STEP_S",
    "step_bytes", "step_settings", "TOP_KERNELS", "UNCHECKED", "variant_floor", "variant_precision",
    "variants", "WATERFALL", "waterfall", "waterfall_figure", "where_figure", "where_time_goes"
]
