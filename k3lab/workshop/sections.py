"""Generated sections of the workshop's docs (the instructor guide's hints, the day's agenda): a marked
section of a markdown file replaced by text made from the code and the records, and the command that
rewrites it, so a doc cannot drift from what it describes (a test compares the committed section with
the generated one)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path


def replace_section(doc: str, section: str, begin: str, end: str) -> str:
    """`doc` with the part from `begin` through `end` replaced by `section` (which carries both markers);
    `section` appended when `doc` has no such part."""
    if begin in doc and end in doc:
        head, rest = doc.split(begin, 1)
        return head + section + rest.split(end, 1)[1]
    return doc.rstrip("\n") + "\n\n" + section + "\n"


def section_command(argv: list[str] | None, prog: str, generate: Callable[[], str],
                    rewrite: Callable[[str], str], said: str) -> int:
    """`python -m PROG [FILE]`: print the generated section, or rewrite FILE's section in place. Exit 2
    with a usage line for anything but one existing file."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(generate())
        return 0
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(f"usage: python -m {prog} [FILE]: FILE must be an existing markdown file, got {argv}",
              file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(rewrite(path.read_text()))
    print(f"{path}: {said}")
    return 0
