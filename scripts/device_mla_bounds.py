"""Issue 5, one device call: what bounds the before policy at 1K and the decode at 32K, measured beside
the decode, the before and the einsum peer the way the mla_padding study times them (its inputs and rotation, graph
replay, many calls per graph).

The before policy (one block walks a request's whole history; ours runs one block per query row) can be
no faster than one SM streaming that history: `each` readers (scripts/mla_read_probe.cu) have every
block read the whole history by itself, through the block table into a ring of bulk copies (the
decode's data path) or with 16-byte loads over the contiguous cache. At 32K the split decode can be no
faster than the grid streaming the cache and a second kernel behind it (`ring split 128 +tail`).
Prints a table and writes $OUT/bounds.json.
    OUT=dir PYTHONPATH=. python3 scripts/device_mla_bounds.py
"""
import ctypes
import json
import os
import subprocess
import zlib

import torch

from k3lab import bench, env
from k3lab.ops import mla_before_cuda as mb
from k3lab.studies import mla_padding as st

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
so = "/tmp/mla_read_probe.so"
subprocess.run(["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                "scripts/mla_read_probe.cu", "-o", so], check=True)
lib = ctypes.CDLL(so)
vp, ci = ctypes.c_void_p, ctypes.c_int
lib.probe_ldg.argtypes = [vp, ctypes.c_longlong, ci, vp, ci, vp]
lib.probe_ldg_each.argtypes = [vp, ctypes.c_longlong, ci, vp, vp]
lib.probe_ring.argtypes = [vp, vp, ci, ci, ci, ci, ci, vp, ci, vp]
bw = env.PEAKS["H200"].bandwidth_tbs * 1e12
sms = torch.cuda.get_device_properties(0).multi_processor_count
sink = torch.zeros(16, dtype=torch.int32, device="cuda")


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {rc}")


def ldg_each(blocks):
    return lambda s: check(lib.probe_ldg_each(s["cache"].data_ptr(), s["cache"].numel() * 2, blocks, sink.data_ptr(),
                                              stream()), "ldg_each")


def before_direct(s):
    return s["before_direct"]()  # planned before timing (a plan syncs with the host)


def ring(blocks, inter=0, cpt=8, tail=0):
    def f(s):
        ntiles = s["lengths_host"][0] // 32
        check(lib.probe_ring(s["pool"].data_ptr(), s["table"].data_ptr(), ntiles, blocks, 5, inter, cpt,
                             sink.data_ptr(), tail, stream()), "ring")
    return f


rows = {}
for name, ctx in (("ctx1k", 1024), ("ctx32k", 32768)):
    case = next((c for c in st.cases() if c.name == name), st.Case(name, 1, ctx))
    first = st._make_set(case, 12, torch.bfloat16, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, 12, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64) - 1)]
    variants = {
        "after (default)": lambda s: st._plan("after", case, s, 12)(),
        "before (default)": lambda s: st._plan("before", case, s, 12)(),
        "before, direct loads": before_direct,
        "einsum (PyTorch)": lambda s: st._plan("einsum", case, s, 12)(),
        "each: ring, 1 block": ring(1, inter=2),
        "each: ring, 1 block, 1 copy/tile": ring(1, inter=2, cpt=1),
        "each: ring, 12 blocks": ring(12, inter=2),
        "each: ldg, 1 block": ldg_each(1),
        "each: ldg, 12 blocks": ldg_each(12),
        "ring split 128 +tail": ring(128, tail=192),
    }
    for s in sets:
        st._plan("after", case, s, 12)
        assert st._plan("before", case, s, 12).rows_via == "ring"
        s["before_direct"] = mb.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], ring=False)
    res = {}
    for label, fn in variants.items():
        t = bench.time_fn(fn, rotate=[(s,) for s in sets], graph=True, warmup=5, repeats=40)
        per_block_gbs = nbytes / (t.median_us * 1e-6) / 1e9
        res[label] = {"us": t.median_us, "p20": t.p20_us, "p80": t.p80_us,
                      "share": nbytes / bw / (t.median_us * 1e-6), "history_gb_per_s": per_block_gbs}
        print(f"{name:7s} {label:34s} {t.median_us:9.2f} us  {100 * res[label]['share']:6.1f}% of copy bw  "
              f"history at {per_block_gbs:7.1f} GB/s", flush=True)
    rows[name] = {"bytes": nbytes, "sets": len(sets), "floor_us": nbytes / bw * 1e6, "variants": res}
    del sets, first
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()),
           "commit": bench.git_commit(), "copy_bandwidth_tbs": bw / 1e12, "sms": sms, "rows": rows},
          open(os.path.join(out, "bounds.json"), "w"), indent=1)
