"""The stacked SiTU-GLU op against k3lab.nn.situ.situ_glu (fp64 reference) on fresh random inputs up to
the saturations, its backend choice, and bad input refused before a kernel. The shared tests run on
the GPU when there is one (compiled), else in Triton's interpreter on the CPU."""

import math

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.config import K3Config
from k3lab.nn.situ import situ_glu
from k3lab.ops import situ_glu as op
from k3lab.ops.situ_glu import BACKEND_ENV, BACKENDS, situ_glu_stacked

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="needs a GPU (the CPU runs the interpreter tests)")
# fp32 relative tolerance: Triton's interpreter rounds exp and division exactly; a GPU runs them as
# approximate instructions (~2 ulp), an error that 1 - exp(-2|x|) in the tanh can enlarge about fourfold
# near |x| = 1/8, so the compiled kernel gets more room
FP32_RTOL = 4e-6 if DEV == "cuda" else 1e-6
# against the fp64 reference: fp32 to FP32_RTOL (2x on random inputs, whose outputs are products of
# three rounded factors), bf16 / fp16 to half a unit in the last place (the output's rounding); atol
# only for results below the low formats' normal range
TOL = {torch.float32: dict(rtol=2 * FP32_RTOL, atol=1e-9), torch.bfloat16: dict(rtol=2 ** -8, atol=1e-9),
       torch.float16: dict(rtol=2 ** -11, atol=1e-7)}
# against the torch backend: its fp32 values differ from the kernel's by ulps, so a rounding can flip
ONE_ULP = {torch.float32: TOL[torch.float32], torch.bfloat16: dict(rtol=2 ** -7, atol=1e-9),
           torch.float16: dict(rtol=2 ** -10, atol=1e-7)}


def _gu(*lead, f, dtype=torch.float32, seed=0, device=DEV):
    """Random [*lead, 2F] with columns at scales 0.01 .. 200 (so both tanh saturate and sigmoid
    underflows), never zero."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, 2 * f, generator=gen, dtype=torch.float64)
    scale = torch.tensor([0.01, 0.5, 3.0, 30.0, 200.0], dtype=torch.float64)
    x = x * scale[torch.randint(0, 5, (2 * f,), generator=gen)]
    return x.clamp(-200, 200).to(dtype).to(device)


def _ref(gu):
    g, u = gu.double().chunk(2, dim=-1)
    return situ_glu(g, u)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,f", [((7,), 200), ((2, 3), 1100), ((1,), 1)])
def test_triton_matches_fp64_reference(dtype, lead, f):
    gu = _gu(*lead, f=f, dtype=dtype, seed=f)
    assert (gu != 0).all() and (f < 100 or gu.abs().max() > 100)
    got = situ_glu_stacked(gu, backend="triton")
    assert got.shape == (*lead, f) and got.dtype == dtype and got.device == gu.device
    torch.testing.assert_close(got.double(), _ref(gu), **TOL[dtype])
    # and against the torch backend (the engine's current path): rounding of nearly equal fp32 values
    plain = situ_glu_stacked(gu, backend="torch")
    torch.testing.assert_close(got, plain, **ONE_ULP[dtype])


def _by_hand(g, u):
    return 4 * math.tanh(g / 4) / (1 + math.exp(-g)) * 25 * math.tanh(u / 25)


def test_saturations_and_signs():
    g = [200.0, -200.0, 200.0, -80.0, 1e-4, -1e-4, 0.3, -0.3, 60.0]
    u = [-0.3, 0.3, -1e-4, 200.0, -200.0, 200.0, -200.0, 1e-3, 150.0]
    gu = torch.tensor([g + u], device=DEV)
    got = situ_glu_stacked(gu, backend="triton")
    want = torch.tensor([[_by_hand(a, b) for a, b in zip(g, u)]], dtype=torch.float64)
    torch.testing.assert_close(got.double().cpu(), want, rtol=FP32_RTOL, atol=1e-30)
    assert got[0, 1].item() == 0  # g = -200: the gate is -4 sigmoid(-200), below fp32's range
    assert got[0, 8].item() == pytest.approx(100.0 * math.tanh(6.0), rel=1e-6)  # both saturated


def test_small_arguments_grid():
    # both tanh near 0, where 1 - exp(-2|x|) would cancel: relative accuracy of the whole product
    g, u = torch.linspace(-3, 3, 4000), torch.linspace(-15, 15, 4000)
    gu = torch.cat([g, u]).view(1, -1).to(DEV)
    got = situ_glu_stacked(gu, backend="triton")
    torch.testing.assert_close(got.double(), _ref(gu), rtol=FP32_RTOL, atol=0)


def test_out_in_place_and_row_slices():
    gu = _gu(4, f=300, seed=3)
    out = torch.full((4, 300), float("nan"), device=DEV)
    res = situ_glu_stacked(gu, out=out, backend="triton")
    assert res is out
    torch.testing.assert_close(out.double(), _ref(gu), **TOL[torch.float32])
    # out as a column slice of a wider buffer, gu as rows of a wider buffer: row strides are honoured
    wide_gu = _gu(4, f=400, seed=4)[:, :600]
    wide_out = torch.zeros(4, 500, device=DEV)
    situ_glu_stacked(wide_gu, out=wide_out[:, 100:400], backend="triton")
    torch.testing.assert_close(wide_out[:, 100:400].double(), _ref(wide_gu), **TOL[torch.float32])
    assert (wide_out[:, :100] == 0).all() and (wide_out[:, 400:] == 0).all()
    out_t = torch.empty(4, 300, device=DEV)
    assert situ_glu_stacked(gu, out=out_t, backend="torch") is out_t
    torch.testing.assert_close(out_t, out, **TOL[torch.float32])


def test_empty_and_fp64_on_torch():
    assert situ_glu_stacked(torch.randn(0, 8, device=DEV), backend="triton").shape == (0, 4)
    gu = _gu(3, f=50, dtype=torch.float64, seed=5)
    torch.testing.assert_close(situ_glu_stacked(gu, backend="torch"), _ref(gu), rtol=1e-12, atol=1e-300)
    with pytest.raises(ValueError, match="gu: the triton backend takes fp32, fp16 or bf16"):
        situ_glu_stacked(gu, backend="triton")


def pick_backend(backend, device):
    return BACKENDS.choose(backend, device)[0]


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert pick_backend(None, "cpu") == "torch"
    if torch.cuda.is_available():
        assert pick_backend(None, "cuda") == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert pick_backend(None, DEV) == "torch"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert pick_backend(None, DEV) == "triton"
    assert pick_backend("torch", DEV) == "torch"  # the argument wins over the variable
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        pick_backend(None, DEV)
    monkeypatch.delenv(BACKEND_ENV)
    with pytest.raises(ValueError, match="backend must be one of"):
        situ_glu_stacked(_gu(1, f=4), backend="numpy")
    # CPU tensors without the interpreter: triton cannot run there, and forcing it says so
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="'triton' cannot run here: .*TRITON_INTERPRET"):
        situ_glu_stacked(_gu(1, f=4, device="cpu"), backend="triton")
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        situ_glu_stacked(_gu(1, f=4, device="cpu"))


def test_forced_by_env_runs_that_backend(monkeypatch):
    calls = []
    real = op.situ_glu
    monkeypatch.setattr(op, "situ_glu", lambda g, u: calls.append(1) or real(g, u))
    gu = _gu(2, f=40, seed=6)
    monkeypatch.setenv(BACKEND_ENV, "torch")
    a = situ_glu_stacked(gu)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    b = situ_glu_stacked(gu)
    assert calls == [1]  # only the torch run went through k3lab.nn.situ
    torch.testing.assert_close(a, b, **TOL[torch.float32])


def test_bad_inputs():
    gu = _gu(3, f=8)
    cases = [
        (dict(gu=[1.0, 2.0]), "gu must be a torch.Tensor"),
        (dict(gu=torch.randn(3, 7)), "even last dim"),
        (dict(gu=torch.tensor(1.0)), "even last dim"),
        (dict(gu=torch.arange(12).view(3, 4)), "gu must be float32, float16, bfloat16 or float64"),
        (dict(gu=gu, out=torch.empty(3, 16, device=DEV)), r"out must be \(3, 8\) \(gu's leading dims"),
        (dict(gu=gu, out=torch.empty(3, 8, device=DEV, dtype=torch.bfloat16)), "out must be float32, got"),
        (dict(gu=gu, out=torch.empty(3, 8, device="meta")), f"out must be on {gu.device}, got meta"),
        (dict(gu=gu, out=[0.0] * 24), "out must be a torch.Tensor"),
        (dict(gu=gu.t().contiguous().t()), "stride-1 last dim"),
        (dict(gu=_gu(2, 3, f=8).transpose(0, 1)), "leading dims must collapse"),
        (dict(gu=gu, out=torch.empty(8, 3, device=DEV).t()), "out must have a stride-1 last dim"),
    ]
    for backend in ("triton", "torch"):  # one contract for both
        for kwargs, msg in cases:
            with pytest.raises(ValueError, match=msg):
                situ_glu_stacked(backend=backend, **kwargs)


@GPU_ONLY
@pytest.mark.parametrize("f", sorted({384, *op.widths().values()}))
@pytest.mark.parametrize("n", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_at_tp8_widths(f, n, dtype):
    cfg = K3Config.tp_slice(8)
    assert set(op.widths().values()) == {cfg.shared_intermediate_size, cfg.intermediate_size}
    gu = _gu(n, f=f, dtype=dtype, seed=n + f, device="cuda")
    got = situ_glu_stacked(gu)  # the default on GPU tensors is the compiled kernel
    torch.testing.assert_close(got.double(), _ref(gu), **TOL[dtype])
    torch.testing.assert_close(got, situ_glu_stacked(gu, backend="torch"), **ONE_ULP[dtype])


@GPU_ONLY
def test_cuda_graph_capture():
    f = op.widths()["shared_expert"]
    gu = _gu(1, f=f, dtype=torch.bfloat16, seed=11, device="cuda")
    out = torch.empty(1, f, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        situ_glu_stacked(gu, out=out, backend="triton")  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        situ_glu_stacked(gu, out=out, backend="triton")
        fresh = situ_glu_stacked(gu, backend="triton")  # allocated from the graph's pool
    for seed in (12, 13):
        gu.copy_(_gu(1, f=f, dtype=torch.bfloat16, seed=seed, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.double(), _ref(gu), **TOL[torch.bfloat16])
        assert torch.equal(fresh, out)
