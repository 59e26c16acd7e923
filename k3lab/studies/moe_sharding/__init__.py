"""The MoE output sharding study (notebook 02), run by `k3lab bench moe_sharding`: the latent MoE tail
replicated vs sharded and the routed experts' grouped kernels against the per-expert loop, at TP8
shapes on a GPU (`measure` does the work and holds the contract; notebook 02's tables and figures are
in `tables`). GPU only: the timings are of compiled kernels.
"""

from .measure import (case_names, EXPERT_TOKENS, profile_targets, run, run_tokens, TAIL_TOKENS)
from .tables import (check_frame, CONVERSATION_TOKENS, hit_rate_effect, memory_figure, memory_table, NAME,
    ownership_figure, padding_figure, SEED_CACHE_RUN, table, tail_table)

__all__ = [
    "case_names", "check_frame", "CONVERSATION_TOKENS", "EXPERT_TOKENS", "hit_rate_effect", "memory_figure",
    "memory_table", "NAME", "ownership_figure", "padding_figure", "profile_targets", "run", "run_tokens",
    "SEED_CACHE_RUN", "table", "tail_table", "TAIL_TOKENS"
]
