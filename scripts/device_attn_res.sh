#!/usr/bin/env bash
# AttnRes + RMSNorm on a GPU, in one call:
#  1. registers/spills of every kernel variant of copy_removal.ATTN_RES_VARIANTS as compiled for 9 sources;
#  2. the launch sweep (checked first, graph replay, `before` alongside) at the shapes of ATTN_RES_SHAPES
#     ("T:S,S;T:S" e.g. "1:2,5,9;64:9"; default: the study's whole sweep), variants ATTN_RES_SWEPT
#     (comma list; default: the study's choice per shape); $OUT/attn_res_sweep.json after every shape;
#  3. SPREAD=1: the CUDA kernel kernels/attn_res_norm.cu (a cluster per row, and its one-block mode)
#     checked, then timed at 1 and 8 tokens beside `before` and Triton's tile8 ($OUT/attn_res_spread.json;
#     until commit dc23e22 this step also timed k3lab/ops/attn_res_spread.py, a Triton row spread over
#     programs with a barrier in memory: 7.3-11 us, slower than both, since removed);
#  4. MAIN=1: the study's main AttnRes cases with launch_config's choices
#     ($OUT/attn_res_main.json; each record names its launch) and fresh before/after traces ($OUT/tr/).
#   OUT=dir K3LAB_COMMIT=<hash> [ATTN_RES_SHAPES=...] [ATTN_RES_SWEPT=...] [MAIN=1] bash scripts/device_attn_res.sh
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-}:." PYTHONUNBUFFERED=1
OUT="${OUT:-build/device}"; mkdir -p "$OUT"
timeout "${SWEEP_TIMEOUT:-180}" python3 - "$OUT" <<'PY'
import json, os, sys, time
import torch
from k3lab.ops import attn_res_norm as arn
from k3lab.studies import copy_removal as cr
out = sys.argv[1]
t0 = time.time()
swept = [v for v in os.environ.get("ATTN_RES_SWEPT", "").split(",") if v]
shapes = None
if os.environ.get("ATTN_RES_SHAPES"):
    shapes = {}
    for part in os.environ["ATTN_RES_SHAPES"].split(";"):
        t, ss = part.split(":")
        for s in ss.split(","):
            shapes[(int(t), int(s))] = swept or cr.ATTN_RES_SWEEP.get((int(t), int(s)), list(cr.ATTN_RES_VARIANTS))

# registers and spills of each variant as compiled for 9 sources (one launch returns the kernel)
x = cr.attn_res_inputs(1, 9, cr.HIDDEN_GPU)
res = {}
for name, c in cr.ATTN_RES_VARIANTS.items():
    if swept and name not in swept:
        continue
    common = (x.prefix, x.delta, x.blocks, torch.empty_like(x.prefix), x.mix_weight, x.next_norm_w,
              x.blocks.stride(0))
    flags = dict(D=cr.HIDDEN_GPU, N_BLOCKS=8, HAS_DELTA=True, PUSH=False, INT_ROUND=c.get("int_round", 0),
                 num_warps=c["num_warps"])
    k = arn._attn_res_norm_kernel[(1,)](*common, 0, 1e-5, BLOCK_D=8192, GROUP=c["group"], PREFETCH=c["prefetch"],
                                        W_RELOAD=c["w_reload"], STAGES=c["stages"], **flags)
    if k is None:  # Triton's interpreter (a CPU dry run) compiles nothing
        continue
    res[name] = {"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
    print(f"{name:14s} regs {k.n_regs:4d} spills {k.n_spills:4d} smem {k.metadata.shared}", flush=True)
json.dump(res, open(f"{out}/attn_res_regs.json", "w"), indent=1)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)

def save(records):
    json.dump([r.to_dict() for r in records], open(f"{out}/attn_res_sweep.json", "w"), indent=1)
    print(f"{time.time() - t0:5.0f} s  done {records[-1].case.split('.')[0]}", flush=True)

records = cr.attn_res_sweep(shapes=shapes, on_shape=save)
import pandas as pd
pd.set_option("display.width", 200)
table = cr.sweep_table(records)
print(table.round(3).to_string(index=False))
if os.environ.get("SPREAD") == "1":
    # the CUDA kernel's two modes beside tile8, checked first (a failure is reported and left out;
    # its first call compiles it)
    from k3lab.ops import attn_res_cuda as arc
    few = {f"cuda{m}": (lambda *a, m=m, **k: arc.cuda_after(*a, mode=m, **k)) for m in ("cluster", "block")}
    recs = cr.attn_res_sweep(shapes={shape: ["tile8", *few] for shape in ((1, 2), (1, 5), (1, 9), (8, 9))},
                             kernels=few, skip_failures=True)
    json.dump([r.to_dict() for r in recs], open(f"{out}/attn_res_spread.json", "w"), indent=1)
    print(cr.sweep_table(recs).round(3).to_string(index=False), flush=True)
if os.environ.get("MAIN") == "1":
    main = cr.run(cases=[c for c in cr.case_names() if c.startswith("attn_res")])
    json.dump([r.to_dict() for r in main], open(f"{out}/attn_res_main.json", "w"), indent=1)
    # traces of the study's profile targets (before and after, 64 tokens, 9 sources)
    from k3lab import profile
    os.makedirs(f"{out}/tr", exist_ok=True)
    for variant, fn in cr.profile_targets().items():
        cap = profile.capture(fn, steps=3, warmup=1, trace_dir=f"{out}/tr", name=f"copy_removal-{variant}")
        print(f"== {variant}: {cap.counts()}", flush=True)
    print(cr.bench.compare(main)[["case", "mode", "before_us", "after_us", "floor_us", "speedup",
                                  "floor_fraction"]].round(3).to_string(index=False))
PY
