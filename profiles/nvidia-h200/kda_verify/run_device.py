"""How the kda_verify records in this folder were made (one lent H200, one process).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl   # fla-core 0.6.0
    PYTHONPATH=/tmp/site:. python3 profiles/nvidia-h200/kda_verify/run_device.py $OUT

Runs every case of k3lab.studies.kda_verify (each variant checked against fp64 first), writes all
records to OUT/records.json (one file, split into per-case files by bench.save_records afterwards),
captures torch.profiler traces of one B=1, T=4 verify step per variant, and prints a summary.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import k3lab  # noqa: F401
from k3lab import bench, env, profile
from k3lab.studies import kda_verify as study

BUDGET_S = float(sys.argv[2]) if len(sys.argv) > 2 else 220.0


def main(out: Path) -> None:
    t0 = time.time()
    print(env.describe(), flush=True)
    print(env.versions(), flush=True)
    names = study.case_names()
    sweep = [c for c in names if "_w" in c]
    first = ["b1_t4", "b1_t4.final_only"]
    first += [c for c in names if c.startswith("b1_t4.") and c not in sweep and c not in first]
    order = first + [c for c in names if c not in first and c not in sweep] + sweep
    records, failed = [], []
    for case in order:
        if time.time() - t0 > BUDGET_S:
            failed.append(f"{case}: skipped (time budget)")
            continue
        try:
            recs = study.run(cases=[case])
            records += recs
            for r in recs:
                print(f"{case:24s} {r.variant:7s} {r.mode:6s} {r.median_us:8.2f} us  floor {r.floor_us:6.2f}  "
                      f"o {r.error['o']['max_rel']:.1e} S {r.error['states']['max_rel']:.1e}  "
                      f"tile {r.extra['tile_v']} w{r.extra['num_warps']}", flush=True)
        except Exception as exc:  # keep going: one failing case must not lose the others
            failed.append(f"{case}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        (out / "records.json").write_text(json.dumps([r.to_dict() for r in records], indent=0))
    for label, fn in study.profile_targets().items():
        try:
            cap = profile.capture(fn, steps=3, warmup=2, name=f"kda_verify_b1_t4_{label}",
                                  trace_path=out / f"trace_b1_t4_{label}.json.gz")
            print(label, cap.counts(), flush=True)
            print(cap.table[["name", "calls", "mean_us"]].to_string(index=False), flush=True)
        except Exception as exc:
            failed.append(f"trace {label}: {type(exc).__name__}: {exc}")
    print("\nFAILED:", *failed, sep="\n  ") if failed else print("\nall cases ran")
    df = bench.compare(records)
    cols = ["case", "mode", "before_us", "after_us", "fla_us", "floor_us", "speedup", "after_vs_peer"]
    print(df[[c for c in cols if c in df]].to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    print(f"elapsed {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
