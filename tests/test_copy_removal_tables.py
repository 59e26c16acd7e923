"""copy_removal's tables (k3lab/studies/copy_removal/tables.py): the floor formula, the attn_res table's
values against the records it was built from (planted under a temporary root and the committed H200
ones), an absent record shown as not measured, and bad inputs named. CPU only: nothing is launched."""

from __future__ import annotations

import math

import pytest

from k3lab import bench
from k3lab.studies import copy_removal
from k3lab.studies.copy_removal import tables

HIDDEN = 7168


def _record(case, variant, median_us, floor_us, study="copy_removal", tokens=64, sources=9):
    mode = "graph" if "graph" in case else "eager"
    t = bench.Timing(median_us, median_us * 0.9, median_us * 1.1, 10, mode, 0.5)
    shape = {"tokens": tokens, "sources": sources, "hidden": HIDDEN}
    return bench.make_record(study, case, variant, t, shape=shape, dtype="bfloat16", floor_us=floor_us)


def _planted(tmp_path):
    recs = [_record("attn_res_t64_s9", "before", 200.0, 2.5), _record("attn_res_t64_s9", "after", 40.0, 2.5),
            _record("attn_res_t64_s9_graph", "before", 150.0, 2.5),
            _record("attn_res_t64_s9_graph", "after", 6.0, 2.5),
            _record("attn_res_t64_s9.w8", "after", 5.0, 2.5),  # a sweep point: not the library's case
            _record("pack_copy", "before", 3.0, None)]
    bench.save_records(recs, root=tmp_path)
    return recs


def test_attn_res_bytes_counts_each_source_once_and_two_writes():
    # 8 stored blocks + partial + delta read, partial + output written: 12 rows of hidden bf16 values
    assert tables.attn_res_bytes(1, 9, HIDDEN) == 12 * HIDDEN * 2
    assert tables.attn_res_bytes(8192, 2, HIDDEN, elem=4) == 8192 * HIDDEN * 4 * 5
    assert copy_removal.attn_res_bytes is tables.attn_res_bytes  # the measuring code uses the same formula
    from k3lab.studies.copy_removal import measure
    assert measure.attn_res_bytes is tables.attn_res_bytes


@pytest.mark.parametrize("kwargs, name", [({"tokens": 0}, "tokens"), ({"sources": 1.5}, "sources"),
                                          ({"hidden": -1}, "hidden"), ({"elem": True}, "elem")])
def test_attn_res_bytes_names_a_bad_size(kwargs, name):
    args = {"tokens": 1, "sources": 9, "hidden": HIDDEN, **kwargs}
    with pytest.raises(ValueError, match=name):
        tables.attn_res_bytes(**args)


def test_table_values_are_the_records_fields(tmp_path):
    planted = _planted(tmp_path)
    # make_record files the planted records under this machine's folder: cpu, or the GPU's slug on a GPU
    folder = bench.device_slug(planted[0].device, planted[0].backend)
    table = copy_removal.attn_res_table(device=folder, root=tmp_path)
    assert list(table.columns) == copy_removal.ATTN_RES_COLUMNS
    assert sorted(table["case"]) == ["attn_res_t64_s9", "attn_res_t64_s9_graph"]  # no sweep point, no pack
    by = {(r.case, r.variant): r for r in planted}
    for row in table.itertuples():
        before, after = by[(row.case, "before")], by[(row.case, "after")]
        assert row.mode == after.mode
        assert row.before_us == before.median_us and row.after_us == after.median_us
        assert row.floor_us == after.floor_us
        assert row.speedup == pytest.approx(before.median_us / after.median_us)
        assert row.floor_fraction == pytest.approx(after.floor_us / after.median_us)


def test_committed_table_matches_the_committed_records():
    recs = copy_removal.load()
    if not recs:
        pytest.skip("no committed H200 records of copy_removal in this tree")
    table = copy_removal.attn_res_table()
    attn = copy_removal.attn_res_records(recs)
    assert len(table) == len({r.case for r in attn}) == 18  # 9 shapes, eager and graph
    by = {(r.case, r.variant): r for r in attn}
    for row in table.itertuples():
        assert row.before_us == by[(row.case, "before")].median_us
        assert row.after_us == by[(row.case, "after")].median_us
        assert row.floor_us == by[(row.case, "after")].floor_us
    # the floor each record carries is attn_res_bytes at the copy bandwidth: larger shapes, larger floors
    t1 = table.set_index("case").loc["attn_res_t1_s9_graph", "floor_us"]
    t8192 = table.set_index("case").loc["attn_res_t8192_s9_graph", "floor_us"]
    ratio = tables.attn_res_bytes(8192, 9, HIDDEN) / tables.attn_res_bytes(1, 9, HIDDEN)
    assert t8192 / t1 == pytest.approx(ratio, rel=1e-6)


def test_a_missing_record_reads_not_measured(tmp_path):
    recs = [_record("attn_res_t1_s2", "before", 40.0, 0.02), _record("attn_res_t1_s2", "after", 4.0, 0.02),
            _record("attn_res_t1_s5", "before", 45.0, 0.03),  # its after record is absent
            _record("attn_res_t1_s9", "before", 50.0, None), _record("attn_res_t1_s9", "after", 5.0, None)]
    table = copy_removal.attn_res_table(recs).set_index("case")
    assert table.loc["attn_res_t1_s5", "before_us"] == 45.0
    for col in ("after_us", "speedup", "floor_fraction"):
        assert table.loc["attn_res_t1_s5", col] == copy_removal.NOT_MEASURED
    # a record measured without a floor (a CPU run) shows no floor, not NaN; its speedup stays a number
    assert table.loc["attn_res_t1_s9", "floor_us"] == copy_removal.NOT_MEASURED
    assert table.loc["attn_res_t1_s9", "speedup"] == pytest.approx(10.0)
    assert table.loc["attn_res_t1_s2", "speedup"] == pytest.approx(10.0)
    assert not any(isinstance(v, float) and math.isnan(v) for v in table.to_numpy().ravel())


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="no attn_res records of copy_removal under"):
        copy_removal.attn_res_table(device="cpu", root=tmp_path)  # an empty root
    with pytest.raises(ValueError, match="among the records given"):
        copy_removal.attn_res_table([_record("attn_res_t1_s2", "before", 1.0, None, study="kda_decode")])
    with pytest.raises(TypeError, match="records must be bench.Record"):
        copy_removal.attn_res_table([{"case": "attn_res_t1_s2"}])
    with pytest.raises(TypeError, match="device"):
        copy_removal.load(device=None)


def test_doc_headline_is_the_committed_records():
    """docs/copy_removal.md's headline rows are generated from the committed records (stale: run
    `python -m k3lab.studies.copy_removal.headline --write`), each figure the graph record's at two decimals,
    and a record re-measured (a temp copy) changes the rows."""
    from k3lab.studies.copy_removal import headline

    body = headline.in_doc(headline.DOC.read_text())
    assert body == headline.markdown(), "stale: python -m k3lab.studies.copy_removal.headline --write"
    recs = tables.load()
    by = {(r.case, r.variant): r for r in recs}
    for tokens, sources in headline.HEADLINE:
        case = f"attn_res_t{tokens}_s{sources}_graph"
        before, after = by[(case, "before")], by[(case, "after")]
        want = (f"| {tokens}, {sources} | {before.median_us:.2f} | {after.median_us:.2f} "
                f"| {after.floor_us:.2f} |")
        assert want in body.splitlines(), (want, body)
    faster = [r if (r.case, r.variant) != ("attn_res_t1_s9_graph", "after") else
              bench.Record.from_dict({**r.to_dict(), "median_us": r.median_us / 2, "p20_us": r.p20_us / 2,
                                      "p80_us": r.p80_us / 2}) for r in recs]
    assert headline.markdown(faster) != body
    without = headline.markdown([r for r in recs if not r.case.startswith("attn_res_t1_s9")])
    assert "| 1, 9 | not measured | not measured | not measured |" in without.splitlines()
