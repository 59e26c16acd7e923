"""The `k3lab` command and the report builder, on CPU."""

import json
import os

import nbformat
import pytest

from k3lab import cli, report


def test_info_prints_the_machine_and_the_optional_backends(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("k3lab: backend=")
    for name in ("triton", "fla", "aiter", "rocprofv3", "preset"):
        assert name in out


def test_bench_launch_overhead_saves_records(tmp_path, capsys):
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path)]) == 0
    saved = list((tmp_path / "records").rglob("*.json"))
    assert saved, "no records written"
    rec = json.loads(saved[0].read_text())[0]  # one file per (case, variant): a list of timings
    assert rec["study"] == "launch_overhead" and rec["median_us"] > 0
    assert "launch_overhead" in capsys.readouterr().out


def test_unknown_study_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown study"):
        cli.main(["bench", "no_such_study"])


def test_plotly_outputs_get_an_html_twin():
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=["before", "after"], y=[3, 1]))
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("fig")
    cell.outputs = [nbformat.v4.new_output("display_data", data={report.PLOTLY_MIME: fig.to_plotly_json()})]
    nb.cells.append(cell)
    assert report.add_html_for_plotly(nb) == 1
    html = nb.cells[0].outputs[0]["data"]["text/html"]
    assert "Plotly.newPlot" in html and "before" in html
    assert report.add_html_for_plotly(nb) == 0  # idempotent


def test_execute_notebook_writes_ipynb_and_html(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# t"), nbformat.v4.new_code_cell("x = 6 * 7\nprint(x)")]
    src = tmp_path / "01_t.ipynb"
    nbformat.write(nb, src)
    out, seconds = report.execute_notebook(src, tmp_path / "out", timeout_s=120)
    ran = nbformat.read(out, as_version=4)
    assert "42" in ran.cells[1].outputs[0]["text"]
    assert (tmp_path / "out" / "01_t.html").read_text().count("42") >= 1


def test_failing_notebook_raises(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("raise RuntimeError('boom')")]
    src = tmp_path / "02_bad.ipynb"
    nbformat.write(nb, src)
    with pytest.raises(Exception, match="boom"):
        report.execute_notebook(src, tmp_path / "out", timeout_s=60)


def test_report_runs_notebooks_in_worker_processes(tmp_path):
    # build_report executes each notebook in a spawned worker process: one that runs is linked with its
    # time, one that fails is named with its error message in the page, and the call then exits non-zero
    src = tmp_path / "nbs"
    src.mkdir()
    good = nbformat.v4.new_notebook()
    good.cells = [nbformat.v4.new_code_cell("import os\nprint('pid', os.getpid())")]
    nbformat.write(good, src / "01_good.ipynb")
    bad = nbformat.v4.new_notebook()
    bad.cells = [nbformat.v4.new_code_cell("raise ValueError('boom in a worker')")]
    nbformat.write(bad, src / "02_bad.ipynb")
    with pytest.raises(SystemExit, match="notebook 02_bad.ipynb"):
        report.build_report(out=tmp_path / "out", run_studies=False, notebooks=src, timeout_s=120)
    page = (tmp_path / "out" / "report.html").read_text()
    assert "01_good</a>" in page and "ran in" in page
    assert "FAILED: ValueError: boom in a worker" in page
    ran = nbformat.read(tmp_path / "out" / "notebooks" / "01_good.ipynb", as_version=4)
    assert int(ran.cells[0].outputs[0]["text"].split()[1]) != os.getpid()  # a kernel, not this process


def test_bench_json_then_import_round_trip(tmp_path):
    out = tmp_path / "all.json"
    assert cli.main(["bench", "launch_overhead", "--out", str(tmp_path / "b"), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows and all(r["study"] == "launch_overhead" for r in rows)
    assert cli.main(["import", str(out), "--root", str(tmp_path / "profiles")]) == 0
    from k3lab import bench

    back = bench.load_records(study="launch_overhead", root=str(tmp_path / "profiles"))
    assert sorted((r.case, r.variant, r.median_us) for r in back) == \
        sorted((r["case"], r["variant"], r["median_us"]) for r in rows)
