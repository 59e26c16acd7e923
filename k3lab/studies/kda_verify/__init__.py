"""Study: KDA speculative verification with narrow tiles (seed section 5, vLLM PR 58045).

A verify step runs KDA over T draft positions of each sequence and keeps the state after every
position (for rollback). At TP8 one GPU has 12 KDA heads x 128 value columns; with 32-column tiles
one sequence makes 48 programs, far fewer than the 132 SMs of an H200 or 256 CUs of an MI355X.

Variants (all checked, outputs and every per-position state, against an fp64 reference first):
  before  `kda_verify_before`: 32-column tiles, 128-thread workgroups, run-time length, per-token loads
  after   `kda_verify`: narrow tiles chosen from the device, single-wave workgroups, compile-time
          length, hoisted inputs and token-invariant work
  fla     fla-core's `fused_recurrent_kda` (GPU only), the public peer; it returns the final state
          only, so the `.final_only` cases time every variant writing just the final state as well.

Cases: `b{B}_t{T}` (per-position states), `b{B}_t{T}.final_only`; on a GPU also the ablation at B=1,
T=4, one change at a time on top of 'before' (variant 'after' in the records): `.narrow_only` (the
streaming kernel with the narrowest tiles, still 128 threads), `.narrow_1wave` (+ one wave),
`.narrow8_w1` (the Triton narrow kernel), `.cudawarp8_w4` (the CUDA kernel, plain launch), then the
default (= 'after': on an NVIDIA GPU the CUDA kernel as a programmatic dependent launch), and `.ragged`
(the narrow path through its dynamic cu_seqlens path); and a sweep of tile width x waves for both
Triton kernels (`b{B}_t4.narrow{W}_w{N}`, `b{B}_t4.stream{W}_w{N}`). Records name the kernel that ran
in extra (kernel, backend, num_warps, pdl). Graph timings replay one graph of >= 10 calls cycling
through enough input sets to exceed twice the L2 (inputs and states are not cache-hot). Floors: state
read + state writes + inputs and outputs over the copy bandwidth, and one launch (graph or eager
launch cost).
"""

from .measure import (ABLATIONS, case_names, check_result, CPU_SHAPES, CUDA_ABLATION, floor_parts,
    GATE_LOWER_BOUND, GPU_SHAPES, kernel_name, make_inputs, MIN_GRAPH_CALLS, profile_targets, reference, run,
    SWEEP, SWEEP_BATCHES)
from .tables import (ablation_table, best_config, bytes_moved, launch_floor_us, NAME, predict,
    reference_records, summary, sweep_table, UNIT_BACKEND, UNITS, workgroup_table)

__all__ = [
    "ablation_table", "ABLATIONS", "best_config", "bytes_moved", "case_names", "check_result", "CPU_SHAPES",
    "CUDA_ABLATION", "floor_parts", "GATE_LOWER_BOUND", "GPU_SHAPES", "kernel_name", "launch_floor_us",
    "make_inputs", "MIN_GRAPH_CALLS", "NAME", "predict", "profile_targets", "reference",
    "reference_records", "run", "summary", "SWEEP", "SWEEP_BATCHES", "sweep_table", "UNIT_BACKEND", "UNITS",
    "workgroup_table"
]
