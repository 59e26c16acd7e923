"""Shared by scripts/device_mla_read_probe.py and scripts/device_mla_bounds.py (device calls, issue 5):
the readers of scripts/mla_read_probe.cu as callables of one study input set, the study's 12-head input
sets of a case (rotated so nothing stays in L2), and the timing loop that writes one JSON of rows.
"""
import ctypes
import json
import os
import subprocess
import zlib

import torch

from k3lab import bench, env
from k3lab.studies import mla_padding as st

BW = env.PEAKS["H200"].bandwidth_tbs * 1e12
_vp, _ci = ctypes.c_void_p, ctypes.c_int


def load(so: str = "/tmp/mla_read_probe.so") -> ctypes.CDLL:
    """Build scripts/mla_read_probe.cu for sm_90a and declare its launchers."""
    subprocess.run(["nvcc", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                    "scripts/mla_read_probe.cu", "-o", so], check=True)
    lib = ctypes.CDLL(so)
    lib.probe_ldg.argtypes = [_vp, ctypes.c_longlong, _ci, _vp, _ci, _vp]
    lib.probe_ldg_each.argtypes = [_vp, ctypes.c_longlong, _ci, _vp, _vp]
    lib.probe_ring.argtypes = [_vp, _vp, _ci, _ci, _ci, _ci, _ci, _vp, _ci, _vp]
    return lib


class Readers:
    """Callables f(input_set) for bench.time_fn(rotate=...): each launches one reader over the set's cache."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib, self.sink = lib, torch.zeros(16, dtype=torch.int32, device="cuda")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: {rc}")

    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def ldg(self, blocks, tail=0):
        """16-byte loads over the contiguous cache, shared by the grid (+ an empty PDL kernel of `tail` blocks)."""
        return lambda s: self._check(self.lib.probe_ldg(s["cache"].data_ptr(), s["cache"].numel() * 2, blocks,
                                                        self.sink.data_ptr(), tail, self._stream()), "ldg")

    def ldg_each(self, blocks):
        """16-byte loads, every block reading the whole cache by itself."""
        return lambda s: self._check(self.lib.probe_ldg_each(s["cache"].data_ptr(), s["cache"].numel() * 2, blocks,
                                                             self.sink.data_ptr(), self._stream()), "ldg_each")

    def ring(self, blocks, stages=5, inter=0, cpt=8, tail=0):
        """The paged cache through its block table into a ring of 32-row tiles (inter: 0 contiguous pieces,
        1 round-robin, 2 every block reads every tile; cpt: bulk copies per tile)."""
        def f(s):
            ntiles = s["lengths_host"][0] // 32
            self._check(self.lib.probe_ring(s["pool"].data_ptr(), s["table"].data_ptr(), ntiles, blocks, stages, inter,
                                            cpt, self.sink.data_ptr(), tail, self._stream()), "ring")
        return f


def input_sets(name: str, ctx: int):
    """(case, sets, bytes): the study's 12-head bf16 input sets of case `name` (B = 1, `ctx` positions where
    the study has no such case), as many as bench.rotation_count asks for."""
    case = next((c for c in st.cases() if c.name == name), st.Case(name, 1, ctx))
    first = st._make_set(case, 12, torch.bfloat16, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = st.cache_bytes(case, torch.bfloat16, first["lengths_host"])
    sets = [first] + [st._make_set(case, 12, torch.bfloat16, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64) - 1)]
    return case, sets, nbytes


def time_rows(name: str, sets, nbytes: int, variants: dict, width: int = 32, **timing) -> dict:
    """Each variant timed by graph replay over the rotated sets; prints a line each; one row of the JSON."""
    res = {}
    for label, fn in variants.items():
        t = bench.time_fn(fn, rotate=[(s,) for s in sets], graph=True, **timing)
        gbs = nbytes / (t.median_us * 1e-6) / 1e9
        res[label] = {"us": t.median_us, "p20": t.p20_us, "p80": t.p80_us, "share": nbytes / BW / (t.median_us * 1e-6),
                      "history_gb_per_s": gbs}
        print(f"{name:8s} {label:{width}s} {t.median_us:9.2f} us  {100 * res[label]['share']:6.1f}% of copy bw  "
              f"history at {gbs:7.1f} GB/s", flush=True)
    return {"bytes": nbytes, "sets": len(sets), "floor_us": nbytes / BW * 1e6, "variants": res}


def write(path: str, rows: dict, **extra) -> None:
    """The run's JSON: device, versions, commit, copy bandwidth, `extra`, rows."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    json.dump({"device": torch.cuda.get_device_name(), "versions": dict(env.versions()), "commit": bench.git_commit(),
               "copy_bandwidth_tbs": BW / 1e12, **extra, "rows": rows}, open(path, "w"), indent=1)
