"""`python -m k3lab.workshop.hints [FILE]`: print the instructor guide's hints section, generated from the
task definitions, or rewrite FILE's hints section in place (docs/instructor.md)."""

from __future__ import annotations

from k3lab.workshop import TASKS
from k3lab.workshop.grading import hints_markdown, with_hints
from k3lab.workshop.sections import section_command


def main(argv: list[str] | None = None) -> int:
    return section_command(argv, "k3lab.workshop.hints", lambda: hints_markdown(TASKS),
                           lambda doc: with_hints(doc, TASKS), f"hints section written ({len(TASKS)} tasks)")


if __name__ == "__main__":
    raise SystemExit(main())
