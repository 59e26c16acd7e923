"""One tensor-parallel rank's weights for the decode step, in the form the step's kernels read.

`RankWeights.from_model(model, world_size, rank)` slices a k3lab.nn K3Model (docs/k3.md:
attention heads, the dense MLP's and the experts' intermediate, the shared expert's width and the
vocabulary divided; the MLA low-rank projections, the router, the latent MoE projections and every norm
replicated). `RankWeights.random(config, distinct_layers=R)` draws fresh weights at a rank's shapes (a
`K3Config.tp_slice(8)` config is TP8), R distinct sets per layer kind rotated through the layers: one
rank's weights for all 93 layers do not fit one GPU (the routed experts alone are 7.4 GB per layer in
bf16 at TP8), and R sets of ~100 MB+ per layer are far more than the L2 holds.

Projections that read the same input are stored stacked (one matmul each): KDA's q, k, v, g_proj,
b_proj, f_a; MLA's q_a, kv_a_proj_with_mqa, g_proj; the dense MLP's and the shared expert's gate and up.

`RankWeights.to_fp8()` returns the same weights with the large dense projections (FP8_PROJECTIONS) as
`fp8.Fp8Linear` (float8_e4m3fn, a scale per output row); everything else is shared with the original.
`RankWeights.to_article()` is that plus the routed experts w1, w3, w2 in MXFP4 (`mxfp4.Mxfp4Weight`:
E2M1 codes two a byte, an E8M0 scale per 32 along K, 4.25 bits a weight), the article's formats.
`dequantized()` gives back plain tensors of the values any of these forms stand for (references).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from k3lab.config import K3Config
from k3lab.ops.attn_res_norm import fold_mix_weight
from k3lab.ops.kda_decode import KDADecodeWeights
from k3lab.ops.moe_experts import mxfp4

from . import fp8

# The projections stored in FP8 by `RankWeights.to_fp8`, per weight kind. Kept in the step's dtype:
# KDA's f_b (goes through the packed-matmul dispatcher that `pack_where_used` switches; C x r, under
# 0.2% of the layer), MLA's absorbed w_uk / w_uv (per-head batched products), the router gate (routing
# decisions: a near-tie must not flip on quantization error), the MoE up_proj (read by the fused
# latent-tail kernel with its RMSNorm and residual add; a rank reads 1/TP of it when sharded), the
# routed experts (their own grouped kernels), lm_head (the step's output logits; one matrix per step,
# ~1.5% of a TP8 rank's dense bytes) and the embedding (a row gather).
FP8_PROJECTIONS = {"KDAWeights": ("w_in", "o_proj"), "MLAWeights": ("w_in", "q_b", "o_proj"),
                   "DenseWeights": ("gate_up", "down"), "MoEWeights": ("down", "shared_in", "shared_down")}


def _rows(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t.detach()[rank * n:(rank + 1) * n]


def _cols(t: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    n = t.shape[1] // world
    return t.detach()[:, rank * n:(rank + 1) * n]


def _stack(*ts: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.detach() for t in ts]).contiguous()


@dataclass
class MixWeights:
    """One AttnRes pair: res_norm [D], res_proj [D] and their fp32 product (the fused kernel's weight)."""

    res_norm: torch.Tensor
    res_proj: torch.Tensor
    folded: torch.Tensor

    @classmethod
    def of(cls, norm_w: torch.Tensor, proj_w: torch.Tensor) -> MixWeights:
        n, p = norm_w.detach().contiguous(), proj_w.detach().reshape(-1).contiguous()
        return cls(n, p, fold_mix_weight(n, p))


@dataclass
class NormWeights:
    """A decoder layer's norms: input and post-attention RMSNorm, the attention and MLP AttnRes pairs."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn_mix: MixWeights
    mlp_mix: MixWeights

    @classmethod
    def from_layer(cls, layer) -> NormWeights:
        return cls(layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach(),
                   MixWeights.of(layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight),
                   MixWeights.of(layer.mlp_res_norm.weight, layer.mlp_res_proj.weight))


@dataclass
class KDAWeights:
    """w_in [4C + H + r, hidden] = q | k | v | g_proj | b_proj | f_a rows; f_b [C, r]; o_proj [hidden, C]
    (C = this rank's heads x 128); decode: conv, gate and output-norm parameters for the KDA kernels."""

    w_in: torch.Tensor
    f_b: torch.Tensor
    o_proj: torch.Tensor
    decode: KDADecodeWeights

    @property
    def heads(self) -> int:
        return self.decode.num_heads

    @property
    def split(self) -> tuple[int, ...]:
        C, H = self.f_b.shape[0], self.heads
        return (C, C, C, C, H, self.f_b.shape[1])

    @classmethod
    def from_layer(cls, attn, world: int, rank: int) -> KDAWeights:
        H = attn.num_heads // world
        dec = KDADecodeWeights.from_layer(attn)
        C = H * attn.head_dim
        sl = slice(rank * C, (rank + 1) * C)
        dec = KDADecodeWeights(dec.conv_q[sl].contiguous(), dec.conv_k[sl].contiguous(),
                               dec.conv_v[sl].contiguous(),
                               dec.A_log[rank * H:(rank + 1) * H].contiguous(), dec.dt_bias[sl].contiguous(),
                               dec.o_norm, dec.lower_bound, dec.eps)
        w_in = _stack(
            *(
                _rows(p.weight, world, rank)
                for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.g_proj, attn.b_proj)
            ),
            attn.f_a.weight,
        )
        return cls(w_in, _rows(attn.f_b.weight, world, rank).contiguous(),
                   _cols(attn.o_proj.weight, world, rank).contiguous(), dec)


@dataclass
class MLAWeights:
    """w_in [q_lora + 576 + H*128, hidden] = q_a | kv_a_proj_with_mqa | g_proj rows; q_a_norm [q_lora];
    q_b [H*192, q_lora]; kv_a_norm [512]; w_uk, w_uv [H, 128, 512] (kv_b_proj's key and value halves,
    absorbed into the query and the output); o_proj [hidden, H*128]; eps of the two low-rank norms."""

    w_in: torch.Tensor
    q_a_norm: torch.Tensor
    q_b: torch.Tensor
    kv_a_norm: torch.Tensor
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    o_proj: torch.Tensor
    eps: float

    @property
    def heads(self) -> int:
        return self.w_uk.shape[0]

    @classmethod
    def from_layer(cls, attn, world: int, rank: int) -> MLAWeights:
        w_uk, w_uv = attn.absorbed_weights()
        w_in = _stack(attn.q_a_proj.weight, attn.kv_a_proj_with_mqa.weight,
                      _rows(attn.g_proj.weight, world, rank))
        return cls(w_in, attn.q_a_layernorm.weight.detach(),
                   _rows(attn.q_b_proj.weight, world, rank).contiguous(),
                   attn.kv_a_layernorm.weight.detach(), _rows(w_uk, world, rank).contiguous(),
                   _rows(w_uv, world, rank).contiguous(), _cols(attn.o_proj.weight, world, rank).contiguous(),
                   float(attn.q_a_layernorm.eps))


@dataclass
class DenseWeights:
    """Layer 0's MLP on this rank: gate_up [2I, hidden] (gate rows, then up rows), down [hidden, I]."""

    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def from_mlp(cls, mlp, world: int, rank: int) -> DenseWeights:
        return cls(_stack(_rows(mlp.gate_proj.weight, world, rank), _rows(mlp.up_proj.weight, world, rank)),
                   _cols(mlp.down_proj.weight, world, rank).contiguous())


@dataclass
class MoEWeights:
    """A latent MoE layer on this rank: router gate [E, hidden] and its fp32 selection bias; down
    [LAT, hidden]; experts w1, w3 [E, F, LAT], w2 [E, LAT, F] (this rank's F of the intermediate);
    norm [LAT]; up [hidden, LAT] whole (the sharded tail reads its rows `own_rows` only); shared_in
    [2S, hidden] (gate rows, then up rows) and shared_down [hidden, S], or None without a shared expert."""

    gate: torch.Tensor
    gate_bias: torch.Tensor
    top_k: int
    scaling: float
    renormalize: bool
    down: torch.Tensor
    w1: torch.Tensor
    w3: torch.Tensor
    w2: torch.Tensor
    norm: torch.Tensor
    eps: float
    up: torch.Tensor
    shared_in: torch.Tensor | None
    shared_down: torch.Tensor | None
    world_size: int = 1
    rank: int = 0

    @property
    def own_rows(self) -> tuple[int, int]:
        n = self.up.shape[0] // self.world_size
        return self.rank * n, (self.rank + 1) * n

    @classmethod
    def from_layer(cls, layer, world: int, rank: int) -> MoEWeights:
        from k3lab.parallel.moe_tail import shard_moe

        w = shard_moe(layer, world, rank, "replicated")
        shared_in = None if w.shared_gate is None else _stack(w.shared_gate, w.shared_up)
        return cls(w.gate_weight, w.gate_bias, w.top_k, w.scaling, w.renormalize, w.down_proj, w.w1, w.w3,
                   w.w2,
                   w.norm_weight, w.eps, w.up_proj, shared_in, w.shared_down, world, rank)


@dataclass
class LayerWeights:
    norms: NormWeights
    attn: KDAWeights | MLAWeights
    mlp: DenseWeights | MoEWeights


@dataclass
class RankWeights:
    """Everything one rank reads in a decode step. layers[i] may be the same object for several i
    (`distinct_layers` sets per kind, rotated); source: 'model' or 'random'."""

    config: K3Config
    world_size: int
    rank: int
    embed: torch.Tensor       # [V / W, hidden], rows [rank * V / W, ...) of the vocabulary
    lm_head: torch.Tensor     # [V / W, hidden]
    final_norm: torch.Tensor  # [hidden]
    out_mix: MixWeights
    layers: list
    distinct_layers: int
    source: str
    projections: str = "bf16"  # 'bf16' (the dtype of the tensors), 'fp8' or 'fp8_emulated' (to_fp8)
    experts: str = "bf16"      # the routed experts: 'bf16' (the dtype of the tensors) or 'mxfp4' (to_article)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @classmethod
    def from_model(cls, model, world_size: int = 1, rank: int = 0) -> RankWeights:
        """Rank `rank` of `world_size` of a K3Model (ValueError when a divided size does not divide)."""
        config = model.config.sliced(world_size) if world_size > 1 else model.config
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}), got {rank!r}")
        layers = []
        for layer in model.layers:
            kda = layer.layer_type == "kda"
            attn = (KDAWeights if kda else MLAWeights).from_layer(layer.self_attn, world_size, rank)
            mlp = (MoEWeights.from_layer(layer.mlp, world_size, rank) if layer.is_moe
                   else DenseWeights.from_mlp(layer.mlp, world_size, rank))
            layers.append(LayerWeights(NormWeights.from_layer(layer), attn, mlp))
        return cls(config, world_size, rank, _rows(model.embed_tokens.weight, world_size, rank),
                   _rows(model.lm_head.weight, world_size, rank), model.norm.weight.detach(),
                   MixWeights.of(model.output_res_norm.weight, model.output_res_proj.weight), layers,
                   config.num_hidden_layers, "model")

    @classmethod
    def random(cls, config: K3Config, *, distinct_layers: int = 4, device=None, dtype=torch.bfloat16,
               seed: int = 0) -> RankWeights:
        """Fresh weights at the shapes of `config` (a rank's slice), `distinct_layers` sets of each kind
        (KDA attention, MLA attention, MoE) rotated through the layers; drawn on `device`."""
        if not isinstance(distinct_layers, int) or distinct_layers < 1:
            raise ValueError(f"distinct_layers must be a positive integer, got {distinct_layers!r}")
        gen = _Draw(device, dtype, seed)
        h = config.hidden_size
        kinds = {"kda": [], "mla": [], "moe": []}
        layers = []
        for i, kind in enumerate(config.layer_types):
            sets = kinds[kind]
            if len(sets) < distinct_layers:
                sets.append(gen.kda(config) if kind == "kda" else gen.mla(config))
            attn = sets[sum(1 for t in config.layer_types[:i] if t == kind) % distinct_layers]
            if config.is_moe_layer(i):
                moe = kinds["moe"]
                if len(moe) < distinct_layers:
                    moe.append(gen.moe(config))
                mlp = moe[(i - config.first_k_dense_replace) % distinct_layers]
            else:
                mlp = gen.dense(config)
            layers.append(LayerWeights(gen.norms(h), attn, mlp))
        return cls(config, config.tp_size, 0, gen.matrix(config.vocab_size, h, unit=True),
                   gen.matrix(config.vocab_size, h), gen.norm(h), gen.mix(h), layers, distinct_layers,
                   "random")

    def to_fp8(self, *, emulated: bool = False) -> RankWeights:
        """These weights with FP8_PROJECTIONS quantized (`fp8.quantize_weight`: e4m3fn, per-row fp32
        scales) and, on a GPU, the MoE router (bf16) as a `GemvWeight`, so every one-row product of the
        FP8 step is k3lab's GEMV; the rest, and the rotation of shared layer sets, shared with self.
        emulated: the plain-PyTorch product (CPU tests where torch's CPU `_scaled_mm` lacks e4m3fn).
        ValueError if these are FP8 already."""
        if self.projections != "bf16":
            raise ValueError(f"weights: projections are {self.projections} already")
        done: dict[int, object] = {}

        def convert(part):
            if id(part) not in done:
                names = FP8_PROJECTIONS.get(type(part).__name__, ())
                new = {n: fp8.quantize_weight(getattr(part, n), emulated=emulated) for n in names
                       if getattr(part, n) is not None}
                if isinstance(part, MoEWeights) and part.gate.is_cuda:  # the bf16 router: one-row GEMV
                    from k3lab.ops.gemv import GemvWeight

                    new["gate"] = GemvWeight(part.gate)
                done[id(part)] = dataclasses.replace(part, **new) if new else part
            return done[id(part)]

        layers = [LayerWeights(lw.norms, convert(lw.attn), convert(lw.mlp)) for lw in self.layers]
        return dataclasses.replace(self, layers=layers, projections="fp8_emulated" if emulated else "fp8")

    def to_article(self, *, emulated: bool = False) -> RankWeights:
        """The article's weight formats: `to_fp8(emulated=)` (FP8 dense projections) and every MoE
        layer's routed experts w1, w3, w2 as `mxfp4.Mxfp4Weight` stacks (quantized once per shared
        layer set). ValueError if the experts are converted already."""
        if self.experts != "bf16":
            raise ValueError(f"weights: the experts are {self.experts} already")
        q = self.to_fp8(emulated=emulated)
        done: dict[int, object] = {}

        def convert(part):
            if isinstance(part, MoEWeights) and id(part) not in done:
                done[id(part)] = dataclasses.replace(part, **{n: mxfp4.quantize(getattr(part, n))
                                                             for n in ("w1", "w3", "w2")})
            return done.get(id(part), part)

        layers = [LayerWeights(lw.norms, lw.attn, convert(lw.mlp)) for lw in q.layers]
        return dataclasses.replace(q, layers=layers, experts="mxfp4")

    def dequantized(self, dtype: torch.dtype = torch.float64) -> RankWeights:
        """Plain `dtype` tensors of the values these weights stand for: FP8 projections and MXFP4 experts
        dequantized (exactly: every code times its scale), GEMV-wrapped weights unwrapped, the rest cast;
        the rotation of shared layer sets kept. The reference a quantized step is checked against."""
        done: dict[int, object] = {}

        def plain(t):
            if isinstance(t, fp8.Fp8Linear):
                return t.dequantize().to(dtype)
            if isinstance(t, mxfp4.Mxfp4Weight):
                return t.dequantize(dtype)
            if isinstance(t, fp8.GemvWeight):
                t = t.weight
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        def part_of(part):
            if id(part) not in done:
                new = {f.name: plain(getattr(part, f.name)) for f in dataclasses.fields(part)}
                new = {n: MixWeights(*(plain(getattr(v, f)) for f in ("res_norm", "res_proj", "folded")))
                       if isinstance(v, MixWeights) else v for n, v in new.items()}
                if isinstance(part, KDAWeights):
                    dec = part.decode
                    new["decode"] = dataclasses.replace(dec, **{f.name: plain(getattr(dec, f.name))
                                                                for f in dataclasses.fields(dec)})
                done[id(part)] = dataclasses.replace(part, **new)
            return done[id(part)]

        layers = [LayerWeights(part_of(lw.norms), part_of(lw.attn), part_of(lw.mlp)) for lw in self.layers]
        out_mix = MixWeights(*(plain(getattr(self.out_mix, f)) for f in ("res_norm", "res_proj", "folded")))
        return dataclasses.replace(self, embed=plain(self.embed), lm_head=plain(self.lm_head),
                                   final_norm=plain(self.final_norm), out_mix=out_mix, layers=layers,
                                   projections="bf16", experts="bf16")

    def to_gemv(self) -> RankWeights:
        """These weights with FP8_PROJECTIONS and the MoE router wrapped as `k3lab.ops.gemv.GemvWeight`
        (the same tensors: one-row inputs run k3lab's one-row kernel, more rows torch.matmul); the rest
        shared with self. ValueError if these are converted already."""
        if self.projections != "bf16":
            raise ValueError(f"weights: projections are {self.projections} already")
        from k3lab.ops.gemv import GemvWeight

        done: dict[int, object] = {}

        def wrap(part):
            if id(part) not in done:
                names = FP8_PROJECTIONS.get(type(part).__name__, ()) + (
                    ("gate",) if isinstance(part, MoEWeights) else ()
                )
                new = {n: GemvWeight(getattr(part, n)) for n in names if getattr(part, n) is not None}
                done[id(part)] = dataclasses.replace(part, **new) if new else part
            return done[id(part)]

        layers = [LayerWeights(lw.norms, wrap(lw.attn), wrap(lw.mlp)) for lw in self.layers]
        return dataclasses.replace(self, layers=layers, projections="gemv")

    def projection_bytes(self, projections: str = "fp8", by_part: bool = False):
        """Bytes one step reads from FP8_PROJECTIONS (every layer, shared sets counted at each use),
        stored as `projections`: 'bf16' (the embedding's dtype, as the plain step holds them) or 'fp8'
        (a byte per value of the 16-padded matrix and a 4-byte scale per padded row). From shapes: the
        same figure whichever form these weights are in. The FP8 step's bytes floor is the plain one
        less projection_bytes('bf16') - projection_bytes('fp8'). by_part: a dict per layer part
        instead ('kda', 'mla', 'moe', 'dense': the decode_step attribution's parts)."""
        if projections not in fp8.PROJECTIONS:
            raise ValueError(f"projections must be one of {fp8.PROJECTIONS}, got {projections!r}")
        parts = {"KDAWeights": "kda", "MLAWeights": "mla", "MoEWeights": "moe", "DenseWeights": "dense"}
        total = dict.fromkeys(parts.values(), 0)
        for layer in self.layers:
            for part in (layer.attn, layer.mlp):
                kind = type(part).__name__
                for name in FP8_PROJECTIONS.get(kind, ()):
                    t = getattr(part, name)
                    if t is None:
                        continue
                    n, k = t.shape
                    if projections == "fp8":
                        total[parts[kind]] += fp8.round_up(n) * (fp8.round_up(k) + 4)
                    else:
                        total[parts[kind]] += n * k * self.embed.element_size()
        return total if by_part else sum(total.values())

    def nbytes(self) -> dict[str, int]:
        """Bytes of distinct weight storage held: 'experts', 'other' and 'total' (FP8 projections at
        their stored size: a byte per value and the row scales)."""
        seen, sizes = set(), {"experts": 0, "other": 0}
        for layer in self.layers:
            for part in (layer.norms, layer.attn, layer.mlp):
                if id(part) in seen:
                    continue
                seen.add(id(part))
                for name, t in vars(part).items():
                    if isinstance(t, torch.Tensor):
                        sizes["experts" if name in ("w1", "w2", "w3")
                              else "other"] += t.numel() * t.element_size()
                    elif isinstance(t, mxfp4.Mxfp4Weight):
                        sizes["experts"] += t.nbytes
                    elif isinstance(t, fp8.Fp8Linear):
                        sizes["other"] += t.nbytes()
                    elif isinstance(t, fp8.GemvWeight):
                        sizes["other"] += t.weight.numel() * t.weight.element_size()
        sizes["other"] += sum(t.numel() * t.element_size() for t in (self.embed, self.lm_head))
        sizes["total"] = sizes["experts"] + sizes["other"]
        return sizes


class _Draw:
    """Random weights of K3's kinds, scaled as k3lab.model.init_weights scales them (projections by
    fan_in^-0.5, norms near one, gate parameters in their working ranges), drawn on the device."""

    def __init__(self, device, dtype, seed: int):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def matrix(self, *shape, unit: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype)
        return t if unit else t.mul_(shape[-1] ** -0.5)

    def uniform(self, n: int, lo: float, hi: float) -> torch.Tensor:
        return torch.empty(n, device=self.device).uniform_(lo, hi, generator=self.gen)

    def norm(self, n: int) -> torch.Tensor:
        return self.matrix(n, unit=True).mul_(0.1).add_(1.0)

    def mix(self, h: int) -> MixWeights:
        return MixWeights.of(self.norm(h), self.matrix(1, h))

    def norms(self, h: int) -> NormWeights:
        return NormWeights(self.norm(h), self.norm(h), self.mix(h), self.mix(h))

    def kda(self, c: K3Config) -> KDAWeights:
        H, K, r, h = c.kda_num_heads, c.kda_head_dim, c.kda_gate_rank, c.hidden_size
        C = H * K
        f32 = {"device": self.device, "dtype": torch.float32}
        conv = [torch.randn(C, c.kda_conv_size, generator=self.gen, **f32).mul_(c.kda_conv_size ** -0.5)
                for _ in range(3)]
        dec = KDADecodeWeights(*conv, self.uniform(H, math.log(0.5), math.log(2.0)),
                               self.uniform(C, -6.0, 0.0),
                               self.norm(K).float(), c.kda_gate_lower_bound, c.rms_norm_eps)
        return KDAWeights(self.matrix(4 * C + H + r, h), self.matrix(C, r), self.matrix(h, C), dec)

    def mla(self, c: K3Config) -> MLAWeights:
        H, h, lat = c.num_attention_heads, c.hidden_size, c.kv_lora_rank
        w_in = self.matrix(c.q_lora_rank + c.mla_latent_dim + H * c.v_head_dim, h)
        return MLAWeights(w_in, self.norm(c.q_lora_rank), self.matrix(H * c.qk_head_dim, c.q_lora_rank),
                          self.norm(lat), self.matrix(H, c.qk_nope_head_dim, lat),
                          self.matrix(H, c.v_head_dim, lat),
                          self.matrix(h, H * c.v_head_dim), c.rms_norm_eps)

    def dense(self, c: K3Config) -> DenseWeights:
        return DenseWeights(self.matrix(2 * c.intermediate_size, c.hidden_size),
                            self.matrix(c.hidden_size, c.intermediate_size))

    def moe(self, c: K3Config) -> MoEWeights:
        E, F, L, h, S = (c.num_experts, c.moe_intermediate_size, c.routed_expert_hidden_size, c.hidden_size,
                         c.shared_intermediate_size)
        bias = torch.randn(E, generator=self.gen, device=self.device).mul_(0.1)
        shared = (self.matrix(2 * S, h), self.matrix(h, S)) if c.num_shared_experts else (None, None)
        return MoEWeights(self.matrix(E, h), bias, c.num_experts_per_token, c.routed_scaling_factor,
                          c.norm_topk_prob, self.matrix(L, h), self.matrix(E, F, L), self.matrix(E, F, L),
                          self.matrix(E, L, F), self.norm(L), c.rms_norm_eps, self.matrix(h, L), *shared,
                          world_size=c.tp_size, rank=0)
