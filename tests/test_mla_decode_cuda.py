"""The CUDA backend's after (kernels/mla_decode.cu via k3lab.ops.mla_decode.cuda): refusals by name,
the piece rule and the form rule everywhere; the sm_90a build (no spills, the ctypes Args layout and
shared-memory formulas checked against the compiled library, which loads without a GPU) where nvcc
is present; results against the fp32 reference on a GPU for both forms ('mma', 'wgmma') and for
verification groups. Its HIP compile (a stub) is covered by tests/test_kernels_build.py."""

import ctypes
import re
from pathlib import Path

import pytest
import torch

from k3lab import bench
from k3lab.ops import _build
from k3lab.ops import mla_decode as mla
from k3lab.ops.mla_decode import cuda as mc
from k3lab.ops.mla_decode.inputs import choose_splits

GPU = torch.cuda.is_available()
NVCC = _build.find_toolchain("nvcc") is not None


def _inputs(B=1, L=96, H=12, device="cpu", dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, mla.LATENT_DIM, generator=g).to(device, dtype)
    cache = torch.randn(B, L, mla.LATENT_DIM, generator=g).to(device, dtype)
    return q, cache


def _misaligned(shape, dtype=torch.bfloat16):
    n = 1
    for s in shape:
        n *= s
    return torch.zeros(n + 1, dtype=dtype)[1:].view(*shape)  # starts 2 bytes into its storage


def _paged(page=64, L=96, lengths=(96,)):
    q, cache = _inputs(B=len(lengths), L=L)
    pool, bt = mla.to_paged(cache, page)
    return q, pool, bt, torch.tensor(lengths, dtype=torch.int32)


@pytest.mark.parametrize("case,match", [
    ("q_fp32", "bfloat16"),
    ("q_len2", "q_len"),
    ("heads17", "heads"),
    ("width512", "576"),
    ("cache_fp16", "cache must be bfloat16, got torch.float16"),
    ("row_stride", "stride"),
    ("page16", "page size"),
    ("paged_no_lengths", "lengths"),
    ("cache_misaligned", "16-byte"),
    ("q_misaligned", "4-byte"),
    ("splits0", "num_splits"),
    ("form_bad", "form"),
    ("wgmma_page32", "pages .* of >= 64"),
    ("wgmma_pool_gaps", "tensor map of rows"),
    ("wgmma_q_misaligned", "16-byte"),
    ("scale_negative", "scale"),
    ("too_long", "longer"),
    ("page_out_of_pool", "outside the pool"),
])
def test_bad_arguments_are_refused_by_name(case, match):
    q, cache = _inputs()
    kw = {}
    lengths = None
    if case == "q_fp32":
        q = q.float()
    elif case == "q_len2":
        q = q.expand(1, 2, 12, 576).contiguous()
    elif case == "heads17":
        q = _inputs(H=17)[0]
    elif case == "width512":
        q = q[..., :512].contiguous()
    elif case == "cache_fp16":
        cache = cache.half()
    elif case == "row_stride":
        cache = torch.zeros(1, 96, 600, dtype=torch.bfloat16)[..., :576]
    elif case == "page16":
        q, cache, kw["block_table"], lengths = _paged(page=16)
    elif case == "paged_no_lengths":
        q, cache, kw["block_table"], _ = _paged()
    elif case == "cache_misaligned":
        cache = _misaligned((1, 96, 576))
    elif case == "q_misaligned":
        q = _misaligned((1, 1, 12, 576))
    elif case == "splits0":
        kw["num_splits"] = 0
    elif case == "form_bad":
        kw["form"] = "wgmma2"
    elif case == "wgmma_page32":
        q, cache, kw["block_table"], lengths = _paged(page=32)
        kw["form"] = "wgmma"
    elif case == "wgmma_pool_gaps":  # pages that do not follow each other in memory
        q, pool, kw["block_table"], lengths = _paged()
        cache = torch.zeros(pool.shape[0], 2 * 64, 576, dtype=torch.bfloat16)[:, :64]
        kw["form"] = "wgmma"
    elif case == "wgmma_q_misaligned":
        # head stride 580: pairs, not 16 bytes
        q = torch.zeros(1, 1, 12, 580, dtype=torch.bfloat16)[..., :576]
        kw["form"] = "wgmma"
    elif case == "scale_negative":
        kw["scale"] = -0.1
    elif case == "too_long":
        lengths = torch.tensor([97])
    elif case == "page_out_of_pool":
        q, cache, bt, lengths = _paged()
        kw["block_table"] = bt + cache.shape[0]
    with pytest.raises(ValueError, match=match):
        mc.plan(q, cache, lengths, **kw)


def test_good_arguments_pass_the_checks():
    q, cache = _inputs(B=2)
    c = mc.check(q, cache, torch.tensor([96, 40]))
    assert (c.batch, c.heads, c.paged, c.lengths_host) == (2, 12, False, (96, 40))
    q, pool, bt, lengths = _paged(lengths=(96,))
    assert mc.check(q, pool, lengths, block_table=bt).paged


@pytest.mark.skipif(GPU, reason="checks what a machine without a GPU says")
def test_without_a_gpu_it_says_so_after_the_checks():
    ok, why = mc.status()
    assert not ok and "GPU" in why
    q, cache = _inputs()
    with pytest.raises(_build.KernelUnavailable, match="GPU"):
        mc.plan(q, cache)


def test_pieces_fill_the_units_once_in_whole_tiles():
    # H200: 132 SMs, one 5-stage block each
    assert choose_splits(1, 32768, 132) == (128, 256)  # 8 tiles of 32 rows per piece
    assert choose_splits(1, 131072, 132) == (128, 1024)
    assert choose_splits(8, 8192, 132) == (16, 512)  # 8 x 16 = 128 blocks
    assert choose_splits(1, 1024, 132) == (32, 32)  # never more pieces than tiles
    assert choose_splits(1, 100, 132) == (4, 32)
    assert choose_splits(64, 8192, 132) == (2, 4096)  # 128 blocks: 3 pieces would spill into a second wave
    assert choose_splits(200, 8192, 132) == (1, 8192)  # more requests than units: one piece each
    for B in range(1, 133):  # never a second wave while the batch alone does not need one
        splits, _ = choose_splits(B, 131072, 132)
        assert B * splits <= 132 < 2 * B * splits, (B, splits)  # one wave, at least half full
    for B, L, units in ((1, 32768, 132), (3, 5000, 80), (2, 33, 7), (1, 1, 132)):
        splits, chunk = choose_splits(B, L, units)
        # no empty piece at max_len
        assert chunk % mc.BLOCK_N == 0 and (splits - 1) * chunk < L <= splits * chunk
    assert choose_splits(1, 32768, 132, num_splits=7) == (7, 4704)
    with pytest.raises(ValueError, match="num_splits"):
        choose_splits(1, 1024, 132, num_splits=0)
    with pytest.raises(ValueError, match="compute_units"):
        choose_splits(1, 1024, 0)
    # form 'wgmma': tiles of 64 rows
    assert choose_splits(1, 32768, 132, block_n=mc.WG_BLOCK_N) == (128, 256)  # 4 tiles of 64 rows
    assert choose_splits(1, 1024, 132, block_n=mc.WG_BLOCK_N) == (16, 64)
    assert choose_splits(1, 100, 132, block_n=mc.WG_BLOCK_N) == (2, 64)
    with pytest.raises(ValueError, match="block_n"):
        choose_splits(1, 1024, 132, block_n=0)


def test_form_rule_takes_wgmma_for_pieces_of_four_tiles_or_more():
    # H200: 132 SMs; pieces of 64-row tiles
    assert mc.choose_form(1, 32768, 132)[0] == "wgmma"  # 128 pieces of 4 tiles
    assert mc.choose_form(8, 8192, 132)[0] == "wgmma"  # 16 pieces of 8 tiles per request
    assert mc.choose_form(1, 131072, 132)[0] == "wgmma"
    form, why = mc.choose_form(1, 1024, 132)  # 16 pieces of one tile
    assert form == "mma" and "1 tile" in why
    assert mc.choose_form(1, 16384, 132)[0] == "mma"  # 128 pieces of 2 tiles
    assert mc.choose_form(1, 16384, 132, num_splits=32)[0] == "wgmma"  # 32 pieces of 8 tiles
    assert mc.choose_form(1, 32768, 132, refusal="pages of 32") == ("mma", "pages of 32")


def test_what_wgmma_cannot_take_is_a_reason_for_auto():
    # what form='auto' would refuse for wgmma is a reason, not an error
    q, pool, bt, lengths = _paged(page=32)
    assert "pages" in mc.wgmma_refusal(q, pool, bt)
    q, pool, bt, lengths = _paged(page=64)
    assert mc.wgmma_refusal(q, pool, bt) is None


def test_shared_memory_fits_one_block_per_h200_sm():
    assert mc.smem_bytes() <= 232448 < 2 * mc.smem_bytes()  # the H200's opt-in limit per block
    # form 'wgmma': two 72 KB tiles, Q^T 18 KB, P 2 KB, exchanges, barriers and 1 KB of alignment slack
    assert mc.wg_smem_bytes() == 1024 + 2 * 73728 + 18432 + 2048 + 768 + 24 <= 232448
    assert mc.wg_smem_bytes(2) == mc.wg_smem_bytes() + 18432 + 2048 + 768 <= 232448  # two tokens per block


@pytest.mark.skipif(not NVCC, reason="nvcc not on PATH (or CUDA_HOME)")
def test_sm90a_build_has_no_spills_and_matches_the_python_layout(tmp_path):
    lib_path = _build.compile_kernel(mc.NAME, kind="nvcc", target="sm_90a", output="shared",
                                     dest=tmp_path / "mla_decode.so")
    report = Path(str(lib_path) + ".log").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    # form 'mma' (one split kernel), form 'wgmma' (one and two tokens per block), two merge builds
    assert sum("split_kernel" in k for k in kernels) == 1 and sum("wg_kernel" in k for k in kernels) == 2
    assert sum("merge_kernel" in k for k in kernels) == 2 and len(kernels) == 5
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert spills and all(s == 0 for s in spills), report[-2000:]
    assert regs and max(regs) <= 255
    # the library loads without a GPU (the CUDA runtime is linked statically): its Args size and
    # shared-memory formulas must equal the Python side's (bind checks them)
    lib = mc.bind(ctypes.CDLL(str(lib_path)))
    assert lib.k3_mla_decode_supported() == 1
    assert lib.k3_mla_decode_args_size() == ctypes.sizeof(mc.Args)
    assert lib.k3_mla_wg_smem(1) == mc.wg_smem_bytes(1) and lib.k3_mla_wg_smem(3) == -4
    # the launchers refuse bad sizes before touching the GPU (-4): pieces that are not whole tiles
    args = mc.Args()
    args.B, args.heads, args.splits, args.chunk, args.page_shift, args.q_run, args.q_tq = (
        1,
        12,
        4,
        40,
        6,
        1,
        1,
    )
    assert lib.k3_mla_decode(ctypes.byref(args), 1, 1 << 18, None) == -4
    map128 = (ctypes.c_ubyte * 128)()
    assert lib.k3_mla_decode_wg(ctypes.byref(args), ctypes.addressof(map128), ctypes.addressof(map128), 1,
                                1 << 18,
                                1, None) == -4


# ----------------------------------------------------------------------------------------------
# on a GPU


def _runs() -> bool:
    return GPU and mc.status()[0]


def _ragged(B, L, lengths, H, paged, seed, nan_tail):
    """q, the kernel's cache (NaN past every length when nan_tail), the clean reference cache,
    lengths and block table."""
    q, cache = _inputs(B=B, L=L, H=H, device="cuda", seed=seed)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    clean = cache.clone()
    pos = torch.arange(L, device="cuda")
    past = pos[None, :] >= lens[:, None].long()
    clean[past] = 0
    if paged:
        pool, bt = mla.to_paged(clean, 64, spare_pages=3)
        ref = mla.gather_paged(pool, bt, L)
        kern = pool.clone()
        if nan_tail:
            used = torch.zeros(pool.shape[0] * pool.shape[1], dtype=torch.bool, device="cuda")
            rows = (bt.long()[:, :, None] * 64 + torch.arange(64, device="cuda")).view(B, -1)[:, :L]
            used[rows[~past]] = True
            kern.view(-1, mla.LATENT_DIM)[~used] = float("nan")
        return q, kern, ref, lens, bt
    kern = cache.clone()
    if nan_tail:
        kern[past] = float("nan")
    return q, kern, clean, lens, None


def _check(o, lse, q, ref_cache, lens, H):
    ro, rl = mla.reference(q.float(), ref_cache.float(), lens)
    assert o.shape == (q.shape[0], 1, H, mla.VALUE_DIM) and o.dtype == torch.bfloat16
    assert lse.shape == (q.shape[0], 1, H) and lse.dtype == torch.float32
    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("form", mc.FORMS)
@pytest.mark.parametrize("lengths,H,splits", [
    ((1,), 12, None),
    ((31,), 12, None),
    ((33,), 16, None),
    ((4097,), 12, None),
    ((4097,), 12, 1),  # one piece: the split kernel writes the result itself
    ((2049,), 1, 7),
    ((5000, 33, 1, 64, 2049), 12, None),  # mixed lengths: empty pieces for the short requests
    ((32768,), 12, None),
    ((131072,), 12, None),  # 32 tiles a piece: every stage refilled many times
    ((20000,), 12, 300),  # more than 128 pieces: the merge loads them in batches after the maximum
])
def test_on_the_gpu_matches_the_reference(paged, lengths, H, splits, form):
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    L = max(lengths) + 40
    q, kern, ref, lens, bt = _ragged(len(lengths), L, lengths, H, paged, seed=len(lengths) + H, nan_tail=True)
    p = mc.plan(q, kern, lens, block_table=bt, num_splits=splits, form=form)
    o, lse = p()
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all(), "NaN past a length leaked into the output"
    _check(o, lse, q, ref, lens, H)
    if splits == 1:
        assert p.num_splits == 1 and p.launches == 1


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_on_the_gpu_auto_takes_wgmma_for_long_histories_and_split_for_short():
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    for L, form in ((32768, "wgmma"), (1024, "mma")):
        q, kern, ref, lens, bt = _ragged(1, L, (L,), 12, True, seed=L % 97, nan_tail=False)
        p = mc.plan(q, kern, lens, block_table=bt, form="auto", compute_units=132)
        assert p.form == form, p.form_why
        o, lse = p()
        torch.cuda.synchronize()
        _check(o, lse, q, ref, lens, 12)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_on_the_gpu_scale_and_graph_replay():
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    q, kern, ref, lens, bt = _ragged(2, 3000, (3000, 1500), 12, True, seed=5, nan_tail=False)
    o, lse = mc.plan(q, kern, lens, block_table=bt, scale=0.05)()
    ro, rl = mla.reference(q.float(), ref.float(), lens, scale=0.05)
    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
    p = mc.plan(q, kern, lens, block_table=bt)
    p()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p()
    q.copy_(torch.randn_like(q))  # new inputs in place: the replay must see them
    p.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(p.out, p.lse, q, ref, lens, 12)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("form", mc.FORMS)
def test_on_the_gpu_many_graph_replays_of_a_long_history_stay_right(form):
    # 32 tiles a piece, 50 back-to-back replays: every stage's mbarrier phase reused many times
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    q, kern, ref, lens, bt = _ragged(1, 131072, (131072,), 12, True, seed=13, nan_tail=False)
    p = mc.plan(q, kern, lens, block_table=bt, form=form)
    p()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    _check(p.out, p.lse, q, ref, lens, 12)


@pytest.mark.parametrize("case,match", [("contiguous", "block_table"), ("no_lengths", "lengths"),
                                        ("heads17", "heads"), ("short", "shorter than q_len"),
                                        ("share", "share must be")])
def test_verify_as_requests_refusals_by_name(case, match):
    q, pool, bt, lens = _paged(page=64, L=128, lengths=(100,))
    q = q.expand(1, 4, 12, mla.LATENT_DIM).contiguous()
    kw = dict(block_table=bt)
    if case == "contiguous":
        pool, kw = _inputs(L=128)[1], dict(block_table=None)
    if case == "no_lengths":
        lens = None
    if case == "heads17":
        q = torch.randn(1, 4, 17, mla.LATENT_DIM, dtype=torch.bfloat16)
    if case == "short":
        lens = torch.tensor([3], dtype=torch.int32)
    if case == "share":
        kw["share"] = "dram"
    with pytest.raises(ValueError, match=match):
        mc.plan_verify(q, pool, lens, **kw)


@pytest.mark.parametrize("kw,match", [(dict(tokens_per_block=3), "tokens_per_block must be"),
                                      (dict(tokens_per_block=2, form="split"), "form 'wgmma' only"),
                                      (dict(tokens_per_block=2, odd=True), "even batch"),
                                      (dict(q_group="q3"), "needs tokens_per_block=2"),
                                      (dict(tokens_per_block=2, q_group="q3"), "do not give"),
                                      (dict(tokens_per_block=2, q_group="run1"), "do not give")])
def test_two_tokens_per_block_refusals_by_name(kw, match):
    q, pool, bt, lens = _paged(page=64, L=128, lengths=(100, 90))
    if kw.pop("odd", False):
        q, bt, lens = q[:1], bt[:1], lens[:1]
    group = kw.get("q_group")
    if group == "q3":  # 3 groups of one token run as 2: 6 requests, not q's 2
        kw["q_group"] = (q[:1].expand(3, 1, 12, mla.LATENT_DIM).contiguous(), 2)
    if group == "run1":  # 2 tokens per group, run as 1 token: fewer run than real
        kw["q_group"] = (q.view(1, 2, 12, mla.LATENT_DIM), 1)
    with pytest.raises(ValueError, match=match):
        mc.plan(q, pool, lens, block_table=bt, **kw)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("share", ["pairs", "l2"])
@pytest.mark.parametrize(
    "lengths,q_len",
    [
        ((4097,), 2),
        ((32768,), 4),
        ((5000, 33, 64, 2049), 4),
        ((700,), 8),
        ((130, 64, 65), 2),
        ((130, 64, 65), 3),
        ((63, 2), 2),
        ((4133, 70), 5),
        ((9000,), 7),
        ((66, 129), 6),
    ],
)
def test_on_the_gpu_verify_as_requests_matches_the_reference(lengths, q_len, share, monkeypatch):
    """Each token of a verification group as its own request, two per block in one product ('pairs',
    an odd group padded by one token whose query reads zeros) or one per block sharing tiles through L2:
    causal inside the group (lengths ending on and just past a tile edge, so a pair's tokens disagree on
    their last tile; one-tile pieces), outputs and lse against the fp32 reference, through
    plan_after(backend='cuda'); a padded plan reads q afresh at every call."""
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    real = mc.plan_verify
    monkeypatch.setattr(mc, "plan_verify", lambda *a, **k: real(*a, share=share, **k))
    g = torch.Generator().manual_seed(q_len * 7 + len(lengths))
    B, L = len(lengths), max(lengths) + 40
    q = torch.randn(B, q_len, 12, mla.LATENT_DIM, generator=g).cuda().bfloat16()
    cache = torch.randn(B, L, mla.LATENT_DIM, generator=g).cuda().bfloat16()
    pool, bt = mla.to_paged(cache, 64)
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    p = mla.plan_after(q, pool, lens, block_table=bt, backend="cuda")
    assert p.facts()["verify"] == "tokens as requests" and p.facts()["share"] == share
    assert p.programs >= B * q_len // (2 if share == "pairs" else 1)
    assert p.facts()["padded_q_len"] == q_len + (share == "pairs" and q_len % 2)
    o, lse = p()
    ro, rl = mla.reference(q.float(), pool.float(), lens, block_table=bt)
    assert o.shape == (B, q_len, 12, mla.VALUE_DIM) and lse.shape == (B, q_len, 12)
    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
    # new queries in the same buffer: the plan sees them
    q.copy_(torch.randn(q.shape, generator=g).bfloat16())
    o, lse = p()
    ro, rl = mla.reference(q.float(), pool.float(), lens, block_table=bt)
    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_on_the_gpu_the_default_takes_every_group_to_cuda_in_pairs():
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    cache = torch.randn(1, 4096, mla.LATENT_DIM, device="cuda").bfloat16()
    pool, bt = mla.to_paged(cache, 64)
    lens = torch.tensor([4000], dtype=torch.int32, device="cuda")
    for q_len in range(1, mla.MAX_Q_LEN + 1):
        q = torch.randn(1, q_len, 12, mla.LATENT_DIM, device="cuda").bfloat16()
        p = mla.plan_after(q, pool, lens, block_table=bt)
        assert p.backend == ("cuda" if q_len in mla.CUDA_VERIFY_Q_LENS else "triton"), (q_len, p.backend)
        assert q_len == 1 or p.facts()["share"] == "pairs"
    q = torch.randn(1, 2, 12, mla.LATENT_DIM, device="cuda").bfloat16()
    assert mla.plan_after(q, cache, lens).backend == "triton"  # a contiguous cache: no pages to share
