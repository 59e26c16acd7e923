"""docs/mi355x.md's per-op table is generated from the committed ISA report (k3lab.studies.mi355x_table):
the doc holds the rendered text, every compile figure in a row is a token bound to the report (so it
changes only with the report), and docs/README.md lists every page of docs/."""

import copy
import re

import pytest

from k3lab.studies import mi355x_table as m

# a compile figure: a number before a unit the ISA report measures
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:-\d+)?\s*(?:\+\s*\d+\s*)?"
                    r"(?:VGPR|AGPR|KiB|waves?/SIMD|wave|MFMA|vector FMA|programs|stages|spill|registers|"
                    r"launches|kernel)", re.I)


def test_the_doc_holds_the_generated_table():
    assert m.doc_table(m.DOC.read_text()) == m.markdown()


def test_no_compile_figure_in_a_row_is_typed():
    for row in (*m.ROWS, (m.COUNT,)):
        for cell in row:
            text = m.TOKEN.sub(" ", cell)
            for typed in m.TYPED_FIGURES:
                text = text.replace(typed, " ")
            assert not FIGURE.findall(text), (cell, FIGURE.findall(text))
    assert all(why for why in m.TYPED_FIGURES.values())


def _row(report, target, case, index):
    return next(r for r in report["rows"] if (r["target"], r["case"], r["index"]) == (target, case, index))


def test_a_figure_follows_its_report():
    report = m.load_report()
    changed = copy.deepcopy(report)
    split = _row(changed, "gfx950", "mla_decode.after_32k", 0)
    split["vgprs"] += 1
    split["shared_bytes"] += 512
    before, after = m.markdown(report), m.markdown(changed)
    assert f"{split['vgprs'] - 1} + {split['agprs']} VGPR/AGPR" in before
    assert f"{split['vgprs']} + {split['agprs']} VGPR/AGPR" in after
    assert f"{split['shared_bytes'] / 1024:.1f} KiB LDS" in after
    _row(changed, "gfx950", "mla_decode.dcp_merge", 0)["ok"] = False
    assert "| MLA decode, DCP merge | torch, or Triton `merge._merge_kernel` | no |" in m.markdown(changed)
    _row(changed, "gfx942", "moe_router.route_t64", 1)["spills"] = 3
    assert "VGPRs on gfx942, 3 spills" in m.markdown(changed)


def test_a_bad_selection_names_itself():
    report = m.load_report()
    with pytest.raises(ValueError, match="no report row for gfx950 nope"):
        m.render_token("gfx950 nope 0 vgprs", "d", report)
    with pytest.raises(ValueError, match="is not a report field"):
        m.render_token("gfx950 mla_decode.before 0 nope", "d", report)
    with pytest.raises(ValueError, match="several values"):
        m.render_token("gfx950 gemv.router * vgprs", "d", report)
    with pytest.raises(ValueError, match="TARGET CASES INDEX FIELD"):
        m.render_token("gfx950 gemv.router vgprs", "d", report)


def test_write_doc_refuses_a_file_without_markers(tmp_path):
    path = tmp_path / "mi355x.md"
    path.write_text("# no table here\n")
    with pytest.raises(ValueError, match="markers"):
        m.write_doc(path)


def test_the_docs_index_lists_every_page():
    index = (m.REPO / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (m.REPO / "docs").glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []
