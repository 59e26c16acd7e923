"""The report builder on CPU: the notebook step (no stalls, timeouts fail), the first screen, sections."""

import html
import os
import time

import nbformat
import pytest

from k3lab import report
from k3lab.report import front, tables

WIDGET_CELL = '''
import ipywidgets as w
from IPython.display import display
out = w.Output()
n = w.IntSlider(value=3, min=1, max=9)
def redraw(n):
    out.clear_output(wait=True)
    with out:
        for i in range(4 * n):
            print("line", i)
            display({"text/plain": f"item {i}"}, raw=True)
w.interactive_output(redraw, {"n": n})
w.VBox([n, out])
'''


def _notebook(path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)
    return path


def test_widget_explorer_cells_never_stall(tmp_path):
    # An Output widget filled by interactive_output (notebook 06's explorer, in small): with nbclient's
    # own Output mimic this waited for the whole per-cell timeout in most runs of five such cells.
    src = _notebook(tmp_path / "01_widgets.ipynb", "x = 1", *[WIDGET_CELL, "print(x)"] * 5)
    for _ in range(4):
        start = time.perf_counter()
        out, seconds, slowest = report.execute_notebook(src, tmp_path / "out", timeout_s=20)
        assert slowest < 5, f"a cell took {slowest:.1f} s: the client waited on a reply it had"
        assert time.perf_counter() - start < 60
    ran = nbformat.read(out, as_version=4)
    state = ran.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    filled = [m["state"]["outputs"] for m in state.values() if m["model_name"] == "OutputModel" and
              m["state"]["outputs"]]
    assert len(filled) == 5 and all(len(o) == 24 for o in filled)  # 12 prints + 12 displays each, kept


def test_execute_notebook_writes_ipynb_and_html(tmp_path):
    src = _notebook(tmp_path / "01_t.ipynb", "x = 6 * 7\nprint(x)")
    out, seconds, slowest = report.execute_notebook(src, tmp_path / "out", timeout_s=120)
    ran = nbformat.read(out, as_version=4)
    assert "42" in ran.cells[0].outputs[0]["text"] and 0 <= slowest <= seconds
    assert (tmp_path / "out" / "01_t.html").read_text().count("42") >= 1


def _stopped(out_dir, stem):
    """The executed notebook's k3lab metadata, its cells' sources and its page."""
    ran = nbformat.read(out_dir / f"{stem}.ipynb", as_version=4)
    return ran.metadata["k3lab"], [c.source for c in ran.cells], (out_dir / f"{stem}.html").read_text()


def test_a_cell_that_reaches_the_timeout_fails_and_the_page_names_it(tmp_path):
    src = _notebook(tmp_path / "01_slow.ipynb", "x = 1", "# the slow one\nimport time\ntime.sleep(30)", "x")
    said = (r"^code cell 2 of 3 \(index 1 in the file: `# the slow one`\) reached the per-cell timeout of "
            r"2 s; 1 of 3 code cells ran before it\n")
    with pytest.raises(report.CellTimedOut, match=said) as got:
        report.execute_notebook(src, tmp_path / "out", timeout_s=2)
    assert got.value.cell["code_cell"] == 2 and got.value.cell["index"] == 1
    meta, sources, page = _stopped(tmp_path / "out", "01_slow")
    assert meta["stopped"] == "timeout" and meta["cell"]["index"] == 1 and meta["finished"] == 1
    assert "Timed out" in sources[0] and "time.sleep(30)" in sources[0]  # the banner: its first lines
    assert "Timed out here" in sources[3]  # right after the cell (the banner moved it to index 2)
    top = page.split("<main>", 1)[1]
    assert top.index("Timed out") < top.index("jp-CodeCell")  # before the first code cell
    assert "reached the per-cell timeout of 2 s" in top and "<code># the slow one</code>" in top
    with pytest.raises(ValueError, match="timeout_s"):
        report.execute_notebook(src, tmp_path / "out", timeout_s=0)


def test_failing_cell_names_its_error_and_the_page_says_where(tmp_path):
    src = _notebook(tmp_path / "02_bad.ipynb", "y = 2", "raise RuntimeError('boom')", "y")
    seconds = {}
    with pytest.raises(report.NotebookFailed, match=r"^code cell 2 of 3 \(index 1 in the file: `raise "
                                                    r"RuntimeError\('boom'\)`\) raised RuntimeError: boom; 1 "
                                                    r"of 3 code cells ran before it"):
        report.execute_notebook(src, tmp_path / "out", timeout_s=60, cell_seconds=seconds)
    cells = nbformat.read(src, as_version=4).cells
    assert set(seconds) == {cells[0].id, cells[1].id}  # the cells that ran, the failing one included
    meta, sources, page = _stopped(tmp_path / "out", "02_bad")
    assert meta["stopped"] == "failed" and meta["interrupted"] is False
    assert "Failed run" in sources[0] and "raised RuntimeError: boom" in sources[0]
    assert "Failed here" in sources[3]
    top = page.split("<main>", 1)[1]
    assert "Failed run" in top and top.index("Failed run") < top.index("jp-CodeCell")


def test_a_stop_before_any_cell_and_a_bad_kind_are_told_apart():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1"), nbformat.v4.new_markdown_cell("m")])
    assert report.execute.mark_stopped(nb, None, "interrupted") == "stopped before its cells ran"
    assert nb.metadata["k3lab"]["cell"] is None and "Interrupted run" in nb.cells[0].source
    with pytest.raises(ValueError, match="kind must be one of"):
        report.execute.mark_stopped(nb, 1, "crashed")


def test_report_marks_failures_and_timeouts_and_exits_non_zero(tmp_path, capfd):
    src = tmp_path / "nbs"
    src.mkdir()
    _notebook(src / "01_good.ipynb", "import os\nprint('pid', os.getpid())")
    _notebook(src / "02_bad.ipynb", "raise ValueError('boom in a worker')")
    _notebook(src / "03_slow.ipynb", "import time\ntime.sleep(30)")
    with pytest.raises(SystemExit) as stop:
        report.build_report(out=tmp_path / "out", run_studies=False, notebooks=src, timeout_s=3)
    said = str(stop.value.code)
    # the summary names each failed notebook with the cell that stopped it and the reason
    assert "notebook 02_bad.ipynb (failed: code cell 1 of 1 (index 0 in the file: `raise ValueError(" in said
    assert "raised ValueError: boom in a worker" in said
    assert ("notebook 03_slow.ipynb (timed out: code cell 1 of 1 (index 0 in the file: `import time`) "
            "reached the per-cell timeout of 3 s") in said
    page = (tmp_path / "out" / "report.html").read_text()
    assert "01_good</a>" in page and "passed in" in page
    assert "FAILED: code cell 1 of 1" in page and "raised ValueError: boom in a worker" in page
    assert "FAILED, timed out: code cell 1 of 1" in page
    assert "<b>Failed:</b><ul><li>notebook 02_bad.ipynb (failed: code cell 1 of 1" in page
    assert "notebooks/03_slow.html#k3lab-stopped-here" in page
    timings = __import__("json").loads((tmp_path / "out" / "timings.json").read_text())
    slow = timings["steps"]["notebook:03_slow"]
    assert slow["status"] == "timeout" and slow["stopped_at"].startswith("code cell 1 of 1")
    (only,) = nbformat.read(src / "03_slow.ipynb", as_version=4).cells
    assert list(slow["cells"]) == [only.id] and slow["cells"][only.id] >= 3
    kind = "gpu" if __import__("torch").cuda.is_available() else "cpu"
    assert timings["machine_kind"]["kind"] == kind and timings["machine_kind"]["cpus"] >= 1
    ran = nbformat.read(tmp_path / "out" / "notebooks" / "01_good.ipynb", as_version=4)
    assert int(ran.cells[0].outputs[0]["text"].split()[1]) != os.getpid()  # a kernel, not this process
    err = capfd.readouterr().err  # the workers' lines: another process, the same stderr
    for stem in ("01_good", "02_bad", "03_slow"):  # one line as each starts and as each ends
        assert f"notebook {stem}: started" in err and (f"notebook {stem}: passed" in err or
                                                       f"notebook {stem}: FAILED" in err)


def test_the_first_screen_names_the_cell_a_notebook_stopped_in():
    from k3lab.report.workers import Outcome

    cell = {"code_cell": 15, "code_cells": 21, "index": 30, "text": "code cell 15 of 21 (...)"}
    assert report._notebook_check(Outcome("timeout", cell=cell)) == "FAILED (code cell 15 of 21 timed out)"
    assert report._notebook_check(Outcome("failed", cell=cell)) == ("FAILED (code cell 15 of 21 raised an "
                                                                    "error)")
    assert report._notebook_check(Outcome("failed")) == "FAILED"  # no cell known (the worker died)
    assert report._notebook_check(Outcome("passed")) == "passed"


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


def test_front_table_has_a_row_per_optimization_and_follows_the_tree(tmp_path):
    page = front.front_table(report.REPO, front.Checks(studies={"mla_padding": "passed"}))
    import html as _html

    for opt in front.OPTIMIZATIONS:  # each optimization's title cell, once
        assert page.count(f"<b>{_html.escape(opt.title)}</b>") == 1, opt.title
    for opt in front.OPTIMIZATIONS:
        assert opt.title in page
        built = front.notebook_for(opt, report.REPO) is not None
        row = page.split(opt.title, 1)[1].split("</tr>", 1)[0]
        assert ("not built yet" in row) != built, opt.title
    from k3lab import bench

    mla = next(o for o in front.OPTIMIZATIONS if o.title == "MLA head padding")
    after_32k = front.headline_rows(mla, bench.load_records(device="nvidia-h200"))[0]["after"]
    assert "mla_padding: passed" in page and f">{front.plain(after_32k)} us<" in page  # the 32K after
    # an empty tree: every row is "not built yet"
    empty = front.front_table(tmp_path, front.Checks())
    assert empty.count("not built yet") == len(front.OPTIMIZATIONS)


def test_headline_rows_carry_the_speedups():
    from k3lab import bench

    opt = next(o for o in front.OPTIMIZATIONS if o.title == "MLA head padding")
    rows = front.headline_rows(opt, bench.load_records(device="nvidia-h200"))
    assert [r["label"] for r in rows] == [h.label for h in opt.headlines]
    for r in rows:
        assert r["speedup"] == pytest.approx(r["before"] / r["after"]) and r["speedup"] > 1
        assert r["vs_peer"] == pytest.approx(r["peer_us"] / r["after"]) and r["peer"] == "flashmla"


def _front_row(page: str, label: str) -> list[str]:
    import re

    row = page.split(label, 1)[1].split("</tr>", 1)[0]
    return re.findall(r"<td class='num'>([^<]*)</td>", row)


def test_front_table_reads_as_speedups_in_one_unit_per_row():
    """Speedups as before / after with an x; one unit per row (the routed experts' loop is 234 ms, its
    grouped kernels under 10 ms: all in ms); no exponent anywhere."""
    from k3lab import bench

    recs = bench.load_records(device="nvidia-h200")
    page = front.front_table(report.REPO, front.Checks())
    assert "e+0" not in page and "after/before" not in page
    for opt in front.OPTIMIZATIONS:
        for r in front.headline_rows(opt, recs):
            cells = _front_row(page, html.escape(r["label"]))
            less = " less" if r["unit"] == "bytes" else ""
            assert cells[2] == front.times(r["before"] / r["after"]) + less
            units = {c.split()[1] for c in (cells[0], cells[1], cells[5]) if c}
            assert len(units) == 1, (r["label"], cells)
    experts = _front_row(page, "routed experts, 64 tokens")
    assert experts[0].endswith(" ms") and experts[1].endswith(" ms")


def test_dcp_row_shows_the_memory_it_frees_and_the_attention_it_keeps():
    from k3lab.config import K3Config

    page = front.front_table(report.REPO, front.Checks())
    mem = _front_row(page, "MLA history per GPU")
    full = K3Config.full()
    tp8 = full.num_mla_layers * front.CONVERSATION * full.mla_latent_bytes_per_position(1)
    assert mem[0] == f"{front.plain(tp8 / 1e6)} MB" and mem[0].startswith("1,96")  # 1,963 MB
    assert mem[1].startswith("24") and mem[2] == "8.00x less"  # 245 MB: one eighth
    kept = _front_row(page, "local attention kept")
    assert kept[0].endswith(" us") and kept[1].endswith(" us")  # TP8's and DCP8's local attention


def test_whole_step_row_shows_the_steps_before_and_after():
    from k3lab import bench

    page = front.front_table(report.REPO, front.Checks())
    step = {r.case: r.median_us for r in bench.load_records(study="decode_step", device="nvidia-h200")
            if r.case.startswith("b1_32k.all_o")}
    cells = _front_row(page, "whole step, B = 1, 32K: all off / all on")
    assert cells[0] == f"{front.plain(step['b1_32k.all_off'] / 1e3)} ms"
    assert cells[1] == f"{front.plain(step['b1_32k.all_on'] / 1e3)} ms"
    assert cells[2] == front.times(step["b1_32k.all_off"] / step["b1_32k.all_on"])


CALIBRATION_WORDING = ("Calibration, not a comparison", "over the model's projection")


def _measurements_beside_projections(section: str) -> list[str]:
    """The blocks (paragraph, table row, heading) of the serving section that show one of the article's
    measured tokens/s/GPU (any spelling) without the calibration wording: a measurement set beside the
    projection as comparable."""
    import re

    from k3lab.serving.hardware import SEED

    spellings = {s for k in ("mi355x_tokens_per_s_gpu", "b300_tokens_per_s_gpu")
                 for s in (front.plain(SEED[k]), f"{SEED[k]:,.0f}", f"{SEED[k]:.0f}")}
    blocks = re.split(r"</p>|</tr>|</h2>|</svg>", section)
    return [b for b in blocks if any(re.search(rf"(?<![\d,.]){re.escape(s)}(?![\d,])", b) for s in spellings)
            and not all(w in b for w in CALIBRATION_WORDING)]


def test_the_serving_section_labels_the_projection_with_its_error_and_calibrates_against_the_article():
    """The first screen's serving curve: every figure labelled projected, the step model's measured error
    (serving.validate.model_error) and the all-on band beside it, the article's measured figures only as
    calibration ratios. The check finds a planted measurement beside the projection."""
    import re

    n = front._serving_numbers(report.REPO)
    page = front.serving_html(n)
    assert page == front.serving_section(report.REPO)
    err, band = n["error"], n["band"]["at_target"]
    assert "projected" in page.split("</h2>", 1)[0]
    shown = page.split("<p class='projection'>", 1)[1].split("</p>", 1)[0]
    assert f"up to {err['worst']:.0%}" in shown and html.escape(err["kind"]) in shown
    assert front.band_phrase(band["low"], band["high"]) in shown
    assert page.count("<polygon") == 1 and "all on, projected band" in page  # the band, shaded
    for th in re.findall(r"<th>([^<]*tokens/s/GPU[^<]*)</th>", page):
        assert th.startswith("projected") and f"error up to {err['worst']:.0%}" in th, th
    cal = page.split("<p class='calibration'>", 1)[1]
    assert all(w in cal for w in CALIBRATION_WORDING) and len(n["calibration"]) == 2
    for c in n["calibration"]:
        assert f"{html.escape(c['gpu'])} {c['ratio_central']:.2f} (over the band: " in cal
    assert _measurements_beside_projections(page) == []
    # planted: the sentence the page had, a table row, a bare figure in the error paragraph
    for planted in (page.replace("</table>", "</table><p>the article measured 7,567 tokens/s/GPU at 50 "
                                 "tokens/s/user.</p>"),
                    page.replace("</table>", "<tr><td>the article (measured)</td><td class='num'>7,567</td>"
                                 "</tr></table>"),
                    page.replace("(that error,", "(the article: 6083; that error,")):
        assert len(_measurements_beside_projections(planted)) == 1
    # the article's figure inside the calibration wording is a calibration, not a comparison
    assert _measurements_beside_projections(page.replace("A factor for", "(7,567 / the projection) A factor "
                                                         "for")) == []


def test_the_readme_paragraph_on_projections_is_the_records(tmp_path):
    """README.md's projection paragraph is k3lab.report.readme's output on the committed records: the
    error every projection carries and the MI355X band, no measured figure of the article beside them."""
    from k3lab.report import readme

    text = (report.REPO / "README.md").read_text()
    section = readme.readme_section(text)
    assert section == readme.markdown(report.REPO), "run: python -m k3lab.report.readme --write"
    n = front._serving_numbers(report.REPO)
    assert f"worst {n['error']['worst']:.0%}" in section and "band " in section
    assert _measurements_beside_projections(section) == []
    # the writer puts the paragraph between the markers, and refuses a file without them
    path = tmp_path / "README.md"
    path.write_text(f"head\n{readme.BEGIN}\nstale\n{readme.END}\ntail\n")
    assert readme.write_readme(path) and readme.readme_section(path.read_text()) == section
    assert not readme.write_readme(path)
    path.write_text("no markers\n")
    with pytest.raises(ValueError, match="lacks the markers"):
        readme.write_readme(path)


def test_a_study_page_draws_the_roofline_of_its_shown_cases():
    """A study whose records carry bytes and flops shows its roofline (the H200's measured ceilings, MI355X's
    labelled projected) under its committed table; one without formulas shows none and no error."""
    from k3lab.report import sections

    page = sections._committed("mla_padding", report.REPO)
    assert "mla_padding roofline on NVIDIA H200 (committed records)" in page
    assert "AMD Instinct MI355X (projected)" in page and page.count("Plotly.newPlot") == 2
    other = sections._committed("agent_cache", report.REPO)
    assert "roofline" not in other and other.count("Plotly.newPlot") == 1


def test_shown_cases_leave_out_variants_and_keep_graph_timings():
    from k3lab import bench

    for study in ("copy_removal", "mla_padding", "kda_verify", "kda_scan", "kda_decode", "launch_overhead"):
        recs = bench.load_records(study=study, device="nvidia-h200")
        shown = tables.shown_cases(recs)
        cases = {r.case for r in shown}
        assert shown and len(cases) <= tables.MAX_CASES, study
        assert not any("." in c for c in cases), study
        graph = {(r.case, r.variant) for r in recs if r.mode == "graph"}
        graph_cases = {c for c, v in graph if v == "after"}
        # graph timings where a case has them; an eager one only for a variant never replayed
        assert all(r.mode == "graph" or (r.case, r.variant) not in graph for r in shown if r.case
                   in graph_cases)
        t = tables.compact(shown)
        assert not t.isna().all().any(), study  # no empty column


def test_cpu_section_shows_no_interpreter_timings():
    from k3lab import bench
    from k3lab.report.sections import INTERPRETER_NOTE, LiveRun, study_section

    recs = [r for r in bench.load_records(study="kda_verify", device="nvidia-h200") if r.case == "b1_t4"]
    page = study_section(LiveRun("kda_verify", recs, "passed", 1.0), report.REPO, gpu=False)
    mine = page.split("On this machine", 1)[1]
    assert INTERPRETER_NOTE in mine and "<table" not in mine
    assert "On the H200" in page and page.count("<table") == 1


def test_study_tables_keep_the_sweeps_order_and_write_plain_numbers():
    """Committed cases in sweep order (ctx1k before ctx32k before ctx128k; not alphabetical), and the
    128K before (about 2,890 us) as a plain number, not 2.89e+03."""
    from k3lab import bench

    recs = bench.load_records(study="mla_padding", device="nvidia-h200")
    shown = tables.shown_cases(tables.in_case_order(recs, "mla_padding"))
    cases = list(dict.fromkeys(r.case for r in shown))
    assert cases.index("ctx1k") < cases.index("ctx32k") < cases.index("ctx128k"), cases
    assert sorted(cases) != cases  # alphabetical would put ctx128k first
    page = tables.to_html(tables.compact(shown))
    assert "e+0" not in page and "e-0" not in page
    before_128k = next(r.median_us for r in shown if r.case == "ctx128k" and r.variant == "before")
    assert f"<td>{tables.plain(before_128k)}</td>" in page and "," in tables.plain(before_128k)


def test_a_study_s_own_list_sets_the_order():
    from types import SimpleNamespace

    recs = [SimpleNamespace(case=c) for c in ("b", "zz9", "a", "zz10")]
    known = tables.case_order("launch_overhead")
    assert known  # the study lists its cases on any machine
    mixed = [SimpleNamespace(case=c) for c in reversed(known)] + recs
    out = [r.case for r in tables.in_case_order(mixed, "launch_overhead")]
    assert out == known + ["a", "b", "zz9", "zz10"]


def test_exported_pages_load_nothing_from_the_network():
    """Notebook 06 (53 formulas, a widget explorer, plotly figures) exported as the report exports it: no
    script, style, image or module from the network (require.js, MathJax, mermaid, the CDN widget
    manager), the widget view carried in the page, and the formulas as MathML."""
    import re

    from k3lab.report import pages

    nb = nbformat.read(report.REPO / "notebooks" / "06_draft_depth.ipynb", as_version=4)
    page = pages.export_html(nb)
    assert pages.remote_loads(page) == [], pages.remote_loads(page)
    assert "unpkg.com" not in page and "html-manager" not in page and "require.min.js" not in page
    assert "k3labWidgetKinds" in page and '<script src="../plotly.min.js"></script>' in page
    # the check itself sees each kind of load (it must be able to fail)
    seen = pages.remote_loads("<script src='https://cdn.x/a.js'></script><link rel=stylesheet "
                              "href='//fonts.x/b.css'><img src=\"http://i.x/c.png\"><style>"
                              "@import url(https://s.x/d.css)</style><script>import('https://m.x/e.js')"
                              "; var u = 'https://unpkg.com/@jupyter-widgets/html-manager@1/dist/"
                              "embed-amd.js';</script><a href='https://link.x/'>a link</a>")
    assert len(seen) == 6 and not [u for u in seen if "link.x" in u], seen
    pytest.importorskip("latex2mathml", reason="without latex2mathml the formulas stay as LaTeX text")
    formulas = sum(len(re.findall(r"\$\$.+?\$\$|\$[^$\n]+\$", c.source, flags=re.S))
                   for c in nb.cells if c.cell_type == "markdown")
    assert formulas and page.count("<math") >= formulas


def test_every_widget_kind_k3lab_shows_is_drawn_offline():
    """Each ipywidgets class that k3lab or a notebook builds has a view in the pages' widget view (a new
    kind fails here, before a page shows it as a box that names it)."""
    import json
    import re

    from k3lab.report import pages

    texts = [p.read_text() for p in (report.REPO / "k3lab").rglob("*.py")]
    texts += ["".join("".join(c["source"]) for c in json.loads(p.read_text())["cells"])
              for p in report.notebook_paths()]
    built = {m for t in texts for m in re.findall(r"\b(?:w|widgets|ipywidgets)\.([A-Z]\w+)\(", t)}
    assert {"FloatText", "FloatSlider", "IntSlider", "Dropdown", "VBox", "Output"} <= built, built
    views = {b for b in built if f"{b}Model" not in pages.NOT_VIEWS and b not in ("Layout",)}
    assert not {f"{b}Model" for b in views} - pages.drawn_widget_kinds()
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {pages.WIDGET_STATE_MIME: {"state": {
        "a": {"model_name": "FloatSliderModel"}, "b": {"model_name": "LayoutModel"},
        "c": {"model_name": "FancyModel"}}}}
    assert pages.undrawn_widget_kinds(nb) == {"FancyModel"}


def _stock_cell_seconds(path, timeout_s: int) -> tuple[dict, object]:
    """Execute with stock nbclient, what `jupyter nbconvert --execute` and papermill run (its own Output
    mimic, echo included); each cell's seconds and the executed notebook."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    began, seconds = {}, {}
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.on_cell_execute = lambda cell, cell_index: began.__setitem__(cell_index, time.perf_counter())
    client.on_cell_executed = lambda cell, cell_index, execute_reply: seconds.__setitem__(
        cell_index, time.perf_counter() - began[cell_index])
    client.execute()
    return seconds, nb


def test_notebook_06s_explorer_does_not_stall_under_stock_nbconvert(tmp_path):
    """The explorer (k3lab.studies.draft_depth.explorer) fills its Output from the kernel, so stock
    nbclient has nothing to echo and no reply to sit on: each explorer cell after the first (which
    imports plotly) takes well under a second here; a captured Output waited several seconds a cell."""
    src = _notebook(tmp_path / "explorer.ipynb", "import k3lab.studies.draft_depth as dd",
                    *["dd.explorer()"] * 4, "print('done')")
    seconds, ran = _stock_cell_seconds(src, timeout_s=60)
    assert max(seconds[i] for i in (2, 3, 4)) < 3, seconds
    assert "done" in ran.cells[-1].outputs[0]["text"]
    state = ran.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    drawn = [m["state"]["outputs"] for m in state.values() if m["model_name"] == "OutputModel"]
    assert len(drawn) == 4 and all("application/vnd.plotly.v1+json" in o[0]["data"] for o in drawn)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("runner", ["nbconvert", "papermill"])
def test_notebook_06_runs_under_stock_runners(tmp_path, runner):
    """`jupyter nbconvert --to notebook --execute` (and papermill where it is installed) run notebook 06
    to the end, each cell within nbconvert's per-cell limit given here."""
    import subprocess
    import sys

    src = report.REPO / "notebooks" / "06_draft_depth.ipynb"
    out = tmp_path / "06.ipynb"
    if runner == "papermill":
        pytest.importorskip("papermill", reason="papermill is not installed (optional)")
        cmd = [sys.executable, "-m", "papermill", str(src), str(out), "--execution-timeout", "300",
               "--cwd", str(src.parent)]
    else:
        cmd = [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(src),
               "--output", str(out), "--ExecutePreprocessor.timeout=300"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1100, cwd=src.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = nbformat.read(out, as_version=4)
    code = [c for c in ran.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code)


def test_the_band_phrase_says_when_its_low_end_reaches_nothing():
    assert front.band_phrase(1610.0, 26190.0) == "band 1,610 to 26,190"
    low_none = front.band_phrase(0.0, 27140.0)
    assert low_none.startswith("band up to 27,140") and "none reaching the target" in low_none
