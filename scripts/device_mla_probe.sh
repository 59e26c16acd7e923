#!/usr/bin/env bash
# One device call: the CUDA MLA decode's timeline probe (scripts/device_mla_probe.py) and Nsight
# Compute's stall reasons for its split kernel at 32K.   OUT=dir bash scripts/device_mla_probe.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"
timeout 200 python3 scripts/device_mla_probe.py 2>&1 | tail -30
cat > /tmp/mla_ncu.py <<'PY'
import torch
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st
s = st._make_set(st.Case("ctx32k", 1, 32768), 12, torch.bfloat16, seed=3)
p = mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"])
for _ in range(3):
    p()
torch.cuda.synchronize()
PY
timeout 120 ncu -k regex:split_kernel --launch-skip 2 --launch-count 1 --csv --print-units base \
  --metrics "gpu__time_duration.sum,smsp__inst_executed.sum,sm__cycles_elapsed.max,smsp__cycles_active.avg,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
  python3 /tmp/mla_ncu.py > "$OUT/ncu_stalls.csv" 2>&1
python3 - "$OUT/ncu_stalls.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 3 and r[-3].startswith(("gpu__", "smsp__", "sm__"))]
vals = sorted(((r[-3].replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", ""), float(r[-1].replace(",", ""))) for r in rows), key=lambda x: -x[1])
for k, v in vals[:16]:
    print(f"{k:40s} {v:12.3f}")
PY
