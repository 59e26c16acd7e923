"""How far the step model's predictions can be trusted, measured from records: held-out shapes, the
extrapolation past the batches it was fitted on, and the error of projecting it to another GPU.

Every function here takes measured steps (`stepmodel.StepPoint`s, e.g. `serving.inputs.step_points`)
and returns one row per predicted point plus, through `summarize`, the worst and mean error per variant.
Nothing is typed in: the figures docs/serving.md quotes are these functions' output on the committed
records (`report_markdown`, checked by tests/test_serving_validate.py).

    held_out(points)               fit every variant on all its measured shapes but every fourth
                                   (stepmodel.held_out_of: a held-out shape leaves the fit with every record
                                   measured at it), predict the held-out ones
    extrapolation(points)          fit on batch <= 32, predict batch 64-128 (every context measured there)
    cross_gpu(fit_on, test_on)     fit on one device's points (all of them), predict the other device's with
                                   the projection the curve uses for another GPU: each bytes term over the
                                   other GPU's measured copy bandwidth (its records' `bandwidth_tbs`),
                                   the waves at its compute units, the fixed term kept
    split(points)                  two disjoint halves of one grid (a checkerboard over batch x context),
                                   to exercise cross_gpu where only one device's grid exists
    scaled_copy(points, ...)       a copy of measured points whose times and bandwidth are changed by
                                   known factors: the error cross_gpu must report follows from the factors

rel_err is predicted / measured - 1 throughout.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable

from . import stepmodel
from .stepmodel import StepFit, StepPoint

FIT_MAX_BATCH = 32
TEST_MIN_BATCH = 64


def _by_variant(points: Iterable[StepPoint]) -> dict[str, list[StepPoint]]:
    out: dict[str, list[StepPoint]] = {}
    for p in points:
        if not isinstance(p, StepPoint):
            raise TypeError(f"points must be stepmodel.StepPoint, got {type(p).__name__}")
        out.setdefault(p.variant, []).append(p)
    return out


def _row(kind: str, f: StepFit, p: StepPoint, **extra) -> dict:
    pred = f.predict_point(p)
    return {"check": kind, "variant": p.variant, "batch": p.batch, "context": p.context,
            "measured_ms": p.us / 1e3, "predicted_ms": pred / 1e3, "rel_err": pred / p.us - 1.0,
            "source": p.source, **extra}


def held_out(points: Iterable[StepPoint], *, min_points: int = 3) -> list[dict]:
    """Per variant with at least `min_points` points: fit with `stepmodel.held_out_of`'s shapes left out,
    one row per held-out point; `fitted_batches` lists the batches the fit saw. The held-out shapes are
    checked to be absent from the fit (RuntimeError otherwise: the check would be no check)."""
    rows = []
    for v, pts in sorted(_by_variant(points).items()):
        if len(pts) < min_points:
            continue
        f = stepmodel.fit(pts)
        seen = {(p.batch, p.context) for p in f.fitted}
        leak = seen & {(p.batch, p.context) for p in f.held_out}
        if leak:
            raise RuntimeError(f"{v}: held-out shapes {sorted(leak)} are also fitted")
        batches = sorted({p.batch for p in f.fitted})
        rows += [_row("held-out", f, p, fitted_batches=batches) for p in f.held_out]
    return rows


def extrapolation(points: Iterable[StepPoint], *, fit_max_batch: int = FIT_MAX_BATCH,
                  test_min_batch: int = TEST_MIN_BATCH) -> list[dict]:
    """Per variant with points on both sides: fit on every point at batch <= fit_max_batch, predict every
    point at batch >= test_min_batch. ValueError when test_min_batch <= fit_max_batch (they would overlap)."""
    if not test_min_batch > fit_max_batch:
        raise ValueError(f"test_min_batch must be > fit_max_batch, got {test_min_batch} and {fit_max_batch}")
    rows = []
    for v, pts in sorted(_by_variant(points).items()):
        train = [p for p in pts if p.batch <= fit_max_batch]
        test = [p for p in pts if p.batch >= test_min_batch]
        if len(train) < 3 or not test:
            continue
        f = stepmodel.fit(train, held_out=[])
        rows += [_row("extrapolation", f, p, fit_batches=f"<= {fit_max_batch}") for p in test]
    return rows


def cross_gpu(fit_on: Iterable[StepPoint], test_on: Iterable[StepPoint], *, fit_device: str,
              test_device: str) -> list[dict]:
    """Fit each variant on every point of `fit_on` (one device's grid) and predict every point of the same
    variant in `test_on` (another device's) through its own measured bandwidth and waves, the fixed term
    kept (module docstring). Variants missing on either side are left out; ValueError when none is shared."""
    a, b = _by_variant(fit_on), _by_variant(test_on)
    shared = sorted(v for v in a if v in b and len(a[v]) >= 3)
    if not shared:
        raise ValueError(f"fit_on ({fit_device}) and test_on ({test_device}) share no variant with >= 3 "
                         f"fitted points: {sorted(a)} and {sorted(b)}")
    rows = []
    for v in shared:
        f = stepmodel.fit(a[v], held_out=[])
        rows += [_row("cross-GPU", f, p, fitted_on=fit_device, tested_on=test_device) for p in b[v]]
    return rows


def cross_gpu_both(a: list[StepPoint], b: list[StepPoint], name_a: str, name_b: str) -> list[dict]:
    """cross_gpu in both directions: fitted on a, tested on b, and fitted on b, tested on a."""
    return (cross_gpu(a, b, fit_device=name_a, test_device=name_b)
            + cross_gpu(b, a, fit_device=name_b, test_device=name_a))


def split(points: Iterable[StepPoint]) -> tuple[list[StepPoint], list[StepPoint]]:
    """Two disjoint halves of one grid: shapes whose batch and context indices (in sorted order) sum to an
    even number, and the rest; every record of a shape goes to the same half."""
    pts = list(points)
    bs = sorted({p.batch for p in pts})
    cs = sorted({p.context for p in pts})
    even = [p for p in pts if (bs.index(p.batch) + cs.index(p.context)) % 2 == 0]
    odd = [p for p in pts if (bs.index(p.batch) + cs.index(p.context)) % 2 == 1]
    return even, odd


def scaled_copy(points: Iterable[StepPoint], *, time_scale: float = 1.0, bandwidth_scale: float = 1.0,
                fits: dict[str, StepFit] | None = None) -> list[StepPoint]:
    """A copy of `points` as another device would have measured them, by construction:
    - bandwidth_scale s (with `fits`, one StepFit per variant): the copy's bandwidth is s x the point's and
      its time is the point's less (1 - 1/s) of the fit's bandwidth-bound terms (every term but 'fixed'
      and 'tokens') at the point: a device whose bytes move s x as fast and whose fixed part is the same,
      which is what the projection assumes;
    - time_scale k: every time x k afterwards (a device k x slower on every term).
    With the same fits, cross_gpu's predicted time of a copied point is the fit's prediction of the original
    (the projection's bytes terms shrink by exactly the time taken out), so the expected rel_err is
    (fit's prediction of the original - what was taken out) / the copy's time - 1, known before the call.
    ValueError for a scale that is not > 0, or bandwidth_scale != 1 without fits."""
    if not (time_scale > 0 and bandwidth_scale > 0):
        raise ValueError(f"time_scale and bandwidth_scale must be > 0, got {time_scale!r}, "
                         f"{bandwidth_scale!r}")
    if bandwidth_scale != 1.0 and fits is None:
        raise ValueError("bandwidth_scale != 1 needs fits (the bytes-bound terms to shrink)")
    out = []
    for p in points:
        us = p.us
        if bandwidth_scale != 1.0:
            terms = fits[p.variant].terms(p.parts, p.tokens, p.bandwidth_tbs, p.batch, p.waves)
            moved = sum(t for k, t in terms.items() if k not in ("fixed", "tokens"))
            us = us - moved * (1.0 - 1.0 / bandwidth_scale)
        out.append(dataclasses.replace(p, us=us * time_scale, bandwidth_tbs=p.bandwidth_tbs * bandwidth_scale,
                                       source=f"{p.source} (scaled copy: time x {time_scale:g}, bandwidth x "
                                              f"{bandwidth_scale:g})"))
    return out


def summarize(rows: list[dict], by: tuple[str, ...] = ("check", "variant")) -> list[dict]:
    """One row per group of `by`: points, worst abs(rel_err) and where, mean abs(rel_err), signed mean."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in by), []).append(r)
    out = []
    for key, rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        worst = max(rs, key=lambda r: abs(r["rel_err"]))
        out.append({**dict(zip(by, key)), "points": len(rs), "worst_abs_err": abs(worst["rel_err"]),
                    "worst_err": worst["rel_err"], "worst_at": f"b{worst['batch']} ctx{worst['context']}",
                    "mean_abs_err": statistics.fmean(abs(r["rel_err"]) for r in rs),
                    "mean_err": statistics.fmean(r["rel_err"] for r in rs)})
    return out


def model_error(device: str = "nvidia-h200", other: str | None = "nvidia-h100-80gb-hbm3", root=None) -> dict:
    """The measured error a projection's band carries: the cross-GPU error (both directions, worst per
    variant) when `other`'s grid is committed, else the worse of the held-out and the extrapolation error
    on `device`'s grid; `kind` names which, `per_variant` the worst abs(rel_err) per variant, `worst` the
    largest over variants, `source` the records. LookupError when `device` has no steps."""
    from . import inputs

    pts = inputs.step_points(device, root)
    if not pts:
        raise LookupError(f"no graph-replayed step records of {device}")
    others = []
    if other:
        try:
            others = [p for p in inputs.step_points(other, root) if p.source.split("/")[2] == "serving"]
        except (LookupError, ValueError):
            others = []
    if others:
        rows = cross_gpu_both(pts, others, device, other)
        kind = f"cross-GPU ({device} <-> {other}, both directions)"
        src = f"profiles/{device}/ and profiles/{other}/serving/grid.*"
    else:
        rows = held_out(pts) + extrapolation(pts)
        kind = (f"held-out and extrapolation on {device} (no second GPU's grid committed: the cross-GPU "
                f"error is not known)")
        src = f"profiles/{device}/decode_step/ and profiles/{device}/serving/grid.*"
    per = {}
    for r in rows:
        per[r["variant"]] = max(per.get(r["variant"], 0.0), abs(r["rel_err"]))
    return {"kind": kind, "per_variant": per, "worst": max(per.values()), "points": len(rows), "source": src,
            "rows": rows}


def report_markdown(device: str = "nvidia-h200", other: str | None = "nvidia-h100-80gb-hbm3",
                    root=None) -> str:
    """The section of docs/serving.md that quotes the step model's errors: held-out and extrapolation per
    variant on `device`'s committed records and, once `other`'s grid is committed, the cross-GPU error in
    both directions, as a markdown table (the test compares the page to this)."""
    from . import inputs

    pts = inputs.step_points(device, root)
    rows = held_out(pts) + extrapolation(pts)
    err = model_error(device, other, root) if other else None
    if err and err["kind"].startswith("cross-GPU"):
        rows += [dict(r, check=f"cross-GPU, fitted on {r['fitted_on']}") for r in err["rows"]]
    rows = summarize(rows)
    lines = ["| check | variant | points | worst abs(rel_err) | at | mean abs(rel_err) | mean rel_err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['check']} | {r['variant']} | {r['points']} | {r['worst_abs_err']:.1%} | "
                     f"{r['worst_at']} | {r['mean_abs_err']:.1%} | {r['mean_err']:+.1%} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------ the serving model on measured runs
RUNS_DEVICE = "nvidia-h100-80gb-hbm3"
RUNS_BEGIN = ("<!-- model check, each run held out: python -m k3lab.studies.serving.held_out --write "
              "(k3lab/studies/serving/held_out.py) -->")
RUNS_END = "<!-- end of model check, each run held out -->"


def _unseen(rec, others) -> list[str]:
    """The held-out run's settings no fitted record shares: its DCP degree, host tier (or none), decode
    sizes measured."""
    def sizes(r):
        return {int(b) for b in r.extra["summary"].get("decode_step_ms", {})}

    out = []
    dcp, host = rec.shape.get("dcp", 1), rec.shape.get("host_tier", True)
    if dcp not in {o.shape.get("dcp", 1) for o in others}:
        out.append(f"DCP{dcp}")
    if host not in {o.shape.get("host_tier", True) for o in others}:
        out.append("host tier" if host else "no host tier")
    new = sizes(rec) - set().union(*(sizes(o) for o in others))
    if new:
        out.append("decode sizes " + ", ".join(f"b{b}" for b in sorted(new)))
    return out


def held_out_runs(records, tolerance: float | None = None) -> list[dict]:
    """The serving model against each measured serving run, leaving that run out of its costs: per record
    (bench.Records or their dicts), the step costs fitted on every OTHER record (`plan.costs_from_records`:
    median decode step per captured size, prefill per call + per token), the held-out run's own requests,
    sessions and settings replayed through `predict.check_run` (its figures over the requests the run
    counts; a metric off by more than `tolerance` names its term). Each row is check_run's with `held_out`
    (the case), `fitted_on` (the other cases), `unseen` (the held-out run's settings no fitted run shares)
    and each fitted term against the held-out run's own measurement of it, predicted / measured - 1:
    `decode_step_err` per captured size the run used, `prefill_err` over its calls and tokens
    (`predict.prefill_model_s`). ValueError for fewer than three records or two of one case (a run left
    out must leave the fit whole)."""
    from k3lab.bench import Record

    from . import plan, predict

    recs = [r if isinstance(r, Record) else Record.from_dict(r) for r in records]
    cases = [r.case for r in recs]
    if len(recs) < 3 or len(set(cases)) != len(cases):
        raise ValueError(f"records must be three or more serving-run records of distinct cases, got "
                         f"{cases!r}")
    tol = predict.TOLERANCE if tolerance is None else tolerance
    rows = []
    for i, rec in enumerate(recs):
        others = recs[:i] + recs[i + 1:]
        costs = plan.costs_from_records(others)
        row = predict.check_run(rec, costs, tol)
        meas = predict.measured(rec)
        steps = {b: costs.decode_us(b, b, 0.0) / (ms * 1e3) - 1.0 for b, ms in meas["decode_step_ms"].items()}
        model_pf = predict.prefill_model_s(costs, meas)
        rows.append({**row, "held_out": cases[i], "fitted_on": cases[:i] + cases[i + 1:],
                     "unseen": _unseen(rec, others), "tolerance": tol, "decode_step_err": steps,
                     "prefill_err": model_pf / meas["prefill_s"] - 1.0 if meas["prefill_s"] else None})
    return rows


NAMES = {"ttft_p50_ms": "TTFT P50 (ms)", "ttft_p90_ms": "TTFT P90 (ms)", "tpot_p50_ms": "TPOT P50 (ms)",
         "tpot_p90_ms": "TPOT P90 (ms)", "output_tokens_per_s_gpu": "output tok/s/GPU"}


def _term(r: dict) -> str:
    """The table's last cell: the term check_run names for a failing run; for a passing one, a fitted term
    off by more than the tolerance against the run's own measurement, with the settings the fit lacked."""
    unseen = f" ({', '.join(r['unseen'])} not in the fit)" if r["unseen"] else ""
    if not r["pass"]:
        return f"{r['wrong_term']} ({', '.join(NAMES[m] for m in r['failing'])}){unseen}"
    off = [f"decode step b{b} {e:+.1%}" for b, e in sorted(r["decode_step_err"].items())
           if abs(e) > r["tolerance"]]
    if r["prefill_err"] is not None and abs(r["prefill_err"]) > r["tolerance"]:
        off.append(f"prefill {r['prefill_err']:+.1%}")
    return f"none; off alone: {', '.join(off)}{unseen}" if off else "none"


def runs_markdown(recs, device: str = RUNS_DEVICE) -> str:
    """docs/serving_run.md's table of `held_out_runs` on `device`'s committed quick-form serving-run
    records `recs` (the study reads them: k3lab.studies.serving.held_out): per held-out run, predicted /
    measured (rel_err) per metric, the fit's prefill, each fitted term against the run's own, and the term
    named (the test compares the page to this)."""
    from . import predict

    if len(recs) < 3:
        return (f"No model check: {device} has {len(recs)} committed serving-run records (three or more "
                "needed).\n")
    rows = held_out_runs(recs)
    ok = sum(r["pass"] for r in rows)
    lines = [f"Model check on {rows[0]['device']}, each run held out: held-out set, the row's run; fit, "
             f"the other {len(rows) - 1} runs' records (profiles/{device}/serving_run/). {ok} of {len(rows)} "
             f"runs within {predict.TOLERANCE:.0%} on every metric. Cells: predicted / measured (predicted / "
             "measured - 1).", "",
             "| held-out run | prefill fitted on the others | "
             + " | ".join(NAMES[m] for m in predict.METRICS)
             + f" | within {predict.TOLERANCE:.0%} | fitted terms vs the run's own | term named |",
             "|---|---|" + "---|" * len(predict.METRICS) + "---|---|---|"]
    for r in rows:
        cells = []
        for m in predict.METRICS:
            d = 0 if m.startswith("ttft") else 1
            cells.append(f"{r[f'{m} predicted']:,.{d}f} / {r[f'{m} measured']:,.{d}f} ({r[f'{m} err']:+.1%})")
        worst = max(r["decode_step_err"].items(), key=lambda kv: abs(kv[1]))
        terms = f"decode step {worst[1]:+.1%} (worst, b{worst[0]}), prefill {r['prefill_err']:+.1%}"
        fit = r["costs"].split(" of ")[0].replace("decode steps and prefill ", "").strip("()")
        lines.append(f"| {r['held_out']} | {fit} | " + " | ".join(cells)
                     + f" | {'yes' if r['pass'] else 'no'} | {terms} | {_term(r)} |")
    return "\n".join(lines) + "\n"
