"""The decode step's glue kernels measured alone (k3lab.studies.decode_step.glue): the router check
catches a differing path, the study's 'glue' case measures nothing on a CPU and says so, and on a GPU
every record is checked and labelled."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.studies import decode_step as ds
from k3lab.studies.decode_step import glue

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_router_check_passes_on_this_device_and_can_fail(monkeypatch):
    chk, (logits, _, m) = glue.router_check(1, device=DEV)
    assert chk["ok"], chk
    assert logits.shape == (1, glue.E) and m > 0
    real = glue.route_and_sort

    def off_by_one(logits, bias, k, *, backend, **kw):
        w, idx, s = real(logits, bias, k, backend=backend, **kw)
        return (w, idx.flip(-1), s) if backend == "triton" else (w, idx, s)

    monkeypatch.setattr(glue, "route_and_sort", off_by_one)
    bad, _ = glue.router_check(1, device=DEV)
    assert not bad["ok"] and not bad["idx_equal"]
    with pytest.raises(bench.CheckFailed, match="N = 1"):
        glue.router_records((1,), device=DEV, repeats=2)


def test_the_glue_case_is_a_study_case_kept_out_of_the_step_tables():
    assert "glue" in ds.case_names() and "probe" in ds.case_names()
    t = bench.Timing(5.0, 5.0, 5.0, 3, "graph", 0.0)
    rec = bench.make_record("decode_step", "glue.moe_router.N1", "after", t, shape={"tokens": 1},
                            dtype="float32")
    assert ds.load([rec]) == []
    if not torch.cuda.is_available():
        said = []
        assert glue.run(log=said.append) == [] and "nothing is measured" in said[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the glue kernels are timed on a GPU")
def test_glue_records_on_the_gpu():
    recs = glue.run(experts=False)
    cases = {r.case for r in recs}
    assert {"glue.moe_router.N1", "glue.moe_router.N64", "glue.situ_glu.shared_expert_N1"} <= cases
    assert {r.variant for r in recs} == {"before", "after"} and all(r.median_us > 0 for r in recs)


# the default, the former default and the down launch's first flat choice
TINY_SWEEP = glue.EXPERT_SWEEP[:2] + tuple(c for c in glue.EXPERT_SWEEP if c[2] == "flat")[:1]


def _tiny_experts(log=lambda *a: None, **kw):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32  # the interpreter has no bf16 arithmetic
    # widths 128: the grouped form's K step divides them
    return glue.expert_records(TINY_SWEEP, experts=8, top_k=2, latent=128, intermediate=128,
                               sets=2, repeats=3, device=DEV, dtype=dtype, log=log, **kw)


def test_expert_records_check_each_choice_and_label_it():
    """bf16 'before', one MXFP4 'after' per block choice (the first the default), each checked against its
    fp64 product, floored at its own bytes (MXFP4's 4.25 bits against the dense dtype's)."""
    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    said = []
    recs = _tiny_experts(log=said.append)
    grouped, why = mk.grouped_runs_here()
    assert [r.variant for r in recs] == ["before"] + ["after"] * (len(TINY_SWEEP) + grouped)
    assert recs[0].case == "glue.experts.N1.bf16" and recs[0].error["max_rel_vs_fp64"] <= 1e-2
    assert [c[2] for c in TINY_SWEEP] == ["pairs", "pairs", "flat"]
    for r, (up, down, form) in zip(recs[1:4], TINY_SWEEP):
        word = {"pairs": "down", "flat": "flat"}[form]
        assert r.case == f"glue.experts.N1.mxfp4.up{{}}x{{}}w{{}}.{word}{{}}x{{}}w{{}}".format(*up, *down)
        assert r.error["max_abs_vs_fp64"] <= r.error["tolerance"] and r.extra["down_form"] == form
        assert r.extra["default"] == ((up, down, form) == (mk.UP_BLOCKS, mk.DOWN_BLOCKS, mk.DOWN_FORM))
    for r in recs[1:]:
        assert r.extra["bytes"] == mk.expert_bytes(1, 2, 128, 128) < recs[0].extra["bytes"]
        assert r.floor_us == pytest.approx(r.extra["bytes"] / (r.extra["bandwidth_tbs"] * 1e6))
    if grouped:  # the tensor-core form at the same token, checked against MXFP8-rounded activations
        r = recs[-1]
        assert r.case == "glue.experts.N1.mxfp4_grouped.m{}n{}k{}w{}".format(*mk.GROUPED)
        assert r.error["max_abs_vs_fp64_mx_activations"] <= r.error["tolerance"] and not r.extra["default"]
    else:  # the interpreter has no tl.dot_scaled: said, not timed
        assert any("grouped form not timed" in line and why in line for line in said)


def test_expert_records_refuse_a_wrong_grouped_result(monkeypatch):
    """Where the grouped form runs, a planted result 1% off fails its check before it is timed."""
    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    if not mk.grouped_runs_here()[0]:
        pytest.skip(mk.grouped_runs_here()[1])
    real = mk.mxfp4_experts_grouped
    monkeypatch.setattr(mk, "mxfp4_experts_grouped", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(bench.CheckFailed, match="mxfp4_experts_grouped at one token"):
        _tiny_experts()


def test_expert_records_refuse_a_wrong_kernel_before_timing(monkeypatch):
    """A planted MXFP4 result 1% off fails its check, naming the block choice, and nothing is timed."""
    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    real, timed = mk.mxfp4_experts, []
    monkeypatch.setattr(mk, "mxfp4_experts", lambda *a, **k: real(*a, **k) * 1.01)
    monkeypatch.setattr(bench, "time_fn", lambda *a, **k: timed.append(1))
    with pytest.raises(bench.CheckFailed, match="up8x256w4.down4x128w4"):
        _tiny_experts()
    assert timed == []


def test_expert_table_is_made_of_the_records(tmp_path):
    """The experts table holds each record's figures (median, floor, share, ratio to bf16 of the same
    run) and marks the default; docs/decode_step.md holds the committed records' table."""
    from pathlib import Path

    from k3lab.ops.moe_experts import mxfp4_kernels as mk

    assert "No one-token expert record" in glue.expert_markdown(root=tmp_path)
    recs = _tiny_experts()
    bench.save_records(recs, root=tmp_path)
    text = glue.expert_markdown(root=tmp_path)
    bf16 = recs[0]
    for r in recs[1:4]:
        blocks = r.case.split(".", 4)[4]
        default = " (default)" if r.extra["default"] else ""
        row = (f"| mxfp4 | {blocks}{default} | {r.median_us:.1f} | {r.floor_us:.1f} | "
               f"{100 * r.floor_us / r.median_us:.0f}% | {r.median_us / bf16.median_us:.2f} |")
        assert row in text, (row, text)
    assert f"| bf16 | - | {bf16.median_us:.1f} | {bf16.floor_us:.1f} |" in text
    assert text.count("(default)") == sum(r.extra.get("default", False) for r in recs) == (
        (mk.UP_BLOCKS, mk.DOWN_BLOCKS, mk.DOWN_FORM) in TINY_SWEEP)
    page = (Path(__file__).resolve().parents[1] / "docs" / "decode_step.md").read_text()
    committed = glue.expert_markdown()
    assert committed in page
    # the code's default is marked, not the one a record was taken under
    marked = [line.split(" | ")[1] for line in committed.splitlines() if "(default)" in line]
    assert all(m == glue._choice_name(mk.UP_BLOCKS, mk.DOWN_BLOCKS, mk.DOWN_FORM) + " (default)"
               for m in marked), marked
