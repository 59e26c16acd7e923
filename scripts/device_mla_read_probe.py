"""Issue 5, one device call: the read floor of the MLA decode's cache bytes, measured the way the decode
is (the mla_padding study's inputs and rotation, graph replay, many calls per graph), beside the decode.

Readers (scripts/mla_read_probe.cu, built here with nvcc): `ldg` streams the contiguous cache with
16-byte loads; `ring.*` is the decode's own data path without arithmetic (bulk copies into a 5-tile
ring, one block per SM, through the block table); `+tail` adds an empty PDL kernel after the reader,
as the merge follows the decode's split kernel. Prints a table (us and share of the measured copy
bandwidth, k3lab.env.PEAKS) and writes $OUT/read_probe.json.
    OUT=dir PYTHONPATH=. python3 scripts/device_mla_read_probe.py
"""
import ctypes
import json
import os
import subprocess
import zlib

import torch

from k3lab import bench, env
from k3lab.studies import mla_padding as st

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
so = "/tmp/mla_read_probe.so"
subprocess.run(["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                "scripts/mla_read_probe.cu", "-o", so], check=True)
lib = ctypes.CDLL(so)
lib.probe_ldg.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
lib.probe_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int,
                                                                                      ctypes.c_void_p]
bw = env.PEAKS["H200"].bandwidth_tbs * 1e12
sms = torch.cuda.get_device_properties(0).multi_processor_count
sink = torch.zeros(16, dtype=torch.int32, device="cuda")


def stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {rc}")


def ldg(blocks, tail=0):
    return lambda s: check(lib.probe_ldg(s["cache"].data_ptr(), s["cache"].numel() * 2, blocks, sink.data_ptr(), tail,
                                         stream()), "ldg")


def ring(blocks, stages=5, inter=0, cpt=8, tail=0):
    def f(s):
        ntiles = s["lengths_host"][0] // 32
        check(lib.probe_ring(s["pool"].data_ptr(), s["table"].data_ptr(), ntiles, blocks, stages, inter, cpt,
                             sink.data_ptr(), tail, stream()), "ring")
    return f


rows = {}
for name, ctx in (("ctx32k", 32768), ("ctx128k", 131072)):
    case = next((c for c in st.cases() if c.name == name), st.Case(name, 1, ctx))
    first = st._make_set(case, 12, torch.bfloat16, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, 12, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64) - 1)]
    variants = {
        "decode (after, default)": lambda s: st._plan("after", case, s, 12)(),
        "torch sum (contiguous)": lambda s: s["cache"].view(-1).sum(dtype=torch.float32),
        f"ldg {4 * sms} blocks": ldg(4 * sms),
        f"ldg {2 * sms} blocks": ldg(2 * sms),
        f"ldg {4 * sms} blocks +tail": ldg(4 * sms, tail=192),
        "ring split 128 (decode path)": ring(128),
        f"ring split {sms}": ring(sms),
        "ring split 128, 4 stages": ring(128, stages=4),
        "ring split 128, 1 copy/tile": ring(128, cpt=1),
        f"ring round-robin {sms}": ring(sms, inter=1),
        "ring split 128 +tail": ring(128, tail=192),
    }
    for s in sets:
        st._plan("after", case, s, 12)
    res = {}
    for label, fn in variants.items():
        t = bench.time_fn(fn, rotate=[(s,) for s in sets], graph=True, warmup=10, repeats=60)
        res[label] = {"us": t.median_us, "p20": t.p20_us, "p80": t.p80_us, "share": nbytes / bw / (t.median_us * 1e-6)}
        print(f"{name:8s} {label:32s} {t.median_us:8.2f} us  {100 * res[label]['share']:5.1f}% of copy bw", flush=True)
    rows[name] = {"bytes": nbytes, "sets": len(sets), "floor_us": nbytes / bw * 1e6, "variants": res}
    del sets, first
    torch.cuda.empty_cache()
json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()),
           "commit": bench.git_commit(), "copy_bandwidth_tbs": bw / 1e12, "rows": rows},
          open(os.path.join(out, "read_probe.json"), "w"), indent=1)
