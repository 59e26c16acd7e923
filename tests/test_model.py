"""K3Model: prefill + decode == a longer prefill (logits and every cache entry), greedy generation,
deterministic weights, and bad input."""

import pytest
import torch

from k3lab.config import K3Config
from k3lab.model import K3Cache, K3Model, init_weights
from k3lab.nn.kda import KDACache
from k3lab.nn.mla import MLACache

TINY = K3Config.tiny()


@pytest.fixture(scope="module")
def model64():
    return init_weights(K3Model(TINY, dtype=torch.float64), seed=0)


def ids_for(B, T, seed):
    return torch.randint(0, TINY.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_cache_close(got: K3Cache, want: K3Cache, tol):
    assert got.length == want.length
    g, w = got.entries(), want.entries()
    assert g.keys() == w.keys()
    for name in w:
        assert g[name].shape == w[name].shape, name
        assert g[name].dtype == w[name].dtype, name
        torch.testing.assert_close(g[name], w[name], rtol=tol, atol=tol, msg=name)


@torch.no_grad()
@pytest.mark.parametrize("T", [5, 64])
def test_prefill_then_decode_equals_longer_prefill(model64, T):
    """T = 64: the decoded token is the first of a second KDA chunk. Every step crosses the tiny
    model's AttnRes block boundaries (layers 0, 2, 4)."""
    ids = ids_for(2, T + 1, seed=T)
    logits_full, cache_full = model64.prefill(ids)
    logits, cache = model64.prefill(ids[:, :T])
    torch.testing.assert_close(logits, logits_full[:, :T], rtol=1e-9, atol=1e-9)  # causal
    step, cache_step = model64.decode(ids[:, T:], cache)
    torch.testing.assert_close(step, logits_full[:, T:], rtol=1e-9, atol=1e-9)
    assert_cache_close(cache_step, cache_full, 1e-9)
    assert cache.length == T  # the input cache is not modified


@torch.no_grad()
def test_several_decode_steps_fp32():
    model = init_weights(K3Model(TINY), seed=1)
    ids = ids_for(1, 12, seed=2)
    logits_full, cache_full = model.prefill(ids)
    _, cache = model.prefill(ids[:, :8])
    steps = []
    for t in range(8, 12):
        step, cache = model.decode(ids[:, t:t + 1], cache)
        steps.append(step)
    torch.testing.assert_close(torch.cat(steps, 1), logits_full[:, 8:], rtol=1e-4, atol=1e-4)
    assert_cache_close(cache, cache_full, 1e-4)


@torch.no_grad()
def test_cache_layout(model64):
    _, cache = model64.prefill(ids_for(3, 7, seed=3))
    kinds = ["mla" if isinstance(c, MLACache) else "kda" for c in cache.layers]
    assert kinds == TINY.layer_types
    for c in cache.layers:
        if isinstance(c, MLACache):
            assert c.latent.shape == (3, 7, TINY.mla_latent_dim)
        else:
            assert isinstance(c, KDACache)
            assert c.state.shape == (3, TINY.kda_num_heads, 128, 128) and c.conv_q.shape == (
                3,
                TINY.kda_width,
                3,
            )
    assert cache.attn_res_blocks.shape == (len(TINY.attn_res_block_starts()), 3, TINY.hidden_size)
    sizes = cache.nbytes()
    assert sizes["mla_latent"] == TINY.num_mla_layers * 3 * 7 * 576 * 8
    assert sizes["kda_state"] == TINY.num_kda_layers * 3 * TINY.kda_state_bytes_per_sequence(8)


@torch.no_grad()
def test_generate_is_greedy_and_consistent_with_prefill(model64):
    prompt = ids_for(2, 6, seed=4)
    out = model64.generate(prompt, 5)
    assert out.shape == (2, 11) and torch.equal(out[:, :6], prompt)
    logits, _ = model64.prefill(out[:, :-1])
    assert torch.equal(logits[:, 5:].argmax(-1), out[:, 6:])
    assert torch.equal(model64.generate(prompt[0].tolist(), 5), out[:1])
    assert torch.equal(model64.generate(prompt, 0), prompt)


def test_init_weights_is_deterministic_and_sane():
    a = init_weights(K3Model(TINY), seed=5)
    b = init_weights(K3Model(TINY), seed=5)
    c = init_weights(K3Model(TINY), seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["layers.0.self_attn.q_proj.weight"], sc["layers.0.self_attn.q_proj.weight"])
    assert all(bool(v.abs().sum() > 0) for v in sa.values()), "no parameter may be left at zero"
    # activations of order one through the stack
    seen = []
    for layer in a.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append(out[0].partial.float().std().item()))
    with torch.no_grad():
        logits, _ = a.prefill(ids_for(2, 16, seed=7))
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10
    assert all(0.05 < s < 20 for s in seen), seen


def test_init_weights_refuses_meta():
    with torch.device("meta"):
        layer = K3Model(TINY)
    with pytest.raises(ValueError, match="meta"):
        init_weights(layer, 0)


def test_full_model_is_refused_as_a_tp_slice():
    with pytest.raises(ValueError, match="tp_size"):
        K3Model(K3Config.tp_slice(8))
    with pytest.raises(ValueError, match="config"):
        K3Model("tiny")


def test_bad_inputs(model64):
    with pytest.raises(ValueError, match="input_ids"):
        model64.prefill(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids"):
        model64.prefill(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="input_ids must lie"):
        model64.prefill(torch.full((1, 2), TINY.vocab_size))
    with torch.no_grad():
        _, cache = model64.prefill(ids_for(2, 3, seed=0))
    with pytest.raises(ValueError, match=r"input_ids must be \[B, 1\]"):
        model64.decode(ids_for(2, 2, seed=0), cache)
    with pytest.raises(ValueError, match="cache must be"):
        model64.decode(ids_for(2, 1, seed=0), None)
    with pytest.raises(ValueError, match=r"cache.layers\[0\].*cache.conv_q"):
        model64.decode(ids_for(1, 1, seed=0), cache)  # batch 1 against a batch-2 cache
    bad = K3Cache(cache.layers[:-1], cache.attn_res_blocks, cache.attn_res_partial, cache.length)
    with pytest.raises(ValueError, match="cache.layers must have"):
        model64.decode(ids_for(2, 1, seed=0), bad)
    layers = list(cache.layers)
    layers[1] = KDACache(layers[1].conv_q, layers[1].conv_k, layers[1].conv_v, layers[1].state[:, :, :64])
    with pytest.raises(ValueError, match=r"cache.layers\[1\].*cache.state"):
        model64.decode(ids_for(2, 1, seed=0),
                       K3Cache(layers, cache.attn_res_blocks, cache.attn_res_partial, 3))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model64.generate(ids_for(1, 2, seed=0), -1)


def test_anatomy_helpers_agree_with_the_config():
    from k3lab.model import component_table, layer_plan, state_sizes
    full = K3Config.full()
    plan = layer_plan(full)
    assert len(plan) == 93 and sum(r["attention"] == "mla" for r in plan) == 24
    assert [r["layer"] for r in plan if r["opens_block"]] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert plan[0]["mlp"] == "dense" and all(r["mlp"] == "moe" for r in plan[1:])
    rows = {r["component"]: r for r in component_table(full)}
    assert sum(r["params"] for r in rows.values()) == full.param_counts()[0]
    assert rows["routed_experts"]["count"] == 92 * 896 and rows["routed_experts"]["format"] == "MXFP4"
    assert rows["routed_experts"]["bytes"] == rows["routed_experts"]["params"] * 4.25 / 8
    s = state_sizes(full)
    assert s["mla_per_position"] == 24 * 576 and s["kda_state_per_sequence_per_layer"] == 6 * 2**20
    assert s["kda_conv_per_sequence"] == 69 * 3 * 12288 * 3 * 2
    assert s["attn_res_per_token_in_flight"] == 9 * 7168 * 4
