"""Kimi K3's numbers, the presets k3lab runs at, and the sizes derived from them.

Field names follow the Hugging Face config where one exists. Every default is the released
K3 value (docs/k3.md). `K3Config.full()` is the whole model,
`K3Config.tp_slice(8)` is one GPU's share in the seed's TP8 layout, and `K3Config.tiny()` is a
few-layer model for CPUs that keeps the per-head sizes K3's kernels assume (KDA K = V = 128,
MLA latent 512 + 64), so that the same kernels run on it unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

GiB = 1024**3
MiB = 1024**2


# The chunk sizes KDA's chunked form takes: powers of two (the kernels tile a chunk by them) up to 256
# (the reference forms a [C, C, K] pairwise-decay tensor per chunk, which grows with C squared).
KDA_CHUNK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class K3Config:
    # model body
    hidden_size: int = 7168
    num_hidden_layers: int = 93
    vocab_size: int = 163840
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    # layer map: an MLA layer every `mla_layer_period` layers (0-based index period-1, 2*period-1,
    # ...) and the last layer; KDA elsewhere
    mla_layer_period: int = 4
    mla_last_layer: bool = True
    # MLA
    num_attention_heads: int = 96
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_rope: bool = False  # NoPE: the 64 "rope" dims are stored and used, never rotated
    # KDA
    kda_num_heads: int = 96
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_gate_rank: int = 128  # f_a: hidden -> 128, f_b: 128 -> heads * head_dim
    kda_gate_lower_bound: float = -5.0
    kda_chunk_size: int = 64
    # MLP / MoE
    first_k_dense_replace: int = 1
    intermediate_size: int = 33792
    num_experts: int = 896
    num_experts_per_token: int = 16
    moe_intermediate_size: int = 3072
    routed_expert_hidden_size: int = 3584
    num_shared_experts: int = 2
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # Attention Residuals: a block is this many decoder layers
    attn_res_block_size: int = 12
    # speculative decoding: K3 ships no MTP layer; its drafter is a separate model
    num_nextn_predict_layers: int = 0
    # which rank's share this config describes (1 = the whole model)
    tp_size: int = 1
    name: str = field(default="full", compare=False)

    def __post_init__(self):
        positive = [
            "hidden_size", "num_hidden_layers", "vocab_size", "mla_layer_period", "num_attention_heads",
            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "kda_num_heads", "kda_head_dim", "kda_conv_size", "kda_gate_rank", "kda_chunk_size",
            "intermediate_size", "num_experts", "num_experts_per_token", "moe_intermediate_size",
            "routed_expert_hidden_size", "attn_res_block_size", "tp_size",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"K3Config.{name} must be a positive integer, got {value!r}")
        if self.num_shared_experts < 0:
            raise ValueError(f"K3Config.num_shared_experts must be >= 0, got {self.num_shared_experts}")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"K3Config.num_experts_per_token ({self.num_experts_per_token}) cannot exceed "
                f"num_experts ({self.num_experts})")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            raise ValueError(
                f"K3Config.first_k_dense_replace must be in [0, num_hidden_layers={self.num_hidden_layers}], "
                f"got {self.first_k_dense_replace}")
        if self.kda_chunk_size not in KDA_CHUNK_SIZES:
            raise ValueError(f"K3Config.kda_chunk_size must be one of {KDA_CHUNK_SIZES} (a power of two up "
                             f"to 256; K3 uses 64), got {self.kda_chunk_size!r}")
        if not self.kda_gate_lower_bound < 0:
            raise ValueError(f"K3Config.kda_gate_lower_bound must be negative, got "
                             f"{self.kda_gate_lower_bound}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"K3Config.rms_norm_eps must be positive, got {self.rms_norm_eps}")

    # ---------------------------------------------------------------- presets
    @classmethod
    def full(cls) -> "K3Config":
        """The released model, TP = 1."""
        return cls()

    @classmethod
    def tp_slice(cls, tp: int = 8) -> "K3Config":
        """One rank's share under tensor parallelism `tp` (the seed serves K3 at TP8).

        Heads, intermediate widths and the vocabulary (embedding and lm_head are vocab-parallel) are
        divided; the hidden size, the MLA latent (replicated under TP), the router and the latent MoE
        projections are not.
        """
        return cls.full().sliced(tp)

    @classmethod
    def tiny(cls) -> "K3Config":
        """Six layers (KDA x3, MLA, KDA, MLA), AttnRes blocks of 2 layers (boundaries at 0, 2, 4),
        8 experts top-2, hidden 256; KDA K = V = 128 and MLA latent 512 + 64 as in K3."""
        return cls(
            hidden_size=256, num_hidden_layers=6, vocab_size=512, num_attention_heads=4, q_lora_rank=64,
            kda_num_heads=2, kda_gate_rank=32, intermediate_size=512, num_experts=8,
            num_experts_per_token=2, moe_intermediate_size=64, routed_expert_hidden_size=128,
            attn_res_block_size=2, name="tiny",
        )

    @classmethod
    def preset(cls, name: str) -> "K3Config":
        """'full', 'tiny', or 'tpN' (for example 'tp8')."""
        if name == "full":
            return cls.full()
        if name == "tiny":
            return cls.tiny()
        if name.startswith("tp") and name[2:].isdigit():
            return cls.tp_slice(int(name[2:]))
        raise ValueError(f"preset must be 'full', 'tiny' or 'tpN' (e.g. 'tp8'), got {name!r}")

    def sliced(self, tp: int) -> "K3Config":
        """This config divided over `tp` ranks; raises ValueError naming the field that does not divide."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive integer, got {tp!r}")
        if self.tp_size != 1:
            raise ValueError(f"this config is already a TP{self.tp_size} slice; slice the full config")
        divided = {
            "num_attention_heads": self.num_attention_heads,
            "kda_num_heads": self.kda_num_heads,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,  # embedding and lm_head are split by vocabulary under TP
        }
        for name, value in divided.items():
            if value % tp:
                raise ValueError(f"K3Config.{name} = {value} is not divisible by tp = {tp}")
        if self.shared_intermediate_size % tp:
            raise ValueError(
                f"K3Config shared expert width {self.shared_intermediate_size} is not divisible by tp = {tp}")
        return dataclasses.replace(
            self, tp_size=tp, name=f"tp{tp}" if self.name == "full" else f"{self.name}-tp{tp}",
            **{k: v // tp for k, v in divided.items()})

    # ---------------------------------------------------------------- layer map
    @property
    def layer_types(self) -> list[str]:
        """'kda' or 'mla' for each decoder layer (K3: MLA at 3, 7, ..., 91 and 92)."""
        last = self.num_hidden_layers - 1
        return [
            "mla" if (i % self.mla_layer_period == self.mla_layer_period - 1)
            or (self.mla_last_layer and i == last)
            else "kda"
            for i in range(self.num_hidden_layers)
        ]

    @property
    def num_mla_layers(self) -> int:
        return self.layer_types.count("mla")

    @property
    def num_kda_layers(self) -> int:
        return self.layer_types.count("kda")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    def attn_res_block_starts(self) -> list[int]:
        """Layers at which the running partial sum is pushed as a completed block and reset."""
        return list(range(0, self.num_hidden_layers, self.attn_res_block_size))

    @property
    def attn_res_max_sources(self) -> int:
        """Stored blocks plus the running partial at the model output (K3: 8 + 1 = 9)."""
        return len(self.attn_res_block_starts()) + 1

    # ---------------------------------------------------------------- derived widths
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Cached values per position per MLA layer: latent + rope part (576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def mla_softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5

    @property
    def kda_width(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def shared_intermediate_size(self) -> int:
        """The shared experts are one MLP of width num_shared_experts x moe intermediate (K3: 6144)."""
        # At a TP slice the routed intermediate is already divided; the full shared width is
        # num_shared * full moe intermediate, so divide it the same way.
        return self.num_shared_experts * self.moe_intermediate_size

    # ---------------------------------------------------------------- sizes
    def mla_latent_bytes_per_position(self, dtype_bytes: float = 1) -> float:
        """Bytes per cached position per MLA layer (576 in FP8, 1152 in BF16)."""
        return self.mla_latent_dim * dtype_bytes

    def kda_state_bytes_per_sequence(self, dtype_bytes: int = 4) -> int:
        """The recurrent state of one sequence in one KDA layer (K3 fp32: 6 MiB; TP8 slice: 768 KiB)."""
        return self.kda_num_heads * self.kda_head_dim * self.kda_head_dim * dtype_bytes

    def kda_conv_state_values_per_sequence(self) -> int:
        """Conv history kept per KDA layer: (conv_size - 1) inputs of q, k and v."""
        return 3 * self.kda_width * (self.kda_conv_size - 1)

    def conversation_bytes_per_gpu(self, tokens: int, dcp: int = 1, dtype_bytes: float = 1) -> float:
        """MLA history of a `tokens`-long conversation held by one GPU.

        Under TP alone every GPU keeps the whole latent (it is not divided by heads); under DCP
        each GPU keeps every `dcp`-th position (ceil(tokens / dcp)).
        """
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        if not isinstance(dcp, int) or dcp < 1:
            raise ValueError(f"dcp must be a positive integer, got {dcp!r}")
        positions = math.ceil(tokens / dcp)
        return self.num_mla_layers * positions * self.mla_latent_bytes_per_position(dtype_bytes)

    def kda_state_bytes_all_layers(self, dtype_bytes: int = 4) -> int:
        return self.num_kda_layers * self.kda_state_bytes_per_sequence(dtype_bytes)

    # ---------------------------------------------------------------- parameters
    def component_params(self) -> dict[str, int]:
        """Parameters of one layer of each kind, and of the model's ends (this config's share)."""
        h = self.hidden_size
        w = self.kda_width
        nh = self.num_attention_heads
        # input and post-attention norms, and two AttnRes pairs (norm [h] + projection [1, h])
        layer_norms = 6 * h
        kda = (
            3 * w * h + 3 * w * self.kda_conv_size + self.kda_gate_rank * h + w * self.kda_gate_rank
            + w + self.kda_num_heads + self.kda_num_heads * h + w * h + self.kda_head_dim + h * w
        )
        mla = (
            self.q_lora_rank * h + self.q_lora_rank + nh * self.qk_head_dim * self.q_lora_rank
            + self.mla_latent_dim * h + self.kv_lora_rank
            + nh * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank
            + nh * self.v_head_dim * h + h * nh * self.v_head_dim
        )
        expert = 3 * self.moe_intermediate_size * self.routed_expert_hidden_size
        moe_common = (
            self.num_experts * h + self.num_experts  # router and its correction bias
            + 2 * self.routed_expert_hidden_size * h + self.routed_expert_hidden_size  # down, up, norm
            + 3 * self.shared_intermediate_size * h
        )
        return {
            "embedding": self.vocab_size * h,
            "lm_head": 0 if self.tie_word_embeddings else self.vocab_size * h,
            "final_norm": 3 * h,  # the final norm and the output AttnRes pair
            "layer_norms": layer_norms,
            "kda": kda,
            "mla": mla,
            "dense_mlp": 3 * self.intermediate_size * h,
            "moe_common": moe_common,
            "expert": expert,
        }

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters of this config's share, embeddings included."""
        c = self.component_params()
        ends = c["embedding"] + c["lm_head"] + c["final_norm"]
        attn = self.num_kda_layers * c["kda"] + self.num_mla_layers * c["mla"]
        dense = self.first_k_dense_replace * c["dense_mlp"]
        body = self.num_hidden_layers * c["layer_norms"] + attn + dense
        total = ends + body + self.num_moe_layers * (c["moe_common"] + self.num_experts * c["expert"])
        active = ends + body + self.num_moe_layers * (c["moe_common"] + self.num_experts_per_token
                                                      * c["expert"])
        return total, active

    def summary(self) -> str:
        total, active = self.param_counts()
        return (f"K3Config[{self.name}]: {self.num_hidden_layers} layers ({self.num_kda_layers} KDA, "
                f"{self.num_mla_layers} MLA), hidden {self.hidden_size}, MLA heads "
                f"{self.num_attention_heads}, KDA heads {self.kda_num_heads}, experts {self.num_experts} "
                f"top-{self.num_experts_per_token}, {total / 1e9:.2f}B params ({active / 1e9:.2f}B active)")
