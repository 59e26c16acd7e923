"""The step-time grid the serving model is fitted to: one TP8 rank's whole decode step, graph-replayed,
over batch x context, for all on, the article's befores, and each switch off alone at a few points.

    python -m k3lab.studies.serving grid --json $OUT/serving_grid.json [--budget-s 390] [--repeats 5]
        [--batches 1 4 16 ...] [--contexts 1024 16384 ...] [--variants all_on base ...]
        [--switches-everywhere]

Records are study 'serving', case 'grid.b{batch}_{context}.{variant}', mode 'graph' (eager where the
step cannot be captured, and on a CPU), written to the JSON file after every point, so a run stopped
by its time budget (or killed) leaves what it measured; `k3lab import FILE` files them under
profiles/<device>/serving/. The variants:

    all_on       every switch on (the decode_step study's all_on)
    base         every switch off except grouped_experts: the article's befores. The decode_step
                 study's all_off also loops over experts one by one, reading the counts back to the host,
                 which cannot be captured in a graph and is nothing a server runs (its step takes seconds
                 at B = 64); base keeps the grouped launches so that it replays as one graph.
    no_<switch>  all on but one switch, at SUBSET points (the switches that apply to a decode step and
                 can be graphed: grouped_experts off cannot)

No logits check here: the decode_step study checks every variant against its reference; this grid only
times them (each record says so in extra['check']). Points whose caches do not fit in the device's free
memory are skipped, with the bytes in the log line. Order: all_on and base at every point in a
checkerboard (every other point first, so a run cut short still spans the grid), then the subsets.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from k3lab import bench

STUDY = "serving"
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072)
CPU_POINTS = ((1, 8), (2, 16))
# no_<switch> is measured at these points only: both ends of context at B = 1, and a spread of batches
SUBSET = ((1, 4096), (1, 131072), (8, 32768), (32, 16384), (128, 4096))
GRID_SWITCHES = ("kda_fused", "mla_padded", "attn_res_fused", "pack_where_used", "moe_tail_sharded",
                 "glue_fused")
BUDGET_S = 390.0  # default seconds from the start of the run (weights included) to the last point
MEMORY_SLACK = 0.85  # fraction of the free device memory a point's caches and buffers may take


def decode_step_measure():
    """The decode_step study's measuring module (its `step_bytes`, `bench_config`, `on_gpu`,
    `measured_bandwidth_tbs`), wherever this tree keeps it."""
    names = ("k3lab.studies.decode_step.measure", "k3lab.studies.decode_step.run", "k3lab.engine.bench")
    for name in names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and name.startswith(err.name):
                continue  # this tree keeps it elsewhere
            raise
        if hasattr(module, "step_bytes"):
            return module
    raise ImportError(f"no decode_step measuring module with step_bytes in this tree (looked for {names})")


def variant_switches(variant: str) -> dict[str, bool]:
    """Switch name -> on, for a grid variant ('all_on', 'base' or 'no_<switch>'); ValueError otherwise."""
    from k3lab.engine import SWITCHES, all_but

    if variant == "all_on":
        return dict.fromkeys(SWITCHES, True)
    if variant == "base":
        return {n: n == "grouped_experts" for n in SWITCHES}
    if variant.startswith("no_") and variant[3:] in GRID_SWITCHES:
        return all_but(variant[3:])
    raise ValueError(f"variant must be 'all_on', 'base' or one of "
                     f"{[f'no_{s}' for s in GRID_SWITCHES]}, got {variant!r}")


def default_points(gpu: bool) -> list[tuple[int, int]]:
    """(batch, context) of the grid: BATCHES x CONTEXTS on a GPU, CPU_POINTS on a CPU."""
    return [(b, c) for b in BATCHES for c in CONTEXTS] if gpu else list(CPU_POINTS)


def plan(points: Iterable[tuple[int, int]], subset: Iterable[tuple[int, int]] = SUBSET,
         switches: Iterable[str] = GRID_SWITCHES) -> list[tuple[int, int, str]]:
    """(batch, context, variant) in measuring order: all_on and base at every point, checkerboard first
    (points whose batch and context indices sum to an even number), then no_<switch> at the subset
    points that are in `points`. ValueError for a point that is not two positive integers."""
    pts = []
    for p in points:
        if (not isinstance(p, (tuple, list)) or len(p) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in p)):
            raise ValueError(f"points must be (batch, context) pairs of positive integers, got {p!r}")
        pts.append((int(p[0]), int(p[1])))
    bs, cs = sorted({b for b, _ in pts}), sorted({c for _, c in pts})
    order = sorted(pts, key=lambda p: ((bs.index(p[0]) + cs.index(p[1])) % 2, p))
    out = [(b, c, v) for b, c in order for v in ("all_on", "base")]
    sub = [p for p in order if p in set(map(tuple, subset))]
    return out + [(b, c, f"no_{s}") for b, c in sub for s in switches]


def point_bytes(config, batch: int, context: int, act_bytes: int = 2) -> float:
    """Device bytes a step at (batch, context) allocates besides the weights: the MLA latent buffers
    (context + 1 rows per sequence and MLA layer), the KDA states (fp32) and conv histories, and the
    split-history MLA partials; 25% on top for activations and the graph's pool."""
    c = config
    mla = c.num_mla_layers * batch * (context + 1) * c.mla_latent_dim * act_bytes
    kda = c.num_kda_layers * batch * (c.kda_state_bytes_per_sequence()
                                      + c.kda_conv_state_values_per_sequence() * act_bytes)
    partials = c.num_mla_layers * batch * 16 * 64 * (c.kv_lora_rank + 1) * 4
    return 1.25 * (mla + kda + partials)


def _free_bytes(gpu: bool) -> float | None:
    if not gpu:
        return None
    free, _ = torch.cuda.mem_get_info()
    return float(free)


def _write_json(path: Path, records: list[bench.Record]) -> None:
    """The records as one JSON list (what `k3lab import` reads), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps([r.to_dict() for r in records], indent=1) + "\n")
    os.replace(tmp, path)


def measure_point(weights, batch: int, context: int, variant: str, *, repeats: int, bandwidth: tuple,
                  step_bytes: Callable) -> bench.Record:
    """One variant's step at (batch, context): built on `weights`, timed as one graph replay where it
    can be captured (eager otherwise), `repeats` samples after one warm-up call. The record's extra holds
    the step's bytes (the decode_step study's `step_bytes`, caches at the weights' dtype), the
    bandwidth measured in this run, the switches and how long the point took."""
    from k3lab.engine import DecodeStep

    t0 = time.perf_counter()
    switches = variant_switches(variant)
    step = DecodeStep(weights.config, batch, context, optimizations=switches, weights=weights)
    gen = torch.Generator().manual_seed(batch * 1_000_003 + context)
    step.set_tokens(torch.randint(0, weights.config.vocab_size, (batch, 1), generator=gen))
    ok, why = step.capturable()
    with torch.no_grad():
        timing = bench.time_fn(step.run, warmup=1, repeats=repeats, graph=ok, calls_per_sample=1)
        finite = bool(torch.isfinite(step.logits).all()) if step.logits is not None else None
    esize = weights.embed.element_size()
    parts = step_bytes(weights.config, batch, context, tail="sharded" if switches["moe_tail_sharded"]
                       else "replicated", act_bytes=esize, cache_bytes=esize)
    bw, how = bandwidth
    label = "before" if variant == "base" else "after"
    rec = bench.make_record(
        STUDY, f"grid.b{batch}_{context}.{variant}", label, timing,
        shape={"batch": batch, "context_len": context, "q_len": 1, "tp": step.world_size,
               "layers": step.config.num_hidden_layers},
        dtype=step.dtype, floor_us=parts["total"] / (bw * 1e6),
        grid_variant=variant, switches=switches, label=step.resolved.label(),
        graph="captured" if ok else f"eager: {why}", bytes=parts, bandwidth_tbs=bw, bandwidth_how=how,
        logits_finite=finite, seconds=time.perf_counter() - t0,
        check="not checked here: the decode_step study checks each variant against its reference")
    del step
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rec


def measure_grid(points=None, *, variants: Iterable[str] | None = None, budget_s: float = BUDGET_S,
                 repeats: int = 5, distinct_layers: int = 3, json_path=None, config=None,
                 log: Callable = print, started: float | None = None,
                 subset: Iterable[tuple[int, int]] | None = None) -> list[bench.Record]:
    """Measure the grid (module docstring): `points` (batch, context) pairs (default: `default_points`),
    `variants` to keep from the plan (default: all of it), stopping before a point that would end past
    `budget_s` seconds from `started` (default: now; weights and the bandwidth copy count), estimated from
    the slowest point so far. Records are written to `json_path` after every point when given. Returns the
    records. ValueError for a bad argument before anything is allocated."""
    started = time.perf_counter() if started is None else started
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    if not isinstance(budget_s, (int, float)) or budget_s <= 0:
        raise ValueError(f"budget_s must be a positive number of seconds, got {budget_s!r}")
    m = decode_step_measure()
    gpu = m.on_gpu()
    pts = default_points(gpu) if points is None else points
    todo = plan(pts, SUBSET if subset is None else subset)
    if variants is not None:
        keep = set(variants)
        for v in keep:
            variant_switches(v)
        todo = [t for t in todo if t[2] in keep]
    config = m.bench_config() if config is None else config
    dev = torch.device("cuda" if gpu else "cpu")
    from k3lab.engine import RankWeights

    weights = RankWeights.random(config, distinct_layers=distinct_layers, device=dev,
                                 dtype=torch.bfloat16 if gpu else torch.float32)
    bandwidth = m.measured_bandwidth_tbs()
    log(f"serving grid: {len(todo)} steps to time on {config.name}; weights "
        f"{weights.nbytes()['total'] / 2**30:.1f} GiB, {bandwidth[0]:.2f} TB/s; "
        f"[{time.perf_counter() - started:.0f} s of {budget_s:.0f}]")
    path = Path(json_path) if json_path else None
    records: list[bench.Record] = []
    slowest = 0.0
    skipped = []
    for batch, context, variant in todo:
        need, free = point_bytes(config, batch, context), _free_bytes(gpu)
        if free is not None and need > MEMORY_SLACK * free:
            skipped.append((batch, context, variant))
            log(f"  skip b{batch} ctx{context} {variant}: needs ~{need / 2**30:.0f} GiB of "
                f"{free / 2**30:.0f} GiB free")
            continue
        elapsed = time.perf_counter() - started
        if elapsed + 1.5 * slowest > budget_s:
            log(f"  budget: stopping at {elapsed:.0f} s with {len(records)} of {len(todo)} steps timed "
                f"(the slowest took {slowest:.1f} s)")
            break
        t = time.perf_counter()
        rec = measure_point(weights, batch, context, variant, repeats=repeats, bandwidth=bandwidth,
                            step_bytes=m.step_bytes)
        slowest = max(slowest, time.perf_counter() - t)
        records.append(rec)
        log(f"  b{batch} ctx{context} {variant}: {rec.median_us / 1e3:.2f} ms ({rec.mode})  "
            f"[{time.perf_counter() - started:.0f} s]")
        if path:
            _write_json(path, records)
    if skipped:
        log(f"  {len(skipped)} steps skipped: their caches do not fit in this device's memory")
    return records


def main(argv: list[str] | None = None) -> int:
    import argparse

    started = time.perf_counter()
    p = argparse.ArgumentParser(prog="python -m k3lab.studies.serving",
                                description="the step-time grid the serving model is fitted to")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("grid", help="time the decode step over batch x context (GPU; a tiny grid on CPU)")
    g.add_argument("--json", required=True, help="write the records to this JSON file (after every point)")
    g.add_argument("--budget-s", type=float, default=BUDGET_S,
                   help="stop before a point that would end past this many seconds from the start")
    g.add_argument("--repeats", type=int, default=5, help="timed samples per step")
    g.add_argument("--distinct-layers", type=int, default=3, help="weight sets per layer kind")
    g.add_argument("--batches", type=int, nargs="+", help=f"batches to time (default {BATCHES})")
    g.add_argument("--contexts", type=int, nargs="+", help=f"contexts to time (default {CONTEXTS})")
    g.add_argument("--variants", nargs="+", help="variants to keep: all_on, base, no_<switch> (default all)")
    g.add_argument("--switches-everywhere", action="store_true",
                   help="time the no_<switch> variants at every point, not only at SUBSET (a second GPU's "
                        "grid for the cross-GPU check: serving.validate.cross_gpu fits each variant there)")
    args = p.parse_args(argv)
    from k3lab import env

    print(env.describe())
    points = None
    if args.batches or args.contexts:
        points = [(b, c) for b in (args.batches or BATCHES) for c in (args.contexts or CONTEXTS)]
    recs = measure_grid(points, variants=args.variants, budget_s=args.budget_s, repeats=args.repeats,
                        distinct_layers=args.distinct_layers, json_path=args.json, started=started,
                        subset=points if args.switches_everywhere and points else None)
    if not recs:
        _write_json(Path(args.json), recs)
    print(f"wrote {len(recs)} records to {args.json} in {time.perf_counter() - started:.0f} s")
    return 0
