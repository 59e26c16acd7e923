"""Checks and timings of the occupancy study (the package docstring says what it measures): one
compiled kernel relaunched at each level of reserved shared memory, its outputs checked bit-identical
to the unreserved launch's before each level is timed into a record.
"""

from __future__ import annotations

import copy

import torch

from k3lab import bench
from k3lab.isa.targets import TARGETS, nvidia_blocks_per_sm
from k3lab.studies import select_cases
from k3lab.studies.peers import on_gpu

from .tables import CASES, NAME, blocks_by_shared, level_case, planned_levels, reserve_levels

CPU_NOTE = ("no GPU here, so nothing is launched or timed: the levels each target would take, from the "
            "committed ISA report's compile of the kernel (profiles/isa/report.json)")


def _target():
    from k3lab import env

    info = env.detect()
    if info.backend == "rocm":
        return TARGETS["gfx950"] if "gfx950" in (info.arch or "") else TARGETS["gfx942"]
    return TARGETS["sm90"]


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
    """The launch's tensors filled with fresh values in [-0.05, 0] (finite, <= 0: valid gates)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    for t in tensors:
        if t.dtype.is_floating_point:
            t.copy_(-0.05 * torch.rand(t.shape, generator=gen, device=t.device, dtype=torch.float32))
    return tensors


def measure_case(case: str, repeats: int = 50) -> list[bench.Record]:
    """One record per level of `case` on this GPU (eager, device events): its launch compiled once by
    Triton's JIT, relaunched with `reserve` extra bytes of dynamic shared memory per level; each level's
    outputs must equal the unreserved launch's bit for bit (bench.CheckFailed otherwise) before it is
    timed."""
    from k3lab.isa.cases import run_case

    isa_case, index = CASES[case]
    target = _target()
    torch.set_default_device("cuda")
    try:
        launch = run_case(isa_case)[index]
    finally:
        torch.set_default_device(None)
    fn, args, kwargs, grid = launch.kernel, launch.args, launch.kwargs, launch.grid
    tensors = _fill(args)
    snapshot = [t.clone() for t in tensors]
    ck = fn.warmup(*args, grid=grid, **kwargs)
    binder = fn.device_caches[torch.cuda.current_device()][4]
    bound = list(binder(*args, **kwargs)[0].values())
    ck._init_handles()
    meta = ck.metadata
    natural = min(blocks_by_shared(target, meta.shared),
                  nvidia_blocks_per_sm(target, ck.n_regs, 0, meta.num_warps) if not target.is_amd
                  else target.waves_per_simd * target.simds // meta.num_warps)
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
    shape = {"grid": list(grid), "num_warps": meta.num_warps}
    records = []
    for programs, extra in reserve_levels(target, meta.shared, natural):
        k = ck if extra == 0 else _launcher(ck, extra)
        restore()
        runner(k)()
        if not all(torch.equal(a, b) for a, b in zip(tensors, baseline)):
            raise bench.CheckFailed(f"{case}: the launch reserving {extra} B more shared memory "
                                    f"({programs} per unit) wrote other outputs than the unreserved one")
        t = bench.time_fn(runner(k), repeats=repeats, calls_per_sample=1)
        records.append(bench.make_record(
            NAME, level_case(case, programs), "after", t, shape=shape, dtype="bfloat16",
            study_case=case, isa_case=isa_case, index=index, kernel=launch.name, target=target.name,
            programs_per_unit=programs, reserve_bytes=extra, shared_bytes=meta.shared + extra,
            threads=meta.num_warps * target.warp_size, registers=getattr(ck, "n_regs", None),
            outputs_identical=True))
    return records


# ---------------------------------------------------------------------------------------- study contract
def case_names(preset=None) -> list[str]:
    return list(CASES)


def run(preset=None, cases=None, *, repeats: int = 50) -> list[bench.Record]:
    """Every level of each case checked and timed on this GPU. Without a GPU nothing is launched: it
    prints that and the levels each target would take (`planned_levels`), and returns no records."""
    chosen = select_cases(case_names(), cases)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if not on_gpu():
        print(f"{NAME}: {CPU_NOTE}")
        for case in chosen:
            print(planned_levels(case).to_string(index=False))
        return []
    return [r for case in chosen for r in measure_case(case, repeats)]


def profile_targets(preset=None) -> dict:
    return {}
