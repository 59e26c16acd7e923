"""The packing dispatcher: before packs on every call, after only where the kernel reads the copy."""

import pytest
import torch

from k3lab.config import K3Config
from k3lab.model import K3Model, init_weights
from k3lab.ops import packed_matmul as pm


@pytest.fixture
def pack_calls(monkeypatch):
    calls = []
    real = pm.pack

    def counting_pack(x):
        calls.append(tuple(x.shape))
        return real(x)

    monkeypatch.setattr(pm, "pack", counting_pack)
    return calls


@pytest.mark.parametrize("k,specialized", [(128, False), (256, True), (512, True), (300, False)])
def test_branch_choice_and_packing(pack_calls, k, specialized):
    x, w = torch.randn(3, k, dtype=torch.float64), torch.randn(7, k, dtype=torch.float64)
    assert pm.specialized_applies(x, w) is specialized
    ref = x @ w.t()
    torch.testing.assert_close(pm.dispatch_before(x, w), ref)
    assert len(pack_calls) == 1  # before packs whatever it chooses
    torch.testing.assert_close(pm.dispatch_after(x, w), ref)
    assert len(pack_calls) == (2 if specialized else 1)  # after packs only for the specialized kernel


def test_rows_carry_the_policies_and_the_reference(pack_calls):
    """The table's rows: 'dispatch' carries both policies, 'torch' the plain product; the face calls the
    row it picks and packs only as the policy says."""
    x, w = torch.randn(3, 256, dtype=torch.float64), torch.randn(5, 256, dtype=torch.float64)
    ref = x @ w.t()
    assert pm.VARIANTS == {"before": pm.dispatch_before, "after": pm.dispatch_after}
    assert not hasattr(pm, "POLICIES")  # one name for the axis
    for variant in pm.VARIANTS:
        torch.testing.assert_close(pm.packed_linear(x, w, variant=variant), ref)
        torch.testing.assert_close(pm.packed_linear(x, w, variant=variant, backend="torch"), ref)
    assert len(pack_calls) == 2  # the two dispatcher calls, none by the reference row
    with pytest.raises(ValueError, match="variant must be one of"):
        pm.packed_linear(x, w, variant="middle")


def test_pack_is_one_private_copy():
    x = torch.randn(2, 3, 128)
    p = pm.pack(x)
    assert p.shape == (6, 128) and p.data_ptr() != x.data_ptr()
    assert torch.equal(p, x.reshape(6, 128))


def _decode_profile(model, ids, cache):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out, _ = model.decode(ids, cache)
    names = [e.name for e in prof.events()]
    return out, names.count("k3lab::pack_activation"), names.count("aten::clone")


def test_decode_step_shows_one_unused_copy_per_kda_layer_before_and_none_after():
    cfg = K3Config.tiny()
    model = init_weights(K3Model(cfg), seed=1)
    _, cache = model.prefill(torch.randint(0, cfg.vocab_size, (2, 5)))
    ids = torch.randint(0, cfg.vocab_size, (2, 1))
    ref, _ = model.decode(ids, cache)
    assert pm.install(model, "before") == cfg.num_kda_layers
    out_b, packs_b, clones_b = _decode_profile(model, ids, cache)
    assert pm.install(model, "after") == cfg.num_kda_layers
    out_a, packs_a, clones_a = _decode_profile(model, ids, cache)
    assert torch.equal(out_b, ref) and torch.equal(out_a, ref)  # the copy never changed the result
    assert packs_b == cfg.num_kda_layers and packs_a == 0
    assert clones_b - clones_a == cfg.num_kda_layers


def test_bad_policy_is_named():
    with pytest.raises(ValueError, match="policy"):
        pm.install(torch.nn.Linear(2, 2), "sometimes")
    with pytest.raises(ValueError, match="policy"):
        pm.DispatchedLinear(torch.nn.Linear(2, 2, bias=False), "never")
