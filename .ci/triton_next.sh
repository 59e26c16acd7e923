#!/usr/bin/env bash
# CI: k3lab on the newest Triton release beside the pinned one (`make test` runs the pinned 3.6.0).
# What a 2-core CPU machine can afford: the KDA chunk kernels (notebook 05's) under the interpreter,
# exact against their references; notebook 05 itself; and the ISA report (every kernel compiled for
# gfx950 and gfx942, held to k3lab/isa/known.py), plus the sm90 compile of the KDA prologue (Triton's
# own ptxas reads it). Its own virtual environment outside the checkout: torch 2.13.0 (the CPU build on
# disk here) and TRITON_NEXT; nothing of the main environment is touched.
#   TRITON_NEXT      the Triton to test (default triton==3.9.0, the newest release when this was written)
#   TRITON_NEXT_VENV where its environment goes (default /tmp/k3lab-triton-next; reused when it exists)
set -euo pipefail
cd "$(dirname "$0")/.."
spec="${TRITON_NEXT:-triton==3.9.0}"
venv="${TRITON_NEXT_VENV:-/tmp/k3lab-triton-next}"
py="$venv/bin/python"
t0=$SECONDS
if [ ! -x "$py" ]; then
  python3 -m venv "$venv"
fi
"$py" -m pip install -q torch==2.13.0 "$spec"
"$py" -m pip install -q -e '.[dev]'
# the install must not have replaced the Triton under test (k3lab's requirements name none)
want="${spec#triton==}"
have="$("$py" -c 'import triton; print(triton.__version__)')"
if [ "$want" != "$spec" ] && [ "$have" != "$want" ]; then
  echo "k3lab CI (next Triton): asked for $spec, the environment has triton $have" >&2
  exit 1
fi
echo "k3lab CI (next Triton): triton $have, torch $("$py" -c 'import torch; print(torch.__version__)')," \
     "environment ready in $((SECONDS - t0)) s"
export TRITON_INTERPRET=1
"$py" -m pytest -q tests/test_kda_chunk.py -p no:cacheprovider
"$py" -m pytest -q notebooks/05_kda_scan.ipynb --nbval-lax --nbval-current-env -p no:cacheprovider
# the ISA report compiles (its workers set TRITON_INTERPRET=0 themselves)
"$py" -m pytest -q tests/test_isa.py -p no:cacheprovider
"$py" -m k3lab.isa --target sm90 --case kda_chunk
echo "k3lab CI (next Triton): passed in $((SECONDS - t0)) s"
