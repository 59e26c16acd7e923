"""The ladder of notebook 03 (copy removal and fusion): one token's row in registers, then the fused
AttnRes + RMSNorm step (`k3lab.ops.attn_res_norm`'s kernel, simplified: every source read once, the
mixture and the norm never leaving registers).

    row_rms         y = RMSNorm(x) * w per row, the mean over the D real columns of a padded block
    depth_mix       AttnRes over S sources held as one [S_PAD, BLOCK_D] tile: logits, softmax, mixture
    attn_res_norm   the sources one at a time with an online softmax, then the next layer's RMSNorm

Graded in fp64 against `k3lab.nn.norms.rms_norm` and `k3lab.nn.attn_res.attn_res_mix`. The notebook's
own task (the gated output norm) follows the ladder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.nn.attn_res import attn_res_mix
from k3lab.nn.norms import rms_norm
from k3lab.workshop._core import Case

from ._grade import Puzzle

NB = "03_copy_removal"
EPS = 1e-5


# ------------------------------------------------------------------------------------ row_rms
@triton.jit
def _row_rms(x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(out_ptr + row * D + cols, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def row_rms(kernel, x, weight, eps=1e-5):
    """RMSNorm of every row of x [rows, D] with weight [D]; out in x's dtype. One program per row,
    BLOCK = D rounded up to a power of two."""
    x = x.contiguous()
    out = torch.empty_like(x)
    kernel[(x.shape[0],)](x, weight.contiguous(), out, x.shape[1], eps,
                          BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


ROW_RMS_STUB = '''\
@triton.jit
def row_rms_kernel(x_ptr, w_ptr, out_ptr, D, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)                     # one program per row; the row stays in registers
    cols = tl.arange(0, BLOCK)                 # BLOCK is D rounded up to a power of two
    mask = cols < D
    x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    # TODO 1: load the weight w [D] as fp32
    # TODO 2: rstd = 1 / sqrt(mean of x * x over the D real columns + eps)
    y = x                                      # placeholder: x * rstd * w
    tl.store(out_ptr + row * D + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
'''


def _row_rms_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, rows, D, scale, dt in (
            ("4 rows of 128", 4, 128, 1.0, torch.float32),
            ("D = 100: BLOCK 128 holds 28 padded columns", 3, 100, 1.0, torch.float32),
            ("D = 48, fp16", 5, 48, 1.0, torch.float16),
            ("rows far from unit scale", 2, 64, 50.0, torch.float32)):
        x = scale * torch.randn(rows, D, generator=gen, dtype=torch.float64)
        w = 1.0 + 0.2 * torch.randn(D, generator=gen, dtype=torch.float64)
        out.append(Case(label, {"x": x.to(device=device, dtype=dt), "weight": w.to(device=device, dtype=dt),
                                "eps": EPS}, dt))
    return out


def _row_rms_reference(case: Case):
    x = case.inputs
    return rms_norm(x["x"].double().cpu(), x["weight"].double().cpu(), x["eps"])


ROW_RMS = Puzzle(
    name="row_rms", notebook=NB, step=1, minutes=6, title="A row reduction kept in registers",
    statement="""\
**Ladder 1: RMSNorm of a row in registers.** `row_rms(kernel, x, weight)` gives each row of `x [rows, D]`
one program holding the whole row (`BLOCK` = D rounded up to a power of two, padded lanes loaded as 0).
Write `y = x * rsqrt(mean(x*x) + eps) * w`, the mean over the **D** real columns (one case has D = 100
in a block of 128). Compute in fp32; the store rounds to x's dtype. Graded against
`k3lab.nn.norms.rms_norm` in fp64.""",
    kernel_name="row_rms_kernel", stub=ROW_RMS_STUB, wrapper=row_rms, solution=_row_rms,
    cases=_row_rms_cases, reference=_row_rms_reference, outputs=("out",))


# ------------------------------------------------------------------------------------ AttnRes cases
def _sources_cases(seed: int, device: str, with_next: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, S, T, D, dt in (
            ("3 sources (embedding, one block, the partial), 4 tokens, D = 64", 3, 4, 64, torch.float32),
            ("6 sources (S_PAD 8), D = 100 in a block of 128", 6, 3, 100, torch.float32),
            ("one source: the mixture is the source itself", 1, 2, 64, torch.float32),
            ("5 sources, fp16", 5, 3, 48, torch.float16)):
        # sources of very different scales, as the block sums of a residual stream are
        scales = torch.logspace(0, 1.5, S, dtype=torch.float64)[:, None, None]
        src = scales * torch.randn(S, T, D, generator=gen, dtype=torch.float64)
        w = 2.0 * torch.randn(D, generator=gen, dtype=torch.float64)  # norm_weight * proj_weight
        inputs = {"sources": src.to(device=device, dtype=dt), "w_mix": w.to(device=device, dtype=dt)}
        if with_next:
            nw = 1.0 + 0.2 * torch.randn(D, generator=gen, dtype=torch.float64)
            inputs["next_w"] = nw.to(device=device, dtype=dt)
        inputs["eps"] = EPS
        out.append(Case(label, inputs, dt if with_next else torch.float32))
    return out


def _mix64(x: dict) -> torch.Tensor:
    src, w = x["sources"].double().cpu(), x["w_mix"].double().cpu()
    return attn_res_mix(src, w, torch.ones_like(w), x["eps"])


# ------------------------------------------------------------------------------------ depth_mix
@triton.jit
def _depth_mix(src_ptr, w_ptr, h_ptr, S, T, D, eps, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    i = tl.arange(0, S_PAD)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    v = tl.load(src_ptr + (i[:, None] * T + t) * D + cols[None, :], mask=(i < S)[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    logits = tl.sum(v * w[None, :], axis=1) / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
    logits = tl.where(i < S, logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=0))
    h = tl.sum(p[:, None] * v, axis=0) / tl.sum(p, axis=0)
    tl.store(h_ptr + t * D + cols, h, mask=cmask)


def depth_mix(kernel, sources, w_mix, eps=1e-5):
    """AttnRes: h [T, D] fp32 mixes sources [S, T, D] per token with softmax weights from
    logit_i = sum_d RMSNorm(v_i)[d] * w_mix[d]. One program per token; S_PAD = S rounded up to a power
    of two (>= 2), BLOCK_D = D rounded up."""
    S, T, D = sources.shape
    h = torch.empty(T, D, dtype=torch.float32, device=sources.device)
    kernel[(T,)](sources.contiguous(), w_mix.contiguous(), h, S, T, D, eps,
                 S_PAD=max(2, triton.next_power_of_2(S)), BLOCK_D=triton.next_power_of_2(D))
    return h


DEPTH_MIX_STUB = '''\
@triton.jit
def depth_mix_kernel(src_ptr, w_ptr, h_ptr, S, T, D, eps, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)                       # one program per token
    i = tl.arange(0, S_PAD)                    # the sources, padded to a power of two
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    # TODO 1: load the [S_PAD, BLOCK_D] tile of sources [S, T, D] at token t (real sources, real
    #         columns; 0 elsewhere), as fp32
    v = tl.zeros((S_PAD, BLOCK_D), dtype=tl.float32)   # placeholder
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    # TODO 2: logits[i] = sum_d v[i, d] * w[d] / sqrt(mean over D of v[i, :]**2 + eps);
    #         padded sources get -inf
    # TODO 3: p = softmax of the logits over the sources; h = sum_i p[i] * v[i, :]
    h = tl.sum(v, axis=0)                      # placeholder
    tl.store(h_ptr + t * D + cols, h, mask=cmask)
'''

DEPTH_MIX = Puzzle(
    name="depth_mix", notebook=NB, step=2, minutes=8, title="AttnRes: a softmax over depth",
    statement="""\
**Ladder 2: AttnRes's mixture of the sources.** Each token mixes `S` sources (the embedding, the
completed block sums and the current partial sum), `sources [S, T, D]`, with a softmax over depth:
`logit_i = sum_d RMSNorm(v_i)[d] * w_mix[d]` (the norm without a weight), `h = sum_i softmax(logit)_i v_i`.
`depth_mix(kernel, ...)` gives each token a program holding all its sources as one `[S_PAD, BLOCK_D]`
tile. Fill the TODOs: the 2-D masked load, the logits (row reductions, `axis=1`; padded sources at
`-inf`) and the softmax-weighted sum (`axis=0`). h is fp32. Graded against
`k3lab.nn.attn_res.attn_res_mix` in fp64.""",
    kernel_name="depth_mix_kernel", stub=DEPTH_MIX_STUB, wrapper=depth_mix, solution=_depth_mix,
    cases=lambda seed, device: _sources_cases(seed, device, with_next=False),
    reference=lambda case: _mix64(case.inputs), outputs=("h",))


# ------------------------------------------------------------------------------------ attn_res_norm
@triton.jit
def _attn_res_norm(src_ptr, w_ptr, nw_ptr, out_ptr, T, D, eps, S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    m = float("-inf")
    s = 0.0
    h = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for i in range(S):
        v = tl.load(src_ptr + (i * T + t) * D + cols, mask=cmask, other=0.0).to(tl.float32)
        logit = tl.sum(v * w, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)              # rescales what was summed under the old max
        p = tl.exp(logit - m_new)
        h = h * alpha + p * v
        s = s * alpha + p
        m = m_new
    h = h / s
    nw = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = h / tl.sqrt(tl.sum(h * h, axis=0) / D + eps) * nw
    tl.store(out_ptr + t * D + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)


def attn_res_norm(kernel, sources, w_mix, next_w, eps=1e-5):
    """The fused step: out [T, D] in the sources' dtype = RMSNorm(AttnRes(sources, w_mix)) * next_w.
    One program per token, walking the S sources one at a time; BLOCK_D = D rounded up."""
    S, T, D = sources.shape
    out = torch.empty(T, D, dtype=sources.dtype, device=sources.device)
    kernel[(T,)](sources.contiguous(), w_mix.contiguous(), next_w.contiguous(), out, T, D, eps, S=S,
                 BLOCK_D=triton.next_power_of_2(D))
    return out


ATTN_RES_NORM_STUB = '''\
@triton.jit
def attn_res_norm_kernel(src_ptr, w_ptr, nw_ptr, out_ptr, T, D, eps, S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    t = tl.program_id(0)                       # one program per token
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    m = float("-inf")                          # the largest logit so far
    s = 0.0                                    # sum of exp(logit - m) so far
    h = tl.zeros((BLOCK_D,), dtype=tl.float32) # sum of exp(logit - m) * v so far
    for i in range(S):
        v = tl.load(src_ptr + (i * T + t) * D + cols, mask=cmask, other=0.0).to(tl.float32)
        logit = tl.sum(v * w, axis=0) / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
        # TODO 1: the online softmax step: a new max m; rescale h and s by exp(old m - new m);
        #         add this source with weight exp(logit - m)
        h = h + v                              # placeholder
        s = s + 1.0                            # placeholder
    h = h / s
    # TODO 2: the next layer's RMSNorm of h with weight nw [D] (load it), still in registers
    y = h                                      # placeholder
    tl.store(out_ptr + t * D + cols, y.to(out_ptr.dtype.element_ty), mask=cmask)
'''


def _attn_res_norm_reference(case: Case):
    x = case.inputs
    return rms_norm(_mix64(x), x["next_w"].double().cpu(), x["eps"])


ATTN_RES_NORM = Puzzle(
    name="attn_res_norm", notebook=NB, step=3, minutes=10, title="The fused AttnRes + RMSNorm step",
    statement="""\
**Ladder 3: the fused step.** Unfused, the mixture `h` goes to memory and a second kernel reads it back
for the next layer's RMSNorm. Here one program per token reads each source once, **one at a time**, and
carries the softmax online: keep the largest logit `m`, the sum `s` of `exp(logit - m)` and the sum `h`
of `exp(logit - m) * v`; when `m` grows, rescale `s` and `h` by `exp(m_old - m_new)`. After the last
source, `h / s` is the mixture; normalise it with `next_w` in registers and store it once, in the
sources' dtype. This is `k3lab.ops.attn_res_norm`'s kernel with a group of one source. Graded against
`rms_norm(attn_res_mix(...), next_w)` in fp64.""",
    kernel_name="attn_res_norm_kernel", stub=ATTN_RES_NORM_STUB, wrapper=attn_res_norm,
    solution=_attn_res_norm, cases=lambda seed, device: _sources_cases(seed, device, with_next=True),
    reference=_attn_res_norm_reference, outputs=("out",))

PUZZLES = (ROW_RMS, DEPTH_MIX, ATTN_RES_NORM)
