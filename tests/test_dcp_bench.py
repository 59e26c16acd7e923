"""The one-GPU DCP benchmark script runs end to end at smoke sizes: fp32 through Triton's interpreter on a
CPU, bf16 compiled on a GPU. The test checks what the script writes, never how fast anything ran."""

import json

import pytest

from k3lab import bench
from k3lab.parallel import bench_dcp


@pytest.mark.slow
def test_bench_smoke_writes_records_and_ratios(tmp_path, capsys):
    out = tmp_path / "dcp.json"
    assert bench_dcp.main(["--smoke", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cases = {(r["case"], r["variant"]) for r in data["records"]}
    assert ("local_tp8_B2_L128", "after") in cases and ("local_dcp8_B2_L128", "after") in cases
    assert ("merge_N8_B2", "before") in cases and ("merge_N8_B2", "after") in cases
    for r in data["records"]:  # checked first, within its dtype's bound (fp32 here, bf16 on a GPU)
        key, tol = bench.tolerance_for(r["dtype"])
        err = r["error"]
        assert err["dtype"] == key, (r["case"], err)
        assert err["max_rel"] <= tol.max_rel and err["rel_l2"] <= tol.rel_l2, (r["case"], err)
        assert r["median_us"] > 0
    [ratio] = data["local_ratio"]
    assert ratio["batch"] == 2 and ratio["ratio"] == pytest.approx(ratio["dcp8_us"] / ratio["tp8_us"])
    [merge] = data["merge"]
    assert merge["speedup"] == pytest.approx(merge["torch_us"] / merge["triton_us"])
    assert all(m["agrees"] for m in data["memory"]), data["memory"]  # measured on a GPU only
    assert "DCP8/TP8" in capsys.readouterr().out
