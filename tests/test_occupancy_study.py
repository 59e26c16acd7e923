"""The occupancy study (k3lab.studies.occupancy): the reserve arithmetic against the committed H200
records and the ISA report, what a CPU runs instead of launching, bad input, and on a GPU the study's
own run (every level bit-identical, the levels the arithmetic plans)."""

import pytest
import torch
from cpu_child import on_a_cpu

from k3lab import bench
from k3lab.isa.targets import TARGETS
from k3lab.studies import load_study, occupancy, report_form


def _h200():
    recs = bench.load_records(occupancy.NAME, "nvidia-h200")
    assert recs, "the committed H200 records of the occupancy study are missing"
    return recs


def _levels(recs):
    return sorted(((r.extra["programs_per_unit"], r.extra["reserve_bytes"]) for r in recs), reverse=True)


def test_the_committed_levels_are_the_ones_the_arithmetic_gives():
    recs = _h200()
    unreserved = [r for r in recs if r.extra["reserve_bytes"] == 0]
    assert len(unreserved) == 1 and {r.extra["target"] for r in recs} == {"sm90"}
    shared, natural = unreserved[0].extra["shared_bytes"], unreserved[0].extra["programs_per_unit"]
    assert occupancy.reserve_levels(TARGETS["sm90"], shared, natural) == _levels(recs)
    planned = occupancy.planned_levels("prologue_16k")
    sm90 = planned[planned.target == "sm90"]
    assert sorted(zip(sm90.programs_per_unit, sm90.reserve_bytes), reverse=True) == _levels(recs)
    for r in recs:  # each record's case names its level; every level was checked bit-identical
        assert r.case == occupancy.level_case(r.extra["study_case"], r.extra["programs_per_unit"])
        assert r.extra["outputs_identical"] is True and r.variant == "after"


def test_each_level_lets_shared_memory_hold_no_more_than_its_programs():
    for name in ("sm90", "gfx950", "gfx942"):
        t = TARGETS[name]
        for shared, natural in ((40960, 2), (32768, 4), (4096, 8)):
            natural = min(natural, occupancy.blocks_by_shared(t, shared))
            levels = occupancy.reserve_levels(t, shared, natural)
            assert levels[0] == (natural, 0)
            for programs, extra in levels[1:]:
                assert occupancy.blocks_by_shared(t, shared + extra) == programs, (name, shared, extra)
                assert shared + extra <= t.shared_per_block
                # the reserve is the smallest: one byte less lets one more program in
                assert occupancy.blocks_by_shared(t, shared + extra - 1) > programs or extra == 0


def test_the_table_reads_each_level_against_the_unreserved_one():
    recs = _h200()
    table = occupancy.levels_table(recs)
    assert list(table.programs_per_unit) == sorted(table.programs_per_unit, reverse=True)
    base = next(r.median_us for r in recs if r.extra["reserve_bytes"] == 0)
    for row in table.itertuples():
        assert row.vs_unreserved == pytest.approx(row.median_us / base)
    assert "unreserved" in occupancy.summary_text(recs)


@on_a_cpu  # the study's CPU form: nothing launched, the planned levels printed
def test_on_a_cpu_the_study_says_what_it_runs_instead(capsys):
    form = report_form("occupancy", gpu=False)
    assert form.cases is None
    assert load_study("occupancy").run(preset=None, cases=form.cases, **form.kwargs) == []
    out = capsys.readouterr().out
    assert occupancy.CPU_NOTE in out and "gfx950" in out and "sm90" in out


def test_bad_input_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="cases must be among"):
        occupancy.run(cases=["nope"])
    with pytest.raises(ValueError, match="repeats must be a positive integer"):
        occupancy.run(repeats=0)
    with pytest.raises(ValueError, match="case must be one of"):
        occupancy.planned_levels("nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the occupancy study launches on a GPU")
def test_on_a_gpu_every_level_is_checked_and_timed():
    recs = occupancy.run(repeats=5)
    assert recs and all(r.extra["outputs_identical"] for r in recs)
    assert all(r.median_us > 0 and r.mode == "eager" for r in recs)
    target = recs[0].extra["target"]
    planned = occupancy.planned_levels("prologue_16k", targets=(target,))
    if torch.version.hip is None:  # the ISA report's sm90 compile is the H100/H200's binary
        assert _levels(recs) == sorted(zip(planned.programs_per_unit, planned.reserve_bytes), reverse=True)
