"""Reference components of Kimi K3 in plain PyTorch: readable, any size, the ground truth every
k3lab kernel is checked against. Nothing here imports k3lab.ops."""

from .attn_res import AttnResState, attn_res_mix
from .decoder import DecoderLayer
from .kda import (
    KDACache,
    KimiDeltaAttention,
    chunk_inverse,
    kda_beta,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    short_conv,
)
from .mla import MLACache, MultiHeadLatentAttention, latent_attention
from .moe import DenseMLP, LatentMoE, MoEGate, RoutedExpert, SiTUMLP, route
from .norms import RMSNorm, gated_rms_norm, l2_normalize, rms_norm
from .situ import situ_gate, situ_glu, situ_up

__all__ = [
    "AttnResState", "DecoderLayer", "DenseMLP", "KDACache", "KimiDeltaAttention", "LatentMoE", "MLACache",
    "MoEGate", "MultiHeadLatentAttention", "RMSNorm", "RoutedExpert", "SiTUMLP", "attn_res_mix",
    "chunk_inverse", "gated_rms_norm", "kda_beta", "kda_chunked", "kda_gate", "kda_recurrent", "l2_normalize",
    "latent_attention", "rms_norm", "route", "short_conv", "situ_gate", "situ_glu", "situ_up",
]
