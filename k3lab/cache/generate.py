"""A seeded generator of AgentX-like agent sessions (k3lab.cache.traces describes the schema).

Each session arrives at a uniform time in the first `arrival_share` of the run, has a lognormal
number of turns, and grows: turn k+1's prompt is turn k's prompt, its output and new tool / user
tokens, so its full blocks extend turn k's (one chain of block ids per session). Turns are separated
by the request's own time (a fixed decode rate over its output) and a lognormal think time. A share of
sessions also start subagents: shorter sessions whose prompts begin with the parent's first blocks
(the shared system prompt and tools) and then diverge. Requests after `duration_s` are dropped.

The defaults follow the public AgentX figures (docs/k3.md): median 43 turns, median prompt about
142K tokens, median output 444, over 95% prefix reuse, subagents in 44% of sessions. The medians
of a generated workload are checked against them in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import numpy as np

from ..ops import int_arg
from .traces import Request, Trace, Workload


@dataclass(frozen=True)
class SessionModel:
    """The generator's knobs (medians of lognormals, and their log-space spreads)."""

    median_turns: float = 46
    turns_sigma: float = 0.5
    median_first_prompt: float = 88_000
    first_prompt_sigma: float = 0.35
    median_output: float = 444
    output_sigma: float = 0.8
    median_new_tokens: float = 1_500
    new_tokens_sigma: float = 0.9
    median_think_s: float = 4.0
    think_sigma: float = 0.8
    decode_tokens_per_s: float = 50.0
    max_prompt: int = 262_144
    subagent_share: float = 0.44
    subagents_per_session: float = 2.0
    subagent_turns: float = 8
    system_prompt_tokens: int = 12_000
    block_size: int = 64

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("max_prompt", "block_size", "system_prompt_tokens"):
                int_arg(f.name, v, low=int(f.name != "system_prompt_tokens"), what="a token count: an int")
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")
        for name in ("median_turns", "median_first_prompt", "median_output", "median_new_tokens",
                     "decode_tokens_per_s", "subagent_turns"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.subagent_share > 1:
            raise ValueError(f"subagent_share must be in [0, 1], got {self.subagent_share!r}")


AGENTX = SessionModel()


def _lognormal(rng, median, sigma, size=None):
    return median * np.exp(sigma * rng.standard_normal(size))


class _Builder:
    """Accumulates requests and chains into a Workload."""

    def __init__(self, block: int):
        self.block, self.next_id = block, 0
        self.rows: list[tuple] = []
        self.chains: list[np.ndarray] = []

    def new_ids(self, n: int) -> np.ndarray:
        ids = np.arange(self.next_id, self.next_id + n, dtype=np.int64)
        self.next_id += n
        return ids

    def session(self, rng, m: SessionModel, sid: int, t0: float, turns: int, first: int, kind: int,
                prefix: np.ndarray | None, duration: float) -> np.ndarray:
        """Add one session's requests; returns its chain (full blocks of its longest prompt)."""
        outs = np.maximum(1, _lognormal(rng, m.median_output, m.output_sigma, turns)).astype(np.int64)
        news = np.maximum(1, _lognormal(rng, m.median_new_tokens, m.new_tokens_sigma, turns)).astype(np.int64)
        thinks = _lognormal(rng, m.median_think_s, m.think_sigma, turns)
        prompts = first + np.concatenate([[0], np.cumsum(outs[:-1] + news[1:])])
        prompts = prompts[prompts <= m.max_prompt]
        if len(prompts) == 0:
            prompts = np.array([min(first, m.max_prompt)])
        full = int(prompts[-1]) // self.block
        head = prefix[: min(len(prefix), full)] if prefix is not None else np.empty(0, np.int64)
        chain = np.concatenate([head, self.new_ids(full - len(head))])
        self.chains.append(chain)
        c = len(self.chains) - 1
        t = t0
        for k, n_in in enumerate(prompts):
            if k:
                t += outs[k - 1] / m.decode_tokens_per_s + thinks[k]
            if t > duration:
                break
            n_in = int(n_in)
            tail = int(self.new_ids(1)[0]) if n_in % self.block else -1
            self.rows.append((t, sid, kind, n_in, int(outs[k]), c, n_in // self.block, tail))
        return chain

    def build(self) -> Workload:
        if not self.rows:
            raise ValueError("the generated workload is empty: raise sessions or duration_s")
        cols = list(zip(*self.rows))
        order = np.lexsort((np.asarray(cols[1]), np.asarray(cols[0])))  # by time, then session
        arr = [np.asarray(c)[order] for c in cols]
        return Workload(arr[0].astype(float), arr[1].astype(np.int32), arr[2].astype(np.int8),
                        arr[3].astype(np.int64), arr[4].astype(np.int64), arr[5].astype(np.int32),
                        arr[6].astype(np.int64), arr[7].astype(np.int64), self.chains, self.block,
                        self.next_id)


def generate(sessions: int = 200, *, duration_s: float = 3600.0, seed: int = 0,
             arrival_share: float = 0.5, model: SessionModel = AGENTX, **overrides) -> Workload:
    """A Workload of `sessions` root sessions (and their subagents) over `duration_s` seconds.
    overrides: any SessionModel field (e.g. median_turns=10)."""
    int_arg("sessions", sessions, low=1)
    if isinstance(duration_s, bool) or not 0 < duration_s < math.inf:
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    if not 0 < arrival_share <= 1:
        raise ValueError(f"arrival_share must be in (0, 1], got {arrival_share!r}")
    m = replace(model, **overrides) if overrides else model
    rng = np.random.default_rng(seed)
    b = _Builder(m.block_size)
    sid = 0
    for _ in range(sessions):
        t0 = float(rng.uniform(0, duration_s * arrival_share))
        turns = max(1, int(round(_lognormal(rng, m.median_turns, m.turns_sigma))))
        first = int(
            max(m.system_prompt_tokens + 1, _lognormal(rng, m.median_first_prompt, m.first_prompt_sigma))
        )
        chain = b.session(rng, m, sid, t0, turns, first, 0, None, duration_s)
        sid += 1
        if rng.random() < m.subagent_share:
            system = chain[: m.system_prompt_tokens // m.block_size]
            for _ in range(max(1, int(rng.poisson(m.subagents_per_session)))):
                ts = t0 + float(rng.uniform(0, 0.5)) * duration_s * (1 - arrival_share)
                sub_turns = max(1, int(round(_lognormal(rng, m.subagent_turns, m.turns_sigma))))
                sub_first = m.system_prompt_tokens + int(_lognormal(rng, 8_000, 0.5))
                b.session(rng, m, sid, ts, sub_turns, sub_first, 2, system, duration_s)
                sid += 1
    return b.build()


def to_traces(w: Workload, *, limit: int | None = None) -> list[Trace]:
    """The schema form of a workload (one Trace per session; `limit` sessions at most), e.g. to write
    a small sample file with traces.dump_traces."""
    if limit is not None:
        int_arg("limit", limit, what="a number of sessions: an int")
    traces: dict[int, Trace] = {}
    names = ("n", "s", "subagent")
    for i in range(len(w)):
        s = int(w.session[i])
        if s not in traces:
            if limit is not None and len(traces) >= limit:
                continue
            traces[s] = Trace(f"session-{s}", w.block_size, [])
        tr = traces[s]
        prev_end = (
            tr.requests[-1].t + tr.requests[-1].out_tokens / AGENTX.decode_tokens_per_s
            if tr.requests
            else None
        )
        think = 0.0 if prev_end is None else max(0.0, float(w.t[i]) - prev_end)
        tr.requests.append(Request(float(w.t[i]), names[w.kind[i]], int(w.in_tokens[i]), int(w.out_tokens[i]),
                                   [int(x) for x in w._block_ids(i)], round(think, 3)))
    return list(traces.values())
