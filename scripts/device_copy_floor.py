"""Issue 5: what a plain device copy, and a sum, of an MLA decode's cache bytes take, timed the way the
decode is (graph replay, many calls per graph): the share of the measured copy bandwidth
(k3lab.env.PEAKS) that they reach at B = 1 and 1K / 32K / 128K tokens (576 bf16 per token) and at
8 x 8K, against the decode's targets (70% at 32K, 80% at 128K).
Prints a table; writes $OUT/copy_floor.json.   PYTHONPATH=. python3 scripts/device_copy_floor.py"""

import json
import os

import torch

from k3lab import bench, env

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
bw = env.PEAKS["H200"].bandwidth_tbs * 1e12
rows = {}
for name, tokens in (("ctx1k", 1024), ("ctx32k", 32768), ("ctx128k", 131072), ("b8_8k", 8 * 8192)):
    n = tokens * 576  # bf16 elements read by the decode
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    t = bench.time_fn(lambda s=src, d=dst: d.copy_(s), graph=True, warmup=5, repeats=50)
    acc = torch.empty((), device="cuda", dtype=torch.float32)
    r = bench.time_fn(lambda s=src, a=acc: torch.sum(s, dim=0, dtype=torch.float32, out=a), graph=True, warmup=5, repeats=50)
    read_only_us = 2 * n / bw * 1e6  # the decode's floor: its bytes read once at the copy bandwidth
    copy_floor_us = 2 * (2 * n) / bw * 1e6  # a copy reads and writes them
    rows[name] = {"bytes_read": 2 * n, "copy_us": t.median_us, "copy_floor_us": copy_floor_us,
                  "copy_share": copy_floor_us / t.median_us, "decode_floor_us": read_only_us,
                  "sum_us": r.median_us, "sum_share": read_only_us / r.median_us}
    print(f"{name:8s} copy {t.median_us:7.2f} us, floor {copy_floor_us:7.2f} us: {100 * copy_floor_us / t.median_us:5.1f}% "
          f"of the measured copy bandwidth; a sum reading the same bytes {r.median_us:7.2f} us: "
          f"{100 * read_only_us / r.median_us:5.1f}% (floor {read_only_us:.2f} us)", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "versions": dict(env.versions()),
           "commit": bench.git_commit(), "rows": rows}, open(os.path.join(out, "copy_floor.json"), "w"), indent=1)
