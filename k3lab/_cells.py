"""A notebook kernel gives the GPU memory it has cached back to the device after every cell.

PyTorch's caching allocator keeps what a process freed, so a kernel that ran one cell at K3's full
shapes holds that cell's peak (tens of GiB) until it exits. On a GPU several kernels share (a
workshop's JupyterHub, the test runner's notebooks beside its workers) that starves the others: on an
H100 one notebook kernel held 48 GiB of cache while tests beside it ran out of memory. After each cell
the cache is emptied; the next cell allocates afresh (milliseconds; every measurement in k3lab warms
up before it times). Registered once, on `import k3lab` inside IPython; nothing happens elsewhere, and
a kernel that never used CUDA is not made to initialise it.

Before emptying, the hook notes the kernel's peak so far (`torch.cuda.max_memory_reserved`, what the
allocator held at its most, plus the CUDA context it cannot see: CONTEXT_GIB) in GiB, in the file that
K3LAB_GPU_PEAK_FILE names when it is set: the report's notebook workers set it, keep each notebook's
peak in their timings, and start no notebook that its neighbours' peaks leave no room for
(k3lab.report.workers).
"""

from __future__ import annotations

import os
import sys

_HOOKED: set[int] = set()
PEAK_ENV = "K3LAB_GPU_PEAK_FILE"
CONTEXT_GIB = 0.5  # a CUDA context's own device memory, outside the allocator's count (about 0.5 GiB)


def give_back_gpu_cache(*_event) -> int:
    """Empty this process's CUDA cache if CUDA is in use; the bytes it gave back (0 otherwise)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    note_peak(torch.cuda.max_memory_reserved())
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved()


def note_peak(reserved_bytes: int) -> None:
    """Write reserved_bytes / 2^30 + CONTEXT_GIB to the file PEAK_ENV names (nothing when unset); the
    allocator's maximum only grows, so the file holds the kernel's peak so far."""
    path = os.environ.get(PEAK_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"{reserved_bytes / 2 ** 30 + CONTEXT_GIB:.2f}\n")


def read_peak(path) -> float | None:
    """The GiB a note_peak file holds; None when it is absent or unreadable (a kernel that never used
    CUDA writes none)."""
    try:
        with open(path, encoding="utf-8") as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


def hook_cells(shell=None) -> bool:
    """Register `give_back_gpu_cache` after every cell of `shell` (default: the running IPython, if
    any). True when the hook is (already) registered, False when there is no IPython shell."""
    if shell is None:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
    events = getattr(shell, "events", None)
    if events is None:
        return False
    if id(shell) not in _HOOKED:
        events.register("post_run_cell", give_back_gpu_cache)
        _HOOKED.add(id(shell))
    return True
