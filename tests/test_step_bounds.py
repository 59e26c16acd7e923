"""The whole-step bounds: the projection list covers the floor's dense weights, the profile split adds
up, and the GPU probes say what runs instead on a CPU."""

import pytest
import torch

from k3lab import bench
from k3lab.config import K3Config
from k3lab.studies.decode_step import bounds
from k3lab.studies.decode_step import measure

from cpu_child import on_a_cpu


@pytest.mark.parametrize("config", [K3Config.tp_slice(8), measure.CPU_CONFIG])
def test_projection_shapes_are_the_floors_dense_weights(config):
    """Every dense weight the floor counts is a probed projection, except the absorbed MLA key/value
    halves (batched matmuls) and the embedding rows."""
    c = config
    probed = sum(s["out"] * s["in"] * s["calls"] for s in bounds.projection_shapes(c))
    absorbed = c.num_mla_layers * 2 * c.num_attention_heads * c.qk_nope_head_dim * c.kv_lora_rank
    dense = measure.step_bytes(c, 1, 1024, act_bytes=1)["weights_dense"]
    assert probed + absorbed + c.hidden_size == dense


def test_split_of_a_committed_profile_adds_up():
    recs = [r for r in bench.load_records(bounds.NAME, device="nvidia-h200") if r.case
            == "b1_1k.all_on.graph"]
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
        assert bounds.run(measure.CPU_CONFIG) == []
        said = []
        assert measure.probe_records(log=said.append) == [] and "no GPU here" in said[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the probes time GPU kernels")
def test_probes_on_the_gpu():
    recs = bounds.run(measure.CPU_CONFIG, repeats=3)
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
    assert stream["kernel_ms"] + rest["kernel_ms"] == pytest.approx(r.extra["profile_graph"]["kernel_sum_us"]
                                                                    / 1e3)
    assert stream["floor_ms"] + rest["floor_ms"] == pytest.approx(r.floor_us / 1e3, rel=1e-6)
    assert whole["probe_ms"] == pytest.approx(r.median_us / 1e3)
    assert ds.where_time_goes([], "b1_1k") == []


@on_a_cpu
def test_experts_read_counts_the_recorded_routes_and_sets_the_floor():
    from k3lab.engine import DecodeStep

    c = measure.CPU_CONFIG
    step = DecodeStep(c, 2, 8, optimizations="all", device="cpu", dtype=torch.float32)
    assert step.experts_read() is None
    with torch.no_grad():
        step.routes = []
        step.run()
    assert len(step.routes) == c.num_moe_layers
    read = step.experts_read()
    assert read == sum(len(set(i.reshape(-1).tolist())) for i in step.routes)
    assert (
        c.num_moe_layers * c.num_experts_per_token
        <= read
        <= c.num_moe_layers * min(c.num_experts, 2 * c.num_experts_per_token)
    )
    case = {"bytes": measure.step_bytes(c, 2, 8), "bandwidth_tbs": 2.0}
    f = measure.variant_floor(case, read, measure.expert_bytes(c), saved=1000)
    b = f["bytes"]
    assert b["weights_experts"] == read * measure.expert_bytes(c)
    assert b["weights_dense"] == case["bytes"]["weights_dense"] - 1000
    assert b["total"] == pytest.approx(case["bytes"]["total"] - 1000 - b["weights_experts_uniform"]
                                       + b["weights_experts"])
    assert f["floor_us"] == pytest.approx(b["total"] / 2e6)


def test_routed_experts_refuses_a_sort_of_other_pairs():
    from k3lab.ops import moe_experts as me

    g = torch.Generator().manual_seed(3)
    z, w = torch.randn(3, 16, generator=g), torch.rand(3, 2, generator=g)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2]])
    w1, w3, w2 = (
        torch.randn(4, 8, 16, generator=g),
        torch.randn(4, 8, 16, generator=g),
        torch.randn(4, 16, 8, generator=g),
    )
    other = me.sort_by_expert(idx[:2], 4, 16)
    with pytest.raises(ValueError, match="sort must be the ExpertSort"):
        me.routed_experts(z, w, idx, w1, w3, w2, sort=other, backend="torch")
    good = me.sort_by_expert(idx, 4, 16)
    with pytest.raises(ValueError, match="block_m=32"):
        me.routed_experts(z, w, idx, w1, w3, w2, sort=good, block_m=32, backend="torch")
