"""The one-GPU DCP benchmark runs end to end at smoke sizes: fp32 through Triton's interpreter on a CPU,
bf16 compiled on a GPU. The test checks what it returns and what `k3lab bench dcp --smoke` writes, never
how fast anything ran."""

import json

import pytest

from k3lab import bench, cli
from k3lab.studies.dcp import measure


@pytest.mark.follows_gpu  # the study puts its tensors on the GPU where there is one
@pytest.mark.slow
def test_bench_smoke_checks_records_and_ratios(capsys):
    data = measure.one_gpu(smoke=True)
    cases = {(r.case, r.variant) for r in data["records"]}
    assert ("local_tp8_B2_L128", "after") in cases and ("local_dcp8_B2_L128", "after") in cases
    assert ("merge_N8_B2", "before") in cases and ("merge_N8_B2", "after") in cases
    for r in data["records"]:  # checked first, within its dtype's bound (fp32 here, bf16 on a GPU)
        key, tol = bench.tolerance_for(r.dtype)
        err = r.error
        assert err["dtype"] == key, (r.case, err)
        assert err["max_rel"] <= tol.max_rel and err["rel_l2"] <= tol.rel_l2, (r.case, err)
        assert r.median_us > 0
    [ratio] = data["local_ratio"]
    assert ratio["batch"] == 2 and ratio["ratio"] == pytest.approx(ratio["dcp8_us"] / ratio["tp8_us"])
    [merge] = data["merge"]
    assert merge["speedup"] == pytest.approx(merge["torch_us"] / merge["triton_us"])
    assert all(m["agrees"] for m in data["memory"]), data["memory"]  # measured on a GPU only
    measure.print_summary(data)
    assert "DCP8/TP8" in capsys.readouterr().out


@pytest.mark.follows_gpu  # the study puts its tensors on the GPU where there is one
@pytest.mark.slow
def test_cli_smoke_writes_the_records(tmp_path, capsys):
    out = tmp_path / "dcp.json"
    assert cli.main(["bench", "dcp", "--smoke", "--json", str(out), "--out", str(tmp_path / "b")]) == 0
    rows = json.loads(out.read_text())
    assert {r["case"] for r in rows} >= {"local_tp8_B2_L128", "merge_N8_B2"}
    assert all(r["study"] == "dcp" for r in rows)
    assert "DCP8/TP8" in capsys.readouterr().out


def test_without_a_gpu_the_full_run_refuses_by_name():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="smoke=True"):
        measure.one_gpu()
