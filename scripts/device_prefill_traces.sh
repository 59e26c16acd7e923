#!/usr/bin/env bash
# One device call: torch.profiler traces of one KDA prefill call per variant (before, after, fla) at
# 12 heads x 16K tokens, B = 1 (kda_scan.profile_targets), gzipped into $OUT. fla's compiled kernels
# come from the carried Triton cache (.cache/tcache.tgz) where there is one.
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_prefill_traces.sh
source "$(dirname "$0")/device_env.sh"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout "${TRACE_TIMEOUT:-150}" python3 - "$W" <<'PY'
import sys
from k3lab import profile
from k3lab.studies import kda_scan
for variant, fn in kda_scan.profile_targets().items():
    cap = profile.capture(fn, steps=1, warmup=1, trace_dir=sys.argv[1], name=f"kda_scan-{variant}")
    print(variant, cap.counts(), flush=True)
    print(cap.table.head(8).to_string(index=False), flush=True)
PY
for f in "$W"/*.json; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$(basename "$f").gz"; done
ls "$OUT"
