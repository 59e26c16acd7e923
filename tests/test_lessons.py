"""The lesson helpers: predict then reveal, and a kernel's source on the page."""

import inspect
import textwrap

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
    g = lesson.predict("launches", 5, widget=True)
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
