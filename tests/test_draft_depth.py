"""k3lab.studies.draft_depth: the study contract, its checks, and that they can fail."""

import numpy as np
import pytest

from k3lab import bench
from k3lab import speculative as spec
from k3lab.studies import draft_depth as dd
from k3lab.studies import load_study
from k3lab.studies.draft_depth import measure as dd_measure


@pytest.fixture
def small(monkeypatch):
    # Fewer cycles keep the test fast; the 10^6-cycle figure is the benchmark record's job.
    monkeypatch.setattr(dd_measure, "CYCLES", 40_000)
    monkeypatch.setattr(dd_measure, "RANDOM_CYCLES", 20_000)
    monkeypatch.setattr(dd_measure, "TOKEN_CYCLES", 40_000)


def test_contract():
    study = load_study("draft_depth")
    assert study is dd and dd.NAME == "draft_depth"
    names = dd.case_names()
    assert names == ["cycles_depth3", "cycles_depth4", "cycles_depth7", "random_curves", "tokens_v8_depth4"]
    targets = dd.profile_targets()
    assert set(targets) == {"before", "after"} and all(callable(f) for f in targets.values())


def test_run_checks_then_times(small):
    records = dd.run(cases=["cycles_depth4", "random_curves", "tokens_v8_depth4"])
    by = {(r.case, r.variant): r for r in records}
    assert set(by) == {("cycles_depth4", "before"), ("cycles_depth4", "after"), ("random_curves", "after"),
                       ("tokens_v8_depth4", "after")}
    for r in records:
        assert r.study == "draft_depth" and r.mode == "cpu" and r.median_us > 0
        assert 0 < r.extra["cpu_per_wall"] < 1.5  # numpy does this on one core
        # CPU time is a mean over calls and the median is of wall times: on a loaded machine one slow
        # call moves the mean, so only its sign and finiteness are a property of the code
        assert 0 < r.extra["cpu_us_per_call"] < float("inf")
    cyc = by[("cycles_depth4", "after")]
    assert cyc.shape["cycles"] == 40_000 and cyc.shape["depth"] == 4
    assert cyc.error["formula"] == pytest.approx(3.36, abs=0.005)
    assert abs(cyc.error["z"]) < 3 and cyc.error["counts_identical"] is True
    assert cyc.extra["cycles_per_s"] > 0
    assert by[("random_curves", "after")].error["max_abs_z"] < 3
    tok = by[("tokens_v8_depth4", "after")].error
    assert tok["p_value"] > 1e-3 and tok["dof"] == 8 * 7
    table = bench.compare(records)
    assert table.loc[table.case == "cycles_depth4", "speedup"].iloc[0] > 1  # vectorising pays


def test_run_raises_when_simulators_disagree(small, monkeypatch):
    real = spec.simulate_cycles_loop

    def off_by_one(*args, **kwargs):
        stats = real(*args, **kwargs)
        counts = stats.counts.copy()
        counts[0] += 1
        counts[-1] -= 1
        return spec.CycleStats(stats.depth, stats.cycles, stats.mean, stats.stderr, counts)

    monkeypatch.setattr(spec, "simulate_cycles_loop", off_by_one)
    with pytest.raises(bench.CheckFailed, match="different cycles"):
        dd.run(cases=["cycles_depth3"])


def test_run_raises_when_formula_and_simulation_disagree(small, monkeypatch):
    real = spec.expected_committed
    monkeypatch.setattr(spec, "expected_committed", lambda a, k: real(a, k) + 0.05)
    with pytest.raises(bench.CheckFailed, match="standard errors"):
        dd.run(cases=["cycles_depth3"])
    with pytest.raises(bench.CheckFailed, match="standard errors"):
        dd.run(cases=["random_curves"])


def test_run_raises_when_tokens_miss_the_target(small, monkeypatch):
    real = spec.simulate_tokens
    monkeypatch.setattr(spec, "simulate_tokens", lambda *a, **k: real(*a, **{**k, "recovery": "target"}))
    with pytest.raises(bench.CheckFailed, match="chi-square"):
        dd.run(cases=["tokens_v8_depth4"])


def test_bad_cases_and_preset():
    with pytest.raises(ValueError, match="cases"):
        dd.run(cases=["cycles_depth5"])
    with pytest.raises(ValueError, match="preset"):
        dd.case_names(preset=3)


def test_token_logits_are_random_and_conditioned():
    target, draft = dd.token_logits()
    assert target.shape == draft.shape == (8, 8)
    assert not np.allclose(target, draft)
    assert np.std(target[:, 0]) > 0.1  # rows differ: the next token depends on the previous one


def test_figures_show_the_numbers():
    ref = spec.reference_acceptance(8)
    sims = [spec.simulate_cycles(ref, k, 20_000, seed=k) for k in (3, 4)]
    fig = dd.agreement_figure(ref, sims)
    assert list(fig.data[0].x) == list(range(1, 9)) and list(fig.data[1].x) == [3, 4]
    assert fig.data[0].y[3] == pytest.approx(3.36, abs=0.005)
    bars = dd.breakeven_figure(ref)
    assert bars.data[0].y[2] == pytest.approx(12.0, abs=0.5)  # the seed's 12%: 3 -> 4 drafts
    assert len(dd.z_figure([0.5, -1.0], [2, 3]).data[0].y) == 2

    profiles = {name: spec.illustrative_costs(name) for name in spec.ILLUSTRATIVE_PROFILES}
    rates = dd.rate_figure(ref, profiles)
    stars = [t for t in rates.data if t.marker.symbol == "star"]
    assert [int(s.x[0]) for s in stars] == [spec.best_depth(ref, c).depth for c in profiles.values()]

    target, draft = dd.token_logits()
    stats = spec.simulate_tokens(target, draft, 3, 5_000, seed=1)
    tok = dd.token_figure({"residual": stats}, previous_token=2)
    assert np.allclose(tok.data[0].y, stats.target[2])
    with pytest.raises(ValueError, match="previous_token"):
        dd.token_figure({"residual": stats}, previous_token=8)


def test_explorer_follows_its_defaults():
    fig, choice = dd.explorer_figure(**dd.EXPLORER_DEFAULTS)
    curve = spec.geometric_acceptance(dd.EXPLORER_DEFAULTS["first"], dd.EXPLORER_DEFAULTS["decay"], 8)
    assert choice.depth == spec.best_depth(curve, dd.explorer_costs(
        **{k: v for k, v in dd.EXPLORER_DEFAULTS.items() if k not in ("first", "decay")})).depth
    assert f"best depth {choice.depth}" in fig.layout.title.text
    box = dd.explorer()
    sliders = box.children[0].children
    assert len(sliders) == 7 and sliders[0].value == dd.EXPLORER_DEFAULTS["first"]
