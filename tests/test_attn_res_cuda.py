"""The CUDA AttnRes cluster kernel (kernels/attn_res_norm.cu, k3lab.ops.attn_res_norm.cuda): argument checks
everywhere,
results against the unfused sequence on a GPU. Its compilation for sm_90a and gfx90a/gfx940 is
checked by tests/test_kernels_build.py."""

import pytest
import torch

from attn_res_cases import make_inputs, run_beside_before
from k3lab.ops import _build
from k3lab.ops.attn_res_norm import cuda as arc

GPU = torch.cuda.is_available()


def _inputs(T, D, n_slots=9, seed=0, device="cpu", dtype=torch.bfloat16):
    return make_inputs(T, D, dtype, seed=seed, device=device, n_slots=n_slots)


def _call(x, n_blocks=4, **kw):
    return arc.cuda_after(x["prefix"], x["delta"], x["blocks"], n_blocks, x["res_norm_w"], x["res_proj_w"],
                          x["next_norm_w"], **kw)


@pytest.mark.parametrize("change,kw,match", [
    (dict(dtype=torch.float32), dict(), "bfloat16"),
    (dict(D=100), dict(), "multiple of 8"),
    (dict(D=9 * 1024), dict(), "at most 8192"),
    (dict(), dict(n_blocks=9, push_block=False), "n_blocks"),
])
def test_bad_arguments_are_refused_by_name(change, kw, match):
    x = _inputs(2, change.get("D", 64), n_slots=10, dtype=change.get("dtype", torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        _call(x, **kw)


def test_a_misaligned_row_start_is_refused():
    x = _inputs(2, 64)
    x["prefix"] = torch.zeros(2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64)  # starts 2 bytes in
    with pytest.raises(ValueError, match="16-byte"):
        _call(x)


@pytest.mark.skipif(GPU, reason="checks what a machine without a GPU says")
def test_without_a_gpu_it_says_so():
    with pytest.raises(_build.KernelUnavailable, match="GPU"):
        _call(_inputs(2, 64))


@pytest.mark.skipif(not GPU or not _build.clusters_available()[0],
                    reason="the cluster kernel runs on a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("D", [7168, 1000])
@pytest.mark.parametrize(
    "T,n_blocks,push,with_delta",
    [(1, 8, False, True), (1, 0, True, True), (8, 4, True, False), (3, 1, False, False)],
)
def test_on_the_gpu_matches_the_unfused_sequence(D, T, n_blocks, push, with_delta):
    x = _inputs(T, D, seed=T + n_blocks, device="cuda")
    ya, yb, (pa, ba), (pb, bb) = run_beside_before(arc.cuda_after, x, n_blocks, push, with_delta)
    torch.testing.assert_close(ya.float(), yb.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(pa, pb) and torch.equal(ba, bb), "persistent state not bit-exact"
