"""No result record is lost: committed references are protected whether or not git can answer, a second
save merges, every write is atomic, and one bad file is skipped by name rather than hiding every record."""

from __future__ import annotations

import json
import subprocess
import warnings

import pytest

from k3lab import bench
from k3lab.bench import records as rec
from k3lab.studies.runs import DEVICES  # every device folder a claim may name


def _record(median: float, mode: str = "eager") -> bench.Record:
    return bench.Record(study="s", case="c", variant="after", device="NVIDIA H200", backend="cuda",
                        versions={"torch": "x"}, commit="abc1234", date=f"2025-01-01T00:00:{int(median):02d}",
                        shape={"B": 1}, dtype="bfloat16", median_us=median, p20_us=median, p80_us=median,
                        mode=mode)


def _medians(root) -> list[float]:
    return [r.median_us for r in bench.load_records(root=root)]


@pytest.fixture
def profiles(tmp_path, monkeypatch):
    """A committed-record tree (PROFILES) in a folder that is no git work tree."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    root = tmp_path / "profiles"
    monkeypatch.setattr(rec, "PROFILES", root)
    return root


def test_without_git_on_path_a_reference_is_not_replaced(profiles, monkeypatch):
    bench.save_records([_record(10.0)], root=profiles)
    monkeypatch.setenv("PATH", "")  # no git to ask
    with pytest.raises(FileExistsError, match="git cannot tell"):
        bench.save_records([_record(11.0)], root=profiles)
    assert _medians(profiles) == [10.0]
    bench.save_records([_record(11.0)], root=profiles, overwrite=True)  # asked for: replaced
    assert _medians(profiles) == [11.0]


def test_in_a_tree_without_git_a_reference_is_not_replaced(profiles):
    if subprocess.run(["git", "--version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("git is not installed: the case without .git needs a git that answers 'not a repository'")
    bench.save_records([_record(10.0)], root=profiles)
    with pytest.raises(FileExistsError, match="committed reference"):
        bench.save_records([_record(11.0)], root=profiles)
    assert _medians(profiles) == [10.0]


def test_a_second_save_merges_instead_of_replacing(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    root = tmp_path / "scratch"  # not PROFILES, not in git: a scratch run's records
    bench.save_records([_record(10.0, "eager"), _record(10.0, "graph")], root=root)
    bench.save_records([_record(12.0, "eager")], root=root)
    bench.save_records([_record(12.0, "eager")], root=root)  # the same record again: kept once
    got = [(r.mode, r.median_us) for r in bench.load_records(root=root)]
    assert got == [("eager", 10.0), ("graph", 10.0), ("eager", 12.0)]


def test_an_interrupted_save_leaves_the_previous_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    root = tmp_path / "scratch"
    (path,) = bench.save_records([_record(10.0)], root=root)
    before = path.read_text()

    def crash(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(rec.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        bench.save_records([_record(11.0)], root=root, overwrite=True)
    assert path.read_text() == before
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left behind


def test_an_interrupted_atomic_write_leaves_the_previous_json(tmp_path, monkeypatch):
    from k3lab.bench import records

    out = tmp_path / "run.json"
    records.write_atomic(out, json.dumps([_record(10.0).to_dict()]))
    before = out.read_text()

    def interrupted(src, dst):  # the rename never happens: as if the process died before it
        raise KeyboardInterrupt

    monkeypatch.setattr(records.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        records.write_atomic(out, json.dumps([_record(11.0).to_dict()]))
    assert out.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_a_corrupt_existing_file_is_not_merged_into(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    root = tmp_path / "scratch"
    (path,) = bench.save_records([_record(10.0)], root=root)
    path.write_text(path.read_text()[:40])
    with pytest.raises(FileExistsError, match="does not hold result records"):
        bench.save_records([_record(11.0)], root=root)
    assert len(path.read_text()) == 40


def test_a_bad_record_file_is_named_and_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    good = _record(10.0)
    bench.save_records([good], root=tmp_path)
    folder = tmp_path / "nvidia-h200" / "s"
    (folder / "truncated__after.json").write_text('[{"study": "s", "ca')
    (folder / "wrong__after.json").write_text('[{"study": "s"}]')
    with pytest.warns(rec.RecordFileWarning) as caught:
        got = bench.load_records(root=tmp_path)
    assert [r.median_us for r in got] == [10.0]
    names = " ".join(str(w.message) for w in caught)
    assert "truncated__after.json" in names and "wrong__after.json" in names


@pytest.mark.parametrize("folder", sorted(rec.NOT_STUDIES))
def test_the_gpu_check_and_ncu_folders_are_not_read_as_records(tmp_path, monkeypatch, folder):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    bench.save_records([_record(10.0)], root=tmp_path)
    check = tmp_path / "nvidia-h200" / folder
    check.mkdir()
    (check / "tests_abc1234.json").write_text('{"label": "tests", "device": "NVIDIA H200"}')
    with warnings.catch_warnings():
        warnings.simplefilter("error", rec.RecordFileWarning)
        assert [r.median_us for r in bench.load_records(root=tmp_path)] == [10.0]
        assert [r.median_us for r in bench.load_records(device="nvidia-h200", root=tmp_path)] == [10.0]
    (tmp_path / "nvidia-h200" / "s" / "wrong__after.json").write_text('[{"study": "s"}]')  # a study's: named
    with pytest.warns(rec.RecordFileWarning, match="wrong__after.json"):
        assert [r.median_us for r in bench.load_records(root=tmp_path)] == [10.0]


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_the_committed_records_load_without_a_warning(device):
    with warnings.catch_warnings():
        warnings.simplefilter("error", rec.RecordFileWarning)
        assert bench.load_records(device=device)  # gpu_check's reports and ncu's captures passed over


# ------------------------------------------------------------------ concurrent writers keep every record
_WRITER = """
import json, sys, time
from pathlib import Path
from k3lab import bench, cli
kind, root, tag, n, go = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])
while not go.exists():  # every writer starts together
    time.sleep(0.01)
for i in range(n):
    d = dict(study="launch_overhead", case="c", variant="after", device="NVIDIA H200", backend="cuda",
             versions={"torch": "2"}, commit="abc1234", date="2025-01-01T00:00:00+00:00",
             shape={"writer": tag, "i": i}, dtype="bfloat16", median_us=1.0 + i, p20_us=1.0 + i,
             p80_us=1.0 + i, mode="eager")
    if kind == "save":
        bench.save_records([bench.Record(**d)], root=root)
    else:  # what `k3lab import` does with one file
        f = Path(root).parent / f"{tag}-{i}.json"
        f.write_text(json.dumps([d]))
        assert cli.main(["import", str(f), "--root", root]) == 0
"""


def test_concurrent_saves_and_imports_keep_every_record(tmp_path):
    """Two processes saving 200 records each into one file, then two running `k3lab import` 25 times
    each, all at once: every record is kept (without the lock, a save that read the file before another's
    rename wrote back a list without the other's record)."""
    import os
    import sys

    root, go = tmp_path / "profiles", tmp_path / "go"
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    jobs = [("save", "a", 200), ("save", "b", 200), ("import", "i", 25), ("import", "j", 25)]
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, kind, str(root), tag, str(n), str(go)], env=env,
                              stderr=subprocess.PIPE, text=True) for kind, tag, n in jobs]
    try:
        go.touch()
        errors = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * 4, errors
    kept = {(r.shape["writer"], r.shape["i"]) for r in bench.load_records(root=root)}
    expected = {(tag, i) for _, tag, n in jobs for i in range(n)}
    assert kept == expected, f"{len(expected - kept)} of {len(expected)} records lost"


def test_save_holds_a_lock_on_the_root(tmp_path, monkeypatch):
    """The read-merge-rename runs under files.locked(root): another process that holds the lock makes a
    save wait until it is released."""
    import sys
    import time

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    root = tmp_path / "scratch"
    root.mkdir()
    hold = ("import sys, time; from k3lab.files import locked\n"
            "with locked(sys.argv[1]):\n    print('held', flush=True); time.sleep(2)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        bench.save_records([_record(10.0)], root=root)
        assert time.monotonic() - t0 > 1.0  # waited for the holder's release
    finally:
        holder.wait(timeout=60)
    assert _medians(root) == [10.0]
    assert sorted(p.name for p in root.iterdir()) == ["nvidia-h200"]  # no lock file left among the records


# ------------------------------------------------------------------ every field of a record checked
@pytest.mark.parametrize("field,value,says", [
    ("median_us", float("nan"), "median_us must be a finite number"),
    ("median_us", float("inf"), "median_us must be a finite number"),
    ("p20_us", -1.0, "p20_us must be a finite number"),
    ("median_us", "12.5", "median_us must be a finite number"),
    ("median_us", True, "median_us must be a finite number"),
    ("floor_us", float("nan"), "floor_us must be a finite number"),
    ("study", ".", "study must be a name"),
    ("study", "..", "study must be a name"),
    ("case", "../x", "case must be a name"),
    ("case", ".hidden", "case must be a name"),
    ("case", "-rf", "case must be a name"),
    ("variant", ["after"], "variant must be one of"),
    ("device", 7, "device must be a string"),
    ("shape", [1, 2], "shape must be a dict"),
])
def test_a_record_with_a_bad_field_is_refused_by_name(field, value, says):
    d = _record(10.0).to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=says):
        bench.Record.from_dict(d)


@pytest.mark.parametrize("field,value,says", [
    ("study", "no_such_study", "not a known study"),
    ("backend", "tpu", "backend must be one of"),
    ("mode", "fast", "mode must be one of"),
    ("commit", "abc", "commit must be a commit id"),
    ("date", "yesterday", "date must be an ISO 8601 date"),
    ("p80_us", 5.0, "p20_us <= median_us <= p80_us"),
    ("device", " ", "device and dtype must be non-empty"),
    ("versions", {"torch": 2}, "versions must map names"),
    ("surprise", 1, "unknown fields"),
])
def test_an_imported_record_is_checked_beyond_its_kinds(field, value, says):
    d = {**_record(10.0).to_dict(), "study": "launch_overhead", field: value}
    with pytest.raises(ValueError, match=says):
        rec.record_from_import(d, studies=("launch_overhead",))
    assert rec.record_from_import({**_record(10.0).to_dict(), "study": "launch_overhead", "date":
                                   "2025-01-01T00:00:00+00:00"}, studies=("launch_overhead",))


def test_a_text_median_is_skipped_by_name_and_the_report_reads_the_rest(tmp_path, monkeypatch):
    """A hand-edited record (a text median) never reaches a reader: load_records names the file and
    skips it, and the report's first table is built from the other records."""
    from k3lab.report.front import Checks, front_table

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    good = bench.Record(**{**_record(10.0).to_dict(), "study": "kda_decode"})
    bench.save_records([good], root=tmp_path / "profiles")
    bad = tmp_path / "profiles" / "nvidia-h200" / "kda_decode" / "B1__before.json"
    bad.write_text(json.dumps([{**good.to_dict(), "case": "B1", "variant": "before", "median_us": "12 us"}]))
    with pytest.warns(rec.RecordFileWarning, match="B1__before.json.*median_us") as caught:
        page = front_table(tmp_path, Checks())
        got = bench.load_records(root=tmp_path / "profiles")
    assert [r.median_us for r in got] == [10.0]
    assert page.count("<tr") > 1  # the header and the optimizations' rows
    assert all("B1__before.json" in str(w.message) for w in caught)


def test_a_copy_of_the_tree_inside_another_repository_is_not_taken_for_untracked(tmp_path, monkeypatch):
    """A `git archive` copy of k3lab inside another checkout (as a GPU machine may get it): that checkout's
    git calls every file of the copy untracked, so the copy must count as 'git cannot tell', and the
    output checks refuse its source folders and files."""
    import importlib.util
    import shutil

    from k3lab import files

    if subprocess.run(["git", "--version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("git is not installed")
    outer = tmp_path / "outer"
    (outer / "copy" / "k3lab").mkdir(parents=True)
    (outer / "copy" / "notebooks").mkdir()
    (outer / "copy" / "README.md").write_text("committed upstream\n")
    shutil.copy(files.__file__, outer / "copy" / "k3lab" / "files.py")
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    spec = importlib.util.spec_from_file_location("copied_files", outer / "copy" / "k3lab" / "files.py")
    copied = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(copied)
    assert copied.REPO == (outer / "copy").resolve()
    assert copied.repo_is_checkout() is False
    assert copied.tracked_files(outer / "copy" / "README.md") is None
    with pytest.raises(ValueError, match="--json .*git cannot tell"):
        copied.check_output_file(outer / "copy" / "README.md", "--json")
    with pytest.raises(ValueError, match="--out .*git cannot tell"):
        copied.check_output_dir(outer / "copy" / "notebooks", "--out")
    assert copied.check_output_dir(outer / "copy" / "build" / "x", "--out") == outer / "copy" / "build" / "x"
    assert copied.check_output_file(outer / "copy" / "new.json", "--json") == outer / "copy" / "new.json"
    # this checkout itself (CI's clean clone): git answers for it
    if files.repo_is_checkout():
        assert files.tracked_files(files.REPO / "README.md") == ["README.md"]
