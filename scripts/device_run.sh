#!/usr/bin/env bash
# Reproduce a study's committed records on a GPU machine:
#
#   scripts/device_run.sh STUDY [CASE ...]      (run from the repository root)
#
# Runs `k3lab bench STUDY --cases CASE ... --json DIR/STUDY.json` (DIR: $OUT when set, else
# build/device; no CASE: the study's headline cases below, or every case for a study not listed),
# and prints the compact before / after / peer table. Bring DIR/STUDY.json back and commit the
# records with `k3lab import STUDY.json --overwrite`.
#
# Installs nothing silently: fla-core (the KDA peer) is installed only from wheels carried in .whl/
# (the device has no network), and the script says so; without it the peer is left out and said so.
# K3LAB_COMMIT (the commit of the tree sent, e.g. $(git rev-parse --short HEAD) evaluated before the
# call) names the records' commit where the device's copy carries no usable .git.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
study=$1
shift

declare -A HEADLINE=(
  [kda_decode]="B1_H12 B128_H12"
  [kda_verify]="b1_t4"
  [copy_removal]="attn_res_t1_s2 attn_res_t1_s5 attn_res_t1_s9 attn_res_t64_s2 attn_res_t64_s5 attn_res_t64_s9 attn_res_t8192_s2 attn_res_t8192_s5 attn_res_t8192_s9"
)
cases=("$@")
if [[ ${#cases[@]} -eq 0 && -n "${HEADLINE[$study]:-}" ]]; then
  read -r -a cases <<<"${HEADLINE[$study]}"
fi

out=${OUT:-build/device}
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
python=${PYTHON:-python3}

if ! "$python" -c "import fla" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "installing the carried wheels from .whl/ into /tmp/k3lab-site: $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
    "$python" -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/k3lab-site .whl/*.whl
    export PYTHONPATH="/tmp/k3lab-site:$PYTHONPATH"
  else
    echo "fla-core is not installed and no wheel is carried in .whl/: the fla peer is left out"
  fi
fi

"$python" -m k3lab.cli info || true
args=(bench "$study" --json "$out/$study.json" --out "$out")
if [[ ${#cases[@]} -gt 0 ]]; then
  args+=(--cases "${cases[@]}")
fi
echo "+ k3lab ${args[*]}"
"$python" -m k3lab.cli "${args[@]}"
