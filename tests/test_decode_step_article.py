"""The decode_step study's setting variants: all_on_default (the projections the step picks itself) and
all_on_article (DecodeStep(precision='article')), their floors and checks (k3lab.studies.decode_step)."""

from __future__ import annotations

import pytest

from k3lab.config import K3Config
from k3lab.engine.switches import SWITCHES
from k3lab.studies import GPU_QUICK
from k3lab.studies.decode_step import measure as sb

from cpu_child import on_a_cpu

KEYS = ("weights_dense", "weights_experts", "mla_cache", "kda_state", "kda_conv")


def _summed(kinds: dict) -> dict:
    """part_bytes' kinds summed key by key, with their total: what step_bytes returns."""
    out = {k: sum(kind[k] for kind in kinds.values()) for k in KEYS}
    return dict(out, total=sum(out.values()))


def test_the_variant_table_holds_the_setting_variants():
    v = sb.variants()
    for name in ("all_on_default", "all_on_article"):
        assert v[name] == dict.fromkeys(SWITCHES, True)
    assert sb.step_settings("all_on_article") == {"precision": "article"}
    assert sb.step_settings("all_on_default") == {"projections": None}  # the step's own default
    # the names of committed records keep what they measured
    assert sb.step_settings("all_on") == {"projections": "bf16"}
    assert sb.step_settings("all_on_fp8") == {"projections": "fp8"}
    waterfall = sb.chosen_variants(sb.WATERFALL)
    assert not set(sb.SETTING_VARIANTS) & set(waterfall) and "all_on" in waterfall
    assert sb.chosen_variants(["all_on_article", "all_off"]) == ["all_off", "all_on_article"]
    with pytest.raises(ValueError, match="variants must be among"):
        sb.chosen_variants(["all_on_fp4"])
    with pytest.raises(TypeError, match="variants must be None"):
        sb.chosen_variants("all_on")
    # the report's quick form leaves the setting variants to the default and full runs
    assert GPU_QUICK["decode_step"].kwargs["variants"] == sb.WATERFALL


@on_a_cpu
def test_the_cpu_case_leaves_the_article_step_out():
    assert "all_on_article" in sb.CPU_SKIPPED and "all_on_article" not in sb.chosen_variants()
    assert "all_on_default" in sb.chosen_variants()


def test_bf16_floors_are_unchanged():
    """step_bytes and case_floor at the default precision: part_bytes summed at bf16, and the routed
    experts at two bytes a weight (the formula before precisions)."""
    tp8 = K3Config.tp_slice(8)
    kinds = sb.part_bytes(tp8, 64, 8192)
    got = sb.step_bytes(tp8, 64, 8192)
    assert got == _summed(kinds) == sb.step_bytes(tp8, 64, 8192, precision="bf16")
    F, L, E, k = (tp8.moe_intermediate_size, tp8.routed_expert_hidden_size, tp8.num_experts,
                  tp8.num_experts_per_token)
    assert sb.expert_bytes(tp8, 2) == 3 * F * L * 2
    chosen = E * (1 - (1 - k / E) ** 64)
    assert got["weights_experts"] == pytest.approx(tp8.num_moe_layers * chosen * 3 * F * L * 2, rel=1e-12)
    floor = sb.case_floor(tp8, (64, 8192), 2, (4.0, "given"))
    assert floor["bytes"] == got and floor["floor_us"] == pytest.approx(got["total"] / 4e6, rel=1e-12)


def test_the_article_floor_is_the_article_bytes():
    """case_floor at 'article' is part_bytes at 'article' summed, smaller than bf16's in each part the
    article stores in fewer bytes; variant_floor counts the experts read at MXFP4 bytes."""
    c = sb.CPU_CONFIG
    art = sb.case_floor(c, (1, 8), 2, (2.0, "given"), "article")
    want = _summed(sb.part_bytes(c, 1, 8, act_bytes=2, cache_bytes=2, precision="article"))
    assert art["bytes"] == want and art["precision"] == "article"
    bf16 = sb.step_bytes(c, 1, 8)
    for key in ("weights_dense", "weights_experts", "mla_cache"):
        assert want[key] < bf16[key], key
    per_expert = sb.expert_bytes(c, 2, "article")
    assert per_expert == 3 * c.moe_intermediate_size * c.routed_expert_hidden_size * 17 // 32  # 4.25 bits
    v = sb.variant_floor(art, 5, per_expert)
    assert v["bytes"]["weights_experts"] == 5 * per_expert
    assert v["bytes"]["total"] == pytest.approx(want["total"] - want["weights_experts"] + 5 * per_expert)
    assert v["floor_us"] == pytest.approx(v["bytes"]["total"] / 2e6)


@on_a_cpu
def test_the_article_step_of_the_cpu_case_runs_and_passes_its_check():
    """The study's article variant on its CPU config (run_cases, as the GPU runs it): checked against its
    reference's switches at the same precision to the bf16 variants' bound, its formats' cost against
    bf16 recorded (and large enough to show they ran), its floor the article bytes with the experts it
    read at MXFP4 bytes."""
    recs = sb.run_cases(repeats=1, profile=False, variants_run=["all_on_article"], log=lambda *_: None)
    assert [r.case for r in recs] == ["tiny_b1_ctx8.all_on_article"]
    r = recs[0]
    chk = r.error["logits_vs_reference"]
    assert chk["reference"] == "all_off_but_moe_tail_sharded at article"
    # like with like: the same MXFP4 / FP8 weights and FP8 cache, fp32 activations on the CPU, so the
    # kernels differ from the switches-off paths by fp32 rounding only (measured ~5e-7)
    assert chk["finite"] and chk["rel_l2"] < 1e-5, chk
    # the formats' cost: FP8 projections and MXFP4 experts move the tiny step's logits by ~14%
    assert 0.01 < r.error["precision_vs_bf16"]["rel_l2"] < 0.5, r.error["precision_vs_bf16"]
    assert r.extra["step"]["precision"] == "article"
    c, act = sb.CPU_CONFIG, 4  # the CPU case's fp32 weights
    want = _summed(sb.part_bytes(c, 1, 8, act_bytes=act, cache_bytes=act, precision="article"))
    got = r.extra["bytes"]
    assert got["weights_experts"] == r.extra["experts_read"] * sb.expert_bytes(c, act, "article")
    assert got["weights_dense"] == want["weights_dense"]  # FP8 projections counted once, not subtracted
    assert got["mla_cache"] == want["mla_cache"]
    assert r.floor_us == pytest.approx(got["total"] / (r.extra["bandwidth_tbs"] * 1e6), rel=1e-12)
