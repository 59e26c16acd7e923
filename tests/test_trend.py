"""Records as a trend (k3lab.profiling.trend, plots.trend, `k3lab records trend`) and the CI check that
the current tree's deterministic figures are no worse than the committed records'."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from cpu_child import on_a_cpu

from k3lab import cli, plots
from k3lab.profiling import trend

# A few kernels whose AMD ISA the CI check recompiles (gfx950, Triton's own backend on a CPU): cheap ones
# that cover a decode kernel, a verify kernel and the fused AttnRes + norm.
ISA_CASES = "attn_res_norm,kda_verify"


def test_history_holds_every_committed_version():
    from k3lab import files

    if not files.repo_is_checkout():
        pytest.skip("this tree is a copy, not a git checkout: its history is the working tree's records")
    h = trend.history("mla_padding", "ctx32k")
    assert list(h.columns) == list(trend.TREND_COLUMNS)
    assert set(h["case"]) == {"ctx32k"} and {"before", "after"} <= set(h["variant"])
    # records later overwritten are still there: more distinct measured commits than the working tree holds
    from k3lab import bench

    now = {r.commit for r in bench.load_records("mla_padding", device="nvidia-h200") if r.case == "ctx32k"}
    assert set(h["record_commit"]) > now
    assert list(h["date"]) == sorted(h["date"])
    ok = h["floor_ratio"].notna()
    assert (h.loc[ok, "floor_ratio"] == h.loc[ok, "median_us"] / h.loc[ok, "floor_us"]).all()
    assert trend.history("mla_padding", "no_such_case").empty
    with pytest.raises(ValueError, match="study"):
        trend.history("")


def test_trend_figure_and_command(tmp_path, capsys):
    h = trend.history("kda_decode", "B1_H12")
    fig = plots.trend(h, title="t")
    assert {t.name for t in fig.data} >= {"after graph", "before eager"}
    n_groups = h.groupby(["device", "variant", "mode"]).ngroups
    assert len(fig.data) == 2 * n_groups  # median and ratio to floor per group
    with pytest.raises(ValueError, match="history"):
        plots.trend(h.iloc[0:0])
    assert cli.main(["records", "trend", "kda_decode", "B1_H12", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "trend-kda_decode-B1_H12.html").is_file() and f"{len(h)} records" in out
    assert cli.main(["records", "trend", "kda_decode", "nope", "--out", str(tmp_path)]) == 2
    assert "no kda_decode records of case nope" in capsys.readouterr().err


def test_regressions_names_the_case_and_figure():
    committed = {"a": {"registers": 100.0, "spills": 0.0}, "b": {"registers": 50.0}}
    current = {"a": {"registers": 108.0, "spills": 1.0}, "b": {"registers": 40.0}, "new": {"registers": 9e9}}
    found = trend.regressions(current, committed, trend.ISA_TOLERANCE, what="ISA")
    assert found == ["ISA a: spills 0 -> 1 (tolerance +0)"]  # +8 registers is within tolerance; b improved
    current["a"]["registers"] = 109.0
    assert "ISA a: registers 100 -> 109 (tolerance +8)" in trend.regressions(current, committed,
                                                                           trend.ISA_TOLERANCE, what="ISA")


@pytest.fixture(scope="module")
def isa_now():
    from k3lab import isa

    return trend.isa_figures(isa.report(targets="gfx950", cases=ISA_CASES, workers=1))


def test_ci_isa_registers_and_spills_no_worse_than_committed(isa_now):
    committed = trend.isa_figures(trend.committed_isa_report())
    assert len(isa_now) >= 4 and set(isa_now) <= set(committed), sorted(set(isa_now) - set(committed))
    assert trend.regressions(isa_now, committed, trend.ISA_TOLERANCE, what="ISA") == []


def test_ci_isa_check_fails_on_a_planted_regression(isa_now):
    """The same check, with the committed report edited as if the kernels had been leaner: it fails and
    names the case."""
    rep = copy.deepcopy(trend.committed_isa_report())
    key = sorted(isa_now)[0]
    target, case = key.split()[:2]
    for r in rep["rows"]:
        if r["target"] == target and r["case"] == case and r.get("ok"):
            r["vgprs_total"] = r["vgprs_total"] - 40
            r["spills"] = 0
    found = trend.regressions(isa_now, trend.isa_figures(rep), trend.ISA_TOLERANCE, what="ISA")
    assert found and all(case in f for f in found) and "registers" in found[0]


def test_ci_bytes_per_step_no_worse_than_committed():
    current, committed = trend.step_bytes_figures()
    assert len(committed) >= 20
    assert trend.regressions(current, committed, trend.STEP_BYTES_TOLERANCE, what="bytes per step") == []


def test_ci_bytes_per_step_fails_on_a_planted_regression():
    """A config whose MLA cache is one byte a value wider (a planted regression of the step's bytes) fails,
    naming the cases."""
    from k3lab import bench
    from k3lab.config import K3Config

    recs = [r for r in bench.load_records("decode_step", device="nvidia-h200") if r.case.startswith("b1_32k")]
    base = K3Config.tp_slice(8)
    wider = dataclasses.replace(base, kv_lora_rank=base.kv_lora_rank + 64)
    current, committed = trend.step_bytes_figures(recs, config=wider)
    found = trend.regressions(current, committed, trend.STEP_BYTES_TOLERANCE, what="bytes per step")
    assert found and all(f.startswith("bytes per step b1_32k") for f in found)
    assert any("mla_cache" in f for f in found)


# ------------------------------------------------------------------------------ launches per step
@pytest.fixture(scope="module")
def launches_now():
    return trend.step_launch_figures()


@on_a_cpu
def test_ci_launches_per_step_no_worse_than_committed(launches_now):
    current, committed = launches_now
    assert set(current) == set(committed) == set(trend.LAUNCH_CASES)
    assert all(f["launches"] == f["triton"] + f["aten"] > 0 and f["triton"] > 0 for f in current.values())
    found = trend.regressions(current, committed, trend.STEP_LAUNCH_TOLERANCE, what="launches per step")
    assert found == [], found + trend.launch_changes(current, committed)


@on_a_cpu
def test_ci_launches_check_fails_on_a_planted_launch():
    """The every-switch-off step with one more launch in its MoE tail (a clone of its input, one aten
    kernel per MoE layer) fails the check, naming the case and the kernel that grew."""
    step = trend.launch_step("decode.before")
    tail = step.tail

    def tail_with_a_copy(*args, **kwargs):
        args[0].clone()
        return tail(*args, **kwargs)

    step.tail = tail_with_a_copy
    current, committed = trend.step_launch_figures(["decode.before"], steps={"decode.before": step})
    found = trend.regressions(current, committed, trend.STEP_LAUNCH_TOLERANCE, what="launches per step")
    assert any(f.startswith("launches per step decode.before: launches") for f in found), found
    assert any(f.startswith("launches per step decode.before: aten") for f in found), found
    changes = trend.launch_changes(current, committed)
    assert len(changes) == 1 and changes[0].startswith("decode.before: aten.clone"), changes


@on_a_cpu
def test_count_launches_counts_triton_and_aten_kernels_not_views():
    import torch

    from k3lab.ops import situ_glu

    x = torch.randn(2, 64)
    with trend.count_launches() as counts:
        x.view(4, 32).t()  # views: no kernel
        torch.empty(3)  # an allocation: no kernel
        y = x * 2
        situ_glu.situ_glu_stacked(y, backend="triton")
    assert counts["aten.mul"] == 1
    assert not any(k.startswith(("aten.view", "aten.t", "aten.empty")) for k in counts), dict(counts)
    assert sum(v for k, v in counts.items() if k.startswith("triton.")) == 1, dict(counts)


def test_launch_step_refuses_an_unknown_case():
    with pytest.raises(ValueError, match="case"):
        trend.launch_step("decode.sideways")
