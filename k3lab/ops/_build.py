"""Compile kernels/<name>.cu into a shared library once, cache it, load it with ctypes.

The .cu kernels expose `extern "C"` launchers that take raw device pointers, sizes and a stream, so
no torch C++ ABI is involved: tensors go in as `data_ptr()` and the stream as
`torch.cuda.current_stream().cuda_stream` (which keeps CUDA-graph capture working).

- NVIDIA: `nvcc -O3`, for the device's own architecture; Hopper (sm_90) gets
  `-gencode=arch=compute_90a,code=sm_90a`.
- AMD: `hipcc -x hip --offload-arch=<gcnArchName>`, with HIP_PLATFORM=amd. Not yet run on AMD
  hardware by this project (only compiled, for gfx90a and gfx940, with Debian's hipcc).

Libraries are cached under ~/.cache/k3lab/kernels/<hash>/ (K3LAB_KERNEL_CACHE overrides the root);
the hash covers the sources (the .cu and the headers in kernels/), the flags, the target and the
compiler's version line, so any change rebuilds and nothing stale is loaded.

A missing compiler or GPU is not an error at import: `status(name)` says whether the kernel can run
here and, if not, why (callers then use the PyTorch reference and say so).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from k3lab.ops import environment, setting

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
NOT_RUN_ON_AMD = "not yet run on AMD hardware by this project"


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or run here (no GPU, no compiler, or the build failed)."""


@dataclass(frozen=True)
class Toolchain:
    kind: str  # 'nvcc' or 'hipcc'
    path: str
    version: str


def cache_root() -> Path:
    return Path(setting("K3LAB_KERNEL_CACHE") or Path.home() / ".cache" / "k3lab" / "kernels")


def source_path(name: str) -> Path:
    path = KERNEL_DIR / f"{name}.cu"
    if not path.is_file():
        raise ValueError(f"no kernel source kernels/{name}.cu (looked in {KERNEL_DIR})")
    return path


@functools.cache
def find_toolchain(kind: str) -> Toolchain | None:
    """nvcc or hipcc on PATH (nvcc also under CUDA_HOME), with its version line; None if absent."""
    if kind not in ("nvcc", "hipcc"):
        raise ValueError(f"kind must be 'nvcc' or 'hipcc', got {kind!r}")
    path = shutil.which(kind)
    if path is None and kind == "nvcc":
        home = setting("CUDA_HOME") or setting("CUDA_PATH") or "/usr/local/cuda"
        cand = Path(home) / "bin" / "nvcc"
        path = str(cand) if cand.is_file() else None
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                             env=_compiler_env(kind), check=False)
        lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
        version = lines[-1] if kind == "nvcc" and lines else (lines[0] if lines else "unknown")
    except (OSError, subprocess.SubprocessError):
        return None
    return Toolchain(kind, path, version)


def _compiler_env(kind: str) -> dict:
    env = environment()
    if kind == "hipcc":
        env["HIP_PLATFORM"] = "amd"  # where nvcc is also installed, hipcc would otherwise pick it
    return env


def device_target(device=None) -> tuple[str, str]:
    """(toolchain kind, target) of a visible GPU: ('nvcc', 'sm_90a') or ('hipcc', 'gfx942...')."""
    if not torch.cuda.is_available():
        raise KernelUnavailable("no GPU visible to torch (torch.cuda.is_available() is False)")
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    if getattr(torch.version, "hip", None):
        return "hipcc", props.gcnArchName  # full target id, e.g. gfx942:sramecc+:xnack-
    major, minor = props.major, props.minor
    return "nvcc", f"sm_{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def clusters_available(device=None) -> tuple[bool, str]:
    """(True, why) when the visible GPU runs thread-block clusters (a CUDA build, compute capability 9.0
    or later), else (False, why)."""
    if not torch.cuda.is_available():
        return False, "no GPU visible to torch"
    if getattr(torch.version, "hip", None):
        return False, "HIP build: no thread-block clusters"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return False, f"compute capability {major}.{minor}: clusters need 9.0 or later"
    return True, f"CUDA, compute capability {major}.{minor}"


def arch_flags(kind: str, target: str) -> list[str]:
    """Code-generation flags for one target ('sm_90a', 'sm_89', 'gfx90a', ...)."""
    if kind == "nvcc":
        if not target.startswith("sm_"):
            raise ValueError(f"nvcc target must look like 'sm_90a', got {target!r}")
        num = target[3:]
        return [f"-gencode=arch=compute_{num},code=sm_{num}"]
    if kind == "hipcc":
        if not target.startswith("gfx"):
            raise ValueError(f"hipcc target must look like 'gfx942', got {target!r}")
        return [f"--offload-arch={target}"]
    raise ValueError(f"kind must be 'nvcc' or 'hipcc', got {kind!r}")


def base_flags(kind: str) -> list[str]:
    common = ["-O3", "-std=c++17", f"-I{KERNEL_DIR}"]
    if kind == "nvcc":
        return common + ["-Xcompiler", "-fPIC", "--split-compile=0", "-Xptxas", "-v"]
    return ["-x", "hip"] + common + ["-fPIC"]


def _sources_digest(name: str) -> str:
    h = hashlib.sha256()
    for path in [source_path(name), *sorted(KERNEL_DIR.glob("*.h"))]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def build_key(name: str, tool: Toolchain, flags: list[str]) -> str:
    h = hashlib.sha256()
    for part in (_sources_digest(name), tool.kind, tool.version, *flags):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def compile_kernel(name: str, *, kind: str, target, output: str = "shared", dest: Path | None = None,
                   extra_flags: tuple[str, ...] = (), timeout: float = 900, source: Path
                   | None = None) -> Path:
    """Compile kernels/<name>.cu (or `source`) for one target, or several (a tuple: one fat binary).
    output='shared' (a .so to load) or 'object' (a .o: a compile-only check, no GPU needed). Returns
    the cached (or `dest`) path; raises KernelUnavailable when the compiler is missing or fails (its
    message included)."""
    if output not in ("shared", "object"):
        raise ValueError(f"output must be 'shared' or 'object', got {output!r}")
    tool = find_toolchain(kind)
    if tool is None:
        raise KernelUnavailable(f"{kind} is not on PATH: cannot compile kernels/{name}.cu")
    targets = (target,) if isinstance(target, str) else tuple(target)
    flags = base_flags(kind) + [f for t in targets for f in arch_flags(kind, t)] + list(extra_flags)
    flags += ["-shared"] if output == "shared" else ["-c"]
    suffix = ".so" if output == "shared" else ".o"
    src = Path(source) if source is not None else source_path(name)
    if dest is None:
        if source is not None:
            raise ValueError("a custom source needs an explicit dest (the cache key covers kernels/ only)")
        folder = cache_root() / build_key(name, tool, flags)
        dest = folder / f"{name}{suffix}"
        if dest.is_file():
            return dest
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=suffix, dir=dest.parent)
    os.close(fd)
    cmd = [tool.path, *flags, str(src), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_compiler_env(kind),
                              check=False)
        # the compiler's report (e.g. ptxas -v: registers, spills) kept beside the output
        Path(str(dest) + ".log").write_text(" ".join(cmd) + "\n" + proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise KernelUnavailable(f"{kind} failed on kernels/{name}.cu ({' '.join(cmd)}):\n"
                                    f"{proc.stderr[-4000:]}")
        os.replace(tmp, dest)  # atomic: a concurrent build never sees half a library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """Build (once, cached on disk) and load kernels/<name>.cu for the current GPU."""
    kind, target = device_target()
    if kind == "hipcc":
        pass  # the HIP build: not yet run on AMD hardware by this project
    path = compile_kernel(name, kind=kind, target=target, output="shared")
    return ctypes.CDLL(str(path))


def status(name: str) -> tuple[bool, str]:
    """(True, what runs) when kernels/<name>.cu can be built and loaded here, else (False, why).
    Builds on first call (tens of seconds), then reads the cache."""
    try:
        kind, target = device_target()
        if find_toolchain(kind) is None:
            return False, f"{kind} not found on PATH: no compiler for the {target} GPU"
        load(name)
    except KernelUnavailable as exc:
        return False, str(exc)
    note = f" ({NOT_RUN_ON_AMD})" if kind == "hipcc" else ""
    return True, f"kernels/{name}.cu built with {kind} for {target}{note}"


def check_library(lib: ctypes.CDLL, name: str, args_type, int_functions=(),
                  supported: bool = True) -> ctypes.CDLL:
    """The checks every ctypes binding of a kernels/<name>.cu library makes: `int_functions` (and
    k3_<name>_args_size) return int; the library's Args is as large as the Python `args_type`; with
    `supported`, k3_<name>_supported() says the build has a kernel (not a HIP or old-target stub).
    Raises KernelUnavailable naming the mismatch; returns lib."""
    for fn in (f"k3_{name}_args_size", *int_functions):
        getattr(lib, fn).restype = ctypes.c_int
    size = getattr(lib, f"k3_{name}_args_size")()
    if size != ctypes.sizeof(args_type):
        raise KernelUnavailable(f"{name}.cu's Args is {size} bytes but the Python Args is "
                                f"{ctypes.sizeof(args_type)}: the two disagree")
    if supported:
        getattr(lib, f"k3_{name}_supported").restype = ctypes.c_int
        if not getattr(lib, f"k3_{name}_supported")():
            raise KernelUnavailable(f"kernels/{name}.cu has no kernel in this build (HIP or an old target)")
    return lib


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher uses


def stream_handle(index: int) -> int:
    """The current CUDA stream of device `index` as a raw handle for a ctypes launcher (capturable)."""
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


@functools.cache
def max_shared_optin(index: int) -> int:
    """Shared memory one block may opt in to on device `index` (bytes)."""
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def cuda_status(name: str, load_library, *, instead: str, min_capability: tuple[int, int] | None = None,
                needs: str = "", hip_note: str = "") -> tuple[bool, str]:
    """(True, what runs) when kernels/<name>.cu can run on this machine's GPU: a CUDA (not HIP) device of
    at least `min_capability`, the library built and loaded by `load_library` (which raises
    KernelUnavailable when it cannot); else (False, why, ending with what runs `instead`). `needs`
    says what the capability is for; `hip_note` why a HIP build does not run it."""
    if not torch.cuda.is_available():
        return False, f"no GPU visible to torch: {instead}"
    if getattr(torch.version, "hip", None):
        note = hip_note or f"is {NOT_RUN_ON_AMD}"
        return False, f"HIP build: kernels/{name}.cu {note}; {instead}"
    if min_capability is not None:
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < tuple(min_capability):
            need = ".".join(map(str, min_capability))
            return (
                False,
                f"compute capability {major}.{minor}: kernels/{name}.cu needs {need} or later{needs}; "
                f"{instead}",
            )
    ok, why = status(name)
    if not ok:
        return False, why
    try:
        load_library()
    except KernelUnavailable as exc:
        return False, str(exc)
    return True, why

