"""What bounds the whole step above its bytes floor: two read-only probes and the profiled step's split.

    k3lab bench decode_step --cases probe --json F      (GPU; records of study decode_step, cases probe.*)

The bytes floor (`measure.step_bytes` over the copy bandwidth) assumes every byte streams at copy speed
and nothing else costs time. A B = 1 step of one rank departs from it in two ways, each measured here
on its own:

- `projection_probe`: every dense projection of a step (the shapes of `projection_shapes`, x [1, in] @
  W^T in the step's dtype, through torch.matmul as the plain step runs them and through
  k3lab.ops.gemv as the `projections="gemv"` step does), each timed alone as a CUDA graph
  over enough distinct copies of W that none is read from the L2 twice. Its per-step sum (each shape
  times its calls per step) against those weights' bytes over the copy bandwidth says what the matrix
  library reaches on one-row products at these shapes.
- `small_kernel_probe`: a CUDA graph of n dependent one-element kernels: what a kernel that does no
  work costs inside a graph (its launch, its wait for the previous one, its drain). A step of many
  small kernels pays at least that for each.

`split(profile, ...)` then divides a profiled step's kernel time into weight streaming (GEMMs and the
grouped expert kernels) and the rest, with the kernel counts, so that the two probes can be held
against the two halves. GPU only; on a CPU the probes say so and return nothing.
"""

from __future__ import annotations

import math

import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.ops import gemv

from .measure import NAME

L2_BYTES = 50 * 2**20  # the H200's L2; copies are drawn until their sum is several times this
STREAM_KERNELS = ("_up_kernel", "_down_kernel")  # the grouped expert kernels stream weights too


def projection_shapes(config: K3Config) -> list[dict]:
    """Each dense projection of one rank's B = 1 step (torch matmuls in the step): name, out and in
    features, calls per step. Stacked projections (k3lab.engine.weights) count as one."""
    c = config
    h, C, H, r = c.hidden_size, c.kda_width, c.kda_num_heads, c.kda_gate_rank
    heads, L, S = c.num_attention_heads, c.routed_expert_hidden_size, c.shared_intermediate_size
    kda, mla, moe = c.num_kda_layers, c.num_mla_layers, c.num_moe_layers
    rows = [("kda.w_in", 4 * C + H + r, h, kda), ("kda.f_b", C, r, kda), ("kda.o_proj", h, C, kda),
            ("mla.w_in", c.q_lora_rank + c.mla_latent_dim + heads * c.v_head_dim, h, mla),
            ("mla.q_b", heads * c.qk_head_dim, c.q_lora_rank, mla),
            ("mla.o_proj", h, heads * c.v_head_dim, mla),
            ("moe.gate", c.num_experts, h, moe), ("moe.down", L, h, moe),
            ("moe.up_own_rows", h // c.tp_size, L, moe),
            ("moe.shared_in", 2 * S, h, moe), ("moe.shared_down", h, S, moe),
            ("dense.gate_up", 2 * c.intermediate_size, h, c.first_k_dense_replace),
            ("dense.down", h, c.intermediate_size, c.first_k_dense_replace), ("lm_head", c.vocab_size, h, 1)]
    return [{"name": n, "out": o, "in": i, "calls": k} for n, o, i, k in rows if k > 0]


def _copies(nbytes: int) -> int:
    return max(2, min(16, math.ceil(4 * L2_BYTES / nbytes)))


def projection_probe(config: K3Config, *, dtype=torch.bfloat16, repeats: int = 10) -> list[bench.Record]:
    """One record per projection shape (case probe.gemv.<name>): per-call graph time, bytes, TB/s in
    extra; nothing on a CPU (its matmuls say nothing about a GPU's)."""
    if not torch.cuda.is_available():
        return []
    out = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for s in projection_shapes(config):
        nbytes = s["out"] * s["in"] * torch.finfo(dtype).bits // 8
        ws = [torch.randn(s["out"], s["in"], device="cuda", dtype=dtype, generator=g) * 0.02
              for _ in range(_copies(nbytes))]
        x = torch.randn(1, s["in"], device="cuda", dtype=dtype, generator=g)
        for variant, fn in (("cublas", lambda w: x @ w.t()), ("triton", lambda w: gemv.gemv(x, w))):
            fn(ws[0])  # the Triton kernel picks its blocks on its first call, outside the timed graph
            t = bench.time_fn(fn, warmup=3, repeats=repeats, graph=True, rotate=[(w,) for w in ws])
            out.append(bench.make_record(NAME, f"probe.gemv.{s['name']}", variant, t,
                                         shape={"out": s["out"], "in": s["in"], "rows": 1}, dtype=dtype,
                                         floor_us=None, bytes=nbytes, calls_per_step=s["calls"],
                                         tbs=nbytes / (t.median_us * 1e-6) / 1e12, copies=len(ws)))
        del ws
    torch.cuda.empty_cache()
    return out


def small_kernel_probe(n: int = 2000, *, repeats: int = 10) -> bench.Record | None:
    """A graph of `n` dependent in-place adds on one element: per-kernel time (case probe.small_kernel);
    None on a CPU."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not torch.cuda.is_available():
        return None
    x = torch.zeros(1, device="cuda")
    # a graph of n successive calls, timed per call: each add waits for the one before it
    t = bench.time_fn(lambda: x.add_(1.0), warmup=2, repeats=repeats, graph=True, calls_per_sample=n)
    return bench.make_record(NAME, "probe.small_kernel", "torch", t, shape={"kernels": n},
                             dtype=torch.float32,
                             what="one dependent one-element add per kernel, captured as one graph")


def split(profile: dict) -> dict:
    """A profiled step's kernels (the `profile_graph` / `profile_eager` dict of a decode_step record,
    with its `top_kernels` and `categories`) as {stream_us, stream_kernels, rest_us, rest_kernels}:
    stream = the GEMM category plus the grouped expert kernels, rest = everything else."""
    if not isinstance(profile, dict) or "categories" not in profile or "top_kernels" not in profile:
        raise ValueError("profile must be a decode_step record's profile dict with 'categories' and "
                         "'top_kernels'")
    gemm = [c for c in profile["categories"] if c["category"] == "gemm"]
    experts = [k for k in profile["top_kernels"] if k["name"] in STREAM_KERNELS]
    stream_us = sum(c["total_us"] for c in gemm) + sum(k["total_us"] for k in experts)
    stream_n = sum(c["calls"] for c in gemm) + sum(k["calls"] for k in experts)
    return {"stream_us": stream_us, "stream_kernels": stream_n, "rest_us": profile["kernel_sum_us"]
            - stream_us,
            "rest_kernels": profile["launches"] - stream_n}


def run(config: K3Config | None = None, *, repeats: int = 10) -> list[bench.Record]:
    """Both probes at `config` (default K3Config.tp_slice(8)); [] on a CPU."""
    config = config or K3Config.tp_slice(8)
    recs = projection_probe(config, repeats=repeats)
    sk = small_kernel_probe(repeats=repeats)
    return recs + ([sk] if sk is not None else [])
