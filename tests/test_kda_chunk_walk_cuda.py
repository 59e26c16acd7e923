"""kernels/kda_chunk_walk.cu (the 'cuda' backend's summaries and replay in k3lab.ops.kda_chunk) against the
Triton walks on the same prologue outputs, end to end against fp64, graph replay, and how the backend is
chosen or refused. GPU-only tests skip with the reason the kernels cannot run here."""

import pytest
import torch

import k3lab  # noqa: F401
from k3lab.nn.kda import kda_chunked
from k3lab.ops import kda_chunk as kc
from k3lab.ops.kda_chunk import cuda as kcu
from k3lab.ops.kda_chunk import scan, walk
from kda_cases import _inputs, _rel, check_ragged_against_fp64

HAVE_GPU = torch.cuda.is_available()
_STATUS = kcu.available() if HAVE_GPU else (False, "no GPU: the CUDA backend needs an NVIDIA GPU")
needs_kernel = pytest.mark.skipif(not _STATUS[0], reason=_STATUS[1])


def _walked(backend, q, k, v, g, beta, S0, plan, work):
    """The after's walking launches of `backend` on prologue outputs already in `work`."""
    parts = kc.after_launches(q, k, v, g, beta, None, S0, plan=plan, work=work, backend=backend)
    for name in ("summaries", "scan", "replay"):
        parts[name]()
    return parts["result"]()


@needs_kernel
@pytest.mark.parametrize("T,gs", [(64 * 40, 8), (1000, 3), (4096 + 37, 16)])
def test_summaries_and_replay_match_the_triton_walks(T, gs):
    """The same prologue outputs (Triton's) walked by both backends: every summary (N, b, D), o and the
    final state agree to bf16 rounding of the walked operands (the two differ in summation order only)."""
    q, k, v, g, beta = _inputs(1, T, 3, seed=T)
    S0 = torch.randn(1, 3, 128, 128, device="cuda") * 0.1
    plan = kc.make_plan([T], 3, group_size=gs, device="cuda")
    assert plan.uses_scan
    work = kc.kda_chunk_prologue(q, k, v, g, beta, plan, 128**-0.5, backend="triton")
    o1, S1 = (t.clone() for t in _walked("cuda", q, k, v, g, beta, S0, plan, work))
    o2, S2 = _walked("triton", q, k, v, g, beta, S0, plan, work)
    torch.cuda.synchronize()
    assert torch.isfinite(o1).all() and torch.isfinite(S1).all()
    assert _rel(o1, o2) < 5e-3 and _rel(S1, S2) < 5e-3
    sums = {}
    for name, launch in (("cuda", kcu.summaries), ("triton", walk.summaries)):
        sums[name], _ = scan.buffers(plan, q.device)
        launch(work, plan, sums[name])
    for name, a, b in zip(("N", "b", "D"), sums["cuda"], sums["triton"], strict=True):
        assert _rel(a, b) < 5e-3, name
    assert _rel(sums["cuda"][2], sums["triton"][2]) < 1e-6  # D: products of d, exact in both


@needs_kernel
@pytest.mark.parametrize("variant", ["before", "after"])
def test_cuda_backend_matches_fp64_on_a_ragged_batch(variant):
    """cu_seqlens with lengths not multiples of 64 (one of a single chunk, one shorter than a chunk), an
    initial state per sequence: o and every final state against kda_chunked in fp64."""
    lengths = [700, 64, 1500, 37, 2100]
    T = sum(lengths)
    q, k, v, g, beta = _inputs(1, T, 3, seed=11)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    S0 = torch.randn(len(lengths), 3, 128, 128, device="cuda") * 0.1
    o, S = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant=variant, backend="cuda",
                        **({"group_size": 5} if variant == "after" else {}))
    check_ragged_against_fp64(o, S, (q, k, v, g, beta), cu, S0)


@needs_kernel
def test_batched_inputs_without_initial_state():
    """B = 2 (no cu_seqlens), no initial state: the before and the after (CUDA backend) against fp64."""
    q, k, v, g, beta = _inputs(2, 777, 2, seed=4)
    for variant, kw_ in (("before", {}), ("after", {"group_size": 4})):
        o, S = kc.kda_chunk(q, k, v, g, beta, variant=variant, backend="cuda", **kw_)
        for b in range(2):
            ro, rS = kda_chunked(*(t[b : b + 1].double() for t in (q, k, v, g, beta)))
            assert _rel(o[b : b + 1], ro) < 1e-2 and _rel(S[b], rS[0]) < 1e-2, (variant, b)


@needs_kernel
def test_cuda_backend_replays_in_a_graph():
    q, k, v, g, beta = _inputs(1, 4096, 2, seed=9)
    S0 = torch.randn(1, 2, 128, 128, device="cuda") * 0.1
    plan = kc.make_plan([4096], 2, group_size=8, device="cuda")
    work = kc.alloc_work(plan.n_chunks, 2, q.dtype, q.device)

    def call():
        return kc.kda_chunk_after(q, k, v, g, beta, initial_state=S0, plan=plan, work=work, backend="cuda")

    o1, S1 = (t.clone() for t in call())
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            o2, S2 = call()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(S1, S2)


@needs_kernel
def test_fp32_inputs_are_refused_by_name_and_run_on_triton_by_default():
    q, k, v, g, beta = _inputs(1, 300, 1, seed=2)
    q, k, v = q.float(), k.float(), v.float()
    plan = kc.make_plan([300], 1, device="cuda")
    assert kc.BACKENDS.choose(None, q, k, v, g, beta, plan)[0] == "triton"
    with pytest.raises(ValueError, match="backend='cuda' cannot run here.*bf16"):
        kc.kda_chunk_before(q, k, v, g, beta, backend="cuda")


@needs_kernel
def test_default_backend_on_this_gpu_is_cuda():
    q, k, v, g, beta = _inputs(1, 300, 1, seed=2)
    plan = kc.make_plan([300], 1, device="cuda")
    assert kc.BACKENDS.choose(None, q, k, v, g, beta, plan)[0] == "cuda"


# ------------------------------------------------------------------------------------------------
# CPU: what the CUDA backend says off the GPU


def _cpu_inputs(T=200, H=1):
    return _inputs(1, T, H, seed=1, device="cpu")


def test_cuda_backend_off_the_gpu_says_why():
    q, k, v, g, beta = _cpu_inputs()
    plan = kc.make_plan([200], 1)
    assert kc.BACKENDS.choose(None, q, k, v, g, beta, plan)[0] == "triton"
    if not HAVE_GPU:
        with pytest.raises(ValueError, match="backend='cuda' cannot run here"):
            kc.kda_chunk_before(q, k, v, g, beta, backend="cuda")


def test_verify_names_what_it_does_not_take():
    q, k, v, g, beta = _cpu_inputs()
    plan = kc.make_plan([200], 1)
    ok, why = kcu.verify(q, k, v, g, beta, plan)
    assert not ok and "CUDA device" in why
    if HAVE_GPU:
        qc, kc_, vc, gc, bc = (t.cuda() for t in (q, k, v, g, beta))
        plan = kc.make_plan([200], 1, device="cuda")
        ok, why = kcu.verify(qc.float(), kc_, vc, gc, bc, plan)
        assert not ok and "bf16" in why
        assert kcu.verify(qc, kc_, vc, gc, bc, plan) == (True, "")


def test_committed_walk_bench_reads_back(tmp_path):
    """The committed H200 walk bench: every launch with both kinds, the CUDA walks faster on the
    summaries and the replay and the whole after faster with them; a file that is not one is refused."""
    from k3lab.studies import kda_scan as ks

    wb = ks.walk_launches().set_index("launch")
    assert list(wb.index) == ["summaries", "scan", "replay", "after"]
    assert (wb[["triton", "cuda"]] > 0).all().all()
    assert (
        wb.loc["summaries", "speedup"] > 1
        and wb.loc["replay", "speedup"] > 1
        and wb.loc["after", "speedup"] > 1
    )
    bad = tmp_path / "bad.json"
    bad.write_text('{"triton.after": 1.0}')
    with pytest.raises(ValueError, match="walk bench"):
        ks.walk_launches(bad)
