"""The hand-written CUDA MLA decode (kernels/mla_decode.cu via k3lab.ops.mla_decode_cuda; EXPERIMENTAL,
not yet run on a GPU by this project): refusals by name and the piece rule everywhere; the sm_90a
build (no spills, the ctypes Args layout and shared-memory formula checked against the compiled
library, which loads without a GPU) where nvcc is present; results against mla_decode.reference in
fp32 on a GPU. Its HIP compile (a stub) is covered by tests/test_kernels_build.py with every kernel."""

import ctypes
import re
from pathlib import Path

import pytest
import torch

from k3lab import bench
from k3lab.ops import _build
from k3lab.ops import mla_decode as mla
from k3lab.ops import mla_decode_cuda as mc

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
    ("cache_fp16", "cache.dtype"),
    ("row_stride", "stride"),
    ("page16", "page size"),
    ("paged_no_lengths", "lengths"),
    ("cache_misaligned", "16-byte"),
    ("q_misaligned", "4-byte"),
    ("splits0", "num_splits"),
    ("stages6", "stages"),
    ("warps16", "warps"),
    ("form_bad", "form"),
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
    elif case == "stages6":
        kw["stages"] = 6
    elif case == "warps16":
        kw["warps"] = 16
    elif case == "form_bad":
        kw["form"] = "wgmma"
    elif case == "scale_negative":
        kw["scale"] = -0.1
    elif case == "too_long":
        lengths = torch.tensor([97])
    elif case == "page_out_of_pool":
        q, cache, bt, lengths = _paged()
        kw["block_table"] = bt + cache.shape[0]
    with pytest.raises(ValueError, match=match):
        mc.mla_decode_cuda(q, cache, lengths, **kw)


def test_good_arguments_pass_the_checks():
    q, cache = _inputs(B=2)
    c = mc.check(q, cache, torch.tensor([96, 40]))
    assert (c.inp.batch, c.inp.heads, c.inp.paged, c.stages) == (2, 12, False, mc.DEFAULT_STAGES)
    q, pool, bt, lengths = _paged(lengths=(96,))
    assert mc.check(q, pool, lengths, block_table=bt).inp.paged


@pytest.mark.skipif(GPU, reason="checks what a machine without a GPU says")
def test_without_a_gpu_it_says_so_after_the_checks():
    ok, why = mc.status()
    assert not ok and "GPU" in why
    q, cache = _inputs()
    with pytest.raises(_build.KernelUnavailable, match="GPU"):
        mc.mla_decode_cuda(q, cache)


def test_pieces_fill_the_units_once_in_whole_tiles():
    # H200: 132 SMs, one 5-stage block each
    assert mc.choose_splits(1, 32768, 132) == (128, 256)  # 8 tiles of 32 rows per piece
    assert mc.choose_splits(1, 131072, 132) == (128, 1024)
    assert mc.choose_splits(8, 8192, 132) == (16, 512)  # 8 x 16 = 128 blocks
    assert mc.choose_splits(1, 1024, 132) == (32, 32)  # never more pieces than tiles
    assert mc.choose_splits(1, 100, 132) == (4, 32)
    assert mc.choose_splits(64, 8192, 132) == (3, 2752)
    for B, L, units in ((1, 32768, 132), (3, 5000, 80), (2, 33, 7), (1, 1, 132)):
        splits, chunk = mc.choose_splits(B, L, units)
        assert chunk % mc.BLOCK_N == 0 and (splits - 1) * chunk < L <= splits * chunk  # no empty piece at max_len
    assert mc.choose_splits(1, 32768, 132, num_splits=7) == (7, 4704)
    with pytest.raises(ValueError, match="num_splits"):
        mc.choose_splits(1, 1024, 132, num_splits=0)
    with pytest.raises(ValueError, match="compute_units"):
        mc.choose_splits(1, 1024, 0)


def test_shared_memory_fits_one_block_per_h200_sm():
    assert mc.smem_bytes(5) <= 232448 < 2 * mc.smem_bytes(3)  # the H200's opt-in limit per block
    with pytest.raises(ValueError, match="stages"):
        mc.smem_bytes(2)


@pytest.mark.skipif(not NVCC, reason="nvcc not on PATH (or CUDA_HOME)")
def test_sm90a_build_has_no_spills_and_matches_the_python_layout(tmp_path):
    lib_path = _build.compile_kernel(mc.NAME, kind="nvcc", target="sm_90a", output="shared",
                                     dest=tmp_path / "mla_decode.so")
    report = Path(str(lib_path) + ".log").read_text()
    kernels = re.findall(r"Compiling entry function '(\w+)'", report)
    # every (stages, warps) pair, plus the default plan's timeline-probe instance (template flag b1)
    assert sum("split_kernel" in k and "Lb0E" in k for k in kernels) == len(mc.STAGES) * len(mc.WARPS)
    assert sum("split_kernel" in k and "Lb1E" in k for k in kernels) == 1
    assert sum("team_kernel" in k for k in kernels) == 2  # and the team kernel, with and without the probe
    assert any("merge_kernel" in k for k in kernels)
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    assert spills and all(s == 0 for s in spills), report[-2000:]
    assert regs and max(regs) <= 255
    # the library loads without a GPU (the CUDA runtime is linked statically): its Args size and
    # shared-memory formula must equal the Python side's
    lib = mc.bind(ctypes.CDLL(str(lib_path)))
    assert lib.k3_mla_decode_supported() == 1
    assert lib.k3_mla_decode_args_size() == ctypes.sizeof(mc.Args)


# ----------------------------------------------------------------------------------------------
# on a GPU


def _runs() -> bool:
    return GPU and mc.available()


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


@pytest.mark.skipif(not GPU, reason="needs a GPU (the kernel is not yet run on one by this project)")
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("form,warps", [("team", 4), ("split", 4), ("split", 8)])
@pytest.mark.parametrize("lengths,H,splits,stages", [
    ((1,), 12, None, 5),
    ((31,), 12, None, 5),
    ((33,), 16, None, 4),
    ((4097,), 12, None, 5),
    ((4097,), 12, 1, 5),  # one piece: the split kernel writes the result itself
    ((2049,), 1, 7, 3),
    ((5000, 33, 1, 64, 2049), 12, None, 5),  # mixed lengths: empty pieces for the short requests
    ((32768,), 12, None, 5),
    ((131072,), 12, None, 5),  # 32 tiles a piece: every stage refilled six times
])
def test_on_the_gpu_matches_the_reference(paged, lengths, H, splits, stages, form, warps):
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    L = max(lengths) + 40
    q, kern, ref, lens, bt = _ragged(len(lengths), L, lengths, H, paged, seed=len(lengths) + H, nan_tail=True)
    p = mc.plan(q, kern, lens, block_table=bt, num_splits=splits, stages=stages, warps=warps, form=form)
    o, lse = p()
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all(), "NaN past a length leaked into the output"
    _check(o, lse, q, ref, lens, H)
    if splits == 1:
        assert p.num_splits == 1 and p.launches == 1


@pytest.mark.skipif(not GPU, reason="needs a GPU (the kernel is not yet run on one by this project)")
def test_on_the_gpu_scale_and_pdl_off_and_graph_replay():
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    q, kern, ref, lens, bt = _ragged(2, 3000, (3000, 1500), 12, True, seed=5, nan_tail=False)
    o, lse = mc.mla_decode_cuda(q, kern, lens, block_table=bt, scale=0.05, pdl=False)
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


@pytest.mark.skipif(not GPU, reason="needs a GPU (the kernel is not yet run on one by this project)")
@pytest.mark.parametrize("form", mc.FORMS)
def test_on_the_gpu_the_timeline_probe_is_ordered_and_changes_nothing(form):
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.status()[1]}")
    q, kern, ref, lens, bt = _ragged(1, 9000, (9000,), 12, True, seed=9, nan_tail=False)
    p0 = mc.plan(q, kern, lens, block_table=bt, form=form)
    probe = torch.zeros(mc.probe_size(1, 12, p0.num_splits), dtype=torch.int64, device="cuda")
    o, lse = mc.plan(q, kern, lens, block_table=bt, form=form, probe=probe)()
    torch.cuda.synchronize()
    _check(o, lse, q, ref, lens, 12)
    tl = mc.timeline(probe, 1, 12, p0.num_splits)
    assert len(tl["blocks"]) == p0.num_splits and sum(bl["tiles"] for bl in tl["blocks"]) == -(-9000 // 32)
    for bl in tl["blocks"]:
        assert 0 <= bl["start"] <= bl["first"] <= bl["loop_end"] <= bl["end"]
    assert min(m["start"] for m in tl["merge"]) >= max(bl["end"] for bl in tl["blocks"]) - 0.1  # timer grain


@pytest.mark.skipif(not GPU, reason="needs a GPU (the kernel is not yet run on one by this project)")
@pytest.mark.parametrize("form", mc.FORMS)
def test_on_the_gpu_many_graph_replays_of_a_long_history_stay_right(form):
    # 32 tiles a piece, 50 back-to-back replays: the team kernel's first form read a tile early here
    # (one barrier per stage, two teams: its parity test passed on the other team's phase)
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
