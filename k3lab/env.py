"""Where k3lab is running: backend (rocm / cuda / cpu), device facts, peaks, and the preset to use.

Detected once per process. `describe()` is the one line every notebook and `k3lab info` print;
`quiet()` is the notebooks' setup call that silences the warnings known to be harmless.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import warnings
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peak:
    """A device's ceilings. `source` says where a number comes from: 'datasheet' or 'measured'."""

    name: str
    bandwidth_tbs: float  # memory bandwidth, TB/s
    bandwidth_source: str
    bf16_tflops: float  # dense bf16 matrix rate, TFLOP/s
    bf16_source: str
    compute_units: int | None = None
    wave_width: int | None = None
    shared_memory_kib: int | None = None  # LDS per CU (AMD) / shared memory per SM (NVIDIA)
    memory_gb: float | None = None
    note: str = ""


# From docs/k3.md ("Public figures the notebooks cite"). Only a figure that committed records back is
# labelled measured (tests/test_roofline.py holds each such label to the records): the H200's copy
# bandwidth (the device copy every decode_step attribution record times). The H200's 707 TFLOP/s came
# with the project's first files, said to be a bf16 8192^3 matmul on the lent H200, and no record of that
# run exists; it stays because the committed H200 floors were computed with it. The ceilings probe
# (`python -m k3lab.studies.ceilings --save` on an H200) would measure it, and `roofline.ceilings`
# prefers such a record to this table. The others are datasheet values.
PEAKS: dict[str, Peak] = {
    "MI355X": Peak("AMD Instinct MI355X", 8.0, "datasheet (7.2 measured in public work)", 2500.0,
                   "datasheet (dense bf16)", 256, 64, 160, 288.0, "10.1 PF MXFP4 dense"),
    "B300": Peak("NVIDIA B300", 8.0, "datasheet", 2250.0, "datasheet (dense bf16)", None, 32, 228, 288.0,
                 "13.5 PF FP4 dense"),
    "H200": Peak("NVIDIA H200", 4.25, "measured (device copy, read + write; datasheet 4.8)", 707.0,
                 "unrecorded (bf16 8192^3 random, no committed record; datasheet 989)", 132, 32, 228,
                 141.0),
    "H100": Peak("NVIDIA H100", 3.35, "datasheet", 989.0, "datasheet (dense bf16)", 132, 32, 228, 80.0),
    "CPU": Peak("CPU", 0.05, "order of magnitude (copies here reach 40-60 GB/s)", 0.5, "order of magnitude",
                os.cpu_count(), None, None, None),
}


@dataclass(frozen=True)
class DeviceInfo:
    backend: str  # 'rocm', 'cuda' or 'cpu'
    name: str
    compute_units: int
    memory_gb: float | None
    wave_width: int | None
    arch: str | None
    peak: Peak

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.backend == "cpu" else "cuda")


def _peak_for(name: str) -> Peak:
    upper = name.upper()
    for key in ("MI355X", "B300", "H200", "H100"):
        if key in upper:
            return PEAKS[key]
    if "MI355" in upper or "GFX950" in upper:
        return PEAKS["MI355X"]
    return PEAKS["CPU"]


@functools.lru_cache(maxsize=1)
def detect() -> DeviceInfo:
    """Detect the backend once: ROCm if torch is a HIP build with a device, CUDA with a device, else CPU."""
    if torch.cuda.is_available():
        backend = "rocm" if getattr(torch.version, "hip", None) else "cuda"
        props = torch.cuda.get_device_properties(0)
        arch = getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}"
        wave = getattr(props, "warp_size", None) or (64 if backend == "rocm" else 32)
        peak = _peak_for(props.name + " " + (arch or ""))
        return DeviceInfo(backend, props.name, props.multi_processor_count, props.total_memory / 1e9, wave,
                          arch, peak)
    return cpu_info()


@functools.lru_cache(maxsize=1)
def cpu_info() -> DeviceInfo:
    """This machine's CPU as a DeviceInfo, GPU or not: what a host-clock timing ran on."""
    return DeviceInfo("cpu", platform.processor() or platform.machine(), os.cpu_count() or 1, None, None,
                      None, PEAKS["CPU"])


def optional_backends() -> dict[str, str]:
    """Optional pieces and what is used when one is missing (absence is never an error)."""
    found = {}
    found["triton"] = "found" if importlib.util.find_spec("triton") else "missing: PyTorch references only"
    found["fla"] = ("found" if importlib.util.find_spec("fla") else
                    "missing: no fla-core peer in KDA benchmarks (pip install fla-core)")
    found["aiter"] = ("found (not yet run on AMD hardware by this project)"
                      if importlib.util.find_spec("aiter")
                      else "missing: k3lab's own MLA decode kernel is used")
    found["rocprofv3"] = ("found (not yet run on AMD hardware by this project)" if shutil.which("rocprofv3")
                          else "missing: torch.profiler is used")
    found["ncu"] = "found" if shutil.which("ncu") else "missing: no hardware counters"
    return found


def triton_interpreted() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1, the CPU path)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_preset(info: DeviceInfo | None = None) -> str:
    """The preset a notebook should use here: the TP8 slice on a GPU, tiny on a CPU."""
    info = info or detect()
    return "tiny" if info.backend == "cpu" else "tp8"


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "cuda": torch.version.cuda, "hip": getattr(torch.version, "hip", None)}
    for mod in ("triton", "fla"):
        if importlib.util.find_spec(mod):
            try:
                out[mod] = __import__(mod).__version__
            except Exception as exc:  # a broken optional install is reported, not fatal
                out[mod] = f"import failed: {type(exc).__name__}"
        else:
            out[mod] = None
    return out


def describe() -> str:
    """One line: backend, device, versions, preset."""
    info = detect()
    v = versions()
    parts = [f"backend={info.backend}", f"device={info.name}", f"units={info.compute_units}",
             f"torch={v['torch']}"]
    if v.get("hip"):
        parts.append(f"hip={v['hip']}")
    if v.get("cuda"):
        parts.append(f"cuda={v['cuda']}")
    parts.append(f"triton={v.get('triton') or 'none'}")
    parts.append(f"preset={default_preset(info)}")
    if triton_interpreted():
        parts.append("(Triton kernels run in the interpreter)")
    return "k3lab: " + " ".join(parts)


# Warnings known to be harmless in k3lab's notebooks: (category, message pattern, why it is harmless).
HARMLESS_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (RuntimeWarning, r"All-NaN (slice|axis) encountered",
     "a nan-reduction over a column that holds no value on this machine (a case not timed here): "
     "NaN is the meant result"),
)


def quiet() -> None:
    """Notebook setup: silence exactly `HARMLESS_WARNINGS` (every other warning still shows).
    Kineto's profiler chatter is dropped where traces are captured (`k3lab.profile.capture`)."""
    for category, pattern, _why in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
