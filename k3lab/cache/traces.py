"""Agent-session traces in the public cc-traces schema, and a seeded generator of AgentX-like ones.

The schema (the records the AgentX harness replays; docs/k3.md gives the source): a trace is one
agent session, `{"id": str, "block_size": 64, "requests": [...]}`, and each request has
    t           seconds from the trace's start (non-decreasing within a trace); `to_workload` adds
                each trace's start offset
    type        'n' (a normal turn), 's', or 'subagent'
    in, out     prompt and output tokens
    hash_ids    one id per `block_size`-token block of the prompt (equal ids = equal content and prefix)
    think_time  seconds the agent waited before sending it (optional: 0)
    api_time, stop   optional, kept when present.
`load_traces` checks every field of every request before it returns anything, and names the trace,
request and field of the first problem. Nothing is half-loaded.

`generate(...)` draws a `Workload` whose defaults follow the public AgentX figures (median 43 turns
per session, median prompt about 142K tokens, median output 444, over 95% prefix reuse, subagents in
44% of sessions): each turn's prompt is the previous prompt, its output and new tool/user tokens, so
its blocks extend the previous turn's. It is a synthetic workload made here, not the dataset.

A `Workload` is the simulator's compact form (arrays, one entry per request): the prompt's full
blocks are the first `n_full` ids of chain `chain`, and a partial last block, if any, has its own id
`tail` (a partial block's content differs from the full block that later prompts have there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ops import int_arg

REQUEST_TYPES = ("n", "s", "subagent")
_TYPE_CODE = {t: i for i, t in enumerate(REQUEST_TYPES)}
# The largest token count (and block size) a trace may give: far beyond any context or output, and
# small enough that the workload's int64 columns and their sums over any realistic trace never wrap
# (a count of 10**19 would turn negative in int64).
MAX_TOKENS = 2**31 - 1


class TraceError(ValueError):
    """A trace that does not follow the schema: the message names trace, request and field."""


@dataclass
class Request:
    t: float
    type: str
    in_tokens: int
    out_tokens: int
    hash_ids: list
    think_time: float = 0.0
    api_time: float | None = None
    stop: str | None = None


@dataclass
class Trace:
    id: str
    block_size: int
    requests: list[Request]


def _field(req: dict, name: str, where: str, kinds, *, required=True, default=None):
    if name not in req:
        if required:
            raise TraceError(f"{where}: field '{name}' is missing")
        return default
    value = req[name]
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TraceError(f"{where}: field '{name}' must be {getattr(kinds, '__name__', kinds)}, got "
                         f"{value!r}")
    return value


def _parse_request(raw, where: str, block_size: int, prev_t: float) -> Request:
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: a request must be an object, got {type(raw).__name__}")
    t = float(_field(raw, "t", where, (int, float)))
    if not np.isfinite(t) or t < prev_t:
        raise TraceError(f"{where}: field 't' must be finite and not before the previous request ({prev_t}), "
                         f"got {t}")
    rtype = _field(raw, "type", where, str)
    if rtype not in REQUEST_TYPES:
        raise TraceError(f"{where}: field 'type' must be one of {REQUEST_TYPES}, got {rtype!r}")
    n_in = _field(raw, "in", where, int)
    n_out = _field(raw, "out", where, int)
    if not (1 <= n_in <= MAX_TOKENS and 0 <= n_out <= MAX_TOKENS):
        raise TraceError(f"{where}: fields 'in' in 1..{MAX_TOKENS} and 'out' in 0..{MAX_TOKENS} expected, "
                         f"got in={n_in}, out={n_out}")
    ids = _field(raw, "hash_ids", where, list)
    need = -(-n_in // block_size)
    if len(ids) != need:
        raise TraceError(f"{where}: field 'hash_ids' must hold ceil(in / block_size) = {need} ids, got "
                         f"{len(ids)}")
    if not all(isinstance(h, (int, str)) and not isinstance(h, bool) for h in ids):
        raise TraceError(f"{where}: field 'hash_ids' must hold ints or strings")
    think = float(_field(raw, "think_time", where, (int, float), required=False, default=0.0))
    if not (think >= 0 and np.isfinite(think)):
        raise TraceError(f"{where}: field 'think_time' must be finite and >= 0, got {think}")
    api = _field(raw, "api_time", where, (int, float), required=False)
    if api is not None and not (api >= 0 and np.isfinite(api)):
        raise TraceError(f"{where}: field 'api_time' must be finite and >= 0, got {api}")
    stop = raw.get("stop")
    return Request(t, rtype, n_in, n_out, ids, think, None if api is None else float(api),
                   None if stop is None else str(stop))


def parse_traces(data) -> list[Trace]:
    """Traces from already-decoded JSON: one trace object or a list of them."""
    items = [data] if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise TraceError(f"traces must be a trace object or a list of them, got {type(data).__name__}")
    out = []
    for k, raw in enumerate(items):
        where = f"trace {k}"
        if not isinstance(raw, dict):
            raise TraceError(f"{where}: must be an object, got {type(raw).__name__}")
        tid = str(_field(raw, "id", where, (str, int)))
        where = f"trace {tid!r}"
        block = _field(raw, "block_size", where, int)
        if not 1 <= block <= MAX_TOKENS:
            raise TraceError(f"{where}: field 'block_size' must be in 1..{MAX_TOKENS}, got {block}")
        reqs = _field(raw, "requests", where, list)
        parsed, prev = [], -np.inf
        for j, r in enumerate(reqs):
            parsed.append(_parse_request(r, f"{where} request {j}", block, prev))
            prev = parsed[-1].t
        out.append(Trace(tid, block, parsed))
    return out


def load_traces(path) -> list[Trace]:
    """Traces from a JSON file (one trace object or a list); TraceError naming the first bad field."""
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: not valid JSON ({err})") from None
    return parse_traces(data)


def dump_traces(traces: list[Trace]) -> list[dict]:
    """The JSON form of `traces` (what load_traces reads back)."""
    return [{"id": tr.id, "block_size": tr.block_size, "requests": [
        {"t": r.t, "type": r.type, "in": r.in_tokens, "out": r.out_tokens, "hash_ids": list(r.hash_ids),
         "think_time": r.think_time, **({} if r.api_time is None else {"api_time": r.api_time}),
         **({} if r.stop is None else {"stop": r.stop})} for r in tr.requests]} for tr in traces]


@dataclass
class Workload:
    """Requests as arrays (see the module docstring); `chains[c]` holds dense block ids (int64)."""

    t: np.ndarray
    session: np.ndarray
    kind: np.ndarray
    in_tokens: np.ndarray
    out_tokens: np.ndarray
    chain: np.ndarray
    n_full: np.ndarray
    tail: np.ndarray
    chains: list
    block_size: int
    n_blocks: int

    def __len__(self) -> int:
        return len(self.t)

    def block_ids(self, i: int) -> np.ndarray:
        """Request i's prompt blocks, in order (i an int in [0, len(self)): no bool, no negative index
        counted from the end)."""
        return self._block_ids(int_arg("i", i, high=len(self) - 1, what="a request index: an int"))

    def _block_ids(self, i: int) -> np.ndarray:
        ids = self.chains[self.chain[i]][: self.n_full[i]]
        return ids if self.tail[i] < 0 else np.append(ids, self.tail[i])

    def reuse_per_request(self) -> np.ndarray:
        """Per request (in workload order), the tokens of its prompt whose block was seen earlier as part
        of the same prefix: what an unbounded cache would find, at block granularity, before
        resume-point rules."""
        seen = np.zeros(self.n_blocks, dtype=bool)
        out = np.zeros(len(self), dtype=np.int64)
        for i in np.argsort(self.t, kind="stable"):
            ids = self._block_ids(i)
            s = seen[ids]
            h = len(ids) if s.all() else int(np.argmin(s))
            out[i] = min(h * self.block_size, int(self.in_tokens[i]))
            seen[ids] = True
        return out

    def theoretical_reuse(self) -> float:
        """Share of all prompt tokens an unbounded cache would find (`reuse_per_request`)."""
        return int(self.reuse_per_request().sum()) / max(1, int(self.in_tokens.sum()))

    def active_sessions(self, at, decode_tokens_per_s: float = 50.0) -> np.ndarray:
        """Sessions active at each time of `at`: from a session's first request to the end of its last
        one's output (at `decode_tokens_per_s`)."""
        n = int(self.session.max()) + 1 if len(self) else 0
        start, end = np.full(n, np.inf), np.full(n, -np.inf)
        np.minimum.at(start, self.session, self.t)
        np.maximum.at(end, self.session, self.t + self.out_tokens / decode_tokens_per_s)
        at = np.asarray(at, dtype=float)
        return (np.searchsorted(np.sort(start), at, side="right")
                - np.searchsorted(np.sort(end), at, side="left"))


def _prefix_ids(dense: dict, hash_ids):
    """Dense ids of a request's blocks keyed by (previous block, hash id): a block is its content and
    everything before it, as in a prefix cache (equal hash ids after different prefixes, or repeated
    within one prompt, are different blocks)."""
    parent = -1
    for h in hash_ids:
        parent = dense.setdefault((parent, h), len(dense))
        yield parent


def to_workload(traces: list[Trace], offsets=None) -> Workload:
    """The simulator's form of loaded traces: each request its own chain, ids mapped to dense ints by
    prefix (`_prefix_ids`). offsets: each trace's start time in the replay (default 0 for all)."""
    if not traces:
        raise TraceError("traces must hold at least one trace")
    offsets = np.zeros(len(traces)) if offsets is None else np.asarray(offsets, dtype=float)
    if offsets.shape != (len(traces),):
        raise TraceError(f"offsets must hold one start time per trace ({len(traces)}), got shape "
                         f"{offsets.shape}")
    if not np.isfinite(offsets).all():
        bad = offsets[~np.isfinite(offsets)][:4].tolist()
        raise TraceError(f"offsets must be finite start times, got {bad}")
    block = traces[0].block_size
    for tr in traces:
        if tr.block_size != block:
            raise TraceError(f"trace {tr.id!r}: block_size {tr.block_size} differs from the first trace's "
                             f"{block}")
    dense: dict = {}
    cols = {k: [] for k in ("t", "session", "kind", "in", "out", "chain", "n_full", "tail")}
    chains = []
    for s, tr in enumerate(traces):
        for r in tr.requests:
            ids = np.fromiter(_prefix_ids(dense, r.hash_ids), dtype=np.int64, count=len(r.hash_ids))
            partial = r.in_tokens % block != 0
            chains.append(ids[:-1] if partial else ids)
            for k, v in (("t", r.t + offsets[s]), ("session", s), ("kind", _TYPE_CODE[r.type]),
                         ("in", r.in_tokens),
                         ("out", r.out_tokens), ("chain", len(chains) - 1),
                         ("n_full", len(ids) - partial), ("tail", ids[-1] if partial else -1)):
                cols[k].append(v)
    a = {k: np.asarray(v) for k, v in cols.items()}
    return Workload(a["t"].astype(float), a["session"].astype(np.int32), a["kind"].astype(np.int8),
                    a["in"].astype(np.int64), a["out"].astype(np.int64), a["chain"].astype(np.int32),
                    a["n_full"].astype(np.int64), a["tail"].astype(np.int64), chains, block, len(dense))

