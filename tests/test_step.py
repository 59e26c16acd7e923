"""The decode step (k3lab.engine) against K3Model: logits and every cache, with the same weights, for
every combination of the switches that applies on a CPU (Triton kernels in the interpreter in fp32, the
PyTorch forms elsewhere); a TP group of 2 in lockstep against the whole model; bad configurations.
On a GPU: a reduced-depth model at K3's true widths against 8 TP ranks run in lockstep."""

from __future__ import annotations

import dataclasses
import os
import itertools

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import SWITCHES, DecodeStep, RankWeights, run_group
from k3lab.model import K3Model, init_weights

# Two layers (KDA + the dense MLP, then MLA + MoE) with an AttnRes block per layer: every op once and
# a mix over several blocks, small enough to run all 64 combinations of the decode switches.
SMALL = dataclasses.replace(K3Config.tiny(), num_hidden_layers=2, attn_res_block_size=1, name="tiny2")
# Four layers (KDA x3, MLA; blocks at 0 and 2) for verification and the TP group.
FOUR = dataclasses.replace(K3Config.tiny(), num_hidden_layers=4, name="tiny4")
BATCH, CONTEXT = 2, 5
CPU_DECODE = [n for n in SWITCHES if n != "kda_verify_tiles"]


def _case(config, q_len, seed=3):
    """(model, prefilled cache, next ids [B, q_len], reference logits, reference cache)."""
    model = init_weights(K3Model(config), seed).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (BATCH, CONTEXT + q_len), generator=gen)
    with torch.no_grad():
        _, cache = model.prefill(ids[:, :CONTEXT])
        ref, ref_cache = model(ids[:, CONTEXT:], cache)
    return model, cache, ids[:, CONTEXT:], ref, ref_cache


# The CPU-device tests below: where there is a GPU, k3lab leaves Triton's interpreter off, so a step on
# CPU tensors cannot run its Triton kernels (DecodeStep says so; test_gpu_only_switch... checks it).
CPU_STEP = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                              reason="a step on CPU tensors needs Triton's interpreter, which is off where "
                                     "there is a GPU")


@pytest.fixture(scope="module")
def small():
    return _case(SMALL, 1)


@pytest.fixture(scope="module")
def four_verify():
    return _case(FOUR, 3)


def _mine(entry: torch.Tensor, ref: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's share of a reference cache entry (conv channels and state heads are divided)."""
    if entry.shape == ref.shape:
        return ref
    n = ref.shape[1] // world
    return ref[:, rank * n:(rank + 1) * n]


def _check_step(step: DecodeStep, logits, ref, ref_cache, world=1, rank=0) -> None:
    bench.check(logits, ref, dtype="fp32", name=f"logits ({step.resolved.label()})")
    entries = step.cache_entries()
    for name, want in ref_cache.entries().items():
        bench.check(entries[name], _mine(entries[name], want, world, rank), dtype="fp32", name=name)


def _run(model, cache, ids, **kw) -> tuple[DecodeStep, torch.Tensor]:
    with torch.no_grad():
        step = DecodeStep.from_model(model, BATCH, CONTEXT, **kw)
        step.load_cache(cache)
        return step, step(ids)


@CPU_STEP
@pytest.mark.parametrize("bits", list(itertools.product((True, False), repeat=len(CPU_DECODE))),
                         ids=lambda b: "".join("1" if x else "0" for x in b))
def test_decode_equals_model_every_switch_combination(small, bits):
    model, cache, ids, ref, ref_cache = small
    step, logits = _run(model, cache, ids, optimizations=dict(zip(CPU_DECODE, bits), kda_verify_tiles=False))
    _check_step(step, logits, ref, ref_cache)


@CPU_STEP
@pytest.mark.parametrize("tiles,mla", list(itertools.product((True, False), repeat=2)))
@pytest.mark.parametrize("rest", (True, False), ids=("rest_on", "rest_off"))
def test_verification_equals_model(four_verify, tiles, mla, rest):
    """q_len = 3: the switches whose op changes with q_len (verification tiles, MLA) in every
    combination, the others all on and all off."""
    model, cache, ids, ref, ref_cache = four_verify
    opts = dict.fromkeys(SWITCHES, rest) | {"kda_verify_tiles": tiles, "mla_padded": mla}
    step, logits = _run(model, cache, ids, optimizations=opts, q_len=3)
    assert step.impl["kda_fused"] == "n/a" and step.impl["kda_verify_tiles"] == (
        "after" if tiles else "before"
    )
    _check_step(step, logits, ref, ref_cache)


@CPU_STEP
@pytest.mark.parametrize("opt", ("all", "none"))
def test_tp2_group_in_lockstep_equals_model(opt):
    model, cache, ids, ref, ref_cache = _case(FOUR, 1, seed=5)
    with torch.no_grad():
        steps = [DecodeStep.from_model(model, BATCH, CONTEXT, tp=2, rank=r, optimizations=opt) for r
                 in range(2)]
        for s in steps:
            s.load_cache(cache)
        outs = run_group(steps, ids)
    for r, (s, logits) in enumerate(zip(steps, outs)):
        assert s.config.kda_num_heads == FOUR.kda_num_heads // 2
        _check_step(s, logits, ref, ref_cache, world=2, rank=r)


@CPU_STEP
def test_stand_in_collectives_are_counted_and_change_nothing_at_tp1(small):
    model, cache, ids, ref, _ = small
    step, logits = _run(model, cache, ids, optimizations="none")
    assert step.last_collectives == []  # tp 1: no collective at all
    with torch.no_grad():
        s2 = DecodeStep.from_model(model, BATCH, CONTEXT, tp=2, rank=0, optimizations="none")
        s2.load_cache(cache)
        s2(ids)
    kinds = [k for k, _ in s2.last_collectives]
    # embedding + per layer (attention + MLP: 1 dense, 2 MoE) + the logits' all-gather
    assert kinds.count("all_reduce") == 1 + 2 + 3 and kinds[-1] == "all_gather"


@CPU_STEP
def test_the_comparison_can_fail(small):
    """A step that skipped loading the model's cache does not match: the check is not vacuous."""
    model, _, ids, ref, _ = small
    with torch.no_grad():
        step = DecodeStep.from_model(model, BATCH, CONTEXT, optimizations="none")
        logits = step(ids)
    with pytest.raises(bench.CheckFailed):
        bench.check(logits, ref, dtype="fp32", name="logits")


@CPU_STEP
def test_random_weights_rotate_and_run():
    step = DecodeStep(FOUR, 1, 7, optimizations="all", weights="random", distinct_layers=2, device="cpu")
    kda = [step.weights.layers[i].attn for i, t in enumerate(FOUR.layer_types) if t == "kda"]
    assert kda[0] is kda[2] and kda[0] is not kda[1]  # two sets rotated through three KDA layers
    with torch.no_grad():
        logits = step(torch.tensor([[3]]))
    assert logits.shape == (1, 1, FOUR.vocab_size) and torch.isfinite(logits).all()
    d = step.describe()
    assert d["distinct_layers"] == 2 and d["weights"] == "random" and d["label"] == "all on"


def test_gpu_only_switch_on_cpu_says_what_runs_instead():
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="device='cpu' on a machine with a GPU"):
            DecodeStep(SMALL, 1, 4, optimizations="all", device="cpu")
        return
    step = DecodeStep(SMALL, 1, 4, optimizations="all", device="cpu")
    assert step.impl["kda_fused"] == "torch"  # the kda_decode row that runs: the PyTorch reference
    assert "PyTorch reference" in step.resolved.notes["kda_fused"]
    with pytest.raises(ValueError, match="kda_fused cannot run here"):
        DecodeStep(SMALL, 1, 4, optimizations={"kda_fused": True}, device="cpu", strict=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        step.capture()


@pytest.mark.parametrize("kwargs,match", [
    ({"tp": 3}, "not divisible by tp = 3"),
    ({"batch": 0}, "batch must be an integer"),
    ({"context_len": -1}, "context_len must be an integer"),
    ({"q_len": 9}, "q_len must be an integer in"),
    ({"optimizations": {"mla_pad": True}}, "unknown switch 'mla_pad'"),
    ({"optimizations": "fast"}, "optimizations must be"),
    ({"collectives": "nccl"}, "collectives must be one of"),
    ({"weights": "zeros"}, "weights must be 'random' or a RankWeights"),
    ({"distinct_layers": 0}, "distinct_layers must be an integer >= 1"),
])
@CPU_STEP
def test_bad_configuration(kwargs, match):
    args = {"batch": 1, "context_len": 4} | {k: kwargs.pop(k) for k in ("batch", "context_len") if k
                                             in kwargs}
    with pytest.raises(ValueError, match=match):
        DecodeStep(SMALL, args["batch"], args["context_len"], device="cpu", **kwargs)


@CPU_STEP
def test_bad_model_slice_and_tokens(small):
    model, cache, ids, _, _ = small
    with pytest.raises(ValueError, match="not divisible by tp = 3"):
        RankWeights.from_model(model, 3, 0)
    step = DecodeStep.from_model(model, BATCH, CONTEXT)
    with pytest.raises(ValueError, match="ids must lie in"):
        step(torch.full((BATCH, 1), SMALL.vocab_size))
    with pytest.raises(ValueError, match=r"ids must be integer token ids \[B=2, q_len=1\]"):
        step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="cache must hold context_len = 6 positions, got 5"):
        DecodeStep.from_model(model, BATCH, CONTEXT + 1).load_cache(cache)


# ------------------------------------------------------------------ GPU: K3's true widths, TP8
TP8_SLICE = dataclasses.replace(K3Config.full(), num_hidden_layers=4, num_experts=16, num_experts_per_token=4,
                                vocab_size=8192, attn_res_block_size=2, name="k3-4layers")


def _rel_l2(got: torch.Tensor, ref: torch.Tensor) -> float:
    d = got.double() - ref.double()
    return float(d.norm() / ref.double().norm().clamp_min(1e-30))


def tp8_model_after_prefill():
    """(K3Model at TP8_SLICE in bf16 on the GPU, 65 token ids, its cache after the first 64): the
    reduced-depth GPU tests' start."""
    torch.manual_seed(0)
    model = init_weights(K3Model(TP8_SLICE, device="cuda", dtype=torch.bfloat16), 7, on_device=True).eval()
    ids = torch.randint(0, TP8_SLICE.vocab_size, (1, 65), device="cuda")
    with torch.no_grad():
        _, cache = model.prefill(ids[:, :64])
    return model, ids, cache


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (K3's true widths, 8 ranks in lockstep)")
def test_gpu_tp8_slice_equals_model():
    """Four layers at K3's widths (KDA x3, MLA; 16 experts so that 8 ranks' weights fit one GPU) in
    bf16: the 8 ranks' steps, every switch off and then every switch on, run in lockstep with real sums
    against K3Model in bf16. The two round in different orders through 7168-wide layers (every switch
    off, plain torch ops, differs from K3Model by about 1% in logits on the H200), so the bound is
    two-sided: the unfused step within 2% of the model, and the optimized step no further from the model
    than the unfused one (x 1.25): the kernels add no error of their own. The whole-step bench cannot
    bound its 93-layer bf16 logits this way: a router near-tie flips an expert and the flips compound."""
    model, ids, cache = tp8_model_after_prefill()
    errs = {}
    with torch.no_grad():
        ref, ref_cache = model.decode(ids[:, 64:], cache)
        for opt in ("none", "all"):
            steps = [DecodeStep.from_model(model, 1, 64, tp=8, rank=r, optimizations=opt) for r in range(8)]
            for st in steps:
                st.load_cache(cache)
            outs = run_group(steps, ids[:, 64:])
            assert steps[0].impl["kda_fused"] == ("cuda" if opt == "all" else "triton"), steps[
                0
            ].resolved.notes
            for r, (st, logits) in enumerate(zip(steps, outs)):
                errs[opt, r, "logits"] = _rel_l2(logits, ref)
                entries = st.cache_entries()
                for name, want in ref_cache.entries().items():
                    errs[opt, r, name] = _rel_l2(entries[name], _mine(entries[name], want, 8, r))
            del steps, outs
    for (opt, r, name), e in errs.items():
        if opt == "none":
            assert e < 2e-2, (r, name, e)
        else:
            assert e <= max(1e-2, 1.25 * errs["none", r, name]), (r, name, e, errs["none", r, name])


@CPU_STEP
def test_glue_beyond_the_fused_routers_pairs_routes_in_pytorch_and_says_so(monkeypatch):
    from k3lab.ops import moe_router

    monkeypatch.setattr(moe_router, "MAX_PAIRS", 2)  # BATCH x top-2 = 4 pairs: past the bound
    w = RankWeights.random(SMALL, distinct_layers=1, device="cpu", dtype=torch.float32)
    ids = torch.tensor([[1], [4]])
    out = {}
    for glue in (True, False):
        step = DecodeStep(SMALL, BATCH, CONTEXT, optimizations={"glue_fused": glue}, weights=w)
        assert ("fused router's pairs" in step.resolved.notes.get("glue_fused", "")) == glue
        with torch.no_grad():
            step.set_tokens(ids)
            out[glue] = step.run().clone()
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-5)  # SiTU-GLU still fused
