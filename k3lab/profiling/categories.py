"""Sort a kernel or op name into one of a few categories, so tables and plots can group them.

The categories answer "where did the time go" at the level the seed article argues at:
gemm, attention, recurrence (KDA / delta rule), norm, copy, elementwise, reduction,
communication, other. Names come from many producers (ATen CUDA/HIP kernels, hipBLASLt
`Cijk_*`, cuBLAS/CUTLASS, Triton, fla, rocprofv3 copy records, torch.profiler CPU ops), so the
rules look at substrings and at whole name tokens. The order of the rules matters: a name is
given the first category whose rule matches (a copy kernel wrapped in an elementwise template
is a copy; a norm fused with a rotation is a norm).
"""

from __future__ import annotations

import functools
import re

CATEGORIES = ("gemm", "attention", "recurrence", "norm", "copy", "elementwise", "reduction",
              "communication", "other")

# CPU traces name ATen ops ("aten::mm"); those are matched exactly first, because short op
# names ("to", "t", "mm") are too ambiguous for substring rules.
_ATEN = {
    "gemm": "mm addmm bmm baddbmm matmul linear addmv mv dot einsum _scaled_mm _grouped_mm "
            "convolution conv1d conv2d _convolution",
    "attention": "scaled_dot_product_attention _scaled_dot_product_flash_attention "
                 "_scaled_dot_product_efficient_attention _scaled_dot_product_cudnn_attention "
                 "_flash_attention_forward _efficient_attention_forward",
    "norm": "layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm native_group_norm "
            "batch_norm native_batch_norm linalg_vector_norm norm",
    "copy": "copy_ _to_copy to clone contiguous cat stack _copy_from _copy_from_and_resize "
            "index_select gather scatter index_copy index_put repeat repeat_interleave",
    "reduction": "sum mean max min amax amin argmax argmin prod cumsum logsumexp softmax "
                 "_softmax log_softmax _log_softmax topk sort var std all any",
    "elementwise": "add sub mul div neg exp log sqrt rsqrt pow abs relu gelu silu sigmoid tanh "
                   "clamp where fill zero zeros ones uniform normal dropout masked_fill "
                   "lerp addcmul addcdiv reciprocal sign erf sin cos exp2 maximum minimum",
    "communication": "all_reduce all_gather reduce_scatter all_to_all broadcast",
}
_ATEN_CATEGORY = {op: cat for cat, ops in _ATEN.items() for op in ops.split()}

# (category, substrings anywhere in the lower-cased name, whole tokens). Tokens are the pieces
# between non-alphanumeric characters: "fused_silu_mul_f32" -> fused, silu, mul, f32.
_RULES: tuple[tuple[str, tuple[str, ...], frozenset[str]], ...] = (
    ("communication",
     ("nccl", "rccl", "c10d::", "gloo", "allreduce", "all_reduce", "allgather", "all_gather",
      "reducescatter", "reduce_scatter", "alltoall", "all_to_all", "sendrecv", "cross_device_reduce",
      "custom_all_reduce"),
     frozenset()),
    ("copy",
     ("memcpy", "copybuffer", "copy_kernel", "direct_copy", "copy_", "_to_copy", "batchedcopy",
      "memory_copy", "copyhosttodevice", "copydevicetohost", "copydevicetodevice", "copyhosttohost",
      "reshape_and_cache", "cache_write", "nchwtonhwc", "nhwctonchw", "transpose_kernel"),
     frozenset({"copy", "dtod", "htod", "dtoh", "ptod", "dtop", "clone", "contiguous"})),
    ("recurrence",
     ("kda", "delta_rule", "deltarule", "delta_net", "deltanet", "fused_recurrent", "recurrent",
      "solve_tril", "recompute_w_u", "wy_repr", "gdn_", "_gdn", "gla_", "retention", "selective_scan",
      "mamba"),
     frozenset()),
    ("attention",
     ("attention", "attn", "flash_fwd", "flash_bwd", "flashattn", "flash_attn", "fmha", "sdpa",
      "scaled_dot_product", "paged_", "flashinfer", "flashmla", "mla_decode", "decode_mla"),
     frozenset({"mla", "mha", "gqa", "mqa"})),
    ("gemm",
     ("gemm", "gemv", "cijk_", "matmul", "cutlass", "cublas", "hipblas", "rocblas", "xmma", "nvjet",
      "wmma", "mfma", "scudnn", "fprop", "dgrad", "wgrad", "fused_moe", "grouped_mm", "_scaled_mm",
      "triton_tem_", "tensorop", "splitk"),
     frozenset({"mm", "bmm", "addmm", "baddbmm", "linear"})),
    ("norm",
     ("rmsnorm", "rms_norm", "layernorm", "layer_norm", "groupnorm", "group_norm", "batchnorm",
      "batch_norm", "l2norm", "l2_norm", "gammabeta"),
     frozenset({"norm"})),
    ("reduction",
     ("reduce", "reduction", "triton_red_", "triton_per_", "softmax", "topk", "top_k", "cumsum",
      "logsumexp", "argmax", "argmin", "rocprim", "cub::", "radix_sort", "merge_sort", "pool"),
     frozenset({"sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "sort"})),
    ("elementwise",
     ("elementwise", "vectorized", "triton_poi_", "pointwise", "unrolled", "fillbuffer", "memset",
      "multi_tensor_apply", "act_and_mul", "silu_and_mul", "gelu_and_mul", "swiglu", "rotary",
      "functor", "distribution", "dropout"),
     frozenset({"add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "relu",
                "gelu", "silu", "sigmoid", "tanh", "clamp", "where", "fill", "cast", "convert",
                "quantize", "dequantize", "rope", "rotate", "scale", "bias", "residual"})),
)

_SPLIT = re.compile(r"[^a-z0-9]+")
_CHUNK = re.compile(r"(^|[^a-z])chunk_")  # not aten::chunk (a view), which has no underscore after


@functools.lru_cache(maxsize=65536)
def categorize(name: str) -> str:
    """Category of a kernel or op name: one of `CATEGORIES`.

    Examples (real names from the fixtures): ``Cijk_Alik_Bljk_...`` -> gemm,
    ``__amd_rocclr_copyBuffer`` -> copy, ``Memcpy DtoD (Device -> Device)`` -> copy,
    ``gated_delta_net_q8_fast`` -> recurrence, ``attn_fwd`` -> attention,
    ``rmsnorm_f32`` -> norm, ``ncclDevKernel_Generic_1`` -> communication, ``aten::mm`` -> gemm.
    """
    if not isinstance(name, str):
        raise ValueError(f"categorize: name must be a str, got {type(name).__name__}")
    low = name.strip().lower()
    if low.startswith("aten::"):
        op = low[len("aten::"):]
        found = _ATEN_CATEGORY.get(op) or _ATEN_CATEGORY.get(op.rstrip("_"))
        if found:
            return found
    tokens = frozenset(t for t in _SPLIT.split(low) if t)
    for category, substrings, whole in _RULES:
        if category == "recurrence" and _CHUNK.search(low):
            return "recurrence"  # fla's chunked kernels: chunk_kda_fwd..., chunk_scaled_dot_kkt_fwd...
        if category == "norm" and "rsqrt" in tokens and ("mean" in tokens or "var" in tokens):
            return "norm"  # Inductor names a fused RMSNorm by its ops: ..._mean_mul_pow_rsqrt_0
        if any(s in low for s in substrings) or (whole and not whole.isdisjoint(tokens)):
            return category
    return "other"
