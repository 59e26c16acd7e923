"""Issue 5, one device call: builds of kernels/mla_before.cu with other knobs (K3_MB_UNROLL, K3_MB_STAGES;
each compiled with its own -Dk3mb=... namespace) beside the library's before, each checked
against the fp32 reference on the study's first input set and timed like the study (rotated sets, graph
replay) at 1K and 32K. BEFORE_VARIANTS='label:path,...'. Prints a table; writes $OUT/before_variants.json.
    OUT=dir BEFORE_VARIANTS=u2:.cache/variants/mb_u2.so PYTHONPATH=. python3 scripts/device_mla_before_variants.py
"""
import ctypes
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mla_probe_readers as pr  # noqa: E402 - a sibling script module

from k3lab import bench  # noqa: E402
from k3lab.ops import mla_before_cuda as mb  # noqa: E402
from k3lab.ops import mla_decode as mla  # noqa: E402

out = os.environ.get("OUT", "build/device")
libs = {"default": mb._library()}
for item in filter(None, os.environ.get("BEFORE_VARIANTS", "").split(",")):
    label, _, path = item.partition(":")
    libs[label] = mb.bind(ctypes.CDLL(path))
real = mb._library
rows = {}
for name, ctx in (("ctx1k", 1024), ("ctx32k", 32768)):
    case, sets, nbytes = pr.input_sets(name, ctx)
    first = sets[0]
    ro, rl = mla.reference(first["q"].float(), first["cache"].float(), lengths=first["lengths"])
    variants = {}
    for label, lib in libs.items():
        mb._library = lambda lib=lib: lib
        plans = [mb.plan(s["q"], s["pool"], s["lengths"], block_table=s["table"]) for s in sets]
        o, lse = plans[0]()
        err = bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
        print(f"check {name} {label}: o max_rel {err['o']['max_rel']:.2e}", flush=True)
        variants[label] = lambda s, plans=plans, idx={id(x): i for i, x in enumerate(sets)}: plans[idx[id(s)]]()
    mb._library = real
    rows[name] = pr.time_rows(name, sets, nbytes, variants, width=10, warmup=5, repeats=40)
    del sets
    torch.cuda.empty_cache()
pr.write(os.path.join(out, "before_variants.json"), rows)
