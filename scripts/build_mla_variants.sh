#!/usr/bin/env bash
# Builds the MLA decode's diagnostic variants that scripts/device_mla_records.sh (BREAKDOWN=1) times,
# here where nvcc is, into .cache/variants/ (carried to the device with .cache): each is
# kernels/mla_decode.cu with one build flag and its own namespace (-Dk3mla=...), so several load at once.
#   d    -DK3_MLA_WG_DATA_ONLY=1                     the wgmma form's tile stream, no arithmetic
#   dme  -DK3_MLA_WG_DATA_ONLY=1 -DK3_MLA_MERGE_EMPTY  ... and the merge kernel launched but empty
#   me   -DK3_MLA_MERGE_EMPTY                        the whole decode, the merge kernel empty
#   co   -DK3_MLA_WG_COMPUTE_ONLY=1                  one tile loaded, every tile's arithmetic run on it
# Outputs of all four are meaningless; they are timed only.   bash scripts/build_mla_variants.sh
set -euo pipefail
mkdir -p .cache/variants
nv=(nvcc -O3 -std=c++17 -Ikernels -Xcompiler -fPIC --shared -gencode=arch=compute_90a,code=sm_90a)
"${nv[@]}" -DK3_MLA_WG_DATA_ONLY=1 -Dk3mla=k3v_d kernels/mla_decode.cu -o .cache/variants/d.so &
"${nv[@]}" -DK3_MLA_WG_DATA_ONLY=1 -DK3_MLA_MERGE_EMPTY -Dk3mla=k3v_dme kernels/mla_decode.cu -o .cache/variants/dme.so &
"${nv[@]}" -DK3_MLA_MERGE_EMPTY -Dk3mla=k3v_me kernels/mla_decode.cu -o .cache/variants/me.so &
"${nv[@]}" -DK3_MLA_WG_COMPUTE_ONLY=1 -Dk3mla=k3v_co kernels/mla_decode.cu -o .cache/variants/co.so &
wait
ls -l .cache/variants
