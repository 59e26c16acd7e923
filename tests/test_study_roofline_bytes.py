"""Rooflines of the dcp and moe_sharding studies: their records' bytes and flops come from the formulas
their floors are made of (k3lab.studies.<study>.work), written by the study's measure into new records
and, for committed records saved before, derived from the record by profiling.roofline's `work`, each
point saying which. And the MLA decode's one flop count (k3lab.ops.mla_decode.decode_flops) that the
rooflines and both studies use, against the reference's matrix products."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3lab import bench, env, plots
from k3lab.config import K3Config
from k3lab.ops import mla_decode
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
    pts = rl.points(recs)
    assert len(pts) == len(recs)  # every record placed, none left out for want of bytes and flops
    assert (pts["bytes"] > 0).all() and (pts["flops"] > 0).all() and pts["work"].notna().all()


def test_drawing_a_roofline_changes_no_formula_table():
    """roofline.WORK holds dcp's and moe_sharding's entries itself: a record is placed without a figure
    drawn first, and drawing one leaves the table as it was."""
    before = dict(rl.WORK)
    assert {"dcp", "moe_sharding"} <= set(before)
    for study in ("dcp", "moe_sharding"):
        plots.study_roofline(study)
    assert rl.WORK == before


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
    pts = rl.points(recs)
    assert len(pts) == len(recs)
    kinds = set()
    for r, got in zip(recs, pts.itertuples()):
        assert (got.case, got.variant, got.mode) == (r.case, r.variant, r.mode)
        w = moe_work.work_of(r)
        assert (got.bytes, got.flops) == (w["bytes"], w["flops"])
        if "bytes" in r.extra:  # the tail records: measured with tail_cost's figures, kept as written
            assert got.work.startswith("carried")
            assert (r.extra["bytes"], r.extra["flops"]) == (w["bytes"], w["flops"])
        else:
            assert got.work.startswith("derived: k3lab.studies.moe_sharding.work.work_of"), got.work
            assert "bytes" not in r.extra  # the committed record itself is not changed
        kinds.add(got.work.split(":")[0])
    assert kinds == {"carried", "derived"}  # the committed records hold both kinds
    # the figure's points say it on their hover
    fig = plots.study_roofline("moe_sharding")
    shown = [c for t in fig.data if t.customdata is not None for c in t.customdata]
    assert any(c.startswith("derived") for c in shown) and any(c.startswith("carried") for c in shown)


def test_changed_case_parameters_change_the_bytes():
    r = next(r for r in _committed("dcp") if r.case == "local_dcp8_B1_L32768")
    wider = dataclasses.replace(r, shape={**r.shape, "rows": 2 * r.shape["rows"]}, extra={})
    one, two = rl.work(r), rl.work(wider)
    assert two[0] == 2 * one[0] and two[1] == 2 * one[1]
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
    assert rl.work(odd) is None and rl.points([odd]).empty


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
    assert len(rl.points([r for r in recs if r.study == "dcp"])) >= 4


def test_mla_decode_flops_count_the_references_matrix_products():
    """The one MLA flop count against two counts made without it: by hand (per query row, head and
    cached position, a 576-wide dot for the score and a 512-wide multiply-add into the value sum, 2
    flops an element) and by torch's flop counter on the reference's own products."""
    from torch.utils.flop_counter import FlopCounterMode

    from k3lab.nn.mla import latent_attention

    per_position = 2 * 576 + 2 * 512  # score dot + value multiply-add, per query row and head
    assert per_position == 2176
    assert mla_decode.decode_flops(10, 2) == 10 * 2 * 2176 == 43_520
    assert mla_decode.decode_flops(10, 2, 4) == 4 * 43_520  # four query rows a sequence
    B, Tq, H, L = 2, 3, 5, 7
    q, cache = torch.randn(B, Tq, H, 576), torch.randn(B, L, 576)
    with FlopCounterMode(display=False) as fc:
        latent_attention(q, cache)
    assert fc.get_total_flops() == mla_decode.decode_flops(B * L, H, Tq) == B * Tq * H * L * 2176
    # the config-driven form (decode_step's parts) takes its widths
    c = K3Config.tp_slice(8)
    assert mla_decode.decode_flops(3, 1, latent=c.mla_latent_dim, value=c.kv_lora_rank) == 3 * 2176
    with pytest.raises(ValueError, match="heads"):
        mla_decode.decode_flops(8, 0)
    with pytest.raises(ValueError, match="positions"):
        mla_decode.decode_flops(2.5, 12)
