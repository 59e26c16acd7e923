"""MLA: the absorbed decode form equals the naive prefill form; the latent cache; latent_attention."""

import math

import pytest
import torch

from k3lab.config import K3Config
from k3lab.model import init_weights
from k3lab.nn.mla import MLACache, MultiHeadLatentAttention, latent_attention


def tiny_mla(dtype=torch.float64, seed=0):
    return init_weights(MultiHeadLatentAttention(K3Config.tiny(), dtype=dtype), seed)


def rand_x(layer, B, T, seed, dtype=torch.float64):
    return torch.randn(B, T, layer.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_tiny_keeps_k3_head_dims_and_scale():
    layer = tiny_mla()
    assert layer.latent_dim == 576 and layer.kv_lora_rank == 512
    assert layer.scale == pytest.approx(192 ** -0.5)


@torch.no_grad()
@pytest.mark.parametrize("T", [1, 7])
def test_absorbed_equals_naive_prefill(T):
    layer = tiny_mla()
    x = rand_x(layer, 2, T, seed=T)
    a, ca = layer(x, form="absorbed")
    n, cn = layer(x, form="naive")
    torch.testing.assert_close(a, n, rtol=1e-10, atol=1e-10)
    assert torch.equal(ca.latent, cn.latent)


@torch.no_grad()
def test_absorbed_equals_naive_after_a_cache():
    layer = tiny_mla()
    x = rand_x(layer, 2, 9, seed=3)
    _, cache = layer(x[:, :5])
    a, _ = layer(x[:, 5:], cache, form="absorbed")
    n, _ = layer(x[:, 5:], cache, form="naive")
    torch.testing.assert_close(a, n, rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_decode_steps_equal_one_prefill():
    layer = tiny_mla()
    x = rand_x(layer, 2, 8, seed=5)
    full, c_full = layer(x)  # naive form (T > 1)
    out, cache = layer(x[:, :3])
    outs = [out]
    for t in range(3, 8):  # absorbed form (T = 1)
        before = cache.latent.clone()
        y, new = layer(x[:, t:t + 1], cache)
        assert torch.equal(cache.latent, before)  # the input cache is untouched
        assert new.length == cache.length + 1
        outs.append(y)
        cache = new
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(cache.latent, c_full.latent, rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_cache_rows_are_normed_latent_then_unrotated_rope_part():
    layer = tiny_mla()
    x = rand_x(layer, 1, 4, seed=6)
    _, cache = layer(x)
    ckv = x @ layer.kv_a_proj_with_mqa.weight.T
    c, k_pe = ckv[..., :512], ckv[..., 512:]
    c = c / torch.sqrt((c * c).mean(-1, keepdim=True)
                       + layer.kv_a_layernorm.eps) * layer.kv_a_layernorm.weight
    torch.testing.assert_close(cache.latent, torch.cat([c, k_pe], -1), rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_layer_matches_per_head_attention_by_hand():
    """One head at a time, from the equations: scores over [k_nope | k_pe], softmax scale 192^-0.5,
    gate, o_proj."""
    layer = tiny_mla()
    x = rand_x(layer, 1, 5, seed=8)
    out, cache = layer(x)
    H = layer.num_heads
    q = (layer.q_a_layernorm(x @ layer.q_a_proj.weight.T) @ layer.q_b_proj.weight.T).view(1, 5, H, 192)
    lat = cache.latent[0]
    kv = (lat[:, :512] @ layer.kv_b_proj.weight.T).view(5, H, 256)
    gate = torch.sigmoid(x @ layer.g_proj.weight.T).view(1, 5, H, 128)
    heads = []
    for h in range(H):
        k = torch.cat([kv[:, h, :128], lat[:, 512:]], -1)  # [5, 192]
        s = (q[0, :, h] @ k.T) / math.sqrt(192)
        s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(s.softmax(-1) @ kv[:, h, 128:] * gate[0, :, h])
    ref = torch.stack(heads, 1).reshape(5, H * 128) @ layer.o_proj.weight.T
    torch.testing.assert_close(out[0], ref, rtol=1e-10, atol=1e-10)


def test_latent_attention_lengths_and_causality():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 4, 576, generator=gen, dtype=torch.float64)
    cache = torch.randn(2, 10, 576, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([10, 6])
    o, lse = latent_attention(q, cache, lengths)
    for b in range(2):
        for t in range(3):
            pos = int(lengths[b]) - 3 + t
            s = (q[b, t] @ cache[b, :pos + 1].T) * 192 ** -0.5  # [H, pos+1]
            torch.testing.assert_close(lse[b, t], torch.logsumexp(s, -1), rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(o[b, t], s.softmax(-1) @ cache[b, :pos + 1, :512], rtol=1e-12,
                                       atol=1e-12)


@torch.no_grad()
def test_bf16_layer_is_close_to_fp64():
    layer = tiny_mla(dtype=torch.bfloat16)
    ref = tiny_mla(dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x = rand_x(layer, 1, 6, seed=1, dtype=torch.float64)
    out, cache = layer(x.bfloat16())
    want, _ = ref(x)
    assert out.dtype == torch.bfloat16 and cache.latent.dtype == torch.bfloat16
    assert (out.double() - want).norm() / want.norm() < 0.05


def test_bad_inputs():
    layer = tiny_mla()
    h = layer.hidden_size
    x = torch.randn(1, 1, h, dtype=torch.float64)
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(1, h, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must have the layer's weight dtype"):
        layer(x.float())
    with pytest.raises(ValueError, match="cache.latent"):
        layer(x, MLACache(torch.zeros(1, 4, 512, dtype=torch.float64)))
    with pytest.raises(ValueError, match="cache.latent"):
        layer(x, MLACache(torch.zeros(2, 4, 576, dtype=torch.float64)))
    with pytest.raises(ValueError, match="cache must be"):
        layer(x, torch.zeros(1, 4, 576))
    with pytest.raises(ValueError, match="form"):
        layer(x, form="fast")
    with pytest.raises(ValueError, match="rows"):
        MLACache(torch.zeros(1, 4, 576)).append(torch.zeros(1, 2, 512))
    with pytest.raises(ValueError, match="lengths"):
        latent_attention(torch.randn(1, 2, 4, 576), torch.randn(1, 5, 576), lengths=torch.tensor([1]))
