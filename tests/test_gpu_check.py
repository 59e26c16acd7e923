"""scripts/gpu_check.py's choice of pytest-xdist workers from the GPU's free memory and the CPU count,
at the machines' own figures (torch.cuda.mem_get_info's free bytes on an idle card), and its refusals."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)

GIB = 2 ** 30
H100_FREE, H200_FREE = int(79.1 * GIB), int(139.8 * GIB)  # idle: 81,559 and 143,771 MiB cards


@pytest.mark.parametrize("free, cpus, want", [
    (H100_FREE, 16, 4),  # the H100: out of memory with 12 workers, not with 4
    (H200_FREE, 16, 8),  # the H200: within memory with 8 and 12; half its 16 cores
    (H200_FREE, 64, 8),  # more cores do not raise it past the memory
    (H100_FREE, 4, 2),  # fewer cores lower it
    (int(15.9 * GIB), 16, 1),  # a nearly full card still runs, on one worker
    (0, 16, 1),
    (None, 16, 1),  # no GPU: as make test runs
    (H200_FREE, 1, 1),
    (H200_FREE, None, 1),  # CPU count unknown: taken as 2
])
def test_workers_fit_the_gpu_memory_and_half_the_cpus(free, cpus, want):
    n, why = gpu_check.choose_workers(free, cpus)
    assert n == want, why
    assert (f"so {want}" in why) if free is not None else ("no GPU" in why)


def test_twelve_workers_fit_neither_card_at_the_measured_figure():
    """The figure is safe where the H100 failed: 12 workers never come out of the H100's memory, and
    a per-worker figure of the H100's own failure (79 GiB / 12) would have allowed it."""
    assert gpu_check.choose_workers(H100_FREE, 128)[0] < 12
    assert gpu_check.choose_workers(H100_FREE, 128, per_worker_bytes=H100_FREE // 12)[0] == 12
    assert gpu_check.PER_WORKER_BYTES * 12 > H100_FREE


@pytest.mark.parametrize("kwargs, name", [
    (dict(free_bytes=-1, cpu_count=8), "free_bytes"),
    (dict(free_bytes=1.5 * GIB, cpu_count=8), "free_bytes"),
    (dict(free_bytes=True, cpu_count=8), "free_bytes"),
    (dict(free_bytes=GIB, cpu_count=0), "cpu_count"),
    (dict(free_bytes=GIB, cpu_count=8, per_worker_bytes=0), "per_worker_bytes"),
    (dict(free_bytes=GIB, cpu_count=8, per_worker_bytes=None), "per_worker_bytes"),
])
def test_bad_figures_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be an int"):
        gpu_check.choose_workers(**kwargs)


def test_workers_option_overrides_and_refuses_zero(tmp_path, monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(gpu_check.subprocess, "call", lambda cmd: seen.append(cmd) or 0)
    monkeypatch.setattr(gpu_check, "gpu_free_bytes", lambda: H200_FREE)
    monkeypatch.setattr(gpu_check.os, "cpu_count", lambda: 16)
    assert gpu_check.main([str(tmp_path), "--label", "x", "tests/test_config.py"]) == 0
    assert seen[-1][seen[-1].index("-n") + 1] == "8"  # chosen
    assert gpu_check.main([str(tmp_path), "--label", "y", "--workers", "1", "tests/test_config.py"]) == 0
    assert "-n" not in seen[-1]  # one worker: no xdist, as make test
    assert gpu_check.main([str(tmp_path), "--label", "z", "--workers", "3", "tests/test_config.py"]) == 0
    assert seen[-1][seen[-1].index("-n") + 1] == "3"
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--workers", "0"])
    assert "--workers must be >= 1" in capsys.readouterr().err
