"""k3lab.ops.mla_glue: the three fused launches around MLA decode against the lines of
k3lab.engine.layers.mla_partial they replace (copied here as the reference), the op's torch backend, and
mla_partial with either glue backend against the PyTorch sequence it ran before.

Triton runs in its interpreter on these CPU tensors: on a GPU machine those tests run in a child that
sees no GPU (`@on_a_cpu`, tests/cpu_child.py); the bad-input checks, which refuse before any kernel, run
in place. fp32 agrees to a few fp32 ulps (the sums run in another order). bf16 reproduces the
reference's roundings: every element equal or within 1 bf16 ulp (where the fp32 sum, in another order,
lands on the other side of a rounding boundary), and nearly all of them bit-equal.
"""

from __future__ import annotations

import functools

import pytest
import torch

from k3lab.config import K3Config
from k3lab.engine.layers import mla_partial
from k3lab.engine.weights import MLAWeights
from k3lab.nn.norms import rms_norm
from k3lab.ops import BackendUnavailable
from k3lab.ops import mla_glue as mg

from cpu_child import on_a_cpu

TP8 = K3Config.tp_slice(8)
# (H, q_lora, LAT, ROPE, NOPE, V): a small shape with widths that are not powers of two (masks), and a
# TP8 rank's MLA
SHAPES = {
    "small": (3, 96, 64, 16, 24, 40),
    "tp8": (TP8.num_attention_heads, TP8.q_lora_rank, TP8.kv_lora_rank, TP8.qk_rope_head_dim,
            TP8.qk_nope_head_dim, TP8.v_head_dim),
}
BT = [(1, 1), (1, 2), (2, 1)]  # (B, T): N = 1, then N = 2 as one sequence of 2 or 2 of 1
DTYPES = [torch.float32, torch.bfloat16]
L, POS, EPS = 7, 3, 1e-6


# ------------------------------------------------------------------------ the reference: mla_partial's lines

def ref_norms(qa, ckv, q_a_norm, kv_a_norm, eps, rows):
    B, T, W = rows.shape
    lat, rope = kv_a_norm.shape[0], W - kv_a_norm.shape[0]
    out = rms_norm(qa, q_a_norm, eps)
    rows[..., :lat].copy_(rms_norm(ckv[:, :lat], kv_a_norm, eps).view(B, T, lat))
    rows[..., lat:].copy_(ckv[:, lat:].view(B, T, rope))
    return out


def ref_absorb(q, w_uk, q_buf):
    B, T, H, W = q_buf.shape
    lat, nope = w_uk.shape[2], w_uk.shape[1]
    rope = W - lat
    q_lat = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [H, N, 512]
    q_buf[..., :lat].copy_(q_lat.transpose(0, 1).view(B, T, H, lat))
    q_buf[..., lat:].copy_(q[..., nope:].view(B, T, H, rope))


def ref_out_gate(o_lat, w_uv, g):
    H, _, lat = w_uv.shape
    N = g.shape[0]
    o = torch.bmm(o_lat.reshape(N, H, lat).transpose(0, 1), w_uv.transpose(1, 2))  # [H, N, 128]
    o = o.transpose(0, 1) * torch.sigmoid(g.view(N, H, -1))
    return o.reshape(N, -1)


# ------------------------------------------------------------------------ inputs and comparisons

def _inputs(shape: str, B: int, T: int, dtype, seed: int = 0) -> dict:
    """Fresh random inputs; qa, ckv and g are column slices of one stacked product (strided rows), rows
    a view of a [B, L, LAT + ROPE] cache."""
    H, Q, LAT, ROPE, NOPE, V = SHAPES[shape]
    N = B * T
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0, shift=0.0):
        return (torch.randn(*s, generator=gen) * scale + shift).to(dtype)

    stacked = r(N, Q + LAT + ROPE + H * V, scale=2.0)
    qa, ckv, g = stacked.split([Q, LAT + ROPE, H * V], dim=-1)
    return dict(H=H, Q=Q, LAT=LAT, ROPE=ROPE, NOPE=NOPE, V=V, B=B, T=T, N=N, qa=qa, ckv=ckv, g=g,
                q_a_norm=r(Q, scale=0.3, shift=1.0), kv_a_norm=r(LAT, scale=0.3, shift=1.0),
                latent=r(B, L, LAT + ROPE), q=r(N, H, NOPE + ROPE), w_uk=r(H, NOPE, LAT, scale=NOPE ** -0.5),
                w_uv=r(H, V, LAT, scale=LAT ** -0.5), o_lat=r(B, T, H, LAT), q_buf=r(B, T, H, LAT + ROPE))


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of the bf16 spacing at the larger magnitude."""
    a, b = a.float(), b.float()
    _, e = torch.frexp(torch.maximum(a.abs(), b.abs()))
    return (a - b).abs() / torch.ldexp(torch.ones_like(a), e - 8)


def _agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert not got.isnan().any(), f"{what}: NaN (an element left unwritten)"
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6, msg=what)
        return
    ulps = _ulps(got, want)
    assert ulps.max() <= 1, f"{what}: {ulps.max().item()} bf16 ulps apart"
    assert (got == want).float().mean() >= 0.98, f"{what}: only {(got == want).float().mean():.3f} bit-equal"


def _sentinel(t: torch.Tensor) -> torch.Tensor:
    """t filled with NaN: what the kernel must overwrite everywhere."""
    return torch.full_like(t, float("nan"))


# ------------------------------------------------------------------------ the three functions

@on_a_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T", BT, ids=["b1t1", "b1t2", "b2t1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_norms_match_the_reference_and_touch_only_the_new_rows(shape, B, T, dtype):
    d = _inputs(shape, B, T, dtype)
    want_cache = d["latent"].clone()
    want = ref_norms(d["qa"], d["ckv"], d["q_a_norm"], d["kv_a_norm"], EPS, want_cache[:, POS:POS + T])
    for backend in ("triton", "torch"):
        cache = d["latent"].clone()
        cache[:, POS:POS + T] = float("nan")
        got = mg.mla_norms(d["qa"], d["ckv"], d["q_a_norm"], d["kv_a_norm"], EPS, cache[:, POS:POS + T],
                           backend=backend)
        assert got.shape == (d["N"], d["Q"]) and got.dtype == dtype
        _agree(got, want, f"{backend} qa_normed")
        _agree(cache[:, POS:POS + T], want_cache[:, POS:POS + T], f"{backend} new latent rows")
        outside = torch.ones(L, dtype=torch.bool)
        outside[POS:POS + T] = False
        assert torch.equal(cache[:, outside], d["latent"][:, outside]), f"{backend} wrote outside its rows"
        # the rope part is a copy: bit-equal whatever the dtype
        assert torch.equal(cache[:, POS:POS + T, d["LAT"]:], d["ckv"][:, d["LAT"]:].view(B, T, -1))


@on_a_cpu
def test_norms_eps_enters_as_the_reference():
    """Small rows where eps is a fair share of mean(x^2): a misplaced eps shows."""
    d = _inputs("small", 1, 2, torch.float32, seed=3)
    qa, ckv = d["qa"] * 0.05, d["ckv"] * 0.05
    want_cache, cache = d["latent"].clone(), d["latent"].clone()
    want = ref_norms(qa, ckv, d["q_a_norm"], d["kv_a_norm"], 1e-2, want_cache[:, POS:POS + 2])
    got = mg.mla_norms(qa, ckv, d["q_a_norm"], d["kv_a_norm"], 1e-2, cache[:, POS:POS + 2], backend="triton")
    _agree(got, want, "qa_normed")
    _agree(cache, want_cache, "cache")
    assert not torch.allclose(want, rms_norm(qa, d["q_a_norm"], 2e-2), rtol=1e-3)


@on_a_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T", BT, ids=["b1t1", "b1t2", "b2t1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_absorb_q_fills_all_of_q_buf_as_the_reference(shape, B, T, dtype):
    d = _inputs(shape, B, T, dtype)
    want = d["q_buf"].clone()
    ref_absorb(d["q"], d["w_uk"], want)
    for backend in ("triton", "torch"):
        q_buf = _sentinel(d["q_buf"])
        assert mg.mla_absorb_q(d["q"], d["w_uk"], q_buf, backend=backend) is q_buf
        _agree(q_buf, want, f"{backend} q_buf")
        assert torch.equal(q_buf[..., d["LAT"]:], d["q"][..., d["NOPE"]:].view(B, T, d["H"], -1))


@on_a_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T", BT, ids=["b1t1", "b1t2", "b2t1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_out_gate_rounds_as_the_reference(shape, B, T, dtype):
    d = _inputs(shape, B, T, dtype)
    want = ref_out_gate(d["o_lat"], d["w_uv"], d["g"])
    assert d["g"].stride(0) != d["g"].shape[1]  # a column slice: strided rows
    for backend in ("triton", "torch"):
        got = mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"], backend=backend)
        _agree(got, want, f"{backend} o")
        out = torch.full((d["N"], d["H"] * d["V"]), float("nan"), dtype=dtype)
        o3 = d["o_lat"].view(d["N"], d["H"], d["LAT"])  # the [N, H, LAT] form, into a given out
        assert mg.mla_out_gate(o3, d["w_uv"], d["g"], out=out, backend=backend) is out
        _agree(out, want, f"{backend} out=")


@on_a_cpu
def test_out_gate_rounds_each_stage_in_bf16():
    """The gate is rounded to bf16 before the product, as torch.sigmoid on a bf16 tensor is: an fp32
    product of the unrounded values differs in many elements, which the triton backend must not."""
    d = _inputs("small", 1, 2, torch.bfloat16, seed=5)
    N, H, LAT = d["N"], d["H"], d["LAT"]
    got = mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"], backend="triton")
    o = torch.bmm(d["o_lat"].view(N, H, LAT).float().transpose(0, 1), d["w_uv"].float().transpose(1, 2))
    once = (o.transpose(0, 1) * torch.sigmoid(d["g"].float().view(N, H, -1))).reshape(N, -1).bfloat16()
    want = ref_out_gate(d["o_lat"], d["w_uv"], d["g"])
    assert (once != want).any()  # the check can tell the two apart
    assert (got == want).float().mean() > (got == once).float().mean()


@on_a_cpu
def test_backend_is_chosen_by_device_argument_or_variable(monkeypatch):
    d = _inputs("small", 1, 1, torch.float32)
    calls = []
    real = mg.launch_out_gate
    monkeypatch.setattr(mg, "launch_out_gate", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.delenv(mg.BACKEND_ENV, raising=False)
    mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"])
    assert calls == []  # CPU tensors: torch
    monkeypatch.setenv(mg.BACKEND_ENV, "triton")
    mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"])
    assert calls == [1]
    mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"], backend="torch")  # the argument wins
    assert calls == [1]
    with pytest.raises(ValueError, match="^backend must be one of"):
        mg.mla_out_gate(d["o_lat"], d["w_uv"], d["g"], backend="cuda")
    assert issubclass(BackendUnavailable, ValueError)


# ------------------------------------------------------------------------ bad inputs

def _bad_cases():
    d = _inputs("small", 1, 2, torch.float32)
    rows = d["latent"][:, POS:POS + 2]
    meta = torch.empty(d["LAT"], device="meta")
    norms = lambda **kw: ("norms", {**dict(qa=d["qa"], ckv=d["ckv"], q_a_norm=d["q_a_norm"],  # noqa: E731
                                           kv_a_norm=d["kv_a_norm"], eps=EPS, rows=rows), **kw})
    absorb = lambda **kw: ("absorb", {**dict(q=d["q"], w_uk=d["w_uk"], q_buf=d["q_buf"]), **kw})  # noqa: E731
    gate = lambda **kw: ("gate", {**dict(o_lat=d["o_lat"], w_uv=d["w_uv"], g=d["g"]), **kw})  # noqa: E731
    return [
        ("qa", norms(qa=d["qa"][None])),  # wrong dims
        ("ckv", norms(ckv=d["ckv"][:, 1:])),  # wrong width
        ("rows", norms(rows=d["latent"][:, POS:POS + 1])),  # B*T != N
        ("rows", norms(rows=rows.half())),  # dtype
        ("q_a_norm", norms(q_a_norm=d["q_a_norm"][1:])),
        ("kv_a_norm", norms(kv_a_norm=meta)),  # device
        ("eps", norms(eps=0.0)),
        ("q", absorb(q=d["q"][:, :2])),  # heads
        ("q", absorb(q=d["q"].transpose(1, 2).contiguous().transpose(1, 2))),  # last dim not stride 1
        ("w_uk", absorb(w_uk=d["w_uk"].bfloat16())),
        ("q_buf", absorb(q_buf=d["q_buf"].to(torch.int32))),
        ("o_lat", gate(o_lat=d["o_lat"][..., 1:])),
        ("w_uv", gate(w_uv=d["w_uv"].half())),
        ("g", gate(g=d["g"][:, 1:])),
        ("out", gate(out=torch.zeros(3, d["g"].shape[1]))),
        ("out", gate(out=torch.empty(d["g"].shape, device="meta"))),
    ]


FNS = {"norms": mg.mla_norms, "absorb": mg.mla_absorb_q, "gate": mg.mla_out_gate}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_are_refused_by_name_before_any_kernel(backend):
    for arg, (fn, kwargs) in _bad_cases():
        outputs = [t for t in (kwargs.get("rows"), kwargs.get("q_buf"), kwargs.get("out"))
                   if t is not None and t.device.type == "cpu"]
        before = [t.clone() for t in outputs]
        with pytest.raises(ValueError, match=rf"^{arg}\b"):
            FNS[fn](**kwargs, backend=backend)
        assert all(torch.equal(t, b) for t, b in zip(outputs, before)), f"{arg}: an output was written"


# ------------------------------------------------------------------------ end to end: mla_partial

def _weights(shape: str, hidden: int, dtype, seed: int = 1) -> MLAWeights:
    H, Q, LAT, ROPE, NOPE, V = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale):
        return (torch.randn(*s, generator=gen) * scale).to(dtype)

    return MLAWeights(
        w_in=r(Q + LAT + ROPE + H * V, hidden, scale=hidden ** -0.5), q_a_norm=(1 + r(Q, scale=0.2)),
        q_b=r(H * (NOPE + ROPE), Q, scale=Q ** -0.5), kv_a_norm=(1 + r(LAT, scale=0.2)),
        w_uk=r(H, NOPE, LAT, scale=NOPE ** -0.5), w_uv=r(H, V, LAT, scale=LAT ** -0.5),
        o_proj=r(hidden, H * V, scale=(H * V) ** -0.5), eps=EPS)


def _plan(latent, q_buf, pos, lat):
    """Causal attention of q_buf over latent[:, :pos + T] (what an MLA decode plan computes): (o_lat
    [B, T, H, LAT] in q_buf's dtype, lse)."""
    def run():
        T, W = q_buf.shape[1], q_buf.shape[-1]
        kv = latent[:, :pos + T].float()
        s = torch.einsum("bthd,bld->bthl", q_buf.float(), kv) * W ** -0.5
        seen = torch.arange(pos + T)[None, :] <= (pos + torch.arange(T))[:, None]  # [T, pos + T]
        s = s.masked_fill(~seen[None, :, None, :], float("-inf"))
        o = torch.einsum("bthl,bld->bthd", s.softmax(-1), kv[..., :lat])
        return o.to(q_buf.dtype), s.logsumexp(-1)
    return run


def original_partial(w: MLAWeights, x, latent, pos, q_buf, plan):
    """mla_partial as it was before the glue op: the PyTorch sequence, copied here as the reference."""
    from k3lab.engine.fp8 import linear

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


def glued_partial(w: MLAWeights, x, latent, pos, q_buf, plan):
    """mla_partial with its glue lines replaced by the three calls (what the integrator will do)."""
    from k3lab.engine.fp8 import linear

    B, T, H, _ = q_buf.shape
    lat, rope = w.kv_a_norm.shape[0], q_buf.shape[-1] - w.kv_a_norm.shape[0]
    qa, ckv, g = linear(x, w.w_in).split([w.q_a_norm.shape[0], lat + rope, H * w.w_uv.shape[1]], dim=-1)
    qa_n = mg.mla_norms(qa, ckv, w.q_a_norm, w.kv_a_norm, w.eps, latent[:, pos:pos + T], backend="triton")
    q = linear(qa_n, w.q_b).view(B * T, H, -1)
    mg.mla_absorb_q(q, w.w_uk, q_buf, backend="triton")
    o_lat, _ = plan()
    return linear(mg.mla_out_gate(o_lat, w.w_uv, g, backend="triton"), w.o_proj)


@on_a_cpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("B,T", BT, ids=["b1t1", "b1t2", "b2t1"])
@pytest.mark.parametrize("shape", SHAPES)
def test_mla_partial_with_the_glue_calls_agrees_with_mla_partial(shape, B, T, dtype):
    H, Q, LAT, ROPE, NOPE, V = SHAPES[shape]
    hidden = 64
    w = _weights(shape, hidden, dtype)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(B * T, hidden, generator=gen).to(dtype)
    latent0 = torch.randn(B, L, LAT + ROPE, generator=gen).to(dtype)
    integrated = [functools.partial(mla_partial, glue=name) for name in ("triton", "torch")]
    results = []
    for fn in (original_partial, glued_partial, *integrated):
        latent, q_buf = latent0.clone(), torch.zeros(B, T, H, LAT + ROPE, dtype=dtype)
        y = fn(w, x, latent, POS, q_buf, _plan(latent, q_buf, POS, LAT))
        results.append((y, latent, q_buf))
    (y0, lat0, qb0), *others = results
    assert y0.abs().max() > 0.1  # not a trivially small output
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for i, (y1, lat1, qb1) in enumerate(others):
        _agree(lat1, lat0, f"latent cache ({i})")
        # q_buf's inputs went through q_b on a norm that may differ by an ulp: the projection spreads it
        torch.testing.assert_close(qb1, qb0, **tol)
        torch.testing.assert_close(y1, y0, **tol)
    assert torch.equal(others[2][0], y0)  # glue='torch' is the PyTorch sequence itself
