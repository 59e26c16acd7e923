"""One compile worker of the ISA report: a process bound to one target (`python -m k3lab.isa.worker NAME`).

It makes k3lab's launch policies see that target as the device (cases.as_device, before any op is
imported), then answers JSON requests, one a line, on stdin:
  {"cmd": "list", "case": C}           -> {"launches": [{"index", "kernel", "key", "meta", "note"}]}
  {"cmd": "compile", "case": C, "index": I} -> {"row": {...}}  (the figures, or "error")
Answers go to the process's original stdout, prefixed with PREFIX; everything else anything prints
(Triton's MLIR dumps, C-level messages) goes to stderr. Runs with TRITON_INTERPRET=0 (the runner
sets it) and sees no GPU: it refuses to start where one is visible, since the ops' launch policies would
then read this machine rather than the target. A backend that aborts kills only this process; the runner
starts another.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

PREFIX = "\x1eISA "
_FIGURE_CODE = ("asm.py", "targets.py", "worker.py", "capture.py")


def figures_version() -> str:
    """Hash of the code that turns a kernel into figures: part of every cache key."""
    h = hashlib.sha256()
    for name in _FIGURE_CODE:
        h.update((Path(__file__).parent / name).read_bytes())
    return h.hexdigest()[:12]


def _root_cause(exc: BaseException) -> str:
    c = exc
    while c.__cause__ is not None or (c.__context__ is not None and not c.__suppress_context__):
        c = c.__cause__ or c.__context__
    text = str(c).strip().splitlines()
    return f"{type(c).__name__}: {text[-1] if text else ''}"[:400]


class Worker:
    def __init__(self, target_name: str):
        import torch

        from k3lab.isa.targets import TARGETS

        if torch.cuda.is_available():  # the runner hides them (runner.worker_env); a caller that did not
            raise RuntimeError(
                f"the ISA worker for {target_name} sees a GPU ({torch.cuda.get_device_name(0)}): the ops "
                f"would pick their launches for this machine, not the target; start it with "
                f"runner.worker_env()")
        self.target = TARGETS[target_name]
        from k3lab.isa import cases

        cases.as_device(self.target)
        self.cases = cases
        self.launches: dict[str, list] = {}
        self.version = figures_version()

    def _specs(self, case: str) -> list:
        from k3lab.isa.capture import compile_spec

        if case not in self.launches:
            self.launches[case] = [(launch, compile_spec(launch, self.target)) for launch
                                   in self.cases.run_case(case)]
        return self.launches[case]

    def list(self, case: str) -> dict:
        out = []
        for i, (launch, spec) in enumerate(self._specs(case)):
            out.append(
                {
                    "index": i,
                    "kernel": launch.name,
                    "key": f"{spec.key}-{self.version}",
                    "meta": spec.meta,
                    "note": launch.note,
                }
            )
        return {"launches": out}

    def compile(self, case: str, index: int) -> dict:
        from k3lab.isa import asm
        from k3lab.isa.capture import compile_kernel

        launch, spec = self._specs(case)[index]
        t0 = time.perf_counter()
        k = compile_kernel(spec, self.target)
        row = {"compile_s": round(time.perf_counter() - t0, 2)}
        shared, warps = int(k.metadata.shared), spec.meta["num_warps"]
        if self.target.is_amd:
            row.update(asm.amd_figures(k.asm["amdgcn"], shared, warps, self.target))
            row["code_bytes"] = len(k.asm.get("hsaco", b""))
        else:
            with tempfile.TemporaryDirectory() as d:
                log = asm.ptxas_report(k.asm["ptx"], d)
            row.update(asm.nvidia_figures(k.asm["ptx"], log, shared, warps, self.target))
            row["code_bytes"] = len(k.asm.get("cubin", b""))
        return {"row": row}

    def handle(self, req: dict) -> dict:
        try:
            if req["cmd"] == "list":
                return self.list(req["case"])
            if req["cmd"] == "compile":
                return self.compile(req["case"], int(req["index"]))
            return {"error": f"unknown cmd {req['cmd']!r}"}
        except Exception as exc:  # a compile error is a result of its kernel, not of the worker
            return {"error": _root_cause(exc), "traceback": traceback.format_exc()[-3000:]}


def main(argv: list[str]) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else printed, from Python or C, goes to stderr
    sys.stdout = sys.stderr
    worker = Worker(argv[0])
    proto.write(PREFIX + json.dumps({"ready": worker.target.name}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = worker.handle(json.loads(line))
        proto.write(PREFIX + json.dumps(answer, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
