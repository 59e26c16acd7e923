"""One device step: torch.profiler traces of one B = 1, T = 4 KDA verify step per variant (before,
after with its default form, fla), into $OUT/trace_b1_t4_<variant>.json.gz, the files notebook 05
reads from profiles/nvidia-h200/kda_verify/.   OUT=dir python3 scripts/device_verify_traces.py"""
import os
from pathlib import Path

from k3lab import profile
from k3lab.studies import kda_verify as study

out = Path(os.environ.get("OUT", "build/device"))
out.mkdir(parents=True, exist_ok=True)
for label, fn in study.profile_targets().items():
    cap = profile.capture(fn, steps=3, warmup=2, name=f"kda_verify_b1_t4_{label}",
                          trace_path=out / f"trace_b1_t4_{label}.json.gz")
    print(label, cap.counts(), flush=True)
    print(cap.table[["name", "calls", "mean_us"]].head(4).to_string(index=False), flush=True)
