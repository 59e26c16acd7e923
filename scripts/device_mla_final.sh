#!/usr/bin/env bash
# One device call: the MLA decode with the CUDA kernel as the default after. GPU tests (CUDA kernel
# and the Triton paths' wiring), then the study's main one-token cases with the Triton split kernel
# beside ('<case>.triton') in one run, then the team kernel's sweep points and timeline probe.
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_mla_final.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"
echo "== tests"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_mla_decode_cuda.py tests/test_mla_decode.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
echo "== study"
timeout 260 python3 -m k3lab.cli bench mla_padding --cases ctx1k ctx32k ctx128k b1_8k b8_8k b64_8k ragged8_8k \
  ctx1k.triton ctx32k.triton ctx128k.triton b1_8k.triton b8_8k.triton b64_8k.triton ragged8_8k.triton \
  --json "$OUT/main.json" 2>&1 | tail -45
echo "== team"
CASES=ctx32k,ctx128k TIMING_ONLY=1 timeout 100 bash scripts/device_mla_cuda.sh 2>&1 | grep -E "team|split|cuda " | tail -14
FORMS=team timeout 60 python3 scripts/device_mla_probe.py 2>&1 | tail -8
