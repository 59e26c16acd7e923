"""Issue 6: where the CUDA prologue's time goes (kernels/kda_prologue.cu's timeline probe) at one case.
Prints the prologue's time (eager device events), each stage's median per block, the span of the
launch and how many blocks ran on an SM at once; writes the probe frame to $OUT/probe_<case>.csv.
   PYTHONPATH=. python3 scripts/device_prologue_probe.py [case ...]"""

import os
import sys

import torch

from k3lab import bench
from k3lab.ops import kda_chunk as kc
from k3lab.ops import kda_prologue_cuda as kp
from k3lab.studies import kda_scan as ks

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
for name in sys.argv[1:] or ["h12_b1_t16384"]:
    case = ks.parse_case(name)
    inp = ks.make_inputs(case)
    q, k, v, g, beta = (inp[x] for x in ("q", "k", "v", "g", "beta"))
    H = q.shape[2]
    plan = kc.make_plan(case.lengths, H, device=q.device)
    work = kc._alloc_work(plan.n_chunks, H, q.dtype, q.device)
    fns = {kind: kc.prologue_launches(q, k, v, g, beta, plan, 128**-0.5, work, prologue=kind) for kind in ("cuda", "rows")}
    for kind, parts in fns.items():
        def whole(ps=tuple(parts.values())):
            for f in ps:
                f()
        t = bench.time_fn(whole, warmup=3, repeats=30)
        print(f"{name} prologue {kind:5s} {t.median_us:8.1f} us (p20 {t.p20_us:.1f}, p80 {t.p80_us:.1f})", flush=True)
    probe = torch.zeros(plan.n_chunks * H, kp.probe_words(), dtype=torch.int64, device=q.device)
    for _ in range(3):  # the last of three back-to-back probe launches
        kp.launch(q, k, v, g, beta, plan.chunk_tok, plan.chunk_len, work, n_chunks=plan.n_chunks, heads=H,
                  scale=128**-0.5, spread=kc.SAFE_SPREAD, probe=probe)
    torch.cuda.synchronize()
    frame = kp.timeline(probe)
    frame.to_csv(os.path.join(out, f"probe_{name}.csv"), index=False)
    span = (frame["start_us"] + frame["total_us"]).max()
    print(f"{name}: {len(frame)} blocks, launch span {span:.1f} us (probe build), regs {kp.registers()}, "
          f"smem {kp.shared_bytes()} B")
    print("stage medians per block (us):", {c: round(float(frame[c].median()), 2) for c in (*kp.PROBE_STAGES, "total_us")})
    print("stage p90 per block (us):", {c: round(float(frame[c].quantile(0.9)), 2) for c in (*kp.PROBE_STAGES, "total_us")})
    ends = frame["start_us"] + frame["total_us"]
    mid = span / 2
    live = ((frame["start_us"] <= mid) & (ends >= mid)).groupby(frame["sm"]).sum()
    print(f"blocks live at mid-launch per SM: mean {live.mean():.2f}, max {live.max()}, SMs used {frame['sm'].nunique()}")
