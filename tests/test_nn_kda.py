"""KDA references: chunked == recurrent (outputs and state), fla's naive references, the short conv,
the gate, and the whole layer against a token-by-token implementation written from the equations."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from k3lab.config import K3Config
from k3lab.model import init_weights
from k3lab.nn.kda import (
    KDACache,
    KimiDeltaAttention,
    chunk_inverse,
    kda_beta,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    short_conv,
)


def kda_inputs(B, T, H, K, V, *, seed, dtype=torch.float64, state=False):
    """Fresh random inputs in K3's ranges: unit-norm q and k, g in (-5, 0), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) - 2)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    s0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64) if state else None
    cast = [t.to(dtype) for t in (q, k, v, g, beta)]
    return (*cast, None if s0 is None else s0.to(torch.float64 if dtype == torch.float64 else torch.float32))


# ------------------------------------------------------------------ chunked == recurrent
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent_fp64(T, with_state):
    q, k, v, g, beta, s0 = kda_inputs(2, T, 2, 32, 16, seed=T, state=with_state)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunked(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o_c, o_r, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_c, s_r, rtol=1e-10, atol=1e-10)


def test_chunked_equals_recurrent_at_k3_head_dims_fp32():
    q, k, v, g, beta, s0 = kda_inputs(1, 130, 2, 128, 128, seed=7, dtype=torch.float32, state=True)
    o_r, s_r = kda_recurrent(q.double(), k.double(), v.double(), g.double(), beta.double(),
                             initial_state=s0.double())
    o_c, s_c = kda_chunked(q, k, v, g, beta, initial_state=s0)
    assert o_c.dtype == torch.float32 and s_c.dtype == torch.float32
    torch.testing.assert_close(o_c, o_r.float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_c, s_r.float(), rtol=1e-4, atol=1e-4)


def test_state_carries_across_calls():
    q, k, v, g, beta, s0 = kda_inputs(1, 90, 2, 16, 16, seed=3, state=True)
    o_all, s_all = kda_chunked(q, k, v, g, beta, initial_state=s0)
    o1, s1 = kda_chunked(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], initial_state=s0)
    o2, s2 = kda_recurrent(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], initial_state=s1)
    torch.testing.assert_close(torch.cat([o1, o2], 1), o_all, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s2, s_all, rtol=1e-10, atol=1e-10)


@settings(max_examples=12, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 100), H=st.integers(1, 2), K=st.sampled_from([4, 8, 16]),
       V=st.sampled_from([4, 8, 12]), chunk=st.sampled_from([4, 16, 64]), with_state=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunked_equals_recurrent_property(B, T, H, K, V, chunk, with_state, seed):
    q, k, v, g, beta, s0 = kda_inputs(B, T, H, K, V, seed=seed, state=with_state)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    o_c, s_c = kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=chunk)
    torch.testing.assert_close(o_c, o_r, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s_c, s_r, rtol=1e-9, atol=1e-9)


# ------------------------------------------------------------------ fla-core's naive references
def _fla_naive():
    try:
        from fla.ops.kda import naive
    except Exception as err:  # noqa: BLE001 - fla-core is optional; any import failure means "absent"
        pytest.skip(f"fla-core not importable ({type(err).__name__}: {err}); k3lab's references are "
                    "checked against each other and the hand-written layer instead")
    return naive


@pytest.mark.parametrize("with_state", [False, True])
def test_recurrent_equals_fla_naive_recurrent(with_state):
    naive = _fla_naive()
    q, k, v, g, beta, s0 = kda_inputs(2, 70, 2, 32, 16, seed=11, dtype=torch.float32, state=with_state)
    o_f, s_f = naive.naive_recurrent_kda(q, k, v, g, beta, scale=32 ** -0.5, initial_state=s0,
                                         output_final_state=True)
    o_k, s_k = kda_recurrent(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o_k, o_f, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_k, s_f, rtol=1e-5, atol=1e-5)


def test_chunked_equals_fla_naive_chunk():
    naive = _fla_naive()
    # fla's naive chunk form needs T to be a multiple of its chunk size
    q, k, v, g, beta, s0 = kda_inputs(1, 128, 2, 64, 32, seed=12, dtype=torch.float32, state=True)
    o_f, s_f = naive.naive_chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                     chunk_size=64)
    o_k, s_k = kda_chunked(q, k, v, g, beta, initial_state=s0, chunk_size=64)
    torch.testing.assert_close(o_k, o_f, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s_k, s_f, rtol=1e-4, atol=1e-4)


def test_gate_equals_fla_lower_bound_gate():
    try:
        from fla.ops.kda.gate import naive_kda_lowerbound_gate
    except Exception as err:  # noqa: BLE001 - as above
        pytest.skip(f"fla-core not importable ({type(err).__name__}: {err})")
    gen = torch.Generator().manual_seed(5)
    H, K = 3, 16
    raw = torch.randn(2, 7, H * K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    ref = naive_kda_lowerbound_gate(raw.view(2, 7, H, K), A_log, dt_bias, lower_bound=-5.0)
    torch.testing.assert_close(kda_gate(raw, A_log, dt_bias, -5.0), ref, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ short conv, gate, beta
def test_short_conv_equals_padded_conv1d():
    gen = torch.Generator().manual_seed(0)
    B, T, C, W = 2, 9, 6, 4
    x = torch.randn(B, T, C, generator=gen, dtype=torch.float64)
    w = torch.randn(C, 1, W, generator=gen, dtype=torch.float64)
    ref = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w, groups=C)).transpose(1, 2)
    y, state = short_conv(x, w)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))
    y2, _ = short_conv(x, w[:, 0], activation=False)
    torch.testing.assert_close(F.silu(y2), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("split", [1, 2, 5])
def test_short_conv_streams_with_its_state(split):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 11, 5, generator=gen, dtype=torch.float64)
    w = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    full, s_full = short_conv(x, w)
    outs, state = [], None
    for start in range(0, 11, split):
        y, state = short_conv(x[:, start:start + split], w, state)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-12, atol=1e-12)
    assert torch.equal(state, s_full)


def test_kda_gate_formula_and_range():
    raw = torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=torch.float64)
    A_log = torch.tensor([0.0, math.log(2.0)], dtype=torch.float64)
    dt_bias = torch.tensor([0.5, 0.0, -1.0, 3.0], dtype=torch.float64)

    def sig(z):
        return 1 / (1 + math.exp(-z))
    expected = torch.tensor([[[-5 * sig(1.0), -5 * sig(-1.0)], [-5 * sig(2 * 1.0), -5 * sig(2 * 3.0)]]],
                            dtype=torch.float64)
    got = kda_gate(raw, A_log, dt_bias, -5.0)
    assert got.shape == (1, 2, 2)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # the gate lies in [-5, 0]: exactly -5 only where the sigmoid saturates in floating point
    gen = torch.Generator().manual_seed(0)
    wide = kda_gate(torch.randn(100, 8, dtype=torch.float64, generator=gen) * 10, torch.zeros(2),
                    torch.zeros(8),
                    -5.0)
    assert bool((wide >= -5).all()) and bool((wide <= 0).all())
    torch.testing.assert_close(kda_beta(torch.tensor([0.0, 2.0])), torch.sigmoid(torch.tensor([0.0, 2.0])))


# ------------------------------------------------------------------ the layer
def tiny_kda_layer(dtype=torch.float64, seed=0):
    layer = KimiDeltaAttention(K3Config.tiny(), dtype=dtype)
    return init_weights(layer, seed)


def kda_layer_by_hand(layer, x):
    """Architecture.md section 3 steps 1-6, one token at a time, written without k3lab's helpers."""
    B, T, _ = x.shape
    H, K = layer.num_heads, layer.head_dim
    C = H * K

    def conv_silu(y, w):
        return F.silu(F.conv1d(F.pad(y.transpose(1, 2), (3, 0)), w, groups=C)).transpose(1, 2)

    q = conv_silu(x @ layer.q_proj.weight.T, layer.q_conv.weight).reshape(B, T, H, K)
    k = conv_silu(x @ layer.k_proj.weight.T, layer.k_conv.weight).reshape(B, T, H, K)
    v = conv_silu(x @ layer.v_proj.weight.T, layer.v_conv.weight).reshape(B, T, H, K)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    raw = (x @ layer.f_a.weight.T
           @ layer.f_b.weight.T).reshape(B, T, H, K) + layer.dt_bias.double().reshape(H, K)
    # the fp32 gate params, used in fp64
    g = -5.0 * torch.sigmoid(layer.A_log.double().exp().reshape(H, 1) * raw)
    beta = torch.sigmoid(x @ layer.b_proj.weight.T)
    S = torch.zeros(B, H, K, K, dtype=x.dtype)
    o = torch.zeros(B, T, H, K, dtype=x.dtype)
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        for b in range(B):
            for h in range(H):
                kt = k[b, t, h]
                u = S[b, h].T @ kt
                S[b, h] = S[b, h] + torch.outer(kt, beta[b, t, h] * (v[b, t, h] - u))
                o[b, t, h] = S[b, h].T @ (q[b, t, h] * K ** -0.5)
    gate = torch.sigmoid(x @ layer.g_proj.weight.T).reshape(B, T, H, K)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + layer.eps) * layer.o_norm.weight * gate
    return o.reshape(B, T, C) @ layer.o_proj.weight.T, S


@torch.no_grad()
def test_layer_matches_the_equations():
    layer = tiny_kda_layer()
    x = torch.randn(2, 6, layer.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    ref, s_ref = kda_layer_by_hand(layer, x)
    out, cache = layer(x)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cache.state, s_ref, rtol=1e-10, atol=1e-10)


@torch.no_grad()
@pytest.mark.parametrize("T", [3, 64, 70])
def test_layer_prefill_then_decode_equals_longer_prefill(T):
    layer = tiny_kda_layer()
    x = torch.randn(1, T + 3, layer.hidden_size, generator=torch.Generator().manual_seed(T),
                    dtype=torch.float64)
    full, c_full = layer(x)
    out, cache = layer(x[:, :T])
    outs = [out]
    for t in range(T, T + 3):  # decode: one token at a time, kda_recurrent
        before = {k: v.clone() for k, v in cache.entries().items()}
        y, new = layer(x[:, t:t + 1], cache)
        for name, t_ in cache.entries().items():  # the input cache is not modified
            assert torch.equal(t_, before[name]), name
        outs.append(y)
        cache = new
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-9)
    for name, t_ in c_full.entries().items():
        torch.testing.assert_close(cache.entries()[name], t_, rtol=1e-9, atol=1e-9, msg=name)


@torch.no_grad()
def test_layer_algorithms_agree_and_empty_cache_is_a_fresh_start():
    layer = tiny_kda_layer()
    x = torch.randn(2, 20, layer.hidden_size, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    a, ca = layer(x, algorithm="chunked")
    b, cb = layer(x, algorithm="recurrent")
    c, _ = layer(x, layer.empty_cache(2, state_dtype=torch.float64))
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ca.state, cb.state, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(c, a, rtol=1e-12, atol=1e-12)
    assert ca.state.dtype == torch.float64


@torch.no_grad()
def test_layer_fp32_state_and_bf16_activations():
    layer = tiny_kda_layer(dtype=torch.bfloat16)
    assert layer.A_log.dtype == torch.float32 and layer.dt_bias.dtype == torch.float32
    x = torch.randn(1, 5, layer.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    out, cache = layer(x)
    assert out.dtype == torch.bfloat16 and cache.state.dtype == torch.float32
    assert cache.conv_q.dtype == torch.bfloat16
    ref = tiny_kda_layer(dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    want, _ = ref(x.double())
    err = (out.double() - want).norm() / want.norm()
    assert err < 0.05, f"bf16 layer relative error {err:.3g}"


def test_layer_bad_inputs():
    layer = tiny_kda_layer()
    h = layer.hidden_size
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(1, 3, h + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have the layer's weight dtype"):
        layer(torch.randn(1, 3, h))
    with pytest.raises(ValueError, match="x must hold"):
        layer(torch.randn(1, 0, h, dtype=torch.float64))
    good = layer.empty_cache(1, state_dtype=torch.float64)
    bad_state = KDACache(good.conv_q, good.conv_k, good.conv_v,
                         torch.zeros(1, 2, 128, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="cache.state"):
        layer(torch.randn(1, 1, h, dtype=torch.float64), bad_state)
    bad_conv = KDACache(good.conv_q[:, :, :2], good.conv_k, good.conv_v, good.state)
    with pytest.raises(ValueError, match="cache.conv_q"):
        layer(torch.randn(1, 1, h, dtype=torch.float64), bad_conv)
    with pytest.raises(ValueError, match="cache.state"):
        layer(torch.randn(1, 1, h, dtype=torch.float64), KDACache(good.conv_q, good.conv_k, good.conv_v,
                                                                  good.state.half()))
    with pytest.raises(ValueError, match="algorithm"):
        layer(torch.randn(1, 1, h, dtype=torch.float64), algorithm="fast")


def test_function_bad_inputs():
    x = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="weight"):
        short_conv(x, torch.randn(7, 4))
    with pytest.raises(ValueError, match="conv_state"):
        short_conv(x, torch.randn(8, 4), torch.zeros(1, 8, 2))
    with pytest.raises(ValueError, match="x must be"):
        short_conv(torch.randn(4, 8), torch.randn(8, 4))
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(torch.randn(3, 8), torch.zeros(2), torch.zeros(6))
    with pytest.raises(ValueError, match="raw"):
        kda_gate(torch.randn(3, 9), torch.zeros(2), torch.zeros(9))
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(torch.randn(3, 8), torch.zeros(2, 1), torch.zeros(8))
    q, k, v, g, beta, _ = kda_inputs(1, 5, 2, 8, 8, seed=0)
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunked(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="beta"):
        kda_recurrent(q, k, v, g, beta[..., :1])


def test_empty_sequence_passes_the_state_through():
    q = torch.randn(1, 0, 2, 8, dtype=torch.float64)
    v = torch.randn(1, 0, 2, 4, dtype=torch.float64)
    beta = torch.rand(1, 0, 2, dtype=torch.float64)
    s0 = torch.randn(1, 2, 8, 4, dtype=torch.float64)
    for fn in (kda_chunked, kda_recurrent):
        o, s = fn(q, q, v, q, beta, initial_state=s0)
        assert o.shape == (1, 0, 2, 4) and torch.equal(s, s0)


def test_bad_chunk_sizes_scales_and_inverse_inputs_are_refused_by_name():
    from k3lab.config import KDA_CHUNK_SIZES

    q, k, v, g, beta, _ = kda_inputs(1, 9, 1, 8, 8, seed=0)
    for bad in (7, 0, -64, 3, 512, 64.0, True, "64", None):
        with pytest.raises(ValueError, match="chunk_size must be one of"):
            kda_chunked(q, k, v, g, beta, chunk_size=bad)
    for good in KDA_CHUNK_SIZES[:4]:
        kda_chunked(q, k, v, g, beta, chunk_size=good)
    for fn in (kda_chunked, kda_recurrent):
        for bad in (0.0, -0.3, float("nan"), float("inf"), "x", True):
            with pytest.raises(ValueError, match="scale must be a positive finite number"):
                fn(q, k, v, g, beta, scale=bad)
    for bad in (torch.zeros(3, 4), torch.zeros(3), torch.zeros(2, 2, dtype=torch.int64)):
        with pytest.raises(ValueError, match="A_strict_lower must be"):
            chunk_inverse(bad)
