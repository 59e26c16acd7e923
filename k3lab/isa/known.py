"""The problems the ISA report finds on AMD targets today, each with what causes it and the change it needs.

CI (tests/test_isa.py) holds the report to exactly this list: a new problem fails the test, and so does
a listed one that no longer occurs (remove its entry when the owning op is fixed).
`k3lab.isa.problems` attaches each entry's text to the problem it explains. docs/mi355x.md explains each.
"""

from __future__ import annotations

# (case prefix, kernel function, target, kind) -> cause and fix
KNOWN: dict[tuple[str, str, str, str], str] = {}


def explain(case: str, kernel: str, target: str, kind: str) -> str | None:
    """The KNOWN entry for one problem (kernel: the function's name), or None when it is not listed."""
    for (prefix, k, t, kd), why in KNOWN.items():
        if case.startswith(prefix) and kernel == k and target == t and kind == kd:
            return why
    return None
