"""Notebook 01's study helpers: memory, layout, merge by hand, bytes, the cost model's inputs."""

import torch

from k3lab.studies import dcp as study


def test_memory_table_marks_the_142k_case():
    t = study.memory_table()
    row = t[t.tokens == study.CONVERSATION].iloc[0]
    assert round(row.tp_bytes / 1e9, 2) == 1.96 and round(row.dcp_bytes / 1e6) == 245
    assert (t.kda_state_bytes == 69 * 12 * 128 * 128 * 4).all()  # one TP8 rank's KDA state per sequence
    assert len(study.memory_figure(t).data) == 3


def test_layout_and_two_shard_example():
    lay = study.layout_table(20, 4, 16)
    assert lay[lay["rank"] == 1].position.tolist() == [16, 17, 18, 19] and (lay["rank"] < 2).all()
    assert lay.local_row.tolist()[16:] == [0, 1, 2, 3]
    ex = study.two_shard_example()
    assert ex["max_diff"] < 1e-12 and abs(sum(ex["weights"].values()) - 1) < 1e-12


def test_cost_model_from_records_and_public_figures():
    att = study.attention_model()
    assert att and 3.0 < att["bw_TBps"] < 5.0  # the H200 records' slope: near the copy bandwidth
    cost = study.cost_model(contexts=(1_000, 128_000), batches=(1, 64), attention=att)
    assert (cost.dcp_low_us <= cost.dcp_high_us).all() and (cost.dcp_local_us <= cost.tp_us).all()
    big = cost[(cost.batch == 64) & (cost.context == 128_000)].iloc[0]
    assert big.dcp_high_us < big.tp_us  # many long requests: DCP pays even at the high latency
    small = cost[(cost.batch == 1) & (cost.context == 1_000)].iloc[0]
    assert small.dcp_low_us > small.tp_us  # one short request: the collectives cost more than they save
    cap = study.capacity_table()
    assert (cap.dcp_requests >= cap.tp_requests).all()
    b = study.bytes_table((1,), dtype=torch.bfloat16)
    assert b.calls.tolist() == [3, 2]
