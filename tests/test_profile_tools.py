"""`k3lab profile --tool`: the refusals here, the vendor readers on real files, the child-process paths with
the profiler replaced by the files it writes (k3lab.profiling.tools, .child)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from k3lab import cli
from k3lab import profile as P
from k3lab.profiling import child, tools

FIX = Path(__file__).parent / "fixtures" / "profiles"
NSYS = sorted((FIX / "nsys").glob("cuda_gpu_trace_*.csv"))


def test_cli_offers_every_tool():
    action = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["profile"]._actions
                  if a.dest == "tool")
    assert tuple(action.choices) == tools.TOOLS


@pytest.mark.parametrize("tool, backend, on_path, expect", [
    ("ncu", "cpu", False, ["ncu is not on PATH", "NVIDIA (CUDA)", "backend is cpu"]),
    ("ncu", "cuda", False, ["ncu is not on PATH"]),
    ("ncu", "rocm", True, ["NVIDIA (CUDA)", "backend is rocm"]),
    ("nsys", "cpu", True, ["NVIDIA (CUDA)"]),
    ("rocprofv3", "cuda", False, ["rocprofv3 is not on PATH", "AMD (ROCm)"]),
])
def test_missing_names_what_is_missing(tool, backend, on_path, expect):
    why = tools.missing(tool, backend=backend, which=lambda t: f"/usr/bin/{t}" if on_path else None)
    assert why.startswith(f"--tool {tool}: ") and "\n" not in why and "--tool torch" in why
    for text in expect:
        assert text in why
    assert tools.missing(tool, backend=tools._VENDOR[tool][0], which=lambda t: "/x") is None


def test_missing_torch_and_unknown():
    assert tools.missing("torch", backend="cpu") is None
    with pytest.raises(ValueError, match="--tool"):
        tools.missing("vtune")


@pytest.mark.parametrize("tool", ["ncu", "nsys", "rocprofv3"])
def test_cli_refuses_a_tool_missing_here_before_anything_runs(tool, tmp_path, capsys, monkeypatch):
    if tools.missing(tool) is None:
        pytest.skip(f"{tool} can run on this machine")
    from k3lab import studies

    def must_not_run(*a, **k):
        raise AssertionError("ran despite the refusal")

    monkeypatch.setattr(studies.load_study("launch_overhead"), "profile_targets", must_not_run)
    monkeypatch.setattr(tools, "_run", must_not_run)
    assert cli.main(["profile", "launch_overhead", "--tool", tool, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"k3lab profile: --tool {tool}: ")
    with pytest.raises(ValueError, match=f"--tool {tool}"):
        tools.capture_tool(tool, "launch_overhead", "before", preset=None, out_dir=tmp_path)


def test_cli_profile_torch_writes_perfetto_and_hta(tmp_path, capsys):
    assert cli.main(["profile", "launch_overhead", "--out", str(tmp_path), "--steps", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "traces" / "launch_overhead"
    traces = sorted(folder.glob("*.trace.json"))
    assert traces, out
    for trace in traces:
        variant = trace.name.split(".")[0]
        doc = json.loads(trace.read_text())
        marks = [e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("k3lab.step.")]
        steps = [e for e in marks if e.get("cat") == "user_annotation"]  # a GPU trace also has each range
        cats = {e.get("cat") for e in marks}
        assert len(steps) == 2 and cats <= {"user_annotation", "gpu_user_annotation"}, cats
        assert len(marks) in (2, 4), [e.get("cat") for e in marks]  # on the device's timeline
        hta = json.loads(gzip.decompress((folder / "hta" / variant / "rank-0.json.gz").read_bytes()))
        marks = [e for e in hta["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
        host = [e["name"] for e in marks if e.get("cat") != "gpu_user_annotation"]  # a GPU trace repeats each
        assert sorted(host) == ["ProfilerStep#0", "ProfilerStep#1"], [e.get("cat") for e in marks]
        assert len(marks) in (2, 4), [e.get("cat") for e in marks]
        assert hta["distributedInfo"]["rank"] == 0
        assert str(trace) in out and f"hta/{variant}/rank-0.json.gz" in out
    assert cli.main(["profile", "launch_overhead", "--variant", "nope", "--out", str(tmp_path)]) == 2
    assert "--variant" in capsys.readouterr().err


# ---------------------------------------------------------------- nsys

@pytest.mark.parametrize("path", NSYS, ids=lambda p: p.stem)
def test_nsys_cuda_gpu_trace_real_files(path):
    assert len(NSYS) == 2
    f = tools.read_cuda_gpu_trace(path)
    assert len(f) == 16 and f.attrs["source"] == "nsys"
    assert list(f["kind"]).count("kernel") == 4 and list(f["kind"]).count("memcpy") == 12
    kern = f[f["kind"] == "kernel"]
    saxpy = "vernier::bench::demo::<unnamed>::saxpyKernel(float, const float *, float *, unsigned long)"
    assert set(kern["name"]) == {saxpy}  # the quoted name's commas kept
    assert kern["bytes"].isna().all() and (f.loc[f["kind"] == "memcpy", "bytes"] == 4_194_000).all()
    assert set(f["stream"]) == {13, 14} and set(f["category"]) >= {"copy"}
    text = path.read_text().splitlines()
    first = text[1].split(",")
    assert f["start_ns"].iloc[0] == int(first[0]) and f["dur_ns"].iloc[0] == int(first[1])
    assert P.counts(f, steps=4)["launches"] == 4 and P.counts(f, steps=4)["copies"] == 3


def test_nsys_reader_skips_notices_and_refuses_other_text():
    body = (NSYS[0]).read_text()
    f = tools.read_cuda_gpu_trace("NOTICE: Existing SQLite export found\n\nProcessing [x.sqlite]...\n" + body)
    assert len(f) == 16
    with pytest.raises(ValueError, match="cuda_gpu_trace"):
        tools.read_cuda_gpu_trace("name,calls\nx,1\n")


# ---------------------------------------------------------------- ncu

def test_ncu_frame_real_details_page():
    long = P.parse_ncu_csv(FIX / "ncu" / "copy_blocked_head.csv")
    f = tools.ncu_frame(long)
    assert len(f) == 1 and f["dur_ns"].iloc[0] == 21_058_944 and f.attrs["source"] == "ncu"
    assert f["name"].iloc[0].startswith("copy_blocked[") and f["bytes"].isna().all()  # no DRAM byte metric


def test_ncu_frame_raw_metrics_two_launches():
    text = ('"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum","dram__bytes_write.sum"\n'
            '"","","nsecond","byte","Kbyte"\n'
            '"0","k3kda_decode","5,000","1000","2"\n'
            '"1","k3mla::wg_kernel<1>","7,500","4000","1"\n')
    f = tools.ncu_frame(P.parse_ncu_csv(text))
    assert list(f["name"]) == ["k3kda_decode", "k3mla::wg_kernel<1>"]
    assert list(f["dur_ns"]) == [5000, 7500] and list(f["start_ns"]) == [0, 5000]
    assert list(f["bytes"]) == [3000, 5000]
    with pytest.raises(ValueError, match="duration"):
        tools.ncu_frame(P.parse_ncu_csv(text.replace("gpu__time_duration.sum", "sm__cycles.sum")))
    with pytest.raises(ValueError, match="parse_ncu_csv"):
        tools.ncu_frame(f)


def test_ncu_capture_command(tmp_path, monkeypatch):
    """capture_ncu: the child command under ncu with the step-0 NVTX filter; stdout read into the frame."""
    seen = {}

    def fake_run(cmd, **kw):
        seen["cmd"] = cmd
        return subprocess.CompletedProcess(cmd, 0, stdout=(FIX / "ncu" / "copy_blocked_head.csv").read_text(),
                                           stderr="")

    monkeypatch.setattr(tools.subprocess, "run", fake_run)
    cap = tools.capture_ncu("kda_decode", "after", preset="tp8", out_dir=tmp_path)
    cmd = seen["cmd"]
    assert cmd[0] == "ncu" and cmd[cmd.index("--nvtx-include") + 1] == "k3lab.step.0/"
    args = cmd[cmd.index("k3lab.profiling.child") + 1:]
    assert args == ["kda_decode", "after", "--steps", "1", "--warmup", "1", "--preset", "tp8"]
    assert cap.backend == "ncu" and cap.trace_path.exists() and len(cap.kernels) == 1
    assert cap.note == ""  # the ncu path has run on a GPU (profiles/nvidia-h100-80gb-hbm3/ncu)


def test_rocprofv3_capture_reads_what_the_tool_wrote(tmp_path, monkeypatch):
    """The rocprofv3 path end to end, rocprofv3 replaced by copying real rocprofv3 files into its -d
    folder."""
    src = FIX / "rocprofv3" / "docs-samples-2024"
    monkeypatch.setattr(tools, "missing", lambda tool, **k: None)
    monkeypatch.setattr("k3lab.profiling.rocprofv3_run.rocprofv3_available", lambda: True)

    def fake_run(cmd, **kw):
        assert cmd[0] == "rocprofv3" and "k3lab.profiling.child" in cmd
        out = Path(cmd[cmd.index("-d") + 1])
        for f in ("kernel_trace.csv", "memory_copy_trace.csv"):
            shutil.copy(src / f, out / f"run_{f}")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr("k3lab.profiling.rocprofv3_run.subprocess.run", fake_run)
    cap = tools.capture_tool("rocprofv3", "kda_decode", "after", preset=None, out_dir=tmp_path, steps=2)
    direct = [P.read_trace(src / f) for f in ("kernel_trace.csv", "memory_copy_trace.csv")]
    assert len(cap.kernels) == sum(map(len, direct)) > 0 and cap.steps == 2
    assert sorted(cap.kernels["name"]) == sorted(n for d in direct for n in d["name"])
    assert cap.trace_path.name.endswith(".perfetto.json")


# ---------------------------------------------------------------- the child

def test_child_marks_each_step_after_the_warmup(monkeypatch, capsys):
    import torch

    from k3lab import studies

    calls = []
    monkeypatch.setattr(studies.load_study("launch_overhead"), "profile_targets",
                        lambda preset=None: {"after": lambda: calls.append(torch.ones(4).sum())})
    cap = P.capture(lambda: child.run("launch_overhead", "after", steps=3, warmup=2), steps=1, warmup=0,
                    device="cpu")
    doc = json.loads(Path(cap.trace_path).read_text())
    names = [e["name"] for e in doc["traceEvents"] if e.get("cat") == "user_annotation"]
    assert sorted(n for n in names if n.startswith("k3lab.step.")) == \
        ["k3lab.step.0", "k3lab.step.0", "k3lab.step.1", "k3lab.step.2"]  # capture's step 0; the child's
    assert len(calls) == 5 and "2 warm-up and 3 marked steps" in capsys.readouterr().out
    assert child.main(["launch_overhead", "nope"]) == 2
    assert "variant" in capsys.readouterr().err


H100_NCU = Path(__file__).parents[1] / "profiles" / "nvidia-h100-80gb-hbm3" / "ncu"


@pytest.mark.parametrize("study, kernels", [("kda_decode", ["kda_decode_kernel"]),
                                            ("mla_padding", ["wg_kernel", "merge_kernel"])])
def test_ncu_frame_reads_the_committed_h100_captures(study, kernels):
    """The H100's `k3lab profile --tool ncu` captures (the fused KDA decode, the MLA split kernel and its
    merge) read into the kernel table: one row per launch, in launch order, each launch's duration and
    DRAM bytes the file's own metric rows (read here with the csv module, apart from the parser)."""
    import csv
    import io

    path = H100_NCU / f"{study}-after.ncu.csv"
    text = path.read_text()
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    metric = {(int(r["ID"]), r["Metric Name"]): float(r["Metric Value"].replace(",", "")) for r in rows}
    f = tools.ncu_frame(P.parse_ncu_csv(path))
    assert [next(k for k in kernels if k in n) for n in f["name"]] == kernels and f.attrs["source"] == "ncu"
    for i in range(len(kernels)):
        assert f["dur_ns"].iloc[i] == metric[(i, "gpu__time_duration.sum")]
        dram = metric[(i, "dram__bytes_read.sum")] + metric[(i, "dram__bytes_write.sum")]
        assert f["bytes"].iloc[i] == dram


# ---------------------------------------------------------------- the decode step's part labels

class _RecordingNvtx:
    """Stands in for torch.cuda.nvtx on this CPU: records each range push and pop."""

    def __init__(self):
        self.pushed, self.open = [], 0

    def range_push(self, name):
        self.pushed.append(name)
        self.open += 1

    def range_pop(self):
        self.open -= 1


def one_weight_set(monkeypatch) -> None:
    """decode_step's profile targets drawn with one weight set per layer kind instead of two: on a GPU
    K3's TP8 step then holds about 7 GiB, not 15 (each MoE set is 896 experts, 7.4 GB in bf16), on a
    device the suite's workers share; the parts and their ranges are the same."""
    from k3lab.engine.weights import RankWeights

    draw = RankWeights.random
    monkeypatch.setattr(RankWeights, "random",
                        classmethod(lambda cls, config, **kw: draw(config, **{**kw, "distinct_layers": 1})))


@pytest.mark.follows_gpu  # the study builds its step on the GPU where there is one
def test_profile_decode_step_names_its_parts(tmp_path, capsys, monkeypatch):
    """`k3lab profile decode_step`: the Chrome/Perfetto trace and the HTA folder hold a k3lab.part.* range
    per part of the program, each inside the step's range; the same names go to NVTX (here a recorder
    standing in for torch.cuda.nvtx, which a CPU lacks)."""
    from k3lab.profiling import export

    one_weight_set(monkeypatch)
    nvtx = _RecordingNvtx()
    monkeypatch.setattr(export, "_nvtx", lambda: nvtx)
    argv = ["profile", "decode_step", "--variant", "after", "--steps", "1", "--top", "3",
            "--out", str(tmp_path)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    folder = tmp_path / "traces" / "decode_step"
    want = {"k3lab.part." + p for p in ("embed", "mix", "kda", "mla", "moe", "dense", "collective")}
    chrome = json.loads((folder / "after.trace.json").read_text())
    hta = json.loads(gzip.decompress((folder / "hta" / "after" / "rank-0.json.gz").read_bytes()))
    for doc in (chrome, hta):
        ranges = [e for e in doc["traceEvents"] if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
        step = next(e for e in ranges if e["name"] == "k3lab.step.0")
        parts = [e for e in ranges if e["name"].startswith("k3lab.part.")]
        assert {e["name"] for e in parts} == want
        assert all(step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] for e in parts)
    assert any(e.get("name") == "ProfilerStep#0" for e in hta["traceEvents"])
    assert "ProfilerStep#0" not in {e.get("name") for e in chrome["traceEvents"]}
    assert want <= set(nvtx.pushed) and "k3lab.step.0" in nvtx.pushed and nvtx.open == 0


# ---------------------------------------------------------------- studies with nothing to profile here

@pytest.mark.parametrize("study", sorted(set(tools.NO_KERNELS) | {"draft_depth", "agent_cache"}))
def test_profile_refuses_a_study_without_kernels(study, tmp_path, capsys, monkeypatch):
    """A study with no kernels of its own exits 2 with one line naming it, what to run instead and the
    studies that have kernels, and writes nothing; its profile_targets are indeed empty or run host code
    only (draft_depth's and agent_cache's simulators: a CPU capture of them records no PyTorch op)."""
    import sys

    from k3lab import studies

    mod = studies.load_study(study)
    if study == "draft_depth":  # its simulators at 2e4 cycles, not 1e6: the same code, a test's time
        monkeypatch.setattr(sys.modules[mod.__name__ + ".measure"], "CYCLES", 20_000)
    targets = mod.profile_targets()
    assert bool(targets) == (study in ("draft_depth", "agent_cache"))
    for variant, fn in targets.items():
        cap = P.capture(fn, steps=1, warmup=0, device="cpu", trace_dir=tmp_path / "scratch", name=variant)
        assert len(cap.kernels) == 0 and len(cap.table) == 0, (study, variant, cap.table)
    assert cli.main(["profile", study, "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"k3lab profile: {study} has no kernels to profile: ")
    assert "`k3lab " in err  # what to run instead
    listed = err.split("Studies with kernels to profile: ")[1].split(", ")
    assert "decode_step" in listed and "kda_decode" in listed and not set(listed) & set(tools.NO_KERNELS)
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(tools, "missing", lambda tool: None)  # as on a GPU with ncu: still refused first
    monkeypatch.setattr(tools, "_run", lambda *a, **k: pytest.fail("ncu ran for a study without kernels"))
    with pytest.raises(ValueError, match=f"{study} has no kernels"):
        tools.profile_study(study, tool="ncu", variants=["after"], out_dir=tmp_path)


@pytest.mark.parametrize("tool", tools.TOOLS)
def test_an_unknown_variant_is_refused_before_the_tool_is_looked_for(tool, tmp_path, capsys, monkeypatch):
    """--variant naming no profile target: one line naming --variant, the study's variants and the wrong
    name, exit 2, before the tool's presence is asked (so on a CPU too) and before any child or capture
    runs; a known variant goes on to the tool check (here faked present, its child faked)."""
    from k3lab.profiling import capture

    asked = []
    monkeypatch.setattr(tools, "missing", lambda t: asked.append(t))
    monkeypatch.setattr(tools, "_run", lambda *a, **k: pytest.fail("a profiler ran for an unknown variant"))
    monkeypatch.setattr(capture, "capture", lambda *a, **k: pytest.fail("captured an unknown variant"))
    argv = ["profile", "launch_overhead", "--tool", tool, "--variant", "before", "nope", "--steps", "1",
            "--out", str(tmp_path / "out")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and asked == [] and not (tmp_path / "out").exists()
    assert err.startswith("k3lab profile: --variant: launch_overhead profiles before")
    assert err.endswith("; not 'nope'")
    with pytest.raises(ValueError, match="--variant: .*not an empty list"):
        tools.profile_study("launch_overhead", tool=tool, variants=[], out_dir=tmp_path)
    with pytest.raises(ValueError, match="--variant: expected a list"):
        tools.profile_study("launch_overhead", tool=tool, variants="before", out_dir=tmp_path)
    with pytest.raises(ValueError, match="--steps"):
        tools.profile_study("launch_overhead", tool=tool, variants=["before"], steps=0, out_dir=tmp_path)
    if tool == "torch":
        return
    ran = []
    monkeypatch.setattr(tools, "capture_tool", lambda t, study, v, **k: ran.append((t, study, v)))
    tools.profile_study("launch_overhead", tool=tool, variants=["before", "before"], out_dir=tmp_path)
    assert asked == [tool] and ran == [(tool, "launch_overhead", "before")]


def test_the_child_refuses_an_unknown_variant_in_the_same_words(capsys):
    from k3lab import studies

    names = ", ".join(studies.load_study("launch_overhead").profile_targets())
    assert child.main(["launch_overhead", "nope"]) == 2
    assert capsys.readouterr().err.strip() == \
        f"k3lab.profiling.child: --variant: launch_overhead profiles {names} here; not 'nope'"


def test_profile_refuses_empty_targets_of_any_study(tmp_path, capsys, monkeypatch):
    """A study outside NO_KERNELS whose profile_targets build nothing here is refused too, never a silent
    exit 0 with no trace."""
    from k3lab import studies

    monkeypatch.setattr(studies.load_study("launch_overhead"), "profile_targets", lambda preset=None: {})
    assert cli.main(["profile", "launch_overhead", "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "launch_overhead has no kernels to profile" in err and "built none" in err
    assert not (tmp_path / "out").exists()
    assert tools.no_targets("launch_overhead") is None
    with pytest.raises(ValueError, match="unknown study"):
        tools.no_targets("nope")


@pytest.mark.follows_gpu  # the study builds its inputs on the GPU where there is one
def test_profile_kda_decode_runs_here(tmp_path, capsys):
    """`k3lab profile kda_decode` on the device at hand: every variant on a GPU; on a CPU the unfused
    chain in Triton's interpreter (the fused kernel and fla need a GPU), its state advancing each call."""
    import torch

    from k3lab import studies

    targets = studies.load_study("kda_decode").profile_targets()
    if not torch.cuda.is_available():
        assert sorted(targets) == ["before"]
        first = targets["before"]().clone()  # out [B, H*V] of one step; the next step reads the new state
        second = targets["before"]()
        assert first.shape == second.shape == (1, 2 * 128) and torch.isfinite(second).all()
        assert not torch.equal(first, second)
    assert cli.main(["profile", "kda_decode", "--steps", "1", "--top", "3", "--out", str(tmp_path)]) == 0
    for variant in targets:
        doc = json.loads((tmp_path / "traces" / "kda_decode" / f"{variant}.trace.json").read_text())
        assert step_work(doc, gpu=torch.cuda.is_available()), variant


def step_work(doc: dict, *, gpu: bool) -> list[dict]:
    """The work a Chrome trace shows inside its first step's host range (k3lab.step.0): its ATen ops, and
    on a GPU also its kernel launches (cuda_runtime / cuda_driver calls whose kernel the trace recorded),
    since a variant that launches through ctypes (the fused KDA decode, the CUDA MLA kernels) runs no
    ATen op. An empty list when the step is missing or ran nothing."""
    events = doc["traceEvents"]
    step = next((e for e in events if e.get("name") == "k3lab.step.0" and e.get("cat") == "user_annotation"),
                None)
    if step is None:
        return []
    end = step["ts"] + step["dur"]
    inside = [e for e in events if e.get("ph") == "X" and step["ts"] <= e.get("ts", -1) <= end]
    work = [e for e in inside if e.get("cat") == "cpu_op"]
    if gpu:
        ran = {e.get("args", {}).get("correlation") for e in events if e.get("cat") == "kernel"}
        work += [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")
                 and e.get("args", {}).get("correlation") in ran]
    return work


@pytest.mark.parametrize("variant", ["before", "after"])
def test_step_work_reads_launches_on_the_committed_h200_mla_traces(variant):
    """The H200's mla_padding traces: 'after' launches its CUDA kernels through ctypes (no ATen op at all),
    so its step's work is its launches; without the GPU reading, or with its kernels gone, none is found."""
    root = Path(__file__).parents[1] / "profiles" / "nvidia-h200" / "mla_padding" / "traces"
    (path,) = root.glob(f"mla_padding-{variant}-cuda-*.trace.json.gz")
    doc = json.loads(gzip.decompress(path.read_bytes()))
    work = step_work(doc, gpu=True)
    assert work and all(e["cat"] in ("cpu_op", "cuda_runtime", "cuda_driver") for e in work)
    if variant == "after":
        assert not any(e.get("cat") == "cpu_op" for e in doc["traceEvents"])
        assert step_work(doc, gpu=False) == []
    kept = [e for e in doc["traceEvents"] if e.get("cat") not in ("kernel", "cpu_op")]
    no_kernels = dict(doc, traceEvents=kept)
    assert step_work(no_kernels, gpu=True) == []


def _release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.mark.follows_gpu  # the studies build their inputs on the GPU where there is one
@pytest.mark.parametrize("study, before, after, cpu_dtype", [
    ("dcp", "before", "after", "float32"),
    ("moe_sharding", "experts_before", "experts_after", "float16"),
])
def test_profile_kernel_studies_before_and_after(study, before, after, cpu_dtype, tmp_path, capsys):
    """dcp and moe_sharding profile their before/after kernels at a small case: the Triton form agrees
    with the torch form (the study's reference) within the inputs' dtype's bounds (bf16 on a GPU), and
    every variant leaves a trace and an HTA folder with its step."""
    import torch

    from k3lab import bench, studies

    targets = studies.load_study(study).profile_targets()
    got, want = targets[after](), targets[before]()
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)  # the merge's (o, lse)
    dt = torch.bfloat16 if torch.cuda.is_available() else getattr(torch, cpu_dtype)
    bench.check(got, want.double(), dtype=dt, name=f"{study} {after} against {before}")
    variants = list(targets)
    # the command builds its own targets: on a GPU moe_sharding's are K3's TP8 experts (about 7 GB), so
    # these go first rather than hold twice that on a device the suite's workers share
    del targets, got, want
    _release_device_memory()
    assert cli.main(["profile", study, "--steps", "1", "--top", "3", "--out", str(tmp_path)]) == 0
    folder = tmp_path / "traces" / study
    for variant in variants:
        doc = json.loads((folder / f"{variant}.trace.json").read_text())
        assert any(e.get("name") == "k3lab.step.0" for e in doc["traceEvents"]), variant
        assert (folder / "hta" / variant / "rank-0.json.gz").is_file()
