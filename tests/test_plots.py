"""k3lab.plots: each figure has the traces, values and axes it promises, and exports to HTML."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from k3lab import bench, plots
from k3lab.env import Peak


def _rec(case, variant, median, floor=None, mode="eager", shape=None, **extra):
    t = bench.Timing(median, median * 0.8, median * 1.3, 10, mode, 0.1)
    return bench.make_record("demo", case, variant, t, shape=shape or {"bytes": 1}, dtype=torch.float32,
                             floor_us=floor, **extra)


@pytest.fixture
def records():
    return [_rec("small", "before", 10.0, 1.0), _rec("small", "after", 5.0, 1.0), _rec("small", "fla", 6.0),
            _rec("large", "before", 100.0, 40.0), _rec("large", "after", 50.0, 40.0),
            _rec("large", "fla", 45.0)]


def test_before_after_from_records(records):
    fig = plots.before_after(records, log=True, title="demo")
    assert isinstance(fig, go.Figure)
    names = [t.name for t in fig.data]
    assert names == ["before", "after", "peer: fla", "floor"]
    before = fig.data[0]
    assert list(before.x) == ["small", "large"] and list(before.y) == [10.0, 100.0]
    assert list(before.error_y.array) == pytest.approx([3.0, 30.0])  # p80 - median
    assert list(before.error_y.arrayminus) == pytest.approx([2.0, 20.0])  # median - p20
    assert list(fig.data[3].y) == [1.0, 40.0]
    assert fig.layout.yaxis.type == "log" and fig.layout.barmode == "group"
    assert "<div" in fig.to_html(include_plotlyjs=False, full_html=False)


def test_before_after_from_compare_frame_and_case_order(records):
    df = bench.compare(records)
    fig = plots.before_after(df, cases=["large", "small"], unit="ms")
    assert list(fig.data[0].x) == ["large", "small"]
    assert list(fig.data[1].y) == pytest.approx([0.05, 0.005])
    assert fig.layout.yaxis.type != "log"
    with pytest.raises(ValueError, match="columns"):
        plots.before_after(pd.DataFrame({"a": [1]}))
    with pytest.raises(ValueError, match="Record"):
        plots.before_after([1, 2])


def test_before_after_labels_modes_when_mixed():
    # an eager 'before' and a graph 'after' share one group; the case in another row keeps eager only
    recs = [_rec("k", "before", 4.0), _rec("k", "after", 2.0, mode="graph"), _rec("j", "before", 3.0),
            _rec("j", "after", 1.0)]
    fig = plots.before_after(recs)
    assert list(fig.data[0].x) == ["k [before:eager after:graph]", "j [eager]"]
    assert list(fig.data[1].y) == [2.0, 1.0]
    assert list(fig.data[1].error_y.array) == pytest.approx([0.6, 0.3])  # the graph record's p80 found


def test_size_sweep_time_and_throughput():
    recs = [_rec(f"copy{n}", v, us, floor=n / 1e3, shape={"bytes": n}, bytes_moved=2 * n)
            for n, (b, a) in {1000: (4.0, 1.0), 10**6: (300.0, 290.0)}.items() for v, us
            in (("before", b), ("after", a))]
    fig = plots.size_sweep(recs)
    assert [t.name for t in fig.data] == ["after (eager)", "before (eager)", "floor"]
    assert list(fig.data[1].x) == [1000, 10**6] and list(fig.data[1].y) == [4.0, 300.0]
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    thr = plots.size_sweep(recs, throughput=True)
    assert list(thr.data[0].y) == pytest.approx([2000 / 1.0 / 1e3, 2e6 / 290.0 / 1e3])
    with pytest.raises(ValueError, match="shape"):
        plots.size_sweep(recs, size_key="tokens")


def _kernels(n_gemm, n_copy):
    rows = [{"name": "gemm", "category": "matmul", "start_us": 10.0 * i, "dur_us": 8.0} for i
            in range(n_gemm)]
    rows += [{"name": "copy", "category": "copy", "start_us": 10.0 * (n_gemm + i), "dur_us": 2.0}
             for i in range(n_copy)]
    return pd.DataFrame(rows)


def _table(k):
    return k.groupby(["name", "category"], as_index=False).agg(calls=("dur_us", "size"),
                                                               total_us=("dur_us", "sum"))


def test_kernel_bars_stack_per_variant():
    tables = {"before": _table(_kernels(3, 4)), "after": _table(_kernels(3, 0))}
    fig = plots.kernel_bars(tables, title="k")
    bars = [t for t in fig.data if isinstance(t, go.Bar)]
    assert [t.name for t in bars] == ["gemm", "copy"]
    assert list(bars[0].y) == [24.0, 24.0] and list(bars[1].y) == [8.0, 0.0]
    assert fig.layout.barmode == "stack"
    few = plots.kernel_bars(tables, top=1)
    assert [t.name for t in few.data if isinstance(t, go.Bar)] == ["gemm", "other"]
    by_cat = plots.kernel_bars(tables, by="category")
    assert {t.name for t in by_cat.data if isinstance(t, go.Bar)} == {"matmul", "copy"}
    with pytest.raises(ValueError, match="total_us"):
        plots.kernel_bars({"x": pd.DataFrame({"name": ["a"], "category": ["c"]})})


def test_timeline_rows_and_relative_starts():
    k = _kernels(2, 1)
    shifted = k.assign(start_us=k["start_us"] + 1000.0)
    fig = plots.timeline({"before": k, "after": shifted})
    assert sorted(t.name for t in fig.data) == ["copy", "matmul"]
    mat = next(t for t in fig.data if t.name == "matmul")
    assert list(mat.y) == ["before", "before", "after", "after"]
    assert list(mat.base) == [0.0, 10.0, 0.0, 10.0]  # each variant starts at 0
    assert list(mat.x) == [8.0, 8.0, 8.0, 8.0] and mat.orientation == "h"
    cut = plots.timeline({"before": k}, max_kernels=2)
    assert "left out: before: 1" in cut.layout.title.text


def test_roofline_ceilings_and_points():
    pk = Peak("test", 2.0, "t", 100.0, "t")  # ridge at 50 flop/byte
    pts = [{"name": "gemm", "flops": 2e9, "bytes": 1e7, "time_us": 40.0},
           {"name": "copy", "flops": 0, "bytes": 1e6, "time_us": 1.0}]
    fig = plots.roofline(pts, peak=pk)
    bw, comp, meas = fig.data
    assert bw.y[-1] == pytest.approx(100.0) and bw.x[-1] == pytest.approx(50.0)
    assert bw.y[0] == pytest.approx(bw.x[0] * 2.0)
    assert list(comp.y) == [100.0, 100.0]
    assert list(meas.text) == ["gemm"]
    assert meas.x[0] == pytest.approx(200.0) and meas.y[0] == pytest.approx(50.0)  # 2e9 / 40 us = 50 TFLOP/s
    assert "1 points without flops" in fig.layout.title.text
    with pytest.raises(ValueError, match="time_us"):
        plots.roofline([{"name": "x", "flops": 1}])


def test_records_table(records):
    fig = plots.records_table(records)
    (table,) = fig.data
    assert isinstance(table, go.Table)
    assert list(table.header.values)[:3] == ["study", "case", "variant"]
    assert len(table.cells.values[0]) == len(records)
    with pytest.raises(ValueError, match="empty"):
        plots.records_table([])


def test_bench_does_not_import_plotly():
    import subprocess
    import sys

    code = "import sys, k3lab.bench; assert 'plotly' not in sys.modules, 'bench pulled plotly in'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_short_kernel_name_drops_templates_and_arguments():
    from k3lab.plots import short_kernel_name

    long = ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
            "BinaryFunctor<float, float, float> > >(int, at::native::BinaryFunctor<float, float, float>)")
    assert short_kernel_name(long) == "at::native::elementwise_kernel"
    assert short_kernel_name("_attn_res_norm_kernel") == "_attn_res_norm_kernel"
    assert short_kernel_name("x" * 100, width=10) == "x" * 9 + "…"
