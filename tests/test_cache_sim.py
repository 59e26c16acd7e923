"""k3lab.cache.sim against a plain per-block reference simulator written from its docstring, on small
random workloads with shared prefixes, equal-time requests, both policies, host tiers and tight
budgets; order independence; the resume-aware policy's rules on hand-made traces."""

import dataclasses

import numpy as np
import pytest

from k3lab.cache import generate as gen
from k3lab.cache import sim, traces

_HBM, _HOST = 1, 2


def _reference(w: traces.Workload, cc: sim.CacheConfig) -> dict:
    """The simulator's rules, one block at a time with dicts (slow, plain)."""
    b, step = cc.block_size, cc.checkpoint_interval // cc.block_size
    tier, key, ckpt = {}, {}, {}
    ends = {}
    tot = dict(hit=0, mla=0, host_hit=0, host_bytes=0.0, evictions=0)

    def size(x):
        return cc.mla_bytes_per_block + (cc.kda_checkpoint_bytes if x in ckpt else 0.0)

    def used(t):
        return sum(size(x) for x, v in tier.items() if v == t)

    def checkpoints(n_in, n_full):
        out = {j: (j + 1) * b for j in range(step - 1, n_full, step)} if step else {}
        if n_full and (n_in % b == 0 or cc.tail_aligned):
            out[n_full - 1] = n_in
        return out

    def evict(t, budget, down):
        if used(t) <= budget + 1e-6:
            return
        need, got, last_key = used(t) - cc.low_water * budget, 0.0, None
        for x in sorted((x for x, v in tier.items() if v == t), key=lambda x: key[x]):
            if got >= need and key[x] != last_key:
                break
            got += size(x)
            last_key = key[x]
            tot["evictions"] += 1
            if down:
                tier[x] = down
            else:
                del tier[x]
                ckpt.pop(x, None)

    times = sorted(set(w.t.tolist()))
    for stamp, now in enumerate(times, 1):
        group = [i for i in range(len(w)) if w.t[i] == now]
        stores = []
        for i in group:
            ids = [int(x) for x in w.chains[w.chain[i]][: w.n_full[i]]]
            n_in = int(w.in_tokens[i])
            h = next((d for d, x in enumerate(ids) if x not in tier), len(ids))
            cands = [ckpt[x] for x in ids[:h] if x in ckpt and 0 < ckpt[x] <= n_in - 1]
            resume = max(cands, default=0)
            tot["mla"] += min(h * b, n_in)
            tot["hit"] += resume
            if resume:
                j = max(d for d, x in enumerate(ids[:h]) if ckpt.get(x) == resume)
                used_ids = ids[: -(-resume // b)]
                n_host = sum(tier.get(x) == _HOST for x in used_ids)
                tot["host_bytes"] += n_host * cc.mla_bytes_per_block + (
                    cc.kda_checkpoint_bytes if tier[ids[j]] == _HOST else 0.0)
                tot["host_hit"] += min(resume, n_host * b)
            cks = checkpoints(n_in, len(ids))
            keep = len(ids) if cc.policy == "lru" else (max(cks) + 1 if cks else 0)
            stores.append((i, ids, cks, keep, n_in))
        touched = {}
        for i, ids, cks, keep, n_in in stores:
            s = int(w.session[i])
            if cc.policy == "resume_aware" and cks and cks[max(cks)] == n_in:
                prev, d_end = ends.get(s), max(cks)
                if prev is not None and prev[1] < d_end and prev[1] < len(ids) and ids[prev[1]] == prev[0]:
                    d = prev[1]
                    if prev[0] in ckpt:
                        if step and (d + 1) % step == 0:
                            ckpt[prev[0]] = (d + 1) * b
                        else:
                            del ckpt[prev[0]]
                ends[s] = (ids[d_end], d_end)
            for d, x in enumerate(ids[:keep]):
                tier[x] = _HBM
                touched[x] = max(touched.get(x, (0, -1)), (stamp, -d))
                if d in cks:
                    ckpt[x] = max(ckpt.get(x, -1), cks[d])
        key.update(touched)
        evict(_HBM, cc.hbm_bytes, _HOST if cc.host_bytes > 0 else 0)
        evict(_HOST, cc.host_bytes, 0)
    return tot


def _as_reference(r: sim.SimResult) -> dict:
    return dict(hit=r.hit_tokens, mla=r.mla_hit_tokens, host_hit=r.host_hit_tokens,
                host_bytes=r.host_restored_bytes, evictions=r.evictions)


def _small_workload(seed: int, tick: float) -> traces.Workload:
    w = gen.generate(4, seed=seed, duration_s=120.0, median_turns=6, median_first_prompt=1_500,
                     system_prompt_tokens=300, median_new_tokens=200, median_output=60,
                     decode_tokens_per_s=20.0, median_think_s=2.0, subagent_share=0.7, subagent_turns=3)
    # round times so that several requests share a stamp
    return dataclasses.replace(w, t=np.round(w.t / tick) * tick)


CASES = [dict(policy=p, tail_aligned=tail, checkpoint_interval=iv, host=host, hbm=hbm, low_water=lw)
         for p in ("lru", "resume_aware") for tail in (False, True) for iv in (0, 256, 512)
         for host, hbm, lw in ((0.0, 40.0, 1.0), (60.0, 25.0, 0.9), (0.0, 1e9, 1.0))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_simulator_equals_the_plain_reference(case):
    for seed, tick in ((1, 5.0), (2, 1.0)):
        w = _small_workload(seed, tick)
        cc = sim.CacheConfig(hbm_bytes=case["hbm"], host_bytes=case["host"], mla_bytes_per_block=1.0,
                             kda_checkpoint_bytes=3.0, checkpoint_interval=case["checkpoint_interval"],
                             tail_aligned=case["tail_aligned"], policy=case["policy"],
                             low_water=case["low_water"])
        assert _as_reference(sim.simulate(w, cc)) == _reference(w, cc), (seed, case)


def test_equal_time_requests_evict_alike_whatever_their_order():
    # two sessions stored at one stamp, a budget that must evict part of them: blocks of equal recency
    # and depth go together, so listing the traces the other way round changes nothing
    def tr(tid, reqs):
        return {"id": tid, "block_size": 64, "requests": reqs}

    def rq(t, ids):
        return {"t": t, "type": "n", "in": 64 * len(ids), "out": 1, "hash_ids": ids}

    data = [tr("a", [rq(0.0, [1, 2, 3, 4]), rq(2.0, [1, 2, 3, 4, 5])]),
            tr("b", [rq(0.0, [11, 12, 13, 14]), rq(3.0, [11, 12, 13, 14, 16])])]
    cc = sim.CacheConfig(hbm_bytes=6.0, mla_bytes_per_block=1.0, kda_checkpoint_bytes=0.0,
                         checkpoint_interval=64,
                         low_water=1.0)
    one = sim.simulate(traces.to_workload(traces.parse_traces(data)), cc)
    other = sim.simulate(traces.to_workload(traces.parse_traces(data[::-1])), cc)
    assert one.as_dict() == other.as_dict()
    # t=0 evicts the deepest block of both; a's turn at t=2 resumes at 3 blocks and its store pushes out
    # b's blocks at depths 2 and 1, so b's turn at t=3 resumes at 1 block
    assert one.hit_tokens == 3 * 64 + 64


def test_resume_aware_drops_superseded_end_checkpoints():
    # one session of four growing turns, tail-aligned checkpoints only: under LRU every turn's end
    # checkpoint stays (3 bytes each), under resume_aware only the latest one
    def tr(reqs):
        return traces.parse_traces({"id": "s", "block_size": 64, "requests": reqs})

    reqs = [{"t": float(k), "type": "n", "in": n, "out": 1, "hash_ids": list(range(-(-n // 64)))}
            for k, n in enumerate((200, 330, 460, 590))]
    # the tails differ from the later full blocks: give each prompt's partial block its own id
    for k, r in enumerate(reqs):
        r["hash_ids"][-1] = 1000 + k
    w = traces.to_workload(tr(reqs))
    base = dict(mla_bytes_per_block=1.0, kda_checkpoint_bytes=3.0, checkpoint_interval=0, tail_aligned=True,
                low_water=1.0)
    # 13 bytes: the third turn's 7 full blocks and two checkpoints. LRU holds three checkpoints then,
    # evicts the deepest block with the newest one, and the fourth turn resumes at 330; resume_aware
    # holds one and the fourth turn resumes at 460
    lru = sim.simulate(w, sim.CacheConfig(hbm_bytes=13.0, **base))
    aware = sim.simulate(w, sim.CacheConfig(hbm_bytes=13.0, policy="resume_aware", **base))
    assert lru.hit_tokens == 200 + 330 + 330 and lru.evictions > 0
    assert aware.hit_tokens == 200 + 330 + 460


def test_blocks_are_keyed_by_their_prefix():
    # a repeated hash id, and an equal id after another prefix, are other blocks (as in a prefix cache)
    reqs = [{"t": 0.0, "type": "n", "in": 192, "out": 1, "hash_ids": [1, 2, 1]},
            {"t": 1.0, "type": "n", "in": 128, "out": 1, "hash_ids": [3, 2]},
            {"t": 2.0, "type": "n", "in": 128, "out": 1, "hash_ids": [1, 2]}]
    w = traces.to_workload(traces.parse_traces({"id": "s", "block_size": 64, "requests": reqs}))
    assert w.n_blocks == 5
    assert w.block_ids(2).tolist() == w.block_ids(0)[:2].tolist()
    assert w.block_ids(1)[1] not in w.block_ids(0)
