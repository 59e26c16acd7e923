"""The `k3lab` command on CPU: help lists the studies, names resolve, bench prints a compact table."""

import json

import pytest

from k3lab import cli, studies


def test_info_prints_the_machine_and_the_optional_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("k3lab: backend=")
    for name in ("triton", "fla", "aiter", "rocprofv3", "preset"):
        assert name in out


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["profile", "--help"]])
def test_help_lists_every_study_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for name in studies.STUDIES:
        hits = [ln for ln in lines if ln.split()[:1] == [name]]
        assert len(hits) == 1 and len(hits[0].split()) > 3, (name, hits)  # the name and a description


@pytest.mark.parametrize("command", ["bench", "profile"])
def test_unknown_study_is_one_line_naming_the_known_ones_and_exit_2(command, capsys):
    assert cli.main([command, "no_such_study"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "no_such_study" in captured.err and all(n in captured.err for n in studies.STUDIES)


def test_every_study_name_in_the_readme_and_the_report_resolves():
    import re
    from pathlib import Path

    from k3lab.report.front import OPTIMIZATIONS

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    listed = readme.split("lists the studies:", 1)[1].split(".\n", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", listed))
    assert len(named) >= 8, listed
    named |= {n for opt in OPTIMIZATIONS for n in opt.studies} | {h.study for opt in OPTIMIZATIONS for h
                                                                  in opt.headlines}
    named.add("kda_decode")
    for name in named:
        assert studies.load_study(name).NAME == studies.canonical(name), name


def test_bench_prints_a_compact_table_without_empty_columns(tmp_path, capsys):
    assert (
        cli.main(["bench", "launch_overhead", "--out", str(tmp_path), "--cases", "tiny_op", "copy_1792B"])
        == 0
    )
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert header.split()[:3] == ["case", "before", "(us)"] and "floor (us)" in header
    assert "nan" not in out.lower()
    assert "peer" not in header  # no peer in this study: its columns are dropped, not shown empty
    assert "copies of 1792 B per decode step" in out  # the study's summary_text follows the table
    saved = list((tmp_path / "records").rglob("*.json"))
    rec = json.loads(saved[0].read_text())[0]  # one file per (case, variant): a list of timings
    assert rec["study"] == "launch_overhead" and rec["median_us"] > 0


def test_bench_run_options_reach_run_or_name_the_flag(tmp_path, capsys):
    """--repeats / --distinct-layers / --no-profile become run() keywords; a study whose run() lacks one
    is exit status 2 naming the flag, before anything runs."""
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path), "--distinct-layers", "2"]) == 2
    assert "takes no --distinct-layers option" in capsys.readouterr().err
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path), "--backend", "triton"]) == 2
    assert "takes no --backend option" in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "kda_scan", "--backend", "triton"])
    assert cli.run_options(studies.load_study("kda_scan"), args) == {"backend": "triton"}
    seen = {}
    study = type("S", (), {"NAME": "s", "run": staticmethod(lambda preset=None, cases=None, *, repeats=5,
                                                                    profile=True: seen)})
    args = cli.build_parser().parse_args(["bench", "decode_step", "--repeats", "2", "--no-profile"])
    assert cli.run_options(study, args) == {"repeats": 2, "profile": False}
    args = cli.build_parser().parse_args(["bench", "decode_step"])
    assert cli.run_options(study, args) == {}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "decode_step", "--repeats", "0"])


@pytest.mark.parametrize("name", list(studies.STUDIES))
def test_every_studys_bad_backend_or_cases_is_one_line_and_exit_2_before_anything_runs(name, capsys,
                                                                                       monkeypatch):
    """For every study, GPU-only ones on a CPU included: an unknown --backend, one this machine cannot
    run, and an unknown case are one line on stderr naming the flag, exit 2, and run() is never called."""
    import functools
    import inspect

    import torch

    study = studies.load_study(name)

    def must_not_run(*a, **k):
        raise AssertionError("ran despite a bad argument")

    monkeypatch.setattr(study, "run", functools.wraps(study.run)(must_not_run))  # keeps run's signature
    takes = "backend" in inspect.signature(study.run).parameters
    bad = [(["--backend", "nope"], "--backend" if takes else "takes no --backend option"),
           (["--cases", "no_such_case"], "--cases")]
    if takes:
        assert getattr(study, "BACKENDS", None) is not None, f"{name}'s run() takes backend= but no BACKENDS"
        if not torch.cuda.is_available():
            bad.append((["--backend", "cuda"], "--backend 'cuda' cannot run on this machine"))
    for extra, named in bad:
        code = cli.main(["bench", name, *extra])
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and named in err, (extra, code, err, captured.out)
    if takes:  # the op's own variable, read when no --backend is given, is checked the same way
        monkeypatch.setenv(study.BACKENDS.env, "nope")
        code = cli.main(["bench", name])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and study.BACKENDS.env in err, (code, err)


def test_compact_table_keeps_peer_and_ratios():
    from k3lab import bench
    from k3lab.report.tables import compact

    recs = [r for r in bench.load_records(study="kda_decode", device="nvidia-h200") if r.case == "B1_H12"]
    table = compact(recs)
    assert list(table.columns) == ["case", "mode", "before (us)", "after (us)", "peer", "peer (us)",
                                   "floor (us)",
                                   "after/before", "after/peer"]
    row = table[table["mode"] == "graph"].iloc[0]
    assert row["after/before"] == pytest.approx(row["after (us)"] / row["before (us)"])
    assert row["after/peer"] == pytest.approx(row["after (us)"] / row["peer (us)"]) and row["peer"] == "fla"


def test_bench_json_then_import_round_trip(tmp_path):
    out = tmp_path / "all.json"
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path / "b"), "--cases", "tiny_op",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows and all(r["study"] == "launch_overhead" for r in rows)
    assert cli.main(["import", str(out), "--root", str(tmp_path / "profiles")]) == 0
    from k3lab import bench

    back = bench.load_records(study="launch_overhead", root=str(tmp_path / "profiles"))
    assert sorted((r.case, r.variant, r.median_us) for r in back) == \
        sorted((r["case"], r["variant"], r["median_us"]) for r in rows)


def test_make_test_groups_skips_by_reason():
    from types import SimpleNamespace

    from conftest import skip_groups

    reports = [SimpleNamespace(nodeid=f"tests/test_{f}.py::t{i}", longrepr=("x.py", 1, f"Skipped: {why}"))
               for i, (f, why) in enumerate([("a", "needs a GPU"), ("b", "needs a GPU"), ("a", "needs a GPU"),
                                             ("c", "fla missing")])]
    assert skip_groups(reports) == [("needs a GPU", 3, ["tests/test_a.py", "tests/test_b.py"]),
                                    ("fla missing", 1, ["tests/test_c.py"])]


# ------------------------------------------------------------------ every argument checked up front
@pytest.mark.parametrize("argv,named", [
    (["bench", "launch_overhead", "--preset", "huge"], "--preset"),
    (["bench", "launch_overhead", "--preset", "tp7"], "--preset"),
    (["profile", "launch_overhead", "--preset", "huge"], "--preset"),
    (["report", "--preset", "huge"], "--preset"),
    (["report", "--timeout", "-5"], "--timeout"),
    (["report", "--timeout", "0"], "--timeout"),
    (["report", "--workers", "0"], "--workers"),
    (["profile", "launch_overhead", "--steps", "0"], "--steps"),
    (["bench", "launch_overhead", "--cases", "no_such_case"], "--cases"),
    (["bench", "launch_overhead", "--cases"], "--cases"),  # empty: nothing would run
    # output paths, checked before the study runs ({tmp}: a fresh folder holding a file 'afile')
    (["bench", "launch_overhead", "--json", "{tmp}"], "--json"),
    (["bench", "launch_overhead", "--json", "{tmp}/afile/x.json"], "--json"),
    (["bench", "launch_overhead", "--json", "{repo}/README.md"], "--json"),
    (["bench", "launch_overhead", "--out", "{tmp}/afile"], "--out"),
    (["bench", "launch_overhead", "--out", "{repo}"], "--out"),
    (["bench", "launch_overhead", "--out", "{repo}/notebooks"], "--out"),
    (["profile", "launch_overhead", "--out", "{repo}/docs"], "--out"),
    (["profile", "launch_overhead", "--out", "{tmp}/afile/sub"], "--out"),
    (["report", "--out", "."], "--out"),  # run from the repository's root: its tracked notebooks
    (["report", "--out", "{repo}/notebooks"], "--out"),
    (["report", "--out", "{repo}/.."], "--out"),  # holds the repository
    (["report", "--out", "{tmp}/afile"], "--out"),
    (["import", "{tmp}/afile", "--root", "{tmp}/afile"], "--root"),
])
def test_a_bad_argument_is_one_line_naming_it_and_exit_2(argv, named, capsys, monkeypatch, tmp_path):
    """Nothing runs: a study's run() and profile_targets() and the report's builder would fail the test
    if reached."""
    from pathlib import Path

    import k3lab.report

    def must_not_run(*a, **k):
        raise AssertionError("ran despite a bad argument")

    (tmp_path / "afile").write_text("x")
    repo = Path(cli.__file__).resolve().parent.parent
    argv = [a.format(tmp=tmp_path, repo=repo) for a in argv]
    monkeypatch.chdir(repo)
    monkeypatch.setattr(k3lab.report, "build_report", must_not_run)
    monkeypatch.setattr(studies.load_study("launch_overhead"), "run", must_not_run)
    monkeypatch.setattr(studies.load_study("launch_overhead"), "profile_targets", must_not_run)
    try:
        code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and named in err, err


@pytest.mark.parametrize("content,why", [
    (None, "cannot be read"),
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a record or a list of records"),
    ('[{"study": "x"}]', "not a record file"),
])
def test_import_of_a_bad_file_names_the_file_and_saves_nothing(tmp_path, capsys, content, why):
    good = tmp_path / "good.json"
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path / "b"), "--cases", "tiny_op",
                     "--json", str(good)]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    root = tmp_path / "profiles"
    assert cli.main(["import", str(good), str(bad), "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and why in err, err
    assert not root.exists()  # the good file's records were not saved either: every file is read first


def test_import_over_a_committed_record_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    from k3lab.bench import records

    f = tmp_path / "r.json"
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path / "b"), "--cases", "tiny_op",
                     "--json", str(f)]) == 0
    root = tmp_path / "profiles"
    assert cli.main(["import", str(f), "--root", str(root)]) == 0
    monkeypatch.setattr(records, "committed_reason", lambda path: "tracked by git")
    capsys.readouterr()
    assert cli.main(["import", str(f), "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "committed reference" in err


def test_make_test_runs_under_the_hang_guard():
    """`make test` requires pytest-timeout, which [dev] installs, and pyproject sets its limit."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml without a package")
    root = Path(__file__).resolve().parent.parent
    conf = tomllib.loads((root / "pyproject.toml").read_text())
    assert any(d.startswith("pytest-timeout") for d in conf["project"]["optional-dependencies"]["dev"])
    ini = conf["tool"]["pytest"]["ini_options"]
    assert int(ini["timeout"]) >= 600 and ini["timeout_method"] == "thread"
    make = (root / "Makefile").read_text()
    test_rule = make.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "required_plugins=pytest-timeout" in test_rule


def _fake_records(n: int = 2):
    from k3lab import bench

    common = dict(study="launch_overhead", case="tiny_op", variant="after", device="cpu", backend="cpu",
                  versions={"torch": "2"}, commit="abc1234", date="2025-01-01T00:00:00+00:00",
                  dtype="float32", mode="cpu")
    return [bench.Record(**common, shape={"i": i}, median_us=1.0 + i, p20_us=1.0 + i, p80_us=1.0 + i)
            for i in range(n)]


@pytest.mark.parametrize("change,says", [
    ({"median_us": float("nan")}, "median_us must be a finite number"),
    ({"median_us": float("inf"), "p80_us": float("inf")}, "median_us must be a finite number"),
    ({"median_us": -1.0, "p20_us": -1.0}, "median_us must be a finite number"),
    ({"median_us": "1.5"}, "median_us must be a finite number"),
    ({"study": "."}, "study must be a name"),
    ({"study": ".."}, "study must be a name"),
    ({"study": "no_such_study"}, "not a known study"),
    ({"case": "../../x"}, "case must be a name"),
    ({"backend": "gpu"}, "backend must be one of"),
    ({"date": "today"}, "date must be an ISO 8601 date"),
])
def test_import_refuses_a_bad_field_with_one_line_before_writing(tmp_path, capsys, change, says):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    rows = [r.to_dict() for r in _fake_records()]
    good.write_text(json.dumps(rows))
    bad.write_text(json.dumps([rows[0], {**rows[1], **change}]))  # the second record of the file is bad
    root = tmp_path / "profiles"
    assert cli.main(["import", str(good), str(bad), "--root", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err and "record 1" in err and says in err, err
    assert not root.exists()
    assert cli.main(["import", str(good), "--root", str(root)]) == 0  # the good one alone goes in


def test_save_profiles_checks_the_cpu_folder_for_host_timed_records_on_a_gpu_machine(tmp_path, capsys,
                                                                                    monkeypatch):
    from k3lab import env
    from k3lab.bench import records

    gpu = env.DeviceInfo("cuda", "NVIDIA Test GPU", 132, 80.0, 32, "sm_90", env.PEAKS["H100"])
    monkeypatch.setattr(env, "detect", lambda: gpu)
    profiles = tmp_path / "profiles"
    case = studies.load_study("draft_depth").case_names(None)[0]
    folder = profiles / "cpu" / "draft_depth"      # where its host-clock records go, GPU or not
    folder.mkdir(parents=True)
    (folder / f"{case}__after.json").write_text("[]")
    monkeypatch.setattr(records, "PROFILES", profiles)
    monkeypatch.setattr(records, "committed_reason", lambda path: "tracked by git")
    study = studies.load_study("draft_depth")
    monkeypatch.setattr(study, "run", lambda **k: pytest.fail("ran despite a committed cpu/ record"))
    assert cli.main(["bench", "draft_depth", "--save-profiles", "--cases", case]) == 2
    assert f"{case}__after.json is a committed reference" in capsys.readouterr().err


def test_save_profiles_onto_a_committed_record_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    from k3lab.bench import records

    def must_not_run(*a, **k):
        raise AssertionError("ran despite --save-profiles onto a committed record")

    profiles = tmp_path / "profiles"
    folder = profiles / records.device_slug() / "launch_overhead"  # this machine's folder: cpu, or the GPU's
    folder.mkdir(parents=True)
    (folder / "tiny_op__before.json").write_text("[]")
    (folder / "copy_1792B__before.json").write_text("[]")
    monkeypatch.setattr(records, "PROFILES", profiles)
    monkeypatch.setattr(records, "committed_reason", lambda path: "tracked by git")
    study = studies.load_study("launch_overhead")
    monkeypatch.setattr(study, "run", must_not_run)
    argv = ["bench", "launch_overhead", "--save-profiles", "--cases", "tiny_op"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "tiny_op__before.json is a committed reference" in err, err
    monkeypatch.setattr(study, "run", lambda **k: [])  # another case's committed file, or --overwrite: runs
    assert cli.main(["bench", "launch_overhead", "--save-profiles", "--cases", "tiny_op_x"]) == 2  # unknown
    capsys.readouterr()
    assert cli.main(argv + ["--overwrite"]) == 0
    assert "no records" in capsys.readouterr().out


def test_a_save_that_fails_after_the_run_keeps_the_records_and_says_where(tmp_path, capsys, monkeypatch):
    import tempfile

    from k3lab import bench

    study = studies.load_study("launch_overhead")
    monkeypatch.setattr(study, "run", lambda **k: _fake_records(3))
    monkeypatch.delattr(study, "summary_text", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "save_records", disk_full)
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err, err
    (kept,) = (tmp_path / "tmp").glob("k3lab-launch_overhead-*.json")
    assert str(kept) in err and [r["median_us"] for r in json.loads(kept.read_text())] == [1.0, 2.0, 3.0]


def test_report_traces_go_under_out_and_only_the_last_runs_stay(tmp_path, monkeypatch, capsys):
    """`k3lab report` points K3LAB_TRACE_DIR (which the notebook kernels inherit) at out/traces/report
    for the run, after removing the previous run's, and puts it back afterwards."""
    import os

    import k3lab.report
    from k3lab.profiling.capture import default_trace_dir

    out = tmp_path / "build"
    old = out / "traces" / "report" / "old.trace.json"
    old.parent.mkdir(parents=True)
    old.write_text("{}")
    seen = {}

    def build(out, **kwargs):
        seen["dir"] = default_trace_dir()
        return out / "report.html"

    monkeypatch.delenv("K3LAB_TRACE_DIR", raising=False)
    monkeypatch.setattr(k3lab.report, "build_report", build)
    assert cli.main(["report", "--out", str(out)]) == 0
    assert seen["dir"] == (out / "traces" / "report").absolute()
    assert not old.exists() and "K3LAB_TRACE_DIR" not in os.environ


def test_kda_scans_documented_case_names_pass_the_cli_check(capsys, monkeypatch):
    """kda_scan's run() takes names beyond case_names() (any h{H}_b{B}_t{T}, '<case>.parts',
    '<case>.sweep', docs/kda_scan.md names one): the CLI's --cases check accepts them through the
    study's check_cases and still refuses a name run() would refuse, in one line with exit 2."""
    study = studies.load_study("kda_scan")
    seen = []
    monkeypatch.setattr(study, "run", lambda **k: seen.append(k["cases"]) or [])
    for name in ("h12_b1_t16384.parts", "h2_b1_t64.sweep", "h96_b8_t4096"):
        assert cli.main(["bench", "kda_scan", "--cases", name]) == 0, capsys.readouterr().err
        assert seen[-1] == [name]
    for bad in ("h12_b1.sweep", "h0_b1_t64", "no_such_case"):
        code = cli.main(["bench", "kda_scan", "--cases", bad])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and "--cases" in err, (bad, code, err)
    assert seen == [["h12_b1_t16384.parts"], ["h2_b1_t64.sweep"], ["h96_b8_t4096"]]
