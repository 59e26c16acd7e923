"""Notebook 01's cost model carries its measured error, computed from the committed records.

The attention line is checked against plain arithmetic on the record files, its held-out error is shown
to follow a record edited in a temporary copy (so a typed error would fail), the rows and the figure say
"model" and the error, the collectives say they are public figures, and bad inputs are named.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from k3lab import bench
from k3lab.studies import dcp as study

SRC = Path(__file__).resolve().parent.parent / "profiles" / "nvidia-h200" / "mla_padding"
CASES = ("ctx1k", "b1_8k", "ctx32k", "ragged8_8k", "b8_8k", "ctx128k", "b64_8k")

pytestmark = pytest.mark.skipif(not all((SRC / f"{c}__after.json").is_file() for c in CASES),
                                reason="the committed H200 mla_padding after records are missing")


def _graph(path: Path) -> dict:
    return next(r for r in json.loads(path.read_text()) if r["mode"] == "graph")


def _copy(tmp_path: Path) -> Path:
    """A records root holding a copy of the seven after files the model reads."""
    dst = tmp_path / "nvidia-h200" / "mla_padding"
    dst.mkdir(parents=True)
    for c in CASES:
        shutil.copy(SRC / f"{c}__after.json", dst / f"{c}__after.json")
    return tmp_path


def _edit(root: Path, case: str, mode: str, factor: float) -> None:
    path = root / "nvidia-h200" / "mla_padding" / f"{case}__after.json"
    recs = json.loads(path.read_text())
    for r in recs:
        if r["mode"] == mode:
            r["median_us"] *= factor
    path.write_text(json.dumps(recs))


def _load(root: Path) -> list:
    return bench.load_records("mla_padding", "nvidia-h200", root=root)


def test_the_line_and_its_error_are_plain_arithmetic_on_the_record_files():
    a, b = _graph(SRC / "ctx32k__after.json"), _graph(SRC / "ctx128k__after.json")
    slope = (b["median_us"] - a["median_us"]) / (b["shape"]["lengths_sum"] - a["shape"]["lengths_sum"])
    t0 = a["median_us"] - slope * a["shape"]["lengths_sum"]
    err = study.attention_fit_error()
    assert sorted(err.case) == sorted(CASES)
    want = {}
    for c in CASES:
        r = _graph(SRC / f"{c}__after.json")
        want[c] = (t0 + slope * r["shape"]["lengths_sum"] - r["median_us"]) / r["median_us"]
    got = dict(zip(err.case, err.rel_error))
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert set(err[err.role == "fit"].case) == {"ctx32k", "ctx128k"}
    held = {c: abs(v) for c, v in want.items() if c not in ("ctx32k", "ctx128k")}
    att = study.attention_model()
    assert att["heldout_worst_rel"] == pytest.approx(max(held.values()), rel=1e-12)
    assert att["heldout_case"] == max(held, key=held.get) and att["heldout_points"] == len(held)
    assert att["fit_worst_rel"] < 1e-12  # two points, two parameters: the line passes through both
    assert att["heldout_worst_rel"] > 0.01  # a real error: the held-out records are not on the line
    assert att["us_per_position"] == pytest.approx(slope) and att["t0_us"] == pytest.approx(t0)


def test_the_error_follows_an_edited_record(tmp_path):
    root = _copy(tmp_path)
    base = study.attention_model(_load(root))
    assert base == study.attention_model()  # the copy reads as the committed records do
    # a held-out record's time doubled: its error, and the worst, change to what the unchanged line gives
    _edit(root, "b64_8k", "graph", 2.0)
    err = study.attention_fit_error(_load(root))
    row = err[err.case == "b64_8k"].iloc[0]
    measured = 2 * _graph(SRC / "b64_8k__after.json")["median_us"]
    line = base["t0_us"] + base["us_per_position"] * row.positions
    assert row.rel_error == pytest.approx((line - measured) / measured, rel=1e-9)
    edited = study.attention_model(_load(root))
    assert edited["heldout_worst_rel"] == pytest.approx(abs((line - measured) / measured), rel=1e-9)
    assert edited["heldout_worst_rel"] != pytest.approx(base["heldout_worst_rel"], rel=1e-3)
    assert edited["heldout_case"] == "b64_8k"
    # a fitting record moved: the line moves, and so does every held-out error
    _edit(root, "ctx128k", "graph", 1.25)
    moved = study.attention_fit_error(_load(root))
    assert study.attention_model(_load(root))["us_per_position"] > base["us_per_position"]
    held = moved.role == "held out"
    assert (moved[held].rel_error.values != err[held].rel_error.values).all()
    # the eager timings are not the model's input
    root2 = _copy(tmp_path / "eager")
    _edit(root2, "ctx1k", "eager", 3.0)
    assert study.attention_model(_load(root2)) == base


def test_a_least_squares_fit_over_more_records_agrees_with_numpy():
    err = study.attention_fit_error(fit=("ctx32k", "ctx128k", "b64_8k"))
    pts = err[err.role == "fit"]
    slope, t0 = np.polyfit(pts.positions.astype(float), pts.measured_us, 1)
    assert err.attrs["us_per_position"] == pytest.approx(slope) and err.attrs["t0_us"] == pytest.approx(t0)
    assert (pts.rel_error.abs() > 0).any()  # three points: a residual on the fit


def test_cost_rows_say_model_carry_the_error_and_where_they_extrapolate():
    att = study.attention_model()
    cost = study.cost_model(contexts=(1_000, 32_000, 256_000), batches=(1, 64), attention=att)
    assert set(cost.kind) == {"model"} and set(cost.collectives) == {study.COLLECTIVES}
    assert "not measured" in study.COLLECTIVES and "public" in study.COLLECTIVES
    assert (cost.attention_error_pct == 100 * att["heldout_worst_rel"]).all()
    lo, hi = att["measured_positions"]
    assert (lo, hi) == (1024, 524288)  # the records' history lengths: ctx1k to b64_8k
    local = cost.batch * np.ceil(cost.context / 8)
    assert cost.beyond_records.tolist() == ((local < lo) | (cost.batch * cost.context > hi)).tolist()
    assert cost.beyond_records.any() and not cost.beyond_records.all()


def test_the_figure_says_model_and_the_error_and_draws_no_measurement():
    cost = study.cost_model(batches=(1, 64))
    att = study.attention_model()
    fig = study.cost_figure(cost)
    title = fig.layout.title.text
    assert "Model" in title and "not measured" in title and "projected for 8 GPUs" in title
    assert f"held-out error up to {100 * att['heldout_worst_rel']:.1f}%" in title
    assert study.COLLECTIVES in title and "extrapolate" in title
    assert all(t.name.startswith("model: ") for t in fig.data)
    assert all("public figure" in t.name for t in fig.data if "DCP" in t.name)
    model_values = set(np.round(pd.concat([cost.tp_us, cost.dcp_low_us, cost.dcp_high_us]), 9))
    assert all(set(np.round(t.y, 9)) <= model_values for t in fig.data)  # every point is a model row
    assert "model" in fig.layout.yaxis.title.text


def test_bad_inputs_are_named():
    att = study.attention_model()
    with pytest.raises(ValueError, match="contexts"):
        study.cost_model(contexts=(), attention=att)
    with pytest.raises(ValueError, match="batches"):
        study.cost_model(batches=(0,), attention=att)
    with pytest.raises(ValueError, match="world"):
        study.cost_model(world=0, attention=att)
    with pytest.raises(ValueError, match="merge"):
        study.cost_model(merge="ring", attention=att)
    with pytest.raises(ValueError, match="attention must be attention_model"):
        study.cost_model(attention={"t0_us": 7.0, "us_per_position": 2.7e-4})  # no measured error
    with pytest.raises(ValueError, match="no attention model"):
        study.cost_model(attention={})
    with pytest.raises(ValueError, match="table"):
        study.cost_figure(pd.DataFrame({"batch": [1], "context": [1], "tp_us": [1.0]}))
    cost = study.cost_model(contexts=(32_000,), batches=(1,), attention=att)
    with pytest.raises(ValueError, match="model rows only"):
        study.cost_figure(cost.assign(kind="measured"))
    with pytest.raises(ValueError, match="fit: no committed"):
        study.attention_fit_error(fit=("ctx32k", "ctx999k"))
    with pytest.raises(ValueError, match="two history lengths"):
        study.attention_fit_error(fit=("ctx32k",))
    with pytest.raises(TypeError, match="fit"):
        study.attention_fit_error(fit="ctx32k")
    assert study.attention_model([]) == {}  # no records: no model, and cost_model says why
