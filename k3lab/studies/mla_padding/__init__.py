"""Study: MLA decode with 12 heads padded to 16 and the history split across programs (seed section 4).

At TP8 each GPU holds 12 of K3's 96 MLA query heads. The seed padded them to 16 so that AITER's
assembly decode could run (each head attends on its own, so the real heads are unchanged and the
extra outputs are dropped), and that path also cut a long history into pieces handled in parallel
instead of one workgroup walking the whole conversation: 43.8 -> 23.6 ms per output token at 32K
input, 22.9 -> 22.8 at 1K (8x MI355X, TP8, concurrency 1, whole-model time per token).

Here both policies run as kernels (`k3lab.ops.mla_decode`) on the machine at hand:

- before: 12 heads, one program per query row walking the whole history, no matrix units (on NVIDIA
  GPUs the CUDA backend's CUDA-core kernel; the Triton kernel elsewhere);
- after: padded to 16 rows for the matrix units, the history split into pieces merged by LSE (the
  CUDA backend on Hopper, Triton elsewhere; '<case>.triton' records the Triton backend beside it);
- peers in the same run: plain PyTorch (einsum + softmax: variant 'torch') and torch SDPA
  (recorded as case '<case>.sdpa', variant 'torch', since both are plain PyTorch), FlashMLA's dense
  decode where it runs (variant 'flashmla': an NVIDIA sm_90a GPU and its prebuilt library, see
  k3lab.ops.mla_decode.peers; `flashmla_status()` says why not elsewhere), and AITER's
  padded decode on ROCm when it is installed (variant 'aiter', not yet run on AMD hardware by this
  project).

Cases on a GPU (bf16 cache, paged, page size 64, B = 1 unless named): 1K, 32K and 128K context; a
batch sweep B in {1, 8, 64} at 8K; a ragged batch; 2- and 4-position verification at 32K (read by
the draft-depth study); the seed's explicit-copy padding ('<case>.padcopy') and a contiguous cache
('<case>.contig'); a split-count sweep at 1K, 32K and 128K ('ctx32k.s64', ...); verification groups
of 1 to 8 positions. On a CPU the same code runs on tiny contexts in fp32
through Triton's interpreter (timings there say nothing about GPUs). Every record carries its error
figures against the fp32 reference (k3lab.nn.mla.latent_attention) and the floor: cache bytes over
the measured copy bandwidth.
"""

from .measure import (ANCHORS_H200_US, cache_bytes, Case, case_names, cases, committed_traces,
    DEFAULT_PRESET, flashmla_status, instruction_mix, padding_cost, PAGE_SIZE, profile_targets,
    programs_figure, programs_table, run, SEED_MS_PER_TOKEN, TRACES)
from .tables import (arithmetic_per_tile, BOUND_ROWS, BOUNDS, bounds_figure, breakdown_figure,
    BREAKDOWN_STEPS, H200_SMS, MERGE_RUN, NAME, peer_figure, PEER_KERNELS, peer_kernels, peer_table,
    probe_frames, PROBE_PHASES, probe_runs, read_breakdown, READ_FLOORS, read_floors, READ_PROBE,
    STAGE_BUILDS, stage_figure, STAGE_RUNS, stage_table, summary, sweep_figure, sweep_table, target_bounds,
    TARGETS, targets, verify_figure, verify_table, wave_figure, WAVE_RUNS, wave_table, WGMMA_RUN)

__all__ = [
    "ANCHORS_H200_US", "arithmetic_per_tile", "BOUND_ROWS", "BOUNDS", "bounds_figure", "breakdown_figure",
    "BREAKDOWN_STEPS", "cache_bytes", "Case", "case_names", "cases", "committed_traces", "DEFAULT_PRESET",
    "flashmla_status", "H200_SMS", "instruction_mix", "MERGE_RUN", "NAME", "padding_cost", "PAGE_SIZE",
    "peer_figure", "PEER_KERNELS", "peer_kernels", "peer_table", "probe_frames", "PROBE_PHASES",
    "probe_runs", "profile_targets", "programs_figure", "programs_table", "read_breakdown", "READ_FLOORS",
    "read_floors", "READ_PROBE", "run", "SEED_MS_PER_TOKEN", "STAGE_BUILDS", "stage_figure", "STAGE_RUNS",
    "stage_table", "summary", "sweep_figure", "sweep_table", "target_bounds", "TARGETS", "targets",
    "TRACES", "verify_figure", "verify_table", "wave_figure", "WAVE_RUNS", "wave_table", "WGMMA_RUN"
]
