"""Study: chunked KDA prefill, the plain chunk walk ("before") against the group scan ("after").

Seed, section 5: KDA's state after a chunk depends on the state before it. With one sequence and
12 heads (TP8) the plain walk runs 24 programs of 256 chunk steps each on a 16K-token prompt while
the rest of the GPU idles. The group scan first summarises each group of chunks as one affine map
of its incoming state, scans the summaries in order, then replays every group in parallel: 4
launches instead of 2, and more arithmetic, in exchange for a much shorter dependency chain. With
many sequences or heads the walk already fills the GPU and the scan's extra passes cost more than
they save; `k3lab.ops.kda_chunk.choose_group_size` then falls back to the walk.

Variants: 'before' = `kda_chunk_before`, 'after' = `kda_chunk_after`, 'fla' = fla-core's
`chunk_kda` (raw log-decay g, no in-kernel gate, norm or sigmoid: the same function), when
fla-core and a GPU are present. Every variant is checked against `k3lab.nn.kda.kda_chunked` in
fp64 (on GPU: on the first heads and sequences of the batch, over the whole length) before it is
timed, outputs and final state both.

Cases are named h{heads}_b{batch}_t{tokens}, or h{heads}_ragged (cu_seqlens). On a GPU: the TP8
slice (12 heads) at B = 1, T = 4K / 16K / 64K and B = 8, T = 4K / 16K, and all 96 heads at B = 1,
T = 4K / 16K. On CPU (Triton's interpreter, fp32, tiny T) the same kernels run at a size a laptop
finishes in seconds, with the group size forced small so the scan path runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3lab import bench
from k3lab import env as _env
from k3lab.nn.kda import kda_chunked
from k3lab.ops import kda_chunk as kc

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


def _gpu() -> bool:
    return _env.detect().backend != "cpu"


def parse_case(name: str) -> Case:
    """'h12_b1_t16384' -> Case(heads 12, one sequence of 16384); 'h2_ragged' -> packed sequences."""
    gpu = _gpu()
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
    return list(GPU_CASES if _gpu() else CPU_CASES)


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

def fla_available() -> bool:
    if not _gpu():
        return False
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken optional install means 'no peer', said in the records
        return False
    return True


class Runner:
    """Plans and work buffers for one case, built once so that timed calls hold only the launches."""

    def __init__(self, case: Case, inp: dict, tune: dict | None = None, tune_after: dict | None = None):
        """tune: launch options for both k3lab variants (block_v, num_warps, num_stages, prologue,
        prologue_warps; kda_chunk's defaults otherwise); tune_after overrides them for the after."""
        self.case, self.inp = case, inp
        self.tune = dict(tune or {})
        self.tune_after = {**self.tune, **(tune_after or {})}
        block_v = self.tune_after.get("block_v", 64)
        dev = inp["q"].device
        self.group_size = (
            case.group_size
            if case.group_size is not None
            else kc.choose_group_size(case.lengths, case.heads, block_v=block_v)
        )
        self.plan_before = kc.make_plan(case.lengths, case.heads, None, device=dev)
        self.plan_after = kc.make_plan(case.lengths, case.heads, self.group_size, device=dev)
        if not self.plan_after.uses_scan:
            # no groups: the after is the plain walk, so it takes the walk's options, not the ones
            # tuned for the replay (run 6 timed 12 heads x 4K with the replay's 64-column tiles: 219 us
            # against the before's 196 on 32 columns, the same launches otherwise)
            self.tune_after = {**self.tune_after, **{k: v for k, v in self.tune.items() if k in _REPLAY_KEYS}}
            for key in _REPLAY_KEYS:
                if key not in self.tune:
                    self.tune_after.pop(key, None)
        self.work = kc._alloc_work(self.plan_before.n_chunks, case.heads, case.dtype, dev)

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
            **self.tune,
        )

    def after(self, plan=None):
        i = self.inp
        return kc.kda_chunk_after(
            *self._args(),
            initial_state=i["initial_state"],
            cu_seqlens=i["cu_seqlens"],
            plan=plan or self.plan_after,
            work=self.work,
            **self.tune_after,
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

    def variants(self) -> dict[str, Callable]:
        out = {"before": self.before, "after": self.after}
        if fla_available():
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
    return (2, 2) if _gpu() else (None, None)


def _timing_kw(case: Case) -> dict:
    if not _gpu():
        return {"warmup": 0, "repeats": 2}
    big = case.tokens * case.heads >= 12 * 65536
    return {"warmup": 3 if big else 5, "repeats": 20 if big else 50}


def run(
    preset=None,
    cases=None,
    variants=None,
    graph: bool = False,
    strict: bool = True,
    tune: dict | None = None,
    tune_after: dict | None = None,
) -> list[bench.Record]:
    """Check every variant against the fp64 reference (raising on failure), then time it. Returns
    records (not saved). `cases`: names from case_names() or crossover_cases() or any
    h{H}_b{B}_t{T}; `variants`: a subset of before / after / fla. strict=False records a failed
    check in the record's error (error['failed']) and still times it (for exploring, never for
    committed references)."""
    names = case_names(preset) if cases is None else list(cases)
    records = []
    for name in names:
        case = parse_case(name)
        inp = make_inputs(case)
        runner = Runner(case, inp, tune, tune_after)
        ref = reference(case, inp, *_ref_limits(case))
        floor = floor_for(case)
        for variant, fn in runner.variants().items():
            if variants is not None and variant not in variants:
                continue
            err = _run_and_check(case, inp, fn, ref, strict)
            timing = bench.time_fn(fn, graph=graph, **_timing_kw(case))
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
                    tune=_tune_record(runner, variant),
                )
            )
        del runner, inp, ref
        if _gpu():
            torch.cuda.empty_cache()
    return records


def _tune_record(runner: Runner, variant: str) -> dict:
    if variant == "fla":
        return {}
    t = dict(runner.tune_after if variant == "after" else runner.tune)
    t.setdefault("prologue", kc.choose_prologue(*runner._args()))
    plan = runner.plan_after if variant == "after" else runner.plan_before
    t.setdefault("walk", kc.choose_walk(runner._args()[0], plan=plan))
    return t


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
    from k3lab.ops.kda_chunk.scan_math import sequential_depth

    n = max(-(-L // kc.CHUNK) for L in case.lengths)
    return sequential_depth(n, plan.group_size if variant == "after" and plan.uses_scan else None)


def group_size_sweep(
    name: str, sizes=None, strict: bool = True, tune: dict | None = None
) -> list[bench.Record]:
    """The 'after' at several group sizes on one case (checked, then timed): the curve behind
    choose_group_size. Records are named '<case>.gs<size>' ('<case>.walk' for the plain walk)."""
    case = parse_case(name)
    inp = make_inputs(case)
    runner = Runner(case, inp, tune)
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


# prologue candidates the calibration checks and times on this device: (kind, options) over
# kda_chunk.PROLOGUE_DEFAULTS. Run 3 (H200, 12 heads x 16K) timed rows 544 us (A launch 387),
# fused 712 (block_k 16: 963, with a 168-register cap 793; tf32x3 Akk: 1237) and split 778 (A launch
# 632). The capped 'rows' points are queued for the next run: for sm_90a the A phase at block_k 32
# needs 255 registers (2 programs per SM); a 168-register cap gives 3, with spills (472 bytes of
# stack at block_k 32, 128 at block_k 16), and the cap bought 18% in the fused kernel at block_k 16.
PROLOGUE_CANDIDATES = (
    ("rows", {}),
    ("rows", {"maxnreg": 168}),
    ("rows", {"block_k": 16, "maxnreg": 168}),
    ("fused", {}),
    ("split", {}),
)
# Issue 6 (run 5): the first call timed rows 540 us (A 386, inverse 68, W/U 73), rows with the inverse's
# products in tf32x3 529 (inverse 49: no spills on 1 warp; now rows' default), the inverse and W / U in
# one launch 630, 'flat' 650 (A 497), 'flat' two programs per item 639, batched 3-D 'flat' 1048. The
# second call's candidates: with the exact path for wide decays in a fix-up launch the A kernel is
# 6.3K instructions per thread without spills (8.5K and 80 bytes of stack with it compiled in).
PROLOGUE_CANDIDATES_I6 = (
    ("cuda", {}),
    ("rows", {}),
    ("rows", {"exact": "fixup"}),
    ("rows", {"exact": "fixup", "maxnreg": 168}),
)
# the after's walk-side launch options (kda_chunk_after keywords): calibrate times each one's summaries,
# scan and replay and takes, launch by launch, the fastest one's options. Shared memory and registers
# decide how many programs share an SM (sm_90a, offline): the replay at 64 columns on 2 stages needs
# 147 KB, 1 per SM (its 264 programs at 12 heads x 16K then run in 2 waves); on 1 stage 74 KB and 246
# registers, 2 per SM (one wave); 32 columns on 1 stage 158 registers, 3 per SM. Summaries at 64
# columns: 250 registers, 2 per SM (480 programs, 2 waves); 32 columns on 1 stage: 140 registers and
# 41 KB, 3 per SM.
# The two one-stage candidates (sb32s1_bv64s1, sb64s1_bv32s1) hit an illegal memory access on the H200
# in the second call (run5_call2_log.txt) and are refused on NVIDIA GPUs (kda_chunk._check_walk_stages).
AFTER_CANDIDATES = (
    {"summary_block": 64, "summary_stages": 2, "num_stages": 2, "block_v": 64},
    {"summary_block": 32, "summary_stages": 2, "num_stages": 2, "block_v": 32},
)
_SUMMARY_KEYS = ("summary_block", "summary_warps", "summary_stages")
_REPLAY_KEYS = ("block_v", "num_warps", "num_stages")
_SCAN_KEYS = ("scan_block", "scan_warps", "scan_stages")


def _after_label(opts: dict) -> str:
    """'sb64s2_bv64s2': summaries' columns and stages, replay's columns and stages (+ any other keys)."""
    short = {"summary_block": "sb", "summary_stages": "s", "block_v": "_bv", "num_stages": "s"}
    head = "".join(f"{short[k]}{opts[k]}" for k in short if k in opts)
    rest = {k: v for k, v in opts.items() if k not in short}
    return head + ("_" + _label(rest) if rest else "")


def _label(opts: dict) -> str:
    return "_".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in sorted(opts.items()))


def _prologue_checker(check_case: str):
    """A function (kind, options) -> error figures of the before with that prologue on `check_case`
    against fp64 (outputs and final state, the case's dtype): each calibrated prologue is checked
    end to end before its times can be chosen."""
    case = parse_case(check_case)
    inp = make_inputs(case, seed=1)
    ref = reference(case, inp, *_ref_limits(case))
    runner = Runner(case, inp)

    def check(kind, opts):
        runner.tune = {"prologue": kind, "prologue_options": opts}
        return _run_and_check(case, inp, runner.before, ref, strict=False)

    return check


def calibrate(
    name: str = "h12_b1_t16384",
    walks=(),
    candidates=PROLOGUE_CANDIDATES,
    check_case="h2_b1_t4096",
    summaries=(),
    after_options=(),
):
    """Time each launch on its own to pick launch options on this device: every prologue candidate
    (kind, options) whole and, when it has several launches, launch by launch, after checking it
    end to end on `check_case` against fp64 (a candidate that fails is timed, recorded with the
    failure, and never chosen); then, if `walks` lists any, (block_v, num_warps) for the plain walk
    and for the after's summaries + replay (else `kda_chunk.choose_block_v` decides), and for each
    (summary_block, summary_warps) in `summaries` the after's summaries launch; for each dict of
    kda_chunk_after options in `after_options`, the summaries, scan and replay launches (the fastest
    summaries, scan and replay each give their own options). The fastest of each goes into the tune.
    Returns (records named '<case>.part_*', {'tune', 'tune_after', 'times_us'})."""
    checker = _prologue_checker(check_case)
    case = parse_case(name)
    inp = make_inputs(case)
    runner = Runner(case, inp)
    q, k, v, g, beta = runner._args()
    S0, scale = inp["initial_state"], HEAD_DIM**-0.5
    kw = {"warmup": 3, "repeats": 20} if _gpu() else {"warmup": 0, "repeats": 1}
    records, times = [], {}

    def rec(part, variant, timing, **extra):
        times[part] = timing.median_us
        records.append(
            bench.make_record(
                NAME, f"{name}.part_{part}", variant, timing, shape=case.shape(), dtype=case.dtype, **extra
            )
        )

    plan = runner.plan_before
    whole_t = {}
    for kind, opts in candidates:
        label = f"{kind}_{_label(opts)}" if opts else kind
        try:
            fns = kc.prologue_launches(q, k, v, g, beta, plan, scale, runner.work, options=opts, prologue=kind)
            for f in fns.values():  # compile, and valid inputs for each launch timed alone (each reruns in place)
                f()
            if len(fns) > 1:
                for part, f in fns.items():
                    rec(f"{label}_{part}", "before", bench.time_fn(f, **kw), prologue=kind, options=opts)

            def whole(fs=tuple(fns.values())):
                for f in fs:
                    f()

            err = checker(kind, opts)
            rec(f"prologue_{label}", "before", bench.time_fn(whole, **kw), prologue=kind, options=opts,
                check_case=check_case, error=err)  # fmt: skip
            if "failed" not in err:
                whole_t[(kind, label)] = (times[f"prologue_{label}"], opts)
            else:
                print(f"calibrate prologue {label}: check FAILED {err['failed'][:200]}")
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses is skipped
            print(f"calibrate prologue {label}: {type(exc).__name__}: {str(exc)[:300]}")
    best_kind, best = kc.choose_prologue(q, k, v, g, beta), {}
    if whole_t:
        (best_kind, _), (_, best) = min(whole_t.items(), key=lambda kv: kv[1][0])
    kc.kda_chunk_prologue(q, k, v, g, beta, plan, scale, runner.work, prologue=best_kind, options=best)
    walk_t, after_t = {}, {}

    def after_parts(plan, bv, nw):
        return kc.after_launches(q, k, v, g, beta, scale, S0, inp["cu_seqlens"], plan=plan, work=runner.work,
                                 block_v=bv, num_warps=nw, prologue=best_kind, prologue_options=best)  # fmt: skip

    for bv, nw in walks:
        tag = f"bv{bv}_w{nw}"
        try:
            parts = after_parts(runner.plan_before, bv, nw)
            rec(f"walk_{tag}", "before", bench.time_fn(parts["walk"], **kw), block_v=bv, num_warps=nw)
            walk_t[(bv, nw)] = times[f"walk_{tag}"]
            if runner.plan_after.uses_scan:
                parts = after_parts(runner.plan_after, bv, nw)
                total = 0.0
                for part in ("summaries", "scan", "replay"):
                    rec(
                        f"{part}_{tag}",
                        "after",
                        bench.time_fn(parts[part], **kw),
                        block_v=bv,
                        num_warps=nw,
                        group_size=runner.group_size,
                    )
                    total += times[f"{part}_{tag}"]
                after_t[(bv, nw)] = total
        except Exception as exc:  # noqa: BLE001
            print(f"calibrate walk {tag}: {type(exc).__name__}: {str(exc)[:300]}")
    sum_t = {}
    if runner.plan_after.uses_scan:
        for sb, sw in summaries:
            tag = f"sb{sb}_w{sw}"
            try:
                parts = kc.after_launches(
                    q, k, v, g, beta, scale, S0, inp["cu_seqlens"], plan=runner.plan_after, work=runner.work,
                    summary_block=sb, summary_warps=sw, prologue=best_kind, prologue_options=best,
                )  # fmt: skip
                parts["prologue"]()
                rec(f"summaries_{tag}", "after", bench.time_fn(parts["summaries"], **kw), summary_block=sb,
                    summary_warps=sw, group_size=runner.group_size)  # fmt: skip
                sum_t[(sb, sw)] = times[f"summaries_{tag}"]
            except Exception as exc:  # noqa: BLE001
                print(f"calibrate summaries {tag}: {type(exc).__name__}: {str(exc)[:300]}")
    part_t = {}  # (part, option index) -> us
    if runner.plan_after.uses_scan:
        for i, ao in enumerate(after_options):
            tag = _after_label(ao)
            try:
                parts = kc.after_launches(
                    q, k, v, g, beta, scale, S0, inp["cu_seqlens"], plan=runner.plan_after, work=runner.work,
                    prologue=best_kind, prologue_options=best, **ao,
                )  # fmt: skip
                for part in ("prologue", "summaries", "scan", "replay"):
                    parts[part]()
                for part in ("summaries", "scan", "replay"):
                    t = bench.time_fn(parts[part], **kw)
                    rec(f"{part}_{tag}", "after", t, group_size=runner.group_size, options=ao)
                    part_t[(part, i)] = t.median_us
            except Exception as exc:  # noqa: BLE001
                print(f"calibrate after options {tag}: {type(exc).__name__}: {str(exc)[:300]}")
    tune = {"prologue": best_kind, "prologue_options": best}
    tune_after = {}
    for part, keys in (("summaries", _SUMMARY_KEYS), ("scan", _SCAN_KEYS), ("replay", _REPLAY_KEYS)):
        got = {i: t for (p, i), t in part_t.items() if p == part}
        if got:
            ib = min(got, key=got.get)
            tune_after.update({key: val for key, val in after_options[ib].items() if key in keys})
    if sum_t:
        bs_ = min(sum_t, key=sum_t.get)
        tune_after.update(summary_block=bs_[0], summary_warps=bs_[1])
    if walk_t:  # else kda_chunk's choose_block_v picks the walk's tiles
        bw = min(walk_t, key=walk_t.get)
        tune.update(block_v=bw[0], num_warps=bw[1])
    if after_t:
        ba = min(after_t, key=after_t.get)
        tune_after.update(block_v=ba[0], num_warps=ba[1])
    return records, {"tune": tune, "tune_after": tune_after, "times_us": times}


def tune_sweep(name: str, options: list[dict], strict: bool = False) -> list[bench.Record]:
    """before and after under several launch options (block_v, num_warps, num_stages, prologue_warps)
    on one case; records are named '<case>.tune<i>' with the options in extra['tune']."""
    records = []
    for i, opts in enumerate(options):
        try:
            recs = run(cases=[name], variants=("before", "after"), strict=strict, tune=opts)
        except Exception as exc:  # noqa: BLE001 - an option the compiler refuses (shared memory): go on
            print(f"tune {opts}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        for r in recs:
            r.case = f"{name}.tune{i}"
        records += recs
    return records


def profile_targets(preset=None) -> dict[str, Callable[[], None]]:
    """variant -> one call on the study's headline case (h12_b1_t16384 on a GPU, the first CPU case)."""
    name = "h12_b1_t16384" if _gpu() else CPU_CASES[0]
    case = parse_case(name)
    runner = Runner(case, make_inputs(case))
    return {v: (lambda f=f: f()) for v, f in runner.variants().items()}


# ----------------------------------------------------------------------------------------------
# tables for the notebook


def crossover_table(records):
    """Per case (heads, batch, T): before / after / fla medians, the group size the rule chose, and
    after/before and after/fla (< 1: the scan wins). Takes Records or their dicts."""
    import pandas as pd

    rows = {}
    for r in records:
        r = r if isinstance(r, dict) else r.to_dict()
        if "." in r["case"]:
            continue  # group-size sweep points
        key = r["case"]
        row = rows.setdefault(
            key,
            {
                "case": key,
                "heads": r["shape"].get("heads"),
                "batch": r["shape"].get("batch"),
                "T": r["shape"].get("T"),
            },
        )
        row[f"{r['variant']}_us"] = r["median_us"]
        if r["variant"] == "after":
            row["group_size"] = r.get("extra", {}).get("group_size")
            row["floor_us"] = r.get("floor_us")
    df = pd.DataFrame(list(rows.values()))
    if df.empty:
        return df
    if {"after_us", "before_us"} <= set(df.columns):
        df["after/before"] = df["after_us"] / df["before_us"]
    if {"after_us", "fla_us"} <= set(df.columns):
        df["after/fla"] = df["after_us"] / df["fla_us"]
    return df.sort_values(["heads", "batch", "T"]).reset_index(drop=True)


def sweep_table(records):
    """Group-size sweep records -> DataFrame (case, group_size, median_us, sequential_steps)."""
    import pandas as pd

    rows = []
    for r in records:
        r = r if isinstance(r, dict) else r.to_dict()
        base, _, tag = r["case"].partition(".")
        if not (tag.startswith("gs") or tag == "walk"):
            continue
        rows.append(
            {
                "case": base,
                "group_size": r["extra"].get("group_size"),
                "median_us": r["median_us"],
                "sequential_steps": r["extra"].get("sequential_steps"),
                "chosen": r["extra"].get("chosen_group_size"),
            }
        )
    return pd.DataFrame(rows)


def reference_records(device: str = "nvidia-h200", root="profiles"):
    """The committed GPU records of this study (for a CPU reader)."""
    return bench.load_records(NAME, device=device, root=root)


PROLOGUE_PROBE = "extra/prologue_probe_80064e7.csv.gz"  # one launch of the CUDA prologue, 12 heads x 16K


def prologue_stages(path=None, device: str = "nvidia-h200", root=None):
    """Where the CUDA prologue's time goes, from a committed timeline probe (kernels/kda_prologue.cu,
    Args.probe; written by scripts/device_prologue_probe.py): one row per stage with the median and
    p90 over the launch's blocks (us per block) and its share of a block's median lifetime."""
    import pandas as pd

    from k3lab.ops.kda_chunk import cuda as kda_prologue_cuda

    if path is None:
        path = Path(bench.PROFILES if root is None else root) / device / NAME / PROLOGUE_PROBE
    frame = pd.read_csv(path)
    stages = [c for c in kda_prologue_cuda.PROBE_STAGES if c in frame.columns]
    if not stages or "total_us" not in frame.columns:
        raise ValueError(f"{path} is not a prologue probe (expected the columns {kda_prologue_cuda.PROBE_STAGES})")
    total = float(frame["total_us"].median())
    return pd.DataFrame(
        {
            "stage": stages,
            "median_us": [float(frame[c].median()) for c in stages],
            "p90_us": [float(frame[c].quantile(0.9)) for c in stages],
            "share_of_block": [float(frame[c].median()) / total for c in stages],
        }
    )


WALK_BENCH = "extra/walk_bench_8464a89.json"  # scripts/device_walk_bench.py at 12 heads x 16K, run 7's call


def walk_launches(path=None, device: str = "nvidia-h200", root=None):
    """The after's walking launches by kind, from a committed walk bench (each launch timed alone on the
    same prologue outputs, eager device events): one row per launch ('summaries', 'scan', 'replay',
    and 'after' for the whole call) with its 'triton' and 'cuda' times (us) and triton / cuda."""
    import json

    import pandas as pd

    if path is None:
        path = Path(bench.PROFILES if root is None else root) / device / NAME / WALK_BENCH
    rows = json.loads(Path(path).read_text()).get("rows_us", {})
    keys = {"summaries": "{}.scan.summaries", "scan": "{}.scan.scan", "replay": "{}.scan.replay", "after": "{}.after"}
    missing = [k.format(kind) for k in keys.values() for kind in ("triton", "cuda") if k.format(kind) not in rows]
    if missing:
        raise ValueError(f"{path} is not a walk bench (missing {missing[:4]})")
    frame = pd.DataFrame({"launch": list(keys),
                          "triton": [rows[k.format("triton")] for k in keys.values()],
                          "cuda": [rows[k.format("cuda")] for k in keys.values()]})
    frame["speedup"] = frame["triton"] / frame["cuda"]
    return frame


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
    from k3lab.ops.kda_chunk.scan_math import sequential_depth

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


def main(argv=None) -> int:
    """Run the whole study on this machine and write every record to <out>/records.json (one file,
    so a remote run returns it whole): calibration, the crossover grid (fla beside k3lab while the
    time budget leaves room for fla's compile and autotuning, about 85 s per head count on the H200),
    the group-size sweep and the ragged case."""
    import argparse
    import json
    import os
    import time
    import traceback

    ap = argparse.ArgumentParser(prog="python -m k3lab.studies.kda_scan")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--phases", default="calibrate,cases,sweep")
    ap.add_argument("--sweep-cases", default="h12_b1_t16384")
    ap.add_argument("--calibrate-case", default="h12_b1_t16384")
    ap.add_argument("--cases", default=None, help="comma list replacing the grid + ragged case")
    ap.add_argument("--prologues", default="", help="comma list of prologue kinds to calibrate (default: all "
                    "of PROLOGUE_CANDIDATES)")
    ap.add_argument("--walks", default="", help="walk tiles to calibrate, e.g. '32x4,64x4' (block_v x warps)")
    ap.add_argument("--summaries", default="", help="summary tiles to calibrate, e.g. '64x4,128x8'")
    ap.add_argument("--issue6", action="store_true", help="calibrate PROLOGUE_CANDIDATES_I6 and AFTER_CANDIDATES "
                    "(issue 6's candidates) instead of PROLOGUE_CANDIDATES")
    ap.add_argument("--fla-first-s", type=float, default=100.0,
                    help="time fla only while this much budget is left for a head count it has not compiled")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    records: list[bench.Record] = []
    print("kda_scan:", _env.describe(), flush=True)

    def left() -> float:
        return args.budget_s - (time.time() - t0)

    def save():
        with open(os.path.join(args.out, "records.json"), "w") as f:
            json.dump([r.to_dict() for r in records], f, indent=1)

    def step(label, fn, need_s=20.0):
        if left() < need_s:
            print(f"[skip {label}: {left():.0f} s left]", flush=True)
            return
        t = time.time()
        try:
            recs = fn()
            records.extend(recs)
            for r in recs:
                e = r.error
                if "failed" in e:
                    el = "FAILED " + e["failed"][:120]
                elif "o" in e:
                    el = f"o {e['o']['rel_l2']:.1e} S {e['state']['rel_l2']:.1e}"
                else:
                    el = ""
                print(
                    f"  {r.case:28s} {r.variant:7s} {r.median_us:10.1f} us  gs={r.extra.get('group_size')}  "
                    f"{el}",
                    flush=True,
                )
        except Exception:  # noqa: BLE001 - one failing case must not lose the others' records
            print(f"[{label} failed]\n" + traceback.format_exc()[-1500:], flush=True)
        print(f"[{label}: {time.time() - t:.1f} s, {left():.0f} s left]", flush=True)
        save()

    phases = args.phases.split(",")
    tune, tune_after = {}, {}
    if "calibrate" in phases:

        def cal():
            nonlocal tune, tune_after
            kinds = [x for x in args.prologues.split(",") if x]
            pool = PROLOGUE_CANDIDATES_I6 if args.issue6 else PROLOGUE_CANDIDATES
            cands = [c for c in pool if not kinds or c[0] in kinds]
            walks = [tuple(int(y) for y in x.split("x")) for x in args.walks.split(",") if x]
            sums = [tuple(int(y) for y in x.split("x")) for x in args.summaries.split(",") if x]
            recs, choice = calibrate(args.calibrate_case, walks=walks, candidates=cands, summaries=sums,
                                     after_options=AFTER_CANDIDATES if args.issue6 else ())  # fmt: skip
            tune, tune_after = choice["tune"], choice["tune_after"]
            print("calibrated:", json.dumps({k: choice[k] for k in ("tune", "tune_after")}), flush=True)
            print(
                "part times (us):",
                json.dumps({k: round(v, 1) for k, v in choice["times_us"].items()}),
                flush=True,
            )
            return recs

        step("calibrate", cal, need_s=60.0)
        if not tune:
            print(f"[calibrate gave no choice: the cases use kda_chunk's defaults ({kc.DEFAULT_PROLOGUE})]", flush=True)
    grid = crossover_cases()
    grid = sorted(grid, key=lambda n: (parse_case(n).heads, parse_case(n).batch, n != "h12_b1_t16384"))
    names = args.cases.split(",") if args.cases else grid + ["h12_ragged"]
    fla_heads: set = set()
    swept = False
    for name in names:
        if "sweep" in phases and not swept and parse_case(name).heads != 12:
            swept = True
            for sw in args.sweep_cases.split(","):
                step(sw + " sweep", lambda n=sw: group_size_sweep(n, strict=False, tune={**tune, **tune_after}))
        if "cases" not in phases:
            continue
        case = parse_case(name)
        key = (case.heads, case.ragged)
        with_fla = fla_available() and (key in fla_heads or left() > args.fla_first_s)
        if with_fla:
            fla_heads.add(key)
        else:
            print(f"[{name}: fla left out, {left():.0f} s left]", flush=True)
        variants = None if with_fla else ("before", "after")
        step(
            name,
            lambda n=name, vs=variants: run(cases=[n], variants=vs, strict=False, tune=tune, tune_after=tune_after),
            need_s=15.0,
        )
    if "sweep" in phases and not swept:
        for sw in args.sweep_cases.split(","):
            step(sw + " sweep", lambda n=sw: group_size_sweep(n, strict=False, tune={**tune, **tune_after}))
    save()
    print(f"kda_scan done: {len(records)} records, {time.time() - t0:.0f} s", flush=True)
    print(summary_text(records), flush=True)
    return 0


def summary_text(records) -> str:
    """A short table for the end of a log: the prologue parts, then before / after / fla per case."""
    lines = ["prologue parts (us): " + ", ".join(
        f"{r.case.split('.part_')[1]} {r.median_us:.0f}" + (" FAILED" if "failed" in (r.error or {}) else "")
        for r in records if ".part_" in r.case)]  # fmt: skip
    lines.append(f"{'case':16s} {'before':>8s} {'after':>8s} {'fla':>8s} {'floor':>6s}  gs  o/S rel_l2 (after)")
    for row in crossover_table(records).to_dict("records"):
        err = next((r.error for r in records if r.case == row["case"] and r.variant == "after"), {}) or {}
        e = f"{err['o']['rel_l2']:.1e}/{err['state']['rel_l2']:.1e}" if "o" in err else err.get("failed", "")[:40]
        lines.append(
            f"{row['case']:16s} {row.get('before_us', float('nan')):8.0f} {row.get('after_us', float('nan')):8.0f} "
            f"{row.get('fla_us', float('nan')):8.0f} {row.get('floor_us', float('nan')):6.0f}  "
            f"{row.get('group_size')}  {e}"
        )
    return "\n".join(lines)


__all__ = [
    "NAME",
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
    "reference_records",
    "run",
    "sweep_table",
]


if __name__ == "__main__":
    raise SystemExit(main())
