"""docs/serving_run.md's generated tables: the serving model checked on each committed GPU serving run held
out of its own costs (`k3lab.serving.validate.held_out_runs` over the records `serving_run.measured`
reads), and the capacity form's measured runs (`serving_run.tables.capacity_markdown`). The serving room
computes the check; this study side reads the records and writes the page, so serving/ never imports
studies/ (tests/test_layout.py).

    python -m k3lab.studies.serving.held_out           # print both tables
    python -m k3lab.studies.serving.held_out --write   # put each between its markers on the page
"""

from __future__ import annotations

from k3lab.serving import validate


def markdown(device: str = validate.RUNS_DEVICE, root=None) -> str:
    """The table for `device`'s committed quick-form serving runs (root: default the tree's profiles/)."""
    from k3lab.studies import serving_run

    return validate.runs_markdown(serving_run.measured(root=root, device=device), device)


def capacity(device: str = validate.RUNS_DEVICE, root=None) -> str:
    """The capacity table for `device`'s committed capacity-form serving runs."""
    from k3lab.studies import serving_run
    from k3lab.studies.serving_run import tables

    recs = serving_run.measured(root=root, device=device, form="capacity")
    return tables.capacity_markdown(recs, device) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`--write` puts markdown() and capacity() into docs/serving_run.md between their markers; else prints
    them."""
    import argparse

    from k3lab.studies.runs import REPO, write_between

    ap = argparse.ArgumentParser(prog="python -m k3lab.studies.serving.held_out", description=main.__doc__)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    from k3lab.studies.serving_run import tables

    text, cap = markdown(), capacity()
    if a.write:
        page = REPO / "docs" / "serving_run.md"
        write_between(page, validate.RUNS_BEGIN, validate.RUNS_END, text)
        write_between(page, tables.CAPACITY_BEGIN, tables.CAPACITY_END, cap)
    else:
        print(text, end="\n\n")
        print(cap, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
