"""The decode step at the article's precision (DecodeStep(precision='article')): FP8 dense projections,
MXFP4 routed experts (k3lab.ops.moe_experts.mxfp4_kernels, the GEMV form at batch 1) and an FP8 MLA
latent cache (k3lab.ops.mla_decode.fp8_cache), against a plain-PyTorch fp64 step over the values they
stand for: the weights dequantized (`RankWeights.dequantized`) and the cache dequantized.

The reference is the step itself in fp64 with every switch in its PyTorch form (the KDA decode's
PyTorch row, the AttnRes sequence, the per-expert loop, the PyTorch glue), the MLA decode replaced by
fp64 attention over its latent rows, and the step's one rounding that is not a weight's mirrored: the
new latent rows are quantized into the FP8 cache before the decode reads them, so the reference rounds
its new rows the same way (`fp8_cache.quantize_rows` with the layer's scale, then dequantized). At batch
1 the FP8 projections take the one-row W8A16 path (activations unquantized), so what is left between
the two is fp32 against fp64 arithmetic: the bound is fp32's. Triton rows run in the interpreter on a
CPU (slow: small shapes).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import SWITCHES, DecodeStep, RankWeights, resolve, rows
from k3lab.ops.moe_experts.mxfp4 import Mxfp4Weight
from k3lab.ops.mla_decode import fp8_cache

from test_step import CPU_STEP

# KDA + the dense MLP, then MLA + MoE, an AttnRes block per layer (test_step's SMALL)
SMALL = dataclasses.replace(K3Config.tiny(), num_hidden_layers=2, attn_res_block_size=1, name="tiny2")
CONTEXT = 6
# the reference's switches: every op in its PyTorch form (kda_fused on: on a CPU its CUDA row is
# replaced by the PyTorch reference of the same step, which the step's notes say)
PLAIN = {**dict.fromkeys(SWITCHES, False), "kda_fused": True}


def _fp64_attention(q: torch.Tensor, latent: torch.Tensor, scale: float):
    """o [B, 1, H, 512] of one query row per sequence over every latent row, in fp64."""
    s = torch.einsum("bthd,bld->bthl", q.double(), latent.double()) * scale
    return torch.einsum("bthl,bld->bthd", torch.softmax(s, dim=-1), latent.double()[..., :512])


def _reference(step: DecodeStep, monkeypatch) -> DecodeStep:
    """The fp64 plain-PyTorch step over `step`'s dequantized weights and dequantized caches (module
    docstring). Its MLA decode is bound to fp64 attention here (the Triton plans take fp32 at most)."""
    with monkeypatch.context() as m:
        m.setattr(rows, "mla_plan_binder", lambda padded: lambda *args: None)
        ref = DecodeStep(step.config, step.batch, step.context_len,
                         weights=step.weights.dequantized(torch.float64), optimizations=PLAIN)
    assert ref.resolved.precision == "bf16" and ref.dtype == torch.float64
    ctx = step.context_len
    for i, cache in step.kda_caches.items():
        for name, t in cache.entries().items():
            getattr(ref.kda_caches[i], name).copy_(t)
    for i, codes in step.latent.items():
        scale = step.kv_scales[i]
        ref.latent[i].copy_(fp8_cache.dequantize(codes, scale))
        latent, q = ref.latent[i], ref.q_bufs[i]

        def plan(latent=latent, q=q, scale=scale):
            new = latent[:, ctx:]
            new.copy_(fp8_cache.dequantize(fp8_cache.quantize_rows(new, scale), scale))
            return _fp64_attention(q, latent, step.config.mla_softmax_scale), None

        ref.mla_plans[i] = plan
    return ref


def _article_case(seed: int):
    w = RankWeights.random(SMALL, distinct_layers=1, dtype=torch.float32, seed=seed)
    step = DecodeStep(SMALL, 1, CONTEXT, weights=w, precision="article", seed=seed)
    ids = torch.randint(0, SMALL.vocab_size, (1, 1), generator=torch.Generator().manual_seed(seed))
    return step, ids


@CPU_STEP
@pytest.mark.parametrize("seed", (0, 1))
def test_article_step_equals_the_fp64_step_over_dequantized_weights_and_cache(seed, monkeypatch):
    step, ids = _article_case(seed)
    assert step.resolved.precision == "article" and step.resolved.projections.startswith("fp8")
    assert step.resolved.backends["moe_experts"] == "mxfp4_gemv"
    assert step.resolved.backends["mla_decode"] == "fp8_cache"
    assert step.weights.experts == "mxfp4" and isinstance(step.weights.layers[1].mlp.w1, Mxfp4Weight)
    assert all(t.dtype == torch.float8_e4m3fn for t in step.latent.values())
    ref = _reference(step, monkeypatch)
    with torch.no_grad():
        want = ref(ids).clone()
        got = step(ids).clone()
    bench.check(got, want, dtype="fp32", name="logits: article step vs fp64 reference")
    got_state, want_state = step.cache_entries(), ref.cache_entries()
    for name, t in want_state.items():
        bench.check(got_state[name], t, dtype="fp32", name=name)
    # the FP8 cache's new row: the codes the writer stored are the reference's rounding of its row
    for i in step.latent:
        codes, scale = step.latent[i][:, CONTEXT:], step.kv_scales[i]
        mirrored = fp8_cache.quantize_rows(ref.latent[i][:, CONTEXT:], scale)
        differ = (codes.float() != mirrored.float()).float().mean().item()
        assert differ < 0.02, differ  # a code flips only where fp32 and fp64 rows straddle a rounding edge


@CPU_STEP
def test_the_comparison_can_fail(monkeypatch):
    """The reference catches a cache scale off by 2x (the decode reads every latent value doubled)."""
    step, ids = _article_case(0)
    ref = _reference(step, monkeypatch)
    for s in step.kv_scales.values():
        s.mul_(2.0)
    with torch.no_grad():
        want, got = ref(ids).clone(), step(ids).clone()
    with pytest.raises(AssertionError):
        bench.check(got, want, dtype="fp32", name="logits")


@CPU_STEP
def test_article_experts_loop_equals_the_gemv_form():
    """grouped_experts off at 'article': the PyTorch loop over each chosen expert dequantized, against
    the MXFP4 GEMV form on the same weights and caches (fp32 both: fp32's bound)."""
    w = RankWeights.random(SMALL, distinct_layers=1, dtype=torch.float32, seed=5).to_article()
    ids = torch.tensor([[7]])
    out = {}
    for name, opt in (("gemv", "all"), ("loop", {"grouped_experts": False})):
        step = DecodeStep(SMALL, 1, CONTEXT, weights=w, precision="article", optimizations=opt, seed=5)
        assert step.resolved.backends["moe_experts"] == f"mxfp4_{'torch' if name == 'loop' else 'gemv'}"
        with torch.no_grad():
            out[name] = step(ids).clone()
    bench.check(out["loop"], out["gemv"].double(), dtype="fp32", name="logits: MXFP4 loop vs GEMV form")


@CPU_STEP
def test_article_step_is_bit_stable_run_to_run():
    step, ids = _article_case(2)
    saved = step.save_state()
    outs = []
    with torch.no_grad():
        for _ in range(2):
            step.restore_state(saved)
            outs.append((step(ids).clone(), {k: v.clone() for k, v in step.save_state().items()}))
    assert torch.equal(outs[0][0], outs[1][0])
    for name, t in outs[0][1].items():
        assert torch.equal(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t,
                           outs[1][1][name].view(torch.uint8) if t.dtype == torch.float8_e4m3fn
                           else outs[1][1][name]), name


@CPU_STEP
def test_article_weights_and_cache_are_in_the_articles_formats():
    w = RankWeights.random(SMALL, distinct_layers=1, dtype=torch.float32)
    a = w.to_article()
    moe = a.layers[1].mlp
    E, F, L = SMALL.num_experts, SMALL.moe_intermediate_size, SMALL.routed_expert_hidden_size
    assert moe.w1.packed.shape == (E, F, L // 2) and moe.w2.scale_exp.shape == (E, L, F // 32)
    assert a.nbytes()["experts"] == 3 * E * F * L * 17 // 32  # 4.25 bits a weight
    assert a.layers[1].mlp.down.wq.dtype == torch.float8_e4m3fn and a.projections == "fp8"
    d = a.dequantized(torch.float64)
    assert torch.equal(d.layers[1].mlp.w1, moe.w1.dequantize(torch.float64))
    assert (d.layers[1].mlp.w1 - w.layers[1].mlp.w1.double()).abs().max() > 0  # it did quantize
    with pytest.raises(ValueError, match="experts are mxfp4 already"):
        a.to_article()
    with pytest.raises(ValueError, match="weights hold fp8 projections"):
        DecodeStep(SMALL, 1, 4, weights=w.to_fp8(), precision="article")
    step = DecodeStep(SMALL, 1, 4, weights=a, precision="article")  # converted weights taken as they are
    assert step.weights.layers[1].mlp.w1 is moe.w1
    assert step.describe()["mla_cache"] == "fp8_e4m3" and step.describe()["experts"] == "mxfp4"


@pytest.mark.parametrize("bad", ("fp4", "ARTICLE", "", True, 8))
def test_bad_precision_is_refused_before_anything_runs(bad, monkeypatch):
    """A bad name is a ValueError naming the setting, raised before any weights are drawn or any kernel
    runs (drawing weights is made to fail here, so reaching it would show)."""
    def drawn(*args, **kwargs):
        raise AssertionError("weights were drawn before the precision was checked")

    monkeypatch.setattr(RankWeights, "random", drawn)
    with pytest.raises(ValueError, match="precision must be one of"):
        DecodeStep(SMALL, 1, 4, device="cpu", precision=bad)
    with pytest.raises(ValueError, match="precision must be one of"):
        DecodeStep(SMALL, 1, 4, device="cpu", optimizations={"precision": bad})
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve("all", "cpu", torch.float32, 1, precision=bad)


@pytest.mark.parametrize("precision", ("bf16", "fp8", "article"))
def test_part_bytes_of_the_moe_and_mla_parts_at_each_precision(precision):
    """measure.part_bytes' MoE and MLA parts against the bytes of tensors stored as that precision
    stores them: RankWeights drawn at the TP2 tiny slice and converted (`to_fp8`, `to_article`), each
    tensor's own storage summed (FP8 projections with their row scales, MXFP4 codes with their block
    scales), the routed experts at the expected number of distinct experts chosen, the MLA cache from
    an FP8 tensor's element size and its scale."""
    from k3lab.studies.decode_step.measure import CPU_CONFIG as c
    from k3lab.studies.decode_step.measure import part_bytes

    w = RankWeights.random(c, distinct_layers=1, dtype=torch.bfloat16)
    w = {"bf16": w, "fp8": w.to_fp8(emulated=True), "article": w.to_article(emulated=True)}[precision]
    moe = w.layers[c.first_k_dense_replace].mlp
    mla = w.layers[c.layer_types.index("mla")].attn

    def stored(part, names):
        total = 0
        for n in names:
            t = getattr(part, n)
            total += t.nbytes() if callable(getattr(t, "nbytes", None)) else (
                t.nbytes if isinstance(t, Mxfp4Weight) else t.numel() * t.element_size())
        return total

    batch, ctx = 3, 40
    got = part_bytes(c, batch, ctx, tail="replicated", precision=precision)
    E, k = c.num_experts, c.num_experts_per_token
    chosen = E * (1 - (1 - k / E) ** batch)
    per_expert = stored(moe, ("w1", "w3", "w2")) / E
    assert got["moe"]["weights_dense"] == c.num_moe_layers * stored(
        moe, ("gate", "down", "up", "shared_in", "shared_down"))
    assert got["moe"]["weights_experts"] == pytest.approx(c.num_moe_layers * chosen * per_expert, rel=1e-12)
    assert got["mla"]["weights_dense"] == c.num_mla_layers * stored(
        mla, ("w_in", "q_b", "w_uk", "w_uv", "o_proj"))
    dtype = torch.float8_e4m3fn if precision == "article" else torch.bfloat16
    rows = torch.empty(batch, ctx + 2, c.mla_latent_dim, dtype=dtype)
    scale = 4 if precision == "article" else 0
    assert got["mla"]["mla_cache"] == c.num_mla_layers * (rows.numel() * rows.element_size() + scale)
    if precision == "article":  # 4.25 bits a routed weight
        assert per_expert == 3 * c.moe_intermediate_size * c.routed_expert_hidden_size * 4.25 / 8
    with pytest.raises(ValueError, match="precision must be one of"):
        part_bytes(c, 1, 8, precision="fp4")


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@GPU
def test_gpu_article_kernels_in_the_step_equal_pytorch():
    """On the GPU (not yet run on one here): the article step (fp32 activations, so the FP8 decode's
    products run in fp32) against the same step with its two new kernels replaced by PyTorch: the routed
    experts by the loop over each chosen expert dequantized (grouped_experts off), the FP8 split decode
    by fp64 attention over the dequantized cache after the same row writer. The FP8 projections and the
    glue are the same kernels in both, so the bound is fp32's; then a CUDA graph replay equals eager."""
    w = RankWeights.random(SMALL, distinct_layers=1, dtype=torch.float32, device="cuda", seed=6).to_article()
    ids = torch.tensor([[5]], device="cuda")
    fast = DecodeStep(SMALL, 1, CONTEXT, weights=w, precision="article", seed=6)
    plain = DecodeStep(SMALL, 1, CONTEXT, weights=w, precision="article", seed=6,
                       optimizations={"grouped_experts": False})
    assert fast.resolved.backends["moe_experts"] == "mxfp4_gemv"
    assert plain.resolved.backends["moe_experts"] == "mxfp4_torch"
    for i, codes in plain.latent.items():
        scale, q, rows_new = plain.kv_scales[i], plain.q_bufs[i], plain.new_rows[i]

        def plan(codes=codes, scale=scale, q=q, rows_new=rows_new):
            codes[:, CONTEXT:].copy_(fp8_cache.quantize_rows(rows_new, scale))
            o = _fp64_attention(q, fp8_cache.dequantize(codes, scale), SMALL.mla_softmax_scale)
            return o.to(q.dtype), None

        plain.mla_plans[i] = plan
    saved = fast.save_state()
    with torch.no_grad():
        got, want = fast(ids).clone(), plain(ids).clone()
    bench.check(got, want.double(), dtype="fp32", name="logits: article kernels vs PyTorch")
    for name, t in plain.cache_entries().items():
        bench.check(fast.cache_entries()[name], t.double(), dtype="fp32", name=name)
    assert fast.capturable() == (True, "")
    fast.capture()
    fast.restore_state(saved)
    bench.check(fast.replay().clone(), got.double(), dtype="fp32", name="graph replay vs eager")
