"""The CUDA backend's before on CUDA cores (kernels/mla_decode_before.cu via k3lab.ops.mla_decode.cuda):
refusals by name everywhere; the sm_90a build (no spills, the ctypes Args layout checked against the
compiled library, which loads without a GPU) where nvcc is present; on a GPU, outputs and lse against
the fp32 reference for contiguous and paged caches, ragged lengths with NaN past them, and
verification groups, through plan_before as the study calls it."""

import ctypes
import re
from pathlib import Path

import pytest
import torch

from k3lab import bench
from k3lab.ops import _build
from k3lab.ops import mla_decode as mla
from k3lab.ops.mla_decode import cuda as mc

GPU = torch.cuda.is_available()
NVCC = _build.find_toolchain("nvcc") is not None


@pytest.mark.parametrize("case,match", [("fp32", "bfloat16"), ("odd_row", "4-byte"), ("width", "576")])
def test_refusals_by_name(case, match):
    q = torch.randn(1, 1, 12, mla.LATENT_DIM).bfloat16()
    cache = torch.randn(1, 64, mla.LATENT_DIM).bfloat16()
    if case == "fp32":
        q, cache = q.float(), cache.float()
    if case == "odd_row":
        cache = torch.zeros(1, 64 * mla.LATENT_DIM + 1).bfloat16()[:, 1:].view(1, 64, mla.LATENT_DIM)
    if case == "width":
        cache = torch.randn(1, 64, 512).bfloat16()
    with pytest.raises(ValueError, match=match):
        mc.check_before(q, cache)


def test_plan_before_backend_choice_by_name():
    q = torch.randn(1, 1, 12, mla.LATENT_DIM)
    cache = torch.randn(1, 64, mla.LATENT_DIM)
    with pytest.raises(ValueError, match="backend must be one of"):
        mla.plan_before(q, cache, backend="asm")
    with pytest.raises(mla.BackendUnavailable, match="'aiter' cannot run here"):
        mla.plan_before(q, cache, backend="aiter")
    # wherever AITER is installed, it has no before
    ok, why = mla.BACKENDS.check("aiter", q, cache, need="plan_before")
    assert not ok and "provides no plan_before" in why
    if not GPU:  # asked for by name where it cannot run: the reason, not a silent fallback
        with pytest.raises(mla.BackendUnavailable, match="'cuda' cannot run here"):
            mla.plan_before(q.bfloat16(), cache.bfloat16(), backend="cuda")
        # the Triton kernel runs, as before_status() says
        assert mla.plan_before(q, cache).backend == "triton"


@pytest.mark.skipif(not NVCC, reason="nvcc not on PATH (or CUDA_HOME)")
def test_sm90a_build_has_no_spills_and_matches_the_python_layout(tmp_path):
    lib_path = _build.compile_kernel(mc.BEFORE_NAME, kind="nvcc", target="sm_90a", output="shared",
                                     dest=tmp_path / "b.so")
    report = Path(str(lib_path) + ".log").read_text()
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and all(s == 0 for s in spills), report[-2000:]
    lib = mc.bind_before(ctypes.CDLL(str(lib_path)))
    assert lib.k3_mla_decode_before_args_size() == ctypes.sizeof(mc.BeforeArgs)
    assert lib.k3_mla_decode_before_has_ring() == 1


def _runs() -> bool:
    return GPU and mc.before_status()[0]


@pytest.mark.skipif(not GPU, reason="needs a GPU")
@pytest.mark.parametrize("ring", [None, False], ids=["default", "direct"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize(
    "lengths,q_len,H",
    [
        ((1,), 1, 12),
        ((33,), 1, 12),
        ((1000,), 1, 16),
        ((32768,), 1, 12),
        ((5000, 7, 64, 2049), 1, 12),
        ((300, 130), 4, 12),
        ((700,), 8, 3),
    ],
)
def test_on_the_gpu_matches_the_reference(ring, paged, lengths, q_len, H):
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.before_status()[1]}")
    g = torch.Generator().manual_seed(sum(lengths) + q_len + H)
    B, L = len(lengths), max(lengths) + 40
    q = torch.randn(B, q_len, H, mla.LATENT_DIM, generator=g).cuda().bfloat16()
    cache = torch.randn(B, L, mla.LATENT_DIM, generator=g).cuda().bfloat16()
    lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    past = torch.arange(L, device="cuda")[None, :] >= lens[:, None]
    cache[past] = 0  # the reference's view: nothing past a length
    if paged:
        pool, bt = mla.to_paged(cache, 64, spare_pages=2)
        kern = pool.clone()
        rows = (bt.long()[:, :, None] * 64 + torch.arange(64, device="cuda")).view(B, -1)[:, :L]
        used = torch.zeros(pool.shape[0] * 64, dtype=torch.bool, device="cuda")
        used[rows[~past]] = True
        kern.view(-1, mla.LATENT_DIM)[~used] = float("nan")  # NaN past every length must not leak
        p = mla.plan_before(q, kern, lens, block_table=bt) if ring is None else \
            mc.plan_before(q, kern, lens, block_table=bt, ring=ring)
    else:
        kern = cache.clone()
        kern[past] = float("nan")
        p = mla.plan_before(q, kern, lens) if ring is None else mc.plan_before(q, kern, lens, ring=ring)
    assert p.backend == "cuda" and p.programs == B * q_len * H and p.grid == (H, q_len, B)
    # dense, aligned rows take the ring by default
    assert p.rows_via == ("ring" if ring is None else "direct")
    o, lse = p()
    ro, rl = mla.reference(q.float(), cache.float(), lens)
    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)


@pytest.mark.skipif(not GPU, reason="needs a GPU")
def test_on_the_gpu_ring_with_small_pages_and_a_refusal():
    """Pages of 16 rows: a 64-row tile is four copies; a cache whose rows are not dense is refused by
    name when the ring is asked for, and loaded directly by default."""
    if not _runs():
        pytest.skip(f"kernel unavailable: {mc.before_status()[1]}")
    g = torch.Generator().manual_seed(7)
    lens = torch.tensor([1000, 77], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 2, 12, mla.LATENT_DIM, generator=g).cuda().bfloat16()
    cache = torch.randn(2, 1040, mla.LATENT_DIM, generator=g).cuda().bfloat16()
    cache[torch.arange(1040, device="cuda")[None, :] >= lens[:, None]] = 0
    pool, bt = mla.to_paged(cache, 16, spare_pages=3)
    p = mc.plan_before(q, pool, lens, block_table=bt, ring=True)
    o, lse = p()
    ro, rl = mla.reference(q.float(), cache.float(), lens)
    bench.check_all({"o": (o, ro), "lse": (lse, rl)}, dtype=torch.bfloat16)
    wide = torch.zeros(2, 1040, mla.LATENT_DIM + 8, device="cuda").bfloat16()
    wide[..., :mla.LATENT_DIM] = cache
    strided = wide[..., :mla.LATENT_DIM]
    with pytest.raises(ValueError, match="ring=True needs"):
        mc.plan_before(q, strided, lens, ring=True)
    assert mc.plan_before(q, strided, lens).rows_via == "direct"
    o2, lse2 = mc.plan_before(q, strided, lens)()
    bench.check_all({"o": (o2, ro), "lse": (lse2, rl)}, dtype=torch.bfloat16)


def test_committed_h200_before_records():
    """What notebook 04b says of the committed H200 records: the CUDA before is the before of the main
    cases and at least 5x faster than the Triton before (the tune.* records, an earlier call on the
    same H200: the Triton before is no longer a case) at 1K and 32K, and the after still beats it by
    1.8x at 32K."""
    from k3lab.studies import mla_padding as study

    h200 = bench.load_records(study.NAME, device="nvidia-h200")
    graph = {(r.case, r.variant): r for r in h200 if r.mode == "graph"}
    for case, triton in (("ctx1k", "tune.ctx1k.before.bn32w8s2"), ("ctx32k", "tune.ctx32k.before.bn32w8s2")):
        cuda = graph[case, "before"]
        assert cuda.extra.get("backend", cuda.extra.get("kernel")) == "cuda"
        assert cuda.error and cuda.error["o"]["rel_l2"] < 0.02
        assert cuda.device == graph[triton, "before"].device
        assert cuda.median_us * 5 <= graph[triton, "before"].median_us
    assert graph["ctx32k", "before"].median_us >= 1.8 * graph["ctx32k", "after"].median_us
