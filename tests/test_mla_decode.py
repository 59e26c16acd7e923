"""k3lab.ops.mla_decode: the Triton kernels against the fp32 reference (outputs and LSE), the
split-count rule, the padding, the backend table, and bad input; the study's tables from committed
records. On CPU the kernels run in Triton's interpreter (fp32 / fp16)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench, env
from k3lab.ops import mla_decode as mla
from k3lab.ops.mla_decode import inputs, triton as mt

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, Tq, H, L, dtype, *, lengths=None, paged=False, page_size=16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, Tq, H, mla.LATENT_DIM, generator=g).to(DEV, dtype)
    cache = torch.randn(B, L, mla.LATENT_DIM, generator=g).to(DEV, dtype)
    lens = None if lengths is None else torch.tensor(lengths, device=DEV)
    if paged:
        pool, bt = mla.to_paged(cache, page_size, seed=seed, spare_pages=3)
        return q, cache, lens, pool, bt
    return q, cache, lens, cache, None


def _has_nvidia_backend() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton.backends.nvidia.compiler") is not None


def _check(o, lse, ref_o, ref_l, dtype, name):
    bench.check(o, ref_o, dtype=dtype, name=f"{name}/o")
    bench.check(lse, ref_l, dtype=dtype, name=f"{name}/lse")


# (B, q_len, heads, cache length, per-request lengths, paged): context lengths are not multiples of
# the tiles (32 / 64) or pages (16), batches mix lengths, q_len > 1 checks causality inside the group.
CASES = {
    "b1_h12_L100_contig": (1, 1, 12, 100, None, False),
    "b2_h12_mixed_paged": (2, 1, 12, 150, [150, 37], True),
    "b2_q3_h4_mixed_paged": (2, 3, 4, 90, [90, 5], True),
    "b3_q2_h4_mixed_contig": (3, 2, 4, 70, [70, 9, 33], False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", list(CASES))
def test_before_and_after_match_reference(case, dtype):
    B, Tq, H, L, lengths, paged = CASES[case]
    q, cache, lens, kv, bt = _inputs(B, Tq, H, L, dtype, lengths=lengths, paged=paged)
    ref_o, ref_l = mla.reference(q.float(), cache.float(), lens)
    o, lse = mla.mla_decode_before(q, kv, lens, block_table=bt, backend="triton")
    assert o.shape == (B, Tq, H, mla.VALUE_DIM) and o.dtype == dtype and lse.shape == (B, Tq, H)
    _check(o, lse, ref_o, ref_l, dtype, f"{case}/before")
    o, lse = mla.mla_decode_after(q, kv, lens, block_table=bt, backend="triton")  # split count from the rule
    assert o.shape == (B, Tq, H, mla.VALUE_DIM) and o.dtype == dtype
    _check(o, lse, ref_o, ref_l, dtype, f"{case}/after")


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_after_any_split_count(splits):
    # 5 splits of a 150-long history in 64-position tiles: some pieces are empty, and the short
    # request (37 positions) gets one non-empty piece: the merge must ignore the empty ones.
    q, cache, lens, kv, bt = _inputs(2, 2, 12, 150, torch.float32, lengths=[150, 37], paged=True, seed=splits)
    ref_o, ref_l = mla.reference(q.float(), cache.float(), lens)
    plan = mla.plan_after(q, kv, lens, block_table=bt, num_splits=splits)
    assert plan.backend == "triton" and plan.num_splits == splits and plan.programs == splits * 2 * 1
    assert plan.launches == (1 if splits == 1 else 2)
    o, lse = plan()
    _check(o, lse, ref_o, ref_l, torch.float32, f"splits{splits}")


def test_lse_is_natural_log_and_merges_shards():
    # Two halves of a history, each decoded alone, merged with natural-log weights, equal the whole.
    q, cache, _, _, _ = _inputs(1, 1, 12, 96, torch.float32, seed=3)
    o1, l1 = mla.mla_decode_after(q, cache[:, :48].contiguous())
    o2, l2 = mla.mla_decode_after(q, cache[:, 48:].contiguous())
    ref_o, ref_l = mla.reference(q, cache)
    lse = torch.logaddexp(l1, l2)
    o = torch.exp(l1 - lse)[..., None] * o1 + torch.exp(l2 - lse)[..., None] * o2
    _check(o, lse, ref_o, ref_l, torch.float32, "merged halves")


def test_padding_never_reaches_the_output():
    # pad='copy' builds the seed's 16-head query; fill the 4 extra heads with NaN: they are computed
    # (their outputs are NaN) and dropped, and the 12 real heads are exact.
    q, cache, lens, kv, bt = _inputs(1, 1, 12, 80, torch.float32, seed=5)
    plan = mla.plan_after(q, kv, lens, pad="copy", pad_fill=float("nan"), num_splits=2)
    o, lse = plan()
    assert plan.padded_query.shape[2] == mla.MMA_ROWS and o.shape[2] == 12
    assert torch.isnan(plan.padded_out[:, :, 12:]).all()
    ref_o, ref_l = mla.reference(q, cache)
    _check(o, lse, ref_o, ref_l, torch.float32, "pad=copy")


def test_fold_heads_beyond_16():
    q, cache, _, _, _ = _inputs(1, 1, 20, 40, torch.float32, seed=7)
    with pytest.raises(ValueError, match="fold_heads"):
        mla.plan_after(q, cache)
    plan = mla.plan_after(q, cache, fold_heads=True, num_splits=1)
    assert plan.grid == (1, 1, 2)  # 20 heads = 2 groups of 16 rows
    o, lse = plan()
    ref_o, ref_l = mla.reference(q, cache)
    _check(o, lse, ref_o, ref_l, torch.float32, "folded")


def test_plain_pytorch_peers():
    q, cache, lens, _, _ = _inputs(2, 3, 12, 50, torch.float32, lengths=[50, 20], seed=11)
    ref_o, ref_l = mla.reference(q, cache, lens)
    o, lse = mla.einsum_decode(q, cache, lens)
    _check(o, lse, ref_o, ref_l, torch.float32, "einsum")
    o, lse = mla.sdpa_decode(q, cache, lens)
    assert lse is None
    bench.check(o, ref_o, dtype=torch.float32, name="sdpa/o")


def test_split_rule_choices():
    rule = mla.choose_num_splits
    # one request, long history: enough pieces to cover most of an H200's 132 SMs
    s = rule(1, 32768, 132)
    assert 64 <= s <= 132, s
    assert rule(1, 32768, 256) > s  # more units, more pieces (MI355X)
    # a short history gets few pieces; one tile's worth gets exactly one (no merge)
    assert rule(1, 64, 132) == 1
    assert rule(1, 1024, 132) <= 16
    # a batch that fills the machine needs little or no splitting
    assert rule(64, 8192, 132) <= 4
    assert rule(256, 8192, 132) == 1
    # never fewer pieces for a longer history, never more for a bigger batch
    lens = [256, 1024, 4096, 32768, 131072]
    assert [rule(1, n, 132) for n in lens] == sorted(rule(1, n, 132) for n in lens)
    batches = [1, 2, 8, 32, 128]
    assert [rule(b, 8192, 132) for b in batches] == sorted((rule(b, 8192, 132) for b in batches),
                                                           reverse=True)
    # the rule is the argmin of its cost model
    costs = {k: mla.split_cost(k, 1, 32768, 132) for k in range(1, 257)}
    assert costs[s] == min(costs.values())
    with pytest.raises(ValueError, match="compute_units"):
        rule(1, 1024, 0)


def test_plan_reuse_is_stable():
    q, cache, lens, kv, bt = _inputs(1, 1, 12, 70, torch.float32, seed=13)
    plan = mla.plan_after(q, kv, num_splits=3, backend="triton")
    o1 = plan()[0].clone()
    o2 = plan()[0]
    assert torch.equal(o1, o2)


def test_bad_input():
    q, cache, _, _, _ = _inputs(1, 1, 12, 32, torch.float32)
    with pytest.raises(ValueError, match="cache width"):
        mla.plan_after(q, cache[..., :512].contiguous())
    with pytest.raises(ValueError, match="latent width"):
        mla.plan_before(q[..., :512].contiguous(), cache)
    with pytest.raises(ValueError, match="longer than the cache"):
        mla.plan_after(q, cache, torch.tensor([33]))
    with pytest.raises(ValueError, match="longer than the cache"):
        mla.plan_before(q, cache, torch.tensor([40]))
    with pytest.raises(ValueError, match="q_len"):
        mla.plan_after(torch.randn(1, 9, 12, 576, device=DEV), cache)
    with pytest.raises(ValueError, match="q_len"):
        mla.plan_before(torch.randn(1, 0, 12, 576, device=DEV), cache)
    with pytest.raises(ValueError, match="shorter than q_len"):
        mla.plan_after(torch.randn(1, 4, 12, 576, device=DEV), cache, torch.tensor([3]))
    with pytest.raises(ValueError, match="cache must be float16, got torch.float32"):  # q's dtype
        mla.plan_after(q.half(), cache)
    with pytest.raises(ValueError, match="heads"):
        mla.plan_after(torch.randn(1, 1, 17, 576, device=DEV), cache)
    pool, bt = mla.to_paged(cache, 16)
    full = torch.tensor([32], device=DEV)
    with pytest.raises(ValueError, match="lengths is required"):
        mla.plan_after(q, pool, block_table=bt)
    with pytest.raises(ValueError, match="page ids"):
        mla.plan_after(q, pool, full, block_table=bt + 100)
    with pytest.raises(ValueError, match="block_table"):
        mla.plan_after(q, pool, full, block_table=bt.float())
    with pytest.raises(ValueError, match="pad"):
        mla.plan_after(q, cache, pad="zeros")
    with pytest.raises(ValueError, match="num_splits"):
        mla.plan_after(q, cache, num_splits=0)


def _fake_aiter_mla():
    """A stand-in for aiter.mla with mla_decode_fwd's signature from the committed amd-aiter wheel file:
    it writes o from the call's index lists (page_size 1: kv_indices lists each position's row) and,
    like that version's non-persistent path, returns a final_lse nothing wrote (NaN here)."""
    import inspect
    import types
    from pathlib import Path

    spec = json.loads((Path(__file__).resolve().parents[1] / "profiles" / "isa" / "aiter_mla_signature.json")
                      .read_text())
    empty = inspect.Parameter.empty
    sig = inspect.Signature([inspect.Parameter(p["name"], inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                               default=empty if p["default"] is None else None)
                             for p in spec["params"]])

    def mla_decode_fwd(*args, **kwargs):
        a = sig.bind(*args, **kwargs).arguments  # an argument this version lacks fails here
        q, kv, o, Tq = a["q"], a["kv_buffer"].reshape(-1, mla.LATENT_DIM), a["o"], a["max_seqlen_q"]
        starts, rows = a["kv_indptr"].tolist(), a["kv_indices"].long()
        for b in range(len(starts) - 1):
            keys = kv[rows[starts[b]:starts[b + 1]]].double()
            for t in range(Tq):
                n = starts[b + 1] - starts[b] - Tq + t + 1
                p = torch.softmax(q[b * Tq + t].double() @ keys[:n].T * a["sm_scale"], -1)
                o[b * Tq + t] = (p @ keys[:n, :mla.VALUE_DIM]).to(o.dtype)
        return o, torch.full(o.shape[:2], float("nan"))

    mla_decode_fwd.__signature__ = sig
    return types.SimpleNamespace(mla_decode_fwd=mla_decode_fwd)


def test_aiter_path_returns_no_lse_and_dcp_refuses_it_by_name(monkeypatch):
    """AITER 0.1.7.post2.dev18's decode without a work list leaves its final_lse unwritten: k3lab's AITER
    path returns lse None (the outputs are the decode's), and a caller that merges by lse refuses it."""
    import sys
    import types

    from k3lab.ops.mla_decode import peers

    monkeypatch.setitem(sys.modules, "aiter", types.SimpleNamespace(mla=_fake_aiter_mla()))
    monkeypatch.setattr(peers, "aiter_status", lambda: (True, "a stand-in with the wheel's signature"))
    q, cache, lens, pool, bt = _inputs(2, 2, 12, 70, torch.float32, lengths=[70, 9], paged=True, seed=41)
    ref_o, _ = mla.reference(q, cache, lens)
    o, lse = peers.aiter_decode(q, pool, lens, block_table=bt)
    assert lse is None
    bench.check(o, ref_o, dtype="fp32", name="aiter o")
    plan = peers.AiterPlan(q, pool, lens, block_table=bt)
    assert plan.returns_lse is False and plan.facts()["lse"] is False and plan()[1] is None
    with pytest.raises(ValueError, match="DCP merges .* backend 'aiter' gives none"):
        peers.require_lse("aiter", "DCP")
    for name in ("triton", "cuda"):
        peers.require_lse(name, "DCP")


def test_aiter_absence_is_not_an_error():
    ok, why = mla.aiter_status()
    if env.detect().backend != "rocm":
        assert not ok and "ROCm" in why
    assert isinstance(why, str) and why


def test_launch_config_reads_the_device():
    cfg = mt.launch_config("after", torch.bfloat16, rows=16)
    assert cfg.block_n == 32 and cfg.num_warps == 4 and 1 <= cfg.num_stages <= 3
    assert mt.launch_config("after", rows=16, block_n=16).block_n == 16  # explicit arguments win
    with pytest.raises(ValueError, match="variant"):
        mt.launch_config("middle")
    cfg64 = mt.launch_config("after", torch.bfloat16, rows=64)
    assert cfg64.num_warps == 8 and cfg64.block_n * mla.LATENT_DIM * 2 * cfg64.num_stages < 232448
    assert math.isclose(mla.DEFAULT_SCALE, 192 ** -0.5)


def test_verify_tokens_per_program_by_wave_width(monkeypatch):
    """Up to 4 verify tokens share an after-program on 32-lane devices (the H200's configuration); one
    on 64-lane devices, where 32 or 64 accumulator rows spill (k3lab.isa). Both match the reference."""
    assert [mt.token_tile(t, 32) for t in (1, 2, 3, 4, 8)] == [1, 2, 4, 4, 4]
    assert [mt.token_tile(t, 64) for t in (1, 2, 3, 4, 8)] == [1, 1, 1, 1, 1]
    assert mla.after_groups(12, 4, 32) == 1 and mla.after_groups(12, 4, 64) == 4
    q, cache, lens, kv, bt = _inputs(2, 3, 4, 90, torch.float32, lengths=[90, 5], paged=True, seed=31)
    ref_o, ref_l = mla.reference(q.float(), cache.float(), lens)
    amd = env.DeviceInfo("rocm", "MI355X", 256, None, 64, "gfx950", env.PEAKS["CPU"])
    monkeypatch.setattr(env, "detect", lambda: amd)
    plan = mla.plan_after(q, kv, lens, block_table=bt, num_splits=2)
    assert plan.programs == 2 * 2 * 3  # splits x requests x one program per token
    o, lse = plan()
    _check(o, lse, ref_o, ref_l, torch.float32, "wave64 verify")


@pytest.mark.parametrize("page_size,block_n,splits", [(64, 32, 1), (16, 16, 1), (16, 16, 3), (32, 16, 2)])
def test_after_paged_page_groups(page_size, block_n, splits):
    # Tiles inside pages: the kernel reads the block table 16 pages at a time; 300 positions in
    # pages of 16 are 19 pages, so the second group and a partial last page are exercised.
    q, cache, lens, kv, bt = _inputs(2, 2, 12, 300, torch.float32, lengths=[300, 131], paged=True,
                                     page_size=page_size, seed=page_size + splits)
    ref_o, ref_l = mla.reference(q, cache, lens)
    plan = mt.plan_after(q, kv, lens, block_table=bt, num_splits=splits, block_n=block_n)
    assert plan.config.block_n == block_n and plan.backend == "triton"
    o, lse = plan()
    _check(o, lse, ref_o, ref_l, torch.float32, f"page{page_size}/bn{block_n}/s{splits}")


def test_study_checks_and_records():
    from k3lab.studies import mla_padding as study

    if DEV != "cpu":
        pytest.skip("the study's GPU cases are benchmarks, run by `k3lab bench mla_padding`")
    records = study.run("tp8", cases=["ctx96"])
    by = {(r.case, r.variant) for r in records}
    assert {("ctx96", "before"), ("ctx96", "after"), ("ctx96", "torch"), ("ctx96.sdpa", "torch"),
            ("ctx96.padcopy", "after"), ("ctx96.contig", "after")} <= by
    for r in records:
        assert r.study == study.NAME and r.floor_us > 0 and r.shape["heads"] == 12
        assert r.error["o"]["max_rel"] <= r.error["o"]["bound_max_rel"]
    after = next(r for r in records if (r.case, r.variant) == ("ctx96", "after"))
    assert "lse" in after.error and after.extra["num_splits"] >= 1
    table = study.summary(records)
    assert set(table["case"]) == {"ctx96"} and (table["speedup"] > 0).all()


def test_study_tables_from_committed_h200_records():
    from k3lab.studies import mla_padding as study

    h200 = bench.load_records(study.NAME, device="nvidia-h200")
    if not h200:
        pytest.skip("no committed H200 records in profiles/")
    summary = study.summary(h200)
    assert {"ctx1k", "ctx32k", "ctx128k", "verify4_32k", "b64_8k"} <= set(summary["case"])
    sweep = study.sweep_table(h200)
    assert (sweep.groupby("case")["splits"].nunique() >= 5).all()
    targets = study.targets(h200)
    assert len(targets) == 10 and set(targets["mode"]) == {"eager", "graph"}


def test_after_second_page_group_and_tile_tail():
    # 1100 positions in pages of 16 are 69 pages: more than the 64 block-table entries one group
    # holds, so the kernel reloads the table mid-piece; 1100 is not a multiple of the 16-row tile.
    assert mt.page_groups(1100, 1, 16, 16) == 64 and inputs.piece_len(1100, 1, 16) == 1104
    q, cache, lens, kv, bt = _inputs(1, 1, 4, 1100, torch.float32, lengths=[1100], paged=True, seed=17)
    ref_o, ref_l = mla.reference(q, cache, lens)
    o, lse = mt.plan_after(q, kv, lens, block_table=bt, num_splits=1, block_n=16)()
    _check(o, lse, ref_o, ref_l, torch.float32, "two page groups")


def test_merge_with_many_empty_pieces():
    # 100 pieces of a ragged batch: pieces are cut from the longest request (150 -> 16 positions
    # each), so the 20-long request fills 2 and the other 98 of its programs are empty (zero weight)
    q, cache, lens, kv, bt = _inputs(2, 1, 4, 150, torch.float32, lengths=[150, 20], paged=True, seed=19)
    ref_o, ref_l = mla.reference(q, cache, lens)
    assert inputs.piece_len(150, 100, 16) == 16
    plan = mt.plan_after(q, kv, lens, block_table=bt, num_splits=100, block_n=16)
    assert plan.num_splits == 100 and plan.launches == 2
    o, lse = plan()
    _check(o, lse, ref_o, ref_l, torch.float32, "many empty pieces")


def test_merge_early_launch_compiles_for_hopper():
    # programmatic dependent launch: the split kernel lets the merge launch, the merge waits for it;
    # compiled for sm_90 here (no GPU needed) when this Triton has the NVIDIA backend
    from k3lab.studies import mla_padding as study

    mix = study.instruction_mix()
    if "note" in mix:
        if _has_nvidia_backend():
            pytest.fail(f"sm_90 compile failed: {mix['note'].iloc[0]}")
        pytest.skip(f"no sm_90 compile here: {mix['note'].iloc[0]}")
    row = mix.set_index("kernel")
    assert row.loc["after", "griddepcontrol"] >= 1 and row.loc["merge", "griddepcontrol"] >= 1
    assert row.loc["before", "griddepcontrol"] == 0
    if not torch.cuda.is_available():  # no GPU: the merge launches after the split kernel, and says so
        assert not mt.pdl_usable()
        assert mla.plan_after(*_inputs(1, 1, 4, 40, torch.float32)[:3], num_splits=2).pdl is False


def _poison_past_lengths(pool, bt, lengths, page_size):
    """NaN in every pool row past a request's length (its last page's tail) and in unused pages."""
    pool = pool.clone()
    used = set()
    for b, n in enumerate(lengths):
        pages = -(-n // page_size)
        used.update(int(p) for p in bt[b, :pages])
        last = int(bt[b, pages - 1])
        pool[last, n - (pages - 1) * page_size:] = float("nan")
        for p in bt[b, pages:]:
            pool[int(p)] = float("nan")
    for p in range(pool.shape[0]):
        if p not in used:
            pool[p] = float("nan")
    return pool


def test_rows_past_the_length_are_never_read():
    # Rows past a request's length may hold anything (NaN here): a tile that straddles the length
    # must take them out of both products (0 x NaN would poison the value sum), and pages past it
    # must not be touched. 200 = 6 whole tiles of 32 + 8 rows; 75 = 2 tiles + 11 rows.
    lengths = [200, 75]
    q, cache, lens, pool, bt = _inputs(2, 1, 12, 256, torch.float32, lengths=lengths, paged=True,
                                       page_size=64,
                                       seed=23)
    pool = _poison_past_lengths(pool, bt, lengths, 64)
    ref_o, ref_l = mla.reference(q, cache, lens)
    for splits in (1, 3):
        o, lse = mla.plan_after(q, pool, lens, block_table=bt, num_splits=splits, backend="triton")()
        assert torch.isfinite(o).all() and torch.isfinite(lse).all()
        _check(o, lse, ref_o, ref_l, torch.float32, f"poisoned/s{splits}")


def test_backend_table_and_forcing_by_name(monkeypatch):
    """The dispatcher takes the first available backend that takes the inputs; backend= or
    K3LAB_MLA_DECODE_BACKEND forces one by name; an unknown name or an unavailable backend is a clear
    error."""
    assert [b.name for b in sorted(mla.BACKENDS, key=lambda b: b.priority)] == ["cuda", "triton", "aiter",
                                                                                   "torch"]
    for b in mla.BACKENDS:
        ok, why = b.available()
        assert isinstance(ok, bool) and isinstance(why, str) and why
    q, cache, lens, _, _ = _inputs(1, 1, 12, 96, torch.float32, lengths=[96])
    name, why = mla.BACKENDS.choose(None, "after", q, cache, lens)
    assert name == "triton"  # fp32: the CUDA kernels take bf16 only
    if not mla.BACKENDS["cuda"].available()[0]:
        assert "cuda" in why
    assert mla.BACKENDS.choose(None, "after", q, cache, lens, pad="copy")[0] == "triton"
    with pytest.raises(ValueError, match="backend must be one of"):
        mla.plan_after(q, cache, lens, backend="tma")
    monkeypatch.setenv(mla.BACKEND_ENV, "nope")
    with pytest.raises(ValueError, match=mla.BACKEND_ENV):
        mla.plan_after(q, cache, lens)
    monkeypatch.setenv(mla.BACKEND_ENV, "triton")
    assert mla.plan_after(q, cache, lens).backend == "triton"
    assert mla.plan_before(q, cache, lens).backend == "triton"
    monkeypatch.delenv(mla.BACKEND_ENV)
    if not mla.BACKENDS["aiter"].available()[0]:
        with pytest.raises(mla.BackendUnavailable, match="'aiter' cannot run here"):
            mla.plan_after(q, cache, lens, backend="aiter")
    with pytest.raises(ValueError, match="form"):
        mla.plan_after(q, cache, lens, backend="triton", form="wgmma")


@pytest.mark.parametrize("case", ["b2_q3_h4_mixed_paged", "b3_q2_h4_mixed_contig"])
def test_torch_row_is_the_reference_and_matches_the_triton_row(case, monkeypatch):
    """backend='torch' selects the plain-PyTorch row (before and after alike), and it computes what the
    Triton row computes on fresh random fp32 inputs (CPU: the Triton row in the interpreter)."""
    monkeypatch.delenv(mla.BACKEND_ENV, raising=False)
    B, Tq, H, L, lengths, paged = CASES[case]
    q, cache, lens, kv, bt = _inputs(B, Tq, H, L, torch.float32, lengths=lengths, paged=paged, seed=11)
    row = mla.BACKENDS["torch"]
    assert row.plan_before is row.plan_after and row.available()[0]
    assert mla.BACKENDS.choose("torch", "after", q, kv, lens, bt)[0] == "torch"
    ref = mla.plan_after(q, kv, lens, block_table=bt, backend="torch")
    assert ref.backend == "torch"
    assert mla.plan_before(q, kv, lens, block_table=bt, backend="torch").backend == "torch"
    o, lse = (t.clone() for t in ref())
    for variant in ("before", "after"):
        fast = mla.VARIANTS[variant](q, kv, lens, block_table=bt, backend="triton")
        _check(*fast, o, lse, torch.float32, f"torch row vs triton {variant}")
    ref_o, ref_l = mla.reference(q.double(), cache.double(), lens)  # and the fp64 reference
    _check(o, lse, ref_o, ref_l, torch.float32, "torch row vs fp64")
    assert o.dtype == torch.float32 and not torch.equal(o, torch.zeros_like(o))
    with pytest.raises(ValueError, match="form"):
        mla.plan_after(q, kv, lens, block_table=bt, backend="torch", form="wgmma")
    with pytest.raises(ValueError, match="lengths"):  # the kernels' checks, before anything runs
        mla.plan_after(q, kv, torch.full((B,), 10 ** 6, device=DEV), block_table=bt, backend="torch")


def test_after_says_which_backend_runs_and_runs_triton_without_the_cuda_kernel():
    ok, why = mla.BACKENDS.check("cuda", "after")
    if not torch.cuda.is_available():
        assert not ok and "GPU" in why  # on a CPU the Triton kernels run (interpreter), and it says so
        q = torch.randn(1, 1, 12, mla.LATENT_DIM)
        cache = torch.randn(1, 96, mla.LATENT_DIM)
        plan = mla.plan_after(q, cache, torch.tensor([96]))
        assert (
            isinstance(plan, mla.DecodePlan)
            and plan.backend == "triton"
            and plan.facts()["backend"] == "triton"
        )
        with pytest.raises(RuntimeError, match="cannot run here"):
            mla.plan_after(q.bfloat16(), cache.bfloat16(), torch.tensor([96]), backend="cuda")
        with pytest.raises(RuntimeError, match="cannot run here"):  # a CUDA form asks for the CUDA backend
            mla.plan_after(q.bfloat16(), cache.bfloat16(), torch.tensor([96]), form="wgmma")


def test_committed_read_floors_beside_the_decode(tmp_path):
    """The H200 copy / sum of each case's bytes: shares in (0, 1], a copy above a sum-only read at the
    large sizes, the decode's graph share joined from the records; a file that is not one is refused."""
    from k3lab.studies import mla_padding as study

    rf = study.read_floors(bench.load_records(study.NAME, device="nvidia-h200")).set_index("case")
    assert {"ctx1k", "ctx32k", "ctx128k", "b8_8k"} <= set(rf.index)
    assert ((rf[["copy_share", "sum_share"]] > 0) & (rf[["copy_share", "sum_share"]] <= 1.05)).all().all()
    assert (rf.loc[["ctx32k", "ctx128k"], "copy_share"] > rf.loc[["ctx32k", "ctx128k"], "sum_share"]).all()
    assert rf["decode_share"].notna().all()
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": {"ctx1k": {"copy_us": 1.0}}}')
    with pytest.raises(ValueError, match="read-floor"):
        study.read_floors(path=bad)


def test_committed_arithmetic_per_tile(tmp_path):
    # the compute-only build's committed H200 times: the arithmetic of a 64-row tile takes time, but
    # less than the tile's share of DRAM time (else no pipeline could hide it); bad files are refused
    from k3lab.studies import mla_padding as study

    df = study.arithmetic_per_tile()
    row = df.iloc[0]
    assert len(df) == 1 and row["commit"] and row["pieces"] >= 100
    assert 0.2 < row["arithmetic_us_per_tile"] < row["dram_us_per_tile"]
    assert math.isclose(row["dram_us_per_tile"], 64 * 576 * 2 * row["pieces"] / 4.25e12 * 1e6, rel_tol=0.01)
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": {"ctx32k": {"forms": {}}}}')
    with pytest.raises(ValueError, match="wgmma-co-unchecked"):
        study.arithmetic_per_tile(path=bad)


def test_committed_breakdown_orders_readers_and_decodes(tmp_path):
    """The H200 read probe and wgmma run: every step of both cases present with its commit; a plain
    read is faster than the tile ring, an empty second kernel costs something, and the full decodes
    are the slowest steps; a file without the expected rows is refused."""
    from k3lab.studies import mla_padding as study

    df = study.read_breakdown()
    assert set(df["case"]) == {"ctx32k", "ctx128k"} and len(df) == 2 * len(study.BREAKDOWN_STEPS)
    assert (df["commit"] != "").all() and ((df["share"] > 0) & (df["share"] < 1.2)).all()
    label = {key: text for _, key, text in study.BREAKDOWN_STEPS}
    for case, g in df.groupby("case"):
        us = {step: t for step, t in zip(g["step"], g["us"])}
        at = lambda key: us[label[key]]  # noqa: E731
        # loads < ring < ring + a second kernel
        assert at("ldg 528 blocks") < at("ring split 128 (decode path)") < at("ring split 128 +tail")
        assert max(at("wgmma"), at("split")) == max(us.values())  # a full decode is the slowest step
        assert at("wgmma-data-only") < at("wgmma")  # the arithmetic costs time on top of the data path
        # the merge kernel's work costs time too, with or without the arithmetic (the same run)
        assert at("wgmma-dme-data-only") < at("wgmma-me-no-merge") < at("wgmma")
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": {"ctx32k": {"us": 1.0}}}')
    with pytest.raises(ValueError, match="no rows"):
        study.read_breakdown(probe_path=bad)
    with pytest.raises(ValueError, match="merge run"):
        study.read_breakdown(merge_path=bad)
    pytest.importorskip("plotly")  # the figure below; the bare GPU machine has no plotly
    fig = study.breakdown_figure(df)
    assert len(fig.data) == len(study.BREAKDOWN_STEPS)


def test_committed_stage_runs(tmp_path):
    """The committed three-stage runs, as notebook 04 states them: without arithmetic three 64 KB
    stages stream faster than two 72 KB ones at 128K and 64 x 8K (the rope read by registers), yet no
    three-stage decode beats the two-stage after at 32K or 128K; a run without a build is refused."""
    from k3lab.studies import mla_padding as study

    df = study.stage_table()
    assert set(df["run"]) == {label for label, _, _ in study.STAGE_RUNS} and (df["commit"] != "").all()
    us = {(r, c, b): t for r, c, b, t in zip(df["run"], df["case"], df["build"], df["us"])}
    two_d, three_d, two, three = (b for _, b in study.STAGE_BUILDS)
    regs = study.STAGE_RUNS[0][0]
    for case in ("ctx128k", "b64_8k"):
        assert us[regs, case, three_d] < 0.95 * us[regs, case, two_d]
    for run in set(df["run"]):
        for case in ("ctx32k", "ctx128k"):
            assert us[run, case, three] > us[run, case, two]
    bad = tmp_path / "bad.json"
    bad.write_text('{"commit": "x", "rows": {"ctx32k": {"forms": {"wgmma": {"us": 1, "share": 0.5}}}}}')
    with pytest.raises(ValueError, match="wgmma-data-only"):
        study.stage_table(runs=(("bad", str(bad), "k"),))
    pytest.importorskip("plotly")  # the figure below; the bare GPU machine has no plotly
    fig = study.stage_figure(df)
    assert len(fig.data) >= len(study.STAGE_BUILDS)


def test_committed_wave_runs_show_the_second_wave(tmp_path):
    # the H200 runs notebook 04 draws: 64 x 8K with 3 pieces a request (192 blocks, 1.45 waves) and 2 (one
    # wave)
    from k3lab.studies import mla_padding as study

    df = study.wave_table()
    assert set(df["pieces"]) == {2, 3} and set(df["form"]) == {"split", "wgmma", "halves"}
    assert (df["blocks"] == 64 * df["pieces"]).all() and (df["commit"] != "").all()
    for form, g in df.groupby("form"):
        us = dict(zip(g["pieces"], g["us"]))
        assert us[2] < us[3], form  # one wave beats a wave and a half, for every form
    assert (df.loc[df["pieces"] == 2, "waves"] <= 1).all() and (df.loc[df["pieces"] == 3, "waves"] > 1).all()
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": {"ctx32k": {}}}')
    with pytest.raises(ValueError, match="b64_8k"):
        study.wave_table(paths=[bad])
    pytest.importorskip("plotly")  # the figure below; the bare GPU machine has no plotly
    assert len(study.wave_figure(df).data) == 2


def test_committed_probe_runs_read_as_timelines():
    # the H200 timeline-probe runs the notebook draws: every block's phases in order, the merge after
    from k3lab.studies import mla_padding as study

    runs = study.probe_runs()
    assert {"probe_split_3d0e2f8", "probe_team_1a77c32", "probe_wgmma_20255de"} <= set(runs)
    for run in runs.values():
        frames = study.probe_frames(run)
        assert frames
        for label, df in frames.items():
            assert set(df["category"]) == set(study.PROBE_PHASES), label
            assert (df["dur_us"] >= -0.05).all(), label  # the global timer's grain
            loop_end = df.loc[df["category"] == "write piece", "start_us"].max()
            assert df.loc[df["category"] == "merge", "start_us"].min() >= loop_end - 0.05, label


def test_committed_target_bounds(tmp_path):
    """The bounds run (scripts/device_mla_bounds.py), as notebook 04 states it: each missed target's
    needed time recomputed from the run's own times; the 32K bandwidth target is left 0-1.5 us beyond
    the after's data path, while the 5x-einsum and the 1K targets need less time than their data paths
    take; the before's ring kernel beats its direct loads in the same run; a foreign file is refused."""
    from k3lab.studies import mla_padding as study

    df = study.target_bounds().set_index("target")
    run = json.loads((bench.PROFILES / "nvidia-h200" / study.NAME / study.BOUNDS).read_text())
    v32, v1 = (run["rows"][c]["variants"] for c in ("ctx32k", "ctx1k"))
    bw, ein, k1 = df.index  # the order of BOUND_ROWS
    assert df.loc[bw, "needed_us"] == pytest.approx(run["rows"]["ctx32k"]["floor_us"] / 0.70)
    assert df.loc[ein, "needed_us"] == pytest.approx(v32["einsum (PyTorch)"]["us"] / 5)
    assert df.loc[k1, "needed_us"] == pytest.approx(1.15 * v1["after (default)"]["us"])
    assert df.loc[k1, "kernel_us"] == v1["before (default)"]["us"]
    assert list(df["reachable"]) == [True, False, False]
    assert 0 < df.loc[bw, "margin_us"] < 1.5 and (df.loc[[ein, k1], "margin_us"] < 0).all()
    assert (df["kernel_us"] > df["needed_us"]).all()  # all three are missed by the kernels of this run
    for v in (v1, v32):
        assert v["before (default)"]["us"] < v["before, direct loads"]["us"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": {"ctx32k": {"us": 1.0}}}')
    with pytest.raises(ValueError, match="device_mla_bounds"):
        study.target_bounds(path=bad)
    pytest.importorskip("plotly")  # the figure below; the bare GPU machine has no plotly
    assert len(study.bounds_figure(df.reset_index()).data) == 3


def test_committed_h200_traces():
    """The traces notebook 04 reads on a CPU (k3lab profile mla_padding on the H200, 3 steps each): one
    kernel launch per step for the before, a split and a merge kernel for the after and for FlashMLA,
    and the before's kernel the longest by far."""
    from k3lab import profile
    from k3lab.studies import mla_padding as study

    files = study.committed_traces()
    assert set(files) == {"before", "after", "torch", "flashmla"}
    per_step = {}
    for name, path in files.items():
        df = profile.read_trace(path)
        kernels = df[df["kind"] == "kernel"]
        per_step[name] = kernels["dur_us"].sum() / 3
        launches = profile.counts(df, steps=3)["launches"]
        assert launches == {"before": 1, "after": 2, "flashmla": 2}.get(name, launches), (name, launches)
    assert per_step["before"] > 10 * max(v for k, v in per_step.items() if k != "before")
    assert per_step["after"] < per_step["flashmla"] and per_step["after"] < per_step["torch"]


def test_committed_verify_table_steps_in_pairs():
    """The H200 records notebooks 04 and 06 read: the after at 32K for every group of 1 to 8 positions;
    a pair costs under 1.3x one token; an odd group within 3% of the next even one (padded pairs); each
    step of two a real rise; the Triton kernel slower wherever it was recorded."""
    from k3lab.studies import mla_padding as study

    vt = study.verify_table(bench.load_records(study.NAME, device="nvidia-h200")).set_index("q_len")
    assert list(vt.index) == list(range(1, 9)) and vt.loc[1, "per_token_ratio"] == 1.0
    t = vt["after_us"]
    assert t[2] < 1.3 * t[1]
    for odd in (3, 5, 7):
        assert abs(t[odd] - t[odd + 1]) < 0.03 * t[odd + 1]
        assert t[odd] > 1.1 * t[odd - 1]
    triton = vt["triton_us"].dropna()
    assert len(triton) >= 3 and (triton > t[triton.index]).all()
    with pytest.raises(ValueError, match="one-token after"):
        study.verify_table([])
