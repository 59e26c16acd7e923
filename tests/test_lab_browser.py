"""A learner's path through JupyterLab in a real browser: `jupyter lab` serves a copy of notebook 06 (no
token, a free localhost port, a temporary root), headless Chromium opens it, runs every cell through the
notebook's own "run all" command, and the test checks that every code cell ran without an error output,
that the explorer's ipywidgets sliders drew, and that dragging a slider with the mouse redraws the plotly
figure with other data.

How the browser is driven: the Chrome DevTools protocol over its websocket, with websocket-client (a
dependency of jupyter_server, so present wherever `jupyter lab` is). Selenium would need chromedriver
matched to the installed Chromium and a package this project does not otherwise use; Playwright
downloads its own browser, which an offline CI cannot. The protocol needs neither: the Chromium CI
already installs (.ci/run) is all it drives.

Skips, saying why, where Chromium, JupyterLab, ipywidgets' lab extension or websocket-client is missing.
Every wait has a deadline, and the test as a whole a pytest timeout, so it cannot hang. JupyterLab's
commands (open, Run All) are started and then polled, never awaited in one protocol reply: on a loaded
2-core machine Run All outlasts any one reply's wait.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = "06_draft_depth.ipynb"
BROWSER = next((shutil.which(b) for b in (os.environ.get("K3LAB_CHROMIUM", ""), "chromium",
                                          "chromium-browser", "google-chrome")
                if b and shutil.which(b)), None)
SERVER_START_S = 60       # jupyter lab answering its API
PAGE_S = 60               # the notebook open and its kernel idle
RUN_ALL_S = 150           # every cell executed (the notebook takes about 18 s alone on 2 cores)
REDRAW_S = 30             # the figure redrawn after the slider moved


def _missing() -> str | None:
    if BROWSER is None:
        return "no Chromium here (Debian: apt-get install chromium; .ci/run installs it)"
    for module, what in (("jupyterlab", "JupyterLab"), ("websocket", "websocket-client (jupyter_server's)"),
                         ("jupyterlab_widgets", "ipywidgets' JupyterLab extension (jupyterlab_widgets)")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed: the browser test needs it"
    return None


pytestmark = [pytest.mark.skipif(_missing() is not None, reason=_missing() or ""),
              pytest.mark.timeout(300), pytest.mark.slow]


try:   # a page too busy to answer within the socket's timeout is polled again, not a failure
    from websocket import WebSocketTimeoutException
    _WS_TIMEOUT: tuple = (WebSocketTimeoutException,)
except ImportError:
    _WS_TIMEOUT = ()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: str, deadline_s: float, probe, interval: float = 0.25, describe=None):
    """probe() until it returns something true; a pytest failure naming `what` at the deadline, with
    describe()'s account of the page where given."""
    end = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < end:
        try:
            last = probe()
        except (OSError, ValueError, *_WS_TIMEOUT) as e:   # not up yet, or the page busy past a reply's wait
            last = e
        else:
            if last:
                return last
        time.sleep(interval)
    seen = describe() if describe else last
    pytest.fail(f"timed out after {deadline_s:.0f} s waiting for {what} (seen: {str(seen)[:800]})")


class DevTools:
    """The few Chrome DevTools protocol calls the test needs, on one page's websocket."""

    def __init__(self, ws_url: str):
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (promises awaited); page errors raise."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"page error: {r['exceptionDetails'].get('exception', {}).get('description')}")
        return r["result"].get("value")

    def start(self, name: str, promise: str):
        """Start a JupyterLab command without waiting on it: its promise can take longer than one reply
        may (opening starts a kernel; Run All resolves when every cell ran), so its outcome goes to
        window.__k3lab[name] and `outcome` polls it."""
        return self.js(f"(() => {{ const s = window.__k3lab = window.__k3lab || {{}};"
                       f" s[{name!r}] = 'running'; ({promise}).then(() => {{ s[{name!r}] = 'done'; }},"
                       f" e => {{ s[{name!r}] = 'error: ' + e; }}); return true; }})()")

    def outcome(self, name: str) -> str:
        """'running' or 'done'; a rejected command fails the test with its error."""
        now = self.js(f"(window.__k3lab || {{}})[{name!r}] || 'not started'")
        if now.startswith("error") or now == "not started":
            pytest.fail(f"JupyterLab's {name} command: {now}")
        return now

    def mouse(self, kind: str, x: float, y: float, buttons: int = 1):
        self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", buttons=buttons,
                  clickCount=1)

    def close(self):
        self.ws.close()


def _stop(proc: subprocess.Popen):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture
def lab(tmp_path):
    """A jupyter lab serving a copy of notebook 06 from a temporary root; yields its notebook URL."""
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(REPO / "notebooks" / NOTEBOOK, root / NOTEBOOK)
    settings = tmp_path / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Every cell in the DOM (no windowed rendering), so the widgets are there to find wherever they sit.
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))
    port = _free_port()
    env = {**os.environ, "K3LAB_PREDICTIONS": "off", "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("K3LAB_WORKSHOP_GRADE", None)   # the learner's view: unsolved tasks, lesson goes on
    log = (tmp_path / "lab.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         "--ServerApp.port_retries=0", "--IdentityProvider.token=", "--ServerApp.password=",
         f"--ServerApp.root_dir={root}", f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--LabApp.expose_app_in_browser=True",
         "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
         "--ServerApp.terminals_enabled=False",
         *(["--allow-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])],  # CI's containers
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def up():
            if proc.poll() is not None:
                tail = (tmp_path / "lab.log").read_text()[-2000:]
                pytest.fail(f"jupyter lab exited ({proc.returncode}): {tail}")
            with urllib.request.urlopen(f"{base}/api/status", timeout=2) as r:
                return r.status == 200
        _wait("jupyter lab's API", SERVER_START_S, up)
        yield f"{base}/lab/tree/{NOTEBOOK}"
    finally:
        _stop(proc)
        log.close()


@pytest.fixture
def page(tmp_path, lab):
    """Headless Chromium on the notebook's URL; yields DevTools on the page."""
    url = lab
    profile = tmp_path / "chromium"
    proc = subprocess.Popen(
        [BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--window-size=1400,1000",
         "--remote-debugging-port=0", "--remote-allow-origins=*", f"--user-data-dir={profile}",
         "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tools = None
    try:
        port_file = profile / "DevToolsActivePort"
        first = _wait("Chromium's DevTools port", 30, lambda: port_file.is_file() and port_file.read_text())
        port = int(first.splitlines()[0])

        def target():
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            return pages[0]["webSocketDebuggerUrl"] if pages else None
        tools = DevTools(_wait("a page target", 15, target))
        tools.call("Page.enable")
        tools.call("Page.navigate", url=url)
        yield tools
    finally:
        if tools is not None:
            tools.close()
        _stop(proc)


# The notebook panel JupyterLab shows (window.jupyterapp: --LabApp.expose_app_in_browser).
# Found among the main area's widgets by its name: a headless window has no focus, and JupyterLab's
# currentWidget follows focus.
PANEL = (f"window.jupyterapp && Array.from(window.jupyterapp.shell.widgets('main'))"
         f".find(w => w.title.label === '{NOTEBOOK}')")
CELLS_STATE = f"""(() => {{
  const p = {PANEL};
  if (!p || !p.content || !p.sessionContext || !p.sessionContext.session) return null;
  const cells = Array.from(p.content.model.cells).filter(c => c.type === 'code');
  return {{status: p.sessionContext.session.kernel.status,
           counts: cells.map(c => c.executionCount),
           errors: cells.flatMap((c, i) => Array.from({{length: c.outputs.length}},
                                                       (_, j) => c.outputs.get(j).toJSON())
             .filter(o => o.output_type === 'error')
             .map(o => `code cell ${{i}}: ${{o.ename}}: ${{o.evalue}}`))}};
}})()"""
# The explorer's plotly figure: the div plotly.js draws into carries the figure's data.
FIGURE = """(() => {
  const plots = Array.from(document.querySelectorAll('.widget-vbox .js-plotly-plot'));
  if (!plots.length || !plots[plots.length - 1].data) return null;
  const p = plots[plots.length - 1];
  return JSON.stringify({data: p.data.map(t => ({x: Array.from(t.x || []), y: Array.from(t.y || [])})),
                         title: p.layout && p.layout.title && p.layout.title.text});
})()"""
HANDLE = """(() => {
  const s = Array.from(document.querySelectorAll('.widget-vbox .widget-slider'))
    .find(el => (el.querySelector('.widget-label') || {}).textContent === 'acceptance of draft 1');
  if (!s) return null;
  const h = s.querySelector('.noUi-handle'); if (!h) return null;
  h.scrollIntoView({block: 'center'});
  const r = h.getBoundingClientRect(), t = s.querySelector('.noUi-target').getBoundingClientRect();
  return {x: r.x + r.width / 2, y: r.y + r.height / 2, track: t.width,
          readout: (s.querySelector('.widget-readout') || {}).textContent};
})()"""


# What the page shows, for a failure message: the app, the current tab, its kernel, any dialog.
SUMMARY = """(() => ({title: document.title, app: !!window.jupyterapp,
  widgets: window.jupyterapp && Array.from(window.jupyterapp.shell.widgets('main')).map(w => w.title.label),
  kernel: (() => { try { const s = (""" + PANEL + """).sessionContext;
    return s.kernelDisplayName + ' '
      + (s.session && s.session.kernel ? s.session.kernel.status : 'no session'); }
    catch (e) { return String(e); } })(),
  dialog: (document.querySelector('.jp-Dialog') || {}).innerText || null}))()"""


def test_notebook_06_runs_in_jupyterlab_and_its_slider_redraws_the_figure(page):
    tools = page
    t0 = time.monotonic()
    page_now = functools.partial(tools.js, SUMMARY)
    _wait("JupyterLab to load in the page", PAGE_S,
          lambda: tools.js("!!window.jupyterapp") and tools.start("restore", "window.jupyterapp.restored"),
          describe=page_now)
    _wait("JupyterLab to restore its layout", PAGE_S, lambda: tools.outcome("restore") == "done",
          describe=page_now)
    tools.start("open", f"window.jupyterapp.commands.execute('docmanager:open', {{path: '{NOTEBOOK}', "
                        "factory: 'Notebook'})")
    _wait("the notebook to open with an idle kernel", PAGE_S,
          lambda: tools.outcome("open") == "done" and (tools.js(CELLS_STATE) or {}).get("status") == "idle",
          describe=page_now)
    # The menu's Run > Run All Cells, on the notebook's panel (activated: the command acts on the current).
    tools.start("run-all", f"(() => {{ const p = {PANEL}; window.jupyterapp.shell.activateById(p.id); "
                           "p.activate(); "
                           "return window.jupyterapp.commands.execute('notebook:run-all-cells'); })()")

    def all_ran():
        state = tools.js(CELLS_STATE)
        if state and state["errors"]:
            pytest.fail("a cell raised in JupyterLab: " + "; ".join(state["errors"]))
        done = tools.outcome("run-all") == "done"
        return state if done and state and state["status"] == "idle" and all(state["counts"]) else None
    state = _wait("every code cell to run (Run All)", RUN_ALL_S, all_ran, interval=0.5)
    assert state["counts"] == sorted(state["counts"]), f"cells ran out of order: {state['counts']}"

    # The widgets drew: the explorer's sliders (ipywidgets' views, not their text fallback).
    sliders = _wait("the explorer's ipywidgets sliders in the page", 30,
                    lambda: tools.js("document.querySelectorAll('.widget-vbox .widget-slider').length"))
    assert sliders >= 7, f"expected the explorer's 7 sliders, found {sliders}"
    before = _wait("the explorer's plotly figure", 30, lambda: tools.js(FIGURE))
    assert json.loads(before)["data"], "the explorer's figure has no traces"

    # Drag the "acceptance of draft 1" handle a third of the track to the left, as a learner would.
    h = _wait("the slider's handle", 10, lambda: tools.js(HANDLE))
    x, y, dx = h["x"], h["y"], -h["track"] / 3
    tools.mouse("mouseMoved", x, y, buttons=0)
    tools.mouse("mousePressed", x, y)
    for i in range(1, 11):
        tools.mouse("mouseMoved", x + dx * i / 10, y)
    tools.mouse("mouseReleased", x + dx, y, buttons=0)
    def readout_moved():
        now = tools.js(HANDLE)
        return now if now and now["readout"] != h["readout"] else None
    moved = _wait("the slider's readout to change", 10, readout_moved)
    after = _wait("the figure to redraw with other data", REDRAW_S,
                  lambda: (lambda f: f if f and f != before else None)(tools.js(FIGURE)))
    b, a = json.loads(before), json.loads(after)
    assert a["data"] != b["data"], f"the figure's title changed but not its data: {a['title']!r}"
    print(f"JupyterLab run of {NOTEBOOK}: {len(state['counts'])} code cells, slider {h['readout']} -> "
          f"{moved['readout']}, figure {b['title']!r} -> {a['title']!r}; {time.monotonic() - t0:.1f} s "
          f"in the browser")
