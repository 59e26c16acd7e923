"""The router + expert sort (k3lab.ops.moe_router): the one launch and the two launches against
nn.moe.route followed by moe_experts.sort_by_expert (Triton's interpreter on a CPU, compiled on a GPU where
there is one), ties and NaN against the documented order, the grouped expert kernels fed either sort, bad
input, the pair bounds, backend choice and graph capture."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.nn.moe import route
from k3lab.ops import moe_experts as me
from k3lab.ops import moe_router as mr
from k3lab.ops.moe_experts import triton as me_triton
from k3lab.ops.moe_router import triton as router

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the same checks run compiled where there is a GPU
FIELDS = ("pair_of_row", "tile_expert", "n_tiles", "counts")
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CUDA graph capture)")


def router_inputs(n, e, k, seed, bias=True):
    """Fresh logits and bias whose choices sigmoid(logits) + bias are a random permutation per token of
    jittered, evenly spaced values in [0.1, 0.9], so no two are within rounding of each other (the
    selection and its order do not hang on ties); checked here."""
    gen = torch.Generator().manual_seed(seed)
    b = (torch.rand(e, generator=gen) - 0.5) * 0.1 if bias else None
    step = 0.8 / e
    grid = 0.1 + step * (torch.arange(e) + 0.6 * torch.rand(n, e, generator=gen))
    choice = torch.stack([row[torch.randperm(e, generator=gen)] for row in grid]) if n else grid
    logits = torch.logit(choice - (0 if b is None else b)).float()
    got = torch.sigmoid(logits) + (0 if b is None else b)
    top = got.topk(min(k + 1, e), dim=-1).values
    assert n == 0 or (top[:, :-1] - top[:, 1:]).min() > 0.3 * step
    return logits.to(DEV), None if b is None else b.to(DEV)


def assert_same(got, logits, bias, k, scaling, renormalize, m):
    weights, idx, sort = got
    w0, i0, _ = route(logits, bias, k, scaling, renormalize)
    s0 = me.sort_by_expert(i0, logits.shape[1], m)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(idx, i0)  # the same experts in the same (descending) order
    torch.testing.assert_close(weights, w0, rtol=1e-6, atol=0)
    for f in FIELDS:
        assert getattr(sort, f).dtype == getattr(s0, f).dtype, f
        assert torch.equal(getattr(sort, f), getattr(s0, f)), f
    assert (sort.block_m, sort.max_tiles, sort.pairs) == (s0.block_m, s0.max_tiles, s0.pairs)


@pytest.mark.parametrize("n, e, k, m, scaling, renormalize, bias", [
    (5, 8, 2, 16, 1.0, True, True),
    (7, 24, 4, 32, 2.5, False, True),
    (3, 40, 40, 16, 1.0, True, False),   # top_k = E: every expert, none left over
    (70, 8, 3, 16, 2.5, True, True),     # 210 pairs: two blocks of the sort, several tiles per expert
    (9, 20, 5, 64, 1.0, True, True),
])
def test_triton_matches_route_then_sort_by_expert(n, e, k, m, scaling, renormalize, bias):
    logits, b = router_inputs(n, e, k, seed=n * 100 + e, bias=bias)
    got = mr.route_and_sort(logits, b, k, scaling=scaling, renormalize=renormalize, block_m=m,
                            backend="triton")
    assert_same(got, logits, b, k, scaling, renormalize, m)


@pytest.mark.parametrize("n", [1, 64])
def test_k3_sizes(n):
    """K3: E = 896, top_k = 16, 16-row tiles (the decode default)."""
    logits, b = router_inputs(n, 896, 16, seed=n)
    m = me.default_block_m(n, 16, 896)
    got = mr.route_and_sort(logits, b, 16, scaling=2.5, block_m=m, backend="triton")
    assert_same(got, logits, b, 16, 2.5, True, m)


def test_the_sort_on_64_lane_devices_takes_smaller_blocks_and_sorts_the_same(monkeypatch):
    assert router.sort_block_cap(32) == 128 and router.sort_block_cap(64) == 32
    monkeypatch.setattr(router, "sort_block_cap", lambda wave_width=None: 32)
    logits, b = router_inputs(64, 96, 16, seed=9)  # 1,024 pairs: 32 blocks of 32
    got = mr.route_and_sort(logits, b, 16, block_m=16, backend="triton")
    assert_same(got, logits, b, 16, 1.0, True, 16)
    logits, b = router_inputs(7, 40, 16, seed=10)  # the one launch with the block-walking sort
    assert_same(router.route_sort(logits, b, 16, 1.0, True, 16), logits, b, 16, 1.0, True, 16)


def test_the_pair_bound_runs_and_one_more_token_raises():
    n = mr.MAX_PAIRS // 16
    logits, b = router_inputs(n, 64, 16, seed=5)
    assert_same(mr.route_and_sort(logits, b, 16, block_m=32, backend="triton"), logits, b, 16, 1.0, True, 32)
    big = torch.randn(n + 1, 64, device=DEV)
    with pytest.raises(ValueError, match=rf"N={n + 1} tokens"):
        mr.route_and_sort(big, b, 16, block_m=32, backend="triton")
    w, idx, sort = mr.route_and_sort(big, b, 16, block_m=32)  # none forced: the torch path takes it
    assert torch.equal(sort.counts, me.sort_by_expert(idx, 64, 32).counts)
    with pytest.raises(ValueError, match="MAX_PAIRS"):
        mr.sort_pairs(idx, 64, 32)
    with pytest.raises(ValueError, match=rf"N={n + 1} tokens.*MAX_PAIRS"):
        router.route_sort(big, b, 16, 1.0, True, 32)


def test_grouped_experts_give_the_same_output_with_either_sort():
    """The grouped kernels fed this sort against the same kernels fed sort_by_expert's, and against the
    per-expert torch loop."""
    n, e, k, lat, f, m = 6, 8, 2, 64, 32, 16
    logits, b = router_inputs(n, e, k, seed=11)
    gen = torch.Generator().manual_seed(12)
    z = torch.randn(n, lat, generator=gen).to(DEV)
    w1, w3 = (torch.randn(e, f, lat, generator=gen).to(DEV) * lat ** -0.5 for _ in range(2))
    w2 = torch.randn(e, lat, f, generator=gen).to(DEV) * f ** -0.5
    weights, idx, sort = mr.route_and_sort(logits, b, k, block_m=m, backend="triton")
    shapes = me.check_inputs(z, weights, idx, w1, w3, w2, check_values=False)
    y = me_triton.grouped_experts(z, weights, idx, w1, w3, w2, shapes, sort)
    y_ref_sort = me_triton.grouped_experts(z, weights, idx, w1, w3, w2, shapes, me.sort_by_expert(idx, e, m))
    assert torch.equal(y, y_ref_sort)
    torch.testing.assert_close(y, me.expert_loop(z, weights, idx, w1, w3, w2), rtol=1e-5, atol=1e-5)


def test_no_tokens():
    logits = torch.randn(0, 8, device=DEV)
    weights, idx, sort = mr.route_and_sort(logits, None, 2, block_m=16, backend="triton")
    assert weights.shape == idx.shape == (0, 2)
    assert sort.max_tiles == sort.pairs == 0 and int(sort.n_tiles) == 0 and not sort.counts.any()


def test_nan_logits_keep_indices_in_range():
    logits, b = router_inputs(4, 16, 4, seed=3)
    logits[1, :5] = float("nan")
    _, idx, sort = mr.route_and_sort(logits, b, 4, block_m=16, backend="triton")
    assert ((idx >= 0) & (idx < 16)).all()
    assert all(len(set(row.tolist())) == 4 for row in idx)  # distinct experts per token
    assert not torch.isin(idx[1], torch.arange(5, device=DEV)).any()  # NaN scores go last
    assert int(sort.counts.sum()) == 16


def test_the_torch_path_is_route_then_sort_by_expert():
    logits, b = router_inputs(5, 12, 3, seed=2)
    got = mr.route_and_sort(logits, b, 3, scaling=1.5, block_m=16, backend="torch")
    assert_same(got, logits, b, 3, 1.5, True, 16)
    w, _, _ = mr.route_and_sort(logits.double(), b, 3, block_m=16, backend="torch")
    assert w.dtype == torch.float64
    with pytest.raises(ValueError, match="fp64 runs on backend='torch'"):
        mr.route_and_sort(logits.double(), b, 3, block_m=16, backend="triton")


@pytest.mark.parametrize("kwargs, match", [
    ({"logits": torch.randn(8)}, "logits must be a 2-D"),
    ({"logits": torch.ones(2, 8, dtype=torch.int32)}, "logits must be float32, bfloat16, float16 or float64"),
    ({"logits": torch.randn(2, 0)}, "at least one expert"),
    ({"bias": torch.randn(7)}, r"bias must be \[E=8\] \(or None\), got \(7,\)"),
    ({"bias": torch.ones(8, dtype=torch.int64)}, "bias must be a floating-point"),
    ({"top_k": 0}, "top_k must be an integer in"),
    ({"top_k": 9}, "top_k must be an integer in"),
    ({"top_k": 2.0}, "top_k must be an integer in"),
    ({"top_k": True}, "top_k must be an integer in"),
    ({"scaling": "2"}, "scaling must be a real number"),
    ({"renormalize": 1}, "renormalize must be a bool"),
    ({"num_experts": 7}, "num_experts must equal"),
    ({"block_m": 8}, "block_m must be one of"),
    ({"backend": "cuda"}, "backend must be one of"),
])
def test_bad_input_names_the_argument(kwargs, match):
    args = {"logits": torch.randn(2, 8), "bias": torch.randn(8), "top_k": 2, "scaling": 1.0,
            "renormalize": True, "num_experts": None, "block_m": 16, "backend": None} | kwargs
    logits, bias, top_k = (args.pop(a) for a in ("logits", "bias", "top_k"))
    with pytest.raises(ValueError, match=match):
        mr.route_and_sort(logits, bias, top_k, **args)


def test_sort_pairs_bad_input():
    for idx, match in ((torch.zeros(4, 2), "int32 or int64"),
                       (torch.zeros(2, 4, dtype=torch.long).t(), "contiguous")):
        with pytest.raises(ValueError, match=match):
            mr.sort_pairs(idx, 8, 16)
    with pytest.raises(ValueError, match="num_experts must be a positive"):
        mr.sort_pairs(torch.zeros(2, 2, dtype=torch.long), 0, 16)


def test_backend_choice_and_the_environment_variable(monkeypatch):
    logits = torch.randn(2, 8)
    def pick(backend):
        return mr.BACKENDS.choose(backend, logits.device, logits.shape[0], 2, logits.dtype)[0]

    monkeypatch.delenv(mr.BACKEND_ENV, raising=False)
    assert pick(None) == "torch"  # CPU tensors: the interpreter is for tests
    monkeypatch.setenv(mr.BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # forcing triton on CPU tensors needs the interpreter
    assert pick(None) == "triton"
    monkeypatch.setenv(mr.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=mr.BACKEND_ENV):
        pick(None)
    monkeypatch.delenv(mr.BACKEND_ENV)
    with pytest.raises(ValueError, match="MAX_PAIRS"):  # the single-program sort's bound, by the verifier
        mr.BACKENDS.choose("triton", logits.device, mr.MAX_PAIRS + 1)
    assert mr.BACKENDS.choose(None, "cuda", mr.MAX_PAIRS // 2 + 1, 2)[0] == "torch"  # past the bound
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not mr.BACKENDS.check("triton", "cpu")[0]
    with pytest.raises(ValueError, match="cannot run here"):
        pick("triton")


@GPU_ONLY
@pytest.mark.parametrize("n", [1, 64])
def test_captured_in_a_cuda_graph_on_gpu(n):
    """One graph of the two launches, replayed on new logits written into the captured input."""
    logits, b = router_inputs(n, 896, 16, seed=20 + n, bias=False)
    m = me.default_block_m(n, 16, 896)
    static = logits.clone()
    mr.route_and_sort(static, b, 16, block_m=m, backend="triton")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mr.route_and_sort(static, b, 16, block_m=m, backend="triton")
    fresh, _ = router_inputs(n, 896, 16, seed=40 + n, bias=False)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert_same(out, fresh, b, 16, 1.0, True, m)


def test_ties_go_to_the_lowest_expert_index():
    """The triton path's own tie rule (torch.topk documents none, so no test compares ties with it)."""
    logits = torch.zeros(2, 16, device=DEV)
    logits[1, 9:] = 1.0
    _, idx, _ = mr.route_and_sort(logits, None, 4, block_m=16, backend="triton")
    assert idx.tolist() == [[0, 1, 2, 3], [9, 10, 11, 12]]


def ordered_reference(logits, bias, k, scaling, renormalize, m):
    """The documented order in plain torch: descending sigmoid(logits) + bias by a stable sort (the lowest
    expert first among equal scores), NaN scores last; the weights as route makes them, the sort by
    sort_by_expert. Equal to route's choice wherever the top k + 1 scores are distinct."""
    scores = torch.sigmoid(logits.float())
    choice = scores if bias is None else scores + bias.float()
    idx = torch.sort(choice.nan_to_num(float("-inf")), dim=-1, descending=True, stable=True).indices[:, :k]
    w = scores.gather(-1, idx)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, idx, me.sort_by_expert(idx, logits.shape[1], m)


def assert_as_documented(got, logits, bias, k, scaling, renormalize, m):
    """got against ordered_reference (exactly: experts, order, sort; weights to fp32 rounding), and, where no
    NaN is chosen, the chosen scores equal the torch path's, slot by slot (ties may differ in index only)."""
    weights, idx, sort = got
    w0, i0, s0 = ordered_reference(logits, bias, k, scaling, renormalize, m)
    assert idx.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(idx, i0)
    torch.testing.assert_close(weights, w0, rtol=1e-6, atol=0, equal_nan=True)
    for f in FIELDS:
        assert getattr(sort, f).dtype == getattr(s0, f).dtype, f
        assert torch.equal(getattr(sort, f), getattr(s0, f)), f
    assert (sort.block_m, sort.max_tiles, sort.pairs) == (s0.block_m, s0.max_tiles, s0.pairs)
    choice = torch.sigmoid(logits.float()) + (0 if bias is None else bias.float())
    if not choice.isnan().any():
        _, i_torch, _ = route(logits, bias, k, scaling, renormalize)
        assert torch.equal(choice.gather(-1, idx), choice.gather(-1, i_torch))


def one_or_two_launches(launches, logits, bias, k, scaling, renormalize, m):
    if launches == 1:
        return router.route_sort(logits, bias, k, scaling, renormalize, m)
    weights, idx = router.topk_weights(logits, bias, k, scaling, renormalize)
    return weights, idx, router.sort_pairs(idx, logits.shape[1], m)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


@pytest.mark.parametrize("n, dtype, bias", [
    (1, F32, True), (1, F32, False), (1, BF16, True), (1, F16, False),
    (2, F32, True), (2, BF16, False), (2, F16, True),
    (7, F32, False), (7, BF16, True), (7, F16, True),      # 112 pairs: the sort in one block
    (64, F32, True), (64, BF16, False),                    # 1,024 pairs: the sort a block at a time
    (128, F16, True), (128, F32, False),                   # 2,048 pairs: MAX_PAIRS
])
def test_the_one_launch_on_fresh_logits(n, dtype, bias):
    """The one launch at any N within MAX_PAIRS (route_and_sort takes it up to FUSED_PAIRS), on fresh random
    logits of each dtype, with and without bias. E = 40 (a partly masked 64-wide row) keeps the interpreter
    quick; bf16 logits without bias tie exactly and often."""
    gen = torch.Generator().manual_seed(1000 * n + (dtype == BF16) + 2 * (dtype == F16) + 4 * bias)
    e, k = 40, 16
    logits = (torch.randn(n, e, generator=gen) * 2).to(dtype).to(DEV)
    b = (torch.randn(e, generator=gen) * 0.05).to(DEV) if bias else None
    m = me.default_block_m(n, k, e)
    got = router.route_sort(logits, b, k, 2.5, True, m)
    assert_as_documented(got, logits, b, k, 2.5, True, m)


@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("bias", [True, False])
def test_exact_ties_follow_the_documented_order(launches, bias):
    """Scores on four levels (and two bias levels): many exact ties, each broken by the lowest expert index,
    as the stable reference does; the chosen scores equal the torch path's."""
    gen = torch.Generator().manual_seed(7 + launches + 2 * bias)
    n, e, k = 6, 24, 8
    logits = torch.randint(-1, 3, (n, e), generator=gen).float().to(DEV)
    b = (torch.randint(0, 2, (e,), generator=gen) * 0.5).to(DEV) if bias else None
    got = one_or_two_launches(launches, logits, b, k, 1.0, False, 16)
    assert_as_documented(got, logits, b, k, 1.0, False, 16)


@pytest.mark.parametrize("launches", [1, 2])
def test_nan_scores_go_last_in_index_order(launches):
    """NaN logits: chosen only when too few scores are left, then last and lowest index first (their weights
    are NaN, as the torch path's would be); the ExpertSort is the reference's."""
    logits, b = router_inputs(4, 16, 4, seed=3 + launches)
    logits[1, :5] = float("nan")
    logits[2, 2:15] = float("nan")  # 13 NaN of 16: one of them is chosen
    got = one_or_two_launches(launches, logits, b, 4, 1.0, True, 16)
    assert_as_documented(got, logits, b, 4, 1.0, True, 16)
    assert set(got[1][2, :3].tolist()) == {0, 1, 15} and int(got[1][2, 3]) == 2  # the lowest NaN index


def test_route_and_sort_takes_one_launch_up_to_fused_pairs(monkeypatch):
    calls = []  # route_and_sort has checked its inputs: it calls the launchers that do not check again
    for where, name in ((mr.triton, "launch_route_sort"), (mr.triton, "launch_topk_weights"),
                        (mr, "sort_pairs")):
        real = getattr(where, name)
        monkeypatch.setattr(where, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    k = 4
    for n in (1, mr.FUSED_PAIRS // k, mr.FUSED_PAIRS // k + 1):
        logits, b = router_inputs(n, 16, k, seed=n)
        calls.clear()
        got = mr.route_and_sort(logits, b, k, block_m=16, backend="triton")
        assert_same(got, logits, b, k, 1.0, True, 16)
        assert calls == (["launch_route_sort"] if n * k <= mr.FUSED_PAIRS
                         else ["launch_topk_weights", "sort_pairs"])


def test_the_glue_bench_checks_each_router_form_and_tables_them(monkeypatch):
    """decode_step.glue's one-launch-against-two records: a form that differs from the torch path stops the
    bench before anything is timed; the table puts each size's three timings on one row."""
    from k3lab import bench
    from k3lab.studies.decode_step import glue

    real = router.route_sort

    def swapped(*a, **kw):
        w, idx, s = real(*a, **kw)
        return w, idx.flip(-1), s

    monkeypatch.setattr(router, "route_sort", swapped)
    with pytest.raises(bench.CheckFailed, match=r"one launch at N = 1, 4 warps"):
        glue.launch_records((1,), device=DEV, repeats=1)
    t = {v: bench.Timing(us, us, us, 3, "graph", 0.0)
         for v, us in (("torch", 40.0), ("two", 9.0), ("one", 5.0))}
    recs = [bench.make_record("decode_step", "glue.moe_router.N1", "before", t["torch"], shape={"tokens": 1},
                              dtype="float32")]
    for v, us in (("before", "two"), ("after", "one")):
        recs.append(bench.make_record("decode_step", "glue.moe_router.launches.N1.w8", v, t[us],
                                      shape={"tokens": 1, "topk_warps": 8}, dtype="float32"))
    row = glue.router_table(recs).splitlines()[1].split()
    assert row[:5] == ["1", "8", "40.00", "9.00", "5.00"] and "1 launch" in " ".join(row[5:])


@pytest.mark.parametrize("launches", [1, 2])
@pytest.mark.parametrize("n, e, k", [(3, 1, 1), (5, 2, 1), (1, 9, 1), (2, 2, 2)])
def test_narrow_rows_and_top_1(launches, n, e, k):
    """One or two experts, and top-1 (a top-k network of one key per row is widened to two)."""
    gen = torch.Generator().manual_seed(n * 10 + e + k)
    logits = torch.randn(n, e, generator=gen).to(DEV)
    got = one_or_two_launches(launches, logits, None, k, 1.0, True, 16)
    assert_as_documented(got, logits, None, k, 1.0, True, 16)
