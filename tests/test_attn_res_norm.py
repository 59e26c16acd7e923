"""Fused AttnRes + RMSNorm (Triton, interpreter on CPU) and the plain sequence vs the nn reference."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
from k3lab.nn.attn_res import attn_res_mix
from k3lab.nn.norms import rms_norm
from k3lab.ops import attn_res_norm as op

pytest.importorskip("triton")


def _inputs(T, D, dtype, max_blocks=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(prefix=r(T, D).to(dtype), delta=r(T, D).to(dtype), blocks=r(max_blocks, T, D).to(dtype),
                res_norm_w=1 + 0.1 * r(D), res_proj_w=0.05 * r(D), next_norm_w=1 + 0.1 * r(D))


def _reference(x, n_blocks, eps=1e-5):
    """fp64: prefix + delta rounded to storage, mix with nn.attn_res, then nn's RMSNorm."""
    prefix = (x["prefix"].double() + x["delta"].double()).to(x["prefix"].dtype) if x["delta"] is not None \
        else x["prefix"]
    sources = torch.cat([x["blocks"][:n_blocks], prefix.unsqueeze(0)]).double()
    h = attn_res_mix(sources, x["res_norm_w"].double(), x["res_proj_w"].double(), eps)
    return rms_norm(h, x["next_norm_w"].double(), eps), prefix


@pytest.mark.parametrize("impl", ["before", "after"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_blocks,push", [(0, False), (1, False), (4, True), (8, False)])
def test_matches_reference_and_updates_state_exactly(impl, dtype, n_blocks, push):
    T, D = 3, 200  # D not a power of two: the masked tail is exercised
    x = _inputs(T, D, dtype, seed=n_blocks)
    ref_out, ref_prefix = _reference(x, n_blocks)
    prefix, blocks = x["prefix"].clone(), x["blocks"].clone()
    out = op.attn_res_norm(prefix, x["delta"], blocks, n_blocks, x["res_norm_w"], x["res_proj_w"],
                           x["next_norm_w"], push_block=push, impl=impl)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    # persistent updates are exact: the partial keeps the storage dtype's rounding
    if push:
        assert torch.equal(blocks[n_blocks], ref_prefix.to(dtype))
        assert torch.count_nonzero(prefix) == 0
    else:
        assert torch.equal(prefix, ref_prefix.to(dtype))
    untouched = [i for i in range(blocks.shape[0]) if not (push and i == n_blocks)]
    assert torch.equal(blocks[untouched], x["blocks"][untouched])


def test_fused_equals_unfused_bitwise_on_persistent_state_without_delta():
    x = _inputs(4, 96, torch.bfloat16, seed=7)
    pa, ba, pb, bb = x["prefix"].clone(), x["blocks"].clone(), x["prefix"].clone(), x["blocks"].clone()
    ya = op.after(pa, None, ba, 3, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"], push_block=True)
    yb = op.before(pb, None, bb, 3, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"], push_block=True)
    assert torch.equal(ba, bb) and torch.equal(pa, pb)
    torch.testing.assert_close(ya.float(), yb.float(), rtol=1e-2, atol=1e-2)


def test_a_wrong_mix_is_caught():
    """The check can fail: dropping one block from the mix changes the output beyond tolerance."""
    x = _inputs(2, 64, torch.float32, seed=3)
    ref_out, _ = _reference(x, 5)
    out = op.after(x["prefix"].clone(), x["delta"], x["blocks"].clone(), 4, x["res_norm_w"], x["res_proj_w"],
                   x["next_norm_w"])
    assert not torch.allclose(out.double(), ref_out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("bad,match", [
    (dict(delta=torch.zeros(3, 5)), "delta"),
    (dict(blocks=torch.zeros(9, 3, 64)), "blocks"),
    (dict(blocks=torch.zeros(9, 2, 64, dtype=torch.float64)), "blocks"),
    (dict(n_blocks=9, push_block=True), "n_blocks"),
    (dict(next_norm_w=torch.ones(63)), "next_norm_w"),
])
def test_bad_input_names_the_argument(bad, match):
    x = _inputs(2, 64, torch.float32)
    args = dict(prefix=x["prefix"], delta=x["delta"], blocks=x["blocks"], n_blocks=2,
                res_norm_w=x["res_norm_w"], res_proj_w=x["res_proj_w"], next_norm_w=x["next_norm_w"])
    args.update(bad)
    for impl in ("before", "after"):
        with pytest.raises(ValueError, match=match):
            op.attn_res_norm(**args, impl=impl)
    with pytest.raises(ValueError, match="impl"):
        op.attn_res_norm(**args, impl="fast")


@pytest.mark.parametrize("prefetch", [0, 1, 2])
@pytest.mark.parametrize("n_blocks", [1, 2, 3, 8])
def test_prefetch_and_warps_do_not_change_the_result(prefetch, n_blocks):
    x = _inputs(2, 130, torch.float32, seed=11)
    ref_out, ref_prefix = _reference(x, n_blocks)
    prefix, blocks = x["prefix"].clone(), x["blocks"].clone()
    out = op.after(prefix, x["delta"], blocks, n_blocks, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"],
                   prefetch=prefetch, num_warps=2)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(prefix, ref_prefix)
