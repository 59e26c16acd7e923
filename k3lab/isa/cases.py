"""The compile entries of the ISA report: each op's own launch code called at K3's TP8 shapes.

A case calls the callables of an op's Triton backend row (`BACKENDS["triton"].after`, `.plan_before`,
..., what the op's face calls once it has picked that row; k3lab.ops' contract) on CPU tensors of the
shapes a TP8 rank sees (where an op autotunes, its fixed-block launcher with each candidate shape);
`capture.capture` records the launches instead of running them, so every kernel is compiled with the
arguments, constexprs, warps and stages the op itself picks, on the device the target names
(`as_device`: the launch policies read the compute units, wave width and shared memory from there).
Tensors are `torch.empty` (nothing is computed; only shapes, dtypes and alignment reach the compiler)
except where a policy reads values (lengths, routes, the FP8 cache's scale).

TP8 (`K3Config.tp_slice(8)`): 12 MLA heads over the 576-wide latent, 12 KDA heads of 128, hidden 7168
with 9 AttnRes sources, MoE latent 3584 with 384 of each expert's 3072 intermediate, 896 experts, top 16.
The shapes are the ones the notebooks and the headline records show.
"""

from __future__ import annotations

import torch

from k3lab.config import K3Config

BF16 = torch.bfloat16
CFG = K3Config.tp_slice(8)
MLA_PAGE = 64


def as_device(target) -> None:
    """Make k3lab's launch policies see `target` (a targets.Target) as the device: env.detect() and the
    few direct device queries of the ops. Call before importing any op module (some read the device at
    import: the KDA prologue's fast exp is NVIDIA inline assembly)."""
    from k3lab import env

    peak = env.PEAKS.get({"gfx950": "MI355X", "sm90": "H200"}.get(target.name, ""), env.PEAKS["CPU"])
    info = env.DeviceInfo("rocm" if target.is_amd else "cuda", target.device, target.compute_units, None,
                          target.warp_size, target.name if target.is_amd else "sm_90", peak)
    env.detect = lambda: info

    from k3lab.ops.mla_decode import triton as mla_triton

    mla_triton._shared_memory_bytes = lambda: target.shared_per_block
    # the H200 launches the merge early (programmatic dependent launch); AMD has no such launch
    mla_triton.pdl_usable = lambda: not target.is_amd


# ------------------------------------------------------------------------------------------ MLA decode


def _mla_inputs(batch: int, q_len: int, length: int, heads: int = CFG.num_attention_heads):
    from k3lab.ops.mla_decode.inputs import LATENT_DIM

    pages = -(-length // MLA_PAGE)
    q = torch.empty(batch, q_len, heads, LATENT_DIM, dtype=BF16)
    kv = torch.empty(batch * pages, MLA_PAGE, LATENT_DIM, dtype=BF16)
    bt = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lengths = torch.full((batch,), length, dtype=torch.int32)
    return q, kv, lengths, bt


def mla_before(batch=1, q_len=1, length=32768):
    from k3lab.ops.mla_decode import BACKENDS

    q, kv, lengths, bt = _mla_inputs(batch, q_len, length)
    BACKENDS["triton"].plan_before(q, kv, lengths, block_table=bt, scale=None)()


def mla_after(batch=1, q_len=1, length=32768):
    from k3lab.ops.mla_decode import BACKENDS

    q, kv, lengths, bt = _mla_inputs(batch, q_len, length)
    BACKENDS["triton"].plan_after(q, kv, lengths, block_table=bt, scale=None)()


def mla_fp8(batch=1, q_len=1, length=32768):
    """The decode over an FP8 (E4M3) latent cache with its fp32 scale, after the writer of the step's new
    rows into it (k3lab.ops.mla_decode.fp8_cache)."""
    from k3lab.ops.mla_decode import fp8_cache

    q, kv, lengths, bt = _mla_inputs(batch, q_len, length)
    cache = torch.empty(kv.shape, dtype=fp8_cache.FP8)
    kv_scale = torch.ones(1, dtype=torch.float32)  # its value is read when the plan is made
    step_cache = torch.empty(batch, 64, kv.shape[-1], dtype=fp8_cache.FP8)  # the writer's contiguous form
    fp8_cache.row_writer(step_cache, q.new_empty(batch, q_len, kv.shape[-1]), kv_scale, 0)()
    fp8_cache.plan_fp8(q, cache, kv_scale, lengths, block_table=bt)()


def dcp_merge(world=8, batch=1, q_len=1):
    from k3lab.ops.mla_decode.merge import BACKENDS

    o = torch.empty(world, batch, q_len, CFG.num_attention_heads, 512, dtype=BF16)
    lse = torch.empty(world, batch, q_len, CFG.num_attention_heads, dtype=torch.float32)
    BACKENDS["triton"].after(o, lse)  # compiles the kernel: values unused


# ------------------------------------------------------------------------------------------ KDA prefill


def _kda_prefill(tokens: int, group: bool):
    from k3lab.ops.kda_chunk import BACKENDS, alloc_work, choose_group_size, launches, make_plan

    H, K = CFG.kda_num_heads, CFG.kda_head_dim
    q, k, v = (torch.empty(1, tokens, H, K, dtype=BF16) for _ in range(3))
    g = torch.empty(1, tokens, H, K, dtype=torch.float32)
    beta = torch.empty(1, tokens, H, dtype=torch.float32)
    plan = make_plan([tokens], H, choose_group_size([tokens], H) if group else None)
    work = alloc_work(plan.n_chunks, H, BF16, q.device)
    o = torch.empty(1, tokens, H, K, dtype=BF16)
    s_final = torch.empty(1, H, K, K, dtype=torch.float32)
    *steps, _result = launches(BACKENDS["triton"], q, k, v, g, beta, None, plan, K ** -0.5, work, o,
                               s_final).values()
    for launch in steps:
        launch()


def kda_prefill_before(tokens=16384):
    _kda_prefill(tokens, group=False)


def kda_prefill_after(tokens=16384):
    _kda_prefill(tokens, group=True)


def kda_prologue_fp32_products(tokens=16384):
    """Not the op's launch: the prologue with its 'tf32' products as 'ieee' (exact fp32 on the fp32
    MFMA), the change gfx950 needs (CDNA4 has no xf32), to show what it would compile to there."""
    from k3lab.ops.kda_chunk import BACKENDS, alloc_work, make_plan, prologue

    exact = prologue.dot_precisions
    prologue.dot_precisions = lambda dtype: {k: "ieee" if v == "tf32" else v for k, v in exact(dtype).items()}
    try:
        H, K = CFG.kda_num_heads, CFG.kda_head_dim
        q, k, v = (torch.empty(1, tokens, H, K, dtype=BF16) for _ in range(3))
        g, beta = torch.empty(1, tokens, H, K), torch.empty(1, tokens, H)
        plan = make_plan([tokens], H)
        work = alloc_work(plan.n_chunks, H, BF16, q.device)
        for launch in BACKENDS["triton"].prologue(q, k, v, g, beta, plan, K ** -0.5, work).values():
            launch()
    finally:
        prologue.dot_precisions = exact


# ------------------------------------------------------------------------------------------ KDA decode /
# verify


def kda_decode_before(batch=1):
    from k3lab.ops.kda_decode import KDADecodeStep, make_example

    inputs, cache, weights = make_example(batch, CFG.kda_num_heads, dtype=BF16)
    KDADecodeStep(cache, weights, backend="triton")(**inputs)


def _verify_inputs(batch: int, positions: int):
    H, K = CFG.kda_num_heads, CFG.kda_head_dim
    q, k, v = (torch.empty(batch, positions, H, K, dtype=BF16) for _ in range(3))
    g = torch.empty(batch, positions, H, K, dtype=torch.float32)
    beta = torch.empty(batch, positions, H, dtype=torch.float32)
    h0 = torch.empty(batch, H, K, K, dtype=torch.float32)
    return q, k, v, g, beta, h0


def kda_verify_after(batch=1, positions=4):
    from k3lab.ops.kda_verify import kda_verify

    kda_verify(*_verify_inputs(batch, positions), backend="triton")


def kda_verify_before(batch=1, positions=4):
    from k3lab.ops.kda_verify import kda_verify_before as before

    before(*_verify_inputs(batch, positions))


# ------------------------------------------------------------------------------------------ AttnRes, MoE,
# study


def attn_res_after(tokens=1):
    from k3lab.ops.attn_res_norm import after

    D, n = CFG.hidden_size, CFG.attn_res_max_sources - 1  # 8 stored blocks + the partial
    prefix, delta = torch.empty(tokens, D, dtype=BF16), torch.empty(tokens, D, dtype=BF16)
    blocks = torch.empty(n + 1, tokens, D, dtype=BF16)
    w = torch.empty(D, dtype=torch.float32)
    after(prefix, delta, blocks, n, w, w, w, mix_weight=w, backend="triton")


def moe_experts(tokens=1):
    from k3lab.ops.moe_experts import BACKENDS, random_router_idx
    from k3lab.ops.moe_experts import triton as moe_triton
    from k3lab.ops.moe_experts.inputs import Shapes

    E, k, L, F = (
        CFG.num_experts,
        CFG.num_experts_per_token,
        CFG.routed_expert_hidden_size,
        CFG.moe_intermediate_size,
    )
    idx = random_router_idx(tokens, num_experts=E, top_k=k)
    z = torch.empty(tokens, L, dtype=BF16)
    weights = torch.empty(tokens, k, dtype=torch.float32)
    w1, w3 = torch.empty(E, F, L, dtype=BF16), torch.empty(E, F, L, dtype=BF16)
    w2 = torch.empty(E, L, F, dtype=BF16)
    BACKENDS["triton"].after(z, weights, idx, w1, w3, w2, Shapes(tokens, k, L, F, E), None, None)
    if tokens == 1:  # the one-token down launch: every other block shape its autotuner may pick
        h = torch.empty(k, F, dtype=BF16)
        for blocks in moe_triton.ROW_BLOCKS[1:]:
            moe_triton.down_row(h, w2, weights.reshape(-1), idx.reshape(-1), L, F, blocks=blocks)


def moe_mxfp4(tokens=1, down_form=None):
    """The MXFP4 routed experts' two GEMV launches (codes and E8M0 scales dequantized in registers);
    down_form: the down launch's form (mxfp4_kernels.DOWN_FORMS; None: the default)."""
    from k3lab.ops.moe_experts.mxfp4 import Mxfp4Weight
    from k3lab.ops.moe_experts import mxfp4_kernels, random_router_idx

    E, k, L, F = CFG.num_experts, CFG.num_experts_per_token, CFG.routed_expert_hidden_size, \
        CFG.moe_intermediate_size

    def experts(n, width):
        return Mxfp4Weight(torch.empty(E, n, width // 2, dtype=torch.uint8),
                           torch.empty(E, n, width // 32, dtype=torch.int8))

    idx = random_router_idx(tokens, num_experts=E, top_k=k)
    z, weights = torch.empty(tokens, L, dtype=BF16), torch.empty(tokens, k)
    up = experts(F, L)
    # many tokens: the grouped dot_scaled form where the target lowers it (gfx950, sm90), else the GEMV form
    run = mxfp4_kernels.mxfp4_experts
    if tokens > 1 and mxfp4_kernels.grouped_runs_here()[0]:
        run = mxfp4_kernels.mxfp4_experts_grouped
    form = {} if down_form is None else {"down_form": down_form}
    run(z, weights, idx, up, up, experts(L, F), check_values=False, **form)


def moe_tail(tokens=1):
    from k3lab.ops.moe_experts import BACKENDS

    L, R = CFG.routed_expert_hidden_size, CFG.hidden_size // 8  # this rank's 896 of the 7168 output columns
    y = torch.empty(tokens, L, dtype=torch.float32)
    args = (y, torch.empty(L, dtype=torch.float32), 1e-5, torch.empty(R, L, dtype=BF16),
            torch.empty(tokens, CFG.hidden_size, dtype=BF16), 0)
    if tokens == 1:  # the one-row kernel: every block shape its autotuner may pick
        from k3lab.ops.moe_experts import tail as tail_mod

        for blocks in tail_mod.ROW_BLOCKS:
            tail_mod.tail_row(*args, blocks=blocks)
    else:
        BACKENDS["triton"].tail(*args)


def moe_router(tokens=1, launches=None):
    """The launches route_and_sort makes for `tokens` (the triton row: one launch up to FUSED_PAIRS pairs,
    else two), or the one launch (`launches=1`) forced up to MAX_PAIRS (the glue bench's comparison)."""
    from k3lab.ops.moe_experts import default_block_m
    from k3lab.ops.moe_router import BACKENDS
    from k3lab.ops.moe_router import triton as router

    E, k = CFG.num_experts, CFG.num_experts_per_token
    logits, bias, m = torch.empty(tokens, E, dtype=BF16), torch.empty(E, dtype=torch.float32), \
        default_block_m(tokens, k, E)
    if launches == 1:
        router.route_sort(logits, bias, k, 1.0, True, m)
        return
    BACKENDS["triton"].after(logits, bias, k, 1.0, True, E, m)


def situ_glu(width=CFG.shared_intermediate_size):
    from k3lab.ops.situ_glu import BACKENDS

    BACKENDS["triton"].after(torch.empty(1, 2 * width, dtype=BF16), torch.empty(1, width, dtype=BF16), width)


def gemv(rows=CFG.num_experts, cols=CFG.hidden_size):
    from k3lab.ops import gemv as gv

    x, w, y = (
        torch.empty(1, cols, dtype=BF16),
        torch.empty(rows, cols, dtype=BF16),
        torch.empty(1, rows, dtype=BF16),
    )
    for blocks in gv.gpu_blocks():  # the autotuner's candidates here: each is a kernel the op may run
        gv.launch(x, w, y, blocks)


def gemv_fp8(rows=CFG.hidden_size, cols=CFG.kda_width):
    """FP8 weights with row scales (o_proj's shape at TP8: 7168 x 1536), every candidate block shape."""
    from k3lab.ops import gemv as gv

    x, y = torch.empty(1, cols, dtype=BF16), torch.empty(1, rows, dtype=BF16)
    w, scale = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(rows, dtype=torch.float32)
    for blocks in gv.gpu_blocks():
        gv.launch(x, w, y, blocks, scale=scale)


def gemv_glu(rows=CFG.hidden_size, cols=CFG.shared_intermediate_size):
    """The shared expert's down_proj with its SiTU-GLU computed in the load (7168 x 768 at TP8), bf16
    and FP8 weights, every candidate block shape."""
    from k3lab.ops import gemv as gv

    gu, y = torch.empty(1, 2 * cols, dtype=BF16), torch.empty(1, rows, dtype=BF16)
    w, wq = torch.empty(rows, cols, dtype=BF16), torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, dtype=torch.float32)
    for blocks in gv.gpu_blocks():
        gv.launch(gu, w, y, blocks, glu=True)
        gv.launch(gu, wq, y, blocks, scale=scale, glu=True)


def gemv_stack_moe():
    """One MoE layer's router (bf16), down_proj and shared gate/up (FP8) in one launch, at TP8."""
    from k3lab.ops import gemv as gv

    h = CFG.hidden_size
    x = torch.empty(1, h, dtype=BF16)
    parts = [(torch.empty(CFG.num_experts, h, dtype=BF16), None)] + [
        (torch.empty(n, h, dtype=torch.float8_e4m3fn), torch.empty(n, dtype=torch.float32))
        for n in (CFG.routed_expert_hidden_size, 2 * CFG.shared_intermediate_size)]
    ys = [torch.empty(1, w.shape[0], dtype=BF16) for w, _ in parts]
    for blocks in gv.gpu_blocks():
        gv.launch_stack(x, parts, ys, blocks)


def mla_glue(stage: str):
    """One MLA layer's glue at one token (N = 1) at TP8: the norms into a cache row, the absorbed query,
    or the value product and gate, each with the block shape its GPU launch takes."""
    from k3lab.ops.mla_glue import BACKENDS

    row = BACKENDS["triton"]
    H, Q, LAT, ROPE = CFG.num_attention_heads, CFG.q_lora_rank, CFG.kv_lora_rank, CFG.qk_rope_head_dim
    NOPE, V = CFG.qk_nope_head_dim, CFG.v_head_dim
    if stage == "norms":
        stacked = torch.empty(1, Q + LAT + ROPE + H * V, dtype=BF16)  # qa | ckv | g: strided rows
        qa, ckv = stacked[:, :Q], stacked[:, Q:Q + LAT + ROPE]
        latent = torch.empty(1, 4096, LAT + ROPE, dtype=BF16)
        row.norms(qa, ckv, torch.empty(Q, dtype=BF16), torch.empty(LAT, dtype=BF16), 1e-6, latent[:, 7:8],
                  1, 1, LAT, ROPE)
    elif stage == "absorb_q":
        row.absorb_q(torch.empty(1, H, NOPE + ROPE, dtype=BF16), torch.empty(H, NOPE, LAT, dtype=BF16),
                     torch.empty(1, 1, H, LAT + ROPE, dtype=BF16), 1, 1, H, NOPE, LAT, ROPE)
    else:
        g = torch.empty(1, Q + LAT + ROPE + H * V, dtype=BF16)[:, -H * V:]
        row.out_gate(torch.empty(1, 1, H, LAT, dtype=BF16), torch.empty(H, V, LAT, dtype=BF16), g,
                     torch.empty(1, H * V, dtype=BF16), 1, H, V, LAT)


def workshop_gated_norm(rows=CFG.kda_num_heads, width=CFG.kda_head_dim):
    """The workshop's reference solution (notebook 03's task): the gated RMS norm of one token's KDA heads."""
    from k3lab.workshop import epilogue

    x, gate = torch.empty(rows, width, dtype=BF16), torch.empty(rows, width, dtype=BF16)
    epilogue.gated_norm_solution(x, gate, torch.empty(width, dtype=BF16))


def workshop_ladder():
    """The Triton ladder's solutions (k3lab.workshop.ladder), each at its first case's small shapes."""
    from k3lab.workshop import ladder

    ladder.launch_solutions()


def launch_overhead_empty():
    from k3lab.studies.launch_overhead import triton_kernel

    triton_kernel()[(1,)](torch.zeros(1))


# name -> (function, keyword arguments, what it is). Names: op.case
CASES: dict[str, tuple] = {
    "mla_decode.before": (mla_before, {}, "12 heads, one token, 32K paged cache"),
    "mla_decode.after_1k": (mla_after, {"length": 1024}, "padded to 16 heads, one token, 1K"),
    "mla_decode.after_32k": (mla_after, {}, "padded to 16 heads, one token, 32K (split + merge)"),
    "mla_decode.after_128k": (mla_after, {"length": 131072}, "one token, 128K"),
    "mla_decode.after_64x8k": (mla_after, {"batch": 64, "length": 8192}, "64 requests x 8K"),
    "mla_decode.verify_2": (mla_after, {"q_len": 2}, "verification group of 2 at 32K"),
    "mla_decode.verify_4": (mla_after, {"q_len": 4}, "verification group of 4 at 32K"),
    "mla_decode.fp8_cache_1k": (mla_fp8, {"length": 1024}, "FP8 latent cache, one token, 1K"),
    "mla_decode.fp8_cache_32k": (mla_fp8, {}, "FP8 latent cache, one token, 32K (split)"),
    "mla_decode.fp8_cache_verify_4": (mla_fp8, {"q_len": 4}, "FP8 latent cache, verification group of 4"),
    "mla_decode.dcp_merge": (dcp_merge, {}, "DCP8 merge of 8 partials"),
    "kda_chunk.before_16k": (kda_prefill_before, {}, "12 heads x 16K: prologue + plain walk"),
    "kda_chunk.after_16k": (kda_prefill_after, {}, "12 heads x 16K: prologue + group scan"),
    "kda_chunk.prologue_fp32_products": (kda_prologue_fp32_products, {},
                                         "what-if, not the op's launch: tf32 products as ieee (gfx950's "
                                         "fix)"),
    "kda_decode.before_b1": (kda_decode_before, {}, "B = 1, the unfused chain"),
    "kda_decode.before_b128": (kda_decode_before, {"batch": 128}, "B = 128, the unfused chain"),
    "kda_verify.after_b1_t4": (kda_verify_after, {}, "B = 1, T = 4: narrow tiles"),
    "kda_verify.before_b1_t4": (kda_verify_before, {}, "B = 1, T = 4: the streaming kernel"),
    "attn_res_norm.t1": (attn_res_after, {}, "1 token, 9 sources"),
    "attn_res_norm.t64": (attn_res_after, {"tokens": 64}, "64 tokens"),
    "attn_res_norm.t8192": (attn_res_after, {"tokens": 8192}, "8192 tokens (prefill)"),
    "moe_experts.grouped_t1": (moe_experts, {}, "one token's 16 experts"),
    "moe_experts.grouped_t64": (moe_experts, {"tokens": 64}, "64 tokens"),
    "moe_experts.mxfp4_t1": (moe_mxfp4, {}, "MXFP4 experts, one token's 16: the two GEMV launches"),
    "moe_experts.mxfp4_t1_flat": (moe_mxfp4, {"down_form": "flat"},
                                  "MXFP4 experts, one token's 16: the down launch over the pairs end to end"),
    "moe_experts.mxfp4_t64": (moe_mxfp4, {"tokens": 64}, "MXFP4 experts, 64 tokens: grouped tl.dot_scaled "
                              "(gfx950, sm90), the GEMV form on gfx942"),
    "moe_experts.tail_t1": (moe_tail, {}, "latent tail, one token"),
    "moe_experts.tail_t256": (moe_tail, {"tokens": 256}, "latent tail, 256 tokens"),
    "moe_router.route_t1": (moe_router, {}, "top-16 of 896 and the expert sort in one launch, one token"),
    "moe_router.route_t2": (moe_router, {"tokens": 2}, "2 tokens: the one launch's bound (FUSED_PAIRS)"),
    "moe_router.route_t64": (moe_router, {"tokens": 64}, "64 tokens: top-k, then the sort"),
    "moe_router.one_launch_t128": (moe_router, {"tokens": 128, "launches": 1},
                                   "the one launch forced at MAX_PAIRS (the glue bench's comparison)"),
    "situ_glu.shared_expert": (situ_glu, {}, "SiTU-GLU of the shared expert's 768 columns"),
    "gemv.router": (gemv, {}, "one-row product 896 x 7168, every candidate block shape"),
    "gemv.fp8_o_proj": (gemv_fp8, {}, "FP8 weights + row scales, 7168 x 1536, every block shape"),
    "gemv.stack_moe": (gemv_stack_moe, {}, "router bf16 + down_proj and shared gate/up FP8, one launch"),
    "gemv.glu_shared_down": (gemv_glu, {}, "shared expert's down_proj, SiTU-GLU in the load, bf16 and FP8"),
    "mla_glue.norms": (mla_glue, {"stage": "norms"}, "q_a and kv_a norms, the cache row, one token"),
    "mla_glue.absorb_q": (mla_glue, {"stage": "absorb_q"}, "q_nope @ w_uk into q_buf, 12 heads, one token"),
    "mla_glue.out_gate": (mla_glue, {"stage": "out_gate"}, "o_lat @ w_uv^T times sigmoid(g), one token"),
    "workshop.gated_norm": (workshop_gated_norm, {}, "the learner task's solution: 12 heads x 128"),
    "workshop.ladder": (workshop_ladder, {}, "the 17 ladder puzzles' solutions at their first case"),
    "launch_overhead.empty_triton": (launch_overhead_empty, {}, "the one-store kernel"),
}


def run_case(name: str) -> list:
    """The launches (capture.Launch) case `name` makes; ValueError for an unknown name."""
    from k3lab.isa.capture import capture

    if name not in CASES:
        raise ValueError(f"case must be one of {sorted(CASES)}, got {name!r}")
    fn, kwargs, note = CASES[name]
    launches: list = []
    with torch.no_grad(), capture(launches):
        fn(**kwargs)
    for launch in launches:
        launch.note = note
    return launches
