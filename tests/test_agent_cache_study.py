"""k3lab.studies.agent_cache: notebook 07's tables and figures on a small workload, and its study cases."""

import pytest

from k3lab import bench
from k3lab.config import K3Config
from k3lab.studies import agent_cache as ac


@pytest.fixture(scope="module")
def w():
    return ac.workload(sessions=6, duration_s=300.0)


def test_tables_and_figures(w):
    table = ac.workload_table(w)
    assert "prefix reuse, unlimited cache" in table.quantity.tolist()
    assert len(ac.workload_figure(w).data) == 5
    ex = ac.resume_example()
    assert ex["resume at"].tolist() == [2048, 3100] and ex["recomputed"].tolist() == [1052, 0]
    assert ac.resume_figure(ex).data
    sweep = ac.budget_sweep(w, (5, 1000))
    assert len(sweep) == 2 * len(ac.VARIANTS)
    big = sweep[sweep.budget_gb == 1000]
    assert (big.hit_rate <= w.theoretical_reuse() + 0.01).all() and (big.hit_rate > 0.8).all()
    assert ac.budget_figure(sweep, mark=5).data
    iv = ac.interval_sweep(w, 5, intervals=(0, 2048))
    assert len(iv) == 4 and ac.interval_figure(iv, 5).data
    lay = ac.layout_table(w, 5)
    tp8 = lay[(lay.layout == "tp8") & (lay.host_gb == 0)].hit_rate.to_numpy()
    assert tp8[1] >= tp8[0]


def test_restore_against_recompute():
    rate, label = ac.h2d_rate(records=[])
    assert rate == 50e9 and "not measured here" in label
    prefill, plabel = ac.prefill_rate(peak_tflops=100.0, efficiency=0.5)
    assert prefill == pytest.approx(50e12 / (2 * K3Config.tp_slice(8).param_counts()[1]))
    assert "modelled" in plabel and ac.prefill_rate(1234.0)[0] == 1234.0
    with pytest.raises(ValueError, match="efficiency"):
        ac.prefill_rate(efficiency=0)
    be = ac.break_even(rate, prefill)
    at = float(be.break_even_tokens.iloc[0])
    again = ac.break_even(rate, prefill, tokens=(at,))
    assert again.restore_ms.iloc[0] == pytest.approx(again.recompute_ms.iloc[0], rel=1e-3)


def test_h2d_rate_reads_the_best_pinned_record():
    t = bench.Timing(100.0, 90.0, 110.0, 5, "eager", 1.0)
    recs = [bench.make_record("agent_cache", f"h2d_{n}MiB", v, t, shape={"bytes": n << 20}, dtype="uint8",
                              gb_per_s=g) for n, v, g
            in ((1, "after", 60.0), (4, "after", 52.0), (4, "before", 20.0))]
    rate, label = ac.h2d_rate(records=recs)
    assert rate == 52e9 and "measured on the H200" in label


def test_headline_and_cases():
    assert ac.headline_table().value.tolist()[2:] == ["18.16 M", "9.69 M", "87.4%", "24.4%", "46.6%"]
    assert ac.case_names()[:2] == ["sim_small", "sim_hour"]
    with pytest.raises(ValueError, match="cases must be among"):
        ac.run(cases=["nope"])
    assert callable(ac.profile_targets()["after"])
