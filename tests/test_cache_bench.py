"""k3lab.cache.bench_h2d at tiny sizes (the script's smoke run; the H200 run is the benchmark)."""

import json

import pytest
import torch

from k3lab import bench
from k3lab.cache import bench_h2d, restore, save


def test_smoke_run_writes_checked_records(tmp_path, capsys):
    out = tmp_path / "h2d.json"
    assert bench_h2d.main(["--smoke", "--json", str(out), "--records-root", str(tmp_path / "profiles")]) == 0
    data = json.loads(out.read_text())
    records = [bench.Record.from_dict(r) for r in data["records"]]
    cases = {r.case for r in records}
    assert {"h2d_64KiB", "d2h_1MiB", "state_save_ctx256", "state_restore_ctx256"} <= cases
    for r in records:
        assert r.study == "agent_cache" and r.p20_us <= r.median_us <= r.p80_us and r.extra["gb_per_s"] > 0
    state = [r for r in records if r.case.startswith("state_")]
    assert all(r.error["continue_outputs_equal"] and r.error["continue_caches_equal"] for r in state)
    assert data["state"]["bytes"] == sum(state[0].extra["bytes_by_kind"].values())
    assert list((tmp_path / "profiles").rglob("state_restore_ctx256__before.json"))
    assert "bit-equal after restore: True" in capsys.readouterr().out


def test_the_equality_check_can_fail():
    torch.manual_seed(0)
    cfg = bench_h2d.K3Config.tiny()
    layers = bench_h2d._layers(cfg, 1, 1, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(3)
    cache = bench_h2d._prefill(layers, 70, 64, gen, torch.float32)
    good = restore(save(cache, 0, pin=False))
    assert bench_h2d._check_equal(cache, good, layers, 2, gen, torch.float32)["restored_equal"]
    bad = restore(save(cache, 0, pin=False))
    bad.layers[0].state[0, 0, 0, 0] += 1e-6   # one value of the KDA state off
    with pytest.raises(bench.CheckFailed, match="restored cache differs"):
        bench_h2d._check_equal(cache, bad, layers, 2, gen, torch.float32)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="sizes must hold positive byte counts"):
        bench_h2d.copy_records((0,), device="cpu")
