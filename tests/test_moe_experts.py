"""The grouped routed-expert kernels (Triton's interpreter on a CPU) and the per-expert loop against
the nn reference; the expert sort; the padding report; bad input."""

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab.bench import check
from k3lab.config import K3Config
from k3lab.model import init_weights
from k3lab.nn.moe import LatentMoE
from k3lab.ops import moe_experts as me

E, K = 8, 2


# Triton's interpreter on CPU tensors: where a GPU is present the kernels run compiled instead, in the
# *_on_gpu / *_on_the_gpu tests below
INTERPRETER_ONLY = pytest.mark.skipif(torch.cuda.is_available(),
                                      reason="interpreter form; on a GPU the compiled tests below run")


@pytest.fixture(scope="module")
def layer():
    return init_weights(LatentMoE(K3Config.tiny()), seed=3)


def reference(layer, z, weights, idx):
    """Each pair through the nn RoutedExpert module, weighted and summed in fp64."""
    y = torch.zeros(z.shape, dtype=torch.float64)
    for n in range(z.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[n, j])
            y[n] += float(weights[n, j]) * layer.experts[e](z[n:n + 1])[0].double()
    return y


def crafted(n=6, seed=0, lat=128):
    """Routing that leaves experts 2 and 5 unchosen and sends tokens to the last expert (7)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, lat, generator=gen)
    idx = torch.tensor([[7, 0], [1, 7], [3, 4], [7, 6], [0, 1], [6, 3]])[:n]
    w = torch.rand(n, K, generator=gen) + 0.1
    return z, w / w.sum(-1, keepdim=True), idx


@INTERPRETER_ONLY
@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_grouped_matches_nn_experts_with_unchosen_and_last_expert(layer, block_m):
    z, w, idx = crafted()
    with torch.no_grad():
        ref = reference(layer, z, w, idx)
        got = me.grouped_experts(z, w, idx, *me.stack_experts(layer.experts), block_m=block_m)
    assert got.dtype == torch.float32
    check(got, ref, dtype=torch.float32, max_rel=1e-5)


@INTERPRETER_ONLY
def test_grouped_and_loop_match_the_layers_routed_latent(layer):
    """Through the real router: a bias steers every token to the last expert and away from 2 and 5."""
    x = torch.randn(9, layer.hidden_size, generator=torch.Generator().manual_seed(1))
    bias = torch.zeros(E)
    bias[7], bias[2], bias[5] = 100.0, -100.0, -100.0
    with torch.no_grad():
        layer.gate.e_score_correction_bias.copy_(bias)
        try:
            w, idx, _ = layer.gate(x)
            ref = layer.routed_latent(x)
            z = layer.routed_expert_down_proj(x)
            stacked = me.stack_experts(layer.experts)
            grouped = me.grouped_experts(z, w, idx, *stacked, block_m=16)
            looped = me.expert_loop(z, w, idx, *stacked)
        finally:
            layer.gate.e_score_correction_bias.zero_()
    assert (idx == 7).any(-1).all() and not torch.isin(idx, torch.tensor([2, 5])).any()
    check(grouped, ref, dtype=torch.float32, max_rel=1e-5)
    check(looped, ref, dtype=torch.float32, max_rel=1e-5)


@INTERPRETER_ONLY
def test_grouped_on_an_intermediate_slice_and_fp16(layer):
    """One rank's slice of the intermediate (16 of 64 columns, not a multiple of the column block)
    and fp16 storage, against the loop on the same slice."""
    z, w, idx = crafted(seed=2)
    w1, w3, w2 = me.stack_experts(layer.experts, 20, 44)
    with torch.no_grad():
        ref = me.expert_loop(z.double(), w, idx, w1.double(), w3.double(), w2.double())
        got32 = me.grouped_experts(z, w, idx, w1, w3, w2)
        got16 = me.grouped_experts(z.half(), w, idx, w1.half(), w3.half(), w2.half())
    check(got32, ref, dtype=torch.float32, max_rel=1e-5)
    check(got16, ref, dtype=torch.float16)


@INTERPRETER_ONLY
@pytest.mark.parametrize("idx_row", [[7, 2], [3, 3]], ids=["distinct", "one-expert-twice"])
def test_one_token_down_sums_as_it_goes(layer, monkeypatch, idx_row):
    """One token runs the down launch that sums the pairs itself (`down_row`: h by pair, no y_pair, no
    reduction):
    against the fp64 nn experts at every ROW_BLOCKS shape, an intermediate slice (20 of 64 columns, not
    a multiple of any K block), an expert chosen twice (two real rows in its tile) and fp16 storage
    (the interpreter's tl.dot in the up launch does not take bf16; the GPU test below runs bf16)."""
    from k3lab.ops.moe_experts import triton as mt

    gen = torch.Generator().manual_seed(11)
    z = torch.randn(1, 128, generator=gen)
    w = torch.rand(1, K, generator=gen) + 0.1
    idx = torch.tensor([idx_row])
    full = me.stack_experts(layer.experts)
    w1, w3, w2 = me.stack_experts(layer.experts, 20, 40)
    calls = []
    real = mt.down_row
    monkeypatch.setattr(mt, "down_row", lambda *a, **k: calls.append(a[3].numel()) or real(*a, **k))
    with torch.no_grad():
        ref = reference(layer, z, w, idx)
        check(me.grouped_experts(z, w, idx, *full), ref, dtype=torch.float32, max_rel=1e-5)
        ref_slice = me.expert_loop(z.double(), w, idx, w1.double(), w3.double(), w2.double())
        for blocks in mt.ROW_BLOCKS:
            monkeypatch.setattr(mt, "down_row", lambda *a, _b=blocks, **k: real(*a, blocks=_b))
            check(me.grouped_experts(z, w, idx, w1, w3, w2), ref_slice, dtype=torch.float32, max_rel=1e-5)
            check(me.grouped_experts(z.half(), w, idx, w1.half(), w3.half(), w2.half()), ref_slice,
                  dtype=torch.float16)
    assert calls == [2]


def test_sort_by_expert_places_every_pair_once_in_its_experts_tiles():
    idx = torch.tensor([[7, 0], [1, 7], [3, 4], [7, 6], [0, 1], [6, 3], [7, 1]])
    for m in (16, 32):
        s = me.sort_by_expert(idx, E, m)
        P = idx.numel()
        rows = s.pair_of_row.long()
        real = rows[rows < P]
        assert sorted(real.tolist()) == list(range(P))
        n_tiles = int(s.n_tiles)
        assert n_tiles == int(((s.counts + m - 1) // m).sum()) <= s.max_tiles
        assert (rows[n_tiles * m:] == P).all()
        tile_of_row = torch.arange(rows.numel()) // m
        experts_of_rows = s.tile_expert.long()[tile_of_row[rows < P]]
        assert torch.equal(experts_of_rows, idx.reshape(-1)[real])
        assert s.counts.tolist() == torch.bincount(idx.reshape(-1), minlength=E).tolist()


def test_max_tiles_bound_is_reached():
    # 16 distinct experts of one token: 16 tiles of one row each, the bound exactly
    assert me.max_tiles(16, 896, 16) == 16
    assert me.max_tiles(32, 4, 16) == (32 + 15 * 4) // 16


def test_no_tokens_gives_an_empty_result(layer):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run the kernels in the interpreter
    z, w, idx = (t[:0].to(dev) for t in crafted())
    y = me.routed_experts(z, w, idx, *(t.to(dev) for t in me.stack_experts(layer.experts)), backend="triton")
    assert y.shape == (0, 128) and y.device.type == dev


def test_padding_of_hand_example():
    idx = torch.tensor([[0, 1], [0, 2], [0, 3]])  # expert 0: 3 rows, experts 1-3: 1 row each
    r = me.padding_of(idx, 4, 16)
    assert (r["rows"], r["experts_chosen"], r["tiles"], r["padded_rows"]) == (6, 4, 4, 64)
    assert r["padding_share"] == pytest.approx(1 - 6 / 64)
    assert r["rows_per_expert_max"] == 3


def test_decode_padding_on_k3_router_shape():
    rows = me.decode_padding(batches=[1, 64, 256], heights=(16, 64))
    by = {(r["batch"], r["block_m"]): r for r in rows}
    assert by[1, 16]["padding_share"] == pytest.approx(15 / 16)  # 16 experts of one row each
    assert by[1, 64]["padding_share"] == pytest.approx(63 / 64)
    assert by[256, 16]["rows"] == 256 * 16
    assert 2 < by[256, 16]["rows_per_expert_mean"] < 16  # a big batch still leaves few rows per expert
    assert by[256, 16]["padding_share"] < by[256, 64]["padding_share"]


@pytest.mark.parametrize("change, message", [
    (lambda a: a.update(z=a["z"][:, :100]), "w1 must be"),
    (lambda a: a.update(w2=a["w2"].transpose(1, 2)), "w2 must be"),
    (lambda a: a.update(w3=a["w3"].half()), "w3 must be float32, got torch.float16"),
    (lambda a: a.update(idx=a["idx"].float()), "idx must be int32 or int64"),
    (lambda a: a.update(idx=a["idx"] + 1), r"idx values must be expert numbers in \[0, E=8\)"),
    (lambda a: a.update(weights=a["weights"][:, :1]), "idx and weights must both be"),
    (lambda a: a.update(z=a["z"].long()), "z must be float32, float16, bfloat16 or float64"),
])
def test_bad_input_is_refused_by_name(layer, change, message):
    z, w, idx = crafted()
    w1, w3, w2 = me.stack_experts(layer.experts)
    args = {"z": z, "weights": w, "idx": idx, "w1": w1, "w3": w3, "w2": w2}
    change(args)
    with pytest.raises(ValueError, match=message):
        me.routed_experts(**args, backend="triton")


def test_bad_tile_height_and_backend(layer, monkeypatch):
    z, w, idx = crafted()
    stacked = me.stack_experts(layer.experts)
    with pytest.raises(ValueError, match="block_m must be one of"):
        me.grouped_experts(z, w, idx, *stacked, block_m=24)
    monkeypatch.setenv(me.BACKEND_ENV, "cutlass")
    with pytest.raises(ValueError, match=f"{me.BACKEND_ENV} must be one of"):
        me.routed_experts(z, w, idx, *stacked)
    monkeypatch.setenv(me.BACKEND_ENV, "torch")
    assert me.BACKENDS.choose()[0] == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (the CPU runs the interpreter tests above)")
@pytest.mark.parametrize("N", [1, 64])
def test_grouped_bf16_at_tp8_shapes_on_gpu(N):
    """K3's rank shapes (896 experts, 3584 x 384) at a decode batch (one token: the down launch that
    sums as it goes, autotuned), bf16, against the loop in fp32."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    Ex, L, F = 896, 3584, 384
    w1, w3 = (torch.randn(Ex, F, L, device=dev, generator=gen) / L**0.5 for _ in range(2))
    w2 = torch.randn(Ex, L, F, device=dev, generator=gen) / F**0.5
    z = torch.randn(N, L, device=dev, generator=gen)
    idx = me.random_router_idx(N).to(dev)
    w = torch.rand(N, 16, device=dev, generator=gen)
    ref = me.expert_loop(z, w, idx, w1, w3, w2)
    bf = [t.bfloat16() for t in (z, w1, w3, w2)]
    for m in (16, 32, 64):
        got = me.grouped_experts(bf[0], w, idx, *bf[1:], block_m=m)
        check(got, ref, dtype=torch.bfloat16)


def _tail_inputs(n, lat=128, rows=40, hidden=100, seed=0):
    gen = torch.Generator().manual_seed(seed + n)
    return (torch.randn(n, lat, generator=gen) * 3, torch.rand(lat, generator=gen) + 0.5,
            torch.randn(rows, lat, generator=gen), torch.randn(n, hidden, generator=gen))


def _normed64(y, nw, eps=1e-5):
    yd = y.double()
    return yd * torch.rsqrt(yd.pow(2).mean(-1, keepdim=True) + eps) * nw.double()


@INTERPRETER_ONLY
@pytest.mark.parametrize("n, lat, block", [(0, 128, 4096), (1, 128, 4096), (65, 128, 4096), (3, 160, 64)])
def test_norm_rows_equals_the_fp64_norm(n, lat, block, monkeypatch):
    """One program per row; (3, 160, 64) walks the row in three blocks, the last one partial."""
    from k3lab.ops.moe_experts import tail as tail_mod

    monkeypatch.setattr(tail_mod, "NORM_BLOCK", block)
    y, nw, _, _ = _tail_inputs(n, lat)
    got = me.norm_rows(y, nw, 1e-5, torch.float32)
    assert got.shape == (n, lat) and got.dtype == torch.float32
    check(got, _normed64(y, nw), dtype=torch.float32, max_rel=1e-5)
    half = me.norm_rows(y, nw, 1e-5, torch.float16)
    assert half.dtype == torch.float16
    check(half, _normed64(y, nw).half().double(), dtype=torch.float16, max_rel=1e-3)


@INTERPRETER_ONLY
@pytest.mark.parametrize("n", [0, 1, 65])
def test_tail_adds_the_normed_projection_into_its_columns_in_place(n):
    y, nw, up, out0 = _tail_inputs(n)
    ref = out0.double()
    ref[:, 30:70] += _normed64(y, nw) @ up.double().t()
    for fn in (me.tail_triton, me.tail_torch):
        out = out0.clone()
        ptr = out.data_ptr()
        got = fn(y, nw, 1e-5, up, out, 30)
        assert got is out and out.data_ptr() == ptr
        check(got, ref, dtype=torch.float32, max_rel=1e-5, name=fn.__name__)
        assert torch.equal(got[:, :30], out0[:, :30]) and torch.equal(got[:, 70:], out0[:, 70:])


@INTERPRETER_ONLY
def test_one_row_tail_is_one_launch_and_rounds_like_the_two_step_tail():
    """N = 1 runs `tail_row` (one program per ROW_BLOCKS rows, the norm recomputed in each): bf16 out and
    weight, equal to the fp64 product of the bf16-rounded normed latent, added with one rounding; rows
    past the last full block (40 = 10 x 4) and a latent walked in 3 blocks of 64 (lat 160)."""
    from k3lab.ops.moe_experts import tail as tail_mod

    y, nw, up, out0 = _tail_inputs(1, lat=160, rows=42)
    up, out0 = up.bfloat16(), out0.bfloat16()
    ref = out0.double()
    ref[:, 30:72] += _normed64(y, nw).bfloat16().double() @ up.double().t()
    out = out0.clone()
    tail_mod.tail_row(y, nw, 1e-5, up, out, 30, blocks=(4, 64, 1))
    check(out, ref, dtype=torch.bfloat16)
    assert torch.equal(out[:, :30], out0[:, :30]) and torch.equal(out[:, 72:], out0[:, 72:])


def test_tail_adds_into_the_strided_column_view_without_a_copy(monkeypatch):
    """The product goes into out[:, 30:70] (row stride 100) through addmm_ with no copy of out: the
    profiler sees no copy op in the tail (the norm's result is computed beforehand: its launch in
    Triton's interpreter copies the arguments)."""
    from torch.profiler import profile

    from k3lab.nn.norms import rms_norm
    from k3lab.ops.moe_experts import tail as tail_mod

    y, nw, up, out = _tail_inputs(5)
    ref = out.double()
    ref[:, 30:70] += _normed64(y, nw) @ up.double().t()
    normed = rms_norm(y, nw, 1e-5)
    monkeypatch.setattr(tail_mod, "norm_rows", lambda *args: normed)
    with profile() as prof:
        me.tail_triton(y, nw, 1e-5, up, out, 30)
    names = [e.name for e in prof.events()]
    assert "aten::addmm_" in names and not any("copy" in name for name in names), names
    check(out, ref, dtype=torch.float32, max_rel=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (the CPU runs the interpreter tests above)")
@pytest.mark.parametrize("n", [1, 65])
def test_tail_on_the_gpu_at_k3_shapes(n):
    """K3's latent (3584) into rank 3's 896 columns of a 7168-wide output, fp32 and bf16."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    y = torch.randn(n, 3584, device="cuda", generator=gen)
    nw = torch.rand(3584, device="cuda", generator=gen) + 0.5
    up = torch.randn(896, 3584, device="cuda", generator=gen) / 3584**0.5
    out0 = torch.randn(n, 7168, device="cuda", generator=gen)
    lo, hi = 3 * 896, 4 * 896
    for dt in (torch.float32, torch.bfloat16):
        out = out0.to(dt)
        ref = out.double()
        ref[:, lo:hi] += _normed64(y, nw).to(dt).double() @ up.to(dt).double().t()
        got = me.tail_triton(y, nw, 1e-5, up.to(dt), out, lo)
        check(got, ref, dtype=dt, **({"max_rel": 1e-5} if dt == torch.float32 else {}))  # fp32: no TF32
        assert torch.equal(got[:, :lo], out0[:, :lo].to(dt)) and torch.equal(got[:, hi:], out0[:, hi:].to(dt))


def test_tail_refuses_bad_input_by_name():
    y, nw, up, out = torch.randn(2, 16), torch.ones(16), torch.randn(8, 16), torch.zeros(2, 20)
    with pytest.raises(ValueError, match=r"columns \[col0, col0 \+ R=8\) inside it"):
        me.latent_tail(y, nw, 1e-5, up, out, 13)
    with pytest.raises(ValueError, match="up_rows must be"):
        me.latent_tail(y, nw, 1e-5, up[:, :8], out, 0)
    with pytest.raises(ValueError, match="out must be float32, got torch.float64"):  # up_rows' dtype
        me.latent_tail(y, nw, 1e-5, up, out.double(), 0)
    with pytest.raises(ValueError, match="out must be contiguous"):
        me.latent_tail(y, nw, 1e-5, up, torch.zeros(20, 2).t(), 0)
    with pytest.raises(ValueError, match="norm_w must be"):
        me.norm_rows(y, nw[:8], 1e-5, torch.float32)
    with pytest.raises(ValueError, match="eps must be positive"):
        me.norm_rows(y, nw, 0.0, torch.float32)
