"""`python -m k3lab.ops.moe_router bench [--out PATH]`: the router + expert sort, torch path against the
two Triton launches, at K3's E = 896, top_k = 16 and N = 1 and 64 tokens (one GPU).

For each N it first checks on the GPU that both paths give the same experts (in order), weights
(rtol 1e-5) and ExpertSort, then times each under a CUDA graph (k3lab.bench.time_fn, graph=True: the
cost of a call inside a long graph, as the decode step replays it). Prints one line per (N, path)
and a check line per N; --out writes the same as JSON. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from k3lab.bench import provenance, time_fn
from k3lab.ops.moe_experts.inputs import default_block_m

from . import route_and_sort

E, TOP_K, SCALING = 896, 16, 2.5
FIELDS = ("pair_of_row", "tile_expert", "n_tiles", "counts")


def compare(n_tokens: int, seed: int = 0, device: str = "cuda") -> tuple[dict, tuple]:
    """(check record, call arguments) for one batch: both paths run once on the same fresh logits."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(n_tokens, E, device=device, generator=gen) * 2
    bias = torch.randn(E, device=device, generator=gen) * 0.05
    m = default_block_m(n_tokens, TOP_K, E)
    out = {b: route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m, backend=b) for b
           in ("torch", "triton")}
    (w0, i0, s0), (w1, i1, s1) = out["torch"], out["triton"]
    rec = {"n_tokens": n_tokens, "block_m": m, "idx_equal": bool(torch.equal(i0, i1)),
           "weights_max_rel": float(((w1 - w0).abs() / w0.abs()).max()),
           "sort_equal": {f: bool(torch.equal(getattr(s0, f), getattr(s1, f))) for f in FIELDS}}
    rec["ok"] = rec["idx_equal"] and rec["weights_max_rel"] <= 1e-5 and all(rec["sort_equal"].values())
    return rec, (logits, bias, m)


def bench(sizes=(1, 64), device: str = "cuda") -> list[dict]:
    """One check record per batch size, with each path's median us per call (graph replay on a GPU)."""
    rows = []
    for n in sizes:
        rec, (logits, bias, m) = compare(n, device=device)
        for b in ("torch", "triton"):
            t = time_fn(
                lambda b=b: route_and_sort(logits, bias, TOP_K, scaling=SCALING, block_m=m, backend=b),
                graph=device != "cpu",
                device=device,
                repeats=100 if device != "cpu" else 3,
                warmup=2,
            )
            rec[f"{b}_us"] = t.median_us
            rec[f"{b}_timing"] = t.summary()
            print(f"N={n:3d} {b:6s} {t.summary()}")
        print(f"N={n:3d} check {'ok' if rec['ok'] else 'FAILED'}: idx equal {rec['idx_equal']}, weights max "
              f"rel {rec['weights_max_rel']:.2e}, sort fields equal {rec['sort_equal']}; "
              f"torch/triton = {rec['torch_us'] / rec['triton_us']:.2f}x")
        rows.append(rec)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3lab.ops.moe_router")
    ap.add_argument("command", choices=["bench"])
    ap.add_argument("--out", help="write the records as JSON here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_router bench needs a GPU (torch sees none); the CPU tests run the kernels in Triton's "
              "interpreter")
        return 2
    rows = bench()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**provenance(), "E": E, "top_k": TOP_K, "rows": rows}, f, indent=1)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
