# Sourced by the scripts/device_round*.sh calls: the environment of one device call. Sets OUT (what
# comes back), W (a work folder bundled into $OUT/all.tgz at the end) and installs the carried
# fla-core wheel (.whl/, git-ignored) where there is one, since the device has no network.
set -uo pipefail
# The device's copy of the tree carries a stale .git: records must name the commit from this side
# (K3LAB_COMMIT=$(git rev-parse --short HEAD) in the command, evaluated before the call is sent).
: "${K3LAB_COMMIT:?set K3LAB_COMMIT to the local commit (the device copy has a stale git HEAD)}"
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; W=/tmp/k3w; mkdir -p "$OUT" "$W"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
