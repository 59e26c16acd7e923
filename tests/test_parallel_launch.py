"""The launcher: rank 0's result comes back, a failing or hanging rank ends every rank, ranks never hang
on the parent's thread pool, bad arguments.

Time limits of the gloo jobs leave room for a loaded machine (another test suite on the same cores):
they only bound a hang, which is still caught and named, and cost nothing when the ranks finish.
"""

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from k3lab.parallel import RankError, rank_device, spawn
from k3lab.parallel.launch import RankTimeout, start_method

ROOM_S = 120  # the limit of a small gloo job here: a hang is caught and named after this


def _sum_of_ranks(rank, world_size, offset):
    t = torch.tensor([float(rank + offset)])
    dist.all_reduce(t)
    return {"sum": t.item(), "world": dist.get_world_size(), "rank": dist.get_rank(),
            "device": str(rank_device()), "tensor": t}


def test_result_of_rank_zero_comes_back():
    out = spawn(_sum_of_ranks, 3, 10.0, backend="gloo", timeout_s=ROOM_S)
    assert out["sum"] == 10 + 11 + 12
    assert out["world"] == 3 and out["rank"] == 0 and out["device"] == "cpu"
    assert torch.equal(out["tensor"], torch.tensor([33.0]))


def test_default_backend_on_cpu_is_gloo():
    if torch.cuda.is_available():
        pytest.skip("default backend on a GPU machine is NCCL; this checks the CPU default")
    assert spawn(lambda r, w: dist.get_backend(), 2, timeout_s=ROOM_S) == "gloo"


def _raise_on_rank(rank, world_size, bad):
    if rank == bad:
        raise ValueError(f"bad input on purpose (rank {rank})")
    t = torch.ones(1)
    dist.all_reduce(t)  # the peers wait in a collective the failed rank never joins
    return t.item()


def test_raising_rank_is_named_and_every_rank_stops():
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 3 raised ValueError: bad input on purpose") as info:
        spawn(_raise_on_rank, 3, 1, backend="gloo", timeout_s=ROOM_S)
    assert time.monotonic() - t0 < ROOM_S / 2  # ended by the error, not by the timeout
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert isinstance(info.value.__cause__, ValueError)
    assert "_raise_on_rank" in info.value.remote_traceback


def _hang_on_rank(rank, world_size, bad):
    dist.barrier()  # every rank started and joined the group before the limit begins to matter
    if rank == bad:
        time.sleep(600)
    return rank


def test_hanging_rank_is_killed_within_the_timeout():
    limit = 10  # long enough for rank 0 to start and report on a loaded machine, short for a test
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank \[1\] of 2 did not finish within timeout_s=10 s") as info:
        spawn(_hang_on_rank, 2, 1, backend="gloo", timeout_s=limit)
    assert limit <= time.monotonic() - t0 < limit + 15  # the timeout, the stacks and the kill grace
    assert isinstance(info.value, RankTimeout) and info.value.stuck == [1] and info.value.waiting == []
    assert "at _hang_on_rank (test_parallel_launch.py:" in str(info.value)


def _hang_while_peers_wait(rank, world_size, bad):
    dist.barrier()
    if rank == bad:
        time.sleep(600)  # in its own code: the one its peers wait for
    t = torch.ones(1)
    dist.all_reduce(t)  # every other rank waits here for the stuck one
    return t.item()


def test_a_hang_names_the_stuck_rank_not_the_ranks_waiting_for_it():
    """Every rank is still running at the deadline, but only rank 2 is outside a collective: the error
    names it (and where it was), and says the others were waiting for it."""
    with pytest.raises(RankTimeout) as info:
        spawn(_hang_while_peers_wait, 4, 2, backend="gloo", timeout_s=10)
    err = info.value
    assert err.stuck == [2] and err.waiting == [0, 1, 3], str(err)
    text = str(err)
    assert text.startswith("rank [2] of 4 did not finish") and "rank 2 at _hang_while_peers_wait" in text
    assert "ranks [0, 1, 3] were waiting for it" in text
    assert "all_reduce" in err.where[0] and "_hang_while_peers_wait" in err.where[0]


def _mismatched(rank, world_size):
    dist.barrier()
    g = dist.new_group(timeout=datetime.timedelta(seconds=600))  # the test's deadline comes first
    if rank == 0:
        dist.barrier(group=g)  # the other waits in an all_reduce: neither can finish
    else:
        dist.all_reduce(torch.ones(1), group=g)


def test_ranks_that_all_wait_in_collectives_are_each_named_with_their_call():
    with pytest.raises(RankTimeout, match=r"ranks \[0, 1\] of 2 were all waiting") as info:
        spawn(_mismatched, 2, backend="gloo", timeout_s=10)
    assert info.value.stuck == [0, 1]
    assert "barrier" in info.value.where[0] and "all_reduce" in info.value.where[1]


def _exit_hard(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def test_rank_that_dies_without_report_is_named():
    with pytest.raises(RankError, match=r"rank 1 of 2 raised ProcessExit: exited with code 3"):
        spawn(_exit_hard, 2, backend="gloo", timeout_s=ROOM_S)


# --------------------------------------------------------------------------- threads per rank
def _parallel_work(rank, world_size):
    """Work that enters OpenMP parallel regions when this rank has several threads: an elementwise op
    over 2M values (torch's parallel_for) and a matmul. Returns every rank's thread count and sums."""
    x = torch.linspace(-1, 1, 2_000_000, dtype=torch.float64)
    a = torch.linspace(0, 1, 384 * 384, dtype=torch.float64).reshape(384, 384)
    mine = [torch.get_num_threads(), x.exp().sum().item(), (a @ a).trace().item()]
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def _expected_work():
    x = torch.linspace(-1, 1, 2_000_000, dtype=torch.float64)
    a = torch.linspace(0, 1, 384 * 384, dtype=torch.float64).reshape(384, 384)
    return x.exp().sum().item(), (a @ a).trace().item()


@pytest.fixture
def parent_pool_in_use():
    """The parent's OpenMP pool holds two threads or more and has run a parallel region, as in any
    notebook or test process that computed something before starting ranks (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    expected = _expected_work()  # runs the parallel regions in this process
    yield expected
    torch.set_num_threads(before)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_forked_ranks_after_the_parents_thread_pool_do_not_hang(parent_pool_in_use, world_size):
    """A forked rank that entered a parallel region with the parent's thread count hung: the pool
    does not survive fork (launch's docstring). Forked ranks run one thread each and finish."""
    every = spawn(_parallel_work, world_size, backend="gloo", timeout_s=ROOM_S)
    assert start_method("gloo") == "fork"
    for threads, exp_sum, trace in every:
        assert threads == 1
        assert (exp_sum, trace) == pytest.approx(parent_pool_in_use, rel=1e-12)


@pytest.mark.slow
def test_several_threads_per_rank_are_spawned_and_finish(parent_pool_in_use):
    """Two ranks of three threads each (on any machine; three, not the two cores of CI's machine, so that
    the count is the launcher's and not torch's default) start fresh (spawned), build their own thread
    pools and compute the same numbers. A spawned rank imports torch again: seconds, so one world size."""
    assert start_method("gloo", 3) == "spawn"
    every = spawn(_parallel_work, 2, backend="gloo", timeout_s=2 * ROOM_S, threads_per_rank=3)
    assert len(every) == 2
    for threads, exp_sum, trace in every:
        assert threads == 3
        assert (exp_sum, trace) == pytest.approx(parent_pool_in_use, rel=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: forked gloo ranks after CUDA init")
def test_gloo_ranks_fork_after_the_parent_used_cuda():
    """A notebook on a GPU has CUDA initialized before it starts gloo ranks; they are still forked (a
    lambda works) and run on CPU tensors, which a fork allows as long as the ranks do not use CUDA."""
    torch.ones(4, device="cuda").sum().item()
    assert torch.cuda.is_initialized() and start_method("gloo") == "fork"
    out = spawn(lambda r, w: _sum_of_ranks(r, w, 1.0), 2, backend="gloo", timeout_s=ROOM_S)
    assert out["sum"] == 1 + 2 and out["device"] == "cpu"


def test_start_method_depends_on_the_arguments_only():
    assert start_method("gloo", 1) == "fork"  # CUDA initialized or not: lambdas and patches work alike
    assert start_method("gloo", 3) == "spawn" and start_method("nccl", 1) == "spawn"


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_bad_threads_per_rank(threads):
    with pytest.raises(ValueError, match="threads_per_rank must be a positive integer"):
        spawn(_sum_of_ranks, 2, 0.0, threads_per_rank=threads)


def test_spawned_ranks_refuse_a_fn_they_cannot_import():
    with pytest.raises(ValueError, match=r"fn must be importable by name when ranks are spawned "
                                         r"\(threads_per_rank=2"):
        spawn(lambda r, w: r, 2, backend="gloo", threads_per_rank=2)


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


# --------------------------------------------------------------------------- blame and dead parents
def _die_by_signal(rank, world_size, bad):
    dist.barrier()  # every rank is in the group, so its peers see a reset connection, not a refused one
    if rank == bad:
        os.kill(os.getpid(), 9)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_the_rank_that_died_first_is_named_not_a_peer_that_lost_it():
    """At 4 ranks a killed rank's peers fail with gloo's "Connection reset by peer" / "Read error"
    (secondary); the error names the killed rank, every time."""
    for _ in range(3):
        with pytest.raises(RankError) as info:
            spawn(_die_by_signal, 4, 2, backend="gloo", timeout_s=ROOM_S)
        assert info.value.rank == 2, str(info.value)
        assert "killed by SIGKILL" in str(info.value)


def test_peer_loss_messages_are_secondary():
    from k3lab.parallel.launch import _is_secondary

    reset = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: " \
            "Connection reset by peer"
    assert _is_secondary(("error", 0, "RuntimeError", reset, "", None))
    assert _is_secondary(("error", 0, "DistBackendError", "anything", "", None))
    timed_out = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 40000ms for recv operation"
    assert _is_secondary(("error", 0, "RuntimeError", timed_out, "", None))
    assert not _is_secondary(("error", 0, "ValueError", "bad input on purpose", "", None))


def _start_a_child(folder, rank) -> int:
    """A process of the rank's own (what a rank running a compiler or a server would start); its pid is
    noted in `folder` as child<rank>.pid."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(folder, f"child{rank}.pid").write_text(str(child.pid))
    return child.pid


def _sleep_and_note_pid(rank, world_size, folder):
    _start_a_child(folder, rank)
    Path(folder, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper (a rank whose parent died is reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def parent_main(folder: str, threads: int) -> None:
    """The parent a test kills: two ranks that sleep (run by `python -c`, see below)."""
    spawn(_sleep_and_note_pid, 2, folder, backend="gloo", timeout_s=900, threads_per_rank=threads)


def _gone_within(pids, seconds: float) -> list[int]:
    """The pids still alive after `seconds` (killed then, so that a failing test leaves nothing behind)."""
    t0 = time.monotonic()
    while any(map(_alive, pids)) and time.monotonic() - t0 < seconds:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return left


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")
@pytest.mark.parametrize("threads", [pytest.param(2, id="spawn"), pytest.param(1, id="fork")])
def test_ranks_and_their_children_die_with_a_killed_parent(tmp_path, threads):
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import test_parallel_launch as t; "
            f"t.parent_main({str(tmp_path)!r}, {threads})")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        t0 = time.monotonic()
        while len(list(tmp_path.glob("rank*.pid"))) < 2:  # a spawned rank imports torch: seconds
            assert parent.poll() is None, "the parent ended before its ranks started"
            assert time.monotonic() - t0 < ROOM_S, "the ranks did not start"
            time.sleep(0.2)
        ranks = [int(p.read_text()) for p in tmp_path.glob("rank*.pid")]
        children = [int(p.read_text()) for p in tmp_path.glob("child*.pid")]
        assert len(children) == 2 and all(map(_alive, ranks + children))
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        left = _gone_within(ranks + children, 10)
        assert not left, (f"still alive 10 s after their parent was killed: ranks {set(left) & set(ranks)}, "
                          f"children of ranks {set(left) & set(children)}")
    finally:
        if parent.poll() is None:
            parent.kill()


def _child_then(rank, world_size, folder, how):
    _start_a_child(folder, rank)
    dist.barrier()
    if how == "raise" and rank == 1:
        raise ValueError("after starting a process")
    return rank


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc (Linux)")
@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_ranks_children_end_when_spawn_returns_or_raises(tmp_path, how):
    if how == "raise":
        with pytest.raises(RankError, match="after starting a process"):
            spawn(_child_then, 2, str(tmp_path), how, backend="gloo", timeout_s=ROOM_S)
    else:
        assert spawn(_child_then, 2, str(tmp_path), how, backend="gloo", timeout_s=ROOM_S) == 0
    children = [int(p.read_text()) for p in tmp_path.glob("child*.pid")]
    assert len(children) == 2
    assert not _gone_within(children, 5), "a rank's child outlived spawn()"
