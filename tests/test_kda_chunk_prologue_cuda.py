"""kernels/kda_chunk_prologue.cu (the 'cuda' backend's prologue of k3lab.ops.kda_chunk) against the PyTorch
algebra in fp64 and against the Triton prologue, end to end through both variants, and its refusals.
GPU-only tests skip with the reason the kernels cannot run here."""

import pytest
import torch

import k3lab  # noqa: F401
from k3lab import bench
from k3lab.ops import kda_chunk as kc
from k3lab.ops.kda_chunk import cuda as kcu
from k3lab.ops.kda_chunk import scan_math as sm
from kda_cases import _inputs, _rel, check_ragged_against_fp64

HAVE_GPU = torch.cuda.is_available()
_STATUS = kcu.available() if HAVE_GPU else (False, "no GPU: the CUDA backend needs an NVIDIA GPU")
needs_kernel = pytest.mark.skipif(not _STATUS[0], reason=_STATUS[1])


def _fields(work):
    return {"W": work.w, "U": work.u, "Qg": work.qg, "Aqk": work.aqk, "KdT": work.kdt, "d": work.d}


def _reference_fields(q, k, v, g, beta, scale):
    cq = sm.chunk_quantities(*(t.double() for t in (q, k, v, g, beta)), scale=scale)
    ref = {"W": cq.W, "U": cq.U, "Qg": cq.Qg, "Aqk": cq.Aqk, "KdT": cq.Kd.transpose(-1, -2), "d": cq.d}
    return {name: t[0].transpose(0, 1) for name, t in ref.items()}  # [B=1, H, n, ...] -> [n, H, ...]


def test_status_says_why_not_without_a_kernel():
    ok, why = _STATUS
    assert isinstance(ok, bool) and why
    if HAVE_GPU:
        assert kc.BACKENDS.status()["cuda"] == _STATUS
    if not HAVE_GPU:
        q = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
        args = (q, q, q, q.float(), torch.zeros(1, 64, 1))
        plan = kc.make_plan([64], 1)
        ok, why = kc.BACKENDS.status()["cuda"]
        assert not ok and "Triton" in why
        assert kc.BACKENDS.choose(None, *args, plan)[0] == "triton"
        with pytest.raises(ValueError, match="cannot run here"):
            kc.BACKENDS.choose("cuda", *args, plan)


@needs_kernel
@pytest.mark.parametrize("T", [64, 100, 13, 1000])
def test_cuda_prologue_writes_the_chunk_quantities(T):
    """Every field the walks read against the fp64 algebra (bf16 outputs: rel. L2 within 1e-2) and
    against the Triton 'rows' prologue on the same inputs (the two differ by rounding only)."""
    q, k, v, g, beta = _inputs(1, T, 3, seed=T)
    plan = kc.make_plan([T], 3, device="cuda")
    scale = 128**-0.5
    cuda = kc.kda_chunk_prologue(q, k, v, g, beta, plan, scale, backend="cuda")
    rows = kc.kda_chunk_prologue(q, k, v, g, beta, plan, scale, backend="triton")
    ref = _reference_fields(q, k, v, g, beta, scale)
    torch.cuda.synchronize()
    for name, got in _fields(cuda).items():
        assert torch.isfinite(got).all(), name
        err = _rel(got, ref[name])
        assert err < 1e-2, f"{name}: rel. L2 {err:.2e} against fp64"
        assert _rel(got, _fields(rows)[name]) < 1e-2, name
    # Aqk's upper blocks and W's padded rows are exact zeros (the walks multiply whole tiles)
    upper = torch.ones(64, 64, dtype=torch.bool, device="cuda").triu(1)
    assert (cuda.aqk[:, :, upper] == 0).all()
    if T % 64:
        pad = T % 64
        assert (cuda.w[-1, :, pad:] == 0).all() and (cuda.qg[-1, :, pad:] == 0).all()


@needs_kernel
def test_wide_decays_take_the_exact_path():
    """Gates down to -12 per token put block spreads far past SAFE_SPREAD (64): those blocks are summed
    pair by pair; no overflow, same fields as the fp64 algebra."""
    q, k, v, g, beta = _inputs(1, 192, 2, seed=3, gate_low=-12.0)
    block_sums = g.reshape(3, 4, 16, 2, 128).sum(2)
    assert (-block_sums).max().item() > kc.SAFE_SPREAD  # the exact path is really taken
    plan = kc.make_plan([192], 2, device="cuda")
    work = kc.kda_chunk_prologue(q, k, v, g, beta, plan, 0.1, backend="cuda")
    ref = _reference_fields(q, k, v, g, beta, 0.1)
    for name, got in _fields(work).items():
        assert torch.isfinite(got).all(), name
        assert _rel(got, ref[name]) < 1e-2, name


@needs_kernel
@pytest.mark.parametrize("variant", ["before", "after"])
def test_walks_with_the_cuda_prologue_match_fp64(variant):
    """End to end on a ragged batch (cu_seqlens, lengths not multiples of 64) with an initial state:
    output and every final state against kda_chunked in fp64; and the default backend is 'cuda'."""
    lengths = [700, 64, 1500, 37]
    T = sum(lengths)
    q, k, v, g, beta = _inputs(1, T, 3, seed=5)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    S0 = torch.randn(len(lengths), 3, 128, 128, device="cuda") * 0.1
    plan = kc.make_plan(lengths, 3, device="cuda")
    assert kc.BACKENDS.choose(None, q, k, v, g, beta, plan)[0] == "cuda"
    o, S = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant=variant,
                        **({"group_size": 4} if variant == "after" else {}))
    check_ragged_against_fp64(o, S, (q, k, v, g, beta), cu, S0)


@needs_kernel
def test_cuda_prologue_replays_in_a_graph():
    q, k, v, g, beta = _inputs(1, 4096, 2, seed=9)
    plan = kc.make_plan([4096], 2, device="cuda")
    work = kc.kda_chunk_prologue(q, k, v, g, beta, plan, 0.1, backend="cuda")
    first = {name: t.clone() for name, t in _fields(work).items()}
    graph = bench.capture_graph(
        lambda: kc.kda_chunk_prologue(q, k, v, g, beta, plan, 0.1, work, backend="cuda"), copies=3
    )
    for t in _fields(work).values():
        t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    for name, t in _fields(work).items():
        assert torch.equal(t, first[name]), name  # the same bits every time


@needs_kernel
def test_cuda_backend_refuses_what_it_cannot_take():
    q, k, v, g, beta = _inputs(1, 64, 2)
    plan = kc.make_plan([64], 2, device="cuda")
    with pytest.raises(ValueError, match="bf16"):
        kc.kda_chunk_prologue(q.float(), k.float(), v.float(), g, beta, plan, 0.1, backend="cuda")
    assert kc.BACKENDS.choose(None, q.float(), k.float(), v.float(), g, beta, plan)[0] == "triton"
    unaligned = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape).copy_(q)
    ok, why = kcu.verify(unaligned, k, v, g, beta, plan)
    assert not ok and "16-byte aligned" in why
    assert kc.BACKENDS.choose(None, unaligned, k, v, g, beta, plan)[0] == "triton"


def test_committed_prologue_probe_reads_back(tmp_path):
    """The committed H200 probe of the CUDA prologue: every stage present, times positive, the shares of
    a block's lifetime below 1 in sum, the A's the largest stage; a file that is not a probe is refused."""
    from k3lab.studies import kda_scan as ks

    st = ks.prologue_stages()
    assert list(st["stage"]) == list(ks.PROLOGUE_PROBE_STAGES)
    assert (st["median_us"] >= 0).all() and (st["p90_us"] >= st["median_us"]).all()
    assert 0.8 < st["share_of_block"].sum() < 1.2
    assert st.set_index("stage")["median_us"].idxmax() == "A's"
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="probe"):
        ks.prologue_stages(bad)
