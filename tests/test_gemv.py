"""The one-row product kernel against torch in fp64, its weight wrapper, and its errors. On a CPU the
kernel runs in Triton's interpreter (set by `import k3lab` without a GPU); on a GPU, compiled."""

import pytest
import torch

import k3lab  # noqa: F401  (TRITON_INTERPRET=1 without a GPU)
from k3lab.ops import gemv as gv

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(DEV, dtype)
    x = torch.randn(1, k, generator=g).to(DEV, dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(1, 1), (5, 70), (33, 129), (64, 256)])
def test_matches_fp64_reference(n, k, dtype):
    x, w = _inputs(n, k, dtype, seed=n * k)
    y = gv.gemv(x, w, backend="triton")
    ref = x.double() @ w.double().t()
    assert y.dtype == dtype and y.shape == (1, n)
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < TOL[dtype], err


def test_row_strided_weight_and_the_wrapper():
    x, w_big = _inputs(40, 96, torch.float32, seed=5)
    w = w_big[:, :64]  # rows of stride 96: still contiguous rows
    y = gv.gemv(x[:, :64].contiguous(), w, backend="triton")
    torch.testing.assert_close(y, x[:, :64] @ w.t(), rtol=1e-5, atol=1e-5)
    gw = gv.GemvWeight(w_big)
    assert gw.shape == w_big.shape and gw.dtype == w_big.dtype
    torch.testing.assert_close(gw(x), x @ w_big.t(), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(3, 96, device=DEV)
    torch.testing.assert_close(gw(x3), x3 @ w_big.t())  # more rows: torch.matmul


def test_bad_input_names_the_argument(monkeypatch):
    x, w = _inputs(8, 16, torch.float32)
    for args, match in (((x.repeat(2, 1), w), "one row"), ((x[:, :8], w), r"x must be \[1, 16\]"),
                        ((x, torch.randn(16, 16, device=DEV).t()), "w must have a stride-1 last dim"),
                        ((x.double(), w.double()), "x must be float32, float16 or bfloat16"),
                        ((x.half(), w), "x must be float32, got torch.float16")):
        with pytest.raises(ValueError, match=match):
            gv.gemv(*args)
    with pytest.raises(ValueError, match="backend must be one of"):
        gv.gemv(x, w, backend="cutlass")
    monkeypatch.setenv(gv.BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match=gv.BACKEND_ENV):
        gv.gemv(x, w)
    monkeypatch.setenv(gv.BACKEND_ENV, "torch")
    torch.testing.assert_close(gv.gemv(x, w), x @ w.t())
    with pytest.raises(ValueError, match="weight must be"):
        gv.GemvWeight(torch.zeros(3))
    monkeypatch.delenv(gv.BACKEND_ENV)
    if DEV == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not gv.BACKENDS.check("triton", "cpu")[0]
        with pytest.raises(ValueError, match="cannot run here"):
            gv.gemv(x, w, backend="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="K3's widths and graph capture need a GPU")
@pytest.mark.parametrize("n,k", [(896, 7168), (1536, 32), (20480, 7168)])
def test_gpu_k3_widths_and_graph_capture(n, k):
    x, w = _inputs(n, k, torch.bfloat16, seed=1)
    y = gv.gemv(x, w)  # autotunes here, before the capture
    ref = x.double() @ w.double().t()
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2
    out = torch.empty_like(y)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(gv.gemv(x, w))
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(out, gv.gemv(x, w), rtol=0, atol=0)


def test_a_decode_step_with_gemv_projections_equals_the_matmul_step():
    from k3lab.engine import DecodeStep
    from k3lab.studies.decode_step import measure as sb

    ids = torch.tensor([[3]])
    out = {}
    for proj in ("bf16", "gemv"):
        step = DecodeStep(sb.CPU_CONFIG, 1, 8, optimizations="all", projections=proj, device=DEV,
                          dtype=torch.float32, seed=4)
        assert step.resolved.projections == ("gemv" if proj == "gemv" else "fp32")
        with torch.no_grad():
            step.set_tokens(ids)
            out[proj] = step.run().clone()
    err = float((out["gemv"] - out["bf16"]).norm() / out["bf16"].norm())
    assert 0 < err < 1e-5 or torch.equal(out["gemv"], out["bf16"]), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(3, 40), (33, 129), (70, 256)])
def test_fp8_weights_with_row_scales_match_the_widened_product(n, k, dtype):
    from k3lab.engine import fp8

    x, w = _inputs(n, k, torch.float32, seed=7 * n + k)
    q = fp8.quantize_weight(w * torch.linspace(0.1, 10.0, n, device=DEV)[:, None])  # scales differ by row
    wq, scale = q.wq[:n, :k], q.scale[0]
    y = gv.gemv(x.to(dtype), wq, scale=scale, backend="triton")
    ref = (x.to(dtype).double() @ wq.double().t()) * scale[:n].double()
    assert y.dtype == dtype and y.shape == (1, n)
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < TOL[dtype], err
    torch.testing.assert_close(gv.gemv(x.to(dtype), wq, scale=scale, backend="torch").double(), ref,
                               rtol=TOL[dtype], atol=TOL[dtype])
    deq = q.dequantize().double()  # and it is the product with the weight the FP8 form stands for
    assert float(((y.double() - x.to(dtype).double() @ deq.t()).norm() / ref.norm())) < TOL[dtype]


def test_fp8_weights_bad_input_names_the_argument():
    from k3lab.engine import fp8

    x, w = _inputs(8, 32, torch.bfloat16)
    q = fp8.quantize_weight(w)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gv.gemv(x, w, scale=q.scale[0])  # a bf16 weight with a scale
    with pytest.raises(ValueError, match="w must be float32, float16 or bfloat16"):
        gv.gemv(x, q.wq)  # an FP8 weight without its scale
    for bad in (q.scale[0, :4], q.scale[0].double(), q.scale.t()[::2].reshape(-1)[:4]):
        with pytest.raises(ValueError, match="scale must be"):
            gv.gemv(x, q.wq, scale=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_weight", [False, True], ids=["plain", "fp8"])
def test_glu_input_is_the_situ_glu_then_the_product_in_one_launch(dtype, fp8_weight):
    """glu=True: x is a gate|up row and the kernel computes its SiTU-GLU while loading it: equal, bit for
    bit, to the SiTU-GLU kernel followed by the GEMV (the same fp32 math, rounded to x's dtype at the same
    point), and close to the fp64 product of the nn reference's activation; gates and ups large enough to
    reach both bounds; a K (129) that is not a multiple of the block."""
    from k3lab.engine import fp8
    from k3lab.nn.situ import situ_glu
    from k3lab.ops.situ_glu import situ_glu_stacked

    n, k = 33, 129
    gen = torch.Generator().manual_seed(5)
    gu = (torch.randn(1, 2 * k, generator=gen) * 20).to(DEV).to(dtype)
    w = torch.randn(n, k, generator=gen).to(DEV)
    scale = None
    if fp8_weight:
        q = fp8.quantize_weight(w)
        w, scale = q.wq[:n, :k], q.scale[0]
    else:
        w = w.to(dtype)
    one = gv.gemv(gu, w, scale=scale, glu=True, backend="triton")
    two = gv.gemv(situ_glu_stacked(gu, backend="triton"), w, scale=scale, backend="triton")
    assert one.dtype == dtype and one.shape == (1, n) and torch.equal(one, two)
    act = situ_glu(*gu.double().chunk(2, dim=-1)).to(dtype).double()
    ref = act @ w.double().t() * (1.0 if scale is None else scale[:n].double())
    assert float((one.double() - ref).norm() / ref.norm()) < TOL[dtype]
    torch.testing.assert_close(gv.gemv(gu, w, scale=scale, glu=True, backend="torch").double(), ref,
                               rtol=TOL[dtype], atol=TOL[dtype] * float(ref.abs().max()))
    with pytest.raises(ValueError, match=r"gate \| up, glu=True"):
        gv.gemv(gu[:, :k], w, scale=scale, glu=True)  # one half only


@pytest.mark.parametrize("count", [1, 2, 3])
def test_stack_of_weights_that_read_one_row_in_one_launch(count):
    """One to three weights read by the same x, bf16 and FP8 (with row scales) mixed in one launch:
    each output equals its own one-weight product (the same kernel body, in the interpreter's blocks)
    and the fp64 reference."""
    from k3lab.engine import fp8

    shapes = [(70, 200), (5, 200), (129, 200)][:count]
    x = _inputs(1, 200, torch.bfloat16, seed=3)[0]
    parts = []
    for i, (n, k) in enumerate(shapes):
        w = _inputs(n, k, torch.float32, seed=11 + i)[1]
        if i == 1:
            q = fp8.quantize_weight(w)
            parts.append((q.wq[:n, :k], q.scale[0]))
        else:
            parts.append((w.bfloat16(), None))
    ys = gv.gemv_stack(x, parts, backend="triton")
    assert [tuple(y.shape) for y in ys] == [(1, n) for n, _ in shapes]
    for y, (w, sc) in zip(ys, parts):
        one = gv.gemv(x, w, scale=sc, backend="triton")
        if DEV == "cpu":  # the same blocks, so the same sums; a GPU may tune the two kernels apart
            assert torch.equal(y, one)
        ref = x.double() @ w.double().t() * (1.0 if sc is None else sc[:w.shape[0]].double())
        assert float((y.double() - ref).norm() / ref.norm()) < TOL[torch.bfloat16]
    torch.testing.assert_close(gv.gemv_stack(x, parts, backend="torch")[0], ys[0], rtol=1e-2, atol=1e-2)


def test_stack_bad_input_names_the_argument():
    x, w = _inputs(8, 16, torch.float32)
    for parts, match in (([], "one to three"), ([(w, None)] * 4, "one to three"), ([w], r"parts\[0\]"),
                         ([(w, None), (w[:, :8], None)], r"x must be \[1, 8\]")):
        with pytest.raises(ValueError, match=match):
            gv.gemv_stack(x, parts)
