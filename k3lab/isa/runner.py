"""Run the ISA report's compiles in worker processes, with a timeout per compile and a result cache.

`compile_all(targets, cases, workers, timeout_s)` returns one row per (case, kernel launch, target).
Each target's work runs in a worker process of its own (`k3lab.isa.worker`), at most `workers` at once;
a compile that aborts the process or passes `timeout_s` becomes an error row for that kernel, and a
fresh worker carries on with the rest. Workers see no GPU (`worker_env`), so the report is the same on
a machine with one as on a CPU. Results are cached by key (the kernel's source and its
dependencies' source, argument types, constexprs, attributes, options, target, Triton's version and
the code that reads the figures) under $K3LAB_ISA_CACHE (default ~/.cache/k3lab/isa); `cache=False`
skips it.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from k3lab.isa.worker import PREFIX


def cache_dir() -> Path:
    return Path(os.environ.get("K3LAB_ISA_CACHE") or Path.home() / ".cache" / "k3lab" / "isa")


class WorkerDied(RuntimeError):
    pass


# Every way a CUDA or ROCm runtime is told which devices it sees: the worker sees none.
HIDE_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def worker_env() -> dict:
    """The environment of a compile worker: compiled Triton (TRITON_INTERPRET=0), one BLAS thread unless
    the caller set OMP_NUM_THREADS, this checkout first on PYTHONPATH, and no GPU visible. The launches
    it captures are the ones the op picks on the *target*: with the machine's own GPU visible the ops'
    GPU-only steps would run too (the MLA after-plan launches once more to read the compiled kernel's
    occupancy from the real device), so a GPU machine would report other launches than a CPU one."""
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(dict.fromkeys(HIDE_DEVICES, ""))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class _Proc:
    """A worker process for one target and the line protocol to it."""

    def __init__(self, target: str):
        self.target = target
        self.err = tempfile.TemporaryFile(mode="w+b")
        env = worker_env()
        self.p = subprocess.Popen([sys.executable, "-m", "k3lab.isa.worker", target], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.err, env=env)
        self.buf = b""
        self.ask(None, timeout_s=180)  # the ready line

    def stderr_tail(self, n: int = 1500) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")[-n:]

    def ask(self, req: dict | None, timeout_s: float) -> dict:
        if req is not None:
            self.p.stdin.write((json.dumps(req) + "\n").encode())
            self.p.stdin.flush()
        deadline = time.monotonic() + timeout_s
        sel = selectors.DefaultSelector()
        sel.register(self.p.stdout, selectors.EVENT_READ)
        try:
            while True:
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    text = line.decode(errors="replace")
                    if text.startswith(PREFIX):
                        return json.loads(text[len(PREFIX):])
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise WorkerDied(f"no answer within {timeout_s:g} s (killed)")
                if sel.select(timeout=min(left, 1.0)):
                    chunk = os.read(self.p.stdout.fileno(), 1 << 16)
                    if not chunk:
                        code = self.p.wait()
                        raise WorkerDied(f"worker exited with code {code}: {self.stderr_tail(600)}")
                    self.buf += chunk
        finally:
            sel.close()

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self._close_pipes()

    def _close_pipes(self):
        for pipe in (self.p.stdin, self.p.stdout):
            try:
                pipe.close()
            except OSError:  # a pipe of a killed worker may already be broken
                pass

    def close(self):
        try:
            self.p.stdin.close()
            self.p.wait(timeout=10)
        except Exception:
            self.kill()
        self._close_pipes()
        self.err.close()


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _run_target(target: str, cases: list[str], timeout_s: float, use_cache: bool, rows: list, lock) -> None:
    cdir = cache_dir()
    proc = None

    def worker() -> _Proc:
        nonlocal proc
        if proc is None or proc.p.poll() is not None:
            proc = _Proc(target)
        return proc

    def drop():
        nonlocal proc
        if proc is not None:
            proc.close()
        proc = None

    def emit(row: dict):
        with lock:
            rows.append(row)

    try:
        for case in cases:
            base = {"target": target, "case": case}
            try:
                listing = worker().ask({"cmd": "list", "case": case}, timeout_s)
            except WorkerDied as exc:
                emit(base | {"kernel": None, "ok": False, "error": f"listing the launches: {exc}"})
                drop()
                continue
            if "error" in listing:
                emit(base
                     | {"kernel": None, "ok": False, "error": f"listing the launches: {listing['error']}"})
                continue
            for item in listing["launches"]:
                row = base | {"kernel": item["kernel"], "index": item["index"], "key": item["key"],
                              "note": item["note"], **item["meta"]}
                path = cdir / f"{item['key']}.json"
                cached = _load(path) if use_cache else None
                if cached is not None:
                    emit(row | cached | {"cached": True})
                    continue
                try:
                    ans = worker().ask({"cmd": "compile", "case": case, "index": item["index"]}, timeout_s)
                except WorkerDied as exc:
                    emit(row | {"ok": False, "error": str(exc)})
                    drop()
                    continue
                result = {"ok": "error" not in ans, **(ans.get("row") or {})}
                if "error" in ans:
                    result["error"] = ans["error"]
                if use_cache:
                    cdir.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(f".{os.getpid()}.tmp")
                    tmp.write_text(json.dumps(result))
                    tmp.replace(path)
                emit(row | result | {"cached": False})
    finally:
        if proc is not None:
            proc.close()


def compile_all(targets: list[str], cases: list[str], workers: int = 2, timeout_s: float = 240,
                use_cache: bool = True) -> list[dict]:
    """Rows for every launch of every case on every target (see the module docstring), in
    (target, case, launch) order."""
    rows: list[dict] = []
    lock = threading.Lock()
    # a target's cases in as many shares as there are worker slots per target (each share a process)
    shares = max(1, -(-workers // max(1, len(targets))))
    pending = [(t, cases[i::shares]) for t in targets for i in range(shares) if cases[i::shares]]
    errors: list[BaseException] = []

    def slot():
        while True:
            with lock:
                if not pending:
                    return
                target, share = pending.pop(0)
            try:
                _run_target(target, share, timeout_s, use_cache, rows, lock)
            except BaseException as exc:  # reported after the other slots finish
                errors.append(exc)

    threads = [threading.Thread(target=slot) for _ in range(max(1, min(workers, len(pending))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    order = {t: i for i, t in enumerate(targets)}
    corder = {c: i for i, c in enumerate(cases)}
    return sorted(rows, key=lambda r: (order[r["target"]], corder[r["case"]], r.get("index", -1)))
