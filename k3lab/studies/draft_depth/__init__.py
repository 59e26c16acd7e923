"""Study: how many tokens to draft (seed section 6), and how fast the simulator behind it runs.

The lesson lives in `k3lab.speculative` (expected committed tokens, cycle costs, best depth); what this
study measures is the machinery that backs the formula up:

- `cycles_depth<k>` (k = 3, 4, 7): 10^6 draft-verify cycles on the reference acceptance curve.
  'before' = the plain loop over cycles and positions, 'after' = the vectorised numpy simulator;
  both read the same uniform draws, so their counts must be identical (checked first), and the
  mean must lie within 3 standard errors of the formula. Timed with k3lab.bench's CPU timer; numpy
  runs this on one core. Each record carries the process CPU seconds per wall second of its timing
  run (at most 1.0 shows one core; well below 1.0 means other processes shared it and the wall
  figures are inflated) and the CPU time per call, which such sharing does not inflate.
- `random_curves`: 20 random acceptance curves of depth 1..8, 10^5 cycles each: the largest
  |z| between simulator and formula (must be < 3) and the time of the whole sweep.
- `tokens_v8_depth4`: token-level rejection sampling over an 8-token vocabulary with random
  target and draft logits (each conditioned on the previous token): the chi-square p-value of the
  committed tokens against the target distribution and the |z| of the mean against the exact
  curve derived from the two distributions.

Everything here runs on the host CPU whatever the machine has; the model preset does not change
this study (it is accepted so every study has the same signature).
"""

from .measure import (case_names, CURVE_DEPTH, CYCLES, DEPTHS, MIN_P_VALUE, NAME, profile_targets,
    RANDOM_CURVES, RANDOM_CYCLES, run, TOKEN_CYCLES, TOKEN_DEPTH, token_logits, TOKEN_VOCAB)
from .tables import (agreement_figure, breakeven_figure, depth_table, explorer, explorer_costs,
    EXPLORER_DEFAULTS, explorer_figure, MAX_Z, rate_figure, token_figure, z_figure)

__all__ = [
    "agreement_figure", "breakeven_figure", "case_names", "CURVE_DEPTH", "CYCLES", "depth_table", "DEPTHS",
    "explorer", "explorer_costs", "EXPLORER_DEFAULTS", "explorer_figure", "MAX_Z", "MIN_P_VALUE", "NAME",
    "profile_targets", "RANDOM_CURVES", "RANDOM_CYCLES", "rate_figure", "run", "TOKEN_CYCLES",
    "TOKEN_DEPTH", "token_figure", "token_logits", "TOKEN_VOCAB", "z_figure"
]
