"""The ceilings probe (k3lab.studies.ceilings): its checks fail on a wrong copy or product, its figures are
the records' arithmetic, its committed records are the ones the rooflines read, and without a GPU it
launches nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from k3lab import bench
from k3lab.profiling import roofline as rl
from k3lab.studies import ceilings

H100 = Path(__file__).resolve().parents[1] / "profiles" / "nvidia-h100-80gb-hbm3" / ceilings.NAME


def test_figures_are_bytes_and_flops_over_time():
    assert ceilings.bandwidth_tbs(1e12, 1e6) == pytest.approx(2.0)  # 1 TB read + 1 TB written in 1 s
    assert ceilings.matmul_tflops(1000, 2.0) == pytest.approx(2e9 / 2e-6 / 1e12)
    for bad in (0, -1, True, "1", None):
        with pytest.raises(ValueError, match="nbytes"):
            ceilings.bandwidth_tbs(bad, 1.0)
        with pytest.raises(ValueError, match="median_us"):
            ceilings.matmul_tflops(8, bad)


def test_cpu_records_carry_the_figures_of_their_own_timing():
    c = ceilings.measure_copy(1 << 12, device="cpu", repeats=3)
    assert (c.study, c.case, c.variant) == (ceilings.NAME, "copy_4096B", "reference")
    assert c.extra["bandwidth_tbs"] == pytest.approx(ceilings.bandwidth_tbs(1 << 12, c.median_us))
    assert "measured" in c.extra["bandwidth_how"]
    m = ceilings.measure_matmul(48, device="cpu", repeats=3)
    assert (m.case, m.shape) == ("matmul_bf16_48", {"m": 48, "n": 48, "k": 48})
    assert m.extra["matmul_tflops"] == pytest.approx(ceilings.matmul_tflops(48, m.median_us))
    # what the roofline reads from them: the matrix rate, and the copy as a measured bandwidth
    c = rl.ceilings("nvidia-h200", records=[c, m])
    assert c.matrix_tflops == pytest.approx(m.extra["matmul_tflops"]) and "probe" in c.matrix_source
    assert c.bandwidth_source.startswith("measured")


def test_a_wrong_product_fails_its_check():
    def off_by_a_column(a, b):
        return torch.roll(a @ b, 1, dims=1)

    with pytest.raises(bench.CheckFailed, match="product"):
        ceilings.measure_matmul(32, device="cpu", repeats=1, product=off_by_a_column)

    def fp8_rounded(a, b):  # the right product, rounded to a coarser format than bf16 allows
        return (a @ b).to(torch.float8_e5m2).to(torch.bfloat16)

    with pytest.raises(bench.CheckFailed):
        ceilings.measure_matmul(32, device="cpu", repeats=1, product=fp8_rounded)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="nbytes"):
        ceilings.measure_copy(0, device="cpu")
    with pytest.raises(ValueError, match="repeats"):
        ceilings.measure_matmul(8, device="cpu", repeats=1.5)
    with pytest.raises(ValueError, match="device"):
        ceilings.measure_copy(8, device="abacus")
    with pytest.raises(ValueError, match="case"):
        ceilings.measure_case("copy_2GiB")
    with pytest.raises(ValueError, match="cases must be among"):
        ceilings.run(cases=["copy_2GiB"])


def test_without_a_gpu_nothing_is_launched(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run() would measure it")
    assert ceilings.run() == []
    assert "no GPU here" in capsys.readouterr().out
    assert ceilings.main([]) == 0


def test_committed_records_are_the_probes_cases_and_format():
    rows = [d for f in sorted(H100.glob("*.json")) for d in json.loads(f.read_text())]
    assert sorted(d["case"] for d in rows) == sorted(ceilings.CASES)
    recs = [bench.Record.from_dict(d) for d in rows]
    df = ceilings.table(recs)
    by = dict(zip(df["case"], df["figure"]))
    # each figure is its record's own arithmetic on its record's own time
    med = {r.case: r.median_us for r in recs}
    assert by["copy_1GiB"] == pytest.approx(ceilings.bandwidth_tbs(ceilings.COPY_BYTES, med["copy_1GiB"]))
    assert by["matmul_bf16_8192"] == pytest.approx(ceilings.matmul_tflops(ceilings.MATMUL_N,
                                                                          med["matmul_bf16_8192"]))
    assert ceilings.summary_text(recs).count("NVIDIA H100") == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path of the probe needs a GPU")
def test_gpu_path_checks_and_times_small_cases(tmp_path):
    c = ceilings.measure_copy(1 << 20, device="cuda", repeats=3)
    m = ceilings.measure_matmul(512, device="cuda", repeats=3)
    assert c.extra["bandwidth_tbs"] > 0 and m.extra["matmul_tflops"] > 0
    assert c.device == m.device != "cpu"
    with pytest.raises(bench.CheckFailed):
        ceilings.measure_matmul(256, device="cuda", repeats=1,
                                product=lambda a, b: torch.roll(a @ b, 1, dims=1))
