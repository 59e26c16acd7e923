"""The serving model against the committed H200 step records: the fit, its held-out error, units and
monotonicity, and batch 1 against notebook 08's measured step."""

from __future__ import annotations

import pytest

from k3lab import bench
from k3lab.serving import curve, hardware, inputs, node, stepmodel

pytestmark = pytest.mark.skipif(not bench.load_records("decode_step", device="nvidia-h200"),
                                reason="no committed H200 decode_step records")


@pytest.fixture(scope="module")
def inp():
    return inputs.node_inputs()


def test_batch_one_reproduces_notebook_08s_step_within_the_fit_error(inp):
    on = inp.fits["all_on"]
    worst = max(abs(r["rel_err"]) for r in stepmodel.residuals(on))
    for r in bench.load_records("decode_step", device="nvidia-h200"):
        if r.case in ("b1_1k.all_on.graph", "b1_32k.all_on.graph"):
            pred = on.predict(r.extra["bytes"], 1, r.extra["bandwidth_tbs"], 1)
            assert abs(pred / r.median_us - 1) <= max(worst, 0.02) + 1e-9


def test_held_out_points_are_not_fitted(inp):
    for f in inp.fits.values():
        assert not set(map(id, f.held_out)) & set(map(id, f.fitted))


def test_step_parts_equal_the_records_bytes(inp):
    c = node.tp_config()
    for p in inputs.step_points():
        if p.source.split("/")[2] != "decode_step":
            continue
        got = node.step_parts(c, p.batch, p.batch * p.context, p.tokens, dense_bytes=p.parts["weights_dense"])
        for key in ("mla_cache", "kda_state", "kda_conv"):
            assert got[key] == pytest.approx(p.parts[key], rel=1e-9)
        assert got["weights_experts"] == pytest.approx(p.parts["weights_experts_uniform"], rel=1e-6)


def test_the_step_grows_with_batch_and_context_and_units_are_microseconds(inp):
    t = {(b, c): sum(node.rank_step_us(inp, frozenset(), b, b * c, b).values())
         for b in (1, 8, 64) for c in (1024, 32768)}
    assert t[(1, 1024)] < t[(8, 1024)] < t[(64, 1024)]
    assert t[(1, 1024)] < t[(1, 32768)] and t[(64, 1024)] < t[(64, 32768)]
    assert 5e3 < t[(1, 1024)] < 1e5  # one step of one rank: milliseconds, in microseconds


def test_more_concurrency_trades_per_user_for_per_gpu_rate(inp):
    w = curve.agent_workload()
    g = hardware.gpu("mi355x")
    rung = curve.RUNGS[-1]
    a, b = (curve.evaluate(inp, rung, g, dcp=1, depth=0, concurrency=c, work=w) for c in (2, 8))
    assert a["tokens_per_s_user"] > b["tokens_per_s_user"] and a["tokens_per_s_gpu"] < b["tokens_per_s_gpu"]
    assert b["tokens_per_s_user"] <= b["tokens_per_s_user_mean"] * 1.001  # P90 is not above the mean here


def test_capacity_h200_cannot_hold_fp4_weights_mi355x_can():
    assert node.max_concurrency(142_000, hardware.gpu("h200")) == 0
    g = hardware.gpu("mi355x")
    assert node.max_concurrency(142_000, g, dcp=8) > node.max_concurrency(142_000, g, dcp=1) > 0


def test_front_is_pareto():
    pairs = ((10, 100), (20, 50), (15, 40), (5, 90))
    pts = [{"tokens_per_s_user": u, "tokens_per_s_gpu": g} for u, g in pairs]
    fr = curve.front(pts)
    assert [(p["tokens_per_s_user"], p["tokens_per_s_gpu"]) for p in fr] == [(10, 100), (20, 50)]
    assert curve.at_interactivity(fr, 15) == 50 and curve.at_interactivity(fr, 30) == 0


def test_every_variant_predicts_its_held_out_steps_within_ten_percent(inp):
    rows = stepmodel.validation(inp.fits)
    assert {r["variant"] for r in rows} >= {"all_on", "base"} | {f"no_{s}" for s in node.SWITCH_ORDER}
    worst = max(rows, key=lambda r: abs(r["rel_err"]))
    assert abs(worst["rel_err"]) <= 0.10, worst


def test_the_committed_validation_records_are_the_models_current_predictions(inp):
    from k3lab.studies.serving import validation_records

    saved = {r.case: r for r in bench.load_records("serving", device="nvidia-h200")
             if r.case.startswith("validate.")}
    now = validation_records(inp)
    assert saved and {r.case for r in now} == set(saved)
    for r in now:
        s = saved[r.case]
        assert s.median_us == pytest.approx(r.median_us, rel=1e-9)
        assert s.extra["rel_err"] == pytest.approx(r.extra["rel_err"], abs=1e-6)
        assert s.extra["rel_err"] == pytest.approx(s.extra["predicted_us"] / s.median_us - 1, abs=1e-9)
        assert s.device == "NVIDIA H200" and s.versions.get("cuda")  # the measured step's, not this machine's


def test_the_routing_pool_inverts_the_distinct_expert_count():
    for tokens, pool in ((2, 40.0), (64, 296.0), (128, 896.0)):
        read = stepmodel.distinct_experts(tokens, pool, 16)
        assert stepmodel.routing_pool(read, tokens, 16, 896) == pytest.approx(pool, rel=1e-6)
    assert stepmodel.distinct_experts(1, 896, 16) == pytest.approx(16)
    with pytest.raises(ValueError, match="read_per_layer"):
        stepmodel.routing_pool(900, 64, 16, 896)  # more than uniform routing over all experts can read


def test_waves_of_a_one_program_per_token_and_head_kernel():
    assert [stepmodel.waves(b, 12, 132) for b in (1, 8, 11, 12, 16, 32, 64, 128)] == [1, 1, 1, 2, 2, 3, 6, 12]
    with pytest.raises(ValueError, match="units"):
        stepmodel.waves(1, 12, 0)
