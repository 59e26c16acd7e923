"""`DecodeStep`: one decode (or verification) step of one tensor-parallel rank through every layer of K3.

    step = DecodeStep(K3Config.tp_slice(8), batch=1, context_len=32768, optimizations="all")
    logits = step(ids)              # ids [B, q_len] -> logits [B, q_len, vocab] (fp32), caches updated
    step.capture(); step.replay()   # the whole step as one CUDA graph (GPU)

    step = DecodeStep.from_model(model, batch, context_len)   # a K3Model's weights, for checking
    step.load_cache(cache)                                    # the model's K3Cache after `context_len`

The step holds one rank's caches (per KDA layer the conv histories and the fp32 state, per MLA layer a
latent buffer of context_len + q_len rows, written at positions [context_len, context_len + q_len)) and
runs, per layer: the AttnRes mix + the input RMSNorm, attention, the collective, the mix + the
post-attention norm, the MLP or MoE and its collectives; then the output mix, the final norm and the
rank's slice of lm_head. Each optimization is a switch (`switches.SWITCHES`); `step.resolved` says what
runs for each and holds the chosen row of every op the step calls, whose callables the step binds once
(`rows`): a step that runs chooses no backend. `projections='fp8'` runs the large dense projections in
FP8 (`fp8`, `weights.FP8_PROJECTIONS`).

`precision='article'` runs the article's formats: FP8 dense projections, the routed experts in MXFP4
(`RankWeights.to_article`, read by k3lab.ops.moe_experts.mxfp4_kernels) and each MLA layer's latent
cache in FP8 E4M3 (k3lab.ops.mla_decode.fp8_cache) with one fp32 scale per layer's cache, per tensor
rather than per page: a decode step adds one row to a page at a time, so a page's scale would have to
be fixed before the rows that set its range arrive (or the page re-quantized when a larger one comes),
while a per-tensor scale is set once, from the cache loaded (`load_cache`: its largest magnitude times
KV_HEADROOM) or the random one drawn, and costs 4 bytes a layer and no read per page in the decode's
inner loop. The new rows of a step are written by the MLA glue into a small buffer in the step's dtype
and quantized into the cache just before the decode reads it; `cache_entries` gives the values the
FP8 cache stands for, `save_state` its codes.

Collectives: the rank program yields each one it would run ('all_reduce' of a partial sum, 'all_gather'
of the logits). `collectives='stand_in'` answers each on this one device with a copy of the same bytes
(an all-gather: the rank's slice written world_size times), so the step's memory traffic and launches
are a rank's, but not its communication time: the bench shows them apart, labelled. `run_group` drives
several ranks' steps in lockstep with real sums (the TP check on one device). At tp 1 nothing is yielded.
"""

from __future__ import annotations

import dataclasses

import torch

from k3lab.config import K3Config
from k3lab.nn import KDACache
from k3lab.ops import kda_decode, mla_decode
from k3lab.ops.mla_decode import fp8_cache

from . import fp8, layers
from .switches import resolve, settings
from .weights import KDAWeights, RankWeights

COLLECTIVES = ("stand_in", "skip")
MAX_Q_LEN = 8
STATE_SCALE = 0.1  # random KDA states: of the size a decayed recurrence holds
KV_HEADROOM = 2.0  # an FP8 cache's scale holds this times the largest magnitude it was set from: room for
                   # new rows a little larger (E4M3's relative step is the same at every normal magnitude)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        span = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {span}, got {value!r}")
    return value


def _check_config(config: K3Config) -> None:
    if not isinstance(config, K3Config):
        raise ValueError(f"config must be a K3Config, got {type(config).__name__}")  # noqa: TRY004
    if config.kda_head_dim != kda_decode.HEAD_DIM:
        raise ValueError(f"config.kda_head_dim must be {kda_decode.HEAD_DIM} (the KDA kernels' head dim), "
                         f"got {config.kda_head_dim}")
    if config.mla_latent_dim != mla_decode.LATENT_DIM or config.kv_lora_rank != mla_decode.VALUE_DIM:
        raise ValueError(f"config's MLA latent must be {mla_decode.VALUE_DIM} + "
                         f"{mla_decode.LATENT_DIM - mla_decode.VALUE_DIM} (the MLA kernels' width), got "
                         f"{config.kv_lora_rank} + {config.qk_rope_head_dim}")


class DecodeStep:
    """One rank's decode step (see the module docstring).

    config: the rank's slice (K3Config.tp_slice(8) for TP8), or a whole config with `tp=` (sliced here;
    ValueError naming the size that does not divide). batch, context_len: sequences and positions already
    cached; q_len: tokens per sequence (1 = decode, 2..8 = verification of q_len - 1 drafts).
    optimizations: 'all', 'none', a set of switch names that are on, or {name: bool} (see
    `switches.parse`). weights: 'random' (fresh weights at the rank's shapes, `distinct_layers` sets per
    layer kind rotated through the layers) or a `RankWeights`. strict: ValueError for a switch that
    cannot run as named here, instead of running its replacement (`self.resolved.notes` says which).
    device / dtype: where the random weights and caches live (default: the GPU with bf16 if there is
    one, else the CPU with fp32). projections: None (the default at precision 'bf16': 'gemv' where the
    step has one token, batch 1 decode, on a GPU, else 'bf16'; `rows.default_projections`), 'bf16' (the dense
    projections as torch matmuls in the weights' dtype), 'gemv' (the same weights, one-row products by
    k3lab.ops.gemv: `RankWeights.to_gemv`; where Triton cannot run, torch matmuls with a note) or 'fp8'
    (`RankWeights.to_fp8`: e4m3fn weights with per-row scales, activations quantized per token,
    `torch._scaled_mm`, the one-row GEMV at one row; the step quantizes its own copy of bf16 weights, or
    takes weights already converted). Where FP8 cannot run, a GPU step runs its dtype and says so in
    `self.resolved.notes['projections']` (ValueError with strict=True); a CPU step whose torch lacks
    CPU e4m3fn products runs a plain-PyTorch emulation of the same arithmetic, said the same way.
    precision: 'bf16' (the weights' dtype), 'fp8' (FP8 dense projections: the same as projections='fp8')
    or 'article' (FP8 dense projections, MXFP4 routed experts, an FP8 MLA latent cache: the module
    docstring); None follows projections. Both are settings of the same table as the switches
    (`switches.SETTINGS`) and may be given in the optimizations dict instead.
    """

    def __init__(self, config: K3Config, batch: int, context_len: int, *, optimizations="all",
                 weights="random",
                 distinct_layers: int = 4, q_len: int = 1, tp: int | None = None, device=None, dtype=None,
                 strict: bool = False, collectives: str = "stand_in", seed: int = 0,
                 projections: str | None = None, precision: str | None = None):
        if tp is not None:
            _check_config(config)
            config = config.sliced(_check_int("tp", tp, 1)) if tp > 1 else config
        _check_config(config)
        self.batch = _check_int("batch", batch, 1)
        self.context_len = _check_int("context_len", context_len, 0)
        self.q_len = _check_int("q_len", q_len, 1, MAX_Q_LEN)
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
        settings(optimizations, projections, precision)  # bad settings refused before weights are drawn
        if isinstance(weights, RankWeights):
            if weights.config != config:
                raise ValueError(f"weights are for {weights.config.name}, not for config {config.name}")
        elif weights == "random":
            dev = torch.device(device) if device is not None else (
                torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
            dt = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
            weights = RankWeights.random(config,
                                         distinct_layers=_check_int("distinct_layers", distinct_layers, 1),
                                         device=dev, dtype=dt, seed=seed)
        else:
            raise ValueError(f"weights must be 'random' or a RankWeights (RankWeights.from_model), got "
                             f"{weights!r}")
        self.config, self.weights, self.collectives = config, weights, collectives
        self.world_size, self.rank = weights.world_size, weights.rank
        self.device, self.dtype = weights.device, weights.dtype
        self.tokens = self.batch * self.q_len
        self.resolved = resolve(optimizations, self.device, self.dtype, self.q_len, strict=strict,
                                projections=projections, precision=precision, tokens=self.tokens,
                                top_k=config.num_experts_per_token)
        self.article = self.resolved.precision == "article"
        if self.article:
            weights = _article_weights(weights, self.resolved.projections)
        self.weights, ran, note = fp8.weights_for(weights, self.resolved.projections)
        if note:
            self.resolved = dataclasses.replace(self.resolved, projections=ran,
                                                notes=dict(self.resolved.notes, projections=note))
        self.impl = self.resolved.impl
        self.block_starts = frozenset(config.attn_res_block_starts())
        self._alloc(seed)
        self._bind()
        self.graph = None
        self.logits = None
        self.last_collectives: list[tuple[str, int]] = []
        self.routes: list | None = None  # a list: each MoE layer's chosen experts of a run are appended

    @classmethod
    def from_model(cls, model, batch: int, context_len: int, *, tp: int = 1, rank: int = 0,
                   **kw) -> DecodeStep:
        """The step with `model`'s weights (a K3Model), rank `rank` of `tp`; keyword arguments as for
        DecodeStep (optimizations, q_len, strict, collectives)."""
        w = RankWeights.from_model(model, _check_int("tp", tp, 1), rank)
        return cls(w.config, batch, context_len, weights=w, **kw)

    # ------------------------------------------------------------ buffers and caches
    def _alloc(self, seed: int) -> None:
        c, B, T, dev, dt = self.config, self.batch, self.q_len, self.device, self.dtype
        gen = torch.Generator(device=dev).manual_seed(seed + 1)
        f = {"device": dev, "dtype": dt}
        self.kda_caches: dict[int, KDACache] = {}
        self.latent: dict[int, torch.Tensor] = {}
        self.kv_scales: dict[int, torch.Tensor] = {}  # FP8 caches: each layer's fp32 [1] scale
        self.new_rows: dict[int, torch.Tensor] = {}   # FP8 caches: the step's new rows before quantizing
        C, H = c.kda_width, c.kda_num_heads
        for i, kind in enumerate(c.layer_types):
            if kind == "kda":
                conv = [torch.randn(B, C, c.kda_conv_size - 1, generator=gen, **f) for _ in range(3)]
                state = torch.randn(B, H, c.kda_head_dim, c.kda_head_dim, generator=gen,
                                    device=dev).mul_(STATE_SCALE)
                self.kda_caches[i] = KDACache(*conv, state)
            else:
                self.latent[i] = torch.randn(B, self.context_len + T, c.mla_latent_dim, generator=gen, **f)
                if self.article:
                    self.kv_scales[i] = fp8_cache.scale_for(self.latent[i].abs().amax(), KV_HEADROOM).to(dev)
                    self.latent[i] = fp8_cache.quantize_rows(self.latent[i], self.kv_scales[i])
                    self.new_rows[i] = torch.zeros(B, T, c.mla_latent_dim, **f)
        self.lengths = torch.full((B,), self.context_len + T, dtype=torch.int32, device=dev)
        self.ids = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.prefix = torch.zeros(self.tokens, c.hidden_size, **f)
        self.blocks = torch.zeros(len(self.block_starts), self.tokens, c.hidden_size, **f)
        self.states = (torch.empty(B, T, H, c.kda_head_dim, c.kda_head_dim, device=dev, dtype=torch.float32)
                       if T > 1 else None)

    def _bind(self) -> None:
        """What a server binds once, from the rows settled by `resolve` (`self.resolved.rows`): the
        callables every layer shares, and per call site what holds its own state or tensors (the AttnRes
        mix per count of stored blocks, the KDA steps, decode or verification, and the MLA plans,
        validated here and launched without checks in every step). Nothing is chosen after this."""
        B, T, c, on, ops = self.batch, self.q_len, self.config, self.resolved.on, self.resolved.rows
        # the fused kernel takes the weights' fp32 product, folded at load, and the next norm's weight in
        # fp32, converted here once rather than by a copy kernel per mix
        self.mix_folded = on["attn_res_fused"]
        rw = self.weights
        norms = [rw.final_norm] + [w for lw in rw.layers for w in (lw.norms.input_norm, lw.norms.post_norm)]
        self.norms32 = {id(w): w.float() for w in norms} if self.mix_folded else {}
        self.mixes = {}  # (has a delta, stored blocks) -> the mix bound for those call sites
        n_blocks = 0
        for i in range(c.num_hidden_layers):
            for key in ((i > 0, n_blocks), (True, n_blocks + (i in self.block_starts))):
                if key not in self.mixes:
                    self.mixes[key] = ops["attn_res_norm"].bind(self.prefix, self.blocks, key[1], key[0])
            n_blocks += i in self.block_starts
        self.mixes.setdefault((True, n_blocks), ops["attn_res_norm"].bind(self.prefix, self.blocks, n_blocks,
                                                                          True))
        self.pack = ops["packed_matmul"].dispatch
        self.glu = ops["situ_glu"].glu
        self.shared_down = ops["situ_glu"].shared_down
        self.router = ops["moe_router"].route
        self.experts = ops["moe_experts"].experts
        self.tail = ops["moe_experts"].tail
        self.mla_glue = ops["mla_glue"]
        self.tail_sharded = on["moe_tail_sharded"]
        self.kda_steps, self.mla_plans, self.q_bufs = {}, {}, {}
        self.article_rows = self.new_rows if self.article else {}
        for i, cache in self.kda_caches.items():
            w: KDAWeights = self.weights.layers[i].attn
            if T == 1:
                self.kda_steps[i] = ops["kda_decode"].bind(cache, w.decode)
            else:
                verify = ops["kda_verify"].bind(cache.state, self.states, self.dtype)
                self.kda_steps[i] = layers.KDAVerifyStep(cache, w.decode, verify, self.states, B, T)
        H = c.num_attention_heads
        for i, latent in self.latent.items():
            q = torch.zeros(B, T, H, c.mla_latent_dim, device=self.device, dtype=self.dtype)
            self.q_bufs[i] = q
            if self.article:
                self.mla_plans[i] = ops["mla_decode"].bind(q, latent, self.kv_scales[i], self.lengths,
                                                           c.mla_softmax_scale, self.new_rows[i],
                                                           self.context_len)
            else:
                self.mla_plans[i] = ops["mla_decode"].bind(q, latent, self.lengths, c.mla_softmax_scale)

    def load_cache(self, cache) -> None:
        """Copy a K3Cache of `context_len` positions (K3Model.prefill / decode) into this rank's caches:
        the MLA histories whole (replicated under TP; an FP8 cache takes a new scale from the history's
        largest magnitude times KV_HEADROOM and quantizes it), the KDA conv histories and states of this
        rank's heads."""
        if getattr(cache, "length", None) != self.context_len:
            raise ValueError(f"cache must hold context_len = {self.context_len} positions, got "
                             f"{getattr(cache, 'length', type(cache).__name__)}")
        W, r = self.world_size, self.rank
        for i, layer in enumerate(cache.layers):
            if i in self.latent:
                if tuple(layer.latent.shape) != (self.batch, self.context_len, self.config.mla_latent_dim):
                    raise ValueError(f"cache.layers[{i}].latent must be [B={self.batch}, {self.context_len}, "
                                     f"{self.config.mla_latent_dim}], got {tuple(layer.latent.shape)}")
                if self.article:
                    amax = layer.latent.abs().amax() if layer.latent.numel() else 0.0
                    self.kv_scales[i].copy_(fp8_cache.scale_for(amax, KV_HEADROOM).to(self.device))
                    self.latent[i][:, :self.context_len].copy_(
                        fp8_cache.quantize_rows(layer.latent.to(self.device), self.kv_scales[i]))
                else:
                    self.latent[i][:, :self.context_len].copy_(layer.latent)
                continue
            mine = self.kda_caches[i]
            for name in ("conv_q", "conv_k", "conv_v", "state"):
                src = getattr(layer, name)
                n = src.shape[1] // W
                getattr(mine, name).copy_(src[:, r * n:(r + 1) * n])

    def cache_entries(self) -> dict[str, torch.Tensor]:
        """This rank's caches under K3Cache.entries()' names: 'layers.{i}.latent' [B, context_len + q_len,
        576] (an FP8 cache: the values it stands for, codes x scale, in the step's dtype), 'layers.{i}.conv_q'
        / conv_k / conv_v / state, 'attn_res.blocks' [S, B, hidden] and 'attn_res.partial' [B, hidden] (the
        last position's depth state at the model output)."""
        out = {}
        for i in range(self.config.num_hidden_layers):
            if i in self.latent:
                t = self.latent[i]
                out[f"layers.{i}.latent"] = (fp8_cache.dequantize(t, self.kv_scales[i], self.dtype)
                                             if self.article else t)
            else:
                for name, t in self.kda_caches[i].entries().items():
                    out[f"layers.{i}.{name}"] = t
        B, T, D = self.batch, self.q_len, self.config.hidden_size
        out["attn_res.blocks"] = self.blocks.view(-1, B, T, D)[:, :, -1]
        out["attn_res.partial"] = self.prefix.view(B, T, D)[:, -1]
        return out

    def save_state(self) -> dict[str, torch.Tensor]:
        """Clones of what a step writes and the next one reads: per KDA layer the conv histories and the
        state, per MLA layer its rows [context_len, context_len + q_len) (the rows before are never
        written). `restore_state` puts them back, so a step re-run from there sees the same inputs."""
        out = {f"layers.{i}.{n}": t.clone() for i, c in self.kda_caches.items() for n, t
               in c.entries().items()}
        out.update({f"layers.{i}.latent": t[:, self.context_len:].clone() for i, t in self.latent.items()})
        return out

    def restore_state(self, saved: dict[str, torch.Tensor]) -> None:
        """Copy a `save_state()` of this step back in place (the buffers a captured graph reads stay)."""
        for i, c in self.kda_caches.items():
            for n, t in c.entries().items():
                t.copy_(saved[f"layers.{i}.{n}"])
        for i, t in self.latent.items():
            t[:, self.context_len:].copy_(saved[f"layers.{i}.latent"])

    # ------------------------------------------------------------ the rank program
    def _collective(self, kind: str, t: torch.Tensor):
        if self.world_size == 1:
            return t
        return (yield kind, t)

    def _mix(self, delta, n_blocks: int, mix, next_norm, push: bool) -> torch.Tensor:
        kw = {"mix_weight": mix.folded} if self.mix_folded else {}
        next_norm = self.norms32.get(id(next_norm), next_norm)
        mix_op = self.mixes[delta is not None, n_blocks]
        return mix_op(self.prefix, delta, self.blocks, n_blocks, mix.res_norm, mix.res_proj, next_norm,
                      self.config.rms_norm_eps, push_block=push, **kw)

    def _attention(self, i: int, w, x: torch.Tensor):
        if i in self.article_rows:  # the glue writes the new rows; the bound plan quantizes them in
            part = layers.mla_partial(w, x, self.article_rows[i], 0, self.q_bufs[i], self.mla_plans[i],
                                      self.mla_glue)
        elif i in self.latent:
            part = layers.mla_partial(w, x, self.latent[i], self.context_len, self.q_bufs[i],
                                      self.mla_plans[i], self.mla_glue)
        else:
            part = layers.kda_partial(w, x, self.kda_steps[i], self.pack)
        return (yield from self._collective("all_reduce", part))

    def _mlp(self, w, x: torch.Tensor):
        if not hasattr(w, "gate"):  # the dense layer
            return (yield from self._collective("all_reduce", layers.dense_partial(w, x, self.glu)))
        logits, z, gu = layers.moe_products(w, x)
        lat = yield from self._collective("all_reduce", layers.moe_latent_partial(
            w, logits, z, self.router, self.experts, self.routes))
        shared = layers.moe_shared_partial(w, x, gu, self.shared_down)
        if self.tail_sharded:
            layers.moe_tail(w, lat, shared, True, self.tail)
            return (yield from self._collective("all_reduce", shared))
        shared = yield from self._collective("all_reduce", shared)
        return layers.moe_tail(w, lat, shared, False, self.tail)

    def _embed(self):
        w = self.weights.embed
        flat = self.ids.reshape(-1)
        if self.world_size == 1:
            e = torch.nn.functional.embedding(flat, w)
        else:
            local = flat - self.rank * w.shape[0]
            inside = ((local >= 0) & (local < w.shape[0])).unsqueeze(-1)
            e = torch.nn.functional.embedding(local.clamp(0, w.shape[0] - 1), w) * inside
        e = yield from self._collective("all_reduce", e)
        self.prefix.copy_(e)

    def program(self):
        """The rank's step as a generator: yields (kind, tensor) at each collective, receives its result,
        returns logits [B, q_len, vocab] (fp32)."""
        rw = self.weights
        yield from self._embed()
        n_blocks, m = 0, None
        for i, lw in enumerate(rw.layers):
            starts = i in self.block_starts
            x = self._mix(m, n_blocks, lw.norms.attn_mix, lw.norms.input_norm, starts)
            n_blocks += starts
            a = yield from self._attention(i, lw.attn, x)
            x = self._mix(a, n_blocks, lw.norms.mlp_mix, lw.norms.post_norm, False)
            m = yield from self._mlp(lw.mlp, x)
        h = self._mix(m, n_blocks, rw.out_mix, rw.final_norm, False)
        logits = (h @ rw.lm_head.t()).float()
        logits = yield from self._collective("all_gather", logits)
        return logits.view(self.batch, self.q_len, -1)

    def _answer(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        self.last_collectives.append((kind, t.numel() * t.element_size()))
        if self.collectives == "skip":
            return t if kind == "all_reduce" else t.repeat(1, self.world_size)
        if kind == "all_reduce":
            return torch.empty_like(t).copy_(t)
        return torch.cat([t] * self.world_size, dim=-1)

    def run(self) -> torch.Tensor:
        """One step on the tokens in `self.ids`, collectives answered by `self.collectives`."""
        self.last_collectives = []
        gen = self.program()
        try:
            req = next(gen)
            while True:
                req = gen.send(self._answer(*req))
        except StopIteration as done:
            self.logits = done.value
        return self.logits

    def set_tokens(self, ids) -> None:
        ids = torch.as_tensor(ids, device=self.device)
        if ids.shape != (self.batch, self.q_len) or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"ids must be integer token ids [B={self.batch}, q_len={self.q_len}], got "
                             f"{tuple(ids.shape)} {ids.dtype}")
        lo, hi = int(ids.min()), int(ids.max())
        vocab = self.config.vocab_size * self.world_size
        if lo < 0 or hi >= vocab:
            raise ValueError(f"ids must lie in [0, vocab_size={vocab}), got [{lo}, {hi}]")
        self.ids.copy_(ids)

    def __call__(self, ids=None) -> torch.Tensor:
        """Set the tokens (ids [B, q_len]; None keeps the last ones) and run one step eagerly."""
        if ids is not None:
            self.set_tokens(ids)
        return self.run()

    # ------------------------------------------------------------ CUDA graph
    def experts_read(self) -> int | None:
        """Distinct routed experts summed over the MoE layers of the last run made while `routes` was a
        list (the expert weights that run read); None when routes were not recorded."""
        return None if self.routes is None else sum(int(torch.unique(i).numel()) for i in self.routes)

    def capturable(self) -> tuple[bool, str]:
        """(True, '') when the whole step can be captured in one CUDA graph here, else (False, why)."""
        if self.device.type != "cuda":
            return False, "CUDA graphs need a CUDA device; this step is on the CPU"
        return not self.resolved.graph, self.resolved.graph

    def capture(self, warmup: int = 2) -> None:
        """Capture one whole step (the tokens in `self.ids`) as a CUDA graph; `replay()` runs it and
        refreshes `self.logits` in place. ValueError saying why where it cannot be captured."""
        ok, why = self.capturable()
        if not ok:
            raise ValueError(f"capture: {why}")
        from k3lab.runtime import capture_graph

        self.graph = capture_graph(self.run, warmup=warmup)

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            raise ValueError("replay: call capture() first")
        self.graph.replay()
        return self.logits

    def describe(self) -> dict:
        """What this step is, for records: shapes, dtype, weights, switches and what runs for each."""
        rw = self.weights
        return {"config": self.config.name, "tp": self.world_size, "batch": self.batch,
                "context_len": self.context_len, "q_len": self.q_len,
                "dtype": str(self.dtype).replace("torch.", ""),
                "projections": self.resolved.projections, "precision": self.resolved.precision,
                "experts": rw.experts, "mla_cache": "fp8_e4m3" if self.article else str(self.dtype)[6:],
                "weights": rw.source, "distinct_layers": rw.distinct_layers,
                "layers": self.config.num_hidden_layers,
                "switches": dict(self.resolved.on), "impl": dict(self.impl),
                "notes": dict(self.resolved.notes), "backends": self.resolved.backends,
                "label": self.resolved.label(), "collectives": self.collectives,
                "mla_backend": {str(i): getattr(p, "backend", "?") for i, p
                                in list(self.mla_plans.items())[:1]}}


def _article_weights(given: RankWeights, ran: str) -> RankWeights:
    """`given` in the article's formats (`RankWeights.to_article`: FP8 projections as `ran` says, MXFP4
    experts), or itself where it holds them already. ValueError for FP8 projections over bf16 experts."""
    if given.experts == "mxfp4":
        return given
    if given.projections != "bf16":
        raise ValueError(f"weights hold {given.projections} projections with {given.experts} experts: pass "
                         "the unconverted RankWeights, or RankWeights.to_article(), for precision='article'")
    return given.to_article(emulated=ran == "fp8_emulated")


def run_group(steps: list[DecodeStep], ids) -> list[torch.Tensor]:
    """Run the steps of ranks 0..W-1 of one TP group in lockstep on this process, answering every
    collective with the real result (all_reduce: the sum of the ranks' partials, all_gather: their
    slices in rank order). Returns each rank's logits."""
    W = len(steps)
    if W < 1 or [s.rank for s in steps] != list(range(W)) or any(s.world_size != W for s in steps):
        raise ValueError(f"steps must be ranks 0..{W - 1} of a TP group of {W}, got ranks "
                         f"{[(s.rank, s.world_size) for s in steps]}")
    for s in steps:
        s.set_tokens(ids)
    gens = [s.program() for s in steps]
    reqs = [next(g) for g in gens]
    out = [None] * W
    while True:
        kinds = {r[0] for r in reqs}
        if len(kinds) != 1:
            raise RuntimeError(f"ranks disagree on the next collective: {[r[0] for r in reqs]}")
        parts = [r[1] for r in reqs]
        result = torch.stack(parts).sum(0) if kinds == {"all_reduce"} else torch.cat(parts, dim=-1)
        nxt = []
        for r, g in enumerate(gens):
            try:
                nxt.append(g.send(result.clone()))
            except StopIteration as done:
                out[r] = done.value
                steps[r].logits = done.value
        if all(o is not None for o in out):
            return out
        if len(nxt) != W:
            raise RuntimeError("ranks finished at different collectives")
        reqs = nxt
