"""The compile targets of the ISA report and the per-unit limits its figures are read against.

A target is what `triton.compile` is told to build for (`GPUTarget(backend, arch, warp_size)`) plus
the device facts an op's launch policy reads (`env.detect()`: compute units, wave width) and the
limits of one compute unit (LDS / shared memory, registers, resident waves). Nothing here needs the
device: the figures are the vendors' published ones (docs/k3.md, the ISA guides).
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024


@dataclass(frozen=True)
class Target:
    """One compile target.

    name: 'gfx950' (MI355X, CDNA4), 'gfx942' (MI300X, CDNA3) or 'sm90' (H100/H200, Hopper).
    backend / arch / warp_size: the GPUTarget triple. device / compute_units: what the ops' launch
    policies are told they run on. shared_budget: LDS (AMD) or shared memory (NVIDIA) per compute unit
    in bytes, the figure a kernel's request is held against; shared_per_block: the most one program may
    request (NVIDIA's opt-in limit; all of the LDS on AMD). AMD: vgprs / agprs per lane of one SIMD
    (512 unified on CDNA3/4, allocated in granules of 8), waves_per_simd (the hardware's resident-wave
    cap), simds per CU. NVIDIA: regs_per_sm, max_threads_per_sm, max_blocks_per_sm."""

    name: str
    backend: str
    arch: str | int
    warp_size: int
    device: str
    compute_units: int
    shared_budget: int
    shared_per_block: int
    vgprs: int = 0
    vgpr_granule: int = 8
    waves_per_simd: int = 0
    simds: int = 4
    regs_per_sm: int = 0
    max_threads_per_sm: int = 0
    max_blocks_per_sm: int = 0

    @property
    def is_amd(self) -> bool:
        return self.backend == "hip"

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)

    @property
    def budget_label(self) -> str:
        if self.is_amd:
            return f"{self.shared_budget // KiB} KiB LDS per CU"
        return f"{self.shared_budget // 1000} KB shared memory per SM"


TARGETS: dict[str, Target] = {
    "gfx950": Target("gfx950", "hip", "gfx950", 64, "AMD Instinct MI355X", 256, 160 * KiB, 160 * KiB,
                     vgprs=512, waves_per_simd=8),
    "gfx942": Target("gfx942", "hip", "gfx942", 64, "AMD Instinct MI300X", 304, 64 * KiB, 64 * KiB,
                     vgprs=512, waves_per_simd=8),
    "sm90": Target("sm90", "cuda", 90, 32, "NVIDIA H200", 132, 228 * KiB, 227 * KiB,
                   regs_per_sm=65536, max_threads_per_sm=2048, max_blocks_per_sm=32),
}
DEFAULT_TARGETS = ("gfx950", "gfx942", "sm90")


def parse_targets(spec: str | list | tuple | None) -> tuple[Target, ...]:
    """Targets from 'gfx950,gfx942,sm90' (or a list of names); None: all of them. ValueError naming
    the unknown name."""
    if spec is None:
        names = list(DEFAULT_TARGETS)
    elif isinstance(spec, str):
        names = [s.strip() for s in spec.split(",") if s.strip()]
    else:
        names = list(spec)
    bad = [n for n in names if n not in TARGETS]
    if bad or not names:
        raise ValueError(f"targets must be a comma-separated subset of {list(TARGETS)}, got {spec!r}")
    return tuple(TARGETS[n] for n in dict.fromkeys(names))


def amd_waves_per_simd(target: Target, vgprs: int, agprs: int, lds_bytes: int, num_warps: int) -> int:
    """Waves of one kernel resident per SIMD: the unified register file (VGPRs then AGPRs, each rounded
    to the granule, 512 per lane) and the CU's LDS shared by its workgroups, capped by the hardware.
    The compiler's own `Occupancy` line counts registers and its LDS view; this adds the LDS of the
    workgroups actually launched."""
    def up(x: int, g: int) -> int:
        return -(-x // g) * g

    regs = up(max(vgprs, 1), target.vgpr_granule) + (up(agprs, target.vgpr_granule) if agprs else 0)
    by_regs = min(target.waves_per_simd, target.vgprs // regs)
    if lds_bytes <= 0:
        return by_regs
    groups = target.shared_budget // lds_bytes  # workgroups per CU by LDS
    waves_per_cu = groups * num_warps
    return max(0, min(by_regs, waves_per_cu // target.simds))


def nvidia_blocks_per_sm(target: Target, regs: int, shared_bytes: int, num_warps: int) -> int:
    """Programs (thread blocks) resident per SM from registers (allocated per warp in 256-register
    units), shared memory (plus the 1 KiB the driver reserves per block) and threads."""
    threads = num_warps * 32
    fits = [target.max_threads_per_sm // threads, target.max_blocks_per_sm]
    if regs:
        per_warp = -(-regs * 32 // 256) * 256
        fits.append(target.regs_per_sm // (per_warp * num_warps))
    if shared_bytes:
        fits.append(target.shared_budget // (shared_bytes + 1024))
    return max(0, min(fits))
