"""Study: MLA decode with 12 heads padded to 16 and the history split across programs (seed section 4).

At TP8 each GPU holds 12 of K3's 96 MLA query heads. The seed padded them to 16 so that AITER's
assembly decode could run (each head attends on its own, so the real heads are unchanged and the
extra outputs are dropped), and that path also cut a long history into pieces handled in parallel
instead of one workgroup walking the whole conversation: 43.8 -> 23.6 ms per output token at 32K
input, 22.9 -> 22.8 at 1K (8x MI355X, TP8, concurrency 1, whole-model time per token).

Here both policies run as kernels (`k3lab.ops.mla_decode`) on the machine at hand:

- before: 12 heads, one program per query row walking the whole history, no matrix units (on NVIDIA
  GPUs a CUDA-core kernel, k3lab.ops.mla_before_cuda; the Triton kernel elsewhere and in the
  'tune.*.before.*' cases);
- after: padded to 16 rows for tl.dot, the history split by `choose_num_splits`, merged by LSE;
- peers in the same run: plain PyTorch (einsum + softmax: variant 'torch') and torch SDPA
  (recorded as case '<case>.sdpa', variant 'torch', since both are plain PyTorch), FlashMLA's dense
  decode where it runs (variant 'flashmla': an NVIDIA sm_90a GPU and its prebuilt library, see
  k3lab.ops.flashmla_peer; `flashmla_status()` says why not elsewhere), and AITER's
  padded decode on ROCm when it is installed (variant 'aiter', not yet run on AMD hardware by this
  project).

Cases on a GPU (bf16 cache, paged, page size 64, B = 1 unless named): 1K, 32K and 128K context; a
batch sweep B in {1, 8, 64} at 8K; a ragged batch; 2- and 4-position verification at 32K (read by
the draft-depth study); the seed's explicit-copy padding ('<case>.padcopy') and a contiguous cache ('<case>.contig'); a split-count
sweep at 1K, 32K and 128K ('ctx32k.s64', ...); and, when asked (`tune=True`), launch-configuration
variants ('tune.<case>.<variant>.bn64w4s2'). On a CPU the same code runs on tiny contexts in fp32
through Triton's interpreter (timings there say nothing about GPUs). Every record carries its error
figures against the fp32 reference (k3lab.nn.mla.latent_attention) and the floor: cache bytes over
the measured copy bandwidth.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from k3lab import bench
from k3lab import env as _env
from k3lab.config import K3Config
from k3lab.ops import flashmla_peer
from k3lab.ops import mla_decode as mla

NAME = "mla_padding"
PAGE_SIZE = 64
DEFAULT_PRESET = "tp8"  # the seed's case: 12 heads per GPU (the preset picks the head count only)

# Seed section 4: mean time per output token, ms (8x MI355X, TP8, concurrency 1, whole model).
SEED_MS_PER_TOKEN = {"1K": (22.9, 22.8), "32K": (43.8, 23.6)}
# shared/anchors.md, one H200, plain PyTorch, B = 1, 12 heads unless noted: (einsum+softmax us, SDPA us)
ANCHORS_H200_US = {1024: (71.0, 106.0), 32768: (71.0, 548.0), 131072: (140.0, 1999.0)}
# Targets set for this study on the H200 (bf16, B = 1): checked by `targets()`.
TARGETS = {"bw_32k": 0.70, "bw_128k": 0.80, "speedup_32k": 1.8, "ratio_1k_band": 0.15, "vs_einsum_32k": 5.0}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int
    q_len: int = 1
    ragged: bool = False  # per-request lengths drawn in [context / 8, context], the first = context
    splits: int | None = None  # force the split count (the sweep)
    kind: str = "main"  # 'main', 'sweep' or 'tune'
    tune: tuple | None = None  # (variant, block_n, num_warps, num_stages)
    kernel: str | None = None  # after kernel ('cuda' / 'bulk' / 'split'; None = plan_after's choice): sweep points
    config: tuple | None = None  # the after kernel's (block_n, num_warps, num_stages): sweep points
    options: str | None = None  # the bulk kernel's form (mla_decode.BULK_OPTIONS), e.g. "tail=64"


def _gpu() -> bool:
    return _env.detect().backend != "cpu"


def _main_cases() -> list[Case]:
    if _gpu():
        return [Case("ctx1k", 1, 1024), Case("ctx32k", 1, 32768), Case("ctx128k", 1, 131072),
                Case("b1_8k", 1, 8192), Case("b8_8k", 8, 8192), Case("b64_8k", 64, 8192),
                Case("ragged8_8k", 8, 8192, ragged=True), Case("verify2_32k", 1, 32768, q_len=2),
                Case("verify4_32k", 1, 32768, q_len=4)]
    return [Case("ctx96", 1, 96), Case("ctx320", 1, 320), Case("b3_ctx96", 3, 96),
            Case("ragged3_ctx96", 3, 96, ragged=True), Case("verify4_ctx64", 1, 64, q_len=4)]


def _sweep_cases() -> list[Case]:
    if _gpu():
        grid = {"ctx1k": (1024, (1, 4, 8, 16, 32, 64)),
                "ctx32k": (32768, (1, 16, 32, 64, 128, 132, 192, 256, 264, 396)),
                "ctx128k": (131072, (32, 64, 128, 132, 256, 264, 396))}
    else:
        grid = {"ctx320": (320, (1, 2, 5))}
    return ([Case(f"{base}.s{s}", 1, n, splits=s, kind="sweep") for base, (n, ss) in grid.items() for s in ss]
            + _kernel_cases())


def _kernel_cases() -> list[Case]:
    """Other after kernels beside the default: '<case>.triton' (the Triton split kernel, where the
    default is the CUDA kernel), the bulk-copy kernel (opt-in, see mla_decode.bulk_status) as
    '<case>.bulk' at its default configuration and '<case>.bulk_bn64w4s2' at another one."""
    if not _gpu():
        return [Case("ctx320.bulk", 1, 320, kind="sweep", kernel="bulk"),
                Case("ctx320.bulk_bn64w4s3t64", 1, 320, kind="sweep", kernel="bulk", config=(64, 4, 3),
                     options="tail=64"),
                Case("verify4_ctx64.bulk", 1, 64, q_len=4, kind="sweep", kernel="bulk")]
    base = {c.name: c for c in _main_cases()}
    # the Triton split kernel beside the default after (the CUDA kernel where it runs), same run
    out = [Case(f"{n}.triton", base[n].batch, base[n].context, ragged=base[n].ragged, kind="sweep", kernel="split")
           for n in ("ctx1k", "ctx32k", "ctx128k", "b1_8k", "b8_8k", "b64_8k", "ragged8_8k")]
    # verification groups on the Triton split kernel beside the default (the CUDA kernel, tokens as
    # requests: mla_decode.CUDA_VERIFY_Q_LENS), and 3 positions on both; 8 x 8K on both
    out += [Case(f"verify{tq}_32k.triton", 1, 32768, q_len=tq, kind="sweep", kernel="split") for tq in (2, 3, 4)]
    out += [Case("verify3_32k.cuda", 1, 32768, q_len=3, kind="sweep", kernel="cuda")]
    out += [Case(f"verify{tq}_b8_8k.{label}", 8, 8192, q_len=tq, kind="sweep", kernel=kernel)
            for tq in (2, 3, 4) for label, kernel in (("triton", "split"), ("cuda", "cuda"))]
    # every other verification group at 32K, the after only: with the main cases' 1, 2 and 4 positions the
    # draft-depth study's record-based cost profile (k3lab.spec.costs_from_records) then reaches depth 7
    out += [Case(f"verify{tq}_32k", 1, 32768, q_len=tq, kind="sweep") for tq in (3, 5, 6, 7, 8)]
    out += [Case(f"{n}.bulk", base[n].batch, base[n].context, q_len=base[n].q_len, ragged=base[n].ragged,
                kind="sweep", kernel="bulk")
           for n in ("ctx1k", "ctx32k", "ctx128k", "b8_8k", "b64_8k", "ragged8_8k", "verify4_32k")]
    for n, cfgs in (("ctx32k", ((64, 4, 2), (64, 8, 1))), ("ctx128k", ((64, 4, 2), (64, 8, 1))),
                    ("ctx1k", ((64, 4, 2),))):
        out += [Case(f"{n}.bulk_bn{b}w{w}s{st}", 1, base[n].context, kind="sweep", kernel="bulk", config=(b, w, st))
                for b, w, st in cfgs]
    # three copy buffers of 64 rows (the next tile is in flight while one is computed), one program
    # per SM: fits only with the 64-row tail step (no second query copy in shared memory)
    out += [Case(f"{n}.bulk_bn64w4s3t64", 1, base[n].context, kind="sweep", kernel="bulk", config=(64, 4, 3),
                 options="tail=64") for n in ("ctx1k", "ctx32k", "ctx128k")]
    out += [Case(f"{n}.bulk_s3t64", base[n].batch, base[n].context, ragged=base[n].ragged, kind="sweep",
                 kernel="bulk", config=(64, 4, 3), options="tail=64") for n in ("b8_8k", "b64_8k", "ragged8_8k")]
    return out


def _tune_cases() -> list[Case]:
    """Launch-configuration variants (GPU): tile rows, warps, pipeline stages."""
    if not _gpu():
        return []
    out = []
    for base, n, tq in (("ctx32k", 32768, 1), ("ctx128k", 131072, 1), ("verify4_32k", 32768, 4)):
        cfgs = ((64, 4, 2), (64, 8, 2), (32, 4, 3), (32, 4, 4), (32, 8, 3), (128, 8, 1)) if tq == 1 else \
            ((32, 8, 3), (32, 8, 2), (64, 8, 2), (16, 8, 4), (32, 4, 3))
        out += [Case(f"tune.{base}.after.bn{b}w{w}s{s}", 1, n, q_len=tq, kind="tune", tune=("after", b, w, s))
                for b, w, s in cfgs]
    out += [Case(f"tune.ctx32k.before.bn{b}w{w}s{s}", 1, 32768, kind="tune", tune=("before", b, w, s))
            for b, w, s in ((16, 4, 2), (32, 4, 2), (32, 8, 2), (64, 8, 2), (32, 8, 3))]
    # the Triton before at its default configuration, where the default before is the CUDA kernel
    out += [Case("tune.ctx1k.before.bn32w8s2", 1, 1024, kind="tune", tune=("before", 32, 8, 2))]
    return out


def cases(preset=None, *, tune: bool = False) -> list[Case]:
    _heads(preset)  # validates the preset
    return _main_cases() + _sweep_cases() + (_tune_cases() if tune else [])


def case_names(preset=None) -> list[str]:
    """Main cases, then the split-count sweep (tuning cases are run only when asked: run(tune=True))."""
    return [c.name for c in cases(preset)]


def _heads(preset) -> int:
    cfg = K3Config.preset(preset or DEFAULT_PRESET)
    return cfg.num_attention_heads


def _dtype(dtype=None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.bfloat16 if _gpu() else torch.float32


# ----------------------------------------------------------------------------------------------
# inputs


def _lengths(case: Case, gen: torch.Generator) -> list[int]:
    if not case.ragged:
        return [case.context] * case.batch
    lo = max(case.q_len, case.context // 8)
    rest = torch.randint(lo, case.context + 1, (case.batch - 1,), generator=gen).tolist()
    return [case.context] + rest


def _make_set(case: Case, heads: int, dtype, seed: int) -> dict:
    """One input set: query, contiguous cache (for the PyTorch peers) and its paged copy (kernels)."""
    dev = _env.detect().device
    gen = torch.Generator().manual_seed(seed)
    lens = _lengths(case, gen)
    q = torch.randn(case.batch, case.q_len, heads, mla.LATENT_DIM, generator=gen).to(dev, dtype)
    cache = torch.empty(case.batch, case.context, mla.LATENT_DIM, dtype=dtype, device=dev)
    cache.normal_(generator=torch.Generator(device=dev).manual_seed(seed + 1))
    pool, table = mla.to_paged(cache, PAGE_SIZE, seed=seed)
    lengths = torch.tensor(lens, dtype=torch.int32, device=dev)
    return {"q": q, "cache": cache, "pool": pool, "table": table, "lengths": lengths,
            "lengths_host": lens, "plans": {}}


def cache_bytes(case: Case, dtype, lengths: list[int] | None = None) -> int:
    """Latent bytes one decode step must read: every position in use, 576 values each."""
    elem = torch.tensor([], dtype=dtype).element_size()
    total = sum(lengths) if lengths is not None else case.batch * case.context
    return total * mla.LATENT_DIM * elem


# ----------------------------------------------------------------------------------------------
# variants


def _variants(case: Case, heads: int, dtype: torch.dtype | None = None) -> dict[str, tuple[str, str]]:
    """(record case, record variant) for each runnable variant key of a case."""
    if case.kind == "sweep":
        return {"after": (case.name, "after")}
    if case.kind == "tune":
        return {case.tune[0]: (case.name, case.tune[0])}
    out = {"before": (case.name, "before"), "after": (case.name, "after"), "einsum": (case.name, "torch"),
           "sdpa": (f"{case.name}.sdpa", "torch"), "padcopy": (f"{case.name}.padcopy", "after"),
           "contig": (f"{case.name}.contig", "after")}
    if heads > mla.MMA_ROWS:
        out.pop("padcopy")
    if mla.aiter_status()[0] and heads <= mla.MMA_ROWS:
        out["aiter"] = (case.name, "aiter")
    if dtype in (torch.bfloat16, torch.float16) and flashmla_status()[0]:
        out["flashmla"] = (case.name, "flashmla")
    return out


def flashmla_status() -> tuple[bool, str]:
    """Whether FlashMLA's decode joins the cases as a peer (k3lab.ops.flashmla_peer), and why not."""
    if PAGE_SIZE != flashmla_peer.PAGE_SIZE:
        return False, f"the study's pages are {PAGE_SIZE} rows, FlashMLA's {flashmla_peer.PAGE_SIZE}"
    return flashmla_peer.status()


def _plan(key: str, case: Case, s: dict, heads: int):
    """The callable for variant `key` on input set s (kernel plans are built once per set)."""
    if key in s["plans"]:
        return s["plans"][key]
    q, pool, table, lens, cache = s["q"], s["pool"], s["table"], s["lengths"], s["cache"]
    ragged = case.ragged or case.q_len > 1
    fold = heads > mla.MMA_ROWS
    tune = dict(zip(("block_n", "num_warps", "num_stages"), case.tune[1:])) if case.tune else {}
    if key == "before":
        fn = mla.plan_before(q, pool, lens, block_table=table, **tune)
    elif key == "after":
        if case.config:
            tune = dict(zip(("block_n", "num_warps", "num_stages"), case.config))
        fn = mla.plan_after(q, pool, lens, block_table=table, num_splits=case.splits, fold_heads=fold,
                            kernel=case.kernel, bulk_options=case.options, **tune)
    elif key == "padcopy":
        fn = mla.plan_after(q, pool, lens, block_table=table, pad="copy")
    elif key == "contig":
        fn = mla.plan_after(q, cache, lens, fold_heads=fold)
    elif key == "einsum":
        fn = (lambda: mla.einsum_decode(q, cache, lens)) if ragged else (lambda: mla.einsum_decode(q, cache))
    elif key == "sdpa":
        fn = (lambda: mla.sdpa_decode(q, cache, lens)) if ragged else (lambda: mla.sdpa_decode(q, cache))
    elif key == "flashmla":
        fn = flashmla_peer.plan(q, pool, lens, block_table=table)
    elif key == "aiter":  # not yet run on AMD hardware by this project
        fn = lambda: mla.aiter_decode(q, pool, lens, block_table=table)  # noqa: E731
    else:
        raise ValueError(f"unknown variant {key!r}")
    s["plans"][key] = fn
    return fn


def _plan_facts(fn) -> dict:
    return fn.facts() if callable(getattr(fn, "facts", None)) else {}  # Triton or CUDA plan; {} for the peers


# ----------------------------------------------------------------------------------------------
# the study contract


def _timing_opts(gpu: bool, repeats: int | None) -> dict:
    if gpu:
        return {"warmup": 10, "repeats": repeats or 100}
    return {"warmup": 0, "repeats": repeats or 2}  # the interpreter: a correctness run, not a benchmark


def run(preset=None, cases=None, *, tune: bool = False, modes=None, dtype=None, repeats: int | None = None,
        log: Callable[[str], None] | None = None) -> list[bench.Record]:
    """Check every variant of each case against the fp32 reference (raising bench.CheckFailed on a
    mismatch), then time it; returns the records (not saved).

    cases: names from case_names() (or tuning names from cases(tune=True)); None = all of
    case_names() (plus the tuning cases when tune=True). modes: GPU timing modes, default
    ('eager', 'graph') for main cases and ('graph',) for sweep and tuning cases."""
    heads = _heads(preset)
    dt = _dtype(dtype)
    table = {c.name: c for c in _main_cases() + _sweep_cases() + _tune_cases()}
    if cases is None:
        chosen = [c for c in _main_cases() + _sweep_cases() + (_tune_cases() if tune else [])]
    else:
        unknown = [n for n in cases if n not in table]
        if unknown:
            raise ValueError(f"unknown cases {unknown}; cases here: {list(table)}")
        chosen = [table[n] for n in cases]
    gpu = _gpu()
    info = _env.detect()
    records: list[bench.Record] = []
    for case in chosen:
        records += _run_case(case, heads, dt, gpu, info, modes, repeats, log)
    return records


def _run_case(case: Case, heads: int, dt, gpu: bool, info, modes, repeats, log) -> list[bench.Record]:
    say = log or (lambda msg: None)
    first = _make_set(case, heads, dt, seed=zlib.crc32(case.name.encode()) % 10_000)
    nbytes = cache_bytes(case, dt, first["lengths_host"])
    sets = [first] + [_make_set(case, heads, dt, seed=1000 + i)
                      for i in range(bench.rotation_count(nbytes, max_sets=64 if gpu else 2) - 1)]
    ref_o, ref_l = mla.latent_attention(first["q"].float(), first["cache"].float(), lengths=first["lengths"])
    variants = _variants(case, heads, dt)
    errors: dict[str, dict] = {}
    for key, (rcase, _) in variants.items():  # every check before any timing
        out = _plan(key, case, first, heads)()
        o, lse = out if isinstance(out, tuple) else (out, None)
        pairs = {"o": (o, ref_o)}
        if lse is not None:
            pairs["lse"] = (lse, ref_l)
        errors[key] = bench.check_all(pairs, dtype=dt)
    floor = bench.floor_us(bytes=nbytes)
    if gpu:
        use_modes = tuple(modes) if modes else (("eager", "graph") if case.kind == "main" else ("graph",))
    else:
        use_modes = ("cpu",)
    records = []
    shape = {"batch": case.batch, "context": case.context, "q_len": case.q_len, "heads": heads,
             "padded_heads": mla.MMA_ROWS, "latent": mla.LATENT_DIM, "value": mla.VALUE_DIM,
             "page_size": PAGE_SIZE, "ragged": case.ragged, "lengths_sum": sum(first["lengths_host"])}
    for key, (rcase, variant) in variants.items():
        facts = _plan_facts(_plan(key, case, first, heads))
        for s in sets:  # validate and plan every set now: no host sync inside timing or graph capture
            _plan(key, case, s, heads)
        rot = [(s,) for s in sets]
        fn = (lambda s, k=key: _plan(k, case, s, heads)())  # noqa: E731 - one step per input set
        for mode in use_modes:
            timing = bench.time_fn(fn, rotate=rot, graph=(mode == "graph"), **_timing_opts(gpu, repeats))
            achieved = nbytes / (timing.median_us * 1e-6) / 1e12
            extra = dict(facts, cache_bytes=nbytes, achieved_tbs=achieved,
                         copy_bw_fraction=achieved / info.peak.bandwidth_tbs, compute_units=info.compute_units,
                         layout="contiguous" if key in ("einsum", "sdpa", "contig") else "paged",
                         peer={"einsum": "einsum+softmax", "sdpa": "sdpa", "flashmla": "flashmla"}.get(key))
            rec = bench.make_record(NAME, rcase, variant, timing, shape=shape, dtype=dt, floor_us=floor,
                                    error=errors[key], **extra)
            records.append(rec)
            say(f"{rcase:28s} {variant:7s} {mode:6s} {timing.median_us:10.2f} us  floor {floor:8.2f} us  "
                f"{achieved:6.3f} TB/s  splits {facts.get('num_splits', '-')}")
    del sets, first
    if gpu:
        torch.cuda.empty_cache()
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """One decode step per variant at 32K (GPU) or 320 positions (CPU), for traces: before, after, the
    einsum peer ('torch') and, where it runs, FlashMLA."""
    heads = _heads(preset)
    case = Case("ctx32k", 1, 32768) if _gpu() else Case("ctx320", 1, 320)
    dtype = _dtype()
    s = _make_set(case, heads, dtype, seed=7)
    variants = [("before", "before"), ("after", "after"), ("einsum", "torch")]
    if dtype in (torch.bfloat16, torch.float16) and heads <= mla.MMA_ROWS and flashmla_status()[0]:
        variants.append(("flashmla", "flashmla"))
    out = {}
    for key, label in variants:
        fn = _plan(key, case, s, heads)
        out[label] = (lambda f=fn: f())
    return out


TRACES = "traces"  # the committed H200 traces of profile_targets (k3lab profile mla_padding), by variant


def committed_traces(device: str = "nvidia-h200") -> dict[str, Path]:
    """The newest committed trace file of each profile_targets variant
    (profiles/<device>/mla_padding/traces/mla_padding-<variant>-*.trace.json.gz), by variant."""
    base = bench.PROFILES / device / NAME / TRACES
    out = {}
    for variant in ("before", "after", "torch", "flashmla"):
        found = sorted(base.glob(f"{NAME}-{variant}-*.trace.json.gz"))
        if found:
            out[variant] = found[-1]
    return out


# ----------------------------------------------------------------------------------------------
# tables and figures for the notebook and the report


def programs_table(preset=None, contexts=(1024, 32768), batch: int = 1, q_len: int = 1,
                   compute_units: int | None = None):
    """Programs each policy launches against the compute units, per context length (no GPU needed)."""

    heads = _heads(preset)
    units = compute_units or _env.detect().compute_units
    groups = mla.after_groups(heads, q_len)
    rows = []
    for n in contexts:
        before_programs = batch * q_len * heads
        rows.append({"context": n, "policy": "before", "programs": before_programs, "compute_units": units,
                     "units_busy": min(1.0, before_programs / units), "splits": 1,
                     "positions_per_program": n, "launches": 1, "matrix_units": False})
        s = mla.choose_num_splits(batch, n, units, groups_per_request=groups)
        after_programs = batch * groups * s
        rows.append({"context": n, "policy": "after", "programs": after_programs, "compute_units": units,
                     "units_busy": min(1.0, after_programs / units), "splits": s,
                     "positions_per_program": -(-n // s), "launches": 1 + (s > 1), "matrix_units": True})
    return pd.DataFrame(rows)


def programs_figure(table, title: str | None = None):
    """Bars: programs per policy and context, with the compute-unit count as a line."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for policy, color in (("before", "#d62728"), ("after", "#2ca02c")):
        sub = table[table["policy"] == policy]
        fig.add_trace(go.Bar(name=policy, x=[f"{c // 1024}K" if c >= 1024 else str(c) for c in sub["context"]],
                             y=sub["programs"], marker_color=color,
                             text=[f"{p} programs, {s} split(s)" for p, s in zip(sub["programs"], sub["splits"])]))
    units = int(table["compute_units"].iloc[0])
    fig.add_hline(y=units, line_dash="dash", annotation_text=f"{units} compute units")
    fig.update_layout(barmode="group", template="plotly_white", xaxis_title="context length",
                      yaxis_title="programs in the main kernel",
                      title=title or "Programs launched vs compute units, B = 1 decode")
    return fig


def padding_cost(preset=None, contexts=(1024, 32768, 131072), batch: int = 1, dtype=torch.bfloat16):
    """What padding 12 -> 16 heads costs: the cache read (the bulk of the bytes) is the same; only
    the query, the matrix rows and the dropped outputs grow."""

    heads = _heads(preset)
    padded = -(-heads // mla.MMA_ROWS) * mla.MMA_ROWS
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for n in contexts:
        cache = batch * n * mla.LATENT_DIM * elem
        for label, h in (("12 heads" if heads == 12 else f"{heads} heads", heads), (f"padded to {padded}", padded)):
            q_bytes = batch * h * mla.LATENT_DIM * elem
            flops = 2 * batch * h * n * (mla.LATENT_DIM + mla.VALUE_DIM)
            rows.append({"context": n, "query": label, "cache_bytes": cache, "query_bytes": q_bytes,
                         "output_bytes": batch * h * mla.VALUE_DIM * elem, "matrix_flops": flops,
                         "flops_per_cache_byte": flops / cache})
    return pd.DataFrame(rows)


def instruction_mix(dtype: str = "bf16", arch: int = 90):
    """Compile the kernels (before; after's split kernel and its merge) for an NVIDIA sm_90
    (H100/H200) here, with no GPU needed (Triton's own compiler and its bundled ptxas), and report
    which instructions carry the products: wgmma / mma.sync (matrix units) or fma only, with
    registers, spills, shared memory, and the grid-dependency instructions (griddepcontrol) of the
    early-launched merge.

    Where Triton runs as the interpreter (CPU), the compile runs in a child process with
    TRITON_INTERPRET=0, since interpreted kernels cannot be compiled. Returns a DataFrame; a 'note'
    column instead when this Triton cannot compile for NVIDIA (no NVIDIA backend)."""
    import json
    import os
    import subprocess
    import sys


    if _env.triton_interpreted():
        code = (f"import json; from k3lab.studies import mla_padding as st; "
                f"print('ROWS=' + json.dumps(st._instruction_rows({dtype!r}, {arch})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, TRITON_INTERPRET="0"))
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROWS=")]
        if res.returncode != 0 or not line:
            return pd.DataFrame([{"kernel": "both", "note": f"compile for sm_{arch} failed: {res.stderr[-400:]}"}])
        return pd.DataFrame(json.loads(line[0][5:]))
    return pd.DataFrame(_instruction_rows(dtype, arch))


def _instruction_rows(dtype: str, arch: int) -> list[dict]:
    import glob
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # pointer and stride arguments get the 16-divisibility hint Triton's launcher gives them at run time
    div16 = {"q_ptr", "kv_ptr", "bt_ptr", "len_ptr", "o_ptr", "lse_ptr", "op_ptr", "lsep_ptr", "stride_qb",
             "stride_qt", "stride_qh", "stride_kvp", "stride_kvr", "stride_ob", "stride_ot", "stride_oh"}
    ptr = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "bt_ptr": "*i32", "len_ptr": "*i32", "o_ptr": f"*{dtype}",
           "lse_ptr": "*fp32", "op_ptr": "*fp32", "lsep_ptr": "*fp32", "scale_log2": "fp32"}
    bcfg = mla.launch_config("before")
    acfg = mla.launch_config("after", rows=mla.MMA_ROWS)  # the static default (no device needed)
    kernels = {
        "before": (mla._before_kernel, dict(PAGED=True, PAGE_SIZE=PAGE_SIZE, DV=512, DR=64, BLOCK_N=bcfg.block_n,
                                            INTERPRET=False), bcfg),
        "after": (mla._split_kernel, dict(PAGED=True, PAGE_SIZE=PAGE_SIZE, PAGE_GROUPS=16, DV=512, DR=64,
                                          HEAD_TILE=16, TOK_TILE=1, BLOCK_N=acfg.block_n, WRITE_FINAL=False,
                                          IEEE=False, PDL=True, INTERPRET=False), acfg),
        "merge": (mla._merge_kernel, dict(DV=512, BLOCK_DV=mla.MERGE_DV, SPLITS_P2=256, SPLIT_TILE=256, PDL=True),
                  mla.LaunchConfig(mla.MERGE_DV, 4, 1)),
    }
    if mla.TensorDescriptor is not None:  # the bulk-copy kernel (Hopper TMA), the after default there
        kcfg = mla.launch_config("after", rows=mla.MMA_ROWS, kernel="bulk")
        ptr["kc_desc"] = f"tensordesc<{dtype}[{kcfg.block_n},512]>"
        ptr["kpe_desc"] = f"tensordesc<{dtype}[{kcfg.block_n},64]>"
        for label, cfg_b, opts in (("after_bulk", kcfg, None), ("after_bulk_s3", mla.LaunchConfig(64, 4, 3), "tail=64")):
            kernels[label] = (mla._page_split_kernel, dict(
                PAGE_SIZE=PAGE_SIZE, DV=512, DR=64, HEAD_TILE=16, TOK_TILE=1, BLOCK_N=cfg_b.block_n, CAUSAL=False,
                WRITE_FINAL=False, IEEE=False, PDL=True, INTERPRET=False, **mla._bulk_options(opts)), cfg_b)
    ptxas = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
    rows = []
    for name, (fn, consts, cfg) in kernels.items():
        names = fn.arg_names
        sig = {n: ("constexpr" if n in consts else ptr.get(n, "i32")) for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in div16}
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
        except Exception as exc:  # no NVIDIA backend in this Triton build: say so, do not fail
            return [{"kernel": name, "note": f"could not compile for sm_{arch}: {type(exc).__name__}: {exc}"}]
        ptx = k.asm["ptx"]
        row = {"kernel": name, "target": f"sm_{arch}", "wgmma": ptx.count("wgmma.mma_async"),
               "mma_sync": ptx.count("mma.sync"), "bulk_copies": ptx.count("cp.async.bulk.tensor"),
               "griddepcontrol": ptx.count("griddepcontrol."), "fma_f32": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
               "shared_kb": k.metadata.shared / 1024, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
               "registers": None, "spill_bytes": None}
        if ptxas:
            with tempfile.TemporaryDirectory() as d:
                src = os.path.join(d, "k.ptx")
                with open(src, "w") as f:
                    f.write(ptx)
                res = subprocess.run([ptxas[0], "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(d, "k.cubin")],
                                     capture_output=True, text=True)
            m_reg = re.search(r"Used (\d+) registers", res.stderr)
            m_sp = re.search(r"(\d+) bytes spill stores", res.stderr)
            row["registers"] = int(m_reg.group(1)) if m_reg else None
            row["spill_bytes"] = int(m_sp.group(1)) if m_sp else None
        rows.append(row)
    return rows


def _main_name(case: str) -> str:
    return case.split(".")[0]


def summary(records):
    """One row per (device, main case, mode): before, after, the peers and AITER, the floor, and
    the ratios (speedup = before / after; bw_fraction = floor / after = share of the copy bandwidth)."""

    keyed: dict[tuple, dict] = {}
    for r in records:
        if r.study != NAME or r.case.startswith("tune.") or ".s" in r.case and r.case.split(".")[-1][1:].isdigit():
            continue
        base = _main_name(r.case)
        suffix = r.case[len(base) + 1:] if r.case != base else ""
        col = {("", "before"): "before_us", ("", "after"): "after_us", ("", "torch"): "einsum_us",
               ("sdpa", "torch"): "sdpa_us", ("padcopy", "after"): "after_padcopy_us",
               ("contig", "after"): "after_contig_us", ("", "aiter"): "aiter_us",
               ("", "flashmla"): "flashmla_us"}.get((suffix, r.variant))
        if col is None:
            continue
        row = keyed.setdefault((r.device, base, r.mode), {"device": r.device, "case": base, "mode": r.mode,
                                                          "batch": r.shape.get("batch"),
                                                          "context": r.shape.get("context"),
                                                          "q_len": r.shape.get("q_len"), "floor_us": r.floor_us})
        row[col] = r.median_us
        if col == "after_us":
            row["splits"] = r.extra.get("num_splits")
            row["programs"] = r.extra.get("programs")
    df = pd.DataFrame(list(keyed.values()))
    if df.empty:
        return df
    for c in ("before_us", "after_us", "einsum_us", "sdpa_us", "after_padcopy_us", "after_contig_us", "aiter_us",
              "flashmla_us"):
        if c not in df:
            df[c] = math.nan
    df["speedup"] = df["before_us"] / df["after_us"]
    df["bw_fraction"] = df["floor_us"] / df["after_us"]
    df["vs_einsum"] = df["einsum_us"] / df["after_us"]
    df["vs_sdpa"] = df["sdpa_us"] / df["after_us"]
    df["vs_flashmla"] = df["flashmla_us"] / df["after_us"]
    return df


def sweep_table(records, compute_units: int | None = None):
    """The split-count sweep: context, splits, time (graph replay), and the split count the rule picks."""

    rows = []
    for r in records:
        if r.study != NAME or r.case.startswith("tune.") or "." not in r.case:
            continue
        base, tail = r.case.split(".", 1)
        if not (tail.startswith("s") and tail[1:].isdigit()):
            continue
        rows.append({"device": r.device, "case": base, "context": r.shape["context"], "splits": int(tail[1:]),
                     "mode": r.mode, "median_us": r.median_us, "floor_us": r.floor_us,
                     "bw_fraction": r.floor_us / r.median_us if r.floor_us else math.nan})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    units = {}
    for r in records:
        units.setdefault(r.device, r.extra.get("compute_units"))
    df["rule_choice"] = [mla.choose_num_splits(1, int(c), compute_units or units.get(d) or 1)
                         for d, c in zip(df["device"], df["context"])]
    return df.sort_values(["device", "context", "splits"]).reset_index(drop=True)


def sweep_figure(table, title: str | None = None):
    """Time against split count per context, the rule's choice marked."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for (dev, case), sub in table.groupby(["device", "case"]):
        fig.add_trace(go.Scatter(x=sub["splits"], y=sub["median_us"], mode="lines+markers", name=f"{case} ({dev})"))
        choice = int(sub["rule_choice"].iloc[0])
        hit = sub[sub["splits"] == choice]
        if not hit.empty:
            fig.add_trace(go.Scatter(x=hit["splits"], y=hit["median_us"], mode="markers", showlegend=False,
                                     marker=dict(symbol="star", size=14, color="black"),
                                     hovertext=f"rule's choice: {choice}"))
    fig.update_layout(template="plotly_white", xaxis_title="history pieces per request (num_splits)",
                      yaxis_title="time per decode step (us)", xaxis_type="log", yaxis_type="log",
                      title=title or "Split-count sweep (star: choose_num_splits)")
    return fig


def targets(records, device: str = "NVIDIA H200"):
    """The study's H200 targets against the records: name, target, measured, met (graph replay and
    eager both shown where the target depends on the timing mode)."""

    df = summary([r for r in records if r.device == device])
    rows = []
    if df.empty:
        return pd.DataFrame(rows)
    for mode in sorted(df["mode"].unique()):
        sub = df[df["mode"] == mode].set_index("case")

        def get(case, col):
            return float(sub.loc[case, col]) if case in sub.index and col in sub else math.nan

        checks = [
            ("after share of copy bandwidth, 32K", ">= 0.70", get("ctx32k", "bw_fraction"), lambda v: v >= 0.70),
            ("after share of copy bandwidth, 128K", ">= 0.80", get("ctx128k", "bw_fraction"), lambda v: v >= 0.80),
            ("before / after, 32K", ">= 1.8", get("ctx32k", "speedup"), lambda v: v >= 1.8),
            ("before / after, 1K", "0.85 .. 1.15", get("ctx1k", "speedup"), lambda v: 0.85 <= v <= 1.15),
            ("einsum / after, 32K", ">= 5", get("ctx32k", "vs_einsum"), lambda v: v >= 5.0),
        ]
        for name, target, value, ok in checks:
            rows.append({"mode": mode, "target": name, "wanted": target, "measured": value,
                         "met": bool(ok(value)) if not math.isnan(value) else None})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------------------------------
# the CUDA kernel's timeline probe (committed H200 runs of scripts/device_mla_probe.py)

PROBE_PHASES = ("first tile", "tile loop", "write piece", "merge")


def probe_runs(device: str = "nvidia-h200") -> dict[str, dict]:
    """The committed timeline-probe runs (profiles/<device>/mla_padding/extra/probe_*.json), by file
    stem; each maps '<form>.<case>' to that case's graph time, splits and last timeline (under 'rows'
    in runs that also name their device, versions and commit)."""
    base = bench.PROFILES / device / NAME / "extra"
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(base.glob("probe_*.json"))}
    return {k: r["rows"] if "rows" in r else r for k, r in runs.items()}


def probe_frames(run: dict) -> dict[str, pd.DataFrame]:
    """One probe run as kernel-like frames for `plots.timeline`: per '<form>.<case>' one row whose
    bars are every block's phases (waiting for its first tile, the tile loop, writing its piece)
    and the merge blocks' spans, in us from the first block's start."""
    out = {}
    for key, rec in run.items():
        tl = rec["last_timeline"]
        rows = []
        for b in tl["blocks"]:
            first = b["start"] if b["first"] is None else b["first"]
            rows += [(PROBE_PHASES[0], b["start"], first - b["start"]), (PROBE_PHASES[1], first, b["loop_end"] - first),
                     (PROBE_PHASES[2], b["loop_end"], b["end"] - b["loop_end"])]
        rows += [(PROBE_PHASES[3], m["start"], m["end"] - m["start"]) for m in tl["merge"]]
        label = key if "." in key else f"split.{key}"  # the first run's keys had no form
        out[f"{label} ({rec['graph_us']:.1f} us)"] = pd.DataFrame(
            [{"name": n, "category": n, "start_us": t, "dur_us": d} for n, t, d in rows])
    return out


# ----------------------------------------------------------------------------------------------
# how fast a plain read of the same bytes goes (committed H200 run of scripts/device_copy_floor.py)

READ_FLOORS = "extra/copy_floor_d498419.json"


def read_floors(records=None, device: str = "nvidia-h200", path=None) -> pd.DataFrame:
    """A device copy and a PyTorch sum of each case's cache bytes, timed like the decode (graph replay),
    as shares of the measured copy bandwidth: one row per case with 'copy_share' and 'sum_share', and,
    given this study's records, 'decode_share' (the after's bw_fraction in graph mode)."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / READ_FLOORS
    rows = json.loads(Path(path).read_text()).get("rows")
    if not isinstance(rows, dict) or not rows or any("sum_share" not in r for r in rows.values()):
        raise ValueError(f"{path} is not a read-floor run of scripts/device_copy_floor.py")
    df = pd.DataFrame([{"case": case, **vals} for case, vals in rows.items()])
    if records:
        s = summary(records)
        share = s[s["mode"] == "graph"].set_index("case")["bw_fraction"]
        df["decode_share"] = df["case"].map(share)
    return df


# ----------------------------------------------------------------------------------------------
# where the decode's time goes: readers of the same bytes and the wgmma form with its arithmetic
# removed (committed H200 runs of scripts/device_mla_read_probe.py and scripts/device_mla_wgmma.py)

READ_PROBE = "extra/read_probe_20255de.json"
WGMMA_RUN = "extra/merge_cost_20255de.json"
MERGE_RUN = WGMMA_RUN  # the same run holds the builds with the merge kernel emptied (K3_MLA_MERGE_EMPTY)
# (file, key in it) -> label, in the order of the figure: from the plainest read to the full decode
BREAKDOWN_STEPS = (
    ("probe", "ldg 528 blocks", "plain 16-byte loads"),
    ("probe", "ring split 128 (decode path)", "the decode's tile ring, no arithmetic"),
    ("probe", "ring split 128 +tail", "... + an empty second kernel"),
    ("merge", "wgmma-dme-data-only", "wgmma form, no arithmetic, empty merge"),
    ("wgmma", "wgmma-data-only", "wgmma form, no arithmetic, + merge"),
    ("merge", "wgmma-me-no-merge", "wgmma form, empty merge"),
    ("wgmma", "wgmma", "wgmma form (the after from 8K up)"),
    ("wgmma", "split", "mma.sync split kernel"),
)


def read_breakdown(device: str = "nvidia-h200", probe_path=None, wgmma_path=None, merge_path=None) -> pd.DataFrame:
    """One row per (case, step) of BREAKDOWN_STEPS: its graph-replay time and share of the measured
    copy bandwidth, from the committed read-probe, wgmma and merge-cost runs (cases present in all)."""
    base = bench.PROFILES / device / NAME
    runs = {"probe": json.loads(Path(probe_path or base / READ_PROBE).read_text()),
            "wgmma": json.loads(Path(wgmma_path or base / WGMMA_RUN).read_text()),
            "merge": json.loads(Path(merge_path or base / MERGE_RUN).read_text())}
    keys = {"probe": "variants", "wgmma": "forms", "merge": "forms"}
    for src, run in runs.items():
        if not isinstance(run.get("rows"), dict) or any(keys[src] not in r for r in run["rows"].values()):
            raise ValueError(f"the {src} run's file has no rows of {keys[src]!r}")
    rows = []
    for case in [c for c in runs["probe"]["rows"] if all(c in r["rows"] for r in runs.values())]:
        for src, key, label in BREAKDOWN_STEPS:
            vals = runs[src]["rows"][case][keys[src]]
            if key not in vals:
                raise ValueError(f"{case}: no {key!r} in the committed {src} run")
            rows.append({"case": case, "step": label, "us": vals[key]["us"], "share": vals[key]["share"],
                         "commit": runs[src]["commit"]})
    return pd.DataFrame(rows)


def arithmetic_per_tile(device: str = "nvidia-h200", path=None, key: str = "wgmma-co-unchecked",
                        short: str = "ctx32k", long: str = "ctx128k") -> pd.DataFrame:
    """The warpgroup-MMA form's arithmetic per 64-row tile beside the tile's share of DRAM time, from
    the committed run with the compute-only build (`key`: one tile loaded, every tile's products run
    on it): the difference between the `long` and `short` cases over their difference in tiles per
    piece, against 72 KB at the copy bandwidth shared by the pieces that stream at once."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / WGMMA_RUN
    run = json.loads(Path(path).read_text())
    rows = run.get("rows", {})
    try:
        a, b = rows[short]["forms"][key], rows[long]["forms"][key]
        nbytes = {short: rows[short]["bytes"], long: rows[long]["bytes"]}
    except (KeyError, TypeError):
        raise ValueError(f"{path} has no {key!r} times and bytes for {short!r} and {long!r}") from None
    if a["splits"] != b["splits"]:
        raise ValueError(f"{path}: {short} and {long} ran with different piece counts ({a['splits']}, {b['splits']})")
    tile_bytes = 64 * mla.LATENT_DIM * 2  # 64 rows of bf16
    tiles = {c: n / a["splits"] / tile_bytes for c, n in nbytes.items()}  # per piece
    arith = (b["us"] - a["us"]) / (tiles[long] - tiles[short])
    dram = tile_bytes * a["splits"] / (run["copy_bandwidth_tbs"] * 1e12) * 1e6
    return pd.DataFrame([{"commit": run["commit"], "pieces": a["splits"], "arithmetic_us_per_tile": arith,
                          "dram_us_per_tile": dram, "arithmetic_share_of_dram_time": arith / dram}])


def breakdown_figure(df: pd.DataFrame, title: str | None = None):
    """Grouped bars of read_breakdown's shares of the copy bandwidth, with the issue's targets."""
    import plotly.express as px

    fig = px.bar(df, x="case", y="share", color="step", barmode="group", text_auto=".0%",
                 title=title or "Where the MLA decode's time goes (H200, graph replay)",
                 labels={"share": "share of copy bandwidth"})
    for level, label in ((0.7, "target 32K"), (0.8, "target 128K")):
        fig.add_hline(y=level, line_dash="dot", annotation_text=label)
    return fig


# ----------------------------------------------------------------------------------------------
# a third stage: without its rope box a tile is 64 KB and three fit beside the query; the rope must
# then reach the arithmetic another way (committed H200 runs of scripts/device_mla_wgmma.py, each
# timing the two-stage default and one three-stage build, with and without arithmetic)

STAGE_RUNS = (("rope loaded into registers", "extra/rope_regs_07e1932.json", "wgmma-rope-regs"),
              ("rope in a ring of two boxes", "extra/ring3_7691e31.json", "wgmma-r3"))
STAGE_BUILDS = (("wgmma-data-only", "two 72 KB stages, no arithmetic"), ("{key}-data-only", "three 64 KB stages, no arithmetic"),
                ("wgmma", "two 72 KB stages (the after)"), ("{key}", "three 64 KB stages"))


def stage_table(device: str = "nvidia-h200", runs=STAGE_RUNS) -> pd.DataFrame:
    """One row per (run, case, build) of the committed three-stage runs: graph-replay time and share
    of the copy bandwidth of the two-stage default and of the three-stage build, each with and without
    its arithmetic, all timed in that run. `runs`: (label, path under the study's profiles, key)."""
    base = bench.PROFILES / device / NAME
    rows = []
    for label, path, key in runs:
        path = Path(path) if Path(path).is_absolute() else base / path
        run = json.loads(path.read_text())
        if not isinstance(run.get("rows"), dict) or not run["rows"]:
            raise ValueError(f"{path} has no rows of forms")
        for case, row in run["rows"].items():
            for form, build in STAGE_BUILDS:
                v = row.get("forms", {}).get(form.format(key=key))
                if v is None:
                    raise ValueError(f"{path}: {case} has no {form.format(key=key)!r} time")
                rows.append({"run": label, "commit": run["commit"], "case": case, "build": build,
                             "us": v["us"], "share": v["share"]})
    return pd.DataFrame(rows)


def stage_figure(df: pd.DataFrame, title: str | None = None):
    """Grouped bars of stage_table's shares of the copy bandwidth, one panel per run."""
    import plotly.express as px

    return px.bar(df, x="case", y="share", color="build", facet_col="run", barmode="group", text_auto=".0%",
                  title=title or "A third stage (H200, graph replay): the stream gains, the decode does not",
                  labels={"share": "share of copy bandwidth"})


# ----------------------------------------------------------------------------------------------
# waves: the same 64 x 8K decode with 3 pieces per request (192 blocks on 132 SMs: a full wave and a
# 45% one) and with 2 (128 blocks, one wave), each form timed in one run of scripts/device_mla_wgmma.py

WAVE_RUNS = ("extra/forms_b2e4c25.json", "extra/forms_083abc8.json")
H200_SMS = 132


def wave_table(device: str = "nvidia-h200", paths=None, case: str = "b64_8k", batch: int = 64,
               sms: int = H200_SMS) -> pd.DataFrame:
    """One row per (run, form) of `case` (`batch` requests): pieces per request, blocks, waves (blocks /
    sms), graph-replay time and share of the copy bandwidth, from the committed form runs."""
    base = bench.PROFILES / device / NAME
    rows = []
    for path in paths or [base / p for p in WAVE_RUNS]:
        run = json.loads(Path(path).read_text())
        row = run.get("rows", {}).get(case)
        if not isinstance(row, dict) or "forms" not in row:
            raise ValueError(f"{path} has no {case!r} row of forms")
        for form, v in row["forms"].items():
            blocks = batch * v["splits"]
            rows.append({"commit": run["commit"], "form": form, "pieces": v["splits"], "blocks": blocks,
                         "waves": blocks / sms, "us": v["us"], "share": v["share"]})
    return pd.DataFrame(rows)


def wave_figure(df: pd.DataFrame, title: str | None = None):
    """Bars of wave_table: each form's time with the grid spilling into a second wave and without."""
    import plotly.express as px

    df = df.assign(grid=[f"{p} pieces: {b} blocks ({w:.2f} waves)" for p, b, w in zip(df["pieces"], df["blocks"], df["waves"])])
    return px.bar(df, x="form", y="us", color="grid", barmode="group", text_auto=".0f",
                  title=title or "64 requests x 8K on the H200: a second, partial wave costs a whole piece",
                  labels={"us": "us per decode (graph replay)"})


# ----------------------------------------------------------------------------------------------
# a public Hopper kernel in the same run: FlashMLA's dense decode (variant 'flashmla'), and its two
# kernels beside ours (committed H200 run of scripts/device_mla_kernel_times.py, FORMS=wgmma,flashmla)

PEER_KERNELS = "extra/flashmla_kernels_ae5fec0.json"


def peer_table(records, peer: str = "flashmla", mode: str = "graph") -> pd.DataFrame:
    """Per case that has the peer: the after, the peer, the floor, both shares of the copy bandwidth
    and peer / after (above 1: the after is faster), from one run's records."""
    df = summary(records)
    col = f"{peer}_us"
    if df.empty or col not in df or df[col].isna().all():
        raise ValueError(f"no {peer!r} records among these {len(records)} records")
    df = df[(df["mode"] == mode) & df[col].notna()].copy()
    df["after_share"] = df["bw_fraction"]
    df[f"{peer}_share"] = df["floor_us"] / df[col]
    df[f"{peer}_over_after"] = df[col] / df["after_us"]
    keep = ["case", "batch", "context", "q_len", "after_us", col, "floor_us", "after_share", f"{peer}_share",
            f"{peer}_over_after"]
    return df[keep].sort_values(["q_len", "batch", "context"]).reset_index(drop=True)


def peer_figure(df: pd.DataFrame, peer: str = "flashmla", title: str | None = None):
    """Grouped bars of peer_table: the after, the peer and the floor per case (log scale)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for col, name in (("after_us", "after (k3lab)"), (f"{peer}_us", peer), ("floor_us", "floor (bytes / copy bw)")):
        fig.add_trace(go.Bar(x=df["case"], y=df[col], name=name, text=[f"{v:.1f}" for v in df[col]]))
    fig.update_layout(template="plotly_white", barmode="group", yaxis_type="log",
                      yaxis_title="us per decode step (graph replay)",
                      title=title or f"H200: k3lab's after against {peer} in the same run")
    return fig


def peer_kernels(device: str = "nvidia-h200", path=None) -> pd.DataFrame:
    """Per case and form of the committed kernel-times run: the time per call of a graph replay and
    each kernel's mean device duration (split kernel, merge kernel)."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / PEER_KERNELS
    rows = json.loads(Path(path).read_text()).get("rows")
    if not isinstance(rows, dict) or not rows:
        raise ValueError(f"{path} is not a run of scripts/device_mla_kernel_times.py")
    out = []
    for key, v in rows.items():
        case, form = key.split(".", 1)
        kernels = list(v["kernels"].items())
        if len(kernels) != 2:
            raise ValueError(f"{path}: {key} has {len(kernels)} kernels, expected a split and a merge kernel")
        (split_name, split), (merge_name, merge) = kernels
        out.append({"case": case, "form": form, "per_call_us": v["per_call_us"], "split_kernel": split_name,
                    "split_us": split["mean_us"], "merge_kernel": merge_name, "merge_us": merge["mean_us"]})
    return pd.DataFrame(out)


# ----------------------------------------------------------------------------------------------
# what bounds the three missed targets: the data path of each policy alone, timed beside the after,
# the before and the einsum peer (committed H200 run of scripts/device_mla_bounds.py)

BOUNDS = "extra/bounds_c72bac9.json"
# target, the kernel it judges, (case, what that kernel's time must be at most, from the run's times),
# (case, the reader whose time bounds that kernel), what the reader is
BOUND_ROWS = (
    ("after share of copy bandwidth, 32K >= 70%", "after",
     ("ctx32k", lambda v, floor: floor / TARGETS["bw_32k"]),
     ("ctx32k", "ring split 128 +tail"), "the after's data path: the tile ring and an empty second kernel"),
    ("einsum / after, 32K >= 5x (graph replay)", "after",
     ("ctx32k", lambda v, floor: v["einsum (PyTorch)"] / TARGETS["vs_einsum_32k"]),
     ("ctx32k", "ring split 128 +tail"), "the after's data path: the tile ring and an empty second kernel"),
    ("before / after, 1K within 15%", "before",
     ("ctx1k", lambda v, floor: (1 + TARGETS["ratio_1k_band"]) * v["after (default)"]),
     ("ctx1k", "each: ring, 1 block, 1 copy/tile"), "the before policy's data path: one block reading the whole history"),
)
_KERNEL_KEY = {"after": "after (default)", "before": "before (default)"}


def target_bounds(device: str = "nvidia-h200", path=None) -> pd.DataFrame:
    """One row per missed target: the kernel it judges and its time, the time that kernel would need
    (`needed_us`), the time of the data path alone that bounds it (`bound_us`: a reader that moves the
    same bytes the same way and computes nothing), and `reachable` = bound_us <= needed_us, with the
    margin left for everything else. All times from one graph-replay run of
    scripts/device_mla_bounds.py."""
    path = Path(path) if path is not None else bench.PROFILES / device / NAME / BOUNDS
    run = json.loads(Path(path).read_text())
    rows = run.get("rows")
    if not isinstance(rows, dict) or any("variants" not in r or "floor_us" not in r for r in rows.values()):
        raise ValueError(f"{path} is not a run of scripts/device_mla_bounds.py")
    out = []
    for target, kernel, (case, need), (bcase, reader), what in BOUND_ROWS:
        if case not in rows or bcase not in rows:
            raise ValueError(f"{path} has no {case!r} row")
        us = {k: v["us"] for k, v in rows[case]["variants"].items()}
        missing = {_KERNEL_KEY[kernel], "after (default)", "einsum (PyTorch)"} - set(us)
        if missing or reader not in rows[bcase]["variants"]:
            raise ValueError(f"{path}: {case} lacks {sorted(missing) or [reader]}")
        needed = need(us, rows[case]["floor_us"])
        bound = rows[bcase]["variants"][reader]["us"]
        out.append({"target": target, "kernel": kernel, "kernel_us": us[_KERNEL_KEY[kernel]], "needed_us": needed,
                    "bound": what, "bound_us": bound, "margin_us": needed - bound, "reachable": bound <= needed,
                    "commit": run["commit"]})
    return pd.DataFrame(out)


def bounds_figure(df: pd.DataFrame, title: str | None = None):
    """Horizontal bars per target of target_bounds: the kernel now, the time the target needs, and the
    data path alone."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for col, name in (("kernel_us", "the kernel now"), ("needed_us", "what the target needs"),
                      ("bound_us", "its data path alone (no arithmetic)")):
        fig.add_trace(go.Bar(y=df["target"], x=df[col], name=name, orientation="h",
                             text=[f"{v:.2f}" for v in df[col]], textposition="outside"))
    fig.update_layout(template="plotly_white", barmode="group", xaxis_type="log", xaxis_title="us (graph replay)",
                      title=title or "H200: the missed targets against the data path that bounds them",
                      legend={"orientation": "h", "y": -0.2}, height=420)
    return fig


# ----------------------------------------------------------------------------------------------
# the cost of a verification group by its length (the after at 32K, B = 1, graph replay): what the
# draft-depth study's measured cost profile reads (k3lab.spec.costs_from_records)


def verify_table(records, context: int = 32768, mode: str = "graph") -> pd.DataFrame:
    """Per verification length q_len (1 = a plain decode): the after's time at `context` (B = 1, the
    case as the library runs it, no '.' variants), its ratio to one token, the Triton kernel's time
    where a '<case>.triton' record exists, and the commit of each record."""
    after, triton = {}, {}
    for r in records:
        if (r.study != NAME or r.mode != mode or r.variant != "after" or r.shape.get("context") != context
                or r.shape.get("batch") != 1 or r.shape.get("ragged")):
            continue
        q = int(r.shape.get("q_len", 1))
        if "." not in r.case:
            after[q] = r
        elif r.case.endswith(".triton"):
            triton[q] = r
    if 1 not in after:
        raise ValueError(f"no one-token after record at context {context} ({mode}) among {len(records)} records")
    one = after[1].median_us
    rows = [{"q_len": q, "after_us": r.median_us, "per_token_ratio": r.median_us / one, "commit": r.commit,
             "triton_us": triton[q].median_us if q in triton else math.nan,
             "triton_commit": triton[q].commit if q in triton else None}
            for q, r in sorted(after.items())]
    return pd.DataFrame(rows)


def verify_figure(df: pd.DataFrame, title: str | None = None):
    """Bars of verify_table: the after's time per group length, the Triton kernel's where recorded."""
    import plotly.graph_objects as go

    fig = go.Figure()
    fig.add_trace(go.Bar(x=df["q_len"], y=df["after_us"], name="after (CUDA, two tokens per block)",
                         text=[f"{v:.1f}" for v in df["after_us"]]))
    t = df[df["triton_us"].notna()]
    fig.add_trace(go.Bar(x=t["q_len"], y=t["triton_us"], name="Triton kernel", text=[f"{v:.1f}" for v in t["triton_us"]]))
    fig.update_layout(template="plotly_white", barmode="group", xaxis_title="positions verified (q_len)",
                      yaxis_title="us per MLA layer (graph replay)",
                      title=title or "H200, 1 x 32K: an odd group costs what the next even one does")
    return fig
