"""The whole-step bounds: the projection list covers the floor's dense weights, the profile split adds
up, and the GPU probes say what runs instead on a CPU."""

import pytest
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import bench as step_bench
from k3lab.engine import bounds


@pytest.mark.parametrize("config", [K3Config.tp_slice(8), step_bench.CPU_CONFIG])
def test_projection_shapes_are_the_floors_dense_weights(config):
    """Every dense weight the floor counts is a probed projection, except the absorbed MLA key/value
    halves (batched matmuls) and the embedding rows."""
    c = config
    probed = sum(s["out"] * s["in"] * s["calls"] for s in bounds.projection_shapes(c))
    absorbed = c.num_mla_layers * 2 * c.num_attention_heads * c.qk_nope_head_dim * c.kv_lora_rank
    dense = step_bench.step_bytes(c, 1, 1024, act_bytes=1)["weights_dense"]
    assert probed + absorbed + c.hidden_size == dense


def test_split_of_a_committed_profile_adds_up():
    recs = [r for r in bench.load_records(bounds.STUDY, device="nvidia-h200") if r.case == "b1_1k.all_on.graph"]
    if not recs or "profile_graph" not in recs[0].extra:
        pytest.skip("no committed profiled b1_1k graph record")
    prof = recs[0].extra["profile_graph"]
    s = bounds.split(prof)
    assert s["stream_us"] + s["rest_us"] == pytest.approx(prof["kernel_sum_us"])
    assert s["stream_kernels"] + s["rest_kernels"] == prof["launches"]
    assert 0 < s["stream_us"] < prof["kernel_sum_us"] and s["rest_kernels"] > s["stream_kernels"]


def test_bad_input_and_cpu_answers():
    with pytest.raises(ValueError, match="profile"):
        bounds.split({"launches": 3})
    with pytest.raises(ValueError, match="n must be"):
        bounds.small_kernel_probe(0)
    if not torch.cuda.is_available():
        assert bounds.run(step_bench.CPU_CONFIG) == []
        assert step_bench.main(["bounds"]) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the probes time GPU kernels")
def test_probes_on_the_gpu():
    recs = bounds.run(step_bench.CPU_CONFIG, repeats=3)
    assert {r.case for r in recs} >= {"probe.small_kernel", "probe.gemv.lm_head"}
    assert all(r.median_us > 0 for r in recs)


def test_where_time_goes_from_committed_records():
    from k3lab.studies import decode_step as ds

    recs = ds.load()
    assert not any(r.case.startswith(ds.PROBE) for r in recs)
    rows = ds.where_time_goes(recs, "b1_1k")
    if not rows:
        pytest.skip("no committed profiled b1_1k graph record")
    stream, rest, whole = rows
    r = next(r for r in recs if r.case == "b1_1k.all_on.graph")
    assert stream["kernel_ms"] + rest["kernel_ms"] == pytest.approx(r.extra["profile_graph"]["kernel_sum_us"] / 1e3)
    assert stream["floor_ms"] + rest["floor_ms"] == pytest.approx(r.floor_us / 1e3, rel=1e-6)
    assert whole["probe_ms"] == pytest.approx(r.median_us / 1e3)
    assert ds.where_time_goes([], "b1_1k") == []
