"""Checks and timings of the ceilings probe (the package docstring says what it measures): the device copy
and the bf16 matmul, each checked once and then timed into a record, and the command that saves them."""

from __future__ import annotations

import argparse

import torch

from k3lab import bench
from k3lab.ops import int_arg
from k3lab.studies import select_cases
from k3lab.studies.peers import on_gpu

from .tables import (CASES, COPY_BYTES, MATMUL_N, NAME, VARIANT, bandwidth_tbs, matmul_tflops,
                     summary_text)

CPU_NOTE = ("no GPU here, so nothing is launched or timed (a CPU's copy and matmul are not a GPU's "
            "ceilings); k3lab.profiling.roofline.ceilings reads the committed records and k3lab.env.PEAKS")
CHECK_ROWS = 256  # rows of the product checked against fp32: every output column, a K-long sum each


def _device(device) -> torch.device:
    try:
        return torch.device(device)
    except (TypeError, RuntimeError):
        raise ValueError(f"device: expected a torch device such as 'cuda' or 'cpu', got {device!r}") from None


def measure_copy(nbytes: int = COPY_BYTES, *, device="cuda", repeats: int = 20) -> bench.Record:
    """Copy `nbytes` of uint8 on `device`, check the destination equals the source, then time the copy:
    a record of case copy_<size> with extra bandwidth_tbs (read + write over the median)."""
    n = int_arg("nbytes", nbytes, low=1)
    reps = int_arg("repeats", repeats, low=1)
    dev = _device(device)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if not torch.equal(dst, src):
        raise bench.CheckFailed(f"{NAME}: the {n}-byte device copy wrote other bytes than its source")
    t = bench.time_fn(lambda: dst.copy_(src), warmup=3, repeats=reps, calls_per_sample=1, device=dev.type)
    case = "copy_1GiB" if n == COPY_BYTES else f"copy_{n}B"
    return bench.make_record(NAME, case, VARIANT, t, shape={"bytes": n}, dtype="uint8",
                             bandwidth_tbs=bandwidth_tbs(n, t.median_us),
                             bandwidth_how="device copy, read + write, measured by k3lab.studies.ceilings")


def measure_matmul(n: int = MATMUL_N, *, device="cuda", repeats: int = 20, product=torch.matmul,
                   seed: int = 0) -> bench.Record:
    """An n x n x n bf16 product of random N(0, 1) inputs on `device` (`product(a, b)`, torch.matmul by
    default): its first CHECK_ROWS rows checked against the fp32 product of the same bf16 inputs
    (bench.check, bf16's bounds), then timed: a record of case matmul_bf16_<n> with extra
    matmul_tflops. bench.CheckFailed when the product is wrong."""
    m = int_arg("n", n, low=1)
    reps = int_arg("repeats", repeats, low=1)
    dev = _device(device)
    gen = torch.Generator(device=dev).manual_seed(int_arg("seed", seed))
    a, b = (torch.randn(m, m, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
            for _ in range(2))
    rows = min(m, CHECK_ROWS)
    bench.check(product(a, b)[:rows], a[:rows].float() @ b.float(), dtype=torch.bfloat16,
                name=f"{NAME}: bf16 {m}^3 product")
    t = bench.time_fn(lambda: product(a, b), warmup=3, repeats=reps, calls_per_sample=1, device=dev.type)
    return bench.make_record(NAME, f"matmul_bf16_{m}", VARIANT, t, shape={"m": m, "n": m, "k": m},
                             dtype="bfloat16", matmul_tflops=matmul_tflops(m, t.median_us))


def measure_case(case: str, repeats: int = 20) -> bench.Record:
    """One case of CASES at its full size on this GPU."""
    if case == "copy_1GiB":
        return measure_copy(COPY_BYTES, repeats=repeats)
    if case == "matmul_bf16_8192":
        return measure_matmul(MATMUL_N, repeats=repeats)
    raise ValueError(f"case: expected one of {list(CASES)}, got {case!r}")


# ---------------------------------------------------------------------------------------- study contract
def case_names(preset=None) -> list[str]:
    return list(CASES)


def run(preset=None, cases=None, *, repeats: int = 20) -> list[bench.Record]:
    """Each case checked and timed on this GPU. Without a GPU nothing is launched: it prints CPU_NOTE and
    returns no records."""
    chosen = select_cases(case_names(), cases)
    reps = int_arg("repeats", repeats, low=1)
    if not on_gpu():
        print(f"{NAME}: {CPU_NOTE}")
        return []
    return [measure_case(case, reps) for case in chosen]


def profile_targets(preset=None) -> dict:
    return {}


def main(argv: list[str] | None = None) -> int:
    """`python -m k3lab.studies.ceilings`: measure, print, and with --save write the records."""
    p = argparse.ArgumentParser(prog="python -m k3lab.studies.ceilings",
                                description="Measure this GPU's copy bandwidth and bf16 matrix rate.")
    p.add_argument("--save", action="store_true",
                   help="write profiles/<device>/ceilings/ (or under --root); an existing committed file "
                        "is kept unless --overwrite")
    p.add_argument("--root", default=None, help="records root (default: the repository's profiles/)")
    p.add_argument("--overwrite", action="store_true", help="replace existing records of the same case")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    records = run(repeats=args.repeats)
    if records:
        print(summary_text(records))
    if records and args.save:
        try:
            paths = bench.save_records(records, root=args.root, overwrite=args.overwrite)
        except FileExistsError as exc:  # a committed record of this device: kept unless --overwrite
            print(f"{NAME}: nothing written: {exc}")
            return 1
        for path in paths:
            print("wrote", path)
    return 0
