"""A measured serving run: continuous batching on one TP rank over AgentX-like sessions, with chunked
prefill, a prefix cache in real memory, and every request timed.

Where it has run (CPU: the tiny preset, tests/test_serving_run.py; an H100: the serving-run study's
quick form, CUDA graphs, pinned host buffers and timed restores) is k3lab.studies.runs' part 'serving_run'.

    engine = Engine(weights, slots=16, rows=16_385, cache=CacheBudget(gpu_bytes=3.7e9, host_bytes=14e9))
    result = engine.run(Sessions.of(workload), RunSettings(concurrency=8, duration_s=25))
    result.summary()   # TTFT, TPOT, ITL, end-to-end percentiles; output and total tokens/s/GPU

What runs (one rank of the TP group; the other ranks would run the same steps in lockstep):
- Decode: `k3lab.engine.prefill.SlotDecodeStep` (the DecodeStep over shared slot caches), one per
  captured batch size, each a CUDA graph on a GPU (eager on a CPU). A step runs the smallest captured
  size that covers the highest slot in use; free slots inside it are padding (as vLLM pads to its
  captured sizes).
- Prefill: `PrefillStep` over the uncached input of the requests being prefilled, in chunks: each
  iteration takes at most `max_batched_tokens` tokens, less one per decoding sequence (vLLM's chunked
  prefill budget), in admission order; a chunk also ends at each KDA checkpoint position (so the state
  there can be kept). vLLM runs decode tokens and prefill chunks in one forward pass; here they are two
  passes of the same iteration (the weights are read twice: a rank's cost the record labels).
- The prefix cache (`pool.PrefixPool`) in the memory a rank has left (`CacheBudget`); the running
  sequences' own state is reserved from the same budget when they are admitted (their prompt and output
  rows and one KDA state), and a request waits while that does not fit.
- Collectives: the steps' stand-ins (a copy of the same bytes on this GPU), labelled in every record.

The clock. Each iteration (admission with its lookups and restores, the decode step, the prefill step)
is timed on the host around a device synchronization; the run's clock advances by those times and
jumps over idle gaps (every session thinking): no sleeping. A request arrives when its session's
previous turn ended plus its think time (closed loop: `concurrency` sessions at once, a finished
session replaced by the next). Its first token is stamped at the end of the iteration whose prefill
finishes its prompt; each later token at the end of the iteration whose decode step made it. TTFT =
first token - arrival (queueing included), ITL = gaps between a request's tokens, TPOT = (last - first)
/ (outputs - 1), end-to-end = last - arrival.

Tokens are the workload's (`workload.token_ids`, teacher forcing): outputs are decoded for their
cost; their values do not steer anything. Rates per GPU are the TP group's over its GPUs (a rank's step
time is the group's).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from k3lab.engine import RankWeights
from k3lab.engine.prefill import Chunk, PrefillStep, SlotCaches, SlotDecodeStep

from .pool import PrefixPool, cache_memory
from .workload import Sessions, token_ids

CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PERCENTILES = (50, 90, 99)
# The switches whose "on" form runs in plain PyTorch on a CPU (the rest run Triton's interpreter there,
# seconds per step): a CPU run uses these and says so.
CPU_SWITCHES = {"kda_fused": True, "pack_where_used": True, "moe_tail_sharded": True, "attn_res_fused": False,
                "grouped_experts": False, "glue_fused": False, "mla_padded": False, "kda_verify_tiles": False}


@dataclass(frozen=True)
class CacheBudget:
    """Bytes the prefix cache and the running sequences may use on the device, and the host tier's
    bytes; `source` says where the figures come from."""

    gpu_bytes: float
    host_bytes: float = 0.0
    source: str = "given"

    def __post_init__(self):
        if not (self.gpu_bytes > 0 and self.host_bytes >= 0):
            raise ValueError(f"gpu_bytes must be > 0 and host_bytes >= 0, got {self.gpu_bytes}, "
                             f"{self.host_bytes}")


@dataclass(frozen=True)
class RunSettings:
    """One run: `concurrency` sessions at once; new turns are sent until `duration_s` (run clock) or
    `max_requests` requests, then the requests in flight finish (at most `drain_s` more); DCP degree;
    `host` (use the host tier); checkpoint spacing; `max_batched_tokens` per iteration; `record_logits`
    keeps every token's logits (checks on small runs). step_cost: None (the clock is the measured time)
    or (seconds per iteration, per decoding sequence, per prefill token): a fixed clock that makes a run's
    schedule independent of the machine, for tests of the scheduler and the cache; its times are no
    measurement, and `RunResult.describe['clock']` says which clock ran."""

    concurrency: int
    duration_s: float = math.inf
    max_requests: int | None = None
    drain_s: float = math.inf
    dcp: int = 1
    host: bool = True
    checkpoint_interval: int = 2048
    max_batched_tokens: int = 8192
    record_logits: bool = False
    step_cost: tuple | None = None

    def __post_init__(self):
        if not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        if not (self.duration_s > 0 and self.drain_s >= 0):
            raise ValueError(f"duration_s must be > 0 and drain_s >= 0, got {self.duration_s}, "
                             f"{self.drain_s}")
        if self.max_requests is not None and (not isinstance(self.max_requests, int)
                                              or self.max_requests < 1):
            raise ValueError(f"max_requests must be None or a positive integer, got {self.max_requests!r}")
        if not isinstance(self.dcp, int) or self.dcp < 1:
            raise ValueError(f"dcp must be a positive integer, got {self.dcp!r}")
        if not isinstance(self.max_batched_tokens, int) or self.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be a positive integer, got "
                             f"{self.max_batched_tokens!r}")
        cost = self.step_cost
        if cost is not None and (len(cost) != 3 or not sum(cost) > 0
                                 or not all(isinstance(x, (int, float)) and x >= 0 for x in cost)):
            raise ValueError(f"step_cost must be None or three seconds >= 0 (per iteration, per decoding "
                             f"sequence, per prefill token), not all 0, got {self.step_cost!r}")


@dataclass
class _Req:
    i: int
    session: int
    turn: int
    n_in: int
    out: int
    ids: np.ndarray
    next_id: int | None
    arrival: float
    slot: int = -1
    stage: int = -1
    done: int = 0
    resume: int = 0
    resumed_end: tuple | None = None
    reserved: int = 0
    state: str = "waiting"  # waiting, prefill, decode, finished
    times: list = field(default_factory=list)
    logits: list = field(default_factory=list)


def _percentiles(xs) -> dict:
    xs = np.asarray(xs, dtype=float)
    if not len(xs):
        return {"count": 0}
    return {"count": int(len(xs)), "mean": float(xs.mean()),
            **{f"p{p}": float(np.percentile(xs, p)) for p in PERCENTILES}}


@dataclass
class RunResult:
    """A run's requests (one dict each: arrival, TTFT, TPOT, E2E in seconds, ITLs), its iterations
    (decode batch, times, prefill tokens), the pool's counters, what ran and where (describe)."""

    settings: RunSettings
    requests: list
    iterations: list
    pool: dict
    describe: dict
    incomplete: int = 0
    not_started: int = 0

    def summary(self) -> dict:
        """Per-run figures: counts, duration, output and total tokens/s/GPU, TTFT / TPOT / ITL / E2E mean
        and P50 / P90 / P99 (ms), tokens/s/user, decode step time per batch size, prefill, the cache."""
        done = [r for r in self.requests if r["finished"]]
        gpus = self.describe["gpus"]
        if done:
            t0 = min(r["arrival"] for r in done)
            t1 = max(r["end"] for r in done)
        else:
            t0 = t1 = 0.0
        dur = max(t1 - t0, 1e-12)
        out = sum(r["out"] for r in done)
        prompt = sum(r["n_in"] for r in done)
        ms = lambda key: _percentiles([r[key] * 1e3 for r in done if r[key] is not None])  # noqa: E731
        itl = [x * 1e3 for r in done for x in r["itl"]]
        tpot = [r["tpot"] for r in done if r["tpot"] is not None]
        it = self.iterations
        dec = {}
        for row in it:
            if row["decode_batch"]:
                dec.setdefault(row["decode_batch"], []).append(row["decode_s"] * 1e3)
        pf = [row for row in it if row["prefill_tokens"]]
        return {
            "requests": len(done), "incomplete": self.incomplete, "not_started": self.not_started,
            "duration_s": dur, "output_tokens": out, "prompt_tokens": prompt,
            "computed_prompt_tokens": sum(r["n_in"] - r["resume"] for r in done),
            "output_tokens_per_s_gpu": out / dur / gpus,
            "total_tokens_per_s_gpu": (out + prompt) / dur / gpus,
            "output_tokens_per_s_node": out / dur, "gpus": gpus,
            "ttft_ms": ms("ttft"), "tpot_ms": ms("tpot"), "e2e_ms": ms("e2e"), "itl_ms": _percentiles(itl),
            "tokens_per_s_user": {"p50": 1.0 / float(np.percentile(tpot, 50)) if tpot else None,
                                  "mean_of_users": float(np.mean([1.0 / t for t in tpot])) if tpot else None},
            "mean_running": float(np.mean([row["running"] for row in it])) if it else 0.0,
            "iterations": len(it),
            "decode_step_ms": {str(b): float(np.median(v)) for b, v in sorted(dec.items())},
            "decode_steps": sum(len(v) for v in dec.values()),
            "prefill_calls": len(pf), "prefill_tokens": sum(row["prefill_tokens"] for row in pf),
            "prefill_s": sum(row["prefill_s"] for row in pf),
            "prefill_store_s": sum(row.get("store_s", 0.0) for row in pf),
            "prefill_tokens_per_s": (sum(row["prefill_tokens"] for row in pf)
                                     / max(1e-12, sum(row["prefill_s"] for row in pf))),
            "iterations_with_prefill_and_decode": sum(1 for row in it if row["prefill_tokens"] and
                                                      row["decode_batch"]),
            "hit_rate": self.pool.get("hit_rate", 0.0), "cache": self.pool,
            "later_turns": self._later_turns(done),
        }

    @staticmethod
    def _later_turns(done: list) -> dict:
        """TTFT and TPOT (ms) of the requests that are not a session's first turn: the turns a warm cache
        serves, apart from the cold first prompts a short run starts with."""
        later = [r for r in done if r["turn"] > 0]
        return {"requests": len(later), "ttft_ms": _percentiles([r["ttft"] * 1e3 for r in later]),
                "tpot_ms": _percentiles([r["tpot"] * 1e3 for r in later if r["tpot"] is not None]),
                "resumed_share": (sum(r["resume"] for r in later) / max(1, sum(r["n_in"] for r in later)))}

    def as_dict(self) -> dict:
        return {"settings": asdict(self.settings), "summary": self.summary(), "describe": self.describe,
                "requests": self.requests}


class Engine:
    """One rank's serving engine for a sweep of runs: the slot caches (`slots` sequences of `rows` latent
    rows each, `staging` prompts prefilled at once), the decode steps (CUDA graphs on a GPU unless
    graphs=False), the prefill step (`max_batched_tokens` per call), and the cache memory of `cache`,
    allocated once. optimizations: the switches (default: all on; on a CPU `CPU_SWITCHES`)."""

    def __init__(self, weights: RankWeights, *, slots: int, rows: int, cache: CacheBudget, staging: int = 2,
                 max_batched_tokens: int = 8192, optimizations=None, graphs: bool | None = None,
                 log=print):
        if not isinstance(weights, RankWeights):
            raise ValueError(f"weights must be a RankWeights, got {type(weights).__name__}")  # noqa: TRY004
        if not isinstance(cache, CacheBudget):
            raise ValueError(f"cache must be a CacheBudget, got {type(cache).__name__}")  # noqa: TRY004
        self.weights, self.cache, self.log = weights, cache, log
        dev = weights.device
        on_gpu = dev.type == "cuda"
        self.graphs = on_gpu if graphs is None else bool(graphs)
        if self.graphs and not on_gpu:
            raise ValueError("graphs=True needs the weights on a CUDA device")
        opts = optimizations if optimizations is not None else ("all" if on_gpu else CPU_SWITCHES)
        t0 = time.perf_counter()
        self.slots = SlotCaches(weights.config, slots, rows, staging=staging, device=dev, dtype=weights.dtype)
        self.sizes = sorted({s for s in CAPTURE_SIZES if s < slots} | {slots})
        self.decode = {b: SlotDecodeStep(self.slots, b, weights, optimizations=opts) for b in self.sizes}
        self.prefill = PrefillStep(self.slots, weights, max_tokens=max_batched_tokens, optimizations=opts)
        self.max_batched_tokens = max_batched_tokens
        t_mem = time.perf_counter()
        self.memory = cache_memory(cache.gpu_bytes, cache.host_bytes, dev)
        self.memory_s = time.perf_counter() - t_mem  # pinning a large host tier takes seconds
        self._warm_prefill()
        if self.graphs:
            for b in self.sizes:
                self.decode[b].capture()
        self.build_s = time.perf_counter() - t0
        log(f"serving_run: engine ready in {self.build_s:.1f} s: {slots} slots x {rows} rows "
            f"({self.slots.nbytes()['latent'] / 1e9:.2f} GB latent, "
            f"{self.slots.nbytes()['kda'] / 1e9:.2f} GB KDA), decode sizes {self.sizes} "
            f"({'graphs' if self.graphs else 'eager'}), cache "
            f"{cache.gpu_bytes / 1e9:.2f} GB device + {cache.host_bytes / 1e9:.2f} GB host (allocated in "
            f"{self.memory_s:.1f} s)")

    def _warm_prefill(self) -> None:
        """One prefill call at the largest and one at a small size (compiles and autotunes before any
        timing); the slot and staging entry used are reset afterwards."""
        sc = self.slots
        n = min(self.max_batched_tokens, sc.rows - 1)
        for T in sorted({min(n, m) for m in (n, 2048, 512, 128, 32, 8)}, reverse=True):
            sc.reset_stage(0)
            ids = torch.zeros(T, dtype=torch.long, device=sc.device)
            self.prefill([Chunk(0, 0, 0, ids)])
        sc.reset_stage(0)
        _sync(sc.device)

    def describe(self, settings: RunSettings) -> dict:
        from k3lab import bench

        d = self.decode[self.sizes[0]].describe()
        return {
            "gpus": self.weights.world_size, "config": self.weights.config.name,
            "tp": self.weights.world_size,
            "dcp": settings.dcp, "dtype": d["dtype"], "projections": d["projections"],
            "switches": d["switches"], "impl": d["impl"], "notes": d["notes"], "label": d["label"],
            "collectives": "stand_in: each collective answered by a copy of its bytes on this GPU (no "
                           "communication time; DCP's query all-gather and merge not run)",
            "decode": {"sizes": self.sizes, "graphs": self.graphs, "mla_decode": d["mla_decode"],
                       "mla_backend": d["mla_backend"]},
            "prefill": {k: v for k, v in self.prefill.describe().items()
                        if k in ("max_tokens", "kda_scan", "mla_prefill", "mla_glue_prefill", "router")},
            "slots": self.slots.slots, "rows": self.slots.rows, "staging": self.slots.staging,
            "weights": {"source": self.weights.source, "distinct_layers": self.weights.distinct_layers,
                        "layers": self.weights.config.num_hidden_layers},
            "cache_budget": asdict(self.cache), "build_s": self.build_s, "memory_alloc_s": self.memory_s,
            "provenance": bench.provenance(),
        }

    # ------------------------------------------------------------ one run
    def run(self, sessions: Sessions, settings: RunSettings, *, progress=None) -> RunResult:
        """Serve `sessions` under `settings` (see the module docstring); progress(now, done) is called
        after every iteration when given."""
        if not isinstance(sessions, Sessions):
            raise ValueError(f"sessions must be a workload.Sessions, got {type(sessions).__name__}")  # noqa: TRY004
        if settings.concurrency > self.slots.slots:
            raise ValueError(f"concurrency {settings.concurrency} exceeds the engine's {self.slots.slots} "
                             f"slots")
        if settings.max_batched_tokens > self.max_batched_tokens:
            raise ValueError(f"max_batched_tokens {settings.max_batched_tokens} exceeds the engine's "
                             f"{self.max_batched_tokens}")
        sc = self.slots
        sc.set_dcp(settings.dcp)
        w = sessions.workload
        need = sc.share(sessions.max_len()) + 1
        if need > sc.rows:
            raise ValueError(f"the workload's longest request needs {need} rows at DCP{settings.dcp}; the "
                             f"engine's slots hold {sc.rows}")
        pool = PrefixPool(sc, self.cache.gpu_bytes, self.cache.host_bytes if settings.host else 0.0,
                          block_size=w.block_size, checkpoint_interval=settings.checkpoint_interval,
                          memory=self.memory)
        return _Run(self, pool, sessions, settings, progress).go()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Run:
    """The scheduler and clock of one run (Engine.run)."""

    def __init__(self, engine: Engine, pool: PrefixPool, sessions: Sessions, settings: RunSettings, progress):
        self.e, self.pool, self.s, self.cfg, self.progress = engine, pool, sessions, settings, progress
        self.sc = engine.slots
        self.vocab = engine.weights.config.vocab_size * engine.weights.world_size
        self.now = 0.0
        self.pending: list[tuple[float, int, int]] = []  # (arrival, session, turn index)
        self.queue: list[_Req] = []
        self.active: list[_Req] = []
        self.finished: list[_Req] = []
        self.free_slots = list(range(settings.concurrency))
        self.free_stages = list(range(self.sc.staging))
        self.next_session = 0
        self.scheduled = 0
        self.iterations: list[dict] = []
        self.reserved = 0
        self.per_seq_kda = pool.kda_bytes
        self.row_bytes = pool.n_mla * self.sc.config.mla_latent_dim * pool.elsize

    # ------------------------------------------------------------ sessions and arrivals
    def _start_session(self) -> None:
        if self.next_session >= len(self.s.order):
            return
        s = self.s.order[self.next_session]
        self.next_session += 1
        self._schedule(s, 0, self.now)

    def _schedule(self, session: int, turn: int, at: float) -> None:
        cfg = self.cfg
        if at >= cfg.duration_s or (cfg.max_requests is not None and self.scheduled >= cfg.max_requests):
            return
        turns = self.s.turns[session]
        if turn >= len(turns):
            self._start_session()
            return
        self.scheduled += 1
        self.pending.append((at + (self.s.think[turns[turn]] if turn else 0.0), session, turn))
        self.pending.sort()

    def _arrive(self) -> None:
        w = self.s.workload
        while self.pending and self.pending[0][0] <= self.now:
            at, session, turn = self.pending.pop(0)
            i = self.s.turns[session][turn]
            chain = w.chains[int(w.chain[i])]
            n_in, n_full = int(w.in_tokens[i]), int(w.n_full[i])
            nxt = int(chain[n_full]) if n_full < len(chain) else None  # the block the partial one begins
            self.queue.append(_Req(i, session, turn, n_in, int(w.out_tokens[i]), chain[:n_full], nxt, at))

    # ------------------------------------------------------------ admission
    def _bytes(self, r: _Req) -> int:
        return self.per_seq_kda + self.sc.share(r.n_in + r.out) * self.row_bytes

    def _admit(self) -> float:
        """Admit waiting requests while a slot, a staging entry and the memory allow; returns the host ->
        device restore seconds."""
        host_s = 0.0
        while self.queue and self.free_slots and self.free_stages:
            r = self.queue[0]
            need = self.reserved + self._bytes(r)
            if need > self.pool.pages["gpu"] * self.pool.page_bytes:
                if not self.active:
                    budget = self.pool.pages["gpu"] * self.pool.page_bytes
                    raise RuntimeError(f"request {r.i} needs {self._bytes(r) / 1e6:.1f} MB of running state; "
                                       f"the device budget is {budget / 1e6:.1f} MB")
                break
            self.queue.pop(0)
            r.slot, r.stage = self.free_slots.pop(0), self.free_stages.pop(0)
            self.free_slots.sort()
            hit = self.pool.lookup(r.ids, r.n_in, r.next_id)
            resume, s = self.pool.restore(hit, r.slot, r.stage)
            host_s += s
            r.done = r.resume = resume
            if resume and resume % self.s.workload.block_size:
                r.resumed_end = (int(r.ids[hit.ckpt_block]), hit.resume)
            r.reserved, self.reserved = self._bytes(r), need
            self.pool.reserve(self.reserved)
            r.state = "prefill"
            self.active.append(r)
        return host_s

    # ------------------------------------------------------------ one iteration
    def _decode(self, decoding: list[_Req]) -> tuple[int, float]:
        if not decoding:
            return 0, 0.0
        t0 = time.perf_counter()
        top = max(r.slot for r in decoding) + 1
        b = next(s for s in self.e.sizes if s >= top)
        step = self.e.decode[b]
        ids = torch.zeros(b, 1, dtype=torch.long)
        positions = {}
        for r in decoding:
            n = r.n_in + len(r.times) - 1  # the position of the last token made
            ids[r.slot, 0] = int(token_ids(self.s.workload, r.i, n, n + 1, self.vocab)[0])
            positions[r.slot] = n
        self.sc.set_decode(positions)
        step.ids.copy_(ids, non_blocking=True)
        logits = step.replay() if self.e.graphs else step.run()
        if self.cfg.record_logits:
            for r in decoding:
                r.logits.append(logits[r.slot, 0].detach().to("cpu", copy=True))
        _sync(self.sc.device)
        return b, time.perf_counter() - t0

    def _prefill(self, budget: int) -> tuple[list[_Req], int, float, float]:
        """Chunks of the requests being prefilled within `budget` tokens; returns (requests whose prompt
        is done, tokens run, seconds, the part of them spent storing finished prompts and checkpoints in
        the pool after the chunks' compute, a device sync on each side)."""
        chunks, reqs, iv = [], [], self.cfg.checkpoint_interval
        for r in self.active:
            if r.state != "prefill" or budget <= 0 or len(chunks) >= self.sc.staging:
                continue
            end = min(r.n_in, r.done + budget)
            if iv:
                end = min(end, (r.done // iv + 1) * iv)
            ids = torch.from_numpy(token_ids(self.s.workload, r.i, r.done, end, self.vocab))
            chunks.append(Chunk(r.slot, r.stage, r.done, ids))
            reqs.append(r)
            budget -= end - r.done
        if not chunks:
            return [], 0, 0.0, 0.0
        t0 = time.perf_counter()
        logits = self.e.prefill(chunks)
        _sync(self.sc.device)
        t1 = time.perf_counter()
        finished, B = [], self.s.workload.block_size
        for c, r, row in zip(chunks, reqs, logits):
            r.done += c.tokens
            if r.done == r.n_in:
                # the end checkpoint's partial rows begin block next_id; past the chain, no prompt has
                # that block (an id no lookup matches)
                tail_of = (r.next_id if r.next_id is not None else -1 - r.i) if r.n_in % B else None
                self.pool.store(r.ids, r.slot, len(r.ids), stage=r.stage, checkpoint=(r.n_in, tail_of),
                                supersedes=r.resumed_end)
                self.sc.join(r.stage, r.slot)
                self.free_stages.append(r.stage)
                self.free_stages.sort()
                r.state = "decode"
                if self.cfg.record_logits:
                    r.logits.append(row.detach().to("cpu", copy=True))
                finished.append(r)
            elif iv and r.done % iv == 0:
                self.pool.store(r.ids, r.slot, r.done // B, stage=r.stage, checkpoint=(r.done, None))
        _sync(self.sc.device)
        t2 = time.perf_counter()
        return finished, sum(c.tokens for c in chunks), t2 - t0, t2 - t1

    def _step(self) -> None:
        _sync(self.sc.device)
        t0 = time.perf_counter()
        host_s = self._admit()
        decoding = [r for r in self.active if r.state == "decode"]
        b, dec_s = self._decode(decoding)
        first, tokens, pf_s, store_s = self._prefill(self.cfg.max_batched_tokens - len(decoding))
        _sync(self.sc.device)
        dt = time.perf_counter() - t0
        if self.cfg.step_cost is not None:
            c0, c1, c2 = self.cfg.step_cost
            dt = c0 + c1 * len(decoding) + c2 * tokens
        self.now += dt
        for r in decoding + first:
            r.times.append(self.now)
        self.iterations.append({"t": self.now, "dt": dt, "running": len(self.active), "decode_batch": b,
                                "decode_seqs": len(decoding), "decode_s": dec_s, "prefill_tokens": tokens,
                                "prefill_s": pf_s, "store_s": store_s, "restore_host_s": host_s})
        for r in [r for r in self.active if r.state == "decode" and len(r.times) >= r.out]:
            self._finish(r)

    def _finish(self, r: _Req) -> None:
        r.state = "finished"
        self.active.remove(r)
        self.finished.append(r)
        self.free_slots.append(r.slot)
        self.free_slots.sort()
        self.reserved -= r.reserved
        self.pool.reserve(self.reserved)
        self._schedule(r.session, r.turn + 1, self.now)

    # ------------------------------------------------------------ the loop
    def go(self) -> RunResult:
        for _ in range(self.cfg.concurrency):
            self._start_session()
        stop_at = self.cfg.duration_s + self.cfg.drain_s
        while True:
            self._arrive()
            if not self.active and not self.queue:
                if not self.pending:
                    break
                self.now = max(self.now, self.pending[0][0])
                continue
            if self.now > stop_at:
                break
            self._step()
            if self.progress is not None:
                self.progress(self.now, len(self.finished))
        incomplete = len(self.active)
        not_started = len(self.queue) + len(self.pending)
        reqs = [self._row(r) for r in self.finished + self.active]
        clock = ("measured: host time around each iteration, after a device synchronization"
                 if self.cfg.step_cost is None
                 else f"fixed step costs {self.cfg.step_cost} s (not a measurement)")
        return RunResult(self.cfg, reqs, self.iterations, self.pool.stats.as_dict(),
                         {**self.e.describe(self.cfg), "pool": self.pool.describe(), "clock": clock},
                         incomplete, not_started)

    def _row(self, r: _Req) -> dict:
        t = r.times
        fin = r.state == "finished"
        row = {"request": r.i, "session": r.session, "turn": r.turn, "n_in": r.n_in, "out": r.out,
               "resume": r.resume, "arrival": r.arrival, "finished": fin, "tokens": len(t),
               "ttft": t[0] - r.arrival if t else None, "end": t[-1] if t else None,
               "e2e": t[-1] - r.arrival if fin else None,
               "tpot": (t[-1] - t[0]) / (len(t) - 1) if fin and len(t) > 1 else None,
               "itl": list(np.diff(t)) if len(t) > 1 else []}
        if self.cfg.record_logits:
            row["logits"] = r.logits
        return row

