"""The step model against a measured serving run: the run's own requests replayed through its scheduler's
rules with every iteration's time taken from the model, and the TTFT, TPOT and output tokens/s that gives
set beside what the run measured.

    costs = predict.measure_costs(engine)            # or predict.gpu_costs("nvidia-h200")
    table = predict.check_runs(records, costs)       # one row per serving-run record

What is the same as in the run (read from its record, `k3lab.studies.serving_run`): the requests (prompt and
output tokens, the position each resumed at, i.e. the run's workload and its prefix hits, which the cache's
capacity decided), the sessions and their turn order, the think time before each later turn (its arrival
less the end of the turn before: drawn by the workload, not a timing), the concurrency, the captured decode
sizes, the prefill budget per iteration, the staging entries and the checkpoint interval. What is the
model's: the time of each iteration, `StepCosts` (decode step at the captured size over the sequences'
history, prefill of the chunk's tokens, a per-iteration overhead, zero unless given).

The replay (`replay`) follows `k3lab.serving.run`'s scheduler: closed-loop sessions (the first `concurrency`
start at 0, a session that ends its last recorded turn hands its place to the next), admission while a
slot and a staging entry are free and the running sequences' reserved state (one KDA state and the rows of
prompt and output, at the run's DCP share) fits the device budget the record's pool describes (the cache's
contents are not replayed: the record's resumed positions carry what it held), then the decode step of
the sequences decoding, then prefill chunks within max_batched_tokens less one per decoding sequence, each
chunk ending at a checkpoint position.

The replay's figures are taken over the requests the run's figures count (`counted`: those it finished;
the replay runs the ones cut at the drain limit to their end, past the run's clock).

When a metric is off by more than `TOLERANCE`, `check_run` names the term: it replays again with the
decode step, then the prefill, taken from the run's own measurement (its median decode step per captured
size, its prefill seconds over its calls and tokens) and names the substitution that removes the error;
when neither does, the time outside the steps (host scheduling, lookups, restores: no part of the step
model) is named.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TOLERANCE = 0.15
METRICS = ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "output_tokens_per_s_gpu")
OUTSIDE = "outside the steps (host scheduling, lookups, restores: not in the step model)"


@dataclass(frozen=True)
class StepCosts:
    """An iteration's parts in microseconds: decode_us(captured size, sequences decoding, their history
    positions summed), prefill_us(tokens, history positions before the chunks, summed), a fixed
    iteration_us, and where each comes from (`source`)."""

    decode_us: Callable[[int, int, float], float]
    prefill_us: Callable[[int, float], float]
    iteration_us: float = 0.0
    source: str = ""


def fixed_clock(step_cost) -> StepCosts:
    """The costs of a run made with RunSettings.step_cost = (s per iteration, per decoding sequence, per
    prefill token): the replay of such a run must give its times back (a check of the replay itself)."""
    c0, c1, c2 = (float(x) for x in step_cost)
    return StepCosts(lambda b, n, ctx: c1 * n * 1e6, lambda t, ctx: c2 * t * 1e6, c0 * 1e6,
                     f"fixed step costs {tuple(step_cost)} s")


# ------------------------------------------------------------------------------------------- the record
def _get(record) -> dict:
    d = record.to_dict() if hasattr(record, "to_dict") else dict(record)
    if d.get("study") != "serving_run" or "requests" not in d.get("extra", {}):
        raise ValueError(f"record must be a serving_run record with extra['requests'], got study "
                         f"{d.get('study')!r}")
    return d


def as_record(result, case: str = "run", device: str = "this machine") -> dict:
    """A k3lab.serving.run.RunResult in the form of a serving_run record (the fields this module reads),
    for a run made outside the study (a test's, a notebook's)."""
    st = result.settings
    return {"study": "serving_run", "case": case, "device": device,
            "shape": {"concurrency": st.concurrency, "dcp": st.dcp,
                      "max_batched_tokens": st.max_batched_tokens,
                      "checkpoint_interval": st.checkpoint_interval},
            "extra": {"summary": result.summary(), "describe": result.describe,
                      "requests": [{k: v for k, v in r.items() if k != "logits"} for r in result.requests]}}


def run_inputs(record) -> dict:
    """What the replay takes from a serving_run record: concurrency, DCP, the prefill budget, checkpoint
    interval, staging entries, captured sizes, GPUs, the device budget of the running state (`memory`:
    budget, KDA state and history-row bytes, from the record's pool; None when the record has none), and
    the sessions (each a list of turns: request, prompt, output, resumed position, think seconds before
    it), in the order they started."""
    d = _get(record)
    shape, desc = d["shape"], d["extra"]["describe"]
    rows = sorted(d["extra"]["requests"], key=lambda r: (r["session"], r["turn"]))
    by: dict[int, list[dict]] = {}
    for r in rows:
        by.setdefault(r["session"], []).append(r)
    sessions = []
    for turns in sorted(by.values(), key=lambda t: (t[0]["arrival"], t[0]["session"])):
        seq, prev_end = [], None
        for r in turns:
            think = 0.0 if prev_end is None else max(0.0, r["arrival"] - prev_end)
            seq.append({"request": r["request"], "n_in": int(r["n_in"]), "out": int(r["out"]),
                        "resume": int(r["resume"]), "think": think})
            prev_end = r["arrival"] + r["e2e"] if r.get("e2e") is not None else None
            if prev_end is None:
                break  # cut at the drain limit: no later turn was sent
        sessions.append(seq)
    pool = desc.get("pool") or {}
    memory = None
    if pool.get("page_bytes") and pool.get("rows_per_block"):
        memory = {"budget": int(pool["device_pages"]) * int(pool["page_bytes"]),
                  "state": int(pool["checkpoint_bytes"]),
                  "row": int(pool["page_bytes"]) // int(pool["rows_per_block"])}
    return {"concurrency": int(shape["concurrency"]), "dcp": int(shape.get("dcp", 1)), "memory": memory,
            "max_batched_tokens": int(shape["max_batched_tokens"]),
            "checkpoint_interval": int(shape["checkpoint_interval"]), "staging": int(desc["staging"]),
            "sizes": [int(s) for s in desc["decode"]["sizes"]], "gpus": int(desc["gpus"]),
            "sessions": sessions}


def counted(record) -> set[int]:
    """The requests a run's figures count: those it finished. A request cut at the drain limit is in the
    replay (which runs it to its end) but not in the run's summary, so the replay's figures are taken over
    the same requests as the run's (a replay's figures over the cut ones too run the clock on past the
    run's and shift every percentile)."""
    return {int(r["request"]) for r in _get(record)["extra"]["requests"] if r.get("finished", True)}


def measured(record) -> dict:
    """The run's figures the check compares (METRICS) and the measured terms a diagnosis substitutes
    (decode step ms per captured size, prefill us per token, prefill calls, tokens and seconds)."""
    s = _get(record)["extra"]["summary"]
    pf = s["prefill_s"] / s["prefill_tokens"] * 1e6 if s.get("prefill_tokens") else None
    return {"ttft_p50_ms": s["ttft_ms"].get("p50"), "ttft_p90_ms": s["ttft_ms"].get("p90"),
            "tpot_p50_ms": s["tpot_ms"].get("p50"), "tpot_p90_ms": s["tpot_ms"].get("p90"),
            "output_tokens_per_s_gpu": s["output_tokens_per_s_gpu"],
            "decode_step_ms": {int(b): float(v) for b, v in s.get("decode_step_ms", {}).items()},
            "prefill_us_per_token": pf, "prefill_calls": int(s.get("prefill_calls") or 0),
            "prefill_tokens": int(s.get("prefill_tokens") or 0),
            "prefill_s": float(s.get("prefill_s") or 0.0)}


# ------------------------------------------------------------------------------------------- the replay
def replay(inputs: dict, costs: StepCosts) -> dict:
    """The run's requests through the scheduler (module docstring) with `costs`: per request TTFT, TPOT,
    end (s), the iterations' time split into decode, prefill and overhead (s), and per iteration (captured
    size or 0, decode s, prefill tokens, prefill s)."""
    C, mbt, iv = inputs["concurrency"], inputs["max_batched_tokens"], inputs["checkpoint_interval"]
    sizes = sorted(inputs["sizes"])
    sessions = inputs["sessions"]
    nxt = 0
    now = 0.0
    pending: list = []  # (arrival, seq, session index, turn index)
    queue: list[dict] = []
    active: list[dict] = []
    done: list[dict] = []
    free_slots, free_stages = list(range(C)), list(range(inputs["staging"]))
    mem, reserved = inputs.get("memory"), 0
    parts = {"decode": 0.0, "prefill": 0.0, "overhead": 0.0}
    iterations: list[tuple[int, float, int, float]] = []  # (captured size or 0, decode s, prefill tokens, s)
    seq = 0

    def start_session(at):
        nonlocal nxt, seq
        if nxt < len(sessions):
            heapq.heappush(pending, (at, seq, nxt, 0))
            seq += 1
            nxt += 1

    for _ in range(C):
        start_session(0.0)
    while True:
        while pending and pending[0][0] <= now:
            at, _, s, k = heapq.heappop(pending)
            t = sessions[s][k]
            queue.append({"s": s, "k": k, "arrival": at, "n_in": t["n_in"], "out": t["out"],
                          "done": t["resume"], "times": [], "request": t["request"]})
        if not active and not queue:
            if not pending:
                break
            now = max(now, pending[0][0])
            continue
        while queue and free_slots and free_stages:  # admission
            r = queue[0]
            if mem is not None:
                need = mem["state"] + -(-(r["n_in"] + r["out"]) // inputs["dcp"]) * mem["row"]
                if reserved + need > mem["budget"] and active:
                    break  # waits for memory, as the run's admission does
                r["reserved"] = need
                reserved += need
            queue.pop(0)
            r["slot"], r["stage"], r["state"] = free_slots.pop(0), free_stages.pop(0), "prefill"
            free_slots.sort()
            active.append(r)
        decoding = [r for r in active if r["state"] == "decode"]
        t_dec, b = 0.0, 0
        if decoding:
            top = max(r["slot"] for r in decoding) + 1
            b = next((s for s in sizes if s >= top), sizes[-1])
            ctx = float(sum(r["n_in"] + len(r["times"]) for r in decoding))
            t_dec = costs.decode_us(b, len(decoding), ctx) * 1e-6
        budget, chunks, first, ctx_pf = mbt - len(decoding), 0, [], 0.0
        tokens = 0
        for r in active:
            if r["state"] != "prefill" or budget <= 0 or chunks >= inputs["staging"]:
                continue
            end = min(r["n_in"], r["done"] + budget)
            if iv:
                end = min(end, (r["done"] // iv + 1) * iv)
            n = end - r["done"]
            ctx_pf += r["done"]
            chunks += 1
            tokens += n
            budget -= n
            r["done"] = end
            if end == r["n_in"]:
                first.append(r)
        t_pf = costs.prefill_us(tokens, ctx_pf) * 1e-6 if tokens else 0.0
        t_it = costs.iteration_us * 1e-6
        parts["decode"] += t_dec
        parts["prefill"] += t_pf
        parts["overhead"] += t_it
        iterations.append((b, t_dec, tokens, t_pf))
        now += t_dec + t_pf + t_it
        for r in first:
            free_stages.append(r["stage"])
            free_stages.sort()
            r["state"] = "decode"
        for r in decoding + first:
            r["times"].append(now)
        for r in [r for r in active if r["state"] == "decode" and len(r["times"]) >= r["out"]]:
            active.remove(r)
            done.append(r)
            reserved -= r.get("reserved", 0)
            free_slots.append(r["slot"])
            free_slots.sort()
            if r["k"] + 1 < len(sessions[r["s"]]):
                k = r["k"] + 1
                heapq.heappush(pending, (now + sessions[r["s"]][k]["think"], seq, r["s"], k))
                seq += 1
            else:
                start_session(now)
    reqs = [{"request": r["request"], "out": r["out"], "arrival": r["arrival"],
             "ttft": r["times"][0] - r["arrival"], "end": r["times"][-1],
             "tpot": ((r["times"][-1] - r["times"][0]) / (len(r["times"]) - 1) if len(r["times"]) > 1
                      else None)}
            for r in done]
    return {"requests": reqs, "parts_s": parts, "iterations": iterations}


def figures(rep: dict, gpus: int, only: set[int] | None = None) -> dict:
    """METRICS of a replay, computed as the run's summary computes them, over the requests in `only`
    (`counted(record)`: those the run finished) or every replayed request."""
    reqs = [r for r in rep["requests"] if only is None or r["request"] in only]
    ttft = [r["ttft"] * 1e3 for r in reqs]
    tpot = [r["tpot"] * 1e3 for r in reqs if r["tpot"] is not None]
    dur = max(max(r["end"] for r in reqs) - min(r["arrival"] for r in reqs), 1e-12)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else None  # noqa: E731
    return {"ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90), "tpot_p50_ms": pct(tpot, 50),
            "tpot_p90_ms": pct(tpot, 90), "output_tokens_per_s_gpu": sum(r["out"] for r in reqs) / dur / gpus}


def planted(record, costs: StepCosts, *, decode_scale: float = 1.0, prefill_scale: float = 1.0,
            outside_us: float = 0.0) -> dict:
    """A copy of a serving-run record (a dict) whose figures are those of a run whose decode steps took
    `decode_scale` x, whose prefill took `prefill_scale` x what `costs` give, and whose iterations each
    spent `outside_us` more outside the steps: the replay's TTFT and TPOT percentiles, output tokens/s,
    median decode step per captured size and prefill seconds, with `extra['planted']` saying so. Its
    error against `costs` and the term that carries it are known by construction (tests use it)."""
    if not (decode_scale > 0 and prefill_scale > 0 and outside_us >= 0):
        raise ValueError(f"decode_scale and prefill_scale must be > 0 and outside_us >= 0, got "
                         f"{decode_scale!r}, {prefill_scale!r}, {outside_us!r}")
    import copy

    d = copy.deepcopy(_get(record))
    inp = run_inputs(d)
    wrong = StepCosts(lambda b, n, ctx: decode_scale * costs.decode_us(b, n, ctx),
                      lambda t, ctx: prefill_scale * costs.prefill_us(t, ctx),
                      costs.iteration_us + outside_us, "planted")
    rep = replay(inp, wrong)
    f = figures(rep, inp["gpus"], counted(d))
    s = d["extra"]["summary"]
    s["ttft_ms"].update(p50=f["ttft_p50_ms"], p90=f["ttft_p90_ms"])
    s["tpot_ms"].update(p50=f["tpot_p50_ms"], p90=f["tpot_p90_ms"])
    s["output_tokens_per_s_gpu"] = f["output_tokens_per_s_gpu"]
    steps: dict[int, list[float]] = {}
    for b, t_dec, _, _ in rep["iterations"]:
        if b:
            steps.setdefault(b, []).append(t_dec * 1e3)
    s["decode_step_ms"] = {str(b): statistics.median(v) for b, v in sorted(steps.items())}
    s["prefill_s"] = sum(it[3] for it in rep["iterations"])
    s["prefill_calls"] = sum(1 for it in rep["iterations"] if it[2])
    s["prefill_tokens"] = sum(it[2] for it in rep["iterations"])
    d["extra"]["planted"] = {"decode_scale": decode_scale, "prefill_scale": prefill_scale,
                             "outside_us": outside_us, "costs": costs.source}
    return d


def _errors(pred: dict, meas: dict) -> dict:
    return {m: (pred[m] / meas[m] - 1.0 if pred.get(m) is not None and meas.get(m) else None)
            for m in METRICS}


def _worst(err: dict) -> float:
    return max((abs(e) for e in err.values() if e is not None), default=0.0)


def prefill_model_s(costs: StepCosts, meas: dict) -> float:
    """The model's seconds for a run's prefill: its calls (`measured`'s prefill_calls) at their mean size
    (exact for a prefill linear in tokens); 0.0 when the record counts no calls."""
    calls, tokens = meas.get("prefill_calls"), meas.get("prefill_tokens")
    return calls * costs.prefill_us(tokens / calls, 0.0) * 1e-6 if calls and tokens else 0.0


def with_measured(costs: StepCosts, meas: dict, terms: tuple[str, ...]) -> StepCosts:
    """`costs` with the named terms ('decode step', 'prefill') replaced by the run's own measurement:
    the median decode step of each captured size the run used (the model's at a size it did not), and the
    run's prefill: the model's prefill scaled so that the run's calls at their mean size take the run's
    measured seconds (its shape, per call and per token, kept; exact for a prefill linear in tokens), or
    the run's seconds per token when the record counts no calls."""
    dec, pf = costs.decode_us, costs.prefill_us
    if "decode step" in terms and meas["decode_step_ms"]:
        steps = meas["decode_step_ms"]
        dec = lambda b, n, ctx: steps[b] * 1e3 if b in steps else costs.decode_us(b, n, ctx)  # noqa: E731
    model_s = prefill_model_s(costs, meas)
    if "prefill" in terms and model_s > 0 and meas.get("prefill_s"):
        k = meas["prefill_s"] / model_s
        pf = lambda t, ctx: k * costs.prefill_us(t, ctx)  # noqa: E731
    elif "prefill" in terms and meas["prefill_us_per_token"]:
        per = meas["prefill_us_per_token"]
        pf = lambda t, ctx: per * t  # noqa: E731
    return StepCosts(dec, pf, costs.iteration_us, f"{costs.source}; measured in the run: {', '.join(terms)}")


def term_errors(record, costs: StepCosts) -> dict:
    """Each step term of the model against the run's measurement of it: the decode step per captured size
    (at the run's mean history per decoding sequence) and prefill per token, as predicted / measured - 1."""
    inp, meas = run_inputs(record), measured(record)
    rows = [r for s in inp["sessions"] for r in s]
    mean_ctx = statistics.fmean(r["n_in"] + r["out"] / 2 for r in rows) if rows else 0.0
    out = {}
    for b, ms in meas["decode_step_ms"].items():
        n = min(b, inp["concurrency"])
        out[f"decode step b{b}"] = costs.decode_us(b, n, n * mean_ctx) / (ms * 1e3) - 1.0
    if meas["prefill_us_per_token"]:
        n = inp["max_batched_tokens"]
        out["prefill per token"] = costs.prefill_us(n, 0.0) / n / meas["prefill_us_per_token"] - 1.0
    return out


def check_run(record, costs: StepCosts, tolerance: float = TOLERANCE) -> dict:
    """One serving-run record against the model: per metric predicted, measured and rel_err (predicted /
    measured - 1); `pass` when every metric is within `tolerance`; the largest predicted share of the
    iterations' time (`largest_term`); when it fails, `wrong_term` (module docstring) and the worst error
    over the failing metrics after each substitution (`after_substitution`)."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
    if not isinstance(costs, StepCosts):
        raise TypeError(f"costs must be a predict.StepCosts, got {type(costs).__name__}")
    d = _get(record)
    inp, meas = run_inputs(d), measured(d)
    rep = replay(inp, costs)
    only = counted(d)
    pred = figures(rep, inp["gpus"], only)
    err = _errors(pred, meas)
    parts = rep["parts_s"]
    row = {"case": d["case"], "device": d["device"], "concurrency": inp["concurrency"], "dcp": inp["dcp"],
           "requests": len(rep["requests"]), "costs": costs.source}
    for m in METRICS:
        row[f"{m} predicted"], row[f"{m} measured"], row[f"{m} err"] = pred[m], meas[m], err[m]
    row["pass"] = all(e is not None and abs(e) <= tolerance for e in err.values())
    total = sum(parts.values()) or 1.0
    row["largest_term"] = max(parts, key=parts.get)
    row["term_shares"] = {k: v / total for k, v in parts.items()}
    row["term_errors"] = term_errors(d, costs)
    row["wrong_term"], row["after_substitution"] = None, {}
    if not row["pass"]:
        failing = [m for m in METRICS if err[m] is None or abs(err[m]) > tolerance]
        row["failing"] = failing
        base = _worst({m: err[m] for m in failing}) if all(err[m] is not None for m in failing) else 1.0
        for terms in (("decode step",), ("prefill",), ("decode step", "prefill")):
            p = figures(replay(inp, with_measured(costs, meas, terms)), inp["gpus"], only)
            e = _errors(p, meas)
            row["after_substitution"][" + ".join(terms)] = _worst({m: e[m] for m in failing})
        singles = {k: v for k, v in row["after_substitution"].items() if "+" not in k}
        best = min(singles, key=singles.get)
        if row["after_substitution"]["decode step + prefill"] > tolerance:
            row["wrong_term"] = OUTSIDE
        elif singles[best] <= tolerance or singles[best] < 0.5 * base:
            row["wrong_term"] = best
        else:
            row["wrong_term"] = "decode step + prefill"
    return row


def check_runs(records, costs: StepCosts | Callable, tolerance: float = TOLERANCE) -> list[dict]:
    """check_run for each record; `costs` is one StepCosts or a function of the record giving one (a
    run's DCP degree changes its decode step)."""
    return [check_run(r, costs(r) if callable(costs) and not isinstance(costs, StepCosts) else costs,
                      tolerance) for r in records]


# ------------------------------------------------------------------------------------------- the costs
NOMINAL_TBS = 1.0  # the bandwidth a CPU fit divides bytes by: its coefficients carry the real scale


def measure_costs(engine, *, contexts=None, prefill_tokens=None, repeats: int = 3,
                  dcp: int = 1) -> StepCosts:
    """Time `engine`'s own steps alone (outside any run) and fit the step model to them: every captured
    decode size at `contexts` history positions per sequence (stepmodel.fit on the decode_step bytes parts
    of the engine's config), and one prefill call at each of `prefill_tokens` (a line in tokens). The
    engine's slot 0 and staging entry 0 are reset afterwards. ValueError for a context the slots cannot
    hold or a prefill larger than the engine's budget.

    Default sizes span the run's own: contexts at 1/8, 3/8 and 6/8 of the slots' rows (the longest
    session), prefill calls of 1/8, 3/8 and all of the engine's max_batched_tokens. A fit at sizes far
    below the run's misses it: fitted at 16-160 positions and 8-96 prefill tokens on an H100, where the
    run's histories reach thousands of positions and its chunks 8,192 tokens, the prefill line came out
    a constant (launch-bound at those sizes) 80-93% under the run's prefill per token."""
    sc0 = engine.slots
    if contexts is None:
        contexts = tuple(sorted({max(1, (sc0.rows - 2) * f // 8) for f in (1, 3, 6)}))
    if prefill_tokens is None:
        prefill_tokens = tuple(sorted({max(1, engine.max_batched_tokens * f // 8) for f in (1, 3, 8)}))
    import time

    import torch

    from k3lab.engine.prefill import Chunk

    from . import node, stepmodel

    sc, cfg = engine.slots, engine.weights.config
    if max(contexts) >= sc.rows - 1 or min(contexts) < 1:
        raise ValueError(f"contexts must lie in [1, {sc.rows - 2}], got {contexts!r}")
    if max(prefill_tokens) > engine.max_batched_tokens or min(prefill_tokens) < 1:
        raise ValueError(f"prefill_tokens must lie in [1, {engine.max_batched_tokens}], got "
                         f"{prefill_tokens!r}")
    esize = engine.weights.embed.element_size()
    sync = torch.cuda.synchronize if sc.device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()
        sync()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e6

    sc.set_dcp(dcp)
    points = []
    with torch.no_grad():
        for b in engine.sizes:
            step = engine.decode[b]
            for ctx in contexts:
                sc.set_decode({s: ctx for s in range(b)})
                us = timed(step.replay if engine.graphs else step.run)
                parts = node.step_parts(cfg, b, b * ctx, b, dense_bytes=0.0, expert_weight_bytes=esize,
                                        cache_bytes=esize, dcp=dcp)
                points.append(stepmodel.StepPoint("engine", b, ctx, b, parts, NOMINAL_TBS, us,
                                                  "timed alone by predict.measure_costs"))
        pf = []
        for n in prefill_tokens:
            ids = torch.zeros(n, dtype=torch.long, device=sc.device)

            def call(ids=ids):
                sc.reset_stage(0)
                engine.prefill([Chunk(0, 0, 0, ids)])

            pf.append(timed(call))
        sc.reset_stage(0)
    fit = stepmodel.fit(points, held_out=[])
    slope, icpt = np.polyfit(np.array(prefill_tokens, float), np.array(pf), 1)
    slope, icpt = max(float(slope), 0.0), max(float(icpt), 0.0)

    def decode_us(b, n, ctx):
        parts = node.step_parts(cfg, b, ctx, b, dense_bytes=0.0, expert_weight_bytes=esize, cache_bytes=esize,
                                dcp=dcp)
        return fit.predict(parts, b, NOMINAL_TBS, b)

    return StepCosts(decode_us, lambda t, ctx: icpt + slope * t, 0.0,
                     f"{engine.weights.config.name} steps timed alone on {sc.device.type}: decode step model "
                     f"({', '.join(f'{k} {v:.3g}' for k, v in fit.coef.items())}) over {len(points)} steps, "
                     f"prefill {icpt:.0f} us + {slope:.2f} us per token")


def gpu_costs(device: str = "nvidia-h200", *, dcp: int = 1, variant: str = "all_on", root=None) -> StepCosts:
    """The step model of `device`'s committed grid for a serving run on it: the decode step is `variant`'s
    fit (serving.inputs) over the bytes of the run's step (bf16 weights and history, the
    measured steps' random-router expert count, the history divided by `dcp`, the waves at the device's
    compute units, its measured bandwidth), collectives as the same stand-ins the grid timed; prefill per
    token is the serving model's (node.prefill_us_per_token: the H200's measured KDA scan, FLOPs at the
    measured matrix share; modelled). LookupError when the device has no grid of `variant`."""
    from . import hardware, inputs, node, stepmodel

    pts = inputs.step_points(device, root)
    fits = inputs.fits(pts)
    if variant not in fits:
        raise LookupError(f"no {variant} step records of {device} to fit (profiles/{device}/serving/grid.*)")
    fit = fits[variant]
    c = node.tp_config()
    dense = statistics.median(p.parts["weights_dense"] for p in pts)
    bw = statistics.median(p.bandwidth_tbs for p in pts)
    g = hardware.named(device.replace("-", " "))
    pool, _ = inputs.step_routing_pool(device, root)
    k, E = c.num_experts_per_token, c.num_experts
    h200 = inputs.node_inputs(root=root)

    def decode_us(b, n, ctx):
        parts = node.step_parts(c, b, ctx, b, dense_bytes=dense, expert_weight_bytes=2.0, cache_bytes=2.0,
                                dcp=dcp)
        if b > 1:
            read = stepmodel.distinct_experts(b, pool, k) / stepmodel.distinct_experts(b, E, k)
            parts["weights_experts"] *= read
        return fit.predict(parts, b, bw, b, stepmodel.waves(b, c.num_attention_heads, g.compute_units))

    def prefill_us(t, ctx):
        return t * node.prefill_us_per_token(h200, ctx + t / 2, g, True)

    return StepCosts(decode_us, prefill_us, 0.0,
                     f"{variant} step model of profiles/{device}/ ({len(fit.fitted)} steps, {bw:.2f} TB/s "
                     f"measured), prefill modelled (node.prefill_us_per_token on {g.name})")
