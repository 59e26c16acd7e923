"""The MoE benchmark's code path at tiny sizes on a CPU (eager timings, Triton's interpreter, fp16):
every variant is checked against fp32 before it is timed, and records carry floors and shapes."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.config import K3Config
from k3lab.studies.moe_sharding import measure
from k3lab.studies.moe_sharding import tables


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the real benchmark instead")
def test_bench_runs_every_variant_checked_at_tiny_sizes():
    res = measure.run_tokens(tail_tokens=(3,), expert_tokens=(2,), tp=2, config=K3Config.tiny(), repeats=2,
                        warmup=0)
    got = [(r.case, r.variant) for r in res["records"]]
    assert got == [("tail_N3", "before"), ("tail_N3", "after"), ("tail_N3", "torch"),
                   ("experts_N2", "before"), ("experts_N2", "after"), ("experts_N2", "after")]
    for r in res["records"]:
        assert r.floor_us > 0 and r.error["max_rel"] <= r.error["bound_max_rel"]
    tail = {r.variant: r for r in res["records"] if r.case == "tail_N3"}
    assert tail["before"].shape["rows"] == 256 and tail["after"].shape["rows"] == 128
    # before and after differ only in the rows (the same form), torch is the reference ops
    assert [tail[v].extra["form"] for v in ("before", "after", "torch")] == ["tail_triton", "tail_triton",
                                                                            "tail_torch"]
    assert "case" in tables.table(res["records"])


def test_bench_refuses_to_run_k3_shapes_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="needs a CUDA/ROCm GPU"):
        measure.run_tokens()
