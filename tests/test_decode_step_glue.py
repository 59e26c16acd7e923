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
    recs = glue.run()
    cases = {r.case for r in recs}
    assert {"glue.moe_router.N1", "glue.moe_router.N64", "glue.situ_glu.shared_expert_N1"} <= cases
    assert {r.variant for r in recs} == {"before", "after"} and all(r.median_us > 0 for r in recs)
