"""The FP8 (E4M3) MLA latent cache (k3lab.ops.mla_decode.fp8_cache): the writer's codes, the decode
against fp64 attention over the dequantized cache (contiguous and paged, one token and verify groups,
split histories, folded heads), the same (o, lse) contract as the bf16 decode so the DCP merge is
unchanged, bad input refused by name before any kernel, and the article's bytes. Tensors follow the GPU
where there is one, else Triton's interpreter runs on the CPU (small shapes)."""

import math

import pytest
import torch

from k3lab.ops import mla_decode
from k3lab.ops.mla_decode import fp8_cache as fc
from k3lab.ops.mla_decode.merge import merge_partials

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cache(seed, B, L, kv_scale=0.05):
    """An FP8 cache of random latent rows (about N(0, 1), so 0.05 leaves them far from 448 x scale)
    and its scale."""
    rows = torch.randn(B, L, 576, generator=_gen(seed)).to(DEV)
    scale = torch.tensor([kv_scale], device=DEV)
    cache = torch.empty(B, L, 576, dtype=fc.FP8, device=DEV)
    fc.write_rows(cache, rows, scale, 0)
    return cache, scale


def _query(seed, B, Tq, H, dtype=torch.float32):
    return (torch.randn(B, Tq, H, 576, generator=_gen(seed)) * 0.5).to(dtype).to(DEV)


def _check(o, lse, ref_o, ref_lse, tol):
    assert o.shape == ref_o.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert (o.double().cpu() - ref_o).abs().max().item() <= tol * ref_o.abs().max().item()
    assert (lse.double().cpu() - ref_lse).abs().max().item() <= tol * 10


# ------------------------------------------------------------------------------------------ bytes


def test_bytes_show_the_article_figures():
    assert fc.bytes_per_position() == 576 and fc.bytes_per_position(torch.bfloat16) == 1152
    one_gpu = fc.cache_bytes(fc.ARTICLE_POSITIONS, fc.ARTICLE_LAYERS)
    dcp8 = fc.cache_bytes(fc.ARTICLE_POSITIONS, fc.ARTICLE_LAYERS, fc.ARTICLE_RANKS)
    assert one_gpu == 24 * (142_000 * 576 + 4)                 # codes plus one fp32 scale a layer
    assert round(one_gpu / 1e9, 2) == 1.96 and round(dcp8 / 1e6) == 245
    assert fc.cache_bytes(142_000, 24, dtype=torch.bfloat16) == 2 * 24 * 142_000 * 576
    assert fc.cache_bytes(9, 1, 8) == 2 * 576 + 4             # the busiest rank holds ceil(9 / 8)
    with pytest.raises(ValueError, match="ranks"):
        fc.cache_bytes(10, 1, 0)
    with pytest.raises(TypeError, match="dtype"):
        fc.bytes_per_position("fp8")


# ------------------------------------------------------------------------------------------ writer


def test_writer_codes_scale_and_saturation():
    rows = torch.randn(2, 3, 576, generator=_gen(1)).to(DEV) * 3
    rows[0, 0, 0] = 1e4                                       # saturates at 448 x scale
    scale = fc.scale_for(rows[:, :, 1:].abs().amax())
    assert scale.shape == (1,) and math.isclose(float(scale), float(rows[:, :, 1:].abs().amax()) / 448,
                                                rel_tol=1e-6)
    cache = torch.zeros(2, 8, 576, dtype=fc.FP8, device=DEV)
    fc.write_rows(cache, rows, scale, 4)
    want = (rows.float() / scale).clamp(-448, 448).to(fc.FP8)
    assert torch.equal(cache[:, 4:7].view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(cache[:, :4].view(torch.uint8), torch.zeros_like(cache[:, :4].view(torch.uint8)))
    back = fc.dequantize(cache, scale)[:, 4:7]
    assert back[0, 0, 0].item() == pytest.approx(448 * float(scale))
    rel = (back - rows.double()).abs()[..., 1:] / (rows.double().abs()[..., 1:] + float(scale))
    assert rel.max().item() <= 2 ** -4 + 1e-6                  # E4M3: 3 mantissa bits, nearest rounding
    assert torch.equal(fc.scale_for(0.0), torch.ones(1))
    assert math.isclose(float(fc.scale_for(448.0, headroom=2.0)), 2.0)


def test_writer_refuses_bad_input_by_name():
    cache = torch.zeros(1, 4, 576, dtype=fc.FP8, device=DEV)
    rows = torch.zeros(1, 2, 576, device=DEV)
    one = torch.ones(1, device=DEV)
    for args, exc, says in [
        ((cache.float(), rows, one, 0), ValueError, "cache must be"),
        ((cache, rows[..., :64], one, 0), ValueError, "rows must be"),
        ((cache, rows, one, 3), ValueError, "pos"),
        ((cache, rows, torch.zeros(1, device=DEV), 0), ValueError, "kv_scale must be positive"),
        ((cache, rows, torch.ones(2, device=DEV), 0), ValueError, "kv_scale must be an fp32 tensor"),
        ((cache, rows, 1.0, 0), TypeError, "kv_scale"),
        ((cache, rows.int(), one, 0), ValueError, "rows must be float32, float16, bfloat16 or float64"),
    ]:
        with pytest.raises(exc, match=says):
            fc.write_rows(*args)
    assert not cache.view(torch.uint8).any()                   # nothing written
    for bad, says in [(float("nan"), "amax"), (-1.0, "amax")]:
        with pytest.raises(ValueError, match=says):
            fc.scale_for(bad)
    with pytest.raises(ValueError, match="headroom"):
        fc.scale_for(1.0, headroom=0.5)


# ------------------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_fp64_attention_over_the_dequantized_cache(splits):
    cache, scale = _cache(2, B=2, L=70)
    q = _query(3, B=2, Tq=1, H=12)
    lengths = torch.tensor([70, 41], device=DEV)
    o, lse = fc.mla_decode_fp8(q, cache, scale, lengths, num_splits=splits)
    ref_o, ref_lse = fc.reference(q, cache, scale, lengths.tolist())
    _check(o, lse, ref_o, ref_lse, 2e-5)
    o2, lse2 = fc.mla_decode_fp8(q, cache, scale, lengths, num_splits=splits)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    # a kernel that forgot the scale would be far off: the check above can fail
    o_wrong, _ = fc.mla_decode_fp8(q, cache, scale * 2, lengths, num_splits=splits)
    assert (o_wrong.double().cpu() - ref_o).abs().max() > 0.1 * ref_o.abs().max()


def test_paged_verify_group_folded_heads_bf16():
    B, L, page = 2, 64, 16
    cache, scale = _cache(4, B=B, L=L, kv_scale=0.03)
    pool, table = mla_decode.to_paged(cache.view(torch.uint8), page_size=page)   # the codes, shuffled pages
    pool = pool.view(fc.FP8)
    q = _query(5, B=B, Tq=3, H=20, dtype=torch.bfloat16)
    lengths = torch.tensor([64, 37], device=DEV)
    plan = fc.plan_fp8(q, pool, scale, lengths, block_table=table, num_splits=2)
    o, lse = plan()
    assert plan.grid[:2] == (2, B) and plan.grid[2] >= 2 and o.dtype == torch.bfloat16   # >= 2 head groups
    ref_o, ref_lse = fc.reference(q, cache, scale, lengths.tolist())
    _check(o, lse, ref_o, ref_lse, 2e-2)                                   # bf16 query and p


def test_same_contract_as_the_bf16_decode_and_the_dcp_merge():
    """With a power-of-two scale the dequantized cache is exact in fp32, so the fp32 decode over it is
    the same computation: (o, lse) agree closely, and DCP shards of the FP8 cache merge (unchanged merge)
    into the whole-history result."""
    cache, scale = _cache(6, B=1, L=48, kv_scale=2.0 ** -4)
    q = _query(7, B=1, Tq=1, H=12)
    o, lse = fc.mla_decode_fp8(q, cache, scale, num_splits=2)
    o_bf, lse_bf = mla_decode.mla_decode_after(q, fc.dequantize(cache, scale, torch.float32), num_splits=2,
                                               backend="triton")
    assert torch.allclose(o, o_bf, atol=1e-5) and torch.allclose(lse, lse_bf, atol=1e-5)
    parts = [fc.mla_decode_fp8(q, cache[:, r::2].contiguous(), scale, num_splits=1) for r in range(2)]
    mo, mlse = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
                              backend="torch")
    assert torch.allclose(mo, o, atol=1e-5) and torch.allclose(mlse, lse, atol=1e-5)


def test_empty_pieces_merge_without_nan():
    cache, scale = _cache(8, B=2, L=40)
    q = _query(9, B=2, Tq=1, H=4)
    lengths = torch.tensor([40, 1], device=DEV)          # request 1: three of its four pieces are empty
    o, lse = fc.mla_decode_fp8(q, cache, scale, lengths, num_splits=4)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    ref_o, ref_lse = fc.reference(q, cache, scale, lengths.tolist())
    _check(o, lse, ref_o, ref_lse, 2e-5)


def test_decode_refuses_bad_input_by_name():
    cache, scale = _cache(10, B=1, L=8)
    q = _query(11, B=1, Tq=1, H=4)
    for args, kw, exc, says in [
        ((q, cache.float(), scale), {}, ValueError, "cache must be"),
        ((q[..., :512], cache, scale), {}, ValueError, "q's last dim"),
        ((q.double(), cache, scale), {}, ValueError, "q must be float32, float16 or bfloat16"),
        ((q, cache, scale, torch.tensor([9], device=DEV)), {}, ValueError, "lengths"),
        ((q, cache, -scale), {}, ValueError, "kv_scale"),
        ((q, cache, scale), {"scale": 0.0}, ValueError, "scale"),
        ((q, cache, scale), {"num_splits": 0}, ValueError, "num_splits"),
        ((q, cache, 0.05), {}, TypeError, "kv_scale"),
        ((q, cache[:, :, :64], scale), {}, ValueError, "cache must be"),
    ]:
        with pytest.raises(exc, match=says):
            fc.plan_fp8(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_one_launch_writer_writes_what_the_torch_writer_writes(dtype):
    """row_writer (one launch) against write_rows (PyTorch) on fresh random rows read through a strided
    view, some past 448 x scale (saturated): the same values, only the new positions written."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(11)
    B, L, T, pos = 2, 12, 3, 6
    base = torch.randn(B, T + 2, 576, generator=g) * 3
    rows = base.to(dev, dtype)[:, 1:T + 1]               # not contiguous over (B, T)
    for headroom in (0.5, 1.0, 1e-3):                      # 0.5: the largest rows saturate
        scale = fc.scale_for(rows.float().abs().amax().cpu() * headroom).to(dev)
        want = torch.randn(B, L, 576, generator=g).to(dev).to(fc.FP8)
        got = want.clone()
        fc.write_rows(want, rows, scale, pos)
        assert fc.row_writer(got, rows, scale, pos)() is got
        assert torch.equal(got.float(), want.float())
        if headroom == 0.5:
            assert (got.float().abs() == fc.FP8_MAX).any()
    planted = fc.row_writer(got, rows * 1.01, scale, pos)  # a 1% different row is not the same write
    planted()
    assert not torch.equal(got.float(), want.float())
    with pytest.raises(ValueError, match="pos"):
        fc.row_writer(got, rows, scale, L - T + 1)
    with pytest.raises(ValueError, match="rows"):
        fc.row_writer(got, rows[..., :512], scale, pos)
