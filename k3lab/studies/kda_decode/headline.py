"""docs/kda_decode.md's generated headline: the graph-replayed before, after and fla-core step (us) and the
after's achieved state TB/s at each batch of BATCHES, from the committed H200 records, with the commit
each row was measured at, so the page's figures are the records' and a re-measured record shows up as a
stale page in the test.

    python -m k3lab.studies.kda_decode.headline           # print the rows
    python -m k3lab.studies.kda_decode.headline --write   # put them between the page's markers
"""

from __future__ import annotations

from k3lab import bench
from k3lab.studies.runs import REPO, PageSection

from .measure import BATCHES, HEADS, NAME

DEVICE = "nvidia-h200"
VARIANTS = ("before", "after", "fla")
NOT_MEASURED = "not measured"
DOC = REPO / "docs" / "kda_decode.md"
BEGIN = "<!-- headline: python -m k3lab.studies.kda_decode.headline --write -->"
END = "<!-- end of headline -->"


def markdown(records: list[bench.Record] | None = None) -> str:
    """The headline rows from `records` (default: the committed H200 ones), graph mode only; a missing
    variant reads 'not measured', and the commit cell lists each distinct commit of the row's records."""
    recs = bench.load_records(study=NAME, device=DEVICE) if records is None else records
    graph = {(r.case, r.variant): r for r in recs if r.mode == "graph"}
    rows = ["| B | before (3 kernels + 2 copies) | after | fla-core | state TB/s (after) | commit |",
            "|---|---|---|---|---|---|"]
    for b in BATCHES:
        hit = [graph.get((f"B{b}_H{HEADS}", v)) for v in VARIANTS]
        cells = [f"{r.median_us:.2f}" if r else NOT_MEASURED for r in hit]
        after = hit[1]
        tbs = after.extra.get("state_tbs") if after else None
        cells.append(f"{tbs:.2f}" if isinstance(tbs, (int, float)) else NOT_MEASURED)
        commits = sorted({r.commit[:7] for r in hit if r})
        cells.append(", ".join(commits) if commits else NOT_MEASURED)
        rows.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


SECTION = PageSection(DOC, BEGIN, END, markdown, "k3lab.studies.kda_decode.headline", __doc__)
in_doc, write, main = SECTION.in_doc, SECTION.write, SECTION.main


if __name__ == "__main__":
    raise SystemExit(main())
