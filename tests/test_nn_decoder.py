"""Decoder layers at K3's full dims (meta device: shapes and parameter counts, no memory), the
AttnRes protocol through a stack, and one layer of each kind on a GPU where there is one."""

import pytest
import torch

from k3lab.config import K3Config
from k3lab.model import K3Model, init_weights
from k3lab.nn.attn_res import attn_res_mix
from k3lab.nn.decoder import DecoderLayer

FULL = K3Config.full()

# docs/k3.md, TP = 1, [out, in]
KDA_SHAPES = {
    "q_proj.weight": (12288, 7168), "k_proj.weight": (12288, 7168), "v_proj.weight": (12288, 7168),
    "q_conv.weight": (12288, 1, 4), "k_conv.weight": (12288, 1, 4), "v_conv.weight": (12288, 1, 4),
    "f_a.weight": (128, 7168), "f_b.weight": (12288, 128), "dt_bias": (12288,), "A_log": (96,),
    "b_proj.weight": (96, 7168), "g_proj.weight": (12288, 7168), "o_norm.weight": (128,),
    "o_proj.weight": (7168, 12288),
}
MLA_SHAPES = {
    "q_a_proj.weight": (1536, 7168), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (18432, 1536),
    "kv_a_proj_with_mqa.weight": (576, 7168), "kv_a_layernorm.weight": (512,),
    "kv_b_proj.weight": (24576, 512), "g_proj.weight": (12288, 7168), "o_proj.weight": (7168, 12288),
}
MOE_SHAPES = {
    "gate.weight": (896, 7168), "gate.e_score_correction_bias": (896,),
    "routed_expert_down_proj.weight": (3584, 7168), "routed_expert_norm.weight": (3584,),
    "routed_expert_up_proj.weight": (7168, 3584),
    "experts.0.w1.weight": (3072, 3584), "experts.0.w3.weight": (3072, 3584),
    "experts.0.w2.weight": (3584, 3072),
    "experts.895.w2.weight": (3584, 3072),
    "shared_experts.gate_proj.weight": (6144, 7168), "shared_experts.up_proj.weight": (6144, 7168),
    "shared_experts.down_proj.weight": (7168, 6144),
}
DENSE_SHAPES = {"gate_proj.weight": (33792, 7168), "up_proj.weight": (33792, 7168),
                "down_proj.weight": (7168, 33792)}
LAYER_SHAPES = {
    "input_layernorm.weight": (7168,), "post_attention_layernorm.weight": (7168,),
    "self_attention_res_norm.weight": (7168,), "self_attention_res_proj.weight": (1, 7168),
    "mlp_res_norm.weight": (7168,), "mlp_res_proj.weight": (1, 7168),
}


def _numel(module):
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def full_layers():
    with torch.device("meta"):
        return {i: DecoderLayer(FULL, i, dtype=torch.bfloat16) for i in (0, 1, 3)}


def test_full_layer_kinds(full_layers):
    kinds = {i: (layer.layer_type, layer.is_moe, layer.starts_block) for i, layer in full_layers.items()}
    assert kinds == {0: ("kda", False, True), 1: ("kda", True, False), 3: ("mla", True, False)}


def test_full_dims_parameter_shapes(full_layers):
    checks = [(full_layers[0].self_attn, KDA_SHAPES), (full_layers[3].self_attn, MLA_SHAPES),
              (full_layers[1].mlp, MOE_SHAPES), (full_layers[0].mlp, DENSE_SHAPES),
              (full_layers[3], LAYER_SHAPES)]
    for module, shapes in checks:
        params = dict(module.named_parameters())
        for name, shape in shapes.items():
            assert tuple(params[name].shape) == shape, name
        assert all(p.is_meta for p in params.values())
    kda = dict(full_layers[0].self_attn.named_parameters())
    assert kda["A_log"].dtype == torch.float32 and kda["dt_bias"].dtype == torch.float32
    assert kda["q_proj.weight"].dtype == torch.bfloat16
    assert len(full_layers[1].mlp.experts) == 896


def test_full_dims_parameter_counts_match_the_config(full_layers):
    c = FULL.component_params()
    assert _numel(full_layers[0].self_attn) == c["kda"]
    assert _numel(full_layers[3].self_attn) == c["mla"]
    assert _numel(full_layers[0].mlp) == c["dense_mlp"]
    moe = full_layers[1].mlp
    assert _numel(moe) == c["moe_common"] + FULL.num_experts * c["expert"]
    assert _numel(moe.experts[0]) == c["expert"]


def test_full_dims_norm_counts_match_the_config(full_layers):
    layer = full_layers[3]
    own = _numel(layer) - _numel(layer.self_attn) - _numel(layer.mlp)
    assert own == 6 * 7168
    assert own == FULL.component_params()["layer_norms"]


def test_tp8_slice_layers_build_on_meta():
    cfg = K3Config.tp_slice(8)
    with torch.device("meta"):
        kda, mla = DecoderLayer(cfg, 1), DecoderLayer(cfg, 3)
    assert kda.self_attn.q_proj.weight.shape == (12 * 128, 7168)
    assert mla.self_attn.q_b_proj.weight.shape == (12 * 192, 1536)
    assert mla.mlp.experts[0].w1.weight.shape == (384, 3584)
    assert mla.mlp.shared_experts.gate_proj.weight.shape == (768, 7168)


@torch.no_grad()
def test_attn_res_protocol_through_the_tiny_stack():
    """Recover the block sums from the outputs each attention and MLP adds, captured by hooks."""
    cfg = K3Config.tiny()  # blocks open at layers 0, 2, 4
    model = init_weights(K3Model(cfg, dtype=torch.float64), 0)
    deltas = {}
    for i, layer in enumerate(model.layers):
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: deltas.__setitem__(("attn", i), out[0]))
        layer.mlp.register_forward_hook(lambda m, a, out, i=i: deltas.__setitem__(("mlp", i), out))
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    _, cache = model.prefill(ids)

    def layer_sum(*layers):
        return sum(deltas[("attn", i)] + deltas[("mlp", i)] for i in layers)[:, -1]
    blocks = cache.attn_res_blocks
    assert blocks.shape[0] == len(cfg.attn_res_block_starts()) == cfg.attn_res_max_sources - 1
    torch.testing.assert_close(blocks[0], model.embed_tokens(ids)[:, -1])
    torch.testing.assert_close(blocks[1], layer_sum(0, 1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(blocks[2], layer_sum(2, 3), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(cache.attn_res_partial, layer_sum(4, 5), rtol=1e-12, atol=1e-12)


@torch.no_grad()
def test_attn_res_sources_follow_the_protocol():
    """Replay docs/k3.md's protocol by hand from the captured layer outputs and check the input
    each attention and MLP received (AttnRes mix over the right sources, then the pre-norm)."""
    cfg = K3Config.tiny()
    model = init_weights(K3Model(cfg, dtype=torch.float64), 2)
    got, deltas = {}, {}
    for i, layer in enumerate(model.layers):
        layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: got.__setitem__(("attn", i), a[0]))
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: got.__setitem__(("mlp", i), a[0]))
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: deltas.__setitem__(("attn", i), out[0]))
        layer.mlp.register_forward_hook(lambda m, a, out, i=i: deltas.__setitem__(("mlp", i), out))
    ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    model.prefill(ids)
    blocks, prefix = [], model.embed_tokens(ids)
    for i, layer in enumerate(model.layers):
        srcs = torch.stack(blocks + [prefix])
        h = attn_res_mix(srcs, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight)
        if i % cfg.attn_res_block_size == 0:
            blocks, prefix = blocks + [prefix], torch.zeros_like(prefix)
        torch.testing.assert_close(got[("attn", i)], layer.input_layernorm(h), rtol=1e-12, atol=1e-12)
        prefix = prefix + deltas[("attn", i)]
        h = attn_res_mix(torch.stack(blocks + [prefix]), layer.mlp_res_norm.weight, layer.mlp_res_proj.weight)
        torch.testing.assert_close(got[("mlp", i)], layer.post_attention_layernorm(h), rtol=1e-12, atol=1e-12)
        prefix = prefix + deltas[("mlp", i)]


def test_layer_bad_inputs():
    cfg = K3Config.tiny()
    with pytest.raises(ValueError, match="layer_idx"):
        DecoderLayer(cfg, 6)
    layer = DecoderLayer(cfg, 0)
    with pytest.raises(ValueError, match="state"):
        layer(torch.randn(1, 2, cfg.hidden_size))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm GPU")
@torch.no_grad()
def test_one_layer_of_each_kind_on_gpu():
    """KDA + dense MLP and MLA attention at full dims in bf16; MLA + latent MoE at the TP8 slice
    (the whole 896-expert layer alone is 30B parameters). Weights are drawn on the CPU (deterministic),
    so this takes tens of seconds."""
    from k3lab.nn.attn_res import AttnResState
    from k3lab.nn.mla import MultiHeadLatentAttention
    mla = init_weights(MultiHeadLatentAttention(FULL, device="cuda", dtype=torch.bfloat16), 0)
    out, cache = mla(torch.randn(1, 4, 7168, device="cuda", dtype=torch.bfloat16))
    assert torch.isfinite(out).all() and cache.latent.shape == (1, 4, 576)
    for cfg, idx in ((FULL, 0), (K3Config.tp_slice(8), 3)):
        layer = init_weights(DecoderLayer(cfg, idx, device="cuda", dtype=torch.bfloat16), 0)
        state = AttnResState.start(torch.randn(1, 4, cfg.hidden_size, device="cuda", dtype=torch.bfloat16))
        state, _ = layer(state)
        assert torch.isfinite(state.partial).all()
