"""The whole-step study's arithmetic and tables (k3lab.studies.decode_step and its measure module) on
records made here, without running the benchmark."""

from __future__ import annotations

import pytest
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import SWITCHES, DecodeStep
from k3lab.engine.weights import RankWeights
from k3lab.studies import decode_step as ds
from k3lab.studies.decode_step import measure as sb

from cpu_child import on_a_cpu


def _rec(case: str, variant: str, ms: float, mode: str = "graph", **extra) -> bench.Record:
    t = bench.Timing(ms * 1e3, ms * 1e3, ms * 1e3, 3, mode, 0.0)
    suffix = ".graph" if mode == "graph" else ""
    return bench.make_record("decode_step", f"{case}.{variant}{suffix}", "before" if variant == "all_off"
                             else "after",
                             t, shape={"batch": 1}, dtype="bfloat16", floor_us=8000.0, **extra)


def test_variants_cover_every_decode_switch_once():
    v = sb.variants(1)
    assert list(v)[:2] == ["all_off", "all_on"]
    assert {k[3:] for k in v if k.startswith("no_")} == set(SWITCHES) - {"kda_verify_tiles"}
    assert all(sum(not on for on in opts.values()) == 1 for k, opts in v.items() if k.startswith("no_"))
    assert "no_kda_verify_tiles" in sb.variants(3) and "no_kda_fused" not in sb.variants(3)


def test_step_bytes_parts_and_growth():
    tp8 = K3Config.tp_slice(8)
    b1, b128 = sb.step_bytes(tp8, 1, 1024), sb.step_bytes(tp8, 1, 131072)
    assert b1["total"] == pytest.approx(sum(v for k, v in b1.items() if k != "total"))
    # the MLA history: 24 layers x (context + 2 rows) x 576 x 2 bytes
    assert b128["mla_cache"] == 24 * (131072 + 2) * 576 * 2
    assert b128["weights_dense"] == b1["weights_dense"]
    # one token picks 16 experts per MoE layer: 92 x 16 x 3 x 384 x 3584 x 2 bytes
    assert b1["weights_experts"] == pytest.approx(92 * 16 * 3 * 384 * 3584 * 2)
    replicated = sb.step_bytes(tp8, 1, 1024, tail="replicated")
    # the sharded tail reads 7/8 fewer up_proj rows: 92 x 6272 x 3584 x 2 bytes
    assert replicated["weights_dense"] - b1["weights_dense"] == 92 * 6272 * 3584 * 2


def test_tables_from_records():
    recs = [_rec("b1_32k", "all_on", 10.0), _rec("b1_32k", "all_on", 12.0, mode="eager"),
            _rec("b1_32k", "no_mla_padded", 25.0), _rec("b1_32k", "no_mla_padded", 27.0, mode="eager"),
            _rec("b1_32k", "all_off", 60.0, mode="eager",
                 profile_eager={"launches": 9000, "api_launches": 9000, "kernel_sum_us": 50000.0})]
    wf = ds.waterfall(recs, "b1_32k")
    assert list(wf["variant"]) == ["all_off", "all_on", "no_mla_padded"]
    assert wf.set_index("variant").loc["no_mla_padded", "vs_all_on"] == pytest.approx(1.5)
    assert wf.set_index("variant").loc["all_off", "step_mode"] == "eager"
    m = {r["case"]: r for r in ds.mla_rows(recs)}["b1_32k"]
    assert m["ratio"] == pytest.approx(2.5) and m["seed_ratio"] == pytest.approx(43.8 / 23.6)
    assert ds.gain(recs, "b1_32k", "mla_padded") == pytest.approx(1.5)
    assert ds.gain(recs, "b1_32k", "attn_res_fused") is None
    assert ds.launches(recs, "b1_32k")[0]["kernels"] == 9000
    ds.waterfall_figure(wf, "test")


def test_front_page_rows_say_when_nothing_was_run():
    rows = ds.front_page_rows(records=[])
    assert len(rows) == 12 and all(r["k3lab"] == "no GPU record yet" for r in rows)
    assert "43.8 -> 23.6 ms per token (seed, MI355X)" in rows[1]["seed"]
    recs = [_rec("b1_32k", "all_on", 10.0), _rec("b1_32k", "no_mla_padded", 25.0)]
    assert ds.front_page_rows(records=recs)[1]["k3lab"] == "25.00 -> 10.00 ms (2.50x)"


def test_amdahl_reads_the_committed_per_op_records():
    rows = {r["op"]: r for r in ds.amdahl("ctx32k")}
    assert set(rows) >= {"mla", "kda_decode", "attn_res"}
    assert rows["mla"]["calls"] == 24 and rows["mla"]["before_ms"] > rows["mla"]["after_ms"] > 0


def test_study_interface_and_bad_cases():
    assert ds.NAME == "decode_step" and ds.case_names() == [*sb.cases(), *ds.EXTRA_CASES]
    with pytest.raises(ValueError, match="cases must be among"):
        sb.run_cases(["b1_2k"])
    with pytest.raises(ValueError, match=r"unknown \['b1_2k'\]"):
        ds.run(cases=["probe", "b1_2k"])
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        sb.run_cases(None, repeats=0)


TP2 = sb.CPU_CONFIG  # a TP2 slice: the collectives are stand-ins, as in the GPU's TP8 slice


@pytest.fixture(scope="module")
def tp2_weights():
    return RankWeights.random(TP2, distinct_layers=2, device="cpu", dtype=torch.float32)


def _first(weights, opts, ids):
    step = DecodeStep(TP2, 1, 8, optimizations=opts, weights=weights)
    with torch.no_grad():
        return sb.first_step(step, ids)[0]


@on_a_cpu
def test_stand_in_tails_differ_so_each_variant_has_a_tail_matched_reference(tp2_weights):
    """Under stand-in collectives the sharded and the replicated MoE tail compute different sums (real
    sums make them equal: test_step's TP2 lockstep test), so neither can be the other's reference."""
    ids = sb._ids(TP2, 1)
    on, tail_off = _first(tp2_weights, "all", ids), _first(tp2_weights, sb.all_but("moe_tail_sharded"), ids)
    assert float((on - tail_off).norm() / on.norm()) > 0.1
    assert sb.reference_of(sb.all_but("mla_padded"), 2) == "all_off_but_moe_tail_sharded"
    assert sb.reference_of(sb.all_but("moe_tail_sharded"), 2) == "all_off"
    assert sb.reference_of(dict.fromkeys(SWITCHES, True), 1) == "all_off"
    ref = sb.reference_logits("all_off_but_moe_tail_sharded", tp2_weights, (1, 8))
    torch.testing.assert_close(on, ref, rtol=1e-5, atol=1e-5)


@on_a_cpu
def test_restore_state_reruns_the_checked_step(tp2_weights):
    """A step advanced by timing loops, put back by restore_state, gives the checked call's logits again;
    without the restore it does not (the caches moved on)."""
    step = DecodeStep(TP2, 1, 8, optimizations="all", weights=tp2_weights)
    with torch.no_grad():
        first, saved, _ = sb.first_step(step, sb._ids(TP2, 1))
        for _ in range(3):
            step.run()
        moved = step.run().clone()
        step.restore_state(saved)
        again = step.run()
    assert float((moved - first).norm() / first.norm()) > 1e-3
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@on_a_cpu
def test_bench_checks_every_variant_from_the_same_state():
    recs = sb.run_cases(repeats=1, profile=False, log=lambda *_: None)
    assert len({r.error["state"] for r in recs}) == 1
    checked = {r.case.split(".")[1]: r.error["logits_vs_reference"] for r in recs}
    assert isinstance(checked.pop("all_off"), str)
    for name, e in checked.items():
        # FP8 projections round every projection's weights and inputs to e4m3 (3 mantissa bits): the
        # tiny step's logits move by ~8% (tests/test_step_fp8.py bounds that against the model)
        bound = 0.2 if sb.PROJECTIONS_OF.get(name) == "fp8" else 1e-5
        assert e["finite"] and e["rel_l2"] < bound, (name, e)
    assert 0.01 < checked["all_on_fp8"]["rel_l2"]  # it did run in FP8
    assert checked["no_moe_tail_sharded"]["reference"] == "all_off"
    assert checked["all_on"]["reference"] == "all_off_but_moe_tail_sharded"


def test_checks_label_records_compared_with_all_off_alone():
    old = _rec("b1_1k", "all_on", 10.0,
               error={"logits_vs_all_off": {"rel_l2": 1.3, "max_abs": 5.0, "finite": True}})
    new = _rec("b1_1k", "no_mla_padded", 11.0, error={
        "state": 7.0, "graph_vs_eager": {"rel_l2": 0.0, "max_abs": 0.0, "finite": True},
        "logits_vs_reference": {"reference": "all_off_but_moe_tail_sharded", "rel_l2": 0.02, "max_abs": 0.1,
                                "finite": True}})
    ref = _rec("b1_1k", "all_off", 60.0, mode="eager",
               error={"state": 7.0, "logits_vs_reference": "the reference"})
    rows = {r["variant"]: r for r in ds.checks([old, new, ref])}
    assert rows["all_on"]["note"] == ds.UNCHECKED and rows["all_on"]["rel_l2"] == 1.3
    assert (
        rows["no_mla_padded"]["note"] == ""
        and rows["no_mla_padded"]["reference"] == "all_off_but_moe_tail_sharded"
    )
    assert rows["no_mla_padded"]["graph_vs_eager"] == 0.0 and rows["all_off"]["note"] == "the reference"
