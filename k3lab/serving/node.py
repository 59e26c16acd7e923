"""One node of 8 GPUs serving K3 (TP8, DCP1 or DCP8): bytes, capacity, the served step, the speculative
cycle, prefill, and the rates a configuration gives.

Every part says whether it is measured or modelled:
- the rank's step: the fitted `StepFit`s (measured on one H200 rank, bf16 weights and history), re-costed
  at the served precisions (experts MXFP4, MLA history FP8: their bytes over the same fitted terms);
- collectives: the step's stand-ins (measured copies) out, the link model (hardware.Link) in;
- DCP8: the history split in eight for capacity; attention at DCP8 / TP8 shapes and the merge from the dcp
  study's records; two more collective calls per MLA layer;
- speculation: committed tokens per cycle from k3lab.speculative's acceptance curve; verification of n
  positions from the kda_verify and mla_padding records (the extra over one position, per sequence);
  the drafter as one layer of the step (modelled);
- prefill: the KDA scan per token from kda_scan records; projections and MLA attention as FLOPs over the
  bf16 matrix rate (modelled);
- a GPU other than the one measured: each bytes term scaled by the usable bandwidths' ratio, the per-token
  and prefill terms by the matrix rates' ratio, the fixed term kept (projected, never measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3lab.config import K3Config
from k3lab.ops import int_arg

from .hardware import GPU, gpu as gpu_of, matrix_efficiency
from .stepmodel import waves

MXFP4_BYTES = 0.53125  # 4 bits per value + one 8-bit scale per 32 values
FP8_BYTES = 1.0
TP = 8
MOE_ROWS_GIB = 3.85  # the replicated up_proj rows one rank no longer loads (seed section 2, anchors.md)
RESERVE = 0.08  # share of HBM kept for activations, graphs and the allocator
THINK_SHARE = 0.4  # sessions waiting on the agent per session decoding (the generator's think time)


def tp_config() -> K3Config:
    return K3Config.tp_slice(TP)


def expert_bytes_per_rank(config: K3Config, weight_bytes: float) -> float:
    """One routed expert's slice on a rank (w1, w3, w2) at `weight_bytes` per value."""
    return 3 * config.moe_intermediate_size * config.routed_expert_hidden_size * weight_bytes


def step_parts(
    config: K3Config,
    batch: int,
    context_sum: float,
    tokens: int,
    *,
    dense_bytes: float,
    expert_weight_bytes: float = 2.0,
    cache_bytes: float = 2.0,
    dcp: int = 1,
    q_len: int = 1,
) -> dict[str, float]:
    """Bytes one rank's step moves (the decode_step study's parts): `dense_bytes` (every weight but the
    routed experts, from a record), the experts the `tokens` choose under uniform routing, the MLA
    history (`context_sum` positions over the batch, plus the rows written, divided by `dcp`), the KDA
    states and conv histories read and written."""
    c = config
    for name, v in (("batch", batch), ("tokens", tokens), ("dcp", dcp), ("q_len", q_len)):
        int_arg(name, v, low=1)
    if not 0 <= context_sum < np.inf:
        raise ValueError(f"context_sum must be a finite number of positions >= 0, got {context_sum!r}")
    E, k = c.num_experts, c.num_experts_per_token
    chosen = E * (1.0 - (1.0 - k / E) ** tokens)
    experts = c.num_moe_layers * chosen * expert_bytes_per_rank(c, expert_weight_bytes)
    mla = c.num_mla_layers * (context_sum + 2 * q_len * batch) * c.mla_latent_dim * cache_bytes / dcp
    state = c.num_kda_layers * batch * 2 * c.kda_state_bytes_per_sequence()
    conv = c.num_kda_layers * batch * 2 * c.kda_conv_state_values_per_sequence() * 2
    return {
        "weights_dense": float(dense_bytes),
        "weights_experts": float(experts),
        "mla_cache": float(mla),
        "kda_state": float(state),
        "kda_conv": float(conv),
    }


# ------------------------------------------------------------------------------------------- capacity
def weights_gb_per_rank(config: K3Config | None = None, *, moe_rows_only: bool = True) -> dict[str, float]:
    """GB of weights per rank at the served precisions: routed experts MXFP4, everything else bf16, plus
    the replicated up_proj rows where `moe_rows_only` is off."""
    c = config or tp_config()
    experts = c.num_moe_layers * c.num_experts * expert_bytes_per_rank(c, MXFP4_BYTES)
    total_params, _ = c.param_counts()
    expert_params = (
        c.num_moe_layers * c.num_experts * 3 * c.moe_intermediate_size * c.routed_expert_hidden_size
    )
    rest = (total_params - expert_params) * 2.0
    extra = 0.0 if moe_rows_only else MOE_ROWS_GIB * 2**30
    return {
        "experts": experts / 1e9,
        "rest": rest / 1e9,
        "moe_rows": extra / 1e9,
        "total": (experts + rest + extra) / 1e9,
    }


def sequence_gb(context: float, dcp: int = 1, config: K3Config | None = None) -> float:
    """GB one sequence holds on each GPU: MLA history at FP8 (576 bytes per position and MLA layer,
    divided by the DCP degree) and the KDA states (fp32) and conv histories (bf16), which DCP leaves whole."""
    c = config or tp_config()
    int_arg("dcp", dcp, low=1)
    if not 0 <= context < np.inf:
        raise ValueError(f"context must be a finite number of positions >= 0, got {context!r}")
    mla = c.num_mla_layers * context * c.mla_latent_dim * FP8_BYTES / dcp
    kda = c.num_kda_layers * (c.kda_state_bytes_per_sequence() + c.kda_conv_state_values_per_sequence() * 2)
    return (mla + kda) / 1e9


def free_gb(g: GPU, *, moe_rows_only: bool = True, memory_gb: float | None = None) -> float:
    """HBM left for caches per GPU: memory less the reserve and the weights (negative: the weights do not
    fit)."""
    mem = g.memory_gb if memory_gb is None else memory_gb
    return mem * (1 - RESERVE) - weights_gb_per_rank(moe_rows_only=moe_rows_only)["total"]


def max_concurrency(
    context: float, g: GPU, *, dcp: int = 1, moe_rows_only: bool = True, memory_gb: float | None = None
) -> int:
    """Sequences whose caches fit in HBM at `context` positions each (0 when the weights alone do not fit)."""
    free = free_gb(g, moe_rows_only=moe_rows_only, memory_gb=memory_gb)
    return max(0, int(free // sequence_gb(context, dcp)))


def hits(
    theoretical: float,
    concurrency: int,
    context: float,
    g: GPU,
    *,
    dcp: int,
    host_gb: float,
    moe_rows_only: bool = True,
    memory_gb: float | None = None,
) -> tuple[float, float]:
    """Prefix-cache hits (modelled) as (hit rate, the part of it served from the host tier): the
    workload's theoretical reuse while every live session's cache (those decoding and those waiting on the
    agent, THINK_SHARE per decoding one) fits in HBM plus the host tier, scaled down by the share that fits
    beyond that; the share of the live caches that fits in HBM is served there, the rest of the hits from
    the host (restored over the GPU's host link, `restore`)."""
    free = max(0.0, free_gb(g, moe_rows_only=moe_rows_only, memory_gb=memory_gb))
    need = concurrency * (1 + THINK_SHARE) * sequence_gb(context, dcp)
    if need <= 0:
        return theoretical, 0.0
    held = min(1.0, (free + host_gb) / need)
    in_hbm = min(1.0, free / need)
    return theoretical * held, theoretical * (held - in_hbm)


def restore_gb(prompt: float, hit: float, host_hit: float, *, dcp: int) -> float:
    """GB one GPU copies from the host tier for one request of `prompt` input tokens (modelled): its hit
    prefix's cache (hit x prompt positions: MLA history over the DCP degree, KDA checkpoint whole) times
    the share of hits served from the host."""
    if hit <= 0 or host_hit <= 0:
        return 0.0
    return host_hit / hit * sequence_gb(hit * prompt, dcp)


# ------------------------------------------------------------------------------------------- node model
@dataclass
class Inputs:
    """What the node model reads from records (k3lab.serving.inputs.node_inputs builds it): fits per
    variant (StepFit), the dense weight bytes and the bandwidth of the measured steps, the stand-in
    collectives (calls per step, bytes per token, us at one token and per extra token), the DCP ratio
    (DCP8 / TP8 local attention) and merge cost (us per MLA layer at B = 1 and per extra sequence), the
    verification extras per position (us per layer and sequence, KDA and MLA, after and before), the KDA
    prefill per token and layer (after and before), and the sources of each."""

    fits: dict
    dense_bytes: float
    bandwidth_tbs: float
    coll_calls: int
    coll_bytes_per_token: float
    standin_us: tuple[float, float]
    dcp_ratio: float
    merge_us: tuple[float, float]
    verify_extra: dict
    kda_prefill_us: dict
    sources: dict


SWITCH_ORDER = (
    "moe_tail_sharded",
    "kda_fused",
    "attn_res_fused",
    "pack_where_used",
    "mla_padded",
    "glue_fused",
)


def rank_step_us(
    inp: Inputs,
    off: frozenset,
    batch: int,
    context_sum: float,
    tokens: int,
    *,
    dcp: int = 1,
    g: GPU | None = None,
    q_len: int = 1,
) -> dict[str, float]:
    """The served step on one rank, term by term (us): the all-on fit at served precisions, plus each
    switch in `off` (its no_<switch> fit minus all on; scaled so that all of them together give the base
    fit where one exists), the stand-ins taken out, the modelled collectives and DCP's extras put in."""
    c = tp_config()
    parts = step_parts(
        c,
        batch,
        context_sum,
        tokens,
        dense_bytes=inp.dense_bytes,
        expert_weight_bytes=MXFP4_BYTES,
        cache_bytes=FP8_BYTES,
        dcp=1,
        q_len=q_len,
    )
    bw = inp.bandwidth_tbs
    w = waves(tokens, c.num_attention_heads, (g or gpu_of("h200")).compute_units)
    on = inp.fits["all_on"]
    terms = on.terms(parts, tokens, bw, batch, w)
    base_us = on.predict(parts, tokens, bw, batch, w)
    deltas = {
        s: inp.fits[f"no_{s}"].predict(parts, tokens, bw, batch, w) - base_us
        for s in SWITCH_ORDER
        if f"no_{s}" in inp.fits
    }
    if "base" in inp.fits and sum(deltas.values()) > 0:
        scale = (inp.fits["base"].predict(parts, tokens, bw, batch, w) - base_us) / sum(deltas.values())
        deltas = {s: d * max(scale, 0.0) for s, d in deltas.items()}
    for s in off:
        terms[f"off: {s}"] = deltas.get(s, 0.0)
    if dcp > 1:  # the same attention work on 1/8 of the positions with 8x the heads, measured ratio
        for key in [k for k in terms if k.startswith("history")]:
            terms[key] *= inp.dcp_ratio
        m0, m1 = inp.merge_us
        terms["dcp merge"] = c.num_mla_layers * (m0 + m1 * (batch - 1))
    if g is not None and g.key != "h200":
        from .hardware import gpu as _g

        h = _g("h200")
        r_bw, r_fl = h.usable_bandwidth_tbs / g.usable_bandwidth_tbs, h.bf16_tflops / g.bf16_tflops
        for key in list(terms):
            if key in ("weights", "history", "history_waves", "state", "weights+state"):
                terms[key] *= r_bw
            elif key == "tokens":
                terms[key] *= r_fl
            elif key.startswith("off:") or key == "dcp merge":
                terms[key] *= r_bw
    s0, s1 = inp.standin_us
    terms["stand-ins out"] = -(s0 + s1 * (tokens - 1))
    link = (g or gpu_of("h200")).link
    calls = inp.coll_calls + (2 * c.num_mla_layers if dcp > 1 else 0)
    terms["collectives (modelled)"] = calls * link.call_latency_us + 2 * (
        TP - 1
    ) / TP * inp.coll_bytes_per_token * tokens / (link.gbs_per_direction * 1e3)
    return terms


def verify_extra_us(inp: Inputs, positions: int, batch: int, tiles: bool) -> float:
    """The extra over one position of verifying `positions` per sequence (KDA and MLA layers), from the
    per-layer records at B = 1, per sequence."""
    if positions <= 1:
        return 0.0
    c = tp_config()
    kda = inp.verify_extra["kda_after" if tiles else "kda_before"]
    mla = inp.verify_extra["mla"]

    def at(table: dict, n: int) -> float:
        xs = sorted(table)
        return float(np.interp(n, xs, [table[x] for x in xs]))

    return batch * (c.num_kda_layers * at(kda, positions) + c.num_mla_layers * at(mla, positions))


def prefill_us_per_token(inp: Inputs, context: float, g: GPU, kda_scan: bool) -> float:
    """One uncached token's prefill on the node (each rank its slice), us: the KDA scan per token and
    layer from records, the projections (2 FLOPs per active parameter of the rank) and MLA attention over
    `context` positions as FLOPs over the GPU's bf16 matrix rate at the share a large matmul reaches
    (hardware.matrix_efficiency; modelled)."""
    c = tp_config()
    _, active = c.param_counts()
    flops = 2.0 * active + c.num_mla_layers * 2 * c.num_attention_heads * context * (
        c.mla_latent_dim + c.kv_lora_rank
    )
    kda = c.num_kda_layers * inp.kda_prefill_us["after" if kda_scan else "before"]
    scale = gpu_of("h200").bf16_tflops / g.bf16_tflops
    return kda * scale + flops / (g.bf16_tflops * matrix_efficiency()[0] * 1e6)
