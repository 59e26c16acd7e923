"""A kernel read section by section, and the graded question that follows each read.

    read_kernel(merge._merge_kernel, [
        ("pid = tl.program_id", "One program per query row and block of output columns."),
        ("lse = tl.load", "The N log-sum-exps of this row: N floats, kept in registers."),
        ...])
    read_kernel("kernels/kda_decode.cu", [...], span=("__global__", "}  // kernel"))   # a .cu file
    question("merge_bytes", ANSWER, expected=bytes_per_program, unit="B", why="...")    # graded, never halts

`read_kernel` shows the source (a Python or Triton function, its dotted path, or a file of the repository
such as `kernels/*.cu`) cut into numbered sections: each section starts at the first line, at or after the
previous section's start, that holds its marker, and carries one sentence (what is loaded, what stays in
registers or shared memory, where the bytes go, why the tile has this shape). A marker that is not found
is a ValueError, so a read cannot drift from the code it explains: the page always shows the code that runs.

`question` grades a number the learner writes after a read (relative tolerance `rel`). It never raises for
the learner's answer: None prints "not answered yet", a wrong number prints how far it is and where to
look; under K3LAB_WORKSHOP_GRADE=solutions the expected value is graded (the line says so), as the tasks do.
"""

from __future__ import annotations

import html
import inspect
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

from . import grading
from .lesson import _python_function, _resolve, _span

REPO = Path(__file__).resolve().parent.parent.parent
MAX_READ_LINES = 140


@dataclass(frozen=True)
class Read:
    """A source cut into numbered sections: `sections` is a tuple of (sentence, lines)."""

    name: str
    where: str
    sections: tuple[tuple[str, tuple[str, ...]], ...]

    def text(self) -> str:
        out = [f"# {self.name}  ({self.where})"]
        for i, (sentence, lines) in enumerate(self.sections, 1):
            out.append(f"## {i}. {sentence}")
            out += ["    " + s for s in lines]
        return "\n".join(out)

    __str__ = text

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        parts = [f"<p><code>{html.escape(self.name)}</code> ({html.escape(self.where)})</p>"]
        for i, (sentence, lines) in enumerate(self.sections, 1):
            parts.append(f"<p><b>{i}.</b> {html.escape(sentence)}</p>"
                         f"<pre style='margin-left:1.5em'>{html.escape(chr(10).join(lines))}</pre>")
        return "".join(parts)


def _source(obj, span) -> tuple[str, str, list[str]]:
    """(name, where, lines) of a function/kernel or of a repository file (optionally one span of it)."""
    if isinstance(obj, (str, Path)) and Path(str(obj)).suffix in (".cu", ".h", ".cuh", ".py", ".hip"):
        path = (REPO / obj) if not Path(obj).is_absolute() else Path(obj)
        if not path.is_file():
            raise ValueError(f"obj: no file {obj!r} in the repository")
        lines = path.read_text().splitlines()
        where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
        name, first = path.name, 0
    else:
        fn = _python_function(_resolve(obj))
        try:
            lines = textwrap.dedent(inspect.getsource(fn)).rstrip("\n").splitlines()
        except (OSError, TypeError) as exc:
            raise ValueError(f"obj {obj!r}: no Python source to read ({exc})") from None
        name = f"{fn.__module__}.{fn.__qualname__}"
        try:
            path = Path(inspect.getsourcefile(fn)).resolve()
            where = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name
            first = inspect.getsourcelines(fn)[1] - 1  # the function's own line in its file
        except (OSError, TypeError):
            where, first = "defined in this notebook", 0
    if span is not None:
        a, stop = _span(lines, span, name)
        lines, first = lines[a:stop], first + a
    return name, f"{where}:{first + 1}" if where != "defined in this notebook" else where, lines


def read_kernel(obj, sections, *, span: tuple[str, str] | None = None,
                max_lines: int = MAX_READ_LINES) -> Read:
    """`obj` (function, Triton kernel, dotted path or repository file) in numbered sections.

    sections: a list of (marker, sentence): the section starts at the first line holding `marker` at or
    after the previous section's start and runs to the next section's start (the last one to the end).
    Lines before the first marker are shown under "Signature and arguments". ValueError for a marker
    not found in order, an empty sentence, or a read longer than max_lines (cut it with span)."""
    if not isinstance(sections, (list, tuple)) or not sections:
        raise ValueError("sections must be a non-empty list of (marker, sentence) pairs")
    for s in sections:
        if not (isinstance(s, (list, tuple)) and len(s) == 2
                and all(isinstance(x, str) and x.strip() for x in s)):
            raise ValueError(f"sections: each item must be (marker, sentence), two non-empty strings; "
                             f"got {s!r}")
    name, where, lines = _source(obj, span)
    if len(lines) > max_lines:
        raise ValueError(f"{name} has {len(lines)} lines to read, more than max_lines={max_lines}: "
                         "pass span=")
    starts, at = [], 0
    for marker, _ in sections:
        i = next((j for j in range(at, len(lines)) if marker in lines[j]), None)
        if i is None:
            raise ValueError(f"section marker {marker!r} not found in {name} at or after line {at + 1} "
                             "of the read")
        starts.append(i)
        at = i + 1 if i + 1 <= len(lines) else i
    out = []
    if starts[0] > 0:
        out.append(("Signature and arguments.", tuple(lines[:starts[0]])))
    for k, (_, sentence) in enumerate(sections):
        stop = starts[k + 1] if k + 1 < len(starts) else len(lines)
        out.append((sentence.strip(), tuple(lines[starts[k]:stop])))
    return Read(name, where, tuple(out))


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def question(name: str, answer, *, expected, rel: float = 0.02, unit: str = "", why: str,
             verbose: bool = True) -> bool:
    """Grade the learner's number `answer` against `expected` (relative tolerance rel). One line; True
    when right. `answer=None` is "not answered yet". Under K3LAB_WORKSHOP_GRADE=solutions the expected
    value is graded, and the line says so. Never raises for the learner's answer (a non-number is "not a
    number" in the line); ValueError for a bad name, expected, rel or why."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    exp = _number(expected, "expected")
    if isinstance(rel, bool) or not isinstance(rel, (int, float)) or not 0 <= rel < 1:
        raise ValueError(f"rel must be a number in [0, 1), got {rel!r}")
    if not isinstance(why, str) or not why.strip():
        raise ValueError("why must say where the number comes from (a non-empty string)")
    u = f" {unit}" if unit else ""
    if grading.grading() == "solutions":
        answer, who = exp, "the expected value (K3LAB_WORKSHOP_GRADE=solutions)"
    else:
        who = "your answer"
    if answer is None:
        ok, line = False, f"{name}: not answered yet: set the number in the cell and run it again"
    elif isinstance(answer, bool) or not isinstance(answer, (int, float)) or not math.isfinite(answer):
        ok, line = False, f"{name}: not a number: {answer!r}; write a number{u}"
    else:
        ok = abs(answer - exp) <= rel * abs(exp) + (0 if exp else 1e-12)
        line = (f"{name}: right, {who} {answer:g}{u} (expected {exp:g}{u}): {why}" if ok else
                f"{name}: not yet: {who} {answer:g}{u} is too {'high' if answer > exp else 'low'}; read the "
                f"numbered sections again")
    if verbose:
        print(line)
    return ok


__all__ = ["Read", "question", "read_kernel"]
