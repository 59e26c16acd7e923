"""Chunked KDA prefill: the group-scan algebra (PyTorch, fp64) and the Triton kernels (interpreter on
CPU, fp32 inputs) against k3lab.nn.kda, plus the group-size rule, plans and bad input."""

import math

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 on a machine without a GPU)
from k3lab import bench
from k3lab.nn.kda import kda_chunked, kda_recurrent
from k3lab.ops import kda_chunk as kc
from k3lab.ops.kda_chunk import scan_math as sm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, T, H, K=128, V=128, dtype=torch.float32, seed=0, device=DEV):
    """Normalised q, k; per-channel decay rates from ~-1e-4 (slow) to ~-5 (fast): the state keeps
    information across chunks, so a wrong starting state shows."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    bias = torch.linspace(-9, 0, K)[torch.randperm(K, generator=gen)]
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=gen) + bias)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))

    def to(t, dt=dtype):
        return t.to(device=device, dtype=dt)

    return to(q), to(k), to(v), to(g, torch.float32), to(beta, torch.float32)


def _ref(q, k, v, g, beta, S0=None):
    return kda_chunked(
        q.double(),
        k.double(),
        v.double(),
        g.double(),
        beta.double(),
        initial_state=None if S0 is None else S0.double(),
    )


# ---------------------------------------------------------------------------------------------
# the algebra


def test_composition_equals_sequential_application_random_maps():
    gen = torch.Generator().manual_seed(1)
    K, V, n = 8, 5, 7
    maps = [
        (
            torch.randn(K, K, generator=gen, dtype=torch.float64) * 0.5,
            torch.randn(K, V, generator=gen, dtype=torch.float64),
        )
        for _ in range(n)
    ]
    S0 = torch.randn(K, V, generator=gen, dtype=torch.float64)
    S = S0
    for m in maps:
        S = sm.apply(m, S)
    total = maps[0]
    for m in maps[1:]:
        total = sm.compose(total, m)
    torch.testing.assert_close(sm.apply(total, S0), S, rtol=1e-12, atol=1e-12)
    # grouping is associative: (1..3)(4..7) composed equals the whole
    left, right = maps[0], maps[3]
    for m in maps[1:3]:
        left = sm.compose(left, m)
    for m in maps[4:]:
        right = sm.compose(right, m)
    torch.testing.assert_close(sm.apply(sm.compose(left, right), S0), S, rtol=1e-12, atol=1e-12)
    # and order matters: the reversed composition is a different map
    assert not torch.allclose(
        sm.apply(sm.compose(maps[1], maps[0]), S0), sm.apply(sm.compose(maps[0], maps[1]), S0)
    )


@pytest.mark.parametrize("T,group_size", [(64 * 5, 2), (200, 3), (130, 1), (64, 4)])
def test_group_scan_on_real_chunk_maps_equals_recurrence(T, group_size):
    B, H, K, V = 1, 2, 16, 12
    q, k, v, g, beta = (t.double() for t in _inputs(B, T, H, K, V, device="cpu", seed=T))
    S0 = torch.randn(B, H, K, V, dtype=torch.float64)
    o_ref, S_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    cq = sm.chunk_quantities(q, k, v, g, beta)
    A, Bc = sm.chunk_affine(cq)
    # every chunk's map equals one step of the walk
    S = S0
    for c in range(cq.n_chunks):
        _, S_next = sm.chunk_step(cq, c, S)
        torch.testing.assert_close(sm.apply((A[:, :, c], Bc[:, :, c]), S), S_next, rtol=1e-10, atol=1e-10)
        S = S_next
    torch.testing.assert_close(S, S_ref, rtol=1e-10, atol=1e-10)
    # group summaries composed in order give the same end state, and the scan the same starts
    M, b = sm.group_summaries(A, Bc, group_size)
    starts = sm.scan_starts(M, b, S0)
    S = S0
    for j, (s, e) in enumerate(sm.group_bounds(cq.n_chunks, group_size)):
        torch.testing.assert_close(starts[:, :, j], S, rtol=1e-10, atol=1e-10)
        for c in range(s, e):
            S = sm.chunk_step(cq, c, S)[1]
    o, S_end = sm.kda_group_scan(q, k, v, g, beta, initial_state=S0, group_size=group_size)
    torch.testing.assert_close(o, o_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(S_end, S_ref, rtol=1e-9, atol=1e-10)
    o2, S2 = sm.kda_chunk_walk(q, k, v, g, beta, initial_state=S0)
    torch.testing.assert_close(o2, o_ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(S2, S_ref, rtol=1e-9, atol=1e-10)


def test_sequential_depth():
    assert sm.sequential_depth(256, None) == 256
    assert sm.sequential_depth(256, 16) == 16 + 15 + 16
    assert sm.sequential_depth(10, 64) == 10


# ---------------------------------------------------------------------------------------------
# Triton kernels (interpreter on CPU: fp32 inputs, every product fp32)


def _check(o, S, o_ref, S_ref, dtype=torch.float32):
    bench.check_all({"o": (o, o_ref), "state": (S, S_ref)}, dtype)


@pytest.mark.parametrize("variant,group_size", [("before", None), ("after", 1), ("after", 2)])
def test_kernels_match_reference_partial_chunk_and_initial_state(variant, group_size):
    B, T, H = 1, 130 if group_size != 2 else 300, 1  # 3 or 5 chunks, the last partial
    q, k, v, g, beta = _inputs(B, T, H, seed=3)
    S0 = torch.randn(B, H, 128, 128, device=DEV) * 0.5
    o_ref, S_ref = _ref(q, k, v, g, beta, S0)
    kw = {"group_size": group_size} if variant == "after" else {}
    o, S = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, variant=variant, **kw)
    assert o.dtype == q.dtype and S.dtype == torch.float32 and o.shape == (B, T, H, 128)
    _check(o, S, o_ref, S_ref)


def test_scan_path_really_differs_from_walk_only_by_rounding():
    """The scan's starting states come from composed summaries, not from the walk: same result up
    to fp32 rounding, and not bit-identical (which would mean the scan was skipped)."""
    q, k, v, g, beta = _inputs(1, 256, 1, seed=4)
    S0 = torch.randn(1, 1, 128, 128, device=DEV)
    ob, Sb = kc.kda_chunk_before(q, k, v, g, beta, initial_state=S0)
    plan = kc.make_plan([256], 1, group_size=1, device=DEV)
    assert plan.uses_scan and plan.n_summaries == 3
    oa, Sa = kc.kda_chunk_after(q, k, v, g, beta, initial_state=S0, plan=plan)
    assert not torch.equal(oa, ob)
    torch.testing.assert_close(oa, ob, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(Sa, Sb, rtol=1e-4, atol=1e-5)


def test_after_launches_one_by_one_equal_the_whole_call():
    q, k, v, g, beta = _inputs(1, 200, 1, seed=9)
    S0 = torch.randn(1, 1, 128, 128, device=DEV)
    plan = kc.make_plan([200], 1, group_size=2, device=DEV)
    parts = kc.after_launches(q, k, v, g, beta, initial_state=S0, plan=plan)
    assert list(parts) == ["prologue", "summaries", "scan", "replay", "result"]
    for name in ("prologue", "summaries", "scan", "replay"):
        parts[name]()
    o, S = parts["result"]()
    o2, S2 = kc.kda_chunk_after(q, k, v, g, beta, initial_state=S0, plan=plan)
    torch.testing.assert_close(o, o2, rtol=0, atol=0)
    torch.testing.assert_close(S, S2, rtol=0, atol=0)


def test_ragged_batch_with_cu_seqlens():
    lengths = [70, 0, 5, 64]
    H = 1
    q, k, v, g, beta = _inputs(1, sum(lengths), H, seed=5)
    S0 = torch.randn(len(lengths), H, 128, 128, device=DEV)
    cu = torch.tensor([0, 70, 70, 75, 139], dtype=torch.int32, device=DEV)
    for variant in ("before", "after"):
        kw = {"group_size": 1} if variant == "after" else {}
        o, S = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant=variant, **kw)
        bos = 0
        for n, L in enumerate(lengths):
            if L == 0:  # an empty sequence hands its initial state back unchanged
                torch.testing.assert_close(S[n], S0[n], rtol=0, atol=0)
                continue
            sl = slice(bos, bos + L)
            o_ref, S_ref = _ref(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S0[n : n + 1])
            _check(o[:, sl], S[n : n + 1], o_ref, S_ref)
            bos += L


def test_plain_batch_without_initial_state():
    q, k, v, g, beta = _inputs(2, 65, 2, seed=6)
    o_ref, S_ref = _ref(q, k, v, g, beta)
    o, S = kc.kda_chunk_after(q, k, v, g, beta, group_size=1)
    _check(o, S, o_ref, S_ref)


def test_wide_decay_block_takes_the_exact_path():
    """A 16-token block whose decay spreads beyond SAFE_SPREAD (e^64) cannot use the factored
    e^(G_i - P) e^(P - G_j) form in fp32: the main pass flags its chunk (and only it) and the fix-up pass
    redoes it with exact pairwise decays."""
    q, k, v, g, beta = _inputs(1, 128, 1, seed=7)
    g[:, 2:12] = -8.0  # 80 nats inside the first 16-token block of the first chunk
    spread = (g[0, :16, 0].sum(0) - g[0, 0, 0]).abs().max()
    assert spread > kc.SAFE_SPREAD
    S0 = torch.randn(1, 1, 128, 128, device=DEV)
    o_ref, S_ref = _ref(q, k, v, g, beta, S0)
    plan = kc.make_plan([128], 1, device=DEV)
    work = kc.alloc_work(plan.n_chunks, 1, q.dtype, q.device)
    o, S = kc.kda_chunk_before(q, k, v, g, beta, initial_state=S0, plan=plan, work=work)
    assert work.flags[:, 0].tolist() == [1, 0]
    _check(o, S, o_ref, S_ref)


def _round_tf32(x):
    """Round to tf32 (10 mantissa bits, nearest), as the tensor cores' conversion does."""
    i = x.float().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32).double()


def _walk_with_akk_operands(q, k, v, g, beta, rnd):
    """The chunk walk in fp64 with Akk's dot operands, factored as the kernels factor them (row
    block I around P_I), passed through `rnd`; everything else exact. Returns (o, final state)."""
    T, K = q.shape
    C, scale = 64, K**-0.5
    S = torch.zeros(K, K, dtype=torch.float64)
    outs = []
    for c0 in range(0, T, C):
        qc, kc_, vc, gc, bc = (x[c0 : c0 + C] for x in (q, k, v, g, beta))
        G = gc.cumsum(0)
        A = torch.zeros(C, C, dtype=torch.float64)
        for blk in range(C // 16):
            P = G[16 * blk - 1] if blk else torch.zeros(K, dtype=torch.float64)
            rows, upto = slice(16 * blk, 16 * blk + 16), 16 * blk + 16
            A[rows, :upto] = (
                rnd(kc_[rows] * torch.exp(G[rows] - P)) @ rnd(kc_[:upto] * torch.exp(P - G[:upto])).T
            )
        A = torch.tril(A, -1) * bc[:, None]
        R = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
        W, U = R @ (bc[:, None] * kc_ * torch.exp(G)), R @ (bc[:, None] * vc)
        E = U - W @ S
        Aqk = torch.tril((qc * torch.exp(G)) @ (kc_ * torch.exp(-G)).T) * scale
        outs.append(qc * torch.exp(G) * scale @ S + Aqk @ E)
        S = torch.exp(G[-1])[:, None] * S + (kc_ * torch.exp(G[-1] - G)).T @ E
    return torch.cat(outs), S


@pytest.mark.parametrize("adversarial", [False, True])
def test_tf32_akk_operands_cost_little(adversarial):
    """Why one tf32 pass suffices for Akk (the NVIDIA default): its operands are factors <= 1 (e^spread on
    the diagonal); rounded to tf32 they move o and the state by ~1e-4 (rel. L2) even on nearly
    parallel keys (I + A ill-conditioned), far below the bf16 pipeline's 4.4e-3, while rounding the
    same operands to bf16 (the seed's warning) costs several times more."""
    q, k, v, g, beta = (t[0, :, 0].double() for t in _inputs(1, 512, 1, seed=11, device="cpu"))
    if adversarial:  # nearly parallel keys, slow decay, beta ~ 1
        k = torch.nn.functional.normalize(k[:1] + 0.05 * k, dim=-1)
        g, beta = g * 0.01, 0.95 + 0.05 * beta
    o0, S0 = _walk_with_akk_operands(q, k, v, g, beta, lambda x: x)
    err = {}
    for name, rnd in (("tf32", _round_tf32), ("bf16", lambda x: x.bfloat16().double())):
        o, S = _walk_with_akk_operands(q, k, v, g, beta, rnd)
        err[name] = max(((o - o0).norm() / o0.norm()).item(), ((S - S0).norm() / S0.norm()).item())
    assert 0 < err["tf32"] < 3e-4
    assert err["bf16"] > 4 * err["tf32"]


# ---------------------------------------------------------------------------------------------
# plans and the group-size rule


def test_plan_tables_cover_every_chunk_once():
    plan = kc.make_plan([130, 0, 640, 1], heads=3, group_size=4)
    tok, ln = plan.chunk_tok.tolist(), plan.chunk_len.tolist()
    assert plan.n_chunks == 3 + 0 + 10 + 1
    assert sum(ln) == 130 + 640 + 1 and tok[:3] == [0, 64, 128] and ln[2] == 2
    covered = []
    for c0, nc in zip(plan.grp_chunk0.tolist(), plan.grp_nchunks.tolist()):
        covered += list(range(c0, c0 + nc))
    assert covered == list(range(plan.n_chunks))
    # every sequence has a last group (which writes the final state), and only non-last groups a summary
    assert plan.grp_last.tolist().count(1) == 4
    assert all((s == -1) == bool(last) for s, last in zip(plan.grp_sum.tolist(), plan.grp_last.tolist()))
    assert plan.n_summaries == plan.n_groups - 4


def test_group_size_rule():
    H200 = 132
    gs = kc.choose_group_size([16384], 12, compute_units=H200)
    assert gs is not None
    n_chunks, n_groups = 256, math.ceil(256 / gs)
    assert n_groups * 12 * 2 >= H200  # the replay fills the GPU
    assert sm.sequential_depth(n_chunks, gs) < n_chunks / 3
    # enough parallel work already: the plain walk
    assert kc.choose_group_size([16384], 96, compute_units=H200) is None
    assert kc.choose_group_size([4096] * 8, 12, compute_units=H200) is None
    # too short to split: below ~96 chunks the H200 lost time to the scan's extra passes
    assert kc.choose_group_size([256], 12, compute_units=H200) is None
    assert kc.choose_group_size([4096], 12, compute_units=H200) is None
    assert kc.choose_group_size([4096], 12, compute_units=H200, min_chunks=8) is not None
    # MI355X's 256 CUs: the same rule reads the unit count
    assert kc.choose_group_size([16384] * 8, 12, compute_units=256) is not None


def test_walk_tile_rule():
    # an idle H200 (24 programs at 64 columns): narrower tiles, twice the programs
    assert kc.choose_block_v(1, 12, compute_units=132) == 32
    # 192 programs at 64 columns already cover the 132 SMs
    assert kc.choose_block_v(8, 12, compute_units=132) == 64
    assert kc.choose_block_v(1, 96, compute_units=132) == 64
    # on 256 CUs B = 8 x 12 heads is not enough for wide tiles
    assert kc.choose_block_v(8, 12, compute_units=256) == 32


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: a.update(initial_state=a["initial_state"].double()), "initial_state"),
        (lambda a: a.update(initial_state=torch.zeros(1, 1, 128, 64, device=DEV)), "initial_state"),
        (lambda a: a.update(q=a["q"][..., :64], k=a["k"][..., :64], g=a["g"][..., :64]), "K must be 128"),
        (lambda a: a.update(g=a["g"].to(torch.bfloat16)), "g must be float32, got torch.bfloat16"),
        (lambda a: a.update(beta=a["beta"][:, :-1]), "beta"),
        (lambda a: a.update(k=a["k"].to(torch.float16)), "k must be float32, got torch.float16"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 10, 50], device=DEV)), "cu_seqlens"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 30, 20, 70], device=DEV)), "cu_seqlens"),
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(q=a["q"][:0], k=a["k"][:0], v=a["v"][:0], g=a["g"][:0], beta=a["beta"][:0]),
         "B >= 1"),
        (lambda a: a.update(v=a["v"].repeat(1, 1, 1, 2)[..., ::2]), "v must be contiguous"),
        (lambda a: a.update(initial_state=a["initial_state"].transpose(2, 3)),
         "initial_state must be contiguous"),
        (lambda a: a.update(scale=True), "scale"),
        (lambda a: a.update(scale=float("nan")), "scale"),
        (lambda a: a.update(scale=-1.0), "scale must be a positive"),  # the references refuse it too
        (lambda a: a.update(scale=0.0), "scale must be a positive"),
    ],
)
def test_bad_input_names_the_argument(mutate, match):
    q, k, v, g, beta = _inputs(1, 70, 1)
    args = {
        "q": q,
        "k": k,
        "v": v,
        "g": g,
        "beta": beta,
        "initial_state": torch.zeros(1, 1, 128, 128, device=DEV),
    }
    mutate(args)
    for fn in (kc.kda_chunk_before, kc.kda_chunk_after):
        with pytest.raises(ValueError, match=match):
            fn(**args)


@pytest.mark.parametrize("T", [100, 13, 200])
def test_prologue_writes_the_chunk_quantities(T):
    """The prologue against the PyTorch algebra (fp64) on every field the walks read: T = 100 is one full
    chunk and a 36-token one, 13 one chunk shorter than a 16-row block, 200 ends inside a block."""
    q, k, v, g, beta = _inputs(1, T, 2, seed=8)
    plan = kc.make_plan([T], 2, device=DEV)
    work = kc.kda_chunk_prologue(q, k, v, g, beta, plan, 128**-0.5)
    cq = sm.chunk_quantities(*(t.double() for t in (q, k, v, g, beta)))
    pairs = {
        "W": (work.w, cq.W),
        "U": (work.u, cq.U),
        "Qg": (work.qg, cq.Qg),
        "Aqk": (work.aqk, cq.Aqk),
        "KdT": (work.kdt, cq.Kd.transpose(-1, -2)),
        "d": (work.d, cq.d),
    }
    for name, (got, ref) in pairs.items():  # kernel layout [n, H, ...] vs [B=1, H, n, ...]
        torch.testing.assert_close(got.double(), ref[0].transpose(0, 1), rtol=2e-4, atol=2e-6, msg=name)


def test_bad_options():
    q, k, v, g, beta = _inputs(2, 70, 1)
    with pytest.raises(ValueError, match="B = 1"):
        kc.kda_chunk_after(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 70, 140]))
    with pytest.raises(ValueError, match="plan"):
        kc.kda_chunk_after(q, k, v, g, beta, plan=kc.make_plan([70], 1))
    with pytest.raises(ValueError, match="variant"):
        kc.kda_chunk(q, k, v, g, beta, variant="fast")
    with pytest.raises(ValueError, match="group_size"):
        kc.kda_chunk(q, k, v, g, beta, variant="before", group_size=2)
    plan = kc.make_plan([70, 70], 1, group_size=1, device=DEV)
    with pytest.raises(ValueError, match="group_size or plan"):
        kc.kda_chunk_after(q, k, v, g, beta, plan=plan, group_size=2)
    with pytest.raises(ValueError, match="kda_chunk_before needs a plan with group_size=None"):
        kc.kda_chunk_before(q, k, v, g, beta, plan=plan)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="plan's tables are on"):
            kc.kda_chunk_after(q, k, v, g, beta, plan=kc.make_plan([70, 70], 1, device="meta"))
    with pytest.raises(ValueError, match="work holds"):
        kc.kda_chunk_after(q, k, v, g, beta, work=kc.alloc_work(2, 2, q.dtype, q.device))
    with pytest.raises(ValueError, match="work must be"):
        kc.kda_chunk_after(q, k, v, g, beta, work={})
    with pytest.raises(ValueError, match="prologue needs a plan"):
        kc.kda_chunk_prologue(q, k, v, g, beta, None)
    with pytest.raises(TypeError, match="chunk_size"):
        kc.kda_chunk(q, k, v, g, beta, chunk_size=32)  # the kernels are built for 64-token chunks
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="group_size"):
            kc.make_plan([70], 1, group_size=bad)
    for lengths in ([], [70, -1], [True], "70", [7.0]):
        with pytest.raises(ValueError, match="lengths"):
            kc.make_plan(lengths, 1)
    with pytest.raises(ValueError, match="heads"):
        kc.make_plan([70], 0)
    with pytest.raises(ValueError, match="at most 65535"):
        kc.make_plan([64] * 70000, 1)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="chunk_size"):
            sm.chunk_quantities(*(t[:1].double() for t in (q, k, v, g, beta)), chunk_size=bad)
        with pytest.raises(ValueError, match="group_size"):
            sm.group_bounds(4, bad)
    with pytest.raises(ValueError, match="group_size"):
        sm.sequential_depth(4, 0)


# ---------------------------------------------------------------------------------------------
# backends


def test_backend_table_and_dispatch(monkeypatch):
    q, k, v, g, beta = _inputs(1, 70, 1)
    plan = kc.make_plan([70], 1, device=DEV)
    status = kc.BACKENDS.status()
    assert list(status) == ["cuda", "triton", "torch"] and all(why for _, why in status.values())
    assert [b.name for b in kc.BACKENDS] == ["cuda", "triton", "torch"]
    # fp32 inputs: the CUDA kernels take bf16 only, so the dispatcher picks Triton (here and on a GPU)
    assert kc.BACKENDS.choose(None, q, k, v, g, beta, plan)[0] == "triton"
    with pytest.raises(ValueError, match="backend='cuda' cannot run here"):
        kc.kda_chunk_before(q, k, v, g, beta, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        kc.kda_chunk_before(q, k, v, g, beta, backend="vulkan")
    monkeypatch.setenv(kc.BACKEND_ENV, "vulkan")
    with pytest.raises(ValueError, match="K3LAB_KDA_CHUNK_BACKEND must be one of"):
        kc.kda_chunk_after(q, k, v, g, beta)
    monkeypatch.setenv(kc.BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="K3LAB_KDA_CHUNK_BACKEND='cuda' cannot run here"):
        kc.BACKENDS.choose(None, q, k, v, g, beta, plan)
    monkeypatch.setenv(kc.BACKEND_ENV, "triton")
    assert kc.BACKENDS.choose(None, q, k, v, g, beta, plan)[0] == "triton"
    # the argument wins over the variable
    assert kc.BACKENDS.choose("triton", q, k, v, g, beta, plan)[0] == "triton"


@pytest.mark.parametrize("layout", ["cu_seqlens", "batch"])
def test_torch_row_computes_what_the_triton_row_computes(layout, monkeypatch):
    """backend='torch' (and the variable) select the reference row, before and after alike; on fresh
    random fp32 inputs (partial chunks, an empty sequence, initial states) it gives the Triton row's
    outputs and final states (the interpreter on CPU). It has no launches to hand out."""
    monkeypatch.delenv(kc.BACKEND_ENV, raising=False)
    row = kc.BACKENDS["torch"]
    assert row.before is row.after and row.available()[0]
    if layout == "cu_seqlens":
        lengths = [70, 0, 5]
        q, k, v, g, beta = _inputs(1, sum(lengths), 2, seed=21)
        cu = torch.tensor([0, 70, 70, 75], dtype=torch.int32, device=DEV)
    else:
        lengths, cu = [65, 65], None
        q, k, v, g, beta = _inputs(2, 65, 2, seed=22)
    S0 = torch.randn(len(lengths), 2, 128, 128, device=DEV) * 0.5
    plan = kc.make_plan(lengths, 2, device=DEV)
    assert kc.BACKENDS.choose("torch", q, k, v, g, beta, plan)[0] == "torch"
    for variant, kw in (("before", {}), ("after", {"group_size": 1})):
        o_t, S_t = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant=variant,
                                backend="triton", **kw)
        o_r, S_r = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant=variant,
                                backend="torch", **kw)
        assert o_r.dtype == o_t.dtype and S_r.shape == S_t.shape
        _check(o_r, S_r, o_t.double(), S_t.double())
    if cu is not None:
        torch.testing.assert_close(S_r[1], S0[1], rtol=0, atol=0)  # the empty sequence: its initial state
    monkeypatch.setenv(kc.BACKEND_ENV, "torch")
    o_e, _ = kc.kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, variant="after", group_size=1)
    assert torch.equal(o_e, o_r)  # the variable forces the same row
    monkeypatch.delenv(kc.BACKEND_ENV)
    with pytest.raises(ValueError, match="backend='torch' cannot run here: .* provides no prologue"):
        kc.after_launches(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu, plan=plan, backend="torch")


# ---------------------------------------------------------------------------------------------
# the study's helpers (no kernels)


def test_study_helpers():
    from k3lab.studies import kda_scan as ks

    c = ks.parse_case("h12_b8_t4096")
    assert (c.heads, c.batch, c.tokens) == (12, 8, 32768)
    with pytest.raises(ValueError, match="case"):
        ks.parse_case("h12-b1")
    names = ks.crossover_cases()
    assert "h12_b1_t65536" in names and "h96_b8_t65536" not in names
    assert ks.floor_for(c) > 0 and ks.chunk_flops(c) == 8 * 64 * 12 * (2 * 64 * 64 * 640 + 6 * 64 * 128 * 128)
    recs = [
        {
            "case": "h12_b1_t16384",
            "variant": v,
            "median_us": t,
            "shape": {"heads": 12, "batch": 1, "T": 16384},
            "floor_us": 70.0,
            "extra": {"group_size": 16},
        }
        for v, t in (("before", 400.0), ("after", 200.0), ("fla", 1000.0))
    ]
    pr = ks.predict("h12_b1_t16384", target="H200")
    assert pr["compute_units"] == 132 and pr["group_size"] == 24 and pr["steps_after"] == 2 * 24 + 10
    assert 60 < pr["floor_us"] < 90  # 303 MB over 4.25 TB/s
    with pytest.raises(ValueError, match="target"):
        ks.predict("h12_b1_t16384", target="TPU")
    df = ks.crossover_table(recs)
    assert df.loc[0, "after/before"] == pytest.approx(0.5) and df.loc[0, "after/fla"] == pytest.approx(0.2)


def test_after_without_groups_walks_like_the_before():
    """A plan without groups makes the after the plain walk: the same tiles as the before's
    (`choose_block_v`), not the replay's 64 columns."""
    from k3lab.ops.kda_chunk import walk

    before, after = kc.make_plan([100], 2), kc.make_plan([100], 2, group_size=None)
    assert walk.block_v(after) == walk.block_v(before) == kc.choose_block_v(1, 2)
    assert walk.block_v(kc.make_plan([640], 2, group_size=2)) == walk.REPLAY_BLOCK_V


@pytest.mark.follows_gpu  # the study puts its tensors on the GPU where there is one
def test_study_prologue_parts_are_named_like_the_committed_ones():
    """'<case>.parts' times each backend's prologue whole and the Triton one launch by launch, after an
    end-to-end check; the names are those of the committed H200 part records."""
    from k3lab.studies import kda_scan as ks

    recs = ks.run(cases=["h1_b1_t70.parts"])
    names = {r.case for r in recs}
    assert {f"h1_b1_t70.part_{p}" for p in ("prologue_rows_exactfixup", "rows_exactfixup_a",
                                            "rows_exactfixup_inverse", "rows_exactfixup_wu")} <= names
    whole = next(r for r in recs if r.case.endswith("part_prologue_rows_exactfixup"))
    assert "o" in whole.error and "failed" not in whole.error and whole.extra["backend"] == "triton"


@pytest.mark.follows_gpu  # the study puts its tensors on the GPU where there is one
def test_study_sweep_case_runs_the_group_size_sweep():
    """'<case>.sweep' is `group_size_sweep` of that case (what `k3lab bench kda_scan --cases` reaches):
    one checked record per group size below the chunk count, and the plain walk."""
    from k3lab.studies import kda_scan as ks

    recs = ks.run(cases=["h1_b1_t300.sweep"])  # 5 chunks: group size 4, then the walk
    assert [r.case for r in recs] == ["h1_b1_t300.gs4", "h1_b1_t300.walk"]
    assert [r.extra["group_size"] for r in recs] == [4, None]
    for r in recs:
        assert r.variant == "after" and "o" in r.error and "failed" not in r.error


def test_study_summary_text_of_the_committed_h200_records():
    """What `k3lab bench kda_scan` prints after the table: a line per crossover case with the records'
    medians, then the sweep by group size (the plain walk last); '' when the records hold neither."""
    from k3lab.studies import kda_scan as ks

    recs = ks.reference_records()
    if not recs:
        pytest.skip("no committed H200 kda_scan records in profiles/")
    text = ks.summary_text(recs)
    head = next(ln for ln in text.splitlines() if ln.startswith("h12_b1_t16384 "))
    after = next(r for r in recs if r.case == "h12_b1_t16384" and r.variant == "after")
    assert int(head.split()[2]) == round(after.median_us)
    sweep = text.split("group-size sweep (after):\n", 1)[1].splitlines()[1:]
    sizes = [ln.split()[1] for ln in sweep if ln.startswith("h12_b1_t16384")]
    assert sizes[-1] == "walk" and [int(x) for x in sizes[:-1]] == sorted(int(x) for x in sizes[:-1])
    swept = [r for r in recs if r.case.startswith("h12_b1_t16384.gs") or r.case == "h12_b1_t16384.walk"]
    assert len(sizes) == len(swept)
    assert ks.summary_text([r for r in recs if ".part_" in r.case]) == ""


def test_study_refuses_bad_names_before_any_input(monkeypatch):
    """An unknown backend or case name is a ValueError naming it before inputs are made or kernels run."""
    from k3lab.studies import kda_scan as ks

    def must_not_run(*a, **k):
        raise AssertionError("inputs were made before the names were checked")

    monkeypatch.setattr(ks.measure, "make_inputs", must_not_run)  # run() makes its inputs in measure
    with pytest.raises(ValueError, match="backend"):
        ks.run(cases=["h1_b1_t70"], backend="no_such_backend")
    with pytest.raises(ValueError, match="case"):
        ks.run(cases=["h1_b1_t70", "h1_b1_t70.swep"])


# ---------------------------------------------------------------------------------------------
# launch choices by device (the device facts are what env.detect() reports; nothing runs)


def _as_device(monkeypatch, backend: str, arch: str | None):
    from k3lab import env

    info = env.DeviceInfo(backend, arch or "cpu", 256, None, 64 if backend == "rocm" else 32, arch,
                          env.PEAKS["CPU"])
    monkeypatch.setattr(env, "detect", lambda: info)


@pytest.mark.parametrize("backend, arch, one, near, akk", [
    ("cuda", "sm_90", "tf32", "tf32x3", "tf32"),  # the H200's compiled configuration, unchanged
    ("rocm", "gfx942:sramecc+:xnack-", "tf32", "ieee", "ieee"),  # CDNA3: xf32 MFMA
    ("rocm", "gfx950", "ieee", "ieee", "ieee"),  # CDNA4: no xf32; Triton refuses 'tf32'
    ("cpu", None, "tf32", "ieee", "ieee"),  # the interpreter ignores the precision
])
def test_dot_precisions_by_device(monkeypatch, backend, arch, one, near, akk):
    from k3lab.ops.kda_chunk.inputs import dot_precisions

    _as_device(monkeypatch, backend, arch)
    assert dot_precisions(torch.bfloat16) == {"akk": akk, "aqk": one, "inv": near, "out": one, "scan": near,
                                              "walk": one}
    assert set(dot_precisions(torch.float32).values()) == {"ieee"}


@pytest.mark.parametrize("backend, arch, scan_stages, replay_stages", [
    ("cuda", "sm_90", 2, 2), ("rocm", "gfx950", 2, 2), ("rocm", "gfx942", 1, 1), ("cpu", None, 2, 2)])
def test_scan_and_replay_stages_fit_the_device_lds(monkeypatch, backend, arch, scan_stages, replay_stages):
    """Two stages of the scan and the 64-column replay ask for 72 KiB: one stage on a 64 KiB device;
    the 32-column plain walk's 64 KiB fits everywhere. (tests/test_isa.py checks the compiled LDS.)"""
    from k3lab.ops.kda_chunk import inputs, scan, walk

    _as_device(monkeypatch, backend, arch)
    plan = kc.make_plan([64 * 20], 2, group_size=4, device="cpu")
    assert plan.uses_scan and walk.block_v(plan) == 64
    assert inputs.pipeline_stages(scan.TWO_STAGE_LDS) == scan_stages
    assert inputs.pipeline_stages(walk.WALK_TWO_STAGE_LDS[walk.block_v(plan)]) == replay_stages
    assert inputs.pipeline_stages(walk.WALK_TWO_STAGE_LDS[32]) == 2
