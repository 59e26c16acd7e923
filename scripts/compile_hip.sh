#!/usr/bin/env bash
# Compile-only check of every kernels/*.cu as HIP for AMD Instinct targets, with no AMD GPU needed.
#
#   scripts/compile_hip.sh [out_dir]        (default: a temporary folder, removed afterwards)
#
# Builds each kernel twice: the source as written (`hipcc -x hip`, the k3lab_portability.h HIP branch)
# and the output of torch's hipify (what torch's extension builder would compile on ROCm). Targets:
# gfx90a (MI200) and gfx940 (MI300 family), the ones Debian's hipcc 5.2 knows; gfx942/gfx950 need a
# newer ROCm. Compiled only: not yet run on AMD hardware by this project.
#
# Debian/Ubuntu: apt-get update && apt-get install -y --no-install-recommends hipcc
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v hipcc >/dev/null 2>&1; then
  echo "compile_hip.sh: hipcc not found; install it with:" >&2
  echo "  apt-get update && apt-get install -y --no-install-recommends hipcc" >&2
  exit 2
fi
export HIP_PLATFORM=amd  # where nvcc is installed too, hipcc would otherwise compile for NVIDIA
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TARGETS=${K3LAB_HIP_TARGETS:-"gfx90a gfx940"}
ARCH_FLAGS=()
for t in $TARGETS; do ARCH_FLAGS+=("--offload-arch=$t"); done
OUT=${1:-}
CLEANUP=0
if [ -z "$OUT" ]; then OUT=$(mktemp -d); CLEANUP=1; fi
mkdir -p "$OUT"; rm -rf "$OUT/hipified"  # hipify copies the tree only into a new folder
trap '[ "$CLEANUP" = 1 ] && rm -rf "$OUT"' EXIT

# torch's hipify on a copy of kernels/ (the tree itself is never rewritten)
"$PY" - "$OUT/hipified" <<'PY'
import shutil, sys, tempfile
from torch.utils.hipify import hipify_python
dst = sys.argv[1]
src = tempfile.mkdtemp()
shutil.copytree("kernels", src, dirs_exist_ok=True)
hipify_python.hipify(project_directory=src, output_directory=dst, includes=["*"], show_detailed=False,
                     is_pytorch_extension=True, show_progress=False)
PY

status=0
for cu in kernels/*.cu; do
  name=$(basename "$cu" .cu)
  for variant in source hipified; do
    if [ "$variant" = source ]; then src="$cu"; inc=kernels; else src="$OUT/hipified/$name.hip"; inc="$OUT/hipified"; fi
    if hipcc -x hip -std=c++17 -O3 -fPIC "${ARCH_FLAGS[@]}" -I"$inc" -c "$src" -o "$OUT/$name.$variant.o"; then
      echo "ok   $name ($variant) for $TARGETS"
    else
      echo "FAIL $name ($variant) for $TARGETS" >&2
      status=1
    fi
  done
done
exit $status
