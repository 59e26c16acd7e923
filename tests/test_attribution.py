"""k3lab.profiling.attribution on synthetic Kineto traces: labels from host ranges, alignment of a
replay to the eager run, gaps and the per-part sums."""

import pandas as pd
import pytest

from cpu_child import on_a_cpu

from k3lab.profiling import attribution as at
from k3lab.profiling.torch_trace import kernels_from_trace

P = "k3lab.part."


def _trace(kernels, ranges):
    """kernels: (name, launch_ts, start_us, dur_us, corr); ranges: (name, ts, dur) on the same thread."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": n, "ts": t, "dur": d, "pid": 1, "tid": 1}
          for n, t, d in ranges]
    for name, lts, ts, dur, corr in kernels:
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": lts, "dur": 1,
                   "pid": 1, "tid": 1, "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
                   "args": {"device": 0, "stream": 7, "correlation": corr}})
    return {"traceEvents": ev}


EAGER = _trace([("norm", 1, 100, 2, 11), ("gemm_a", 5, 103, 10, 12), ("attn", 9, 120, 5, 13),
                ("gemm_b", 21, 130, 8, 14), ("other", 40, 140, 1, 15)],
               [(P + "layer0", 0, 30), (P + "mla", 4, 10), (P + "moe", 20, 5)])


def test_labels_are_the_innermost_enclosing_range_and_outside_launches_are_left_out():
    labels = at.part_labels(EAGER, P)
    assert labels == {11: "layer0", 12: "mla", 13: "mla", 14: "moe"}


def test_a_replay_takes_the_eager_parts_by_name_order_and_misses_are_unlabelled():
    eager = at.labelled(kernels_from_trace(EAGER), at.part_labels(EAGER, P))
    assert list(eager["part"]) == ["layer0", "mla", "mla", "moe", at.UNLABELLED]
    rep = kernels_from_trace(_trace([("norm", 0, 0, 2, 1), ("gemm_a", 0, 3, 10, 2), ("extra", 0, 14, 1, 3),
                                     ("attn", 0, 16, 5, 4), ("gemm_b", 0, 21, 8, 5)], []))
    rows, matched = at.align_parts(eager, rep)
    assert list(rows["part"]) == ["layer0", "mla", at.UNLABELLED, "mla", "moe"]
    assert matched == pytest.approx(4 / 5)


def test_gaps_and_part_sums_add_up_to_the_span():
    rep = kernels_from_trace(_trace([("a", 0, 0, 2, 1), ("b", 0, 5, 10, 2), ("c", 0, 12, 1, 3),
                                     ("d", 0, 20, 4, 4)], []))
    rep = rep.assign(part=["x", "y", "y", "x"])
    assert list(at.gaps(rep)) == [0.0, 3.0, 0.0, 5.0]  # c overlaps b: no gap, and b's end counts for d
    t = at.attribute(rep, floors_us={"x": 3.0})
    assert list(t["part"]) == ["x", "y"]
    assert t["total_us"].sum() == pytest.approx(at.span_us(rep) + 1.0)  # c's 1 us overlaps b
    x = t.set_index("part").loc["x"]
    assert (x["kernels"], x["kernel_us"], x["gap_us"], x["floor_us"]) == (2, 6.0, 5.0, 3.0)
    assert x["kernel_vs_floor"] == pytest.approx(2.0)
    assert pd.isna(t.set_index("part").loc["y", "floor_us"])
    g = at.attribute(rep, group=lambda p: "all")
    assert len(g) == 1 and g["kernels"].iat[0] == 4


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="trace"):
        at.part_labels({"events": []}, P)
    with pytest.raises(ValueError, match="prefix"):
        at.part_labels(EAGER, "")
    with pytest.raises(ValueError, match="part"):
        at.attribute(kernels_from_trace(EAGER))


@on_a_cpu  # the tiny step's Triton kernels on CPU tensors: the interpreter (a child without the GPU there)
def test_the_labelled_step_computes_what_the_step_computes_and_opens_its_part_ranges():
    import torch

    from k3lab.engine import DecodeStep
    from k3lab.engine.weights import RankWeights
    from k3lab.studies.decode_step import attribution, measure

    w = RankWeights.random(measure.CPU_CONFIG, distinct_layers=1, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, w.config.vocab_size, (2, 1), generator=torch.Generator().manual_seed(3))
    out = []
    for cls in (DecodeStep, attribution.LabelledStep):
        s = cls(w.config, 2, 8, optimizations="none", weights=w)
        s.set_tokens(ids)
        saved = s.save_state()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            logits = s.run().clone()
        names = {e.name for e in prof.events()}
        out.append((logits, {k: v.clone() for k, v in s.save_state().items()}, names))
        s.restore_state(saved)
    (a, sa, plain), (b, sb, labelled) = out
    assert torch.equal(a, b) and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    parts = {n[len(attribution.PREFIX):] for n in labelled if n.startswith(attribution.PREFIX)}
    assert {"embed", "mix", "kda", "mla", "moe", "collective"} <= parts, parts
    assert not any(n.startswith(attribution.PREFIX) for n in plain)


def test_attribution_refuses_bad_arguments_by_name_and_says_what_runs_without_a_gpu():
    from k3lab.studies.decode_step import attribution

    with pytest.raises(ValueError, match="batch"):
        attribution.attribute(0, 8)
    with pytest.raises(ValueError, match="variant"):
        attribution.attribute(1, 8, variant="fastest")
    import torch

    if not torch.cuda.is_available():
        said = []
        assert attribution.records(log=said.append) == [] and "no" in said[0].lower()
        with pytest.raises(ValueError, match="GPU"):
            attribution.attribute(1, 8)


def test_the_committed_attribution_reads_back_and_accounts_for_the_step():
    from k3lab.studies import decode_step as ds

    rows, summary = ds.attribution_rows("b1_1k", "all_on")
    if not rows:
        pytest.skip("no committed attribution record for b1_1k.all_on")
    assert abs(summary["span_ms"] / summary["step_ms"] - 1) <= 0.05
    assert sum(r["kernels"] for r in rows) == summary["kernels"]
    assert sum(r["total_ms"] for r in rows) == pytest.approx(summary["span_ms"], rel=0.05)
    parts = {r["part"]: r for r in rows}
    assert {"moe", "kda", "mla"} <= set(parts)
    assert all(parts[p]["floor_ms"] > 0 for p in ("moe", "kda", "mla"))
    assert parts["mix"]["floor_ms"] is None  # a part without a floor reads as None, not NaN
    assert ds.attribution_rows("b1_1k", "no_such_variant") == ([], {})
    ds.attribution_figure(rows, "t")
