"""The measured serving run's parts on a CPU (tiny preset, fp32): the prefill step against K3Model and
against the decode step run one token at a time (logits, KDA state, MLA rows), the slot decode step
against K3Model at ragged lengths, chunk attention against the reference, the prefix pool's store /
evict-to-host / restore (bytes identical), the workload's tokens, a whole run's accounting, and a whole
run's every token's logits against K3Model over the full sequence (chunked prefill, resumes from the
pool, host-tier restores and continuous batching included). Bad inputs by name."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import k3lab  # noqa: F401  (sets TRITON_INTERPRET=1 without a GPU)
from k3lab import bench
from k3lab.config import K3Config
from k3lab.engine import RankWeights
from k3lab.engine.prefill import Chunk, PrefillStep, SlotCaches, SlotDecodeStep, chunk_attention
from k3lab.model import K3Model, init_weights
from k3lab.nn.mla import latent_attention
from k3lab.serving.pool import PrefixPool
from k3lab.serving.run import CPU_SWITCHES, CacheBudget, Engine, RunSettings
from k3lab.serving.workload import Scale, Sessions, agentx_sessions, scale_workload, token_ids
from k3lab.cache.generate import generate

from cpu_child import on_a_cpu

# Steps on CPU tensors (and the study's CPU form): on a GPU machine these run in a child that sees no GPU
# (tests/cpu_child.py), where k3lab turns Triton's interpreter on.
CPU = on_a_cpu
TINY = K3Config.tiny()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """A shared 2-core machine: torch's CPU thread pool spins under load (index_add_ took 0.1 s a call
    with 2 threads and a load of 10); one thread keeps these tests' runs to seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return init_weights(K3Model(TINY), 3).eval()


@pytest.fixture(scope="module")
def weights(model):
    return RankWeights.from_model(model)


def _ids(n, seed):
    return torch.randint(0, TINY.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def _check_entries(got: dict, cache, batch_index: int, where: str):
    for name, t in got.items():
        i, field = int(name.split(".")[1]), name.split(".")[2]
        bench.check(t, getattr(cache.layers[i], field)[batch_index], dtype="fp32", name=f"{where} {name}")


# ------------------------------------------------------------------------------------------ prefill
@CPU
@pytest.mark.parametrize("scan", ["recurrent", "chunked"])
def test_prefill_packed_chunks_match_the_model(model, weights, scan):
    """Two sequences, each in two chunks of uneven length, packed two per call (the second call in the
    other order): each chunk's last logits, the staging KDA states and the MLA rows equal K3Model's."""
    a, b = _ids(150, 1), _ids(90, 2)
    with torch.no_grad():
        ref_a, cache_a = model(a)
        ref_b, cache_b = model(b)
        sc = SlotCaches(TINY, 4, 200, staging=2, device="cpu", dtype=torch.float32)
        pf = PrefillStep(sc, weights, max_tokens=160, optimizations=CPU_SWITCHES, kda_scan=scan)
        l1 = pf([Chunk(1, 0, 0, a[0, :70]), Chunk(2, 1, 0, b[0, :40])])
        l2 = pf([Chunk(2, 1, 40, b[0, 40:]), Chunk(1, 0, 70, a[0, 70:])])
    for got, ref, name in ((l1[0], ref_a[0, 69], "a@69"), (l1[1], ref_b[0, 39], "b@39"),
                           (l2[1], ref_a[0, 149], "a@149"), (l2[0], ref_b[0, 89], "b@89")):
        bench.check(got, ref, dtype="fp32", name=name)
    _check_entries(sc.stage_entries(0), cache_a, 0, "a")
    _check_entries(sc.stage_entries(1), cache_b, 0, "b")
    for i in sc.mla_layers:
        bench.check(sc.latent[i][1, :150], cache_a.layers[i].latent[0], dtype="fp32", name=f"a latent {i}")
        bench.check(sc.latent[i][2, :90], cache_b.layers[i].latent[0], dtype="fp32", name=f"b latent {i}")


@CPU
def test_prefill_ops_scan_in_the_interpreter(model, weights):
    """kda_scan='ops' (k3lab.ops.kda_chunk, cu_seqlens over two packed sequences) from a cached start,
    in Triton's interpreter, against the model."""
    p, t = _ids(60, 3), _ids(70, 4)
    with torch.no_grad():
        _, cache = model(p)
        ref, ref_cache = model(t, cache)
        sc = SlotCaches(TINY, 2, 160, staging=2, device="cpu", dtype=torch.float32)
        sc.load(cache, 0, slot=1, stage=1)
        pf = PrefillStep(sc, weights, max_tokens=80, optimizations=CPU_SWITCHES, kda_scan="ops")
        sc.reset_stage(0)
        out = pf([Chunk(1, 1, 60, t[0]), Chunk(0, 0, 0, p[0, :9])])
    bench.check(out[0], ref[0, -1], dtype="fp32", name="logits")
    _check_entries(sc.stage_entries(1), ref_cache, 0, "ops")


@CPU
def test_prefill_equals_the_decode_step_one_token_at_a_time(model, weights):
    """From the same cached state at position 37: a 12-token chunk through the prefill step and the same
    tokens through the slot decode step one at a time give the same last logits, KDA state and rows."""
    p, t = _ids(37, 5), _ids(12, 6)
    with torch.no_grad():
        _, cache = model(p)
        sc = SlotCaches(TINY, 2, 64, staging=1, device="cpu", dtype=torch.float32)
        sc.load(cache, 0, slot=0, stage=0)
        sc.load(cache, 0, slot=1)
        logits = PrefillStep(sc, weights, max_tokens=16, optimizations=CPU_SWITCHES)([Chunk(0, 0, 37, t[0])])
        dec = SlotDecodeStep(sc, 2, weights, optimizations=CPU_SWITCHES)
        for k in range(12):
            sc.set_decode({1: 37 + k})
            out = dec(torch.stack([t[0, k], t[0, k]])[:, None])
    bench.check(logits[0], out[1, 0], dtype="fp32", name="last logits")
    for i, n in sc.kda_index.items():
        bench.check(sc.stage_state[0, n], sc.kda[i].state[1], dtype="fp32", name=f"state {i}")
    for i in sc.mla_layers:
        bench.check(sc.latent[i][0, :49], sc.latent[i][1, :49], dtype="fp32", name=f"rows {i}")


def _slot_decode(model, weights, seqs: dict, nxt, slots: int, **kw):
    """Sequences `seqs` (slot -> ids [1, n]) prefilled by the model and loaded into their slots, then one
    slot decode step of `nxt` [slots]: (its logits, the slot caches, slot -> the model's (logits, cache))."""
    with torch.no_grad():
        sc = SlotCaches(TINY, slots, 48, device="cpu", dtype=torch.float32)
        refs = {}
        for s, ids in seqs.items():
            _, cache = model(ids)
            sc.load(cache, 0, slot=s)
            refs[s] = model(nxt[s:s + 1, None], cache)
        dec = SlotDecodeStep(sc, slots, weights, **kw)
        assert sc.lengths.tolist() == [1] * slots  # the plans were bound for full slots, then reset
        sc.set_decode({s: ids.shape[1] for s, ids in seqs.items()})
        return dec(nxt[:, None]), sc, refs


@CPU
def test_slot_decode_matches_the_model_at_ragged_lengths(model, weights):
    """Three sequences of 40, 9 and 25 positions in slots 0, 2, 3 of a batch of 4 (slot 1 free): one step
    writes each new row at its own position and equals the model's decode of each."""
    seqs = {0: _ids(40, 7), 2: _ids(9, 8), 3: _ids(25, 9)}
    out, sc, refs = _slot_decode(model, weights, seqs, _ids(4, 10)[0], 4, optimizations=CPU_SWITCHES)
    for s, (ref, ref_cache) in refs.items():
        n = seqs[s].shape[1]
        bench.check(out[s, 0], ref[0, 0], dtype="fp32", name=f"slot {s} logits")
        for i in sc.mla_layers:
            bench.check(sc.latent[i][s, :n + 1], ref_cache.layers[i].latent[0], dtype="fp32",
                        name=f"rows {s}")


@CPU
def test_slot_decode_with_the_mla_decode_kernel(model, weights):
    """The GPU's MLA path in Triton's interpreter: the padded split-history plan, bound once for full
    slots, reads the shared lengths at run time (here 30 and 11 of 47 rows) after the scatter of the
    new rows, and equals the model."""
    out, _, refs = _slot_decode(model, weights, {0: _ids(30, 12), 1: _ids(11, 13)}, _ids(2, 14)[0], 2,
                                optimizations={**CPU_SWITCHES, "mla_padded": True}, mla_decode="ops")
    for s, (ref, _) in refs.items():
        bench.check(out[s, 0], ref[0, 0], dtype="fp32", name=f"slot {s}")


def test_chunk_attention_against_the_reference():
    """fp64: a chunk of 5 queries at positions 11..15 over 16 rows equals latent_attention's verification
    rule; with key_stride 4 it equals attention over every 4th row (the DCP share), masked by position."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(5, 3, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(16, 576, generator=g, dtype=torch.float64)
    got = chunk_attention(q, kv, 11, scale=0.07)
    ref, _ = latent_attention(q[None], kv[None], torch.tensor([16]), scale=0.07)
    bench.check(got, ref[0], dtype="fp64", name="chunk")
    share = kv[::4]
    got4 = chunk_attention(q, share, 11, scale=0.07, key_stride=4)
    for t in range(5):
        n = (11 + t) // 4 + 1  # rows at positions 0, 4, 8, 12 <= 11 + t
        want, _ = latent_attention(q[None, t:t + 1], share[None, :n], torch.tensor([n]), scale=0.07)
        bench.check(got4[t], want[0, 0], dtype="fp64", name=f"stride 4 query {t}")
    with pytest.raises(ValueError, match="last query sees"):
        chunk_attention(q, kv[:10], 11, scale=0.07)


# ------------------------------------------------------------------------------------------ pool
def _random_slots(seed=0):
    sc = SlotCaches(TINY, 3, 400, staging=2, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    for t in list(sc.latent.values()) + [sc.stage_state, sc.stage_conv]:
        t.copy_(torch.randn(t.shape, generator=g))
    return sc


def test_pool_store_evict_to_host_and_restore_keep_the_bytes():
    """A prompt of 200 positions (3 full blocks + a tail) stored with a grid checkpoint at 128 and its
    end checkpoint; the device tier then squeezed by a reservation so every block goes to the host; a
    lookup of the next turn finds the end checkpoint and restores rows and KDA state bit for bit into
    another slot and staging entry, bringing the pages back (timed, counted)."""
    sc = _random_slots()
    pool = PrefixPool(sc, 40 * 295 * 1024, 40 * 295 * 1024, checkpoint_interval=128)
    ids = np.array([5, 6, 7, 8])
    state_128 = sc.stage_state[0].clone()
    pool.store(ids, 0, 2, stage=0, checkpoint=(128, None))
    sc.stage_state[0].add_(1.0)  # the state moves on to the prompt's end
    pool.store(ids[:3], 0, 3, stage=0, checkpoint=(200, 8))
    assert pool.stats.stored_blocks == 3 and pool.stats.stored_checkpoints == 2
    assert pool.reserve(pool.pages["gpu"] * pool.page_bytes)  # running sequences take the whole device tier
    assert pool.used_pages("gpu") == 0 and pool.stats.to_host_blocks == 3
    pool.reserve(0)
    hit = pool.lookup(ids, 260)
    assert (hit.blocks, hit.resume, hit.ckpt_block, hit.host_blocks) == (4 - 1, 200, 2, 3)
    resume, host_s = pool.restore(hit, 2, 1)
    assert resume == 200 and host_s > 0 and pool.stats.restored_host_bytes > 0
    for i in sc.mla_layers:
        assert torch.equal(sc.latent[i][2, :200], sc.latent[i][0, :200])
    assert torch.equal(sc.stage_state[1], sc.stage_state[0])
    assert torch.equal(sc.stage_conv[1], sc.stage_conv[0])
    # another prompt that does not continue block 8 resumes at the grid checkpoint instead
    other = pool.lookup(np.array([5, 6, 7, 99]), 260)
    assert other.resume == 128
    resume, _ = pool.restore(other, 1, 1)
    assert resume == 128 and torch.equal(sc.stage_state[1], state_128)
    assert pool.stats.hit_tokens == 328 and pool.stats.lookups == 2


def test_pool_lru_goes_deepest_first_and_drops_without_a_host_tier():
    """No host tier: the least recently used prompt's blocks are dropped, deepest first, so its first
    blocks stay findable; a full miss resumes at 0 with a zeroed staging state."""
    sc = _random_slots(1)
    page = 2 * 64 * 576 * 4
    pool = PrefixPool(sc, 12 * page, 0, checkpoint_interval=0)
    pool.store(np.arange(10, 16), 0, 6)          # an old prompt of 6 blocks
    pool.store(np.arange(20, 24), 1, 4)          # a newer one of 4
    pool.store(np.arange(30, 34), 2, 4)          # 4 more: 2 of the old prompt's go, its last two
    assert pool.stats.dropped_blocks == 2
    assert [b in pool.blocks for b in range(10, 16)] == [True] * 4 + [False] * 2
    miss = pool.lookup(np.array([40, 41]), 130)
    assert miss.resume == 0 and pool.restore(miss, 0, 0) == (0, 0.0)
    assert not sc.stage_state[0].any()


def test_pool_bad_inputs():
    sc = _random_slots()
    with pytest.raises(ValueError, match="gpu_bytes"):
        PrefixPool(sc, 1000)
    with pytest.raises(ValueError, match="checkpoint_interval"):
        PrefixPool(sc, 1e8, checkpoint_interval=100)
    with pytest.raises(ValueError, match="slots must be a SlotCaches"):
        PrefixPool("slots", 1e8)


# ------------------------------------------------------------------------------------------ workload
def test_scaled_workload_keeps_prefixes_and_tokens():
    """Scaled prompts still extend the previous turn's; a subagent's first blocks are its parent's; the
    tokens of a turn's prompt begin with the previous turn's prompt and output tokens."""
    full = generate(6, seed=2, median_turns=4)
    w = scale_workload(full, Scale(context=1 / 64, output=1 / 8))
    assert (w.in_tokens <= np.maximum(1, np.round(full.in_tokens / 64)) + 0).all()
    by_session = {}
    for i in np.argsort(w.t, kind="stable"):
        by_session.setdefault(int(w.session[i]), []).append(int(i))
    checked = 0
    for reqs in by_session.values():
        for a, b in zip(reqs, reqs[1:]):
            assert w.in_tokens[b] >= w.in_tokens[a] and w.chain[a] == w.chain[b]
            n = int(w.in_tokens[a] + w.out_tokens[a])
            if w.in_tokens[b] >= n:
                assert (token_ids(w, a, 0, n, 512) == token_ids(w, b, 0, n, 512)).all()
                checked += 1
    assert checked > 3
    subs = [i for i in range(len(w)) if w.kind[i] == 2]
    assert subs, "the generator gives subagents"
    with pytest.raises(ValueError, match="scale.context"):
        Scale(context=2.0)


# ------------------------------------------------------------------------------------------ whole runs
def _sessions(seed=2, sessions=2, turns=4):
    w = agentx_sessions(sessions, scale=Scale(context=1 / 512, output=1 / 64, time=1 / 8), seed=seed,
                        median_turns=turns)
    return Sessions.of(w, think_scale=1 / 8, seed=seed)


def _engine(weights, sessions, gpu_mb, host_mb, slots=3):
    return Engine(weights, slots=slots, rows=sessions.max_len() + 2,
                  cache=CacheBudget(gpu_mb * 1e6, host_mb * 1e6, "test budget"), staging=2,
                  max_batched_tokens=96, log=lambda *a: None)


# A fixed clock (seconds per iteration, per decoding sequence, per prefill token) so that the schedule,
# and with it which blocks are evicted and restored, does not depend on this machine's load.
COST = (0.01, 0.002, 0.0005)
SETTINGS = {"concurrency": 3, "checkpoint_interval": 128, "max_batched_tokens": 96, "step_cost": COST}


# One engine and one logged run, built on first use and shared by the tests below (in the CPU child on a
# GPU machine, where the marked tests run).
_BUILT: dict[tuple[str, int], tuple] = {}


def _engine_for(weights):
    key = ("engine", id(weights))
    if key not in _BUILT:
        ss = _sessions()
        _BUILT[key] = ss, _engine(weights, ss, 6.0, 3.0)
    return _BUILT[key]


def _logged_run(weights):
    """One run whose cache binds (evictions to the host tier, restores from it), every token's logits kept."""
    key = ("run", id(weights))
    if key not in _BUILT:
        ss, eng = _engine_for(weights)
        with torch.no_grad():
            _BUILT[key] = ss, eng.run(ss, RunSettings(record_logits=True, **SETTINGS))
    return _BUILT[key]


@CPU
def test_run_accounting(weights):
    """Every request completes; tokens are conserved (each request's outputs, the prompt tokens computed
    = prompt - resumed, prefill tokens run = computed); 0 < TTFT <= E2E; ITLs are outputs - 1; the cache
    bound (evictions to the host tier, restores from it) and hits happened."""
    ss, res = _logged_run(weights)
    w = ss.workload
    s = res.summary()
    assert res.incomplete == 0 and res.not_started == 0
    assert s["requests"] == len(w) == len(res.requests)
    assert sorted(r["request"] for r in res.requests) == list(range(len(w)))
    for r in res.requests:
        assert r["finished"] and r["tokens"] == r["out"] == int(w.out_tokens[r["request"]])
        assert 0 < r["ttft"] <= r["e2e"] and len(r["itl"]) == r["out"] - 1
        assert r["n_in"] == int(w.in_tokens[r["request"]]) and 0 <= r["resume"] < r["n_in"]
    assert s["output_tokens"] == int(w.out_tokens.sum()) and s["prompt_tokens"] == int(w.in_tokens.sum())
    assert s["prefill_tokens"] == s["computed_prompt_tokens"] == s["prompt_tokens"] - res.pool["hit_tokens"]
    assert sum(row["decode_seqs"] for row in res.iterations) == sum(r["out"] - 1 for r in res.requests)
    assert res.pool["hit_tokens"] > 0 and res.pool["to_host_blocks"] > 0
    assert res.pool["restored_host_bytes"] > 0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
    assert s["output_tokens_per_s_gpu"] > 0 and s["total_tokens_per_s_gpu"] > s["output_tokens_per_s_gpu"]
    # the pool's stores are timed apart inside the prefill calls: a part of each, and there whenever a
    # prompt finished (every request's did)
    for row in res.iterations:
        assert 0.0 <= row["store_s"] <= row["prefill_s"]
        assert (row["store_s"] > 0) <= (row["prefill_tokens"] > 0)
    assert 0 < s["prefill_store_s"] <= s["prefill_s"]
    assert s["prefill_store_s"] == pytest.approx(sum(row["store_s"] for row in res.iterations))


@CPU
def test_run_every_token_matches_the_model(model, weights):
    """Each request's logits (its first token from the prefill that ended its prompt, the rest from
    decode steps beside other sequences) equal K3Model over the whole sequence from scratch: resumes at
    checkpoints, host-tier restores, chunk boundaries and continuous batching change nothing."""
    ss, res = _logged_run(weights)
    w = ss.workload
    for r in res.requests:
        i, n_in, out = r["request"], r["n_in"], r["out"]
        ids = torch.from_numpy(token_ids(w, i, 0, n_in + out - 1, TINY.vocab_size))[None]
        with torch.no_grad():
            ref, _ = model(ids)
        got = torch.stack(r["logits"])
        bench.check(got, ref[0, n_in - 1:], dtype="fp32", name=f"request {i} (resumed at {r['resume']})")
    assert any(r["resume"] for r in res.requests)


@CPU
def test_dcp8_and_the_host_tier_where_capacity_binds(weights):
    """The same sessions and budget without the host tier: DCP1 loses hits to dropped blocks; the host
    tier (the logged run) and DCP8 (an eighth of the history rows per rank) each win them back."""
    ss, eng = _engine_for(weights)
    rates = {"dcp1_host": _logged_run(weights)[1].pool["hit_rate"]}
    with torch.no_grad():
        for name, kw in (("dcp1_gpu", {"host": False}), ("dcp8_gpu", {"host": False, "dcp": 8})):
            res = eng.run(ss, RunSettings(**SETTINGS, **kw))
            assert res.incomplete == 0 and res.describe["dcp"] == kw.get("dcp", 1)
            rates[name] = res.pool["hit_rate"]
            if name == "dcp1_gpu":
                assert res.pool["dropped_blocks"] > 0 and res.pool["to_host_blocks"] == 0
    assert rates["dcp1_host"] > rates["dcp1_gpu"] and rates["dcp8_gpu"] > rates["dcp1_gpu"], rates


@CPU
def test_a_measured_run(weights):
    """The measured clock: a short run of three requests at concurrency 1 completes with positive,
    ordered times."""
    ss = _sessions()
    eng = _engine(weights, ss, 6.0, 0.0, slots=1)
    with torch.no_grad():
        res = eng.run(ss, RunSettings(concurrency=1, max_requests=3, checkpoint_interval=128,
                                      max_batched_tokens=96))
    s = res.summary()
    assert s["requests"] == 3 and res.incomplete == 0 and res.describe["clock"].startswith("measured")
    for r in res.requests:
        assert 0 < r["ttft"] <= r["e2e"] and all(x > 0 for x in r["itl"])
    assert s["decode_step_ms"]["1"] > 0 and s["prefill_tokens_per_s"] > 0


# ------------------------------------------------------------------------------------------ bad inputs
@CPU
def test_bad_inputs_by_name(weights):
    with pytest.raises(ValueError, match="concurrency"):
        RunSettings(concurrency=0)
    with pytest.raises(ValueError, match="max_requests"):
        RunSettings(concurrency=1, max_requests=0)
    with pytest.raises(ValueError, match="gpu_bytes"):
        CacheBudget(0)
    sc = SlotCaches(TINY, 2, 40, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="batch"):
        SlotDecodeStep(sc, 3, weights, optimizations=CPU_SWITCHES)
    with pytest.raises(ValueError, match="q_len"):
        SlotDecodeStep(sc, 1, weights, optimizations=CPU_SWITCHES, q_len=2)
    other = dataclasses.replace(TINY, num_hidden_layers=4, name="tiny4")
    with pytest.raises(ValueError, match="weights must be a RankWeights"):
        PrefillStep(SlotCaches(other, 2, 40, device="cpu", dtype=torch.float32), weights)
    pf = PrefillStep(sc, weights, max_tokens=16, optimizations=CPU_SWITCHES)
    ok = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="max_tokens"):
        pf([Chunk(0, 0, 0, torch.zeros(17, dtype=torch.long))])
    with pytest.raises(ValueError, match="slots hold"):
        pf([Chunk(0, 0, 38, ok)])
    with pytest.raises(ValueError, match="distinct"):
        pf([Chunk(0, 0, 0, ok), Chunk(0, 0, 4, ok)])
    with pytest.raises(ValueError, match="vocab_size"):
        pf([Chunk(0, 0, 0, ok + TINY.vocab_size)])
    with pytest.raises(ValueError, match="kda_scan"):
        PrefillStep(sc, weights, kda_scan="fast")
    with pytest.raises(ValueError, match="positions: slot"):
        sc.set_decode({0: 39})
    ss = _sessions()
    eng = _engine(weights, ss, 4.5, 0, slots=2)
    with pytest.raises(ValueError, match="exceeds the engine's 2 slots"):
        eng.run(ss, RunSettings(concurrency=3))
    with pytest.raises(ValueError, match="sessions must be"):
        eng.run(ss.workload, RunSettings(concurrency=1))


# ------------------------------------------------------------------------------------------ the study
@CPU
def test_study_records_on_a_cpu(tmp_path):
    """The study's CPU form through its CLI: one record per case, written after each run, with TPOT
    percentiles as the timing, the summary's percentiles and rates, what ran and the budget's source."""
    from k3lab.studies import serving_run

    assert set(serving_run.case_names()) == set(serving_run.CPU_CASES)
    out = tmp_path / "records.json"
    assert serving_run.main(["--cases", "c2.dcp1.host", "c2.dcp8.gpu_only", "--json", str(out),
                             "--save-dir", str(tmp_path / "profiles")]) == 0
    recs = [bench.Record.from_dict(d) for d in __import__("json").loads(out.read_text())]
    assert [r.case for r in recs] == ["c2.dcp1.host", "c2.dcp8.gpu_only"]
    for r in recs:
        s = r.extra["summary"]
        assert r.study == "serving_run" and r.mode == "cpu" and r.p20_us <= r.median_us <= r.p80_us
        assert s["requests"] == 8 and s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
        assert s["output_tokens_per_s_gpu"] > 0 and "stand_in" in r.extra["describe"]["collectives"]
        assert "scaled-down budget" in r.extra["describe"]["cache_budget"]["source"]
        assert len(r.extra["requests"]) == 8 and r.shape["dcp"] == int(r.case.split(".")[1][3:])
    assert len(list((tmp_path / "profiles").rglob("*.json"))) == 2
    back = serving_run.measured(root=tmp_path / "profiles", device="cpu")
    assert [r.case for r in back] == ["c2.dcp1.host", "c2.dcp8.gpu_only"]  # DCP1 first
    assert serving_run.measured(root=tmp_path / "nothing") == []
    with pytest.raises(ValueError, match="case must look like"):
        serving_run.parse_case("c8.dcp1")
    with pytest.raises(ValueError, match="form"):
        serving_run.run(form="fast")


def test_study_budget_is_the_article_rank_scaled():
    """The GPU budget: one MI355X rank's HBM left after K3's weights at the served precision (59.9 GB)
    and the recipe's 224.875 GB host tier, both x the context scale."""
    from k3lab.serving import hardware, node
    from k3lab.studies import serving_run

    b = serving_run.budget(1 / 16)
    assert b.gpu_bytes == pytest.approx(node.free_gb(hardware.gpu("mi355x")) * 1e9 / 16)
    assert b.host_bytes == pytest.approx(224.875e9 / 16) and "MI355X" in b.source


@CPU
def test_study_budget_rows_and_the_model_beside_each_run():
    """A budget that no run fits still measures the first run and starts no other; curve_rows reads the
    summary (the decode step at the batch nearest the run's mean, TPOT P90 over it); the model's costs
    are timed on the run's engine and its prediction is stored beside the run (extra['model']), which the
    notebook reads when it has no costs of its own; the thread count comes back."""
    from k3lab.studies import serving_run
    from k3lab.studies.serving_run import tables

    threads, lines = torch.get_num_threads(), []
    recs, costs = serving_run.run_with_costs(cases=["c1.dcp1.host", "c2.dcp1.host"], budget_s=1e-3,
                                             log=lines.append)
    assert [r.case for r in recs] == ["c1.dcp1.host"] and torch.get_num_threads() == threads
    assert any("stopping before c2.dcp1.host" in ln for ln in lines), lines
    assert any("over the budget" in ln for ln in lines), lines
    (row,) = serving_run.curve_rows(recs)
    s = recs[0].extra["summary"]
    assert row["tpot_p90_ms"] == s["tpot_ms"]["p90"] and row["ttft_p50_ms"] == s["ttft_ms"]["p50"]
    assert row["step_ms"] == s["decode_step_ms"][str(row["step_batch"])]
    assert row["tpot_p90_over_step"] == pytest.approx(row["tpot_p90_ms"] / row["step_ms"])
    assert row["total_tok_s_gpu"] > row["output_tok_s_gpu"] > 0 and 0 <= row["prefill_iterations"] <= 1
    assert tables._step_at({"1": 5.0, "2": 7.0, "4": 9.0}, 3.0) == (4, 9.0)  # a tie: the larger
    assert tables._step_at({"1": 5.0, "2": 7.0, "4": 9.0}, 1.2) == (1, 5.0)
    table = serving_run.report_table(recs)
    assert list(table.columns)[:len(serving_run.REPORT_COLUMNS)] == list(serving_run.REPORT_COLUMNS.values())
    assert len(table) == 1 and table["TPOT P50 (%)"][0] == pytest.approx(
        100 * recs[0].extra["model"]["tpot_p50_ms err"])
    assert "timed alone" in costs.source and costs.decode_us(1, 1, 16.0) > 0
    model = recs[0].extra["model"]  # the model beside the run, stored with it
    assert model["costs"] == costs.source and model["case"] == "c1.dcp1.host"
    assert model["tpot_p50_ms measured"] == pytest.approx(s["tpot_ms"]["p50"])
    assert model["tpot_p50_ms err"] == pytest.approx(model["tpot_p50_ms predicted"] / s["tpot_ms"]["p50"] - 1)
    assert serving_run.model_rows(recs) == ([model], costs.source)  # no costs given: the stored rows
    rows, source = serving_run.model_rows(recs, costs)  # costs given: checked again with them
    assert source == costs.source and rows[0]["tpot_p50_ms predicted"] == pytest.approx(
        model["tpot_p50_ms predicted"])
    other = dataclasses.replace(recs[0], study="serving")
    with pytest.raises(ValueError, match="records must be 'serving_run' records"):
        serving_run.curve_rows([other])
    with pytest.raises(ValueError, match="concurrency must be a positive int"):
        serving_run.engine_costs(0)
