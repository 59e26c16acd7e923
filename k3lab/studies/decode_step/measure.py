"""The whole-step benchmark: one TP8 rank's decode step with every optimization on, all off, and each
switched off alone (the waterfall), eager and as one CUDA graph, with its bytes floor, its launches per
step from the profiler and the collective stand-ins timed apart.

    k3lab bench decode_step --json F [--cases b1_1k b64_8k] [--distinct-layers 3] [--repeats 5]
    k3lab bench decode_step --cases probe --json F     (the bounds probes, k3lab.studies.decode_step.bounds)
    python -m k3lab.studies.decode_step.targets --json F --budget-s N   (only the pairs the step's targets
                                                         name, a pass/miss table last: targets.py)

Cases on a GPU (K3Config.tp_slice(8), bf16, random weights: `distinct_layers` sets per layer kind rotated
through the 93 layers): b1_1k, b1_32k, b1_128k (B = 1) and b64_8k (B = 64). On a CPU one case at a
TP2 slice of a 4-layer tiny config (stand-in collectives as on the GPU) runs the same code with Triton
in its interpreter (its times are not speeds).

The check, before any timing: every variant's step starts from the same caches (drawn from one seed;
`error['state']` is their checksum) and its first step's logits are compared with its reference's
(`error['logits_vs_reference']`). The reference is all off, except that at TP > 1 a variant with the
sharded MoE tail is compared with all off but that tail (`reference_of`): the collective stand-ins copy
this rank's partial instead of summing the ranks', and the two tails add the routed output in different
places (sharded: this rank's columns, before the all-reduce; replicated: every column, after it), so
under stand-ins they compute different sums, equal only with real collectives (`run_group`). A graph
record also holds `error['graph_vs_eager']`: one replay from the saved state against the eager check.
bf16 over 93 layers, and a near-tie in the router may pick another expert, so the figures are recorded,
not asserted. Committed records: profiles/<device>/decode_step/.

Every variant but two passes its projections ('bf16' unless PROJECTIONS_OF says otherwise), so a name
keeps what its committed records measured. all_on_default leaves them unset (the step's default:
the one-row GEMV at B = 1 on a GPU). all_on_article runs DecodeStep(precision='article'); its floor is
the article's bytes (`part_bytes(precision='article')`, the routed experts it read at MXFP4 bytes) and
its check is against its reference's switches at the same precision, the same quantized weights and
FP8 cache through the switches-off paths (`reference_logits`), so it is held to the same like-with-like
comparison as the bf16 variants; what the formats cost against bf16 is recorded beside it
(error['precision_vs_bf16']). On a CPU the article variant is left out (CPU_SKIPPED).
"""

from __future__ import annotations

import dataclasses
import gc
import tempfile
import time

import torch

from k3lab import bench, env
from k3lab.config import K3Config

from k3lab.engine.step import DecodeStep
from k3lab.engine.switches import DECODE_ONLY, SWITCHES, VERIFY_ONLY, all_but
from k3lab.engine.weights import RankWeights
from k3lab.studies import select_cases
from k3lab.studies.peers import on_gpu

NAME = "decode_step"
PROBE = "probe."  # case prefix of the bounds probes (k3lab.studies.decode_step.bounds)
PROBE_CASE = "probe"  # the case that runs them
GLUE = "glue."  # case prefix of the glue kernels' records (k3lab.studies.decode_step.glue)
GLUE_CASE = "glue"  # the case that runs them
ATTRIBUTION = "attribution."  # case prefix of the step attributions (k3lab.studies.decode_step.attribution)
ATTRIBUTION_CASE = "attribution"  # the case that runs them
EXTRA_CASES = (PROBE_CASE, GLUE_CASE, ATTRIBUTION_CASE)
GPU_CASES = {"b1_1k": (1, 1024), "b1_32k": (1, 32768), "b1_128k": (1, 131072), "b64_8k": (64, 8192)}
CPU_CASES = {"tiny_b1_ctx8": (1, 8)}  # every variant but CPU_SKIPPED's (the article step: slow there)
CPU_CONFIG = dataclasses.replace(K3Config.tiny(), num_hidden_layers=4, name="tiny4").sliced(2)
TOP_KERNELS = 15  # kernels by total time kept per profiled run: where the step's time goes
PROFILED = ("all_on", "all_off", "all_on_fp8", "all_on_gemv")
# variant -> DecodeStep(projections=...); the others run the weights' dtype through torch.matmul
# (projections='bf16', as their committed records did); all_on_default leaves projections unset, so the
# step takes `rows.default_projections` (the one-row GEMV at B = 1 on a GPU, the matrix library above)
# profiled at B = 1 only: the loop at B = 64 runs ~450K kernels a step
PROJECTIONS_OF = {"all_on_fp8": "fp8", "all_on_gemv": "gemv", "all_on_default": None}
# variant -> DecodeStep(precision=...): all_on_article runs the article's formats (FP8 projections, MXFP4
# routed experts, an FP8 MLA cache); its floor is part_bytes at that precision and its check is against
# its reference's switches at the same precision (`reference_logits`)
PRECISION_OF = {"all_on_article": "article"}
# the variants of the step's settings rather than of its switches: the report's quick form leaves them
# out (run(variants=WATERFALL)), the default and full runs measure them
SETTING_VARIANTS = ("all_on_default", "all_on_article")
WATERFALL = "waterfall"  # run(variants=WATERFALL): every variant but SETTING_VARIANTS
# variants the CPU case leaves out, and why: the CPU case must run in seconds
CPU_SKIPPED = {"all_on_article": "the article step's MXFP4 and FP8-cache kernels run in Triton's "
                                 "interpreter on a CPU: about 6 s a step, 20 s with its timing, against "
                                 "under a second for the others (tests/test_decode_step_article.py "
                                 "checks it)"}


def cases() -> dict[str, tuple[int, int]]:
    """Case name -> (batch, context_len) on this machine."""
    return GPU_CASES if on_gpu() else CPU_CASES


def bench_config() -> K3Config:
    return K3Config.tp_slice(8) if on_gpu() else CPU_CONFIG


def variants(q_len: int = 1) -> dict[str, dict]:
    """all_off first (the others are compared with it), all_on, all_on_fp8, all_on_gemv, then
    no_<switch> for each switch that applies at this q_len, then SETTING_VARIANTS (every switch on:
    all_on_default with the projections the step picks itself, all_on_article at the article's
    precision). `step_settings` gives each one's projections / precision."""
    names = [n for n in SWITCHES if not (n in VERIFY_ONLY and q_len == 1) and
             not (n in DECODE_ONLY and q_len > 1)]
    out = {"all_off": dict.fromkeys(SWITCHES, False), "all_on": dict.fromkeys(SWITCHES, True),
           "all_on_fp8": dict.fromkeys(SWITCHES, True), "all_on_gemv": dict.fromkeys(SWITCHES, True)}
    out.update({f"no_{n}": all_but(n) for n in names})
    out.update({n: dict.fromkeys(SWITCHES, True) for n in SETTING_VARIANTS})
    return out


def step_settings(name: str) -> dict:
    """DecodeStep keywords of variant `name`: {'precision': ...} for PRECISION_OF's (its projections follow
    the precision), else {'projections': PROJECTIONS_OF's or 'bf16'}."""
    if name in PRECISION_OF:
        return {"precision": PRECISION_OF[name]}
    return {"projections": PROJECTIONS_OF.get(name, "bf16")}


def expert_bytes(config: K3Config, act_bytes: int = 2, precision: str = "bf16") -> int:
    """Bytes of one routed expert's slice on this rank (w1, w3, w2): at `act_bytes` a weight, or at
    precision 'article' in MXFP4 (k3lab.ops.moe_experts.mxfp4.nbytes: codes and block scales)."""
    from k3lab.ops.moe_experts import mxfp4

    F, L = config.moe_intermediate_size, config.routed_expert_hidden_size
    return 3 * (mxfp4.nbytes(F, L) if precision == "article" else F * L * act_bytes)


def variant_floor(case_floor: dict, experts_read: int | None, expert_nbytes: int, saved: int = 0) -> dict:
    """The case's floor (`step_bytes` with uniform routing) with the routed experts counted as this
    variant's step read them (`experts_read`: distinct experts summed over the MoE layers of its checked
    step; None keeps the uniform expectation) and `saved` bytes fewer dense weights (FP8 projections)."""
    b = dict(case_floor["bytes"])
    b["weights_experts_uniform"] = b["weights_experts"]
    if experts_read is not None:
        b["weights_experts"] = float(experts_read * expert_nbytes)
    b["weights_dense"] -= saved
    b["total"] = sum(b[k] for k in ("weights_dense", "weights_experts", "mla_cache", "kda_state", "kda_conv"))
    return dict(case_floor, bytes=b, floor_us=b["total"] / (case_floor["bandwidth_tbs"] * 1e6),
                experts_read=experts_read)


PRECISIONS = ("bf16", "fp8", "article")  # part_bytes' number formats (k3lab.engine.switches.PRECISIONS)


def part_bytes(config: K3Config, batch: int, context_len: int, q_len: int = 1, *, tail: str = "sharded",
               act_bytes: int = 2, cache_bytes: int = 2,
               precision: str = "bf16") -> dict[str, dict[str, float]]:
    """The bytes of `step_bytes`, per layer kind of the step: 'kda', 'mla', 'moe', 'dense' and 'ends'
    (the lm_head slice and the embedding rows), each a dict of the same keys as `step_bytes`' parts
    (weights_dense, weights_experts, mla_cache, kda_state, kda_conv; the ones a kind does not move are
    0). Summed over the kinds they give `step_bytes`.

    precision: the step's number formats (DecodeStep(precision=)). 'bf16': every weight at `act_bytes`,
    the MLA cache at `cache_bytes` a value. 'fp8': the projections stored in FP8
    (k3lab.engine.weights.FP8_PROJECTIONS) at a byte a value of the matrix padded to 16 x 16 plus a 4-byte
    scale per padded row (`RankWeights.projection_bytes('fp8')`), the rest as 'bf16'. 'article': 'fp8'
    plus the routed experts in MXFP4 (4.25 bits a weight: half a byte of code and a one-byte scale per
    32) and the MLA cache in FP8 (one byte a value, `cache_bytes` not read, plus its fp32 scale, 4 bytes
    a layer)."""
    from k3lab.engine import fp8

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    c, N = config, batch * q_len
    h, C, H = c.hidden_size, c.kda_width, c.kda_num_heads
    nh, L = c.num_attention_heads, c.routed_expert_hidden_size
    quantized = precision in ("fp8", "article")

    def proj(n: int, k: int) -> float:  # one FP8_PROJECTIONS matrix [n, k] as this precision stores it
        return float(fp8.round_up(n) * (fp8.round_up(k) + 4) if quantized else n * k * act_bytes)

    up_rows = h // c.tp_size if tail == "sharded" else h
    kda = proj(4 * C + H + c.kda_gate_rank, h) + proj(h, C) + C * c.kda_gate_rank * act_bytes
    mla = (proj(c.q_lora_rank + c.mla_latent_dim + nh * c.v_head_dim, h)
           + proj(nh * c.qk_head_dim, c.q_lora_rank) + proj(h, nh * c.v_head_dim)
           + 2 * nh * c.qk_nope_head_dim * c.kv_lora_rank * act_bytes)
    S = c.shared_intermediate_size
    shared = proj(2 * S, h) + proj(h, S) if c.num_shared_experts else 0.0
    moe = proj(L, h) + shared + (c.num_experts * h + up_rows * L) * act_bytes
    dense = proj(2 * c.intermediate_size, h) + proj(h, c.intermediate_size)
    ends = c.vocab_size * h + N * h  # lm_head slice, embedding rows
    E, k = c.num_experts, c.num_experts_per_token
    chosen = E * (1.0 - (1.0 - k / E) ** N)
    expert = float(expert_bytes(c, act_bytes, precision))
    rows = batch * (context_len + 2 * q_len) * c.mla_latent_dim
    cache = rows + 4 if precision == "article" else rows * cache_bytes
    zero = dict.fromkeys(("weights_dense", "weights_experts", "mla_cache", "kda_state", "kda_conv"), 0.0)
    return {
        "kda": dict(zero, weights_dense=float(c.num_kda_layers * kda),
                    kda_state=float(c.num_kda_layers * batch * 2 * c.kda_state_bytes_per_sequence()),
                    kda_conv=float(c.num_kda_layers * batch * 2 * c.kda_conv_state_values_per_sequence()
                                   * act_bytes)),
        "mla": dict(zero, weights_dense=float(c.num_mla_layers * mla),
                    mla_cache=float(c.num_mla_layers * cache)),
        "moe": dict(zero, weights_dense=float(c.num_moe_layers * moe),
                    weights_experts=float(c.num_moe_layers * chosen * expert)),
        "dense": dict(zero, weights_dense=float(c.first_k_dense_replace * dense)),
        "ends": dict(zero, weights_dense=float(ends * act_bytes)),
    }


def step_bytes(config: K3Config, batch: int, context_len: int, q_len: int = 1, *, tail: str = "sharded",
               act_bytes: int = 2, cache_bytes: int = 2, precision: str = "bf16") -> dict[str, float]:
    """Bytes one rank's step must move at least: every weight it reads once (the routed experts: the
    expected number of distinct experts `batch * q_len` tokens choose under uniform routing), the MLA
    history read and the new rows written, the KDA states read and written, the conv histories, in the
    number formats of `precision` (`part_bytes`).
    Keys: weights_dense, weights_experts, mla_cache, kda_state, kda_conv, total (`part_bytes` summed)."""
    kinds = part_bytes(config, batch, context_len, q_len, tail=tail, act_bytes=act_bytes,
                       cache_bytes=cache_bytes, precision=precision)
    parts = {key: sum(kind[key] for kind in kinds.values()) for key in next(iter(kinds.values()))}
    parts["total"] = sum(parts.values())
    return parts


def measured_bandwidth_tbs() -> tuple[float, str]:
    """(TB/s, how): a 1 GiB device copy (read + write) timed here on a GPU; the env peak on a CPU."""
    if not on_gpu():
        pk = env.detect().peak
        return pk.bandwidth_tbs, f"{pk.name} peak ({pk.bandwidth_source})"
    n = 1 << 30
    src, dst = (
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        torch.empty(n, dtype=torch.uint8, device="cuda"),
    )
    t = bench.time_fn(lambda: dst.copy_(src), warmup=3, repeats=10, calls_per_sample=1)
    return 2 * n / (t.median_us * 1e-6) / 1e12, "1 GiB device copy, read + write, measured in this run"


def _standin_us(collectives: list[tuple[str, int]], world: int) -> float:
    """The collective stand-ins alone: the same copies, timed as one graph on a GPU."""
    dev = "cuda" if on_gpu() else "cpu"
    srcs = [torch.empty(b * (world if k == "all_gather" else 1), dtype=torch.uint8, device=dev) for k, b
            in collectives]
    bufs = [(s, torch.empty_like(s)) for s in srcs]
    if not bufs:
        return 0.0

    def copies():
        for s, d in bufs:
            d.copy_(s)

    return bench.time_fn(copies, warmup=2, repeats=10, graph=on_gpu(), calls_per_sample=1).median_us


def _profile(fn, name: str, trace_dir: str) -> dict:
    from k3lab import profile

    cap = profile.capture(fn, steps=1, warmup=0, name=name, trace_dir=trace_dir)
    counts = cap.counts()
    cats = cap.categories.head(8)
    top = cap.table.head(TOP_KERNELS)
    return {"launches": counts["launches"], "copies": counts["copies"],
            "api_launches": counts["api_launches"],
            "kernel_sum_us": cap.total_us(),
            "categories": [{"category": r.category, "calls": int(r.calls), "total_us": float(r.total_us)}
                           for r in cats.itertuples()],
            "top_kernels": [{"name": str(r.name)[:120], "category": r.category, "calls": int(r.calls),
                             "total_us": float(r.total_us)} for r in top.itertuples()]}


REFERENCES = {"all_off": dict.fromkeys(SWITCHES, False),
              "all_off_but_moe_tail_sharded": {n: n == "moe_tail_sharded" for n in SWITCHES}}


def reference_of(opts: dict, world_size: int) -> str:
    """The variant a variant's logits are checked against (see the module docstring): 'all_off', or at
    world_size > 1 with the sharded MoE tail on, 'all_off_but_moe_tail_sharded'."""
    return "all_off_but_moe_tail_sharded" if world_size > 1 and opts["moe_tail_sharded"] else "all_off"


def _rel(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = x.double() - ref.double()
    return {"rel_l2": float(d.norm() / ref.double().norm().clamp_min(1e-30)), "max_abs": float(d.abs().max()),
            "finite": bool(torch.isfinite(x).all())}


def _checksum(saved: dict[str, torch.Tensor]) -> float:
    """Sum of |x| over a step's saved state: equal across variants when they start from the same caches."""
    return float(sum(t.double().abs().sum() for t in saved.values()))


def _errors(logits: torch.Tensor, ref: torch.Tensor | None, ref_name: str, saved: dict) -> dict:
    out = {"state": _checksum(saved)}
    if ref is None:
        out["logits_vs_reference"] = "this variant is the reference"
    else:
        out["logits_vs_reference"] = {"reference": ref_name, **_rel(logits, ref)}
    return out


def first_step(step: DecodeStep, ids: torch.Tensor) -> tuple[torch.Tensor, dict, float]:
    """The checked call: (logits of one step on `ids` from the step's caches as built, the state saved
    before it, seconds it took). The caches are left advanced by one step, and the step's routes
    recorded (`step.experts_read()`)."""
    saved = step.save_state()
    step.set_tokens(ids)
    step.routes = []  # kept for step.experts_read(); the caller sets None before timing
    t = time.perf_counter()
    logits = step.run().clone()
    return logits, saved, time.perf_counter() - t


def _ids(config: K3Config, batch: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(11))


def reference_logits(name: str, weights: RankWeights, shape: tuple[int, int],
                     precision: str = "bf16") -> torch.Tensor:
    """One check reference's first-step logits (REFERENCES[name] at `precision`), its step freed after.
    At 'article' the reference runs the same quantized weights and FP8 cache through the switches-off
    paths (the PyTorch loop over dequantized experts among them), so the article step is checked like
    with like: what its kernels change, not what the formats cost."""
    step = DecodeStep(weights.config, *shape, optimizations=REFERENCES[name], weights=weights,
                      precision=precision)
    with torch.no_grad():
        logits = first_step(step, _ids(weights.config, shape[0]))[0]
    del step
    _free()
    return logits


def _free() -> None:
    gc.collect()
    if on_gpu():
        torch.cuda.empty_cache()


SLOW_STEP_S = 0.5  # a step slower than this (the per-expert loop at B = 64) is timed over at most 3 samples


def _time(step: DecodeStep, repeats: int, graph: bool, first_s: float) -> bench.Timing:
    if first_s > SLOW_STEP_S and not graph:
        repeats = min(repeats, 3)
    return bench.time_fn(step.run, warmup=1, repeats=repeats, graph=graph, calls_per_sample=1)


def case_floor(config: K3Config, shape: tuple[int, int], act_bytes: int, bandwidth: tuple[float, str],
               precision: str = "bf16") -> dict:
    """A case's floor at `precision`: `step_bytes` (uniform routing; the cache at `act_bytes` a value at
    'bf16' and 'fp8') over the measured copy bandwidth (TB/s, how)."""
    parts = step_bytes(config, *shape, act_bytes=act_bytes, cache_bytes=act_bytes, precision=precision)
    bw, how = bandwidth
    return {"bytes": parts, "bandwidth_tbs": bw, "how": how, "floor_us": parts["total"] / (bw * 1e6),
            "precision": precision}


def run_variant(case: str, name: str, opts: dict, weights: RankWeights, shape: tuple[int, int], *, ref,
                ref_name: str, repeats: int, floor: dict, trace_dir: str, profile: bool,
                bf16_ref: torch.Tensor | None = None) -> tuple[list[bench.Record], torch.Tensor]:
    """Build one variant's step (`step_settings(name)`), check it (`first_step` against `ref`, the
    logits of `ref_name`; None for the reference itself), time it eager (and as one graph where it can
    be captured, then replay once from the saved state against the eager check), profile it if asked;
    returns (records, its first-step logits). floor: `case_floor` at the variant's precision. bf16_ref:
    for a variant at another precision, the bf16 reference's logits: error['precision_vs_bf16'] records
    what its number formats move the logits by (a figure, not a check)."""
    B, ctx = shape
    step = DecodeStep(weights.config, B, ctx, optimizations=opts, weights=weights, **step_settings(name))
    with torch.no_grad():
        logits, saved, t_first = first_step(step, _ids(weights.config, B))
        experts_read, step.routes = step.experts_read(), None
        err = _errors(logits, ref, ref_name, saved)
        if bf16_ref is not None:
            err["precision_vs_bf16"] = _rel(logits, bf16_ref)
        prec = step.resolved.precision
        # FP8 projections below a bf16 floor: the bytes they save; an 'article' floor counts them already
        fp8_saved = (weights.projection_bytes("bf16") - weights.projection_bytes("fp8")
                     if step.resolved.projections.startswith("fp8") and floor.get("precision") != prec
                     else 0)
        floor = variant_floor(floor, experts_read,
                              expert_bytes(weights.config, weights.embed.element_size(), prec), fp8_saved)
        extra = {
            "step": step.describe(),
            "bytes": floor["bytes"],
            "experts_read": floor["experts_read"],
            "bandwidth_tbs": floor["bandwidth_tbs"],
            "bandwidth_how": floor["how"],
            "collectives": {
                "count": len(step.last_collectives),
                "bytes": sum(b for _, b in step.last_collectives),
                "what": "stand-ins: one device copy of the same bytes",
            },
        }
        extra["collectives"]["standin_us"] = _standin_us(step.last_collectives, step.world_size)
        if profile:
            extra["profile_eager"] = _profile(step.run, f"{case}_{name}_eager", trace_dir)
        label = "before" if name == "all_off" else "after"
        sh = {"batch": B, "context_len": ctx, "q_len": 1, "tp": step.world_size,
              "layers": step.config.num_hidden_layers}
        recs = [
            bench.make_record(
                NAME,
                f"{case}.{name}",
                label,
                _time(step, repeats, False, t_first),
                shape=sh,
                dtype=step.dtype,
                floor_us=floor["floor_us"],
                error=err,
                **extra,
            )
        ]
        ok, why = step.capturable()
        if ok:
            t = _time(step, repeats, True, t_first)
            gextra = dict(extra)
            step.capture()
            if profile:
                gextra["profile_graph"] = _profile(step.replay, f"{case}_{name}_graph", trace_dir)
            step.restore_state(saved)
            gerr = dict(err, graph_vs_eager=_rel(step.replay().clone(), logits))
            recs.append(bench.make_record(NAME, f"{case}.{name}.graph", label, t, shape=sh, dtype=step.dtype,
                                          floor_us=floor["floor_us"], error=gerr, **gextra))
        else:
            recs[0].extra["graph"] = f"not captured: {why}"
    del step, saved
    _free()
    return recs, logits


def chosen_variants(chosen=None) -> list[str]:
    """The variants a run measures: None, every one (`variants()`; on a CPU less CPU_SKIPPED's);
    WATERFALL, those less SETTING_VARIANTS; or a list of names. ValueError for an unknown name."""
    known = list(variants())
    here = [n for n in known if on_gpu() or n not in CPU_SKIPPED]
    if chosen is None:
        return here
    if chosen == WATERFALL:
        return [n for n in here if n not in SETTING_VARIANTS]
    if isinstance(chosen, str) or not all(isinstance(n, str) for n in chosen):
        raise TypeError(f"variants must be None, {WATERFALL!r} or a list of variant names, got {chosen!r}")
    unknown = [n for n in chosen if n not in known]
    if unknown:
        raise ValueError(f"variants must be among {known}, got {unknown}")
    return [n for n in known if n in chosen]


def run_cases(names: list[str] | None = None, *, distinct_layers: int = 3, repeats: int = 5,
              profile: bool = True, variants_run=None,
              log=print) -> list[bench.Record]:
    """Every variant (`chosen_variants(variants_run)`) of every case in `names` (default: all cases
    here); see the module docstring."""
    here = cases()
    names = list(here) if names is None else list(names)
    unknown = [n for n in names if n not in here]
    if unknown:
        raise ValueError(f"cases must be among {list(here)} on this machine, got {unknown}")
    run_names = chosen_variants(variants_run)
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    t0 = time.perf_counter()
    weights = bench_weights(distinct_layers, log)
    bandwidth = measured_bandwidth_tbs()
    records = []
    with tempfile.TemporaryDirectory() as trace_dir:
        for case in names:
            refs = {}  # (reference name, precision) -> its first-step logits
            for name in run_names:
                recs = measure_variant(case, name, weights, refs, bandwidth, repeats=repeats, profile=profile,
                                       trace_dir=trace_dir)
                records += recs
                log(f"  {case} {name}: " + ", ".join(f"{r.mode} {r.median_us / 1e3:.2f} ms" for r in recs)
                    + f"  [{time.perf_counter() - t0:.0f} s]")
    return records


def bench_weights(distinct_layers: int, log=print) -> RankWeights:
    """The study's random weights (`bench_config()`; bf16 on a GPU, fp32 on a CPU), `distinct_layers`
    sets per layer kind; one log line says their size and how long they took."""
    t0 = time.perf_counter()
    dev = torch.device("cuda" if on_gpu() else "cpu")
    dt = torch.bfloat16 if on_gpu() else torch.float32
    weights = RankWeights.random(bench_config(), distinct_layers=distinct_layers, device=dev, dtype=dt)
    log(f"decode_step: weights drawn ({weights.nbytes()['total'] / 2**30:.1f} GiB, {distinct_layers} sets "
        f"per kind) in {time.perf_counter() - t0:.0f} s")
    return weights


def measure_variant(case: str, name: str, weights: RankWeights, refs: dict, bandwidth: tuple[float, str], *,
                    repeats: int, profile: bool, trace_dir: str) -> list[bench.Record]:
    """One variant of one whole-step case (`cases()[case]`), checked then timed (`run_variant`): its
    reference's logits (bf16, and at the variant's precision when that differs) are computed first
    unless `refs` (a dict kept for the case: (reference name, precision) -> logits) holds them already,
    and kept there for the case's next variants. profile: profiled where PROFILED names it at B = 1."""
    B, ctx = cases()[case]
    opts, prec = variants()[name], PRECISION_OF.get(name, "bf16")
    rname = reference_of(opts, weights.world_size)
    for p in dict.fromkeys(("bf16", prec)):
        if (rname, p) not in refs and (rname != name or p != prec):
            refs[rname, p] = reference_logits(rname, weights, (B, ctx), p)
    floor = case_floor(weights.config, (B, ctx), weights.embed.element_size(), bandwidth, prec)
    recs, logits = run_variant(case, name, opts, weights, (B, ctx), ref=refs.get((rname, prec)),
                               ref_name=rname if prec == "bf16" else f"{rname} at {prec}",
                               repeats=repeats, floor=floor, trace_dir=trace_dir,
                               profile=profile and name in PROFILED and B == 1,
                               bf16_ref=refs[rname, "bf16"] if prec != "bf16" else None)
    if name in REFERENCES:
        refs.setdefault((name, "bf16"), logits)
    return recs


def probe_records(log=print) -> list[bench.Record]:
    """The bounds probes (k3lab.studies.decode_step.bounds: cases probe.gemv.<projection>,
    probe.small_kernel), each record with the copy bandwidth measured in this run; logs one line per
    record and the projections' per-step sum against their bytes floor. [] on a CPU (said in the log)."""
    from . import bounds

    if not on_gpu():
        log("decode_step probe: the probes time GPU kernels; there is no GPU here, so nothing is measured")
        return []
    recs = bounds.run()
    bw, how = measured_bandwidth_tbs()
    total_us, total_floor_us = {}, 0.0
    for r in recs:
        log(f"  {r.case:28s} {r.variant:7s} {r.median_us:9.2f} us"
            + (f"  {r.extra['tbs']:.2f} TB/s x {r.extra['calls_per_step']}" if "tbs" in r.extra else ""))
        if "tbs" in r.extra:
            total_us[r.variant] = total_us.get(r.variant, 0.0) + r.median_us * r.extra["calls_per_step"]
            if r.variant == "cublas":
                total_floor_us += r.extra["bytes"] * r.extra["calls_per_step"] / (bw * 1e6)
    alone = ", ".join(f"{v} {t / 1e3:.2f} ms" for v, t in total_us.items())
    log(f"projections per step alone: {alone}; {total_floor_us / 1e3:.2f} ms at {bw:.2f} TB/s ({how})")
    for r in recs:
        r.extra.update(bandwidth_tbs=bw, bandwidth_how=how)
    return recs


# ------------------------------------------------------------------ the study contract
def case_names(preset=None) -> list[str]:
    """The whole-step cases on this machine (GPU: b1_1k, b1_32k, b1_128k, b64_8k; CPU: one tiny case),
    then 'probe' (the bounds probes), 'glue' (the glue kernels alone) and 'attribution' (where the
    batch-1 steps' time goes, kernel by kernel): GPU kernels, nothing measured on a CPU."""
    return [*cases(), *EXTRA_CASES]


def run(preset=None, cases=None, *, repeats: int = 5, distinct_layers: int = 3, profile: bool = True,
        variants=None) -> list:
    """Every variant of the whole-step `cases` (see measure.run_cases; `variants`: None for all,
    WATERFALL for all but SETTING_VARIANTS (the report's quick form), or a list), with 'probe' among them the
    bounds probes (measure.probe_records), with 'glue' the glue kernels (glue.run), with 'attribution'
    the per-part attribution of the batch-1 steps (attribution.records); records of study 'decode_step'.
    Unknown cases are a ValueError naming them, before anything runs."""
    from . import attribution, glue

    chosen = select_cases(case_names(preset), cases)
    steps = [c for c in chosen if c not in EXTRA_CASES]
    chosen_variants(variants)  # an unknown variant refused before anything runs
    records = run_cases(steps, distinct_layers=distinct_layers, repeats=repeats, profile=profile,
                        variants_run=variants) if steps else []
    records += probe_records() if PROBE_CASE in chosen else []
    records += glue.run() if GLUE_CASE in chosen else []
    return records + (attribution.records() if ATTRIBUTION_CASE in chosen else [])


def profile_targets(preset=None) -> dict:
    """One eager step with every optimization off ('before') and on ('after'), at the first case's
    shape, each part of the program inside its named range (`attribution.LabelledStep`:
    k3lab.part.embed, .mix, .kda, .mla, .moe, .dense, .collective; NVTX too where torch sees a GPU), so
    `k3lab profile decode_step`'s traces name the parts."""
    from k3lab.engine.weights import RankWeights

    from .attribution import LabelledStep

    B, ctx = next(iter(cases().values()))
    gpu = on_gpu()
    w = RankWeights.random(bench_config(), distinct_layers=2, device="cuda" if gpu else "cpu",
                           dtype=torch.bfloat16 if gpu else torch.float32)
    steps = {v: LabelledStep(w.config, B, ctx, optimizations=o, weights=w) for v, o
             in (("before", "none"), ("after", "all"))}
    return {v: s.run for v, s in steps.items()}
