"""The serving rank's steps: slot caches shared by every step, a decode step over them, and a prefill step
that runs chunks of uncached input for several sequences at once.

Where it has run (CPU: the tiny preset, tests/test_serving_run.py; an H100: the serving-run study's
quick form, CUDA graphs, pinned host buffers and timed restores) is k3lab.studies.runs' part 'serving_run'.

    slots = SlotCaches(config, slots=16, rows=8193, staging=4, device=..., dtype=...)
    decode = {b: SlotDecodeStep(slots, b, weights) for b in (1, 2, 4, 8, 16)}   # one graph per size
    prefill = PrefillStep(slots, weights, max_tokens=8192)
    logits = prefill([Chunk(slot=3, stage=0, start=0, ids=prompt[:4096])])    # [1, vocab], last token
    slots.join(stage=0, slot=3)                                              # prompt done: decode it
    slots.set_decode({3: 4096}); decode[4](ids)                              # one token for slot 3

`SlotCaches` holds one rank's caches for `slots` sequences: per MLA layer a latent buffer [slots, rows, 576]
(a sequence's rows in order of position; the last row is a trash row), per KDA layer the decode state
(`KDACache` of [slots, ...] tensors), and `staging` KDA states for prompts being prefilled (one tensor
per kind, [staging, KDA layers, ...], so that a checkpoint is one contiguous copy). A prompt's KDA state
lives in its staging entry until the prompt is done, then `join` copies it into the decode slot: the
decode steps update every slot of their batch (free ones too, harmlessly), so a state being prefilled
must not sit in a decode slot.

`SlotDecodeStep` is a `DecodeStep` whose caches are the first `batch` slots of a `SlotCaches` (so the
steps of every batch size, each captured as its own CUDA graph, read the same memory), and whose MLA
layers write each sequence's new latent row at that sequence's own position (`SlotCaches.write_rows`,
set before each step on the device, read inside the graph), not at one position for the whole batch:
the projections' rows go to a scratch buffer and the bound attention plan scatters them first
(`_ScatterPlan`). Attention reads each sequence's own length (`SlotCaches.lengths`). Where the MLA
decode kernels run only in Triton's interpreter (a CPU), the plan is the PyTorch reference
(k3lab.nn.mla.latent_attention) and `resolved.notes['mla_padded']` says so.

`PrefillStep` runs a packed batch of chunks (each a sequence's next `T` tokens after `start` cached
positions) through every layer with the decode step's own bound ops (AttnRes mix, projections, the
router, the grouped experts, the SiTU-GLU, the MoE tail, stand-in collectives): per KDA layer the
short convs per sequence from its staging conv state, then one chunked scan over all chunks
(k3lab.ops.kda_chunk with cu_seqlens on a GPU; on a CPU a k3lab.nn.kda form per chunk, since the
interpreter is seconds per launch), the staging states updated; per MLA layer the new latent rows
written into each sequence's slot at [start, start + T) and absorbed attention of the chunk over its
history and itself (`chunk_attention`, causal, tiled over keys with a running softmax, fp32 softmax
statistics); then logits of each chunk's last token only. The MLA glue runs its PyTorch backend here (the
Triton glue is shaped for one token per sequence).

DCP (`SlotCaches(dcp=d)`): the rank holds every d-th position of each sequence's MLA history (positions
0, d, 2d, ...: row p // d), so buffers, lengths and written rows are the rank's share; prefill attention
runs d x the TP heads over the share (a DCP rank's work: all heads of its positions; the merge across
ranks is not run), decode attention runs the TP step's heads over the share (the same bytes; the query
all-gather and the LSE merge are collectives, not run here). With d > 1 the outputs are not the
model's (only the share is attended): DCP changes what a rank holds and reads, for timing and capacity.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from k3lab.config import K3Config
from k3lab.nn import KDACache
from k3lab.nn.kda import kda_beta, kda_chunked, kda_gate, kda_recurrent, short_conv
from k3lab.nn.mla import latent_attention
from k3lab.nn.norms import gated_rms_norm, l2_normalize
from k3lab.ops import kda_chunk, mla_glue

from . import layers
from .fp8 import linear
from .step import DecodeStep, _check_int
from .weights import RankWeights

KDA_SCANS = ("ops", "chunked", "recurrent")
MLA_DECODES = ("ops", "reference")
SCORE_ELEMENTS = 1 << 25  # fp32 scores per key tile of chunk_attention (128 MiB)


def _device_default_scan(device: torch.device) -> str:
    return "ops" if device.type == "cuda" else "recurrent"


class SlotCaches:
    """One rank's caches of `slots` sequences (see the module docstring).

    config: the rank's slice; rows: latent rows per slot (the longest sequence's share of positions, plus
    the trash row); staging: prompts that can be prefilled at once; dcp: the DCP degree (1: the rank
    holds every position). Buffers are zeros; `lengths` [slots] int32 and `write_rows` [slots] int64 live on
    the device (the decode steps' graphs read them)."""

    def __init__(self, config: K3Config, slots: int, rows: int, *, staging: int = 2, dcp: int = 1,
                 device=None, dtype=None):
        if not isinstance(config, K3Config):
            raise ValueError(f"config must be a K3Config, got {type(config).__name__}")  # noqa: TRY004
        self.config = config
        self.slots = _check_int("slots", slots, 1)
        self.rows = _check_int("rows", rows, 2)
        self.staging = _check_int("staging", staging, 1)
        self.dcp = _check_int("dcp", dcp, 1)
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        c, f = config, {"device": self.device, "dtype": self.dtype}
        C, H, K, W = c.kda_width, c.kda_num_heads, c.kda_head_dim, c.kda_conv_size
        kinds = c.layer_types
        self.mla_layers = [i for i, k in enumerate(kinds) if k == "mla"]
        self.kda_layers = [i for i, k in enumerate(kinds) if k == "kda"]
        self.kda_index = {i: n for n, i in enumerate(self.kda_layers)}
        self.latent = {i: torch.zeros(slots, rows, c.mla_latent_dim, **f) for i in self.mla_layers}
        self.kda = {i: KDACache(*(torch.zeros(slots, C, W - 1, **f) for _ in range(3)),
                                torch.zeros(slots, H, K, K, device=self.device, dtype=torch.float32))
                    for i in self.kda_layers}
        n = len(self.kda_layers)
        self.stage_state = torch.zeros(staging, n, H, K, K, device=self.device, dtype=torch.float32)
        self.stage_conv = torch.zeros(staging, n, 3, C, W - 1, **f)
        self.lengths = torch.ones(slots, dtype=torch.int32, device=self.device)
        self.write_rows = torch.zeros(slots, dtype=torch.int64, device=self.device)
        self.set_decode({})

    # ------------------------------------------------------------ positions and the rank's share
    def set_dcp(self, dcp: int) -> None:
        """Hold every `dcp`-th position from now on (the buffers keep their rows; steps bound to them stay
        valid). Every slot's contents are stale afterwards."""
        self.dcp = _check_int("dcp", dcp, 1)
        self.set_decode({})

    def share(self, positions: int) -> int:
        """Rows this rank holds of the first `positions` positions (ceil(positions / dcp))."""
        return -(-positions // self.dcp)

    def set_decode(self, positions: dict[int, int]) -> None:
        """Before a decode step: `positions` maps each decoding slot to its sequence's length before the
        step (the new token's position). Those slots attend their share of positions [0, n] and write the
        new row at row n // dcp; every other slot attends one row and writes the trash row."""
        lengths = [1] * self.slots
        rows = [s * self.rows + self.rows - 1 for s in range(self.slots)]
        for s, n in positions.items():
            if not 0 <= s < self.slots:
                raise ValueError(f"positions: slot {s} is outside [0, {self.slots})")
            if not 0 <= n // self.dcp < self.rows - 1:
                raise ValueError(f"positions: slot {s} at position {n} needs row {n // self.dcp}; slots hold "
                                 f"{self.rows - 1} rows (the last is the trash row)")
            lengths[s], rows[s] = n // self.dcp + 1, s * self.rows + n // self.dcp
        self.lengths.copy_(torch.tensor(lengths, dtype=torch.int32), non_blocking=True)
        self.write_rows.copy_(torch.tensor(rows, dtype=torch.int64), non_blocking=True)

    # ------------------------------------------------------------ moving states
    def stage_entries(self, stage: int) -> dict[str, torch.Tensor]:
        """Staging entry `stage` under K3Cache's names ('layers.{i}.conv_q' / conv_k / conv_v / state)."""
        out = {}
        for i, n in self.kda_index.items():
            for j, name in enumerate(("conv_q", "conv_k", "conv_v")):
                out[f"layers.{i}.{name}"] = self.stage_conv[stage, n, j]
            out[f"layers.{i}.state"] = self.stage_state[stage, n]
        return out

    def _pairs(self, stage: int, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        dst, src = [], []
        for i, n in self.kda_index.items():
            cache = self.kda[i]
            dst += [cache.conv_q[slot], cache.conv_k[slot], cache.conv_v[slot], cache.state[slot]]
            src += [self.stage_conv[stage, n, 0], self.stage_conv[stage, n, 1], self.stage_conv[stage, n, 2],
                    self.stage_state[stage, n]]
        return dst, src

    def join(self, stage: int, slot: int) -> None:
        """Copy staging entry `stage` (a prompt's KDA state after its last chunk) into decode slot `slot`."""
        dst, src = self._pairs(stage, slot)
        torch._foreach_copy_(dst, src)

    def reset_stage(self, stage: int) -> None:
        """Staging entry `stage` at the start of a sequence: zero conv histories and state."""
        self.stage_state[stage].zero_()
        self.stage_conv[stage].zero_()

    def load(self, cache, batch_index: int, *, slot: int, stage: int | None = None) -> None:
        """Put sequence `batch_index` of a K3Cache (K3Model.prefill / decode; whole model, TP 1) into
        `slot`'s latent rows [0, share(length)) and its KDA state into staging entry `stage` (None: into
        the decode slot itself)."""
        n = cache.length
        if self.share(n) > self.rows - 1:
            raise ValueError(f"cache holds {n} positions; slots hold {self.rows - 1} rows")
        for i in self.mla_layers:
            self.latent[i][slot, :self.share(n)].copy_(cache.layers[i].latent[batch_index, ::self.dcp])
        if stage is None:
            for i in self.kda_layers:
                for name, t in cache.layers[i].entries().items():
                    getattr(self.kda[i], name)[slot].copy_(t[batch_index])
            return
        for name, t in self.stage_entries(stage).items():
            i, field = int(name.split(".")[1]), name.split(".")[2]
            t.copy_(getattr(cache.layers[i], field)[batch_index])

    def nbytes(self) -> dict[str, int]:
        """Bytes held: 'latent' (every slot's rows), 'kda' (decode states), 'staging'."""
        size = lambda t: t.numel() * t.element_size()  # noqa: E731
        return {"latent": sum(size(t) for t in self.latent.values()),
                "kda": sum(c.nbytes() for c in self.kda.values()),
                "staging": size(self.stage_state) + size(self.stage_conv)}


class _ScatterPlan:
    """A bound MLA attention that first scatters the step's new latent rows (`scratch` [B, 1, 576]) to
    each sequence's row (`write_rows`, flat indices into latent [B * rows, 576]), then attends: the
    decode plan (`inner`) or, where `inner` is None, the PyTorch reference over `lengths`."""

    def __init__(self, scratch, latent, write_rows, inner, q_buf, lengths, scale):
        self.scratch, self.latent, self.write_rows, self.inner = scratch, latent, write_rows, inner
        self.q_buf, self.lengths, self.scale = q_buf, lengths, scale
        self.backend = getattr(inner, "backend", "torch reference")

    def __call__(self):
        B = self.scratch.shape[0]
        self.latent.view(-1, self.latent.shape[-1]).index_copy_(0, self.write_rows, self.scratch.view(B, -1))
        if self.inner is not None:
            return self.inner()
        o, lse = latent_attention(self.q_buf, self.latent, self.lengths, scale=self.scale)
        return o.to(self.q_buf.dtype), lse


def _check_shared(caches, weights, kw: dict) -> None:
    """The checks a step over slot caches shares: their types, one config, device and dtype, and no
    keyword that the caches and weights fix."""
    if not isinstance(caches, SlotCaches):
        raise ValueError(f"caches must be a SlotCaches, got {type(caches).__name__}")  # noqa: TRY004
    if not isinstance(weights, RankWeights) or weights.config != caches.config:
        raise ValueError(f"weights must be a RankWeights for config {caches.config.name}")
    if weights.device != caches.device or weights.dtype != caches.dtype:
        raise ValueError(f"weights ({weights.device}, {weights.dtype}) and caches ({caches.device}, "
                         f"{caches.dtype}) must share device and dtype")
    for bad in ("q_len", "context_len", "weights", "tp", "device", "dtype"):
        if bad in kw:
            raise ValueError(f"{bad} is fixed by the slot caches and weights; not an argument here")


class SlotDecodeStep(DecodeStep):
    """A decode step (q_len 1) over the first `batch` slots of `caches`, with `weights` shared by every
    step of the run (see the module docstring). mla_decode: 'ops' (k3lab.ops.mla_decode's plan, as
    DecodeStep binds it) or 'reference' (k3lab.nn.mla.latent_attention); None: 'ops' on a GPU, 'reference'
    on a CPU. Other keywords as DecodeStep (optimizations, strict, collectives, projections)."""

    def __init__(self, caches: SlotCaches, batch: int, weights: RankWeights, *, mla_decode: str | None = None,
                 **kw):
        _check_shared(caches, weights, kw)
        if not isinstance(batch, int) or not 1 <= batch <= caches.slots:
            raise ValueError(f"batch must be an integer in [1, slots={caches.slots}], got {batch!r}")
        mla_decode = mla_decode or ("ops" if caches.device.type == "cuda" else "reference")
        if mla_decode not in MLA_DECODES:
            raise ValueError(f"mla_decode must be one of {MLA_DECODES}, got {mla_decode!r}")
        self.slot_caches, self.mla_decode = caches, mla_decode
        super().__init__(caches.config, batch, caches.rows - 1, weights=weights, **kw)
        if mla_decode == "reference":
            self.resolved.notes["mla_padded"] = ("MLA attention by the PyTorch reference "
                                                 "(k3lab.nn.mla.latent_attention): mla_decode='reference'")

    def _alloc(self, seed: int) -> None:
        sc, B, D = self.slot_caches, self.batch, self.config.hidden_size
        f = {"device": self.device, "dtype": self.dtype}
        self.kda_caches = {i: KDACache(*(t[:B] for t in c.entries().values())) for i, c in sc.kda.items()}
        self.latent = {i: t[:B] for i, t in sc.latent.items()}
        self.scratch = {i: torch.zeros(B, 1, self.config.mla_latent_dim, **f) for i in self.latent}
        self.lengths = sc.lengths[:B]
        self.write_rows = sc.write_rows[:B]
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self.prefix = torch.zeros(B, D, **f)
        self.blocks = torch.zeros(len(self.block_starts), B, D, **f)
        self.states = None

    def _bind(self) -> None:
        # The MLA plans split each history into pieces sized at plan time from the longest length; plan
        # for full slots, so that any length up to the capacity is covered (shorter ones leave pieces idle).
        sc = self.slot_caches
        saved = sc.lengths.clone()
        sc.lengths.fill_(sc.rows - 1)
        super()._bind()
        sc.lengths.copy_(saved)
        for i, plan in list(self.mla_plans.items()):
            self.mla_plans[i] = _ScatterPlan(self.scratch[i], self.latent[i], self.write_rows,
                                             plan if self.mla_decode == "ops" else None, self.q_bufs[i],
                                             self.lengths, self.config.mla_softmax_scale)

    def _attention(self, i: int, w, x: torch.Tensor):
        if i not in self.latent:
            return (yield from super()._attention(i, w, x))
        part = layers.mla_partial(w, x, self.scratch[i], 0, self.q_bufs[i], self.mla_plans[i], self.mla_glue)
        return (yield from self._collective("all_reduce", part))

    def describe(self) -> dict:
        return {**super().describe(), "slots": self.slot_caches.slots, "dcp": self.slot_caches.dcp,
                "mla_decode": self.mla_decode}


# ---------------------------------------------------------------------------------------------- prefill
@dataclass(frozen=True)
class Chunk:
    """A sequence's next tokens for a prefill step: `ids` [T] (T >= 1) at positions [start, start + T) of
    the sequence in `slot`, whose KDA state is in staging entry `stage`."""

    slot: int
    stage: int
    start: int
    ids: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])


@functools.lru_cache(maxsize=None)
def _mm_fp32_out(device: str, dtype: torch.dtype) -> bool:
    """Whether torch.mm takes out_dtype=float32 for `dtype` operands here (fp32 scores from 16-bit
    operands in one product); else the operands are converted to fp32 first."""
    a, c = torch.ones(4, 16, device=device, dtype=dtype), torch.ones(8, 16, device=device, dtype=dtype)
    try:  # the layouts chunk_attention uses: a transposed right operand, then a column slice of rows
        s = torch.mm(a, c.t(), out_dtype=torch.float32)
        torch.mm(s.to(dtype), c[:, :8], out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 (fp64 for fp64): 16-bit operands multiplied with an fp32 result where torch can."""
    if a.dtype in (torch.float32, torch.float64):
        return a @ b
    if _mm_fp32_out(str(a.device), a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def chunk_attention(q: torch.Tensor, kv: torch.Tensor, start: int, *, scale: float, value_dim: int = 512,
                    key_stride: int = 1) -> torch.Tensor:
    """Absorbed MLA attention of a chunk: q [T, H, D] (queries at positions start .. start + T - 1) over
    latent rows kv [L, D] (row j at position j * key_stride), causal: a query sees the rows at positions
    <= its own. Values are kv's first `value_dim` columns. Computed over tiles of keys with a running
    max and sum in fp32 (the products in fp32 too where torch allows, else on fp32 copies); returns
    [T, H, value_dim] in q's dtype (fp64 in, fp64 out)."""
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [T, H, D] and kv [L, D] with q's D, got {tuple(q.shape)} and "
                         f"{tuple(kv.shape)}")
    T, H, D = q.shape
    L = kv.shape[0]
    last = (start + T - 1) // key_stride + 1  # rows any query can see
    if last > L:
        raise ValueError(f"kv holds {L} rows; the chunk's last query sees {last}")
    acc_dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = (q.reshape(T * H, D) * scale).to(q.dtype)
    m = torch.full((T * H, 1), float("-inf"), device=q.device, dtype=acc_dt)
    den = torch.zeros(T * H, 1, device=q.device, dtype=acc_dt)
    acc = torch.zeros(T * H, value_dim, device=q.device, dtype=acc_dt)
    qpos = (start + torch.arange(T, device=q.device)).repeat_interleave(H)[:, None]  # [T*H, 1]
    tile = max(64, SCORE_ELEMENTS // (T * H) // 64 * 64)
    first_masked = start // key_stride  # rows before it are visible to every query
    for k0 in range(0, last, tile):
        k1 = min(last, k0 + tile)
        s = _mm32(qf, kv[k0:k1].t()).to(acc_dt)
        if k1 > first_masked:
            kpos = torch.arange(k0, k1, device=q.device) * key_stride
            s = s.masked_fill(kpos[None, :] > qpos, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = (m - m_new).exp()
        p = (s - m_new).exp()
        den = den * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + _mm32(p.to(kv.dtype) if acc_dt == torch.float32 else p, kv[k0:k1, :value_dim]).to(
            acc_dt)
        m = m_new
    return (acc / den).view(T, H, value_dim).to(q.dtype)


class PrefillStep(DecodeStep):
    """Chunks of several sequences through every layer of one rank (see the module docstring).

    caches: the SlotCaches the chunks' sequences live in; weights: the run's RankWeights; max_tokens: the
    most tokens one call takes (buffers are sized for it; the router's choice of kernel is made for it).
    kda_scan: 'ops' (k3lab.ops.kda_chunk, the group scan), 'chunked' or 'recurrent' (k3lab.nn.kda's
    kda_chunked / kda_recurrent per chunk, PyTorch); None: 'ops' on a GPU, 'recurrent' on a CPU (at the
    tiny preset's two heads the token walk is several times faster than the chunked form's [64, 64, 128]
    decay tensors). Other keywords as DecodeStep (optimizations,
    strict, collectives, projections). A call returns logits [chunks, vocab] (fp32) of each chunk's last
    token; the slots' latent rows and the staging states are updated in place."""

    def __init__(self, caches: SlotCaches, weights: RankWeights, *, max_tokens: int = 8192,
                 kda_scan: str | None = None, **kw):
        _check_shared(caches, weights, kw)
        kda_scan = kda_scan or _device_default_scan(caches.device)
        if kda_scan not in KDA_SCANS:
            raise ValueError(f"kda_scan must be one of {KDA_SCANS}, got {kda_scan!r}")
        self.slot_caches, self.kda_scan = caches, kda_scan
        super().__init__(caches.config, _check_int("max_tokens", max_tokens, 1), 0, weights=weights, **kw)
        self.max_tokens = max_tokens
        self.chunks: list[Chunk] = []

    def _bind(self) -> None:
        """DecodeStep's binding, except the AttnRes mixes: their kernel is picked by the token count, which
        here is the call's chunks' and changes from call to call, so each mix binds per call."""
        super()._bind()
        bind = self.resolved.rows["attn_res_norm"].bind

        def mix(prefix, delta, blocks, n_blocks, *args, **kw):
            kernel = bind(prefix, blocks, n_blocks, delta is not None)
            return kernel(prefix, delta, blocks, n_blocks, *args, **kw)

        self.mixes = dict.fromkeys(self.mixes, mix)

    def _alloc(self, seed: int) -> None:
        N, D = self.batch, self.config.hidden_size
        f = {"device": self.device, "dtype": self.dtype}
        self.kda_caches, self.latent = {}, {}
        self.lengths = torch.ones(1, dtype=torch.int32, device=self.device)
        self._ids = torch.zeros(N, dtype=torch.long, device=self.device)
        self._prefix = torch.zeros(N, D, **f)
        self._blocks = torch.zeros(len(self.block_starts) * N * D, **f)
        self.ids, self.prefix, self.states = self._ids[:1, None], self._prefix[:1], None
        self.blocks = self._blocks[:len(self.block_starts) * D].view(-1, 1, D)

    # ------------------------------------------------------------ validation and the call
    def _check_chunks(self, chunks) -> list[Chunk]:
        sc = self.slot_caches
        chunks = list(chunks)
        if not chunks or not all(isinstance(c, Chunk) for c in chunks):
            raise ValueError("chunks must be a non-empty list of Chunk")
        total = 0
        vocab = self.config.vocab_size * self.world_size
        for j, c in enumerate(chunks):
            if not (0 <= c.slot < sc.slots and 0 <= c.stage < sc.staging):
                raise ValueError(f"chunks[{j}]: slot must be in [0, {sc.slots}) and stage in [0, "
                                 f"{sc.staging}), got slot {c.slot}, stage {c.stage}")
            if c.ids.dim() != 1 or c.tokens < 1 or c.ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"chunks[{j}].ids must be a 1-D integer tensor of >= 1 token, got "
                                 f"{tuple(c.ids.shape)} {c.ids.dtype}")
            if not isinstance(c.start, int) or c.start < 0 or sc.share(c.start + c.tokens) > sc.rows - 1:
                raise ValueError(f"chunks[{j}]: positions [{c.start}, {c.start + c.tokens}) need "
                                 f"{sc.share(c.start + c.tokens)} rows; slots hold {sc.rows - 1}")
            lo, hi = int(c.ids.min()), int(c.ids.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"chunks[{j}].ids must lie in [0, vocab_size={vocab}), got [{lo}, {hi}]")
            total += c.tokens
        if total > self.max_tokens:
            raise ValueError(f"chunks hold {total} tokens; this step takes at most "
                             f"max_tokens={self.max_tokens}")
        if len({c.slot for c in chunks}) < len(chunks) or len({c.stage for c in chunks}) < len(chunks):
            raise ValueError("chunks must be of distinct sequences (distinct slots and stages)")
        return chunks

    def __call__(self, chunks) -> torch.Tensor:
        """Run `chunks` (a list of Chunk); returns logits [len(chunks), vocab] fp32 of their last tokens."""
        chunks = self._check_chunks(chunks)
        N = sum(c.tokens for c in chunks)
        self.chunks = chunks
        self.ids = self._ids[:N, None]
        self.ids[:, 0].copy_(torch.cat([c.ids.to(self.device) for c in chunks]))
        D = self.config.hidden_size
        self.prefix = self._prefix[:N]
        self.blocks = self._blocks[:len(self.block_starts) * N * D].view(-1, N, D)  # contiguous [S, N, D]
        self._offsets = [0]
        for c in chunks:
            self._offsets.append(self._offsets[-1] + c.tokens)
        self._last = torch.tensor([o - 1 for o in self._offsets[1:]], device=self.device)
        self.batch = len(chunks)  # DecodeStep.program shapes its logits [batch, q_len = 1, vocab]
        return self.run()[:, 0]

    def _mix(self, delta, n_blocks: int, mix, next_norm, push: bool) -> torch.Tensor:
        """DecodeStep's mix; the last one (into the final norm) keeps each chunk's last token only, so that
        DecodeStep.program's lm_head and logits all-gather run on [chunks, hidden] (`batch` = chunks)."""
        out = super()._mix(delta, n_blocks, mix, next_norm, push)
        return out.index_select(0, self._last) if next_norm is self.weights.final_norm else out

    # ------------------------------------------------------------ attention over chunks
    def _attention(self, i: int, w, x: torch.Tensor):
        part = self._mla_chunks(i, w, x) if i in self.slot_caches.latent else self._kda_chunks(i, w, x)
        return (yield from self._collective("all_reduce", part))

    def _kda_chunks(self, i: int, w, x: torch.Tensor) -> torch.Tensor:
        sc, d = self.slot_caches, w.decode
        n, H, K = sc.kda_index[i], w.heads, self.config.kda_head_dim
        q, k, v, gate, b_raw, g_raw = layers.kda_inputs(w, x, self.pack)
        ys = [[], [], []]
        for c, lo, hi in zip(self.chunks, self._offsets, self._offsets[1:]):
            for j, (t, conv_w) in enumerate(((q, d.conv_q), (k, d.conv_k), (v, d.conv_v))):
                state = sc.stage_conv[c.stage, n, j]
                y, new = short_conv(t[lo:hi].unsqueeze(0), conv_w, state.unsqueeze(0))
                state.copy_(new[0])
                ys[j].append(y[0])
        N = x.shape[0]
        qn = l2_normalize(torch.cat(ys[0]).view(1, N, H, K)).contiguous()
        kn = l2_normalize(torch.cat(ys[1]).view(1, N, H, K)).contiguous()
        vv = torch.cat(ys[2]).view(1, N, H, K).contiguous()
        g = kda_gate(g_raw.view(1, N, -1), d.A_log, d.dt_bias, d.lower_bound).contiguous()
        beta = kda_beta(b_raw.reshape(1, N, H)).contiguous()
        stages = torch.tensor([c.stage for c in self.chunks], device=self.device)
        if self.kda_scan == "ops":
            init = sc.stage_state[:, n].index_select(0, stages).contiguous()
            cu = torch.tensor(self._offsets, dtype=torch.int32, device=self.device)
            o, final = kda_chunk.kda_chunk(qn, kn, vv, g, beta, K ** -0.5, init, cu, variant="after")
            sc.stage_state[:, n].index_copy_(0, stages, final)
        else:
            outs = []
            for c, lo, hi in zip(self.chunks, self._offsets, self._offsets[1:]):
                state = sc.stage_state[c.stage, n]
                args = (qn[:, lo:hi], kn[:, lo:hi], vv[:, lo:hi], g[:, lo:hi], beta[:, lo:hi])
                if self.kda_scan == "chunked":
                    o_j, final = kda_chunked(*args, scale=K ** -0.5, initial_state=state.unsqueeze(0),
                                             chunk_size=self.config.kda_chunk_size)
                else:
                    o_j, final = kda_recurrent(*args, scale=K ** -0.5, initial_state=state.unsqueeze(0))
                state.copy_(final[0])
                outs.append(o_j)
            o = torch.cat(outs, dim=1)
        o = gated_rms_norm(o.to(x.dtype), gate.reshape(1, N, H, K), d.o_norm, d.eps)
        return linear(o.reshape(N, H * K), w.o_proj)

    def _mla_chunks(self, i: int, w, x: torch.Tensor) -> torch.Tensor:
        sc, N, H = self.slot_caches, x.shape[0], w.heads
        lat = w.kv_a_norm.shape[0]
        qa, ckv, g = linear(x, w.w_in).split([w.q_a_norm.shape[0], self.config.mla_latent_dim,
                                              H * w.w_uv.shape[1]], dim=-1)
        rows = torch.empty(1, N, self.config.mla_latent_dim, device=self.device, dtype=self.dtype)
        glue, W = mla_glue.BACKENDS["torch"], self.config.mla_latent_dim  # the reference row's callables
        nope, V = w.w_uk.shape[1], w.w_uv.shape[1]
        qa_n = glue.norms(qa, ckv, w.q_a_norm, w.kv_a_norm, w.eps, rows, 1, N, lat, W - lat)
        q_buf = torch.empty(1, N, H, self.config.mla_latent_dim, device=self.device, dtype=self.dtype)
        glue.absorb_q(linear(qa_n, w.q_b).view(N, H, -1), w.w_uk, q_buf, 1, N, H, nope, lat, W - lat)
        latent, d = sc.latent[i], sc.dcp
        o_lat = torch.empty(N, H, lat, device=self.device, dtype=self.dtype)
        for c, lo, hi in zip(self.chunks, self._offsets, self._offsets[1:]):
            first = sc.share(c.start)  # the rank's rows of the chunk: positions d * r in [start, start + T)
            mine = rows[0, lo:hi][(first * d - c.start)::d]
            latent[c.slot, first:first + mine.shape[0]].copy_(mine)
            q = q_buf[0, lo:hi].repeat(1, d, 1) if d > 1 else q_buf[0, lo:hi]
            o = chunk_attention(q, latent[c.slot, :sc.share(c.start + c.tokens)], c.start,
                                scale=self.config.mla_softmax_scale, value_dim=lat, key_stride=d)
            o_lat[lo:hi] = o[:, :H]
        return linear(glue.out_gate(o_lat, w.w_uv, g, None, N, H, V, lat), w.o_proj)

    def describe(self) -> dict:
        return {**super().describe(), "max_tokens": self.max_tokens, "kda_scan": self.kda_scan,
                "mla_prefill": "chunk_attention (PyTorch, absorbed, fp32 softmax statistics)",
                "mla_glue_prefill": "torch", "dcp": self.slot_caches.dcp,
                "router": self.resolved.backends["moe_router"]}
