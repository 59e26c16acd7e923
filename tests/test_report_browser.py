"""The report and an exported notebook page opened in headless Chromium with the network off: every plot
renders (an SVG in each plot), every widget view draws, a stopped notebook's page says where and why, the
console shows no error and no request leaves the machine. Needs Debian's `chromium` (.ci/run installs
it); skips with a reason without."""

import functools
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from k3lab import report

BROWSER = next(
    (
        shutil.which(b)
        for b in (
            os.environ.get("K3LAB_CHROMIUM", ""),
            "chromium",
            "chromium-headless-shell",
            "chromium-browser",
        )
        if b and shutil.which(b)
    ),
    None,
)
pytestmark = pytest.mark.skipif(BROWSER is None,
                                reason="no headless Chromium here (Debian: apt-get install chromium; "
                                                        ".ci/run installs it)")

# Collects what the page reports as an error into the DOM, where --dump-dom can read it back
# (Chromium's own log does not say which console messages were errors).
CONSOLE_HOOK = """<script>
window.__errors = [];
const keep = (m) => { window.__errors.push(String(m));
  const el = document.getElementById('k3lab-errors') || Object.assign(document.createElement('pre'), {id:
  'k3lab-errors'});
  el.textContent = window.__errors.join('\\n'); (document.body || document.documentElement).appendChild(el);
  };
const err = console.error.bind(console);
console.error = (...a) => { keep('console.error: ' + a.join(' ')); err(...a); };
window.addEventListener('error', (e) => keep('error: ' + (e.message || e.target?.src || e.type)), true);
window.addEventListener('unhandledrejection', (e) => keep('unhandled rejection: ' + e.reason));
</script>"""


class _Network:
    """The network as the browser sees it: every request Chromium sends goes to this listener on
    localhost (its proxy), which records the request's first line and answers nothing. Names do not
    resolve either, so a page that needs the network cannot get it, and each try is on record."""

    def __init__(self):
        self.requests: list[str] = []
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.settimeout(2)
            try:
                self.requests.append(conn.recv(4096).split(b"\r\n", 1)[0].decode("latin-1"))
            except OSError as exc:
                self.requests.append(f"(unread: {exc})")
            finally:
                conn.close()

    def close(self):
        self._sock.close()


def _render(page):
    """Chromium's DOM of `page` after its scripts ran, its log, and the requests it sent to the network
    (none may leave the machine: the network is off, see _Network), the browser's own left out."""
    dom, log, requests = _render_raw(page)
    own = _browser_own()
    return dom, log, [r for r in requests if _host(r) not in own
                      and not any(_host(r) == d or _host(r).endswith("." + d) for d in BROWSER_OWN_DOMAINS)]


def _render_raw(page):
    probe = page.with_name("probe_" + page.name)
    probe.write_text(page.read_text().replace("<head>", "<head>" + CONSOLE_HOOK, 1))
    net = _Network()
    try:
        run = subprocess.run(
            [
                BROWSER,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--enable-logging=stderr",
                "--v=0",
                # the network off: every request to the recorder, no name resolves, and none of the
                # browser's own background requests (updates, sync) that would blur what the page asked
                f"--proxy-server=http://127.0.0.1:{net.port}",
                "--proxy-bypass-list=<-loopback>",
                "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--no-pings",
                f"--user-data-dir={page.parent / '.chromium-profile'}",
                "--virtual-time-budget=15000",
                "--dump-dom",
                probe.as_uri(),
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        net.close()
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, run.stderr, net.requests


# Chromium itself still calls Google's own hosts whatever the flags (sign-in, connectivity, device
# check-in: www., accounts., clients2., android.clients.google.com, redirector.gvt1.com), at moments of its
# own: those are the browser's, not the page's. They are left out of what a page is held to, with
# whatever an empty page also asks for (`_browser_own`, measured once).
BROWSER_OWN_DOMAINS = ("google.com", "gvt1.com")


def _host(request: str) -> str:
    """The host a proxy request line asks for: 'CONNECT h:443 ...' or 'GET http://h/... ...'."""
    parts = request.split()
    target = parts[1] if len(parts) > 1 else request
    return re.sub(r"^[a-z]+://", "", target).split("/", 1)[0].rsplit(":", 1)[0]


@functools.lru_cache(maxsize=1)
def _browser_own() -> frozenset:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="k3lab-blank-") as tmp:
        blank = Path(tmp) / "blank.html"
        blank.write_text("<html><head></head><body>nothing to load</body></html>")
        _, _, requests = _render_raw(blank)
    return frozenset(_host(r) for r in requests)


def test_report_plots_render_and_the_console_is_clean(tmp_path):
    page = report.build_report(out=tmp_path, run_studies=False, run_notebooks=False)
    source = page.read_text()
    expected = source.count('class="plotly-graph-div"')
    assert expected >= 5, "the report should hold the H200 figures of the studies"
    dom, log, requests = _render(page)
    assert not requests, f"the report asked the network for {requests}"
    plots = dom.split('class="plotly-graph-div')[1:]
    assert len(plots) == expected
    blank = [i for i, p in enumerate(plots) if "main-svg" not in p.split("plotly-graph-div", 1)[0]]
    assert not blank, f"plots {blank} of {expected} drew no SVG"
    errors = re.search(r'<pre id="k3lab-errors">(.*?)</pre>', dom, re.S)
    assert errors is None, errors.group(1)
    uncaught = [ln for ln in log.splitlines() if "CONSOLE" in ln and "Uncaught" in ln]
    assert not uncaught, uncaught


def test_the_probe_catches_an_error_and_a_blank_plot(tmp_path):
    # the test above must be able to fail: a page with a broken script and a plot div plotly never drew
    page = tmp_path / "bad.html"
    page.write_text('<html><head></head><body><div class="plotly-graph-div"></div>'
                    "<script>console.error('bad thing'); not_defined();</script></body></html>")
    dom, _, _ = _render(page)
    assert "console.error: bad thing" in dom and "not_defined" in dom
    assert "main-svg" not in dom


def test_the_network_probe_sees_every_kind_of_remote_load(tmp_path):
    # the no-network assertions above and below must be able to fail: a script, an image and a module
    # import from the network each reach the recorder
    page = tmp_path / "remote.html"
    page.write_text("<html><head><script src='https://unpkg.com/nothing@1/x.js'></script></head><body>"
                    "<img src='http://example.org/a.png'><script type='module'>"
                    "import('https://cdn.jsdelivr.net/npm/nothing@1/y.mjs').catch(() => {});</script>"
                    "</body></html>")
    _, _, requests = _render(page)
    text = " ".join(requests)
    assert "unpkg.com" in text and "example.org" in text and "cdn.jsdelivr.net" in text, requests


# A notebook with every kind of widget k3lab's notebooks show, whose last cell fails: the page must draw
# them all offline (the widget state of the cells that ran is saved though the run failed), and say on
# top which cell stopped the run and why.
WIDGET_CELLS = (
    "from k3lab.workshop.lesson import predict\n"
    "g = predict('How many microseconds does the step take', 3.5, unit='us', widget=True)",
    "import k3lab.studies.draft_depth as dd\ndd.explorer()",  # notebook 06's sliders, figure and table
    "import ipywidgets as w\n"
    "w.VBox([w.Dropdown(options=['mi355x', 'h200'], value='h200', description='GPU'),\n"
    "        w.HBox([w.Checkbox(value=True, description='on'), w.Button(description='go')]),\n"
    "        w.HTML('<b>bold words</b>'), w.Label('a label'), w.IntProgress(value=3, max=10),\n"
    "        w.ToggleButtons(options=['x', 'y'], value='y'), w.Textarea('some text'),\n"
    "        w.Tab(children=[w.Label('first'), w.Label('second')], titles=('A', 'B')),\n"
    "        w.IntRangeSlider(value=(2, 5), min=0, max=9),\n"
    "        w.SelectionSlider(options=['lo', 'hi'], value='hi')])",
    "raise RuntimeError('the lesson stops here')",
)


def _widget_page(tmp_path):
    import nbformat

    src = tmp_path / "01_widgets.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Widgets\n\n$a^2 + b^2$")]
                                  + [nbformat.v4.new_code_cell(c) for c in WIDGET_CELLS])
    nbformat.write(nb, src)
    out = tmp_path / "site" / "notebooks"
    with pytest.raises(report.NotebookFailed, match=r"code cell 4 of 4 \(index 4 in the file: `raise "
                                                    r"RuntimeError.*\) raised RuntimeError: the lesson stops "
                                                    r"here; 3 of 4 code cells ran before it"):
        report.execute_notebook(src, out, timeout_s=300)
    report._write_plotly_js(out.parent)  # the report's copy, beside the notebooks' folder
    return out / "01_widgets.html"


def test_an_exported_notebook_draws_every_widget_offline_and_names_where_it_stopped(tmp_path):
    page = _widget_page(tmp_path)
    source = page.read_text()
    views = source.count('<script type="application/vnd.jupyter.widget-view+json">')
    assert views == 3
    dom, log, requests = _render(page)
    assert not requests, f"the page asked the network for {requests}"
    errors = re.search(r'<pre id="k3lab-errors">(.*?)</pre>', dom, re.S)
    assert errors is None, errors.group(1)
    counts = re.search(r'<body[^>]*data-k3lab-widgets="([^"]*)"', dom)
    assert counts and counts.group(1) == f"views={views} drawn={views} missing=0 unsupported=0", counts
    drawn = dom.split('class="k3lab-widget"')[1:]
    assert len(drawn) == views
    # the prediction box holds the guess; the explorer's sliders, figure and table; the other kinds
    assert 'data-k3lab-model="FloatTextModel"' in drawn[0] and 'value="3.5"' in drawn[0]
    assert "How many microseconds" in dom
    explorer = drawn[1]
    assert explorer.count('data-k3lab-model="FloatSliderModel"') == 6
    assert "acceptance of draft 1" in explorer and 'data-k3lab-model="IntSliderModel"' in explorer
    assert "main-svg" in explorer, "the explorer's plotly figure was not drawn"
    assert "<table" in explorer and "speedup_vs_plain" in explorer
    kinds = set(re.findall(r'data-k3lab-model="(\w+)"', drawn[2]))
    assert kinds >= {"DropdownModel", "CheckboxModel", "ButtonModel", "HTMLModel", "LabelModel",
                     "IntProgressModel", "ToggleButtonsModel", "TextareaModel", "TabModel",
                     "IntRangeSliderModel", "SelectionSliderModel", "HBoxModel"}, kinds
    assert "<option selected=\"\">h200</option>" in drawn[2] and "bold words" in drawn[2]
    assert ">2 - 5<" in drawn[2] and ">hi<" in drawn[2]
    # the stop: a banner first on the page, naming the cell, its first line and the reason
    body = dom.split("<main>", 1)[1]
    first = body.index("Failed run")
    assert first < body.index("Widgets") and first < body.index('class="k3lab-widget"')
    banner = body[first:first + 1500]
    assert "code cell 4 of 4" in banner and "RuntimeError: the lesson stops here" in banner
    assert "raise RuntimeError(" in banner  # the cell's first line
    assert "Failed here" in body and body.index("Failed here") > body.index("the lesson stops here")
    assert "<math" in dom  # the formula drawn as MathML, no MathJax


def test_the_widget_probe_catches_a_view_without_state_and_a_kind_it_cannot_draw(tmp_path):
    # the widget assertions above must be able to fail: a view of a kind the page cannot draw, and one
    # whose state was not saved (nbconvert shows such a view's text instead, so it is written by hand)
    import json

    from k3lab.report.pages import WIDGET_STATE_MIME, widgets_js

    state = {"version_major": 2, "version_minor": 0, "state": {"odd": {
        "model_name": "FancyModel", "model_module": "x", "model_module_version": "1", "state": {}}}}
    views = "".join(f'<div><script type="application/vnd.jupyter.widget-view+json">{{"model_id": "{m}"}}'
                    "</script></div>" for m in ("gone", "odd"))
    page = tmp_path / "odd.html"
    page.write_text(f"<html><head><script>{widgets_js()}</script></head><body>{views}"
                    f'<script type="{WIDGET_STATE_MIME}">{json.dumps(state)}</script></body></html>')
    dom, _, requests = _render(page)
    assert not requests
    counts = re.search(r'<body[^>]*data-k3lab-widgets="([^"]*)"', dom)
    assert counts and counts.group(1) == "views=2 drawn=0 missing=1 unsupported=1", dom[-3000:]
    assert "ipywidgets FancyModel: not drawn" in dom and "state was not saved" in dom
