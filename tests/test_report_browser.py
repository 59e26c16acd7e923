"""The report opened in headless Chromium: every plot renders (an SVG in each plot) and the page's
console shows no error. Needs Debian's `chromium` (.ci/run installs it); skips with a reason without."""

import os
import re
import shutil
import subprocess

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


def _render(page):
    probe = page.with_name("probe_" + page.name)
    probe.write_text(page.read_text().replace("<head>", "<head>" + CONSOLE_HOOK, 1))
    run = subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=15000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout, run.stderr


def test_report_plots_render_and_the_console_is_clean(tmp_path):
    page = report.build_report(out=tmp_path, run_studies=False, run_notebooks=False)
    source = page.read_text()
    expected = source.count('class="plotly-graph-div"')
    assert expected >= 5, "the report should hold the H200 figures of the studies"
    dom, log = _render(page)
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
    dom, _ = _render(page)
    assert "console.error: bad thing" in dom and "not_defined" in dom
    assert "main-svg" not in dom
