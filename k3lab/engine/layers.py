"""One rank's share of each sublayer of a decode (or verification) step, up to the point where the
tensor-parallel layer needs a collective: every function returns this rank's partial result, which the
caller all-reduces (docs/k3.md). Inputs x are [N, hidden] (N = batch x q_len tokens, the
pre-normed hidden state); caches are updated in place. Every dense projection goes through
`fp8.linear`: a torch matmul for a plain weight, the FP8 product for an `Fp8Linear` (RankWeights.to_fp8).
"""

from __future__ import annotations

import torch

from k3lab.nn.kda import kda_beta, kda_gate, short_conv
from k3lab.nn.moe import route
from k3lab.nn.norms import gated_rms_norm, l2_normalize, rms_norm
from k3lab.nn.situ import situ_glu
from k3lab.ops import kda_verify as _kda_verify
from k3lab.ops import moe_experts, moe_router, packed_matmul
from k3lab.ops.situ_glu import situ_glu_stacked

from .fp8 import linear, quantize_input
from .weights import DenseWeights, KDAWeights, MLAWeights, MoEWeights


def kda_inputs(w: KDAWeights, x: torch.Tensor, pack: str):
    """(q, k, v, gate, beta_raw, g_raw), each [N, width] with a contiguous last dim: one stacked matmul,
    then f_b through the matmul dispatcher ('after': packs only for the kernel that reads the copy;
    'before': packs first, and the fallback that runs ignores the copy)."""
    q, k, v, gate, b_raw, fa = linear(x, w.w_in).split(w.split, dim=-1)
    g_raw = packed_matmul.POLICIES[pack](fa, w.f_b)
    return q, k, v, gate, b_raw, g_raw


def kda_decode_partial(w: KDAWeights, x: torch.Tensor, decode_step, pack: str) -> torch.Tensor:
    """One token per sequence: the KDA decode op (fused, chain or reference, bound to the layer's cache
    in `decode_step`), then this rank's columns of o_proj. Returns [N, hidden]."""
    q, k, v, gate, b_raw, g_raw = kda_inputs(w, x, pack)
    return linear(decode_step(q, k, v, g_raw, b_raw, gate), w.o_proj)


def kda_verify_partial(w: KDAWeights, x: torch.Tensor, cache, batch: int, q_len: int, pack: str, impl: str,
                       states: torch.Tensor) -> torch.Tensor:
    """q_len > 1 positions per sequence: the short convs (conv states updated), q/k norms and gates in
    PyTorch, the recurrence by the verification kernel ('after': narrow tiles, 'before': the streaming
    kernel) keeping every position's state in `states` [B, T, H, 128, 128]; the cache keeps the last
    one (every draft accepted). Returns [N, hidden]."""
    H, K = w.heads, w.decode.o_norm.shape[0]
    B, T = batch, q_len
    q, k, v, gate, b_raw, g_raw = kda_inputs(w, x, pack)
    d = w.decode
    ys = []
    for t, conv_w, state in ((q, d.conv_q, cache.conv_q), (k, d.conv_k, cache.conv_k),
                             (v, d.conv_v, cache.conv_v)):
        y, new_state = short_conv(t.reshape(B, T, -1), conv_w, state)
        state.copy_(new_state)
        ys.append(y)
    qn = l2_normalize(ys[0].view(B, T, H, K))
    kn = l2_normalize(ys[1].view(B, T, H, K))
    g = kda_gate(g_raw.view(B, T, -1), d.A_log, d.dt_bias, d.lower_bound).contiguous()
    beta = kda_beta(b_raw.reshape(B, T, H)).contiguous()
    verify = _kda_verify.kda_verify if impl == "after" else _kda_verify.kda_verify_before
    o, _ = verify(qn.contiguous(), kn.contiguous(), ys[2].view(B, T, H, K).contiguous(), g, beta, cache.state,
                  states_out=states)
    cache.state.copy_(states[:, -1])
    o = gated_rms_norm(o.to(x.dtype), gate.reshape(B, T, H, K), d.o_norm, d.eps)
    return linear(o.reshape(B * T, H * K), w.o_proj)


def mla_partial(w: MLAWeights, x: torch.Tensor, latent: torch.Tensor, pos: int, q_buf: torch.Tensor, plan,
                ) -> torch.Tensor:
    """The absorbed MLA decode: projections, the new latent rows written at positions [pos, pos + T) of
    `latent` [B, L, 576], the absorbed query written into `q_buf` [B, T, H, 576] (the buffer `plan`, an
    MLA decode plan, reads), attention, the value half of kv_b_proj, the output gate and this rank's
    columns of o_proj. Returns [N, hidden]."""
    B, T, H, _ = q_buf.shape
    lat, rope = w.kv_a_norm.shape[0], q_buf.shape[-1] - w.kv_a_norm.shape[0]
    nope = w.w_uk.shape[1]
    qa, ckv, g = linear(x, w.w_in).split([w.q_a_norm.shape[0], lat + rope, H * w.w_uv.shape[1]], dim=-1)
    q = linear(rms_norm(qa, w.q_a_norm, w.eps), w.q_b).view(B * T, H, -1)
    rows = latent[:, pos:pos + T]
    rows[..., :lat].copy_(rms_norm(ckv[:, :lat], w.kv_a_norm, w.eps).view(B, T, lat))
    rows[..., lat:].copy_(ckv[:, lat:].view(B, T, rope))
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w.w_uk)  # [H, N, 512]
    q_buf[..., :lat].copy_(q_lat.transpose(0, 1).view(B, T, H, lat))
    q_buf[..., lat:].copy_(q[..., nope:].view(B, T, H, rope))
    o_lat, _ = plan()
    o = torch.bmm(o_lat.view(B * T, H, lat).transpose(0, 1), w.w_uv.transpose(1, 2))  # [H, N, 128]
    o = o.transpose(0, 1) * torch.sigmoid(g.view(B * T, H, -1))
    return linear(o.reshape(B * T, -1), w.o_proj)


def glu(gu: torch.Tensor, glue: str) -> torch.Tensor:
    """SiTU-GLU of a stacked gate|up product [N, 2F] -> [N, F]: one Triton launch ('triton') or the
    PyTorch sequence ('torch')."""
    if glue == "triton":
        return situ_glu_stacked(gu, backend="triton")
    return situ_glu(*gu.chunk(2, dim=-1))


def dense_partial(w: DenseWeights, x: torch.Tensor, glue: str = "torch") -> torch.Tensor:
    """Layer 0's SiTU-GLU MLP on this rank's share of the intermediate: [N, hidden], a partial sum."""
    return linear(glu(linear(x, w.gate_up), glue), w.down)


def moe_input(w: MoEWeights, x: torch.Tensor):
    """What down_proj and the shared expert's gate/up read: x, or x quantized once for both where
    they are FP8 (`fp8.quantize_input`)."""
    return quantize_input(x, w.down)


def fused_routing_fits(tokens: int, top_k: int) -> bool:
    """Whether the fused router takes `tokens` x `top_k` pairs (k3lab.ops.moe_router.MAX_PAIRS)."""
    return tokens * top_k <= moe_router.MAX_PAIRS


def moe_latent_partial(w: MoEWeights, x: torch.Tensor, experts: str, xin=None, glue: str = "torch",
                       seen: list | None = None) -> torch.Tensor:
    """Router (replicated, on x), down_proj (replicated, on xin: `moe_input(w, x)`, default x) and this
    rank's share of every chosen expert: [N, LAT] fp32, the partial latent that the layer all-reduces.
    experts: 'triton' (two grouped launches) or 'torch' (the per-expert loop). glue: 'triton' routes
    and sorts in two launches (k3lab.ops.moe_router, where the pairs fit) or 'torch' (route(), and the
    grouped kernels sort). seen: a list the chosen experts [N, top_k] are appended to (the bench's
    count of expert weights read)."""
    logits = linear(x, w.gate)
    sort = None
    if glue == "triton" and fused_routing_fits(x.shape[0], w.top_k):
        m = moe_experts.default_block_m(x.shape[0], w.top_k, w.w1.shape[0])
        weights, idx, sort = moe_router.route_and_sort(logits, w.gate_bias, w.top_k, scaling=w.scaling,
                                                       renormalize=w.renormalize, block_m=m, backend="triton")
    else:
        weights, idx, _ = route(logits.float(), w.gate_bias, w.top_k, w.scaling, w.renormalize)
    if seen is not None:
        seen.append(idx)
    z = linear(x if xin is None else xin, w.down)
    return moe_experts.routed_experts(z, weights, idx, w.w1, w.w3, w.w2, backend=experts, check_values=False,
                                      sort=sort if experts == "triton" else None)


def moe_shared_partial(w: MoEWeights, x: torch.Tensor, xin=None, glue: str = "torch") -> torch.Tensor:
    """This rank's share of the shared expert (row-parallel; gate/up on xin as in moe_latent_partial):
    [N, hidden] in x's dtype, contiguous."""
    if w.shared_in is None:
        return torch.zeros_like(x)
    return linear(glu(linear(x if xin is None else xin, w.shared_in), glue), w.shared_down).contiguous()


def moe_tail(w: MoEWeights, lat: torch.Tensor, out: torch.Tensor, sharded: bool,
             backend: str) -> torch.Tensor:
    """out[:, cols] += up[cols](RMSNorm(lat)) in place: this rank's rows of up_proj (sharded) or all
    of them (replicated). Returns out."""
    lo, hi = w.own_rows if sharded else (0, w.up.shape[0])
    return moe_experts.latent_tail(lat, w.norm, w.eps, w.up[lo:hi], out, lo, backend=backend)
