"""The step model's error measured from the committed H200 records (k3lab.serving.validate): held-out shapes
disjoint from the fit, the extrapolation past batch 32, the cross-GPU fit/validate run on the H200 grid split
in two and on scaled copies whose error is known by construction, and docs/serving.md's generated table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from k3lab import bench
from k3lab.serving import stepmodel, validate

pytestmark = pytest.mark.skipif(not bench.load_records("serving", device="nvidia-h200"),
                                reason="no committed H200 serving grid records")


@pytest.fixture(scope="module")
def points():
    from k3lab.serving import inputs

    return inputs.step_points()


def _fit_all(pts):
    by = {}
    for p in pts:
        by.setdefault(p.variant, []).append(p)
    return {v: stepmodel.fit(ps, held_out=[]) for v, ps in by.items() if len(ps) >= 3}


def test_held_out_shapes_are_disjoint_from_the_fit_and_the_fit_sees_every_batch(points):
    rows = validate.held_out(points)
    by = {}
    for p in points:
        by.setdefault(p.variant, []).append(p)
    for v, pts in by.items():
        f = stepmodel.fit(pts)
        held = {(p.batch, p.context) for p in f.held_out}
        assert held and not held & {(p.batch, p.context) for p in f.fitted}, v
        # every record measured at a held-out shape left the fit (grid and decode_step records of one shape)
        assert all((p.batch, p.context) not in held for p in f.fitted)
        assert {p.batch for p in f.fitted} == {p.batch for p in pts}, v  # fitted on every measured batch
    assert {r["variant"] for r in rows} == {v for v, ps in by.items() if len(ps) >= 3}
    for r in rows:
        assert r["rel_err"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1, abs=1e-12)


def test_held_out_of_takes_every_record_of_a_shape_together():
    parts = {"weights_dense": 1e9, "weights_experts": 1e9, "mla_cache": 1e8, "kda_state": 1e7,
             "kda_conv": 1e6}

    def pt(b, c, us, src):
        p = dict(parts, mla_cache=parts["mla_cache"] * b * c / 1024, kda_state=parts["kda_state"] * b,
                 weights_experts=parts["weights_experts"] * b ** 0.5)
        return stepmodel.StepPoint("v", b, c, b, p, 4.0, us, src, stepmodel.waves(b, 12, 132))

    pts = [pt(b, c, 1000.0 + b + c / 100, "grid") for b in (1, 2, 4, 8) for c in (1024, 4096, 16384)]
    pts.append(pt(1, 4096, 1010.0, "decode_step"))  # a second record of the shape held out first
    held = stepmodel.held_out_of(pts)
    shapes = {(p.batch, p.context) for p in held}
    assert (1, 4096) in shapes
    assert sum(1 for p in held if (p.batch, p.context) == (1, 4096)) == 2
    assert not shapes & {(p.batch, p.context) for p in pts if p not in held}


def test_extrapolation_fits_below_and_tests_above(points):
    rows = validate.extrapolation(points)
    assert rows and all(r["batch"] >= validate.TEST_MIN_BATCH for r in rows)
    on = [p for p in points if p.variant == "all_on"]
    f = stepmodel.fit([p for p in on if p.batch <= validate.FIT_MAX_BATCH], held_out=[])
    for r in (r for r in rows if r["variant"] == "all_on"):
        p = next(p for p in on if (p.batch, p.context, p.source) == (r["batch"], r["context"], r["source"]))
        assert r["rel_err"] == pytest.approx(f.predict_point(p) / p.us - 1, rel=1e-9)
    # docs/serving.md says the extrapolation runs short in every variant: the mean error is negative
    for s in validate.summarize(rows):
        assert s["mean_err"] < 0, s
    with pytest.raises(ValueError, match="test_min_batch"):
        validate.extrapolation(points, fit_max_batch=64, test_min_batch=64)


def test_cross_gpu_on_the_h200_grid_split_in_two(points):
    a, b = validate.split(points)
    assert not {(p.batch, p.context) for p in a} & {(p.batch, p.context) for p in b}
    assert len(a) + len(b) == len(points)
    rows = validate.cross_gpu_both(a, b, "half A", "half B")
    fits_a = _fit_all(a)
    ab = [r for r in rows if r["fitted_on"] == "half A"]
    assert len(ab) == sum(1 for p in b if p.variant in fits_a)
    for r in ab:
        p = next(p for p in b if (p.variant, p.batch, p.context, p.source) ==
                 (r["variant"], r["batch"], r["context"], r["source"]))
        assert r["rel_err"] == pytest.approx(fits_a[p.variant].predict_point(p) / p.us - 1, rel=1e-9)
    s = validate.summarize(rows, by=("fitted_on", "variant"))
    assert {x["fitted_on"] for x in s} == {"half A", "half B"}
    assert all(x["worst_abs_err"] >= x["mean_abs_err"] > 0 for x in s)


@pytest.mark.parametrize("time_scale,bandwidth_scale", [(1.25, 1.0), (1.0, 2.0), (0.8, 1.5)])
def test_cross_gpu_reports_the_error_a_scaled_copy_has_by_construction(points, time_scale, bandwidth_scale):
    """A copy of half the grid as a device whose bytes move bandwidth_scale x as fast (its fixed part the
    same: what the projection assumes) and which is time_scale x slower on everything: fitted on the
    original, cross_gpu must report (the fit's prediction of the original - the time taken out) / the copy's
    time - 1 at every point."""
    a, _ = validate.split(points)
    fits = _fit_all(a)
    a = [p for v in sorted(fits) for p in a if p.variant == v]  # cross_gpu's row order: by variant
    copy = validate.scaled_copy(a, time_scale=time_scale, bandwidth_scale=bandwidth_scale, fits=fits)
    rows = validate.cross_gpu(a, copy, fit_device="original", test_device="copy")
    assert len(rows) == len(a)
    for p, c, r in zip(a, copy, rows):
        terms = fits[p.variant].terms(p.parts, p.tokens, p.bandwidth_tbs, p.batch, p.waves)
        moved = sum(t for k, t in terms.items() if k != "fixed") * (1 - 1 / bandwidth_scale)
        expect = (fits[p.variant].predict_point(p) - moved) / ((p.us - moved) * time_scale) - 1
        assert c.bandwidth_tbs == pytest.approx(p.bandwidth_tbs * bandwidth_scale)
        assert r["rel_err"] == pytest.approx(expect, abs=1e-9)
    if bandwidth_scale == 1.0:  # a uniformly slower device: every error moves by the factor
        mean = sum(r["rel_err"] for r in rows) / len(rows)
        assert mean == pytest.approx(1 / time_scale - 1, abs=0.02)


def test_scaled_copy_and_cross_gpu_refuse_bad_inputs(points):
    with pytest.raises(ValueError, match="bandwidth_scale"):
        validate.scaled_copy(points[:3], bandwidth_scale=2.0)
    with pytest.raises(ValueError, match="time_scale"):
        validate.scaled_copy(points[:3], time_scale=0)
    on = [p for p in points if p.variant == "all_on"]
    base = [dataclasses.replace(p, variant="other") for p in on]
    with pytest.raises(ValueError, match="share no variant"):
        validate.cross_gpu(on, base, fit_device="x", test_device="y")
    with pytest.raises(TypeError, match="StepPoint"):
        validate.held_out([{"variant": "all_on"}])


def test_model_error_without_a_second_grid_is_the_held_out_and_extrapolation_error(points, tmp_path):
    err = validate.model_error(other=str(tmp_path.name))  # no records of that device: no cross-GPU error
    assert err["kind"].startswith("held-out and extrapolation")
    rows = validate.held_out(points) + validate.extrapolation(points)
    assert err["worst"] == pytest.approx(max(abs(r["rel_err"]) for r in rows))


def test_docs_quote_the_generated_error_table():
    page = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    assert validate.report_markdown() in page


def test_model_error_takes_the_cross_gpu_error_once_a_second_grid_is_filed(tmp_path):
    """The path the H100 grid takes after `k3lab import`: records under
    profiles/nvidia-h100-80gb-hbm3/serving/ (here the H200's grid of three variants refiled as an H100's,
    its bandwidth x 0.7 and every time x 1.1) make model_error the cross-GPU error, both directions, per
    variant shared; the H100 has no decode_step records, so its steps take the H200's routing pool."""
    import json
    import shutil

    src = Path(bench.PROFILES) / "nvidia-h200"
    shutil.copytree(src / "decode_step", tmp_path / "nvidia-h200" / "decode_step")
    (tmp_path / "nvidia-h200" / "serving").mkdir(parents=True)
    h100 = tmp_path / "nvidia-h100-80gb-hbm3" / "serving"
    h100.mkdir(parents=True)
    keep = ("all_on", "base", "no_mla_padded")
    for f in (src / "serving").glob("grid.*.json"):
        shutil.copy(f, tmp_path / "nvidia-h200" / "serving" / f.name)
        recs = json.loads(f.read_text())
        if recs[0]["extra"]["grid_variant"] not in keep:
            continue
        for r in recs:
            r["device"] = "NVIDIA H100 80GB HBM3"
            r["extra"]["bandwidth_tbs"] *= 0.7
            r["median_us"] *= 1.1
        (h100 / f.name).write_text(json.dumps(recs))
    err = validate.model_error(root=tmp_path)
    assert err["kind"].startswith("cross-GPU") and set(err["per_variant"]) == set(keep)
    directions = {(r["fitted_on"], r["tested_on"]) for r in err["rows"]}
    assert directions == {("nvidia-h200", "nvidia-h100-80gb-hbm3"), ("nvidia-h100-80gb-hbm3", "nvidia-h200")}
    from k3lab.serving import inputs

    h = inputs.step_points("nvidia-h100-80gb-hbm3", tmp_path)
    assert {p.variant for p in h} == set(keep) and all(p.source.split("/")[2] == "serving" for p in h)
    assert all(r["rel_err"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1) for r in err["rows"])
    table = validate.report_markdown(root=tmp_path)  # docs/serving.md's table then carries both directions
    assert "| cross-GPU, fitted on nvidia-h200 | all_on |" in table
    assert "| cross-GPU, fitted on nvidia-h100-80gb-hbm3 | no_mla_padded |" in table
