"""docs/workshop.md's agenda is the one k3lab.workshop.agenda computes from the timing records, the ladder's
and the tasks' minutes; the clock moves when a record does; every notebook 00-09 is on it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from k3lab.workshop import TASKS, agenda
from k3lab.workshop.ladder import PUZZLES

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "workshop.md"


def test_the_committed_agenda_is_the_generated_one():
    doc = DOC.read_text()
    assert agenda.BEGIN in doc and agenda.END in doc, "docs/workshop.md has no generated agenda section"
    committed = agenda.BEGIN + doc.split(agenda.BEGIN, 1)[1].split(agenda.END, 1)[0] + agenda.END
    assert committed == agenda.markdown(), (
        "docs/workshop.md's agenda differs from the records: "
        "python -m k3lab.workshop.agenda docs/workshop.md")


def test_every_notebook_00_to_09_has_a_segment_and_every_task_and_rung_its_minutes():
    notebooks = [s.notebook for s in agenda.SEGMENTS]
    assert [n[:2] for n in notebooks] == [f"{i:02d}" for i in range(10)]
    text = agenda.markdown()
    for t in TASKS.values():
        assert f"task `{t.name}` {t.minutes}" in text, t.name
    for p in PUZZLES.values():
        assert f"`{p.name}`" in text, p.name   # core or stretch, every rung is on the page


def _copy_records(tmp_path: Path) -> Path:
    gpu = [p.relative_to(REPO) for p in REPO.glob("profiles/*/gpu_check/report_*")]
    for rel in [agenda.CPU_RECORD, *gpu]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    return tmp_path


def _row(text: str, notebook: str) -> str:
    """The agenda's row of `notebook` (its first cell is a clock time)."""
    return next(line for line in text.splitlines()
                if f"| `{notebook}` |" in line and ":" in line.split("|")[1])


def test_the_clock_follows_the_records(tmp_path):
    root = _copy_records(tmp_path)
    before = agenda.markdown(root)
    rec = json.loads((root / agenda.CPU_RECORD).read_text())
    rec["steps"]["notebook:05_kda_scan"]["seconds"] = 600.0   # ten minutes on the CPU
    (root / agenda.CPU_RECORD).write_text(json.dumps(rec))
    after = agenda.markdown(root)
    assert "running it 10" in _row(after, "05_kda_scan")
    assert "running it 10" not in _row(before, "05_kda_scan")

    def end(text):
        return next(line for line in text.splitlines() if line.startswith("The day ends"))
    assert end(before) != end(after)
    assert _row(before, "06_draft_depth").split("|")[1] != _row(after, "06_draft_depth").split("|")[1]
    assert "| `05_kda_scan` | 600 s" in after


def test_gpu_runs_name_their_card_and_commit_and_missing_timings_say_so(tmp_path):
    root = tmp_path
    log = root / "profiles" / "nvidia-h100-80gb-hbm3" / "gpu_check" / "report_abc1234.log"
    log.parent.mkdir(parents=True)
    log.write_text("[ 1 s] notebook 00_k3_anatomy: started\n"
                   "[ 9 s] notebook 00_k3_anatomy: passed in 8 s (slowest cell 3 s)\n"
                   "[ 9 s] notebook 01_dcp: started\n"
                   "[20 s] notebook 02_moe_sharding: FAILED: code cell 7 of 9 (index 12) raised ValueError\n")
    runs = agenda.gpu_timings(root)
    assert [label for label, _ in runs] == ["H100 at abc1234"]
    t = runs[0][1]
    assert t["00_k3_anatomy"] == agenda.Timing(8.0, "passed", 3.0)
    assert t["01_dcp"].seconds is None and t["01_dcp"].status == "not finished in the run"
    assert t["02_moe_sharding"].status == "failed at code cell 7"
    assert agenda._fmt(t.get("09_serving_curve")) == "no timing yet"


def test_the_section_is_replaced_in_place_or_appended():
    section = agenda.markdown()
    doc = "# Title\n\nbefore\n\n" + agenda.BEGIN + "\nold\n" + agenda.END + "\n\nafter\n"
    new = agenda.with_agenda(doc)
    assert new.startswith("# Title\n\nbefore\n\n") and new.endswith("\n\nafter\n") and section in new
    assert "\nold\n" not in new
    assert agenda.with_agenda("# Only a title\n").endswith(section + "\n")


def test_bad_arguments_and_an_unreadable_record_are_named(tmp_path, capsys):
    assert agenda.main([str(tmp_path / "missing.md")]) == 2
    assert "FILE must be an existing markdown file" in capsys.readouterr().err
    (tmp_path / agenda.CPU_RECORD).parent.mkdir(parents=True)
    (tmp_path / agenda.CPU_RECORD).write_text("{not json")
    with pytest.raises(ValueError, match="report_timings_2cores.json cannot be read as JSON"):
        agenda.markdown(tmp_path)


def test_what_to_cut_when_late_is_priced_from_the_definitions(monkeypatch):
    text = agenda.markdown()
    assert f"03's rung `depth_mix` ({PUZZLES['depth_mix'].minutes} min)" in text
    assert f"08's task `fix_first` ({TASKS['fix_first'].minutes} min)" in text
    row = _row(text, "07_agent_cache").split("|")[1].strip()          # e.g. 15:34-16:00
    start, end = ([int(x) for x in t.split(":")] for t in row.split("-"))
    assert f"segment 07 as a whole ({(end[0] - start[0]) * 60 + end[1] - start[1]} min)" in text
    monkeypatch.setattr(agenda, "CUTS", (("lunch", "x", "y"),))
    with pytest.raises(ValueError, match="kind must be rung, task, records or segment"):
        agenda.markdown()
