"""KDA decode (seed section 3): the reference against the equations and the nn layer, the unfused
Triton chain against the reference (CPU, Triton's interpreter), bad input, and on a GPU the fused
kernel (kernels/kda_decode.cu) against the reference for every compiled config and both layouts."""

import math

import pytest
import torch

from k3lab import bench
from k3lab.bench import timing
from k3lab.config import K3Config
from k3lab.model import init_weights
from k3lab.nn import KDACache
from k3lab.nn.kda import KimiDeltaAttention
from k3lab.ops import kda_decode as kd

GPU = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not GPU, reason="the fused kernel needs a CUDA/ROCm GPU; none is visible")

# the unfused chain's Triton kernels need GPU tensors on a GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def plain_step(inputs, cache, w, state_layout="kv"):
    """The decode step written from docs/k3.md with plain fp64 torch, per head."""
    d = torch.float64
    q, k, v = (inputs[n].to(d) for n in ("q", "k", "v"))
    B, C = q.shape
    H, K = C // 128, 128

    def conv(x, wt, st):
        xs = torch.cat([st.to(d), x[..., None]], -1)  # [B, C, 4], oldest first
        y = (xs * wt.to(d)).sum(-1)
        return y * torch.sigmoid(y), xs[..., 1:]

    yq, cq = conv(q, w.conv_q, cache.conv_q)
    yk, ck = conv(k, w.conv_k, cache.conv_k)
    yv, cv = conv(v, w.conv_v, cache.conv_v)
    out = torch.empty(B, H, K, dtype=d)
    S_all = cache.state.to(d).clone()
    for b in range(B):
        for h in range(H):
            sl = slice(h * K, (h + 1) * K)
            qh = yq[b, sl] / torch.sqrt((yq[b, sl] ** 2).sum() + 1e-6) * K ** -0.5
            kh = yk[b, sl] / torch.sqrt((yk[b, sl] ** 2).sum() + 1e-6)
            g = w.lower_bound * torch.sigmoid(torch.exp(w.A_log[h].to(d)) * (inputs["g_raw"][b, sl].to(d)
                                                                            + w.dt_bias[sl].to(d)))
            beta = torch.sigmoid(inputs["beta_raw"][b, h].to(d))
            S = S_all[b, h] if state_layout == "kv" else S_all[b, h].T
            S = torch.exp(g)[:, None] * S
            u = S.T @ kh
            S = S + torch.outer(kh, beta * (yv[b, sl] - u))
            o = S.T @ qh
            S_all[b, h] = S if state_layout == "kv" else S.T
            o = o / torch.sqrt((o ** 2).mean() + w.eps) * w.o_norm.to(d)
            out[b, h] = o * torch.sigmoid(inputs["gate"][b, sl].to(d))
    return out.reshape(B, C), KDACache(cq, ck, cv, S_all)


def assert_cache_close(got, ref, *, state_tol=1e-10):
    for n in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(getattr(got, n).to(torch.float64), getattr(ref, n).to(torch.float64)), n
    torch.testing.assert_close(got.state.to(torch.float64), ref.state.to(torch.float64), rtol=state_tol,
                               atol=state_tol)


# ------------------------------------------------------------------ reference (CPU)
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_reference_matches_plain_equations_fp64(layout):
    inputs, cache, w = kd.make_example(2, 2, dtype=torch.float64, state_layout=layout, seed=11)
    cache.state = cache.state.double()
    out, new = kd.reference(**inputs, cache=cache, weights=w, state_layout=layout,
                            compute_dtype=torch.float64)
    ref_out, ref = plain_step(inputs, cache, w, layout)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    assert_cache_close(new, ref)
    assert not torch.equal(new.state, cache.state)  # the step changed the state: the test can fail


def test_reference_is_pure():
    inputs, cache, w = kd.make_example(1, 1, dtype=torch.float32, seed=3)
    before = kd.clone_cache(cache)
    kd.reference(**inputs, cache=cache, weights=w)
    assert_cache_close(cache, before, state_tol=0)


def test_reference_matches_the_nn_layer_decode_fp64():
    """The op's inputs are the layer's projections: o_proj(reference) must equal the layer's T=1 step."""
    cfg = K3Config.tiny()
    layer = init_weights(KimiDeltaAttention(cfg, dtype=torch.float64), seed=5)
    with torch.no_grad():
        layer.A_log.copy_(torch.log(torch.linspace(1.0, 16.0, layer.num_heads, dtype=torch.float64)))
        layer.dt_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    B, H = 2, layer.num_heads
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(B, 1, cfg.hidden_size, generator=gen, dtype=torch.float64)
    cache = layer.empty_cache(B, state_dtype=torch.float64)
    for t in (cache.conv_q, cache.conv_k, cache.conv_v, cache.state):
        t.normal_(0, 0.3, generator=gen)
    with torch.no_grad():
        want, want_cache = layer(x, cache=cache)
        inputs = {"q": layer.q_proj(x)[:, 0], "k": layer.k_proj(x)[:, 0], "v": layer.v_proj(x)[:, 0],
                  "g_raw": layer.f_b(layer.f_a(x))[:, 0], "beta_raw": layer.b_proj(x)[:, 0],
                  "gate": layer.g_proj(x)[:, 0]}
        w = kd.KDADecodeWeights.from_layer(layer, dtype=torch.float64)
        out, new = kd.reference(**inputs, cache=cache, weights=w, compute_dtype=torch.float64)
        got = layer.o_proj(out)
    torch.testing.assert_close(got, want[:, 0], rtol=1e-10, atol=1e-10)
    assert_cache_close(new, want_cache)
    assert B * H * 128 == out.numel()


def test_handoff_rounding_is_what_differs():
    """Rounding the conv outputs and o to bf16 (the unfused chain's handoffs) moves the result by
    bf16-sized amounts; without it the reference is unchanged."""
    inputs, cache, w = kd.make_example(2, 2, dtype=torch.bfloat16, seed=4)
    out, new = kd.reference(**inputs, cache=cache, weights=w)
    out_h, new_h = kd.reference(**inputs, cache=cache, weights=w, handoff_dtype=torch.bfloat16)
    rel = (new_h.state - new.state).norm() / new.state.norm()
    assert 1e-5 < rel < 2e-2
    bench.check(out_h, out, dtype="bf16", name="output")


# ------------------------------------------------------------------ before (CPU: Triton interpreter)
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_before_matches_reference_fp32(layout):
    inputs, cache, w = kd.make_example(2, 2, dtype=torch.float32, state_layout=layout, device=DEVICE, seed=21)
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, state_layout=layout,
                                compute_dtype=torch.float64)
    out = kd.kda_decode(**inputs, cache=cache, weights=w, backend="triton", state_layout=layout)
    bench.check(out, ref_out, dtype="fp32", name="output")
    bench.check(cache.state, ref.state, dtype="fp32", name="state")
    assert_cache_close(KDACache(cache.conv_q, cache.conv_k, cache.conv_v, ref.state), ref)


def test_rows_carry_the_bound_steps_of_their_variants():
    """plan_before / plan_after per row: the torch row (the reference) binds both, the Triton chain only
    the before, the fused kernel only the after; a step asks for its variant's row."""
    assert {b.name: sorted(b.parts) for b in kd.BACKENDS} == {
        "cuda": ["plan_after"], "torch": ["plan_after", "plan_before"], "triton": ["plan_before"]}
    for variant in kd.VARIANTS:
        inputs, cache, w = kd.make_example(1, 2, dtype=torch.float32, device=DEVICE, seed=24)
        ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, compute_dtype=torch.float64)
        step = kd.KDADecodeStep(cache, w, backend="torch", variant=variant)
        bench.check(step(**inputs), ref_out, dtype="fp32", name=f"{variant} output")
        bench.check(cache.state, ref.state, dtype="fp32", name=f"{variant} state")
    with pytest.raises(ValueError, match="backend 'triton' provides no plan_after"):
        kd.KDADecodeStep(cache, w, backend="triton", variant="after")
    with pytest.raises(ValueError, match="variant must be one of"):
        kd.KDADecodeStep(cache, w, variant="middle")


def test_before_bf16_matches_reference_with_the_same_handoffs():
    inputs, cache, w = kd.make_example(3, 1, dtype=torch.bfloat16, device=DEVICE, seed=22)
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, compute_dtype=torch.float64,
                                handoff_dtype=torch.bfloat16)
    out = torch.empty(3, 128, dtype=torch.bfloat16, device=DEVICE)
    got = kd.before(**inputs, cache=cache, weights=w, out=out)
    assert got is out
    bench.check_all({"output": (out, ref_out), "state": (cache.state, ref.state)},
                    {"output": "bf16", "state": "bf16"})
    for n in ("conv_q", "conv_k", "conv_v"):
        assert torch.equal(getattr(cache, n).double(), getattr(ref, n)), n


def test_before_takes_views_of_one_packed_projection():
    """q, k, v as column slices of one [B, 3*H*K] buffer (row stride 3*H*K), as a fused projection gives."""
    inputs, cache, w = kd.make_example(2, 1, dtype=torch.float32, device=DEVICE, seed=23)
    packed = torch.cat([inputs["q"], inputs["k"], inputs["v"]], 1)
    views = dict(inputs, q=packed[:, :128], k=packed[:, 128:256], v=packed[:, 256:])
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, compute_dtype=torch.float64)
    out = kd.before(**views, cache=cache, weights=w)
    bench.check(out, ref_out, dtype="fp32", name="output")
    bench.check(cache.state, ref.state, dtype="fp32", name="state")


def test_before_conv_branch_per_input_is_bit_identical(monkeypatch):
    """On AMD the conv kernel runs each input's code in its own branch (Triton's AMD pointer pass cannot
    take a pointer chosen among tensors); outputs and every cache tensor equal the one-body form's."""
    from k3lab import env

    inputs, cache, w = kd.make_example(3, 2, dtype=torch.bfloat16, device=DEVICE, seed=25)
    runs = {}
    for name, info in (("one body", env.detect()),
                       ("branch",
                        env.DeviceInfo("rocm", "MI355X", 256, None, 64, "gfx950", env.PEAKS["CPU"]))):
        monkeypatch.setattr(env, "detect", lambda info=info: info)
        c = KDACache(*(t.clone() for t in (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)))
        runs[name] = (kd.before(**inputs, cache=c, weights=w), c)
    (o1, c1), (o2, c2) = runs["one body"], runs["branch"]
    assert torch.equal(o1, o2)
    for n in ("conv_q", "conv_k", "conv_v", "state"):
        assert torch.equal(getattr(c1, n), getattr(c2, n)), n
        assert not torch.equal(getattr(c1, n), getattr(cache, n)), n  # the step moved it


def test_three_steps_carry_state():
    inputs, cache, w = kd.make_example(1, 1, dtype=torch.float32, device=DEVICE, seed=24)
    ref_cache = KDACache(*(t.double() for t in (cache.conv_q, cache.conv_k, cache.conv_v, cache.state)))
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        step_in = {n: torch.randn(t.shape, generator=gen, dtype=torch.float64).to(DEVICE) for n, t
                   in inputs.items()}
        ref_out, ref_cache = kd.reference(**step_in, cache=ref_cache, weights=w, compute_dtype=torch.float64)
        out = kd.before(**{n: t.float() for n, t in step_in.items()}, cache=cache, weights=w)
        bench.check(out, ref_out, dtype="fp32", name=f"output step {step}")
    bench.check(cache.state, ref_cache.state, dtype="fp32", name="state")


# ------------------------------------------------------------------ the bound step (CPU)
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bound_step_matches_the_functional_form(backend):
    inputs, cache, w = kd.make_example(2, 2, dtype=torch.float32, device=DEVICE, seed=25)
    c1, c2 = kd.clone_cache(cache), kd.clone_cache(cache)
    step = kd.KDADecodeStep(c1, w, backend=backend)
    for _ in range(2):  # two tokens: the bound cache carries the state
        got = step(*(inputs[n] for n in kd.TOKEN_INPUTS))
        want = kd.kda_decode(**inputs, cache=c2, weights=w, backend=backend)
    assert got is step.out
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(c1.state, c2.state, rtol=0, atol=0)


def test_bound_step_checks_each_token_input():
    inputs, cache, w = kd.make_example(2, 2, dtype=torch.float32, seed=26)
    step = kd.KDADecodeStep(cache, w, backend="triton")
    args = [inputs[n] for n in kd.TOKEN_INPUTS]
    for i, name in enumerate(kd.TOKEN_INPUTS):
        bad = list(args)
        bad[i] = args[i][:1]
        with pytest.raises(ValueError, match=f"{name} must be"):
            step(*bad)
    bad = list(args)
    bad[5] = torch.randn(256, 2).t()  # right shape, last dimension strided
    with pytest.raises(ValueError, match="gate must have a stride-1 last dim"):
        step(*bad)
    with pytest.raises(ValueError, match="apply to backend='cuda' only"):
        kd.KDADecodeStep(cache, w, backend="triton", tile_v=16)


# ------------------------------------------------------------------ entry point and bad input (CPU)
def test_reference_backend_updates_in_place():
    inputs, cache, w = kd.make_example(2, 1, dtype=torch.float32, seed=31)
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w)
    out = kd.kda_decode(**inputs, cache=cache, weights=w, backend="torch")
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(cache.state, ref.state)


@pytest.mark.skipif(GPU, reason="checks what backend=None does without a GPU")
def test_auto_without_gpu_says_it_uses_the_reference():
    ok, why = kd.fused_status()
    assert not ok and "reference" in why
    inputs, cache, w = kd.make_example(1, 1, dtype=torch.bfloat16, seed=32)
    ref_out, _ = kd.reference(**inputs, cache=cache, weights=w)
    out = kd.kda_decode(**inputs, cache=cache, weights=w)  # auto
    bench.check(out, ref_out, dtype="bf16")
    inputs, cache, w = kd.make_example(1, 1, seed=33)
    with pytest.raises(ValueError, match="GPU"):
        kd.after(**inputs, cache=cache, weights=w)


def _bad(**change):
    inputs, cache, w = kd.make_example(2, 2, dtype=torch.float32, seed=40)
    args = dict(inputs, cache=cache, weights=w)
    args.update(change)
    return args


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("change, match", [
    (lambda a: {"q": a["q"][:, :200]}, "q must be"),
    (lambda a: {"k": a["k"][:1]}, "k must be"),
    (lambda a: {"beta_raw": a["beta_raw"][:, :1]}, "beta_raw must be"),
    (lambda a: {"gate": a["gate"].double()}, "gate must be float32, got torch.float64"),  # q's dtype
    (lambda a: {"cache": KDACache(a["cache"].conv_q, a["cache"].conv_k, a["cache"].conv_v,
                                  a["cache"].state.bfloat16())}, "cache.state must be float32 or float64"),
    (lambda a: {"cache": KDACache(a["cache"].conv_q[..., :2], a["cache"].conv_k, a["cache"].conv_v,
                                  a["cache"].state)}, "cache.conv_q must be"),
    (lambda a: {"cache": KDACache(a["cache"].conv_q, a["cache"].conv_k, a["cache"].conv_v,
                                  a["cache"].state[..., :64])}, "cache.state must be"),
    (lambda a: {"weights": kd.KDADecodeWeights.random(3)}, "weights.A_log must be"),
    (lambda a: {"cache": (1, 2)}, "cache must be a k3lab.nn.KDACache"),
])
def test_bad_input_is_rejected_before_any_kernel(backend, change, match):
    base = _bad()
    args = _bad(**change(base))
    state_before = args["cache"].state.clone() if isinstance(args["cache"], KDACache) else None
    with pytest.raises(ValueError, match=match):
        kd.kda_decode(**args, backend=backend)
    if state_before is not None:
        assert torch.equal(args["cache"].state, state_before)


def test_head_dim_must_be_128():
    inputs, cache, w = kd.make_example(1, 1, dtype=torch.float32, seed=41)
    q = torch.randn(1, 192)  # 1.5 heads of 128, or 3 heads of 64: neither is K3's head_dim
    with pytest.raises(ValueError, match="head_dim 128"):
        kd.kda_decode(**dict(inputs, q=q), cache=cache, weights=w, backend="torch")


def test_bad_backend_and_layout_names(monkeypatch):
    args = _bad()
    with pytest.raises(ValueError, match="backend must be one of"):
        kd.kda_decode(**args, backend="fused")
    monkeypatch.setenv(kd.BACKEND_ENV, "fused")
    with pytest.raises(ValueError, match=kd.BACKEND_ENV):
        kd.kda_decode(**args)
    monkeypatch.delenv(kd.BACKEND_ENV)
    with pytest.raises(ValueError, match="state_layout must be one of"):
        kd.kda_decode(**args, backend="torch", state_layout="kvk")
    with pytest.raises(ValueError, match="apply to backend='cuda' only"):
        kd.kda_decode(**args, backend="torch", tile_v=16)


def test_choose_config_and_hints_follow_the_measured_rules():
    # H200: 132 SMs. 12 heads at B = 1 are split over clusters of 4 (48 blocks); from 66 heads on, a head
    # per block; without clusters (the split would need an atomic exchange) always a head per block.
    assert kd.choose_config(1, 12, 132) == kd.SPLIT_TILE_FINE  # 96 blocks of 16 columns fit 132 units
    assert kd.choose_config(2, 12, 132) == kd.SPLIT_TILE  # 192 would not: 4 blocks of 32 per head
    assert kd.choose_config(5, 12, 132) == kd.SPLIT_TILE
    assert kd.choose_config(6, 12, 132) == (128, 256)
    assert kd.choose_config(128, 12, 132) == (128, 256)
    assert kd.choose_config(1, 12, 132, clusters=False) == (128, 256)
    assert kd.choose_config(1, 12, 256, warp_size=64, clusters=False)[1] % 64 == 0  # MI355X-like
    with pytest.raises(ValueError, match="warp width"):
        kd.choose_config(1, 12, 132, warp_size=96)
    l2 = 60 << 20
    assert kd.default_hints(1, 12, l2) == kd.HINT_PREFETCH_L2  # 0.75 MiB of state: stays in L2
    assert kd.default_hints(32, 12, l2) == kd.HINT_PREFETCH_L2  # 24 MiB
    assert kd.default_hints(128, 12, l2) == kd.HINT_PREFETCH_L2 | kd.HINT_STREAM_LOADS | kd.HINT_STREAM_STORES
    assert kd.CONFIGS == ((128, 256), kd.SPLIT_TILE, kd.SPLIT_TILE_FINE)  # only what choose_config picks


def test_study_cases_name_the_batches():
    from k3lab.studies import kda_decode as kb

    assert kb.case_names() == ["B1_H12", "B8_H12", "B32_H12", "B128_H12"] and kb.NAME == "kda_decode"
    with pytest.raises(ValueError, match="cases"):
        kb.run(cases=["B3_H8"])
    with pytest.raises(ValueError, match="not both"):
        kb.run(cases=["B1_H12"], batches=(1,))


def test_study_summary_text_of_the_committed_h200_records():
    """What `k3lab bench kda_decode` prints after the table: one line per batch and mode, in batch order,
    each figure read from the records (before / after / fla, floor, ratios, state TB/s)."""
    from k3lab import bench
    from k3lab.studies import kda_decode as kb

    recs = bench.load_records(study="kda_decode", device="nvidia-h200")
    if not recs:
        pytest.skip("no committed H200 kda_decode records in profiles/")
    lines = kb.summary_text(recs).splitlines()
    keys = sorted({(r.case, r.mode) for r in recs}, key=lambda k: (int(k[0][1:].split("_")[0]), k[1]))
    assert lines[0].split()[:3] == ["case", "mode", "before"] and len(lines) == 1 + len(keys)
    for line, (case, mode) in zip(lines[1:], keys):
        by = {r.variant: r for r in recs if r.case == case and r.mode == mode}
        cols = line.split()
        assert cols[:2] == [case, mode]
        assert float(cols[3]) == pytest.approx(by["after"].median_us, abs=0.006)
        assert float(cols[6]) == pytest.approx(by["before"].median_us / by["after"].median_us, abs=0.006)



def test_doc_headline_is_the_committed_records():
    """docs/kda_decode.md's headline rows are generated from the committed graph records (stale: run
    `python -m k3lab.studies.kda_decode.headline --write`), each figure the record's at two decimals with
    the records' commit, and a record re-measured (a changed copy) or missing changes the rows."""
    from k3lab.studies.kda_decode import headline

    recs = bench.load_records(study="kda_decode", device="nvidia-h200")
    if not recs:
        pytest.skip("no committed H200 kda_decode records in profiles/")
    body = headline.in_doc(headline.DOC.read_text())
    assert body == headline.markdown(), "stale: python -m k3lab.studies.kda_decode.headline --write"
    graph = {(r.case, r.variant): r for r in recs if r.mode == "graph"}
    lines = body.splitlines()
    assert len(lines) == 2 + len(headline.BATCHES)
    for b in headline.BATCHES:
        before, after, fla = (graph[(f"B{b}_H12", v)] for v in ("before", "after", "fla"))
        commits = ", ".join(sorted({r.commit[:7] for r in (before, after, fla)}))
        want = (f"| {b} | {before.median_us:.2f} | {after.median_us:.2f} | {fla.median_us:.2f} "
                f"| {after.extra['state_tbs']:.2f} | {commits} |")
        assert want in lines, (want, body)
    slower = [r if (r.case, r.variant, r.mode) != ("B128_H12", "fla", "graph") else
              bench.Record.from_dict({**r.to_dict(), "median_us": r.median_us * 1.5}) for r in recs]
    changed = headline.markdown(slower)
    assert changed != body
    assert f"| {graph[('B128_H12', 'fla')].median_us * 1.5:.2f} |" in changed
    without = headline.markdown([r for r in recs if not (r.case == "B1_H12" and r.variant == "fla")])
    assert any(line.startswith("| 1 | ") and "| not measured |" in line for line in without.splitlines())
    assert headline.in_doc("no markers here") == ""

def test_step_bytes_floor_inputs():
    from k3lab.studies import kda_decode as kb
    sb = kb.step_bytes(128, 12)
    assert sb["state"] == 2 * 128 * 12 * 128 * 128 * 4  # the anchors' KDA decode floor term
    assert sum(sb.values()) > sb["state"]


# ------------------------------------------------------------------ the fused kernel (GPU)
def _fused_ready():
    ok, why = kd.fused_status()
    if not ok:
        pytest.skip(why)


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_fused_every_config_matches_reference(layout):
    _fused_ready()
    from k3lab.studies import kda_decode as kb
    f = kd.cuda.load_fused(torch.device("cuda"))
    n = 0
    for (tile_v, threads) in sorted(f.configs):
        splits = ["whole"] if tile_v == 128 else [m for m in ("atomic", "cluster") if m in f.split_modes]
        for split in splits:
            if split == "cluster" and not f.clusters:
                continue
            for B, hints in ((1, 0), (3, 7)):
                res = kb.check_case(B, 5, state_layout=layout, variants=("after",), seed=B * 100 + tile_v,
                                    tile_v=tile_v, hints=hints, split=split)
                assert res["after"]["state"]["max_rel"] < 2e-4
                n += 1
    assert n >= len(f.configs) * 2


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 32, 128])
def test_fused_tp8_slice_against_reference_and_before(B):
    _fused_ready()
    from k3lab.studies import kda_decode as kb
    res = kb.check_case(B, 12, seed=B)
    assert set(res) >= {"after", "before"}


@needs_gpu
@pytest.mark.gpu
def test_fused_strided_inputs_and_output_buffer():
    _fused_ready()
    inputs, cache, w = kd.make_example(4, 3, device="cuda", seed=50)
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w)
    packed = torch.cat([inputs["q"], inputs["k"], inputs["v"]], 1)
    views = dict(inputs, q=packed[:, :384], k=packed[:, 384:768], v=packed[:, 768:])
    big = torch.zeros(4, 2 * 384, device="cuda", dtype=torch.bfloat16)
    out = big[:, 384:]  # row stride 768: written in place, the other half untouched
    for tile_v in (128, 16):
        c = kd.clone_cache(cache)
        kd.after(**views, cache=c, weights=w, out=out, tile_v=tile_v)
        bench.check(out, ref_out, dtype="bf16")
        bench.check(c.state, ref.state, dtype="fp32", name="state")
        assert torch.count_nonzero(big[:, :384]) == 0


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("split", ["atomic", "cluster"])
def test_fused_under_cuda_graph_replay(split):
    _fused_ready()
    if split == "cluster" and not kd.cuda.load_fused(torch.device("cuda")).clusters:
        pytest.skip("thread-block clusters need compute capability >= 9.0")
    inputs, cache, w = kd.make_example(2, 12, device="cuda", seed=51)
    ref_cache = kd.clone_cache(cache)
    outs = []
    for _ in range(3):  # eager reference trajectory: three steps of the same token
        o, ref_cache = kd.reference(**inputs, cache=ref_cache, weights=w)
        ref_cache = KDACache(ref_cache.conv_q.bfloat16(), ref_cache.conv_k.bfloat16(),
                             ref_cache.conv_v.bfloat16(), ref_cache.state)  # exact: past bf16 inputs
        outs.append(o)
    out = torch.empty(2, 12 * 128, device="cuda", dtype=torch.bfloat16)
    kd.after(**inputs, cache=kd.clone_cache(cache), weights=w, out=out, tile_v=16, split=split)  # warm
    g = torch.cuda.CUDAGraph()
    c = kd.clone_cache(cache)
    snapshot = kd.clone_cache(c)
    with torch.cuda.graph(g):
        kd.after(**inputs, cache=c, weights=w, out=out, tile_v=16, split=split)
    for n in ("conv_q", "conv_k", "conv_v", "state"):  # capture must not have run it
        getattr(c, n).copy_(getattr(snapshot, n))
    for step in range(3):
        g.replay()
        torch.cuda.synchronize()
        bench.check(out, outs[step], dtype="bf16", name=f"output step {step}")
    bench.check(c.state, ref_cache.state, dtype="fp32", name="state")


@needs_gpu
@pytest.mark.gpu
def test_fused_bound_step_matches_reference_over_steps():
    _fused_ready()
    inputs, cache, w = kd.make_example(3, 12, device="cuda", seed=53)
    ref = kd.clone_cache(cache)
    step = kd.KDADecodeStep(cache, w, backend="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    for t in range(4):
        tok = {n: torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype) for n, x in inputs.items()}
        want, ref = kd.reference(**tok, cache=ref, weights=w)
        ref = KDACache(*(x.to(torch.bfloat16) if i < 3 else x for i, x in enumerate(
            (ref.conv_q, ref.conv_k, ref.conv_v, ref.state))))
        got = step(*(tok[n] for n in kd.TOKEN_INPUTS))
        bench.check(got, want, dtype="bf16", name=f"output token {t}")
    bench.check(cache.state, ref.state, dtype="fp32", name="state after 4 tokens")


@needs_gpu
@pytest.mark.gpu
def test_fused_rejects_non_bf16_and_bad_config():
    _fused_ready()
    inputs, cache, w = kd.make_example(1, 2, device="cuda", dtype=torch.float16, seed=52)
    with pytest.raises(ValueError, match="bf16"):
        kd.after(**inputs, cache=cache, weights=w)
    inputs, cache, w = kd.make_example(1, 2, device="cuda", seed=52)
    with pytest.raises(ValueError, match="tile_v must be one of"):
        kd.after(**inputs, cache=cache, weights=w, tile_v=12)
    assert math.isfinite(float(kd.after(**inputs, cache=cache, weights=w).float().sum()))


def test_cold_state_timing_cycles_through_enough_caches():
    """Timing with cold state cycles caches whose states together exceed twice the cache, one per call."""
    from k3lab.studies import kda_decode as kb

    state = kb.step_bytes(1, 12)["state"]
    assert kb.state_copies(1) == min(64, -(-2 * timing._cache_bytes() // state)) > 1
    assert kb.state_copies(128) == 1  # 100 MB of state is already past any cache
    seen = []
    step = kb.measure._cycling(["a", "b", "c"], seen.append)
    for _ in range(4):
        step()
    assert seen == ["a", "b", "c", "a"]
