"""kernels/kda_walk.cu (the 'cuda' walk of k3lab.ops.kda_chunk): the summaries, the replay and the
plain walk against the Triton walks on the same prologue outputs, end to end against fp64, graph
replay, and how the walk kind is chosen or refused. GPU-only tests skip with the reason the kernel
cannot run here."""

import pytest
import torch

import k3lab  # noqa: F401
from k3lab.nn.kda import kda_chunked
from k3lab.ops import kda_chunk as kc
from k3lab.ops.kda_chunk import cuda_walk as kw
from kda_cases import _inputs, _rel, check_ragged_against_fp64

HAVE_GPU = torch.cuda.is_available()
_STATUS = kw.status() if HAVE_GPU else (False, "no GPU: the CUDA walks need an NVIDIA GPU")
needs_kernel = pytest.mark.skipif(not _STATUS[0], reason=_STATUS[1])


def _parts(walk, q, k, v, g, beta, S0, plan, cu=None):
    parts = kc.after_launches(q, k, v, g, beta, None, S0, cu, plan=plan, walk=walk, prologue="rows")
    for name in ("prologue", "summaries", "scan", "replay", "walk"):
        if name in parts:
            parts[name]()
    return parts


@needs_kernel
@pytest.mark.parametrize("T,gs", [(64 * 40, 8), (1000, 3), (4096 + 37, 16)])
def test_summaries_and_replay_match_the_triton_walks(T, gs):
    """The same prologue outputs ('rows') walked by both kinds: every summary (N, b, D), o and the final
    state agree to bf16 rounding of the walked operands (the two differ in summation order only)."""
    q, k, v, g, beta = _inputs(1, T, 3, seed=T)
    S0 = torch.randn(1, 3, 128, 128, device="cuda") * 0.1
    plan = kc.make_plan([T], 3, group_size=gs, device="cuda")
    assert plan.uses_scan
    got, ref = (_parts(w, q, k, v, g, beta, S0, plan) for w in ("cuda", "triton"))
    torch.cuda.synchronize()
    (o1, S1), (o2, S2) = got["result"](), ref["result"]()
    assert torch.isfinite(o1).all() and torch.isfinite(S1).all()
    assert _rel(o1, o2) < 5e-3 and _rel(S1, S2) < 5e-3
    # the summaries themselves, launched again on both kinds' buffers from one prologue
    sums = {}
    for walk in ("cuda", "triton"):
        buf, _ = kc._scan_buffers(plan, 3, q.device)
        work = kc.kda_chunk_prologue(q, k, v, g, beta, plan, 128**-0.5, prologue="rows")
        kc._launch_summaries(work, plan, buf, 3, q.dtype, kc._walk_options(q, plan, walk))
        sums[walk] = buf
    for name, a, b in zip(("N", "b", "D"), sums["cuda"], sums["triton"], strict=True):
        assert _rel(a, b) < 5e-3, name
    assert torch.equal(sums["cuda"][2], sums["triton"][2]) or _rel(sums["cuda"][2], sums["triton"][2]) < 1e-6


@needs_kernel
@pytest.mark.parametrize("variant", ["before", "after"])
def test_cuda_walks_match_fp64_on_a_ragged_batch(variant):
    """cu_seqlens with lengths not multiples of 64 (one of a single chunk, one shorter than a chunk), an
    initial state per sequence: o and every final state against kda_chunked in fp64; 'cuda' is the
    default walk for bf16 on this GPU."""
    lengths = [700, 64, 1500, 37, 2100]
    T = sum(lengths)
    q, k, v, g, beta = _inputs(1, T, 3, seed=11)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    S0 = torch.randn(len(lengths), 3, 128, 128, device="cuda") * 0.1
    assert kc.choose_walk(q) == "cuda"
    o, S = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant=variant, walk="cuda",
                        **({"group_size": 5} if variant == "after" else {}))
    check_ragged_against_fp64(o, S, (q, k, v, g, beta), cu, S0)


@needs_kernel
def test_batched_inputs_without_initial_state():
    """B = 2 (no cu_seqlens), no initial state: the before and the after (CUDA walks) against fp64."""
    q, k, v, g, beta = _inputs(2, 777, 2, seed=4)
    for variant, kw_ in (("before", {}), ("after", {"group_size": 4})):
        o, S = kc.kda_chunk(q, k, v, g, beta, variant=variant, walk="cuda", **kw_)
        for b in range(2):
            ro, rS = kda_chunked(*(t[b : b + 1].double() for t in (q, k, v, g, beta)))
            assert _rel(o[b : b + 1], ro) < 1e-2 and _rel(S[b], rS[0]) < 1e-2, (variant, b)


@needs_kernel
def test_cuda_walks_replay_in_a_graph():
    q, k, v, g, beta = _inputs(1, 4096, 2, seed=9)
    S0 = torch.randn(1, 2, 128, 128, device="cuda") * 0.1
    plan = kc.make_plan([4096], 2, group_size=8, device="cuda")
    work = kc._alloc_work(plan.n_chunks, 2, q.dtype, q.device)

    def call():
        return kc.kda_chunk_after(q, k, v, g, beta, initial_state=S0, plan=plan, work=work, walk="cuda")

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
def test_fp32_inputs_are_refused_by_name_and_walk_in_triton_by_default():
    q, k, v, g, beta = _inputs(1, 300, 1, seed=2)
    q, k, v = q.float(), k.float(), v.float()
    assert kc.choose_walk(q) == "triton"
    with pytest.raises(ValueError, match="walk='cuda' cannot run here.*bf16"):
        kc.kda_chunk_before(q, k, v, g, beta, walk="cuda")


# ------------------------------------------------------------------------------------------------
# CPU: the choice of walk


def _cpu_inputs(T=200, H=1):
    return _inputs(1, T, H, seed=1, device="cpu")


def test_triton_options_select_the_triton_walk_and_cuda_refuses_them():
    q = _cpu_inputs()[0]
    plan = kc.make_plan([200], 1, device="cpu")
    wo = kc._walk_options(q, plan, None, num_warps=8)
    assert wo.kind == "triton" and wo.num_warps == 8
    assert kc._walk_options(q, plan, None, block_v=32).kind == "triton"
    with pytest.raises(ValueError, match="fixed 64-column tiles.*num_stages"):
        kc._walk_options(q, plan, "cuda", num_stages=3)
    with pytest.raises(ValueError, match="block_v"):
        kc._walk_options(q, plan, "cuda", block_v=32)
    with pytest.raises(ValueError, match="walk must be one of"):
        kc._walk_options(q, plan, "fast")
    with pytest.raises(ValueError, match="unknown walk options"):
        kc._walk_options(q, plan, None, warps=4)


def test_cuda_walk_off_the_gpu_says_why():
    q, k, v, g, beta = _cpu_inputs()
    ok, why = kc.walk_status(q)
    assert not ok and why
    assert kc.choose_walk(q) == "triton"
    with pytest.raises(ValueError, match="walk='cuda' cannot run here"):
        kc.kda_chunk_before(q, k, v, g, beta, walk="cuda")


def test_env_var_forces_a_walk(monkeypatch):
    q = _cpu_inputs()[0]
    monkeypatch.setenv("K3LAB_KDA_WALK", "triton")
    assert kc.choose_walk(q) == "triton"
    monkeypatch.setenv("K3LAB_KDA_WALK", "vulkan")
    with pytest.raises(ValueError, match="K3LAB_KDA_WALK must be one of"):
        kc.choose_walk(q)


def test_supports_names_what_it_does_not_take():
    q = _cpu_inputs()[0]
    assert "CUDA device" in kw.supports(q, 1)
    if HAVE_GPU:
        qc = q.cuda()
        assert "bf16" in kw.supports(qc.float(), 1)
        assert "1 to 65535" in kw.supports(qc, 70000)
        assert kw.supports(qc, 10) is None


def test_committed_walk_bench_reads_back(tmp_path):
    """The committed H200 walk bench: every launch with both kinds, the CUDA walks faster on the
    summaries and the replay and the whole after faster with them; a file that is not one is refused."""
    from k3lab.studies import kda_scan as ks

    wb = ks.walk_launches().set_index("launch")
    assert list(wb.index) == ["summaries", "scan", "replay", "after"]
    assert (wb[["triton", "cuda"]] > 0).all().all()
    assert wb.loc["summaries", "speedup"] > 1 and wb.loc["replay", "speedup"] > 1 and wb.loc["after", "speedup"] > 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"triton.after": 1.0}')
    with pytest.raises(ValueError, match="walk bench"):
        ks.walk_launches(bad)
