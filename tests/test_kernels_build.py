"""The single-source kernels in kernels/ compile for both vendors without a GPU: nvcc for Hopper
(sm_90a), hipcc for AMD Instinct gfx90a and gfx940 (as written, and after torch's hipify). Each test
skips, with the reason, where its compiler is not on PATH."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from k3lab.ops import _build

KERNELS = sorted(p.stem for p in _build.KERNEL_DIR.glob("*.cu"))
ROOT = Path(__file__).resolve().parents[1]


def test_there_are_kernels():
    assert "kda_decode" in KERNELS


@pytest.mark.skipif(_build.find_toolchain("nvcc") is None, reason="nvcc not on PATH (or CUDA_HOME)")
@pytest.mark.parametrize("name", KERNELS)
def test_nvcc_compiles_for_sm90a(name, tmp_path):
    obj = _build.compile_kernel(name, kind="nvcc", target="sm_90a", output="object", dest=tmp_path / f"{name}.o")
    assert obj.stat().st_size > 0
    # ptxas's report of this build: no kernel may spill registers to local memory (the state lives
    # in registers; a spill would send it back through memory).
    report = Path(str(obj) + ".log").read_text()
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert spills, "ptxas -v printed no register report"
    assert all(int(s) == 0 for s in spills), f"register spills in {name}: {spills}"


def test_build_cache_key_covers_source_flags_and_compiler():
    tool = _build.Toolchain("nvcc", "/x/nvcc", "Cuda compilation tools, release 13.0")
    a = _build.build_key("kda_decode", tool, ["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    b = _build.build_key("kda_decode", tool, ["-O3", "-gencode=arch=compute_89,code=sm_89"])
    c = _build.build_key("kda_decode", _build.Toolchain("nvcc", "/x/nvcc", "release 12.8"),
                         ["-O3", "-gencode=arch=compute_90a,code=sm_90a"])
    assert len({a, b, c}) == 3
    assert _build.arch_flags("nvcc", "sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert _build.arch_flags("hipcc", "gfx942:sramecc+:xnack-") == ["--offload-arch=gfx942:sramecc+:xnack-"]
    with pytest.raises(ValueError, match="sm_90a"):
        _build.arch_flags("nvcc", "gfx90a")
    with pytest.raises(ValueError, match="no kernel source"):
        _build.source_path("no_such_kernel")


def test_missing_compiler_is_reported_not_raised_at_import(monkeypatch):
    monkeypatch.setattr(_build, "find_toolchain", lambda kind: None)
    with pytest.raises(_build.KernelUnavailable, match="not on PATH"):
        _build.compile_kernel("kda_decode", kind="nvcc", target="sm_90a", output="object")


@pytest.mark.skipif(shutil.which("hipcc") is None,
                    reason="hipcc not on PATH (apt-get install -y --no-install-recommends hipcc)")
def test_hipcc_compiles_for_gfx90a_and_gfx940_source_and_hipified(tmp_path):
    """scripts/compile_hip.sh: every kernel as written and after torch's hipify, for gfx90a + gfx940
    (compiled only: not yet run on AMD hardware by this project)."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "compile_hip.sh"), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for name in KERNELS:
        for variant in ("source", "hipified"):
            assert f"ok   {name} ({variant}) for gfx90a gfx940" in proc.stdout
            assert (tmp_path / f"{name}.{variant}.o").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_clusters_are_not_claimed_without_a_gpu():
    ok, why = _build.clusters_available()
    assert not ok and "GPU" in why


def test_check_library_names_each_mismatch():
    """_build.check_library: a library whose Args size differs, or whose build is a stub, is refused by
    name; a matching one is returned."""
    import ctypes
    from types import SimpleNamespace

    from k3lab.ops import _build

    class Args(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int), ("b", ctypes.c_int)]

    def lib(size, supported):
        def ret(v):
            f = lambda: v  # noqa: E731
            return f
        return SimpleNamespace(k3_x_args_size=ret(size), k3_x_supported=ret(supported), k3_x_regs=ret(0))

    good = lib(8, 1)
    assert _build.check_library(good, "x", Args, ("k3_x_regs",)) is good
    assert good.k3_x_regs.restype is ctypes.c_int
    with pytest.raises(_build.KernelUnavailable, match="12 bytes but the Python Args is 8"):
        _build.check_library(lib(12, 1), "x", Args)
    with pytest.raises(_build.KernelUnavailable, match="no kernel in this build"):
        _build.check_library(lib(8, 0), "x", Args)
    assert _build.check_library(lib(8, 0), "x", Args, supported=False)
