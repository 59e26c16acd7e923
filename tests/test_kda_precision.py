"""The precision study of KDA's 64 x 64 within-chunk inverse (k3lab.studies.kda_precision), on CPU
with fixed seeds."""

import pytest
import torch

from k3lab import bench
from k3lab.nn.kda import chunk_inverse
from k3lab.studies import kda_precision as kp


def test_subtraction_example_is_computed():
    rows = {r["inputs"]: r for r in kp.subtraction_example()}
    assert rows["fp32"]["a - b (fp32)"] == 0.5
    assert rows["bf16"]["a"] == 256.0  # 256.5 rounds to 256 in bf16
    assert rows["bf16"]["a - b (fp32)"] == 0.0
    # and a value bf16 can hold survives: the example is about rounding, not subtraction
    assert {r["inputs"]: r for r in kp.subtraction_example(258.0, 256.0)}["bf16"]["a - b (fp32)"] == 2.0


@pytest.mark.parametrize("kind", kp.KINDS)
def test_blocked_inverse_is_the_inverse(kind):
    x = kp.make_inputs(kind, n_chunks=2, heads=1, seed=3)
    A = kp.prepare_chunks(x["q"], x["k"], x["v"], x["g"], x["beta"], dtype=torch.float64).A
    R64 = kp.blocked_inverse(A, "fp64")
    bench.check(R64, chunk_inverse(A), dtype=torch.float64, name="R fp64")
    eye = torch.eye(64, dtype=torch.float64)
    assert torch.allclose((eye + A) @ R64, eye.expand_as(A), atol=1e-10)
    # fp32 inputs and accumulation: fp32-level error; bf16 inputs: far worse on the adversarial chunks
    R32 = kp.blocked_inverse(A.float(), "fp32")
    bench.check(R32, chunk_inverse(A), dtype=torch.float32, name="R fp32")


def test_blocked_inverse_rejects_bad_arguments():
    with pytest.raises(ValueError, match="precision"):
        kp.blocked_inverse(torch.zeros(64, 64), "fp8")
    with pytest.raises(ValueError, match="A must be"):
        kp.blocked_inverse(torch.zeros(60, 60))
    with pytest.raises(ValueError, match="kind"):
        kp.make_inputs("gentle")


def test_chunk_walk_equals_reference():
    figs = kp.check_pipeline(n_chunks=3, heads=2, seed=1)
    assert figs["o"]["max_rel"] < 1e-9 and figs["state"]["max_rel"] < 1e-9


def test_fp32_inputs_beat_bf16_inputs_on_adversarial_chunks():
    kw = dict(n_chunks=8, heads=1, seed=0)
    for rounded in (True, False):
        fp32 = kp.measure("adversarial", "fp32", round_inverse=rounded, **kw)
        bf16_in = kp.measure("adversarial", "bf16_in", round_inverse=rounded, **kw)
        for part in ("o", "state"):
            assert fp32[part]["rel_l2"] < bf16_in[part]["rel_l2"], (part, rounded)
        assert fp32["inverse"]["rel_l2"] < 1e-5 < 1e-3 < bf16_in["inverse"]["rel_l2"]
    # with the finished inverse left in fp32 the gap is orders of magnitude
    assert fp32["o"]["rel_l2"] * 100 < bf16_in["o"]["rel_l2"]
    assert fp32["condition"] > 50  # nearly parallel keys, beta ~ 1: (I + A) is ill-conditioned


def test_real_looking_gates_are_well_conditioned():
    m = kp.measure("k3_gate", "fp32", round_inverse=True, n_chunks=4, heads=1, seed=0)
    assert m["condition"] < 10
    assert m["o"]["rel_l2"] < 1e-3 and m["state"]["rel_l2"] < 1e-3


def test_run_makes_records():
    recs = kp.run(cases=["adversarial", "adversarial.unrounded"], n_chunks=4, heads=1)
    assert [(r.case, r.variant) for r in recs] == [("adversarial", "before"), ("adversarial", "after"),
                                                   ("adversarial.unrounded", "before"),
                                                   ("adversarial.unrounded", "after")]
    table = kp.summary(recs)
    assert (table["precision"] == ["bf16_in", "fp32", "bf16_in", "fp32"]).all()
    with pytest.raises(ValueError, match="cases"):
        kp.run(cases=["nope"])
