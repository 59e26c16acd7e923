"""Before a serving run: how many turns each session gets in the run's clock, how much prefix cache its
sessions hold against the budget, and whether capacity binds (k3lab.studies.serving_run.plan).

    p = plan_run(sessions, layout, budget, concurrency=16, dcp=8, host=True, costs=costs, clock_s=90)
    p["turns_per_session"], p["need_bytes"], p["binds"]

Bytes. The pool's layout (`Layout.of(config, dtype_bytes)`, the same arithmetic as
k3lab.serving.pool.PrefixPool): a page is one block of `block_size` positions' MLA rows (block_size / dcp
rows under DCP), a KDA checkpoint is every KDA layer's fp32 state and conv history (not divided by DCP),
stored over whole pages with the partial block's rows at a prompt's end. A session holds its latest
prompt's full blocks, its end checkpoint and the grid checkpoints below it; a running sequence reserves
one KDA state and the rows of its prompt and output from the same device budget. `need_bytes` is the
`concurrency` live sessions' cache at the longest prompt each reaches in the clock plus every one of
them running: capacity binds when that exceeds the device budget. When it binds without a host tier
(or beyond it), closed-loop sessions revisit their prefixes in turn, which LRU serves worst: the plan
takes every later turn as a miss (recomputed from 0). Otherwise every later turn resumes where the
previous prompt ended.

Turns. The sessions' own turns (prompt, output, think time) replayed through the run's scheduler with
measured step times (k3lab.serving.predict.replay), each later turn resuming as above; a turn counts when
the run sends it: its session's previous turn ended inside the clock (a first turn: the session started
inside it), or, for a run of `max_requests`, among the first that many arrivals. The plan is the
arithmetic of a design, checked against measured runs in tests/test_serving_run_capacity.py; a run's own
records are what it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .predict import StepCosts, replay


@dataclass(frozen=True)
class Layout:
    """Bytes of the pool's units for a config at an element size: MLA layers, the latent width, the KDA
    checkpoint's bytes, the block size."""

    n_mla: int
    latent: int
    elsize: int
    kda_bytes: int
    block_size: int = 64

    @classmethod
    def of(cls, config, elsize: int, block_size: int = 64) -> Layout:
        if elsize not in (2, 4):
            raise ValueError(f"elsize must be 2 (bf16) or 4 (fp32), got {elsize!r}")
        kinds = list(config.layer_types)
        n_mla, n_kda = kinds.count("mla"), kinds.count("kda")
        W = config.kda_conv_size - 1
        kda = (n_kda * config.kda_num_heads * config.kda_head_dim ** 2 * 4
               + n_kda * 3 * config.kda_width * W * elsize)
        return cls(n_mla, config.mla_latent_dim, elsize, kda, block_size)

    def row_bytes(self) -> int:
        """One position's MLA rows over every MLA layer."""
        return self.n_mla * self.latent * self.elsize

    def page_bytes(self, dcp: int) -> int:
        return self.row_bytes() * (self.block_size // dcp)

    def session_bytes(self, n_in: int, dcp: int, interval: int) -> int:
        """A session's cache after a prompt of n_in positions: its full blocks, the end checkpoint (with
        the partial block's rows) and the grid checkpoints below the prompt's end, in whole pages."""
        pb, B = self.page_bytes(dcp), self.block_size
        full = n_in // B
        tail = -(-n_in // dcp) - full * (B // dcp)
        end = -(-(self.kda_bytes + tail * self.row_bytes()) // pb) if n_in % B else 0
        grid = ((n_in - 1) // interval if interval else 0) + (0 if n_in % B else 1)
        return (full + end + grid * -(-self.kda_bytes // pb)) * pb

    def running_bytes(self, positions: int, dcp: int) -> int:
        """A running sequence's reservation: one KDA state and its rows (prompt and output)."""
        return self.kda_bytes + -(-positions // dcp) * self.row_bytes()


def costs_from_records(records) -> StepCosts:
    """Step times from measured serving-run records: the median decode step per captured size over
    every record, and a prefill call's seconds as a + b x tokens, fitted by least squares over the
    records' prefill calls, tokens and seconds (a call's fixed part is large: the prefill step runs
    eagerly, layer by layer)."""
    steps: dict[int, list[float]] = {}
    rows, secs = [], []
    for r in records:
        s = r.extra["summary"]
        for b, ms in s.get("decode_step_ms", {}).items():
            steps.setdefault(int(b), []).append(float(ms))
        if s.get("prefill_calls"):
            rows.append([float(s["prefill_calls"]), float(s["prefill_tokens"])])
            secs.append(float(s["prefill_s"]))
    if not steps or len(rows) < 2:
        raise ValueError("records must hold at least two serving-run summaries with decode steps and "
                         "prefill calls")
    (a, b), *_ = np.linalg.lstsq(np.array(rows), np.array(secs), rcond=None)
    if not (a >= 0 and b > 0):
        raise ValueError(f"the records' prefill times give no positive per-token cost (a={a:.3g} s per "
                         f"call, b={b:.3g} s per token)")
    step = {k: float(np.median(v)) for k, v in steps.items()}

    def decode_us(size, n, ctx):
        return step[min(step, key=lambda k: (abs(k - size), -k))] * 1e3

    return StepCosts(decode_us, lambda t, ctx: (a + b * t) * 1e6, 0.0,
                     f"decode steps and prefill ({a * 1e3:.0f} ms a call + {1 / b:.0f} tokens/s) of "
                     f"{len(records)} records")


def _turns(sessions, concurrency: int, limit: int) -> list[list[dict]]:
    """The first sessions the closed loop can reach (their order), each as replay turns (resume 0)."""
    w = sessions.workload
    out = []
    for s in sessions.order[:concurrency + limit]:
        out.append([{"request": int(i), "n_in": int(w.in_tokens[i]), "out": int(w.out_tokens[i]),
                     "resume": 0, "think": float(sessions.think[i])} for i in sessions.turns[s][:limit]])
    return out


def _with_resumes(turns: list[list[dict]], hit: bool) -> list[list[dict]]:
    out = []
    for seq in turns:
        prev, new = 0, []
        for t in seq:
            new.append({**t, "resume": prev if hit and 0 < prev < t["n_in"] else 0})
            prev = t["n_in"]
        out.append(new)
    return out


def plan_run(sessions, layout: Layout, budget, *, concurrency: int, dcp: int, host: bool, costs: StepCosts,
             clock_s: float | None = None, max_requests: int | None = None, checkpoint_interval: int = 0,
             max_batched_tokens: int = 8192, staging: int = 4, max_turns: int = 60) -> dict:
    """The plan of one run (module docstring): `sessions` (workload.Sessions), `budget` (run.CacheBudget),
    the run's settings, step `costs`, and its clock (`clock_s` of serving clock or `max_requests`).
    Returns turns_per_session and min_turns (over the `concurrency` sessions started at 0), requests,
    later_sessions (sessions started when one ended its turns), need_bytes,
    cache_bytes (the sessions' cache alone), running_bytes, budget and host bytes, binds (need over the
    device budget), host_holds (binds, and the cache fits the host tier), later_turns_hit (the plan's
    assumption for later turns)."""
    if (clock_s is None) == (max_requests is None):
        raise ValueError("give exactly one of clock_s (seconds of serving clock) and max_requests")
    if not isinstance(concurrency, int) or concurrency < 1 or dcp not in (1, 2, 4, 8):
        raise ValueError(f"concurrency must be a positive int and dcp 1, 2, 4 or 8, got {concurrency!r}, "
                         f"{dcp!r}")
    turns = _turns(sessions, concurrency, max_turns)
    gpu, host_b = float(budget.gpu_bytes), float(budget.host_bytes) if host else 0.0
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if s < concurrency} | {concurrency})
    mem = {"budget": gpu, "state": layout.kda_bytes, "row": layout.row_bytes()}

    def go(hit: bool) -> tuple[dict, list]:
        inputs = {"concurrency": concurrency, "dcp": dcp, "memory": mem,
                  "max_batched_tokens": max_batched_tokens, "checkpoint_interval": checkpoint_interval,
                  "staging": staging, "sizes": sizes, "gpus": 8,
                  "sessions": _with_resumes(turns, hit)}
        rep = replay(inputs, costs)
        reqs = sorted(rep["requests"], key=lambda r: r["arrival"])
        if max_requests is not None:
            return rep, reqs[:max_requests]
        # the run sends a turn when the session's previous one ended inside the clock (a first turn
        # when the session starts inside it); it arrives after its think time, perhaps past the clock
        ends = {r["request"]: r["end"] for r in reqs}
        arrivals = {r["request"]: r["arrival"] for r in reqs}
        sent = set()
        for seq in turns:
            for k, t in enumerate(seq):
                at = arrivals.get(t["request"], math.inf) if k == 0 else ends.get(seq[k - 1]["request"],
                                                                                    math.inf)
                if at < clock_s:
                    sent.add(t["request"])
        return rep, [r for r in reqs if r["request"] in sent]

    def needs(kept) -> tuple[int, int]:
        by_req = {t["request"]: (si, t) for si, seq in enumerate(turns) for t in seq}
        longest: dict[int, dict] = {}
        for r in kept:
            si, t = by_req[r["request"]]
            if si not in longest or t["n_in"] > longest[si]["n_in"]:
                longest[si] = t
        live = sorted(longest.values(), key=lambda t: -t["n_in"])[:concurrency]
        cache = sum(layout.session_bytes(t["n_in"], dcp, checkpoint_interval) for t in live)
        run = sum(layout.running_bytes(t["n_in"] + t["out"], dcp) for t in live)
        return cache, run

    _, kept = go(True)
    cache, run = needs(kept)
    binds = cache + run > gpu
    host_holds = binds and cache + run <= gpu + host_b
    hit = not binds or host_holds
    if not hit:
        _, kept = go(False)
        cache, run = needs(kept)
    by_req = {t["request"]: si for si, seq in enumerate(turns) for t in seq}
    per = {}
    for r in kept:
        per[by_req[r["request"]]] = per.get(by_req[r["request"]], 0) + 1
    first = [per.get(si, 0) for si in range(min(concurrency, len(turns)))]  # the sessions started at 0
    return {"concurrency": concurrency, "dcp": dcp, "host": host, "requests": len(kept),
            "sessions": len(per), "turns_per_session": float(np.mean(first)), "min_turns": int(min(first)),
            "later_sessions": len(per) - sum(1 for c in first if c),
            "cache_bytes": cache, "running_bytes": run, "need_bytes": cache + run, "budget_bytes": gpu,
            "host_bytes": host_b, "binds": bool(binds), "host_holds": bool(host_holds),
            "later_turns_hit": bool(hit), "costs": costs.source}
