"""Where the whole decode step's time goes, kernel by kernel: the graph-replayed step of one TP8 rank
with each kernel named by the layer part that launched it, the idle gap before it, and per part the
kernel time, the gaps and the part's bytes floor (notebook 08; issue: the step toward its floor).

How (k3lab.profiling.attribution): one eager step runs with a `record_function` range around each
part of the program (`LabelledStep`, a DecodeStep whose program methods open the ranges: embedding,
AttnRes + norm mixes, KDA and MLA attention, the MoE and dense MLPs, the collectives' stand-ins), so
each kernel's launch is inside its part's range; the same step captured as one CUDA graph is replayed
under the profiler; the replay's kernels are aligned to the eager run's by name and take their parts.
Per part: kernels, kernel time, the gaps before its kernels (launch bubbles and dependency waits), and
the floor: the part's bytes (`measure.part_bytes`) over the copy bandwidth measured in the same run.
The check: the parts' total equals the replay's span, and the span is compared with the step time
timed apart (`bench.time_fn` of the graph), `agree` within 5%.

Records: study 'decode_step', case 'attribution.<case>.<variant>' (excluded from the waterfall's
`load`); `extra.parts` holds the table, `extra.top` the slowest kernels with their parts,
`extra.kernels` the per-(part, kernel name) split.
"""

from __future__ import annotations

import json
import tempfile

import torch

from k3lab import bench
from k3lab.engine import DecodeStep
from k3lab.profiling import attribution as at
from k3lab.profiling.diff import short_name

from . import measure

PREFIX = "k3lab.part."
CASE_PREFIX = "attribution."
PARTS = ("embed", "mix", "kda", "mla", "moe", "dense", "collective", at.UNLABELLED)
# The kernels no part range encloses: the lm_head projection and the logits' cast after the last mix.
UNLABELLED_IS = "lm_head"
FLOOR_OF = {"kda": "kda", "mla": "mla", "moe": "moe", "dense": "dense", UNLABELLED_IS: "ends"}
AGREE = 0.05
KERNEL_ROWS = 60  # the (part, kernel) rows a record keeps, longest first: every one above ~20 us a step


def _range(name: str):
    return torch.profiler.record_function(PREFIX + name)


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


def _trace(fn, name: str, trace_dir: str):
    from k3lab import profile

    cap = profile.capture(fn, steps=1, warmup=1, name=name, trace_dir=trace_dir)
    return cap.kernels, json.loads(cap.trace_path.read_text())


def attribute(batch: int, context_len: int, *, variant: str = "all_on", weights=None,
              distinct_layers: int = 3, repeats: int = 10, bandwidth=None) -> dict:
    """The attribution of one step (see the module docstring): a dict with 'table' (a DataFrame, one row
    per part: kernels, kernel_us, gap_us, total_us, share, floor_us, kernel_vs_floor), 'span_us' (the
    replay from its first kernel's start to its last kernel's end), 'step_us' (the graph step timed
    apart), 'agree' (|span / step - 1| <= 5%), 'matched' (share of the replay's kernels aligned to the
    eager run), 'launches' (kernels in one replay), 'top' (the 12 longest kernels with part and gap),
    'kernels' (`at.by_kernel`: per part and kernel name, launches, time and gaps, the KERNEL_ROWS longest),
    'bandwidth_tbs'. Needs a CUDA GPU (a graph); ValueError naming the argument otherwise."""
    for name, v in (("batch", batch), ("context_len", context_len), ("repeats", repeats)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    opts = measure.variants().get(variant)
    if opts is None:
        raise ValueError(f"variant must be one of {list(measure.variants())}, got {variant!r}")
    if not measure.on_gpu():
        raise ValueError("attribute needs a CUDA GPU: the step is replayed as one CUDA graph; on a CPU the "
                         "committed attribution records are read instead (decode_step.attributions())")
    from k3lab.engine.weights import RankWeights

    if weights is None:
        weights = RankWeights.random(measure.bench_config(), distinct_layers=distinct_layers, device="cuda",
                                     dtype=torch.bfloat16)
    bw, how = bandwidth if bandwidth is not None else measure.measured_bandwidth_tbs()
    proj = measure.PROJECTIONS_OF.get(variant, "bf16")
    step = LabelledStep(weights.config, batch, context_len, optimizations=opts, weights=weights,
                        projections=proj)
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
    kinds = measure.part_bytes(weights.config, batch, context_len, act_bytes=weights.embed.element_size(),
                               cache_bytes=weights.embed.element_size())
    if proj == "fp8":  # FP8 projections: a byte per weight and the row scales, part by part
        bf16, fp8 = (weights.projection_bytes(f, by_part=True) for f in ("bf16", "fp8"))
        for part, saved in bf16.items():
            kinds[part]["weights_dense"] -= saved - fp8[part]
    floors = {p: sum(kinds[k].values()) / (bw * 1e6) for p, k in FLOOR_OF.items()}
    table = at.attribute(rows, floors_us=floors)
    span = at.span_us(rows)
    rows = rows.assign(gap_us=at.gaps(rows))
    top = rows.nlargest(12, "dur_us")[["name", "part", "dur_us", "gap_us"]]
    top["name"] = top["name"].str.slice(0, 120)
    kernels = at.by_kernel(rows, name=short_name).head(KERNEL_ROWS)
    del step
    measure._free()
    return {"table": table, "span_us": span, "step_us": timing.median_us, "timing": timing,
            "agree": abs(span / timing.median_us - 1.0) <= AGREE, "matched": matched,
            "launches": int(len(rows)), "top": top, "kernels": kernels, "bandwidth_tbs": bw,
            "bandwidth_how": how,
            "floor_us": sum(sum(k.values()) for k in kinds.values()) / (bw * 1e6)}


def records(cases=None, variants=("all_on",), log=print) -> list[bench.Record]:
    """One record per (case, variant) of `cases` (default: measure.GPU_CASES' batch-1 cases) with the
    attribution in `extra` (parts, top, span_us, matched, launches) and the step's graph timing."""
    from k3lab.engine.weights import RankWeights

    if not measure.on_gpu():
        log("decode_step attribution: the step is replayed as one CUDA graph on a GPU; there is none here, "
            "so nothing is measured (the committed records are read instead; tests/test_attribution.py "
            "checks the method on a CPU)")
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
            t = a["table"]
            log(f"{case} {v}: step {a['step_us'] / 1e3:.2f} ms, span {a['span_us'] / 1e3:.2f} ms, "
                f"{a['launches']} kernels, {a['matched']:.0%} aligned, floor {a['floor_us'] / 1e3:.2f} ms")
            log(t.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
            out.append(bench.make_record(
                measure.NAME, f"{CASE_PREFIX}{case}.{v}", "after" if v != "all_off" else "before",
                a["timing"], shape={"batch": B, "context_len": ctx, "q_len": 1}, dtype=torch.bfloat16,
                floor_us=a["floor_us"], parts=t.astype(object).where(t.notna(), None).to_dict("records"),
                top=a["top"].to_dict("records"), kernels=a["kernels"].to_dict("records"),
                span_us=a["span_us"], matched=a["matched"], launches=a["launches"], agree=a["agree"],
                bandwidth_tbs=a["bandwidth_tbs"], bandwidth_how=a["bandwidth_how"]))
    return out
