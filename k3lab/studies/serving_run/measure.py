"""Runs of the serving_run study (the package docstring says what it measures): the forms and their
set-up (workload scale, cache budget, checkpoint interval, clock), the engine built once for a form's
cases, one record per run with the step model beside it, the plan behind a form, and the CLI
(`python -m k3lab.studies.serving_run`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from k3lab import bench

from .tables import FORM_PREFIX, NAME, measured, parse_case, summary_text

DISTINCT_LAYERS = 2  # weight sets per layer kind on a GPU: each layer's ~100 MB+ dwarfs the L2 either way
PLAN_DEVICE = "nvidia-h100-80gb-hbm3"  # whose committed quick-form records give `plan` its step times
GPU_SCALE = {"context": 1 / 16, "output": 1 / 8, "time": 1 / 8}
CPU_SCALE = {"context": 1 / 512, "output": 1 / 64, "time": 1 / 8}
MAX_BATCHED_TOKENS = {"gpu": 8192, "cpu": 96}
CHECKPOINT_INTERVAL = {"gpu": 2048, "cpu": 128}
CPU_BUDGET = (6e6, 3e6)
QUICK = ("c1.dcp1.host", "c2.dcp1.host", "c4.dcp1.host", "c8.dcp1.host", "c16.dcp1.host", "c16.dcp8.host",
         "c16.dcp1.gpu_only")
FULL = tuple(f"c{c}.dcp{d}.{h}" for c in (1, 2, 4, 8, 16, 32, 64) for d in (1, 8)
             for h in ("host", "gpu_only"))
BRIEF = ("c1.dcp1.host", "c4.dcp1.host", "c16.dcp1.host")
CPU_CASES = ("c1.dcp1.host", "c2.dcp1.host", "c3.dcp1.host", "c3.dcp8.gpu_only")
CAPACITY = ("capacity.c16.dcp1.gpu_only", "capacity.c16.dcp1.host", "capacity.c16.dcp8.host",
            "capacity.c4.dcp1.gpu_only")
CPU_CAPACITY = ("capacity.c3.dcp1.gpu_only", "capacity.c3.dcp1.host", "capacity.c3.dcp8.host",
                "capacity.c1.dcp1.host")
CAPACITY_CPU_BUDGET = (5.5e6, 6e6)
CAPACITY_CPU_REQUESTS = 12  # about four turns a session at c3 (the clock orders which session takes each)
CAPACITY_CPU_TURNS = 8      # the CPU workload's median turns per session in this form (4 elsewhere)
RUN_S = {"quick": (15.0, 10.0), "full": (40.0, 20.0), "brief": (6.0, 4.0),
         "capacity": (75.0, 10.0)}  # serving clock, then at most this to finish the requests in flight
FORM_CASES = {"quick": QUICK, "full": FULL, "brief": BRIEF, "capacity": CAPACITY}
CAPACITY_WHY = """The capacity form: where the cache's capacity binds, what DCP8 and the host tier change.

Its GPU cases were planned from the H100 quick runs (serving.plan) and then run on an H100 (records
profiles/nvidia-h100-80gb-hbm3/serving_run/capacity.*; docs/serving_run.md's capacity table).

Why it exists. In the quick form's 15 s a session at concurrency 16 completes about one turn (the
sixteen first prompts' prefill takes longer than the clock), so almost no turn can hit a cached prefix
and DCP8 and the host tier show nothing. This form gives each session several turns (k3lab.serving.plan
expects about 4 to 7 at c16 on an H100, at least 3) and a budget that c16's sessions overfill at DCP1
and fit at DCP8.

What it changes, and why. The workload is the quick form's scaled one (prompts x 1/16, outputs and
think times x 1/8) and so is the budget (an MI355X rank's 59.9 GB and its 224.875 GB host tier, x 1/16):
- the serving clock is 75 s (plus at most 10 s to finish the requests in flight) instead of 15 s, so that
  each session gets several turns: four runs fit one 10-minute GPU call with the engine's setup;
- KDA checkpoints are kept at prompt ends only (checkpoint interval 0, the quick form's is 2048): a
  checkpoint is every KDA layer's state (56 MB per sequence on one rank of K3 at bf16, not divided by
  DCP); with one every 2048 positions a c16 session's checkpoints alone would outweigh its DCP8 history
  and DCP8 would bind too. At prompt ends only, a session holds its history (which DCP divides by its
  degree) and one state, and a miss recomputes the whole prompt.
The plan (`plan(case, 'capacity')`): at c16 the sessions need about 5.4 to 6 GB at DCP1 (their prefixes
plus their running state) against the 3.74 GB budget, about 2.3 GB at DCP8; at c4 DCP1 about 2 GB (the
case where nothing binds). On a CPU the same cases at concurrency 3 (and 1) on the tiny preset, twelve
requests each (four turns a session), in a 5.5 MB device budget and a 6 MB host tier chosen likewise.
Its records carry the form in their case names ('capacity.c16.dcp8.host') and in extra['form'], apart
from the curve's records (`measured(form='capacity')`)."""
CAPACITY_LABEL = {"gpu": " [the capacity form: the scaled workload above, a 75 s clock, KDA checkpoints at "
                         "prompt ends only (serving_run.CAPACITY_WHY)]",
                  "cpu": " [the capacity form at its CPU size: the scaled workload above, 12 requests a run, "
                         "KDA checkpoints at prompt ends only (serving_run.CAPACITY_WHY)]"}


def plan(case: str, form: str = "quick", kind: str | None = None) -> dict:
    """k3lab.serving.plan.plan_run of `case` as `form` runs it on `kind` ('gpu' or 'cpu'; default this
    machine's): the form's workload (drawn as for the form's default cases run together), budget,
    checkpoint interval and clock; on a GPU the step times of the
    H100's committed quick-form records (`plan.costs_from_records`), on a CPU a fixed clock (its runs are
    bounded by a request count, not a clock: the times only order the turns). Adds 'case', 'form',
    'kind'. ValueError for a malformed case or form, or (GPU) no committed H100 records."""
    from k3lab.config import K3Config
    from k3lab.serving import plan as planning
    from k3lab.serving.predict import fixed_clock

    kind = kind or ("gpu" if _on_gpu() else "cpu")
    spec = form_setup(form, kind)
    p = parse_case(case)
    cases = list(spec["cases"] or FORM_CASES[form])  # the workload is drawn for the cases run together
    if case.removeprefix(FORM_PREFIX) not in [c.removeprefix(FORM_PREFIX) for c in cases]:
        cases.append(case)
    sessions = _sessions(cases, spec)
    if kind == "gpu":
        recs = measured(device=PLAN_DEVICE)
        if not recs:
            raise ValueError(f"no committed {NAME} records of {PLAN_DEVICE} to take step times from")
        costs = planning.costs_from_records(recs)
        layout = planning.Layout.of(K3Config.tp_slice(8), 2)
    else:
        costs = fixed_clock((1e-3, 1e-4, 1e-5))
        layout = planning.Layout.of(K3Config.tiny(), 4)
    lim = spec["limits"]
    out = planning.plan_run(sessions, layout, spec["cache"], concurrency=p["concurrency"], dcp=p["dcp"],
                            host=p["host"], costs=costs, clock_s=lim.get("duration_s"),
                            max_requests=lim.get("max_requests"),
                            checkpoint_interval=spec["checkpoint_interval"],
                            max_batched_tokens=MAX_BATCHED_TOKENS[kind], staging=4 if kind == "gpu" else 2)
    return {"case": case, "form": form, "kind": kind, **out}


def _on_gpu() -> bool:
    return torch.cuda.is_available()


def form_setup(form: str, kind: str) -> dict:
    """What a form's runs are on `kind` ('gpu' or 'cpu'): the workload's scale, its generator overrides,
    root sessions per concurrency, the cache budget, the checkpoint interval and the run's limits
    (duration_s and drain_s on a GPU, max_requests on a CPU). Every form but 'capacity' shares one
    set-up per kind (the package docstring); the capacity form's differs only where its docstring
    (`CAPACITY_WHY`) says."""
    if form not in RUN_S:
        raise ValueError(f"form must be one of {sorted(RUN_S)}, got {form!r}")
    if kind not in ("gpu", "cpu"):
        raise ValueError(f"kind must be 'gpu' or 'cpu', got {kind!r}")
    from k3lab.serving.run import CacheBudget
    from k3lab.serving.workload import Scale

    cap = form == "capacity"
    if kind == "gpu":
        scale = Scale(**GPU_SCALE)
        dur, drain = RUN_S[form]
        return {"scale": scale, "overrides": {}, "sessions": lambda c: max(2, c + c // 2),
                "cache": budget(scale.context),
                "checkpoint_interval": 0 if cap else CHECKPOINT_INTERVAL[kind],
                "limits": {"duration_s": dur, "drain_s": drain}, "cases": CAPACITY if cap else None}
    if cap:
        cache = CacheBudget(*CAPACITY_CPU_BUDGET, source="a scaled-down budget for the tiny preset on a CPU, "
                            "the capacity form's: 5.5 MB of device memory and a 6 MB host tier, where "
                            "k3lab.serving.plan puts three sessions' prefixes and running state over it at "
                            "DCP1 and under it at DCP8")
        return {"scale": Scale(**CPU_SCALE), "overrides": {"median_turns": CAPACITY_CPU_TURNS},
                "sessions": lambda c: max(2, c + c // 2), "cache": cache, "checkpoint_interval": 0,
                "limits": {"max_requests": CAPACITY_CPU_REQUESTS}, "cases": CPU_CAPACITY}
    cache = CacheBudget(*CPU_BUDGET, source="a scaled-down budget for the tiny preset on a CPU: 6 MB of "
                                            "device memory and a 3 MB host tier (about 20 and 10 blocks "
                                            "of 64 positions), so that capacity binds at 3 sessions")
    return {"scale": Scale(**CPU_SCALE), "overrides": {"median_turns": 4}, "sessions": lambda c: 2,
            "cache": cache, "checkpoint_interval": CHECKPOINT_INTERVAL[kind], "limits": {"max_requests": 8},
            "cases": CPU_CASES}


def case_names(preset=None) -> list[str]:
    """Every case of the full form on a GPU (the quick and brief forms' among them); on a CPU the CPU
    cases."""
    return list(CPU_CASES) if not _on_gpu() else list(dict.fromkeys(QUICK + BRIEF + FULL))


def budget(context_scale: float, target: str = "mi355x"):
    """The cache budget (k3lab.serving.run.CacheBudget) of one rank of an 8 x `target` node after K3's
    weights at the served precision, and the recipe's host tier, both x `context_scale`."""
    from k3lab.serving import hardware, node
    from k3lab.serving.run import CacheBudget

    g = hardware.gpu(target)
    free, host = node.free_gb(g), hardware.SEED["host_cache_gb"]
    w = node.weights_gb_per_rank()["total"]
    return CacheBudget(free * 1e9 * context_scale, host * 1e9 * context_scale,
                       f"one rank of 8 x {g.name}: {g.memory_gb:g} GB x (1 - {node.RESERVE}) - {w:.1f} GB "
                       f"of K3 weights (MXFP4 experts, bf16 rest) = {free:.1f} GB, and the recipe's host "
                       f"tier {host:g} GB per rank; both x {context_scale:g} (the workload's context "
                       f"scale). The run stores history and KDA state in its own dtype")


def _sessions(cases: list[str], spec: dict):
    """The closed-loop sessions of a run of `cases` under a form's set-up (`form_setup`): root sessions
    for the largest concurrency among them."""
    from k3lab.serving.workload import Sessions, agentx_sessions

    conc = max(parse_case(c)["concurrency"] for c in cases)
    w = agentx_sessions(spec["sessions"](conc), scale=spec["scale"], seed=0, **spec["overrides"])
    return Sessions.of(w, think_scale=spec["scale"].time)


def _setup(cases: list[str], log, form: str = "quick"):
    """(engine, sessions, kind, scale) for `cases` in `form`: the weights, the workload and the engine
    sized for the largest concurrency among them."""
    from k3lab.config import K3Config
    from k3lab.engine import RankWeights
    from k3lab.serving.run import CPU_SWITCHES, Engine

    kind = "gpu" if _on_gpu() else "cpu"
    spec = form_setup(form, kind)
    conc = max(parse_case(c)["concurrency"] for c in cases)
    t0 = time.perf_counter()
    if kind == "gpu":
        from k3lab.report.kernels import build_all

        built, note = build_all()
        log(f"serving_run: kernels ({note}): " + ", ".join(f"{n} {s}" for n, _, s in built)
            + f" in {time.perf_counter() - t0:.0f} s")
        config, dev, dt = K3Config.tp_slice(8), torch.device("cuda"), torch.bfloat16
        opts = "all"
    else:
        config, dev, dt = K3Config.tiny(), torch.device("cpu"), torch.float32
        opts = CPU_SWITCHES
    scale, cache = spec["scale"], spec["cache"]
    weights = RankWeights.random(config, distinct_layers=DISTINCT_LAYERS if kind == "gpu" else 1, device=dev,
                                 dtype=dt)
    log(f"serving_run: weights drawn ({weights.nbytes()['total'] / 2**30:.1f} GiB) in "
        f"{time.perf_counter() - t0:.0f} s")
    sessions = _sessions(cases, spec)
    rows = sessions.max_len() + 2
    engine = Engine(weights, slots=conc, rows=rows, cache=cache, staging=2 if kind == "cpu" else 4,
                    max_batched_tokens=MAX_BATCHED_TOKENS[kind], optimizations=opts, log=log)
    return engine, sessions, kind, scale


def _record(case: str, res, kind: str, scale, form: str = "quick") -> bench.Record:
    s = res.summary()
    tpots = sorted(r["tpot"] * 1e6 for r in res.requests if r["finished"] and r["tpot"] is not None)
    if tpots:
        import numpy as np

        med, p20, p80 = (float(np.percentile(tpots, q)) for q in (50, 20, 80))
    else:
        med = p20 = p80 = 0.0
    info = bench.provenance()
    d = res.describe
    keys = ("request", "session", "turn", "n_in", "out", "resume", "arrival", "ttft", "tpot", "e2e",
            "finished")
    rows = [{k: r[k] for k in keys} for r in res.requests]
    return bench.Record(
        study=NAME, case=case, variant="after", device=info["device"], backend=info["backend"],
        versions=info["versions"], commit=info["commit"], date=info["date"],
        shape={"concurrency": res.settings.concurrency, "dcp": res.settings.dcp,
               "host_tier": res.settings.host, "config": d["config"],
               "max_batched_tokens": res.settings.max_batched_tokens,
               "checkpoint_interval": res.settings.checkpoint_interval, "slots": d["slots"],
               "rows": d["rows"]},
        dtype=d["dtype"], median_us=med, p20_us=p20, p80_us=p80, floor_us=None,
        mode="graph" if d["decode"]["graphs"] else ("cpu" if kind == "cpu" else "eager"),
        extra=_plain({
            "what": "a measured serving run (TPOT percentiles over requests in median/p20/p80)",
            "summary": s, "describe": d, "form": form,
            "workload": scale.describe() + (CAPACITY_LABEL[kind] if form == "capacity" else ""),
            "run_clock_s": [res.settings.duration_s, res.settings.drain_s], "requests": rows}))


def _plain(obj):
    """JSON-ready copy: numpy numbers as Python numbers, tuples as lists, non-finite floats as text."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, torch.Tensor):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj if obj is None or isinstance(obj, (str, int, float, bool)) else str(obj)


def run(preset=None, cases=None, *, form: str = "full", log=print, budget_s: float | None = None,
        on_record=None) -> list[bench.Record]:
    """One record per case (default: the form's on a GPU, the CPU cases on a CPU), in order; as for
    every study, run() with no form runs every case (`k3lab report --full`, `k3lab bench serving_run`),
    the CLI the quick form. Stops starting runs once `budget_s` seconds (from the start, engine
    included) would be passed by one more run of the form's length; the first always runs.
    on_record(record) is called after each run (the CLI writes its file).

    On a CPU the runs use one torch thread (restored after): on a shared 2-core machine under load,
    torch's pool of two spins (the CPU form took 116 s with two threads at a load of 5, 7 s alone)."""
    return _one_thread_on_a_cpu(_run_cases, cases, form, log, budget_s, on_record)[0]


def run_with_costs(cases=None, *, form: str = "brief", log=print, budget_s: float | None = None):
    """(records, costs): run() of `cases` in `form`, and the step model's costs it timed on the same
    engine (k3lab.serving.predict.measure_costs; each record's extra['model'] is predict.check_run with
    them)."""
    return _one_thread_on_a_cpu(_run_cases, cases, form, log, budget_s, None)


def engine_costs(concurrency: int, log=print):
    """The step model's costs (predict.measure_costs) timed on an engine built as a run of `concurrency`
    sequences would be, without running any requests: for committed records of this machine."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")

    def build():
        from k3lab.serving import predict

        engine, _, kind, _ = _setup([f"c{concurrency}.dcp1.host"], log)
        with torch.no_grad():
            costs = predict.measure_costs(engine)
        del engine
        _give_back_memory(kind)
        return costs

    return _one_thread_on_a_cpu(build)


def model_rows(records, costs=None, log=print) -> tuple[list[dict], str]:
    """(rows, source): the step model beside each of `records` (predict.check_run rows) and what the
    model is. On a GPU whose serving grid is committed, that grid's step model (predict.gpu_costs);
    else `costs` when given (timed on the run's own engine); else the rows the study stored with the
    records (extra['model']: its engine's steps timed alone after the runs); else the steps of a fresh
    engine of the records' largest concurrency (`engine_costs`)."""
    from k3lab.serving import predict

    if _on_gpu():
        try:
            costs = predict.gpu_costs(bench.device_slug())
        except (LookupError, ValueError) as exc:  # no grid of this GPU committed
            log(f"serving_run: {exc}: the model is this GPU's steps timed alone")
    if costs is None and records and all("model" in r.extra for r in records):
        return [r.extra["model"] for r in records], records[0].extra["model"]["costs"]
    if costs is None:
        costs = engine_costs(max(int(r.shape["concurrency"]) for r in records), log)
    return predict.check_runs(records, costs), costs.source


def _attach_model(records: list, engine, log):
    """Time `engine`'s steps alone and fit the step model (predict.measure_costs), then set it beside each
    record (extra['model'] = predict.check_run: TTFT / TPOT P50 / P90 and output tokens/s predicted,
    measured, rel_err, and the term named when one is off by more than predict.TOLERANCE). The costs."""
    from k3lab.serving import predict

    t0 = time.perf_counter()
    with torch.no_grad():
        costs = predict.measure_costs(engine)
    for rec in records:
        try:
            row = predict.check_run(rec, costs)
        except ValueError as exc:  # e.g. a run that finished no request: said in the record
            row = {"case": rec.case, "error": str(exc)}
        rec.extra["model"] = _plain({"what": "modelled: this run's requests replayed through the scheduler "
                                             "with the step model's times (k3lab.serving.predict)",
                                     "costs": costs.source, **row})
    log(f"serving_run: the step model beside each run ({time.perf_counter() - t0:.1f} s): {costs.source}")
    return costs


def _one_thread_on_a_cpu(fn, *args):
    """fn(*args) with one torch thread on a CPU (run()'s docstring says why), the count restored after."""
    threads = torch.get_num_threads()
    if not _on_gpu():
        torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _run_cases(cases, form, log, budget_s, on_record):
    """(records, costs): the runs of run() / run_with_costs(), the model beside each (_attach_model)."""
    from k3lab.serving.run import RunSettings

    kind = "gpu" if _on_gpu() else "cpu"
    spec = form_setup(form, kind)
    chosen = _form_cases(form, (spec["cases"] or FORM_CASES[form]) if cases is None else cases)
    t0 = time.perf_counter()
    engine, sessions, kind, scale = _setup(chosen, log, form)
    dur, drain = RUN_S[form]
    kw = {"checkpoint_interval": spec["checkpoint_interval"], "max_batched_tokens": MAX_BATCHED_TOKENS[kind],
          **spec["limits"]}
    out, per_run = [], None
    for k, case in enumerate(chosen):
        spent = time.perf_counter() - t0
        est = per_run if per_run is not None else dur + drain / 2
        if budget_s is not None and k > 0 and spent + est > budget_s:
            log(f"serving_run: stopping before {case}: {spent:.0f} s spent, about {est:.0f} s more per run, "
                f"budget {budget_s:.0f} s ({len(chosen) - k} cases not run)")
            break
        log(f"serving_run: {case} [{k + 1}/{len(chosen)}], {spent:.0f} s so far, ETA "
            f"{est * (len(chosen) - k):.0f} s")
        p = parse_case(case)
        settings = RunSettings(concurrency=p["concurrency"], dcp=p["dcp"], host=p["host"], **kw)
        last = [time.perf_counter()]

        def progress(now, done, case=case, last=last):
            if time.perf_counter() - last[0] > 10:
                last[0] = time.perf_counter()
                log(f"serving_run:   {case}: run clock {now:.1f} s, {done} requests done")

        t_run = time.perf_counter()
        with torch.no_grad():
            res = engine.run(sessions, settings, progress=progress)
        took = time.perf_counter() - t_run
        n = k + 1
        per_run = (per_run * k + took) / n if per_run is not None else took
        rec = _record(case, res, kind, scale, form)
        log(f"serving_run: done in {took:.0f} s ({rec.extra['summary']['requests']} requests, "
            f"{res.incomplete} cut at the drain limit): {summary_text([rec])}")
        res = None  # a run's result holds its pool: nothing of it outlives its record
        out.append(rec)
        if on_record is not None:
            on_record(rec)
    if budget_s is not None and time.perf_counter() - t0 > budget_s:
        log(f"serving_run: {time.perf_counter() - t0:.0f} s, over the budget of {budget_s:.0f} s (the "
            "engine's setup and the first run are always measured)")
    costs = _attach_model(out, engine, log) if out else None
    del engine, sessions
    _give_back_memory(kind)
    return out, costs


def _form_cases(form: str, cases) -> list[str]:
    """`cases` checked for `form` (ValueError naming a malformed one, before anything runs): any
    well-formed case runs; in the capacity form each carries the form's prefix (added when absent), in
    another form none may (its records would pass for the capacity form's)."""
    chosen = list(cases)
    if not chosen:
        raise ValueError("cases must name at least one case")
    for c in chosen:
        parse_case(c)
    if form == "capacity":
        return [c if c.startswith(FORM_PREFIX) else FORM_PREFIX + c for c in chosen]
    wrong = [c for c in chosen if parse_case(c).get("form")]
    if wrong:
        raise ValueError(f"cases {wrong} are the capacity form's: run them with form='capacity'")
    return chosen


def _give_back_memory(kind: str) -> None:
    """The engine's weights, slots, pool and graphs go with it; on a GPU the cached blocks are given back
    too, so the processes that run after this one in the same report (notebooks) find the memory free."""
    import gc

    gc.collect()
    if kind == "gpu":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def profile_targets(preset=None) -> dict:
    """Nothing to profile apart: the decode step is the decode_step study's (`k3lab profile decode_step`),
    the KDA chunk scan the kda_scan study's."""
    return {}


def _write(path: Path, records: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump([r.to_dict() for r in records], f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def main(argv=None) -> int:
    """The CLI (the package docstring; `python -m k3lab.studies.serving_run`): records to --json after
    every run (a run cut short keeps what it measured) and, with --save-dir, as profiles/-style files under
    that folder."""
    from k3lab.studies import serving_run  # its docstring's first line is the CLI's description

    ap = argparse.ArgumentParser(prog="python -m k3lab.studies.serving_run",
                                 description=serving_run.__doc__.splitlines()[0])
    ap.add_argument("--form", choices=sorted(RUN_S), default="quick")
    ap.add_argument("--cases", nargs="*", help="cases to run (default: the form's)")
    ap.add_argument("--json", type=Path, required=True,
                    help="file the records go to (rewritten after each run)")
    ap.add_argument("--save-dir", type=Path, help="also save them as <dir>/<device>/serving_run/*.json")
    ap.add_argument("--budget-s", type=float, default=None, help="start no run that would end past this")
    args = ap.parse_args(argv)
    done: list = []

    def keep(rec):
        done.append(rec)
        _write(args.json, done)
        if args.save_dir is not None:
            bench.save_records([rec], root=args.save_dir, overwrite=True)

    run(cases=args.cases or None, form=args.form, budget_s=args.budget_s, on_record=keep,
        log=lambda m: print(m, flush=True))
    if done:  # again, with the model beside each run (extra['model'], set after the last run)
        _write(args.json, done)
        if args.save_dir is not None:
            bench.save_records(done, root=args.save_dir, overwrite=True)
        print(summary_text(done), flush=True)
    return 0 if done else 1

