"""A prefix-cache simulator for a hybrid model over agent traces: what a GPU's cache budget, a host
tier, KDA checkpoints and tail alignment do to the token hit rate.

The model of one GPU's cache (one rank of TP8 or DCP8):
- MLA history is stored in the traces' 64-token blocks (`mla_bytes_per_block`: 24 layers x 576 B x
  64 under TP8 in FP8, an eighth of that under DCP8). A prompt's hit is its longest prefix of blocks
  present in HBM or on the host.
- KDA state is stored as checkpoints (`kda_checkpoint_bytes`: conv + recurrent state of all KDA layers
  of the rank's heads; DCP does not divide it), saved on a grid of `checkpoint_interval` positions and,
  with `tail_aligned`, at the end of every prompt together with the MLA rows of its partial last block.
  A checkpoint lives and is evicted with the block it ends in (or whose end it follows, for a tail).
- A request resumes at the latest checkpoint inside its hit (k3lab.cache.resume), never past
  prompt - 1, and recomputes the rest; what it computed is then stored.
- When HBM is over budget, blocks go, least recently used first, to the host tier (if any, with its
  own budget and the same order) or are dropped. Eviction runs in batches down to `low_water` of the
  budget, so that its cost is paid once per many requests.
Requests with equal times see the cache as it was before any of them and are stored after all of
them, so the result does not depend on the order in which equal-time events are processed.

Eviction policies:
- "lru": by last use; among the blocks of one request (all used at once), the deepest first, since a
  block is useful only while every block before it is present (vLLM frees a request's blocks in that
  order too). Every checkpoint stays as long as its block does.
- "resume_aware": the same order, but only state that can serve a resume is kept. (1) Blocks after a
  request's last checkpoint are not kept: a later request can only resume at a checkpoint, and every
  checkpoint past that point will be made by a request that recomputes (and so re-creates) those
  rows. (2) When a turn extends its session's previous prompt, the previous prompt's end checkpoint is
  dropped (a grid checkpoint in that block is kept): the next turn of the session resumes at the new,
  later end, and a checkpoint is KDA state of every layer (about 56 MB per GPU at TP8, twice the MLA
  rows of a 2,048-token interval in FP8), so superseded ones would take most of the budget. What (2)
  gives up: a request that returns to an earlier end of its session (a retried turn) resumes at the
  grid checkpoint before it. Session order within one stamp follows processing order; a session has
  one request per stamp in any sensible trace.
Costs: restoring from host moves bytes at `h2d_bytes_per_s`; recomputing costs tokens at
`prefill_tokens_per_s` (measured figures, or given and labelled by the caller).
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from ..config import K3Config
from ..ops import int_arg
from .traces import Workload

POLICIES = ("lru", "resume_aware")
_ABSENT, _HBM, _HOST = 0, 1, 2
_DEPTH_BITS = 24  # depth < 2^24 blocks (over 10^9 tokens): the eviction key is stamp << 24 | rank


@dataclass(frozen=True)
class CacheConfig:
    """One GPU's cache. Bytes are per GPU; positions are tokens."""

    hbm_bytes: float
    mla_bytes_per_block: float
    kda_checkpoint_bytes: float
    host_bytes: float = 0.0
    checkpoint_interval: int = 2048
    tail_aligned: bool = False
    policy: str = "lru"
    low_water: float = 0.98
    h2d_bytes_per_s: float = 50e9
    prefill_tokens_per_s: float = 20_000.0
    block_size: int = 64

    def __post_init__(self):
        for name in ("hbm_bytes", "host_bytes", "mla_bytes_per_block", "kda_checkpoint_bytes"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 bytes, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        int_arg("block_size", self.block_size, low=1, what="a token count: an int")
        iv = self.checkpoint_interval
        if isinstance(iv, bool) or not isinstance(iv, int) or iv < 0 or iv % self.block_size:
            raise ValueError(f"checkpoint_interval must be 0 (prompt ends only) or a positive multiple of "
                             f"block_size={self.block_size}, got {iv!r}")
        if not 0 < self.low_water <= 1:
            raise ValueError(f"low_water must be in (0, 1], got {self.low_water!r}")
        if not (self.h2d_bytes_per_s > 0 and self.prefill_tokens_per_s > 0):
            raise ValueError("h2d_bytes_per_s and prefill_tokens_per_s must be > 0")

    @classmethod
    def for_k3(cls, hbm_gb: float, *, layout: str = "tp8", host_gb: float = 0.0, config: K3Config
               | None = None,
               latent_bytes: float = 1, **kw) -> CacheConfig:
        """Sizes from K3Config for one GPU: layout 'tp8' (each GPU holds the whole MLA history) or
        'dcp8' (an eighth of the positions); latent in FP8 (latent_bytes=1) by default; KDA state fp32
        and conv bf16 for the rank's 12 heads."""
        if layout not in ("tp8", "dcp8"):
            raise ValueError(f"layout must be 'tp8' or 'dcp8', got {layout!r}")
        cfg = config or K3Config.full()
        block = kw.get("block_size", 64)
        mla = (
            cfg.num_mla_layers
            * cfg.mla_latent_bytes_per_position(latent_bytes)
            * block
            / (8 if layout == "dcp8" else 1)
        )
        tp = cfg.sliced(8)
        kda = (
            tp.kda_state_bytes_all_layers() + tp.num_kda_layers * tp.kda_conv_state_values_per_sequence() * 2
        )
        return cls(hbm_bytes=hbm_gb * 1e9, host_bytes=host_gb * 1e9, mla_bytes_per_block=mla,
                   kda_checkpoint_bytes=kda, **kw)


@dataclass
class SimResult:
    requests: int
    prompt_tokens: int
    hit_tokens: int            # resumed (not recomputed)
    mla_hit_tokens: int        # the block prefix found, before the resume-point rule
    recomputed_tokens: int
    host_hit_tokens: int       # resumed tokens whose blocks came from the host tier
    host_restored_bytes: float
    restore_s: float           # host -> device time of what was restored
    recompute_s: float         # prefill time of what was recomputed
    host_recompute_s: float    # what recomputing the host-restored tokens would have cost instead
    evictions: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    @property
    def mla_hit_rate(self) -> float:
        return self.mla_hit_tokens / max(1, self.prompt_tokens)

    def as_dict(self) -> dict:
        return {**asdict(self), "token_hit_rate": self.token_hit_rate, "mla_hit_rate": self.mla_hit_rate}


class _Segment:
    """Blocks stored in HBM at one stamp, in eviction order (deepest first), or blocks moved to the host
    in one eviction. `keys` (stamp << 24 | rank, ascending) is None when they follow from the order: a
    single request's blocks, whose key rises by one per entry. `pos`: entries already consumed."""

    __slots__ = ("ids", "keys", "stamp", "pos", "dead")

    def __init__(self, ids: np.ndarray, keys: np.ndarray | None, stamp: int):
        self.ids, self.keys, self.stamp, self.pos, self.dead = ids, keys, stamp, 0, False

    def chunk(self, stop: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.ids[self.pos:stop]
        if self.keys is not None:
            return ids, self.keys[self.pos:stop]
        base = (np.int64(self.stamp) << _DEPTH_BITS) | np.int64((1 << _DEPTH_BITS) - len(self.ids))
        return ids, base + np.arange(self.pos, stop, dtype=np.int64)


class _Cache:
    """Per block: its tier, the stamp it was last stored at, and the position of the KDA checkpoint it
    holds (-1: none). Per tier: bytes used and the eviction log (segments in stamp order). An entry of
    the log is live while its block is in that tier and was not stored again since (`last` equals the
    entry's stamp); stale entries are skipped, and a segment wholly replaced by a later store of the
    same chain is dropped at once (`dead`)."""

    def __init__(self, n_blocks: int, cc: CacheConfig):
        self.cc = cc
        self.tier = np.zeros(n_blocks, np.int8)
        self.last = np.zeros(n_blocks, np.int64)
        self.ckpt = np.full(n_blocks, -1, np.int64)
        self.used = {_HBM: 0.0, _HOST: 0.0}
        self.logs = {_HBM: deque(), _HOST: deque()}
        self.chain_seg: dict[int, _Segment] = {}
        self.evictions = 0

    def bytes_of(self, ids: np.ndarray) -> float:
        return float(len(ids) * self.cc.mla_bytes_per_block + (self.ckpt[ids] >= 0).sum()
                     * self.cc.kda_checkpoint_bytes)

    def lookup(self, ids: np.ndarray, n_in: int) -> tuple[int, int, int, np.ndarray]:
        """(blocks found, resume position, index of the block holding the checkpoint or -1, the tiers
        of `ids`)."""
        t = self.tier[ids]
        absent = t == _ABSENT
        k = int(absent.argmax()) if len(ids) else 0
        h = k if len(ids) and absent[k] else len(ids)
        if h == 0:
            return 0, 0, -1, t
        ck = self.ckpt[ids[:h]]
        if ck.max() > n_in - 1:
            ck = np.where(ck <= n_in - 1, ck, -1)
        j = int(ck.argmax())
        return (h, int(ck[j]), j, t) if ck[j] > 0 else (h, 0, -1, t)

    def store(self, ids: np.ndarray, ck_blocks: np.ndarray, ck_pos: np.ndarray, keep: int,
              t: np.ndarray | None = None):
        """Blocks `ids[:keep]` of a request are now in HBM, with the KDA checkpoints it saved (block
        indices `ck_blocks`, ascending, positions `ck_pos`); blocks past `keep` are left as they are.
        t: the tiers of `ids` when nothing changed them since they were read. Bytes are updated for the
        blocks that change tier or gain a checkpoint only; stamps and the log are the caller's."""
        kept = ids[:keep]
        cc = self.cc
        t = self.tier[kept] if t is None else t[:keep]
        moved = kept[t != _HBM]
        if len(moved):
            from_host = moved[self.tier[moved] == _HOST]
            if len(from_host):
                n_ck = int((self.ckpt[from_host] >= 0).sum())
                self.used[_HOST] -= len(from_host) * cc.mla_bytes_per_block + n_ck * cc.kda_checkpoint_bytes
                self.used[_HBM] += n_ck * cc.kda_checkpoint_bytes
            self.used[_HBM] += len(moved) * cc.mla_bytes_per_block
            self.tier[moved] = _HBM
        n = int(np.searchsorted(ck_blocks, keep))
        if n:
            tgt = kept[ck_blocks[:n]]
            new = np.unique(tgt[self.ckpt[tgt] < 0])
            self.used[_HBM] += len(new) * cc.kda_checkpoint_bytes
            self.ckpt[tgt] = np.maximum(self.ckpt[tgt], ck_pos[:n])

    def drop_checkpoint(self, block: int, grid_pos: int):
        """Replace the checkpoint of `block` by its grid checkpoint `grid_pos` (-1: none), freeing
        its bytes where none is left."""
        if self.ckpt[block] < 0:
            return
        self.ckpt[block] = grid_pos
        if grid_pos < 0 and self.tier[block] != _ABSENT:
            self.used[int(self.tier[block])] -= self.cc.kda_checkpoint_bytes

    def log_one(self, chain: int, kept: np.ndarray, stamp: int):
        """Log the blocks one request stored at `stamp` (the only request of that stamp)."""
        self.last[kept] = stamp
        prev = self.chain_seg.get(chain)
        if prev is not None and len(prev.ids) <= len(kept):
            prev.dead = True  # a prefix of the same chain: every entry of it was stored again now
        seg = _Segment(kept[::-1], None, stamp)
        self.chain_seg[chain] = seg
        self.logs[_HBM].append(seg)

    def log_group(self, kept_list: list[np.ndarray], stamp: int):
        """Log the blocks several equal-time requests stored: each block once, at its shallowest depth
        among them; blocks of equal depth share a key and are evicted together, so the result does not
        depend on the order the requests were processed in."""
        kept_list = [k for k in kept_list if len(k)]
        if not kept_list:
            return
        ids = np.concatenate(kept_list)
        depth = np.concatenate([np.arange(len(k), dtype=np.int64) for k in kept_list])
        order = np.lexsort((depth, ids))  # by id, shallowest first
        ids, depth = ids[order], depth[order]
        first = np.r_[True, ids[1:] != ids[:-1]]
        ids, depth = ids[first], depth[first]
        order = np.lexsort((ids, -depth))  # deepest first, ties by id
        ids, depth = ids[order], depth[order]
        self.last[ids] = stamp
        keys = (np.int64(stamp) << _DEPTH_BITS) | ((1 << _DEPTH_BITS) - 1 - depth)
        self.logs[_HBM].append(_Segment(ids, keys, stamp))

    def _take(self, tier: int, need: float) -> tuple[np.ndarray, np.ndarray]:
        """Pop the least recently stored blocks of `tier` until they hold at least `need` bytes, and
        every block of the same key as the last one taken. Returns (ids, keys) in eviction order."""
        log, out, out_keys, got = self.logs[tier], [], [], 0.0
        cc = self.cc
        while got < need and log:
            seg = log[0]
            if seg.dead or seg.pos >= len(seg.ids):
                log.popleft()
                continue
            stop = len(seg.ids) if seg.keys is not None else min(len(seg.ids), seg.pos + 4096)
            ids, keys = seg.chunk(stop)
            ok = (self.tier[ids] == tier) & (self.last[ids] == (keys >> _DEPTH_BITS))
            cand, ckeys = ids[ok], keys[ok]
            has_ck = self.ckpt[cand] >= 0
            total = len(cand) * cc.mla_bytes_per_block + int(has_ck.sum()) * cc.kda_checkpoint_bytes
            if got + total < need:  # the whole chunk goes
                out.append(cand)
                out_keys.append(ckeys)
                got += total
                seg.pos = stop
                continue
            csum = np.cumsum(cc.mla_bytes_per_block + has_ck * cc.kda_checkpoint_bytes)
            n = min(len(cand), int(np.searchsorted(csum, need - got, side="left")) + 1)
            if 0 < n < len(cand):
                n = int(np.searchsorted(ckeys, ckeys[n - 1], side="right"))  # the rest of its key
            if n < len(cand):  # stop inside this chunk: advance past the n-th valid entry only
                stop = seg.pos + int(np.flatnonzero(ok)[n - 1]) + 1
            out.append(cand[:n])
            out_keys.append(ckeys[:n])
            got += float(csum[n - 1]) if n else 0.0
            seg.pos = stop
        if not out:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate(out), np.concatenate(out_keys)

    def evict(self):
        for tier, budget, down in ((_HBM, self.cc.hbm_bytes, _HOST if self.cc.host_bytes > 0 else _ABSENT),
                                   (_HOST, self.cc.host_bytes, _ABSENT)):
            if self.used[tier] <= budget + 1e-6:
                continue
            out, keys = self._take(tier, self.used[tier] - self.cc.low_water * budget)
            self.evictions += len(out)
            moved = self.bytes_of(out)
            self.used[tier] -= moved
            if down == _ABSENT:
                self.ckpt[out] = -1
            else:
                self.used[down] += moved
                self.logs[down].append(_Segment(out, keys, 0))
            self.tier[out] = down


class _Grid:
    """The KDA checkpoints a prompt saves (k3lab.cache.resume): every `checkpoint_interval` positions
    and, when it is block-aligned or the tail is saved with it, at the prompt's end."""

    def __init__(self, cc: CacheConfig, max_blocks: int):
        self.b, self.tail = cc.block_size, cc.tail_aligned
        self.step = cc.checkpoint_interval // cc.block_size
        js = np.arange(self.step - 1, max_blocks, self.step,
                       dtype=np.int64) if self.step else np.empty(0, np.int64)
        self.js, self.pos = js, (js + 1) * self.b

    def __call__(self, n_in: int, n_full: int) -> tuple[np.ndarray, np.ndarray]:
        """(block indices ascending, positions), one checkpoint per block at most (the later wins)."""
        count = n_full // self.step if self.step else 0
        js, pos = self.js[:count], self.pos[:count]
        if n_full and (n_in % self.b == 0 or self.tail):
            if count and js[-1] == n_full - 1:
                pos = pos.copy()
                pos[-1] = n_in
            else:
                js, pos = np.append(js, n_full - 1), np.append(pos, n_in)
        return js, pos


def _checkpoints(n_in: int, n_full: int, cc: CacheConfig) -> tuple[np.ndarray, np.ndarray]:
    """(block indices, positions) of the KDA checkpoints a prompt of n_in tokens saves."""
    return _Grid(cc, n_full)(n_in, n_full)


def _supersede(cache: _Cache, ends: dict, session: int, ids: np.ndarray, js: np.ndarray, pos: np.ndarray,
               n_in: int, grid: _Grid):
    """resume_aware (2): drop the session's previous end checkpoint once this prompt extends past it."""
    prev = ends.get(session)
    end = len(js) and pos[-1] == n_in
    if prev is not None and end and prev[1] < int(js[-1]) and prev[1] < len(ids) and ids[prev[1]] == prev[0]:
        d = prev[1]
        on_grid = grid.step and (d + 1) % grid.step == 0
        cache.drop_checkpoint(prev[0], (d + 1) * grid.b if on_grid else -1)
    if end:
        ends[session] = (int(ids[js[-1]]), int(js[-1]))


def simulate(w: Workload, cc: CacheConfig) -> SimResult:
    """Replay `w` through one GPU's cache `cc`; totals over all requests."""
    if not isinstance(w, Workload):
        raise ValueError(f"w must be a traces.Workload, got {type(w).__name__}")
    if w.block_size != cc.block_size:
        raise ValueError(f"the workload's block_size {w.block_size} differs from the cache's {cc.block_size}")
    cache = _Cache(w.n_blocks, cc)
    grid = _Grid(cc, int(w.n_full.max()) if len(w) else 0)
    order = np.argsort(w.t, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(w.t[order]) != 0]).tolist() + [len(order)]
    order = order.tolist()
    chain, n_full, n_in_all, session = (
        w.chain.tolist(),
        w.n_full.tolist(),
        w.in_tokens.tolist(),
        w.session.tolist(),
    )
    ends: dict[int, tuple[int, int]] = {}  # session -> (block, depth) of its last end checkpoint
    hit = mla = host_hit = 0
    host_bytes = 0.0
    b, lru, has_host = cc.block_size, cc.policy == "lru", cc.host_bytes > 0
    for stamp in range(1, len(starts)):
        group = order[starts[stamp - 1]:starts[stamp]]
        looked = []
        for i in group:
            ids = w.chains[chain[i]][: n_full[i]]
            n_in = n_in_all[i]
            h, resume, j, t = cache.lookup(ids, n_in)
            mla += min(h * b, n_in)
            hit += resume
            if resume and has_host:
                n_host = int((t[: -(-resume // b)] == _HOST).sum())
                host_bytes += n_host * cc.mla_bytes_per_block + (cc.kda_checkpoint_bytes if t[j] == _HOST
                                                                 else 0.0)
                host_hit += min(resume, n_host * b)
            js, pos = grid(n_in, len(ids))
            keep = len(ids) if lru else (int(js[-1]) + 1 if len(js) else 0)
            looked.append((i, ids, js, pos, keep, t))
        for i, ids, js, pos, keep, t in looked:
            if not lru:
                _supersede(cache, ends, session[i], ids, js, pos, n_in_all[i], grid)
            cache.store(ids, js, pos, keep, t if len(looked) == 1 else None)  # t: nothing changed tiers since
        if len(looked) == 1:
            i, ids, _, _, keep, _ = looked[0]
            if keep:
                cache.log_one(chain[i], ids[:keep], stamp)
        else:
            cache.log_group([ids[:keep] for _, ids, _, _, keep, _ in looked], stamp)
        cache.evict()
    prompt = int(w.in_tokens.sum())
    rec = prompt - hit
    return SimResult(len(w), prompt, hit, mla, rec, host_hit, host_bytes, host_bytes / cc.h2d_bytes_per_s,
                     rec / cc.prefill_tokens_per_s, host_hit / cc.prefill_tokens_per_s, cache.evictions)
