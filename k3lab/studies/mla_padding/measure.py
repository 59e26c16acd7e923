"""Checks and timings of the mla_padding study (the package docstring says what it measures): the
cases, each variant checked against the fp32 reference, then timed into records.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch

from k3lab import bench
from k3lab import env as _env
from k3lab.config import K3Config
from k3lab.ops import mla_decode as mla
from k3lab.ops.mla_decode import peers
from k3lab.ops.mla_decode import triton as mla_triton
from k3lab.studies import peers as study_peers
from k3lab.studies.peers import on_gpu
from .tables import NAME

PAGE_SIZE = 64
DEFAULT_PRESET = "tp8"  # the seed's case: 12 heads per GPU (the preset picks the head count only)

# Seed section 4: mean time per output token, ms (8x MI355X, TP8, concurrency 1, whole model).
SEED_MS_PER_TOKEN = {"1K": (22.9, 22.8), "32K": (43.8, 23.6)}
# docs/k3.md, one H200, plain PyTorch, B = 1, 12 heads unless noted: (einsum+softmax us, SDPA us)
ANCHORS_H200_US = {1024: (71.0, 106.0), 32768: (71.0, 548.0), 131072: (140.0, 1999.0)}


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    context: int
    q_len: int = 1
    ragged: bool = False  # per-request lengths drawn in [context / 8, context], the first = context
    splits: int | None = None  # force the split count (the sweep)
    kind: str = "main"  # 'main' or 'sweep'
    # the after's backend ('cuda' / 'triton'; None = plan_after's choice): sweep points
    backend: str | None = None


def _main_cases() -> list[Case]:
    if on_gpu():
        return [Case("ctx1k", 1, 1024), Case("ctx32k", 1, 32768), Case("ctx128k", 1, 131072),
                Case("b1_8k", 1, 8192), Case("b8_8k", 8, 8192), Case("b64_8k", 64, 8192),
                Case("ragged8_8k", 8, 8192, ragged=True), Case("verify2_32k", 1, 32768, q_len=2),
                Case("verify4_32k", 1, 32768, q_len=4)]
    return [Case("ctx96", 1, 96), Case("ctx320", 1, 320), Case("b3_ctx96", 3, 96),
            Case("ragged3_ctx96", 3, 96, ragged=True), Case("verify4_ctx64", 1, 64, q_len=4)]


def _sweep_cases() -> list[Case]:
    if on_gpu():
        grid = {"ctx1k": (1024, (1, 4, 8, 16, 32, 64)),
                "ctx32k": (32768, (1, 16, 32, 64, 128, 132, 192, 256, 264, 396)),
                "ctx128k": (131072, (32, 64, 128, 132, 256, 264, 396))}
    else:
        grid = {"ctx320": (320, (1, 2, 5))}
    return ([Case(f"{base}.s{s}", 1, n, splits=s, kind="sweep") for base, (n, ss) in grid.items() for s in ss]
            + _kernel_cases())


def _kernel_cases() -> list[Case]:
    """The after on a named backend beside the default: '<case>.triton' (the Triton kernel, where the
    default is the CUDA one), verification groups on both, and every other group length at 32K."""
    if not on_gpu():
        return []
    base = {c.name: c for c in _main_cases()}
    out = [
        Case(
            f"{n}.triton",
            base[n].batch,
            base[n].context,
            ragged=base[n].ragged,
            kind="sweep",
            backend="triton",
        )
        for n in ("ctx1k", "ctx32k", "ctx128k", "b1_8k", "b8_8k", "b64_8k", "ragged8_8k")
    ]
    out += [Case(f"verify{tq}_32k.triton", 1, 32768, q_len=tq, kind="sweep", backend="triton") for tq
            in (2, 3, 4)]
    out += [Case("verify3_32k.cuda", 1, 32768, q_len=3, kind="sweep", backend="cuda")]
    out += [Case(f"verify{tq}_b8_8k.{b}", 8, 8192, q_len=tq, kind="sweep", backend=b)
            for tq in (2, 3, 4) for b in ("triton", "cuda")]
    # every other verification group at 32K, the after only: with the main cases' 1, 2 and 4 positions
    # the draft-depth study's record-based cost profile (k3lab.speculative.costs_from_records) then
    # reaches depth 7
    out += [Case(f"verify{tq}_32k", 1, 32768, q_len=tq, kind="sweep") for tq in (3, 5, 6, 7, 8)]
    return out


def cases(preset=None) -> list[Case]:
    _heads(preset)  # validates the preset
    return _main_cases() + _sweep_cases()


def case_names(preset=None) -> list[str]:
    """Main cases, then the split-count sweep and the named-backend points."""
    return [c.name for c in cases(preset)]


def _heads(preset) -> int:
    cfg = K3Config.preset(preset or DEFAULT_PRESET)
    return cfg.num_attention_heads


def _dtype(dtype=None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return torch.bfloat16 if on_gpu() else torch.float32


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
    out = {"before": (case.name, "before"), "after": (case.name, "after"), "einsum": (case.name, "torch"),
           "sdpa": (f"{case.name}.sdpa", "torch"), "padcopy": (f"{case.name}.padcopy", "after"),
           "contig": (f"{case.name}.contig", "after")}
    if heads > mla.MMA_ROWS:
        out.pop("padcopy")
    if study_peers.aiter_status()[0] and heads <= mla.MMA_ROWS:
        out["aiter"] = (case.name, "aiter")
    if dtype in (torch.bfloat16, torch.float16) and flashmla_status()[0]:
        out["flashmla"] = (case.name, "flashmla")
    return out


def flashmla_status() -> tuple[bool, str]:
    """Whether FlashMLA's decode joins the cases as a peer at this study's page size, and why not."""
    return study_peers.flashmla_status(PAGE_SIZE)


def _plan(key: str, case: Case, s: dict, heads: int):
    """The callable for variant `key` on input set s (kernel plans are built once per set)."""
    if key in s["plans"]:
        return s["plans"][key]
    q, pool, table, lens, cache = s["q"], s["pool"], s["table"], s["lengths"], s["cache"]
    ragged = case.ragged or case.q_len > 1
    fold = heads > mla.MMA_ROWS
    if key == "before":
        fn = mla.plan_before(q, pool, lens, block_table=table)
    elif key == "after":
        fn = mla.plan_after(q, pool, lens, block_table=table, num_splits=case.splits, fold_heads=fold,
                            backend=case.backend)
    elif key == "padcopy":
        fn = mla.plan_after(q, pool, lens, block_table=table, pad="copy")
    elif key == "contig":
        fn = mla.plan_after(q, cache, lens, fold_heads=fold)
    elif key == "einsum":
        fn = (
            (lambda: peers.einsum_decode(q, cache, lens))
            if ragged
            else (lambda: peers.einsum_decode(q, cache))
        )
    elif key == "sdpa":
        fn = (lambda: peers.sdpa_decode(q, cache, lens)) if ragged else (lambda: peers.sdpa_decode(q, cache))
    elif key == "flashmla":
        fn = study_peers.flashmla_plan(q, pool, lens, block_table=table)
    elif key == "aiter":  # not yet run on AMD hardware by this project
        fn = lambda: peers.aiter_decode(q, pool, lens, block_table=table)  # noqa: E731
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


def run(preset=None, cases=None, *, modes=None, dtype=None, repeats: int | None = None,
        log: Callable[[str], None] | None = None) -> list[bench.Record]:
    """Check every variant of each case against the fp32 reference (raising bench.CheckFailed on a
    mismatch), then time it; returns the records (not saved).

    cases: names from case_names(); None = all of them. modes: GPU timing modes, default
    ('eager', 'graph') for main cases and ('graph',) for sweep cases."""
    heads = _heads(preset)
    dt = _dtype(dtype)
    table = {c.name: c for c in _main_cases() + _sweep_cases()}
    if cases is None:
        chosen = list(table.values())
    else:
        unknown = [n for n in cases if n not in table]
        if unknown:
            raise ValueError(f"unknown cases {unknown}; cases here: {list(table)}")
        chosen = [table[n] for n in cases]
    gpu = on_gpu()
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
    ref_o, ref_l = mla.reference(first["q"].float(), first["cache"].float(), first["lengths"])
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
                         copy_bw_fraction=achieved / info.peak.bandwidth_tbs,
                         compute_units=info.compute_units,
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
    case = Case("ctx32k", 1, 32768) if on_gpu() else Case("ctx320", 1, 320)
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
        fig.add_trace(
            go.Bar(
                name=policy,
                x=[f"{c // 1024}K" if c >= 1024 else str(c) for c in sub["context"]],
                y=sub["programs"],
                marker_color=color,
                text=[f"{p} programs, {s} split(s)" for p, s in zip(sub["programs"], sub["splits"])],
            )
        )
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
        for label, h in (("12 heads" if heads == 12 else f"{heads} heads", heads),
                         (f"padded to {padded}", padded)):
            q_bytes = batch * h * mla.LATENT_DIM * elem
            flops = mla.decode_flops(batch * n, h)
            rows.append({"context": n, "query": label, "cache_bytes": cache, "query_bytes": q_bytes,
                         "output_bytes": batch * h * mla.VALUE_DIM * elem, "matrix_flops": flops,
                         "flops_per_cache_byte": flops / cache})
    return pd.DataFrame(rows)


def instruction_mix(dtype: str = "bf16", arch: int = 90):
    """Compile the Triton kernels (before; after's split kernel and its merge) for an NVIDIA sm_90
    (H100/H200) here, with no GPU needed (Triton's own compiler and its bundled ptxas), and report
    which instructions carry the products: wgmma / mma.sync (matrix units) or fma only, with
    registers, spills, shared memory, and the grid-dependency instructions (griddepcontrol) of the
    early-launched merge.

    Where Triton runs as the interpreter (CPU), the compile runs in a child process with
    TRITON_INTERPRET=0, since interpreted kernels cannot be compiled. Returns a DataFrame; a 'note'
    column instead when this Triton cannot compile for NVIDIA (no NVIDIA backend)."""
    import os
    import subprocess
    import sys


    if _env.triton_interpreted():
        code = (f"import json; from k3lab.studies.mla_padding import measure as st; "
                f"print('ROWS=' + json.dumps(st._instruction_rows({dtype!r}, {arch})))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                             env=dict(os.environ, TRITON_INTERPRET="0"))
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("ROWS=")]
        if res.returncode != 0 or not line:
            return pd.DataFrame([{"kernel": "both", "note": f"compile for sm_{arch} failed: "
                                                            f"{res.stderr[-400:]}"}])
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
    ptr = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "bt_ptr": "*i32", "len_ptr": "*i32",
           "o_ptr": f"*{dtype}",
           "lse_ptr": "*fp32", "op_ptr": "*fp32", "lsep_ptr": "*fp32", "scale_log2": "fp32"}
    mt = mla_triton
    bcfg = mt.launch_config("before")
    acfg = mt.launch_config("after", rows=mla.MMA_ROWS)  # the static default (no device needed)
    kernels = {
        "before": (
            mt._before_kernel,
            dict(PAGED=True, PAGE_SIZE=PAGE_SIZE, DV=512, DR=64, BLOCK_N=bcfg.block_n, INTERPRET=False),
            bcfg,
        ),
        "after": (
            mt._split_kernel,
            dict(
                PAGED=True,
                PAGE_SIZE=PAGE_SIZE,
                PAGE_GROUPS=16,
                DV=512,
                DR=64,
                HEAD_TILE=16,
                TOK_TILE=1,
                BLOCK_N=acfg.block_n,
                WRITE_FINAL=False,
                IEEE=False,
                PDL=True,
                INTERPRET=False,
            ),
            acfg,
        ),
        "merge": (
            mt._merge_kernel,
            dict(DV=512, BLOCK_DV=mt.MERGE_DV, SPLITS_P2=256, PDL=True),
            mla.LaunchConfig(mt.MERGE_DV, 4, 1),
        ),
    }
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
               "griddepcontrol": ptx.count("griddepcontrol."),
               "fma_f32": len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
               "shared_kb": k.metadata.shared / 1024, "block_n": cfg.block_n, "num_warps": cfg.num_warps,
               "registers": None, "spill_bytes": None}
        if ptxas:
            with tempfile.TemporaryDirectory() as d:
                src = os.path.join(d, "k.ptx")
                with open(src, "w") as f:
                    f.write(ptx)
                res = subprocess.run(
                    [ptxas[0], "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(d, "k.cubin")],
                    capture_output=True,
                    text=True,
                )
            m_reg = re.search(r"Used (\d+) registers", res.stderr)
            m_sp = re.search(r"(\d+) bytes spill stores", res.stderr)
            row["registers"] = int(m_reg.group(1)) if m_reg else None
            row["spill_bytes"] = int(m_sp.group(1)) if m_sp else None
        rows.append(row)
    return rows
