"""The README's paragraph on projections, generated from the committed records.

`markdown()` is the error every projection carries (`serving.validate.model_error`) and the MI355X all-on
projection with its band (`serving.bands.band`), the numbers the report's serving section shows
(`front._serving_numbers`); no measured figure is set beside them. `python -m k3lab.report.readme --write`
rewrites it in README.md between `BEGIN` and `END`; tests/test_report.py compares the README to it.
"""

from __future__ import annotations

from pathlib import Path

from k3lab.report.front import _serving_numbers
from k3lab.studies.runs import REPO, between, section_main, write_between

BEGIN = "<!-- projection error: python -m k3lab.report.readme --write (k3lab/report/readme.py) -->"
END = "<!-- end of projection error -->"


def _tens(v: float) -> str:
    """Tokens/s to the nearest ten, as docs/serving.md's generated tables write them."""
    return f"{round(v, -1):,.0f}" if v else "none reaches it"


def markdown(root: Path = REPO) -> str:
    """The README's paragraph on projections from the records under `root`/profiles."""
    n = _serving_numbers(root)
    err, a = n["error"], n["band"]["at_target"]
    return (f"Every projection carries the step model's measured error: {err['kind']}, worst "
            f"{err['worst']:.0%} over {err['points']} points (`serving.validate.model_error()`). Projected "
            f"for 8x MI355X, all on, at {n['target']:g} tokens/s/user: {_tens(a['central'])} total "
            f"tokens/s/GPU, band {_tens(a['low'])} to {_tens(a['high'])} (that error, the prefix hit rate, "
            "acceptance and call latency at their ends: `serving.bands`). The other projections, and the "
            "article's measured figures as calibration ratios over them, are in "
            "[docs/serving.md](docs/serving.md).\n")


def readme_section(readme: str) -> str:
    """The README's generated paragraph ('' when the markers are absent)."""
    return between(readme, BEGIN, END)


def write_readme(path: Path = REPO / "README.md", root: Path = REPO) -> bool:
    """Rewrite the paragraph between the markers; True when the file changed."""
    return write_between(path, BEGIN, END, markdown(root))


def main(argv: list[str] | None = None) -> int:
    section_main(argv, prog="python -m k3lab.report.readme", doc=__doc__, what="paragraph", markdown=markdown,
                 write=write_readme)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
