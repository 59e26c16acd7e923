"""`python -m k3lab.workshop.hints [FILE]`: print the instructor guide's hints section, generated from the
task definitions, or rewrite FILE's hints section in place (docs/instructor.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from k3lab.workshop import TASKS
from k3lab.workshop.grading import hints_markdown, with_hints


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(hints_markdown(TASKS))
        return 0
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(f"usage: python -m k3lab.workshop.hints [FILE]: FILE must be an existing markdown file, got "
              f"{argv}", file=sys.stderr)
        return 2
    path = Path(argv[0])
    path.write_text(with_hints(path.read_text(), TASKS))
    print(f"{path}: hints section written ({len(TASKS)} tasks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
