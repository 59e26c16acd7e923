"""The serving study's step-time grid: its plan, its memory rule, its time budget, and a real run of the tiny
config on a CPU (two points, the same code the GPU runs)."""

from __future__ import annotations

import json

import pytest

from k3lab import bench
from k3lab.studies.serving import measure


def test_plan_times_all_on_and_base_everywhere_then_the_single_switches_at_the_subset():
    pts = [(b, c) for b in (1, 2, 4) for c in (1024, 4096)]
    order = measure.plan(pts, subset=[(1, 4096), (8, 8)], switches=("kda_fused", "mla_padded"))
    head = order[:2 * len(pts)]
    assert {(b, c) for b, c, _ in head} == set(pts)
    assert [v for _, _, v in head] == ["all_on", "base"] * len(pts)
    # checkerboard: the first half of the points are those with even index sums
    first = [(b, c) for b, c, _ in head[:len(pts)]]
    assert all((([1, 2, 4].index(b) + [1024, 4096].index(c)) % 2) == 0 for b, c in first)
    assert order[2 * len(pts):] == [(1, 4096, "no_kda_fused"), (1, 4096, "no_mla_padded")]


@pytest.mark.parametrize("bad", [(0, 8), (1,), ("1", 8), (True, 8), (2, -1)])
def test_plan_refuses_a_bad_point_by_name(bad):
    with pytest.raises(ValueError, match="points"):
        measure.plan([bad])


def test_variant_switches():
    assert all(measure.variant_switches("all_on").values())
    base = measure.variant_switches("base")
    assert base["grouped_experts"] and not any(v for k, v in base.items() if k != "grouped_experts")
    off = measure.variant_switches("no_mla_padded")
    assert not off["mla_padded"] and sum(not v for v in off.values()) == 1
    with pytest.raises(ValueError, match="variant"):
        measure.variant_switches("no_grouped_experts")  # the per-expert loop cannot be graphed


def test_point_bytes_grows_with_batch_and_context_and_rules_out_the_largest_points():
    from k3lab.config import K3Config

    c = K3Config.tp_slice(8)
    small, wide, long = (measure.point_bytes(c, 1, 1024), measure.point_bytes(c, 8, 1024),
                         measure.point_bytes(c, 1, 8192))
    assert small < wide and small < long
    # the MLA history alone at B = 128, 128K in bf16: 24 x 128 x 131073 x 576 x 2 bytes > an H200's 141 GB
    assert measure.point_bytes(c, 128, 131072) > 141e9 > measure.point_bytes(c, 16, 16384)


def _fake_record(case: str, us: float) -> bench.Record:
    return bench.Record(study="serving", case=case, variant="after", device="cpu", backend="cpu", versions={},
                        commit="x", date="d", shape={}, dtype="float32", median_us=us, p20_us=us, p80_us=us)


def test_the_budget_stops_before_a_point_that_would_overrun_and_the_json_keeps_what_was_measured(
        monkeypatch, tmp_path):
    clock = [0.0]
    monkeypatch.setattr(measure.time, "perf_counter", lambda: clock[0])

    def fake_point(weights, batch, context, variant, **kw):
        clock[0] += 10.0  # every point takes 10 s
        return _fake_record(f"grid.b{batch}_{context}.{variant}", 1.0)

    monkeypatch.setattr(measure, "measure_point", fake_point)
    out = tmp_path / "grid.json"
    recs = measure.measure_grid([(1, 8), (2, 8), (4, 8)], variants=["all_on"], budget_s=25.0, json_path=out,
                             log=lambda *_: None)
    # 0 s -> 10 s -> 20 s; a third point would end near 35 s > 25 s
    assert len(recs) == 2
    saved = [bench.Record.from_dict(d) for d in json.loads(out.read_text())]
    assert [r.case for r in saved] == [r.case for r in recs]


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="repeats"):
        measure.measure_grid([(1, 8)], repeats=0)
    with pytest.raises(ValueError, match="budget_s"):
        measure.measure_grid([(1, 8)], budget_s=0)
    with pytest.raises(ValueError, match="variant"):
        measure.measure_grid([(1, 8)], variants=["all_off"])


@pytest.mark.follows_gpu  # the study puts its tensors on the GPU where there is one
def test_the_tiny_grid_runs_on_this_machine_and_writes_records_k3lab_import_reads(tmp_path):
    out = tmp_path / "grid.json"
    recs = measure.measure_grid([(1, 8), (1, 16)], variants=["all_on"], repeats=1, distinct_layers=1,
                             json_path=out, log=lambda *_: None)
    assert [r.case for r in recs] == ["grid.b1_8.all_on", "grid.b1_16.all_on"]
    for r in recs:
        assert r.study == "serving" and r.median_us > 0 and r.extra["logits_finite"]
        assert r.shape["batch"] == 1 and r.extra["bytes"]["mla_cache"] > 0
    # the longer history moves more bytes (the model's history term reads these parts)
    assert recs[1].extra["bytes"]["mla_cache"] > recs[0].extra["bytes"]["mla_cache"]
    saved = bench.save_records([bench.Record.from_dict(d) for d in json.loads(out.read_text())],
                               root=tmp_path / "profiles")
    assert len(saved) == 2


def test_the_second_gpu_grid_command_plans_every_variant_at_every_point(monkeypatch, tmp_path):
    """The H100 grid the lead runs (docs/serving.md): the CLI's points, variants and --switches-everywhere
    reach measure_grid, and its plan times each named variant at every point (what cross_gpu fits)."""
    seen = {}

    def fake(points, **kw):
        seen.update(kw, points=points)
        return []

    monkeypatch.setattr(measure, "measure_grid", fake)
    out = tmp_path / "g.json"
    argv = ["grid", "--json", str(out), "--budget-s", "220", "--batches", "1", "4", "16", "--contexts",
            "1024", "16384", "--variants", "all_on", "base", "no_mla_padded", "--switches-everywhere"]
    assert measure.main(argv) == 0
    assert seen["points"] == [(1, 1024), (1, 16384), (4, 1024), (4, 16384), (16, 1024), (16, 16384)]
    assert seen["subset"] == seen["points"] and seen["variants"] == ["all_on", "base", "no_mla_padded"]
    todo = [t for t in measure.plan(seen["points"], seen["subset"]) if t[2] in seen["variants"]]
    for v in seen["variants"]:
        assert {(b, c) for b, c, w in todo if w == v} == set(seen["points"])
    assert json.loads(out.read_text()) == []
