"""The lesson helpers: predict then reveal, and a kernel's source on the page."""

import inspect
import json
import re
import textwrap
from pathlib import Path

import pytest

from k3lab.ops.mla_decode import merge
from k3lab.workshop import lesson


def test_predict_then_reveal_reports_the_guess_and_the_measurement(capsys):
    g = lesson.predict("MB moved per step", 2.0, unit="MB", widget=False)
    assert g.value == 2.0 and g.widget is None
    assert "Predict: MB moved per step? Your guess: 2 MB" in capsys.readouterr().out
    r = lesson.reveal(g, 1.0, why="only the state moves", source="this run")
    assert r.ratio == 0.5 and "2x high" in str(r) and "only the state moves" in str(r)
    low = lesson.reveal(lesson.predict("launches", 1, widget=False), 5, why="five kernels")
    assert "5x low" in str(low)
    exact = lesson.reveal(lesson.predict("x", 3, widget=False), 3, why="so")
    assert "exactly right" in str(exact)


def test_reveal_reads_the_box_when_one_is_drawn():
    pytest.importorskip("ipywidgets")
    g = lesson.predict("launches after the box is edited", 5, widget=True)
    g.widget.value = 1.0  # the learner edits the box after running the cell
    assert lesson.reveal(g, 1, why="one fused kernel").ratio == 1.0


def test_bad_predictions_are_named():
    with pytest.raises(ValueError, match="guess"):
        lesson.predict("q", float("nan"))
    with pytest.raises(ValueError, match="question"):
        lesson.predict("", 1.0)
    g = lesson.predict("q", 1.0, widget=False)
    with pytest.raises(ValueError, match="measured"):
        lesson.reveal(g, "3", why="w")
    with pytest.raises(ValueError, match="why"):
        lesson.reveal(g, 3.0, why=" ")
    with pytest.raises(ValueError, match="guess must be"):
        lesson.reveal(1.0, 3.0, why="w")


def test_show_source_reads_the_kernel_that_runs():
    src = lesson.show_source(merge._merge_kernel, mark=["tl.max"])
    truth = textwrap.dedent(inspect.getsource(merge._merge_kernel.fn)).rstrip("\n").splitlines()
    assert list(src.lines) == truth[: lesson.MAX_LINES] and src.total == len(truth)
    assert src.marked and all("tl.max" in src.lines[i] for i in src.marked)
    assert "k3lab/ops/mla_decode/merge.py:" in src.where
    text = str(src)
    assert text.count(">> ") == len(src.marked)
    assert "<span" in src._repr_html_() or "<pre" in src._repr_html_()
    by_path = lesson.show_source("k3lab.ops.mla_decode.merge._merge_kernel")
    assert by_path.lines == src.lines


def test_show_source_elides_past_max_lines_and_refuses_stale_marks():
    src = lesson.show_source(merge.merge_partials, max_lines=5)
    assert len(src.lines) == 5 and src.total > 5 and "more lines in" in str(src)
    with pytest.raises(ValueError, match="mark"):
        lesson.show_source(merge._merge_kernel, mark=["no such line anywhere"])
    with pytest.raises(ValueError, match="does not resolve"):
        lesson.show_source("k3lab.ops.no_such_module.f")
    with pytest.raises(ValueError, match="max_lines"):
        lesson.show_source(merge._merge_kernel, max_lines=0)


def test_show_source_span_is_an_excerpt_found_by_text():
    from k3lab.ops.kda_verify import triton as kv

    full = textwrap.dedent(inspect.getsource(kv.verify_narrow_kernel.fn)).splitlines()
    src = lesson.show_source(kv.verify_narrow_kernel, span=("qs = ()", "tl.debug_barrier()"),
                             mark=["tl.static_range(T)"])
    start = next(i for i, s in enumerate(full) if "qs = ()" in s)
    stop = next(i for i in range(start, len(full)) if "tl.debug_barrier()" in full[i])
    assert len(src.lines) == stop - start + 1 == src.total
    assert src.lines[0] == "qs = ()" and src.lines[-1] == "tl.debug_barrier()"  # dedented
    line = int(src.where.rsplit(":", 1)[1])
    assert line == inspect.getsourcelines(kv.verify_narrow_kernel.fn)[1] + start and "excerpt" in src.name
    assert len(src.marked) == 1
    with pytest.raises(ValueError, match="span start"):
        lesson.show_source(kv.verify_narrow_kernel, span=("no such text", "tl.debug_barrier()"))
    with pytest.raises(ValueError, match="span end"):
        lesson.show_source(kv.verify_narrow_kernel, span=("tl.debug_barrier()", "no such end"))
    with pytest.raises(ValueError, match="span must"):
        lesson.show_source(kv.verify_narrow_kernel, span="qs = ()")


# the lessons' shape: ~45 minutes of narrative, predict before reveal, the code and the trace diff on the page
REPO = Path(__file__).resolve().parent.parent
LESSONS = sorted((REPO / "notebooks").glob("0[1-8]_*.ipynb"))
CORE_WORDS = 1550  # ~1,500 words of markdown before an optional appendix: about 45 minutes for a learner
TRACE_DIFF = ("01", "02", "03", "04", "05", "08")  # the optimization notebooks whose before/after are kernels


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def core_words(path: Path) -> int:
    """\\w+ tokens in the markdown cells before the first '## Appendix' heading (the optional part)."""
    words = 0
    for c in _cells(path):
        text = "".join(c["source"])
        if c["cell_type"] == "markdown" and text.lstrip().startswith("## Appendix"):
            break
        if c["cell_type"] == "markdown":
            words += len(re.findall(r"\w+", text))
    return words


def test_core_words_counts_up_to_the_appendix(tmp_path):
    nb = {"cells": [{"cell_type": "markdown", "source": ["one two three"]},
                    {"cell_type": "code", "source": ["x = 1  # four five"]},
                    {"cell_type": "markdown", "source": ["## Appendix (optional)\nsix seven"]},
                    {"cell_type": "markdown", "source": ["eight"]}]}
    p = tmp_path / "nb.ipynb"
    p.write_text(json.dumps(nb))
    assert core_words(p) == 3


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_core_is_about_45_minutes(path):
    assert core_words(path) <= CORE_WORDS, (
        f"{path.name}: {core_words(path)} words before any appendix (a core lesson holds ~1,500: say it once "
        "or move depth to a 0Nb notebook, or to an '## Appendix (optional)' section at the end)")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_lesson_predicts_before_it_reveals_and_shows_its_code(path):
    code = ["".join(c["source"]) for c in _cells(path) if c["cell_type"] == "code"]
    first = lambda s: next((i for i, c in enumerate(code) if s in c), None)  # noqa: E731
    predict, reveal = first("lesson.predict("), first("lesson.reveal(")
    assert predict is not None and reveal is not None, f"{path.name}: no predict/reveal pair"
    assert predict < reveal, f"{path.name}: the reveal (code cell {reveal}) comes before the prediction"
    assert first("show_source(") is not None or first("read_kernel(") is not None, (
        f"{path.name}: no kernel or model function on the page")
    if path.name[:2] in TRACE_DIFF:
        assert first("trace_diff(") is not None or first("capture_diff(") is not None, (
            f"{path.name}: no before/after trace diff")
