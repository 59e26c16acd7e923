"""The AgentX-like sessions a serving run replays, scaled to what a short run can serve, and the tokens
of every position.

`agentx_sessions(n, scale=...)` draws a full-size workload with k3lab.cache.generate (its defaults follow
the public AgentX figures) and scales it: every prompt's length by `scale.context` (its block chain
thinned to every 1/context-th block, so equal block ids still mean equal prefixes, subagents still share
their parent's first blocks, and each turn still extends the previous one), every output by
`scale.output`, and the think time between a session's turns by `scale.time`. What a scale changes is
stated in every record (`Scale.describe`).

`Sessions` is the closed-loop form: the sessions in order of their first request, each a list of its
requests in turn order with the think time before each (the first turn's is 0).

`token_ids(w, i, lo, hi, vocab)` gives request i's tokens at positions [lo, hi) of its chain: a position
inside the chain's blocks takes its value from (block id, offset), so the prompts of later turns and of
subagents that share a block see the same tokens, and a prompt's partial last block holds the first
tokens of the block that later turns have there; positions past the chain (the last turn's tail and
outputs) take theirs from (chain, position). Outputs are these tokens too (teacher forcing): a run decodes
the tokens the next turn's prompt will hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from k3lab.cache.generate import AGENTX, generate
from k3lab.cache.traces import Workload


@dataclass(frozen=True)
class Scale:
    """Factors on the workload: prompt lengths (context), outputs, and think times (time)."""

    context: float = 1.0
    output: float = 1.0
    time: float = 1.0

    def __post_init__(self):
        for name in ("context", "output", "time"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"scale.{name} must be a number in (0, 1], got {v!r}")

    def describe(self) -> str:
        if (self.context, self.output, self.time) == (1.0, 1.0, 1.0):
            return "the generator's AgentX-like figures, unscaled"
        return (f"prompts x {self.context:g} (block chains thinned alike), outputs x {self.output:g}, think "
                f"times x {self.time:g}: medians first prompt "
                f"{AGENTX.median_first_prompt * self.context:,.0f}, "
                f"new tokens per turn {AGENTX.median_new_tokens * self.context:,.0f}, output "
                f"{AGENTX.median_output * self.output:,.0f}, think {AGENTX.median_think_s * self.time:.2g} s")


def scale_workload(w: Workload, scale: Scale) -> Workload:
    """`w` with prompts and outputs scaled (see the module docstring); arrival times kept."""
    if not isinstance(w, Workload):
        raise ValueError(f"w must be a k3lab.cache.traces.Workload, got {type(w).__name__}")  # noqa: TRY004
    if not isinstance(scale, Scale):
        raise ValueError(f"scale must be a Scale, got {type(scale).__name__}")  # noqa: TRY004
    step = max(1, int(round(1 / scale.context)))
    B = w.block_size
    chains = [np.ascontiguousarray(c[::step]) for c in w.chains]
    lens = np.array([len(chains[c]) for c in w.chain], dtype=np.int64)
    n_in = np.maximum(1, np.round(w.in_tokens * scale.context)).astype(np.int64)
    n_in = np.minimum(n_in, lens * B + B - 1)  # a prompt ends at most one partial block past its chain
    out = np.maximum(1, np.round(w.out_tokens * scale.output)).astype(np.int64)
    n_full = n_in // B
    partial = n_in % B != 0
    tail = np.full(len(w), -1, dtype=np.int64)
    tail[partial] = w.n_blocks + np.arange(int(partial.sum()))
    next_id = w.n_blocks + int(partial.sum())
    return Workload(w.t.copy(), w.session.copy(), w.kind.copy(), n_in, out, w.chain.copy(), n_full, tail,
                    chains, B, next_id)


def agentx_sessions(sessions: int, *, scale: Scale = Scale(), seed: int = 0, **overrides) -> Workload:
    """`sessions` root sessions (and their subagents) from k3lab.cache.generate (overrides: any of its
    SessionModel fields), scaled by `scale`."""
    return scale_workload(generate(sessions, seed=seed, **overrides), scale)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 of uint64 keys: well-spread token values from structured keys."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def token_ids(w: Workload, i: int, lo: int, hi: int, vocab: int) -> np.ndarray:
    """Request i's tokens at positions [lo, hi) (int64, in [0, vocab)); see the module docstring."""
    if not 0 <= lo <= hi:
        raise ValueError(f"positions must satisfy 0 <= lo <= hi, got [{lo}, {hi})")
    chain = w.chains[int(w.chain[i])]
    pos = np.arange(lo, hi, dtype=np.int64)
    blk = pos // w.block_size
    inside = blk < len(chain)
    with np.errstate(over="ignore"):
        key_in = chain[np.minimum(blk, max(len(chain) - 1, 0))].astype(np.uint64) * np.uint64(w.block_size) \
            + (pos % w.block_size).astype(np.uint64) if len(chain) else np.zeros(len(pos), np.uint64)
        key_out = ((np.uint64(int(w.chain[i]) + 1) << np.uint64(40)) + pos.astype(np.uint64)
                   + np.uint64(1 << 63))
        key = np.where(inside, key_in, key_out)
        return (_mix(key) % np.uint64(vocab)).astype(np.int64)


@dataclass
class Sessions:
    """Closed-loop sessions: `order` (session ids by first request), `turns[s]` (request indices in turn
    order) and `think[i]` (seconds a session waits before sending request i after its previous turn ends;
    0 for a first turn)."""

    workload: Workload
    order: list
    turns: dict
    think: np.ndarray

    @classmethod
    def of(cls, w: Workload, *, think_scale: float = 1.0, seed: int = 0) -> Sessions:
        """The closed-loop form of `w`: think times drawn as the generator draws them (lognormal around
        its median, x think_scale)."""
        rng = np.random.default_rng(seed + 7)
        idx = np.argsort(w.t, kind="stable")
        turns: dict[int, list[int]] = {}
        for i in idx.tolist():
            turns.setdefault(int(w.session[i]), []).append(i)
        order = sorted(turns, key=lambda s: (w.t[turns[s][0]], s))
        think = AGENTX.median_think_s * think_scale * np.exp(AGENTX.think_sigma * rng.standard_normal(len(w)))
        for s in turns.values():
            think[s[0]] = 0.0
        return cls(w, order, turns, think)

    def max_len(self) -> int:
        """The longest request: prompt plus output positions."""
        w = self.workload
        return int((w.in_tokens + w.out_tokens).max())
