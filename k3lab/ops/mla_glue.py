"""The glue around absorbed MLA decode, fused: three launches where the PyTorch sequence runs ~30 kernels.

    qa_n = mla_norms(qa, ckv, q_a_norm, kv_a_norm, eps, rows)
        qa_n             = rms_norm(qa, q_a_norm, eps)                          [N, q_lora]
        rows[..., :LAT]  = rms_norm(ckv[:, :LAT], kv_a_norm, eps)               (the new latent rows)
        rows[..., LAT:]  = ckv[:, LAT:]                                         (their rope part)
    mla_absorb_q(q, w_uk, q_buf)
        q_buf[..., :LAT] = q_nope[n, h] @ w_uk[h]                               (the absorbed query)
        q_buf[..., LAT:] = q_rope[n, h]
    o = mla_out_gate(o_lat, w_uv, g)
        o[n, h*V:(h+1)*V] = (o_lat[n, h] @ w_uv[h]^T) * sigmoid(g[n, h*V:(h+1)*V])

Contract. N = B*T tokens, H heads, LAT = 512 latent, ROPE = 64, NOPE = 128, V = 128 at K3 (every
width is read from the arguments: LAT = kv_a_norm's / w_uk's last dim, ROPE = the rest of ckv's /
q_buf's last dim, NOPE = w_uk.shape[1], V = w_uv.shape[1]). The activations (qa, ckv, rows, q,
q_buf, o_lat, g, out) share one dtype, fp32, fp16 or bf16, and one device; the weights (norm
vectors of any of those dtypes; w_uk, w_uv of the activations' dtype, as torch.bmm requires) too.
Every tensor needs a stride-1 last dim; the others are free, so qa, ckv and g may be column slices of
the stacked input projection and rows the view latent[:, pos:pos + T] of a [B, L, LAT + ROPE] cache.
  mla_norms     qa [N, q_lora], ckv [N, LAT + ROPE], rows [B, T, LAT + ROPE] written in place; returns
                a new [N, q_lora] tensor. The norms are k3lab.nn.norms.rms_norm's arithmetic: fp32
                x * rsqrt(mean(x^2) + eps) * weight, one rounding to the output dtype.
  mla_absorb_q  q [N, H, NOPE + ROPE], w_uk [H, NOPE, LAT], q_buf [B, T, H, LAT + ROPE] written in
                place (every element). The product accumulates in fp32 and rounds once, as torch.bmm.
  mla_out_gate  o_lat [N, H, LAT] or [B, T, H, LAT] (what an MLA decode plan returns, in q_buf's dtype),
                w_uv [H, V, LAT], g [N, H*V]; returns [N, H*V] (or writes `out`). Rounded as the
                reference's three torch ops round: the product (fp32 sum) to the dtype, sigmoid(g) to
                the dtype, then their product.
Bad input is a ValueError naming the argument, raised before any kernel; nothing is read back to the
host, so the calls can be captured in a CUDA graph.

Backends (`BACKENDS`, k3lab.ops' contract: `backend=` or K3LAB_MLA_GLUE_BACKEND forces one):
  triton  one launch per function. mla_norms: grid (N, 2), program (n, 0) normalizes qa's row, (n, 1)
          the latent row into the cache and copies its rope part. mla_absorb_q: program (n*H + h, block
          of LAT columns) streams that block of w_uk[h] against q_nope (the j = 0 program also copies the
          rope). mla_out_gate: program (n*H + h, block of V rows) streams those rows of w_uv[h] against
          o_lat in LAT steps, then gates. Compiled on GPU tensors; Triton's interpreter on CPU tensors
          (tests; bf16 rounded with integer arithmetic there, since the interpreter's cast truncates).
  torch   the lines of k3lab.engine.layers.mla_partial these replace (the reference): rms_norm's
          elementwise kernels, copies into the cache rows and q_buf, two bmm, a sigmoid and a mul.
Default: triton on GPU tensors, torch on CPU tensors.

Why: at batch 1 an MLA layer's glue is ~30 small kernels around the projections and the attention
kernel, each a launch (a few microseconds) for a few kilobytes of work; the 24 MLA layers of a step pay
that every token. Fused, each stage is one launch whose cost is its small weight stream (w_uk, w_uv:
1.5 MB each per TP8 rank in bf16).
"""

from __future__ import annotations

import torch

from k3lab import env
from k3lab.ops import expect, positive_finite, triton_and_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch backend still runs; BACKENDS says why this one does not
    triton = None

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NORM_BLOCK = 2048  # a norm program loads at most this many values at once (K3's q_lora 1536 in one)
# (columns of LAT per absorb program, warps): on a GPU more programs than heads (12 heads x 8 blocks at
# TP8); in the interpreter (CPU tensors, tests) one program per head, since it pays per program
ABSORB_GPU, ABSORB_INTERPRETER = (64, 4), (512, 1)
# (rows of V per out-gate program, LAT columns per step, warps)
GATE_GPU, GATE_INTERPRETER = (16, 256, 4), (128, 512, 1)

if triton is not None:
    from k3lab.ops.triton_math import rms_row, round_to

    @triton.jit
    def _sigmoid(x):
        # exp of -|x| only, so nothing overflows at large |x|
        e = tl.exp(-tl.abs(x))
        return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @triton.jit
    def _norms_kernel(qa_ptr, qw_ptr, qo_ptr, ckv_ptr, kw_ptr, rows_ptr, eps, T, s_qa, s_qo, s_ckv, s_rb,
                      s_rt, Q: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, Q_BLOCK: tl.constexpr,
                      LAT_BLOCK: tl.constexpr, ROPE_BLOCK: tl.constexpr, INT_ROUND: tl.constexpr):
        # program (n, 0): qa's row n normed into qo; (n, 1): ckv's latent normed into the cache row
        # (b, t) = divmod(n, T) and its rope part copied after it
        n = tl.program_id(0).to(tl.int64)
        if tl.program_id(1) == 0:
            rms_row(qa_ptr + n * s_qa, qw_ptr, qo_ptr + n * s_qo, eps, Q, Q_BLOCK, INT_ROUND)
        else:
            src = ckv_ptr + n * s_ckv
            dst = rows_ptr + (n // T) * s_rb + (n % T) * s_rt
            rms_row(src, kw_ptr, dst, eps, LAT, LAT_BLOCK, INT_ROUND)
            rs = tl.arange(0, ROPE_BLOCK)
            for r0 in range(0, ROPE, ROPE_BLOCK):
                ok = (r0 + rs) < ROPE
                tl.store(dst + LAT + r0 + rs, tl.load(src + LAT + r0 + rs, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def _absorb_q_kernel(q_ptr, wuk_ptr, qb_ptr, T, H, s_qn, s_qh, s_wh, s_wk, s_bb, s_bt, s_bh,
                         NOPE: tl.constexpr, NOPE_BLOCK: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr,
                         ROPE_BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, INT_ROUND: tl.constexpr):
        # q_buf[n, h, j-block] = round(sum_k q[n, h, k] w_uk[h, k, j-block]) for k < NOPE; the program
        # of the first block also copies q[n, h, NOPE:] to q_buf[n, h, LAT:]
        nh = tl.program_id(0).to(tl.int64)
        n, h = nh // H, nh % H
        jb = tl.program_id(1)
        q_row = q_ptr + n * s_qn + h * s_qh
        dst = qb_ptr + (n // T) * s_bb + (n % T) * s_bt + h * s_bh
        ks = tl.arange(0, NOPE_BLOCK)
        kmask = ks < NOPE
        js = jb * BLOCK_J + tl.arange(0, BLOCK_J)
        jmask = js < LAT
        x = tl.load(q_row + ks, mask=kmask, other=0.0).to(tl.float32)
        w = tl.load(wuk_ptr + h * s_wh + ks[:, None].to(tl.int64) * s_wk + js[None, :],
                    mask=kmask[:, None] & jmask[None, :], other=0.0)
        acc = tl.sum(w.to(tl.float32) * x[:, None], axis=0)
        tl.store(dst + js, round_to(acc, qb_ptr.dtype.element_ty, INT_ROUND), mask=jmask)
        if jb == 0:
            rs = tl.arange(0, ROPE_BLOCK)
            for r0 in range(0, ROPE, ROPE_BLOCK):
                ok = (r0 + rs) < ROPE
                tl.store(dst + LAT + r0 + rs, tl.load(q_row + NOPE + r0 + rs, mask=ok, other=0.0), mask=ok)

    @triton.jit
    def _out_gate_kernel(o_ptr, wuv_ptr, g_ptr, out_ptr, H, s_on, s_oh, s_wh, s_wv, s_gn, s_outn,
                         LAT: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         INT_ROUND: tl.constexpr):
        # out[n, h*V + v] = round(round(sum_k o[n, h, k] w_uv[h, v, k]) * round(sigmoid(g[n, h*V + v])))
        # for this program's BLOCK_V rows v of head h
        nh = tl.program_id(0).to(tl.int64)
        n, h = nh // H, nh % H
        vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        vmask = vs < V
        ks = tl.arange(0, BLOCK_K)
        o_row = o_ptr + n * s_on + h * s_oh
        w_rows = wuv_ptr + h * s_wh + vs[:, None].to(tl.int64) * s_wv
        acc = tl.zeros((BLOCK_V, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, LAT, BLOCK_K):
            kk = k0 + ks
            kmask = kk < LAT
            x = tl.load(o_row + kk, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + kk[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        dt = out_ptr.dtype.element_ty
        y = round_to(tl.sum(acc, axis=1), dt, INT_ROUND).to(tl.float32)
        cols = h * V + vs
        g = tl.load(g_ptr + n * s_gn + cols, mask=vmask, other=0.0).to(tl.float32)
        s = round_to(_sigmoid(g), dt, INT_ROUND).to(tl.float32)
        tl.store(out_ptr + n * s_outn + cols, round_to(y * s, dt, INT_ROUND), mask=vmask)


# ------------------------------------------------------------------------------------------ checks

_ACT = {"dtype": DTYPES, "contiguous": "last"}  # every tensor here: fp32 / fp16 / bf16, stride-1 last dim


def _same(ref_name: str, ref: torch.Tensor, *named, dtype: bool = True) -> None:
    """Each (name, tensor) on ref's device (and of its dtype where `dtype`)."""
    for name, t in named:
        if t.device != ref.device:
            raise ValueError(f"{name} must be on {ref_name}'s device {ref.device}, got {t.device}")
        if dtype and t.dtype != ref.dtype:
            raise ValueError(f"{name} must have {ref_name}'s dtype {ref.dtype}, got {t.dtype}")


def _shape(name: str, t: torch.Tensor, want: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(want):
        raise ValueError(f"{name} must be {list(want)} ({what}), got {list(t.shape)}")


def check_norms(qa, ckv, q_a_norm, kv_a_norm, eps, rows) -> tuple[int, int, int, int, int]:
    """Validate mla_norms' inputs (metadata only); returns (B, T, q_lora, LAT, ROPE)."""
    expect("qa", qa, shape=2, what="[N, q_lora]", **_ACT)
    expect("ckv", ckv, shape=2, what="[N, LAT + ROPE]", **_ACT)
    expect("rows", rows, shape=3, what="[B, T, LAT + ROPE] (latent[:, pos:pos + T])", **_ACT)
    expect("q_a_norm", q_a_norm, shape=1, what="[q_lora]", **_ACT)
    expect("kv_a_norm", kv_a_norm, shape=1, what="[LAT]", **_ACT)
    positive_finite("eps", eps)
    B, T, W = rows.shape
    N, Q, LAT = qa.shape[0], qa.shape[1], kv_a_norm.shape[0]
    _shape("ckv", ckv, (N, W), f"qa's N = {N} rows of rows' width {W}")
    if B * T != N:
        raise ValueError(f"rows must be [B, T, {W}] with B*T = N = {N} (qa's rows), got {list(rows.shape)}")
    _shape("q_a_norm", q_a_norm, (Q,), "qa's width")
    if not 0 < LAT < W:
        raise ValueError(f"kv_a_norm must be [LAT] with 0 < LAT < ckv's width {W}, got "
                         f"{list(kv_a_norm.shape)}")
    _same("qa", qa, ("ckv", ckv), ("rows", rows))
    _same("qa", qa, ("q_a_norm", q_a_norm), ("kv_a_norm", kv_a_norm), dtype=False)
    return B, T, Q, LAT, W - LAT


def check_absorb(q, w_uk, q_buf) -> tuple[int, int, int, int, int, int]:
    """Validate mla_absorb_q's inputs; returns (B, T, H, NOPE, LAT, ROPE)."""
    expect("q", q, shape=3, what="[N, H, NOPE + ROPE]", **_ACT)
    expect("w_uk", w_uk, shape=3, what="[H, NOPE, LAT]", **_ACT)
    expect("q_buf", q_buf, shape=4, what="[B, T, H, LAT + ROPE]", **_ACT)
    B, T, H, W = q_buf.shape
    _, NOPE, LAT = w_uk.shape
    if not 0 < LAT < W:
        raise ValueError(f"q_buf's last dim must exceed w_uk's LAT = {LAT}, got {list(q_buf.shape)}")
    _shape("q", q, (B * T, H, NOPE + W - LAT), f"q_buf's B*T = {B * T} tokens and H = {H} heads, NOPE + ROPE")
    _shape("w_uk", w_uk, (H, NOPE, LAT), "q_buf's heads")
    _same("q_buf", q_buf, ("q", q), ("w_uk", w_uk))
    return B, T, H, NOPE, LAT, W - LAT


def check_out_gate(o_lat, w_uv, g, out=None) -> tuple[int, int, int, int]:
    """Validate mla_out_gate's inputs; returns (N, H, V, LAT)."""
    if isinstance(o_lat, torch.Tensor) and o_lat.dim() == 4:
        expect("o_lat", o_lat, shape=4, what="[B, T, H, LAT]", **_ACT)
    else:
        expect("o_lat", o_lat, shape=3, what="[N, H, LAT] (or [B, T, H, LAT])", **_ACT)
    expect("w_uv", w_uv, shape=3, what="[H, V, LAT]", **_ACT)
    expect("g", g, shape=2, what="[N, H*V]", **_ACT)
    H, V, LAT = w_uv.shape
    N = g.shape[0]
    _shape("g", g, (N, H * V), f"w_uv's H*V = {H * V} columns")
    if tuple(o_lat.shape[-2:]) != (H, LAT) or o_lat.shape[:-2].numel() != N:
        raise ValueError(f"o_lat must be [N={N}, H={H}, LAT={LAT}] (or [B, T, H, LAT] with B*T = N), "
                         f"got {list(o_lat.shape)}")
    try:
        o_lat.view(N, H, LAT)
    except RuntimeError:
        raise ValueError(f"o_lat's leading dims must collapse to one token stride, got strides "
                         f"{tuple(o_lat.stride())}") from None
    _same("g", g, ("o_lat", o_lat), ("w_uv", w_uv))
    if out is not None:
        expect("out", out, shape=2, what="[N, H*V]", **_ACT)
        _shape("out", out, (N, H * V), "g's shape")
        _same("g", g, ("out", out))
    return N, H, V, LAT


# ------------------------------------------------------------------------------------------ the rows'
# callables, on checked inputs

def _norms_torch(qa, ckv, q_a_norm, kv_a_norm, eps, rows, B, T, LAT, ROPE):
    from k3lab.nn.norms import rms_norm

    qa_n = rms_norm(qa, q_a_norm, eps)
    rows[..., :LAT].copy_(rms_norm(ckv[:, :LAT], kv_a_norm, eps).view(B, T, LAT))
    rows[..., LAT:].copy_(ckv[:, LAT:].view(B, T, ROPE))
    return qa_n


def _norms_triton(qa, ckv, q_a_norm, kv_a_norm, eps, rows, B, T, LAT, ROPE):
    qa_n = torch.empty(qa.shape, dtype=qa.dtype, device=qa.device)
    if qa.shape[0]:
        launch_norms(qa, ckv, q_a_norm, kv_a_norm, float(eps), rows, qa_n, int_round=env.triton_interpreted())
    return qa_n


def _absorb_torch(q, w_uk, q_buf, B, T, H, NOPE, LAT, ROPE):
    q_lat = torch.bmm(q[..., :NOPE].transpose(0, 1), w_uk)  # [H, N, LAT]
    q_buf[..., :LAT].copy_(q_lat.transpose(0, 1).view(B, T, H, LAT))
    q_buf[..., LAT:].copy_(q[..., NOPE:].view(B, T, H, ROPE))
    return q_buf


def _absorb_triton(q, w_uk, q_buf, B, T, H, NOPE, LAT, ROPE):
    if q_buf.numel():
        interp = env.triton_interpreted()  # the interpreter's blocks and bf16 rounding
        launch_absorb(q, w_uk, q_buf, ABSORB_INTERPRETER if interp else ABSORB_GPU, int_round=interp)
    return q_buf


def _gate_torch(o_lat, w_uv, g, out, N, H, V, LAT):
    o = torch.bmm(o_lat.view(N, H, LAT).transpose(0, 1), w_uv.transpose(1, 2))  # [H, N, V]
    o = (o.transpose(0, 1) * torch.sigmoid(g.view(N, H, -1))).reshape(N, -1)
    return o if out is None else out.copy_(o)


def _gate_triton(o_lat, w_uv, g, out, N, H, V, LAT):
    if out is None:
        out = torch.empty(N, H * V, dtype=g.dtype, device=g.device)
    if out.numel():
        interp = env.triton_interpreted()
        launch_out_gate(o_lat, w_uv, g, out, GATE_INTERPRETER if interp else GATE_GPU, int_round=interp)
    return out


# callables (on checked inputs, the widths the checks return): norms, absorb_q, out_gate. The torch row
# is the reference (and the before: the ~30 kernels the step runs unfused).
BACKENDS = triton_and_torch("mla_glue",
                            {"norms": _norms_triton, "absorb_q": _absorb_triton, "out_gate": _gate_triton},
                            {"norms": _norms_torch, "absorb_q": _absorb_torch, "out_gate": _gate_torch},
                            torch_why="plain PyTorch (the lines of k3lab.engine.layers.mla_partial)")
BACKEND_ENV = BACKENDS.env


# ------------------------------------------------------------------------------------------ entry points

def mla_norms(qa, ckv, q_a_norm, kv_a_norm, eps, rows, *, backend: str | None = None) -> torch.Tensor:
    """rms_norm(qa) returned, rms_norm(ckv's latent) and ckv's rope written into rows (module docstring)."""
    B, T, _, LAT, ROPE = check_norms(qa, ckv, q_a_norm, kv_a_norm, eps, rows)
    row = BACKENDS.pick(backend, qa.device, need="norms")
    return row.norms(qa, ckv, q_a_norm, kv_a_norm, eps, rows, B, T, LAT, ROPE)


def mla_absorb_q(q, w_uk, q_buf, *, backend: str | None = None) -> torch.Tensor:
    """q_buf[..., :LAT] = q_nope @ w_uk per head, q_buf[..., LAT:] = q_rope; returns q_buf."""
    shape = check_absorb(q, w_uk, q_buf)
    return BACKENDS.pick(backend, q.device, need="absorb_q").absorb_q(q, w_uk, q_buf, *shape)


def mla_out_gate(o_lat, w_uv, g, *, out: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """(o_lat @ w_uv^T per head) * sigmoid(g): [N, H*V] in g's dtype (module docstring)."""
    shape = check_out_gate(o_lat, w_uv, g, out)
    return BACKENDS.pick(backend, g.device, need="out_gate").out_gate(o_lat, w_uv, g, out, *shape)


# ------------------------------------------------------------------------------------------ launches

def _pow2(n: int, cap: int | None = None) -> int:
    b = triton.next_power_of_2(max(n, 1))
    return min(b, cap) if cap else b


def launch_norms(qa, ckv, q_a_norm, kv_a_norm, eps: float, rows, qa_n, *, int_round: bool = False) -> None:
    """The mla_norms launch on checked inputs (`check_norms`), qa_n the [N, q_lora] output."""
    N, Q = qa.shape
    LAT = kv_a_norm.shape[0]
    ROPE = ckv.shape[1] - LAT
    _norms_kernel[(N, 2)](qa, q_a_norm, qa_n, ckv, kv_a_norm, rows, eps, rows.shape[1], qa.stride(0),
                          qa_n.stride(0), ckv.stride(0), rows.stride(0), rows.stride(1), Q=Q, LAT=LAT,
                          ROPE=ROPE, Q_BLOCK=_pow2(Q, NORM_BLOCK), LAT_BLOCK=_pow2(LAT, NORM_BLOCK),
                          ROPE_BLOCK=_pow2(ROPE, 256), INT_ROUND=int_round, num_warps=4)


def launch_absorb(q, w_uk, q_buf, blocks: tuple[int, int] = ABSORB_GPU, *, int_round: bool = False) -> None:
    """The mla_absorb_q launch on checked inputs with (BLOCK_J, warps)."""
    B, T, H, W = q_buf.shape
    _, NOPE, LAT = w_uk.shape
    block_j, warps = blocks
    _absorb_q_kernel[(B * T * H, triton.cdiv(LAT, block_j))](
        q, w_uk, q_buf, T, H, q.stride(0), q.stride(1), w_uk.stride(0), w_uk.stride(1), q_buf.stride(0),
        q_buf.stride(1), q_buf.stride(2), NOPE=NOPE, NOPE_BLOCK=_pow2(NOPE), LAT=LAT, ROPE=W - LAT,
        ROPE_BLOCK=_pow2(W - LAT, 256), BLOCK_J=block_j, INT_ROUND=int_round, num_warps=warps)


def launch_out_gate(o_lat, w_uv, g, out, blocks: tuple[int, int, int] = GATE_GPU, *,
                    int_round: bool = False) -> None:
    """The mla_out_gate launch on checked inputs with (BLOCK_V, BLOCK_K, warps)."""
    H, V, LAT = w_uv.shape
    N = g.shape[0]
    o3 = o_lat.view(N, H, LAT)
    bv, bk, warps = blocks
    _out_gate_kernel[(N * H, triton.cdiv(V, bv))](
        o3, w_uv, g, out, H, o3.stride(0), o3.stride(1), w_uv.stride(0), w_uv.stride(1), g.stride(0),
        out.stride(0), LAT=LAT, V=V, BLOCK_V=bv, BLOCK_K=bk, INT_ROUND=int_round, num_warps=warps)
