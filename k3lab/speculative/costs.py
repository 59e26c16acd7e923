"""The cycle cost model (user-given, illustrative or from k3lab's measured verification records) and
`best_depth`, the depth with the most committed tokens per second."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from k3lab.speculative.inputs import cost_arg, count_arg, probabilities
from k3lab.speculative.acceptance import expected_committed_all


# --------------------------------------------------------------------------------------------
# Cycle cost model
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CycleCosts:
    """Time of one draft-verify-commit cycle, in microseconds, as a function of the depth k.

    cycle(k) = draft_fixed_us + k * draft_step_us      (the drafter runs k steps in sequence)
             + verify_us[k]                             (one target forward over k + 1 positions)
             + commit_us                                (sampling, cache and KDA-state bookkeeping)

    ``verify_us[n - 1]`` is the target forward over n positions, n = 1..len; n = 1 is plain decode.
    ``source`` says where the numbers come from: user-given, illustrative, or measured (device).
    """

    draft_step_us: float
    verify_us: tuple[float, ...]
    commit_us: float = 0.0
    draft_fixed_us: float = 0.0
    source: str = "user-given"

    def __post_init__(self):
        cost_arg("draft_step_us", self.draft_step_us)
        cost_arg("commit_us", self.commit_us)
        cost_arg("draft_fixed_us", self.draft_fixed_us)
        try:
            verify = tuple(float(v) for v in self.verify_us)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"verify_us must be a sequence of times in microseconds; got "
                             f"{self.verify_us!r}") from exc
        if len(verify) < 2:
            raise ValueError(f"verify_us must give the target forward for n = 1 and at least n = 2 "
                             f"positions; got {self.verify_us!r}")
        for n, v in enumerate(verify, start=1):
            cost_arg(f"verify_us[{n - 1}] (verification of {n} positions)", v)
        object.__setattr__(self, "verify_us", verify)

    @property
    def max_depth(self) -> int:
        return len(self.verify_us) - 1

    def draft(self, depth: int) -> float:
        depth = count_arg("depth", depth, high=self.max_depth)
        return self.draft_fixed_us + depth * self.draft_step_us

    def verify(self, positions: int) -> float:
        positions = count_arg("positions", positions, high=len(self.verify_us))
        return self.verify_us[positions - 1]

    def cycle_us(self, depth: int) -> float:
        depth = count_arg("depth", depth, high=self.max_depth)
        return self.draft(depth) + self.verify(depth + 1) + self.commit_us

    def cycle_all(self) -> np.ndarray:
        """cycle_us(k) for k = 1..max_depth (entry k - 1)."""
        return np.array([self.cycle_us(k) for k in range(1, self.max_depth + 1)])

    def plain_decode_us(self) -> float:
        """One target forward over one position: the step speculation has to beat."""
        return self.verify_us[0]


def linear_costs(*, draft_step_us: float, verify_one_us: float, verify_extra_position_us: float,
                 commit_us: float = 0.0, draft_fixed_us: float = 0.0, max_depth: int = 8,
                 source: str = "user-given") -> CycleCosts:
    """Costs with verification growing linearly: verify(n) = verify_one_us + (n - 1) * extra.

    Memory-bound verification (few requests: the weights are read once whatever n is) has a small
    ``verify_extra_position_us``; compute-bound verification (many requests) a large one.
    """
    one = cost_arg("verify_one_us", verify_one_us)
    extra = cost_arg("verify_extra_position_us", verify_extra_position_us)
    max_depth = count_arg("max_depth", max_depth)
    verify = tuple(one + extra * (n - 1) for n in range(1, max_depth + 2))
    return CycleCosts(draft_step_us=draft_step_us, verify_us=verify, commit_us=commit_us,
                      draft_fixed_us=draft_fixed_us, source=source)


# Illustrative profiles: made-up but plausible proportions (a target step of 10 ms, a drafter
# step of a few percent of it), chosen to show how the best depth moves. Not measurements.
ILLUSTRATIVE_PROFILES: dict[str, dict[str, float]] = {
    "memory-bound verify (few requests)": dict(draft_step_us=400.0, verify_one_us=10_000.0,
                                               verify_extra_position_us=150.0, commit_us=150.0),
    "compute-bound verify (many requests)": dict(draft_step_us=400.0, verify_one_us=10_000.0,
                                                 verify_extra_position_us=1_600.0, commit_us=150.0),
    "slow drafter": dict(draft_step_us=1_500.0, verify_one_us=10_000.0,
                         verify_extra_position_us=300.0, commit_us=150.0),
}


def illustrative_costs(name: str = "memory-bound verify (few requests)", max_depth: int = 8) -> CycleCosts:
    """One of ``ILLUSTRATIVE_PROFILES``, labelled as illustrative (not measured)."""
    if name not in ILLUSTRATIVE_PROFILES:
        raise ValueError(f"name must be one of {sorted(ILLUSTRATIVE_PROFILES)}; got {name!r}")
    return linear_costs(**ILLUSTRATIVE_PROFILES[name], max_depth=max_depth,
                        source=f"illustrative ({name}): chosen numbers, not measured")


# --------------------------------------------------------------------------------------------
# Best depth
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DepthChoice:
    """The depth with the most committed tokens per second, and the table it was read from."""

    depth: int
    tokens_per_s: float
    table: object  # pandas.DataFrame, one row per depth
    source: str

    def __str__(self) -> str:
        return (f"best depth {self.depth}: {self.tokens_per_s:,.0f} committed tokens/s per sequence "
                f"(costs: {self.source})")


def best_depth(acceptance, costs: CycleCosts | Sequence[float], *, max_depth: int
               | None = None) -> DepthChoice:
    """The draft depth that maximises committed tokens per second.

    ``costs`` is a ``CycleCosts`` or a sequence of whole-cycle times in microseconds for depths
    1..n. The table has, per depth k: expected committed tokens, cycle time, committed tokens per
    second, ``break_even_growth`` (committed(k + 1) / committed(k) - 1: how much longer the cycle
    of k + 1 drafts may take before it stops paying), the actual ``cycle_growth`` and whether the
    next depth pays; with a ``CycleCosts``, also the speed-up over plain decode.
    """
    import pandas as pd  # only here: the rest of the module needs numpy alone

    a = probabilities("acceptance", acceptance)
    if isinstance(costs, CycleCosts):
        cycle = costs.cycle_all()
        source = costs.source
        plain = costs.plain_decode_us()
    else:
        try:
            cycle = np.array([float(c) for c in costs])
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"costs must be CycleCosts or a sequence of cycle times (us); got {costs!r}"
            ) from exc
        if cycle.size == 0:
            raise ValueError("costs must give the cycle time of at least depth 1")
        for k, c in enumerate(cycle, start=1):
            cost_arg(f"costs[{k - 1}] (cycle time at depth {k})", c)
        source, plain = "user-given cycle times", None
    if np.any(cycle <= 0):
        raise ValueError(f"costs must give a positive cycle time at every depth; got {cycle.tolist()}")
    limit = min(a.size, cycle.size)
    n = limit if max_depth is None else count_arg("max_depth", max_depth, high=limit)

    committed = expected_committed_all(a[:n])
    cycle = cycle[:n]
    rate = committed / cycle * 1e6
    gain = np.append(committed[1:] / committed[:-1] - 1.0, np.nan)
    growth = np.append(cycle[1:] / cycle[:-1] - 1.0, np.nan)
    table = pd.DataFrame({
        "depth": np.arange(1, n + 1),
        "committed": committed,
        "cycle_us": cycle,
        "tokens_per_s": rate,
        "break_even_growth": gain,
        "cycle_growth": growth,
        "deeper_pays": np.append(growth[:-1] < gain[:-1], False),
    })
    if plain is not None:
        table["speedup_vs_plain"] = rate / (1e6 / plain)
    best = int(np.argmax(rate))
    return DepthChoice(depth=best + 1, tokens_per_s=float(rate[best]), table=table, source=source)


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------

# Study names and shape keys of k3lab's verification records (k3lab.studies.kda_verify and
# k3lab.studies.mla_padding). A record's shape names the positions verified per sequence.
VERIFY_STUDIES: dict[str, str] = {"kda": "kda_verify", "mla": "mla_padding"}
_POSITION_KEYS = ("T", "q_len", "Tq", "positions", "tokens")
_BATCH_KEYS = ("B", "batch")


class NoVerifyRecords(LookupError):
    """k3lab has no usable measured verification records for the asked device (none yet, or none
    covering 1 and 2 positions): use user-given or illustrative costs, and say so."""


def _shape_value(shape: dict, keys: Sequence[str]):
    for key in keys:
        if key in shape:
            return shape[key]
    return None


def _per_position_table(records, variant: str, batch: int, where: Mapping | None = None):
    """positions -> median us of one layer, from the records of one study on one device.

    Graph-replay timings are preferred (the cost of a kernel inside the served graph); eager ones
    are used only when the study recorded no graph timing. ``where`` keeps only records whose shape
    has those values (e.g. {"L": 32768} for one MLA context length). Returns (table, mode,
    ambiguous): ``ambiguous`` names the other shape keys that still take several values at one
    position count (two context lengths, say), which a median would silently mix."""
    where = dict(where or {})
    # a case name with a '.' is a sweep or ablation point of its case (b1_t4.narrow8_w1), not the
    # case as the library runs it: those would skew the median
    picked = [r for r in records if "." not in r.case and r.variant == variant
              and _shape_value(r.shape, _BATCH_KEYS) in (batch, None)
              and _shape_value(r.shape, _POSITION_KEYS) is not None
              and all(r.shape.get(k, v) == v for k, v in where.items())]
    modes = {r.mode for r in picked}
    mode = "graph" if "graph" in modes else ("eager" if "eager" in modes else next(iter(modes), ""))
    table: dict[int, list[float]] = {}
    seen: dict[int, dict[str, set]] = {}
    for r in picked:
        if r.mode != mode:
            continue
        n = int(_shape_value(r.shape, _POSITION_KEYS))
        table.setdefault(n, []).append(float(r.median_us))
        for key, value in r.shape.items():
            if key not in _POSITION_KEYS and key not in _BATCH_KEYS:
                seen.setdefault(n, {}).setdefault(key, set()).add(repr(value))
    ambiguous = sorted({key for per_n in seen.values() for key, values in per_n.items() if len(values) > 1})
    return {n: float(np.median(v)) for n, v in sorted(table.items())}, mode, ambiguous


def verify_records_summary(device: str | None = None, root=None, *, variant: str = "after",
                           batch: int = 1, where: Mapping[str, Mapping] | None = None) -> dict[str, dict]:
    """What k3lab has measured for verification: {device slug: {'device': name, 'kda': {positions:
    us}, 'mla': {...}, 'modes': {...}, 'ambiguous': {...}}}; ``where`` = {'kda': {...}, 'mla': {...}}
    filters shapes per part. Empty when no records exist (nothing has been run on a GPU yet)."""
    from k3lab import bench

    batch = count_arg("batch", batch)  # a filter on the records' batch: True would pick batch 1
    where = dict(where or {})
    unknown = set(where) - set(VERIFY_STUDIES)
    if unknown:
        raise ValueError(f"where must map parts among {sorted(VERIFY_STUDIES)} to shape values; got "
                         f"{sorted(unknown)}")
    out: dict[str, dict] = {}
    for study in VERIFY_STUDIES.values():
        for r in bench.load_records(study=study, device=device, root=root):
            out.setdefault(bench.device_slug(r.device, r.backend), {"device": r.device})
    for slug, entry in out.items():
        entry["modes"], entry["ambiguous"] = {}, {}
        for part, study in VERIFY_STUDIES.items():
            recs = bench.load_records(study=study, device=slug, root=root)
            entry[part], entry["modes"][part], entry["ambiguous"][part] = _per_position_table(
                recs, variant, batch, where.get(part))
    return out


def costs_from_records(*, draft_step_us: float, commit_us: float = 0.0, rest_one_us: float = 0.0,
                       rest_extra_position_us: float = 0.0, device: str | None = None, root=None,
                       variant: str = "after", batch: int = 1, kda_layers: int | None = None,
                       mla_layers: int | None = None, draft_fixed_us: float = 0.0,
                       where: Mapping[str, Mapping] | None = None) -> CycleCosts:
    """Cycle costs whose verification part comes from k3lab's measured kernel records.

    verify(n) = kda_layers * KDA verification of n positions (study kda_verify)
              + mla_layers * MLA decode with q_len = n (study mla_padding)
              + rest_one_us + (n - 1) * rest_extra_position_us   (the rest of the forward: MoE,
                projections, norms, collectives; not measured here, so user-given)

    One layer's records are per GPU at the shapes the studies ran (the TP8 slice on a GPU); layer
    counts default to K3's 69 KDA and 24 MLA layers. Between measured position counts the time is
    interpolated linearly; outside them nothing is invented: the depth stops at the last position
    count both studies measured. Raises NoVerifyRecords when no device has records covering one and
    two positions (the message says what exists), or whose records mix shapes at one position
    count (two MLA context lengths, say): pick one with ``where={"mla": {"L": 32768}}``. The
    returned ``source`` names the device.
    """
    from k3lab import bench as _bench

    from k3lab.config import K3Config

    full = K3Config.full()
    kda_layers = full.num_kda_layers if kda_layers is None else count_arg("kda_layers", kda_layers, low=0)
    mla_layers = full.num_mla_layers if mla_layers is None else count_arg("mla_layers", mla_layers, low=0)
    rest_one = cost_arg("rest_one_us", rest_one_us)
    rest_extra = cost_arg("rest_extra_position_us", rest_extra_position_us)
    cost_arg("draft_step_us", draft_step_us)
    cost_arg("commit_us", commit_us)
    batch = count_arg("batch", batch)

    found = verify_records_summary(device=device, root=root, variant=variant, batch=batch, where=where)
    usable = {}
    for slug, entry in found.items():
        kda, mla = entry["kda"], entry["mla"]
        if kda_layers and not kda or mla_layers and not mla:
            continue
        if any(entry["ambiguous"][part] for part, layers in (("kda", kda_layers), ("mla", mla_layers))
               if layers):
            continue
        tables = [t for t, layers in ((kda, kda_layers), (mla, mla_layers)) if layers]
        lo = max(min(t) for t in tables)
        hi = min(max(t) for t in tables)
        if lo == 1 and hi >= 2:
            usable[slug] = (entry, hi)
    if not usable:
        place = f"device {device!r}" if device else "any device"
        have = {slug: {part: sorted(e[part]) for part in VERIFY_STUDIES} for slug, e in found.items()}
        mixed = {slug: {p: k for p, k in e["ambiguous"].items() if k} for slug, e in found.items()
                 if any(e["ambiguous"].values())}
        raise NoVerifyRecords(
            f"no measured verification records for {place} under {root or _bench.PROFILES}/ (variant "
            f"{variant!r}, batch {batch}) cover 1 and 2 positions in both {VERIFY_STUDIES['kda']} and "
            f"{VERIFY_STUDIES['mla']}; measured position counts found: {have or 'none'}"
            + (f"; records mixing several values of {mixed} at one position count: choose one with where="
               if mixed
               else "")
            + ". Use linear_costs(...) or illustrative_costs(...) and label them as such.")
    slug = min(usable, key=lambda s: (s == "cpu", s))  # a GPU's records before a CPU's
    entry, hi = usable[slug]

    def per_layer(table: dict[int, float], n: int) -> float:
        xs = np.array(sorted(table), dtype=np.float64)
        return float(np.interp(n, xs, [table[int(x)] for x in xs]))

    verify = []
    for n in range(1, hi + 1):
        t = rest_one + rest_extra * (n - 1)
        if kda_layers:
            t += kda_layers * per_layer(entry["kda"], n)
        if mla_layers:
            t += mla_layers * per_layer(entry["mla"], n)
        verify.append(t)
    parts = []
    if kda_layers:
        parts.append(f"{kda_layers} x KDA verify ({entry['modes']['kda']}, n = {sorted(entry['kda'])})")
    if mla_layers:
        parts.append(f"{mla_layers} x MLA q_len = n ({entry['modes']['mla']}, n = {sorted(entry['mla'])})")
    chosen = f", shapes {dict(where)}" if where else ""
    source = (f"measured on {entry['device']} (k3lab records, variant {variant!r}, batch {batch}{chosen}): "
              + " + ".join(parts) + f"; rest of the forward {rest_one:g} us + {rest_extra:g} us per extra "
              f"position and drafter {draft_step_us:g} us per token: user-given")
    return CycleCosts(draft_step_us=draft_step_us, verify_us=tuple(verify), commit_us=commit_us,
                      draft_fixed_us=draft_fixed_us, source=source)
