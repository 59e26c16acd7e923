"""Build every HIP/CUDA kernel of kernels/ for this machine's GPU before the studies run, all at once.

Each .cu is otherwise compiled the first time an op loads it, one after another in the middle of the
studies (tens of seconds each with nvcc on a fresh machine). Here they are compiled in parallel
threads (each compiler is its own process) into the same on-disk cache `k3lab.ops._build.load` reads,
with the same flags, so the studies and the notebooks' kernels then find them built. Nothing is timed
while they compile. A kernel that fails to build is reported here and left alone: the op that needs it
says what runs instead, as it would have without this step.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


def sources() -> list[str]:
    """The kernel names (kernels/<name>.cu) in the tree."""
    from k3lab.ops import _build

    return sorted(p.stem for p in _build.KERNEL_DIR.glob("*.cu"))


def build_all(max_workers: int | None = None) -> tuple[list[tuple[str, float, str]], str]:
    """Compile every kernels/*.cu for the visible GPU, `max_workers` at a time (default: all).

    Returns ([(name, seconds, 'built' or 'FAILED: <first line>')], note); note says why nothing was
    built when there is no GPU or no compiler (then the list is empty)."""
    import torch

    from k3lab.ops import _build

    if max_workers is not None and (not isinstance(max_workers, int) or max_workers < 1):
        raise ValueError(f"max_workers must be a positive integer or None, got {max_workers!r}")
    if not torch.cuda.is_available():
        return [], "no GPU visible to torch: nothing to build"
    kind, target = _build.device_target()
    if _build.find_toolchain(kind) is None:
        return [], f"{kind} not found: the ops that need a .cu kernel say what runs instead"
    names = sources()

    def one(name: str) -> tuple[str, float, str]:
        start = time.perf_counter()
        try:
            _build.compile_kernel(name, kind=kind, target=target, output="shared")
            status = "built"
        except _build.KernelUnavailable as exc:
            status = "FAILED: " + (str(exc).splitlines() or [type(exc).__name__])[0]
        return name, time.perf_counter() - start, status

    pool = ThreadPoolExecutor(max_workers=max_workers or max(1, len(names)))
    try:
        results = list(pool.map(one, names))
    except BaseException:  # Ctrl-C: wait for no compiler (the report then kills those still running)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return results, f"{kind} for {target}"
