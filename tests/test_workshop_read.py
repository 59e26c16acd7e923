"""workshop.read: a kernel read in numbered sections (markers found in order, a moved marker refused) and
the graded question after it (right, wrong, unanswered, the solutions setting)."""

import pytest

from k3lab.ops.mla_decode import merge as merge_op
from k3lab.workshop import read


def test_sections_follow_the_code_and_cover_it():
    r = read.read_kernel(merge_op._merge_kernel, [("tl.program_id", "which row"), ("tl.load", "the loads")])
    text = r.text()
    assert "## 1." in text and "## 2." in text
    shown = [line for _, lines in r.sections for line in lines]
    # every line of the kernel is in exactly one section, in order
    import inspect
    import textwrap
    src = textwrap.dedent(inspect.getsource(merge_op._merge_kernel.fn)).rstrip("\n").splitlines()
    assert shown == src
    assert "tl.program_id" in r.sections[1][1][0]


def test_a_marker_that_moved_is_refused():
    with pytest.raises(ValueError, match="not found"):
        read.read_kernel(merge_op._merge_kernel, [("tl.load", "loads"), ("no such line here", "gone")])
    # markers must come in order: the second is searched after the first
    with pytest.raises(ValueError, match="not found"):
        read.read_kernel(merge_op._merge_kernel, [("tl.store", "the store"), ("tl.program_id", "first")])


def test_a_cu_file_and_its_span():
    r = read.read_kernel("kernels/kda_decode.cu", [("__global__", "the kernel")], span=("__global__", "{"))
    assert r.where.startswith("kernels/kda_decode.cu:") and "__global__" in r.text()
    with pytest.raises(ValueError, match="no file"):
        read.read_kernel("kernels/missing.cu", [("x", "y")])


def test_question_grades_and_never_raises_for_the_answer(capsys, monkeypatch):
    monkeypatch.delenv("K3LAB_WORKSHOP_GRADE", raising=False)
    assert read.question("q", 100.0, expected=101.0, why="w") is True
    assert read.question("q", 150.0, expected=100.0, why="w") is False
    out = capsys.readouterr().out
    assert "too high" in out and "150" in out and "100" not in out.split("too high")[1]
    assert read.question("q", None, expected=100.0, why="w") is False
    assert "not answered yet" in capsys.readouterr().out
    assert read.question("q", "lots", expected=100.0, why="w") is False
    assert "not a number" in capsys.readouterr().out
    monkeypatch.setenv("K3LAB_WORKSHOP_GRADE", "solutions")
    assert read.question("q", None, expected=100.0, why="w") is True
    assert "K3LAB_WORKSHOP_GRADE=solutions" in capsys.readouterr().out


def test_question_refuses_bad_arguments():
    with pytest.raises(ValueError, match="expected"):
        read.question("q", 1.0, expected=float("nan"), why="w")
    with pytest.raises(ValueError, match="why"):
        read.question("q", 1.0, expected=1.0, why="")
    with pytest.raises(ValueError, match="rel"):
        read.question("q", 1.0, expected=1.0, rel=True, why="w")


def test_where_names_the_function_line_in_its_file():
    import inspect
    r = read.read_kernel(merge_op._merge_kernel, [("tl.load", "the loads")])
    line = inspect.getsourcelines(merge_op._merge_kernel.fn)[1]
    assert r.where == f"k3lab/ops/mla_decode/merge.py:{line}" and line > 1
    r2 = read.read_kernel(merge_op._merge_kernel, [("tl.load", "the loads")], span=("tl.load", "tl.store"))
    src = open(inspect.getsourcefile(merge_op._merge_kernel.fn)).read().splitlines()
    assert "tl.load" in src[int(r2.where.rsplit(":", 1)[1]) - 1]
