"""Study: chunked KDA prefill, the plain chunk walk ("before") against the group scan ("after").

Seed, section 5: KDA's state after a chunk depends on the state before it. With one sequence and
12 heads (TP8) the plain walk runs 24 programs of 256 chunk steps each on a 16K-token prompt while
the rest of the GPU idles. The group scan first summarises each group of chunks as one affine map
of its incoming state, scans the summaries in order, then replays every group in parallel: 4
launches instead of 2, and more arithmetic, in exchange for a much shorter dependency chain. With
many sequences or heads the walk already fills the GPU and the scan's extra passes cost more than
they save; `k3lab.ops.kda_chunk.choose_group_size` then falls back to the walk.

Variants: 'before' = `kda_chunk_before`, 'after' = `kda_chunk_after` (each on the backend
`kda_chunk.BACKENDS.choose` picks: the CUDA prologue and walks for bf16 on NVIDIA GPUs, Triton elsewhere),
'fla' = fla-core's `chunk_kda` (raw log-decay g, no in-kernel gate, norm or sigmoid: the same function),
when fla-core and a GPU are present. Every variant is checked against `k3lab.nn.kda.kda_chunked` in
fp64 (on GPU: on the first heads and sequences of the batch, over the whole length) before it is
timed, outputs and final state both.

Cases are named h{heads}_b{batch}_t{tokens}, or h{heads}_ragged (cu_seqlens). On a GPU: the TP8
slice (12 heads) at B = 1, T = 4K / 16K / 64K and B = 8, T = 4K / 16K, and all 96 heads at B = 1,
T = 4K / 16K. On CPU (Triton's interpreter, fp32, tiny T) the same kernels run at a size a laptop
finishes in seconds, with the group size forced small so the scan path runs. `k3lab bench kda_scan
--cases ...` runs any of them, the crossover grid (`crossover_cases()`, and 'h12_ragged'),
'<case>.sweep' (the group-size sweep) and '<case>.parts' (the prologue alone); `--backend` forces one
`kda_chunk` backend for both k3lab variants. Tables and the committed records' readers:
`k3lab.studies.kda_scan.tables` (re-exported here).
"""

from k3lab.ops.kda_chunk import BACKENDS  # the op table run(backend=...) and `--backend` force

from .measure import (Case, case_names, check_cases, check_variant, chunk_flops, CPU_CASES, CROSSOVER_BATCH,
    crossover_cases, CROSSOVER_HEADS, CROSSOVER_T, floor_for, GPU_CASES, group_size_sweep, HEAD_DIM,
    io_bytes, make_inputs, MAX_TOKEN_HEADS, NAME, parse_case, PARTS_SUFFIX, predict, profile_targets,
    prologue_parts, RAGGED_LENGTHS, reference, run, Runner, SWEEP_SUFFIX)
from .tables import (crossover_table, PROLOGUE_PROBE, PROLOGUE_PROBE_STAGES, prologue_stages,
    reference_records, summary_text, sweep_table, WALK_BENCH, walk_launches)

__all__ = [
    "BACKENDS", "Case", "case_names", "check_cases", "check_variant", "chunk_flops", "CPU_CASES",
    "CROSSOVER_BATCH", "crossover_cases",
    "CROSSOVER_HEADS", "CROSSOVER_T", "crossover_table", "floor_for", "GPU_CASES", "group_size_sweep",
    "HEAD_DIM", "io_bytes", "make_inputs", "MAX_TOKEN_HEADS", "NAME", "parse_case", "PARTS_SUFFIX",
    "predict", "profile_targets", "prologue_parts", "PROLOGUE_PROBE", "PROLOGUE_PROBE_STAGES",
    "prologue_stages", "RAGGED_LENGTHS", "reference", "reference_records", "run", "Runner", "summary_text",
    "SWEEP_SUFFIX", "sweep_table", "WALK_BENCH", "walk_launches"
]
