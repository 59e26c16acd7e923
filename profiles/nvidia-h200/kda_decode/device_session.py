"""How this session's H200 records were made: one lent H200, one process, one JSON of records.

    PYTHONPATH=/tmp/site:. python3 profiles/nvidia-h200/kda_decode/device_session.py $OUT [sweep|final] [budget_s]

'sweep': the KDA verify variants (chunk form x tile x waves, the step form beside it, T = 1..8) and
the fused decode kernel's configs at B = 1, each checked against the reference first, with the main
cases; 'final': the main cases of both studies only. kernels/kda_decode.cu comes prebuilt from
.cache/k3lab_kda_decode (built with the same nvcc 13.0 for sm_90a) when it loads, else compiled here
in the background while the Triton kernels run. Prints a compact table last; writes OUT/records.json.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

import k3lab  # noqa: F401
from k3lab import bench, env
from k3lab.ops import _build
from k3lab.ops import kda_decode as kd
from k3lab.studies import kda_decode_bench as kdb
from k3lab.studies import kda_verify as kvs

T0 = time.time()
OUT = Path(sys.argv[1])
MODE = sys.argv[2] if len(sys.argv) > 2 else "sweep"
BUDGET = float(sys.argv[3]) if len(sys.argv) > 3 else 180.0
RECORDS: list = []
NOTES: list = []


def left() -> float:
    return BUDGET - (time.time() - T0)


def save():
    (OUT / "records.json").write_text(json.dumps([r.to_dict() for r in RECORDS], indent=0))


def install_prebuilt() -> str:
    kind, target = _build.device_target()
    tool = _build.find_toolchain(kind)
    flags = _build.base_flags(kind) + _build.arch_flags(kind, target) + ["-shared"]
    dest = _build.cache_root() / _build.build_key("kda_decode", tool, flags) / "kda_decode.so"
    pre = Path(".cache/k3lab_kda_decode/kda_decode.so")
    if dest.is_file():
        return "cached"
    if pre.is_file():
        probe = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL('{pre}').k3_kda_decode_args_size()"],
                               capture_output=True, text=True, timeout=60, check=False)
        if probe.returncode == 0:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pre, dest)
            return "prebuilt"
        NOTES.append("prebuilt .so did not load: " + probe.stderr[-300:])
    return "compile"


def verify_cases():
    main = ["b1_t4", "b1_t4.final_only", "b1_t1", "b1_t2", "b1_t8"]
    if MODE == "final":
        names = kvs.case_names()
        first = ["b1_t4", "b1_t4.final_only", "b1_t1", "b1_t2", "b1_t8"]
        rest = [c for c in names if ("." not in c or c.endswith((".final_only", ".ragged"))
                                     or c in ("b1_t4.narrow_only", "b1_t4.narrow_1wave")) and c not in first]
        return first + rest
    return main + [c for c in kvs.CHUNK_SWEEP if c.startswith("b1_")] + ["b1_t4.narrow8_w1", "b1_t4.ragged"] + [
        c for c in kvs.CHUNK_SWEEP if not c.startswith("b1_")] + ["b8_t4", "b32_t4"]


def run_verify():
    for case in verify_cases():
        if left() < 75:
            NOTES.append(f"verify {case}: skipped (time)")
            continue
        try:
            recs = kvs.run(cases=[case], modes=None if MODE == "final" else ["graph"])
            RECORDS.extend(recs)
            for r in recs:
                print(f"V {case:20s} {r.variant:6s} {r.mode:5s} {r.median_us:7.2f} us  o {r.error['o']['max_rel']:.1e} "
                      f"S {r.error['states']['max_rel']:.1e}  {r.extra['kernel']} tile {r.extra['tile_v']} "
                      f"w{r.extra['num_warps']}", flush=True)
        except Exception as exc:  # noqa: BLE001 - one failing case must not lose the others
            NOTES.append(f"verify {case}: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
        save()


DECODE_OPTIONS = [
    {"tile_v": 32, "threads": 128, "split": "cluster", "hints": 4},
    {"tile_v": 32, "threads": 128, "split": "cluster", "hints": 0},
    {"tile_v": 16, "threads": 128, "split": "cluster", "hints": 4},
    {"tile_v": 16, "threads": 64, "split": "cluster", "hints": 4},
    {"tile_v": 64, "threads": 128, "split": "cluster", "hints": 4},
    {"tile_v": 32, "threads": 128, "split": "atomic", "hints": 4},
    {"tile_v": 128, "threads": 256, "split": "whole", "hints": 4},
]


def run_decode_sweep():
    for o in DECODE_OPTIONS:
        if left() < 45:
            NOTES.append(f"decode sweep {o}: skipped (time)")
            continue
        tag = f"w{o['tile_v']}_t{o['threads']}_{o['split']}_h{o['hints']}"
        try:
            errs = kdb.check_case(1, variants=("after",), seed=11, **o)["after"]
            inputs, cache, w = kd.make_example(1, kdb.HEADS, device="cuda", seed=3)
            step = kd.KDADecodeStep(cache, w, impl="after", **o)
            args = tuple(inputs[n] for n in kd.TOKEN_INPUTS)
            t = bench.time_fn(lambda: step(*args), warmup=20, repeats=200, graph=True)
            sb = kdb.step_bytes(1, kdb.HEADS)
            r = bench.make_record(kdb.STUDY, f"B1_H12.{tag}", "after", t, shape={"B": 1, "H": 12, "K": 128, "V": 128},
                                  dtype=torch.bfloat16, floor_us=kdb.floor_us(1, kdb.HEADS), error=errs,
                                  launches=1, bytes=sb, state_tbs=sb["state"] / (t.median_us * 1e-6) / 1e12,
                                  config=dict(o, prefetch_ahead=step.prefetch_ahead))
            RECORDS.append(r)
            print(f"D B1_H12.{tag:28s} graph {t.median_us:6.2f} us  state {errs['state']['max_rel']:.1e}", flush=True)
        except Exception as exc:  # noqa: BLE001
            NOTES.append(f"decode {tag}: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
    save()


def run_decode_main():
    for B in (kdb.BATCHES if MODE == "final" else (1, 128)):
        if left() < 20:
            NOTES.append(f"decode B{B}: skipped (time)")
            continue
        try:
            recs = kdb.run(batches=(B,), repeats=100 if MODE == "sweep" else 200)
            RECORDS.extend(recs)
        except Exception as exc:  # noqa: BLE001
            NOTES.append(f"decode B{B}: {type(exc).__name__}: {str(exc)[:300]}")
            traceback.print_exc()
        save()


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    print(env.describe(), "|", env.versions(), flush=True)
    how = install_prebuilt()
    print("kda_decode.so:", how, f"({time.time() - T0:.0f} s)", flush=True)
    build = threading.Thread(target=lambda: kd._load_fused(torch.device("cuda")), daemon=True)
    build.start()  # a compile (nvcc) runs outside the GIL while the Triton kernels are checked and timed
    run_verify()
    build.join()
    print("kda_decode ready", kd.fused_status()[1], f"({time.time() - T0:.0f} s)", flush=True)
    if MODE == "sweep":
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                "tests/test_kda_decode.py", "-k", "fused"], capture_output=True, text=True,
                               timeout=max(10, min(60, left() - 60)), check=False)
        print("GPU tests (fused):", tests.stdout.strip().splitlines()[-1] if tests.stdout.strip() else tests.stderr[-500:],
              flush=True)
        if tests.returncode != 0:
            NOTES.append("decode GPU tests failed: " + tests.stdout[-1500:])
        run_decode_sweep()
    run_decode_main()
    save()
    print("\nNOTES:", *NOTES, sep="\n  ")
    print(kdb.table([r for r in RECORDS if r.study == kdb.STUDY and "." not in r.case]))
    df = bench.compare([r for r in RECORDS if r.study == kvs.NAME])
    cols = ["case", "mode", "before_us", "after_us", "fla_us", "floor_us", "speedup", "after_vs_peer"]
    print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(f"elapsed {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
