"""Block Attention Residuals: the mix by hand, and the depth state's protocol."""

import math

import pytest
import torch

from k3lab.nn.attn_res import AttnResState, attn_res_mix


def test_mix_hand_values():
    v = torch.tensor([[1.0, 1.0], [3.0, -1.0]], dtype=torch.float64)  # two sources, D = 2
    nw = torch.tensor([1.0, 2.0], dtype=torch.float64)
    pw = torch.tensor([[0.5, 1.0]], dtype=torch.float64)
    eps = 1e-5
    keys0 = [1 / math.sqrt(1 + eps)] * 2                               # rms of (1, 1) is 1
    keys1 = [3 / math.sqrt(5 + eps), -1 / math.sqrt(5 + eps)]          # rms of (3, -1) is sqrt(5)
    l0 = keys0[0] * 1 * 0.5 + keys0[1] * 2 * 1.0
    l1 = keys1[0] * 1 * 0.5 + keys1[1] * 2 * 1.0
    p0 = math.exp(l0) / (math.exp(l0) + math.exp(l1))
    expected = torch.tensor([p0 * 1 + (1 - p0) * 3, p0 * 1 + (1 - p0) * -1], dtype=torch.float64)
    torch.testing.assert_close(attn_res_mix(v, nw, pw, eps), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attn_res_mix(v, nw, pw[0], eps), expected, rtol=1e-12, atol=1e-12)


def test_one_source_mixes_to_itself_and_order_does_not_matter():
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(4, 3, 5, 16, generator=gen, dtype=torch.float64)
    nw, pw = (
        torch.randn(16, generator=gen, dtype=torch.float64),
        torch.randn(16, generator=gen, dtype=torch.float64),
    )
    torch.testing.assert_close(attn_res_mix(v[:1], nw, pw), v[0], rtol=0, atol=1e-15)
    perm = torch.tensor([2, 0, 3, 1])
    torch.testing.assert_close(attn_res_mix(v[perm], nw, pw), attn_res_mix(v, nw, pw), rtol=1e-12, atol=1e-12)


def test_mix_is_fp32_for_bf16_sources():
    v = torch.randn(3, 2, 8).bfloat16()
    h = attn_res_mix(v, torch.ones(8).bfloat16(), torch.ones(8).bfloat16())
    assert h.dtype == torch.float32


def test_state_protocol():
    emb = torch.randn(1, 2, 4)
    s = AttnResState.start(emb)
    assert s.blocks == () and torch.equal(s.sources(), emb[None])
    s = s.push_block()
    assert (
        len(s.blocks) == 1 and torch.equal(s.blocks[0], emb) and torch.equal(s.partial, torch.zeros_like(emb))
    )
    a, m = torch.randn(1, 2, 4), torch.randn(1, 2, 4)
    s = s.add(a).add(m)
    torch.testing.assert_close(s.partial, a + m)
    assert s.sources().shape == (2, 1, 2, 4)


def test_bad_inputs():
    v = torch.randn(2, 8)
    with pytest.raises(ValueError, match="norm_weight"):
        attn_res_mix(v, torch.ones(7), torch.ones(8))
    with pytest.raises(ValueError, match="proj_weight"):
        attn_res_mix(v, torch.ones(8), torch.ones(2, 8))
    with pytest.raises(ValueError, match="sources"):
        attn_res_mix(torch.randn(8), torch.ones(8), torch.ones(8))
