"""Tasks of notebooks 06 (the draft depth a server's log and costs call for), 07 (agent cache) and 08
(which part of the step to fix first): host-side decisions from evidence, graded against k3lab's own
functions: `k3lab.speculative.best_depth` on the acceptance curve a log implies,
`k3lab.cache.resume.resume_point` and `k3lab.studies.decode_step.headroom`.

The cases of 06 and 08 are fresh random logs, costs and attribution tables (08's rescaled from the
committed H200 records), ordered so that each common mistake first fails on a case whose label names
what it misses (`_core.cases_exposing`; the mistakes are listed in DEPTH_MISTAKES and FIX_MISTAKES).
"""

from __future__ import annotations

import functools

import numpy as np

from k3lab import speculative as spec
from k3lab.cache.resume import resume_point

from ._core import EXACT, Case, Task, cases_exposing


# ------------------------------------------------------------------------------------------ 06
# The mistakes the cases are built to expose, in case order (tests/test_workshop.py writes each out):
# every depth committing what the K-deep cycles did; depth k's cycle charged the verification of k
# positions; the most tokens per cycle instead of per microsecond; a cycle's commit capped at k tokens.
DEPTH_MISTAKES = ("no_truncation", "k_positions", "most_tokens", "bonus_dropped")
# Per kind of cost curve: the first acceptance and its decay per position, verification's growth per
# position (a share of one position's time), its step past a tile of tokens (a share), a draft step (a
# share); the tile: K - 1 positions, or None for 3-5 at random.
_DEPTH_KINDS = {
    "cheap drafts, memory-bound verification": ((0.8, 0.95), (0.95, 1.0), 0.005, (0.0, 0.02), (0.005, 0.02),
                                                None),
    "a tile step": ((0.75, 0.95), (0.93, 1.0), 0.005, (0.05, 0.4), (0.005, 0.03), "K-1"),
    "compute-bound verification": ((0.6, 0.95), (0.85, 1.0), 0.2, (0.05, 0.2), (0.01, 0.05), None),
    "middling costs": ((0.5, 0.9), (0.8, 1.0), 0.04, (0.05, 0.2), (0.01, 0.08), None),
    "memory-bound verification": ((0.6, 0.95), (0.85, 1.0), 0.01, (0.3, 0.5), (0.01, 0.05), None),
    "slow drafter": ((0.6, 0.95), (0.85, 1.0), 0.04, (0.05, 0.2), (0.1, 0.2), None),
    "steep acceptance decay": ((0.6, 0.95), (0.55, 0.75), 0.04, (0.05, 0.2), (0.01, 0.05), None),
}


def _log_survival(committed_counts) -> np.ndarray:
    """S[j] = the share of the logged cycles that accepted at least j drafts, j = 0..K (S[0] = 1)."""
    n = np.asarray(committed_counts, dtype=np.float64)
    return n[::-1].cumsum()[::-1] / n.sum()


def acceptance_of_log(committed_counts) -> np.ndarray:
    """The conditional acceptance curve a log implies: committed_counts[c - 1] cycles of a run drafted K
    deep committed c tokens (c - 1 drafts accepted); a[j - 1] = P(draft j accepted | drafts 1..j - 1 were)
    = S[j] / S[j - 1] (0 past the deepest draft any cycle accepted)."""
    s = _log_survival(committed_counts)
    prev = s[:-1]
    return np.clip(np.divide(s[1:], prev, out=np.zeros_like(prev), where=prev > 0), 0.0, 1.0)


def _depth_answer(x: dict, mistake: str | None = None) -> int | None:
    """The depth `mistake` picks (None: the right one), or None when the top two rates are within 1e-4."""
    s = _log_survival(x["committed_counts"])
    K = s.size - 1
    k = np.arange(1, K + 1)
    committed = np.cumsum(s)[1:]  # cycles stopped after k drafts: E[min(accepted, k)] + 1
    if mistake == "no_truncation":
        committed = np.full(K, float(np.dot(np.arange(1, K + 2), x["committed_counts"]))
                            / sum(x["committed_counts"]))
    elif mistake == "bonus_dropped":
        committed = np.cumsum(s)[:-1]
    verify = np.asarray(x["verify_us"], dtype=np.float64)
    cycle = k * x["draft_step_us"] + verify[k - 1 if mistake == "k_positions" else k] + x["commit_us"]
    rate = committed if mistake == "most_tokens" else committed / cycle
    top = np.sort(rate)[::-1]
    if top.size > 1 and top[0] < top[1] * (1 + 1e-4):
        return None
    return int(np.argmax(rate)) + 1


def _depth_draw(kind: str, label):
    """A draw for cases_exposing: a K-deep run's log of committed tokens (cycles simulated from a random
    acceptance curve) and random costs of kind `kind`; label(K, tile) names the case."""
    first, decay, per_position, step_of_one, draft_of_one, tile_rule = _DEPTH_KINDS[kind]

    def draw(rng):
        K = int(rng.integers(4, 8))
        acc = np.clip(rng.uniform(*first) * rng.uniform(*decay) ** np.arange(K), 0.02, 0.99)
        rejected = rng.random((int(rng.integers(300, 1000)), K)) >= acc
        accepted = np.where(rejected.any(axis=1), rejected.argmax(axis=1), K)
        counts = np.bincount(accepted, minlength=K + 1)
        one = rng.uniform(5_000, 20_000)
        extra = per_position * one * rng.uniform(0.5, 1.5)
        bend = rng.uniform(1.0, 1.3)  # verification grows a little faster than linearly
        tile = K - 1 if tile_rule == "K-1" else int(rng.choice([3, 4, 5]))
        step = one * rng.uniform(*step_of_one)  # and steps up where the positions outgrow a tile of tokens
        verify = [float(one + extra * (n - 1) ** bend + step * (n > tile)) for n in range(1, K + 2)]
        return label(K, tile), {"committed_counts": [int(c) for c in counts],
                                "draft_step_us": float(one * rng.uniform(*draft_of_one)), "verify_us": verify,
                                "commit_us": float(one * rng.uniform(0.005, 0.02))}
    return draw


def _depth_cases(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)
    steps = [
        (("no_truncation",), _depth_draw("cheap drafts, memory-bound verification", lambda K, t: (
            f"a log of {K}-deep cycles: drafting k, a cycle that would have accepted more stops at k"))),
        (("k_positions",), _depth_draw("a tile step", lambda K, t: (
            f"verification steps up past {t} positions: a depth-k cycle verifies k + 1"))),
        (("most_tokens",), _depth_draw("compute-bound verification", lambda K, t: (
            "compute-bound verification: deeper drafts commit more per cycle, fewer per microsecond"))),
        (("bonus_dropped",), _depth_draw("middling costs", lambda K, t: (
            "a cycle that accepts all k drafts still commits the target's bonus token"))),
    ]
    out = [Case(label, x, EXACT) for label, x in cases_exposing(rng, steps, _depth_answer)]
    for kind in ("memory-bound verification", "compute-bound verification", "slow drafter",
                 "steep acceptance decay"):
        draw = _depth_draw(kind, lambda K, t, kind=kind: f"{kind}, a log of {K}-deep cycles")
        label, x = next(c for c in iter(lambda: draw(rng), None) if _depth_answer(c[1]) is not None)
        out.append(Case(label, x, EXACT))
    return out


def _depth_reference(case: Case) -> int:
    x = case.inputs
    costs = spec.CycleCosts(draft_step_us=x["draft_step_us"], verify_us=tuple(x["verify_us"]),
                            commit_us=x["commit_us"])
    return spec.best_depth(acceptance_of_log(x["committed_counts"]), costs).depth


def best_depth_solution(committed_counts, draft_step_us, verify_us, commit_us):
    """Drafting only k, a logged cycle that committed c tokens commits min(c, k + 1): its first k drafts
    fared as they did, and the target adds its token. Rate = that mean over the log / the cycle's time."""
    cycles = sum(committed_counts)
    best, best_rate = 0, -1.0
    for k in range(1, len(committed_counts)):
        committed = sum(n * min(c, k + 1) for c, n in enumerate(committed_counts, start=1)) / cycles
        cycle = k * draft_step_us + verify_us[k] + commit_us   # verify_us[n - 1]: n positions
        if committed / cycle > best_rate:
            best, best_rate = k, committed / cycle
    return best


DEPTH_STUB = '''\
def best_depth(committed_counts, draft_step_us, verify_us, commit_us):
    """committed_counts[c - 1]: how many cycles of a server's log committed c tokens, c = 1..K + 1, with
    K drafts a cycle. verify_us[n - 1]: one target forward over n positions, n = 1..K + 1. Return the
    depth k in 1..K that would have committed the most tokens per microsecond on these cycles."""
    # TODO: for each depth k: what would these cycles have committed, and what does one cycle cost?
    raise NotImplementedError("choose the depth")
'''

DEPTH = Task(
    name="draft_depth", notebook="06_draft_depth", minutes=15,
    statement="""\
**Task: the draft depth for another drafter and another target.** A server drafted `K` tokens a cycle
and logged what each cycle committed: `committed_counts[c - 1]` cycles committed `c` tokens (the
accepted drafts and the target's own token). Its costs differ from this page's too: a draft step takes
`draft_step_us`, one target forward over `n` positions `verify_us[n - 1]` (it steps up where the
positions outgrow a tile of tokens), the commit `commit_us`. Write `best_depth(committed_counts,
draft_step_us, verify_us, commit_us)` returning the depth `k` (1 to `K`) at which the same cycles would
have committed the most tokens per microsecond. `check` tries eight fresh logs and cost curves against
`k3lab.speculative.best_depth` on the acceptance curve the log implies.""",
    signature="best_depth(committed_counts: list[int] (K + 1), draft_step_us: float, verify_us: list[float] "
              "(K + 1), commit_us: float) -> int",
    outputs=("depth",), cases=_depth_cases, reference=_depth_reference, solution=best_depth_solution,
    stub=DEPTH_STUB,
    forbidden=("k3lab.speculative.costs.best_depth", "k3lab.speculative.acceptance.expected_committed_all",
               "k3lab.speculative.acceptance.expected_committed",
               "k3lab.speculative.acceptance.committed_distribution",
               "k3lab.speculative.costs.CycleCosts.cycle_us", "k3lab.speculative.costs.CycleCosts.cycle_all",
               "k3lab.workshop.serving.acceptance_of_log"),
    hints=(
        "Two things change with the depth k: what one cycle commits on average, and how long it takes. Work "
        "out both for every k from 1 to K from the log, then compare tokens per microsecond.",
        "Drafting only k, a cycle's first k drafts fare exactly as in the log, and drafting stops there: a "
        "logged cycle that committed c tokens (c - 1 accepted drafts) would commit min(c, k + 1), the target "
        "adding its recovery or bonus token either way. One such cycle drafts k tokens, verifies k + 1 "
        "positions and commits.",
        "`cycles = sum(committed_counts)`; for k in 1..K: `committed = sum(n * min(c, k + 1) for c, n in "
        "enumerate(committed_counts, start=1)) / cycles` and `cycle = k * draft_step_us + verify_us[k] + "
        "commit_us` (verify_us[k] is k + 1 positions); return the k with the largest committed / cycle.",
    ))


# ------------------------------------------------------------------------------------------ 07
def _resume_cases(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)
    fixed = [  # (label, prompt_len, mla_reach, checkpoints, mla_block, tail_saved)
        ("the seed's example: history to 3,100, blocks of 1,024", 3300, 3100, [1024, 2048, 3100], 1024,
         False),
        ("the same with the tail saved beside the checkpoint at 3,100", 3300, 3100, [1024, 2048, 3100],
         1024, True),
        ("a checkpoint exactly at the last whole block", 4200, 4100, [2048, 4096], 64, False),
        ("the whole prompt cached, a checkpoint at its end", 5000, 5000, [2048, 4096, 5000], 16, True),
        ("no checkpoint the stored history covers", 900, 700, [768, 896], 64, False),
    ]
    out = [Case(label, {"prompt_len": p, "mla_reach": r, "kda_checkpoints": list(c), "mla_block": b,
                        "tail_saved": t}, EXACT) for label, p, r, c, b, t in fixed]
    for i in range(5):
        block = int(rng.choice([16, 64, 256]))
        prompt = int(rng.integers(500, 20_000))
        reach = int(rng.integers(0, prompt + 1))
        grid = list(range(int(rng.choice([512, 1024, 2048])), prompt + 1, 1024))
        ends = sorted(int(e) for e in rng.integers(1, prompt + 1, size=3))  # earlier turns' ends
        ck = sorted(set(grid + ends))
        out.append(Case(f"random {i + 1}: prompt {prompt}, history {reach}", {
            "prompt_len": prompt, "mla_reach": reach, "kda_checkpoints": ck, "mla_block": block,
            "tail_saved": bool(rng.integers(0, 2))}, EXACT))
    return out


def _resume_reference(case: Case):
    x = case.inputs
    at = resume_point(x["mla_reach"], x["kda_checkpoints"], mla_block=x["mla_block"],
                      tail_saved=x["tail_saved"], limit=x["prompt_len"] - 1)
    return at, x["prompt_len"] - at


def plan_resume_solution(prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved):
    """The latest checkpoint the stored MLA history covers, and short of the prompt's end (one token
    must run to give logits); 0 when none does. Returns (resume_at, tokens to recompute)."""
    stored = mla_reach if tail_saved else (mla_reach // mla_block) * mla_block
    stored = min(stored, prompt_len - 1)
    at = max([c for c in kda_checkpoints if c <= stored], default=0)
    return at, prompt_len - at


RESUME_STUB = '''\
def plan_resume(prompt_len, mla_reach, kda_checkpoints, mla_block, tail_saved):
    """A returning request of prompt_len tokens. The cache held MLA rows for positions [0, mla_reach),
    kept in whole blocks of mla_block positions unless the last partial block (the tail) was saved
    (tail_saved); KDA state exists only at the positions in kda_checkpoints. Return (resume_at,
    recompute): where the request resumes, and how many prompt tokens must be computed."""
    # TODO: how far the stored MLA history reaches; the latest checkpoint within it
    #       (and at least one prompt token must still run, to give logits); 0 if none.
    raise NotImplementedError("find the resume point")
'''

RESUME = Task(
    name="resume_point", notebook="07_agent_cache", minutes=10,
    statement="""\
**Task: a resume point both caches agree on.** MLA history is stored in whole blocks (unless the tail
was saved with a checkpoint); KDA state exists only at checkpoints. Write `plan_resume(prompt_len,
mla_reach, kda_checkpoints, mla_block, tail_saved)` returning `(resume_at, recompute)`: the latest
checkpoint the stored MLA history covers (at least one prompt token must still run, to produce the
next token's logits; 0 when no checkpoint qualifies) and the number of prompt tokens left to compute.
`check` compares with `k3lab.cache.resume.resume_point` (the seed's 3,072 / 2,048 example is case 1).""",
    signature="plan_resume(prompt_len: int, mla_reach: int, kda_checkpoints: list[int], mla_block: int, "
              "tail_saved: bool) -> (resume_at: int, recompute: int)",
    outputs=("resume_at", "recompute"), cases=_resume_cases, reference=_resume_reference,
    solution=plan_resume_solution, stub=RESUME_STUB,
    forbidden=("k3lab.cache.resume.resume_point", "k3lab.cache.resume.stored_mla_reach"),
    hints=(
        "A request can resume only at a position where both kinds of layer have what they need: MLA rows "
        "for every position before it, and a KDA state saved exactly there.",
        "Without the tail saved only whole blocks were stored, so the MLA history reaches "
        "(mla_reach // mla_block) * mla_block; with it, all of mla_reach. Resume at the latest checkpoint at "
        "or below that reach, but at most prompt_len - 1: one prompt token must run to give the next "
        "token's logits. No checkpoint qualifies: 0.",
        "`stored = mla_reach if tail_saved else mla_reach // mla_block * mla_block`, capped at "
        "`prompt_len - 1`; `at = max([c for c in kda_checkpoints if c <= stored], default=0)`; return "
        "`at` and the tokens still to compute.",
    ))


# ------------------------------------------------------------------------------------------ 08
# The mistakes the cases are built to expose, in case order: the saving counted from the kernels alone
# (the gaps before them left out); the longest part; the part furthest from its floor as a ratio; a part
# with no floor (None) taken as a floor of 0.
FIX_MISTAKES = ("kernels_only", "longest", "worst_ratio", "no_floor_is_zero")
FIX_COLUMNS = ("part", "kernels", "kernel_ms", "gap_ms", "total_ms", "share", "floor_ms", "kernel_vs_floor")


@functools.lru_cache(maxsize=1)
def _attribution_tables() -> tuple[tuple[str, tuple[tuple, ...]], ...]:
    """(record name, its part rows as item tuples) for every committed attribution record of the step."""
    from k3lab.studies import decode_step as ds

    out = []
    for r in ds.floor_rows():
        rows, _ = ds.attribution_rows(r["case"], r["variant"])
        if rows:
            out.append((f"{r['case']} {r['variant']}", tuple(tuple(sorted(x.items())) for x in rows)))
    if not out:
        raise LookupError("fix_first's cases start from the committed H200 attribution records "
                          "(profiles/nvidia-h200/decode_step/attribution.*.json), and none was found")
    return tuple(out)


def _fix_draw(rng) -> tuple[str, dict]:
    """One committed attribution table with every part's kernel time, gaps and floor rescaled at random
    (a floor kept below the kernels' time), its rows shuffled: a table no page shows."""
    tables = _attribution_tables()
    name, rows = tables[int(rng.integers(len(tables)))]
    parts = []
    for r in map(dict, rows):
        kernel, gap = r["kernel_ms"] * rng.uniform(0.4, 1.6), r["gap_ms"] * rng.uniform(0.3, 2.5)
        floor = r["floor_ms"]
        if floor is not None:
            floor *= rng.uniform(0.6, 1.4)
            if floor > 0.95 * kernel:
                floor = kernel * rng.uniform(0.3, 0.9)
        parts.append({"part": r["part"], "kernels": int(r["kernels"]), "kernel_ms": kernel, "gap_ms": gap,
                      "total_ms": kernel + gap, "floor_ms": floor,
                      "kernel_vs_floor": None if floor is None else kernel / floor})
    step = sum(p["total_ms"] for p in parts)
    parts = [{k: ({**p, "share": p["total_ms"] / step})[k] for k in FIX_COLUMNS} for p in parts]
    rng.shuffle(parts)
    return name, {"parts": parts}


def _fix_answer(x: dict, mistake: str | None = None) -> tuple[str, float] | None:
    """(part, ms saved) that `mistake` gives (None: the right one); None when the best two savings are
    within 5% (which part is first would hang on rounding)."""
    rows = []
    for p in x["parts"]:
        floor = p["floor_ms"]
        if floor is None and mistake != "no_floor_is_zero":
            continue
        saved = (p["kernel_ms"] if mistake == "kernels_only" else p["total_ms"]) - (floor or 0.0)
        key = {"longest": p["total_ms"], "worst_ratio": p["kernel_vs_floor"] or 0.0}.get(mistake, saved)
        rows.append((key, p["part"], saved))
    rows.sort(reverse=True)
    if mistake is None and len(rows) > 1 and rows[0][0] < 1.05 * rows[1][0]:
        return None
    return rows[0][1], rows[0][2]


def _fix_cases(seed: int, device) -> list[Case]:
    rng = np.random.default_rng(seed)

    def named(label):
        return lambda r: (lambda name, x: (f"{label} (from {name})", x))(*_fix_draw(r))
    steps = [(("kernels_only",), named("the gaps before a part's kernels are its time too")),
             (("longest",), named("the longest part is not the one with the most ms above its floor")),
             (("worst_ratio",), named("the part furthest from its floor as a ratio has few ms to give")),
             (("no_floor_is_zero",), named("a part with no bytes floor (None) cannot be ranked by this "
                                           "table"))]
    out = [Case(label, x, "fp32") for label, x in cases_exposing(rng, steps, _fix_answer)]
    while len(out) < 7:
        name, x = _fix_draw(rng)
        if _fix_answer(x) is not None:
            out.append(Case(f"random table from {name}", x, "fp32"))
    return out


def _fix_reference(case: Case) -> tuple[str, float]:
    from k3lab.studies.decode_step import headroom

    first = headroom(case.inputs["parts"])[0]
    return first["part"], first["headroom_ms"]


def fix_first_solution(parts):
    """The part whose time (kernels and the gaps before them) lies furthest above its bytes floor, in ms,
    among the parts that have a floor; that distance is what the step saves when the part reaches it."""
    best = max((p for p in parts if p["floor_ms"] is not None), key=lambda p: p["total_ms"] - p["floor_ms"])
    return best["part"], best["total_ms"] - best["floor_ms"]


FIX_STUB = '''\
def fix_first(parts):
    """parts: one step's attribution table, a list of rows (dicts) with the keys part, kernels, kernel_ms,
    gap_ms, total_ms, share, floor_ms (None where the part has no bytes floor) and kernel_vs_floor.
    Return (part, saved_ms): the part to work on first, and the ms one step would save if that part ran
    at its bytes floor."""
    # TODO: what would each part give back at its floor?
    raise NotImplementedError("choose the part")
'''

FIX = Task(
    name="fix_first", notebook="08_all_together", minutes=10,
    statement="""\
**Task: what to fix first.** The attribution table above says where one step's time goes, part by part,
beside each part's bytes floor. Write `fix_first(parts)` for a table like it (a list of rows with the
same columns, `floor_ms` None where a part has no bytes floor): return the part to work on first, the
one whose reaching its floor would save the step the most, and the ms the step would save. `check` gives
seven tables it makes from the committed H200 records, every part's times and floor rescaled at random,
so none is the one on this page; the part must match, and the ms to a relative 2e-4.""",
    signature="fix_first(parts: list[dict]) -> (part: str, saved_ms: float)",
    outputs=("part", "saved_ms"), cases=_fix_cases, reference=_fix_reference, solution=fix_first_solution,
    stub=FIX_STUB,
    forbidden=("k3lab.studies.decode_step.headroom",),
    hints=(
        "A part at its bytes floor still takes floor_ms: what it gives back is the distance between its time "
        "now and that floor. The biggest part, or the one with the worst ratio, is not always the one with "
        "the most milliseconds to give.",
        "A part's time in the step is its kernels and the idle gaps before them (total_ms); at its floor it "
        "takes floor_ms in all. The saving is total_ms - floor_ms; the part to fix first has the largest. A "
        "part whose floor_ms is None has no floor to reach in this table: leave it out.",
        "`best = max((p for p in parts if p['floor_ms'] is not None), key=lambda p: p['total_ms'] - "
        "p['floor_ms'])`, then return `best['part']` and that difference.",
    ))
