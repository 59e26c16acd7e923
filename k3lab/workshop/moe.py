"""Task of notebook 02 (MoE output sharding): the rows of the routed output projection one rank
computes, added into its shared-expert partial so that the all-reduce the shared expert needs anyway
assembles the whole output.

The grader plays every rank of a TP group with the learner's function, sums the ranks' buffers as
`all_reduce` would (in fp64, so the sum adds no error of its own), and compares the sum with the
single-GPU tail, `k3lab.nn.norms.rms_norm` and the whole `up_proj` in fp64, plus the shared
partials' sum: the layer `k3lab.parallel.moe_tail` computes with its sharded tail.
"""

from __future__ import annotations

import torch

from k3lab.nn.norms import rms_norm

from ._core import Case, Mismatch, Task

EPS = 1e-5


def _cases(seed: int, device) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    specs = [  # (label, world, tokens, hidden, latent, dtype)
        ("TP4, 5 tokens", 4, 5, 64, 48, torch.float32),
        ("TP8, 1 token (decode)", 8, 1, 96, 40, torch.float32),
        ("TP2, 3 tokens, fp64", 2, 3, 32, 24, torch.float64),
        ("TP4, 6 tokens, bf16 weights", 4, 6, 64, 32, torch.bfloat16),
    ]
    out = []
    for label, W, N, H, LAT, dt in specs:
        lat = torch.randn(N, LAT, generator=gen, dtype=torch.float64) * 3.0       # all-reduced latent, fp32
        norm_w = 1.0 + 0.1 * torch.randn(LAT, generator=gen, dtype=torch.float64)
        up = torch.randn(H, LAT, generator=gen, dtype=torch.float64) / LAT ** 0.5  # [hidden, latent]
        shared = torch.randn(W, N, H, generator=gen, dtype=torch.float64)          # each rank's partial
        lat_in = lat.float() if dt != torch.float64 else lat
        inputs = {"lat": lat_in, "norm_weight": norm_w.to(dt), "eps": EPS, "up_proj": up.to(dt),
                  "shared_partials": shared.to(dt)}
        out.append(Case(label, inputs, dt, extra={"world": W}, out_dtype={"out": dt}))
    return out


def _rank_args(case: Case, rank: int) -> dict:
    x, W = case.inputs, case.extra["world"]
    rows = x["up_proj"].shape[0] // W
    return {"lat": x["lat"].clone(), "norm_weight": x["norm_weight"].clone(), "eps": x["eps"],
            "up_rows": x["up_proj"][rank * rows:(rank + 1) * rows].clone(),  # a rank holds only its rows
            "shared_partial": x["shared_partials"][rank].clone(), "rank": rank, "world_size": W}


def _run(fn, case: Case):
    x, W = case.inputs, case.extra["world"]
    N, H = x["shared_partials"].shape[1:]
    total = torch.zeros(N, H, dtype=torch.float64)
    dtype = x["shared_partials"].dtype
    for r in range(W):
        buf = fn(**_rank_args(case, r))
        if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != (N, H):
            got = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
            raise Mismatch(f"rank {r} must return its [{N}, {H}] buffer (the all-reduce's input), got {got}")
        if buf.dtype != dtype:
            raise Mismatch(f"rank {r} must return the shared partial's dtype {dtype}, got {buf.dtype}")
        total += buf.double()                                      # all_reduce(SUM)
    return total.to(dtype)


def _reference(case: Case):
    x = case.inputs
    y = rms_norm(x["lat"].double(), x["norm_weight"].double(), x["eps"])
    return x["shared_partials"].double().sum(0) + y @ x["up_proj"].double().t()


def rank_tail_solution(lat, norm_weight, eps, up_rows, shared_partial, rank, world_size):
    """This rank's buffer before all-reduce 2: its shared partial, plus the routed output in the
    columns whose up_proj rows it holds, [rank * H / W, (rank + 1) * H / W)."""
    rows = up_rows.shape[0]
    lo = rank * rows
    y = rms_norm(lat, norm_weight, eps, out_dtype=up_rows.dtype)   # the same on every rank
    out = shared_partial.clone()
    out[:, lo:lo + rows] += y @ up_rows.t()
    return out


STUB = '''\
def rank_tail(lat, norm_weight, eps, up_rows, shared_partial, rank, world_size):
    """lat [N, LAT] fp32: the all-reduced latent (the same on every rank); norm_weight [LAT], eps: its
    RMSNorm; up_rows [H / world_size, LAT]: the rows of up_proj this rank holds; shared_partial
    [N, H]: this rank's shared-expert partial sum. Return [N, H] in shared_partial's dtype: the
    buffer this rank hands to the all-reduce."""
    # TODO: y = RMSNorm(lat) (k3lab.nn.norms.rms_norm, out_dtype=up_rows.dtype);
    #       add y @ up_rows.T into the right columns of a copy of shared_partial.
    raise NotImplementedError("write the rank's tail")
'''

TASK = Task(
    name="moe_rank_tail", notebook="02_moe_sharding", minutes=15,
    statement="""\
**Task: one rank's sharded tail.** Rank `r` of `W` holds only rows `r*H/W ... (r+1)*H/W - 1` of
`up_proj`. Write `rank_tail(...)` that returns the buffer this rank hands to the shared expert's
all-reduce: a copy of its shared partial with `RMSNorm(lat) @ up_rows.T` added into exactly the
columns its rows produce. `check` runs your function as every rank, sums the buffers as `all_reduce`
does, and compares the sum with the single-GPU layer (all of `up_proj`, fp64). No new collective: if
each coordinate's routed part is added on exactly one rank, the existing sum assembles it.""",
    signature="rank_tail(lat: Tensor[N, LAT], norm_weight: Tensor[LAT], eps: float, "
              "up_rows: Tensor[H/W, LAT], "
              "shared_partial: Tensor[N, H], rank: int, world_size: int) -> Tensor[N, H]",
    outputs=("out",), cases=_cases, reference=_reference, solution=rank_tail_solution, stub=STUB, run=_run,
    forbidden=("k3lab.ops.moe_experts.latent_tail", "k3lab.ops.moe_experts.tail_torch",
               "k3lab.ops.moe_experts.tail_triton"),
    hints=(
        "The all-reduce adds the W ranks' buffers. For the sum to hold the routed output exactly once, "
        "how many ranks may add into each output column?",
        "Rank r holds rows r*H/W .. (r+1)*H/W - 1 of up_proj, so RMSNorm(lat) @ up_rows.T, [N, H/W], is "
        "exactly those output columns. Add it into those columns of a copy of the shared partial and "
        "leave the other columns alone: the existing all-reduce assembles the rest.",
        "`rows = up_rows.shape[0]`; `out = shared_partial.clone()`; "
        "`y = rms_norm(lat, norm_weight, eps, out_dtype=up_rows.dtype)`; "
        "`out[:, lo:lo + rows] += y @ up_rows.t()` with lo the first column this rank's rows produce.",
    ))
