"""The launcher: rank 0's result comes back, a failing or hanging rank ends every rank, bad arguments."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from k3lab.parallel import RankError, rank_device, spawn


def _sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"sum": t.item(), "world": dist.get_world_size(), "rank": dist.get_rank(),
            "device": str(rank_device()), "tensor": t}


def test_result_of_rank_zero_comes_back():
    out = spawn(_sum_of_ranks, 3, 10.0, backend="gloo", timeout_s=60)
    assert out["sum"] == 10 + 11 + 12
    assert out["world"] == 3 and out["rank"] == 0 and out["device"] == "cpu"
    assert torch.equal(out["tensor"], torch.tensor([33.0]))


def test_default_backend_on_cpu_is_gloo():
    if torch.cuda.is_available():
        pytest.skip("default backend on a GPU machine is NCCL; this checks the CPU default")
    assert spawn(lambda r, w: dist.get_backend(), 2, timeout_s=60) == "gloo"


def _raise_on_rank(rank, world_size, bad):
    if rank == bad:
        raise ValueError(f"bad input on purpose (rank {rank})")
    t = torch.ones(1)
    dist.all_reduce(t)  # the peers wait in a collective the failed rank never joins
    return t.item()


def test_raising_rank_is_named_and_every_rank_stops():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 3 raised ValueError: bad input on purpose") as info:
        spawn(_raise_on_rank, 3, 1, backend="gloo", timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert isinstance(info.value.__cause__, ValueError)
    assert "_raise_on_rank" in info.value.remote_traceback


def _hang_on_rank(rank, world_size, bad):
    if rank == bad:
        time.sleep(600)
    return rank


def test_hanging_rank_is_killed_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of 2 were still running"):
        spawn(_hang_on_rank, 2, 1, backend="gloo", timeout_s=4)
    assert time.monotonic() - t0 < 4 + 5  # the timeout plus the kill grace


def _exit_hard(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def test_rank_that_dies_without_report_is_named():
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ProcessExit: exited with code 3"):
        spawn(_exit_hard, 2, backend="gloo", timeout_s=30)


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True, "2"])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        spawn(_sum_of_ranks, world_size, 0.0)


def test_bad_backend_and_timeout():
    with pytest.raises(ValueError, match="backend must be one of"):
        spawn(_sum_of_ranks, 2, 0.0, backend="mpi")
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        spawn(_sum_of_ranks, 2, 0.0, timeout_s=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs one GPU per rank"):
            spawn(_sum_of_ranks, 2, 0.0, backend="nccl")


def test_init_from_env_outside_torchrun_says_what_is_missing(monkeypatch):
    from k3lab.parallel import init_from_env

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun's environment"):
        init_from_env()
