"""The serving model on the measured H100 serving runs, each run held out of its costs
(k3lab.serving.validate.held_out_runs): the held-out fit never reads the held-out record, every figure is
recomputed from the records, a planted error in a held-out run is caught and named, and
docs/serving_run.md's table is the function's output."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from k3lab.serving import plan, predict, validate
from k3lab.studies import serving_run
from k3lab.studies.serving import held_out
from k3lab.studies.runs import between

REPO = Path(__file__).resolve().parent.parent
RECS = serving_run.measured(device=validate.RUNS_DEVICE)

pytestmark = pytest.mark.skipif(len(RECS) < 3, reason="fewer than three committed H100 serving-run records")


@pytest.fixture(scope="module")
def rows():
    return validate.held_out_runs(RECS)


def _corrupt(rec, k: float):
    """A copy of a record whose step terms (decode steps, prefill seconds) and measured figures are x k."""
    bad = copy.deepcopy(rec)
    s = bad.extra["summary"]
    s["decode_step_ms"] = {b: ms * k for b, ms in s["decode_step_ms"].items()}
    s["prefill_s"] *= k
    for key in ("ttft_ms", "tpot_ms"):
        s[key] = {q: (v * k if q != "count" else v) for q, v in s[key].items()}
    s["output_tokens_per_s_gpu"] /= k
    return bad


def test_the_held_out_fit_never_reads_the_held_out_record(rows):
    pred = [m + " predicted" for m in predict.METRICS]
    for i in (0, len(RECS) - 1):
        planted = RECS[:i] + [_corrupt(RECS[i], 1.5)] + RECS[i + 1:]
        again = validate.held_out_runs(planted)
        # the held-out run's prediction is the same: its record is not in its fit ...
        assert [again[i][m] for m in pred] == [rows[i][m] for m in pred]
        assert again[i]["costs"] == rows[i]["costs"]
        # ... and its measured figures are read: the comparison moves with them
        assert again[i]["ttft_p50_ms measured"] == pytest.approx(1.5 * rows[i]["ttft_p50_ms measured"])
        assert not again[i]["pass"]
        # every other run's fit reads it: their costs change
        assert all(again[j]["costs"] != rows[j]["costs"] for j in range(len(RECS)) if j != i)


def test_every_figure_is_recomputed_from_the_records(rows):
    assert [r["held_out"] for r in rows] == [r.case for r in RECS]
    for rec, row in zip(RECS, rows):
        others = [o for o in RECS if o is not rec]
        assert row["fitted_on"] == [o.case for o in others] and rec.case not in row["fitted_on"]
        costs = plan.costs_from_records(others)
        inp = predict.run_inputs(rec)
        only = predict.counted(rec)
        assert len(only) == rec.extra["summary"]["requests"]  # the requests the run's figures count
        f = predict.figures(predict.replay(inp, costs), inp["gpus"], only)
        s = rec.extra["summary"]
        meas = {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
                "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p90_ms": s["tpot_ms"]["p90"],
                "output_tokens_per_s_gpu": s["output_tokens_per_s_gpu"]}
        for m in predict.METRICS:
            assert row[f"{m} predicted"] == pytest.approx(f[m], rel=1e-12), (rec.case, m)
            assert row[f"{m} measured"] == meas[m], (rec.case, m)
            assert row[f"{m} err"] == pytest.approx(f[m] / meas[m] - 1, rel=1e-9, abs=1e-12)
        assert row["pass"] == all(abs(row[f"{m} err"]) <= predict.TOLERANCE for m in predict.METRICS)
        for b, e in row["decode_step_err"].items():
            assert e == pytest.approx(costs.decode_us(b, b, 0.0) / (s["decode_step_ms"][str(b)] * 1e3) - 1)
        assert row["prefill_err"] == pytest.approx(predict.prefill_model_s(costs, predict.measured(rec))
                                                   / s["prefill_s"] - 1)
        assert row["tolerance"] == predict.TOLERANCE


def test_prefill_model_s_is_the_fit_over_the_runs_calls_and_tokens():
    costs = plan.costs_from_records(RECS)
    a = costs.prefill_us(0, 0.0) * 1e-6
    b = (costs.prefill_us(1000, 0.0) * 1e-6 - a) / 1000
    for rec in RECS:
        m = predict.measured(rec)
        want = a * m["prefill_calls"] + b * m["prefill_tokens"]
        assert predict.prefill_model_s(costs, m) == pytest.approx(want)


@pytest.mark.parametrize("kw,term", [({"decode_scale": 1.6}, "decode step"),
                                     ({"prefill_scale": 2.5}, "prefill")])
def test_a_planted_error_in_a_held_out_run_fails_and_names_its_term(kw, term):
    """The run at concurrency 8 replaced by the replay of a run whose decode steps (or prefill) took longer
    than the other runs' fit says: the check fails on it and names that term."""
    i = next(k for k, r in enumerate(RECS) if r.case == "c8.dcp1.host")
    costs = plan.costs_from_records(RECS[:i] + RECS[i + 1:])
    planted = predict.planted(RECS[i].to_dict(), costs, **kw)
    row = validate.held_out_runs(RECS[:i] + [planted] + RECS[i + 1:])[i]
    assert not row["pass"] and row["wrong_term"] == term, row["after_substitution"]
    assert term in validate._term(row)
    clean = validate.held_out_runs(RECS[:i] + [predict.planted(RECS[i].to_dict(), costs)] + RECS[i + 1:])[i]
    assert clean["pass"] and validate._term(clean) == "none"


def test_unseen_settings_are_named():
    dcp8 = next(r for r in RECS if r.shape["dcp"] == 8)
    assert "DCP8" in validate._unseen(dcp8, [r for r in RECS if r is not dcp8])
    assert validate._unseen(dcp8, RECS) == []


def test_bad_inputs_are_refused_by_name():
    with pytest.raises(ValueError, match="three or more"):
        validate.held_out_runs(RECS[:2])
    with pytest.raises(ValueError, match="distinct cases"):
        validate.held_out_runs(RECS[:3] + [RECS[0]])


def test_docs_table_is_the_functions_output():
    page = (REPO / "docs" / "serving_run.md").read_text()
    body = between(page, validate.RUNS_BEGIN, validate.RUNS_END)
    assert body, "docs/serving_run.md lacks the held-out model check's markers"
    assert body == held_out.markdown(), "stale: run python -m k3lab.studies.serving.held_out --write"
    assert "Model check" in body and "held out" in body
