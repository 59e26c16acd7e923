"""The unfused chain of a KDA decode step in k3lab's own Triton kernels (the seed's "before"): a conv
kernel, a kernel fusing the q/k norm, both gates and the recurrent update, the output norm, and the
two copies between them: 3 compute launches + 2 copies, every handoff through memory in bf16."""

from __future__ import annotations

import torch

from k3lab import env
from k3lab.ops.kda_decode.inputs import HEAD_DIM

try:
    import triton
    import triton.language as tl
except ImportError:  # `before` needs Triton; the reference and the fused kernel do not
    triton = None



if triton is not None:

    @triton.jit
    def _conv_silu_one(x_row, st, w, y, b, which, C, offs, m):
        """Short conv + SiLU of one input's channels `offs` (mask m) into y[b, which] of y [B, 3, C], and its
        conv state [C, 3] rolled by one (x enters)."""
        x = tl.load(x_row + offs, mask=m, other=0.0)
        s0 = tl.load(st + offs * 3, mask=m, other=0.0)
        s1 = tl.load(st + offs * 3 + 1, mask=m, other=0.0)
        s2 = tl.load(st + offs * 3 + 2, mask=m, other=0.0)
        acc = tl.load(w + offs * 4, mask=m, other=0.0) * s0.to(tl.float32)
        acc += tl.load(w + offs * 4 + 1, mask=m, other=0.0) * s1.to(tl.float32)
        acc += tl.load(w + offs * 4 + 2, mask=m, other=0.0) * s2.to(tl.float32)
        acc += tl.load(w + offs * 4 + 3, mask=m, other=0.0) * x.to(tl.float32)
        acc = acc * tl.sigmoid(acc)
        tl.store(y + (b * 3 + which) * C + offs, acc.to(y.dtype.element_ty), mask=m)
        tl.store(st + offs * 3, s1, mask=m)
        tl.store(st + offs * 3 + 1, s2, mask=m)
        tl.store(st + offs * 3 + 2, x, mask=m)

    @triton.jit
    def _conv_silu_kernel(xq, xk, xv, rs_q, rs_k, rs_v, cq, ck, cv, bs_q, bs_k, bs_v, wq, wk, wv, y, C,
                          BC: tl.constexpr, BRANCH: tl.constexpr):
        """Short conv + SiLU of q, k, v (program axis 1 picks which) for one sequence and BC channels;
        rolls the conv states and writes y [B, 3, C] (the first handoff through memory). BRANCH: each
        input's code in its own branch, every pointer taken straight from its argument (what Triton's
        AMD pointer pass needs); else one body on a pointer chosen per program (NVIDIA)."""
        b = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        offs = tl.program_id(2) * BC + tl.arange(0, BC)
        m = offs < C
        if BRANCH:
            if which == 0:
                _conv_silu_one(xq + b * rs_q, cq + b * bs_q, wq, y, b, which, C, offs, m)
            elif which == 1:
                _conv_silu_one(xk + b * rs_k, ck + b * bs_k, wk, y, b, which, C, offs, m)
            else:
                _conv_silu_one(xv + b * rs_v, cv + b * bs_v, wv, y, b, which, C, offs, m)
        else:
            if which == 0:
                x_row = xq + b * rs_q
                st = cq + b * bs_q
                w = wq
            elif which == 1:
                x_row = xk + b * rs_k
                st = ck + b * bs_k
                w = wk
            else:
                x_row = xv + b * rs_v
                st = cv + b * bs_v
                w = wv
            _conv_silu_one(x_row, st, w, y, b, which, C, offs, m)

    @triton.jit
    def _norm_gates_recurrence_kernel(y, g_raw, rs_g, A_log, dt_bias, b_raw, rs_b, state, bs_state, o, H, C,
                                      scale, lower_bound, stride_k, stride_v,
                                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr):
        """The seed's middle kernel: q/k L2 norm, decay and beta gates and the recurrent update for one
        (sequence, head, BV value columns); writes o (the second handoff) and the state."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = bh % H
        ok = tl.arange(0, K)
        ov = tl.program_id(1) * BV + tl.arange(0, BV)
        row = y + b * 3 * C
        q = tl.load(row + h * K + ok).to(tl.float32)
        k = tl.load(row + C + h * K + ok).to(tl.float32)
        v = tl.load(row + 2 * C + h * V + ov).to(tl.float32)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
        z = tl.load(g_raw + b * rs_g + h * K + ok).to(tl.float32) + tl.load(dt_bias + h * K + ok)
        g = lower_bound * tl.sigmoid(tl.exp(tl.load(A_log + h)) * z)
        beta = tl.sigmoid(tl.load(b_raw + b * rs_b + h).to(tl.float32))
        ptrs = state + b * bs_state + h * K * V + ok[:, None] * stride_k + ov[None, :] * stride_v
        S = tl.load(ptrs) * tl.exp(g)[:, None]
        u = tl.sum(S * k[:, None], 0)
        S = S + k[:, None] * (beta * (v - u))[None, :]
        out = tl.sum(S * q[:, None], 0)
        tl.store(o + bh * V + ov, out.to(o.dtype.element_ty))
        tl.store(ptrs, S)

    @triton.jit
    def _gated_rms_norm_kernel(x, gate, rs_gate, w, y, H, eps, V: tl.constexpr):
        """RMSNorm_V(o) * o_norm * sigmoid(gate) for one (sequence, head)."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = bh % H
        ov = tl.arange(0, V)
        xv = tl.load(x + bh * V + ov).to(tl.float32)
        gv = tl.load(gate + b * rs_gate + h * V + ov).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / V + eps)
        tl.store(y + bh * V + ov, (xv * r * tl.load(w + ov) * tl.sigmoid(gv)).to(y.dtype.element_ty))


BEFORE_CONV_BLOCK = 256
BEFORE_TILE_V = 32  # value columns per program of the recurrence kernel (the original's 4 tiles per head)


def launch(q, k, v, g_raw, beta_raw, gate, cache, weights, out, state_layout, B, H) -> torch.Tensor:
    K, C, act = HEAD_DIM, H * HEAD_DIM, q.dtype
    S, cq, ck, cv = cache.state, cache.conv_q, cache.conv_k, cache.conv_v
    y = torch.empty(B, 3, C, device=q.device, dtype=act)
    _conv_silu_kernel[(B, 3, triton.cdiv(C, BEFORE_CONV_BLOCK))](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), cq, ck, cv, cq.stride(0), ck.stride(0), cv.stride(0),
        weights.conv_q, weights.conv_k, weights.conv_v, y, C, BC=BEFORE_CONV_BLOCK,
        BRANCH=env.detect().backend == "rocm")
    o_tmp = torch.empty(B, H, K, device=q.device, dtype=act)
    sk, sv = (K, 1) if state_layout == "kv" else (1, K)
    _norm_gates_recurrence_kernel[(B * H, K // BEFORE_TILE_V)](
        y, g_raw, g_raw.stride(0), weights.A_log, weights.dt_bias, beta_raw, beta_raw.stride(0), S,
        S.stride(0),
        o_tmp, H, C, K ** -0.5, float(weights.lower_bound), sk, sv, K=K, V=K, BV=BEFORE_TILE_V)
    core = torch.empty(B, H * K, device=q.device, dtype=act)
    core.view(B, H, K).copy_(o_tmp)  # copy 1: into the attention-output buffer
    normed = torch.empty(B * H, K, device=q.device, dtype=act)
    _gated_rms_norm_kernel[(B * H,)](core, gate, gate.stride(0), weights.o_norm, normed, H,
                                     float(weights.eps),
                                     V=K)
    out.copy_(normed.view(B, H * K))  # copy 2: into the caller's buffer
    return out

