"""The experimental spread AttnRes kernel (one token's row over several programs) vs the references.
On CPU (Triton's interpreter) a row is one program; several programs per row need a GPU."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on CPU before triton loads)
from attn_res_cases import make_inputs, run_beside_before
from k3lab.ops import attn_res_norm as arn
from k3lab.ops import attn_res_spread as spread

pytest.importorskip("triton")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton launches need GPU tensors on a GPU machine


def _inputs(T, D, dtype, seed=0, device=DEVICE):
    return make_inputs(T, D, dtype, seed=seed, device=device)


def _both(x, n_blocks, push, with_delta, **kw):
    return run_beside_before(spread.spread_after, x, n_blocks, push, with_delta, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_blocks,push,with_delta", [(0, False, True), (1, True, True), (4, False, False),
                                                      (8, False, True)])
def test_one_program_per_row_matches_the_unfused_sequence(dtype, n_blocks, push, with_delta):
    x = _inputs(3, 130, dtype, seed=n_blocks)
    ya, yb, (pa, ba), (pb, bb) = _both(x, n_blocks, push, with_delta, chunk=256)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ya.float(), yb.float(), rtol=tol, atol=tol)
    assert torch.equal(pa, pb) and torch.equal(ba, bb)  # the persistent state, bit for bit


def test_a_wrong_source_count_is_caught():
    """The comparison can fail: the spread kernel mixing one block fewer than `before` differs."""
    x = _inputs(2, 64, torch.float32, seed=5)
    a = spread.spread_after(x["prefix"].clone(), x["delta"], x["blocks"].clone(), 4, x["res_norm_w"],
                            x["res_proj_w"], x["next_norm_w"], chunk=64)
    b = arn.before(x["prefix"].clone(), x["delta"], x["blocks"].clone(), 5, x["res_norm_w"], x["res_proj_w"],
                   x["next_norm_w"])
    assert not torch.allclose(a, b, rtol=1e-3, atol=1e-3)


def test_every_call_leaves_the_barrier_words_ready_for_the_next():
    """Each call passes two barriers per token: every arrival count is back to 0 after it and the
    sense has flipped twice, so graph replays need no reset."""
    x = _inputs(3, 64, torch.float32, seed=11)
    words = spread.sync_words(x["prefix"].device, 3)
    words[1:6:2] = torch.tensor([0, 1, 0], dtype=words.dtype)  # any starting sense works
    start = words[1:6:2].clone()
    for _ in range(2):
        ya, yb, _, _ = _both(x, 4, False, True, chunk=64)
        torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
        assert torch.count_nonzero(words[0:6:2]) == 0
        assert torch.equal(words[1:6:2], start)


@pytest.mark.parametrize("kw,match", [(dict(chunk=48), "chunk"), (dict(chunk=8), "chunk"),
                                      (dict(chunk=16), "programs")])
def test_bad_chunks_are_refused_by_name(kw, match):
    x = _inputs(1, 512, torch.float32)
    with pytest.raises(ValueError, match=match):
        spread.spread_after(x["prefix"], x["delta"], x["blocks"], 2, x["res_norm_w"], x["res_proj_w"],
                            x["next_norm_w"], **kw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="several programs per row wait for each other: "
                    "Triton's interpreter runs programs one after another, so this needs a GPU")
@pytest.mark.parametrize("chunk,warps", [(1024, 8), (512, 4)])
@pytest.mark.parametrize("tokens,n_blocks", [(1, 8), (1, 1), (8, 8), (8, 4)])
def test_spread_rows_on_the_gpu_match_the_unfused_sequence(chunk, warps, tokens, n_blocks):
    x = _inputs(tokens, 7168, torch.bfloat16, seed=tokens + n_blocks, device="cuda")
    for _ in range(3):  # repeated calls reuse the barrier words
        ya, yb, (pa, ba), (pb, bb) = _both(x, n_blocks, False, True, chunk=chunk, num_warps=warps)
        assert not torch.isnan(ya.float()).any(), "a barrier wait ran out"
        torch.testing.assert_close(ya.float(), yb.float(), rtol=1e-2, atol=1e-2)
        assert torch.equal(pa, pb) and torch.equal(ba, bb)
