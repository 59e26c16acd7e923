#!/usr/bin/env bash
# Issue 6, first device call: every new prologue / walk-side option checked end to end against fp64
# (2 heads x 4096 tokens, outputs and final state) and timed launch by launch at 12 heads x 16K tokens,
# then the whole after with the fastest of each beside before and fla's chunk_kda (same run).
# Records (sweep points, '.' in their case names) in $OUT/i6.json, log in $OUT/i6_log.txt.
#   OUT=dir K3LAB_COMMIT=<hash> bash scripts/device_prefill_issue6.sh
source "$(dirname "$0")/device_env.sh"
if [ -f .cache/tcache.tgz ]; then mkdir -p /tmp/tc && tar xzf .cache/tcache.tgz -C /tmp/tc && export TRITON_CACHE_DIR=/tmp/tc/triton; fi
timeout "${I6_TIMEOUT:-190}" python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/i6_log.txt"
import json, os, sys, time, traceback
import torch
from k3lab import bench
from k3lab.ops import kda_chunk as kc
from k3lab.studies import kda_scan as ks
out = sys.argv[1]
t0 = time.time()
recs = []
def save():
    json.dump([r.to_dict() for r in recs], open(os.path.join(out, "i6.json"), "w"), indent=1)
name = os.environ.get("I6_CASE", "h12_b1_t16384")
case = ks.parse_case(name); inp = ks.make_inputs(case); runner = ks.Runner(case, inp)
q, k, v, g, beta = runner._args(); S0 = inp["initial_state"]; scale = 128 ** -0.5
check = ks._prologue_checker(os.environ.get("I6_CHECK", "h2_b1_t4096"))
kw = {"warmup": 3, "repeats": 20} if torch.cuda.is_available() else {"warmup": 0, "repeats": 1}
def rec(part, variant, timing, **extra):
    recs.append(bench.make_record(ks.NAME, f"{name}.part_{part}", variant, timing, shape=case.shape(), dtype=case.dtype, **extra))
    print(f"  {part:48s} {timing.median_us:8.1f} us  {extra.get('error', '')}", flush=True)
    return timing.median_us
CANDS = [("rows", {}), ("rows", {"inv_prec": "tf32x3"}), ("rows", {"inv_wu": True}),
         ("rows", {"inv_wu": True, "inv_prec": "tf32x3"}), ("flat", {}), ("flat", {"dot3": True}),
         ("rows", {"maxnreg": 168}), ("flat", {"split": True}), ("flat", {"dot3": True, "maxnreg": 168}),
         ("rows", {"inv_warps": 4}), ("flat", {"dot3": True, "split": True})]
whole = {}
plan = runner.plan_before
for kind, opts in CANDS:
    if time.time() - t0 > 105: print("[prologue candidates: out of time]"); break
    label = f"{kind}_{ks._label(opts)}" if opts else kind
    try:
        fns = kc.prologue_launches(q, k, v, g, beta, plan, scale, runner.work, options=opts, prologue=kind)
        for f in fns.values(): f()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
        parts = {p: rec(f"i6_{label}_{p}", "before", bench.time_fn(f, **kw), prologue=kind, options=opts) for p, f in fns.items()}
        err = check(kind, opts)
        def wh(fs=tuple(fns.values())):
            for f in fs: f()
        el = f"o {err['o']['rel_l2']:.2e} S {err['state']['rel_l2']:.2e}" if "o" in err else err.get("failed", "")[:200]
        t = rec(f"i6_prologue_{label}", "before", bench.time_fn(wh, **kw), prologue=kind, options=opts, check_case="h2_b1_t4096", error=err)
        print(f"    check: {el}", flush=True)
        if "failed" not in err: whole[(kind, label)] = (t, opts)
    except Exception as exc:
        print(f"  {label}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    save()
best_kind, best = min(whole.items(), key=lambda kv: kv[1][0])[0][0], min(whole.items(), key=lambda kv: kv[1][0])[1][1]
print("best prologue:", best_kind, best, f"{time.time()-t0:.0f} s", flush=True)
kc.kda_chunk_prologue(q, k, v, g, beta, plan, scale, runner.work, prologue=best_kind, options=best)
walk = {}
for tag, kwa in [("sb64_w4", {}), ("sb64_w8", {"summary_warps": 8}), ("sc32_w8", {"scan_warps": 8}),
                 ("sc16_w8", {"scan_block": 16, "scan_warps": 8}), ("sc16_w4", {"scan_block": 16}), ("rp64_w8", {"num_warps": 8, "summary_warps": 4})]:
    try:
        parts = kc.after_launches(q, k, v, g, beta, scale, S0, None, plan=runner.plan_after, work=runner.work,
                                  prologue=best_kind, prologue_options=best, **kwa)
        for p in ("summaries", "scan", "replay"): parts[p]()
        for p in ("summaries", "scan", "replay"):
            walk[(tag, p)] = rec(f"i6_{p}_{tag}", "after", bench.time_fn(parts[p], **kw), group_size=runner.group_size, **kwa)
    except Exception as exc:
        print(f"  walk {tag}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    save()
def pick(p, opts):
    c = {t: walk[(t, p)] for t, _ in opts if (t, p) in walk}
    return min(c, key=c.get) if c else None
ta = {"prologue": best_kind, "prologue_options": best}
s = pick("summaries", [("sb64_w4", 0), ("sb64_w8", 0)])
if s == "sb64_w8": ta["summary_warps"] = 8
sc = pick("scan", [("sc32_w8", 0), ("sc16_w8", 0), ("sc16_w4", 0), ("sb64_w4", 0)])
ta.update({"sc32_w8": {"scan_warps": 8}, "sc16_w8": {"scan_block": 16, "scan_warps": 8}, "sc16_w4": {"scan_block": 16}}.get(sc, {}))
if walk.get(("rp64_w8", "replay"), 1e9) < walk.get(("sb64_w4", "replay"), 1e9): ta["num_warps"] = 8
print("tune_after:", ta, f"{time.time()-t0:.0f} s", flush=True)
tb = {"prologue": best_kind, "prologue_options": best}
ref = ks.reference(case, inp, 2, 2)
for gs in (None, 16, 32):
    if time.time() - t0 > 165: break
    try:
        rr = ks.Runner(case, inp, tb, ta) if gs is None else None
        if gs is None:
            fns = {"before": rr.before, "after": rr.after, **({"fla": rr.fla} if ks.fla_available() else {}), "before_default": runner.before, "after_default": runner.after}
        else:
            p2 = kc.make_plan(case.lengths, case.heads, gs, device=q.device)
            fns = {f"after_gs{gs}": (lambda p2=p2, rr2=ks.Runner(case, inp, tb, ta): rr2.after(plan=p2))}
        for vn, fn in fns.items():
            err = ks._run_and_check(case, inp, fn, ref, strict=False)
            tm = bench.time_fn(fn, **({"warmup": 5, "repeats": 50} if torch.cuda.is_available() else kw))
            base = vn.split("_")[0]
            recs.append(bench.make_record(ks.NAME, f"{name}.i6_{vn}", base, tm, shape=case.shape(), dtype=case.dtype,
                                          floor_us=ks.floor_for(case), error=err, tune=(ta if base == "after" else tb) if "default" not in vn and base != "fla" else {}))
            el = f"o {err['o']['rel_l2']:.2e} S {err['state']['rel_l2']:.2e}" if "o" in err else err.get("failed", "")[:200]
            print(f"  {vn:16s} {tm.median_us:8.1f} us ({tm.p20_us:.0f}-{tm.p80_us:.0f})  {el}", flush=True)
    except Exception:
        print(traceback.format_exc()[-1500:], flush=True)
    save()
print(f"done {time.time()-t0:.0f} s", flush=True)
PY
R="smsp__average_warps_issue_stalled_"; S="_per_issue_active.ratio"
M="gpu__time_duration.sum,launch__registers_per_thread,launch__occupancy_limit_registers,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed"
for r in barrier long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait no_instruction lg_throttle not_selected dispatch_stall branch_resolving; do M="$M,$R$r$S"; done
timeout "${NCU_TIMEOUT:-55}" ncu --csv --page raw --metrics "$M" python3 scripts/kda_prefill_ncu_target.py > "$OUT/ncu.csv" 2> "$OUT/ncu_err.txt"
echo "ncu rc $?"; python3 - "$OUT/ncu.csv" <<'PY2' || true
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if rows:
    h = rows[0]
    for r in rows[2:]:
        d = dict(zip(h, r))
        name = d.get("Kernel Name", "?")[:22]
        stalls = {k.split("stalled_")[1].split("_per")[0]: d[k] for k in h if "stalled_" in k}
        top = sorted(((float(v or 0), k) for k, v in stalls.items()), reverse=True)[:5]
        print(name, {k.split("__")[-1][:28]: d[k] for k in h if k.startswith(("gpu__", "launch__", "sm__", "smsp__inst", "dram", "lts"))}, [(k, round(v, 2)) for v, k in top])
PY2
ls "$OUT"
