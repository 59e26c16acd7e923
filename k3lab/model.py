"""A whole K3 in plain PyTorch, with the caches a server keeps: `K3Model(config)`.

    logits, cache = model.prefill(input_ids)          # [B, T] -> [B, T, vocab]
    logits, cache = model.decode(next_ids, cache)     # [B, 1] -> [B, 1, vocab]
    ids = model.generate(prompt_ids, max_new_tokens)  # greedy

At `K3Config.tiny()` it runs on a CPU in milliseconds per token; at `full` it is the real model's
shape (construct it on the meta device to inspect it). `init_weights(model, seed)` fills it with
deterministic random weights whose activations stay of order one through every layer.
The cache (`K3Cache`) holds per MLA layer the latent history, per KDA layer the conv histories and
the fp32 recurrent state, and the AttnRes blocks and partial sum of the last position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .config import K3Config
from .nn.attn_res import AttnResState, attn_res_mix
from .nn.decoder import DecoderLayer
from .nn.mla import MLACache
from .nn.norms import RMSNorm


@dataclass
class K3Cache:
    """Everything a sequence carries from one step to the next.

    layers[i]: MLACache (grows by one 576-wide row per token) or KDACache (fixed size);
    attn_res_blocks [S, B, hidden] and attn_res_partial [B, hidden]: the depth state at the model
    output for the last position. AttnRes mixes within a position, so the next step does not read
    these; they are kept so that a step's end state can be inspected and checked.
    length: positions processed so far."""

    layers: list
    attn_res_blocks: torch.Tensor
    attn_res_partial: torch.Tensor
    length: int

    def entries(self) -> dict[str, torch.Tensor]:
        """Every tensor by name ('layers.3.latent', 'layers.0.state', 'attn_res.blocks', ...)."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name, t in layer.entries().items():
                out[f"layers.{i}.{name}"] = t
        out["attn_res.blocks"] = self.attn_res_blocks
        out["attn_res.partial"] = self.attn_res_partial
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes held per kind: 'mla_latent', 'kda_state', 'kda_conv', 'attn_res'."""
        sizes = {"mla_latent": 0, "kda_state": 0, "kda_conv": 0, "attn_res": 0}
        for layer in self.layers:
            if isinstance(layer, MLACache):
                sizes["mla_latent"] += layer.nbytes()
            else:
                sizes["kda_state"] += layer.state.numel() * layer.state.element_size()
                sizes["kda_conv"] += sum(t.numel() * t.element_size() for t
                                         in (layer.conv_q, layer.conv_k, layer.conv_v))
        for t in (self.attn_res_blocks, self.attn_res_partial):
            sizes["attn_res"] += t.numel() * t.element_size()
        return sizes


class K3Model(nn.Module):
    """Embedding, the decoder layers, the output AttnRes mix, the final norm and lm_head."""

    def __init__(self, config: K3Config, *, device=None, dtype=None):
        super().__init__()
        if not isinstance(config, K3Config):
            raise ValueError(f"config must be a K3Config, got {type(config).__name__}")  # noqa: TRY004
        if config.tp_size != 1:
            raise ValueError(f"K3Model is the whole model: config must have tp_size 1, got {config.tp_size} "
                             "(build single layers from a TP slice instead)")
        f = {"device": device, "dtype": dtype}
        h = config.hidden_size
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, h, **f)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **f) for i in range(config.num_hidden_layers))
        self.output_res_norm = RMSNorm(h, config.rms_norm_eps, **f)
        self.output_res_proj = nn.Linear(h, 1, bias=False, **f)
        self.norm = RMSNorm(h, config.rms_norm_eps, **f)
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False, **f)

    # ------------------------------------------------------------ checks
    def _check_ids(self, input_ids, name="input_ids"):
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(f"{name} must be a [B, T] integer tensor, got "
                             f"{getattr(input_ids, 'shape', input_ids)}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be int64 or int32 token ids, got {input_ids.dtype}")
        if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            raise ValueError(f"{name} must hold at least one token, got shape {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
            raise ValueError(f"{name} must lie in [0, vocab_size={self.config.vocab_size}), "
                             f"got [{int(input_ids.min())}, {int(input_ids.max())}]")

    def _check_cache(self, cache, batch):
        if not isinstance(cache, K3Cache):
            raise ValueError(f"cache must be a K3Cache (from prefill or decode), got "
                             f"{type(cache).__name__}")  # noqa: TRY004
        if len(cache.layers) != len(self.layers):
            raise ValueError(f"cache.layers must have {len(self.layers)} entries, got {len(cache.layers)}")
        for i, (layer, c) in enumerate(zip(self.layers, cache.layers)):
            try:
                layer.self_attn.check_cache(c, batch)
            except ValueError as err:
                raise ValueError(f"cache.layers[{i}] ({layer.layer_type}): {err}") from None

    # ------------------------------------------------------------ forward
    def forward(self, input_ids, cache: K3Cache | None = None):
        """Run the tokens `input_ids` [B, T] after the positions in `cache` (None: a new sequence).
        Returns (logits [B, T, vocab] in fp32, new cache); the input cache is not modified."""
        self._check_ids(input_ids)
        B, T = input_ids.shape
        if cache is not None:
            self._check_cache(cache, B)
        state = AttnResState.start(self.embed_tokens(input_ids))
        layer_caches = []
        for i, layer in enumerate(self.layers):
            state, c = layer(state, None if cache is None else cache.layers[i])
            layer_caches.append(c)
        eps = self.config.rms_norm_eps
        h = attn_res_mix(state.sources(), self.output_res_norm.weight, self.output_res_proj.weight, eps)
        logits = self.lm_head(self.norm(h, out_dtype=state.partial.dtype)).float()
        new_cache = K3Cache(layer_caches, torch.stack([b[:, -1] for b in state.blocks]) if state.blocks
                            else state.partial.new_zeros(0, B, state.partial.shape[-1]),
                            state.partial[:, -1], (0 if cache is None else cache.length) + T)
        return logits, new_cache

    def prefill(self, input_ids):
        """The prompt [B, T] of new sequences -> (logits [B, T, vocab], cache)."""
        return self.forward(input_ids, None)

    def decode(self, input_ids, cache: K3Cache):
        """One new token per sequence [B, 1] after `cache` -> (logits [B, 1, vocab], cache)."""
        self._check_ids(input_ids)
        if input_ids.shape[1] != 1:
            raise ValueError(f"input_ids must be [B, 1] for decode, got {tuple(input_ids.shape)}")
        if cache is None:
            raise ValueError("cache must be the K3Cache of the sequence (from prefill), got None")
        return self.forward(input_ids, cache)

    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int):
        """Greedy decoding: prefill the prompt [B, T] (or a list of ids), then `max_new_tokens` decode
        steps. Returns [B, T + max_new_tokens] token ids."""
        if not isinstance(prompt_ids, torch.Tensor):
            prompt_ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=self.lm_head.weight.device)
        if prompt_ids.dim() == 1:
            prompt_ids = prompt_ids.unsqueeze(0)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        ids = prompt_ids.long()
        if max_new_tokens == 0:
            self._check_ids(ids, "prompt_ids")
            return ids
        logits, cache = self.prefill(ids)
        out = [ids]
        for step in range(max_new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            if step + 1 < max_new_tokens:
                logits, cache = self.decode(nxt, cache)
        return torch.cat(out, dim=1)


# ------------------------------------------------------------ anatomy: what the model is made of
# MXFP4 stores 32 4-bit values with one shared 8-bit scale: 4 + 8/32 = 4.25 bits per expert weight.
MXFP4_BYTES_PER_PARAM = 4.25 / 8
BF16_BYTES = 2


def layer_plan(config: K3Config) -> list[dict]:
    """One row per decoder layer: layer, attention ('kda'|'mla'), mlp ('dense'|'moe'), attn_res_block
    (which AttnRes block the layer's outputs are summed into) and opens_block (the layer that pushes
    the previous block: 0, 12, 24, ... in K3)."""
    starts = set(config.attn_res_block_starts())
    return [{"layer": i, "attention": kind, "mlp": "moe" if config.is_moe_layer(i) else "dense",
             "attn_res_block": i // config.attn_res_block_size, "opens_block": i in starts}
            for i, kind in enumerate(config.layer_types)]


def component_table(config: K3Config) -> list[dict]:
    """Parameters and release storage per component, from `config.component_params()`: one row per
    component with params_each, count (instances in the model), params, format and bytes. Routed
    experts are MXFP4 (4.25 bits per weight); everything else is counted as BF16 (the few fp32 gate
    parameters are negligible)."""
    c = config.component_params()
    moe_layers = config.num_moe_layers
    rows = [
        ("embedding", c["embedding"], 1), ("lm_head", c["lm_head"], 1), ("final_norm", c["final_norm"], 1),
        ("layer_norms", c["layer_norms"], config.num_hidden_layers),
        ("kda", c["kda"], config.num_kda_layers), ("mla", c["mla"], config.num_mla_layers),
        ("dense_mlp", c["dense_mlp"], config.first_k_dense_replace),
        ("moe_common", c["moe_common"], moe_layers),
        ("routed_experts", c["expert"], moe_layers * config.num_experts),
    ]
    out = []
    for name, each, count in rows:
        fmt, per = ("MXFP4", MXFP4_BYTES_PER_PARAM) if name == "routed_experts" else ("BF16", BF16_BYTES)
        out.append({"component": name, "params_each": each, "count": count, "params": each * count,
                    "format": fmt, "bytes": each * count * per})
    return out


def state_sizes(config: K3Config, *, latent_bytes: float = 1,
                conv_bytes: int = BF16_BYTES) -> dict[str, float]:
    """What serving keeps per position and per sequence (this config's share), in bytes:
    mla_per_position_per_layer (576 in FP8), mla_per_position (all MLA layers), kda_state_per_sequence
    and kda_conv_per_sequence (all KDA layers), attn_res_per_token_in_flight (the 8 blocks + partial a
    token holds during a forward pass, fp32; nothing is carried to the next step)."""
    return {
        "mla_per_position_per_layer": config.mla_latent_bytes_per_position(latent_bytes),
        "mla_per_position": config.num_mla_layers * config.mla_latent_bytes_per_position(latent_bytes),
        "kda_state_per_sequence_per_layer": config.kda_state_bytes_per_sequence(),
        "kda_state_per_sequence": config.kda_state_bytes_all_layers(),
        "kda_conv_per_sequence": config.num_kda_layers * config.kda_conv_state_values_per_sequence()
        * conv_bytes,
        "attn_res_per_token_in_flight": config.attn_res_max_sources * config.hidden_size * 4,
    }


# ------------------------------------------------------------ deterministic weights
def _init_value(name: str, shape: torch.Size, gen: torch.Generator, device=None) -> torch.Tensor:
    """A fresh fp32 tensor for parameter `name`: scales chosen so that every projection keeps unit-size
    activations, gates sit in their working range and norms are near (not exactly) one."""
    leaf = name.rsplit(".", 2)
    last = leaf[-1]
    owner = leaf[-2] if len(leaf) > 1 else ""

    def randn(*s):
        return torch.randn(*s, generator=gen, device=device)

    if last == "A_log":  # decay rate multiplier exp(A_log) in [0.5, 2]
        return torch.empty(shape, device=device).uniform_(math.log(0.5), math.log(2.0), generator=gen)
    if last == "dt_bias":  # spread channels from slow (g ~ -0.01) to fast (g ~ -2.5) decay
        return torch.empty(shape, device=device).uniform_(-6.0, 0.0, generator=gen)
    if last == "e_score_correction_bias":  # small enough to only nudge the choice
        return 0.1 * randn(*shape)
    if owner.endswith(("norm", "layernorm")):
        return 1.0 + 0.1 * randn(*shape)
    if owner.endswith("_conv"):  # depthwise [C, 1, W]
        return randn(*shape) * shape[-1] ** -0.5
    if owner == "embed_tokens":
        return randn(*shape)
    if len(shape) == 2:  # every [out, in] projection, the AttnRes projections ([1, D]) included
        return randn(*shape) * shape[1] ** -0.5
    raise ValueError(f"init_weights has no rule for parameter {name} {tuple(shape)}")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0, on_device: bool = False) -> nn.Module:
    """Fill every parameter of `model` (a K3Model or any k3lab.nn layer) deterministically from `seed`.
    Values are drawn on the CPU in fp32 in parameter order and copied, so the same seed gives the same
    weights on any device and in any dtype. on_device=True draws them on the parameters' device
    instead (GPU-sized models in seconds; the same seed then gives other values than on the CPU).
    Returns the model."""
    first = next(model.parameters(), None)
    device = first.device if on_device and first is not None else torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(int(seed))
    for name, p in model.named_parameters():
        if p.is_meta:
            raise ValueError(f"model parameter {name} is on the meta device: build the model on a real "
                             "device (or call model.to_empty(device=...)) before init_weights")
        p.copy_(_init_value(name, p.shape, gen, device))
    return model
