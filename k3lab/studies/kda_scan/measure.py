"""Checks and timings of the kda_scan study (the package docstring says what it measures): the
cases, each variant checked against the fp64 reference, then timed into records.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from k3lab import bench
from k3lab import env as _env
from k3lab.nn.kda import kda_chunked
from k3lab.ops import kda_chunk as kc
from k3lab.ops.kda_chunk.scan_math import sequential_depth
from k3lab.studies.peers import FLA_CHUNK, fla_status, on_gpu
from .tables import (PROLOGUE_PROBE, PROLOGUE_PROBE_STAGES, WALK_BENCH, crossover_table, prologue_stages,
                     reference_records, summary_text, sweep_table, walk_launches)

NAME = "kda_scan"
HEAD_DIM = kc.HEAD_DIM

GPU_CASES = [
    "h12_b1_t4096",
    "h12_b1_t16384",
    "h12_b1_t65536",
    "h12_b8_t4096",
    "h12_b8_t16384",
    "h96_b1_t4096",
    "h96_b1_t16384",
]
CPU_CASES = ["h2_b1_t200", "h1_ragged"]
RAGGED_LENGTHS = {"gpu": [8192, 4096, 3000, 1000, 130, 64, 1], "cpu": [70, 0, 130, 5]}
CROSSOVER_HEADS = (12, 96)
CROSSOVER_BATCH = (1, 8)
CROSSOVER_T = (4096, 16384, 65536)
MAX_TOKEN_HEADS = 96 * 8 * 16384  # bigger crossover points do not fit one H200 with fla beside


@dataclass
class Case:
    name: str
    heads: int
    lengths: list[int]  # one entry per sequence
    ragged: bool = False  # packed with cu_seqlens (B = 1) rather than [B, T]
    group_size: int | None = None  # None: the rule in choose_group_size
    dtype: torch.dtype = torch.bfloat16
    extra: dict = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    def shape(self) -> dict:
        T = self.lengths[0] if not self.ragged else self.tokens
        d = {
            "heads": self.heads,
            "batch": self.batch,
            "T": T,
            "K": HEAD_DIM,
            "V": HEAD_DIM,
            "chunk": kc.CHUNK,
        }
        if self.ragged:
            d["lengths"] = list(self.lengths)
        return d


def parse_case(name: str) -> Case:
    """'h12_b1_t16384' -> Case(heads 12, one sequence of 16384); 'h2_ragged' -> packed sequences."""
    gpu = on_gpu()
    m = re.fullmatch(r"h(\d+)_b(\d+)_t(\d+)", name)
    dtype = torch.bfloat16 if gpu else torch.float32  # bf16 dots are wrong in the interpreter
    if m:
        H, B, T = (int(x) for x in m.groups())
        if H < 1 or B < 1 or T < 1:
            raise ValueError(f"case {name!r}: heads, batch and T must be >= 1")
        return Case(name, H, [T] * B, dtype=dtype, group_size=None if gpu else 1)
    m = re.fullmatch(r"h(\d+)_ragged", name)
    if m:
        return Case(
            name,
            int(m.group(1)),
            list(RAGGED_LENGTHS["gpu" if gpu else "cpu"]),
            ragged=True,
            dtype=dtype,
            group_size=None if gpu else 1,
        )
    raise ValueError(f"case must look like 'h12_b1_t16384' or 'h12_ragged', got {name!r}")


def case_names(preset=None) -> list[str]:
    """The cases this machine runs: the TP8 / full-head grid on a GPU, two tiny ones on CPU."""
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"preset must be a preset name or None, got {type(preset).__name__}")
    return list(GPU_CASES if on_gpu() else CPU_CASES)


def check_cases(cases=None, preset=None) -> list[str]:
    """The names run() takes, in order (`case_names(preset)` when `cases` is None): a name from
    case_names() or crossover_cases(), any h{H}_b{B}_t{T} or h{H}_ragged, each optionally with
    PARTS_SUFFIX or SWEEP_SUFFIX. ValueError naming the first bad one, before anything runs (the CLI's
    --cases check calls this, so every name run() documents is accepted there too)."""
    names = case_names(preset) if cases is None else list(cases)
    for name in names:
        if not isinstance(name, str):
            raise ValueError(f"cases must be case names (str), got {name!r}")
        parse_case(name.removesuffix(PARTS_SUFFIX).removesuffix(SWEEP_SUFFIX))
    return names


def crossover_cases() -> list[str]:
    """heads {12, 96} x batch {1, 8} x T {4K, 16K, 64K}, without the points too big for one GPU."""
    out = []
    for H in CROSSOVER_HEADS:
        for B in CROSSOVER_BATCH:
            for T in CROSSOVER_T:
                if H * B * T <= MAX_TOKEN_HEADS:
                    out.append(f"h{H}_b{B}_t{T}")
    return out


# ----------------------------------------------------------------------------------------------
# inputs, references, variants


def make_inputs(case: Case, seed: int = 0, device=None):
    """Fresh random inputs: L2-normalised q, k; a per-channel spread of decay rates (slow channels
    with g ~ -1e-4 up to fast ones near K3's bound -5), so the state carries information across
    many chunks; beta in (0, 1); a random initial state. Returns a dict of kernel arguments."""
    device = device or _env.detect().device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    H, K = case.heads, HEAD_DIM
    B, T = (1, case.tokens) if case.ragged else (case.batch, case.lengths[0])

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    q = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(case.dtype)
    k = torch.nn.functional.normalize(rnd(B, T, H, K), dim=-1).to(case.dtype)
    v = rnd(B, T, H, K).to(case.dtype)
    bias = (torch.linspace(-9.0, 0.0, K)[torch.randperm(K, generator=gen)]).to(device)
    g = -5.0 * torch.sigmoid(rnd(B, T, H, K) + bias)
    beta = torch.sigmoid(rnd(B, T, H))
    S0 = rnd(case.batch, H, K, K) * 0.1
    cu = None
    if case.ragged:
        cu = torch.tensor([0] + list(_cumsum(case.lengths)), dtype=torch.int32, device=device)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": S0, "cu_seqlens": cu}


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def reference(case: Case, inp: dict, max_heads: int | None = None, max_seqs: int | None = None):
    """kda_chunked in fp64 on the first `max_heads` heads of the first `max_seqs` sequences (all when
    None). Returns (o_ref per sequence: list of [1, T_n, h, V], S_ref [n, h, K, V], heads, seqs)."""
    h = case.heads if max_heads is None else min(max_heads, case.heads)
    n = case.batch if max_seqs is None else min(max_seqs, case.batch)
    outs, states = [], []
    for s, (tok, L) in enumerate(_seq_slices(case)[:n]):
        S0 = inp["initial_state"][s : s + 1, :h].double()
        if L == 0:
            outs.append(None)
            states.append(S0)
            continue
        args = [_seq(inp[x], case, s, tok, L)[:, :, :h].double() for x in ("q", "k", "v", "g")]
        bt = _seq(inp["beta"], case, s, tok, L)[:, :, :h].double()
        o, S = kda_chunked(*args, bt, initial_state=S0)
        outs.append(o)
        states.append(S)
    return outs, torch.cat(states), h, n


def _seq_slices(case: Case):
    out, b = [], 0
    for L in case.lengths:
        out.append((b, L))
        b += L
    return out


def _seq(t: torch.Tensor, case: Case, s: int, tok: int, L: int) -> torch.Tensor:
    return t[:, tok : tok + L] if case.ragged else t[s : s + 1]


def check_variant(case: Case, inp: dict, o: torch.Tensor, S: torch.Tensor, ref) -> dict:
    """check_all on the referenced heads/sequences: outputs and final state, in the case's dtype."""
    outs, S_ref, h, n = ref
    got_o = [
        (_seq(o, case, s, tok, L)[:, :, :h], r)
        for s, ((tok, L), r) in enumerate(zip(_seq_slices(case)[:n], outs))
        if r is not None
    ]
    pairs = {
        "o": (torch.cat([g.reshape(-1) for g, _ in got_o]), torch.cat([r.reshape(-1) for _, r in got_o])),
        "state": (S[:n, :h], S_ref),
    }
    return bench.check_all(pairs, case.dtype)



def _run_and_check(case, inp, fn, ref, strict: bool) -> dict:
    """Run one variant once and check it; with strict=False a failed check is kept in the record
    (a sweep goes on) instead of raised."""
    o, S = fn()
    try:
        return check_variant(case, inp, o, S, ref)
    except bench.CheckFailed as exc:
        if strict:
            raise
        return {"failed": str(exc)}

class Runner:
    """Plans and work buffers for one case, built once so that timed calls hold only the launches."""

    def __init__(self, case: Case, inp: dict, backend: str | None = None):
        """backend: a name of `kda_chunk.BACKENDS` for both k3lab variants, None for the dispatcher's."""
        self.case, self.inp, self.backend = case, inp, backend
        dev = inp["q"].device
        self.group_size = (
            case.group_size if case.group_size is not None else kc.choose_group_size(case.lengths, case.heads)
        )
        self.plan_before = kc.make_plan(case.lengths, case.heads, None, device=dev)
        self.plan_after = kc.make_plan(case.lengths, case.heads, self.group_size, device=dev)
        self.work = kc.alloc_work(self.plan_before.n_chunks, case.heads, case.dtype, dev)

    def _args(self):
        i = self.inp
        return i["q"], i["k"], i["v"], i["g"], i["beta"]

    def before(self):
        i = self.inp
        return kc.kda_chunk_before(
            *self._args(),
            initial_state=i["initial_state"],
            cu_seqlens=i["cu_seqlens"],
            plan=self.plan_before,
            work=self.work,
            backend=self.backend,
            check_values=False,  # the study's own finite inputs: timed without the value check's sync
        )

    def after(self, plan=None):
        i = self.inp
        return kc.kda_chunk_after(
            *self._args(),
            initial_state=i["initial_state"],
            cu_seqlens=i["cu_seqlens"],
            plan=plan or self.plan_after,
            work=self.work,
            backend=self.backend,
            check_values=False,  # the study's own finite inputs: timed without the value check's sync
        )

    def fla(self):
        from fla.ops.kda import chunk_kda

        i = self.inp
        with torch.inference_mode():
            o, S = chunk_kda(
                *self._args(),
                initial_state=i["initial_state"],
                output_final_state=True,
                cu_seqlens=None if i["cu_seqlens"] is None else i["cu_seqlens"].long(),
            )
        return o, S

    def backend_name(self, variant: str) -> str | None:
        """The backend a k3lab variant runs on (None for fla)."""
        if variant == "fla":
            return None
        plan = self.plan_after if variant == "after" else self.plan_before
        return kc.BACKENDS.choose(self.backend, *self._args(), plan)[0]

    def variants(self) -> dict[str, Callable]:
        out = {"before": self.before, "after": self.after}
        if fla_status(FLA_CHUNK)[0]:
            out["fla"] = self.fla
        return out


# ----------------------------------------------------------------------------------------------
# floors


def chunk_flops(case: Case) -> float:
    """Matrix flops of the chunked algorithm, per chunk and head: Akk, Aqk, W (2 C^2 K each), U
    (2 C^2 V), then W S, Qg S, Kd^T E (2 C K V each) and Aqk E (2 C^2 V). The inverse and the scan's
    extra passes are not counted: the floor is for the problem, not for one way of solving it."""
    C, K, V = kc.CHUNK, HEAD_DIM, HEAD_DIM
    chunks = sum(-(-L // C) for L in case.lengths)
    per = 2 * C * C * (3 * K + 2 * V) + 6 * C * K * V
    return float(chunks * case.heads * per)


def io_bytes(case: Case) -> float:
    """Bytes that must cross memory once: q, k, v read and o written in the input dtype, g fp32,
    beta fp32, the initial state read and the final state written (fp32)."""
    e = torch.tensor([], dtype=case.dtype).element_size()
    tok_heads = case.tokens * case.heads
    per_token = HEAD_DIM * (3 * e + 4 + e) + 4
    states = 2 * case.batch * case.heads * HEAD_DIM * HEAD_DIM * 4
    return float(tok_heads * per_token + states)


def floor_for(case: Case) -> float:
    return bench.floor_us(bytes=io_bytes(case), flops=chunk_flops(case))


# ----------------------------------------------------------------------------------------------
# the study contract


def _ref_limits(case: Case):
    # on a GPU the fp64 reference runs on 2 heads of 2 sequences (heads are independent; the length,
    # where the state's error builds up, is checked in full); on CPU everything is referenced
    return (2, 2) if on_gpu() else (None, None)


def _timing_kw(case: Case) -> dict:
    if not on_gpu():
        return {"warmup": 0, "repeats": 2}
    big = case.tokens * case.heads >= 12 * 65536
    return {"warmup": 3 if big else 5, "repeats": 20 if big else 50}


def run(
    preset=None,
    cases=None,
    variants=None,
    graph: bool = False,
    strict: bool = True,
    backend: str | None = None,
    repeats: int | None = None,
) -> list[bench.Record]:
    """Check every variant against the fp64 reference (raising on failure), then time it. Returns
    records (not saved). `cases`: names from case_names() or crossover_cases() or any h{H}_b{B}_t{T}
    ('<case>.parts': `prologue_parts` of that case; '<case>.sweep': `group_size_sweep` of that case);
    `variants`: a subset of before / after / fla;
    `backend`: a name of `kda_chunk.BACKENDS` for both k3lab variants (None: the dispatcher's choice,
    what the committed records ran). strict=False records a failed check in the record's error
    (error['failed']) and still times it (for exploring, never for committed references). `repeats`:
    timed samples per variant (None: 50, or 20 for the big cases, on a GPU; 2 in the interpreter)."""
    if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
        raise ValueError(f"repeats must be a positive integer or None, got {repeats!r}")
    kc.BACKENDS.forced(backend)  # a name the table does not know is refused here, before any input
    names = check_cases(cases, preset)  # every name parsed before the first case runs
    records = []
    for name in names:
        if name.endswith(PARTS_SUFFIX):
            records += prologue_parts(name[: -len(PARTS_SUFFIX)])
            continue
        if name.endswith(SWEEP_SUFFIX):
            records += group_size_sweep(name[: -len(SWEEP_SUFFIX)], strict=strict, backend=backend)
            continue
        case = parse_case(name)
        inp = make_inputs(case)
        runner = Runner(case, inp, backend)
        ref = reference(case, inp, *_ref_limits(case))
        floor = floor_for(case)
        for variant, fn in runner.variants().items():
            if variants is not None and variant not in variants:
                continue
            err = _run_and_check(case, inp, fn, ref, strict)
            kw = {**_timing_kw(case), **({"repeats": repeats} if repeats else {})}
            timing = bench.time_fn(fn, graph=graph, **kw)
            gs = runner.group_size if variant == "after" else None
            plan = runner.plan_after if variant == "after" else runner.plan_before
            records.append(
                bench.make_record(
                    NAME,
                    name,
                    variant,
                    timing,
                    shape=case.shape(),
                    dtype=case.dtype,
                    floor_us=floor,
                    error=err,
                    group_size=gs,
                    launches=_launches(variant, plan),
                    walk_programs=_programs(case, variant, plan),
                    sequential_steps=_depth(case, variant, plan),
                    ref_heads=ref[2],
                    ref_seqs=ref[3],
                    interpreter=_env.triton_interpreted(),
                    backend=runner.backend_name(variant),
                )
            )
        del runner, inp, ref
        if on_gpu():
            torch.cuda.empty_cache()
    return records


def _launches(variant: str, plan) -> int | None:
    if variant == "fla":
        return None
    return 4 if (variant == "after" and plan.uses_scan) else 2


def _programs(case: Case, variant: str, plan) -> int | None:
    if variant == "fla":
        return None
    return plan.n_groups * case.heads * (HEAD_DIM // 64)


def _depth(case: Case, variant: str, plan) -> int | None:
    """Chunk steps on the critical path of the longest sequence."""
    if variant == "fla":
        return None
    n = max(-(-L // kc.CHUNK) for L in case.lengths)
    return sequential_depth(n, plan.group_size if variant == "after" and plan.uses_scan else None)


def group_size_sweep(name: str, sizes=None, strict: bool = True, backend: str
                     | None = None) -> list[bench.Record]:
    """The 'after' at several group sizes on one case (checked, then timed): the curve behind
    choose_group_size. Records are named '<case>.gs<size>' ('<case>.walk' for the plain walk)."""
    case = parse_case(name)
    inp = make_inputs(case)
    runner = Runner(case, inp, backend)
    ref = reference(case, inp, *_ref_limits(case))
    n = max(-(-L // kc.CHUNK) for L in case.lengths)
    sizes = sizes or [s for s in (4, 8, 12, 16, 24, 32, 64) if s < n]
    floor = floor_for(case)
    records = []
    for gs in list(sizes) + [None]:
        plan = kc.make_plan(case.lengths, case.heads, gs, device=inp["q"].device)

        def fn(p=plan):
            return runner.after(plan=p)

        err = _run_and_check(case, inp, fn, ref, strict)
        kw = _timing_kw(case)
        kw["repeats"] = min(kw["repeats"], 20)
        timing = bench.time_fn(fn, **kw)
        label = f"{name}.gs{gs}" if gs else f"{name}.walk"
        records.append(
            bench.make_record(
                NAME,
                label,
                "after",
                timing,
                shape=case.shape(),
                dtype=case.dtype,
                floor_us=floor,
                error=err,
                group_size=gs,
                launches=_launches("after", plan),
                sequential_steps=_depth(case, "after", plan),
                chosen_group_size=runner.group_size,
            )
        )
    return records


PARTS_SUFFIX = ".parts"  # run(cases=["h12_b1_t16384.parts"]): the prologue launches of each backend
SWEEP_SUFFIX = ".sweep"  # run(cases=["h12_b1_t16384.sweep"]): the after at several group sizes


def prologue_parts(name: str = "h12_b1_t16384", check_case: str | None = None) -> list[bench.Record]:
    """Each backend's chunk prologue timed on its own on case `name` (same inputs, same plan): the whole
    prologue ('<case>.part_prologue_cuda', '.part_prologue_rows_exactfixup') and the Triton prologue's
    launches one by one ('.part_rows_exactfixup_{a,inverse,wu}'). Each backend is first checked end to end
    (the before on `check_case` against fp64, outputs and final state; default h2_b1_t4096 on a GPU, a
    70-token case in Triton's interpreter); a backend that cannot run here is left out."""
    from k3lab.ops.kda_chunk import cuda as kda_cuda
    from k3lab.ops.kda_chunk import prologue as kda_prologue

    check_case = check_case or ("h2_b1_t4096" if on_gpu() else "h1_b1_t70")
    check = parse_case(check_case)
    check_inp = make_inputs(check, seed=1)
    check_ref = reference(check, check_inp, *_ref_limits(check))
    case = parse_case(name)
    inp = make_inputs(case)
    runner = Runner(case, inp)
    args, plan, scale = runner._args(), runner.plan_before, HEAD_DIM**-0.5
    kw = {"warmup": 3, "repeats": 20} if on_gpu() else {"warmup": 0, "repeats": 1}
    forms = {
        "cuda": ("cuda", lambda: {"prologue": lambda: kda_cuda.prologue(*args, plan, scale, runner.work)}),
        "triton": ("rows_exactfixup", lambda: kda_prologue.launches(*args, plan, scale, runner.work)),
    }
    records = []
    for backend, (label, make) in forms.items():
        try:
            kc.BACKENDS.choose(backend, *args, plan)
        except ValueError as exc:  # not on this machine or not for these inputs: said, then left out
            print(f"prologue_parts: {exc}")
            continue
        err = _run_and_check(check, check_inp, Runner(check, check_inp, backend).before, check_ref,
                             strict=False)
        launches = make()
        for f in launches.values():  # compile, and valid inputs for each launch timed alone
            f()

        def whole(fs=tuple(launches.values())):
            for f in fs:
                f()

        parts = {f"prologue_{label}": (whole, err)}
        if len(launches) > 1:
            parts.update({f"{label}_{part}": (f, None) for part, f in launches.items()})
        for part, (fn, e) in parts.items():
            extra = {"backend": backend, "prologue": label.split("_")[0]}
            if e is not None:
                extra["check_case"] = check_case
            records.append(bench.make_record(NAME, f"{name}.part_{part}", "before", bench.time_fn(fn, **kw),
                                             shape=case.shape(), dtype=case.dtype, error=e, **extra))
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """variant -> one call on the study's headline case (h12_b1_t16384 on a GPU, the first CPU case)."""
    name = "h12_b1_t16384" if on_gpu() else CPU_CASES[0]
    case = parse_case(name)
    runner = Runner(case, make_inputs(case))
    return {v: (lambda f=f: f()) for v, f in runner.variants().items()}


def predict(case_name: str, target: str | None = None, compute_units: int | None = None) -> dict:
    """Before measuring: floors, programs and critical-path chunk steps of both variants.

    target: None for this machine, or a key of k3lab.env.PEAKS ('H200', 'MI355X', ...) to predict
    that GPU from anywhere (bf16 inputs, its bandwidth, matrix rate and compute units)."""
    case = parse_case(case_name)
    peak = None
    if target is not None:
        if target not in _env.PEAKS:
            raise ValueError(f"target must be None or one of {sorted(_env.PEAKS)}, got {target!r}")
        peak = _env.PEAKS[target]
        case.dtype = torch.bfloat16
    units = compute_units or (peak.compute_units if peak is not None else None) or _env.detect().compute_units
    gs = kc.choose_group_size(case.lengths, case.heads, compute_units=units)
    n = max(-(-L // kc.CHUNK) for L in case.lengths)
    chunks = [-(-L // kc.CHUNK) for L in case.lengths]
    n_groups = sum(max(1, -(-c // gs)) if gs else 1 for c in chunks)
    floor = bench.floor_us(bytes=io_bytes(case), flops=chunk_flops(case), peak=peak)
    return {
        "case": case_name,
        "target": target or _env.detect().name,
        "floor_us": floor,
        "io_MB": io_bytes(case) / 1e6,
        "GFLOP": chunk_flops(case) / 1e9,
        "walk_programs": kc.walk_programs(case.batch, case.heads),
        "group_size": gs,
        "replay_programs": n_groups * case.heads * 2,
        "steps_before": n,
        "steps_after": sequential_depth(n, gs),
        "compute_units": units,
    }


__all__ = [
    "NAME",
    "PROLOGUE_PROBE",
    "PROLOGUE_PROBE_STAGES",
    "WALK_BENCH",
    "Runner",
    "case_names",
    "crossover_cases",
    "crossover_table",
    "floor_for",
    "group_size_sweep",
    "make_inputs",
    "parse_case",
    "predict",
    "profile_targets",
    "prologue_parts",
    "prologue_stages",
    "reference_records",
    "run",
    "summary_text",
    "sweep_table",
    "walk_launches",
]

