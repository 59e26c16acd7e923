"""Decode context parallelism on gloo ranks: equal to single-rank attention, every layout and merge.

Every spawned run loops over many cases inside the ranks (one process start per world size); the
parent compares each rank-0 result with the fp64 single-rank reference on the same inputs.
"""

import os

import pytest
import torch
import torch.distributed as dist

from k3lab.config import K3Config
from k3lab.nn.mla import latent_attention
from k3lab.parallel import RankError, dcp, spawn

CAP = 72  # global positions of the test caches
ROOM_S = 180  # a small gloo job's limit: room for a loaded machine; a hang is still caught and named


def _inputs(seed, B, Tq, heads_total, lengths):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, heads_total, 576, generator=g, dtype=torch.float64)
    cache = torch.randn(B, CAP, 576, generator=g, dtype=torch.float64)
    return q, cache, torch.tensor(lengths)


def _cases(N, Tqs, interleaves=(1, 16), merges=dcp.MERGES, local="reference"):
    cases = []
    for i, (Tq, inter, merge) in enumerate((t, i, m) for t in Tqs for i in interleaves for m in merges):
        # a request only Tq long (most ranks hold none of it, and none before its new tokens),
        # one near the capacity and one just past a block of 16
        lengths = [Tq, CAP - i % 5, 17 + Tq]
        cases.append(dict(seed=100 * N + i, B=3, Tq=Tq, H=2, lengths=lengths, interleave=inter, merge=merge,
                          local=local))
    return cases


def _run_cases(rank, N, cases, dtype):
    out = []
    for c in cases:
        q, cache, lengths = _inputs(c["seed"], c["B"], c["Tq"], N * c["H"], c["lengths"])
        local, held = dcp.shard_cache(cache.to(dtype), lengths, N, rank, c["interleave"])
        mine = q[:, :, rank * c["H"]:(rank + 1) * c["H"]].to(dtype)
        o, lse = dcp.dcp_decode(mine, local, held, lengths, interleave=c["interleave"], merge=c["merge"],
                                local=c["local"])
        out.append((o, lse))
    return out


def _check_against_reference(N, cases, results, rel):
    for c, (o, lse) in zip(cases, results):
        q, cache, lengths = _inputs(c["seed"], c["B"], c["Tq"], N * c["H"], c["lengths"])
        ro, rl = latent_attention(q[:, :, :c["H"]], cache, lengths)  # rank 0's heads over everything
        assert not torch.isnan(o).any() and not torch.isnan(lse).any(), c
        err = ((o.double() - ro).abs().max() / ro.abs().max()).item()
        assert err < rel, (c, err)
        assert (lse.double() - rl).abs().max().item() < rel * rl.abs().max().item() + rel, c


@pytest.mark.parametrize("world_size,tqs", [(1, (1, 8)), (2, (1, 2, 5)), (3, (1, 3, 8)), (4, (1, 4, 7)),
                                            (8, (1, 6))])
def test_equals_single_rank_fp32(world_size, tqs):
    cases = _cases(world_size, tqs)
    results = spawn(_run_cases, world_size, cases, torch.float32, backend="gloo", timeout_s=ROOM_S)
    _check_against_reference(world_size, cases, results, rel=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="gloo ranks hold CPU tensors; the op's Triton kernels run on them only in the "
                           "interpreter (TRITON_INTERPRET=1, set by k3lab when there is no GPU)")
@pytest.mark.parametrize("world_size", [2, 3])
def test_local_attention_is_the_ops_after(world_size):
    """The same checks with the MLA op's own after kernel (Triton's interpreter here) on every shard."""
    cases = _cases(world_size, (1, 3), interleaves=(1,) if world_size == 2 else (16,), local="after")
    results = spawn(_run_cases, world_size, cases, torch.float32, backend="gloo", timeout_s=ROOM_S)
    _check_against_reference(world_size, cases, results, rel=1e-5)


def test_bf16_within_bf16_tolerance():
    cases = [dict(seed=7, B=3, Tq=2, H=2, lengths=[2, 70, 19], interleave=1, merge=m, local="reference")
             for m in dcp.MERGES]
    results = spawn(_run_cases, 4, cases, torch.bfloat16, backend="gloo", timeout_s=ROOM_S)
    for o, _ in results:
        assert o.dtype == torch.bfloat16
    _check_against_reference(4, cases, results, rel=2e-2)


# ------------------------------------------------------------------------------ layout and append
def test_owner_counts_and_positions_agree():
    for N, inter in ((1, 1), (3, 1), (4, 16), (8, 3)):
        pos = torch.arange(200)
        own = dcp.owner(pos, N, inter)
        assert dcp.owner(37, N, inter) == int(own[37])
        for n in (0, 1, 15, 16, 17, 199):
            counts = [dcp.owned_count(n, N, r, inter) for r in range(N)]
            assert sum(counts) == n
            assert counts == [int((own[:n] == r).sum()) for r in range(N)]
            assert dcp.owned_count(torch.tensor([n]), N, 0, inter).item() == counts[0]
        for r in range(N):
            g = dcp.global_positions(dcp.owned_count(200, N, r, inter), N, r, inter)
            assert torch.equal(g, pos[own == r])  # in order, contiguous on the rank


def test_shard_cache_holds_the_owned_rows_in_order():
    cache = torch.randn(2, 50, 576)
    lengths = [50, 9]
    for N, inter in ((3, 1), (4, 16)):
        seen = torch.zeros(2, 50, dtype=torch.int64)
        for r in range(N):
            local, held = dcp.shard_cache(cache, lengths, N, r, inter, capacity=64)
            assert local.shape[1] == dcp.owned_count(64, N, r, inter)
            for b in range(2):
                g = dcp.global_positions(int(held[b]), N, r, inter)
                assert torch.equal(local[b, :held[b]], cache[b, g])
                assert not local[b, held[b]:].any()
                seen[b, g] += 1
        assert (seen[0] == 1).all() and (seen[1, :9] == 1).all() and not seen[1, 9:].any()


@pytest.mark.parametrize("inter", [1, 16])
def test_append_goes_to_the_owner(inter):
    N, Tq = 3, 5
    cache = torch.randn(2, 60, 576)
    lengths = torch.tensor([41, 5])
    for r in range(N):
        local, held = dcp.shard_cache(cache, lengths - Tq, N, r, inter, capacity=60)
        before = local.clone()
        rows = torch.stack([cache[b, int(n) - Tq:int(n)] for b, n in enumerate(lengths)])
        local2, held2 = dcp.append(local, held, rows, lengths, N, r, inter)
        want, want_held = dcp.shard_cache(cache, lengths, N, r, inter, capacity=60)
        assert local2 is local and torch.equal(held2, want_held) and torch.equal(local2, want)
        changed = (local2 != before).any(-1).sum().item()
        mine = sum(int(dcp.owner(int(n) - Tq + t, N, inter) == r) for n in lengths for t in range(Tq))
        assert changed == mine  # only the owner of each new position wrote it


def test_append_refuses_stale_lengths_and_full_shards():
    local, held = dcp.shard_cache(torch.randn(1, 8, 576), [6], 2, 0)
    with pytest.raises(ValueError, match=r"local_lengths\[0\] = 3, but rank 0 owns 4"):
        dcp.append(local, held, torch.randn(1, 1, 576), [9], 2, 0)
    with pytest.raises(ValueError, match="local_cache holds 4 rows per request"):
        dcp.append(local, held, torch.randn(1, 4, 576), [10], 2, 0)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, None])
def test_bad_interleave_or_world_size(bad):
    with pytest.raises(ValueError, match="interleave must be a positive integer"):
        dcp.owner(3, 4, bad)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        dcp.shard_cache(torch.randn(1, 4, 576), [4], bad, 0)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        dcp.exchange_bytes(1, 1, 12, bad)
    with pytest.raises(ValueError, match="rank must be an integer in"):
        dcp.shard_cache(torch.randn(1, 4, 576), [4], 2, 2)


# ------------------------------------------------------------------------- refusals across ranks
def _decode_with(rank, N, bad_rank, what):
    q, cache, lengths = _inputs(3, 2, 1, N * 2, [20, 9])
    local, held = dcp.shard_cache(cache.float(), lengths, N, rank, 1)
    mine = q[:, :, :2].float()
    if rank == bad_rank and what == "heads":
        mine = q[:, :, :3].float()
    if rank == bad_rank and what == "local_lengths":
        held = held + 1
    if rank == bad_rank and what == "lengths":
        lengths = lengths.clone()
        lengths[1] = 8
        local, held = dcp.shard_cache(cache.float(), lengths, N, rank, 1)
    if rank == bad_rank and what == "merge":
        return dcp.dcp_decode(mine, local, held, lengths, merge="ring")
    return dcp.dcp_decode(mine, local, held, lengths, local="reference")


@pytest.mark.parametrize("what,message", [
    ("heads",
     r"q's shape \[B, Tq, H, 576\] differs across ranks \(rank 0: \[2, 1, 2, 576\], rank 1: \[2, 1, 3, "
     r"576\]"),
    ("lengths", r"lengths \(the global context lengths\) differs across ranks \(rank 0: \[20, 9\], "
                r"rank 1: \[20, 8\], rank 2: \[20, 9\]\)"),
    ("local_lengths", r"rank 1 of 3 refused its inputs: local_lengths\[0\] = 8, but rank 1 of 3 owns 7"),
    ("merge", r"rank 1 of 3 refused its inputs: merge must be one of"),
])
def test_mismatch_across_ranks_is_one_clear_error(what, message):
    with pytest.raises(RankError, match=message) as info:
        spawn(_decode_with, 3, 1, what, backend="gloo", timeout_s=ROOM_S)
    assert info.value.exc_type == "ValueError"


def _decode_with_a_narrow_query(rank, world_size):  # module level: spawned ranks (CUDA machines) pickle it
    dcp.dcp_decode(torch.randn(1, 1, 2, 64), torch.randn(1, 4, 576), [4], [4])


def test_bad_input_on_a_single_rank_raises_before_any_collective():
    with pytest.raises(RankError, match=r"q must be a tensor \[B, Tq, H, 576\]"):
        spawn(_decode_with_a_narrow_query, 1, backend="gloo", timeout_s=ROOM_S)
    with pytest.raises(RuntimeError, match="needs an initialized process group"):
        dcp.dcp_decode(torch.randn(1, 1, 2, 576), torch.randn(1, 4, 576), [4], [4])


# ----------------------------------------------------------------------------------- byte counts
_COUNTED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
            "all_to_all_single")


def _count_collectives(rank, N, merge, check):
    calls = []
    for name in _COUNTED:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def counted(*args, _fn=fn, _name=name, **kw):
            inp = args[1]
            calls.append((_name, inp.numel() * inp.element_size()))
            return _fn(*args, **kw)

        setattr(dist, name, counted)
    q, cache, lengths = _inputs(5, 2, 3, N * 4, [30, 3])
    local, held = dcp.shard_cache(cache.to(torch.bfloat16), lengths, N, rank)
    dcp.dcp_decode(q[:, :, :4].to(torch.bfloat16), local, held, lengths, merge=merge, local="reference",
                   check=check)
    return calls


@pytest.mark.parametrize("merge", dcp.MERGES)
def test_byte_counts_match_the_formula(merge):
    N = 4
    want = dcp.exchange_bytes(2, 3, 4, N, merge, torch.bfloat16)
    calls = spawn(_count_collectives, N, merge, False, backend="gloo", timeout_s=ROOM_S)
    assert len(calls) == want["calls"] == (3 if merge == "ag_rs" else 2)
    assert [b for _, b in calls] == [c["input_bytes"] for c in want["collectives"]]
    kinds = [next(op for op in ("all_gather", "reduce_scatter", "all_to_all") if n.startswith(op)) for n, _
             in calls]
    assert kinds == [c["op"] for c in want["collectives"]]
    checked = spawn(_count_collectives, N, merge, True, backend="gloo", timeout_s=ROOM_S)
    assert len(checked) == want["calls"] + 1 and checked[0][0].startswith("all_gather")  # the agreement
    assert dcp.exchange_bytes(2, 3, 4, 1, merge)["calls"] == 0


def test_exchange_bytes_at_dcp8():
    ag = dcp.exchange_bytes(1, 1, 12, 8, "ag_rs", torch.bfloat16)
    a2a = dcp.exchange_bytes(1, 1, 12, 8, "a2a", torch.bfloat16)
    assert ag["collectives"][0]["input_bytes"] == 12 * 576 * 2  # this rank's queries
    assert ag["collectives"][2]["input_bytes"] == 96 * 512 * 2  # every head's partial output
    assert a2a["collectives"][1]["input_bytes"] == 96 * 514 * 2  # with the fp32 lse in two bf16 slots
    assert a2a["calls"] == 2 and ag["calls"] == 3


# ---------------------------------------------------------------------------------------- memory
def test_memory_of_the_142k_conversation():
    full = K3Config.full()
    tp8 = dcp.cache_bytes_per_rank(full, 142_000, 1, dtype_bytes=1)
    dcp8 = dcp.cache_bytes_per_rank(full, 142_000, 8, dtype_bytes=1)
    assert round(tp8 / 1e9, 2) == 1.96 and round(dcp8 / 1e6) == 245
    for n in (0, 1, 7, 142_000, 142_001):
        assert dcp.cache_bytes_per_rank(full, n, 8) == full.conversation_bytes_per_gpu(n, dcp=8)
    tiny = K3Config.tiny()
    m = dcp.measure_shard_bytes(tiny, 4000, 8, dtype=torch.float8_e4m3fn)
    assert m["measured"] == m["formula"] > 0 and m["slack"] == 0 and m["agrees"]  # storage bytes: exact


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="measures the allocator on a GPU; CPU runs the formula test")
@pytest.mark.parametrize("preset", ["full", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_measured_allocation_of_the_142k_shard_on_a_gpu(dtype, preset):
    """The allocator hands out the formula's bytes and at most one page more (notebook 01 measures the
    tiny preset, where that page is 2.6% of a 20 MB shard; at K3's sizes it is under 1%)."""
    m = dcp.measure_shard_bytes(K3Config.preset(preset), 142_000, 8, dtype=dtype, device="cuda")
    assert m["slack"] == dcp.ALLOCATOR_PAGE and m["agrees"], m
    if preset == "full":
        assert m["measured"] - m["formula"] <= 0.01 * m["formula"], m


def _decode_forced_to_aiter(rank, world_size):
    os.environ["K3LAB_MLA_DECODE_BACKEND"] = "aiter"
    dcp.dcp_decode(torch.randn(1, 1, 2, 576), torch.randn(1, 4, 576), [4], [4], local="after")


def test_dcp_refuses_a_decode_without_lse():
    with pytest.raises(RankError, match="backend 'aiter' gives none"):
        spawn(_decode_forced_to_aiter, 1, backend="gloo", timeout_s=ROOM_S)
