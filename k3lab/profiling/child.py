"""`python -m k3lab.profiling.child STUDY VARIANT [--preset P] [--steps N] [--warmup W]`: run one variant
of a study's profile targets in this process, each step inside a `k3lab.step.N` range (record_function,
and NVTX / ROCTX on a GPU), so a profiler that starts a child process (ncu, nsys, rocprofv3) sees exactly
the steps: warm-up calls run first, outside every step range. Prints one line saying what ran."""

from __future__ import annotations

import argparse
import sys


def run(study: str, variant: str, *, preset: str | None = None, steps: int = 3, warmup: int = 1) -> int:
    """Run `warmup` unmarked calls then `steps` marked calls of the variant; ValueError naming --variant
    when the study has no such profile target (`k3lab profile` checks this before starting the child)."""
    from k3lab.profiling.export import STEP_PREFIX, label
    from k3lab.profiling.tools import check_variants
    from k3lab.studies import load_study

    targets = load_study(study).profile_targets(preset=preset)
    fn = targets[check_variants(study, targets, [variant])[0]]
    sync = _synchronize()
    for _ in range(warmup):
        fn()
    sync()
    for i in range(steps):
        with label(f"{STEP_PREFIX}{i}"):
            fn()
            sync()
    print(f"k3lab.profiling.child: {study}/{variant}: {warmup} warm-up and {steps} marked steps ran")
    return 0


def _synchronize():
    import torch

    return torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m k3lab.profiling.child", description=__doc__)
    p.add_argument("study")
    p.add_argument("variant")
    p.add_argument("--preset", default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    try:
        return run(args.study, args.variant, preset=args.preset, steps=args.steps, warmup=args.warmup)
    except ValueError as exc:
        print(f"k3lab.profiling.child: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
