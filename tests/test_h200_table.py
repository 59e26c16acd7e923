"""The README's H200 results table is generated from the committed records (k3lab.studies.h200_table): the
committed text is the rendered one, no figure is typed outside a token, and a changed record or a typed
number shows."""

import pytest

from k3lab.studies import h200_table as h


def test_readme_table_is_the_rendered_one():
    readme = (h.REPO / "README.md").read_text()
    assert h.readme_table(readme) == h.markdown()


def test_every_figure_is_a_token():
    assert h.typed_figures() == []


def test_a_typed_figure_is_found():
    rows = (*h.ROWS, ("planted", "B = 1", "12.5 us", "", "", ""))
    assert h.typed_figures(rows) == ["'planted': '12.5 us'"]


def test_a_token_follows_its_record(monkeypatch):
    from k3lab.workshop import figures as F

    cell = h.ROWS[0][2]  # the fused KDA decode's before at B = 1
    real = h.render(cell)
    monkeypatch.setattr(F, "field", lambda path, keys: 123.456)
    assert h.render(cell) == "123.46 us" != real


def test_a_broken_source_names_its_token():
    with pytest.raises(ValueError, match="no_such_record"):
        h.render("<<[kda_decode/no_such_record.json:mode=graph/median_us]|.2f>> us")


def test_rows_have_every_column():
    with pytest.raises(ValueError, match="cells"):
        h.markdown(((*h.ROWS[0][:3],),))
