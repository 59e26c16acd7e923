"""Study: the precision of KDA's 64 x 64 within-chunk inverse (seed, technical note "KDA precision").

Each chunk of 64 tokens resolves the dependencies between its tokens with R = (I + A)^-1, A the
strictly lower-triangular matrix A_ij = beta_i sum_d k_id k_jd exp(G_id - G_jd). The forward
substitution that builds R sums terms that grow and then cancel, so the seed keeps the inverse's
*inputs* and accumulation in fp32 (native fp32 matrix instructions) and rounds only the finished
inverse to bf16. Rounding the inputs to bf16 first loses what the cancellation needs, exactly as
bf16(256.5) - bf16(256) = 0 while 256.5 - 256 = 0.5 in fp32 (`subtraction_example`).

`blocked_inverse` computes R the way a matrix-core kernel does: 16 x 16 blocks (the triangle holds
ten of them), forward substitution inside the diagonal blocks, block products for the rest, every
product fed inputs in one precision and accumulated in another:

    fp32      fp32 inputs, fp32 accumulation       (the seed's choice)         variant 'after'
    bf16_in   bf16 inputs, fp32 accumulation       (the tempting shortcut)     variant 'before'
    bf16      bf16 inputs, bf16 accumulation                                   case '<kind>.all_bf16'

`prepare_chunks` + `walk` run 32 chunks of KDA with that inverse (everything else fp32; the finished
inverse rounded to bf16 as the seed does, or not) against k3lab.nn.kda in fp64, on K3-like gates
(g = -5 sigmoid(.)) and on adversarial chunks (decay spread across channels, beta near 1, keys
nearly parallel). CPU-only by design: it runs in seconds and its records are saved with device 'cpu'.
"""

from .measure import (blocked_inverse, case_names, check_pipeline, Chunks, condition, DEFAULT_CHUNKS,
    DEFAULT_HEADS, errors, inverse_for, KINDS, make_inputs, measure, NAME, PRECISIONS, prepare_chunks,
    profile_targets, reference, run, subtraction_example, walk)
from .tables import (BLOCK, CHUNK, inverse_tile_bytes, ONCHIP_KIB, onchip_table, SEED_PROLOGUE_KIB, summary,
    workgroups_per_unit)

__all__ = [
    "BLOCK", "blocked_inverse", "case_names", "check_pipeline", "CHUNK", "Chunks", "condition",
    "DEFAULT_CHUNKS", "DEFAULT_HEADS", "errors", "inverse_for", "inverse_tile_bytes", "KINDS",
    "make_inputs", "measure", "NAME", "ONCHIP_KIB", "onchip_table", "PRECISIONS", "prepare_chunks",
    "profile_targets", "reference", "run", "SEED_PROLOGUE_KIB", "subtraction_example", "summary", "walk",
    "workgroups_per_unit"
]
