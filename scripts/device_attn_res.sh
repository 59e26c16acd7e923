#!/usr/bin/env bash
# AttnRes + RMSNorm on a GPU, the launch sweep: every kernel variant of copy_removal.ATTN_RES_VARIANTS
# at its shapes (checked first, graph replay, `before` alongside), the compiled registers/spills of each
# variant at 9 sources, and a table of speed-up and fraction of the floor per shape with the best marked.
# Writes $OUT/attn_res_sweep.json after every shape (a timeout still leaves what was measured).
#   OUT=dir bash scripts/device_attn_res.sh          (the main records: k3lab bench copy_removal --cases ...)
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"
timeout "${SWEEP_TIMEOUT:-180}" python3 - "$OUT" <<'PY'
import json, sys, time
import torch
from k3lab.ops import attn_res_norm as arn
from k3lab.studies import copy_removal as cr
out = sys.argv[1]
t0 = time.time()
# registers and spills of each variant as compiled for 9 sources (one launch returns the kernel)
x = cr.attn_res_inputs(1, 9, cr.HIDDEN_GPU)
res = {}
for name, c in cr.ATTN_RES_VARIANTS.items():
    k = arn._attn_res_norm_kernel[(1,)](
        x.prefix, x.delta, x.blocks, torch.empty_like(x.prefix), x.mix_weight, x.next_norm_w, x.blocks.stride(0), 0,
        1e-5, D=cr.HIDDEN_GPU, N_BLOCKS=8, HAS_DELTA=True, PUSH=False, BLOCK_D=8192, GROUP=c["group"],
        PREFETCH=c["prefetch"], W_RELOAD=c["w_reload"], STAGES=c["stages"], num_warps=c["num_warps"])
    res[name] = {"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
    print(f"{name:14s} regs {k.n_regs:4d} spills {k.n_spills:4d} smem {k.metadata.shared}", flush=True)
json.dump(res, open(f"{out}/attn_res_regs.json", "w"), indent=1)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)

def save(records):
    json.dump([r.to_dict() for r in records], open(f"{out}/attn_res_sweep.json", "w"), indent=1)
    r = records[-1]
    print(f"{time.time() - t0:5.0f} s  done {r.case.split('.')[0]}", flush=True)

records = cr.attn_res_sweep(on_shape=save)
import pandas as pd
pd.set_option("display.width", 200)
print(cr.sweep_table(records).round(3).to_string(index=False))
PY
