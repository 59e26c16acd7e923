"""The agent_cache study's host <-> device part (k3lab.studies.agent_cache.h2d) at tiny sizes: the smoke
run through `k3lab bench agent_cache` on a CPU (the H200 run is the benchmark), and its checks failing."""

import json

import pytest
import torch

from k3lab import bench, cli
from k3lab.cache import restore, save
from k3lab.studies.agent_cache import h2d


def test_smoke_run_writes_checked_records(tmp_path, capsys):
    out = tmp_path / "h2d.json"
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the benchmark's real sizes")
    assert cli.main(["bench", "agent_cache", "--cases", "copies", "state", "--json", str(out),
                     "--out", str(tmp_path / "b")]) == 0
    records = [bench.Record.from_dict(r) for r in json.loads(out.read_text())]
    cases = {r.case for r in records}
    assert {"h2d_64KiB", "d2h_1MiB", "state_save_ctx256", "state_restore_ctx256"} <= cases
    for r in records:
        assert r.study == "agent_cache" and r.p20_us <= r.median_us <= r.p80_us and r.extra["gb_per_s"] > 0
    state = [r for r in records if r.case.startswith("state_")]
    assert all(r.error["continue_outputs_equal"] and r.error["continue_caches_equal"] for r in state)
    assert list((tmp_path / "b" / "records").rglob("state_restore_ctx256__before.json"))
    assert "bit-equal after restore: True" in capsys.readouterr().out


def test_run_returns_the_summary_of_the_parts_asked():
    res = h2d.run(smoke=True, parts=("state",))
    assert res["records"] and all(r.case.startswith("state_") for r in res["records"])
    assert res["state"]["bytes"] == sum(res["records"][0].extra["bytes_by_kind"].values())


def test_the_equality_check_can_fail():
    torch.manual_seed(0)
    cfg = h2d.K3Config.tiny()
    layers = h2d._layers(cfg, 1, 1, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(3)
    cache = h2d._prefill(layers, 70, 64, gen, torch.float32)
    good = restore(save(cache, 0, pin=False))
    assert h2d._check_equal(cache, good, layers, 2, gen, torch.float32)["restored_equal"]
    bad = restore(save(cache, 0, pin=False))
    bad.layers[0].state[0, 0, 0, 0] += 1e-6   # one value of the KDA state off
    with pytest.raises(bench.CheckFailed, match="restored cache differs"):
        h2d._check_equal(cache, bad, layers, 2, gen, torch.float32)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="sizes must hold positive byte counts"):
        h2d.copy_records((0,), device="cpu")
