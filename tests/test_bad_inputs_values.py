"""Nothing silently wrong, for bad values rather than bad shapes, driven with generated inputs that are
often bad:

- non-finite numbers: a NaN or +inf log-sum-exp in a merge, a NaN or infinity in one token's k, v, gate
  or beta of chunked KDA prefill (refused by name); in KDA verification and decode, where nothing is
  read, a NaN or infinity flows only forward: the earlier positions, other heads and other sequences
  equal the reference computed without it;
- lengths, counts and indices: bools, floats, negatives, numpy and 0-d tensor integers and values past
  their range, for the DCP layout and a rank's local attention, the cache's request and checkpoint
  indices, resume points, KDA plans and cu_seqlens, the router's top_k, num_experts and block_m, and
  the serving model's depth and token counts.
Each call either refuses by name (a ValueError naming the argument) or returns what a plain reference
computes. Triton kernels run in the interpreter on a CPU, so shapes stay small."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.cache import resume, state, traces
from k3lab.cache import generate as gen
from k3lab.config import K3Config
from k3lab.model import K3Cache
from k3lab.nn.kda import KDACache, kda_recurrent
from k3lab.nn.mla import MLACache
from k3lab.nn.moe import route
from k3lab.ops import kda_chunk as kc
from k3lab.ops import kda_decode as kd
from k3lab.ops import kda_verify as kv
from k3lab.ops import mla_decode as mla
from k3lab.ops import moe_router as mr
from k3lab.ops.kda_chunk.inputs import validate as chunk_validate
from k3lab.ops.mla_decode.merge import lse_weights, merge_partials
from k3lab.ops.moe_experts.inputs import TILE_HEIGHTS, sort_by_expert
from k3lab.parallel import dcp
from k3lab.serving import curve, stepmodel
from refusals import as_int, examples, int_like, refused

from hypothesis import event, given  # noqa: E402  (refusals skips the module without hypothesis)
from hypothesis import strategies as st  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = K3Config.tiny()
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def _close(got, ref, name, rtol=1e-5, atol=1e-5):
    """got against ref where both may hold -inf (an empty piece): equal infinities, close elsewhere."""
    torch.testing.assert_close(got.double().cpu(), ref.double().cpu(), rtol=rtol, atol=atol, msg=name)


# ================================================================== non-finite values
# ------------------------------------------------------------------ the merge's log-sum-exp
LSE_VALUES = st.sampled_from([0.0, -1.5, 2.0, 30.0, -math.inf, -math.inf])  # -inf: an empty piece


@examples(40)
@given(n=st.integers(1, 3), rows=st.sampled_from([(2,), (2, 3)]), D=st.sampled_from([8, 130]),
       data=st.data(), poison=st.sampled_from([None, None, math.nan, math.inf]), at=st.integers(0, 17),
       backend=st.sampled_from(["torch", "triton", "weights"]))
def test_merge_refuses_a_nan_or_plus_inf_lse_and_merges_minus_inf_as_empty(n, rows, D, data, poison, at,
                                                                             backend):
    shape = (n, *rows)
    flat = data.draw(st.lists(LSE_VALUES, min_size=math.prod(shape), max_size=math.prod(shape)))
    if poison is not None:
        flat[at % len(flat)] = poison
    lse = torch.tensor(flat, dtype=torch.float32, device=DEV).view(shape)
    o = torch.randn(*shape, D, generator=torch.Generator().manual_seed(n)).to(DEV)
    bad = any(math.isnan(x) or x == math.inf for x in flat)
    try:
        out = lse_weights(lse) if backend == "weights" else merge_partials(o, lse, backend)
    except ValueError as exc:
        assert bad, f"refused finite / -inf lse {flat}: {exc}"
        refused(exc, "lse_parts holds NaN or +inf")
        return
    assert not bad, f"{backend} took lse {flat} holding NaN or +inf"
    l64 = lse.double().cpu()
    total = torch.logsumexp(l64, dim=0)  # -inf where every piece is empty
    w = torch.where(torch.isfinite(total), torch.exp(l64 - total), torch.zeros_like(l64))
    if backend == "weights":
        _close(out[0], w, "weights")
        _close(out[1], total, "lse")
    else:
        _close(out[0], (w[..., None] * o.double().cpu()).sum(0), "o", rtol=1e-4, atol=1e-4)
        _close(out[1], total, "lse")
    event("merged, equal to the reference")


# ------------------------------------------------------------------ KDA: chunked prefill refuses
def _kda_inputs(B, T, H, V, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, 128, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    gate = -torch.rand(B, T, H, 128, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    return {name: t.to(device=DEV, dtype=dtype if name in "qkv" else torch.float32)
            for name, t in zip(("q", "k", "v", "g", "beta"), (q, k, v, gate, beta))}


def _poison(x: dict, where: str, value: float, b: int, t: int, h: int, c: int) -> dict:
    """A copy of the inputs with one value of `where` at (b, t, h[, c]) replaced."""
    x = dict(x)
    x[where] = x[where].clone()
    x[where][(b, t, h) if where == "beta" else (b, t, h, c)] = value
    return x


@examples(16)
@given(T=st.integers(1, 40), H=st.sampled_from([1, 2]),
       where=st.sampled_from([None, "q", "k", "v", "g", "beta", "k", "g", "beta"]), value=NON_FINITE,
       at=st.tuples(st.integers(0, 39), st.integers(0, 1), st.integers(0, 127)),
       variant=st.sampled_from(["before", "after"]))
def test_kda_chunk_refuses_non_finite_keys_values_gates_and_betas(T, H, where, value, at, variant):
    """A NaN or infinity in one token's k, v, g or beta would reach the earlier tokens of its chunk: refused
    by name. In q it stays in that token's output: every other output and the final state are exact."""
    t, h, c = at[0] % T, at[1] % H, at[2]
    clean = _kda_inputs(1, T, H, 128, seed=T)
    x = clean if where is None else _poison(clean, where, value, 0, t, h, c)
    try:
        o, S = kc.kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], variant=variant)
    except ValueError as exc:
        assert where in ("k", "v", "g", "beta"), f"refused {where}: {exc}"
        refused(exc, f"{where} holds NaN or an infinity")
        return
    assert where in (None, "q"), f"took a non-finite {where}"
    ref_o, ref_S = kda_recurrent(*(clean[n].double() for n in ("q", "k", "v", "g", "beta")))
    keep = torch.ones(1, T, H, dtype=torch.bool, device=DEV)
    if where == "q":
        keep[0, t, h] = False  # its own output: NaN or inf, as the recurrence gives
    bench.check(o[keep], ref_o[keep], dtype="fp32", name="o")
    bench.check(S, ref_S, dtype="fp32", name="final state")
    event("computed; a non-finite q stays in its token" if where else "computed, equal to the reference")


def test_kda_chunk_value_check_is_exact_where_a_sum_overflows():
    """Finite values whose fp32 sum overflows are not refused (the check looks again, value by value)."""
    x = _kda_inputs(1, 4, 1, 128, seed=0)
    x["v"][0, :2, 0, :4] = 3e38  # their sum is +inf in fp32; every value is finite
    lengths, H, _ = chunk_validate(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert lengths == [4] and H == 1
    x["v"][0, 3, 0, 7] = math.inf
    with pytest.raises(ValueError, match=r"v holds NaN or an infinity \(first at index \[0, 3, 0, 7\]\)"):
        chunk_validate(x["q"], x["k"], x["v"], x["g"], x["beta"])
    # check_values=False (a caller's own inputs, a study's timing) reads nothing and refuses nothing
    assert chunk_validate(x["q"], x["k"], x["v"], x["g"], x["beta"], check_values=False)[0] == [4]
    lse = torch.tensor([[0.0], [math.inf]], device=DEV)
    with pytest.raises(ValueError, match="lse_parts holds NaN or \\+inf"):
        merge_partials(torch.ones(2, 1, 8, device=DEV), lse)
    o, _ = merge_partials(torch.ones(2, 1, 8, device=DEV), lse, check_values=False)
    assert torch.isnan(o).all()  # what the check is there to prevent


# ------------------------------------------------------------------ KDA: verification lets NaN flow forward
VERIFY_V = 128 if DEV == "cuda" else 32  # the CUDA kernel takes V = 128 (it runs where it can)


@examples(14)
@given(B=st.integers(1, 2), T=st.integers(1, 4), H=st.sampled_from([1, 2]),
       where=st.sampled_from(["q", "k", "v", "g", "beta"]), value=NON_FINITE,
       at=st.tuples(st.integers(0, 1), st.integers(0, 3), st.integers(0, 1), st.integers(0, 31)),
       before=st.booleans())
def test_kda_verify_keeps_a_non_finite_input_to_its_position_and_later(B, T, H, where, value, at, before):
    """Nothing is read (the decode path): the recurrence carries a NaN or infinity forward only, so every
    earlier position, every other head and every other sequence equals the reference without it."""
    b, t, h, c = at[0] % B, at[1] % T, at[2] % H, at[3]
    clean = _kda_inputs(B, T, H, VERIFY_V, seed=10 * B + T)
    x = _poison(clean, where, value, b, t, h, c)
    fn = kv.kda_verify_before if before else kv.kda_verify
    o, states = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], None)
    ref_o, ref_s = kv.reference_verify(*(clean[n] for n in ("q", "k", "v", "g", "beta")), None)
    keep = torch.ones(B, T, H, dtype=torch.bool, device=DEV)
    keep[b, t:, h] = False  # the poisoned position and the ones after it, of that sequence and head
    bench.check(o[keep], ref_o[keep], dtype="fp32", name="o (earlier positions, other heads and sequences)")
    bench.check(states[keep], ref_s[keep], dtype="fp32", name="states (the same)")
    event(f"{where}: flowed forward only")


# ------------------------------------------------------------------ KDA: decode keeps it in its sequence
DECODE_BACKENDS = ["torch", "triton"] + (["cuda"] if DEV == "cuda" and kd.fused_status()[0] else [])


@examples(14)
@given(where=st.sampled_from(list(kd.TOKEN_INPUTS)), value=NON_FINITE, b=st.integers(0, 1),
       col=st.integers(0, 2 * 128 - 1), backend=st.sampled_from(DECODE_BACKENDS))
def test_kda_decode_keeps_a_non_finite_input_to_its_sequence_and_head(where, value, b, col, backend):
    dtype = torch.bfloat16 if backend == "cuda" else torch.float32
    inputs, cache, w = kd.make_example(2, 2, dtype=dtype, device=DEV, seed=4)
    ref_out, ref = kd.reference(**inputs, cache=cache, weights=w, compute_dtype=torch.float64)
    col = col % 2 if where == "beta_raw" else col
    head = col if where == "beta_raw" else col // 128
    inputs[where] = inputs[where].clone()
    inputs[where][b, col] = value
    out = kd.kda_decode(**inputs, cache=cache, weights=w, backend=backend)
    other = 1 - b
    tol = "bf16" if dtype == torch.bfloat16 else "fp32"
    bench.check(out[other], ref_out[other], dtype=tol, name="out of the other sequence")
    bench.check(cache.state[other], ref.state[other], dtype=tol, name="state of the other sequence")
    h2 = 1 - head
    bench.check(out[b, h2 * 128:(h2 + 1) * 128], ref_out[b, h2 * 128:(h2 + 1) * 128], dtype=tol,
                name="out of the other head")
    bench.check(cache.state[b, h2], ref.state[b, h2], dtype=tol, name="state of the other head")
    event(f"{backend}: stayed in its sequence and head")


# ================================================================== lengths, counts and indices
# ------------------------------------------------------------------ the DCP layout
def _owner(p, world, inter):
    return (p // inter) % world


@examples(80)
@given(x=int_like(0, 40), world=st.sampled_from([1, 2, 4]), r=st.integers(0, 3),
       inter=st.sampled_from([1, 3]),
       which=st.sampled_from(["owner", "owned_count", "global_positions", "empty_shard", "cache_bytes"]))
def test_dcp_layout_takes_whole_non_negative_positions(x, world, r, inter, which):
    rank = r % world
    want = as_int(x)
    if isinstance(x, torch.Tensor) and x.dim() == 1 and which in ("owner", "owned_count"):
        want = int(x[0])  # a tensor of positions is the vector form of these two
    calls = {"owner": lambda: dcp.owner(x, world, inter),
             "owned_count": lambda: dcp.owned_count(x, world, rank, inter),
             "global_positions": lambda: dcp.global_positions(x, world, rank, inter),
             "empty_shard": lambda: dcp.empty_shard(1, x, world, rank, inter, dtype=torch.float32),
             "cache_bytes": lambda: dcp.cache_bytes_per_rank(TINY, x, world, rank=rank, interleave=inter)}
    arg = {"owner": "position", "owned_count": "n", "global_positions": "count", "empty_shard": "capacity",
           "cache_bytes": "tokens"}[which]
    try:
        got = calls[which]()
    except ValueError as exc:
        assert want is None, f"{which} refused {x!r}: {exc}"
        refused(exc, f"{arg} must be")
        return
    assert want is not None, f"{which} took {x!r}"
    mine = [p for p in range(4 * 40 + 8) if _owner(p, world, inter) == rank]
    if which == "owner":
        assert int(torch.as_tensor(got).reshape(-1)[0]) == _owner(want, world, inter)
    elif which == "owned_count":
        assert int(torch.as_tensor(got).reshape(-1)[0]) == sum(p < want for p in mine)
    elif which == "global_positions":
        assert got.tolist() == mine[:want]
    elif which == "empty_shard":
        assert got.shape == (1, sum(p < want for p in mine), dcp.LATENT_DIM)
    else:
        assert got >= 0
    event("computed, equal to the brute-force layout")


def _local_reference(q, local_cache, held, lens, world, rank, inter, scale):
    """Attention of each token over the rank's rows it sees, by brute force in fp64."""
    B, Tq, HH, _ = q.shape
    o = torch.zeros(B, Tq, HH, dcp.VALUE_DIM, dtype=torch.float64)
    lse = torch.full((B, Tq, HH), -math.inf, dtype=torch.float64)
    pos = dcp.global_positions(max(held, default=0), world, rank, inter).tolist()
    for b in range(B):
        for t in range(Tq):
            seen = [j for j in range(held[b]) if pos[j] <= lens[b] - Tq + t]
            if not seen:
                continue
            rows = local_cache[b, seen].double().cpu()
            s = q[b, t].double().cpu() @ rows.T * scale  # [HH, J]
            lse[b, t] = torch.logsumexp(s, -1)
            o[b, t] = torch.softmax(s, -1) @ rows[:, :dcp.VALUE_DIM]
    return o, lse


@examples(40)
@given(B=st.integers(1, 2), Tq=st.integers(1, 3), world=st.sampled_from([2, 4]), r=st.integers(0, 3),
       inter=st.sampled_from([1, 2]), lens=st.lists(st.integers(1, 24), min_size=2, max_size=2),
       shift=st.sampled_from([0, 0, 0, 1, -1, 5]), rows=st.sampled_from([0, 0, -1, 3]),
       kind=st.sampled_from(["int", "int", "int", "float", "bool"]))
def test_dcp_local_attention_takes_only_the_local_lengths_its_shard_holds(B, Tq, world, r, inter, lens, shift,
                                                                          rows, kind):
    """local_lengths past the shard's rows, or other than the layout gives this rank, or lengths as floats
    or bools: refused by name before anything runs. Otherwise: the brute-force attention over its rows."""
    rank, lens = r % world, lens[:B]
    held = [dcp.owned_count(n, world, rank, inter) for n in lens]
    held[0] += shift
    C = max(dcp.owned_count(max(lens), world, rank, inter) + rows, 1)
    g = torch.Generator().manual_seed(B * 100 + sum(lens))
    q = torch.randn(B, Tq, 2, dcp.LATENT_DIM, generator=g).to(DEV)
    local_cache = torch.randn(B, C, dcp.LATENT_DIM, generator=g).to(DEV)
    passed = {"int": lens, "float": [float(n) for n in lens], "bool": [n > 0 for n in lens]}[kind]
    ok = (kind == "int" and min(lens) >= Tq and min(held) >= 0 and
          held == [dcp.owned_count(n, world, rank, inter) for n in lens] and max(held) <= C)
    try:
        o, lse = dcp.local_attention(q, local_cache, held, passed, world, rank, inter, local="reference")
    except ValueError as exc:
        assert not ok, f"refused good inputs: {exc}"
        refused(exc, "lengths", "local_lengths", "local_cache holds")
        return
    assert ok, f"took lengths {passed}, local_lengths {held} with {C} rows"
    ref_o, ref_lse = _local_reference(q, local_cache, held, lens, world, rank, inter, dcp.DEFAULT_SCALE)
    _close(lse, ref_lse, "lse", rtol=1e-4, atol=1e-4)
    _close(o, ref_o, "o", rtol=1e-4, atol=1e-4)
    event("computed, equal to the brute-force attention")


MIXED_BOOLS = [([True, 12], 0), ([12, False], 1), ([np.True_, 12], 0), ([12.0, 12], 0)]


def test_dcp_lengths_refuse_a_bool_or_float_inside_a_list():
    """A bool inside a list of ints ([True, 12]: torch.as_tensor reads it as [1, 12]) or a float entry is
    refused by name and entry for every DCP call that takes per-request lengths, before anything runs;
    the same lists with ints in their place are taken."""
    world, rank = 4, 0
    cache = torch.randn(2, 24, dcp.LATENT_DIM, device=DEV)
    for bad, at in MIXED_BOOLS:
        with pytest.raises(ValueError, match=rf"lengths\[{at}\] must be an integer"):
            dcp.shard_cache(cache, bad, world, rank)
    lens = [16, 12]
    loc, held_t = dcp.shard_cache(cache, lens, world, rank)
    held = held_t.tolist()
    q = torch.randn(2, 1, 2, dcp.LATENT_DIM, device=DEV)
    good = dcp.local_attention(q, loc, held, lens, world, rank, local="reference")
    new_rows = torch.randn(2, 1, dcp.LATENT_DIM, device=DEV)
    for bad, at in MIXED_BOOLS:
        as_lens = [bad[i] if i == at else lens[i] for i in range(2)]
        as_held = [bad[i] if i == at else held[i] for i in range(2)]
        for name, call in (
                ("lengths", lambda: dcp.local_attention(q, loc, held, as_lens, world, rank,
                                                        local="reference")),
                ("local_lengths", lambda: dcp.local_attention(q, loc, as_held, lens, world, rank,
                                                              local="reference")),
                ("lengths", lambda: dcp.append(loc.clone(), held, new_rows, as_lens, world, rank)),
                ("local_lengths", lambda: dcp.append(loc.clone(), as_held, new_rows, lens, world, rank))):
            with pytest.raises(ValueError, match=rf"^{name}\[{at}\] must be an integer"):
                call()
    for kind in (np.array, torch.tensor):  # the same values as ints: taken, equal to the list's result
        again = dcp.local_attention(q, loc, kind(held), kind(lens), world, rank, local="reference")
        for a, b in zip(good, again, strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ the cache
def _k3cache(B=3, L=5, hidden=16):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    layers = [MLACache(r(B, L, 576)), KDACache(r(B, 8, 3), r(B, 8, 3), r(B, 8, 3), r(B, 2, 4, 4))]
    return K3Cache(layers, r(2, B, hidden), r(B, hidden), L)


CACHE = _k3cache()
WORKLOAD = gen.generate(2, duration_s=100.0, median_turns=3, seed=1)


@examples(40)
@given(request=int_like(0, 2), position=int_like(0, 9))
def test_save_and_restore_take_request_indices_and_positions_as_ints(request, position):
    want = as_int(request, 0, 2)
    try:
        saved = state.save(CACHE, request, pin=False)
    except ValueError as exc:
        assert want is None, f"refused request {request!r}: {exc}"
        refused(exc, "request must be")
        return
    assert want is not None, f"took request {request!r}"
    assert torch.equal(saved.layers[0]["latent"], CACHE.layers[0].latent[want])
    assert torch.equal(saved.layers[1]["state"], CACHE.layers[1].state[want])
    pos = as_int(position)
    latent = saved.layers[0]["latent"][:pos] if pos is not None else saved.layers[0]["latent"]
    moved = state.RequestState(position, saved.kinds, [{"latent": latent}, saved.layers[1]],
                               saved.attn_res_blocks, saved.attn_res_partial)
    try:
        back = state.restore(moved)
    except ValueError as exc:
        assert pos is None or pos > CACHE.length, f"refused position {position!r}: {exc}"
        refused(exc, "position")
        return
    assert pos is not None and pos <= CACHE.length
    assert back.length == pos and back.layers[0].latent.shape[1] == pos
    event("saved and restored")


@examples(40)
@given(i=int_like(0, len(WORKLOAD) - 1))
def test_a_workload_takes_request_indices_as_ints_in_range(i):
    want = as_int(i, 0, len(WORKLOAD) - 1)
    try:
        ids = WORKLOAD.block_ids(i)
    except ValueError as exc:
        assert want is None, f"refused {i!r}: {exc}"
        refused(exc, "i must be")
        return
    assert want is not None, f"took {i!r}"
    full = WORKLOAD.chains[WORKLOAD.chain[want]][:WORKLOAD.n_full[want]].tolist()
    tail = [int(WORKLOAD.tail[want])] if WORKLOAD.tail[want] >= 0 else []
    assert ids.tolist() == full + tail
    event("the request's blocks")


def test_a_checkpoint_position_is_an_int_not_a_bool():
    ck = state.SequenceCheckpoints(pin=False)
    ck._kda[1] = ck._kda[0] = None  # the lookup alone: True == 1 and hash(True) == hash(1) in a dict
    for bad in (True, False, 1.0):
        with pytest.raises(ValueError, match="position must be a checkpoint"):
            ck.at(bad)
    with pytest.raises(ValueError, match="request must be"):
        state.SequenceCheckpoints(request=True, pin=False).add(CACHE)
    with pytest.raises(traces.TraceError, match="offsets must be finite"):
        traces.to_workload(gen.to_traces(WORKLOAD, limit=1), offsets=[math.nan])


def _mostly_good(low, high):
    """A valid int three times in four, else any of int_like's values (one_of alone would weigh its
    flattened branches evenly: mostly bad ones)."""
    return st.tuples(st.integers(0, 3), st.integers(low, high), int_like(low, high)).map(
        lambda c: c[1] if c[0] else c[2])


@examples(40)
@given(reach=_mostly_good(0, 300), ckpts=st.lists(_mostly_good(0, 300), max_size=3),
       block=_mostly_good(1, 64), limit=st.one_of(st.none(), _mostly_good(0, 300)))
def test_resume_points_take_positions_as_ints(reach, ckpts, block, limit):
    wants = [as_int(reach), *map(as_int, ckpts), as_int(block, 1), None if limit is None else as_int(limit)]
    good = all(w is not None for w in wants[:-1]) and (limit is None or wants[-1] is not None)
    try:
        got = resume.resume_point(reach, ckpts, mla_block=block, limit=limit)
    except ValueError as exc:
        assert not good, f"refused good arguments: {exc}"
        refused(exc, "mla_reach", "kda_checkpoints", "mla_block", "limit")
        return
    assert good, f"took {reach!r}, {ckpts!r}, {block!r}, {limit!r}"
    r, *cs, b, lim = wants
    stored = (r // b) * b if lim is None else min((r // b) * b, lim)
    assert got == max([c for c in cs if 0 < c <= stored], default=0)
    event("computed, equal to the brute-force rule")


# ------------------------------------------------------------------ KDA plans and packed lengths
@examples(40)
@given(lengths=st.lists(int_like(0, 300), min_size=1, max_size=3), heads=int_like(1, 12),
       fn=st.sampled_from(["make_plan", "choose_group_size"]))
def test_kda_plan_lengths_are_ints_never_truncated(lengths, heads, fn):
    wants = [as_int(n) for n in lengths]
    good = all(w is not None for w in wants) and as_int(heads, 1) is not None
    try:
        if fn == "make_plan":
            got = kc.make_plan(lengths, heads).lengths
            expect = wants
        else:
            got = kc.choose_group_size(lengths, heads, compute_units=132)
            expect = kc.choose_group_size(wants, as_int(heads, 1), compute_units=132) if good else None
    except ValueError as exc:
        assert not good, f"{fn} refused {lengths!r}, heads {heads!r}: {exc}"
        refused(exc, "lengths", "heads")
        return
    assert good, f"{fn} took {lengths!r}, heads {heads!r}"
    assert got == expect
    event(f"{fn}: taken as ints")


def _as_given(v: int, how: str):
    return {"int": v, "numpy": np.int64(v), "tensor": torch.tensor(v), "float": float(v),
            "half": v + 0.5, "bool": bool(v), "negative": -v - 1}[how]


@examples(30)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=3), at=st.integers(0, 3),
       how=st.sampled_from(["int", "numpy", "tensor", "float", "half", "bool", "negative"]),
       as_tensor=st.sampled_from([None, torch.int32, torch.float32, torch.bool]))
def test_kda_cu_seqlens_are_ints_never_truncated(lengths, at, how, as_tensor):
    """cu_seqlens with one offset given as a float, a bool or a negative number, or as a float or bool tensor:
    refused by name by the op itself, before any kernel; integer offsets of any kind are read exactly."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    i = at % len(cu)
    given_cu = list(cu)
    given_cu[i] = _as_given(cu[i], how)
    if as_tensor is not None:
        given_cu = torch.tensor(cu, device=DEV).to(as_tensor)
    good = how in ("int", "numpy", "tensor") if as_tensor is None else as_tensor == torch.int32
    T = max(cu[-1], 1)
    x = _kda_inputs(1, T, 1, 128, seed=T)
    try:
        if not good:  # the op refuses on its own, before any kernel
            kc.kda_chunk(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=given_cu)
        got = chunk_validate(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=given_cu)[0]
    except ValueError as exc:
        assert not good or cu[-1] == 0, f"refused {given_cu!r}: {exc}"
        refused(exc, "cu_seqlens")
        return
    assert good, f"took cu_seqlens {given_cu!r}"
    assert got == lengths
    event("taken as ints")


# ------------------------------------------------------------------ the router and the expert sort
@examples(40)
@given(top_k=int_like(1, 8), num_experts=st.one_of(st.none(), int_like(8, 8)),
       block_m=st.sampled_from([16, 32, 64, 16.0, True, 8, np.int64(16)]),
       fn=st.sampled_from(["route_and_sort", "route_sort", "topk_weights", "sort_by_expert", "route"]))
def test_router_counts_are_ints(top_k, num_experts, block_m, fn):
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(3)).to(DEV)
    k, E = as_int(top_k, 1, 8), None if num_experts is None else as_int(num_experts, 8, 8)
    m_ok = type(block_m) is int and block_m in TILE_HEIGHTS
    e_ok = num_experts is None or E is not None
    good = {"route_and_sort": k is not None and e_ok and m_ok, "route_sort": k is not None and m_ok,
            "topk_weights": k is not None, "sort_by_expert": e_ok and m_ok, "route": k is not None}[fn]
    try:
        if fn == "route_and_sort":
            w, idx, _ = mr.route_and_sort(logits, None, top_k, num_experts=num_experts, block_m=block_m,
                                          backend="torch")
        elif fn == "route_sort":
            w, idx, _ = mr.route_sort(logits, None, top_k, 1.0, True, block_m)
        elif fn == "topk_weights":
            w, idx = mr.topk_weights(logits, None, top_k, 1.0, True)
        elif fn == "route":  # the reference itself (a bool top_k once reached torch.topk's own message)
            w, idx, _ = route(logits, None, top_k)
        else:
            idx = torch.arange(2 * 2, device=DEV).view(2, 2) % 8
            sort = sort_by_expert(idx, 8 if num_experts is None else num_experts, block_m)
    except ValueError as exc:
        assert not good, f"{fn} refused top_k={top_k!r}, num_experts={num_experts!r}, block_m={block_m!r}"
        refused(exc, "top_k", "num_experts", "block_m")
        return
    assert good, f"{fn} took top_k={top_k!r}, num_experts={num_experts!r}, block_m={block_m!r}"
    if fn == "sort_by_expert":
        assert int(sort.counts.sum()) == 4
        return
    ref_w, ref_idx, _ = route(logits.double().cpu(), None, k)
    assert torch.equal(idx.cpu().sort(-1).values, ref_idx.sort(-1).values)
    bench.check(w.double().cpu().sort(-1).values, ref_w.sort(-1).values, dtype="fp32", name="weights")
    event(f"{fn}: computed, equal to the reference")


def test_a_non_finite_router_scaling_or_a_non_bool_renormalize_is_refused():
    logits = torch.randn(2, 8, device=DEV)
    for bad in (math.nan, math.inf, -math.inf):
        for call in (lambda: mr.route_and_sort(logits, None, 2, scaling=bad, block_m=16),
                     lambda: mr.route_sort(logits, None, 2, bad, True, 16),
                     lambda: mr.topk_weights(logits, None, 2, bad, True),
                     lambda: route(logits, None, 2, bad)):
            with pytest.raises(ValueError, match="scaling must be a real number, finite"):
                call()
    for bad in (True, np.True_, 2.0, torch.tensor(True)):  # once torch.topk's own message for a bool
        with pytest.raises(ValueError, match="top_k must be an integer"):
            route(logits, None, bad)
    for bad in ("no", 0, None):  # the reference refuses what the op refuses, not read as truthy
        with pytest.raises(ValueError, match="renormalize must be a bool"):
            route(logits, None, 2, 1.0, bad)


# ------------------------------------------------------------------ the serving model
@examples(40)
@given(depth=int_like(0, curve.MAX_DEPTH), tokens=int_like(1, 300))
def test_serving_depths_and_token_counts_are_ints(depth, tokens):
    d = as_int(depth, 0, curve.MAX_DEPTH)
    try:
        got = curve.committed(depth)
    except ValueError as exc:
        assert d is None, f"refused depth {depth!r}: {exc}"
        refused(exc, "depth must be")
    else:
        assert d is not None, f"took depth {depth!r}"
        assert got == curve._committed_all(1.0)[d]
    n = as_int(tokens, 1)
    try:
        waves = stepmodel.waves(tokens, 12, 132)
    except ValueError as exc:
        assert n is None, f"refused tokens {tokens!r}: {exc}"
        refused(exc, "tokens must be")
        return
    assert n is not None and waves == -(-n * 12 // 132)


def test_mla_lengths_and_page_sizes_are_ints():
    """Float or bool lengths, alone or inside a list of ints (torch.as_tensor reads [True, 12] as [1, 12]),
    are refused by name, not truncated (MLA decode reads them as positions); so are page sizes and
    lengths of the paged-cache helpers."""
    q = torch.randn(2, 1, 2, mla.LATENT_DIM, device=DEV)
    cache = torch.randn(2, 16, mla.LATENT_DIM, device=DEV)
    for bad in ([7.9, 12], [True, 12], [12, False], [np.True_, 12], torch.tensor([7.5, 2.0], device=DEV),
                torch.tensor([True, True], device=DEV), [12]):
        for fn in (mla.mla_decode_after, mla.mla_decode_before):
            with pytest.raises(ValueError, match=r"lengths(\[\d\])? must be"):
                fn(q, cache, bad)
    cache = cache[:1]
    for bad in (True, 16.0, 0):
        with pytest.raises(ValueError, match="page_size must be"):
            mla.to_paged(cache, bad)
    pool, table = mla.to_paged(cache, 8)
    assert torch.equal(mla.gather_paged(pool, table, 16), cache)
    for bad in (True, 7.5, -1, 17):
        with pytest.raises(ValueError, match="length must be"):
            mla.gather_paged(pool, table, bad)
