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
- the parent's watchdog kills every rank still running `timeout_s` after the start and raises
  `RankTimeout` (a TimeoutError) naming the rank that is stuck: each rank's progress thread tells the
  parent where its main thread is whenever that changes, so a rank waiting inside a torch.distributed
  call (a collective, a barrier, joining the group) is told apart from the one its peers wait for (in
  its own code, or never reported). The ranks' store and process group time out _WATCHDOG_FIRST_S
  later, so that the watchdog, which knows the stuck rank, speaks first and a waiting rank's own timeout
  error never takes the blame;
- blame goes to the rank that failed first: a rank whose error only says that a peer went away (gloo's
  "Connection reset by peer", "Read error", "Connection closed", "Timed out waiting") is secondary, and
  the parent waits a moment for the primary's report or exit before it names a secondary one;
- ranks die with their parent, however it ends (SIGKILL included): on Linux each rank asks the kernel
  for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), and on every platform a thread in each rank
  watches a pipe whose only writer is the parent and ends the rank when it reads end-of-file;
- the processes a rank starts end with it: each rank leads its own process group, which the parent
  kills when it stops the ranks; on Linux a small guard process per rank (forked at the rank's start,
  holding nothing else) kills the group when the rank dies, however it dies, so a rank's children do not
  outlive a parent that was killed (a child that leaves the group, with setsid, is its own).

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
                   "Socket closed", "peer closed", "remote process exited", "Timed out waiting")
_PROGRESS_S = 0.5  # how often a rank's progress thread looks at its main thread
_SETTLE_S = 2.0  # how long ranks that all reported may take to exit on their own (_stop_all)
_WATCHDOG_FIRST_S = 30.0  # a spawned group's own timeouts come this long after the parent's watchdog
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DIST_DIR = os.path.join(os.path.dirname(dist.__file__), "")


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


class RankTimeout(TimeoutError):
    """Ranks still running `timeout_s` after the start (they were killed). Attributes: `stuck` (the ranks
    that were not waiting in a torch.distributed call, or never reported: the cause), `waiting` (those
    waiting in one for the stuck), `where` (rank -> where its main thread last was)."""

    def __init__(self, message: str, stuck: list[int], waiting: list[int], where: dict[int, str]):
        super().__init__(message)
        self.stuck, self.waiting, self.where = stuck, waiting, where


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


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _end_group() -> None:
    """Kill this rank's process group (itself and the processes it started) when it leads one; else
    end this process only (never the parent's group)."""
    if hasattr(os, "killpg") and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os._exit(1)


_guard = {"pid": None}  # this rank's guard process, reaped by the rank when it ends normally


def _start_group_guard(libc) -> None:
    """Fork the guard (module docstring): it closes every descriptor it inherited, asks for SIGTERM when
    this rank dies, waits for it, then kills the rank's group. Linux only (prctl)."""
    rank_pid = os.getpid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # queued for sigwait, never lost
    try:
        pid = os.fork()
    except OSError:
        pid = None  # no guard: the parent's group kill still covers every end but its own death
    if pid != 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        _guard["pid"] = pid
        return
    try:  # the guard: os calls only
        os.closerange(3, 1 << 16)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() == rank_pid:
            signal.sigwait({signal.SIGTERM})
        os.killpg(rank_pid, signal.SIGKILL)
    finally:
        os._exit(0)


def _stop_guard() -> None:
    """A rank that ends normally stops and reaps its guard (left alone, it would outlive the rank as an
    orphan that only init reaps); the parent then kills what is left of the group."""
    pid, _guard["pid"] = _guard["pid"], None
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


def _die_with_parent(parent_pid: int, lifeline, lifeline_writer_fd) -> None:
    """End this rank when its parent ends, and the processes it starts with it (module docstring): its
    own process group and, on Linux, the group's guard; the kernel's parent-death signal where there is
    one, and a thread that reads the parent's lifeline pipe until end-of-file everywhere."""
    if lifeline_writer_fd is not None:  # forked: this process inherited the writer; only the parent keeps it
        try:
            os.close(lifeline_writer_fd)
        except OSError:
            pass
    try:
        os.setpgid(0, 0)
    except (AttributeError, OSError):
        pass  # no groups here: _end_group then ends this process alone
    libc = _libc() if sys.platform.startswith("linux") else None
    if libc is not None:
        try:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getpgrp() == os.getpid():
                _start_group_guard(libc)
        except AttributeError:
            pass  # no prctl: the lifeline below still ends the rank
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        _end_group()

    def watch():
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        _end_group()  # the parent closed its end or died: nothing is left to report to

    threading.Thread(target=watch, name="k3lab-lifeline", daemon=True).start()


def _where(frame) -> tuple[str, bool]:
    """Where a thread is, from its innermost frame: its innermost frame outside torch, and whether it is
    inside a torch.distributed call (then that call's name too)."""
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    own = next((f for f in stack if not f.f_code.co_filename.startswith(_TORCH_DIR)), None)
    at = f"{own.f_code.co_name} ({os.path.basename(own.f_code.co_filename)}:{own.f_lineno})" if own else "?"
    call = next((f for f in stack if f.f_code.co_filename.startswith(_DIST_DIR)), None)
    if call is not None:
        return f"waiting in torch.distributed {call.f_code.co_name}, called from {at}", True
    return f"at {at}", False


class _Progress:
    """A rank's reports to the parent over one pipe: 'where' messages from a thread that looks at the
    main thread every _PROGRESS_S and sends when the answer changed, then the one final report."""

    def __init__(self, conn, rank: int):
        self.conn, self.rank = conn, rank
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.main = threading.get_ident()
        self.joining = True  # in TCPStore / init_process_group: waiting for the peers

    def start(self) -> None:
        threading.Thread(target=self._run, name="k3lab-progress", daemon=True).start()

    def _run(self) -> None:
        last = None
        while not self.stop.wait(_PROGRESS_S):
            try:
                frame = sys._current_frames().get(self.main)
                where = (("joining the process group", True) if self.joining else
                         _where(frame) if frame is not None else None)
            except Exception:  # noqa: BLE001 - a note it cannot make leaves the last one standing
                continue
            if where is not None and where != last:
                self.send(pickle.dumps(("where", self.rank, *where)))
                last = where

    def send(self, payload: bytes, final: bool = False) -> None:
        """Send a pickled message; the final one (the rank's report) ends the notes."""
        with self.lock:
            if self.stop.is_set():
                return
            if final:
                self.stop.set()
            try:
                self.conn.send_bytes(payload)
            except OSError:
                pass  # the parent went away: the lifeline ends this rank


def _child(rank, world_size, backend, host, port, listen_fd, timeout_s, conn, fn, args, threads,
           parent_pid=None, lifeline=None, lifeline_writer_fd=None):
    # Reports go as plain pickles (send_bytes): tensors travel by value, not as shared-memory handles
    # that would need this process alive after it exits. SIGUSR1 dumps this rank's Python stacks
    # (the parent sends it to ranks it is about to kill for running past the timeout).
    if parent_pid is not None:
        _die_with_parent(parent_pid, lifeline, lifeline_writer_fd)
    progress = _Progress(conn, rank)
    try:
        # First, before any tensor op: a forked rank inherits the parent's thread count, and its first
        # parallel region with more than one thread would hang (module docstring).
        torch.set_num_threads(threads)
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            pass  # no usable stderr (an embedding host): the timeout then kills without stacks
        progress.start()
        timeout_s = timeout_s + _WATCHDOG_FIRST_S  # the parent's watchdog first (module docstring)
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0 and listen_fd is not None:  # forked: rank 0 serves the store on the parent's socket
            store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                                  master_listen_fd=listen_fd, use_libuv=False)
        else:
            store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        _init_group(backend, rank, world_size, timeout_s, store=store)
        progress.joining = False
        result = fn(rank, world_size, *args)
        try:
            payload = pickle.dumps(("ok", rank, _to_cpu(result) if rank == 0 else None))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"rank 0's result could not be pickled back to the caller: {exc}") from exc
        progress.send(payload, final=True)
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises goes to the parent
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(("error", rank, type(exc).__name__, str(exc), tb, exc))
        except Exception:  # the exception itself would not pickle: send its text only
            payload = pickle.dumps(("error", rank, type(exc).__name__, str(exc), tb, None))
        progress.send(payload, final=True)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        conn.close()
        _stop_guard()


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


def _stop_all(procs, settle_s: float = 0.0):
    """End every rank, then every process left in a rank's group (what the rank started). settle_s: how
    long ranks that all reported may take to exit on their own first (each reaps its guard on the way)."""
    settle_by = time.monotonic() + settle_s
    for p in procs:
        p.join(max(0.0, settle_by - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)
    for p in procs:
        # a group whose id is the rank's pid exists only if the rank made it; never this process's own
        if p.pid and hasattr(os, "killpg") and p.pid != os.getpgrp():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass  # no such group left


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
    RankError when a rank raises or dies, RankTimeout (a TimeoutError naming the stuck rank) when ranks
    are still running after timeout_s.
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
                              timeout=datetime.timedelta(seconds=timeout_s + _WATCHDOG_FIRST_S),
                              wait_for_workers=False)
        port, listen_fd = store.port, None
    procs, conns = [], {}
    # the lifeline: the parent holds its only writer; every rank watches the reader (module docstring)
    lifeline, lifeline_writer = ctx.Pipe(duplex=False)
    writer_fd = lifeline_writer.fileno() if method == "fork" else None
    start, finished = time.monotonic(), False
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
        result = _collect(procs, conns, world_size, start + timeout_s, timeout_s)
        finished = True
        return result
    finally:
        _stop_all(procs, _SETTLE_S if finished else 0.0)
        for c in conns:
            c.close()
        lifeline.close()
        lifeline_writer.close()
        if method == "fork":
            store.close()
        del store


def _timeout(procs, state, world_size, timeout_s) -> RankTimeout:
    """The error for ranks still running at the deadline, naming the stuck ones (module docstring)."""
    late = [r for r in range(world_size) if r not in state["done"]]
    where = {r: state["where"].get(r, ("sent no progress report (not started?)", False))[0] for r in late}
    waiting = [r for r in late if state["where"].get(r, ("", False))[1]]
    stuck = [r for r in late if r not in waiting]
    _dump_stacks(procs, stuck or late)
    if stuck:
        text = "; ".join(f"rank {r} {where[r]}" for r in stuck)
        msg = (f"rank{'s' if len(stuck) > 1 else ''} {stuck} of {world_size} did not finish within "
               f"timeout_s={timeout_s} s, outside any torch.distributed call: {text}")
        if waiting:
            msg += f"; ranks {waiting} were waiting for {'them' if len(stuck) > 1 else 'it'} in collectives"
    else:
        text = "; ".join(f"rank {r} {where[r]}" for r in late)
        msg = (f"ranks {late} of {world_size} were all waiting in torch.distributed calls at "
               f"timeout_s={timeout_s} s (collectives that do not match?): {text}")
    return RankTimeout(msg + "; killed", stuck or late, waiting if stuck else [], where)


def _collect(procs, conns, world_size, deadline, timeout_s):
    """Wait for every rank's report; the first error (or death, or the deadline) ends them all."""
    state = {"result": None, "done": set(), "errors": [], "where": {}}
    waiting = dict(conns)  # pipe -> rank, until the rank's final message arrived
    sentinels = {p.sentinel: r for r, p in enumerate(procs)}
    blame_by = None  # when only secondary errors are in: the moment to stop waiting for the primary
    while len(state["done"]) < world_size:
        remaining = deadline - time.monotonic()
        if blame_by is not None:
            remaining = min(remaining, blame_by - time.monotonic())
        if blame_by is not None and (remaining <= 0 or not (waiting or sentinels)):
            break
        if remaining <= 0:
            raise _timeout(procs, state, world_size, timeout_s)
        for obj in mp_connection.wait(list(waiting) + list(sentinels), timeout=remaining):
            if obj in waiting:
                _receive(obj, waiting, state)
            elif obj in sentinels:
                rank = sentinels.pop(obj)
                pipe = next((c for c, r in waiting.items() if r == rank), None)
                while pipe in waiting and pipe.poll():  # its reports arrived with its exit
                    _receive(pipe, waiting, state)
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


def _receive(pipe, waiting, state):
    """Read one message of a rank: a progress note keeps its pipe in `waiting`; the final report, or
    end-of-file, takes it out."""
    rank = waiting[pipe]
    try:
        msg = pickle.loads(pipe.recv_bytes())
    except (EOFError, OSError):
        del waiting[pipe]
        return  # the rank died without a report: its sentinel says how
    if msg[0] == "where":
        state["where"][rank] = msg[2:]
        return
    del waiting[pipe]
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
