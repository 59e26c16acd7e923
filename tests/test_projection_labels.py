"""No projection set beside a measurement as comparable, anywhere a reader meets one (issue 45).

Scanned: README.md, every docs/*.md, the report's serving section as rendered from the committed records
(`report.front.serving_section`), every notebook's markdown, and the serving strings that reach a page
(`serving.article`'s tables and DROPPED, `serving.bands.calibration`, the what-if figure's title). A text
is cut into blocks: a paragraph, a list item, a heading, a table row read with its table's header, and
each whole table (HTML: a paragraph, a heading, a figure, a table row with its header row, a whole
table). Three rules:

1. **No measurement beside a projection.** A block that shows the article's measured tokens/s/GPU (MI355X
   or B300, any spelling) and a projection (a projected figure below, or the words projected /
   projection / the model's / step model / serving model) must say "calibration": the measured figure may
   stand only as a calibration, with its ratio, as docs/serving.md's calibration table does.
2. **A projected figure is labelled.** A block that shows a projected figure says "project" (projected,
   projection) in the block or its table's header.
3. **A projected figure carries its measured error.** The section around it (markdown: from one heading to
   the next; the report: the whole serving section) states the step model's worst error ("worst 31%",
   "up to 31%", from `validate.model_error()`) or says the error is not known.

The projected figures are computed here from the committed records: each `bands.PROJECTIONS` band at the
article's interactivity (central, low and high end), the MI355X ladder's rungs at the target and at the
target every rung reaches, and `article.steps`' rows; each at least 1,000 tokens/s/GPU (a smaller number
is too common to tie to a projection) and spelled as the pages write them (to the nearest ten, or whole).
Each rule is shown to fail on a planted block. Its limit: a projected figure written another way (a
rounded "18.5K", a ratio) or a measurement paraphrased without its number is not caught.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest

from k3lab import bench
from k3lab.serving import article, bands, curve, hardware, inputs, validate

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

pytestmark = pytest.mark.skipif(not bench.load_records("decode_step", device="nvidia-h200"),
                                reason="no committed H200 decode_step records")

PROJECTION_WORDS = re.compile(r"\bproject(ed|ion|ions)\b|\b(the|step|serving) model('s)?\b", re.I)
LABEL = re.compile(r"project", re.I)
CALIBRATION = re.compile(r"calibrat", re.I)


def spellings(v: float) -> set[str]:
    """How a page writes tokens/s `v`: whole, to the nearest ten, with and without thousands commas."""
    out = set()
    for x in (v, round(v, -1)):
        out |= {f"{x:,.0f}", f"{x:.0f}"}
    return out


def _pattern(strings: set[str]) -> re.Pattern:
    alts = "|".join(re.escape(s) for s in sorted(strings, key=len, reverse=True))
    return re.compile(rf"(?<![\w,.])({alts})(?![\w]|[,.]\d)")


ARTICLE_MI355X = f"{hardware.SEED['mi355x_tokens_per_s_gpu']:,.0f}"  # planted in the tests below
MEASURED = _pattern({s for k in ("mi355x_tokens_per_s_gpu", "b300_tokens_per_s_gpu")
                     for s in spellings(hardware.SEED[k])})


@pytest.fixture(scope="module")
def known():
    """The projected figures and the step model's error, from the committed records."""
    inp, work, err = inputs.node_inputs(), curve.agent_workload(), validate.model_error()
    target = hardware.SEED["interactivity"]
    values = []
    for key in bands.PROJECTIONS:
        a = bands.band(inp, key, work, error=err, target=target, per_source=False)["at_target"]
        values += [a["central"], a["low"], a["high"]]
    lad = curve.ladder(inp, hardware.gpu("mi355x"), work, target=target)
    values += [r["at_target"] for r in lad]
    values += [r["at_target"] for r in curve.shares_at(lad, curve.reachable_target(lad))]
    values += [r["tokens_per_s_gpu"] for r in article.steps(inp, work, target=target, error=err)]
    figs = {s for v in values if v and v >= 1000 for s in spellings(v)}
    # a figure that is also the article's measurement would make every rule ambiguous
    assert not figs & {s for k in ("mi355x_tokens_per_s_gpu", "b300_tokens_per_s_gpu")
                       for s in spellings(hardware.SEED[k])}
    worst = f"{err['worst']:.0%}"
    return {"projected": _pattern(figs), "error": re.compile(rf"(worst|up to) {re.escape(worst)}|not known"),
            "err": err, "inp": inp, "work": work}


# ------------------------------------------------------------------ cutting a text into blocks
def markdown_sections(text: str) -> list[list[str]]:
    """Each heading's section of `text` as its list of blocks (module docstring); HTML comments, which
    no reader sees, dropped."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    sections, blocks, para, table = [], [], [], []

    def flush():
        if para:
            blocks.append(" ".join(para))
            para.clear()
        if table:
            head = table[0]
            blocks.extend(head + "\n" + row for row in table[2:])
            blocks.append("\n".join(table))  # the whole table: no measured row beside projected ones
            table.clear()

    for line in text.splitlines():
        s = line.strip()
        if s.startswith("|"):
            if para:
                flush()
            table.append(s)
            continue
        if table:
            flush()
        if s.startswith("#"):
            flush()
            sections.append(blocks)
            blocks = [s]
        elif not s:
            flush()
        elif re.match(r"([-*]|\d+\.) ", s):
            flush()
            para.append(s)
        else:
            para.append(s)
    flush()
    sections.append(blocks)
    return [b for b in sections if b]


def html_blocks(page: str) -> list[str]:
    """A page's blocks: each table row with its header row, then the rest cut at paragraphs, headings
    and figures; tags dropped."""
    out = []

    def rows(m):
        trs = re.findall(r"<tr>.*?</tr>", m.group(0), flags=re.S)
        out.extend(trs[0] + tr for tr in trs[1:])
        out.append(m.group(0))  # the whole table: no measured row beside projected ones
        return "</p>"

    rest = re.sub(r"<table.*?</table>", rows, page, flags=re.S)
    out += re.split(r"</p>|</h\d>|</svg>|</li>", rest)
    return [re.sub(r"<[^>]+>", " ", b) for b in out if b.strip()]


# ------------------------------------------------------------------ the rules
def problems(sections: list[list[str]], k: dict, where: str) -> list[str]:
    """Every block of `sections` that breaks a rule of the module docstring, named with `where`."""
    bad = []
    for blocks in sections:
        section = "\n".join(blocks)
        for b in blocks:
            proj = k["projected"].search(b)
            if MEASURED.search(b) and (proj or PROJECTION_WORDS.search(b)) and not CALIBRATION.search(b):
                bad.append(f"{where}: a measurement beside a projection: {b[:160]!r}")
            if proj and not LABEL.search(b):
                bad.append(f"{where}: projected figure {proj.group(0)} without a label: {b[:160]!r}")
            if proj and not k["error"].search(section):
                bad.append(f"{where}: projected figure {proj.group(0)} with no error in its section: "
                           f"{b[:160]!r}")
    return bad


def _notebook_markdown(nb: Path) -> list[tuple[str, str]]:
    cells = json.loads(nb.read_text())["cells"]
    return [(c.get("id"), "".join(c["source"])) for c in cells if c["cell_type"] == "markdown"]


def test_readme_and_docs_set_no_projection_beside_a_measurement(known):
    bad = [p for f in DOCS for p in problems(markdown_sections(f.read_text()), known, f.name)]
    assert not bad, "\n".join(bad)


def test_the_reports_serving_section_sets_no_projection_beside_a_measurement(known):
    from k3lab.report import front

    page = front.serving_section(REPO)
    assert "not drawn" not in page
    assert known["projected"].search(page), "the section shows no projected figure: the check checks nothing"
    assert problems([html_blocks(page)], known, "report") == []


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_prose_sets_no_projection_beside_a_measurement(nb, known):
    bad = [p for cid, text in _notebook_markdown(nb)
           for p in problems(markdown_sections(text), known, f"{nb.name} cell {cid}")]
    assert not bad, "\n".join(bad)


def test_the_serving_strings_label_each_projection_and_carry_its_error(known):
    """article's tables: every row projected, with the step model's worst error or why it has none;
    DROPPED and the calibration rows say what they are; the ladder's rungs and shares say modelled (H200)
    or projected; the what-if figure says projected and its error."""
    from k3lab.studies.serving import H200_MEMORY_GB, tables

    inp, work, err = known["inp"], known["work"], known["err"]
    worst = f"worst {err['worst']:.0%}"
    for r in article.steps(inp, work, error=err):
        assert r["kind"] == "projected" and worst in r["step_model_error"]
    for t in article.terms(inp, work, error=err):
        assert t["model_kind"] in ("projected", "modelled (AgentX-like generator)", "modelled")
        assert worst in t["model_error"] or t["model_error"].startswith(("none:", "not known:")), t
    for change, why in article.DROPPED:
        assert not MEASURED.search(change + why) or CALIBRATION.search(why)
    for c in bands.calibration(inp, work, error=err):
        assert CALIBRATION.search(c["use"]) and "not a check" in c["use"]
    for key, kind, mem in (("mi355x", "projected", None), ("h200", "modelled", H200_MEMORY_GB)):
        lad = curve.ladder(inp, hardware.gpu(key), work, memory_gb=mem)
        shares = curve.shares_at(lad, curve.reachable_target(lad))
        assert {r["kind"] for r in lad} == {r["kind"] for r in shares} == {kind}, key
    fig, _ = tables.whatif(inp, work, error=err)
    assert "projected" in fig.layout.title.text and worst in fig.layout.title.text
    assert "projected" in fig.data[0].name


# ------------------------------------------------------------------ the rules fail on planted text
def test_each_rule_fails_on_a_planted_block(known):
    text = (REPO / "README.md").read_text()
    ok = problems(markdown_sections(text), known, "README")
    assert ok == []
    para = next(line for line in text.splitlines() if known["projected"].search(line))
    fig = known["projected"].search(para).group(0)
    m = ARTICLE_MI355X
    planted = {
        # the headline comparison the issue names, as a sentence and as a table row
        "beside": f"The model projects {fig} tokens/s/GPU on 8x MI355X against the article's measured {m}.",
        "row": f"| GPU | tokens/s/GPU |\n|---|---|\n| MI355X (projected) | {fig} |\n"
               f"| MI355X (the article) | {m} |",
        # a projected figure with no label
        "unlabelled": f"8x MI355X serve {fig} total tokens/s/GPU at 50 tokens/s/user.",
    }
    rule = {"beside": "beside a projection", "row": "beside a projection", "unlabelled": "without a label"}
    for name, block in planted.items():
        bad = problems(markdown_sections(text.replace(para, para + "\n\n" + block)), known, "README")
        assert any(rule[name] in p for p in bad), (name, bad)
    # the same paragraph without its error: rule 3
    no_err = re.sub(known["error"], "an error", para)
    assert no_err != para
    bad = problems(markdown_sections(text.replace(para, no_err)), known, "README")
    assert any("no error in its section" in b for b in bad)
    # honest text passes: the measurement cited as a calibration with its ratio
    honest = (f"Calibration, not a comparison: the article's measured {m} tokens/s/GPU over the projection "
              "is its ratio.")
    assert problems(markdown_sections(text.replace(para, para + "\n\n" + honest)), known, "README") == []


def test_the_report_rules_fail_on_a_planted_row_and_an_unlabelled_header(known):
    from k3lab.report import front

    page = front.serving_section(REPO)
    fig = known["projected"].search(page).group(0)
    row = page.replace("</table>", f"<tr><td>the article (measured)</td><td class='num'>{ARTICLE_MI355X}</td>"
                       "</tr></table>", 1)
    assert any("beside a projection" in p for p in problems([html_blocks(row)], known, "report"))
    bare = page.replace("</table>", f"</table><p>8x MI355X: {fig} tokens/s/GPU.</p>", 1)
    assert any("without a label" in p for p in problems([html_blocks(bare)], known, "report"))


def test_the_serving_models_error_against_measured_runs_is_stated(tmp_path):
    """README's projection paragraph and the report's serving section state how far the serving model's
    replay of each committed GPU serving run is off (the records' extra['model']), or that it is not known."""
    from k3lab.report import front, readme
    from k3lab.serving import predict
    from k3lab.studies import serving_run

    said = readme.run_error(REPO)
    assert said in (REPO / "README.md").read_text() and html.escape(said) in front.serving_section(REPO)
    assert "not known yet" in readme.run_error(tmp_path)  # no records: says so
    for dev in (d.parent.name for d in (REPO / "profiles").glob("*/serving_run") if d.parent.name != "cpu"):
        recs = [r for r in serving_run.measured(root=REPO / "profiles", device=dev) if r.extra.get("model")]
        if recs:
            ok = sum(bool(r.extra["model"]["pass"]) for r in recs)
            assert f"on {recs[0].device}, {ok} of {len(recs)} runs within {predict.TOLERANCE:.0%}" in said
            out = max((r.extra["model"]["output_tokens_per_s_gpu err"] for r in recs), key=abs)
            assert f"worst {out:+.0%} in output tokens/s/GPU" in said
