"""Rooflines of the dcp and moe_sharding studies: their records' bytes and flops come from the formulas
their floors are made of (k3lab.studies.<study>.work), written by the study's measure into new records
and derived at load, labelled, for committed records saved before (plots.study_roofline)."""

from __future__ import annotations

import dataclasses

import pytest

from k3lab import bench, env, plots
from k3lab.config import K3Config
from k3lab.profiling import roofline as rl
from k3lab.studies.dcp import work as dcp_work
from k3lab.studies.moe_sharding import work as moe_work

H200 = env.PEAKS["H200"]
WORK = {"dcp": dcp_work, "moe_sharding": moe_work}


def _committed(study):
    recs = bench.load_records(study, device="nvidia-h200")
    assert len(recs) >= 18, (study, len(recs))
    return recs


@pytest.mark.parametrize("study", sorted(WORK))
def test_study_roofline_draws_every_committed_record(study):
    recs = _committed(study)
    fig = plots.study_roofline(study)
    assert "NVIDIA H200" in fig.layout.title.text
    pts = rl.points(plots._with_study_work(study, recs))
    assert len(pts) == len(recs)  # every record placed, none left out for want of bytes and flops
    assert (pts["bytes"] > 0).all() and (pts["flops"] > 0).all()


@pytest.mark.parametrize("study", sorted(WORK))
def test_derived_bytes_reproduce_each_committed_floor(study):
    """The floor each record was saved with is the floor of the derived bytes (and, for moe_sharding,
    whose floors count flops too, the derived flops) on the H200's peaks: the same formula, not a second
    one."""
    for r in _committed(study):
        w = WORK[study].work_of(r)
        assert w is not None, r.case
        flops = w["flops"] if study == "moe_sharding" else 0  # dcp's floors are the cache read alone
        floor = bench.floor_us(bytes=w["bytes"], flops=flops, peak=H200)
        assert floor == pytest.approx(r.floor_us, rel=1e-9), (r.case, r.variant)


def test_records_that_carry_bytes_keep_them_and_derived_ones_say_so():
    recs = _committed("moe_sharding")
    loaded = {(r.case, r.variant, r.mode): r for r in plots._with_study_work("moe_sharding", recs)}
    for r in recs:
        got = loaded[(r.case, r.variant, r.mode)]
        w = moe_work.work_of(r)
        assert (got.extra["bytes"], got.extra["flops"]) == (w["bytes"], w["flops"])
        if "bytes" in r.extra:  # the tail records: measured with tail_cost's figures, kept as written
            assert "work" not in got.extra
            assert (r.extra["bytes"], r.extra["flops"]) == (w["bytes"], w["flops"])
        else:
            assert got.extra["work"].startswith("derived at load")
            assert "bytes" not in r.extra  # the committed record itself is not changed


def test_changed_case_parameters_change_the_bytes():
    r = next(r for r in _committed("dcp") if r.case == "local_dcp8_B1_L32768")
    wider = dataclasses.replace(r, shape={**r.shape, "rows": 2 * r.shape["rows"]}, extra={})
    (one,), (two,) = (plots._with_study_work("dcp", [x]) for x in (r, wider))
    assert two.extra["bytes"] == 2 * one.extra["bytes"] and two.extra["flops"] == 2 * one.extra["flops"]
    fp32 = dataclasses.replace(r, dtype="float32")
    assert dcp_work.work_of(fp32)["bytes"] == 2 * dcp_work.work_of(r)["bytes"]
    e = next(r for r in _committed("moe_sharding") if r.case == "experts_N64")
    more = dataclasses.replace(e, shape={**e.shape, "experts_chosen": e.shape["experts_chosen"] + 1})
    one_expert = 3 * e.shape["intermediate"] * e.shape["latent"] * 2  # three projections, bf16
    assert moe_work.work_of(more)["bytes"] - moe_work.work_of(e)["bytes"] == one_expert


def test_tail_work_is_moe_tails_cost():
    from k3lab.parallel import moe_tail as mt

    cfg = K3Config.full()
    for tail, rows in (("replicated", cfg.hidden_size), ("sharded", cfg.hidden_size // 8)):
        cost = mt.tail_cost(cfg, 8, tail, 64, "bf16")
        got = moe_work.tail_work(64, rows, cfg.routed_expert_hidden_size, cfg.hidden_size, 8, "bf16")
        assert got == {"bytes": cost["bytes"], "flops": cost["flops"]}
    with pytest.raises(ValueError, match="rows"):
        moe_work.tail_work(64, 100, cfg.routed_expert_hidden_size, cfg.hidden_size, 8, "bf16")


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="batch"):
        dcp_work.local_work(0, 4096, 96, 2)
    with pytest.raises(ValueError, match="value_dim"):
        dcp_work.merge_work(8, 1, 12, 2.5, 2)
    with pytest.raises(ValueError, match="chosen"):
        moe_work.experts_work(1, 16, 384, 3584, True, 2)


def test_a_record_of_no_known_shape_is_not_placed():
    r = _committed("dcp")[0]
    odd = dataclasses.replace(r, shape={"what": 1}, extra={})
    assert dcp_work.work_of(odd) is None and moe_work.work_of(odd) is None
    assert plots._with_study_work("dcp", [odd])[0].extra == {}


@pytest.mark.follows_gpu  # the studies put their tensors on the GPU where there is one
@pytest.mark.slow
def test_new_records_carry_the_formulas_bytes_and_flops():
    """The studies' measure writes extra['bytes'] and extra['flops'] (at smoke sizes: fp32 through
    Triton's interpreter on a CPU, bf16 compiled on a GPU), equal to what work_of derives from the same
    record's shape."""
    from k3lab.studies.dcp import measure as dcp_measure
    from k3lab.studies.moe_sharding import measure as moe_measure

    recs = dcp_measure.one_gpu(smoke=True)["records"]
    recs += moe_measure.run_tokens(tail_tokens=(3,), expert_tokens=(2,), tp=2, config=K3Config.tiny(),
                                   repeats=2, warmup=1)["records"]
    assert {r.study for r in recs} == {"dcp", "moe_sharding"}
    for r in recs:
        w = WORK[r.study].work_of(r)
        assert (r.extra["bytes"], r.extra["flops"]) == (w["bytes"], w["flops"]), (r.case, r.variant)
    assert len(rl.points(plots._with_study_work("dcp", [r for r in recs if r.study == "dcp"]))) >= 4


def test_dcp_local_attention_counts_what_the_mla_ops_records_count():
    """dcp's local attention is the MLA op's after: its bytes and flops agree with what
    profiling.roofline gives the mla_padding records of the same op at one decode token (B sequences of
    one length read as B x length rows)."""
    seen = 0
    for r in bench.load_records("mla_padding", device="nvidia-h200"):
        s = r.shape
        if (r.variant != "after" or s.get("q_len") != 1 or r.dtype != "bfloat16"
                or "cache_bytes" not in r.extra):
            continue
        got = dcp_work.local_work(1, s["lengths_sum"], s["heads"], 2)
        assert (got["bytes"], got["flops"]) == rl.work(r), r.case
        seen += 1
    assert seen >= 5
