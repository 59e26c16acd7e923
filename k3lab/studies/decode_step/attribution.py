"""Where the whole decode step's time goes, kernel by kernel: the graph-replayed step of one TP8 rank
with each kernel named by the layer part that launched it, the idle gap before it, and per part the
kernel time, the gaps and the part's bytes floor (notebook 08; issue: the step toward its floor).

How (k3lab.profiling.attribution): one eager step runs with a named range `k3lab.part.<part>` around
each part of the program (`LabelledStep`, a DecodeStep whose program methods open the ranges: embedding,
AttnRes + norm mixes, KDA and MLA attention, the MoE and dense MLPs, the collectives' stand-ins; each
range is a `record_function` range and, where torch sees a GPU, an NVTX range for Nsight Systems, which
a ROCm build of torch turns into ROCTX: that path is not yet run on AMD hardware), so each kernel's
launch is inside its part's range; the same step captured as one CUDA graph is replayed under the
profiler; the replay's kernels are aligned to the eager run's by name and take their parts.
Per part: kernels, kernel time, the gaps before its kernels (launch bubbles and dependency waits), and
the floor: the part's bytes (`measure.part_bytes`) over the copy bandwidth measured in the same run.
The check: the parts' total equals the replay's span, and the span is compared with the step time
timed apart (`bench.time_fn` of the graph), `agree` within 5%.

Precision. The step is built as the study builds the variant (`build_step`: `measure.variants()` for
its switches, `measure.step_settings` for its projections or precision), and each part's bytes are
`part_bytes` at the precision the built step runs (`step.resolved.precision`): 'bf16', 'fp8' (FP8 dense
projections) or 'article' (FP8 dense projections, MXFP4 routed experts, an FP8 MLA cache). A table
names its precision, and each part's row holds its bytes by kind (BYTES_COLUMNS: dense weights, routed
experts, MLA cache, KDA state), so the parts whose bytes a precision changes show them. `VARIANT_OF` is
the all-on variant attributed at each precision (what `records` runs by default). On a CPU nothing is
timed (the replay is a CUDA graph): `floors` builds the same step there and gives its per-part bytes
and floors at the CPU's nominal bandwidth, and `records` logs those instead.

Records: study 'decode_step', case 'attribution.<case>.<variant>' (excluded from the waterfall's
`load`); `extra.parts` holds the table, `extra.precision` its precision, `extra.part_bytes` each part's
bytes by kind, `extra.top` the slowest kernels with their parts, `extra.kernels` the per-(part, kernel
name) split.
"""

from __future__ import annotations

import json
import tempfile

import pandas as pd
import torch

from k3lab import bench
from k3lab.engine import DecodeStep
from k3lab.engine.switches import settings
from k3lab.profiling import attribution as at
from k3lab.profiling.diff import short_name
from k3lab.profiling.export import label

from . import measure

PREFIX = "k3lab.part."
CASE_PREFIX = "attribution."
PARTS = ("embed", "mix", "kda", "mla", "moe", "dense", "collective", at.UNLABELLED)
# The kernels no part range encloses: the lm_head projection and the logits' cast after the last mix.
UNLABELLED_IS = "lm_head"
FLOOR_OF = {"kda": "kda", "mla": "mla", "moe": "moe", "dense": "dense", UNLABELLED_IS: "ends"}
AGREE = 0.05
KERNEL_ROWS = 60  # the (part, kernel) rows a record keeps, longest first: every one above ~20 us a step
PRECISIONS = measure.PRECISIONS
# the all-on variant attributed at each precision: at bf16 the step's own projections (the one-row GEMV
# at B = 1 on a GPU), at fp8 the FP8 projections, at 'article' the article's formats
VARIANT_OF = {"bf16": "all_on_default", "fp8": "all_on_fp8", "article": "all_on_article"}
# a part row's bytes columns (MB) -> the part_bytes keys they sum: the first three change with precision
BYTES_COLUMNS = {"dense_MB": ("weights_dense",), "experts_MB": ("weights_experts",),
                 "cache_MB": ("mla_cache",), "state_MB": ("kda_state", "kda_conv")}


def _range(name: str):
    """The part's range: record_function (torch.profiler, Kineto, HTA, Perfetto) and, where torch sees a
    GPU, an NVTX range of the same name for Nsight Systems (`k3lab.profiling.export.label`)."""
    return label(PREFIX + name)


class LabelledStep(DecodeStep):
    """A DecodeStep whose program opens one profiler range per part (see the module docstring); the
    arithmetic is DecodeStep's own, so its logits and state are the same."""

    def _embed(self):
        with _range("embed"):
            return (yield from super()._embed())

    def _mix(self, *args, **kwargs):
        with _range("mix"):
            return super()._mix(*args, **kwargs)

    def _attention(self, i, w, x):
        with _range("mla" if i in self.latent else "kda"):
            return (yield from super()._attention(i, w, x))

    def _mlp(self, w, x):
        with _range("moe" if hasattr(w, "gate") else "dense"):
            return (yield from super()._mlp(w, x))

    def _answer(self, kind, t):
        with _range("collective"):
            return super()._answer(kind, t)


def _part_name(part: str) -> str:
    return UNLABELLED_IS if part == at.UNLABELLED else part


def precision_of(variant: str) -> str:
    """The number formats variant `variant` runs (`measure.step_settings` resolved as DecodeStep resolves
    them): 'bf16', 'fp8' or 'article'. ValueError naming variant for an unknown name."""
    if not isinstance(variant, str) or variant not in measure.variants():
        raise ValueError(f"variant must be one of {list(measure.variants())}, got {variant!r}")
    return settings({}, **measure.step_settings(variant))[1]


def choose(variant: str | None = None, precision: str | None = None) -> tuple[str, str]:
    """(variant, precision) of one attribution: a variant alone runs at its own precision
    (`precision_of`); a precision alone picks VARIANT_OF[precision]; neither is 'all_on' (bf16, the
    matrix library's projections); both must agree. ValueError naming the argument otherwise."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if variant is None:
        variant = VARIANT_OF[precision] if precision is not None else "all_on"
    own = precision_of(variant)
    if precision is not None and precision != own:
        raise ValueError(f"precision={precision!r} contradicts variant={variant!r}, which runs {own!r}; "
                         f"the variant attributed at {precision!r} is {VARIANT_OF[precision]!r}")
    return variant, own


def build_step(variant: str, weights, batch: int, context_len: int) -> LabelledStep:
    """The labelled step of `variant` as the study builds it: its switches (`measure.variants()`) and
    its DecodeStep settings (`measure.step_settings`)."""
    return LabelledStep(weights.config, batch, context_len, optimizations=measure.variants()[variant],
                        weights=weights, **measure.step_settings(variant))


def part_floors(config, batch: int, context_len: int, *, precision: str = "bf16", act_bytes: int = 2,
                cache_bytes: int = 2, tail: str = "sharded") -> dict[str, dict[str, float]]:
    """Each attributed part's bytes at `precision` (FLOOR_OF's parts: kda, mla, moe, dense, lm_head),
    as `measure.part_bytes` counts them for one decode step (its keys: weights_dense, weights_experts,
    mla_cache, kda_state, kda_conv). Summed over the parts they are `step_bytes(...)['total']`.
    ValueError naming precision for a name outside PRECISIONS."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    kinds = measure.part_bytes(config, batch, context_len, tail=tail, act_bytes=act_bytes,
                               cache_bytes=cache_bytes, precision=precision)
    return {part: dict(kinds[kind]) for part, kind in FLOOR_OF.items()}


def step_floors(step: DecodeStep) -> tuple[str, dict[str, dict[str, float]]]:
    """(precision, `part_floors`) of a built step as it runs: its resolved precision (a step whose FP8
    cannot run here runs its dtype, and is counted so), its weights' element size, its MoE tail."""
    prec = step.resolved.precision
    size = step.weights.embed.element_size()
    return prec, part_floors(step.config, step.batch, step.context_len, precision=prec, act_bytes=size,
                             cache_bytes=size, tail=step.impl["moe_tail_sharded"])


def bytes_columns(kinds: dict[str, float] | None) -> dict[str, float | None]:
    """One part's BYTES_COLUMNS (MB) from its part_bytes keys; None each for a part without bytes."""
    return {col: None if kinds is None else sum(kinds[k] for k in keys) / 1e6
            for col, keys in BYTES_COLUMNS.items()}


def with_bytes(table: pd.DataFrame, precision: str, part_bytes: dict) -> pd.DataFrame:
    """An attribution table (one row per part) with the precision and each part's BYTES_COLUMNS."""
    cols = [bytes_columns(part_bytes.get(p)) for p in table["part"]]
    return table.assign(precision=precision, **{c: [row[c] for row in cols] for c in BYTES_COLUMNS})


def _positive(**values) -> None:
    """ValueError naming the first of `values` that is not a positive integer."""
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")


def _total(kinds: dict) -> float:
    return sum(sum(k.values()) for k in kinds.values())


def floors(batch: int, context_len: int, *, variant: str | None = None, precision: str | None = None,
           weights=None, bandwidth=None) -> dict:
    """What an attribution knows without timing, and what runs on a CPU in its place: the step of
    (variant, precision) (`choose`) built from `weights` (default: the study's CPU weights on a CPU, a
    GPU needs them given), and its per-part bytes at the precision it runs. Returns 'variant',
    'precision' (asked), 'ran' (the step's resolved precision, which the bytes count), 'dtype' (the
    weights', what 'bf16' counts: fp32 for the CPU weights), 'notes' (the step's), 'part_bytes',
    'table' (a DataFrame: part, precision, BYTES_COLUMNS, floor_us), 'floor_us' (the parts' sum),
    'bandwidth_tbs', 'bandwidth_how' (`measure.measured_bandwidth_tbs`: on a CPU its nominal peak, so
    the floors are arithmetic, not a device's time)."""
    _positive(batch=batch, context_len=context_len)
    variant, prec = choose(variant, precision)
    if weights is None:
        if measure.on_gpu():
            raise ValueError("weights: a GPU step at TP8 shapes needs its RankWeights given (they are GBs); "
                             "on a CPU the study's CPU weights are drawn here")
        from k3lab.engine.weights import RankWeights

        weights = RankWeights.random(measure.CPU_CONFIG, distinct_layers=1, device="cpu", dtype=torch.float32)
    bw, how = bandwidth if bandwidth is not None else measure.measured_bandwidth_tbs()
    step = build_step(variant, weights, batch, context_len)
    ran, kinds = step_floors(step)
    notes, dtype = dict(step.resolved.notes), str(step.dtype).replace("torch.", "")
    del step
    rows = [{"part": p, "precision": ran, **bytes_columns(k), "floor_us": sum(k.values()) / (bw * 1e6)}
            for p, k in kinds.items()]
    return {"variant": variant, "precision": prec, "ran": ran, "dtype": dtype, "notes": notes,
            "part_bytes": kinds, "table": pd.DataFrame(rows), "floor_us": _total(kinds) / (bw * 1e6),
            "bandwidth_tbs": bw, "bandwidth_how": how}


def _trace(fn, name: str, trace_dir: str):
    from k3lab import profile

    cap = profile.capture(fn, steps=1, warmup=1, name=name, trace_dir=trace_dir)
    return cap.kernels, json.loads(cap.trace_path.read_text())


def attribute(batch: int, context_len: int, *, variant: str | None = None, precision: str | None = None,
              weights=None, distinct_layers: int = 3, repeats: int = 10, bandwidth=None) -> dict:
    """The attribution of one step (see the module docstring) of (variant, precision) (`choose`: a
    variant at its own precision, or a precision's VARIANT_OF; neither: 'all_on'): a dict with 'table'
    (a DataFrame, one row per part: kernels, kernel_us, gap_us, total_us, share, floor_us,
    kernel_vs_floor, precision, BYTES_COLUMNS), 'precision' (what the step ran and its bytes count),
    'variant', 'part_bytes', 'notes' (the step's resolved notes), 'span_us' (the replay from its first
    kernel's start to its last kernel's end), 'step_us' (the graph step timed apart), 'agree'
    (|span / step - 1| <= 5%), 'matched' (share of the replay's kernels aligned to the eager run),
    'launches' (kernels in one replay), 'top' (the 12 longest kernels with part and gap), 'kernels'
    (`at.by_kernel`: per part and kernel name, launches, time and gaps, the KERNEL_ROWS longest),
    'bandwidth_tbs'. Needs a CUDA GPU (a graph); ValueError naming the argument otherwise (on a CPU,
    `floors` gives the same step's per-part bytes and floors, untimed)."""
    _positive(batch=batch, context_len=context_len, repeats=repeats)
    variant, _ = choose(variant, precision)
    if not measure.on_gpu():
        raise ValueError("attribute needs a CUDA GPU: the step is replayed as one CUDA graph; on a CPU the "
                         "committed attribution records are read instead (decode_step.attributions()), and "
                         "attribution.floors() gives the step's per-part bytes and floors untimed")
    from k3lab.engine.weights import RankWeights

    if weights is None:
        weights = RankWeights.random(measure.bench_config(), distinct_layers=distinct_layers, device="cuda",
                                     dtype=torch.bfloat16)
    bw, how = bandwidth if bandwidth is not None else measure.measured_bandwidth_tbs()
    step = build_step(variant, weights, batch, context_len)
    prec, kinds = step_floors(step)
    notes = dict(step.resolved.notes)
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        step.set_tokens(measure._ids(weights.config, batch))
        saved = step.save_state()
        eager_frame, eager_trace = _trace(step.run, "eager", tmp)
        step.restore_state(saved)
        step.capture()
        timing = bench.time_fn(step.replay, warmup=2, repeats=repeats, calls_per_sample=1)
        replay_frame, _ = _trace(step.replay, "replay", tmp)
    eager = at.labelled(eager_frame, at.part_labels(eager_trace, PREFIX))
    rows, matched = at.align_parts(eager, replay_frame)
    rows["part"] = [_part_name(p) for p in rows["part"]]
    floors_us = {p: sum(k.values()) / (bw * 1e6) for p, k in kinds.items()}
    table = with_bytes(at.attribute(rows, floors_us=floors_us), prec, kinds)
    span = at.span_us(rows)
    rows = rows.assign(gap_us=at.gaps(rows))
    top = rows.nlargest(12, "dur_us")[["name", "part", "dur_us", "gap_us"]]
    top["name"] = top["name"].str.slice(0, 120)
    kernels = at.by_kernel(rows, name=short_name).head(KERNEL_ROWS)
    del step
    measure._free()
    return {"table": table, "precision": prec, "variant": variant, "part_bytes": kinds, "notes": notes,
            "span_us": span, "step_us": timing.median_us, "timing": timing,
            "agree": abs(span / timing.median_us - 1.0) <= AGREE, "matched": matched,
            "launches": int(len(rows)), "top": top, "kernels": kernels, "bandwidth_tbs": bw,
            "bandwidth_how": how, "floor_us": _total(kinds) / (bw * 1e6)}


def make_record(case: str, a: dict, batch: int, context_len: int) -> bench.Record:
    """The record of one attribution `a` (`attribute`'s dict) of shape case `case`: case
    'attribution.<case>.<variant>', the graph step's timing, its floor, and in extra the per-part table
    (NaN written as None), its precision and part bytes, the slowest kernels, the per-kernel split."""
    t, v = a["table"], a["variant"]
    return bench.make_record(
        measure.NAME, f"{CASE_PREFIX}{case}.{v}", "after" if v != "all_off" else "before", a["timing"],
        shape={"batch": batch, "context_len": context_len, "q_len": 1}, dtype=torch.bfloat16,
        floor_us=a["floor_us"], parts=t.astype(object).where(t.notna(), None).to_dict("records"),
        precision=a["precision"], part_bytes=a["part_bytes"], notes=a["notes"],
        top=a["top"].to_dict("records"), kernels=a["kernels"].to_dict("records"),
        span_us=a["span_us"], matched=a["matched"], launches=a["launches"], agree=a["agree"],
        bandwidth_tbs=a["bandwidth_tbs"], bandwidth_how=a["bandwidth_how"])


def _cpu_floors(variants, log) -> None:
    """What runs on a CPU in place of the timed attributions: each variant's per-part bytes and floors
    at the CPU case's shape (`floors`), logged."""
    B, ctx = next(iter(measure.CPU_CASES.values()))
    for v in variants:
        f = floors(B, ctx, variant=v)
        log(f"{v} at {f['ran']} ({f['dtype']} weights; CPU case, B = {B}, context {ctx}; floors at "
            f"{f['bandwidth_how']}):")
        log(f["table"].to_string(index=False, float_format=lambda x: f"{x:.3f}"))


def records(cases=None, variants=None, log=print) -> list[bench.Record]:
    """One record per (case, variant) of `cases` (default: measure.GPU_CASES' batch-1 cases) and
    `variants` (default: VARIANT_OF's, one per precision) with the attribution in `extra` (parts,
    precision, part_bytes, top, span_us, matched, launches) and the step's graph timing. Without a GPU
    nothing is timed: the log says so and gives each variant's per-part floors at the CPU case instead
    (`floors`); returns []."""
    from k3lab.engine.weights import RankWeights

    variants = list(VARIANT_OF.values()) if variants is None else list(variants)
    for v in variants:
        precision_of(v)  # an unknown variant refused before anything runs
    if not measure.on_gpu():
        log("decode_step attribution: no GPU here, so nothing is timed (the step is replayed as one CUDA "
            "graph; the committed records are read instead, and tests/test_attribution.py checks the "
            "method on a CPU). What runs instead: each variant's per-part bytes floors at the CPU case")
        _cpu_floors(variants, log)
        return []
    names = [c for c, (b, _) in measure.GPU_CASES.items() if b == 1] if cases is None else list(cases)
    unknown = [c for c in names if c not in measure.GPU_CASES]
    if unknown:
        raise ValueError(f"cases must be among {list(measure.GPU_CASES)}, got {unknown}")
    weights = RankWeights.random(measure.bench_config(), distinct_layers=3, device="cuda",
                                 dtype=torch.bfloat16)
    bw = measure.measured_bandwidth_tbs()
    out = []
    for case in names:
        B, ctx = measure.GPU_CASES[case]
        for v in variants:
            a = attribute(B, ctx, variant=v, weights=weights, bandwidth=bw)
            log(f"{case} {v} ({a['precision']}): step {a['step_us'] / 1e3:.2f} ms, span "
                f"{a['span_us'] / 1e3:.2f} ms, {a['launches']} kernels, {a['matched']:.0%} aligned, floor "
                f"{a['floor_us'] / 1e3:.2f} ms ({a['floor_us'] / a['step_us']:.0%} of it)")
            log(a["table"].to_string(index=False, float_format=lambda x: f"{x:.1f}"))
            out.append(make_record(case, a, B, ctx))
    return out
