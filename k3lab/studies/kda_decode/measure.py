"""Checks and timings of the kda_decode study (the package docstring says what it measures): its cases,
each variant checked against the fp32 reference before it is timed into records.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable

import torch

from k3lab import bench
from k3lab.nn import KDACache
from k3lab.ops import kda_decode as kd
from k3lab.studies.peers import FLA_DECODE, fla_status, on_gpu

NAME = "kda_decode"
HEADS = 12  # TP8 slice
BATCHES = (1, 8, 32, 128)
HEAD = kd.HEAD_DIM


def step_bytes(batch: int, heads: int) -> dict[str, int]:
    """Bytes one decode step must move, by kind (bf16 activations, fp32 state and weights)."""
    B, H, K = batch, heads, HEAD
    return {
        "state": 2 * B * H * K * K * 4,                      # read + write
        "conv_states": 2 * 3 * B * H * K * (kd.CONV_SIZE - 1) * 2,
        "inputs": 5 * B * H * K * 2 + B * H * 2,            # q, k, v, g_raw, gate; beta_raw
        "output": B * H * K * 2,
        "weights": 3 * H * K * kd.CONV_SIZE * 4 + H * K * 4 + H * 4 + K * 4,
    }


def floor_us(batch: int, heads: int) -> float:
    return bench.floor_us(bytes=sum(step_bytes(batch, heads).values()))


# ----------------------------------------------------------------------------------------------
# the fla-core peer


def fla_cache(cache: KDACache) -> dict:
    """fla keeps the last 4 inputs per channel ([B, C, 4]); the oldest is never read on update."""
    def widen(c):
        return torch.cat([torch.zeros_like(c[..., :1]), c], -1).contiguous()
    return {"conv_q": widen(cache.conv_q), "conv_k": widen(cache.conv_k), "conv_v": widen(cache.conv_v),
            "state": cache.state.clone()}


def fla_step(inputs: dict, cache: dict, weights: kd.KDADecodeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step as an fla-core user runs it. Updates the conv caches in place; returns
    (out [B, H*V], new state) (fused_recurrent_kda returns a new state tensor)."""
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import fused_recurrent_kda

    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    B, C = q.shape
    H = C // HEAD
    yq, _ = causal_conv1d_update(x=q, cache=cache["conv_q"], weight=weights.conv_q, activation="silu")
    yk, _ = causal_conv1d_update(x=k, cache=cache["conv_k"], weight=weights.conv_k, activation="silu")
    yv, _ = causal_conv1d_update(x=v, cache=cache["conv_v"], weight=weights.conv_v, activation="silu")
    o, state = fused_recurrent_kda(
        yq.view(B, 1, H, HEAD), yk.view(B, 1, H, HEAD), yv.view(B, 1, H, HEAD),
        g=inputs["g_raw"].view(B, 1, H, HEAD), beta=inputs["beta_raw"].view(B, 1, H),
        A_log=weights.A_log, dt_bias=weights.dt_bias, scale=HEAD ** -0.5, initial_state=cache["state"],
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=weights.lower_bound)
    out = rms_norm_gated(o.view(B * H, HEAD), inputs["gate"].view(B * H, HEAD), weights.o_norm, None,
                         activation="sigmoid", eps=weights.eps)
    return out.view(B, H * HEAD), state


# ----------------------------------------------------------------------------------------------
# checks


def check_case(batch: int, heads: int = HEADS, *, device="cuda", seed: int = 0, state_layout="kv",
               variants=("before", "after", "fla"), **kernel_options) -> dict[str, dict]:
    """Every variant vs the fp32 reference on fresh random inputs: output, conv states, state.
    `after` keeps fp32 intermediates on chip: its state must meet the fp32 bound. `before` and fla
    store the conv outputs and o in bf16 between kernels, so their state meets the bf16 bound (and,
    for `before`, the fp32 bound against a reference rounding at the same handoffs)."""
    inputs, cache, w = kd.make_example(batch, heads, device=device, state_layout=state_layout, seed=seed)
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, state_layout=state_layout)
    ref_h_out, ref_h = kd.reference(**inputs, cache=cache, weights=w, state_layout=state_layout,
                                    handoff_dtype=torch.bfloat16)
    results = {}

    def pairs(out, c, r_out, r):
        return {"output": (out, r_out), "conv_q": (c.conv_q, r.conv_q), "conv_k": (c.conv_k, r.conv_k),
                "conv_v": (c.conv_v, r.conv_v), "state": (c.state, r.state)}

    exact_conv = {"conv_q": "fp32", "conv_k": "fp32", "conv_v": "fp32"}
    if "after" in variants:
        c = kd.clone_cache(cache)
        out = kd.after(**inputs, cache=c, weights=w, state_layout=state_layout, **kernel_options)
        results["after"] = bench.check_all(pairs(out, c, ref_out, ref),
                                           {"output": "bf16", "state": "fp32", **exact_conv})
    if "before" in variants:
        c = kd.clone_cache(cache)
        out = kd.before(**inputs, cache=c, weights=w, state_layout=state_layout)
        results["before"] = bench.check_all(pairs(out, c, ref_out, ref),
                                            {"output": "bf16", "state": "bf16", **exact_conv})
        results["before_vs_handoff_ref"] = bench.check_all(
            {"output": (out, ref_h_out), "state": (c.state, ref_h.state)},
            {"output": "bf16", "state": "bf16"})
    if "fla" in variants and state_layout == "kv" and fla_status(FLA_DECODE)[0]:
        fc = fla_cache(cache)
        out, state = fla_step(inputs, fc, w)
        got = KDACache(fc["conv_q"][..., 1:], fc["conv_k"][..., 1:], fc["conv_v"][..., 1:], state)
        results["fla"] = bench.check_all(pairs(out, got, ref_out, ref),
                                         {"output": "bf16", "state": "bf16", **exact_conv})
    return results


# ----------------------------------------------------------------------------------------------
# timing


def make_callables(batch: int, heads: int = HEADS, *, device="cuda", seed: int = 1, copies: int = 1,
                   **kernel_options) -> tuple[dict[str, Callable[[], None]], dict]:
    """(variant -> one decode step (state evolves across calls), the fused kernel's launch config).
    copies > 1: each variant cycles through that many caches, one per call, so that their states
    together exceed the L2 and each step reads its state from memory, as in a model whose other layers
    run between two steps of this one (`state_copies`)."""
    inputs, cache, w = kd.make_example(batch, heads, device=device, seed=seed)
    args = tuple(inputs[n] for n in kd.TOKEN_INPUTS)
    # Bound once, as a serving engine holds a layer: per call only the six per-token inputs are
    # checked, so eager timings compare launches, not argument checking.
    befores = [kd.KDADecodeStep(kd.clone_cache(cache), w, backend="triton") for _ in range(copies)]
    afters = [kd.KDADecodeStep(kd.clone_cache(cache), w, backend="cuda", **kernel_options) for _
              in range(copies)]
    fns = {"before": _cycling(befores, lambda step: step(*args)),
           "after": _cycling(afters, lambda step: step(*args))}
    after = afters[0].fused
    config = {"tile_v": after.tile_v, "threads": after.threads, "split": after.split, "hints": after.hints,
              "prefetch_ahead": after.prefetch_ahead, "host_path": "KDADecodeStep (bound once)",
              "state_copies": copies}
    if fla_status(FLA_DECODE)[0]:
        fcs = [fla_cache(cache) for _ in range(copies)]
        fns["fla"] = _cycling(fcs, lambda fc: fla_step(inputs, fc, w))
    return fns, config


def _cycling(items: list, call: Callable) -> Callable[[], None]:
    """A no-argument step that applies `call` to the next item each time (one item: always that one)."""
    if len(items) == 1:
        only = items[0]
        return lambda: call(only)
    turn = itertools.cycle(items)
    return lambda: call(next(turn))


def state_copies(batch: int, heads: int = HEADS) -> int:
    """How many caches to cycle so the states exceed twice the L2 (1 when one state already does)."""
    return bench.rotation_count(step_bytes(batch, heads)["state"])


LAUNCHES = {"before": 5, "after": 1, "fla": 5}  # kernels + copies per step


def time_case(batch: int, heads: int = HEADS, *, modes=("eager", "graph"), repeats: int = 200,
              errors: dict | None = None, cold_state: bool = True, **kernel_options) -> list[bench.Record]:
    """Time every variant at one batch. cold_state: cycle `state_copies` caches so no step finds its
    state in L2 (as in a model whose other layers run between two steps of this one)."""
    copies = state_copies(batch, heads) if cold_state else 1
    fns, config = make_callables(batch, heads, copies=copies, **kernel_options)
    fl = floor_us(batch, heads)
    sb = step_bytes(batch, heads)
    records = []
    for variant, fn in fns.items():
        for mode in modes:
            # with several caches, one sample (one graph) holds one call per cache: each is visited
            t = bench.time_fn(fn, warmup=20, repeats=repeats, graph=(mode == "graph"),
                              calls_per_sample=copies if copies > 1 else None)
            extra = {"launches": LAUNCHES[variant], "bytes": sb,
                     "state_tbs": sb["state"] / (t.median_us * 1e-6) / 1e12}
            if variant == "after":
                extra["config"] = config
            records.append(bench.make_record(
                NAME, f"B{batch}_H{heads}", variant, t, shape={"B": batch, "H": heads, "K": HEAD, "V": HEAD},
                dtype=torch.bfloat16, floor_us=fl, error=(errors or {}).get(variant, {}), **extra))
    return records




def case_names(preset=None) -> list[str]:
    """B{batch}_H12 for the batches timed (the TP8 slice's 12 heads)."""
    return [f"B{b}_H{HEADS}" for b in BATCHES]


def _batch_of(case: str) -> int:
    m = re.fullmatch(rf"B(\d+)_H{HEADS}", case)
    if m is None:
        raise ValueError(f"cases must be among {case_names()}, got {case!r}")
    return int(m[1])


def run(preset=None, cases=None, *, batches=None, heads: int = HEADS, modes=("eager", "graph"),
        repeats: int = 200) -> list[bench.Record]:
    """Check every variant at each batch (raising on failure; both state layouts for the fused kernel),
    then time them; returns records. `cases` (B{b}_H12 names) or `batches` pick the batches (default
    all); the fused kernel runs the configuration the library chooses from the device. Needs a GPU:
    the fused kernel and fla run only there (notebook 03 says what a CPU runs instead)."""
    if cases is not None and batches is not None:
        raise ValueError("give cases or batches, not both")
    chosen = tuple(_batch_of(c) for c in cases) if cases is not None else tuple(batches or BATCHES)
    records = []
    for B in chosen:
        errs = {}
        for layout in ("kv", "vk"):
            res = check_case(B, heads, state_layout=layout, seed=B)
            if layout == "kv":
                errs = {k: v for k, v in res.items() if k in ("before", "after", "fla")}
        records += time_case(B, heads, modes=modes, errors=errs, repeats=repeats)
    return records


CPU_PROFILE_HEADS = 2  # the CPU's profile target: notebook 03's CPU check of the chain, at B = 1


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """One B = 1 decode step per variant: on a GPU every variant at the TP8 slice (`make_callables`); on
    a CPU what notebook 03's CPU form runs, the unfused chain ('before', k3lab's Triton kernels in
    Triton's interpreter) at CPU_PROFILE_HEADS heads: the fused kernel ('after') and fla need a GPU."""
    if on_gpu():
        return make_callables(1, HEADS)[0]
    inputs, cache, w = kd.make_example(1, CPU_PROFILE_HEADS, device="cpu", seed=1)
    step = kd.KDADecodeStep(cache, w, backend="triton")
    args = tuple(inputs[n] for n in kd.TOKEN_INPUTS)
    return {"before": lambda: step(*args)}


