#!/usr/bin/env bash
# Install what the AMD compile checks need on a Debian/Ubuntu CI machine (no AMD GPU needed):
# clang-19 + lld-19 + llvm-19 (HIP device compile for gfx942, llvm-readelf for code-object notes),
# libamdhip64-dev (the HIP headers) and rocm-device-libs (the device bitcode libraries, ROCm 5.2).
#
#   scripts/ci_amd_toolchain.sh        (as root, or with sudo available)
#
# Idempotent: does nothing when the tools are present. Always exits 0: when apt cannot install them
# it says so, and the tests that need them skip with that reason (tests/test_kernels_build.py).
# Debian's device-library folder lacks oclc_isa_version_942.bc; k3lab.isa.hip links the gfx940 one
# in a private copy of the folder at compile time (the ISA-version library only sets the target's
# version constants).
set -u
PKGS=(clang-19 lld-19 llvm-19 libamdhip64-dev rocm-device-libs)

have_all() {
  command -v clang++-19 >/dev/null 2>&1 && command -v llvm-readelf-19 >/dev/null 2>&1 \
    && [ -d /usr/include/hip ] && ls /usr/lib/*/amdgcn/bitcode/ocml.bc /usr/lib/amdgcn/bitcode/ocml.bc \
       /usr/share/amdgcn/bitcode/ocml.bc 2>/dev/null | grep -q ocml
}

if have_all; then
  echo "ci_amd_toolchain: clang-19, llvm-readelf-19, HIP headers and device libraries already present"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "ci_amd_toolchain: not root and no sudo; AMD C++ compile checks will skip"; exit 0; fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get update -qq >/dev/null 2>&1; then
  echo "ci_amd_toolchain: apt-get update failed; AMD C++ compile checks will skip"; exit 0
fi
if ! $SUDO apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null 2>&1; then
  echo "ci_amd_toolchain: apt-get install ${PKGS[*]} failed; AMD C++ compile checks will skip"; exit 0
fi
if have_all; then
  echo "ci_amd_toolchain: installed ${PKGS[*]}"
else
  echo "ci_amd_toolchain: installed ${PKGS[*]}, but a tool is still missing; AMD C++ compile checks will skip"
fi
exit 0
