"""Start ranks with an initialized torch.distributed default group, on one host or under torchrun.

`spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in `world_size` child processes
and returns rank 0's result. The same function runs unchanged under `torchrun` through
`init_from_env()`. Backends: gloo on CPU; NCCL on CUDA, which is also the name of RCCL on ROCm
(one GPU per rank, `torch.cuda.set_device(local_rank)`).

Failure contract, so that no distributed code can hang a test or a notebook:
- an exception on any rank is sent to the parent, which ends every other rank at once and raises
  `RankError` naming the rank, with the rank's traceback in the message and the original
  exception as `__cause__` when it can be pickled;
- a rank that dies without reporting (signal, os._exit) is named with its exit code;
- the process group is created with `timeout_s`, and the parent's watchdog kills every rank still
  running `timeout_s` after the start and raises `TimeoutError` naming them;
- blame goes to the rank that failed first: a rank whose error only says that a peer went away (gloo's
  "Connection reset by peer", "Read error", "Connection closed") is secondary, and the parent waits a
  moment for the primary's report or exit before it names a secondary one;
- ranks die with their parent, however it ends (SIGKILL included): on Linux each rank asks the kernel
  for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), and on every platform a thread in each rank
  watches a pipe whose only writer is the parent and ends the rank when it reads end-of-file.

Threads and start method. Each rank runs `threads_per_rank` intra-op threads (default 1):
- one thread: gloo ranks are forked. They start in milliseconds (nothing is imported again) and `fn`
  may be any callable (a lambda, a notebook's function, a module patched by the caller). A forked rank
  must stay on one thread: torch's CPU build parallelizes with GNU OpenMP (libgomp), whose thread pool
  does not survive a fork, so a forked child that enters a parallel region with two or more threads
  after the parent has run one waits forever for pool threads that do not exist (torch's DataLoader
  puts its forked workers on one thread for the same reason). A forked rank must not use CUDA either.
- several threads, or NCCL: ranks are spawned, fresh interpreters that import torch again (seconds
  each) and build their own thread pool (CUDA, too, cannot be used across a fork); `fn` must then be
  importable by name and `args` picklable, checked before any rank starts.
Small gloo jobs (the tests', the notebooks' checks) are fastest forked on one thread each: their
tensors are too small for several threads to pay, and a start costs no import.

The gloo path is tested on CPUs; the NCCL / RCCL path (spawned, one GPU per rank) is not yet run on a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import faulthandler
import io
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
_KILL_GRACE_S = 2.0
_BLAME_GRACE_S = 2.0  # how long a secondary error waits for the primary's report or exit
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# what a rank's error says when it failed only because a peer went away (gloo, the TCP store, NCCL)
_SECONDARY_TYPES = ("DistBackendError", "DistNetworkError")
_SECONDARY_TEXT = ("Connection closed", "Connection reset by peer", "Read error", "Broken pipe",
                   "Socket closed", "peer closed", "remote process exited")


class RankError(RuntimeError):
    """An exception raised on one rank, re-raised on the caller of `spawn`.

    Attributes: rank, world_size, exc_type (the name of the rank's exception class), remote_traceback.
    """

    def __init__(self, rank: int, world_size: int, exc_type: str, message: str, remote_traceback: str):
        super().__init__(
            f"rank {rank} of {world_size} raised {exc_type}: {message}\n"
            f"--- traceback on rank {rank} ---\n{remote_traceback}"
        )
        self.rank = rank
        self.world_size = world_size
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback


def default_backend(world_size: int) -> str:
    """NCCL (RCCL on ROCm) when there is one GPU for every rank, else gloo on CPU tensors."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device() -> torch.device:
    """The device this rank's tensors live on: its GPU under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_args(world_size, backend, timeout_s, threads_per_rank=1) -> str:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not isinstance(threads_per_rank, int) or isinstance(threads_per_rank, bool) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be a positive integer, got {threads_per_rank!r}")
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if backend is None:
        return default_backend(world_size)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < world_size:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: world_size={world_size}, GPUs visible: {gpus}"
            )
    return backend


def _to_cpu(obj):
    """Tensors in a result move to the CPU before they are pickled back to the parent."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_to_cpu(v) for v in obj]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    return obj


def _init_group(backend: str, rank: int, world_size: int, timeout_s: float, store=None, local_rank=None):
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {}
    if backend == "nccl":
        local = rank if local_rank is None else local_rank
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    if store is None:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs
        )


def _die_with_parent(parent_pid: int, lifeline, lifeline_writer_fd) -> None:
    """End this rank when its parent ends (module docstring): the kernel's parent-death signal where
    there is one, and a thread that reads the parent's lifeline pipe until end-of-file everywhere."""
    if lifeline_writer_fd is not None:  # forked: this process inherited the writer; only the parent keeps it
        try:
            os.close(lifeline_writer_fd)
        except OSError:
            pass
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the lifeline below still ends the rank
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        os._exit(1)

    def watch():
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)  # the parent closed its end or died: nothing is left to report to

    threading.Thread(target=watch, name="k3lab-lifeline", daemon=True).start()


def _child(rank, world_size, backend, host, port, listen_fd, timeout_s, conn, fn, args, threads,
           parent_pid=None, lifeline=None, lifeline_writer_fd=None):
    # Reports go as plain pickles (send_bytes): tensors travel by value, not as shared-memory handles
    # that would need this process alive after it exits. SIGUSR1 dumps this rank's Python stacks
    # (the parent sends it to ranks it is about to kill for running past the timeout).
    if parent_pid is not None:
        _die_with_parent(parent_pid, lifeline, lifeline_writer_fd)
    try:
        # First, before any tensor op: a forked rank inherits the parent's thread count, and its first
        # parallel region with more than one thread would hang (module docstring).
        torch.set_num_threads(threads)
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            pass  # no usable stderr (an embedding host): the timeout then kills without stacks
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0 and listen_fd is not None:  # forked: rank 0 serves the store on the parent's socket
            store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                                  master_listen_fd=listen_fd, use_libuv=False)
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        _init_group(backend, rank, world_size, timeout_s, store=store)
        result = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(("ok", rank, _to_cpu(result) if rank == 0 else None))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"rank 0's result could not be pickled back to the caller: {exc}") from exc
        conn.send_bytes(payload)
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(("error", rank, type(exc).__name__, str(exc), tb, exc))
        except Exception:  # the exception itself would not pickle: send its text only
            payload = pickle.dumps(("error", rank, type(exc).__name__, str(exc), tb, None))
        conn.send_bytes(payload)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        conn.close()


def start_method(backend: str, threads_per_rank: int = 1) -> str:
    """'fork' for gloo ranks of one thread each where the platform forks, else 'spawn' (module docstring).

    It depends on these arguments only, never on what the caller ran before (CUDA initialized or not),
    so a function that runs forked on one machine runs forked on every machine."""
    if backend == "gloo" and threads_per_rank == 1 and "fork" in mp.get_all_start_methods():
        return "fork"
    return "spawn"


def _check_spawnable(fn, backend: str, threads_per_rank: int) -> None:
    """A spawned rank unpickles fn by its module and name: refuse, before any rank starts, a fn that
    cannot travel (a lambda, a function defined inside another, one defined in a notebook cell)."""
    try:
        pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 - pickle raises PicklingError, AttributeError or TypeError
        why = "backend 'nccl'" if backend == "nccl" else f"threads_per_rank={threads_per_rank}"
        raise ValueError(
            f"fn must be importable by name when ranks are spawned ({why}; one-thread gloo ranks are forked "
            f"and take any callable): {fn!r} cannot be pickled: {exc}"
        ) from exc


def _stop_all(procs):
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _dump_stacks(procs, ranks):
    """Ask ranks that ran past the timeout for their Python stacks (on their stderr) before the kill."""
    for r in ranks:
        if procs[r].is_alive() and procs[r].pid:
            try:
                os.kill(procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
    time.sleep(0.5)


def _is_secondary(err) -> bool:
    """A rank that failed only because a peer went away (its peer's error is the cause)."""
    return err[2] in _SECONDARY_TYPES or any(t in err[3] for t in _SECONDARY_TEXT)


def _exit_text(code) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def spawn(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 120,
          threads_per_rank: int = 1):
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return rank 0's result.

    backend: None picks NCCL when there is a GPU per rank, else gloo. threads_per_rank: torch's
    intra-op threads on each rank; 1 forks gloo ranks, more spawns them (see the module docstring).
    Rank 0's result comes back pickled, with tensors on the CPU. Raises ValueError for a bad
    world_size / backend / timeout / threads_per_rank or a fn that a spawned rank cannot import,
    RankError when a rank raises or dies, TimeoutError when ranks are still running after timeout_s.
    """
    backend = _check_args(world_size, backend, timeout_s, threads_per_rank)
    method = start_method(backend, threads_per_rank)
    if method == "spawn":
        _check_spawnable(fn, backend, threads_per_rank)
    ctx = mp.get_context(method)
    # The rendezvous store. Forked ranks inherit a listening socket and rank 0 serves the store on it,
    # so the parent runs no store thread while it forks; spawned ranks connect to a store the parent
    # serves (a spawned process starts fresh, threads do not matter).
    if method == "fork":
        store = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        store.bind(("127.0.0.1", 0))
        store.listen(max(16, world_size))
        port, listen_fd = store.getsockname()[1], store.fileno()
    else:
        store = dist.TCPStore("127.0.0.1", 0, None, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        port, listen_fd = store.port, None
    procs, conns = [], {}
    # the lifeline: the parent holds its only writer; every rank watches the reader (module docstring)
    lifeline, lifeline_writer = ctx.Pipe(duplex=False)
    writer_fd = lifeline_writer.fileno() if method == "fork" else None
    start = time.monotonic()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child, name=f"k3lab-rank{rank}",
                args=(rank, world_size, backend, "127.0.0.1", port, listen_fd, timeout_s, child_end, fn, args,
                      threads_per_rank, os.getpid(), lifeline, writer_fd),
                daemon=True,
            )
            try:
                p.start()
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                if method != "spawn":
                    raise
                # fn pickled above: what failed is args
                raise ValueError(f"args must be picklable to start spawned ranks: {exc}") from exc
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
        return _collect(procs, conns, world_size, start + timeout_s, timeout_s)
    finally:
        _stop_all(procs)
        for c in conns:
            c.close()
        lifeline.close()
        lifeline_writer.close()
        if method == "fork":
            store.close()
        del store


def _collect(procs, conns, world_size, deadline, timeout_s):
    """Wait for every rank's report; the first error (or death, or the deadline) ends them all."""
    state = {"result": None, "done": set(), "errors": []}
    waiting = dict(conns)  # pipe -> rank, until the rank's one message arrived
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    blame_by = None  # when only secondary errors are in: the moment to stop waiting for the primary
    while len(state["done"]) < world_size:
        remaining = deadline - time.monotonic()
        if blame_by is not None:
            remaining = min(remaining, blame_by - time.monotonic())
        if blame_by is not None and (remaining <= 0 or not (waiting or sentinels)):
            break
        if remaining <= 0:
            late = [r for r in range(world_size) if r not in state["done"]]
            _dump_stacks(procs, late)
            raise TimeoutError(
                f"ranks {late} of {world_size} were still running after timeout_s={timeout_s} s; killed"
            )
        for obj in mp_connection.wait(list(waiting) + list(sentinels), timeout=remaining):
            if obj in waiting:
                _receive(obj, waiting.pop(obj), state)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                pipe = next((c for c, r in waiting.items() if r == rank), None)
                if pipe is not None and pipe.poll():  # its report arrived with its exit
                    _receive(pipe, waiting.pop(pipe), state)
                reported = rank in state["done"] or any(e[1] == rank for e in state["errors"])
                if not reported:
                    procs[rank].join(0.1)
                    state["errors"].append(("error", rank, "ProcessExit",
                                            f"{_exit_text(procs[rank].exitcode)} without a report",
                                            "", None))
        if state["errors"]:
            if not all(_is_secondary(e) for e in state["errors"]):
                break
            if blame_by is None:
                blame_by = time.monotonic() + _BLAME_GRACE_S
    if state["errors"]:
        # arrival order; the first error that is not a peer's going away is the cause
        primary = sorted(state["errors"], key=_is_secondary)[0]
        _, rank, exc_type, message, tb, exc = primary
        raise RankError(rank, world_size, exc_type, message, tb) from exc
    return state["result"]


def _receive(pipe, rank, state):
    try:
        msg = pickle.loads(pipe.recv_bytes())
    except (EOFError, OSError):
        return  # the rank died without a report: its sentinel says how
    if msg[0] == "ok":
        state["done"].add(rank)
        if rank == 0:
            state["result"] = msg[2]
    else:
        state["errors"].append(msg)


def init_from_env(backend: str | None = None, timeout_s: float = 120) -> tuple[int, int]:
    """Initialize the default group from torchrun's environment; return (rank, world_size).

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; under NCCL each process takes
    GPU LOCAL_RANK. Already initialized: returns the current group's rank and size.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env needs torchrun's environment; missing {missing}")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > local_rank else "gloo"
    elif backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    _init_group(backend, rank, world_size, timeout_s, local_rank=local_rank)
    return rank, world_size
