"""`python -m k3lab.profile`: capture a small known workload on this machine and check the table.

The workload per step: two matmuls, an in-place copy, a transposed copy and (on a GPU) a
device-to-host copy, then, on a GPU, the same matmuls replayed from a CUDA/HIP graph. Checks:
the capture recorded kernels (GPU) or ops (CPU), gemm and copy categories appear, the trace file
reads back to the same rows, the key_averages table works under this torch's field names, and
the graph replay enqueues fewer API launches than the eager step. Prints a JSON summary.
"""

from __future__ import annotations

import json
import sys
import tempfile

from k3lab.profiling.capture import capture
from k3lab.profiling.read import read_trace


def selfcheck(device: str | None = None, size: int = 256, trace_dir=None) -> dict:
    import torch

    from k3lab import env

    dev = device or env.detect().backend
    tdev = torch.device("cpu" if dev == "cpu" else "cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=g).to(tdev)
    b = torch.randn(size, size, generator=g).to(tdev)
    out = torch.empty(size, size, device=tdev)
    gpu = dev != "cpu"

    def step():
        x = a @ b
        y = torch.mm(x, a)
        out.copy_(y)
        out.t().contiguous()
        if gpu:
            y.cpu()

    trace_dir = trace_dir or tempfile.mkdtemp(prefix="k3lab-selfcheck-")
    cap = capture(step, steps=3, warmup=2, device=dev, trace_dir=trace_dir, name="selfcheck")
    cats = set(cap.kernels["category"])
    back = read_trace(cap.trace_path)
    summary = {"device": dev, "backend": cap.backend, "note": cap.note, "trace": str(cap.trace_path),
               "counts": cap.counts(), "categories": sorted(cats), "rows": len(cap.kernels),
               "top": cap.table.head(8)[["name", "category", "calls", "total_us", "bytes"]]
               .astype({"bytes": "object"}).to_dict("records")}
    problems = []
    if not {"gemm", "copy"} <= cats:
        problems.append(f"expected gemm and copy rows, got {sorted(cats)}")
    if list(back["name"]) != list(cap.kernels["name"]):
        problems.append("the trace file does not read back to the captured rows")
    summary["profiler_table_lines"] = len(cap.profiler_table(row_limit=5).splitlines())
    if gpu:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up on a side stream, as graph capture requires
            for _ in range(2):
                out.copy_(torch.mm(a @ b, a))
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            out.copy_(torch.mm(a @ b, a))
        replay = capture(graph.replay, steps=3, warmup=1, device=dev, trace_dir=trace_dir,
                         name="selfcheck-graph")
        summary["graph_counts"] = replay.counts()
        if replay.counts()["api_launches"] is not None and cap.counts()["api_launches"] is not None and \
                not replay.counts()["api_launches"] < cap.counts()["api_launches"]:
            problems.append("a graph replay should enqueue fewer API launches than the eager step")
        if not (cap.kernels["kind"] == "memcpy").any():
            problems.append("the device-to-host copy left no memcpy row")
    summary["problems"] = problems
    return summary


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m k3lab.profile", description=__doc__)
    ap.add_argument("--device", choices=["cpu", "cuda", "rocm"], default=None)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args(argv)
    summary = selfcheck(args.device, args.size, args.trace_dir)
    print(json.dumps(summary, indent=1, default=str))
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
