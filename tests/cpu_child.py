"""Tests that check CPU tensors through Triton's interpreter, on any machine.

k3lab turns Triton's interpreter on at import only where torch sees no GPU (`k3lab/__init__.py`), and
Triton decides interpreted or compiled when a kernel is defined, so in one process Triton kernels on
CPU tensors run only on a machine without a GPU. A test decorated with `@on_a_cpu` runs as it is there;
on a GPU machine it runs itself again in a child pytest that sees no GPU (CUDA_VISIBLE_DEVICES and
HIP_VISIBLE_DEVICES empty, TRITON_INTERPRET=1), and passes or fails with the child, whose output it
shows on failure. So the same facts are checked wherever `make test` runs.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CHILD_TIMEOUT_S = 600


def _needs_child() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def run_as_on_a_cpu(nodeid: str, timeout_s: float = CHILD_TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run one test (a pytest node id relative to the repository root) in a child pytest that sees no
    GPU. Returns the finished process; TimeoutExpired propagates (the test then fails, named)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", nodeid]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def on_a_cpu(test):
    """Decorator: the test checks CPU tensors through the interpreter; on a GPU machine it runs in a
    child process that sees no GPU (see the module docstring)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        if not _needs_child():
            return test(*args, **kwargs)
        current = os.environ.get("PYTEST_CURRENT_TEST", "")
        nodeid = current.rsplit(" (", 1)[0]
        if not nodeid:
            pytest.fail("on_a_cpu: PYTEST_CURRENT_TEST is not set, so the test cannot name itself to a child")
        done = run_as_on_a_cpu(nodeid)
        if done.returncode != 0:
            pytest.fail(f"{nodeid} failed in its CPU child (no GPU visible, TRITON_INTERPRET=1), exit "
                        f"{done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}", pytrace=False)
        if " passed" not in done.stdout:
            if " skipped" in done.stdout:
                pytest.skip(f"skipped in its CPU child: {done.stdout.strip().splitlines()[-1]}")
            pytest.fail(f"{nodeid}: its CPU child ran no test:\n{done.stdout[-2000:]}", pytrace=False)

    return wrapper
