#!/usr/bin/env bash
# Compile-only check of every kernels/*.cu as HIP for AMD Instinct, with no AMD GPU needed, and the
# resources of each kernel read from the code objects (k3lab.isa.hip):
#   gfx942 (MI300X): Debian's clang-19 + ROCm device libraries, device code objects, llvm-readelf --notes;
#   gfx950 (MI355X): clang-19's gfx942 LLVM IR code-generated for gfx950 by Triton's bundled LLVM (proves
#   instruction selection and resources for gfx950, not ROCm 7's headers or hipcc).
#
#   scripts/compile_hip.sh [--json FILE] [--arch gfx942,gfx950]
#
# Install the toolchain first with scripts/ci_amd_toolchain.sh (apt). Exit code: 0 when every file
# compiles for every arch, 1 when one fails, 2 when the toolchain is missing. Compiled only: not yet run
# on AMD hardware by this project.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
exec "$PY" -m k3lab.isa.hip "$@"
