"""A notebook as one HTML page that opens offline (a workshop room without a network), widgets drawn.

nbconvert's lab page would fetch require.js, MathJax, mermaid and the ipywidgets HTML manager from CDNs.
Here none of them is loaded: the page is rendered through a template of our own on top of nbconvert's
`lab` template (`OFFLINE_TEMPLATE`) that leaves those blocks out and carries instead
- plotly.js, the report's local copy (`plotly_src`, by default ../plotly.min.js beside the page's folder);
- the formulas of the markdown cells as MathML (`math_to_mathml`, with latex2mathml; browsers draw
  MathML themselves; without latex2mathml they stay as their LaTeX source);
- a small widget view of our own, inline (widgets.js): it draws every ipywidgets view of the page from
  the widget state saved in the notebook (sliders, text boxes, menus, boxes, Output widgets with their
  figures and tables), as the run left it and read-only, since a page has no kernel. The HTML manager
  itself (@jupyter-widgets/html-manager) is not installed by any of our dependencies, and a bundle from a
  CDN is what a room without a network cannot load.
A `<script src>` to a remote address that still gets in (a newer nbconvert's block) is removed
(`drop_remote_scripts`); `remote_loads(page)` lists anything left that a browser would fetch from the
network, which the report's tests hold at none.
"""

from __future__ import annotations

import copy
import html
import re
from functools import lru_cache
from pathlib import Path

WIDGETS_JS = Path(__file__).with_name("widgets.js")
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
WIDGET_CSS = (
    ".k3lab-widget{margin:4px 0;font-family:var(--jp-ui-font-family,sans-serif);font-size:13px}"
    ".k3w-vbox{display:flex;flex-direction:column;gap:2px}"
    ".k3w-hbox{display:flex;flex-direction:row;flex-wrap:wrap;gap:8px}.k3w-grid{display:grid;gap:4px}"
    ".k3w-row{display:flex;align-items:center;gap:6px;min-height:28px}"
    ".k3w-label{min-width:80px;text-align:right;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}"
    ".k3w-slider{display:inline-flex;align-items:center;gap:6px}.k3w-slider input{width:220px}"
    ".k3w-readout{font-family:monospace}.k3w-choice,.k3w-button{border:1px solid #bbb;padding:1px 8px;"
    "margin-right:2px;background:#f5f5f5}.k3w-picked{background:#dbe8f7;border-color:#5a8fd6}"
    ".k3w-title{font-weight:bold;margin-top:6px}.k3w-stderr{background:#fdd}.k3w-output{margin:4px 0}"
    ".k3lab-widget-missing,.k3lab-widget-unsupported{border:1px dashed #b00;color:#b00;padding:4px}"
)
# On top of nbconvert's lab page: no require.js, no MathJax, no mermaid, no CDN widget manager; the
# report's plotly.js and the widget view instead (module docstring).
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}
<script src="{{ resources.k3lab.plotly_src }}"></script>
<style type="text/css">{{ resources.k3lab.widget_css }}</style>
<script>{{ resources.k3lab.widgets_js }}</script>
{%- endblock html_head_js -%}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
TEMPLATE_NAME = "k3lab_offline.html.j2"

_CODE = re.compile(r"(```.*?```|~~~.*?~~~|`[^`\n]*`)", re.S)
_DISPLAY_MATH = re.compile(r"\$\$(.+?)\$\$", re.S)
_INLINE_MATH = re.compile(r"(?<![\\$])\$(?![\s$])([^$\n]+?)(?<![\s\\])\$(?!\d)")
_REMOTE_SCRIPT = re.compile(r"<script[^>]*\ssrc=[\"']?(?:https?:)?//[^>]*>\s*</script>", re.I)
_REMOTE = r"(?:https?:)?//[^\s\"'<>)]+"
# what a browser fetches by itself: a script, a stylesheet or icon, an image, a frame, a module import, a
# CSS url(), and the addresses a script builds from a string (the CDN widget loader did)
_LOADS = (
    re.compile(r"<(?:script|img|iframe|embed|source|audio|video)\b[^>]*\ssrc=[\"']?(" + _REMOTE + ")", re.I),
    re.compile(r"<link\b[^>]*\shref=[\"']?(" + _REMOTE + ")", re.I),
    re.compile(r"\bimport\s*\(\s*[\"'](" + _REMOTE + ")", re.I),
    re.compile(r"\bfrom\s+[\"'](" + _REMOTE + ")", re.I),
    re.compile(r"url\(\s*[\"']?(" + _REMOTE + ")", re.I),
    re.compile(r"[\"'](https?://(?:unpkg\.com|cdn\.jsdelivr\.net|cdnjs\.cloudflare\.com)[^\"']*)", re.I),
)


def math_to_mathml(markdown: str) -> str:
    """The $...$ and $$...$$ formulas of a markdown text as MathML (code spans and fences untouched);
    a formula latex2mathml cannot read stays as its source. Unchanged when latex2mathml is missing."""
    try:
        from latex2mathml.converter import convert
    except ImportError:
        return markdown

    def render(match, display: str) -> str:
        try:
            return convert(match.group(1).strip(), display=display)
        except Exception:  # noqa: BLE001 - an unreadable formula stays readable as LaTeX
            return html.escape(match.group(0))

    parts = _CODE.split(markdown)
    for i in range(0, len(parts), 2):  # the even parts lie outside code
        text = _DISPLAY_MATH.sub(lambda m: "\n\n" + render(m, "block") + "\n\n", parts[i])
        parts[i] = _INLINE_MATH.sub(lambda m: render(m, "inline"), text)
    return "".join(parts)


def drop_remote_scripts(page: str) -> str:
    """page without <script src="http(s)://..."> tags."""
    return _REMOTE_SCRIPT.sub("", page)


def remote_loads(page: str) -> list[str]:
    """The network addresses `page` would load by itself (scripts, styles, images, frames, module
    imports, CSS urls, CDN addresses in scripts); a plain link (<a href>) is not a load."""
    return sorted({m.group(1) for pattern in _LOADS for m in pattern.finditer(page)})


@lru_cache(maxsize=1)
def widgets_js() -> str:
    return WIDGETS_JS.read_text(encoding="utf-8")


def drawn_widget_kinds() -> frozenset[str]:
    """The ipywidgets model names the page's widget view draws (the keys of VIEWS in widgets.js)."""
    body = widgets_js().split("var VIEWS = {", 1)[1].split("};", 1)[0]
    return frozenset(re.findall(r"\b([A-Z]\w*Model):", body))


def widget_kinds(nb) -> set[str]:
    """The ipywidgets model names whose state `nb` saved (none when it saved no widget state)."""
    state = nb.get("metadata", {}).get("widgets", {}).get(WIDGET_STATE_MIME, {}).get("state", {})
    return {m.get("model_name") for m in state.values()}


# the models that are not views: a page never draws them by themselves
NOT_VIEWS = frozenset({"LayoutModel", "DescriptionStyleModel", "SliderStyleModel", "ButtonStyleModel",
                       "ProgressStyleModel", "ToggleButtonsStyleModel", "CheckboxStyleModel",
                       "TextStyleModel", "HTMLStyleModel", "HTMLMathStyleModel", "LabelStyleModel"})


def undrawn_widget_kinds(nb) -> set[str]:
    """The view models `nb` saved that the offline page cannot draw (drawn as a box naming them)."""
    return widget_kinds(nb) - drawn_widget_kinds() - NOT_VIEWS - {None}


@lru_cache(maxsize=1)
def _exporter():
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    return HTMLExporter(template_name="lab", template_file=TEMPLATE_NAME,
                        extra_loaders=[DictLoader({TEMPLATE_NAME: OFFLINE_TEMPLATE})])


def export_html(nb, plotly_src: str = "../plotly.min.js") -> str:
    """The notebook as one HTML page that needs no network (module docstring); `nb` is not changed.
    plotly_src: where the page finds plotly.js (the report's copy beside the notebooks' folder)."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            cell.source = math_to_mathml(cell.source)
    resources = {"k3lab": {"plotly_src": plotly_src, "widgets_js": widgets_js(), "widget_css": WIDGET_CSS}}
    body, _ = _exporter().from_notebook_node(nb, resources=resources)
    return drop_remote_scripts(body)
