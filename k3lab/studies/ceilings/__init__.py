"""The device's two roofline ceilings, measured: the copy bandwidth and the dense bf16 matrix rate.

A probe of the device, not of an optimization: `k3lab report` does not run it and no notebook times it
(k3lab.studies.PROBES, not STUDIES); the rooflines read its committed records
(`k3lab.profiling.roofline.ceilings`), so a device's figure is drawn under the ceilings that device
measured rather than under its datasheet's.

Cases (variant 'reference', one record each, eager, one call per sample):
- `copy_1GiB`: a 1 GiB device-to-device copy of uint8; extra `bandwidth_tbs` = bytes read + written
  over the median time, `bandwidth_how` says it was measured. Checked: the destination equals the
  source byte for byte.
- `matmul_bf16_8192`: a bf16 8192 x 8192 x 8192 product of random N(0, 1) inputs; extra
  `matmul_tflops` = 2 n^3 over the median time. Checked first: rows of the product against the fp32
  product of the same bf16 inputs, within bf16's tolerance (k3lab.runtime.TOLERANCES).

On a machine without a GPU nothing is launched: `run` says so and returns no records (a CPU's copy and
matmul are not a GPU's ceilings); `measure_copy` and `measure_matmul` take a device and a size, so the
checks and the arithmetic are tested on a CPU at small sizes.

    python -m k3lab.studies.ceilings [--save] [--root DIR] [--repeats N]

writes profiles/<device>/ceilings/<case>__reference.json with --save (`k3lab import` takes the files).
"""

from .measure import (case_names, CPU_NOTE, main, measure_case, measure_copy, measure_matmul,
    profile_targets, run)
from .tables import (bandwidth_tbs, CASES, COPY_BYTES, MATMUL_N, matmul_tflops, NAME, summary_text,
    table)

__all__ = [
    "bandwidth_tbs", "case_names", "CASES", "COPY_BYTES", "CPU_NOTE", "main", "MATMUL_N", "matmul_tflops",
    "measure_case", "measure_copy", "measure_matmul", "NAME", "profile_targets", "run", "summary_text",
    "table",
]
