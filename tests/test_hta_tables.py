"""k3lab.profiling.hta: HTA's kernel breakdown and trace diff of a before/after pair of k3lab traces, and
k3lab's own tables, labelled so, where HTA does not import. The pair is the copy-removal study's packing
case at the tiny preset on this CPU (one pack copy per KDA layer before, none after) and the committed
H200 MLA traces (GPU kernels)."""

from __future__ import annotations

import collections
import sys

import pandas as pd
import pytest
import torch

from k3lab import profile as P
from k3lab.bench.records import PROFILES
from k3lab.config import K3Config
from k3lab.ops import packed_matmul
from k3lab.profiling import export, hta
from k3lab.profiling.diff import device_work
from k3lab.studies import copy_removal

STEPS = 2
H200 = PROFILES / "nvidia-h200" / "mla_padding" / "traces"


@pytest.fixture(scope="module")
def packing_pair(tmp_path_factory):
    """HTA folders of one tiny K3 decode step per policy, `STEPS` steps each, and the KDA layer count."""
    config = K3Config.tiny()
    model, cache, nxt = copy_removal.packing_model(config, seed=0)
    if next(model.parameters()).device.type != "cpu":
        pytest.skip("the tiny model runs on the GPU here, so a CPU-ops capture of it holds launches without "
                    "kernels; HTA's GPU path is tested on the committed H200 pair and runs in notebook 03")
    caps = {}
    root = tmp_path_factory.mktemp("packing")
    for policy in ("before", "after"):
        packed_matmul.install(model, policy)
        with torch.no_grad():
            caps[policy] = P.capture(lambda: model.decode(nxt, cache), steps=STEPS, warmup=1, device="cpu",
                                     trace_dir=root, name=f"packing-{policy}")
    return hta.write_folders(caps), config.num_kda_layers


@pytest.fixture
def no_hta(monkeypatch):
    """HTA made unimportable for the test, whether or not it is installed."""
    for name in [m for m in sys.modules if m == "hta" or m.startswith("hta.")] + ["hta"]:
        monkeypatch.setitem(sys.modules, name, None)


def _h200_folders(tmp_path):
    paths = {v: next(H200.glob(f"mla_padding-{v}-*.trace.json.gz")) for v in ("before", "after")}
    return hta.write_folders(paths, root=tmp_path), paths


def test_hta_tables_of_the_cpu_packing_pair(packing_pair):
    pytest.importorskip("hta.trace_diff")
    folders, layers = packing_pair
    r = hta.compare(folders["before"], folders["after"])
    assert (r.source, r.device) == ("HTA", "cpu") and "HolisticTraceAnalysis" in r.note
    diff = r.diff.set_index("name")
    pack = diff.loc["k3lab::pack_activation"]
    assert (pack["change"], pack["before_calls"], pack["after_calls"]) == ("-", layers * STEPS, 0)
    copies = diff.loc["aten::copy_"]
    assert copies["before_calls"] - copies["after_calls"] == layers * STEPS
    assert list(diff.index[:2]) != [] and (r.diff["before_calls"] != r.diff["after_calls"]).iloc[0]
    assert set(r.breakdown["variant"]) == {"before", "after"}
    assert (r.breakdown["total_us"] >= 0).all()  # HTA's whole-us rounding is off: no negative op times
    assert r.breakdown["share"].between(0, 1).all() and r.breakdown["share"].max() > 0.1
    assert not r.breakdown["name"].str.startswith(("ProfilerStep#", "k3lab.step.")).any()


def test_hta_trace_diff_of_cpu_ops(packing_pair):
    pytest.importorskip("hta.trace_diff")
    folders, layers = packing_pair
    d = export.hta_trace_diff(folders["before"], folders["after"], device="cpu")
    assert not d.index.str.startswith(("ProfilerStep#", "k3lab.step.")).any()
    assert d.loc["k3lab::pack_activation", "before_calls"] == layers * STEPS
    with pytest.raises(ValueError, match="device"):
        export.hta_trace_diff(folders["before"], folders["after"], device="npu")


def test_k3lab_tables_when_hta_is_missing(packing_pair, no_hta):
    folders, layers = packing_pair
    ok, why = export.hta_status()
    assert not ok
    r = hta.compare(folders["before"], folders["after"])
    assert r.source == "k3lab" and r.device == "cpu"
    assert "HTA not used" in r.note and "HolisticTraceAnalysis is not importable" in r.note
    clone = r.diff.set_index("name").loc["aten::clone"]  # the pack's copy, a top-level op in k3lab's frame
    assert clone["change"] == "changed" and clone["before_calls"] - clone["after_calls"] == layers * STEPS
    ours = P.kernel_table(device_work(P.read_trace(next(folders["before"].glob("rank-*")))))
    mine = r.breakdown[r.breakdown["variant"] == "before"]
    assert mine["name"].tolist() == ours["name"].head(len(mine)).tolist()
    assert mine["share"].tolist() == pytest.approx(ours["share"].head(len(mine)).tolist())


def test_hta_tables_of_the_h200_gpu_pair(tmp_path):
    pytest.importorskip("hta.trace_diff")
    folders, paths = _h200_folders(tmp_path)
    r = hta.compare(folders["before"], folders["after"], top=50)
    assert (r.source, r.device) == ("HTA", "gpu")
    for v in ("before", "after"):
        b = r.breakdown[r.breakdown["variant"] == v]
        assert b["share"].sum() == pytest.approx(1.0)  # HTA folds the smallest kernels into 'others'
        assert set(b["kind"]) <= {"COMPUTATION", "MEMORY", "COMMUNICATION", "OTHER"}
    ours = P.trace_diff(P.read_trace(paths["before"]), P.read_trace(paths["after"]), steps=3)
    assert set(r.diff.loc[r.diff["change"] == "-", "name"]) == set(ours.names("gone")) != set()
    assert set(r.diff.loc[r.diff["change"] == "+", "name"]) == set(ours.names("new")) != set()


def test_hta_reads_a_gpu_pair_without_host_ops_to_the_same_tables(tmp_path):
    pytest.importorskip("hta.trace_diff")
    # the MLA study's PyTorch and FlashMLA forms: eager launches, so the traces hold the host's ops
    paths = {w: next(H200.glob(f"mla_padding-{v}-*.trace.json.gz"))
             for w, v in (("before", "torch"), ("after", "flashmla"))}
    folders = hta.write_folders(paths, root=tmp_path)
    lean = hta.without_host_ops(folders["before"], tmp_path / "lean")
    kinds = {}
    for name, folder in (("whole", folders["before"]), ("lean", lean)):
        events = export._trace(next(folder.glob("rank-*.json*")))["traceEvents"]
        kinds[name] = collections.Counter(e.get("cat") for e in events if isinstance(e, dict))
        kinds[name]["steps"] = sum(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)
    assert kinds["whole"]["cpu_op"] > 0 and kinds["lean"]["cpu_op"] == 0
    for kept in ("kernel", "cuda_runtime", "ac2g", "steps"):
        assert kinds["lean"][kept] == kinds["whole"][kept] > 0, kept
    fast = hta.compare(folders["before"], folders["after"], top=50)
    whole = hta.compare(folders["before"], folders["after"], top=50, host_ops=True)
    assert not fast.diff.empty and not fast.breakdown.empty and fast.device == "gpu"
    pd.testing.assert_frame_equal(fast.breakdown, whole.breakdown)
    pd.testing.assert_frame_equal(fast.diff, whole.diff)
    assert "without the host's operator events" in fast.note and "without" not in whole.note
    with pytest.raises(ValueError, match="host_ops"):
        hta.compare(folders["before"], folders["after"], host_ops="yes")


def test_k3lab_tables_of_the_h200_gpu_pair_without_hta(tmp_path, no_hta):
    folders, paths = _h200_folders(tmp_path)
    r = hta.compare(folders["before"], folders["after"], top=50)
    assert (r.source, r.device) == ("k3lab", "gpu") and "not importable" in r.note
    ours = P.trace_diff(P.read_trace(paths["before"]), P.read_trace(paths["after"]), steps=3)
    assert set(r.diff.loc[r.diff["change"] == "gone", "name"]) == set(ours.names("gone")) != set()
    gone = r.diff[r.diff["change"] == "gone"].iloc[0]
    calls = P.kernel_table(P.read_trace(paths["before"])).set_index("name")["calls"]
    assert gone["before_calls"] == calls[gone["name"]]  # totals over the 3 steps, as HTA's are


@pytest.mark.parametrize("with_hta", [True, False], ids=["hta", "k3lab"])
def test_a_trace_compared_with_itself_has_an_empty_diff(tmp_path, monkeypatch, with_hta):
    if with_hta:
        pytest.importorskip("hta.trace_diff")
    else:
        for name in [m for m in sys.modules if m == "hta" or m.startswith("hta.")] + ["hta"]:
            monkeypatch.setitem(sys.modules, name, None)
    folders, _ = _h200_folders(tmp_path)
    r = hta.compare(folders["before"], folders["before"])
    assert r.source == ("HTA" if with_hta else "k3lab")
    assert r.diff.empty and list(r.diff.columns) == list(hta.DIFF_COLUMNS)
    assert not r.breakdown.empty


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="rank-"):
        hta.compare(tmp_path, tmp_path)
    with pytest.raises(ValueError, match="traces"):
        hta.write_folders({})
    with pytest.raises(ValueError, match=r"traces\['before'\]"):
        hta.write_folders({"before": tmp_path / "none.json"})
    folders, _ = _h200_folders(tmp_path)
    with pytest.raises(ValueError, match="min_share"):
        hta.compare(folders["before"], folders["after"], min_share=1.5)
    with pytest.raises(ValueError, match="top"):
        hta.compare(folders["before"], folders["after"], top=0)
