"""Speculative decoding: how many tokens to draft (seed section 6).

A cycle drafts ``k`` tokens with a cheap model, verifies them with one target forward over
``k + 1`` positions, and commits the accepted prefix plus one token from the target: the recovery
token at the first rejection, or the bonus token when every draft was accepted. The useful rate is

    committed tokens per cycle / time of the whole draft-verify-commit cycle,

so a deeper draft pays only when its extra committed tokens grow faster than its cycle time.

What is here, in the order a reader meets it:

- acceptance curves: per-position *conditional* acceptance ``a[i]`` = P(draft i accepted | drafts
  before it were); constant, geometric decay, and a reference curve fitted to the seed's figures;
- the formula: ``expected_committed`` = sum over j = 0..k of a[0]...a[j-1] (the empty product is the
  recovery/bonus token that every cycle commits);
- two Monte Carlo checks of it: cycle-level (one uniform draw per drafted position) and token-level
  (real rejection sampling between a draft and a target distribution over a small vocabulary, which
  also shows that the committed tokens follow the target distribution);
- a cycle cost model (user-given, illustrative, or built from k3lab's measured verification records)
  and ``best_depth``, which picks the depth with the most committed tokens per second and tabulates
  the break-even cycle growth for each extra draft.

Modules: `acceptance` (curves, formula), `simulate` (the two Monte Carlo checks), `costs` (cycle
costs, `best_depth`, measured records), `inputs` (argument checks); every public name is importable
from here (`from k3lab import speculative; speculative.best_depth`).
"""

from k3lab.speculative.acceptance import (
    REFERENCE_COMMITTED,
    break_even_growth,
    committed_distribution,
    constant_acceptance,
    expected_committed,
    expected_committed_all,
    fit_geometric_acceptance,
    geometric_acceptance,
    reference_acceptance,
)
from k3lab.speculative.costs import (
    CycleCosts,
    DepthChoice,
    ILLUSTRATIVE_PROFILES,
    NoVerifyRecords,
    VERIFY_STUDIES,
    best_depth,
    costs_from_records,
    illustrative_costs,
    linear_costs,
    verify_records_summary,
)
from k3lab.speculative.simulate import (
    CycleStats,
    TokenStats,
    acceptance_from_distributions,
    chi_square,
    simulate_cycles,
    simulate_cycles_loop,
    simulate_tokens,
)

__all__ = [
    "constant_acceptance",
    "geometric_acceptance",
    "fit_geometric_acceptance",
    "reference_acceptance",
    "REFERENCE_COMMITTED",
    "expected_committed",
    "expected_committed_all",
    "committed_distribution",
    "break_even_growth",
    "CycleStats",
    "simulate_cycles",
    "simulate_cycles_loop",
    "TokenStats",
    "acceptance_from_distributions",
    "simulate_tokens",
    "chi_square",
    "CycleCosts",
    "linear_costs",
    "illustrative_costs",
    "ILLUSTRATIVE_PROFILES",
    "costs_from_records",
    "verify_records_summary",
    "NoVerifyRecords",
    "VERIFY_STUDIES",
    "DepthChoice",
    "best_depth",
]