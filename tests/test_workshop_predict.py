"""Predictions that count: a prediction locks when its reveal runs, each reveal shows once (guess, the
measurement labelled live or record, the ratio, why), the first reveal goes to the predictions file, and
`k3lab workshop room` draws one histogram per prediction with the measured value marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3lab import cli
from k3lab.workshop import lesson, room


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    monkeypatch.delenv("K3LAB_WORKSHOP_GRADE", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.setenv("K3LAB_PREDICTIONS", str(tmp_path / "predictions.jsonl"))
    monkeypatch.setenv("K3LAB_LEARNER", "ada")
    lesson.reset()
    yield
    lesson.reset()


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------------------------------ lock and reveal
def test_reveal_shows_guess_measurement_label_ratio_and_why(capsys):
    g = lesson.predict("MB per GPU", 500, unit="MB", name="history_mb", notebook="01_dcp", widget=False)
    assert "the reveal locks it" in capsys.readouterr().out
    r = lesson.reveal(g, 1234.0, why="positions are dealt out", record="dcp.cache_bytes_per_rank")
    out = capsys.readouterr().out
    assert out.count("you guessed") == 1  # shown once
    text = str(r)
    assert "you guessed 500 MB; measured 1,234 MB (record: dcp.cache_bytes_per_rank)" in text
    assert "measured / guess = 2.47: your guess 2.47x low" in text and "Why: positions are dealt out" in text
    live = lesson.reveal(lesson.predict("x", 4, widget=False), 2, why="w", source="this run's timer")
    assert "(live, this run's timer)" in str(live) and "your guess 2x high" in str(live)
    with pytest.raises(ValueError, match="record must name"):
        lesson.reveal(lesson.predict("y", 1, widget=False), 2, why="w", record=" ")


def test_a_prediction_locks_when_revealed(capsys):
    g = lesson.predict("launches per step", 3, name="launches", notebook="08", widget=False)
    lesson.reveal(g, 900, why="thousands of small kernels")
    capsys.readouterr()
    g.default = 900  # an edit in code after the reveal
    assert g.value == 3
    assert "prediction 'launches' is locked (revealed with your guess 3)" in capsys.readouterr().out
    again = lesson.predict("launches per step", 900, name="launches", notebook="08", widget=False)
    out = capsys.readouterr().out
    assert again is g and again.value == 3 and "this cell's 900 is not taken" in out
    assert lesson.reveal(again, 900, why="same").guess == 3
    other_notebook = lesson.predict("launches per step", 900, name="launches", notebook="09", widget=False)
    assert other_notebook is not g and other_notebook.value == 900
    lesson.reset()
    assert lesson.predict("launches per step", 900, name="launches", notebook="08", widget=False).value == 900


def test_the_box_is_disabled_and_reverts_after_the_reveal(capsys):
    pytest.importorskip("ipywidgets")
    g = lesson.predict("speedup", 2, widget=True, name="speedup")
    g.widget.value = 5.0  # before the reveal the box is the guess
    lesson.reveal(g, 10, why="w")
    capsys.readouterr()
    g.widget.value = 10.0
    assert g.widget.value == 5.0 and g.value == 5.0 and g.widget.disabled
    assert "the box keeps it" in capsys.readouterr().out
    assert g.widget.description == "guess (locked)"


# ------------------------------------------------------------------------------------ the predictions file
def test_first_reveal_appends_one_line(tmp_path):
    path = tmp_path / "predictions.jsonl"
    g = lesson.predict("MB per GPU", 500, unit="MB", name="history_mb", notebook="01_dcp", widget=False)
    lesson.reveal(g, 1234.0, why="w", record="dcp.cache_bytes_per_rank")
    lesson.reveal(g, 1234.0, why="w")  # a re-run reveal cell adds nothing
    rows = _lines(path)
    assert len(rows) == 1
    row = rows[0]
    assert set(row) == set(room.FIELDS)
    assert (row["learner"], row["notebook"], row["name"], row["guess"], row["measured"], row["unit"]) == (
        "ada", "01_dcp", "history_mb", 500.0, 1234.0, "MB")
    assert row["measured_from"] == "record: dcp.cache_bytes_per_rank" and row["time"].endswith("+00:00")


def test_what_is_recorded_where(tmp_path, monkeypatch, capsys):
    path = tmp_path / "predictions.jsonl"
    monkeypatch.setenv("K3LAB_WORKSHOP_GRADE", "solutions")  # CI's guesses are nobody's
    lesson.reveal(lesson.predict("a", 1, widget=False), 2, why="w")
    monkeypatch.delenv("K3LAB_WORKSHOP_GRADE")
    monkeypatch.setenv("K3LAB_PREDICTIONS", "off")
    lesson.reveal(lesson.predict("b", 1, widget=False), 2, why="w")
    monkeypatch.delenv("K3LAB_PREDICTIONS")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # outside a kernel, nothing goes to ~/.k3lab
    lesson.reveal(lesson.predict("c", 1, widget=False), 2, why="w")
    assert not path.exists() and not (tmp_path / "home").exists()
    monkeypatch.setattr(lesson, "_in_kernel", lambda: True)  # in a kernel: the default file
    assert room.predictions_path() == tmp_path / "home" / ".k3lab" / "predictions.jsonl"
    monkeypatch.setenv("JPY_SESSION_NAME", "/x/notebooks/07_agent_cache.ipynb")
    lesson.reveal(lesson.predict("d", 1, widget=False), 2, why="w")
    assert _lines(room.predictions_path())[0]["notebook"] == "07_agent_cache"
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    monkeypatch.setenv("K3LAB_PREDICTIONS", str(blocked / "predictions.jsonl"))  # a file where a folder goes
    capsys.readouterr()
    lesson.reveal(lesson.predict("e", 1, widget=False), 2, why="w")  # must not raise
    assert "not saved to" in capsys.readouterr().out


# ------------------------------------------------------------------------------------ the room
def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n{\"learner\": 1}\n")
    return path


def _row(learner, name, guess, measured, t, nb="01_dcp"):
    return {"learner": learner, "host": "h", "notebook": nb, "name": name, "question": f"{name}?",
            "unit": "MB", "guess": guess, "measured": measured, "measured_from": "live",
            "time": f"2025-05-01T10:00:{t:02d}+00:00"}


def test_room_keeps_each_learners_first_guess_and_draws_one_histogram_each(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_row("ada", "history_mb", 900, 1234, 5),
                                      _row("ada", "history_mb", 1234, 1234, 9),  # a later guess: ignored
                                      _row("ada", "speedup", 3, 7.5, 6, nb="04_mla_padding")])
    b = _write(tmp_path / "b.jsonl", [_row("bob", "history_mb", 20, 1234, 1), _row("cy", "history_mb", 8000,
                                                                                    1300, 2)])
    rows, skipped = room.load([a, b])
    assert len(rows) == 4 and skipped == 5  # 2 x (not json, not a prediction) + ada's later guess
    assert sorted(r["guess"] for r in rows if r["name"] == "history_mb") == [20, 900, 8000]
    table = room.summary(rows).set_index("prediction")
    assert table.loc["history_mb", "learners"] == 3 and table.loc["history_mb", "measured"] == 1234
    assert table.loc["history_mb", "within 2x"] == pytest.approx(1 / 3)
    figs = {k: room.figure(v) for k, v in room.groups(rows).items()}
    assert set(figs) == {("01_dcp", "history_mb"), ("04_mla_padding", "speedup")}
    fig = figs[("01_dcp", "history_mb")]
    assert sorted(fig.data[0].x) == pytest.approx([1.30103, 2.95424, 3.90309], abs=1e-4)  # 20..8000: log bins
    line = [s for s in fig.layout.shapes if s.type == "line"][0]
    assert line.x0 == pytest.approx(3.0913, abs=1e-4)  # the median measured, log10(1234)
    assert "measured 1,234-1,300 on different machines" in fig.layout.title.text
    lin = figs[("04_mla_padding", "speedup")]
    assert list(lin.data[0].x) == [3] and lin.layout.shapes[0].x0 == 7.5


def test_k3lab_workshop_room_writes_the_page(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [_row("ada", "history_mb", 900, 1234, 5), _row("bob", "history_mb", 20,
                                                                                    1234, 1)])
    out = tmp_path / "out" / "room.html"
    assert cli.main(["workshop", "room", str(a), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "room: 2 guesses, 1 predictions" in said and f"wrote {out}" in said
    page = out.read_text()
    assert page.count("plotly.js v") >= 1 and "01_dcp: history_mb?" in page and "<table" in page
    assert cli.main(["workshop", "room", str(tmp_path / "missing.jsonl")]) == 2
    assert "is not a file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("nothing here\n")
    assert cli.main(["workshop", "room", str(empty)]) == 2
    assert "no prediction" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ in a real kernel
def test_in_a_kernel_each_reveal_task_and_hint_shows_once(tmp_path, monkeypatch):
    """What JupyterLab shows: a reveal that ends its cell (01, 03, 06, 07 did) printed twice before."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("JPY_SESSION_NAME", str(tmp_path / "demo_nb.ipynb"))
    cells = ["from k3lab import workshop\nfrom k3lab.workshop import lesson",
             "g = lesson.predict('how many', 2.0, unit='x', name='demo')",
             "lesson.reveal(g, 4.0, why='because', record='demo record')",
             "g.widget.value = 9.0\nprint(g.value, g.widget.value, g.widget.disabled)",
             "workshop.task('curve_bend', None)",
             "workshop.hint('curve_bend')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    outs = [c.outputs for c in nb.cells]
    reveal = outs[2]
    assert [o.output_type for o in reveal] == ["display_data"], reveal
    assert "measured 4 x (record: demo record)" in reveal[0].data["text/markdown"]
    printed = "".join(o.get("text", "") for o in outs[3])
    assert "2.0 2.0 True" in printed, outs[3]  # the box reverted to the revealed guess, and is disabled
    for i in (4, 5):  # one printed line, no second display of the returned value
        assert [o.output_type for o in outs[i]] == ["stream"]
        assert len(outs[i][0].text.strip().splitlines()) == 1
    assert "not solved yet" in outs[4][0].text and "hint 1 of 3" in outs[5][0].text
    rows = _lines(tmp_path / "predictions.jsonl")
    assert [(r["notebook"], r["name"], r["guess"]) for r in rows] == [("demo_nb", "demo", 2.0)]
