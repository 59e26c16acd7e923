"""The decode step decides once: `resolve` returns a chosen row for every op the step calls, the step binds
their callables, and eager decode and verification steps make no backend choice after that (k3lab.ops'
chooser is counted across several steps). The settings table holds the valued settings too (projections,
precision), and the article's precision (MXFP4 experts, FP8 cache) is one of them, bound once too."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.config import K3Config
from k3lab.engine import SETTINGS, SWITCHES, DecodeStep, resolve
from k3lab.engine import rows, switches
from k3lab.engine.switches import settings
from k3lab.ops import Backends
from k3lab.ops.situ_glu import situ_glu_stacked

SMALL = dataclasses.replace(K3Config.tiny(), num_hidden_layers=2, attn_res_block_size=1, name="tiny2")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16 if DEV == "cuda" else torch.float32
STEP_OPS = {"kda_decode", "mla_decode", "attn_res_norm", "packed_matmul", "situ_glu", "moe_router",
            "moe_experts", "mla_glue"}


@pytest.fixture
def choices(monkeypatch):
    """A Counter of the chooser's calls per op while the test runs (every entry point of Backends that
    chooses a row is wrapped)."""
    calls = collections.Counter()
    for name in ("select", "choose", "pick"):
        original = getattr(Backends, name, None)
        if original is None:
            continue

        def counting(self, *args, _original=original, **kwargs):
            calls[self.op] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(Backends, name, counting)
    return calls


def test_the_counter_sees_a_face_choose(choices):
    """The count can fail: a face called with no backend chooses, and the counter sees it."""
    situ_glu_stacked(torch.randn(2, 64))  # CPU tensors: the plain-PyTorch row is chosen
    assert choices["situ_glu"] >= 1


@pytest.mark.parametrize("projections", ("bf16", "gemv", "fp8", "article"))
@pytest.mark.parametrize("opt", ("all", "none"))
def test_eager_decode_steps_choose_nothing_after_resolve(choices, opt, projections):
    """On the GPU where there is one (bf16: the CUDA kernels' rows), else on the CPU (fp32). 'article':
    precision='article' (its FP8 projections, MXFP4 experts and FP8 cache bound once as well)."""
    kw = {"precision": "article"} if projections == "article" else {"projections": projections}
    step = DecodeStep(SMALL, 1, 4, optimizations=opt, device=DEV, **kw)
    assert set(step.resolved.rows) >= STEP_OPS, set(step.resolved.rows)
    assert set(step.resolved.backends) == set(step.resolved.rows)
    choices.clear()
    with torch.no_grad():
        for t in range(3):
            logits = step(torch.tensor([[t + 1]], device=DEV))
    assert torch.isfinite(logits).all()
    assert sum(choices.values()) == 0, dict(choices)


@pytest.mark.parametrize("opt", ("all", "none"))
def test_eager_verification_steps_choose_nothing_after_resolve(choices, opt):
    step = DecodeStep(SMALL, 1, 4, optimizations=opt, device=DEV, q_len=3)
    assert {"kda_verify", "mla_decode", "attn_res_norm"} <= set(step.resolved.rows)
    choices.clear()
    with torch.no_grad():
        for t in range(2):
            logits = step(torch.tensor([[t + 1, t + 2, t + 3]], device=DEV))
    assert torch.isfinite(logits).all()
    assert sum(choices.values()) == 0, dict(choices)


def test_rows_cover_verification_ops_and_are_objects_with_callables():
    r = resolve("all", DEV, DT, 3)
    assert {"kda_verify", "mla_decode", "attn_res_norm"} <= set(r.rows) and "kda_decode" not in r.rows
    assert callable(r.rows["kda_verify"].bind) and callable(r.rows["mla_decode"].bind)
    assert callable(r.rows["moe_experts"].experts) and callable(r.rows["moe_experts"].tail)
    with pytest.raises(AttributeError, match="binds no 'after'"):
        r.rows["mla_decode"].after  # noqa: B018
    d = resolve("none", DEV, DT, 1)
    assert d.backends["kda_decode"] == "triton" and d.backends["moe_experts"] == "torch"
    assert d.graph and "per-expert loop" in d.graph


def test_projections_and_precision_are_settings_of_the_same_table():
    assert set(SWITCHES) < set(SETTINGS)
    assert SETTINGS["projections"].values == ("bf16", "gemv", "fp8")
    assert SETTINGS["precision"].values == ("bf16", "fp8", "article")
    assert settings("all") == ("bf16", "bf16")
    assert settings({"projections": "fp8"}) == ("fp8", "fp8")
    assert settings("all", precision="fp8") == ("fp8", "fp8")
    assert settings({"projections": "gemv", "kda_fused": False}) == ("gemv", "bf16")
    r = resolve({"projections": "fp8", "glue_fused": False}, DEV, DT, 1)
    assert r.projections.startswith("fp8") and r.precision == "fp8" and not r.on["glue_fused"]
    assert any(line.startswith("precision: fp8") for line in r.describe())


def test_the_default_projections_are_the_one_row_gemv_at_one_row_on_a_gpu_only():
    """Unset projections at precision 'bf16': k3lab.ops.gemv's one-row kernel where the step has one token
    (decode at batch 1) on a GPU, the matrix library above and on a CPU (where the one-row kernel would run
    interpreted); asked for by name, what was asked runs."""
    plain = "bf16" if DEV == "cuda" else "fp32"
    one_row = "gemv" if DEV == "cuda" else plain
    assert resolve("all", DEV, DT, 1, tokens=1).projections == one_row
    assert rows.default_projections(1, torch.float32, "cpu") == "bf16"  # the matrix library on a CPU
    assert rows.default_projections(1, torch.bfloat16, "cuda") == "gemv"
    if DEV == "cuda":
        assert "one-row kernel" in resolve("all", DEV, DT, 1, tokens=1).describe()[-2]
    assert resolve("all", DEV, DT, 1, tokens=2).projections == plain
    assert resolve("all", DEV, DT, 3, tokens=3).projections == plain
    assert resolve("all", DEV, DT, 1, tokens=1, projections="bf16").projections == plain
    assert resolve({"projections": "bf16"}, DEV, DT, 1, tokens=1).projections == plain
    assert resolve("all", DEV, DT, 1, tokens=1, projections="gemv").projections == "gemv"
    assert resolve("all", DEV, DT, 1, tokens=1, precision="fp8").projections.startswith("fp8")
    step = DecodeStep(SMALL, 1, 4, device=DEV)
    assert step.resolved.projections == one_row and step.describe()["projections"] == one_row
    if DEV == "cuda":
        assert type(step.weights.layers[0].attn.w_in).__name__ == "GemvWeight"
    assert DecodeStep(SMALL, 2, 4, device=DEV).resolved.projections == plain
    assert resolve("all", DEV, torch.float64, 1, tokens=1).projections == "float64"  # no fp64 GEMV


@pytest.mark.parametrize("kw,match", [
    ({"precision": "fp4"}, "precision must be one of"),
    ({"projections": "int8"}, "projections must be one of"),
    ({"projections": "gemv", "precision": "fp8"}, "contradicts precision"),
    ({"projections": "fp8", "precision": "bf16"}, "contradicts precision"),
    ({"optimizations": {"projections": "gemv"}, "projections": "fp8"}, "given twice"),
    ({"optimizations": {"projections": True}}, "projections must be one of"),
])
def test_bad_settings_are_refused_by_name(kw, match):
    opts = kw.pop("optimizations", "all")
    with pytest.raises(ValueError, match=match):
        resolve(opts, DEV, DT, 1, **kw)


def test_the_articles_precision_resolves_to_its_rows():
    """precision='article' (a keyword or in the dict) gives FP8 projections, the MXFP4 experts' row and
    the FP8 cache's decode; nothing of it is refused any more."""
    assert not hasattr(switches, "ARTICLE_MISSING")
    assert settings("all", precision="article") == ("fp8", "article")
    for where in ({"precision": "article"}, {"optimizations": {"precision": "article"}}):
        opts = where.pop("optimizations", "all")
        r = resolve(opts, DEV, DT, 1, tokens=1, **where)
        assert r.precision == "article" and r.projections.startswith("fp8")
        assert r.backends["moe_experts"] == "mxfp4_gemv" and r.backends["mla_decode"] == "fp8_cache"
        assert "precision: article" in r.describe() and not r.graph
    off = resolve({"grouped_experts": False, "mla_padded": False}, DEV, DT, 1, precision="article")
    assert off.backends["moe_experts"] == "mxfp4_torch" and "per-expert loop" in off.graph
    assert "FP8 latent cache has one decode" in off.notes["mla_padded"]
    with pytest.raises(ValueError, match="contradicts precision"):
        resolve("all", DEV, DT, 1, precision="article", projections="bf16")
