"""tests/gpu_cache.py: a worker's cached GPU memory goes back after a test; a CPU process is untouched."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import gpu_cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the cache to give back is CUDA's)")
def test_the_freed_blocks_go_back_to_the_device():
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x
    held = torch.cuda.memory_reserved()
    assert held >= 256 << 20, "the freed tensor should still be cached before give_back"
    assert gpu_cache.give_back() >= 256 << 20
    assert torch.cuda.memory_reserved() < held


def test_a_process_without_cuda_in_use_is_not_initialised():
    code = ("import sys; sys.path.insert(0, 'tests'); import torch, gpu_cache; "
            "n = gpu_cache.give_back(); print(n, torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["0", "False"]
