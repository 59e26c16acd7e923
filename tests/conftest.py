"""Test-session hooks: the skipped tests grouped by reason at the end of the run (one line a reason)."""

from __future__ import annotations


def _reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip() or "no reason given"


def skip_groups(reports) -> list[tuple[str, int, list[str]]]:
    """(reason, count, files) for skipped test reports, the most frequent reason first."""
    groups: dict[str, list[str]] = {}
    for rep in reports:
        groups.setdefault(_reason(rep), []).append(rep.nodeid.split("::", 1)[0])
    rows = [(reason, len(files), sorted(set(files))) for reason, files in groups.items()]
    return sorted(rows, key=lambda r: (-r[1], r[0]))


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for reason, count, files in skip_groups(skipped):
        where = ", ".join(f.rsplit("/", 1)[-1] for f in files[:3])
        if len(files) > 3:
            where += f", +{len(files) - 3} more"
        terminalreporter.write_line(f"{count:5d}  {reason}  [{where}]")
