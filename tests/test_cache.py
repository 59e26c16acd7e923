"""k3lab.cache and k3lab.agentx: state save/restore, resume points, traces, the prefix-cache simulator
and the seed's headline arithmetic."""

import json

import numpy as np
import pytest
import torch

from k3lab import agentx
from k3lab.cache import RequestState, SequenceCheckpoints, restore, resume_point, save
from k3lab.cache import generate as gen
from k3lab.cache import sim, traces
from k3lab.config import K3Config
from k3lab.model import K3Model, init_weights


# ------------------------------------------------------------------ state
@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    model = init_weights(K3Model(K3Config.tiny()), seed=3).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    steps = torch.randint(0, model.config.vocab_size, (2, 4))
    return model, ids, steps


def _decode(model, cache, steps):
    logits = []
    for k in range(steps.shape[1]):
        out, cache = model.decode(steps[:, k:k + 1], cache)
        logits.append(out)
    return torch.cat(logits, 1), cache


def _assert_same_cache(a, b):
    ea, eb = a.entries(), b.entries()
    assert ea.keys() == eb.keys()
    for k in ea:
        assert torch.equal(ea[k], eb[k]), k
    assert a.length == b.length


@torch.no_grad()
def test_restore_then_continue_equals_uninterrupted(tiny):
    model, ids, steps = tiny
    _, cache = model.prefill(ids)
    want_logits, want_cache = _decode(model, cache, steps)
    saved = [save(cache, r, pin=False) for r in range(2)]
    for s in saved:
        assert all(not t.is_pinned() for t in s.tensors())
    del cache
    got_logits, got_cache = _decode(model, restore(saved), steps)
    assert torch.equal(got_logits, want_logits)
    _assert_same_cache(got_cache, want_cache)
    # one request alone, restored into a batch of one, continues as its row of the batch did
    one_logits, _ = _decode(model, restore(saved[1]), steps[1:])
    assert torch.allclose(one_logits, want_logits[1:], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_checkpoints_resume_at_any_saved_position(tiny):
    model, ids, steps = tiny
    ids, steps = ids[:1], steps[:1]
    _, cache = model.prefill(ids)
    ck = SequenceCheckpoints()
    ck.add(cache)
    caches = {cache.length: cache}
    for k in range(steps.shape[1]):
        _, cache = model.decode(steps[:, k:k + 1], cache)
        caches[cache.length] = cache
        if k % 2 == 0:
            ck.add(cache)
    assert ck.positions == [9, 10, 12] and ck.mla_reach == 12
    for p in ck.positions:
        _assert_same_cache(ck.at(p), caches[p])
        rest = steps[:, p - 9:]
        if rest.shape[1]:
            got, _ = _decode(model, ck.at(p), rest)
            want, _ = _decode(model, caches[p], rest)
            assert torch.equal(got, want)
    with pytest.raises(ValueError, match="position must be a checkpoint"):
        ck.at(11)
    n = ck.nbytes()
    assert n["mla_latent"] > 0 and n["kda_state"] == 3 * sum(
        layer.state[0].numel() * 4 for layer in caches[9].layers if hasattr(layer, "state"))


def test_save_restore_refuse_bad_input(tiny):
    model, ids, _ = tiny
    with torch.no_grad():
        _, cache = model.prefill(ids)
    with pytest.raises(ValueError, match="request must be"):
        save(cache, 2)
    with pytest.raises(ValueError, match="cache must be a K3Cache"):
        save({"layers": []})
    a = save(cache, 0, pin=False)
    b = RequestState(a.position + 1, a.kinds, a.layers, a.attn_res_blocks, a.attn_res_partial)
    with pytest.raises(ValueError, match="share one position"):
        restore([a, b])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin=True needs a GPU"):
            save(cache, 0, pin=True)


# ------------------------------------------------------------------ resume points
def test_resume_point_rules():
    # the seed's example: MLA history to 3,072, latest compatible KDA checkpoint at 2,048
    assert resume_point(3072, [1024, 2048], mla_block=1024) == 2048
    # a checkpoint at the end of the last turn needs the MLA tail saved beside it
    assert resume_point(3100, [2048, 3100], mla_block=1024) == 2048
    assert resume_point(3100, [2048, 3100], mla_block=1024, tail_saved=True) == 3100
    assert resume_point(3100, [2048, 3100], mla_block=1024, tail_saved=True, limit=3099) == 2048
    assert resume_point(500, [1024], mla_block=16) == 0
    assert resume_point(0, [], mla_block=16) == 0
    with pytest.raises(ValueError, match="mla_block"):
        resume_point(10, [5], mla_block=0)
    with pytest.raises(ValueError, match=r"kda_checkpoints\[1\]"):
        resume_point(10, [5, -1], mla_block=4)


# ------------------------------------------------------------------ traces
def _trace(tid, reqs, block=64):
    return {"id": tid, "block_size": block, "requests": reqs}


def _req(t, n_in, ids, out=10, **kw):
    return {"t": t, "type": "n", "in": n_in, "out": out, "hash_ids": ids, **kw}


@pytest.mark.parametrize("mutate, match", [
    (lambda r: r.pop("hash_ids"), "request 1: field 'hash_ids' is missing"),
    (lambda r: r.update(type="x"), "request 1: field 'type' must be one of"),
    (lambda r: r.update(hash_ids=[1]), "request 1: field 'hash_ids' must hold ceil"),
    (lambda r: r.update(t=-1.0), "request 1: field 't' must be finite and not before"),
    (lambda r: r.update(out=-3), "request 1: fields 'in' in 1..2147483647 and 'out' in 0..2147483647"),
    (lambda r: r.update(out=10**19), "request 1: fields 'in' in 1..2147483647 and 'out' in 0..2147483647"),
    (lambda r: r.update(think_time="soon"), "request 1: field 'think_time' must be"),
    (lambda r: r.update(think_time=float("inf")), "request 1: field 'think_time' must be finite"),
    (lambda r: r.update(api_time=-1.0), "request 1: field 'api_time' must be finite"),
])
def test_loader_names_the_bad_field(tmp_path, mutate, match):
    good = [_req(0.0, 128, [1, 2]), _req(5.0, 130, [1, 2, 3])]
    mutate(good[1])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([_trace("ok", [_req(0.0, 64, [9])]), _trace("s1", good)]))
    with pytest.raises(traces.TraceError, match=f"trace 's1' {match}"):
        traces.load_traces(path)


def test_loader_rejects_non_json_and_wrong_top_level(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{not json")
    with pytest.raises(traces.TraceError, match="not valid JSON"):
        traces.load_traces(p)
    with pytest.raises(traces.TraceError, match="field 'block_size' is missing"):
        traces.parse_traces({"id": "a", "requests": []})


def test_loader_refuses_token_counts_that_would_wrap():
    """10**19 tokens fit a Python int and JSON but not the workload's int64 columns: refused by name."""
    huge = 10**19
    with pytest.raises(traces.TraceError, match="'block_size' must be in 1..2147483647"):
        traces.parse_traces(_trace("a", [_req(0.0, huge, [1])], block=huge))
    with pytest.raises(traces.TraceError, match="fields 'in' in 1..2147483647"):
        traces.parse_traces(_trace("a", [_req(0.0, 64, [1], out=huge)]))
    ok = traces.to_workload(traces.parse_traces(_trace("a", [_req(0.0, 64, [1], out=2**31 - 1)])))
    assert int(ok.out_tokens[0]) == 2**31 - 1


def test_committed_sample_round_trips():
    from importlib.resources import files
    sample = traces.load_traces(files("k3lab.cache").joinpath("agentx_sample.json"))
    assert len(sample) >= 3 and sum(len(t.requests) for t in sample) >= 30
    again = traces.parse_traces(json.loads(json.dumps(traces.dump_traces(sample))))
    assert [r.hash_ids for t in again for r in t.requests] == [r.hash_ids for t in sample for r in t.requests]
    w = traces.to_workload(sample)
    assert len(w) == sum(len(t.requests) for t in sample) and 0.8 < w.theoretical_reuse() < 1


def test_generator_follows_the_public_figures():
    w = gen.generate(150, seed=7)
    roots = np.unique(w.session[w.kind == 0])
    turns = np.bincount(w.session)[roots]
    assert 36 <= np.median(turns) <= 52
    assert 120_000 <= np.median(w.in_tokens) <= 165_000
    assert 400 <= np.median(w.out_tokens) <= 490
    assert w.theoretical_reuse() > 0.95
    back = traces.to_workload(gen.to_traces(w, limit=5))
    first5 = list(dict.fromkeys(w.session.tolist()))[:5]   # to_traces keeps sessions in order of appearance
    assert len(back) == int(np.isin(w.session, first5).sum())
    with pytest.raises(ValueError, match="sessions must be"):
        gen.generate(0)


# ------------------------------------------------------------------ simulator
def _chain_workload(prompts_by_session, times=None, block=64):
    trs = []
    for s, prompts in enumerate(prompts_by_session):
        reqs = []
        for k, n_in in enumerate(prompts):
            ids = [f"{s}-{i}" for i in range(n_in // block)] + ([f"{s}-tail-{k}"] if n_in % block else [])
            reqs.append(_req(float(times[s][k] if times else 10 * k + s), n_in, ids))
        trs.append(traces.Trace(str(s), block, traces.parse_traces(_trace(str(s), reqs))[0].requests))
    return traces.to_workload(trs)


def _cc(**kw):
    base = dict(hbm_bytes=1e18, mla_bytes_per_block=1.0, kda_checkpoint_bytes=0.0, checkpoint_interval=64)
    return sim.CacheConfig(**{**base, **kw})


def test_unbounded_cache_reaches_the_theoretical_reuse():
    w = _chain_workload([[256, 512, 768], [128, 640]])
    r = sim.simulate(w, _cc())
    assert r.hit_tokens == 256 + 512 + 128
    assert r.token_hit_rate == pytest.approx(w.theoretical_reuse())
    assert r.mla_hit_rate == pytest.approx(w.theoretical_reuse())


def test_zero_budget_gives_no_hits():
    w = _chain_workload([[256, 512, 768]])
    r = sim.simulate(w, _cc(hbm_bytes=0.0))
    assert r.hit_tokens == 0 and r.recomputed_tokens == r.prompt_tokens


def test_checkpoint_grid_and_tail_alignment():
    w = _chain_workload([[3100, 3300]])
    grid = sim.simulate(w, _cc(checkpoint_interval=2048))
    assert grid.mla_hit_tokens == 3072 and grid.hit_tokens == 2048   # the seed's 3,072 / 2,048
    tail = sim.simulate(w, _cc(checkpoint_interval=2048, tail_aligned=True))
    assert tail.hit_tokens == 3100


def test_lru_evicts_the_least_recent_session_deepest_first():
    # HBM holds 10 blocks: A (8 blocks), then B (4) pushes out A's deepest blocks, then A returns
    w = _chain_workload([[512, 576], [256]], times=[[0, 2], [1]])
    r = sim.simulate(w, _cc(hbm_bytes=10.0, low_water=1.0))
    assert r.hit_tokens == 6 * 64       # A's first 6 blocks survived
    host = sim.simulate(w, _cc(hbm_bytes=10.0, host_bytes=100.0, low_water=1.0))
    assert host.hit_tokens == 512 and host.host_hit_tokens == 128 and host.host_restored_bytes == 2.0


def test_resume_aware_policy_keeps_only_blocks_that_can_serve_a_resume():
    # HBM holds 8 blocks, checkpoints every 256 tokens. B stores 4 blocks; A's 447-token prompt has 6
    # full blocks, the last 2 past its only checkpoint. Under LRU they push out B's checkpoint block,
    # so B's next turn recomputes everything; the resume-aware policy never keeps them.
    w = _chain_workload([[256, 320], [447]], times=[[0, 3], [1]])
    lru = sim.simulate(w, _cc(hbm_bytes=8.0, checkpoint_interval=256, low_water=1.0))
    aware = sim.simulate(w, _cc(hbm_bytes=8.0, checkpoint_interval=256, low_water=1.0, policy="resume_aware"))
    assert lru.hit_tokens == 0 and lru.mla_hit_tokens == 128
    assert aware.hit_tokens == 256


def test_equal_time_requests_do_not_depend_on_processing_order():
    w = _chain_workload([[256, 512], [256, 512], [256, 512]], times=[[0, 5], [0, 5], [1, 5]])
    cc = _cc(hbm_bytes=12.0, low_water=1.0)
    r1 = sim.simulate(w, cc)
    perm = np.array([5, 4, 3, 2, 1, 0])
    w2 = traces.Workload(w.t[perm], w.session[perm], w.kind[perm], w.in_tokens[perm], w.out_tokens[perm],
                         w.chain[perm], w.n_full[perm], w.tail[perm], w.chains, w.block_size, w.n_blocks)
    assert sim.simulate(w2, cc).as_dict() == r1.as_dict()


def test_cache_config_from_k3_and_bad_values():
    tp8 = sim.CacheConfig.for_k3(100)
    dcp8 = sim.CacheConfig.for_k3(100, layout="dcp8")
    assert tp8.mla_bytes_per_block == 24 * 576 * 64 == 8 * dcp8.mla_bytes_per_block
    assert tp8.kda_checkpoint_bytes == 69 * 12 * 128 * 128 * 4 + 69 * 3 * 1536 * 3 * 2
    with pytest.raises(ValueError, match="checkpoint_interval must be"):
        _cc(checkpoint_interval=100)
    with pytest.raises(ValueError, match="policy must be one of"):
        _cc(policy="fifo")
    with pytest.raises(ValueError, match="layout must be"):
        sim.CacheConfig.for_k3(1, layout="dcp4")


# ------------------------------------------------------------------ the seed's arithmetic
def test_seed_headline_arithmetic_to_its_digits():
    r = agentx.compare(agentx.SEED["mi355x"], agentx.SEED["b300"])
    assert round(r["tokens_per_dollar_a"] / 1e6, 2) == 18.16
    assert round(r["tokens_per_dollar_b"] / 1e6, 2) == 9.69
    assert round(100 * r["tokens_per_dollar_gain"], 1) == 87.4
    assert round(100 * r["throughput_gain"], 1) == 24.4
    assert round(100 * r["cost_per_token_lower"], 1) == 46.6
    with pytest.raises(ValueError, match="usd_per_gpu_hour must be"):
        agentx.tokens_per_dollar(100, 0)


def test_monotone_interpolation():
    x, y = [10, 30, 50, 100, 150], [12000, 9500, 7000, 4000, 2500]
    assert agentx.interpolate(x, y, x) == pytest.approx(y)
    q = np.linspace(10, 150, 281)
    v = agentx.interpolate(x, y, q)
    assert np.all(np.diff(v) <= 1e-9)                          # monotone data stays monotone
    assert np.all((v <= 12000 + 1e-9) & (v >= 2500 - 1e-9))    # no overshoot
    with pytest.raises(ValueError, match="no extrapolation"):
        agentx.interpolate(x, y, 200)
    with pytest.raises(ValueError, match="strictly increasing"):
        agentx.interpolate([1, 1], [2, 3], 1)
