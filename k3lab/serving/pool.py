"""The prefix cache of one rank in real memory: paged MLA history and KDA checkpoints, LRU eviction to a
pinned host tier, restores on a hit.

Where it has run (CPU: the tiny preset, tests/test_serving_run.py; an H100: the serving-run study's
quick form, CUDA graphs, pinned host buffers and timed restores) is k3lab.studies.runs' part 'serving_run'.

    pool = PrefixPool(slots, gpu_bytes=3.7e9, host_bytes=14e9, checkpoint_interval=2048)
    hit = pool.lookup(block_ids, n_in)                 # blocks found, resume position
    pool.restore(hit, slot=3, stage=0)                 # history rows and KDA state into the slot
    ... prefill from hit.resume ...
    pool.store(block_ids, slot=3, stage=0, upto=..., checkpoint=(pos, tail_of))

Layout. A page holds one block: `block_size` positions of MLA history (the rank's share under DCP:
block_size / dcp rows) for every MLA layer, [mla layers, rows, 576] in the slots' dtype. A KDA checkpoint
(the conv histories and fp32 states of every KDA layer at one position, and, for a checkpoint at a prompt's
end, the MLA rows of its partial last block) is stored as raw bytes over as many pages as it needs. The
device arena holds `gpu_bytes // page_bytes` pages; the host arena `host_bytes // page_bytes` (pinned
where there is a GPU, so copies are DMA).

Contents. A block is known by the id the workload gives it (equal ids: equal tokens and equal prefix,
k3lab.cache.traces). A checkpoint belongs to the block it ends in (a grid checkpoint at (j + 1) *
block_size, or a prompt's end inside block j + 1 with that block's partial rows) and moves and goes with
it. A lookup finds the longest run of present blocks from the start, then the latest checkpoint inside it
at a position <= n_in - 1 (k3lab.cache.resume's rule); an end checkpoint counts only for a prompt whose
next block (full, or the one its own partial block begins) is the one the checkpoint's partial rows
begin (`tail_of`), since those rows were not stored as a block of their own.

Capacity. The running sequences' own state (their slots: KDA state and history rows) counts against the
same budget (`reserve`): the cache may use the device pages the running sequences leave. When it needs
more, the least recently used blocks move to the host tier (with their checkpoints) while it has room
(its own LRU blocks are dropped to make it), else they are dropped. Blocks of one request are touched
deepest first, so that among equally recent blocks the deepest go first (a block is useful only while
every block before it is present). A restore brings host-tier pages back to device pages first (the copy
timed and counted) and then copies device pages into the slot. A checkpoint that a request resumed from
at its own prompt's earlier end is dropped when the request stores its new end checkpoint
(`supersedes`): the next turn resumes at the later one, and every checkpoint is a KDA state of every
layer.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from k3lab.engine.prefill import SlotCaches

GPU, HOST = "gpu", "host"


@dataclass
class _Ckpt:
    pos: int
    tail_of: int | None  # end checkpoint: the id of the block its partial rows begin; None: on the grid
    pages: list
    nbytes: int


@dataclass
class _Block:
    tier: str
    page: int
    depth: int
    grid: _Ckpt | None = None  # the grid checkpoint at the block's end
    end: _Ckpt | None = None   # a prompt's end inside the next block, with that block's partial rows

    def ckpts(self) -> list[_Ckpt]:
        return [c for c in (self.grid, self.end) if c is not None]


@dataclass(frozen=True)
class Hit:
    """What a lookup found: `blocks` present from the start, `resume` (the position the request resumes
    at, 0 for none), `ckpt_block` (index of the block holding that checkpoint, -1 for none), `host_blocks`
    (blocks of [0, resume) and the checkpoint on the host tier), `ids` (the prompt's full-block ids)."""

    blocks: int
    resume: int
    ckpt_block: int
    host_blocks: int
    ids: np.ndarray
    n_in: int = 0


@dataclass
class PoolStats:
    lookups: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0            # positions resumed (not recomputed)
    mla_hit_tokens: int = 0        # positions of the block run found, before the resume rule
    host_hit_tokens: int = 0       # resumed positions whose blocks came back from the host tier
    restored_host_bytes: int = 0   # host -> device
    restore_host_s: float = 0.0    # the host -> device copies, timed with a device sync on each side
    restored_device_bytes: int = 0 # device pages -> slot
    stored_blocks: int = 0
    stored_checkpoints: int = 0
    superseded_checkpoints: int = 0
    to_host_blocks: int = 0
    to_host_bytes: int = 0
    offload_s: float = 0.0         # device -> host copies, timed likewise
    dropped_blocks: int = 0
    skipped_stores: int = 0        # blocks not stored: no room even after evicting everything
    restore_failed: int = 0        # hits whose host-tier pages found no device room: recomputed
    peak_device_bytes: int = 0
    peak_host_bytes: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / max(1, self.prompt_tokens)

    def as_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        return {**out, "hit_rate": self.hit_rate,
                "mla_hit_rate": self.mla_hit_tokens / max(1, self.prompt_tokens)}


def cache_memory(gpu_bytes: float, host_bytes: float, device, *, pin: bool | None = None) -> dict:
    """Flat byte buffers for a pool: `gpu_bytes` on `device`, `host_bytes` on the host (pinned where there
    is a GPU, unless pin says otherwise). Allocate once and hand to every PrefixPool of a sweep."""
    pin = torch.cuda.is_available() if pin is None else pin
    return {GPU: torch.empty(int(gpu_bytes), dtype=torch.uint8, device=device),
            HOST: torch.empty(int(host_bytes), dtype=torch.uint8, pin_memory=bool(pin and host_bytes > 0))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrefixPool:
    """One rank's prefix cache (see the module docstring) for the sequences of `slots` (SlotCaches).

    gpu_bytes, host_bytes: the budgets (device pages and host pages, whole pages); block_size: positions
    per block (the workload's, a multiple of the DCP degree); checkpoint_interval: positions between grid
    checkpoints (a multiple of block_size; 0: prompt ends only); memory: buffers from `cache_memory` to
    lay the pages in (at least the budgets; default: allocated here). ValueError for budgets that cannot
    hold a page or a checkpoint, or memory smaller than the budgets."""

    def __init__(self, slots: SlotCaches, gpu_bytes: float, host_bytes: float = 0.0, *, block_size: int = 64,
                 checkpoint_interval: int = 2048, memory: dict | None = None):
        if not isinstance(slots, SlotCaches):
            raise ValueError(f"slots must be a SlotCaches, got {type(slots).__name__}")  # noqa: TRY004
        if not isinstance(block_size, int) or block_size < 1 or block_size % slots.dcp:
            raise ValueError(f"block_size must be a positive multiple of the DCP degree {slots.dcp}, got "
                             f"{block_size!r}")
        if (not isinstance(checkpoint_interval, int) or checkpoint_interval < 0
                or checkpoint_interval % block_size):
            raise ValueError(f"checkpoint_interval must be 0 or a positive multiple of "
                             f"block_size={block_size}, got {checkpoint_interval!r}")
        self.slots, self.block_size, self.interval = slots, block_size, checkpoint_interval
        c, dt = slots.config, slots.dtype
        self.rows = block_size // slots.dcp
        self.n_mla = len(slots.mla_layers)
        self.elsize = torch.empty(0, dtype=dt).element_size()
        self.page_bytes = self.n_mla * self.rows * c.mla_latent_dim * self.elsize
        state_bytes = slots.stage_state[0].numel() * 4
        conv_bytes = slots.stage_conv[0].numel() * self.elsize
        self.kda_bytes = state_bytes + conv_bytes
        self.max_ckpt_pages = -(-(self.kda_bytes + self.page_bytes) // self.page_bytes)
        n_gpu, n_host = int(gpu_bytes // self.page_bytes), int(host_bytes // self.page_bytes)
        if n_gpu < self.max_ckpt_pages + 1:
            raise ValueError(f"gpu_bytes={gpu_bytes:.3g} holds {n_gpu} pages of {self.page_bytes} bytes; a "
                             f"block and a checkpoint need {self.max_ckpt_pages + 1}")
        if n_host and n_host < self.max_ckpt_pages + 1:
            raise ValueError(f"host_bytes={host_bytes:.3g} holds {n_host} pages; give 0 or at least "
                             f"{(self.max_ckpt_pages + 1) * self.page_bytes} bytes")
        shape, pb = (self.n_mla, self.rows, c.mla_latent_dim), self.page_bytes
        memory = memory or cache_memory(n_gpu * pb, n_host * pb, slots.device)
        for tier, n in ((GPU, n_gpu), (HOST, n_host)):
            if memory[tier].dtype != torch.uint8 or memory[tier].numel() < n * pb:
                raise ValueError(f"memory[{tier!r}] must be a uint8 buffer of >= {n * pb} bytes")
        if memory[GPU].device != slots.device:
            raise ValueError(f"memory['gpu'] is on {memory[GPU].device}, the slots on {slots.device}")
        self.bytes_view = {t: memory[t][:n * pb].view(n, pb) for t, n in ((GPU, n_gpu), (HOST, n_host))}
        self.arena = {t: memory[t][:n * pb].view(dt).view(n, *shape)
                      for t, n in ((GPU, n_gpu), (HOST, n_host))}
        self.pages = {GPU: n_gpu, HOST: n_host}
        self.free = {GPU: list(range(n_gpu - 1, -1, -1)), HOST: list(range(n_host - 1, -1, -1))}
        self.lru = {GPU: OrderedDict(), HOST: OrderedDict()}
        self.blocks: dict[int, _Block] = {}
        self.reserved_pages = 0
        self.stats = PoolStats()

    # ------------------------------------------------------------ accounting
    def used_pages(self, tier: str) -> int:
        return self.pages[tier] - len(self.free[tier])

    def capacity_pages(self) -> int:
        """Device pages the cache may use now: the budget less what the running sequences reserve."""
        return self.pages[GPU] - self.reserved_pages

    def reserve(self, nbytes: float) -> bool:
        """Set the running sequences' bytes; evicts what no longer fits. False (nothing changed) when they
        alone exceed the device budget."""
        pages = int(-(-nbytes // self.page_bytes))
        if pages > self.pages[GPU]:
            return False
        self.reserved_pages = pages
        self._make_room(0)
        return True

    def _note_peak(self) -> None:
        s = self.stats
        s.peak_device_bytes = max(s.peak_device_bytes, (self.used_pages(GPU) + self.reserved_pages)
                                  * self.page_bytes)
        s.peak_host_bytes = max(s.peak_host_bytes, self.used_pages(HOST) * self.page_bytes)

    # ------------------------------------------------------------ eviction
    def _pages_of(self, b: _Block) -> list[int]:
        return [b.page] + [p for c in b.ckpts() for p in c.pages]

    def _release(self, tier: str, pages: list[int]) -> None:
        self.free[tier].extend(pages)

    def _take(self, tier: str, n: int) -> list[int] | None:
        if len(self.free[tier]) < n:
            return None
        return [self.free[tier].pop() for _ in range(n)]

    def _drop(self, bid: int) -> None:
        b = self.blocks.pop(bid)
        self.lru[b.tier].pop(bid, None)
        self._release(b.tier, self._pages_of(b))
        self.stats.dropped_blocks += 1

    def _move(self, bid: int, dst: str) -> None:
        """Copy block `bid` (and its checkpoint) to tier `dst`, whose free pages suffice; free the source."""
        b = self.blocks[bid]
        src_pages = self._pages_of(b)
        dst_pages = self._take(dst, len(src_pages))
        for s, d in zip(src_pages, dst_pages):
            self.arena[dst][d].copy_(self.arena[b.tier][s], non_blocking=True)
        self.lru[b.tier].pop(bid)
        self._release(b.tier, src_pages)
        b.tier, b.page = dst, dst_pages[0]
        at = 1
        for c in b.ckpts():
            c.pages, at = dst_pages[at:at + len(c.pages)], at + len(c.pages)
        self.lru[dst][bid] = None
        if dst == HOST:
            self.stats.to_host_blocks += 1
            self.stats.to_host_bytes += len(src_pages) * self.page_bytes

    def _make_room_host(self, n: int, keep=()) -> bool:
        """Drop least recently used host blocks (not those in `keep`) until `n` pages are free."""
        victims = iter([b for b in self.lru[HOST] if b not in keep])
        while len(self.free[HOST]) < n:
            bid = next(victims, None)
            if bid is None:
                return False
            self._drop(bid)
        return True

    def _make_room(self, n: int, keep=()) -> bool:
        """Evict least recently used device blocks (not those in `keep`) until `n` more pages fit under
        the capacity. False when they cannot."""
        t0, moved = time.perf_counter(), False
        skipped = []
        while self.used_pages(GPU) + n > self.capacity_pages() and self.lru[GPU]:
            bid = next(iter(self.lru[GPU]))
            if bid in keep:
                self.lru[GPU].move_to_end(bid)
                skipped.append(bid)
                if len(skipped) >= len(self.lru[GPU]):
                    break
                continue
            need = len(self._pages_of(self.blocks[bid]))
            if self.pages[HOST] and self._make_room_host(need, keep):
                self._move(bid, HOST)
                moved = True
            else:
                self._drop(bid)
        if moved:
            _sync(self.slots.device)
            self.stats.offload_s += time.perf_counter() - t0
        return self.used_pages(GPU) + n <= self.capacity_pages()

    def _touch(self, ids) -> None:
        """Mark blocks `ids` (a request's, in order) used now, the deepest first."""
        for bid in reversed([int(i) for i in ids]):
            b = self.blocks.get(bid)
            if b is not None:
                self.lru[b.tier].move_to_end(bid)

    # ------------------------------------------------------------ lookup and restore
    def lookup(self, ids, n_in: int, next_id: int | None = None) -> Hit:
        """The longest run of present blocks of a prompt (its full-block ids, in order) and the resume
        position (see the module docstring). next_id: the id of the block the prompt's partial last block
        begins (the chain's next block), if it has one. Changes nothing; `restore` counts what is used."""
        ids = np.asarray(ids, dtype=np.int64)
        h = 0
        while h < len(ids) and int(ids[h]) in self.blocks:
            h += 1
        best, where = 0, -1
        for j in range(h):
            for ck in self.blocks[int(ids[j])].ckpts():
                if ck.pos > n_in - 1 or ck.pos <= best:
                    continue
                nxt = int(ids[j + 1]) if j + 1 < len(ids) else next_id
                if ck.tail_of is not None and nxt != ck.tail_of:
                    continue
                best, where = ck.pos, j
        host = sum(self.blocks[int(i)].tier == HOST for i in ids[:where + 1])
        return Hit(h, best, where, host, ids, n_in)

    def restore(self, hit: Hit, slot: int, stage: int) -> tuple[int, float]:
        """Copy the state at `hit.resume` into `slot`'s latent rows [0, share(resume)) and staging entry
        `stage` (zeros at resume 0); host-tier blocks come back to device pages first. Returns (the
        position resumed at, seconds of the host -> device copies). Resumes at 0 (and counts a failed
        restore) when the device budget left by the running sequences cannot hold the hit's pages."""
        sc, s = self.slots, self.stats
        sc.reset_stage(stage)
        s.lookups += 1
        s.prompt_tokens += hit.n_in
        s.mla_hit_tokens += min(hit.blocks * self.block_size, hit.n_in)
        if not hit.resume:
            return 0, 0.0
        n_full = hit.ckpt_block + 1  # a checkpoint of block j lies in [(j + 1), (j + 2)) x block_size
        need = [int(i) for i in hit.ids[:n_full]]
        host_s = self._bring_back(need)
        if host_s is None:
            s.restore_failed += 1
            return 0, 0.0
        pages = torch.tensor([self.blocks[i].page for i in need], dtype=torch.long, device=sc.device)
        for k, i in enumerate(sc.mla_layers):
            dst = sc.latent[i][slot, :n_full * self.rows].view(n_full, self.rows, -1)
            dst.copy_(self.arena[GPU][:, k].index_select(0, pages))
        b = self.blocks[need[-1]]
        ck = next(c for c in b.ckpts() if c.pos == hit.resume)
        self._read_ckpt(ck, slot, stage, n_full)
        s.restored_device_bytes += n_full * self.page_bytes + ck.nbytes
        s.hit_tokens += hit.resume
        s.host_hit_tokens += min(hit.resume, hit.host_blocks * self.block_size)
        self._touch(hit.ids[:hit.blocks])
        return hit.resume, host_s

    def _bring_back(self, need: list[int]) -> float | None:
        """Move the host-tier blocks among `need` to device pages; their copy's seconds, or None when the
        device capacity cannot take them."""
        back = [i for i in need if self.blocks[i].tier == HOST]
        if not back:
            return 0.0
        n = sum(len(self._pages_of(self.blocks[i])) for i in back)
        if not self._make_room(n, keep=set(need)):
            return None
        _sync(self.slots.device)
        t0 = time.perf_counter()
        for i in back:
            self._move(i, GPU)
            self.stats.restored_host_bytes += len(self._pages_of(self.blocks[i])) * self.page_bytes
        _sync(self.slots.device)
        dt = time.perf_counter() - t0
        self.stats.restore_host_s += dt
        return dt

    # ------------------------------------------------------------ checkpoints as bytes
    def _ckpt_tensors(self, slot: int, stage: int, n_full: int, tail: int) -> list[torch.Tensor]:
        """The byte views a checkpoint holds: staging state and convs, then the tail rows per MLA layer."""
        sc = self.slots
        out = [sc.stage_state[stage].view(-1).view(torch.uint8),
               sc.stage_conv[stage].reshape(-1).view(torch.uint8)]
        r0 = n_full * self.rows
        for i in sc.mla_layers:
            if tail:
                out.append(sc.latent[i][slot, r0:r0 + tail].reshape(-1).view(torch.uint8))
        return out

    def _write_ckpt(self, ck: _Ckpt, parts: list[torch.Tensor]) -> None:
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        pb = self.page_bytes
        for k, page in enumerate(ck.pages):
            piece = flat[k * pb:(k + 1) * pb]
            self.bytes_view[GPU][page, :piece.numel()].copy_(piece)

    def _read_ckpt(self, ck: _Ckpt, slot: int, stage: int, n_full: int) -> None:
        tail = self.slots.share(ck.pos) - n_full * self.rows
        parts = self._ckpt_tensors(slot, stage, n_full, tail)
        pages = torch.tensor(ck.pages, dtype=torch.long, device=self.slots.device)
        flat = self.bytes_view[GPU].index_select(0, pages).view(-1)
        at = 0
        for p in parts:
            p.copy_(flat[at:at + p.numel()])
            at += p.numel()

    # ------------------------------------------------------------ store
    def store(self, ids, slot: int, upto: int, *, stage: int | None = None, checkpoint: tuple | None = None,
              supersedes: tuple | None = None) -> int:
        """After a prefill chunk: keep blocks `ids[:upto]` of the sequence in `slot` (those absent are copied
        from its latent rows) and, with `checkpoint` = (pos, tail_of), the KDA state of staging entry
        `stage` at position pos (the chunk's end), attached to block pos // block_size - 1 (the last full
        block before pos; tail_of None for a grid checkpoint at a block boundary, else the id of the block
        the partial rows [.., pos) begin). supersedes: (block id, pos) of the end checkpoint this request
        resumed from, dropped now that a later end is stored. Returns blocks stored."""
        ids = [int(i) for i in np.asarray(ids)[:upto]]
        if supersedes is not None and checkpoint is not None and checkpoint[1] is not None:
            old = self.blocks.get(int(supersedes[0]))
            if old is not None and old.end is not None and old.end.pos == supersedes[1]:
                self._release(old.tier, old.end.pages)
                old.end = None
                self.stats.superseded_checkpoints += 1
        new = [k for k, i in enumerate(ids) if i not in self.blocks]
        stored = 0
        if new:
            n = len(new)
            if not self._make_room(n, keep=set(ids)):
                n = max(0, min(n, self.capacity_pages() - self.used_pages(GPU)))
                self.stats.skipped_stores += len(new) - n
            new = new[:n]  # the first absent ones: a block after one that is not kept could not be found
            pages = self._take(GPU, len(new)) or []
            sc = self.slots
            if pages:
                rows = torch.tensor([k * self.rows + r for k in new for r in range(self.rows)],
                                    device=sc.device)
                dst = torch.tensor(pages, dtype=torch.long, device=sc.device)
                for m, i in enumerate(sc.mla_layers):
                    src = sc.latent[i][slot].index_select(0, rows).view(len(new), self.rows, -1)
                    self.arena[GPU][:, m].index_copy_(0, dst, src)
            for k, page in zip(new, pages):
                self.blocks[ids[k]] = _Block(GPU, page, k)
                self.lru[GPU][ids[k]] = None
            stored = len(pages)
            self.stats.stored_blocks += stored
        if checkpoint is not None:
            self._store_ckpt(ids, slot, stage, *checkpoint)
        self._touch(ids)
        self._note_peak()
        return stored

    def _store_ckpt(self, ids: list[int], slot: int, stage: int, pos: int, tail_of) -> None:
        j = pos // self.block_size - 1
        if j < 0 or j >= len(ids) or ids[j] not in self.blocks:
            return
        b = self.blocks[ids[j]]
        kind = "end" if tail_of is not None else "grid"
        old = getattr(b, kind)
        if old is not None and old.pos >= pos:
            return
        tail = self.slots.share(pos) - (j + 1) * self.rows
        parts = self._ckpt_tensors(slot, stage, j + 1, tail)
        nbytes = sum(p.numel() for p in parts)
        n = -(-nbytes // self.page_bytes)
        if b.tier == HOST or not self._make_room(n, keep=set(ids)) or ids[j] not in self.blocks:
            return
        if old is not None:
            self._release(b.tier, old.pages)
        ck = _Ckpt(pos, tail_of, self._take(GPU, n), nbytes)
        setattr(b, kind, ck)
        self._write_ckpt(ck, parts)
        self.stats.stored_checkpoints += 1

    def describe(self) -> dict:
        return {"page_bytes": self.page_bytes, "device_pages": self.pages[GPU],
                "host_pages": self.pages[HOST],
                "checkpoint_bytes": self.kda_bytes, "block_size": self.block_size,
                "checkpoint_interval": self.interval, "rows_per_block": self.rows, "dcp": self.slots.dcp,
                "dtype": str(self.slots.dtype).replace("torch.", ""),
                "host_pinned": bool(self.arena[HOST].is_pinned()) if self.pages[HOST] else False}
