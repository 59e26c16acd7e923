"""The AttnRes mix folded into the one-row GEMV (k3lab.ops.attn_res_norm.gemv_fold, switches' mix_fold):
the one launch against the plain PyTorch sequence in fp64 (the mixed row, the products, the state updated
in place), its argument checks, and the decode step with the fold on against its reference. CPU tests
run the kernel in Triton's interpreter (conftest); on a GPU the same tests run it compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import SWITCHES, DecodeStep, RankWeights, resolve
from k3lab.model import K3Model, init_weights
from k3lab.ops import attn_res_norm as arn
from k3lab.ops.attn_res_norm import gemv_fold
from k3lab.ops.gemv import FP8
from k3lab.studies.decode_step.measure import CPU_CONFIG

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _inputs(D, n_blocks, rows, dtype, seed, delta=True, push=False, fp8_part=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    prefix = r(1, D).to(dtype).to(DEV)
    blocks = r(n_blocks + 1 + int(push), 1, D).to(dtype).to(DEV)
    weights = [r(D).to(DEV), r(D).to(DEV), (1 + 0.1 * r(D)).to(DEV)]  # res_norm_w, res_proj_w, next_norm_w
    parts = [((r(n, D) / D ** 0.5).to(dtype).to(DEV), None) for n in rows]
    if fp8_part:
        parts.append(((r(7, D) * 4).to(FP8).to(DEV), (0.01 + torch.rand(7, generator=g)).to(DEV)))
    return prefix, (r(1, D).to(dtype).to(DEV) if delta else None), blocks, weights, parts


def _fp64_reference(prefix, delta, blocks, n_blocks, weights, parts, push):
    """The mix and the products in fp64 on copies of the inputs: (x, ys, prefix, blocks) after."""
    p64, b64 = prefix.double().clone(), blocks.double().clone()
    if delta is not None:  # the partial keeps its storage rounding, as the step's residual does
        p64 = (prefix.float() + delta.float()).to(prefix.dtype).double()
    x = arn.before(p64, None, b64, n_blocks, *(w.double() for w in weights), eps=EPS, push_block=push)
    ys = [x @ (w.double() * (1 if sc is None else sc.double()[:, None])).t() for w, sc in parts]
    return x, ys, p64, b64


def _close(a, b, dtype, what):
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    err = ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
    assert err < tol, f"{what}: relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_blocks,delta,push", [(3, True, False), (2, True, True), (0, False, False),
                                                 (1, False, True), (5, True, False)])
def test_fold_equals_the_mix_then_the_products_in_fp64(dtype, n_blocks, delta, push):
    D = 300  # not a power of two: masked columns in the last chunk of every pass
    prefix, dx, blocks, weights, parts = _inputs(D, n_blocks, (70, 5), dtype, seed=17 * n_blocks + push,
                                                 delta=delta, push=push, fp8_part=dtype == torch.bfloat16)
    x_ref, ys_ref, p_ref, b_ref = _fp64_reference(prefix, dx, blocks, n_blocks, weights, parts, push)
    x, ys = arn.mix_gemv(prefix, dx, blocks, n_blocks, *weights, parts, eps=EPS, push_block=push,
                         backend="triton")
    assert x.shape == (1, D) and [y.shape for y in ys] == [(1, w.shape[0]) for w, _ in parts]
    _close(x, x_ref, dtype, "mixed row")
    for i, (y, y_ref) in enumerate(zip(ys, ys_ref)):
        _close(y, y_ref, dtype, f"product {i}")
    assert torch.equal(prefix.double(), p_ref.to(dtype).double())  # the state updates are exact
    assert torch.equal(blocks.double(), b_ref.to(dtype).double())
    assert gemv_fold.scratch(prefix.device, D)[1].item() == 0  # the flag is back at 0 for the next launch


def test_fold_equals_the_unfused_pair_of_launches_at_a_tp8_width():
    """K3's TP8 hidden width with its 8 stored blocks + the partial, three parts (router-like, FP8)."""
    D, n = 7168, 8
    prefix, dx, blocks, weights, parts = _inputs(D, n, (96, 40), torch.bfloat16, seed=3, fp8_part=True)
    p2, b2 = prefix.clone(), blocks.clone()
    x_ref, ys_ref, _, _ = _fp64_reference(prefix, dx, blocks, n, weights, parts, False)
    x, ys = arn.mix_gemv(prefix, dx, blocks, n, *weights, parts, eps=EPS, backend="triton")
    x2 = arn.after(p2, dx, b2, n, *weights, eps=EPS, backend="triton")  # the standalone mix kernel
    _close(x, x_ref, torch.bfloat16, "mixed row")
    assert (x.float() - x2.float()).abs().max().item() <= 2 ** -7 * x2.float().abs().max().item()
    for y, y_ref in zip(ys, ys_ref):
        _close(y, y_ref, torch.bfloat16, "product")
    assert torch.equal(prefix, p2) and torch.equal(blocks, b2)


def test_the_torch_row_is_the_reference_sequence():
    prefix, dx, blocks, weights, parts = _inputs(64, 2, (9,), torch.float32, seed=5)
    x_ref, ys_ref, _, _ = _fp64_reference(prefix, dx, blocks, 2, weights, parts, False)
    x, ys = arn.mix_gemv(prefix, dx, blocks, 2, *weights, parts, eps=EPS, backend="torch")
    _close(x, x_ref, torch.float32, "mixed row")
    _close(ys[0], ys_ref[0], torch.float32, "product")


@pytest.mark.parametrize("change,match", [
    ({"n_blocks": 4}, "n_blocks must be an int in"),          # more sources than the slots hold
    ({"n_blocks": 1.0}, "n_blocks must be an int"),
    ({"prefix": "two_rows"}, "prefix must be one row"),
    ({"parts": []}, "parts must hold one to three"),
    ({"parts": "four"}, "parts must hold one to three"),
    ({"parts": "dtype"}, r"parts\[0\]: x must be \[1, 32\] of w's dtype torch.float16"),
    ({"parts": "width"}, r"parts\[0\]: x must be"),
    ({"parts": "not_pair"}, r"parts\[0\] must be a \(weight, scale or None\) pair"),
    ({"parts": "no_rows"}, r"parts\[0\]: the weight must have rows and columns"),
    ({"mix_weight": "fp16"}, "mix_weight must be a contiguous fp32"),
    ({"delta": "shape"}, "delta must match prefix"),
    ({"eps": -1.0}, "eps must be a positive finite number"),
])
def test_bad_inputs_are_refused_before_any_kernel(change, match, monkeypatch):
    prefix, dx, blocks, weights, parts = _inputs(32, 2, (8,), torch.float32, seed=9)
    launched = []
    monkeypatch.setattr(gemv_fold, "launch", lambda *a, **k: launched.append(a))
    kw = {"prefix": prefix, "delta": dx, "blocks": blocks, "n_blocks": 2, "parts": parts, "eps": EPS,
          "mix_weight": None}
    for key, value in change.items():
        kw[key] = value
    if kw["prefix"] == "two_rows":
        kw["prefix"], kw["delta"], kw["blocks"] = prefix.repeat(2, 1), dx.repeat(2, 1), blocks.repeat(1, 2, 1)
    if kw["delta"] == "shape":
        kw["delta"] = dx[:, :16]
    bad_parts = {"four": parts * 4, "dtype": [(parts[0][0].half(), None)],
                 "width": [(parts[0][0][:, :16], None)], "not_pair": [parts[0][0]],
                 "no_rows": [(parts[0][0][:0], None)]}
    if isinstance(kw["parts"], str):
        kw["parts"] = bad_parts[kw["parts"]]
    if kw["mix_weight"] == "fp16":
        kw["mix_weight"] = weights[0].half()
    with pytest.raises(ValueError, match=match):
        arn.mix_gemv(kw["prefix"], kw["delta"], kw["blocks"], kw["n_blocks"], *weights, kw["parts"],
                     eps=kw["eps"], mix_weight=kw["mix_weight"], backend="triton")
    assert not launched


# ------------------------------------------------------------------------------------------ the step

def test_mix_fold_is_off_unless_asked_and_says_why_it_cannot_run():
    assert not resolve("all", DEV, torch.float32, 1, tokens=1, projections="gemv").mix_fold
    on = dict(dict.fromkeys(SWITCHES, True), mix_fold=True)
    r = resolve(on, DEV, torch.float32, 1, tokens=1, projections="gemv")
    assert r.mix_fold and "mix folded" in r.label()
    assert any(line.startswith("mix_fold: on") for line in r.describe())
    r = resolve(on, DEV, torch.float32, 1, tokens=1, projections="bf16")
    assert not r.mix_fold and "projections" in r.notes["mix_fold"]
    r = resolve(dict(on, attn_res_fused=False), DEV, torch.float32, 1, tokens=1, projections="gemv")
    assert not r.mix_fold and "attn_res_fused is off" in r.notes["mix_fold"]
    assert "2 tokens" in resolve(on, DEV, torch.float32, 1, tokens=2, projections="gemv").notes["mix_fold"]
    only = dict(dict.fromkeys(SWITCHES, False), attn_res_fused=True, mix_fold=True)
    with pytest.raises(ValueError, match="mix_fold cannot run here"):
        resolve(only, DEV, torch.float32, 1, tokens=2, projections="gemv", strict=True)
    with pytest.raises(ValueError, match="mix_fold must be one of"):
        resolve(dict(on, mix_fold=1), DEV, torch.float32, 1, tokens=1, projections="gemv")


def test_the_step_with_the_fold_equals_its_reference_outputs_and_state():
    """A TP2 slice of a 4-layer tiny config in fp32 (the decode_step study's CPU case): all on with the
    one-row GEMV and the fold against the plain PyTorch step (all off but the sharded MoE tail, the
    reference the study uses at TP > 1), logits, saved state and caches; every mix but the last folded."""
    cfg = CPU_CONFIG
    w = RankWeights.random(cfg, distinct_layers=2, device=DEV, dtype=torch.float32, seed=11)
    ids = torch.randint(0, cfg.vocab_size, (1, 1), generator=torch.Generator().manual_seed(2))
    ref_opts = {n: n == "moe_tail_sharded" for n in SWITCHES}
    out = {}
    for name, opts, proj in (("ref", ref_opts, "bf16"), ("gemv", "all", "gemv"),
                             ("fold", dict(dict.fromkeys(SWITCHES, True), mix_fold=True), "gemv")):
        step = DecodeStep(cfg, 1, 8, optimizations=opts, weights=w, projections=proj, seed=5)
        calls = []
        if step.fold is not None:
            fold = step.fold
            step.fold = lambda *a, _f=fold: calls.append(1) or _f(*a)
        logits = step(ids).clone()
        caches = {k: v.clone() for k, v in step.cache_entries().items()}
        out[name] = (logits, step.save_state(), caches, calls)
    assert out["fold"][3] == [1] * (2 * cfg.num_hidden_layers)  # every mix but the final one, folded
    ref = out["ref"]
    for name in ("fold", "gemv"):
        logits, saved, caches, _ = out[name]
        _close(logits, ref[0], torch.float32, f"{name} logits")
        for k in ref[1]:
            _close(saved[k], ref[1][k], torch.float32, f"{name} saved {k}")
        for k in ref[2]:
            _close(caches[k], ref[2][k], torch.float32, f"{name} cache {k}")
    # with and without the fold: the same step but for the mix's fp32 summation order
    assert ((out["fold"][0] - out["gemv"][0]).norm() / out["gemv"][0].norm()).item() < 1e-5


def test_the_step_with_the_fold_equals_the_pytorch_model():
    """Two layers (KDA + the dense MLP, MLA + MoE; an AttnRes block per layer, so a block pushed at every
    attention mix) at batch 1 in fp32 against K3Model, the plain PyTorch model, after a 5-token prefill:
    the logits and every cache, the AttnRes blocks and partial included; all four mixes before a product
    folded."""
    config = dataclasses.replace(K3Config.tiny(), num_hidden_layers=2, attn_res_block_size=1, name="tiny2")
    model = init_weights(K3Model(config), 7).eval().to(DEV)
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7)).to(DEV)
    with torch.no_grad():
        _, cache = model.prefill(ids[:, :5])
        ref, ref_cache = model(ids[:, 5:], cache)
        step = DecodeStep.from_model(model, 1, 5, optimizations=dict(dict.fromkeys(SWITCHES, True),
                                                                     mix_fold=True), projections="gemv")
        step.load_cache(cache)
        calls, fold = [], step.fold
        step.fold = lambda *a: calls.append(1) or fold(*a)
        logits = step(ids[:, 5:])
    assert step.resolved.mix_fold and len(calls) == 2 * config.num_hidden_layers
    bench.check(logits, ref, dtype="fp32", name="logits")
    entries = step.cache_entries()
    for name, want in ref_cache.entries().items():
        bench.check(entries[name], want, dtype="fp32", name=name)
