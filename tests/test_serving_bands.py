"""Projected serving curves as bands (k3lab.serving.bands) on the committed H200 records: the band holds the
central front and every one-source range, a zero step-model error leaves that source no width, the
output rate and TPOT beside total tokens follow from the front's point, the calibration is the article's
figure over the projection, and docs/serving.md's generated section is this computation."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3lab import bench
from k3lab.serving import bands, curve, hardware, inputs, validate

pytestmark = pytest.mark.skipif(not bench.load_records("decode_step", device="nvidia-h200"),
                                reason="no committed H200 decode_step records")


@pytest.fixture(scope="module")
def setup():
    inp, work, err = inputs.node_inputs(), curve.agent_workload(), validate.model_error()
    bs = {k: bands.band(inp, k, work, error=err) for k in bands.PROJECTIONS}
    return inp, work, err, bs


def test_every_projection_is_labelled_and_carries_the_measured_error(setup):
    _, _, err, bs = setup
    assert set(bs) == {"mi355x", "b300", "h200_288gb"}
    for b in bs.values():
        assert b["label"] == "projected" and b["error_kind"] == err["kind"]
        assert b["error_worst"] == err["worst"] > 0
        lo, hi = b["ends"]["step model"]
        assert lo == pytest.approx(1 / (1 - err["worst"])) and hi == pytest.approx(1 / (1 + err["worst"]))


def test_the_band_holds_the_central_front_and_each_source_alone(setup):
    _, _, _, bs = setup
    for b in bs.values():
        a = b["at_target"]
        assert a["low"] <= a["central"] <= a["high"] and a["high"] > a["low"]
        for src, (lo, hi) in b["per_source"].items():
            assert a["low"] <= min(lo, hi) and max(lo, hi) <= a["high"], (b["key"], src)
        for x in (10.0, 30.0, 50.0, 80.0):
            c, lo, hi = (curve.at_interactivity(b[k], x) for k in ("central", "low", "high"))
            assert lo <= c <= hi, (b["key"], x)


def test_output_rate_and_tpot_stand_beside_total_tokens(setup):
    _, work, _, bs = setup
    b = bs["mi355x"]
    best = max((p for p in b["central"] if p["tokens_per_s_user"] >= b["target"]),
               key=lambda p: p["tokens_per_s_gpu"])
    a = b["at_target"]
    assert a["central"] == best["tokens_per_s_gpu"]
    assert a["tpot_p90_ms"] == pytest.approx(1e3 / best["tokens_per_s_user"])
    assert 0 < a["output_tokens_per_s_gpu"] < a["central"]
    # total counts input and output: the ratio is the workload's tokens per output token (per-user mean)
    ratio = a["central"] / a["output_tokens_per_s_gpu"]
    assert ratio == pytest.approx((work.mean_in + work.mean_out) / work.mean_out, rel=1e-6)
    assert a["ttft_s_modelled"] > 0


def test_no_step_model_error_leaves_that_source_no_width(setup):
    inp, work, err, bs = setup
    none = dict(err, worst=0.0)
    b = bands.band(inp, "b300", work, error=none, per_source=True)
    lo, hi = b["per_source"]["step model"]
    assert lo == pytest.approx(hi) == pytest.approx(b["at_target"]["central"])
    assert b["at_target"]["central"] == pytest.approx(bs["b300"]["at_target"]["central"])
    with pytest.raises(ValueError, match="worst"):
        bands.band(inp, "b300", work, error=dict(err, worst=1.0))
    with pytest.raises(ValueError, match="key"):
        bands.band(inp, "h100", work, error=err)


def test_calibration_is_the_articles_figure_over_the_projection(setup):
    inp, work, err, _ = setup
    rows = bands.calibration(inp, work, error=err)
    assert [r["gpu"] for r in rows] == [hardware.gpu("mi355x").name, hardware.gpu("b300").name]
    measured = (hardware.SEED["mi355x_tokens_per_s_gpu"], hardware.SEED["b300_tokens_per_s_gpu"])
    for r, m in zip(rows, measured):
        assert r["article_measured"] == m and r["rung"] == curve.RUNGS[-2].name
        assert r["ratio_central"] == pytest.approx(m / r["projection_central"])
        lo, hi = r["ratio_range"]
        assert lo == pytest.approx(m / r["projection_high"])
        assert hi is None or hi >= r["ratio_central"] >= lo
        assert "calibration" in r["use"] and "not a check" in r["use"]


def test_docs_quote_the_generated_projection_section(setup):
    inp, work, err, bs = setup
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert bands.report_markdown(inp, work, err, bands_by_key=bs) in page


def test_the_band_figure_draws_each_projection_as_a_labelled_region_and_its_central_front(setup):
    from k3lab.studies.serving import tables

    _, _, err, bs = setup
    fig = tables.band_figure(list(bs.values()), 50.0, "projected")
    assert len(fig.data) == 2 * len(bs)
    for region, line, b in zip(fig.data[::2], fig.data[1::2], bs.values()):
        assert region.fill == "toself" and "projected" in region.name and "projected" in line.name
        assert len(region.x) == len(b["high"]) + len(b["low"]) and len(line.x) == len(b["central"])
    assert err["kind"] in fig.layout.annotations[0].text


def test_update_docs_rewrites_only_the_generated_sections(tmp_path, monkeypatch):
    from k3lab.studies.serving import tables

    page = tmp_path / "serving.md"
    page.write_text("intro\n<!-- generated: a() -->\nold a\n<!-- end generated -->\nmiddle\n"
                    "<!-- generated: b() -->\nnew b\n<!-- end generated -->\nend\n")
    monkeypatch.setattr(tables, "docs_sections", lambda root=None: {"a()": "new a", "b()": "new b"})
    assert tables.update_docs(page) == ["a()"]
    assert page.read_text() == ("intro\n<!-- generated: a() -->\nnew a\n<!-- end generated -->\nmiddle\n"
                                "<!-- generated: b() -->\nnew b\n<!-- end generated -->\nend\n")
    assert tables.update_docs(page) == []
    page.write_text("<!-- generated: c() -->\nx\n<!-- end generated -->\n")
    with pytest.raises(ValueError, match="unknown generated section"):
        tables.update_docs(page)
