"""Numbers in the notebooks' prose agree with the committed records they speak of.

Every number with a measured unit (a time, a bandwidth, a percentage or a ratio) in a markdown cell of a
lesson must be either a value the notebook's committed GPU records give (a median, a floor, or a ratio of
two of them in one case and mode, to the precision printed), or stated as someone else's figure in the
same sentence (the seed article's, a datasheet's, a public figure, a target set in advance). Figures that
depend on a run are rendered by code from the records (`k3lab.workshop.lesson.prose`) and never typed.
The planted-number test shows the check can fail.

Its limit: a number is looked up among all of the notebook's records, not those of the case its sentence
names, so a figure that drifted onto another case's value passes (93% is the contiguous-cache variant's
share at 64 x 8K, where the paged after's is 91%). The lessons render such figures from the records.
"""

from __future__ import annotations

import json
import math
import re
from functools import lru_cache
from pathlib import Path

import pytest

from k3lab import bench, env, optimizations

REPO = Path(__file__).resolve().parent.parent
# the lessons 00-08; the appendices (0Nb) quote probe and Nsight figures that docs/<study>.md records
NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("0[0-8]_*.ipynb"))

# a ratio's x is not a product's ("128 x 128"); % and x count as measured only where the sentence speaks
# of speed or bandwidth (98% of the parameters is arithmetic on the config)
UNIT = r"(?:µs|us|ns|ms|TB/s|GB/s|%|[x×](?!\s*\d))"
NUMBER = re.compile(r"(?<![\w.^/-])(\d[\d,]*(?:\.\d+)?)(?:\s?-\s?\d[\d,]*(?:\.\d+)?)?\s?(" + UNIT
                    + r")(?![\w/])")
MEASURED_CONTEXT = re.compile(r"bandwidth|floor|faster|slower|speed|gain|H200|record|measur|took|takes|"
                              r"graph|eager", re.I)
# a sentence that names whose figure it is: the seed article's, a datasheet's, a public one, a target
QUOTED = re.compile(r"seed|article|datasheet|public|target|NCCL|MI355X|B300|vLLM|SemiAnalysis|AgentX|"
                    r"assum|PR \d+", re.I)


def _sentences(text: str):
    # code spans hold formulas and names, not prose figures
    text = re.sub(r"`[^`]*`", " ", text)
    return re.split(r"(?<=[.!?])\s+(?=[A-Z*(])|\n\s*[-*] |\n\n", text)


def prose_numbers(markdown: str) -> list[tuple[str, float, int, str]]:
    """(text, value, decimals, sentence) for every measured-unit number not stated as another's figure."""
    out = []
    for sentence in _sentences(markdown):
        if QUOTED.search(sentence):
            continue
        for m in NUMBER.finditer(sentence):
            raw, unit = m.group(1).replace(",", ""), m.group(2)
            if unit in ("%", "x", "×") and not MEASURED_CONTEXT.search(sentence):
                continue
            decimals = len(raw.split(".")[1]) if "." in raw else 0
            out.append((m.group(0), float(raw), decimals, unit, sentence.strip()))
    return out


def _entry(nb: Path):
    for e in optimizations.ENTRIES:
        if nb in optimizations.notebook_paths(e):
            return e
    return None


@lru_cache(maxsize=None)
def record_values(stem: str) -> dict[str, tuple[float, ...]]:
    """The figures the notebook's committed records give, by kind of unit. 'time': medians, percentiles
    and floors (us and ms), and every number in the other JSON files of its records folders (sweeps and
    probes kept beside the records). 'ratio': within one (case, mode), each variant's time and the floor
    over the after's, and the after's over each variant's. 'percent': the floor over the after (a share
    of the bandwidth), a variant's excess over the after (a gain), and fields named as shares."""
    e = _entry(REPO / "notebooks" / f"{stem}.ipynb")
    if e is None:
        return {"time": (), "ratio": (), "percent": ()}
    times: set[float] = set()
    ratios: set[float] = set()
    shares: set[float] = set()  # fields of probe files named as a share or fraction
    groups: dict[tuple, dict[str, float]] = {}
    for study in e.studies:
        for r in bench.load_records(study=study, device=optimizations.RECORDS_DEVICE):
            for x in (r.median_us, r.p20_us, r.p80_us, r.floor_us):
                if x:
                    times.update((x, x / 1e3))
            g = groups.setdefault((r.case.removesuffix("_graph"), r.mode), {})
            g[r.variant] = r.median_us
            if r.floor_us:
                g["floor"] = r.floor_us
    for folder in e.records:
        for path in (REPO / folder).rglob("*.json"):
            for key, v in _leaves(json.loads(path.read_text())):
                if TIME.search(key):
                    times.update((v, v / 1e3))
                if SHARE.search(key):
                    shares.add(v)
    fractions: set[float] = set()  # a percentage is a share of the floor, or a gain over the after
    for g in groups.values():
        after = g.get("after")
        if not after:
            continue
        for v, x in g.items():
            if v != "after" and x:
                ratios.update((x / after, after / x))
        if g.get("floor"):
            fractions.add(g["floor"] / after)
        fractions.update(x / after - 1 for v, x in g.items() if v not in ("after", "floor") and x)
    # the device peaks k3lab measured (env.PEAKS) are figures of record too
    times.update(v for peak in env.PEAKS.values() for v in vars(peak).values()
                 if isinstance(v, float))
    percents = {100 * r for r in fractions | shares} | {v for v in shares if v > 2}
    clean = lambda xs: tuple(sorted(v for v in xs if math.isfinite(v)))  # noqa: E731
    return {"time": clean(times), "ratio": clean(ratios), "percent": clean(percents)}


def _leaves(obj, key: str = "") -> set[tuple[str, float]]:
    """(key, number) for every number in a JSON document, under the name of the field holding it."""
    if isinstance(obj, dict):
        return set().union(set(), *(_leaves(v, str(k)) for k, v in obj.items()))
    if isinstance(obj, list):
        return set().union(set(), *(_leaves(v, key) for v in obj))
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return {(key, float(obj))}
    return set()


SHARE = re.compile(r"frac|share|pct|percent|of_peak|efficiency", re.I)
TIME = re.compile(r"(^|_)(us|ms|ns|median|p20|p80|floor|time|t0|gbs|tbs|gb_s|tb_s)($|_)|_us$|_ms$", re.I)


def matches(value: float, decimals: int, pool: tuple[float, ...]) -> bool:
    tol = 0.5 * 10 ** -decimals + 1e-9
    import bisect
    i = bisect.bisect_left(pool, value - tol)
    return i < len(pool) and pool[i] <= value + tol


def unmatched(nb: Path) -> list[str]:
    cells = json.loads(nb.read_text())["cells"]
    pools = record_values(nb.stem)
    bad = []
    for i, c in enumerate(cells):
        if c["cell_type"] != "markdown":
            continue
        for text, value, decimals, unit, sentence in prose_numbers("".join(c["source"])):
            kind = "percent" if unit == "%" else "ratio" if unit in ("x", "×") else "time"
            if not matches(value, decimals, pools[kind]):
                bad.append(f"cell {i}: {text!r} in: {sentence[:120]}")
    return bad


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_prose_numbers_agree_with_the_records(nb):
    bad = unmatched(nb)
    assert not bad, (f"{nb.name}: measured numbers in prose that its committed records do not give "
                     "(render them from the records with lesson.prose, or say whose figure it is):\n"
                     + "\n".join(bad))


def test_planted_wrong_numbers_are_found(tmp_path):
    src = REPO / "notebooks" / "04_mla_padding.ipynb"
    nb = json.loads(src.read_text())
    sentence = ("On the H200 graph replay the after reaches {} of the copy bandwidth at 64 x 8K, runs {} "
                "faster"
                " than the before at 32K, and takes {} at 1K.")
    nb["cells"].insert(1, {"cell_type": "markdown", "id": "planted", "metadata": {},
                           "source": [sentence.format("97%", "61x", "5.55 us")]})
    planted = tmp_path / src.name
    planted.write_text(json.dumps(nb))
    bad = unmatched(planted)
    for wrong in ("97%", "61x", "5.55 us"):
        assert any(wrong in b for b in bad), (wrong, bad)
    # the records' figures, to the precision printed, pass
    nb["cells"][1]["source"] = [sentence.format("91%", "44x", "6.78 us")]
    planted.write_text(json.dumps(nb))
    assert not [b for b in unmatched(planted) if "cell 1:" in b]
