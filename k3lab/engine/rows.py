"""The ops a decode step calls, each as one chosen row, and the callables the step binds from them.

`switches.resolve` settles every switch once into one `Chosen` per op: the op, the name of what runs
(a k3lab.ops backend row's name, or the switch's form, 'after' / 'before', where the op's kernel is picked
per call site at bind), why, and the callables the step calls, read as attributes (`chosen.after(...)`,
`chosen.bind(...)`). The callables are the chosen `BACKENDS` row's own (k3lab.ops' contract: `after`,
`before`, `plan_*`, the op's further pieces), given the step's shapes here. Nothing chooses again: a step
that has bound its callables makes no backend choice while it runs (tests/test_step_choices.py counts).

Call sites whose kernel depends on their tensors (the AttnRes mix by the stored blocks it mixes, the KDA
verification by its tile width and buffers, the MLA decode plans, the KDA decode step bound to its cache)
get a `bind(...)` callable: the row is picked once per site when the step binds, never per call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from k3lab.nn.moe import route
from k3lab.ops import attn_res_norm, kda_decode, kda_verify, mla_decode, moe_experts, packed_matmul

from .fp8 import gemv_one_row, linear, one_row_parts


@dataclass(frozen=True)
class Chosen:
    """One op of the step as `resolve` settled it. op: the k3lab.ops op; name: the backend row that runs
    (or the form, 'after' / 'before', where `bind` picks the kernel per site); why: the chooser's reason
    or the note of what runs instead; fns: the callables the step calls, by name (read as attributes)."""

    op: str
    name: str
    why: str = ""
    fns: Mapping[str, Callable] = field(default_factory=dict, compare=False)

    def __getattr__(self, name: str):
        fns = self.__dict__.get("fns") or {}
        if name in fns:
            return fns[name]
        raise AttributeError(f"{self.__dict__.get('op')} ({self.__dict__.get('name')}) binds no {name!r} "
                             f"(it binds {sorted(fns)})")


def of_row(op: str, row, why: str = "", **extra: Callable) -> Chosen:
    """A Chosen holding a k3lab.ops backend row's own callables (its `parts`) and `extra` ones."""
    return Chosen(op, row.name, why, {**row.parts, **extra})


def default_projections(tokens: int | None, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> str:
    """The dense projections' form where none is asked for (fp8.PROJECTIONS' names): 'gemv', k3lab.ops.gemv's
    one-row kernel, where the step multiplies one row (tokens == 1: decode at batch 1, where a projection
    is a weight stream and the one-row kernel streams it faster than the matrix library) on a GPU, else
    'bf16' (the matrix library in the weights' dtype): above one row; for weights in a dtype the one-row
    kernel does not take (fp64 references); and on a CPU, where the one-row kernel runs in Triton's
    interpreter and the matrix library is the fast path by far (asked for by name, it runs there too).
    Chosen once, by `switches.resolve`."""
    gemv_dtype = dtype in (None, torch.float32, torch.float16, torch.bfloat16)
    on_cpu = device is not None and torch.device(device).type == "cpu"
    return "gemv" if tokens == 1 and gemv_dtype and not on_cpu else "bf16"


# ------------------------------------------------------------------------------ the step's callables


def glu(row) -> Callable:
    """SiTU-GLU of a stacked gate|up product [N, 2F] -> [N, F] by the situ_glu row `row`."""
    after = row.after

    def situ_glu(gu: torch.Tensor) -> torch.Tensor:
        return after(gu, None, gu.shape[-1] // 2)

    return situ_glu


def shared_down(act, in_gemv: bool):
    """down(gu, weight) -> linear(act(gu), weight), contiguous; in_gemv (the fused SiTU-GLU): where the
    down projection is a one-row GEMV (`fp8.one_row_parts`), the activation is computed inside its load,
    one launch."""

    def plain(gu: torch.Tensor, weight) -> torch.Tensor:
        return linear(act(gu), weight).contiguous()

    def fused(gu: torch.Tensor, weight) -> torch.Tensor:
        stacked = one_row_parts(gu, [weight])
        if stacked is None:
            return plain(gu, weight)
        (wt, scale), = stacked
        return gemv_one_row(gu, wt, scale, glu=True)

    return fused if in_gemv else plain


def router_fused(row) -> Callable:
    """(weights, idx, sort) of the router's logits [N, E] for a layer's MoEWeights, by the moe_router row
    `row` (routing and the expert sort the grouped experts read)."""
    after = row.after

    def route_and_sort(logits: torch.Tensor, w):
        E = logits.shape[1]
        m = moe_experts.default_block_m(logits.shape[0], w.top_k, w.w1.shape[0])
        return after(logits, w.gate_bias, w.top_k, w.scaling, w.renormalize, E, m)

    return route_and_sort


def route_plain(logits: torch.Tensor, w):
    """(weights, idx, None): routing as the PyTorch sequence (k3lab.nn.moe.route), no sort: the grouped
    kernels sort for themselves and the per-expert loop needs none."""
    weights, idx, _ = route(logits.float(), w.gate_bias, w.top_k, w.scaling, w.renormalize)
    return weights, idx, None


def experts(row) -> Callable:
    """This rank's share of the chosen experts [N, LAT] fp32 by the moe_experts row `row` (the sort
    reused where the router made one)."""
    after = row.after

    def routed(z, weights, idx, w, sort):
        shapes = moe_experts.check_inputs(z, weights, idx, w.w1, w.w3, w.w2, check_values=False)
        return after(z, weights, idx, w.w1, w.w3, w.w2, shapes, sort, None)

    return routed


def experts_mxfp4(row) -> Callable:
    """This rank's share of the chosen experts [N, LAT] fp32 over a layer's MXFP4 experts (w1, w3, w2
    `mxfp4.Mxfp4Weight`), by the moe_experts row `row`'s `mxfp4` callable (the GEMV launches, the grouped
    tl.dot_scaled tiles or the PyTorch loop: k3lab.ops.moe_experts' MXFP4 rows). The router's sort is not
    read (each form sorts for itself)."""
    mxfp4 = row.mxfp4

    def routed(z, weights, idx, w, sort):
        return mxfp4(z, weights, idx, w.w1, w.w3, w.w2, check_values=False)

    return routed


def fp8_plan_binder() -> Callable:
    """bind(q, cache, kv_scale, lengths, scale, rows, pos) -> one MLA layer's decode over its FP8 latent
    cache (k3lab.ops.mla_decode.fp8_cache): a call quantizes the new latent rows `rows` [B, T, 576] (where
    the step's glue wrote them) into cache[:, pos:pos + T] with the cache's per-tensor scale (its row
    writer, one launch), then runs the FP8 split decode's plan, both validated here once.
    Returns (o, lse) as the bf16 plans do, so the DCP merge of partials is unchanged."""
    from k3lab.ops.mla_decode import fp8_cache

    def bind(q, cache, kv_scale, lengths, scale, rows, pos):
        fp8_cache.check_cache(cache)
        fp8_cache.check_kv_scale(kv_scale, cache.device)
        plan = fp8_cache.plan_fp8(q, cache, kv_scale, lengths, scale=scale)
        write = fp8_cache.row_writer(cache, rows, kv_scale, pos)

        def decode():
            write()
            return plan()

        decode.backend = "triton_fp8"
        return decode

    return bind


def mix_binder(fused: bool) -> Callable:
    """bind(prefix, blocks, n_blocks, has_delta) -> the AttnRes mix + RMSNorm for one call site, with
    `attn_res_norm.before`'s arguments: the PyTorch sequence, or (fused) the kernel chosen once for the
    site's stored blocks (the CUDA cluster kernel where it runs them, else Triton's)."""
    if not fused:
        return lambda prefix, blocks, n_blocks, has_delta: attn_res_norm.before
    return _bind_mix_after


def _bind_mix_after(prefix, blocks, n_blocks: int, has_delta: bool) -> Callable:
    delta = torch.empty_like(prefix) if has_delta else None
    after = attn_res_norm.BACKENDS.pick(None, prefix, delta, blocks, n_blocks, need="after").after

    def mix(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block=False,
            mix_weight=None):
        return after(prefix, delta, blocks, n_blocks, res_norm_w, res_proj_w, next_norm_w, eps, push_block,
                     mix_weight, None, None)

    return mix


def kda_decode_binder(name: str) -> Callable:
    """bind(cache, weights) -> a KDADecodeStep on the kda_decode row `name`."""
    return functools.partial(kda_decode.KDADecodeStep, backend=name)


def mla_plan_binder(padded: bool) -> Callable:
    """bind(q, latent, lengths, scale) -> an MLA decode plan: padded to 16 heads with the history split
    (folded by 16 where there are more heads), or one program per query row."""
    if not padded:
        return lambda q, latent, lengths, scale: mla_decode.plan_before(q, latent, lengths, scale=scale)

    def plan_after(q, latent, lengths, scale):
        fold = q.shape[2] > mla_decode.MMA_ROWS
        return mla_decode.plan_after(q, latent, lengths, scale=scale, fold_heads=fold)

    return plan_after


def verify_binder(narrow: bool) -> Callable:
    """bind(state, states, dtype) -> verify(q, k, v, g, beta, initial_state, states_out=) for one KDA layer's
    verification (what `kda_verify.kda_verify` / `kda_verify_before` compute on dense [B, T, H, 128]
    inputs: q, k, v in `dtype`, g and beta fp32, `states` [B, T, H, 128, V] fp32): the kernel, narrow value
    tiles or the streaming one, is chosen once here for tensors like the step's, and each call prepares
    (checks) its inputs and launches that row's callable."""
    return functools.partial(_bind_verify, narrow)


def _bind_verify(narrow: bool, state: torch.Tensor, states: torch.Tensor, dtype: torch.dtype) -> Callable:
    B, T, H, K, V = states.shape
    fp32 = {"device": states.device, "dtype": torch.float32}
    q = torch.empty(B, T, H, K, dtype=dtype, device=states.device)
    g, beta = torch.empty(B, T, H, K, **fp32), torch.empty(B, T, H, **fp32)
    table = kda_verify.BACKENDS
    if narrow:
        tile = kda_verify.choose_tile_v(B, H, V)
        if tile > kda_verify.NARROW_MAX:  # the device is full already: the streaming kernel, as kda_verify
            before = table.pick(None, q, q, q, g, beta, state, tile, states=states, need="before").before
            warps = kda_verify.choose_num_warps(tile)
            run = lambda x: before(x, tile, warps, None)  # noqa: E731
        else:
            after = table.pick(None, q, q, q, g, beta, state, tile, states=states, need="after").after
            run = lambda x: after(x, tile, None, None)  # noqa: E731
    else:
        tile = kda_verify.BEFORE_TILE_V
        before = table.pick(None, q, q, q, g, beta, state, tile, states=states, need="before").before
        run = lambda x: before(x, tile, None, None)  # noqa: E731

    def verify(q, k, v, g, beta, initial_state, *, states_out):
        x = kda_verify.prepare(q, k, v, g, beta, initial_state, None, None, None, False, states_out,
                               None if narrow else tile, None, zero_outputs=not narrow)
        return run(x)

    return verify


def pack_policy(after: bool) -> Callable:
    """The gate input's matmul dispatcher (packed_matmul's 'dispatch' row): packing only where its kernel
    reads the copy (after), or first (before)."""
    row = packed_matmul.BACKENDS["dispatch"]
    return row.after if after else row.before
