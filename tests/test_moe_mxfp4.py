"""The MXFP4 routed experts (k3lab.ops.moe_experts.mxfp4_kernels): against the fp64 product of the
dequantized experts on fresh random inputs, the same bits run to run, edge tiles, bad input refused by
name before any kernel, and the bytes floor. Tensors follow the GPU where there is one (compiled
kernels), else Triton's interpreter runs them on the CPU (small shapes)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from k3lab.ops.moe_experts import mxfp4
from k3lab.ops.moe_experts import mxfp4_kernels as mk

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(seed, N=1, k=4, E=6, L=64, F=64, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, F, L, generator=g) * 0.2
    w3 = torch.randn(E, F, L, generator=g) * 0.2
    w2 = torch.randn(E, L, F, generator=g) * 0.2
    z = torch.randn(N, L, generator=g).to(dtype)
    scores = torch.rand(N, E, generator=g)
    idx = scores.topk(k, dim=1).indices.to(torch.int32)
    weights = torch.rand(N, k, generator=g)
    weights = weights / weights.sum(1, keepdim=True)
    q = [mk.quantize_experts(w.to(DEV)) for w in (w1, w3, w2)]
    return (z.to(DEV), weights.to(DEV), idx.to(DEV), *q)


def _close(y, ref):
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double() - ref).abs().max().item()
    assert err <= 2e-5 * max(1.0, ref.abs().max().item()), err  # fp32 accumulation against fp64


@pytest.mark.parametrize("down_form", mk.DOWN_FORMS)
@pytest.mark.parametrize("N, k", [(1, 4), (3, 2)])
def test_matches_fp64_product_and_is_bit_stable(N, k, down_form):
    args = _case(10 + N, N=N, k=k)
    codes = torch.cat([w.codes().reshape(-1) for w in args[3:]])
    assert len(torch.unique(codes)) == 15          # every E2M1 code and sign (quantize writes no -0)
    y = mk.mxfp4_experts(*args, down_form=down_form)
    ref = mk.reference(*args)
    _close(y, ref)
    assert ref.abs().max() > 0.05                  # a product that would show a wrong code or scale
    assert torch.equal(y, mk.mxfp4_experts(*args, down_form=down_form))  # the same bits run to run


@pytest.mark.parametrize("down_form", mk.DOWN_FORMS)
def test_bf16_input_edge_tiles_and_wide_scales(down_form):
    # L = 96, F = 96: the 64-value steps end in a half-used step (the flat form's steps of two blocks
    # straddle two pairs: 3 blocks a pair); 3 experts of a column block of 16 hit the column mask;
    # scales spread over 2^-6 .. 2^4 by expert
    z, weights, idx, w1, w3, w2 = _case(21, N=2, k=3, E=5, L=96, F=96, dtype=torch.bfloat16)
    spread = torch.pow(2.0, torch.arange(-6, 4, 2.0, device=DEV))[:, None, None]
    w1, w3, w2 = (mk.quantize_experts(w.dequantize() * spread) for w in (w1, w3, w2))
    args = (z, weights, idx, w1, w3, w2)
    y = mk.mxfp4_experts(*args, up_blocks=(16, 64, 4), down_blocks=(32, 64, 4), down_form=down_form)
    _close(y, mk.reference(*args))


def test_the_flat_down_form_uses_every_pair_and_its_weight():
    # each pair's routing weight scaled apart: a flat walk that took the wrong pair's expert, weight or h
    # for a block would move y far past _close's bound
    z, weights, idx, w1, w3, w2 = _case(8, N=2, k=4, E=7, L=64, F=96)
    weights = weights * torch.tensor([1.0, 10.0, 100.0, 1000.0], device=DEV)
    args = (z, weights, idx, w1, w3, w2)
    ref = mk.reference(*args)
    _close(mk.mxfp4_experts(*args, down_form="flat", down_blocks=(16, 128, 4)), ref)
    swapped = idx.flip(1).contiguous()
    assert (mk.reference(z, weights, swapped, w1, w3, w2) - ref).abs().max() > 1e-2 * ref.abs().max()


def test_a_wrong_code_or_scale_is_caught():
    args = list(_case(5))
    y_good = mk.reference(*args)
    w2 = args[5]
    bad = mxfp4.Mxfp4Weight(w2.packed, w2.scale_exp.clone())
    bad.scale_exp.view(-1)[: w2.scale_exp.numel() // 2] += 1        # half the blocks twice too big
    args[5] = bad
    y = mk.mxfp4_experts(*args)
    err = (y.double() - y_good).abs().max().item()
    assert err > 1e-2, err   # the check in _close would fail on such a kernel


def test_empty_batch():
    z, weights, idx, *w = _case(2)
    y = mk.mxfp4_experts(z[:0], weights[:0], idx[:0], *w)
    assert y.shape == (0, 64)


def _refused(exc, says, *args, **kw):
    with pytest.raises(exc, match=says):
        mk.mxfp4_experts(*args, **kw)


def test_bad_input_refused_by_name():
    z, weights, idx, w1, w3, w2 = _case(3)
    good = (z, weights, idx, w1, w3, w2)
    _refused(ValueError, r"z must be \[N, L=64\]", z[:, :32], *good[1:])
    _refused(ValueError, "z must be float32, float16 or bfloat16", z.double(), *good[1:])
    _refused(TypeError, "weights must be a torch.Tensor", z, weights.tolist(), idx, w1, w3, w2)
    _refused(TypeError, "w1 must be an Mxfp4Weight", z, weights, idx, w1.dequantize(), w3, w2)
    narrow = mk.quantize_experts(torch.zeros(6, 64, 32, device=DEV))
    _refused(ValueError, "w2 must be an expert stack", z, weights, idx, w1, w3, narrow)
    _refused(ValueError, "idx values must be expert numbers", z, weights, idx + 10, w1, w3, w2)
    _refused(ValueError, "idx must be int32", z, weights, idx.float(), w1, w3, w2)
    _refused(ValueError, "idx and weights", z, weights[:, :2], idx, w1, w3, w2)
    _refused(ValueError, "up_blocks", *good, up_blocks=(16, 16, 4))
    _refused(ValueError, "down_blocks", *good, down_blocks=(12, 64, 4))
    _refused(ValueError, "down_form: expected one of", *good, down_form="tiles")
    with pytest.raises(ValueError, match="w must be a stack"):
        mk.quantize_experts(torch.zeros(4, 32))


def test_the_mxfp4_rows_carry_the_forms_and_the_face_calls_the_chosen_one():
    """moe_experts' MXFP4 rows: each carries its form as `mxfp4` (none an `after`, so the bf16 face never
    picks one), the face picks by the tokens (GEMV for one, grouped first for more where it runs) and the
    forms agree with the fp64 product."""
    from k3lab.ops import BackendUnavailable, moe_experts

    table = moe_experts.BACKENDS
    forms = {"mxfp4_gemv": mk.mxfp4_experts, "mxfp4_grouped": mk.mxfp4_experts_grouped}
    for name, fn in forms.items():
        assert table[name].mxfp4 is fn and not table[name].provides("after")
    assert [r.name for r in table.ranked(DEV, None, 1, need="mxfp4")][0] == "mxfp4_gemv"
    assert [r.name for r in table.ranked(DEV, None, 4, need="mxfp4")][0] == "mxfp4_grouped"
    assert table.pick(None, DEV, torch.float32, need="after").name in ("triton", "torch")
    args = _case(31, N=3, k=2)
    ref = mk.reference(*args)
    for backend in ("mxfp4_gemv", "mxfp4_torch"):
        _close(moe_experts.mxfp4_routed_experts(*args, backend=backend), ref)
    ok, _ = table.check("mxfp4_grouped", DEV, torch.float32, 3)
    assert (table.pick(None, DEV, torch.float32, 3, need="mxfp4").name == "mxfp4_grouped") == ok
    with pytest.raises(BackendUnavailable, match="provides no after"):
        moe_experts.routed_experts(*args[:3], *(w.dequantize() for w in args[3:]), backend="mxfp4_gemv")
    with pytest.raises(TypeError, match="w1 must be an Mxfp4Weight"):
        moe_experts.mxfp4_routed_experts(*args[:3], args[3].dequantize(), *args[4:], backend="mxfp4_torch")


def test_expert_bytes_floor():
    # K3 at TP8 (F = 384 of 3072, L = 3584), one token, 16 experts: 3 matrices x 4.25 bits a weight
    got = mk.expert_bytes(1, 16, 3584, 384)
    assert got == 16 * 3 * 384 * 3584 * 4.25 / 8 == 16 * 3 * mxfp4.nbytes(384, 3584)
    assert mk.expert_bytes(1, 16, 3584, 384, bytes_per_weight=2) == 16 * 3 * 384 * 3584 * 2
    assert got / mk.expert_bytes(1, 16, 3584, 384, bytes_per_weight=2) == 4.25 / 16
    with pytest.raises(ValueError, match="intermediate"):
        mk.expert_bytes(1, 16, 3584, 0)
    with pytest.raises(ValueError, match="bytes_per_weight"):
        mk.expert_bytes(1, 16, 3584, 384, bytes_per_weight=0)


# ------------------------------------------------------------------------------------------ grouped form

GROUPED_OK, GROUPED_WHY = mk.grouped_runs_here()


@pytest.mark.skipif(not GROUPED_OK, reason=f"grouped dot_scaled form: {GROUPED_WHY}")
def test_grouped_dot_scaled_matches_fp64_with_mxfp8_activations():
    args = _case(31, N=8, k=4, E=6, L=256, F=128)
    y = mk.mxfp4_experts_grouped(*args)
    ref = mk.reference(*args, mx_activations=True)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.double().cpu() - ref.cpu()).abs().max().item()
    assert err <= 5e-3 * ref.abs().max().item(), err   # fp32 h vs fp64 h may round to another E4M3 value
    assert torch.equal(y, mk.mxfp4_experts_grouped(*args))
    exact = mk.reference(*args)   # without MXFP8 activations: a few percent apart, not more
    assert (y.double().cpu() - exact.cpu()).norm() <= 0.1 * exact.norm()


def test_grouped_form_says_what_runs_where_it_cannot():
    args = _case(32, L=128, F=128)
    if GROUPED_OK:
        with pytest.raises(ValueError, match="blocks"):
            mk.mxfp4_experts_grouped(*args, blocks=(16, 64, 32, 4))   # K step below 128
        return
    with pytest.raises(RuntimeError, match="GEMV form"):
        mk.mxfp4_experts_grouped(*args)


@pytest.mark.parametrize("arch, interpreted, gpu, ok", [
    ("sm_90", False, True, True), ("gfx950", False, True, True), ("gfx942", False, True, False),
    (None, True, False, False)])
def test_grouped_runs_here_says_why_in_every_case(monkeypatch, arch, interpreted, gpu, ok):
    """Every answer carries a reason (a Backends table shows it; an empty one fails its table test),
    and the form is offered only where Triton compiles (not in its interpreter) for a target that
    lowers tl.dot_scaled."""
    from types import SimpleNamespace

    from k3lab import env

    monkeypatch.setattr(env, "triton_interpreted", lambda: interpreted)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(env, "detect", lambda: SimpleNamespace(arch=arch))
    got, why = mk.grouped_runs_here()
    assert got is ok and isinstance(why, str) and why, (arch, got, why)
    if ok:
        assert "tl.dot_scaled" in why and arch in why
    elif gpu:
        assert "GEMV form" in why and arch in why


def test_mx_fp8_rounding_rule():
    x = torch.tensor([[448.0 * 4, 1.0, -3.0] + [0.0] * 29, [0.0] * 32], dtype=torch.float64)
    q = mk.mx_fp8(x)
    assert q[0, 0] == 448.0 * 4 and q[0, 1] == 1.0 and q[0, 2] == -3.0 and not q[1].any()
    g = torch.Generator().manual_seed(4)
    r = torch.randn(4, 64, generator=g, dtype=torch.float64)
    rel = ((mk.mx_fp8(r) - r).abs() / r.abs()).max().item()
    assert 0 < rel <= 2 ** -4 + 1e-12   # E4M3: 3 mantissa bits; every block's amax fits under 448 x scale


def test_gfx950_compiles_the_grouped_form_to_the_scaled_mfma(tmp_path):
    """Compiled only (Triton's AMD backend on this machine, no GPU): the 64-token case's two grouped
    launches are v_mfma_scale instructions on gfx950, without spills."""
    out = tmp_path / "isa.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-m", "k3lab.isa", "--target", "gfx950", "--case",
                           "moe_experts.mxfp4_t64", "--json", str(out), "--workers", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    kernels = {r["kernel"].rsplit(".", 1)[-1]: r for r in rows}
    assert set(kernels) == {"_scaled_up_kernel", "_scaled_down_kernel"}
    for r in kernels.values():
        scaled = sum(n for name, n in r["matrix"].items() if "mfma_scale" in name)
        assert r["ok"] and scaled >= 1 and r["spills"] == 0, r
