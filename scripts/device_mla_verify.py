"""Issue 5, verification groups: the Triton split kernel against the CUDA kernel with each token a
one-token request (mla_decode_cuda.plan_verify), a block per token sharing tiles through L2 ('l2') or
two tokens per block in one product ('pairs'; an odd group padded by one zero-query token). Every form is
checked against the fp32 reference
on the study's first input set, then timed by graph replay over the study's rotated sets. Cases from
$CASES (default below: 'B x context x q_len'). Writes $OUT/verify_share.json and prints a table.
"""
import json
import os
import zlib

import torch

from k3lab import bench, env
from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
spec = os.environ.get("CASES", "1x32768x2,1x32768x3,1x32768x4,1x32768x8,8x8192x2,8x8192x4,1x131072x4")
FORMS = {
    "triton": lambda s: mla.plan_after(s["q"], s["pool"], s["lengths"], block_table=s["table"], kernel="split"),
    "l2": lambda s: mc.plan_verify(s["q"], s["pool"], s["lengths"], block_table=s["table"], share="l2"),
    "pairs": lambda s: mc.plan_verify(s["q"], s["pool"], s["lengths"], block_table=s["table"], share="pairs"),
}
rows = {}
for item in spec.split(","):
    B, ctx, tq = (int(x) for x in item.split("x"))
    case = st.Case(f"verify{tq}_{B}x{ctx}", B, ctx, q_len=tq)
    first = st._make_set(case, 12, torch.bfloat16, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, 12, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64) - 1)]
    ref_o, ref_l = mla.reference(first["q"].float(), first["cache"].float(), lengths=first["lengths"])
    floor = bench.floor_us(bytes=nbytes)
    row = {"batch": B, "context": ctx, "q_len": tq, "floor_us": floor, "forms": {}}
    for name, make in FORMS.items():
        plans = [make(s) for s in sets]
        o, lse = plans[0]()
        err = bench.check_all({"o": (o, ref_o), "lse": (lse, ref_l)}, dtype=torch.bfloat16)
        t = bench.time_fn(lambda p: p(), rotate=[(p,) for p in plans], graph=True, warmup=10, repeats=100)
        facts = plans[0].facts() if hasattr(plans[0], "facts") else {}
        row["forms"][name] = {"us": t.median_us, "rel_l2": err["o"]["rel_l2"], "splits": facts.get("num_splits")}
        print(f"{case.name:18s} {name:10s} {t.median_us:8.2f} us  rel_l2 {err['o']['rel_l2']:.1e}  "
              f"splits {facts.get('num_splits')}", flush=True)
    rows[case.name] = row
    del sets, first
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()), "commit": bench.git_commit(),
           "rows": rows}, open(os.path.join(out, "verify_share.json"), "w"), indent=1)
print("case                triton      l2   pairs  (us, graph replay)")
for name, r in rows.items():
    f = r["forms"]
    pairs = f"{f['pairs']['us']:8.2f}" if "pairs" in f else "       -"
    print(f"{name:18s} {f['triton']['us']:8.2f} {f['l2']['us']:8.2f} {pairs}")
