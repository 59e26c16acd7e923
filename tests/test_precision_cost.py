"""What precision costs (k3lab.engine.precision_cost): the step chained over decode steps equals the
model's own decode; the 'bf16' row (a second run) is exactly the reference; FP8 moves the logits by a
nonzero, bounded amount; a precision the step refuses is a row that says so; bad arguments are refused.
CPU tests run the step in Triton's interpreter at a two-layer tiny model; the GPU test runs one step at
TP8 slice shapes (k3lab.engine.precision_cost.tp8_config)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.config import K3Config
from k3lab.engine import RankWeights, precision_cost as pc, switches
from k3lab.model import K3Model, init_weights

CPU_STEP = pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                              reason="a step on CPU tensors needs Triton's interpreter, which is off where "
                                     "there is a GPU")
# KDA + the dense MLP, then MLA + MoE: every kind of layer once
SMALL = dataclasses.replace(K3Config.tiny(), num_hidden_layers=2, attn_res_block_size=1, name="tiny2")


def _article_accepted() -> bool:
    try:
        switches.settings(None, precision="article")
    except ValueError:
        return False
    return True


@CPU_STEP
def test_the_chained_step_equals_the_models_own_decode():
    """Three greedy steps, each a DecodeStep of the grown context loading the last one's caches, against
    K3Model.decode fed the same tokens: fp32 on both sides, so equal to fp32's rounding."""
    model = init_weights(K3Model(SMALL), 4).eval()
    ids = torch.randint(0, SMALL.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, cache = model.prefill(ids[:, :4])
        weights = RankWeights.from_model(model, 1, 0)
        opt = set(pc.CPU_OPTIMIZATIONS)
        logits, toks, runs, routes = pc._decode(weights, cache, ids[:, 4:], 3, "bf16", opt, None)
        want, nxt, mc = [], ids[:, 4:], cache
        for _ in range(3):
            out, mc = model.decode(nxt, mc)
            want.append(out[:, -1].double())
            nxt = out[:, -1].argmax(-1, keepdim=True)
    want = torch.stack(want)
    assert logits.shape == (3, 2, SMALL.vocab_size) and runs.startswith("projections=")
    assert routes.shape == (3, 1, 2, SMALL.num_experts_per_token)  # one MoE layer, two sequences
    assert torch.equal(toks, want.argmax(-1))
    assert (logits - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@CPU_STEP
def test_rows_bf16_is_exact_fp8_is_bounded_article_says_what_it_is():
    rows = {r["precision"]: r for r in pc.greedy_cost(SMALL, steps=3, prompt_len=4, device="cpu")}
    assert list(rows) == list(switches.PRECISIONS)
    ref = rows["bf16"]
    assert ref["status"] == "ran" and ref["dtype"] == "float32"
    got = (ref["max_abs_logit"], ref["kl_mean"], ref["tokens_match"], ref["first_divergence"],
           ref["experts_changed"])
    assert got == (0.0, 0.0, 3, None, 0.0), ref
    f8 = rows["fp8"]
    assert f8["status"] == "ran" and f8["runs"].startswith("projections=fp8")
    # FP8 did run (the logits moved) and moved them by a fraction of their size (an O(1) error, a wrong
    # scale or operand, moves them by their own size); KL finite and positive
    assert 0 < f8["max_abs_logit"] <= 0.5 * f8["ref_abs_max"], f8
    assert 0 < f8["kl_mean"] < 1.0 and 0 <= f8["tokens_match"] <= 3
    art = rows["article"]
    if _article_accepted():
        assert art["status"] == "ran" and "fp8_cache" in art["runs"] and "mxfp4" in art["runs"], art
        assert 0 < art["max_abs_logit"] <= 0.5 * art["ref_abs_max"], art
    else:
        assert art["status"] == "not available" and "article" in art["note"] and art["steps"] == 0, art


@CPU_STEP
def test_one_step_at_a_slice_on_random_weights():
    """step_cost at a TP2 slice of the two-layer tiny model (the TP8 default is K3-wide: GPU test)."""
    got = pc.step_cost(SMALL.sliced(2), context_len=4, precisions=("bf16", "fp8"), device="cpu")
    rows = {r["precision"]: r for r in got}
    assert rows["bf16"]["max_abs_logit"] == 0.0 and rows["bf16"]["tokens_match"] == 1
    assert 0 < rows["fp8"]["max_abs_logit"] <= 0.5 * rows["fp8"]["ref_abs_max"], rows["fp8"]


@CPU_STEP
def test_each_precision_builds_its_step_once(monkeypatch):
    """step_cost builds the reference's step for the reference logits and each asked precision's step
    once (a refused one too: its build is the refusal); at K3's widths a build draws and converts a TP8
    slice of weights, the costly part of notebook 08's precision cell."""
    built = []
    real = pc.DecodeStep

    def counting(*args, precision="bf16", **kwargs):
        built.append(precision)
        return real(*args, precision=precision, **kwargs)

    monkeypatch.setattr(pc, "DecodeStep", counting)
    pc.step_cost(SMALL.sliced(2), context_len=4, precisions=("bf16", "fp8"), device="cpu")
    assert sorted(built) == ["bf16", "bf16", "fp8"]


def test_compare_counts_tokens_and_divergence():
    ref = torch.zeros(4, 1, 3)
    ref[:, 0, 0] = 1.0
    got = ref.clone()
    got[2, 0, 1] = 5.0  # step 2 chooses token 1 instead of 0
    c = pc.compare(got, ref, ref.argmax(-1))
    assert (c["tokens_match"], c["first_divergence"], c["max_abs_logit"]) == (3, 2, 5.0)
    assert c["kl_mean"] > 0 and pc.compare(ref, ref, ref.argmax(-1))["kl_mean"] == 0.0
    with pytest.raises(ValueError, match="must be"):
        pc.compare(got[:, :, :2], ref, ref.argmax(-1))
    routes = torch.tensor([[[[0, 1]]], [[[0, 2]]], [[[0, 1]]], [[[1, 3]]]])  # [S=4, layers=1, tokens=1, 2]
    flipped = pc.compare(got, ref, ref.argmax(-1), routes, routes[[0, 0, 0, 0]])["experts_changed"]
    assert flipped == 0.5 and pc.compare(got, ref, ref.argmax(-1), routes, routes)["experts_changed"] == 0


@pytest.mark.parametrize("kwargs,err,match", [
    ({"steps": 0}, ValueError, "steps must be an integer"),
    ({"steps": 2.0}, ValueError, "steps must be an integer"),
    ({"precisions": "fp8"}, TypeError, "precisions must be a tuple or list"),
    ({"precisions": ("int4",)}, ValueError, "precisions must be distinct names"),
    ({"precisions": ()}, ValueError, "precisions must be distinct names"),
    ({"config": K3Config.tiny().sliced(2)}, ValueError, "tp_size 1"),
    ({"device": "tpu:0"}, ValueError, "device must be"),
    ({"optimizations": {"nope"}}, ValueError, "unknown switches"),
    ({"batch": 0}, ValueError, "batch must be"),
])
def test_bad_arguments_are_refused_by_name(kwargs, err, match):
    with pytest.raises(err, match=match):
        pc.greedy_cost(**kwargs)


def test_bad_step_cost_arguments():
    with pytest.raises(ValueError, match="context_len must be"):
        pc.step_cost(context_len=0)
    with pytest.raises(ValueError, match="layers must be"):
        pc.tp8_config(1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (one step at K3's widths)")
def test_gpu_tp8_slice_step_at_each_precision():
    """Bound: the logits move by less than their own largest size. One router reads the FP8-perturbed
    stream and may flip an expert (O(1) for that layer, a fraction of the logits); a wrong scale or
    operand (448x, a transposed weight) moves them by more than their size."""
    rows = {r["precision"]: r for r in pc.step_cost()}
    assert rows["bf16"]["dtype"] == "bfloat16" and rows["bf16"]["max_abs_logit"] == 0.0
    for p in ("fp8", "article") if _article_accepted() else ("fp8",):
        assert 0 < rows[p]["max_abs_logit"] <= rows[p]["ref_abs_max"], rows[p]
    assert rows["article"]["status"] == ("ran" if _article_accepted() else "not available"), rows["article"]
