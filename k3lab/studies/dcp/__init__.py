"""Notebook 01's study of decode context parallelism: memory, layout, the merge by hand, a live gloo
run, bytes per layer, and a cost model of DCP8 against TP8.

Figures are plain plotly go.Figure objects. The cost model's collective figures are public
figures (not measured here: this project has no multi-GPU record yet) and are labelled as such;
the attention figures come from a line fitted to committed H200 records of the MLA op's after, whose
measured error on the records it was not fitted to `attention_fit_error` gives.
"""

from .measure import (case_names, live_attention, live_run, LOCAL_CASES, MERGE_BATCHES, one_gpu,
    print_summary, profile_targets, run, TP_HEADS)
from .tables import (ATTENTION_FIT, attention_fit_error, attention_model, bytes_table, capacity_table,
    COLLECTIVES, CONVERSATION, cost_figure, cost_model, h200_records, layout_figure, layout_table,
    memory_figure, memory_table, NAME, PUBLIC, two_shard_example, WORLD)

__all__ = [
    "ATTENTION_FIT", "attention_fit_error", "attention_model", "bytes_table", "capacity_table", "case_names",
    "COLLECTIVES", "CONVERSATION", "cost_figure", "cost_model", "h200_records", "layout_figure",
    "layout_table", "live_attention", "live_run", "LOCAL_CASES", "memory_figure", "memory_table",
    "MERGE_BATCHES", "NAME", "one_gpu", "print_summary", "profile_targets", "PUBLIC", "run", "TP_HEADS",
    "two_shard_example", "WORLD"
]
