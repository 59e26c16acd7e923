"""The launch_overhead study on CPU, and the studies registry."""

from __future__ import annotations

import pytest
import torch

from k3lab import bench, studies
from k3lab.studies import launch_overhead as lo

cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="expectations for a CPU run; a GPU is present")


@pytest.fixture(scope="module")
def records():
    return lo.run()


@cpu_only
def test_cases_on_cpu():
    names = lo.case_names()
    assert names[0] == "tiny_op" and names[1] == "copy_1792B" and names[-1] == "copy_1MiB"
    assert "empty_kernel" not in names  # no GPU here


@cpu_only
def test_run_returns_sane_records(records):
    assert [r.case for r in records] == lo.case_names()
    for r in records:
        assert r.study == "launch_overhead" and r.variant == "before" and r.mode == "cpu"
        assert 0 < r.p20_us <= r.median_us <= r.p80_us < 1e5
        assert r.extra["repeats"] >= 30 and r.extra["overhead_us"] < r.median_us
        assert "not modelled on CPU" in r.extra["launch_note"]
        assert 1 <= r.extra["calls_per_sample"] <= bench.MAX_CALLS_PER_SAMPLE and r.extra["lone_call_us"] > 0
    copies = {r.case: r for r in records if r.case.startswith("copy_")}
    for r in copies.values():
        n = r.shape["bytes"]
        assert r.error["max_rel"] == 0.0 and "eager" in r.error["checked"]
        assert r.floor_us == pytest.approx(bench.floor_us(bytes=2 * n))
        assert r.extra["achieved_gbs"] == pytest.approx(2 * n / r.median_us / 1e3)
    seed = copies["copy_1792B"]
    assert seed.shape == {"bytes": 1792}
    assert seed.extra["per_decode_step_us"] == pytest.approx(69 * seed.median_us)
    # 9x the bytes cost far less than 9x the time: a small copy is overhead, not bandwidth. 16 KiB, not
    # 1 MiB: torch splits copies above 32768 elements over threads, which a busy 2-core CI box starves
    # now and then; both of these run on one thread. p20 for the same reason. Which of the two is the
    # quicker is not asserted: both are the call's overhead, and noise on a busy box swaps them.
    mid = copies["copy_16KiB"]
    assert (2 * mid.shape["bytes"] / mid.p20_us) > 2 * (2 * 1792 / seed.p20_us)
    assert copies["copy_1MiB"].median_us > seed.median_us


@cpu_only
def test_summary_and_compare(records):
    df = lo.summary(records)
    assert list(df["case"]) == lo.case_names()
    row = df.set_index("case").loc["copy_1792B"]
    assert row["eager_us"] > 0 and "graph_us" not in df  # no graph on CPU
    assert row["floor_over_eager"] == pytest.approx(row["floor_us"] / row["eager_us"])
    assert bench.compare(records)["before_us"].notna().all()


def test_a_broken_copy_is_caught():
    op = lo.measure._build("copy_4KiB")
    good = op["fn"]
    op["fn"] = lambda src, dst: dst[: dst.numel() // 2].copy_(src[: src.numel() // 2])  # copies half
    with pytest.raises(bench.CheckFailed):
        lo.measure._verify("copy_4KiB", op, graph=False)
    op["fn"] = good
    assert lo.measure._verify("copy_4KiB", op, graph=False)["max_rel"] == 0.0
    tiny = lo.measure._build("tiny_op")
    tiny["fn"] = lambda: None  # a kernel that does nothing
    with pytest.raises(bench.CheckFailed):
        lo.measure._verify("tiny_op", tiny, graph=False)


def test_bad_cases_and_preset():
    with pytest.raises(ValueError, match="copy_3B"):
        lo.run(cases=["copy_3B"])
    with pytest.raises(ValueError, match="preset"):
        lo.case_names(preset=3)
    assert {r.case for r in lo.run(cases=["copy_1792B"])} == {"copy_1792B"}


@cpu_only
def test_profile_targets_run():
    targets = lo.profile_targets()
    assert list(targets) == ["before"]  # no graph on CPU
    targets["before"]()


def test_registry_lists_studies_and_loads_lazily(monkeypatch):
    assert set(studies.STUDIES) >= {"launch_overhead", "copy_removal", "kda_decode", "mla_padding",
                                    "kda_scan",
                                    "kda_verify", "kda_precision", "draft_depth"}
    assert studies.load_study("launch_overhead") is lo
    with pytest.raises(ValueError, match="unknown study 'nope'"):
        studies.load_study("nope")
    monkeypatch.setitem(studies.STUDIES, "ghost", "k3lab.studies.ghost_study_not_written")
    with pytest.raises(ImportError, match="does not exist yet"):
        studies.load_study("ghost")
    monkeypatch.setitem(studies.STUDIES, "half", "k3lab.config")  # a module without the study contract
    with pytest.raises(studies.StudyNotAvailable, match="case_names"):
        studies.load_study("half")
    assert "launch_overhead" in studies.available() and "ghost" not in studies.available()


def test_summary_of_the_committed_h200_records():
    recs = bench.load_records(study="launch_overhead", device="nvidia-h200")
    if not recs:
        pytest.skip("no committed H200 records in profiles/")
    df = lo.summary(recs).set_index("case")
    assert list(df.index[:3]) == ["tiny_op", "empty_kernel", "empty_triton"]
    copies = df[df.index.str.startswith("copy_")]
    assert list(copies["bytes"]) == sorted(copies["bytes"])
    # the lesson in numbers: graph replay wins big on small copies, not on 64 MiB
    assert copies.loc["copy_1792B", "eager_over_graph"] > 5
    assert copies.loc["copy_64MiB", "eager_over_graph"] < 1.5
    table = bench.compare(recs).set_index("case")
    assert table.loc["copy_1792B", "mode"] == "before:eager after:graph"
    assert table.loc["copy_1792B", "speedup"] == pytest.approx(copies.loc["copy_1792B", "eager_over_graph"])


def test_summary_text_reads_its_figures_from_the_records(records):
    """What `k3lab bench launch_overhead` prints after the table: the launch costs and the seed's
    per-step copies as the records carry them (committed H200 records, and this machine's run)."""
    for recs in (bench.load_records(study="launch_overhead", device="nvidia-h200"), records):
        if not recs:
            continue
        text = lo.summary_text(recs)
        first = recs[0].extra
        if first.get("launch_eager_us") is not None:
            assert text.startswith(f"empty kernel launch: {first['launch_eager_us']:.2f} us eager, "
                                   f"{first['launch_graph_us']:.2f} us per kernel")
        else:
            assert text.startswith("launch cost is not modelled on CPU")
        seed = next(r for r in recs if r.case == "copy_1792B" and r.variant == "before")
        assert f"69 copies of 1792 B per decode step: {seed.extra['per_decode_step_us']:.1f} us eager" in text
        assert f"would take {69 * seed.floor_us:.2f} us" in text
    assert lo.summary_text([]) == ""
