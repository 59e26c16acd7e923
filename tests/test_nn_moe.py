"""Router, latent MoE and the dense SiTU-GLU MLP."""

import pytest
import torch

from k3lab.config import K3Config
from k3lab.model import init_weights
from k3lab.nn.moe import DenseMLP, LatentMoE, MoEGate, route
from k3lab.nn.situ import situ_glu


def test_route_hand_example_bias_moves_the_choice_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    s = torch.sigmoid(logits[0])
    w, idx, _ = route(logits, torch.zeros(4, dtype=torch.float64), top_k=2)
    assert sorted(idx[0].tolist()) == [0, 1]
    torch.testing.assert_close(w[0], s[idx[0]] / s[idx[0]].sum())
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)  # expert 3 now wins selection
    w, idx, _ = route(logits, bias, top_k=2)
    assert sorted(idx[0].tolist()) == [0, 3]
    # the weights come from the *unbiased* scores, renormalised over the chosen two
    torch.testing.assert_close(w[0], s[idx[0]] / (s[idx[0]].sum() + 1e-20))
    assert not torch.allclose(w[0], (s + bias)[idx[0]] / (s + bias)[idx[0]].sum())


def test_route_weights_sum_to_one_and_scale():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 16, generator=gen)
    bias = torch.randn(16, generator=gen)
    w, idx, _ = route(logits, bias, top_k=4)
    torch.testing.assert_close(w.sum(-1), torch.ones(50))
    assert w.dtype == torch.float32 and idx.shape == (50, 4)
    w2, idx2, _ = route(logits, bias, top_k=4, scaling=2.5)
    assert torch.equal(idx, idx2)
    torch.testing.assert_close(w2, 2.5 * w)
    w3, _, _ = route(logits, bias, top_k=4, renormalize=False)
    torch.testing.assert_close(w3, torch.sigmoid(logits).gather(-1, idx))


def test_gate_computes_logits_in_fp32():
    gate = MoEGate(8, 4, top_k=2, dtype=torch.bfloat16)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(4, 8))
    x = torch.randn(3, 8).bfloat16()
    _, _, scores = gate(x)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.sigmoid(x.float() @ gate.weight.float().T))


def dense_moe_reference(moe, x):
    """Every expert on every token, weighted by a dense [N, E] matrix (0 for unchosen experts)."""
    xf = x.reshape(-1, x.shape[-1])
    s = torch.sigmoid(xf @ moe.gate.weight.T)
    idx = (s + moe.gate.e_score_correction_bias).topk(moe.gate.top_k, -1).indices
    dense = torch.zeros_like(s).scatter(-1, idx, s.gather(-1, idx))
    dense = dense / dense.sum(-1, keepdim=True)
    z = xf @ moe.routed_expert_down_proj.weight.T
    every = torch.stack([situ_glu(z @ e.w1.weight.T, z @ e.w3.weight.T) @ e.w2.weight.T for e in moe.experts],
                        1)
    y = (dense.unsqueeze(-1) * every).sum(1)
    y = y / torch.sqrt((y * y).mean(-1, keepdim=True)
                       + moe.routed_expert_norm.eps) * moe.routed_expert_norm.weight
    sh = moe.shared_experts
    shared = situ_glu(xf @ sh.gate_proj.weight.T, xf @ sh.up_proj.weight.T) @ sh.down_proj.weight.T
    return (y @ moe.routed_expert_up_proj.weight.T + shared).view(x.shape)


@torch.no_grad()
def test_latent_moe_equals_dense_formulation():
    cfg = K3Config.tiny()
    moe = init_weights(LatentMoE(cfg, dtype=torch.float64), 3)
    assert moe.shared_experts.gate_proj.weight.shape == (cfg.shared_intermediate_size, cfg.hidden_size)
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(moe(x), dense_moe_reference(moe, x), rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_dense_mlp_formula():
    cfg = K3Config.tiny()
    mlp = init_weights(DenseMLP(cfg, dtype=torch.float64), 4)
    x = torch.randn(1, 3, cfg.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref = situ_glu(x @ mlp.gate_proj.weight.T, x @ mlp.up_proj.weight.T) @ mlp.down_proj.weight.T
    torch.testing.assert_close(mlp(x), ref, rtol=1e-12, atol=1e-12)
    assert mlp.gate_proj.weight.shape == (cfg.intermediate_size, cfg.hidden_size)


def test_bad_inputs():
    with pytest.raises(ValueError, match="bias"):
        route(torch.randn(2, 4), torch.zeros(3), 2)
    with pytest.raises(ValueError, match="top_k"):
        route(torch.randn(2, 4), None, 5)
    with pytest.raises(ValueError, match="logits"):
        route(torch.randn(4), None, 1)
    cfg = K3Config.tiny()
    moe = LatentMoE(cfg)
    with pytest.raises(ValueError, match="x must be"):
        moe(torch.randn(2, cfg.hidden_size))
    with pytest.raises(ValueError, match="x must have the layer's weight dtype"):
        DenseMLP(cfg)(torch.randn(1, 2, cfg.hidden_size, dtype=torch.float64))
