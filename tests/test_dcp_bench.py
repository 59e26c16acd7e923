"""The one-GPU DCP benchmark script runs end to end at smoke sizes (fp32, Triton's interpreter on a CPU)."""

import json

import pytest

from k3lab.parallel import bench_dcp


@pytest.mark.slow
def test_bench_smoke_writes_records_and_ratios(tmp_path, capsys):
    out = tmp_path / "dcp.json"
    assert bench_dcp.main(["--smoke", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    cases = {(r["case"], r["variant"]) for r in data["records"]}
    assert ("local_tp8_B2_L128", "after") in cases and ("local_dcp8_B2_L128", "after") in cases
    assert ("merge_N8_B2", "before") in cases and ("merge_N8_B2", "after") in cases
    assert all(r["error"]["max_rel"] < 1e-3 for r in data["records"])  # every case was checked first
    assert [r["batch"] for r in data["local_ratio"]] == [2]
    assert "DCP8/TP8" in capsys.readouterr().out
