"""Every notebook cell stays under half the report's cell timeout on a 2-core CPU, by a committed record.

RECORD is `k3lab report`'s timings.json from a 2-core CPU machine that other jobs shared: each step's
seconds and, per notebook step, each code cell's seconds by cell id (`steps['notebook:<stem>']['cells']`),
with the commit, the date and the load added. The report's ETA reads it too (profiles/*/report_timings_*).
The tests fail when a recorded cell took more than half of the report's per-cell timeout
(`k3lab.report.CELL_TIMEOUT_S`: the margin the design asks for, so a slower laptop still passes), when a
notebook or one of its code cells has no recorded time (a new notebook or cell cannot slip by
unmeasured), or when the record is not a complete CPU run. They read the record and run nothing.

Making the record, on a 2-core CPU machine with the tree committed:

    k3lab report --out /tmp/rep                       # `make run` writes build/
    python tests/test_notebook_timings.py record /tmp/rep

Re-timing some notebooks after changing them (each executed alone, as the report executes one; the
rest of the record is kept):

    python tests/test_notebook_timings.py run notebooks/02_moe_sharding.ipynb [more.ipynb ...]
"""

from __future__ import annotations

import json
import math
import os
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "profiles" / "cpu" / "report_timings_2cores.json"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
HOW = "python tests/test_notebook_timings.py run notebooks/<name>.ipynb (on a 2-core CPU machine)"


def code_cell_ids(path: Path) -> list[str]:
    """The ids of a stored notebook's code cells, in order."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    return [c["id"] for c in nb["cells"] if c["cell_type"] == "code"]


def executed_cell_seconds(path: Path) -> dict[str, float]:
    """Each code cell's seconds in an executed notebook, by cell id, from the execution timestamps
    nbclient writes (metadata.execution: iopub.execute_input to shell.execute_reply); a cell that never
    ran has none and is left out."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    out = {}
    for cell in nb["cells"]:
        stamps = cell.get("metadata", {}).get("execution", {})
        began, ended = stamps.get("iopub.execute_input"), stamps.get("shell.execute_reply")
        if cell["cell_type"] == "code" and began and ended:
            seconds = (datetime.fromisoformat(ended.replace("Z", "+00:00"))
                       - datetime.fromisoformat(began.replace("Z", "+00:00"))).total_seconds()
            out[cell["id"]] = round(seconds, 2)
    return out


def problems(record: dict, notebooks: dict[str, list[str]], limit_s: float) -> list[str]:
    """What is wrong with `record` (a report's timings.json) for these notebooks (stem -> code cell ids)
    and this per-cell limit in seconds, one line each; [] when every code cell has a recorded time of at
    most limit_s."""
    out = []
    if record.get("machine") != "cpu":
        out.append(f"the record is not a CPU run (machine {record.get('machine')!r})")
    if record.get("status") != "complete":
        out.append(f"the record is not of a complete run (status {record.get('status')!r})")
    steps = record.get("steps")
    if not isinstance(steps, dict):
        return out + ["the record has no steps"]
    for stem, ids in sorted(notebooks.items()):
        timed = (steps.get(f"notebook:{stem}") or {}).get("cells")
        if not isinstance(timed, dict):
            out.append(f"{stem}: no recorded cell times; {HOW}")
            continue
        missing = [i for i in ids if i not in timed]
        if missing:
            out.append(f"{stem}: code cells {', '.join(missing)} have no recorded time; {HOW}")
        for cid in ids:
            seconds = timed.get(cid)
            if cid in timed and not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                                     and math.isfinite(seconds) and seconds >= 0):
                out.append(f"{stem}: cell {cid} has no valid time ({seconds!r})")
            elif cid in timed and seconds > limit_s:
                out.append(f"{stem}: cell {cid} (code cell {ids.index(cid) + 1} of {len(ids)}) took "
                           f"{seconds:.1f} s on a CPU, over {limit_s:g} s (half the report's cell timeout)")
    return out


def _limit_s() -> float:
    from k3lab.report import CELL_TIMEOUT_S

    return CELL_TIMEOUT_S / 2


def _stored() -> dict[str, list[str]]:
    return {p.stem: code_cell_ids(p) for p in NOTEBOOKS}


def _record() -> dict:
    assert RECORD.is_file(), f"no {RECORD.relative_to(ROOT)}: make it (this module's docstring)"
    return json.loads(RECORD.read_text(encoding="utf-8"))


def test_the_record_exists_and_is_a_2_core_cpu_report():
    record = _record()
    assert record["machine"] == "cpu" and record["form"] == "quick", (record["machine"], record["form"])
    cpus = (record.get("machine_kind") or {}).get("cpus", record.get("cpus"))
    assert cpus == 2, f"recorded on {cpus} cores, not on a 2-core machine"
    assert record["commit"] and record["date"], "the record names no commit or date"


def test_every_notebook_cell_recorded_under_half_the_cell_timeout():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"
    found = problems(_record(), _stored(), _limit_s())
    assert not found, "\n".join(found)


# The check above must be able to fail: the same function on records that are wrong in each way.

def _synthetic(seconds: dict[str, dict[str, float]]) -> dict:
    steps = {f"notebook:{stem}": {"seconds": 1.0, "cells": cells} for stem, cells in seconds.items()}
    return {"machine": "cpu", "status": "complete", "steps": steps}


def test_a_cell_over_half_the_timeout_fails():
    found = problems(_synthetic({"02_x": {"a": 3.0, "b": 120.5}}), {"02_x": ["a", "b"]}, 120.0)
    assert len(found) == 1 and "02_x: cell b (code cell 2 of 2) took 120.5 s" in found[0], found
    assert problems(_synthetic({"02_x": {"a": 3.0, "b": 120.0}}), {"02_x": ["a", "b"]}, 120.0) == []


def test_a_notebook_or_a_cell_without_a_time_fails():
    record = _synthetic({"02_x": {"a": 1.0}})
    found = problems(record, {"02_x": ["a", "new"], "10_new": ["c"]}, 120.0)
    assert any("02_x: code cells new have no recorded time" in p for p in found), found
    assert any("10_new: no recorded cell times" in p for p in found), found
    assert len(found) == 2, found


@pytest.mark.parametrize("bad", [float("nan"), -1.0, "12", True, None])
def test_a_cell_time_that_is_not_a_number_fails(bad):
    found = problems(_synthetic({"n": {"a": bad}}), {"n": ["a"]}, 120.0)
    assert found == [f"n: cell a has no valid time ({bad!r})"], found


def test_a_record_of_another_machine_or_an_unfinished_run_fails():
    found = problems({"machine": "gpu", "status": "interrupted", "steps": {}}, {}, 120.0)
    assert len(found) == 2 and "not a CPU run" in found[0] and "not of a complete run" in found[1], found
    found = problems({"machine": "cpu", "status": "complete"}, {"n": ["a"]}, 120.0)
    assert found == ["the record has no steps"], found


def test_cell_seconds_are_read_from_the_execution_timestamps(tmp_path):
    stamps = {"iopub.execute_input": "2026-01-01T10:00:00.250000Z",
              "shell.execute_reply": "2026-01-01T10:01:01.750000Z"}
    nb = {"cells": [{"cell_type": "markdown", "id": "m", "metadata": {}, "source": ""},
                    {"cell_type": "code", "id": "a", "metadata": {"execution": stamps}, "source": ""},
                    {"cell_type": "code", "id": "b", "metadata": {}, "source": ""}]}
    path = tmp_path / "n.ipynb"
    path.write_text(json.dumps(nb))
    assert executed_cell_seconds(path) == {"a": 61.5}
    assert code_cell_ids(path) == ["a", "b"]


# Making the record (module docstring): not a test, run as a script.

def _load() -> float | None:
    """The 15-minute load average when the record is written (about the run's, for a report that long)."""
    try:
        return round(os.getloadavg()[2], 2)
    except (AttributeError, OSError):
        return None


def _stamp(record: dict) -> dict:
    from k3lab import env
    from k3lab.bench.records import git_commit

    if env.detect().backend != "cpu":
        raise SystemExit("the record holds CPU times: run this on a machine without a GPU")
    if "machine_kind" not in record:  # an older timings.json, without the core count
        record["cpus"] = os.cpu_count()
    record.update({"commit": git_commit(), "date": datetime.now().astimezone()
                   .isoformat(timespec="seconds"), "cell_timeout_s": _limit_s() * 2})
    return record


def record_report(out: Path) -> dict:
    """The report in `out` (timings.json and the executed notebooks/*.ipynb) as a record: each notebook
    step's cells by id, from timings.json where it keys them so, else from the executed notebook."""
    record = json.loads((out / "timings.json").read_text(encoding="utf-8"))
    for path in sorted((out / "notebooks").glob("*.ipynb")):
        step = record["steps"].setdefault(f"notebook:{path.stem}", {})
        ids = set(code_cell_ids(path))
        if not (isinstance(step.get("cells"), dict) and step["cells"] and set(step["cells"]) <= ids):
            step["cells"] = executed_cell_seconds(path)
    record["load_15min_at_record"] = _load()
    return _stamp(record)


def retime(paths: list[Path]) -> dict:
    """The committed record with the notebooks at `paths` executed again, one at a time, alone."""
    import tempfile
    import time

    from k3lab.report.execute import execute_notebook

    if not RECORD.is_file():
        raise SystemExit(f"no {RECORD.relative_to(ROOT)} to update: record a whole report first (`record`)")
    record = json.loads(RECORD.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="k3lab-timings-") as tmp:
        for path in paths:
            start = time.perf_counter()
            written, _, _ = execute_notebook(Path(path), Path(tmp), _limit_s() * 2)
            seconds, stem = round(time.perf_counter() - start, 1), Path(path).stem
            cells = executed_cell_seconds(written)
            record["steps"][f"notebook:{stem}"] = {"seconds": seconds, "cells": cells, "retimed_alone": True}
            slowest = max(cells.values(), default=0.0)
            print(f"{Path(path).name}: {seconds} s, slowest cell {slowest:.1f} s")
    record["load_15min_at_record"] = _load()
    return _stamp(record)


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "record":
        rec = record_report(Path(args[1]))
    elif len(args) >= 2 and args[0] == "run":
        rec = retime([Path(a) for a in args[1:]])
    else:
        raise SystemExit(__doc__.split("Making the record", 1)[1])
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
    found = problems(rec, _stored(), _limit_s())
    print(f"wrote {RECORD.relative_to(ROOT)}; " + ("; ".join(found) or "every cell within the limit"))
