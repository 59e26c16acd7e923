"""Study `copy_removal` (seed section 3): data passed between kernels costs launches and traffic.

Three cases, each before and after, checked before timed:
- `kda_decode_b{B}`: the single-token KDA path, unfused chain vs one fused HIP/CUDA kernel (plus the
  fla-core peer), from `k3lab.ops.kda_decode` (GPU only: the kernel is compiled there).
- `attn_res_t{T}_s{S}`: AttnRes mix + the next RMSNorm, the plain PyTorch sequence vs one Triton
  kernel, for T tokens and S sources (S - 1 stored blocks and the running partial).
- `packing`: a decode step of K3 at full depth (69 KDA layers) with a matmul dispatcher that packs
  before choosing (one unused copy per KDA layer) vs one that packs only where used; the profiler
  counts the copies, and the pack itself is timed against the seed's 1,792-byte figure.

measure.py checks and times the cases into records; tables.py turns records into the before / after /
floor table of the attn_res cases (`attn_res_table`, the committed H200 records by default) and holds the
floor-traffic formula `attn_res_bytes`.
"""

from .measure import (ATTN_RES_CPU, ATTN_RES_GPU, attn_res_inputs, AttnResInputs, case_names, check_attn_res,
    count_copies, HIDDEN_GPU, KDA_DECODE_BATCHES, kda_decode_records, packing_config, packing_model,
    packing_records, profile_targets, run)
from .tables import (ATTN_RES_COLUMNS, attn_res_bytes, attn_res_records, attn_res_table, DEVICE, load, NAME,
    NOT_MEASURED)

__all__ = [
    "ATTN_RES_COLUMNS", "attn_res_bytes", "ATTN_RES_CPU", "ATTN_RES_GPU", "attn_res_inputs",
    "attn_res_records", "attn_res_table", "AttnResInputs", "case_names", "check_attn_res", "count_copies",
    "DEVICE", "HIDDEN_GPU", "KDA_DECODE_BATCHES", "kda_decode_records", "load", "NAME", "NOT_MEASURED",
    "packing_config", "packing_model", "packing_records", "profile_targets", "run"
]
