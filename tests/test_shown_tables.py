"""No table a notebook shows holds a bare NaN or None: a missing value says why (`plots.say_missing`).

Three checks: `say_missing` itself (a reason per column, a column with missing values and no reason
refused); the code of the notebooks and the library, where a bare `fillna("")` would blank a missing
value instead of saying why; and the executed notebooks of the last `k3lab report` in build/ (what
`make run` writes, and what CI runs before `make test`), for each notebook whose code is still the
stored notebook's (an older build is not this tree's): every HTML table in their outputs and widget
state (no NaN/None cell, no two blank cells in a row that has values), and every table printed as text (a
row of a `to_string()` or a DataFrame's plain repr holding NaN/None). Without a build that check skips
and says so; the planted outputs below show it fails on what it must catch.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from k3lab import plots

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "notebooks"
# a table cell whose whole text is a missing-value marker, as pandas writes it to HTML
BARE = re.compile(r"<td[^>]*>\s*(NaN|nan|None|&lt;NA&gt;|<NA>|NaT)\s*</td>")


# a printed table's missing value: the marker as a whole word, in a line of at least three columns
MARKER = re.compile(r"(?<!\S)(NaN|nan|None|<NA>|NaT)(?!\S)")
ROW = re.compile(r"<tr[^>]*>(.*?)</tr>", re.S)
CELL = re.compile(r"<td[^>]*>(.*?)</td>", re.S)
# a bare `fillna("")` in code: a missing value made blank, with no reason
BLANKING = re.compile(r"""\.fillna\(\s*(?:""|'')\s*\)""")


def bare_missing(html: str) -> list[str]:
    """The bare missing-value markers in the table cells of an HTML text."""
    return BARE.findall(html)


def blank_cells(html: str) -> list[str]:
    """The rows of an HTML table with two or more blank cells beside cells that hold values (missing
    values made blank), each as its cells' texts joined with '|'. One blank cell is let pass: a "note"
    column is empty where there is nothing to note."""
    out = []
    for row in ROW.findall(html):
        cells = [re.sub(r"<[^>]+>|&nbsp;", "", c).strip() for c in CELL.findall(row)]
        if any(cells) and cells.count("") >= 2:
            out.append("|".join(cells))
    return out


def bare_missing_text(text: str) -> list[str]:
    """The lines of a printed text that look like a table row (three or more columns) and hold a bare
    NaN/None/<NA>/NaT as one of their columns."""
    return [line for line in text.splitlines() if len(line.split()) >= 3 and MARKER.search(line)]


def test_say_missing_puts_each_columns_reason_and_keeps_the_rest():
    frame = pd.DataFrame({"ms": [1.23456, np.nan], "peer": ["fla", None], "n": [1, 2]})
    shown = plots.say_missing(frame, {"ms": "not measured on this device", "peer": "none on a CPU"}, digits=2)
    assert shown["ms"].tolist() == [1.23, "not measured on this device"]
    assert shown["peer"].tolist() == ["fla", "none on a CPU"]
    assert shown["n"].tolist() == [1, 2]
    assert frame["ms"].isna().sum() == 1 and frame["peer"].isna().sum() == 1  # the input is not changed
    assert not bare_missing(shown.to_html())
    assert len(bare_missing(frame.to_html())) == 2  # the pattern sees what pandas writes for NaN and None


def test_say_missing_takes_one_reason_for_every_column():
    frame = pd.DataFrame({"a": [np.nan, 1.0], "b": [pd.NA, "x"]})
    shown = plots.say_missing(frame, "n/a: eager only")
    assert shown.iloc[0].tolist() == ["n/a: eager only", "n/a: eager only"]


def test_say_missing_refuses_a_missing_value_without_a_reason():
    frame = pd.DataFrame({"a": [np.nan], "b": [None], "c": [1.0]})
    with pytest.raises(ValueError, match=r"column\(s\) b"):
        plots.say_missing(frame, {"a": "why a"})
    assert plots.say_missing(frame, {"a": "why a", "b": "why b"})["c"].tolist() == [1.0]  # c needs none


@pytest.mark.parametrize("why", ["", {"a": ""}, {"a": None}, 3])
def test_say_missing_refuses_an_empty_or_odd_reason(why):
    with pytest.raises(TypeError, match="why must be"):
        plots.say_missing(pd.DataFrame({"a": [np.nan]}), why)


def test_say_missing_checks_frame_and_digits():
    with pytest.raises(TypeError, match="frame must be a pandas DataFrame"):
        plots.say_missing([1.0], "x")
    with pytest.raises(ValueError, match="digits must be"):
        plots.say_missing(pd.DataFrame({"a": [1.0]}), "x", digits=-1)


def _code(nb: dict) -> dict[str, str]:
    return {c["id"]: "".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"}


def current_builds() -> list[Path]:
    """The executed notebooks in build/ whose code cells match the stored notebooks' (the same ids and
    sources), so what they show is this tree's."""
    out = []
    for path in sorted(BUILD.glob("*.ipynb")):
        stored = ROOT / "notebooks" / path.name
        if stored.is_file() and _code(json.loads(path.read_text(encoding="utf-8"))) == \
                _code(json.loads(stored.read_text(encoding="utf-8"))):
            out.append(path)
    return out


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


def shown_problems(nb: dict, name: str) -> list[str]:
    """What an executed notebook shows that breaks the rule: NaN/None in an HTML or printed table, blank
    cells beside values in an HTML table, NaN/None in a widget's table."""
    found = []
    for i, cell in enumerate(nb["cells"]):
        where = f"{name} cell {i} ({cell.get('id')})"
        for out in cell.get("outputs", []):
            html = _text(out.get("data", {}).get("text/html"))
            if bare_missing(html):
                found.append(f"{where}: {len(bare_missing(html))} bare missing values in an HTML table")
            if blank_cells(html):
                found.append(f"{where}: blank cells beside values, e.g. row {blank_cells(html)[0]!r}")
            # a table printed as text: print(frame.to_string()) (a stream), or a frame's plain repr when it
            # has no HTML form
            plain = _text(out.get("text")) if out.get("output_type") == "stream" else (
                "" if html else _text(out.get("data", {}).get("text/plain")))
            if bare_missing_text(plain):
                found.append(f"{where}: NaN/None in a printed table, e.g. "
                             f"{bare_missing_text(plain)[0].strip()!r}")
    state = json.dumps(nb.get("metadata", {}).get("widgets", {}))
    if bare_missing(state):
        found.append(f"{name}: bare missing values in a widget's table")
    return found


def _executed(outputs: list[dict]) -> dict:
    return {"cells": [{"cell_type": "code", "id": "planted", "source": "", "outputs": outputs}],
            "metadata": {}}


# notebook 06's benchmark table as it was printed (a case with no before variant), and 03's launch rule
# with the cluster kernel's rows blanked by fillna("")
PRINTED_NAN = ("cycles_depth4 1.382437e+06  69434.512501 19.909941\n"
               "random_curves          NaN 104145.603007       NaN\n")
BLANKED = ("<table><thead><tr><th></th><th>tokens</th><th>kernel</th><th>group</th>"
           "<th>stages</th><th>note</th></tr></thead><tbody>"
           "<tr><th>0</th><td>1</td><td>triton</td><td>1</td><td>3</td><td></td></tr>"
           "<tr><th>1</th><td>1</td><td>cuda_cluster</td><td></td><td></td><td></td></tr></tbody></table>")


def test_the_built_notebook_check_fails_on_planted_tables():
    stream = [{"output_type": "stream", "name": "stdout", "text": ["case before_us after_us speedup\n",
                                                                   PRINTED_NAN]}]
    assert shown_problems(_executed(stream), "06") and "random_curves" in shown_problems(_executed(stream),
                                                                                          "06")[0]
    frame = pd.DataFrame({"case": ["a", "b"], "before_us": [1.0, np.nan], "after_us": [1.0, 2.0]})
    repr_only = [{"output_type": "execute_result", "data": {"text/plain": repr(frame)}}]
    assert shown_problems(_executed(repr_only), "x")
    html = [{"output_type": "execute_result", "data": {"text/html": BLANKED, "text/plain": "..."}}]
    assert [p for p in shown_problems(_executed(html), "03") if "blank cells" in p] == [
        "03 cell 0 (planted): blank cells beside values, e.g. row '1|cuda_cluster|||'"]  # row 0's note passes
    told = frame.pipe(plots.say_missing, {"before_us": "none: one variant"})
    fixed = [{"output_type": "stream", "name": "stdout", "text": told.to_string(index=False)},
             {"output_type": "execute_result",
              "data": {"text/html": told.to_html(), "text/plain": repr(told)}}]
    assert shown_problems(_executed(fixed), "x") == []
    # prose that names None or a dict holding it is not a table
    prose = [{"output_type": "stream", "name": "stdout", "text": "peer: None\n{'a': None, 'b': 1}\nok\n"}]
    assert shown_problems(_executed(prose), "x") == []


def test_no_code_blanks_a_missing_value():
    roots = [ROOT / "notebooks", ROOT / "k3lab"]
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.ipynb")) + sorted(root.rglob("*.py")):
            if path.suffix == ".ipynb":
                cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
                sources = [(f"cell {c.get('id')}", _text(c["source"])) for c in cells
                           if c["cell_type"] == "code"]
            else:
                sources = [("", path.read_text(encoding="utf-8"))]
            found += [f"{path.relative_to(ROOT)} {where}".strip() for where, src in sources
                      if BLANKING.search(src)]
    assert BLANKING.search('frame.astype(object).fillna("")') and not BLANKING.search("fillna(0)")
    assert not found, ('fillna("") blanks a missing value without saying why (plots.say_missing gives the '
                       "reason):\n" + "\n".join(found))


def test_no_bare_nan_in_the_tables_of_the_built_notebooks():
    built = current_builds()
    if not built:
        pytest.skip("no executed notebook of this tree in build/notebooks (`make run` makes them)")
    found = []
    for path in built:
        found += shown_problems(json.loads(path.read_text(encoding="utf-8")), path.name)
    assert not found, ("tables with NaN/None or blank cells (give the reason: plots.say_missing):\n"
                       + "\n".join(found))
