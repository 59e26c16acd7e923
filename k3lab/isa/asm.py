"""Read the figures of the ISA report out of a compiled kernel: AMD GCN assembly, NVIDIA PTX and ptxas.

Instruction counts are static: instructions in the code (a loop body counts once), not instructions
executed. Matrix instructions are counted by mnemonic (v_mfma_f32_16x16x32_bf16, wgmma.mma_async
m64n16k16, mma.sync m16n8k16); vector FMAs as the vector-unit work the seed's argument is about
(AMD v_fma / v_fmac / v_pk_fma, a packed one doing two; NVIDIA fma.rn.*).
"""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

from k3lab.isa.targets import Target, amd_waves_per_simd, nvidia_blocks_per_sm

_AMD_MATRIX = re.compile(r"^\s+(v_s?mfmac?_\w+)", re.M)
_AMD_FMA = re.compile(r"^\s+(v_pk_fma_f32|v_pk_fma_f16|v_fmac?_f32\w*|v_fma_mix\w*|v_fmac?_f16\w*|v_dot2\w*)",
                      re.M)
_AMD_FIELDS = {
    "vgprs": r"; NumVgprs:\s+(\d+)", "agprs": r"; NumAgprs:\s+(\d+)",
    "vgprs_total": r"; TotalNumVgprs:\s+(\d+)",
    "sgprs": r"; TotalNumSgprs:\s+(\d+)", "scratch_bytes": r"; ScratchSize:\s+(\d+)",
    "occupancy_compiler": r"; Occupancy:\s+(\d+)", "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"\.sgpr_spill_count:\s+(\d+)", "static_lds_bytes": r"; LDSByteSize:\s+(\d+)",
}
_PTX_MATRIX = re.compile(r"^\s+((?:wgmma\.mma_async|mma\.sync)\S*)", re.M)
_PTX_FMA = re.compile(
    r"^\s+(fma\.rn(?:\.ftz)?\.f32|fma\.rn\.f32x2|fma\.rn(?:\.ftz)?\.f16x2|fma\.rn\.bf16x2)\b", re.M
)
_PTXAS = {
    "regs": r"Used (\d+) registers", "stack_bytes": r"(\d+) bytes stack frame",
    "spill_store_bytes": r"(\d+) bytes spill stores", "spill_load_bytes": r"(\d+) bytes spill loads",
}


def _first_int(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def _short_kind(mnemonic: str) -> str:
    """'wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16' -> 'wgmma.m64n16k16.f32.bf16.bf16'."""
    m = re.match(r"(wgmma|mma)\.\S*?\.(m\d+n\d+k\d+)((?:\.\w+)*)", mnemonic)
    if not m:
        return mnemonic
    tail = ".".join(p for p in m.group(3).split(".") if p and p not in ("row", "col", "aligned", "sync"))
    return f"{m.group(1)}.{m.group(2)}" + (f".{tail}" if tail else "")


def amd_figures(amdgcn: str, shared: int, num_warps: int, target: Target) -> dict:
    """Figures of one AMD kernel from its GCN assembly text and its LDS request (metadata.shared)."""
    out = {k: _first_int(p, amdgcn) for k, p in _AMD_FIELDS.items()}
    matrix = Counter(_AMD_MATRIX.findall(amdgcn))
    fma = Counter(_AMD_FMA.findall(amdgcn))
    lds = int(shared) + int(out.get("static_lds_bytes") or 0)
    out.update({
        "matrix": dict(sorted(matrix.items())), "matrix_total": sum(matrix.values()),
        "fma": dict(sorted(fma.items())),
        "fma_lanes_ops": sum(2 * n if "pk_" in k else n for k, n in fma.items()),
        "shared_bytes": lds, "shared_budget": target.shared_budget, "shared_ok": lds
        <= target.shared_per_block,
        "spills": int(out.get("vgpr_spills") or 0) + int(out.get("sgpr_spills") or 0),
        "occupancy": amd_waves_per_simd(target, out.get("vgprs") or 0, out.get("agprs") or 0, lds, num_warps),
        "occupancy_unit": "waves per SIMD",
    })
    return out


def ptxas_path(arch: int = 90) -> str | None:
    """The ptxas Triton itself runs for compute capability `arch` (its NVIDIA backend's `get_ptxas`: the
    bundled 'ptxas', or from Triton 3.9 on 'ptxas-blackwell' for sm_90 too, the one that reads the PTX
    version that Triton writes), or None where that file is missing."""
    from triton.backends.nvidia.compiler import get_ptxas

    p = Path(get_ptxas(arch).path)
    return str(p) if p.exists() else None


def ptxas_report(ptx: str, workdir: str, arch: str = "sm_90a") -> str:
    """ptxas -v's report of a PTX text (the ptxas Triton uses for `arch`), or '' where there is none.
    RuntimeError with ptxas's message when it refuses the PTX (the figures would otherwise be blank)."""
    ptxas = ptxas_path(int(re.sub(r"\D", "", arch)))
    if ptxas is None:
        return ""
    src = Path(workdir) / "k.ptx"
    src.write_text(ptx)
    res = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(workdir) / "k.cubin")],
                         capture_output=True, text=True, timeout=300, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{ptxas} -v --gpu-name={arch} failed ({res.returncode}): "
                           f"{res.stderr.strip()[-400:]}")
    return res.stdout + res.stderr


def nvidia_figures(ptx: str, ptxas_log: str, shared: int, num_warps: int, target: Target) -> dict:
    """Figures of one NVIDIA kernel from its PTX, ptxas -v's report and its shared-memory request."""
    out = {k: _first_int(p, ptxas_log) for k, p in _PTXAS.items()}
    matrix = Counter(_short_kind(m) for m in _PTX_MATRIX.findall(ptx))
    fma = Counter(_PTX_FMA.findall(ptx))
    regs = out.get("regs") or 0
    out.update({
        "matrix": dict(sorted(matrix.items())), "matrix_total": sum(matrix.values()),
        "fma": dict(sorted(fma.items())),
        "fma_lanes_ops": sum(2 * n if "x2" in k else n for k, n in fma.items()),
        "shared_bytes": int(shared), "shared_budget": target.shared_budget,
        "shared_ok": int(shared) <= target.shared_per_block,
        "spills": (out.get("spill_store_bytes") or 0) + (out.get("spill_load_bytes") or 0),
        "scratch_bytes": out.get("stack_bytes"),
        "occupancy": nvidia_blocks_per_sm(target, regs, int(shared), num_warps),
        "occupancy_unit": "blocks per SM",
        "griddepcontrol": len(re.findall(r"griddepcontrol", ptx)),
    })
    return out
