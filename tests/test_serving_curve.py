"""The serving curve's what-ifs, the shares along it, the article comparison, and the bend (`knee`) that
notebook 09's task is graded against (the task itself: tests/test_workshop.py)."""

from __future__ import annotations

import pytest

from k3lab import bench
from k3lab.serving import article, curve, hardware

needs_records = pytest.mark.skipif(not bench.load_records("decode_step", device="nvidia-h200"),
                                   reason="no committed H200 decode_step records")


@pytest.fixture(scope="module")
def inp():
    from k3lab.serving import inputs

    return inputs.node_inputs()


# ------------------------------------------------------------------------------------ the bend
def test_knee_refuses_bad_fronts_by_name():
    with pytest.raises(ValueError, match="concurrency must rise"):
        curve.knee([2, 1], [2.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="equal lists"):
        curve.knee([1], [1.0], [1.0])
    assert curve.knee([1, 2], [10.0, 9.9], [1.0, 1.98]) == 2  # every step pays


# ------------------------------------------------------------------------------------ scenarios
def test_scenario_refuses_bad_knobs():
    with pytest.raises(ValueError, match="hit_rate"):
        curve.Scenario(hit_rate=1.5)
    with pytest.raises(ValueError, match="max_depth"):
        curve.Scenario(max_depth=curve.MAX_DEPTH + 1)
    with pytest.raises(ValueError, match="context"):
        curve.agent_workload().scaled(0)


def test_acceptance_scales_the_committed_tokens():
    assert curve.committed(3) == pytest.approx(3.0, abs=0.01)  # the seed's 3.00 at three drafts
    assert curve.committed(3, 0.8) < curve.committed(3) < curve.committed(3, 1.1) <= 4.0


@needs_records
def test_fewer_prefix_hits_and_slower_steps_lower_the_figure(inp):
    w, g, rung = curve.agent_workload(), hardware.gpu("mi355x"), curve.RUNGS[-1]
    kw = dict(dcp=1, depth=3, concurrency=8, work=w)
    base = curve.evaluate(inp, rung, g, **kw)
    fewer = curve.evaluate(inp, rung, g, scenario=curve.Scenario(hit_rate=0.8), **kw)
    slower = curve.evaluate(inp, rung, g, scenario=curve.Scenario(step_scale=1.3), **kw)
    assert fewer["tokens_per_s_gpu"] < base["tokens_per_s_gpu"] and fewer["hit_rate"] == 0.8
    assert slower["cycle_ms"] == pytest.approx(1.3 * base["cycle_ms"], rel=1e-9)
    assert slower["tokens_per_s_user"] < base["tokens_per_s_user"]


@needs_records
def test_hits_from_the_host_cost_a_restore_over_the_host_link(inp):
    """Where the live caches pass the HBM left, the host tier's share of the hits is restored over the
    GPU's host link: the request waits restore_gb / host_gbs (half the link, twice the wait; DCP8 copies
    1/8 of the MLA history), the batch's rate does not; a link too slow for the restores the configuration
    asks for recomputes the hits it cannot move, so the hit rate and the rates fall."""
    import dataclasses

    from k3lab.serving import node

    w, g, rung = curve.agent_workload(), hardware.gpu("mi355x"), curve.RUNGS[-2]
    kw = dict(depth=3, concurrency=24, work=w)
    p = curve.evaluate(inp, rung, g, dcp=1, **kw)
    ctx = w.mean_in + w.mean_out / 2
    hit, host = node.hits(w.reuse, 24, ctx, g, dcp=1, host_gb=rung.host_gb)
    assert 0 < host < hit == p["hit_rate"] and p["host_hit_rate"] == host
    assert p["restore_s"] == pytest.approx(node.restore_gb(w.mean_in, hit, host, dcp=1) / g.host_gbs)
    per_s = 24 * p["tokens_per_s_user_mean"] / w.mean_out  # requests the node serves per second
    assert p["host_link_busy"] == pytest.approx(per_s * p["restore_s"])
    half = curve.evaluate(inp, rung, dataclasses.replace(g, host_gbs=g.host_gbs / 2), dcp=1, **kw)
    assert half["restore_s"] == pytest.approx(2 * p["restore_s"])
    assert half["tokens_per_s_gpu"] == pytest.approx(p["tokens_per_s_gpu"])
    mla_only = node.restore_gb(w.mean_in, hit, host, dcp=1) - host / hit * node.sequence_gb(0, 1)
    mla_dcp8 = node.restore_gb(w.mean_in, hit, host, dcp=8) - host / hit * node.sequence_gb(0, 8)
    assert mla_dcp8 == pytest.approx(mla_only / 8)
    slow = curve.evaluate(inp, rung, dataclasses.replace(g, host_gbs=g.host_gbs * 1e-4), dcp=1, **kw)
    assert slow["host_link_busy"] <= 1.0 + 1e-9 and slow["hit_rate"] < p["hit_rate"]
    assert slow["tokens_per_s_gpu"] < p["tokens_per_s_gpu"]
    fits = curve.evaluate(inp, rung, g, dcp=1, depth=3, concurrency=4, work=w)
    assert fits["host_hit_rate"] == 0 and fits["restore_s"] == 0


def test_the_h200_host_link_is_the_committed_measurement():
    """hardware's measured host link is the agent_cache study's 64 MiB pinned copy on the H200."""
    import json
    from pathlib import Path

    f = Path(__file__).resolve().parents[1] / "profiles/nvidia-h200/agent_cache/h2d_64MiB__after.json"
    rec = json.loads(f.read_text())[0]
    assert rec["shape"]["host_memory"] == "pinned" and rec["device"] == "NVIDIA H200"
    assert hardware.gpu("h200").host_gbs == pytest.approx(rec["extra"]["gb_per_s"], rel=0.01)


@needs_records
def test_shares_at_a_target_every_rung_reaches_are_not_all_zero(inp):
    rows = curve.ladder(inp, hardware.gpu("mi355x"), curve.agent_workload())
    t = curve.reachable_target(rows)
    assert t > 0
    shares = curve.shares_at(rows, t)
    assert all(s["at_target"] > 0 for s in shares)
    assert sum(s["gain"] for s in shares) == pytest.approx(shares[-1]["at_target"])
    assert any(s["gain"] > 0 for s in shares[1:])


@needs_records
def test_the_article_walk_keeps_only_projections_with_measured_or_cited_inputs(inp):
    """The walk changes the projection only where the input is measured or cited for the configuration:
    every row is a projection, the article's figure is no row of it (bands.calibration states it as a
    ratio), and removing k3lab's own glue cannot raise the figure."""
    rows = article.steps(inp, curve.agent_workload())
    assert {r["kind"] for r in rows} == {"projected"}
    assert all(r["tokens_per_s_gpu"] != hardware.SEED["mi355x_tokens_per_s_gpu"] for r in rows)
    model, no_glue = (r["tokens_per_s_gpu"] for r in rows)
    assert model >= no_glue > 0
    assert any("80.1%" in change for change, _ in article.DROPPED)
    terms = article.terms(inp, curve.agent_workload())
    assert "total tokens/s/GPU at the target" not in {t["term"] for t in terms}
    for t in terms:
        if t["ratio_article_over_model"] is not None:
            assert t["ratio_article_over_model"] == pytest.approx(t["article"] / t["model"])


@needs_records
def test_the_models_choice_at_the_articles_targets_comes_from_its_own_figures(inp):
    """At each of the article's targets the row is the best front point of the article's stack at or above
    it; the caches and the host-tier flag are recomputed here from node's sizes; each difference from the
    article's setting is named from those figures; a target nothing reaches says so; the page's section is
    this table."""
    from pathlib import Path

    from k3lab.serving import node, validate

    work = curve.agent_workload()
    rows = article.settings(inp, work)
    assert [r["target"] for r in rows] == sorted(hardware.SEED["settings"])
    g = hardware.gpu("mi355x")
    fr = curve.front(curve.candidates(inp, curve.RUNGS[-2], g, work))
    free = node.free_gb(g)
    ctx = work.mean_in + work.mean_out / 2
    for r in rows:
        assert r["kind"] == "projected" and "worst" in r["model_error"]
        ok = [p for p in fr if p["tokens_per_s_user"] >= r["target"]]
        if not ok:
            assert r["model"] is None and "no configuration of the model reaches it" in r["why"]
            continue
        best = max(ok, key=lambda p: p["tokens_per_s_gpu"])
        assert (r["dcp"], r["depth"], r["concurrency"]) == (best["dcp"], best["depth"], best["concurrency"])
        need = best["concurrency"] * (1 + node.THINK_SHARE) * node.sequence_gb(ctx, best["dcp"])
        assert r["cache_need_gb"] == pytest.approx(need) and r["hbm_free_gb"] == pytest.approx(free)
        art = hardware.SEED["settings"][r["target"]]
        assert r["agrees_host"] == ((need > free) == art["host"])
        if need <= free and art["host"]:
            assert "fit in the" in r["why"] and "host tier holds nothing" in r["why"]
        if need > free:  # the restores it costs are named, with the figures of the chosen point
            b = curve.evaluate(inp, curve.RUNGS[-2], g, dcp=r["dcp"], depth=r["depth"],
                               concurrency=r["concurrency"], work=work)
            assert b["host_hit_rate"] > 0 and b["restore_s"] > 0
            assert f"{b['restore_s'] * 1e3:.1f} ms per request over the host link" in r["why"]
        if r["agrees_dcp"] and r["agrees_host"] and art["depths"][0] <= r["depth"] <= art["depths"][1]:
            assert r["why"].startswith("agrees")
        else:
            assert not r["why"].startswith("agrees")
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert article.settings_markdown(inp, work, validate.model_error()) in page


@needs_records
def test_the_models_choice_follows_the_caches_it_must_hold(inp, monkeypatch):
    """With ten sessions waiting on the agent per decoding one (planted; the model's share is
    node.THINK_SHARE), the live caches pass the HBM left at a target where they fitted: that row now says
    the host tier holds them and why, from the same figures."""
    from k3lab.serving import node

    work = curve.agent_workload()
    real = article.settings(inp, work)
    monkeypatch.setattr(node, "THINK_SHARE", 10.0)
    planted = article.settings(inp, work)
    moved = 0
    for r, p in zip(real, planted):
        if p["model"] is None:
            continue
        host = p["cache_need_gb"] > p["hbm_free_gb"]
        assert ("host tier on" in p["model"]) == host and ("restored from the host" in p["why"]) == host
        moved += r["model"] is not None and "GPU only" in r["model"] and host
    assert moved >= 1

@pytest.mark.parametrize("bad", [True, 0, -30.0, float("nan"), 40.0, "50"])
def test_the_settings_refuse_a_target_the_article_does_not_name(inp, bad):
    with pytest.raises(ValueError, match="targets must"):
        article.settings(inp, curve.agent_workload(), targets=[bad])


@needs_records
def test_the_whatif_refuses_a_bad_dcp_before_computing(inp):
    from k3lab.studies.serving import tables

    with pytest.raises(ValueError, match="dcp"):
        tables.whatif(inp, curve.agent_workload(), dcp="4")


@needs_records
def test_the_front_page_section_draws_every_rung_and_tells_measured_from_modelled():
    from pathlib import Path

    from k3lab.report import front

    page = front.serving_section(Path(bench.PROFILES).parent)
    for word in ("Measured:", "Modelled:", "Projected:", "<svg", "validate.*"):
        assert word in page, word
    import html

    assert all(html.escape(r.name) in page for r in curve.RUNGS)
    assert page.count("<polyline") == len(curve.RUNGS)
