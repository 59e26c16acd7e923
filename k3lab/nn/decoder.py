"""One K3 decoder layer: AttnRes mix -> RMSNorm -> KDA or MLA -> AttnRes mix -> RMSNorm -> MLP or MoE.

The AttnRes protocol (docs/k3.md), for layer l with incoming state (blocks, prefix):

    h = AttnRes(blocks + [prefix])            (self-attention pair; just `prefix` while no block exists)
    if l starts a block (0, 12, 24, ...):     blocks += [prefix]; prefix = 0
    prefix += attn(input_layernorm(h))
    h = AttnRes(blocks + [prefix])            (MLP pair)
    prefix += mlp(post_attention_layernorm(h))
"""

from __future__ import annotations

from torch import nn

from .attn_res import AttnResState
from .kda import KimiDeltaAttention
from .mla import MultiHeadLatentAttention
from .moe import DenseMLP, LatentMoE
from .norms import RMSNorm


class DecoderLayer(nn.Module):
    """Layer `layer_idx` of `config`: its attention kind from config.layer_types, dense MLP below
    first_k_dense_replace and latent MoE after, and whether it opens an AttnRes block."""

    def __init__(self, config, layer_idx: int, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < config.num_hidden_layers:
            raise ValueError(f"layer_idx must be in [0, {config.num_hidden_layers}), got {layer_idx!r}")
        f = {"device": device, "dtype": dtype}
        h, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx, self.eps = layer_idx, eps
        self.layer_type = config.layer_types[layer_idx]
        self.is_moe = config.is_moe_layer(layer_idx)
        self.starts_block = layer_idx in config.attn_res_block_starts()
        self.self_attn = (MultiHeadLatentAttention(config, **f) if self.layer_type == "mla"
                          else KimiDeltaAttention(config, **f))
        self.mlp = LatentMoE(config, **f) if self.is_moe else DenseMLP(config, **f)
        self.input_layernorm = RMSNorm(h, eps, **f)
        self.post_attention_layernorm = RMSNorm(h, eps, **f)
        self.self_attention_res_norm = RMSNorm(h, eps, **f)
        self.self_attention_res_proj = nn.Linear(h, 1, bias=False, **f)
        self.mlp_res_norm = RMSNorm(h, eps, **f)
        self.mlp_res_proj = nn.Linear(h, 1, bias=False, **f)

    def empty_cache(self, batch: int):
        return self.self_attn.empty_cache(batch)

    def forward(self, state: AttnResState, cache=None):
        """state: the AttnRes depth state of the tokens in flight ([B, T, hidden] each); cache: this
        layer's KDACache or MLACache (None at the start of a sequence). Returns (state, cache)."""
        if not isinstance(state, AttnResState):
            raise ValueError(f"state must be an AttnResState, got {type(state).__name__}")  # noqa: TRY004
        dtype = state.partial.dtype
        h = (state.mix(self.self_attention_res_norm.weight, self.self_attention_res_proj.weight, self.eps)
             if state.blocks else state.partial)
        if self.starts_block:
            state = state.push_block()
        a, cache = self.self_attn(self.input_layernorm(h, out_dtype=dtype), cache)
        state = state.add(a)
        h = state.mix(self.mlp_res_norm.weight, self.mlp_res_proj.weight, self.eps)
        state = state.add(self.mlp(self.post_attention_layernorm(h, out_dtype=dtype)))
        return state, cache

    def extra_repr(self) -> str:
        return (f"layer {self.layer_idx}: {self.layer_type}, {'moe' if self.is_moe else 'dense'}"
                f"{', opens an AttnRes block' if self.starts_block else ''}")
