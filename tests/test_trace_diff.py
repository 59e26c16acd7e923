"""k3lab.profile.trace_diff on the committed H200 traces and on the shared tool fixtures."""

from pathlib import Path

import pandas as pd
import pytest

from k3lab import profile
from k3lab.profiling.diff import device_work, short_name

REPO = Path(__file__).resolve().parent.parent
H200 = REPO / "profiles" / "nvidia-h200"
SHARED = Path("/work/shared/fixtures")


def _one(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    if not found:
        pytest.skip(f"no {pattern} under {folder}")
    return found[0]


@pytest.fixture(scope="module")
def attn_res():
    d = H200 / "copy_removal" / "traces"
    paths = {v: _one(d, f"copy_removal-{v}-*.json.gz") for v in ("before", "after")}
    return paths, {v: profile.read_trace(p) for v, p in paths.items()}


def test_fused_step_diff_on_the_h200_trace(attn_res):
    paths, fr = attn_res
    d = profile.trace_diff(fr["before"], fr["after"], steps=3, paths=paths)
    # the unfused chain's kernels are all gone, the one fused kernel is new, nothing is shared
    assert set(d.kernels["status"]) == {"gone", "new"}
    assert d.names("new") == ["_attn_res_norm_kernel"]
    before_k = device_work(fr["before"])
    assert len(d.names("gone")) == before_k["name"].nunique()
    # per-step figures: totals divided by the 3 traced steps, the same as counts() and the raw frame
    assert d.launches.loc["before", "launches"] == profile.counts(fr["before"], steps=3)["launches"]
    assert d.launches.loc["after", "launches"] == 1
    assert d.total_us("before") == pytest.approx(before_k["dur_us"].sum() / 3)
    cats = d.categories.set_index("category")
    assert cats["us_before"].sum() == pytest.approx(d.total_us("before"))
    assert cats.loc["copy", "us_after"] == 0 and cats.loc["copy", "us_before"] > 0
    text = d.summary()
    assert "ui.perfetto.dev" in text and str(paths["after"]) in text and "gone" in text
    assert "<table" in d._repr_html_()


def test_same_trace_is_all_same_and_a_slower_kernel_is_changed(attn_res):
    _, fr = attn_res
    a = fr["after"]
    same = profile.trace_diff(a, a)
    assert set(same.kernels["status"]) == {"same"} and (same.kernels["delta_us"] == 0).all()
    slower = a.copy()
    slower["dur_us"] = slower["dur_us"] * 1.5
    d = profile.trace_diff(a, slower)
    assert d.names("changed") == ["_attn_res_norm_kernel"]
    assert d.kernels.loc[0, "delta_us"] == pytest.approx(0.5 * a[a["kind"] == "kernel"]["dur_us"].sum())
    fewer = profile.trace_diff(a, a.iloc[1:])  # one call fewer: changed, whatever the time
    assert fewer.names("changed") == ["_attn_res_norm_kernel"]


def test_split_decode_diff_keeps_shared_kernels_apart_from_new_ones():
    d0 = H200 / "mla_padding" / "traces"
    before = profile.read_trace(_one(d0, "mla_padding-before-*.json.gz"))
    after = profile.read_trace(_one(d0, "mla_padding-after-*.json.gz"))
    d = profile.trace_diff(before, after, steps=3)
    assert d.names("gone") and d.names("new")
    assert not set(d.names("gone")) & set(d.names("new"))
    assert d.total_us("after") < d.total_us("before")


def test_rocprofv3_fixture_against_itself_shifted():
    folder = SHARED / "rocprofv3"
    if not folder.exists():
        pytest.skip("the shared rocprofv3 fixtures are not on this machine")
    csvs = sorted(folder.rglob("*kernel_trace.csv"))
    if not csvs:
        pytest.skip("no rocprofv3 kernel_trace.csv fixture")
    df = profile.read_trace(csvs[0])
    dropped = df["name"].iloc[0]
    d = profile.trace_diff(df, df[df["name"] != dropped], labels=("run1", "run2"))
    assert d.names("gone") == [dropped] and not d.names("new")
    assert "run1" in d.summary()


def test_bad_arguments_are_named():
    df = pd.DataFrame({"name": ["k"], "category": ["other"], "dur_us": [1.0], "kind": ["kernel"]})
    with pytest.raises(ValueError, match="steps"):
        profile.trace_diff(df, df, steps=0)
    with pytest.raises(ValueError, match="labels"):
        profile.trace_diff(df, df, labels=("a", "a"))
    with pytest.raises(ValueError, match="before"):
        profile.trace_diff([1], df)
    with pytest.raises(ValueError, match="side"):
        profile.trace_diff(df, df).total_us("x")


def test_short_names():
    assert short_name("_split_kernel") == "_split_kernel"
    long = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, "
            "float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float>)")
    assert short_name(long) == "at::native::reduce_kernel<...MeanOps>"


def test_capture_diff_profiles_both_callables_here(tmp_path):
    import torch

    x = torch.randn(64, 64, device="cuda" if torch.cuda.is_available() else "cpu")
    d = profile.capture_diff(lambda: (x * 2).sum(), lambda: torch.mm(x, x), steps=2, warmup=0,
                             trace_dir=tmp_path, name="t")
    assert set(d.paths) == {"before", "after"} and all(Path(p).exists() for p in d.paths.values())
    assert all(Path(p).parent == tmp_path for p in d.paths.values())
    gone, new = " ".join(d.names("gone")), " ".join(d.names("new"))
    if torch.cuda.is_available():
        assert d.note == "" and len(d.names("new")) >= 1
    else:  # a CPU trace lists ATen ops, and says so
        assert "aten::mm" in new and "aten::mul" in gone and "ATen" in d.note and "ATen" in d.summary()
    assert d.steps == (2, 2)
    with pytest.raises(ValueError, match="callables"):
        profile.capture_diff(x, lambda: x)
    with pytest.raises(ValueError, match="labels"):
        profile.capture_diff(lambda: x, lambda: x, labels=("a", "a"))
