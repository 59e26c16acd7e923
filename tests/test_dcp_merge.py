"""merge_partials: the log-sum-exp merge of partial attentions, torch and Triton (interpreter on CPU)."""

import pytest
import torch

from k3lab.ops.mla_decode.merge import merge_partials
from k3lab.parallel import dcp

# Triton runs on the GPU when there is one, on CPU tensors in its interpreter otherwise
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _attention(q, rows):
    """Softmax attention of q [M, D] over rows [L, D] (values: the rows), fp64: (o, lse)."""
    s = q @ rows.T
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ rows, lse


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_two_shards_by_hand_equal_attention_over_both(impl):
    g = torch.Generator().manual_seed(0)
    q, rows = torch.randn(6, 64, generator=g, dtype=torch.float64), torch.randn(23, 64, generator=g,
                                                                                dtype=torch.float64)
    whole = _attention(q, rows)
    a, b = _attention(q, rows[::2]), _attention(q, rows[1::2])  # the interleave-1 split over two ranks
    o_parts, lse_parts = torch.stack([a[0], b[0]]).to(DEV), torch.stack([a[1], b[1]]).to(DEV)
    o, lse = merge_partials(o_parts.float(), lse_parts.float(), impl)
    assert torch.allclose(o.double().cpu(), whole[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(lse.double().cpu(), whole[1], rtol=1e-6, atol=1e-5)
    o64, lse64 = merge_partials(o_parts, lse_parts, impl)
    assert o64.dtype == lse64.dtype == torch.float64
    assert torch.allclose(o64.cpu(), whole[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_empty_shards(impl):
    N, shape = 4, (2, 3, 512)
    o = torch.randn(N, *shape)
    lse = torch.randn(N, *shape[:-1])
    # one query: every shard empty; another: only shard 2 holds positions; o of empty shards is NaN
    lse[:, 0, 0] = float("-inf")
    o[:, 0, 0] = float("nan")
    lse[[0, 1, 3], 1, 2] = float("-inf")
    o[[0, 1, 3], 1, 2] = float("nan")
    out, out_lse = merge_partials(o.to(DEV), lse.to(DEV), impl)
    out, out_lse = out.cpu(), out_lse.cpu()
    assert not torch.isnan(out).any() and not torch.isnan(out_lse).any()
    assert (out[0, 0] == 0).all() and out_lse[0, 0] == float("-inf")
    assert torch.allclose(out[1, 2], o[2, 1, 2], atol=1e-6) and torch.allclose(out_lse[1, 2], lse[2, 1, 2])
    ref_l = torch.logsumexp(lse, 0)
    ok = torch.isfinite(ref_l)
    assert torch.allclose(out_lse[ok], ref_l[ok], atol=1e-6)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_one_piece_and_all_empty(impl):
    o, lse = torch.randn(1, 5, 512, device=DEV), torch.randn(1, 5, device=DEV)
    out, out_lse = merge_partials(o, lse, impl)
    assert torch.allclose(out, o[0], atol=1e-6) and torch.allclose(out_lse, lse[0])
    out, out_lse = merge_partials(torch.zeros(3, 5, 512, device=DEV),
                                  torch.full((3, 5), float("-inf"), device=DEV),
                                  impl)
    assert (out == 0).all() and torch.isneginf(out_lse).all()


def test_triton_equals_torch_on_strided_pieces_and_bf16():
    g = torch.Generator().manual_seed(1)
    packed = torch.randn(8, 2, 3, 4, 514, generator=g).to(DEV)  # the a2a layout: 512 values + lse columns
    o, lse = packed[..., :512], packed[..., 512]
    a, b = merge_partials(o, lse, "torch"), merge_partials(o, lse, "triton")
    assert torch.allclose(a[0], b[0], atol=1e-6) and torch.allclose(a[1], b[1], atol=1e-6)
    ob = o.to(torch.bfloat16)
    a, b = merge_partials(ob, lse, "torch"), merge_partials(ob, lse, "triton")
    assert a[0].dtype == b[0].dtype == torch.bfloat16 and a[1].dtype == torch.float32
    assert torch.allclose(a[0].float(), b[0].float(), atol=1e-2)


def test_dcp_reexports_the_merge_and_bad_arguments_are_named():
    assert dcp.merge_partials is merge_partials
    with pytest.raises(ValueError, match="backend must be one of"):
        merge_partials(torch.zeros(2, 3, 8), torch.zeros(2, 3), "cuda")
    with pytest.raises(ValueError, match=r"lse_parts must be \[N, ...\] = \(2, 3\)"):
        merge_partials(torch.zeros(2, 3, 8), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="o_parts must be a tensor"):
        merge_partials(torch.zeros(8), torch.zeros(()))
    with pytest.raises(ValueError, match="o_parts must be a floating-point tensor, got torch.int32"):
        merge_partials(torch.zeros(2, 3, 8, dtype=torch.int32), torch.zeros(2, 3))


def test_triton_with_cpu_tensors_and_no_interpreter_is_refused_by_name(monkeypatch):
    """On a GPU machine (Triton's interpreter off) CPU tensors cannot reach a compiled Triton kernel:
    a refusal naming the backend and what to do, before any launch."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine answers
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here: cpu tensors and TRITON_INTERP"):
        merge_partials(torch.randn(2, 3, 8), torch.randn(2, 3), "triton")
    o, lse = merge_partials(torch.randn(2, 3, 8), torch.randn(2, 3), "torch")  # the torch one still runs
    assert o.shape == (3, 8) and lse.shape == (3,)
