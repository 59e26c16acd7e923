#!/usr/bin/env bash
# AttnRes + RMSNorm on a GPU, in one call:
#  1. registers/spills of every kernel variant of copy_removal.ATTN_RES_VARIANTS as compiled for 9 sources;
#  2. the launch sweep (checked first, graph replay, `before` alongside) at the shapes of ATTN_RES_SHAPES
#     ("T:S,S;T:S" e.g. "1:2,5,9;64:9"; default: the study's whole sweep), variants ATTN_RES_SWEPT
#     (comma list; default: the study's choice per shape); $OUT/attn_res_sweep.json after every shape;
#  3. MAIN=1: rows of <= 8 tokens spread over several programs (arn.SPREAD_MAX_TOKENS = 8, the best
#     spread variant) if that beat the all-blocks tile over the sweep's shapes of <= 8 tokens, then the
#     study's main AttnRes cases
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
    if c.get("spread"):
        n_prog = -(-cr.HIDDEN_GPU // c["spread"])
        part = torch.empty(n_prog * 272, device=x.prefix.device)
        k = arn._attn_res_norm_spread_kernel[(1, n_prog)](
            *common[:6], part, arn._epoch_slots(x.prefix.device, 1), *common[6:], 1e-5, 1 << 22, NS=16,
            CHUNK=c["spread"], P=n_prog, P_POW2=1 << (n_prog - 1).bit_length(), EXACT_DOT=0, **flags)
    elif c["split"]:
        w0, w1, w2 = arn.row_pieces(cr.HIDDEN_GPU)
        k = arn._attn_res_norm_split_kernel[(1,)](*common, 1e-5, NBP=8, W0=w0, W1=w1, W2=w2,
                                                   WIDEN_ONCE=c["widen_once"], **flags)
    else:
        k = arn._attn_res_norm_kernel[(1,)](*common, 0, 1e-5, BLOCK_D=8192, GROUP=c["group"], PREFETCH=c["prefetch"],
                                            W_RELOAD=c["w_reload"], STAGES=c["stages"], **flags)
    if k is None:  # Triton's interpreter (a CPU dry run) compiles nothing
        continue
    res[name] = {"n_regs": k.n_regs, "n_spills": k.n_spills, "shared": k.metadata.shared}
    print(f"{name:14s} regs {k.n_regs:4d} spills {k.n_spills:4d} smem {k.metadata.shared}", flush=True)
json.dump(res, open(f"{out}/attn_res_regs.json", "w"), indent=1)
print(f"compiled in {time.time() - t0:.0f} s", flush=True)

# a variant that fails its check is dropped here (said so) rather than ending the whole sweep
for name in list(swept):
    try:
        xx = cr.attn_res_inputs(2, 9, cr.HIDDEN_GPU)
        ref = arn.before(xx.prefix.clone(), xx.delta, xx.blocks.clone(), xx.n_blocks, *xx.args()[4:])
        cfg = {k: v for k, v in cr.ATTN_RES_VARIANTS[name].items()}
        got = arn.after(xx.prefix.clone(), xx.delta, xx.blocks.clone(), xx.n_blocks, *xx.args()[4:],
                        mix_weight=xx.mix_weight, **cfg)
        cr.bench.check(got, ref, dtype=xx.prefix.dtype, name=name)
    except Exception as e:  # noqa: BLE001
        print(f"DROPPED {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        swept.remove(name)
        shapes = {k: [v for v in vs if v != name] for k, vs in (shapes or {}).items()}

def save(records):
    json.dump([r.to_dict() for r in records], open(f"{out}/attn_res_sweep.json", "w"), indent=1)
    print(f"{time.time() - t0:5.0f} s  done {records[-1].case.split('.')[0]}", flush=True)

records = cr.attn_res_sweep(shapes=shapes, on_shape=save)
import pandas as pd
pd.set_option("display.width", 200)
table = cr.sweep_table(records)
print(table.round(3).to_string(index=False))
if os.environ.get("MAIN") == "1":
    # a few tokens: spread each row over several programs if the best spread variant beats the
    # all-blocks tile in total over the swept shapes of <= 8 tokens
    few = table[table["shape"].str.match(r"attn_res_t[1-8]_")]
    totals = few.groupby("variant")["after_us"].sum()
    spreads = [v for v in totals.index if cr.ATTN_RES_VARIANTS[v].get("spread")]
    if spreads and "tile8" in totals and totals[spreads].min() < totals["tile8"]:
        best = totals[spreads].idxmin()
        arn.SPREAD_MAX_TOKENS, arn.SPREAD_CONFIG = 8, dict(cr.ATTN_RES_VARIANTS[best])
    else:
        best = "tile8"
        arn.SPREAD_MAX_TOKENS = 0
    print(f"tokens <= 8: {best} (totals {totals.round(2).to_dict()})", flush=True)
    main = cr.run(cases=[c for c in cr.case_names() if c.startswith("attn_res")])
    for r in main:
        r.extra["few_tokens_variant"] = best
    json.dump([r.to_dict() for r in main], open(f"{out}/attn_res_main.json", "w"), indent=1)
    # traces of the study's profile targets, in this process so that they use the configuration chosen
    from k3lab import profile
    os.makedirs(f"{out}/tr", exist_ok=True)
    for variant, fn in cr.profile_targets().items():
        cap = profile.capture(fn, steps=3, warmup=1, trace_dir=f"{out}/tr", name=f"copy_removal-{variant}")
        print(f"== {variant}: {cap.counts()}", flush=True)
    print(cr.bench.compare(main)[["case", "mode", "before_us", "after_us", "floor_us", "speedup",
                                  "floor_fraction"]].round(3).to_string(index=False))
PY
