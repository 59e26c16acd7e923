"""No table a notebook shows holds a bare NaN or None: a missing value says why (`plots.say_missing`).

Two checks: `say_missing` itself (a reason per column, a column with missing values and no reason
refused), and the executed notebooks of the last `k3lab report` in build/ (what `make run` writes, and
what CI runs before `make test`): every HTML table in their outputs and widget state, for each notebook
whose code is still the stored notebook's (an older build is not this tree's). Without a build that
check skips and says so.
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


def bare_missing(html: str) -> list[str]:
    """The bare missing-value markers in the table cells of an HTML text."""
    return BARE.findall(html)


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


def test_no_bare_nan_in_the_tables_of_the_built_notebooks():
    built = current_builds()
    if not built:
        pytest.skip("no executed notebook of this tree in build/notebooks (`make run` makes them)")
    found = []
    for path in built:
        nb = json.loads(path.read_text(encoding="utf-8"))
        for i, cell in enumerate(nb["cells"]):
            for out in cell.get("outputs", []):
                html = out.get("data", {}).get("text/html", "")
                html = "".join(html) if isinstance(html, list) else html
                if bare_missing(html):
                    found.append(f"{path.name} cell {i} ({cell.get('id')}): {len(bare_missing(html))} bare "
                                 f"missing values")
        state = json.dumps(nb.get("metadata", {}).get("widgets", {}))
        if bare_missing(state):
            found.append(f"{path.name}: bare missing values in a widget's table")
    assert not found, "tables with NaN/None (give the reason: plots.say_missing):\n" + "\n".join(found)
