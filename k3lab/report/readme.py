"""The README's paragraph on projections, generated from the committed records.

`markdown()` is the error every projection carries (`serving.validate.model_error`) and the MI355X all-on
projection with its band (`serving.bands.band`), the numbers the report's serving section shows
(`front._serving_numbers`), then the serving model's error against the measured serving runs
(`run_error`: each GPU run's replay by `serving.predict`, which its record keeps); no measured figure is
set beside a projection. `python -m k3lab.report.readme --write`
rewrites it in README.md between `BEGIN` and `END`; tests/test_report.py compares the README to it.
"""

from __future__ import annotations

from pathlib import Path

from k3lab.report.front import _serving_numbers, band_phrase
from k3lab.studies.runs import REPO, between, section_main, write_between

BEGIN = "<!-- projection error: python -m k3lab.report.readme --write (k3lab/report/readme.py) -->"
END = "<!-- end of projection error -->"


def _tens(v: float) -> str:
    """Tokens/s to the nearest ten, as docs/serving.md's generated tables write them."""
    return f"{round(v, -1):,.0f}" if v else "none reaches it"


def run_error(root: Path = REPO) -> str:
    """The serving model's error against the committed GPU serving runs: per device, how many runs its
    replay (`serving.predict`, the record's extra['model']) meets within predict.TOLERANCE on every
    metric, the worst error over the metrics and the worst in output tokens/s/GPU, and how many the
    held-out replay meets (each run's costs fitted on the device's other runs, three runs or more);
    a sentence saying it is not known when no GPU run carries a replay."""
    from k3lab.serving import predict, validate
    from k3lab.studies import serving_run

    parts = []
    devices = sorted(d.parent.name for d in (root / "profiles").glob("*/serving_run"))
    for dev in (d for d in devices if d != "cpu"):
        runs = serving_run.measured(root=root / "profiles", device=dev)
        recs = [r for r in runs if r.extra.get("model")]
        errs = [(abs(e), e, m, r.case) for r in recs for m in predict.METRICS
                if isinstance(e := r.extra["model"].get(f"{m} err"), (int, float))]
        if not errs:
            continue
        ok = sum(bool(r.extra["model"].get("pass")) for r in recs)
        worst = [f"{w[1]:+.0%} in {what} ({w[3]})" for what, sel in (
            ("output tokens/s/GPU", lambda m: m == "output_tokens_per_s_gpu"),
            ("TTFT or TPOT", lambda m: m != "output_tokens_per_s_gpu"))
            if (w := max((e for e in errs if sel(e[2])), default=None))]
        held = ""
        if len(runs) >= 3:
            rows = validate.held_out_runs(runs)
            held = (f"; held out (each run's costs fitted on the other runs' records, "
                    f"`serving.validate.held_out_runs`): {sum(bool(r['pass']) for r in rows)} of {len(rows)} "
                    f"within {predict.TOLERANCE:.0%}")
        parts.append(f"on {recs[0].device}, {ok} of {len(recs)} runs within {predict.TOLERANCE:.0%} on every "
                     f"metric, worst {' and '.join(worst)}{held}")
    if not parts:
        return ("The serving model's error against a measured serving run is not known yet: no GPU run's "
                "record carries its replay.")
    return ("The serving model against the measured serving runs (each run replayed with its own steps timed "
            "alone, `serving.predict`; notebook 09, section 2): " + "; ".join(parts)
            + ". The bands do not carry this error yet.")


def markdown(root: Path = REPO) -> str:
    """The README's paragraph on projections from the records under `root`/profiles."""
    n = _serving_numbers(root)
    err, a = n["error"], n["band"]["at_target"]
    return (f"Every projection carries the step model's measured error: {err['kind']}, worst "
            f"{err['worst']:.0%} over {err['points']} points (`serving.validate.model_error()`). Projected "
            f"for 8x MI355X, all on, at {n['target']:g} tokens/s/user: {_tens(a['central'])} total "
            f"tokens/s/GPU, {band_phrase(a['low'], a['high'], _tens)} (that error, the prefix hit rate, "
            "acceptance and call latency at their ends: `serving.bands`). The other projections, and the "
            "article's measured figures as calibration ratios over them, are in "
            f"[docs/serving.md](docs/serving.md). {run_error(root)}\n")


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
