"""Give the caching allocator's free GPU blocks back after every test.

PyTorch keeps the memory a process has freed in its cache, so an xdist worker that once ran a test at
K3's full shapes holds that peak for the rest of the run; on an H100 two workers held 26 and 28 GiB of
cache this way and the other four ran out of memory in tests that need a few hundred MiB. Emptying the
cache after each test makes a worker's footprint its current test's live tensors, which is what
scripts/gpu_check.py's per-worker memory figure assumes. A process that never initialised CUDA (a CPU
run, the CPU child) is left alone: asking would initialise it."""

from __future__ import annotations

import sys


def give_back() -> int:
    """Empty this process's CUDA cache if CUDA is in use; returns the bytes the cache gave back."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_reserved()
