"""No result record is lost: committed references are protected whether or not git can answer, a second
save merges, every write is atomic, and one bad file is skipped by name rather than hiding every record."""

from __future__ import annotations

import json
import subprocess
import warnings

import pytest

from k3lab import bench
from k3lab.bench import records as rec


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


def test_the_gpu_check_folder_is_not_read_as_records(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    bench.save_records([_record(10.0)], root=tmp_path)
    check = tmp_path / "nvidia-h200" / "gpu_check"
    check.mkdir()
    (check / "tests_abc1234.json").write_text('{"label": "tests", "device": "NVIDIA H200"}')
    with warnings.catch_warnings():
        warnings.simplefilter("error", rec.RecordFileWarning)
        assert [r.median_us for r in bench.load_records(root=tmp_path)] == [10.0]
        assert [r.median_us for r in bench.load_records(device="nvidia-h200", root=tmp_path)] == [10.0]
    (tmp_path / "nvidia-h200" / "s" / "wrong__after.json").write_text('[{"study": "s"}]')  # a study's: named
    with pytest.warns(rec.RecordFileWarning, match="wrong__after.json"):
        assert [r.median_us for r in bench.load_records(root=tmp_path)] == [10.0]


def test_the_committed_records_load_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", rec.RecordFileWarning)
        assert bench.load_records(device="nvidia-h200")  # gpu_check's reports are passed over quietly
