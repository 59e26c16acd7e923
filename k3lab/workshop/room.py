"""The room's predictions: one JSON line per revealed prediction, and a histogram per prediction.

    K3LAB_PREDICTIONS=/shared/room/alice.jsonl jupyter lab      # where this learner's guesses go
    k3lab workshop room /shared/room/*.jsonl --out build/room.html

Each learner's first reveal of a prediction appends one line to their predictions file:
{"learner", "host", "notebook", "name", "question", "unit", "guess", "measured", "measured_from",
"time"}. The file is K3LAB_PREDICTIONS when set ('off' records nothing), else ~/.k3lab/predictions.jsonl
inside a Jupyter kernel; a script or a test records nothing unless it sets K3LAB_PREDICTIONS, and
nothing is recorded under K3LAB_WORKSHOP_GRADE=solutions (CI's guesses are not a learner's). A file
that cannot be written is one printed line, never an error: the lesson goes on.

`k3lab workshop room FILES` reads any number of such files (one per learner, or one shared), keeps each
learner's first guess per prediction (the one made before any answer was seen) and draws one histogram
per prediction with the measured value marked (the median where learners measured different values
on different machines, the range in the title), plus a summary table, into one self-contained HTML file
(plotly.js inlined: it opens offline). `--png DIR` also writes each figure as a PNG where plotly's
static export works (kaleido and a Chromium); where it does not, it says so and writes the HTML alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import importlib.util
import json
import math
import os
import socket
import statistics
import sys
from pathlib import Path

PREDICTIONS_ENV = "K3LAB_PREDICTIONS"
LEARNER_ENV = "K3LAB_LEARNER"
DEFAULT_PATH = Path("~/.k3lab/predictions.jsonl")
FIELDS = ("learner", "host", "notebook", "name", "question", "unit", "guess", "measured", "measured_from",
          "time")
OFF = ("", "off", "0", "none", "false", "no")


def predictions_path() -> Path | None:
    """Where this session's revealed predictions go, or None when nothing is recorded (see the module
    docstring)."""
    from .grading import grading
    from .lesson import _in_kernel

    if grading() == "solutions":
        return None
    value = os.environ.get(PREDICTIONS_ENV)
    if value is not None:
        return None if value.strip().lower() in OFF else Path(value).expanduser()
    return DEFAULT_PATH.expanduser() if _in_kernel() else None


def learner_id() -> str:
    """K3LAB_LEARNER, else the login name."""
    name = os.environ.get(LEARNER_ENV, "").strip()
    if name:
        return name
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (a container): the host still tells learners apart
        return "unknown"


def save_prediction(guess, revealed) -> Path | None:
    """Append one revealed prediction (a lesson.Guess and its lesson.Reveal) to the predictions file; the
    path written, or None when nothing is recorded or the file cannot be written (said in one line)."""
    path = predictions_path()
    if path is None:
        return None
    entry = {"learner": learner_id(), "host": socket.gethostname(), "notebook": guess.notebook,
             "name": guess.name, "question": guess.question, "unit": guess.unit, "guess": revealed.guess,
             "measured": revealed.measured, "measured_from": revealed.measured_from,
             "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:  # one write of one line: appends interleave whole
            f.write(json.dumps(entry) + "\n")
    except OSError as exc:
        print(f"prediction {guess.name!r} not saved to {path}: {exc.strerror or exc}; the lesson goes on")
        return None
    return path


def _valid(row) -> bool:
    if not isinstance(row, dict) or not all(k in row for k in FIELDS):
        return False
    nums = (row["guess"], row["measured"])
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in nums)


def load(paths) -> tuple[list[dict], int]:
    """(rows, skipped): every valid line of the files, each learner's first guess per (notebook, name)
    kept; skipped counts lines that are not a prediction (or later guesses of the same learner).
    ValueError naming a path that is not a readable file."""
    rows, skipped = [], 0
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"FILES: {p} is not a file")
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                skipped += 1
                continue
            if _valid(row):
                rows.append(row)
            else:
                skipped += 1
    first: dict[tuple, dict] = {}
    for row in sorted(rows, key=lambda r: str(r["time"])):
        key = (row["learner"], row["host"], row["notebook"], row["name"])
        if key in first:
            skipped += 1
        else:
            first[key] = row
    return list(first.values()), skipped


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(notebook, name) -> its rows, in notebook and name order."""
    out: dict[tuple[str, str], list[dict]] = {}
    for row in sorted(rows, key=lambda r: (str(r["notebook"]), str(r["name"]))):
        out.setdefault((row["notebook"], row["name"]), []).append(row)
    return out


def summary(rows: list[dict]):
    """One row per prediction: learners, median guess, measured (median), the share within 2x of it."""
    import pandas as pd

    table = []
    for (nb, name), rs in groups(rows).items():
        measured = statistics.median(r["measured"] for r in rs)
        close = sum(1 for r in rs if r["guess"] > 0 and measured > 0 and 0.5 <= r["guess"] / measured <= 2)
        table.append({"notebook": nb, "prediction": name, "unit": rs[0]["unit"], "learners": len(rs),
                      "median guess": statistics.median(r["guess"] for r in rs), "measured": measured,
                      "within 2x": close / len(rs)})
    return pd.DataFrame(table)


def figure(rs: list[dict]):
    """One prediction's histogram of guesses with the measured value marked. Guesses spanning more than 20x
    (all positive) are binned on a log scale, so one wild guess does not squash the rest."""
    import plotly.graph_objects as go

    from .lesson import _fmt

    guesses = [r["guess"] for r in rs]
    measured = [r["measured"] for r in rs]
    mark = statistics.median(measured)
    unit = rs[0]["unit"]
    log = min(guesses + [mark]) > 0 and max(guesses + [mark]) / min(guesses + [mark]) > 20
    xs = [math.log10(g) for g in guesses] if log else guesses
    fig = go.Figure(go.Histogram(x=xs, nbinsx=min(30, max(5, len(xs))), name="guesses",
                                 hovertemplate="%{y} learners<extra></extra>"))
    at = math.log10(mark) if log else mark
    fig.add_vline(x=at, line_color="crimson", line_width=3)
    spread = (f"; measured {_fmt(min(measured))}-{_fmt(max(measured))} on different machines, median marked"
              if max(measured) != min(measured) else "")
    fig.add_annotation(x=at, y=1, yref="paper", text=f"measured {_fmt(mark)} {unit}".rstrip(),
                       showarrow=False,
                       xanchor="left", font={"color": "crimson"})
    q = rs[0]["question"]
    fig.update_layout(title=f"{rs[0]['notebook'] or '(notebook not named)'}: {q}<br><sup>{len(rs)} learners"
                            f"{spread}</sup>", bargap=0.05, height=360, showlegend=False,
                      yaxis_title="learners", xaxis_title=f"guess ({unit})" if unit else "guess")
    if log:
        lo, hi = math.floor(min(xs + [at])), math.ceil(max(xs + [at]))
        ticks = list(range(lo, hi + 1))
        fig.update_xaxes(tickvals=ticks, ticktext=[f"{10 ** t:g}" for t in ticks],
                         title=f"guess ({unit}, log scale)" if unit else "guess (log scale)")
    return fig


def write(rows: list[dict], out: Path, png_dir: Path | None = None) -> list[Path]:
    """The room's page (every prediction's histogram and the summary table) at `out`; with png_dir, also
    one PNG per prediction where static export works. Returns the files written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    parts, written = [], []
    for i, ((nb, name), rs) in enumerate(groups(rows).items()):
        fig = figure(rs)
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0)))
        if png_dir is not None:
            png = png_dir / f"{nb or 'notebook'}__{name}.png".replace("/", "_").replace(" ", "_")
            try:
                if importlib.util.find_spec("kaleido") is None:
                    raise RuntimeError("kaleido is not installed (pip install 'kaleido>=1', with a Chromium)")
                png_dir.mkdir(parents=True, exist_ok=True)
                fig.write_image(png)
                written.append(png)
            except Exception as exc:  # noqa: BLE001 - static export needs kaleido and a Chromium: optional
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                print(f"room: no PNG written: {why}; the HTML has every figure")
                png_dir = None
    table = summary(rows).to_html(index=False, float_format=lambda v: f"{v:.3g}", border=0)
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>k3lab workshop: the room's predictions"
            "</title></head><body style='font-family:sans-serif;max-width:60em;margin:auto'>"
            f"<h1>The room's predictions</h1><p>{len(rows)} guesses (each learner's first per prediction). "
            "The red line is the measured value.</p>" + table + "".join(parts) + "</body></html>")
    out.write_text(page, encoding="utf-8")
    return [out] + written


def build_parser(prog: str = "k3lab workshop room") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="One histogram per prediction from predictions files")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="predictions files (JSON lines, K3LAB_PREDICTIONS)")
    p.add_argument("--out", default="build/room.html", help="the HTML page (default build/room.html)")
    p.add_argument("--png", default=None, metavar="DIR", help="also write one PNG per prediction into DIR")


def run(args) -> int:
    """The command: 0 when the page is written, 2 (one line on stderr) for files that cannot be read or
    hold no prediction."""
    try:
        rows, skipped = load(args.files)
    except (ValueError, OSError) as exc:
        print(f"k3lab: {exc}", file=sys.stderr)
        return 2
    if not rows:
        print(f"k3lab: FILES: no prediction in {len(args.files)} file(s) ({skipped} lines skipped)",
              file=sys.stderr)
        return 2
    files = write(rows, Path(args.out), Path(args.png) if args.png else None)
    n = len(groups(rows))
    print(f"room: {len(rows)} guesses, {n} predictions"
          + (f", {skipped} lines skipped (not a prediction, or a learner's later guess)" if skipped else ""))
    with _pandas_wide():
        print(summary(rows).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    for f in files:
        print(f"wrote {f}")
    return 0


def _pandas_wide():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_columns", 20)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser("python -m k3lab.workshop.room").parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
