"""Lesson helpers for the notebooks: predict then reveal, a kernel's source on the page, prose from records.

    g = predict("MB a B = 1 KDA decode step moves", 2.0, unit="MB", name="kda_step_mb")  # the guess
    ...                                                                 # measure
    reveal(g, measured_mb, why="the state is read and written once")    # guess against measurement, live
    reveal(g, rec_mb, why="...", record="kda_decode H200 b1")           # ... or against a record, labelled
    show_source(merge._merge_kernel, mark=["exp2", "tl.max"])           # the kernel, at most ~60 lines
    show_source(kernel, span=("# Phase 1", "tl.debug_barrier()"))        # one part of a longer kernel
    prose(f"At batch 1 the step moves {mb:.2f} MB.")                    # a markdown cell rendered from data

Predict, then reveal: a guess must be on record before the answer is shown, or nothing was predicted. The
guess is a plain number in the notebook cell (what an unattended run uses: nbval, `make run`, papermill),
and where ipywidgets can draw in a live kernel `predict` also shows a box holding that number; editing
the box changes the guess that `reveal` reads, with no re-run of the cell. `reveal` shows (once, in its
own cell) the guess, the measurement labelled live or "record: <name>", their ratio and the reason, so a
wrong guess says which effect the learner left out.

A prediction locks when its reveal runs: the box is disabled and reverts any later change, and setting
the guess or running the predict cell again with another number is refused with a line that says so
(for the rest of the kernel's session; `reset()` or a fresh kernel starts over). The first reveal of
each prediction appends one JSON line to the predictions file (`room.predictions_path()`: the file named
by K3LAB_PREDICTIONS, or ~/.k3lab/predictions.jsonl in a Jupyter kernel; nothing under
K3LAB_WORKSHOP_GRADE=solutions), which `k3lab workshop room FILES` turns into the room's histograms.

The kernel on the page: `show_source` reads a function's source with `inspect.getsource` (a Triton
`@jit` kernel through its wrapped Python function), so the page always shows the code that runs. It
prints at most `max_lines` lines (the rest is elided with a count and the file to read) and marks the
lines holding the given substrings: the guided read beside it names what those lines do.
"""

from __future__ import annotations

import html
import importlib
import inspect
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

MAX_LINES = 60


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a comm channel), where widgets can draw."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _execution_count():
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "execution_count", None)


def _display(obj) -> None:
    if _in_kernel():
        from IPython.display import display
        display(obj)
    else:
        print(obj if isinstance(obj, str) else getattr(obj, "data", obj))


def _notebook() -> str:
    """The running notebook's name where Jupyter says it (JPY_SESSION_NAME), else ''."""
    path = os.environ.get("JPY_SESSION_NAME", "")
    return Path(path).stem if path else ""


@dataclass(eq=False)
class Guess:
    """A learner's prediction: `question`, the number (`value`) and its `unit`. `default` is the number
    the notebook cell holds; `widget` the ipywidgets box showing it, where one is drawn; `name` and
    `notebook` identify it in the predictions file. `locked`: the guess as revealed (None while open)."""

    question: str
    default: float
    unit: str = ""
    widget: object = field(default=None, repr=False)
    name: str = ""
    notebook: str = ""
    locked: float | None = field(default=None, init=False)

    @property
    def value(self) -> float:
        """The current guess: the revealed one once locked, else the box's number where a box is drawn,
        else the cell's."""
        if self.locked is not None:
            return self.locked
        if self.widget is not None:
            return float(self.widget.value)
        return float(self.default)

    def __setattr__(self, key, value):
        if key in ("default", "widget", "locked") and getattr(self, "locked", None) is not None:
            print(f"{self._said_locked()}: {key} is not changed")
            return
        object.__setattr__(self, key, value)

    def _said_locked(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        return f"prediction {self.name!r} is locked (revealed with your guess {_fmt(self.locked)}{unit})"

    def lock(self) -> None:
        """Freeze the guess at its current value: the box is disabled and reverts any later change."""
        if self.locked is not None:
            return
        value = self.value
        object.__setattr__(self, "locked", value)
        box = self.widget
        if box is None:
            return
        try:
            box.disabled = True
            box.description = "guess (locked)"

            def revert(change, box=box, value=value):
                if change["new"] != value:
                    box.value = value
                    print(f"{self._said_locked()}: the box keeps it")
            box.observe(revert, names="value")
        except Exception as exc:  # noqa: BLE001 - a widget that cannot be frozen still has its value locked
            print(f"prediction {self.name!r}: the box could not be disabled ({type(exc).__name__}); "
                  f"the guess is locked at {_fmt(value)} all the same")


# (notebook, name) -> the locked Guess, for this session: a re-run predict cell gets it back
_LOCKED: dict[tuple[str, str], Guess] = {}


def reset() -> None:
    """Forget this session's locked predictions (a fresh kernel does the same)."""
    _LOCKED.clear()


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def predict(question: str, guess: float, *, unit: str = "", name: str | None = None,
            notebook: str | None = None, widget: bool | None = None) -> Guess:
    """Record the learner's guess for `question` before the measurement is shown.

    guess: the number typed in the cell (the answer an unattended run records). name: a short key for the
    predictions file and the room's histogram (default: the question); notebook: the notebook's stem
    (default: what Jupyter says, else ''). widget: draw an ipywidgets box holding the guess (None: when
    ipywidgets is installed and a Jupyter kernel runs this; a missing ipywidgets is not an error, the
    number in the cell is the guess then). A prediction already revealed in this session stays locked:
    the locked Guess comes back and a line says the new number is not taken."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    if not isinstance(unit, str):
        raise ValueError(f"unit must be a string, got {unit!r}")
    for arg, v in (("name", name), ("notebook", notebook)):
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ValueError(f"{arg} must be a non-empty string or None, got {v!r}")
    number = _number(guess, "guess")
    key = (notebook or _notebook(), name or question)
    earlier = _LOCKED.get(key)
    if earlier is not None:
        print(f"Predict: {question}? {earlier._said_locked()}; this cell's {number:g} is not taken")
        return earlier
    g = Guess(question, number, unit, name=key[1], notebook=key[0])
    box = None
    if widget is None or widget:
        try:
            import ipywidgets
        except ImportError:
            ipywidgets = None
        if ipywidgets is not None and (widget or _in_kernel()):
            box = ipywidgets.FloatText(value=g.default, description=f"guess ({unit})" if unit else "guess",
                                       style={"description_width": "initial"})
    g.widget = box
    where = "the box below or the number in this cell" if box is not None else "the number in this cell"
    said = f"Predict: {question}? Your guess: {g.default:g} {unit}".rstrip()
    print(f"{said} (change {where}, then run on; the reveal locks it)")
    if box is not None:
        _display(box)
    return g


def _fmt(v: float) -> str:
    if v == 0 or 0.01 <= abs(v) < 1e5:
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:.3g}"


@dataclass(frozen=True)
class Reveal:
    """The guess against the measurement: `ratio` = measured / guess (inf for a zero guess); `measured_from`
    is 'live' (this run) or 'record: <name>'; `source` says more about where the number comes from."""

    question: str
    guess: float
    measured: float
    unit: str
    ratio: float
    why: str
    source: str
    measured_from: str = "live"
    shown_in: list = field(default_factory=list, compare=False, repr=False)

    def text(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.guess == self.measured:
            verdict = "exactly right"
        elif math.isinf(self.ratio):
            verdict = "a zero guess"
        else:
            r = self.ratio if self.ratio >= 1 else 1 / self.ratio
            verdict = f"your guess {_fmt(r)}x {'low' if self.ratio > 1 else 'high'}"
        src = f", {self.source}" if self.source else ""
        ratio = "inf" if math.isinf(self.ratio) else f"{self.ratio:.3g}"
        return (f"**{self.question}**: you guessed {_fmt(self.guess)}{unit}; measured "
                f"{_fmt(self.measured)}{unit} ({self.measured_from}{src}); measured / guess = {ratio}: "
                f"{verdict}.\n\n**Why:** {self.why}")

    def _repr_markdown_(self) -> str:
        return self.text()

    def _ipython_display_(self) -> None:
        """Shown once per cell run: `reveal` displays it, and the cell's last-expression display of the
        same object adds nothing."""
        count = _execution_count()
        if self.shown_in and self.shown_in[-1] == count:
            return
        self.shown_in.append(count)
        from IPython.display import Markdown, display
        display(Markdown(self.text()))

    def __str__(self) -> str:
        return self.text().replace("**", "")


def reveal(guess: Guess, measured: float, *, why: str, source: str = "", record: str | None = None
           ) -> Reveal:
    """Show `guess` against the `measured` number (in the guess's unit) and the reason `why`, once. The
    measurement is labelled live (this run) unless `record` names the committed record it comes from;
    `source` adds detail (the function or table). Locks the guess, and the first reveal of a prediction
    appends it to the predictions file. Returns the Reveal."""
    if not isinstance(guess, Guess):
        raise ValueError(f"guess must be what predict() returned, got {type(guess).__name__}")
    m = _number(measured, "measured")
    if not isinstance(why, str) or not why.strip():
        raise ValueError("why must say, in a sentence, what sets the measured number")
    if record is not None and (not isinstance(record, str) or not record.strip()):
        raise ValueError(f"record must name the record the measurement comes from, or be None, got "
                         f"{record!r}")
    first = guess.locked is None
    guess.lock()
    _LOCKED[(guess.notebook, guess.name)] = guess
    g = guess.value
    ratio = m / g if g != 0 else math.inf
    out = Reveal(guess.question, g, m, guess.unit, ratio, why.strip(), source,
                 f"record: {record.strip()}" if record else "live")
    if first:
        from . import room
        room.save_prediction(guess, out)
    _display(out)
    return out


def _resolve(obj):
    """A function or Triton kernel, or its dotted import path 'package.module.name'."""
    if isinstance(obj, str):
        module, _, name = obj.rpartition(".")
        if not module:
            raise ValueError(f"obj must be a function or a dotted path 'module.name', got {obj!r}")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"obj {obj!r} does not resolve: {exc}") from None
    return obj


def _python_function(obj):
    """The Python function behind a Triton kernel (JITFunction / InterpretedFunction wrap it as .fn)."""
    seen = 0
    while hasattr(obj, "fn") and not inspect.isfunction(obj) and seen < 4:
        obj, seen = obj.fn, seen + 1
    return obj


@dataclass(frozen=True)
class Source:
    """A function's source as the page shows it: `lines` (at most max_lines), `total` lines in the
    function, `marked` (0-based indices of the shown lines that hold a marked substring), `where`."""

    name: str
    where: str
    lines: tuple[str, ...]
    total: int
    marked: tuple[int, ...]

    def text(self) -> str:
        out = [f"# {self.name}  ({self.where})"]
        out += [(">> " if i in self.marked else "   ") + line for i, line in enumerate(self.lines)]
        if self.total > len(self.lines):
            out.append(f"   ... {self.total - len(self.lines)} more lines in {self.where}")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        body = "\n".join(self.lines)
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer

            fmt = HtmlFormatter(noclasses=True, hl_lines=[i + 1 for i in self.marked], style="default")
            code = highlight(body, PythonLexer(), fmt)
        except ImportError:  # no pygments: plain text, marked lines in bold
            code = "<pre>" + "\n".join(f"<b>{html.escape(s)}</b>" if i in self.marked else html.escape(s)
                                       for i, s in enumerate(self.lines)) + "</pre>"
        more = (f"<p><i>... {self.total - len(self.lines)} more lines in {html.escape(self.where)}</i></p>"
                if self.total > len(self.lines) else "")
        return f"<p><code>{html.escape(self.name)}</code> ({html.escape(self.where)})</p>{code}{more}"


def _span(lines: list[str], span, name: str) -> tuple[int, int]:
    """[first, last) of the lines from the first holding span[0] to the next holding span[1], inclusive."""
    if (not isinstance(span, tuple) or len(span) != 2 or not all(isinstance(x, str) and x for x in span)):
        raise ValueError(f"span must be two non-empty strings (first line, last line), got {span!r}")
    first = next((i for i, s in enumerate(lines) if span[0] in s), None)
    if first is None:
        raise ValueError(f"span start {span[0]!r} not found in {name}")
    last = next((i for i in range(first, len(lines)) if span[1] in lines[i]), None)
    if last is None:
        raise ValueError(f"span end {span[1]!r} not found after {span[0]!r} in {name}")
    return first, last + 1


def show_source(obj, *, mark: tuple[str, ...] | list[str] = (), max_lines: int = MAX_LINES,
                span: tuple[str, str] | None = None) -> Source:
    """The source of `obj` (a function, a Triton kernel, or its dotted import path), at most max_lines
    lines, the lines holding any of the `mark` substrings marked (highlighted in a notebook, '>>' in text).
    span: (start, end) substrings: show only the excerpt from the first line holding `start` through the
    next line holding `end` (a long kernel's one phase), found by text so it follows the code as it moves.
    Every mark must occur in the shown lines, so a guided read cannot point at code that moved away."""
    if not isinstance(max_lines, int) or isinstance(max_lines, bool) or max_lines < 1:
        raise ValueError(f"max_lines must be a positive int, got {max_lines!r}")
    if isinstance(mark, str) or not all(isinstance(m, str) and m for m in mark):
        raise ValueError(f"mark must be a list of non-empty strings, got {mark!r}")
    fn = _python_function(_resolve(obj))
    try:
        lines = textwrap.dedent(inspect.getsource(fn)).rstrip("\n").splitlines()
    except (OSError, TypeError) as exc:
        raise ValueError(f"obj {obj!r}: no Python source to show ({exc})") from None
    first = 0
    if span is not None:
        first, stop = _span(lines, span, fn.__qualname__)
        lines = textwrap.dedent("\n".join(lines[first:stop])).splitlines()
    shown = lines[:max_lines]
    marked = tuple(i for i, s in enumerate(shown) if any(m in s for m in mark))
    missing = [m for m in mark if not any(m in s for s in shown)]
    if missing:
        raise ValueError(f"mark {missing} not found in the first {max_lines} lines of {fn.__qualname__}")
    try:
        path = Path(inspect.getsourcefile(fn)).resolve()
        root = Path(__file__).resolve().parent.parent.parent
        where = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        where += f":{inspect.getsourcelines(fn)[1] + first}"
    except (OSError, TypeError):
        where = "defined in this notebook"
    name = f"{fn.__module__}.{fn.__qualname__}" if fn.__module__ != "__main__" else fn.__qualname__
    if span is not None:
        name += f", excerpt ({len(lines)} lines)"
    out = Source(name, where, tuple(shown), len(lines), marked)
    return out


def prose(text: str):
    """A markdown paragraph built from data (numbers formatted from records in the cell), displayed as
    markdown in a notebook; the text itself elsewhere."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be a non-empty string")
    try:
        from IPython.display import Markdown
    except ImportError:
        return text
    return Markdown(text)


__all__ = ["MAX_LINES", "Guess", "Reveal", "Source", "predict", "prose", "reset", "reveal", "show_source"]
