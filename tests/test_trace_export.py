"""Traces other tools open (k3lab.profiling.export): HTA's per-rank folders with ProfilerStep marks, named
ranges, and HTA's own kernel breakdown on them where HolisticTraceAnalysis is installed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from k3lab import profile as P
from k3lab.bench.records import PROFILES
from k3lab.profiling import export

H200_TRACES = sorted((PROFILES / "nvidia-h200" / "mla_padding" / "traces").glob("*.trace.json.gz"))
HTA_OK, HTA_WHY = export.hta_status()
needs_hta = pytest.mark.skipif(not HTA_OK, reason=f"HTA not installed here: {HTA_WHY}")


@pytest.fixture
def cpu_capture(tmp_path):
    x = torch.randn(32, 32)

    def step():
        with export.label("k3lab.part.matmul"):
            y = x @ x
        with export.label("k3lab.part.norm"):
            return torch.nn.functional.rms_norm(y, (32,))

    return P.capture(step, steps=3, device="cpu", trace_dir=tmp_path, name="export")


def test_step_marks_added_over_each_k3lab_step(cpu_capture):
    doc = export.with_step_marks(cpu_capture.trace_path, rank=2, world_size=4)
    steps = {e["name"]: e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("k3lab.step.")}
    marks = {e["name"]: e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert sorted(marks) == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    for i in range(3):
        s, m = steps[f"k3lab.step.{i}"], marks[f"ProfilerStep#{i}"]
        assert (m["ts"], m["dur"], m["cat"], m["tid"]) == (s["ts"], s["dur"], s["cat"], s["tid"])
    assert doc["distributedInfo"]["rank"] == 2 and doc["distributedInfo"]["world_size"] == 4
    original = json.loads(Path(cpu_capture.trace_path).read_text())
    assert not any(str(e.get("name", "")).startswith("ProfilerStep#") for e in original["traceEvents"])
    again = export.with_step_marks(doc)  # marks present: none added twice
    assert sum(str(e.get("name", "")).startswith("ProfilerStep#") for e in again["traceEvents"]) == 3


def test_part_labels_are_named_ranges_inside_the_steps(cpu_capture):
    doc = json.loads(Path(cpu_capture.trace_path).read_text())
    parts = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("k3lab.part.")]
    assert sorted({e["name"] for e in parts}) == ["k3lab.part.matmul", "k3lab.part.norm"]
    assert len(parts) == 6 and all(e["cat"] == "user_annotation" and e["ph"] == "X" for e in parts)


def test_write_hta_folder(cpu_capture, tmp_path):
    path = export.write_hta_folder(cpu_capture.trace_path, tmp_path / "hta", rank=0)
    assert path == tmp_path / "hta" / "rank-0.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    assert P.read_trace(path)["name"].tolist() == P.read_trace(cpu_capture.trace_path)["name"].tolist()
    assert doc["distributedInfo"]["rank"] == 0
    with pytest.raises(FileExistsError, match="overwrite"):
        export.write_hta_folder(cpu_capture.trace_path, tmp_path / "hta")
    export.write_hta_folder(cpu_capture.trace_path, tmp_path / "hta", overwrite=True)


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="step marks"):
        export.with_step_marks({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1}]})
    with pytest.raises(ValueError, match="traceEvents"):
        export.with_step_marks({"events": []})
    with pytest.raises(ValueError, match="not a file"):
        export.with_step_marks(tmp_path / "none.json")
    with pytest.raises(ValueError, match="rank"):
        export.with_step_marks({"traceEvents": []}, rank=1, world_size=1)
    with pytest.raises(ValueError, match="name"):
        with export.label(""):
            pass


def test_trace_steps_reads_the_step_marks_and_refuses_an_empty_folder(tmp_path):
    marks = [{"ph": "X", "name": f"ProfilerStep#{n}", "ts": 10 * n, "dur": 5, "pid": 1, "tid": 1}
             for n in (3, 1, 2)]
    other = [{"ph": "X", "name": "ProfilerStep#x", "ts": 0, "dur": 1, "pid": 1, "tid": 1},
             {"ph": "i", "name": "ProfilerStep#9", "ts": 0, "pid": 1, "tid": 1}]
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "rank-0.json").write_text(json.dumps({"traceEvents": marks + other}))
    assert export.trace_steps(tmp_path / "f") == [1, 2, 3]
    with pytest.raises(ValueError, match="folder: .* holds no rank"):
        export.trace_steps(tmp_path)


@needs_hta
def test_hta_reads_the_steps_of_a_cpu_trace(cpu_capture, tmp_path):
    folder = tmp_path / "hta"
    export.write_hta_folder(cpu_capture.trace_path, folder)
    assert export.hta_steps(folder) == [0, 1, 2] == export.trace_steps(folder)  # HTA's parse and k3lab's read
    assert export.hta_kernel_breakdown(folder).empty  # a CPU trace has no GPU kernel


@needs_hta
@pytest.mark.parametrize("path", H200_TRACES, ids=lambda p: p.name.split("-cuda")[0])
def test_hta_kernel_breakdown_agrees_with_k3lab_on_h200_traces(path, tmp_path):
    """HTA's kernel breakdown of a committed H200 trace, through write_hta_folder: every kernel it names
    is one of k3lab's (HTA folds the smallest into 'others'), and its time on the one rank (HTA's columns
    are statistics over ranks) lies between one of k3lab's calls, less a microsecond, and k3lab's total:
    HTA rounds each kernel down to whole microseconds and counts only the kernels in its step windows."""
    export.write_hta_folder(path, tmp_path / "hta")
    hta = export.hta_kernel_breakdown(tmp_path / "hta").set_index("name").drop("others", errors="ignore")
    ours = P.kernel_table(P.read_trace(path)).set_index("name")
    assert len(hta) > 0 and set(hta.index) <= set(ours.index)
    for name, row in hta.iterrows():
        assert ours.loc[name, "min_us"] - 1.0 <= row["sum_us"] <= ours.loc[name, "total_us"] + 1e-6, name


@needs_hta
def test_hta_trace_diff_agrees_with_k3labs_on_the_h200_pair(tmp_path):
    """HTA's trace diff of the committed MLA before/after traces names the same kernels gone and new as
    k3lab's own trace_diff, with the same call counts."""
    paths = {v: next(p for p in H200_TRACES if f"-{v}-" in p.name) for v in ("before", "after")}
    for v, p in paths.items():
        export.write_hta_folder(p, tmp_path / v)
    hta = export.hta_trace_diff(tmp_path / "before", tmp_path / "after")
    ours = P.trace_diff(P.read_trace(paths["before"]), P.read_trace(paths["after"]), steps=3)
    assert set(hta.index[hta["change"] == "-"]) == set(ours.names("gone")) != set()
    assert set(hta.index[hta["change"] == "+"]) == set(ours.names("new")) != set()
    calls = P.kernel_table(P.read_trace(paths["after"])).set_index("name")["calls"]
    for name in ours.names("new"):
        assert hta.loc[name, "after_calls"] == calls[name]


def test_hta_missing_is_named(monkeypatch, tmp_path):
    monkeypatch.setattr(export, "hta_status", lambda: (False, "HolisticTraceAnalysis is not importable"))
    with pytest.raises(RuntimeError, match="not importable"):
        export.hta_kernel_breakdown(tmp_path)
    with pytest.raises(RuntimeError, match="not importable"):
        export.hta_trace_diff(tmp_path, tmp_path)


@needs_hta
@pytest.mark.follows_gpu  # the study builds its step on the GPU where there is one
def test_hta_reads_the_part_labels_of_k3lab_profile_decode_step(tmp_path, monkeypatch):
    """`k3lab profile decode_step`'s HTA folders, read by HTA itself: one profiler step each, and its CPU
    trace diff of before against after names every part range (k3lab.part.*) on both sides."""
    from test_profile_tools import one_weight_set

    from k3lab.profiling import tools

    one_weight_set(monkeypatch)  # on a GPU, K3's TP8 step at about 7 GiB rather than 15
    caps = tools.profile_study("decode_step", steps=1, out_dir=tmp_path)
    assert sorted(caps) == ["after", "before"]
    folders = {v: tmp_path / "hta" / v for v in caps}
    assert all(export.trace_steps(f) == [0] for f in folders.values())
    diff = export.hta_trace_diff(folders["before"], folders["after"], device="cpu")
    parts = diff[diff.index.str.startswith("k3lab.part.")]
    want = {"k3lab.part." + p for p in ("embed", "mix", "kda", "mla", "moe", "dense", "collective")}
    assert set(parts.index) == want
    assert (parts["before_calls"] > 0).all() and (parts["after_calls"] > 0).all()
