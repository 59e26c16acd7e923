"""Notebook 02's tables and figures: the numbers they show come from the formulas, bad input refused."""

import pytest

from k3lab.config import K3Config
from k3lab.ops.moe_experts import decode_padding
from k3lab.studies.moe_sharding import tables


def test_memory_table_and_cost_table_at_k3_tp8():
    mem = tables.memory_table(K3Config.full(), 8).set_index("unit")
    assert mem.loc["positions per GPU", "value"] == 4_136_108_032 // 13_824
    assert mem.loc["conversations", "value"] == pytest.approx(4_136_108_032 / (24 * 142_000 * 576))
    cost = tables.tail_table(K3Config.full(), 8, tokens=(1,)).set_index("tail")
    assert cost.loc["replicated", "up_proj rows"] == 8 * cost.loc["sharded", "up_proj rows"]


def test_ownership_figure_marks_every_rank_before_and_one_after():
    fig = tables.ownership_figure(world_size=4, hidden=256)
    before, after = (list(map(list, t.z)) for t in fig.data)
    assert all(v == 2 for row in before for v in row)
    assert [row.index(1) for row in after] == [0, 1, 2, 3] and sum(map(sum, after)) == 4
    with pytest.raises(ValueError, match="does not divide the hidden size"):
        tables.ownership_figure(world_size=3, hidden=256)


def test_hit_rate_effect_and_padding_figure():
    eff = tables.hit_rate_effect(0.748, 0.801)
    assert eff["recomputed_prefill_change"] == pytest.approx(0.199 / 0.252 - 1)
    with pytest.raises(ValueError, match="hit rates"):
        tables.hit_rate_effect(1.2, 0.5)
    fig = tables.padding_figure(decode_padding(batches=[1, 16], heights=(16, 32)))
    assert len(fig.data) == 3
