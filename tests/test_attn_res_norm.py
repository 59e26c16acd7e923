"""Fused AttnRes + RMSNorm (Triton, interpreter on CPU) and the plain sequence vs the nn reference."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
from k3lab.nn.attn_res import attn_res_mix
from k3lab.nn.norms import rms_norm
from k3lab.ops import attn_res_norm as op

pytest.importorskip("triton")

UNITS = 132


def _config(name, n_blocks):
    """The three Triton launch configurations launch_config picks on a 132-unit device: 'tile' (a few
    tokens: every block in one tile), 'pipe' (many tokens, 2+ blocks), 'walk' (many tokens, 0-1 block)."""
    tokens = {"tile": 1, "pipe": 8192, "walk": 8192}[name]
    return op.launch_config(tokens, n_blocks if name != "walk" else min(n_blocks, 1), compute_units=UNITS)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton launches need GPU tensors on a GPU machine


def _inputs(T, D, dtype, max_blocks=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    x = dict(prefix=r(T, D).to(dtype), delta=r(T, D).to(dtype), blocks=r(max_blocks, T, D).to(dtype),
             res_norm_w=1 + 0.1 * r(D), res_proj_w=0.05 * r(D), next_norm_w=1 + 0.1 * r(D))
    return {k: v.to(DEVICE) for k, v in x.items()}


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a race between warps of one program needs a GPU")
@pytest.mark.parametrize("with_delta", [False, True])
def test_the_in_place_update_never_races_the_read(with_delta):
    """At 4 tokens x 96 columns a row is narrower than the program's 8 warps, so several warps hold
    each element of the partial; the partial is overwritten in place (zeros at a block boundary, the
    new sum otherwise). Without a barrier between the read and that store, a warp that loads late
    reads the stored value: on the H200 one token's output was wrong in 44 of 300 launches. Many
    launches on fresh inputs, each against the unfused sequence."""
    wrong = []
    for seed in range(200):
        x = _inputs(4, 96, torch.bfloat16, seed=1000 + seed)
        delta = x["delta"] if with_delta else None
        pa, ba, pb, bb = x["prefix"].clone(), x["blocks"].clone(), x["prefix"].clone(), x["blocks"].clone()
        ya = op.after(pa, delta, ba, 3, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"], push_block=True)
        yb = op.before(pb, delta, bb, 3, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"], push_block=True)
        if not (torch.equal(ba, bb) and torch.equal(pa, pb)
                and torch.allclose(ya.float(), yb.float(), rtol=1e-2, atol=1e-2)):
            wrong.append(seed)
    assert not wrong, f"{len(wrong)} of 200 launches differ from the unfused sequence (seeds {wrong[:5]})"


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


def _case(sources):
    """Deterministic coverage from the source count: T, dtype, push_block and delta vary together."""
    return dict(T=1 if sources % 2 else 3, dtype=torch.bfloat16 if sources in (2, 5, 6, 9) else torch.float32,
                push=sources % 3 == 1, with_delta=sources % 4 != 2)


@pytest.mark.parametrize("variant", ["tile", "pipe", "walk"])
@pytest.mark.parametrize("sources", range(1, 10))
def test_every_launch_config_matches_reference_and_before(variant, sources):
    c = _case(sources)
    n_blocks, dtype = sources - 1, c["dtype"]
    x = _inputs(c["T"], 130, dtype, seed=sources)  # 130: the masked tail of a 256-wide row
    if not c["with_delta"]:
        x["delta"] = None
    ref_out, ref_prefix = _reference(x, n_blocks)
    args = (n_blocks, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"])
    pa, ba, pb, bb = x["prefix"].clone(), x["blocks"].clone(), x["prefix"].clone(), x["blocks"].clone()
    ya = op.after(pa, x["delta"], ba, *args, push_block=c["push"], config=_config(variant, n_blocks))
    yb = op.before(pb, x["delta"], bb, *args, push_block=c["push"])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ya.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(ya.float(), yb.float(), rtol=tol, atol=tol)
    # the persistent state: bit-exact, and equal to what the unfused sequence leaves
    assert torch.equal(pa, pb) and torch.equal(ba, bb)
    if c["push"]:
        assert torch.equal(ba[n_blocks], ref_prefix.to(dtype)) and torch.count_nonzero(pa) == 0
    else:
        assert torch.equal(pa, ref_prefix.to(dtype))


@pytest.mark.parametrize("variant", ["tile", "walk", "pipe"])
def test_launch_configs_at_64_tokens(variant):
    x = _inputs(64, 96, torch.bfloat16, seed=64)
    ref_out, ref_prefix = _reference(x, 8)
    prefix, blocks = x["prefix"].clone(), x["blocks"].clone()
    out = op.after(prefix, x["delta"], blocks, 8, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"],
                   config=_config(variant, 8))
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-2, atol=1e-2)
    assert torch.equal(prefix, ref_prefix) and torch.equal(blocks, x["blocks"])


@pytest.mark.parametrize("n_blocks,group", [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8)])
def test_launch_config_tiles_small_batches_and_pipelines_large_ones(n_blocks, group):
    units = 132
    for tokens in (1, 64, units):  # one token per unit at most: every block in one tile, one round trip
        cfg = op.launch_config(tokens, n_blocks, compute_units=units)
        assert cfg["group"] == group and cfg["stages"] == 0 and cfg["prefetch"] == 1
    for tokens in (units + 1, 8192):  # many tokens per unit: one block at a time, loads kept in flight
        cfg = op.launch_config(tokens, n_blocks, compute_units=units)
        assert cfg["group"] == 1
        if n_blocks >= 2:  # a loop of 2+ steps to software-pipeline
            assert cfg["stages"] == 3 and cfg["prefetch"] == 0
        else:
            assert cfg["stages"] == 0 and cfg["prefetch"] == 1
    # the three configurations the H200 sweep chose (docs/copy_removal.md)
    h200 = dict(compute_units=units, wave_width=32)
    assert op.launch_config(1, 8, **h200) == {"kernel": "triton", "group": 8, "num_warps": 8, "prefetch": 1,
                                              "w_reload": 0, "stages": 0}
    assert op.launch_config(8192, 8, **h200) == {"kernel": "triton", "group": 1, "num_warps": 8,
                                                 "prefetch": 0,
                                                 "w_reload": 0, "stages": 3}
    assert op.launch_config(8192, 1, **h200) == {"kernel": "triton", "group": 1, "num_warps": 4,
                                                 "prefetch": 1,
                                                 "w_reload": 0, "stages": 0}


def test_launch_config_tile_takes_16_waves_on_wave64():
    """On AMD (64 lanes per wave) the one-step tile runs on 16 waves (8 spill 14 VGPRs, k3lab.isa); the
    other two configurations are the H200's."""
    amd, h200 = dict(compute_units=256, wave_width=64), dict(compute_units=256, wave_width=32)
    for tokens in (1, 64):
        assert op.launch_config(tokens, 8, **amd) == op.launch_config(tokens, 8, **h200) | {"num_warps": 16}
    for tokens, n_blocks in ((8192, 8), (8192, 1)):
        assert op.launch_config(tokens, n_blocks, **amd) == op.launch_config(tokens, n_blocks, **h200)


@pytest.mark.parametrize("tokens,n_blocks,expect", [(1, 8, "cuda_cluster"), (18, 4, "cuda_cluster"),
                                                    (19, 8, "triton"), (1, 3, "triton"), (1, 1, "triton")])
def test_launch_config_takes_the_cluster_kernel_for_few_tokens_and_many_sources(tokens, n_blocks, expect):
    """7 blocks per row (hidden 7168) on 132 units: up to 18 tokens, each block gets an SM; 5+ sources."""
    assert op.launch_config(tokens, n_blocks, compute_units=132, cluster_pieces=7)["kernel"] == expect
    assert op.launch_config(tokens, n_blocks, compute_units=132, cluster_pieces=0)["kernel"] == "triton"


def test_without_a_cluster_gpu_after_says_why_and_runs_triton():
    x = _inputs(1, 64, torch.float32, seed=3)
    pieces, why = op.kernel_status(x["prefix"])
    if x["prefix"].device.type == "cpu":
        assert pieces == 0 and "CUDA GPU" in why
    ref_out, ref_prefix = _reference(x, 8)
    prefix, blocks = x["prefix"].clone(), x["blocks"].clone()
    out = op.after(prefix, x["delta"], blocks, 8, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"])
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="backend must be one of"):
        op.after(prefix, x["delta"], blocks, 8, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"],
                 backend="hip")


def test_the_dispatched_launch_is_the_one_launch_config_names(monkeypatch):
    """after() without overrides runs launch_config's choice (a config it cannot run would raise): the
    chooser asks it whether the cluster kernel goes first, the Triton launch takes its config."""
    seen = []
    real = op.launch_config
    monkeypatch.setattr(op, "launch_config", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    x = _inputs(2, 64, torch.float32, seed=5)
    ref_out, _ = _reference(x, 3)
    out = op.after(x["prefix"].clone(), x["delta"], x["blocks"].clone(), 3, x["res_norm_w"], x["res_proj_w"],
                   x["next_norm_w"])
    assert seen and all(c == seen[-1] for c in seen) and seen[-1]["kernel"] == "triton"
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)


def test_bad_kernel_and_config_name_the_argument(monkeypatch):
    x = _inputs(2, 64, torch.float32)
    args = (x["prefix"], x["delta"], x["blocks"], 2, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"])
    with pytest.raises(ValueError, match="config"):
        op.after(*args, config={"kernel": "cuda_cluster"})
    monkeypatch.setenv(op.BACKEND_ENV, "hip")
    with pytest.raises(ValueError, match=op.BACKEND_ENV):
        op.after(*args)
    monkeypatch.setenv(op.BACKEND_ENV, "triton")
    ref_out, _ = _reference(x, 2)
    torch.testing.assert_close(op.after(*args).double(), ref_out, rtol=1e-5, atol=1e-5)
    assert op.BACKENDS.names == ("cuda_cluster", "triton", "torch")
    monkeypatch.setenv(op.BACKEND_ENV, "torch")  # the reference row: the unfused sequence behind after's face
    x = _inputs(2, 64, torch.float32)
    args = (x["prefix"], x["delta"], x["blocks"], 2, x["res_norm_w"], x["res_proj_w"], x["next_norm_w"])
    torch.testing.assert_close(op.after(*args).double(), ref_out, rtol=1e-5, atol=1e-5)
