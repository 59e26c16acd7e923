#!/usr/bin/env bash
# One device call (issue 5): the CUDA MLA decode's and the FlashMLA peer's GPU tests (the peer's library
# carried in .cache/peers: python -m k3lab.ops.flashmla_peer fetch), the mla_padding study's cases (records),
# and the three split-kernel forms timed side by side (scripts/device_mla_wgmma.py). With BREAKDOWN=1,
# also where the time goes, as notebook 04 draws it: the readers of the same bytes (read_probe.json),
# the diagnostic builds beside the decode (merge_cost.json: no arithmetic, empty merge, both, arithmetic
# only; built here first by scripts/build_mla_variants.sh into .cache/variants/), per-kernel durations
# (kernel_times.json) and the timeline probe (mla_probe.json). Results under $OUT.
#   OUT=dir K3LAB_COMMIT=<hash> [BREAKDOWN=1] bash scripts/device_mla_records.sh
set -uo pipefail
source scripts/device_env.sh
export K3LAB_KERNEL_CACHE="${K3LAB_KERNEL_CACHE:-$PWD/.cache/kbuild}"
echo "== tests"
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_mla_decode_cuda.py tests/test_flashmla_peer.py tests/test_mla_before_cuda.py 2>&1 | tail -4 | tee "$OUT/tests.txt"
echo "== study"
timeout 300 python3 -m k3lab.cli bench mla_padding --cases ctx1k ctx32k ctx128k b1_8k b8_8k b64_8k ragged8_8k verify2_32k verify4_32k \
  verify2_32k.triton verify4_32k.triton verify2_b8_8k.triton verify2_b8_8k.cuda verify4_b8_8k.triton verify4_b8_8k.cuda \
  verify3_32k.triton verify3_32k.cuda verify3_b8_8k.triton verify3_b8_8k.cuda tune.ctx1k.before.bn32w8s2 \
  tune.ctx32k.before.bn32w8s2 tune.ctx32k.before.bn64w8s2 verify3_32k verify5_32k verify6_32k verify7_32k verify8_32k \
  --json "$OUT/main.json" 2>&1 | grep -v Warn | tail -30
echo "== kernels, ours and FlashMLA's"
FORMS=wgmma,flashmla CASES=ctx1k,ctx32k,ctx128k timeout 90 python3 scripts/device_mla_kernel_times.py 2>&1 | grep -v -i warn | tail -8
mv "$OUT/kernel_times.json" "$OUT/flashmla_kernels.json" 2>/dev/null
echo "== forms"
CHECK_FORMS=halves TIME_FORMS=split,wgmma,halves timeout 150 python3 scripts/device_mla_wgmma.py 2>&1 | grep -v "^check" | tail -12
mv "$OUT/wgmma.json" "$OUT/forms.json" 2>/dev/null
if [ "${BREAKDOWN:-0}" = 1 ]; then
  echo "== breakdown"
  V=.cache/variants
  timeout 60 python3 scripts/device_mla_read_probe.py 2>&1 | tail -22
  CASES=ctx32k,ctx128k,b8_8k TIME_FORMS=wgmma,wgmma/np,split \
    WG_VARIANTS=data-only:$V/d.so,dme-data-only:$V/dme.so,me-no-merge:$V/me.so,co-unchecked:$V/co.so \
    timeout 120 python3 scripts/device_mla_wgmma.py 2>&1 | grep -v "^check" | tail -22
  mv "$OUT/wgmma.json" "$OUT/merge_cost.json" 2>/dev/null
  WG_DIAG_SO=$V/d.so timeout 60 python3 scripts/device_mla_kernel_times.py 2>&1 | grep -v -i warn | tail -8
  FORMS=wgmma,split timeout 80 python3 scripts/device_mla_probe.py 2>&1 | tail -10
fi
