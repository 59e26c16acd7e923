"""SiTU-GLU against the formula evaluated by hand with math."""

import math

import pytest
import torch

from k3lab.nn.situ import situ_gate, situ_glu, situ_up


def _situ_scalar(g, u):
    a = 4 * math.tanh(g / 4) / (1 + math.exp(-g))
    return a * 25 * math.tanh(u / 25)


def test_situ_glu_hand_values():
    pts = [(-3.0, 2.0), (0.0, 5.0), (1.5, -40.0), (8.0, 100.0), (0.3, 0.7)]
    g = torch.tensor([p[0] for p in pts], dtype=torch.float64)
    u = torch.tensor([p[1] for p in pts], dtype=torch.float64)
    expected = torch.tensor([_situ_scalar(*p) for p in pts], dtype=torch.float64)
    torch.testing.assert_close(situ_glu(g, u), expected, rtol=1e-12, atol=1e-12)


def test_situ_bounds():
    big = torch.tensor([1e4], dtype=torch.float64)
    torch.testing.assert_close(situ_gate(big), torch.tensor([4.0], dtype=torch.float64))
    torch.testing.assert_close(situ_up(big), torch.tensor([25.0], dtype=torch.float64))
    torch.testing.assert_close(situ_up(-big), torch.tensor([-25.0], dtype=torch.float64))
    # near zero the gate is SiLU-like: 4 tanh(g/4) ~ g, so a ~ g * sigmoid(g)
    small = torch.tensor([1e-3], dtype=torch.float64)
    torch.testing.assert_close(situ_gate(small), small * torch.sigmoid(small), rtol=1e-6, atol=0)


def test_situ_glu_computes_in_fp32():
    gen = torch.Generator().manual_seed(1)
    g = (torch.randn(256, generator=gen) * 5).bfloat16()
    u = (torch.randn(256, generator=gen) * 30).bfloat16()
    got = situ_glu(g, u)
    assert got.dtype == torch.bfloat16
    ref = (4 * torch.tanh(g.float() / 4) * torch.sigmoid(g.float()) * 25
           * torch.tanh(u.float() / 25)).bfloat16()
    assert torch.equal(got, ref)


def test_situ_bad_inputs():
    with pytest.raises(ValueError, match="u"):
        situ_glu(torch.randn(3), torch.randn(4))
    with pytest.raises(ValueError, match="g"):
        situ_glu(torch.arange(3), torch.randn(3))
    with pytest.raises(ValueError, match="g must be a floating-point tensor"):
        situ_gate(torch.arange(3))
    with pytest.raises(ValueError, match="u must be a floating-point tensor"):
        situ_up([1.0, 2.0])
