"""k3lab._cells: inside IPython every cell ends by giving cached GPU memory back; elsewhere nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from k3lab import _cells


class _Events:
    def __init__(self):
        self.registered = []

    def register(self, name, fn):
        self.registered.append((name, fn))


class _Shell:
    def __init__(self):
        self.events = _Events()


def test_registers_once_per_shell_after_each_cell():
    shell = _Shell()
    assert _cells.hook_cells(shell) is True
    assert _cells.hook_cells(shell) is True
    assert shell.events.registered == [("post_run_cell", _cells.give_back_gpu_cache)]


def test_no_shell_no_hook():
    assert _cells.hook_cells(object()) is False


def test_a_kernel_without_cuda_in_use_is_not_initialised():
    code = ("import torch, k3lab; from k3lab import _cells; "
            "print(_cells.give_back_gpu_cache(None), torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["0", "False"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the cache to give back is CUDA's)")
def test_the_freed_blocks_go_back_after_a_cell():
    x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del x
    held = torch.cuda.memory_reserved()
    assert held >= 256 << 20
    assert _cells.give_back_gpu_cache(None) >= 256 << 20
    assert torch.cuda.memory_reserved() < held


def test_a_real_ipython_shell_gets_the_hook():
    pytest.importorskip("IPython")
    code = ("from IPython.testing.globalipapp import start_ipython; ip = start_ipython(); import k3lab; "
            "from k3lab import _cells; "
            "print(_cells.give_back_gpu_cache in ip.events.callbacks['post_run_cell'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]
