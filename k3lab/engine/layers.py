"""One rank's share of each sublayer of a decode (or verification) step, up to the point where the
tensor-parallel layer needs a collective: every function returns this rank's partial result, which the
caller all-reduces (docs/k3.md). Inputs x are [N, hidden] (N = batch x q_len tokens, the
pre-normed hidden state); caches are updated in place. Every dense projection goes through
`fp8.linear`: a torch matmul for a plain weight, the FP8 product for an `Fp8Linear` (RankWeights.to_fp8).

What a switch chooses arrives here as a callable, bound once by the step (`DecodeStep._bind`): the KDA
step (`KDADecodeStep`, or `KDAVerifyStep` for q_len > 1), the gate input's pack policy, the SiTU-GLU
(`glu_fused` / `glu_plain`), the router (`route_fused` / `route_plain`), the routed experts
(`experts_grouped` / `experts_loop`) and the MoE tail's op; the MLA glue's backend arrives as its name
(k3lab.ops.mla_glue); nothing here compares a switch's name.
"""

from __future__ import annotations

import torch

from k3lab.nn.kda import kda_beta, kda_gate, short_conv
from k3lab.nn.moe import route
from k3lab.nn.norms import gated_rms_norm, l2_normalize
from k3lab.nn.situ import situ_glu
from k3lab.ops import mla_glue, moe_experts, moe_router
from k3lab.ops.situ_glu import situ_glu_stacked

from k3lab.ops.gemv import gemv, gemv_stack

from .fp8 import linear, one_row_parts, quantize_input
from .weights import DenseWeights, KDAWeights, MLAWeights, MoEWeights


def kda_inputs(w: KDAWeights, x: torch.Tensor, pack):
    """(q, k, v, gate, beta_raw, g_raw), each [N, width] with a contiguous last dim: one stacked matmul,
    then f_b through `pack`, the matmul dispatcher's policy (k3lab.ops.packed_matmul.POLICIES: packs
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
    the verification kernel (`verify`: k3lab.ops.kda_verify.kda_verify, narrow tiles, or
    kda_verify_before, the streaming kernel) and the step's `states` buffer [B, T, H, 128, 128], as
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
                glue: str = "torch") -> torch.Tensor:
    """The absorbed MLA decode: projections, the new latent rows written at positions [pos, pos + T) of
    `latent` [B, L, 576], the absorbed query written into `q_buf` [B, T, H, 576] (the buffer `plan`, an
    MLA decode plan, reads), attention, the value half of kv_b_proj, the output gate and this rank's
    columns of o_proj. glue: the k3lab.ops.mla_glue backend of the work between the projections and
    the attention ('triton': three launches; 'torch': the PyTorch sequence). Returns [N, hidden]."""
    B, T, H, _ = q_buf.shape
    lat, rope = w.kv_a_norm.shape[0], q_buf.shape[-1] - w.kv_a_norm.shape[0]
    qa, ckv, g = linear(x, w.w_in).split([w.q_a_norm.shape[0], lat + rope, H * w.w_uv.shape[1]], dim=-1)
    qa_n = mla_glue.mla_norms(qa, ckv, w.q_a_norm, w.kv_a_norm, w.eps, latent[:, pos:pos + T], backend=glue)
    mla_glue.mla_absorb_q(linear(qa_n, w.q_b).view(B * T, H, -1), w.w_uk, q_buf, backend=glue)
    o_lat, _ = plan()
    return linear(mla_glue.mla_out_gate(o_lat, w.w_uv, g, backend=glue), w.o_proj)


def glu_fused(gu: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU of a stacked gate|up product [N, 2F] -> [N, F] in one Triton launch."""
    return situ_glu_stacked(gu, backend="triton")


def glu_plain(gu: torch.Tensor) -> torch.Tensor:
    """SiTU-GLU of a stacked gate|up product [N, 2F] -> [N, F] as the PyTorch sequence."""
    return situ_glu(*gu.chunk(2, dim=-1))


def dense_partial(w: DenseWeights, x: torch.Tensor, act=glu_plain) -> torch.Tensor:
    """Layer 0's SiTU-GLU MLP on this rank's share of the intermediate: [N, hidden], a partial sum; `act`
    is the SiTU-GLU (`glu_fused` or `glu_plain`)."""
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
        logits, z, *gu = gemv_stack(x, stacked, backend="triton")
        return logits, z, (gu[0] if gu else None)
    xin = quantize_input(x, w.down)
    return (linear(x, w.gate), linear(xin, w.down),
            linear(xin, w.shared_in) if w.shared_in is not None else None)


def route_fused(logits: torch.Tensor, w: MoEWeights):
    """(weights, idx, sort): routing and the expert sort by k3lab.ops.moe_router's Triton kernels (one
    launch up to its FUSED_PAIRS pairs, two beyond; the step binds it where the tokens' pairs fit the
    single-program sort)."""
    m = moe_experts.default_block_m(logits.shape[0], w.top_k, w.w1.shape[0])
    return moe_router.route_and_sort(logits, w.gate_bias, w.top_k, scaling=w.scaling,
                                     renormalize=w.renormalize, block_m=m, backend="triton")


def route_plain(logits: torch.Tensor, w: MoEWeights):
    """(weights, idx, None): routing as the PyTorch sequence (k3lab.nn.moe.route); the grouped kernels
    sort for themselves."""
    weights, idx, _ = route(logits.float(), w.gate_bias, w.top_k, w.scaling, w.renormalize)
    return weights, idx, None


def experts_grouped(z, weights, idx, w: MoEWeights, sort) -> torch.Tensor:
    """This rank's share of the chosen experts in two grouped Triton launches (the router's sort reused)."""
    return moe_experts.routed_experts(z, weights, idx, w.w1, w.w3, w.w2, backend="triton", check_values=False,
                                      sort=sort)


def experts_loop(z, weights, idx, w: MoEWeights, sort=None) -> torch.Tensor:
    """This rank's share of the chosen experts as the per-expert PyTorch loop (no sort read)."""
    return moe_experts.routed_experts(z, weights, idx, w.w1, w.w3, w.w2, backend="torch", check_values=False)


def moe_latent_partial(w: MoEWeights, logits: torch.Tensor, z: torch.Tensor, router=route_plain,
                       experts=experts_loop, seen: list | None = None) -> torch.Tensor:
    """Routing on the router's `logits` and this rank's share of every chosen expert on `z` (both from
    `moe_products`): [N, LAT] fp32, the partial latent that the layer all-reduces. router: `route_fused`
    or `route_plain`; experts: `experts_grouped` or `experts_loop`. seen: a list the chosen experts
    [N, top_k] are appended to (the bench's count of expert weights read)."""
    weights, idx, sort = router(logits, w)
    if seen is not None:
        seen.append(idx)
    return experts(z, weights, idx, w, sort)


def moe_shared_partial(w: MoEWeights, x: torch.Tensor, gu: torch.Tensor | None,
                       act=glu_plain) -> torch.Tensor:
    """This rank's share of the shared expert (row-parallel) from its gate|up product `gu` (from
    `moe_products`; None where the layer has no shared expert: zeros like x), `act` the SiTU-GLU:
    [N, hidden] in x's dtype, contiguous. With the fused SiTU-GLU (`glu_fused`) and a one-row GEMV
    down_proj (`fp8.one_row_parts`) the activation is computed inside the GEMV's load: one launch."""
    if gu is None:
        return torch.zeros_like(x)
    if act is glu_fused:
        stacked = one_row_parts(gu, [w.shared_down])
        if stacked is not None:
            (weight, scale), = stacked
            return gemv(gu, weight, scale=scale, glu=True, backend="triton")
    return linear(act(gu), w.shared_down).contiguous()


def moe_tail(w: MoEWeights, lat: torch.Tensor, out: torch.Tensor, sharded: bool,
             tail=moe_experts.latent_tail) -> torch.Tensor:
    """out[:, cols] += up[cols](RMSNorm(lat)) in place: this rank's rows of up_proj (sharded) or all
    of them (replicated), by `tail` (k3lab.ops.moe_experts.latent_tail with its backend bound).
    Returns out."""
    lo, hi = w.own_rows if sharded else (0, w.up.shape[0])
    return tail(lat, w.norm, w.eps, w.up[lo:hi], out, lo)
