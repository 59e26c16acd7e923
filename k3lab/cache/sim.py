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
  order too).
- "resume_aware": the same order, and blocks after a request's last checkpoint are not kept at all. A
  later request can only resume at a checkpoint, and every checkpoint past that point will be made by
  a request that recomputes (and so re-creates) those rows: such blocks can never serve a resume, yet
  under LRU they take budget from blocks that can.
Costs: restoring from host moves bytes at `h2d_bytes_per_s`; recomputing costs tokens at
`prefill_tokens_per_s` (measured figures, or given and labelled by the caller).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..config import K3Config
from .traces import Workload

POLICIES = ("lru", "resume_aware")
_ABSENT, _HBM, _HOST = 0, 1, 2
_DEPTH_BITS = 24  # depth < 2^24 blocks (over 10^9 tokens): the eviction key is stamp << 24 | rank
_RANKS = (1 << _DEPTH_BITS) - 1 - np.arange(1 << 20, dtype=np.int64)  # the deepest block gets the smallest key


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
        iv = self.checkpoint_interval
        if isinstance(iv, bool) or not isinstance(iv, int) or iv < 0 or iv % self.block_size:
            raise ValueError(f"checkpoint_interval must be 0 (prompt ends only) or a positive multiple of "
                             f"block_size={self.block_size}, got {iv!r}")
        if not 0 < self.low_water <= 1:
            raise ValueError(f"low_water must be in (0, 1], got {self.low_water!r}")
        if not (self.h2d_bytes_per_s > 0 and self.prefill_tokens_per_s > 0):
            raise ValueError("h2d_bytes_per_s and prefill_tokens_per_s must be > 0")

    @classmethod
    def for_k3(cls, hbm_gb: float, *, layout: str = "tp8", host_gb: float = 0.0, config: K3Config | None = None,
               latent_bytes: float = 1, **kw) -> CacheConfig:
        """Sizes from K3Config for one GPU: layout 'tp8' (each GPU holds the whole MLA history) or
        'dcp8' (an eighth of the positions); latent in FP8 (latent_bytes=1) by default; KDA state fp32
        and conv bf16 for the rank's 12 heads."""
        if layout not in ("tp8", "dcp8"):
            raise ValueError(f"layout must be 'tp8' or 'dcp8', got {layout!r}")
        cfg = config or K3Config.full()
        block = kw.get("block_size", 64)
        mla = cfg.num_mla_layers * cfg.mla_latent_bytes_per_position(latent_bytes) * block / (8 if layout == "dcp8" else 1)
        tp = cfg.sliced(8)
        kda = tp.kda_state_bytes_all_layers() + tp.num_kda_layers * tp.kda_conv_state_values_per_sequence() * 2
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


class _Log:
    """Blocks in the order they were stored (eviction order), with the key each had then; an entry
    whose block was used again since (its key changed) or left the tier is stale and skipped.
    Compacted when it grows past twice what it must hold."""

    def __init__(self):
        self.ids = np.empty(1 << 16, np.int64)
        self.keys = np.empty(1 << 16, np.int64)
        self.head = self.end = 0

    def append(self, ids: np.ndarray, keys: np.ndarray, valid):
        n = len(ids)
        if self.end + n > len(self.ids):
            live = valid(self.ids[self.head:self.end], self.keys[self.head:self.end])
            ids_live, keys_live = self.ids[self.head:self.end][live], self.keys[self.head:self.end][live]
            size = max(len(self.ids), 2 * (len(ids_live) + n))
            self.ids, self.keys = np.empty(size, np.int64), np.empty(size, np.int64)
            self.head, self.end = 0, len(ids_live)
            self.ids[: self.end], self.keys[: self.end] = ids_live, keys_live
        self.ids[self.end:self.end + n], self.keys[self.end:self.end + n] = ids, keys
        self.end += n


class _Cache:
    def __init__(self, n_blocks: int, cc: CacheConfig):
        self.cc = cc
        self.tier = np.zeros(n_blocks, np.int8)
        self.key = np.zeros(n_blocks, np.int64)
        self.ckpt = np.full(n_blocks, -1, np.int64)
        self.used = {_HBM: 0.0, _HOST: 0.0}
        self.logs = {_HBM: _Log(), _HOST: _Log()}
        self.evictions = 0

    def bytes_of(self, ids: np.ndarray) -> float:
        return float(len(ids) * self.cc.mla_bytes_per_block + (self.ckpt[ids] >= 0).sum() * self.cc.kda_checkpoint_bytes)

    def lookup(self, ids: np.ndarray, n_in: int) -> tuple[int, int, int]:
        """(blocks found, resume position, index of the block holding the checkpoint or -1)."""
        present = self.tier[ids] != _ABSENT
        h = len(ids) if present.all() else int(np.argmin(present))
        if h == 0:
            return 0, 0, -1
        ck = self.ckpt[ids[:h]]
        ck = np.where(ck <= n_in - 1, ck, -1)
        j = int(np.argmax(ck))
        return (h, int(ck[j]), j) if ck[j] > 0 else (h, 0, -1)

    def _valid(self, tier: int):
        return lambda ids, keys: (self.tier[ids] == tier) & (self.key[ids] == keys)

    def store(self, ids: np.ndarray, stamp: int, ck_blocks: np.ndarray, ck_pos: np.ndarray, keep: int):
        """Blocks `ids[:keep]` of a request were used at `stamp` and are now in HBM, with the KDA
        checkpoints it saved (block indices `ck_blocks`, positions `ck_pos`); blocks past `keep` are
        left as they are."""
        kept = ids[:keep]
        if not len(kept):
            return
        cc = self.cc
        sizes = cc.mla_bytes_per_block + (self.ckpt[kept] >= 0) * cc.kda_checkpoint_bytes
        by_tier = np.bincount(self.tier[kept], weights=sizes, minlength=3)
        self.used[_HBM] -= by_tier[_HBM]
        self.used[_HOST] -= by_tier[_HOST]
        sel = ck_blocks < keep
        if sel.any():
            tgt = kept[ck_blocks[sel]]
            self.ckpt[tgt] = np.maximum(self.ckpt[tgt], ck_pos[sel])
        self.tier[kept] = _HBM
        self.used[_HBM] += len(kept) * cc.mla_bytes_per_block + int((self.ckpt[kept] >= 0).sum()) * cc.kda_checkpoint_bytes
        keys = (np.int64(stamp) << _DEPTH_BITS) | _RANKS[: len(kept)]
        self.key[kept] = keys
        self.logs[_HBM].append(kept[::-1], keys[::-1], self._valid(_HBM))  # deepest first

    def _take(self, tier: int, need: float) -> np.ndarray:
        """Pop the least recently used blocks of `tier` until they hold at least `need` bytes."""
        log, valid, out, got = self.logs[tier], self._valid(tier), [], 0.0
        while got < need and log.head < log.end:
            stop = min(log.end, log.head + 4096)
            ids, keys = log.ids[log.head:stop], log.keys[log.head:stop]
            ok = valid(ids, keys)
            cand = ids[ok]
            sizes = self.cc.mla_bytes_per_block + (self.ckpt[cand] >= 0) * self.cc.kda_checkpoint_bytes
            csum = np.cumsum(sizes)
            n = min(len(cand), int(np.searchsorted(csum, need - got, side="left")) + 1)
            if n < len(cand):  # stop inside this chunk: advance past the n-th valid entry only
                stop = log.head + int(np.flatnonzero(ok)[n - 1]) + 1
            out.append(cand[:n])
            got += float(csum[n - 1]) if n else 0.0
            log.head = stop
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def evict(self):
        for tier, budget, down in ((_HBM, self.cc.hbm_bytes, _HOST if self.cc.host_bytes > 0 else _ABSENT),
                                   (_HOST, self.cc.host_bytes, _ABSENT)):
            if self.used[tier] <= budget + 1e-6:
                continue
            out = self._take(tier, self.used[tier] - self.cc.low_water * budget)
            self.evictions += len(out)
            self.used[tier] -= self.bytes_of(out)
            if down == _ABSENT:
                self.ckpt[out] = -1
            else:
                self.used[down] += self.bytes_of(out)
                self.logs[down].append(out, self.key[out], self._valid(down))
            self.tier[out] = down


def _checkpoints(n_in: int, n_full: int, cc: CacheConfig) -> tuple[np.ndarray, np.ndarray]:
    """(block indices, positions) of the KDA checkpoints a prompt of n_in tokens saves: the grid, and
    its end when that is block-aligned or the tail is saved with it."""
    b = cc.block_size
    step = cc.checkpoint_interval // b
    js = np.arange(step - 1, n_full, step, dtype=np.int64) if step else np.empty(0, np.int64)
    pos = (js + 1) * b
    if n_full and (n_in % b == 0 or cc.tail_aligned):
        js, pos = np.append(js, n_full - 1), np.append(pos, n_in)
    return js, pos


def simulate(w: Workload, cc: CacheConfig) -> SimResult:
    """Replay `w` through one GPU's cache `cc`; totals over all requests."""
    if not isinstance(w, Workload):
        raise ValueError(f"w must be a traces.Workload, got {type(w).__name__}")
    if w.block_size != cc.block_size:
        raise ValueError(f"the workload's block_size {w.block_size} differs from the cache's {cc.block_size}")
    cache = _Cache(w.n_blocks, cc)
    order = np.argsort(w.t, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(w.t[order]) != 0]).tolist() + [len(order)]
    order = order.tolist()
    chain, n_full, n_in_all = w.chain.tolist(), w.n_full.tolist(), w.in_tokens.tolist()
    hit = mla = host_hit = 0
    host_bytes = 0.0
    b = cc.block_size
    for stamp in range(1, len(starts)):
        looked = []
        for i in order[starts[stamp - 1]:starts[stamp]]:
            ids = w.chains[chain[i]][: n_full[i]]
            n_in = n_in_all[i]
            h, resume, j = cache.lookup(ids, n_in)
            mla += min(h * b, n_in)
            hit += resume
            if resume:
                used = ids[: -(-resume // b)]
                n_host = int((cache.tier[used] == _HOST).sum())
                host_bytes += n_host * cc.mla_bytes_per_block + (cc.kda_checkpoint_bytes if cache.tier[ids[j]] == _HOST else 0.0)
                host_hit += min(resume, n_host * b)
            looked.append((ids, n_in))
        for ids, n_in in looked:
            js, pos = _checkpoints(n_in, len(ids), cc)
            keep = len(ids) if cc.policy == "lru" else (int(js.max()) + 1 if len(js) else 0)
            cache.store(ids, stamp, js, pos, keep)
        cache.evict()
    tot = {"hit": hit, "mla": mla, "host_hit": host_hit, "host_bytes": host_bytes}
    prompt = int(w.in_tokens.sum())
    rec = prompt - tot["hit"]
    return SimResult(len(w), prompt, tot["hit"], tot["mla"], rec, tot["host_hit"], tot["host_bytes"],
                     tot["host_bytes"] / cc.h2d_bytes_per_s, rec / cc.prefill_tokens_per_s,
                     tot["host_hit"] / cc.prefill_tokens_per_s, cache.evictions)
