"""RMSNorm, gated RMSNorm and L2 normalisation against values worked out by hand."""

import math

import pytest
import torch

from k3lab.nn.norms import RMSNorm, gated_rms_norm, l2_normalize, rms_norm


def test_rms_norm_hand_values():
    x = torch.tensor([[3.0, 4.0]])
    w = torch.tensor([2.0, 0.5])
    # mean(x^2) = (9 + 16) / 2 = 12.5
    r = 1.0 / math.sqrt(12.5 + 1e-5)
    torch.testing.assert_close(rms_norm(x, w, 1e-5), torch.tensor([[3 * r * 2, 4 * r * 0.5]]))
    torch.testing.assert_close(rms_norm(x, None, 1e-5), torch.tensor([[3 * r, 4 * r]]))


def test_rms_norm_eps_is_inside_the_root():
    x = torch.tensor([1e-3, -1e-3], dtype=torch.float64)
    expected = x / math.sqrt(1e-6 + 0.5)
    torch.testing.assert_close(rms_norm(x, None, 0.5), expected)


def test_rms_norm_computes_in_fp32_and_casts_back():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=g) * 300).bfloat16()
    w = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == torch.bfloat16
    xf, wf = x.float(), w.float()
    ref = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * wf).bfloat16()
    assert torch.equal(got, ref)


def test_rms_norm_module_uses_its_weight_and_eps():
    m = RMSNorm(3, eps=0.25)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([1.0, 2.0, 3.0]))
    x = torch.tensor([1.0, 1.0, 1.0])
    r = 1 / math.sqrt(1 + 0.25)
    torch.testing.assert_close(m(x), torch.tensor([r, 2 * r, 3 * r]))


def test_gated_rms_norm_hand_values():
    x = torch.tensor([3.0, 4.0])
    gate = torch.tensor([0.0, 2.0])
    w = torch.tensor([1.0, 2.0])
    r = 1.0 / math.sqrt(12.5 + 1e-5)
    s2 = 1 / (1 + math.exp(-2.0))
    torch.testing.assert_close(gated_rms_norm(x, gate, w, 1e-5), torch.tensor([3 * r * 0.5, 4 * r * 2 * s2]))


def test_l2_normalize_hand_values():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.float64)
    got = l2_normalize(x)
    torch.testing.assert_close(got[0], torch.tensor([3, 4], dtype=torch.float64) / math.sqrt(25 + 1e-6))
    assert torch.equal(got[1], torch.zeros(2, dtype=torch.float64))  # eps keeps zero rows finite


def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(ValueError, match="x"):
        rms_norm(torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, None, 0.0)
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, torch.randn(2, 7), torch.ones(8))
    with pytest.raises(ValueError, match="dim"):
        RMSNorm(0)
