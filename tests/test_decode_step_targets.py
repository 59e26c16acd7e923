"""The decode step's targets run (k3lab.studies.decode_step.targets): the targets as data, the pass/miss
table on given records, the refusal of bad arguments before anything runs, and the CPU form run end to
end through its command line (records `k3lab import` reads, what it leaves out named)."""

from __future__ import annotations

import json
import re

import pytest

from k3lab.bench.records import Record
from k3lab.studies.decode_step import measure
from k3lab.studies.decode_step import targets as tg

from cpu_child import on_a_cpu


def _rec(case: str, median_ms: float, floor_ms: float | None, *, mode: str = "graph", finite: bool = True,
         backend: str = "cuda") -> Record:
    """A whole-step record as the study writes one (case '<shape>.<variant>[.graph]')."""
    return Record(study="decode_step", case=case + (".graph" if mode == "graph" else ""), variant="after",
                  device="NVIDIA H200", backend=backend, versions={}, commit="abc1234",
                  date="2026-01-01T00:00:00+00:00", shape={"batch": 1}, dtype="bfloat16",
                  median_us=median_ms * 1e3, p20_us=median_ms * 1e3, p80_us=median_ms * 1e3,
                  floor_us=None if floor_ms is None else floor_ms * 1e3, mode=mode,
                  error={"logits_vs_reference": {"reference": "all_off_but_moe_tail_sharded", "rel_l2": 0.2,
                                                 "max_abs": 0.5, "finite": finite}})


def _by(rows: list[dict]) -> dict[tuple[str, str, str], dict]:
    return {(r["case"], r["variant"], r["target"]): r for r in rows}


def test_the_targets_are_the_issues_and_the_run_measures_only_what_they_need():
    shares = {(t.case, t.variant): t.of_floor for t in tg.TARGETS if t.of_floor is not None}
    assert shares == {("b1_1k", "all_on_default"): 0.60, ("b1_32k", "all_on_default"): 0.60,
                      ("b1_128k", "all_on_default"): 0.60, ("b64_8k", "all_on_default"): 0.80,
                      ("b1_1k", "all_on_article"): 0.70}
    assert [(t.case, t.variant, t.faster_than) for t in tg.TARGETS if t.faster_than] == [
        ("b1_1k", "all_on_article", "all_on_fp8")]
    assert tg.OF_FLOOR == {f"{c}.{v}": s for (c, v), s in shares.items()}
    assert tg.units() == [("b1_1k", "all_on_default"), ("b1_1k", "all_on_article"), ("b1_1k", "all_on_fp8"),
                          ("b1_32k", "all_on_default"), ("b1_128k", "all_on_default"),
                          ("b64_8k", "all_on_default")]
    assert tg.units(["b64_8k"]) == [("b64_8k", "all_on_default")]
    # every pair has an estimate, and the whole run fits one device call with room for the start
    assert set(tg.UNIT_S) == set(tg.units())
    assert tg.estimate_s() == tg.SETUP_S + sum(tg.UNIT_S.values()) < 550
    assert set(tg.CPU_UNIT_S) == {v for _, v in tg.units()} - set(measure.CPU_SKIPPED)
    with pytest.raises(ValueError, match="exactly one of of_floor and faster_than"):
        tg.Target("b1_1k", "all_on_default")
    with pytest.raises(ValueError, match="case must be among"):
        tg.Target("b1_2k", "all_on_default", of_floor=0.6)
    with pytest.raises(ValueError, match="faster_than must be a decode_step variant"):
        tg.Target("b1_1k", "all_on_article", faster_than="all_on_fp4")
    with pytest.raises(ValueError, match="of_floor must be a share"):
        tg.Target("b1_1k", "all_on_default", of_floor=60)


def test_the_table_passes_and_misses_against_the_records_floors():
    recs = [_rec("b1_1k.all_on_default", 10.0, 6.1),     # 61%: pass
            _rec("b1_1k.all_on_default", 30.0, 6.1, mode="eager"),  # the graph record is the one read
            _rec("b1_32k.all_on_default", 10.0, 5.9),    # 59%: miss
            _rec("b1_128k.all_on_default", 10.0, 6.5, finite=False),  # fast, but its logits not finite
            _rec("b1_1k.all_on_article", 8.0, 5.7),      # 71%: pass, and faster than FP8
            _rec("b1_1k.all_on_fp8", 9.0, 5.0),
            _rec("b64_8k.all_on_default", 100.0, 85.0, mode="eager")]  # not captured: eager, 85%
    rows = tg.target_rows(recs, left={("b64_8k", "nothing"): "unused"})
    by = _by(rows)
    assert [(r["case"], r["variant"]) for r in rows] == [
        ("b1_1k", "all_on_default"), ("b1_1k", "all_on_article"), ("b1_1k", "all_on_article"),
        ("b1_32k", "all_on_default"), ("b1_128k", "all_on_default"), ("b64_8k", "all_on_default"),
        ("b1_1k", "all_on_fp8")]
    d = by["b1_1k", "all_on_default", ">= 60% of floor"]
    assert (d["ms"], d["mode"], d["floor_ms"], d["verdict"]) == (10.0, "graph", 6.1, "pass")
    assert d["of_floor"] == pytest.approx(0.61)
    assert by["b1_32k", "all_on_default", ">= 60% of floor"]["verdict"] == "miss"
    assert by["b1_128k", "all_on_default", ">= 60% of floor"]["verdict"] == "check failed (logits not finite)"
    assert by["b1_1k", "all_on_article", ">= 70% of floor"]["verdict"] == "pass"
    faster = by["b1_1k", "all_on_article", "faster than all_on_fp8"]
    assert faster["verdict"] == "pass" and faster["note"].startswith("all_on_fp8 9.00 ms (graph)")
    b64 = by["b64_8k", "all_on_default", ">= 80% of floor"]
    assert b64["verdict"] == "pass" and b64["mode"] == "eager" and "not captured" in b64["note"]
    assert by["b1_1k", "all_on_fp8", "none (compared with all_on_article)"]["verdict"] == "-"
    # the article slower than FP8, and under its share: both its rows miss
    slow = [r for r in recs if "all_on_article" not in r.case] + [_rec("b1_1k.all_on_article", 9.5, 5.7)]
    by = _by(tg.target_rows(slow))
    assert by["b1_1k", "all_on_article", "faster than all_on_fp8"]["verdict"] == "miss"
    assert by["b1_1k", "all_on_article", ">= 70% of floor"]["verdict"] == "miss"
    # without FP8's record the comparison is not measured, and says which record it lacks
    by = _by(tg.target_rows([r for r in recs if "all_on_fp8" not in r.case]))
    row = by["b1_1k", "all_on_article", "faster than all_on_fp8"]
    assert row["verdict"] == "not measured" and "all_on_fp8 not measured" in row["note"]
    # a pair left out is named with why; its figures read NOT_MEASURED, never None
    rows = tg.target_rows(recs[:1], left={("b1_32k", "all_on_default"): "past the budget: 500 s spent"})
    by = _by(rows)
    miss = by["b1_32k", "all_on_default", ">= 60% of floor"]
    assert miss["verdict"] == "not measured" and miss["note"] == "past the budget: 500 s spent"
    assert miss["ms"] == miss["floor_ms"] == miss["of_floor"] == tg.NOT_MEASURED
    assert by["b64_8k", "all_on_default", ">= 80% of floor"]["note"] == "no record of b64_8k.all_on_default"
    text = tg.table_text(rows)
    assert text.splitlines()[0].split()[:4] == ["case", "variant", "ms", "floor"]
    assert "past the budget: 500 s spent" in text and "61%" in text and "None" not in text


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"budget_s": -1.0}, "budget_s must be a positive number"),
    ({"budget_s": 0}, "budget_s must be a positive number"),
    ({"budget_s": float("nan")}, "budget_s must be a positive number"),
    ({"budget_s": True}, "budget_s must be a positive number"),
    ({"cases": ["b1_2k"]}, r"cases must be among .*'b1_2k'"),
    ({"cases": "b1_1k"}, "cases must be a list"),
    ({"repeats": 0}, "repeats must be a positive integer"),
    ({"distinct_layers": 1.5}, "distinct_layers must be a positive integer"),
])
def test_bad_arguments_are_refused_before_anything_runs(monkeypatch, kwargs, match):
    def ran(*_a, **_k):
        raise AssertionError("the run started")

    monkeypatch.setattr(measure, "bench_weights", ran)
    monkeypatch.setattr(measure, "measure_variant", ran)
    with pytest.raises(ValueError, match=match):
        tg.run(log=ran, **kwargs)


@pytest.mark.parametrize(("argv", "flag"), [(["--budget-s", "-5"], "--budget-s"),
                                            (["--cases", "b1_2k"], "--cases"),
                                            (["--repeats", "0"], "--repeats")])
def test_the_command_refuses_bad_arguments_naming_the_flag(monkeypatch, tmp_path, capsys, argv, flag):
    monkeypatch.setattr(tg, "run", lambda *a, **k: pytest.fail("the run started"))
    assert tg.main(["--json", str(tmp_path / "t.json"), *argv]) == 2
    assert capsys.readouterr().err.startswith(f"targets: {flag} ")
    assert not (tmp_path / "t.json").exists()


@on_a_cpu
def test_the_cpu_form_runs_through_its_command_and_names_what_it_leaves_out(monkeypatch, tmp_path, capsys):
    """The command on the CPU case: the default step checked and timed (one repeat), FP8 projections left
    out by a budget its estimate does not fit, the article step and the GPU cases named as not run here;
    the records are what `k3lab import` reads, the table printed last."""
    from k3lab.cli import _read_import

    monkeypatch.setattr(tg, "CPU_UNIT_S", {"all_on_default": 1.0, "all_on_fp8": 1e6})
    out = tmp_path / "targets.json"
    assert tg.main(["--json", str(out), "--budget-s", "600", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    recs = _read_import(str(out))
    assert [r.case for r in recs] == ["tiny_b1_ctx8.all_on_default"] and recs[0].mode == "cpu"
    chk = recs[0].error["logits_vs_reference"]
    assert chk["reference"] == "all_off_but_moe_tail_sharded" and chk["finite"] and chk["rel_l2"] < 1e-4
    assert "targets: b1_1k all_on_fp8 not run: past the budget" in printed
    table = printed.rstrip().splitlines()[-8:]  # printed last: a header, six targets, FP8's row
    assert table[0].split()[:2] == ["case", "variant"]
    cols = [re.split(r"\s{2,}", line) for line in table[1:]]  # case, variant, ms, floor, %, target, ...
    rows = _by(tg.target_rows(recs, left={("b1_1k", "all_on_fp8"): "past the budget"},
                              stands_for=tg.CPU_STANDS_FOR))
    d = rows["tiny_b1_ctx8 (for b1_1k)", "all_on_default", ">= 60% of floor"]
    assert d["ms"] == pytest.approx(recs[0].median_us / 1e3) and d["floor_ms"] == recs[0].floor_us / 1e3
    assert d["verdict"].startswith("n/a")
    assert ["tiny_b1_ctx8 (for b1_1k)", "all_on_default", f"{d['ms']:.2f}"] == cols[0][:3]
    assert cols[0][6].startswith("n/a")
    named = {"all_on_fp8": "past the budget", "all_on_article": "left out on a CPU",
             "b1_32k": "a GPU case", "b1_128k": "a GPU case", "b64_8k": "a GPU case"}
    for what, why in named.items():
        lines = [c for c in cols if what in c[:2]]
        assert lines, (what, table)
        assert all(c[2] == "-" and c[6] == "not measured" and why in c[7] for c in lines), (what, table)
    assert json.loads(out.read_text())[0]["study"] == "decode_step"


@on_a_cpu
def test_a_pair_that_raises_is_named_as_failed_and_the_run_goes_on(monkeypatch, tmp_path, capsys):
    calls = []

    def boom(case, variant, *a, **k):
        calls.append(variant)
        raise RuntimeError(f"out of memory in {variant}\nsecond line")

    monkeypatch.setattr(measure, "measure_variant", boom)
    records, left = tg.run(repeats=1, log=lambda *_: None)
    assert records == [] and calls == ["all_on_default", "all_on_fp8"]  # the second pair still ran
    assert left["b1_1k", "all_on_default"] == "failed: RuntimeError: out of memory in all_on_default"
    assert left["b1_1k", "all_on_fp8"].startswith(tg.FAILED)
    # the command prints the table all the same and exits 1
    assert tg.main(["--json", str(tmp_path / "t.json"), "--repeats", "1"]) == 1
    table = capsys.readouterr().out.rstrip().splitlines()[-8:]
    assert any("all_on_default" in line and "failed: RuntimeError" in line for line in table)


def test_the_pages_targets_table_is_the_committed_records():
    """docs/decode_step.md's targets table is doc_markdown of the committed H100 records; each measured
    row's step time and verdict are recomputed here from the records; a tree without records says so."""
    from k3lab import bench
    from k3lab.studies.runs import REPO, between

    page = (REPO / "docs" / "decode_step.md").read_text()
    text = tg.doc_markdown()
    assert between(page, tg.DOC_BEGIN, tg.DOC_END) == text
    recs = bench.load_records(study="decode_step", device="nvidia-h100-80gb-hbm3")
    for row in tg.target_rows(recs, device="nvidia-h100-80gb-hbm3"):
        if row["ms"] == tg.NOT_MEASURED:
            continue
        rec = next(r for r in recs if r.case == f"{row['case']}.{row['variant']}.{row['mode']}"
                   or (row["mode"] == "eager" and r.case == f"{row['case']}.{row['variant']}"))
        assert row["ms"] == rec.median_us / 1e3
        line = f"| {row['case']} | {row['variant']} | {row['ms']:.2f} |"
        assert line in text and row["verdict"] in text
    assert "is committed" in tg.doc_markdown(device="no-such-device")
