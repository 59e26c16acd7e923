"""Notebooks are stored without outputs and follow the suite's shape (nbval executes them separately)."""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = json.loads(path.read_text())
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] == "code":
            assert cell.get("outputs", []) == [], f"{path.name} cell {i} has stored outputs"
            assert cell.get("execution_count") is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_starts_with_a_title_and_prints_the_setup(path):
    nb = json.loads(path.read_text())
    first = nb["cells"][0]
    assert first["cell_type"] == "markdown" and "".join(first["source"]).lstrip().startswith("#")
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "describe()" in code, f"{path.name} never prints the machine line (k3lab.env.describe())"
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert tagged, f"{path.name} has no cell tagged 'parameters'"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_cell_has_a_unique_id(path):
    # nbformat 4.5 cells carry ids; a cell added by hand without one is a validation warning today
    # and, nbformat says, a hard error in a future version
    nb = json.loads(path.read_text())
    if (nb["nbformat"], nb["nbformat_minor"]) < (4, 5):
        pytest.skip(f"{path.name} is nbformat {nb['nbformat']}.{nb['nbformat_minor']} (no cell ids)")
    ids = [c.get("id") for c in nb["cells"]]
    assert all(ids), f"{path.name}: cells {[i for i, x in enumerate(ids) if not x]} have no id"
    assert len(set(ids)) == len(ids), f"{path.name}: repeated cell ids"


# a workshop segment: narrative of at most ~2,000 words, no development history, nothing outside the repo
HISTORY = r"\b[Ii]ssue \d+|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
OUTSIDE = r"architecture\.md|anchors\.md|shared/seed|shared/k3"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_reads_as_a_workshop_segment(path):
    import re

    nb = json.loads(path.read_text())
    markdown = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown"]
    words = sum(len(m.split()) for m in markdown)
    assert words <= 2100, (
        f"{path.name}: {words} words of narrative (a segment holds ~2,000; move depth to a 0Nb notebook)"
    )
    text = "\n".join(markdown)
    assert not re.search(HISTORY, text), (
        f"{path.name} names an issue or a commit: {re.search(HISTORY, text)[0]}"
    )
    assert not re.search(OUTSIDE, text), (
        f"{path.name} points outside the repository: {re.search(OUTSIDE, text)[0]}"
    )
