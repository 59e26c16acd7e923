"""MXFP4 weights (k3lab.ops.moe_experts.mxfp4): exact on representable values, nearest E2M1 code with ties
to even, power-of-two block scales, the packing layout, the bytes, the error bounds on fresh random weights,
and bad input refused by name."""

import pytest
import torch

from k3lab.ops.moe_experts import mxfp4


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_representable_values_round_trip_exactly():
    g = _gen(1)
    grid = torch.tensor(mxfp4.E2M1, dtype=torch.float64)
    codes = torch.randint(0, 8, (6, 64), generator=g)
    signs = torch.where(torch.rand(6, 64, generator=g) < 0.5, -1.0, 1.0).double()
    exps = torch.randint(-10, 10, (6, 2), generator=g).double()
    w = grid[codes] * signs * torch.pow(2.0, exps).repeat_interleave(32, dim=1)
    w[:, 0] = 6.0 * torch.pow(2.0, exps[:, 0])   # each block's amax at 6 x scale: the scale is 2^exp
    w[:, 32] = -4.0 * torch.pow(2.0, exps[:, 1])
    q = mxfp4.quantize(w)
    assert torch.equal(q.dequantize(torch.float64), w)
    assert torch.equal(q.scale_exp.long(), exps.long())


def test_nearest_code_ties_to_even_and_saturation():
    scale_row = torch.tensor([4.0] + [0.0] * 31)  # amax 4: scale 2^0
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.9, -0.25, -5.0])
    w = scale_row.clone()
    w[1:1 + len(vals)] = vals
    got = mxfp4.quantize(w[None]).dequantize(torch.float64)[0, 1:1 + len(vals)]
    # ties: 0.25 between 0 (code 0) and 0.5 (code 1) -> 0; 0.75 -> 1.0 (code 2); 1.25 -> 1.0; 1.75 -> 2.0;
    # 2.5 -> 2.0 (code 4); 3.5 -> 4.0 (code 6); 5.0 -> 4.0 (code 6, not 7); 0.3 -> 0.5; 2.9 -> 3.0
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, 0.0, -4.0], dtype=torch.float64)
    assert torch.equal(got, want)
    # amax 7.5 x 2^0 lands in [4, 8): scale 2^0, and 7.5 saturates to 6
    w2 = torch.zeros(1, 32)
    w2[0, 3] = 7.5
    assert mxfp4.quantize(w2).dequantize(torch.float64)[0, 3].item() == 6.0


def test_packing_layout_and_bytes():
    w = torch.zeros(2, 32)
    w[0, 0], w[0, 1], w[1, 30], w[1, 31] = 4.0, -1.0, 0.5, 6.0   # row 1's amax 6: scale 2^0
    q = mxfp4.quantize(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (2, 16) and q.scale_exp.shape == (2, 1)
    assert q.packed[0, 0].item() == (6 | ((8 | 2) << 4))     # 4.0 is code 6 (low), -1.0 is 8|2 (high)
    assert q.packed[1, 15].item() == (1 | (7 << 4))          # 0.5 is code 1, 6.0 is code 7
    assert q.nbytes == 2 * 16 + 2 and q.shape == (2, 32)
    assert mxfp4.quantize(torch.zeros(3, 64)).dequantize().abs().sum() == 0


def test_error_bounds_on_fresh_random_weights():
    g = _gen(7)
    w = torch.randn(64, 512, generator=g, dtype=torch.float64)
    w = w * torch.rand(64, 1, generator=g, dtype=torch.float64)   # rows of different sizes
    q = mxfp4.quantize(w)
    err = (q.dequantize(torch.float64) - w).view(64, 16, 32).abs()
    amax = w.view(64, 16, 32).abs().amax(-1, keepdim=True)
    assert (err <= amax / 4 + 1e-12).all()                  # saturation bound
    scale = torch.pow(2.0, q.scale_exp.double())[..., None]
    below = w.view(64, 16, 32).abs() <= 6 * scale
    assert (err[below] <= (scale.expand_as(err)[below]) + 1e-12).all()  # half of the largest step (2)
    rel = (q.dequantize(torch.float64) - w).norm() / w.norm()
    assert 0.05 < rel < 0.2, rel   # about 0.12 on N(0, 1) weights: coarser than fp8 (~0.03), far from garbage
    # a product over the dequantized weight is what a kernel must reproduce
    x = torch.randn(3, 512, generator=g, dtype=torch.float64)
    ref = x @ q.dequantize(torch.float64).T
    assert torch.allclose(x.float() @ q.dequantize(torch.float32).T, ref.float(), rtol=1e-4, atol=1e-4)


def _nearest_even(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 value nearest each scaled magnitude, ties to the even code, by brute force."""
    grid = torch.tensor(mxfp4.E2M1, dtype=torch.float64)
    d = (x.abs()[..., None] - grid).abs()
    best = d.argmin(-1)
    up = (best + 1).clamp(max=7)
    tie = (d.gather(-1, up[..., None])[..., 0] == d.gather(-1, best[..., None])[..., 0]) & (up != best)
    return torch.where(tie & (best % 2 == 1), up, best)


def test_slabs_change_nothing_and_codes_match_a_brute_force_nearest(monkeypatch):
    g = _gen(11)
    w = torch.randn(3, 5, 96, generator=g, dtype=torch.float64)
    w = w * torch.rand(3, 5, 1, generator=g, dtype=torch.float64)
    w[0, 0, :8] = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)  # ties
    whole = mxfp4.quantize(w)
    for slab in (64, 200, 96 * 7):      # a slab shorter than a row (one row a slab), uneven tails
        monkeypatch.setattr(mxfp4, "_SLAB_VALUES", slab)
        part = mxfp4.quantize(w)
        assert torch.equal(part.packed, whole.packed) and torch.equal(part.scale_exp, whole.scale_exp)
    scale = torch.pow(2.0, whole.scale_exp.double()).repeat_interleave(32, dim=-1)
    x = (w / scale).clamp(-6, 6)
    assert torch.equal(whole.codes().long() & 7, _nearest_even(x))


@pytest.mark.parametrize("bad, says", [
    (torch.zeros(4, 30), "multiple of the block"),
    (torch.zeros(32), "2-D"),
    (torch.zeros(2, 32, dtype=torch.int32), "floating"),
    (torch.tensor([[float("nan")] * 32]), "finite"),
    (torch.tensor([[float("inf")] + [0.0] * 31]), "finite"),
])
def test_bad_weight_refused_by_name(bad, says):
    with pytest.raises(ValueError, match=says) as e:
        mxfp4.quantize(bad)
    assert "weight" in str(e.value)
    with pytest.raises(TypeError, match="weight"):
        mxfp4.quantize([[1.0] * 32])
    with pytest.raises(ValueError, match="dtype"):
        mxfp4.quantize(torch.ones(1, 32)).dequantize(torch.int8)


def test_a_stack_of_experts_quantizes_row_by_row():
    g = _gen(3)
    w = torch.randn(3, 5, 64, generator=g)
    q = mxfp4.quantize(w)
    assert q.packed.shape == (3, 5, 32) and q.scale_exp.shape == (3, 5, 2) and q.shape == (3, 5, 64)
    flat = mxfp4.quantize(w.reshape(15, 64))
    assert torch.equal(q.packed.reshape(15, 32), flat.packed)
    assert torch.equal(q.scale_exp.reshape(15, 2), flat.scale_exp)
    assert torch.equal(q.dequantize(torch.float64).reshape(15, 64), flat.dequantize(torch.float64))
    assert q.nbytes == mxfp4.nbytes(3, 5, 64) == 3 * 5 * (32 + 2)
    with pytest.raises(ValueError, match="2-D .* or 3-D"):
        mxfp4.quantize(torch.zeros(2, 2, 2, 32))


def test_bytes_are_four_and_a_quarter_bits_a_weight():
    assert mxfp4.bytes_per_weight() * 8 == 4.25
    # K3's routed expert w1 at full width [3072, 3584]: 3072 * 3584 * 4.25 / 8 bytes exactly
    assert mxfp4.nbytes(3072, 3584) * 8 == 3072 * 3584 * 4.25
    assert mxfp4.nbytes(896, 3072, 3584) == 896 * mxfp4.nbytes(3072, 3584)
    for bad in ((3072, 100), (), (-1, 32), (2.0, 32)):
        with pytest.raises(ValueError, match="shape"):
            mxfp4.nbytes(*bad)
