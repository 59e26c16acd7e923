"""docs/copy_removal.md's generated headline: the graph-replayed before, after and floor (us) of AttnRes +
RMSNorm at K3's nine sources, from the committed H200 records (`tables.attn_res_table`), so the page's
figures are the records' and a re-measured record shows up as a stale page in the test.

    python -m k3lab.studies.copy_removal.headline           # print the rows
    python -m k3lab.studies.copy_removal.headline --write   # put them between the page's markers
"""

from __future__ import annotations

from k3lab.studies.runs import REPO, PageSection

from .tables import NOT_MEASURED, attn_res_table

HEADLINE = ((1, 9), (64, 9), (8192, 9))  # (tokens, sources) of the rows: one token, a batch, a prefill
DOC = REPO / "docs" / "copy_removal.md"
BEGIN = "<!-- headline: python -m k3lab.studies.copy_removal.headline --write -->"
END = "<!-- end of headline -->"


def markdown(records=None) -> str:
    """The headline rows from `records` (default: the committed H200 ones); a missing one reads 'not
    measured'."""
    table = attn_res_table(records)
    rows = ["| tokens, sources | before (PyTorch sequence) | after | floor |", "|---|---|---|---|"]
    for tokens, sources in HEADLINE:
        hit = table[table["case"] == f"attn_res_t{tokens}_s{sources}_graph"]
        cells = [NOT_MEASURED] * 3 if hit.empty else [hit.iloc[0][c] for c in ("before_us", "after_us",
                                                                                 "floor_us")]
        rows.append(f"| {tokens}, {sources} | " + " | ".join(
            f"{v:.2f}" if isinstance(v, (int, float)) else str(v) for v in cells) + " |")
    return "\n".join(rows) + "\n"


SECTION = PageSection(DOC, BEGIN, END, markdown, "k3lab.studies.copy_removal.headline", __doc__)
in_doc, write, main = SECTION.in_doc, SECTION.write, SECTION.main


if __name__ == "__main__":
    raise SystemExit(main())
