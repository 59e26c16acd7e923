"""Issue 5, diagnostics: where a graph-replayed MLA decode's time goes, kernel by kernel. Captures a
CUDA graph of 8 back-to-back decodes over the mla_padding study's rotated inputs (as bench.time_fn
does), replays it under torch.profiler and prints, per kernel name, its mean device duration, and
the mean per call of the whole replay (kernels plus the gaps between them). Forms from $FORMS
(default split,wgmma; 'flashmla' is FlashMLA's decode, k3lab.ops.flashmla_peer) over $CASES
(default ctx32k,ctx128k; ctx1k too); with scripts/mla_read_probe.cu built at /tmp/mla_read_probe.so (by
device_mla_read_probe.py), the bare ring reader of the same bytes too. Writes $OUT/kernel_times.json.
"""
import collections
import ctypes
import json
import os
import zlib

import torch

from k3lab import bench, env
from k3lab.ops import flashmla_peer
from k3lab.ops import mla_decode_cuda as mc
from k3lab.studies import mla_padding as st

out = os.environ.get("OUT", "build/device")
os.makedirs(out, exist_ok=True)
forms = os.environ.get("FORMS", "split,wgmma").split(",")
so = "/tmp/mla_read_probe.so"  # built by device_mla_read_probe.py
ring = None
if os.path.exists(so):
    lib = ctypes.CDLL(so)
    lib.probe_ring.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p, ctypes.c_int,
                                                                                          ctypes.c_void_p]
    sink = torch.zeros(16, dtype=torch.int32, device="cuda")

    def ring(s, tail=0):
        lib.probe_ring(s["pool"].data_ptr(), s["table"].data_ptr(), s["lengths_host"][0] // 32, 128, 5, 0, 8,
                       sink.data_ptr(), tail, torch.cuda.current_stream().cuda_stream)

CONTEXTS = {"ctx1k": 1024, "ctx32k": 32768, "ctx128k": 131072}
res = {}
for name in os.environ.get("CASES", "ctx32k,ctx128k").split(","):
    case = st.Case(name, 1, CONTEXTS[name])
    first = st._make_set(case, 12, torch.bfloat16, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, 12, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64) - 1)]

    def plan(s, f):
        if f == "flashmla":
            return flashmla_peer.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"])
        return mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], form=f)
    variants = {f: [(lambda p=plan(s, f): p()) for s in sets] for f in forms}
    diag_so = os.environ.get("WG_DIAG_SO", "/tmp/mla_diag.so")  # K3_MLA_WG_DATA_ONLY build (device_mla_wgmma.py)
    if os.path.exists(diag_so):
        real, diag = mc._library, mc.bind(ctypes.CDLL(diag_so))
        mc._library = lambda: diag  # plans made and called with the diagnostic build while this is set
        dplans = [mc.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"], form="wgmma") for s in sets]
        mc._library = real

        def with_diag(p):
            mc._library = lambda: diag
            p()
            mc._library = real
        variants["wgmma-data"] = [(lambda p=p: with_diag(p)) for p in dplans]
    if ring is not None:
        variants["ring"] = [(lambda s=s: ring(s)) for s in sets]
        variants["ring+tail"] = [(lambda s=s: ring(s, 192)) for s in sets]
    for label, calls in variants.items():
        k = 8
        for c in calls:
            c()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(k):
                calls[i % len(calls)]()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        reps = 20
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                g.replay()
            e1.record()
            torch.cuda.synchronize()
        per_call = e0.elapsed_time(e1) * 1000 / (reps * k)
        durs = collections.defaultdict(list)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
                durs[ev.name[:60]].append(ev.device_time)
        kern = {n: {"mean_us": sum(v) / len(v), "count": len(v)} for n, v in durs.items()}
        res[f"{name}.{label}"] = {"per_call_us": per_call, "kernels": kern}
        print(f"{name:8s} {label:10s} per call {per_call:7.2f} us  | " +
              "  ".join(f"{n[:28]} {v['mean_us']:.2f} us x{v['count'] // reps}" for n, v in kern.items()), flush=True)
json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()),
           "commit": bench.git_commit(), "rows": res},
          open(os.path.join(out, "kernel_times.json"), "w"), indent=1)
