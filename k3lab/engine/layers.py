"""One rank's share of each sublayer of a decode (or verification) step, up to the point where the
tensor-parallel layer needs a collective: every function returns this rank's partial result, which the
caller all-reduces (docs/k3.md). Inputs x are [N, hidden] (N = batch x q_len tokens, the
pre-normed hidden state); caches are updated in place. Every dense projection goes through
`fp8.linear`: a torch matmul for a plain weight, the FP8 product for an `Fp8Linear` (RankWeights.to_fp8).

What a switch chooses arrives here as a callable, bound once by the step (`DecodeStep._bind`, from the
rows `switches.resolve` chose, `rows.Chosen`): the KDA step (`KDADecodeStep`, or `KDAVerifyStep` for
q_len > 1), the gate input's pack policy, the SiTU-GLU and the shared expert's down projection after it,
the router, the routed experts, the MoE tail, and the MLA glue's row (k3lab.ops.mla_glue: its `norms`,
`absorb_q` and `out_gate`). Nothing here chooses a backend or compares a name.
"""

from __future__ import annotations

import torch

from k3lab.nn.kda import kda_beta, kda_gate, short_conv
from k3lab.nn.norms import gated_rms_norm, l2_normalize
from k3lab.ops import mla_glue

from .fp8 import GEMV, linear, one_row_parts, quantize_input
from .weights import DenseWeights, KDAWeights, MLAWeights, MoEWeights


def kda_inputs(w: KDAWeights, x: torch.Tensor, pack):
    """(q, k, v, gate, beta_raw, g_raw), each [N, width] with a contiguous last dim: one stacked matmul,
    then f_b through `pack`, the matmul dispatcher's policy (k3lab.ops.packed_matmul.VARIANTS: packs
    only for the kernel that reads the copy, or packs first and lets the fallback ignore it)."""
    q, k, v, gate, b_raw, fa = linear(x, w.w_in).split(w.split, dim=-1)
    return q, k, v, gate, b_raw, pack(fa, w.f_b)


def kda_partial(w: KDAWeights, x: torch.Tensor, kda_step, pack) -> torch.Tensor:
    """The KDA op bound to the layer's cache in `kda_step` (a KDADecodeStep for one token per sequence,
    a `KDAVerifyStep` for q_len > 1: either takes (q, k, v, g_raw, beta_raw, gate) [N, width]), then this
    rank's columns of o_proj. Returns [N, hidden]."""
    q, k, v, gate, b_raw, g_raw = kda_inputs(w, x, pack)
    return linear(kda_step(q, k, v, g_raw, b_raw, gate), w.o_proj)


class KDAVerifyStep:
    """One KDA layer's verification step (q_len > 1 positions per sequence) bound to its cache, weights,
    the verification kernel (`verify`, bound by `rows.verify_binder`: narrow tiles or the streaming
    kernel, with kda_verify's arguments) and the step's `states` buffer [B, T, H, 128, 128], as
    `KDADecodeStep` binds a decode. A call runs the short convs (conv states updated), the q/k norms and
    gates in PyTorch, the recurrence keeping every position's state in `states`; the cache keeps the
    last one (every draft accepted). Returns o [N, H*128] in the activations' dtype."""

    def __init__(self, cache, weights, verify, states: torch.Tensor, batch: int, q_len: int):
        self.cache, self.weights, self.verify, self.states = cache, weights, verify, states
        self.batch, self.q_len = batch, q_len
        self.heads, self.head_dim = cache.state.shape[1], weights.o_norm.shape[0]

    def __call__(self, q, k, v, g_raw, beta_raw, gate) -> torch.Tensor:
        B, T, H, K = self.batch, self.q_len, self.heads, self.head_dim
        d, cache = self.weights, self.cache
        ys = []
        for t, conv_w, state in ((q, d.conv_q, cache.conv_q), (k, d.conv_k, cache.conv_k),
                                 (v, d.conv_v, cache.conv_v)):
            y, new_state = short_conv(t.reshape(B, T, -1), conv_w, state)
            state.copy_(new_state)
            ys.append(y)
        qn = l2_normalize(ys[0].view(B, T, H, K))
        kn = l2_normalize(ys[1].view(B, T, H, K))
        g = kda_gate(g_raw.view(B, T, -1), d.A_log, d.dt_bias, d.lower_bound).contiguous()
        beta = kda_beta(beta_raw.reshape(B, T, H)).contiguous()
        o, _ = self.verify(qn.contiguous(), kn.contiguous(), ys[2].view(B, T, H, K).contiguous(), g, beta,
                           cache.state, states_out=self.states)
        cache.state.copy_(self.states[:, -1])
        o = gated_rms_norm(o.to(q.dtype), gate.reshape(B, T, H, K), d.o_norm, d.eps)
        return o.reshape(B * T, H * K)


def mla_partial(w: MLAWeights, x: torch.Tensor, latent: torch.Tensor, pos: int, q_buf: torch.Tensor, plan,
                glue="torch") -> torch.Tensor:
    """The absorbed MLA decode: projections, the new latent rows written at positions [pos, pos + T) of
    `latent` [B, L, 576], the absorbed query written into `q_buf` [B, T, H, 576] (the buffer `plan`, an
    MLA decode plan, reads), attention, the value half of kv_b_proj, the output gate and this rank's
    columns of o_proj. glue: the k3lab.ops.mla_glue row (or its name) that runs the work between the
    projections and the attention ('triton': three launches; 'torch': the PyTorch sequence); its
    callables take the shapes read here. Returns [N, hidden]."""
    glue = mla_glue.BACKENDS[glue] if isinstance(glue, str) else glue
    B, T, H, W = q_buf.shape
    lat = w.kv_a_norm.shape[0]
    rope, nope, V = W - lat, w.w_uk.shape[1], w.w_uv.shape[1]
    qa, ckv, g = linear(x, w.w_in).split([w.q_a_norm.shape[0], W, H * V], dim=-1)
    qa_n = glue.norms(qa, ckv, w.q_a_norm, w.kv_a_norm, w.eps, latent[:, pos:pos + T], B, T, lat, rope)
    glue.absorb_q(linear(qa_n, w.q_b).view(B * T, H, -1), w.w_uk, q_buf, B, T, H, nope, lat, rope)
    o_lat, _ = plan()
    return linear(glue.out_gate(o_lat, w.w_uv, g, None, B * T, H, V, lat), w.o_proj)


def dense_partial(w: DenseWeights, x: torch.Tensor, act) -> torch.Tensor:
    """Layer 0's SiTU-GLU MLP on this rank's share of the intermediate: [N, hidden], a partial sum; `act`
    is the SiTU-GLU of a stacked gate|up product."""
    return linear(act(linear(x, w.gate_up)), w.down)


def moe_products(w: MoEWeights, x: torch.Tensor):
    """(router logits, z = down_proj(x), the shared expert's gate|up or None): the three products of the
    MoE layer's input. Where all three take x by the one-row GEMV (`fp8.one_row_parts`: batch 1 on a
    GPU, GEMV or FP8 projections) they are one launch (`k3lab.ops.gemv.gemv_stack`); otherwise the
    router reads x and down_proj and the shared gate/up read x quantized once where they are FP8
    (`fp8.quantize_input`)."""
    ws = [w.gate, w.down] + ([w.shared_in] if w.shared_in is not None else [])
    stacked = one_row_parts(x, ws)
    if stacked is not None:
        logits, z, *gu = GEMV.stack(x, stacked)
        return logits, z, (gu[0] if gu else None)
    xin = quantize_input(x, w.down)
    return (linear(x, w.gate), linear(xin, w.down),
            linear(xin, w.shared_in) if w.shared_in is not None else None)


def moe_latent_partial(w: MoEWeights, logits: torch.Tensor, z: torch.Tensor, router, experts,
                       seen: list | None = None) -> torch.Tensor:
    """Routing on the router's `logits` and this rank's share of every chosen expert on `z` (both from
    `moe_products`): [N, LAT] fp32, the partial latent that the layer all-reduces. router(logits, w) ->
    (weights, idx, sort or None); experts(z, weights, idx, w, sort) -> [N, LAT]. seen: a list the chosen
    experts [N, top_k] are appended to (the bench's count of expert weights read)."""
    weights, idx, sort = router(logits, w)
    if seen is not None:
        seen.append(idx)
    return experts(z, weights, idx, w, sort)


def moe_shared_partial(w: MoEWeights, x: torch.Tensor, gu: torch.Tensor | None, down) -> torch.Tensor:
    """This rank's share of the shared expert (row-parallel) from its gate|up product `gu` (from
    `moe_products`; None where the layer has no shared expert: zeros like x): [N, hidden] in x's dtype,
    contiguous. down(gu, weight): the SiTU-GLU and the down projection (`rows.shared_down`)."""
    if gu is None:
        return torch.zeros_like(x)
    return down(gu, w.shared_down)


def moe_tail(w: MoEWeights, lat: torch.Tensor, out: torch.Tensor, sharded: bool, tail) -> torch.Tensor:
    """out[:, cols] += up[cols](RMSNorm(lat)) in place: this rank's rows of up_proj (sharded) or all
    of them (replicated), by `tail` (the k3lab.ops.moe_experts row's tail(lat, norm_w, eps, up_rows,
    out, col0)). Returns out."""
    lo, hi = w.own_rows if sharded else (0, w.up.shape[0])
    return tail(lat, w.norm, w.eps, w.up[lo:hi], out, lo)
