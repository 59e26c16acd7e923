"""Every figure in a lesson's prose is tied to the one value it prints.

A figure is a number with a unit of time, bandwidth, percentage, ratio ("3x", "3 times"), bytes, a
serving rate (tokens/s, tokens/s/GPU, tokens/s/user) or a count of sequences, requests or users in a
markdown cell (`k3lab.workshop.figures.FIGURE`; a range such as "90-98%" or "43.8 to 23.6 ms" is one
figure with two ends). Each markdown cell lists its figures, in the order printed, with the source of
each, in its metadata:

    "k3lab": {"figures": [["<figure as printed>", "<source>"], ...]}

A source is an arithmetic expression (numbers, + - * /, a tuple for a range) in the printed unit, whose
operands are
  - `[PATH:KEY/KEY/...]`: one field of a committed record, PATH under profiles/nvidia-h200/, keys into
    the JSON, `mode=graph` picking one record of a list (e.g.
    `[mla_padding/ctx32k__after.json:mode=graph/median_us]`, `100 * [...:rows/ctx32k/copy_share]`, a
    ratio `[...before...] / [...after...]`);
  - `k3lab.MODULE.NAME...`: a value the library computes or holds (the config, a study's quoted seed
    figures, e.g. `k3lab.studies.mla_padding.SEED_MS_PER_TOKEN['32K'][1]`);
  - `QUOTED['name']`: a published figure with no home in the library (NCCL's, a datasheet's), kept with
    its origin in `k3lab.workshop.figures.QUOTED`;
  - `NOTED['name']`: a figure k3lab measured that only a study's doc keeps (an Nsight Compute counter),
    kept in `k3lab.workshop.figures.NOTED` with the doc and the phrase of it that prints the figure.
The bound value, rounded to the printed number of decimals, must be the printed number: "16.7 µs" passes
for 16.66 and fails for 16.76. A figure with no binding, or a binding with no figure, fails too.

The planted-figure tests show the check fails: 100 random figures (random kinds and magnitudes, random
precision) either inserted unbound into random cells, or written over a bound figure of a random cell
with the binding's key updated and its source kept (someone editing the number and not the record); at
most 5 in 100 may pass.

Its limit: a number with no unit ("from 41.3 to 37.8 µs" binds both ends, "125 us against 155" binds
only the first), a size used as an adjective ("a 32-byte sector", the hardware's unit), a count of
parameters ("105B") and a number rendered by code (`lesson.prose`) are not checked here; the rendered
ones come from the records by construction.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from k3lab.workshop import figures as F

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _cells(nb: Path) -> list[dict]:
    return json.loads(nb.read_text())["cells"]


def _bindings(cell: dict):
    return cell.get("metadata", {}).get("k3lab", {}).get("figures", [])


def cell_problems(cell: dict) -> list[str]:
    if cell["cell_type"] != "markdown":
        return []
    return F.check("".join(cell["source"]), _bindings(cell))


def unbound(nb: Path) -> list[str]:
    return [f"cell {i} ({c.get('id')}): {p}" for i, c in enumerate(_cells(nb)) for p in cell_problems(c)]


def test_lessons_are_covered():
    names = {p.stem[:3] for p in NOTEBOOKS}
    assert {"00_", "04b", "05b", "09_"} <= names, sorted(names)


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_figure_is_bound_and_agrees(nb):
    bad = unbound(nb)
    assert not bad, (f"{nb.name}: figures in prose without a binding, or whose bound value is not the "
                     "printed one (k3lab.workshop.figures says how to bind one):\n" + "\n".join(bad))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_bindings_sit_only_on_markdown(nb):
    stray = [i for i, c in enumerate(_cells(nb)) if c["cell_type"] != "markdown" and _bindings(c)]
    assert not stray, f"{nb.name}: figure bindings on code cells {stray}"


# kinds of figure with plausible magnitudes: (unit, low, high)
KINDS = [("µs", 0.5, 300.0), ("us", 0.5, 300.0), ("ms", 0.5, 60.0), ("GB/s", 20.0, 900.0),
         ("TB/s", 0.5, 4.8), ("%", 1.0, 100.0), ("x", 1.05, 60.0), ("B", 16.0, 20000.0),
         ("bytes", 2.0, 2048.0), ("KB", 1.0, 228.0), ("KiB", 1.0, 228.0), ("MB", 0.5, 500.0),
         ("MiB", 0.5, 500.0), ("GB", 1.0, 300.0), ("GiB", 0.5, 100.0), ("TB", 0.1, 5.0),
         ("tokens/s/GPU", 300.0, 30000.0), ("tokens/s", 20.0, 200000.0), ("tokens/s/user", 5.0, 400.0),
         ("tok/s", 5.0, 400.0), ("times", 1.05, 60.0), ("sequences", 1, 512), ("requests", 1, 512),
         ("users", 1, 512)]
COUNTS = ("sequences", "requests", "users")


def _random_figure(rng: random.Random, unit: str | None = None) -> str:
    unit, lo, hi = next(k for k in KINDS if k[0] == unit) if unit else rng.choice(KINDS)
    value = rng.uniform(lo, hi)
    decimals = 0 if unit in COUNTS else rng.choice((0, 1, 1, 2))
    number = f"{value:,.{decimals}f}" if value >= 1000 and rng.random() < 0.5 else f"{value:.{decimals}f}"
    return f"{number}{'' if unit in ('%', 'x') else ' '}{unit}"


def _all_cells():
    return [(nb, i, c) for nb in NOTEBOOKS for i, c in enumerate(_cells(nb)) if c["cell_type"] == "markdown"]


def test_the_checks_detect_a_figure_of_every_kind():
    rng = random.Random(0)
    for unit, *_ in KINDS:
        text = _random_figure(rng, unit)
        assert [f.text for f in F.figures(f"it takes {text} here.")] == [text], text


def test_serving_rates_ratios_and_counts_are_figures():
    text = ("The node serves 23,480 tokens/s/GPU here, 41 tokens/s/user, 3 times the rate and 2.5x faster "
            "at 24 sequences; a price (\\$1.50 and \\$2.26) opens no formula: 7 tokens/s after it counts.")
    assert [f.text for f in F.figures(text)] == ["23,480 tokens/s/GPU", "41 tokens/s/user", "3 times", "2.5x",
                                                 "24 sequences", "7 tokens/s"]
    assert F.figures(text)[0].values == (23480.0,)
    # the audit's sentence, added to a bound cell of notebook 09, fails
    nb = REPO / "notebooks" / "09_serving_curve.ipynb"
    cell = next(c for c in _cells(nb) if c.get("id") == "535d3175")
    assert not cell_problems(cell)
    planted = dict(cell, source="".join(cell["source"]) + "\nThe node serves 23,480 tokens/s/GPU here.\n")
    assert cell_problems(planted)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_planted_unbound_figures_fail(seed):
    rng = random.Random(seed)
    cells = [x for x in _all_cells() if not cell_problems(x[2])]
    passed = 0
    for _ in range(100):
        nb, i, cell = rng.choice(cells)
        source = "".join(cell["source"])
        # after a sentence or a line, outside code spans and formulas (those hold no prose figures)
        prose = F._strip_code(source)
        cut = rng.choice([j + 1 for j, ch in enumerate(source) if ch in ".\n" and prose[j] == ch
                          and source[j + 1:j + 2] in ("", " ", "\n")] or [len(source)])
        planted = dict(cell, source=source[:cut] + f" The H200 takes {_random_figure(rng)} here. "
                       + source[cut:])
        passed += not cell_problems(planted)
    assert passed <= 5, f"{passed} of 100 unbound planted figures passed"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_planted_figures_over_bound_ones_fail(seed):
    # the number printed is changed and its binding's key with it, the source kept: the value must differ
    rng = random.Random(seed)
    bound = [(nb, i, c, k) for nb, i, c in _all_cells() if not cell_problems(c)
             for k, (text, _) in enumerate(_bindings(c)) if len(F.figures(text)[0].values) == 1]
    assert len(bound) >= 20, f"only {len(bound)} bound single figures to plant over"
    passed = 0
    for _ in range(100):
        nb, i, cell, k = rng.choice(bound)
        text, src = _bindings(cell)[k]
        new = _random_figure(rng, F.figures(text)[0].unit.replace("×", "x"))
        source = "".join(cell["source"])
        # overwrite the k-th printed figure
        spans = [m.span() for m in F.FIGURE.finditer(F._strip_code(source))]
        a, b = spans[k]
        bindings = [list(x) for x in _bindings(cell)]
        bindings[k] = [new, src]
        planted = dict(cell, source=source[:a] + new + source[b:], metadata={"k3lab": {"figures": bindings}})
        passed += not cell_problems(planted)
    assert passed <= 5, f"{passed} of 100 planted figures over bound ones passed"


def test_noted_figures_are_printed_in_their_docs():
    for name, (value, doc, phrase) in F.NOTED.items():
        assert f"{value:g}" in phrase, f"NOTED[{name!r}]: the phrase {phrase!r} does not print {value:g}"
        text = " ".join((REPO / doc).read_text().split())
        assert phrase in text, f"NOTED[{name!r}]: {doc} lacks {phrase!r}"


def test_a_source_names_one_field_and_rounds_at_the_printed_precision():
    src = "[mla_padding/ctx32k__after.json:mode=graph/median_us]"
    v = F.resolve(src)[0]
    ok = f"{v:.1f} µs"
    assert F.check(f"It takes {ok}.", [[ok, src]]) == []
    off = f"{v + 0.1:.1f} µs"
    assert F.check(f"It takes {off}.", [[off, src]])
    assert F.check(f"It takes {ok}.", [])  # unbound
    with pytest.raises(KeyError):
        F.field("mla_padding/ctx32k__after.json", "mode=nope/median_us")
    with pytest.raises(ValueError, match="only arithmetic"):
        F.resolve("__import__('os').getcwd()")
