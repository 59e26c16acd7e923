"""docs/serving_run.md's generated table: the serving model checked on each committed GPU serving run held
out of its own costs (`k3lab.serving.validate.held_out_runs` over the records `serving_run.measured`
reads). The serving room computes the check; this study side reads the records and writes the page, so
serving/ never imports studies/ (tests/test_layout.py).

    python -m k3lab.studies.serving.held_out           # print the table
    python -m k3lab.studies.serving.held_out --write   # put it between the page's markers
"""

from __future__ import annotations

from k3lab.serving import validate


def markdown(device: str = validate.RUNS_DEVICE, root=None) -> str:
    """The table for `device`'s committed quick-form serving runs (root: default the tree's profiles/)."""
    from k3lab.studies import serving_run

    return validate.runs_markdown(serving_run.measured(root=root, device=device), device)


def main(argv: list[str] | None = None) -> int:
    """`--write` puts markdown() into docs/serving_run.md between its markers; else prints it."""
    import argparse

    from k3lab.studies.runs import REPO, write_between

    ap = argparse.ArgumentParser(prog="python -m k3lab.studies.serving.held_out", description=main.__doc__)
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    text = markdown()
    if a.write:
        write_between(REPO / "docs" / "serving_run.md", validate.RUNS_BEGIN, validate.RUNS_END, text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
