"""`python -m k3lab.parallel.check`: exit 0 on a match, 1 on a mismatch, 2 when it cannot run."""

import sys

import torch

from k3lab.parallel import check, dcp


def test_dcp_check_passes_and_prints_errors_and_bytes(capsys):
    code = check.main(
        ["dcp", "--world-size", "3", "--attention", "reference", "--tq", "2", "--interleave", "16"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "dcp check: 3 ranks" in out and out.count("ag_rs ") == 3 and out.count("a2a ") == 3
    assert "ag_rs: 3 collectives per layer and rank" in out and "a2a: 2 collectives" in out
    assert out.strip().endswith("OK")


def test_dcp_check_fails_on_a_wrong_merge(monkeypatch, capsys):
    real = dcp._merge_ag_rs

    def off_by_a_bit(*args):
        o, lse = real(*args)
        return o * 1.001, lse

    monkeypatch.setattr(dcp, "_merge_ag_rs", off_by_a_bit)
    # gloo ranks of one thread are forked, and forked ranks inherit the patch (spawned ones, NCCL's on a
    # machine of two GPUs, would import dcp afresh)
    code = check.main(["dcp", "--world-size", "2", "--attention", "reference", "--merge", "ag_rs",
                       "--backend", "gloo"])
    out = capsys.readouterr().out
    assert code == 1 and "MISMATCH" in out and "FAILED" in out


def test_dcp_check_refusals_exit_2(capsys):
    assert check.main(["dcp", "--world-size", "0"]) == 2
    assert "world_size must be a positive integer" in capsys.readouterr().err


def test_moe_check_missing_module_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "k3lab.parallel.moe_tail", None)
    assert check.main(["moe", "--world-size", "2"]) == 2
    assert "k3lab.parallel.moe_tail.run_check" in capsys.readouterr().err


def test_tolerances_cover_the_dtypes():
    assert set(check.TOLERANCE) == {"float32", "bfloat16", "float16"}
    assert all(hasattr(torch, k) for k in check.TOLERANCE)
