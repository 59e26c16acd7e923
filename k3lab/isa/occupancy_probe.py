"""The seed's occupancy experiment on a GPU: the same kernel binary, launched with more shared memory
(LDS) reserved than it uses, so that fewer of its programs fit on one compute unit; does the time change?

The kernel is one launch of an ISA-report case (`k3lab.isa.cases`, default the KDA chunk prologue's main
pass at 12 heads x 16K), compiled once by Triton's JIT on this GPU. Each level relaunches that compiled
binary with its dynamic shared-memory request raised by `reserve` bytes (nothing reads them), chosen so
that shared memory allows 1, 2, ... programs per unit up to what the kernel reaches unreserved. Every
level first checks its outputs are bit-identical to the unreserved launch on the same inputs (fresh
random values, <= 0, finite), then times the launch (k3lab.bench.time_fn, device events, eager).

    python -m k3lab.isa.occupancy_probe [--case kda_chunk.after_16k] [--index 0] [--json FILE]

Prints one line per level and writes {"device", "case", "kernel", "levels": [...]} with --json. Needs a
CUDA or ROCm GPU (run on an H200: profiles/isa/occupancy_probe_h200.json; not yet run on ROCm).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

from k3lab.isa.targets import TARGETS, nvidia_blocks_per_sm


def _target():
    from k3lab import env

    info = env.detect()
    if info.backend == "cpu":
        raise RuntimeError("the occupancy probe needs a GPU (it times launches); none is visible to torch")
    if info.backend == "rocm":
        return TARGETS["gfx950"] if "gfx950" in (info.arch or "") else TARGETS["gfx942"]
    return TARGETS["sm90"]


def blocks_by_shared(target, shared: int) -> int:
    """Programs per compute unit that `shared` bytes of shared memory / LDS per program allow."""
    overhead = 0 if target.is_amd else 1024  # NVIDIA's driver reserves 1 KiB per block
    return target.shared_budget // (shared + overhead) if shared else 1 << 30


def reserve_levels(target, shared: int, natural: int) -> list[tuple[int, int]]:
    """(programs per unit, extra bytes) from `natural` (unreserved) down to 1: the smallest reserve that
    brings shared memory's limit to each count, within the per-program maximum."""
    overhead = 0 if target.is_amd else 1024
    out = [(natural, 0)]
    for b in range(natural - 1, 0, -1):
        need = target.shared_budget // (b + 1) + 1 - overhead  # per-program bytes just past b + 1
        extra = max(0, need - shared)
        if shared + extra > target.shared_per_block:
            break
        out.append((min(b, blocks_by_shared(target, shared + extra)), extra))
    return out


def _launcher(ck, extra: int):
    """A CompiledKernel on the same binary whose launches request `extra` more bytes of shared memory."""
    from triton.compiler import make_backend

    k2 = copy.copy(ck)
    k2.metadata = ck.metadata._replace(shared=ck.metadata.shared + extra)
    k2.packed_metadata = make_backend(k2.metadata.target).pack_metadata(k2.metadata)
    k2.module = k2.function = k2._run = None
    k2._init_handles()
    return k2


def _fill(args) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        if t.dtype.is_floating_point:
            t.copy_(-0.05 * torch.rand(t.shape, generator=gen, device=t.device, dtype=torch.float32))
    return tensors


def probe(case: str = "kda_chunk.after_16k", index: int = 0, repeats: int = 50) -> dict:
    """Run the experiment (see the module docstring); returns the report as a dict."""
    import triton

    from k3lab.bench import time_fn
    from k3lab.isa.cases import run_case

    target = _target()
    torch.set_default_device("cuda")
    try:
        launch = run_case(case)[index]
    finally:
        torch.set_default_device(None)
    fn, args, kwargs, grid = launch.kernel, launch.args, launch.kwargs, launch.grid
    tensors = _fill(args)
    snapshot = [t.clone() for t in tensors]
    ck = fn.warmup(*args, grid=grid, **kwargs)
    device = torch.cuda.current_device()
    binder = fn.device_caches[device][4]
    bound = list(binder(*args, **kwargs)[0].values())
    ck._init_handles()
    threads = ck.metadata.num_warps * target.warp_size
    natural = min(blocks_by_shared(target, ck.metadata.shared),
                  nvidia_blocks_per_sm(target, ck.n_regs, 0, ck.metadata.num_warps) if not target.is_amd
                  else target.waves_per_simd * target.simds // ck.metadata.num_warps)
    stream = torch.cuda.current_stream().cuda_stream
    g = list(grid) + [1] * (3 - len(grid))

    def runner(k):
        return lambda: k.run(g[0], g[1], g[2], stream, k.function, k.packed_metadata, None, None, None,
                             *bound)

    def restore():
        for t, s in zip(tensors, snapshot):
            t.copy_(s)

    restore()
    runner(ck)()
    baseline = [t.clone() for t in tensors]
    levels = []
    for blocks, extra in reserve_levels(target, ck.metadata.shared, natural):
        k = ck if extra == 0 else _launcher(ck, extra)
        restore()
        runner(k)()
        same = all(torch.equal(a, b) for a, b in zip(tensors, baseline))
        t = time_fn(runner(k), repeats=repeats, calls_per_sample=1)
        levels.append({"programs_per_unit": blocks, "reserve_bytes": extra,
                       "shared_bytes": ck.metadata.shared + extra, "median_us": t.median_us,
                       "p20_us": t.p20_us,
                       "p80_us": t.p80_us, "outputs_identical": same})
    return {"device": torch.cuda.get_device_name(), "target": target.name, "case": case, "index": index,
            "kernel": launch.name, "grid": list(grid), "num_warps": ck.metadata.num_warps, "threads": threads,
            "registers": getattr(ck, "n_regs", None), "shared_bytes": ck.metadata.shared,
            "triton": triton.__version__, "levels": levels}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.isa.occupancy_probe",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="kda_chunk.after_16k")
    ap.add_argument("--index", type=int, default=0, help="which of the case's launches (0: the first)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        rep = probe(args.case, args.index, args.repeats)
    except (RuntimeError, ValueError) as exc:
        print(f"occupancy_probe: {exc}", file=sys.stderr)
        return 2
    print(f"{rep['kernel']} on {rep['device']}: grid {rep['grid']}, {rep['num_warps']} warps, "
          f"{rep['registers']} registers, {rep['shared_bytes']} B shared")
    for lv in rep["levels"]:
        print(f"  {lv['programs_per_unit']:3d} per unit  reserve {lv['reserve_bytes']:7d} B  "
              f"{lv['median_us']:9.2f} us (p20 {lv['p20_us']:.2f}, p80 {lv['p80_us']:.2f})  "
              f"outputs identical: {lv['outputs_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 0 if all(lv["outputs_identical"] for lv in rep["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())
