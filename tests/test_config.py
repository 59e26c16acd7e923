"""K3Config: the true K3 numbers and the sizes derived from them (docs/k3.md)."""

import dataclasses
import math

import pytest

from k3lab.config import K3Config, MiB


def test_layer_map_matches_k3():
    c = K3Config.full()
    types = c.layer_types
    assert len(types) == 93
    mla = [i for i, t in enumerate(types) if t == "mla"]
    assert mla == list(range(3, 92, 4)) + [92]
    assert c.num_mla_layers == 24 and c.num_kda_layers == 69
    assert c.num_moe_layers == 92 and not c.is_moe_layer(0) and c.is_moe_layer(1)


def test_param_counts_near_published():
    total, active = K3Config.full().param_counts()
    # docs/k3.md: about 2.78T total, 105B active (published 2.8T, 104B)
    assert 2.77e12 < total < 2.79e12
    assert 104e9 < active < 106.5e9


def test_state_and_cache_sizes():
    c = K3Config.full()
    assert c.mla_latent_bytes_per_position(1) == 576
    assert c.mla_latent_bytes_per_position(2) == 1152
    assert c.kda_state_bytes_per_sequence() == 6 * MiB
    assert c.kda_state_bytes_all_layers() == 414 * MiB
    assert c.kda_conv_state_values_per_sequence() == 3 * 12288 * 3
    # the seed's 142,000-token conversation: 1.96 GB per GPU under TP8, about 245 MB under DCP8
    assert round(c.conversation_bytes_per_gpu(142_000) / 1e9, 2) == 1.96
    assert round(c.conversation_bytes_per_gpu(142_000, dcp=8) / 1e6) == 245
    assert c.conversation_bytes_per_gpu(142_000, dcp=8) == 24 * math.ceil(142_000 / 8) * 576


def test_tp8_slice_is_the_seeds_layout():
    s = K3Config.tp_slice(8)
    assert (s.num_attention_heads, s.kda_num_heads, s.moe_intermediate_size) == (12, 12, 384)
    assert s.shared_intermediate_size == 768 and s.tp_size == 8
    assert s.hidden_size == 7168 and s.mla_latent_dim == 576  # the latent is replicated under TP
    assert s.kda_state_bytes_per_sequence() == 12 * 128 * 128 * 4
    assert K3Config.preset("tp8") == s


def test_tiny_keeps_kernel_dims_and_covers_both_kinds():
    t = K3Config.tiny()
    assert t.kda_head_dim == 128 and t.kv_lora_rank == 512 and t.qk_rope_head_dim == 64
    assert {"kda", "mla"} <= set(t.layer_types)
    assert len(t.attn_res_block_starts()) >= 2  # at least one block boundary after layer 0
    assert t.num_experts_per_token <= t.num_experts


def test_softmax_scale_and_widths():
    c = K3Config.full()
    assert c.mla_softmax_scale == pytest.approx(192 ** -0.5)
    assert c.kda_width == 12288 and c.shared_intermediate_size == 6144
    assert c.attn_res_max_sources == 9


@pytest.mark.parametrize("field,value,match", [
    ("num_experts_per_token", 1000, "num_experts_per_token"),
    ("hidden_size", 0, "hidden_size"),
    ("kda_gate_lower_bound", 1.0, "kda_gate_lower_bound"),
    ("first_k_dense_replace", 200, "first_k_dense_replace"),
    ("rms_norm_eps", 0.0, "rms_norm_eps"),
    ("kda_chunk_size", 7, "kda_chunk_size must be one of"),
    ("kda_chunk_size", 512, "kda_chunk_size must be one of"),
])
def test_impossible_configs_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(K3Config.full(), **{field: value})


def test_unshardable_tp_names_the_field():
    with pytest.raises(ValueError, match="num_attention_heads"):
        K3Config.tp_slice(7)
    with pytest.raises(ValueError, match="already a TP8 slice"):
        K3Config.tp_slice(8).sliced(2)
    with pytest.raises(ValueError, match="preset"):
        K3Config.preset("huge")
    with pytest.raises(ValueError, match="dcp"):
        K3Config.full().conversation_bytes_per_gpu(10, dcp=0)
