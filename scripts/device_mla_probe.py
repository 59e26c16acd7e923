"""One device call: where the CUDA MLA decode's time goes (kernels/mla_decode.cu, timeline probe).

Prints, for each form in $FORMS (default: split) at ctx32k and ctx128k (B = 1, 12 heads, paged bf16, the mla_padding
study's inputs): the graph-replay time; the per-block timeline (start skew, first tile landed, loop,
end) and thread 0's cycles in tile waits and barriers (form 'wgmma': sync_cyc is the cycles until its
first tiles were requested), from the probe; the merge's window; and, for
scale, a plain read of the same cache bytes by torch (sum over a bf16 view). Writes
$OUT/mla_probe.json.   OUT=dir [FORMS=team,split,wgmma] python3 scripts/device_mla_probe.py
Other builds of kernels/mla_decode.cu (each with its own -Dk3mla=... namespace) are probed as form
'wgmma-<label>' when given as WG_VARIANTS=label:path,... (as in scripts/device_mla_wgmma.py); CASES picks
among ctx32k, ctx128k.
"""
import json
import os
import statistics as stt

import torch

from k3lab import bench, env
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
builds = {f"wgmma-{label}": lib for label, lib in mc.load_variants(os.environ.get("WG_VARIANTS", "")).items()}
real_library = mc._library
cases = os.environ.get("CASES", "ctx32k,ctx128k").split(",")
res = {}
for spec, name, ctx in [(f, n, c) for f in [x for x in os.environ.get("FORMS", "split").split(",") if x] + list(builds)
                        for n, c in (("ctx32k", 32768), ("ctx128k", 131072)) if n in cases]:
    mc._library = (lambda lib=builds[spec]: lib) if spec in builds else real_library
    form = "wgmma" if spec in builds else spec
    case = st.Case(name, 1, ctx)
    # as the study times it: input sets in rotation (cold cache bytes), and the probed runs after an L2 flush
    sets = [st._make_set(case, 12, torch.bfloat16, seed=5 + i) for i in range(bench.rotation_count(st.cache_bytes(case, torch.bfloat16)))]
    s = sets[0]
    plans = [mc.plan(x["q"], x["pool"], x["lengths"], block_table=x["table"], form=form) for x in sets]
    p0 = plans[0]
    probe = torch.zeros(mc.probe_size(1, 12, p0.num_splits), dtype=torch.int64, device="cuda")
    pp = mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], probe=probe, form=form)
    t_plain = bench.time_fn(lambda p: p(), rotate=[(p,) for p in plans], graph=True, warmup=10, repeats=100).median_us
    t_probe = bench.time_fn(pp, graph=True, warmup=10, repeats=100).median_us
    flush = torch.empty(2 * torch.cuda.get_device_properties(0).L2_cache_size, dtype=torch.uint8, device="cuda")
    runs = []
    for _ in range(5):
        flush.fill_(1)
        pp()
        torch.cuda.synchronize()
        runs.append(mc.timeline(probe, 1, 12, p0.num_splits))
    # a plain read of the same bytes (the pool pages this request uses)
    nbytes = st.cache_bytes(case, torch.bfloat16, s["lengths_host"])
    flat = s["pool"].view(-1)[: nbytes // 2]
    t_read = bench.time_fn(lambda: flat.sum(dtype=torch.float32), graph=True, warmup=10, repeats=100).median_us
    summ = []
    for tl in runs:
        bl = tl["blocks"]
        med = lambda k: stt.median(b[k] - b["start"] for b in bl)  # noqa: E731
        summ.append({"start_spread": max(b["start"] for b in bl), "first_med": med("first"),
                     "first_max": max(b["first"] - b["start"] for b in bl), "loop_med": stt.median(b["loop_end"] - b["first"] for b in bl),
                     "end_max": max(b["end"] for b in bl), "end_med": stt.median(b["end"] for b in bl),
                     "wait_cyc_med": stt.median(b["wait_cycles"] for b in bl), "sync_cyc_med": stt.median(b["sync_cycles"] for b in bl),
                     "tiles": bl[0]["tiles"], "sms": len({b["sm"] for b in bl}),
                     "merge_start": min(m["start"] for m in tl["merge"]) if tl["merge"] else None,
                     "merge_end": max(m["end"] for m in tl["merge"]) if tl["merge"] else None})
    res[f"{spec}.{name}"] = {"graph_us": t_plain, "graph_probe_us": t_probe, "torch_sum_read_us": t_read, "bytes": nbytes,
                 "splits": p0.num_splits, "chunk": p0.chunk, "summaries": summ, "last_timeline": runs[-1]}
    print(f"{spec} {name}: graph {t_plain:.2f} us rotated (probe {t_probe:.2f} warm), torch sum read {t_read:.2f} us "
          f"({nbytes / t_read / 1e6:.2f} TB/s), splits {p0.num_splits}")
    for x in summ[-3:]:
        print("  " + "  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in x.items()))
json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()), "commit": bench.git_commit(),
           "rows": res}, open(f"{out}/mla_probe.json", "w"), indent=1)
