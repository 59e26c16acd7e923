"""Fused KDA decode benchmark: before (unfused chain), after (one launch), fla-core peer, floor.

At the TP8 slice (12 heads, K = V = 128, bf16 activations, fp32 state) for B in {1, 8, 32, 128}:
every variant is first checked against the fp32 reference on fresh random inputs (output, the three
conv states and the recurrent state), then timed eager and under CUDA-graph replay
(`k3lab.bench.time_fn`). The floor is the bytes one step must move (state read + write, conv states,
per-token inputs, output, weights) over the measured copy bandwidth.

The peer is what an fla-core user runs for the same step: three `causal_conv1d_update` calls (one
per ShortConvolution), `fused_recurrent_kda` with its in-kernel gate, L2 norm and beta sigmoid, and
`rms_norm_gated` with a sigmoid gate.

Study `kda_decode` (`k3lab bench kda_decode --cases B1_H12 B128_H12 --json F`; any B{batch}_H12 case
runs); the copy_removal study (notebook 03) folds these functions in. `k3lab profile kda_decode`
traces one B = 1 step per variant.
"""

from .measure import (BATCHES, case_names, check_case, fla_cache, fla_step, floor_us, HEAD, HEADS, LAUNCHES,
    make_callables, NAME, profile_targets, run, state_copies, step_bytes, time_case)
from .tables import (summary_text)

__all__ = [
    "BATCHES", "case_names", "check_case", "fla_cache", "fla_step", "floor_us", "HEAD", "HEADS", "LAUNCHES",
    "make_callables", "NAME", "profile_targets", "run", "state_copies", "step_bytes", "summary_text",
    "time_case"
]
