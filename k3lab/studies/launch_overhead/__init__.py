"""Study: what one kernel launch costs, and why moving 1,792 bytes faster barely helps.

The seed (section 3) found 69 needless copies per decode step, one per KDA layer, each moving only
1,792 bytes yet taking about 4.8 us on an MI355X: launch overhead, not bandwidth. This study measures
that on the machine at hand:

- `tiny_op`: a one-element torch op (x.add_(1)), the cost of any small PyTorch kernel call;
- `empty_kernel` (GPU): torch.cuda._sleep(0), a kernel with nothing to do;
- `empty_triton` (GPU with Triton): a one-program Triton kernel storing one value;
- `copy_<size>`: a device copy from 1,792 bytes up to 64 MiB (4 MiB on CPU), with its bandwidth floor
  and the achieved bytes/s, which stays far below the bandwidth until the copy is megabytes long.

Variants: 'before' = the op launched eagerly, 100 calls back to back between one pair of device events
(per call = total / 100: the cost of the op in a stream of work, as in a decode step of many kernels);
'after' = the same 100 calls captured in one CUDA/HIP graph and replayed (per call = replay / 100):
graph replay is the fix for launch-bound chains of tiny kernels. Each 'before' record also keeps the
latency of a lone call with its own event pair (extra['lone_call_us'], timer overhead included).

On CPU there is no graph: only 'before', timed with
perf_counter (launch cost is not modelled on CPU; the figure is PyTorch's host overhead). The model
preset does not change this study (it is accepted so every study has the same signature).
"""

from .measure import (case_names, profile_targets, run, triton_kernel)
from .tables import (GRAPH_COPIES, NAME, SEED_COPIES_PER_STEP, SEED_COPY_BYTES, size_label, summary,
    summary_text)

__all__ = [
    "case_names", "GRAPH_COPIES", "NAME", "profile_targets", "run", "SEED_COPIES_PER_STEP",
    "SEED_COPY_BYTES", "size_label", "summary", "summary_text", "triton_kernel"
]
