"""The ladder of notebook 05 (KDA group scan): affine maps of the state composed before the state is
known, then walked once per group (`k3lab.ops.kda_chunk.scan`'s ordered scan, simplified).

    compose_maps     "apply (A1, B1), then (A2, B2)" is (A2 A1, A2 B1 + B2): two tl.dots per pair
    linear_scan      h_t = a_t h_(t-1) + b_t along a row with tl.associative_scan and a combine function
    group_summaries  each group's chunk maps composed in order into one (M, b), a program per group
    group_starts     the scan over the summaries: the state where every group starts, from S0

The maps are KDA's real chunk maps (`scan_math.chunk_affine` of random KDA inputs, 16-token chunks,
K = 16), graded in fp64 against `k3lab.ops.kda_chunk.scan_math` (compose, group_summaries, apply) and a
plain loop. fp32 cases of the products are held to the tf32 bound: on NVIDIA GPUs `tl.dot` of fp32
inputs rounds them to tf32 by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab.ops.kda_chunk import scan_math
from k3lab.workshop._core import Case

from ._grade import Puzzle

NB = "05_kda_scan"
CHUNK = 16


def _tol(dt: torch.dtype, chain: int = 1):
    """The case's bound: one product of fp32 inputs is held to tf32 (what `tl.dot` rounds them to on NVIDIA
    GPUs). A chain of more than two products compounds that rounding (five tf32 products measured 2.9e-3
    rel_l2 on an H100), so it is held to the next coarser bound, bf16's, which a wrong index or a missing
    term (O(1) errors) still fails."""
    if chain > 2:
        return "bf16"
    return "tf32" if dt == torch.float32 else dt


def _chunk_maps(gen, n: int, K: int, V: int):
    """n consecutive chunk maps of one KDA head, fp64: A [n, K, K], Bc [n, K, V]."""
    T = n * CHUNK
    q = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(1, T, 1, V, generator=gen, dtype=torch.float64)
    g = -5.0 * torch.sigmoid(torch.randn(1, T, 1, K, generator=gen, dtype=torch.float64) - 6.0)  # mild decay
    beta = torch.sigmoid(torch.randn(1, T, 1, generator=gen, dtype=torch.float64))
    A, Bc = scan_math.chunk_affine(scan_math.chunk_quantities(q, k, v, g, beta, chunk_size=CHUNK))
    return A[0, 0], Bc[0, 0]


# ------------------------------------------------------------------------------------ compose_maps
@triton.jit
def _compose_maps(a1_ptr, b1_ptr, a2_ptr, b2_ptr, m_ptr, b_ptr, K: tl.constexpr, V: tl.constexpr):
    i = tl.program_id(0)
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    kk = i * K * K + rk[:, None] * K + rk[None, :]
    kv = i * K * V + rk[:, None] * V + rv[None, :]
    a1 = tl.load(a1_ptr + kk)
    a2 = tl.load(a2_ptr + kk)
    b1 = tl.load(b1_ptr + kv)
    b2 = tl.load(b2_ptr + kv)
    tl.store(m_ptr + kk, tl.dot(a2, a1).to(m_ptr.dtype.element_ty))
    tl.store(b_ptr + kv, (tl.dot(a2, b1) + b2.to(tl.float32)).to(b_ptr.dtype.element_ty))


def compose_maps(kernel, A1, B1, A2, B2):
    """Pair i: the map S -> A2[i] (A1[i] S + B1[i]) + B2[i] as one (M [n, K, K], b [n, K, V]), in the
    inputs' dtype. A [n, K, K], B [n, K, V] with K, V powers of two >= 16; one program per pair."""
    n, K, V = B1.shape
    M = torch.empty_like(A1)
    b = torch.empty_like(B1)
    kernel[(n,)](A1.contiguous(), B1.contiguous(), A2.contiguous(), B2.contiguous(), M, b, K=K, V=V)
    return M, b


COMPOSE_MAPS_STUB = '''\
@triton.jit
def compose_maps_kernel(a1_ptr, b1_ptr, a2_ptr, b2_ptr, m_ptr, b_ptr, K: tl.constexpr, V: tl.constexpr):
    i = tl.program_id(0)                       # one pair of maps per program
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    kk = i * K * K + rk[:, None] * K + rk[None, :]   # offsets of pair i's [K, K] matrices
    kv = i * K * V + rk[:, None] * V + rv[None, :]   # offsets of pair i's [K, V] matrices
    a1 = tl.load(a1_ptr + kk)
    b1 = tl.load(b1_ptr + kv)
    # TODO 1: load the second map (a2, b2)
    # TODO 2: the composed map "first, then second": M = a2 @ a1 and b = a2 @ b1 + b2 (tl.dot)
    M = a1                                     # placeholder
    b = b1                                     # placeholder
    tl.store(m_ptr + kk, M.to(m_ptr.dtype.element_ty))
    tl.store(b_ptr + kv, b.to(b_ptr.dtype.element_ty))
'''


def _compose_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, n, K, V, dt in (
            ("3 pairs of chunk maps, K = V = 16, fp32 (held to tf32)", 3, 16, 16, torch.float32),
            ("2 pairs, V = 32", 2, 16, 32, torch.float32),
            ("4 pairs, fp16", 4, 16, 16, torch.float16),
            ("K = 32: one pair", 1, 32, 16, torch.float32)):
        A, Bc = _chunk_maps(gen, 2 * n, K, V)
        inputs = {"A1": A[0::2], "B1": Bc[0::2], "A2": A[1::2], "B2": Bc[1::2]}
        out.append(Case(label, {k: v.to(device=device, dtype=dt) for k, v in inputs.items()}, _tol(dt)))
    return out


def _compose_reference(case: Case):
    x = {k: v.double().cpu() for k, v in case.inputs.items()}
    return scan_math.compose((x["A1"], x["B1"]), (x["A2"], x["B2"]))


COMPOSE_MAPS = Puzzle(
    name="compose_maps", notebook=NB, step=1, minutes=6, title="Composing two affine maps",
    statement="""\
**Ladder 1: compose two maps.** A KDA chunk maps the state `S [K, V]` it starts from to
`A S + B` (`A [K, K]`, `B [K, V]`), and these maps are known before any state is. Applying `(A1, B1)`
then `(A2, B2)` is one map: `A2 (A1 S + B1) + B2 = (A2 A1) S + (A2 B1 + B2)`. `compose_maps(kernel, A1,
B1, A2, B2)` runs one program per pair of real chunk maps (K = 16). Load the second map and form the
composition with two `tl.dot`s; mind the order (`A2 A1`, not `A1 A2`). Graded against
`scan_math.compose` in fp64.""",
    kernel_name="compose_maps_kernel", stub=COMPOSE_MAPS_STUB, wrapper=compose_maps, solution=_compose_maps,
    cases=_compose_cases, reference=_compose_reference, outputs=("M", "b"))


# ------------------------------------------------------------------------------------ linear_scan
@triton.jit
def _then(a_l, b_l, a_r, b_r):
    # the map h -> a_l h + b_l, then h -> a_r h + b_r
    return a_r * a_l, a_r * b_l + b_r


@triton.jit
def _linear_scan(a_ptr, b_ptr, h_ptr, T, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)
    mask = t < T
    a = tl.load(a_ptr + row * T + t, mask=mask, other=1.0).to(tl.float32)
    b = tl.load(b_ptr + row * T + t, mask=mask, other=0.0).to(tl.float32)
    _, h = tl.associative_scan((a, b), 0, _then)
    tl.store(h_ptr + row * T + t, h, mask=mask)


def linear_scan(kernel, a, b):
    """h [R, T] fp32 with h[:, t] = a[:, t] * h[:, t-1] + b[:, t] and h[:, -1] = 0, from a, b [R, T].
    One program per row holding all T steps (BLOCK_T = T rounded up to a power of two)."""
    R, T = a.shape
    h = torch.empty(R, T, dtype=torch.float32, device=a.device)
    kernel[(R,)](a.contiguous(), b.contiguous(), h, T, BLOCK_T=triton.next_power_of_2(T))
    return h


LINEAR_SCAN_STUB = '''\
@triton.jit
def combine_maps(a_l, b_l, a_r, b_r):
    # the map h -> a_l * h + b_l (earlier steps), then h -> a_r * h + b_r (later steps), as one map
    return a_r, b_r                            # TODO 1: the composed (a, b)


@triton.jit
def linear_scan_kernel(a_ptr, b_ptr, h_ptr, T, BLOCK_T: tl.constexpr):
    row = tl.program_id(0)                     # one program per row of T steps
    t = tl.arange(0, BLOCK_T)
    mask = t < T
    a = tl.load(a_ptr + row * T + t, mask=mask, other=1.0).to(tl.float32)   # padding: the identity map
    b = tl.load(b_ptr + row * T + t, mask=mask, other=0.0).to(tl.float32)
    # TODO 2: scan the maps (a, b) along axis 0 with tl.associative_scan and combine_maps;
    #         from h_(-1) = 0, step t's h is the b of the maps 0 ... t composed
    h = b                                      # placeholder
    tl.store(h_ptr + row * T + t, h, mask=mask)
'''


def _linear_scan_cases(seed: int, device: str) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, R, T, dt in (("3 rows of 64 steps", 3, 64, torch.float32),
                            ("T = 100: BLOCK_T 128 holds 28 padded steps", 2, 100, torch.float32),
                            ("fp16 decays and inputs", 4, 32, torch.float16),
                            ("one step", 2, 1, torch.float32)):
        a = torch.exp(-0.2 * torch.rand(R, T, generator=gen, dtype=torch.float64))  # decays in (0.82, 1]
        b = torch.randn(R, T, generator=gen, dtype=torch.float64)
        out.append(Case(label, {"a": a.to(device=device, dtype=dt), "b": b.to(device=device, dtype=dt)},
                        torch.float32))
    return out


def _linear_scan_reference(case: Case):
    a, b = case.inputs["a"].double().cpu(), case.inputs["b"].double().cpu()
    h = torch.zeros_like(b)
    state = torch.zeros(b.shape[0], dtype=torch.float64)
    for t in range(b.shape[1]):  # the plain recurrence, one step at a time
        state = a[:, t] * state + b[:, t]
        h[:, t] = state
    return h


LINEAR_SCAN = Puzzle(
    name="linear_scan", notebook=NB, step=2, minutes=8, title="tl.associative_scan of affine maps",
    statement="""\
**Ladder 2: a recurrence as a scan.** `h_t = a_t h_(t-1) + b_t` looks sequential, but each step is an
affine map of `h`, and composing maps is associative: `tl.associative_scan` can combine them as a tree
(log T levels instead of T steps). Write `combine_maps(a_l, b_l, a_r, b_r)`, the map "left (earlier),
then right (later)", and scan `(a, b)` with it in `linear_scan_kernel`: from `h_(-1) = 0`, `h_t` is the
`b` of the composition of steps `0 ... t`. One program per row of `a, b [R, T]` (decays `a` in
(0.82, 1]); `h` is fp32. Graded against the plain loop in fp64.""",
    kernel_name="linear_scan_kernel", stub=LINEAR_SCAN_STUB, wrapper=linear_scan, solution=_linear_scan,
    cases=_linear_scan_cases, reference=_linear_scan_reference, outputs=("h",))


# ------------------------------------------------------------------------------------ group_summaries
@triton.jit
def _group_summaries(a_ptr, bc_ptr, m_ptr, b_ptr, n, GROUP, K: tl.constexpr, V: tl.constexpr):
    g = tl.program_id(0)
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    kk = rk[:, None] * K + rk[None, :]
    kv = rk[:, None] * V + rv[None, :]
    M = tl.where(rk[:, None] == rk[None, :], 1.0, 0.0)
    b = tl.zeros((K, V), dtype=tl.float32)
    c = g * GROUP
    end = tl.minimum(c + GROUP, n)
    while c < end:
        A = tl.load(a_ptr + c * K * K + kk).to(tl.float32)
        M = tl.dot(A, M)
        b = tl.dot(A, b) + tl.load(bc_ptr + c * K * V + kv).to(tl.float32)
        c += 1
    tl.store(m_ptr + g * K * K + kk, M.to(m_ptr.dtype.element_ty))
    tl.store(b_ptr + g * K * V + kv, b.to(b_ptr.dtype.element_ty))


def group_summaries(kernel, A, Bc, group_size):
    """Each group's summary (M [G, K, K], b [G, K, V], the inputs' dtype) of chunk maps A [n, K, K],
    Bc [n, K, V]: groups are chunks [0, g), [g, 2g), ... (the last may be shorter); one program per group."""
    n, K, V = Bc.shape
    G = triton.cdiv(n, group_size)
    M = torch.empty(G, K, K, dtype=A.dtype, device=A.device)
    b = torch.empty(G, K, V, dtype=Bc.dtype, device=Bc.device)
    kernel[(G,)](A.contiguous(), Bc.contiguous(), M, b, n, group_size, K=K, V=V)
    return M, b


GROUP_SUMMARIES_STUB = '''\
@triton.jit
def group_summaries_kernel(a_ptr, bc_ptr, m_ptr, b_ptr, n, GROUP, K: tl.constexpr, V: tl.constexpr):
    g = tl.program_id(0)                       # one group of GROUP chunks per program
    rk = tl.arange(0, K)
    rv = tl.arange(0, V)
    kk = rk[:, None] * K + rk[None, :]         # offsets inside one [K, K] matrix
    kv = rk[:, None] * V + rv[None, :]         # offsets inside one [K, V] matrix
    M = tl.where(rk[:, None] == rk[None, :], 1.0, 0.0)   # the identity map: (I, 0)
    b = tl.zeros((K, V), dtype=tl.float32)
    c = g * GROUP                              # this group's first chunk
    end = tl.minimum(c + GROUP, n)             # the last group may hold fewer than GROUP
    while c < end:                             # a run-time bound: a while loop (see the statement)
        # TODO: compose (M, b) with chunk c's map (A_c, B_c), in order: M = A_c @ M, b = A_c @ b + B_c
        c += 1
    tl.store(m_ptr + g * K * K + kk, M.to(m_ptr.dtype.element_ty))
    tl.store(b_ptr + g * K * V + kv, b.to(b_ptr.dtype.element_ty))
'''


def _group_cases(seed: int, device: str, starts: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for label, n, gs, K, V, dt in (
            ("7 chunks in groups of 3: the last group is short", 7, 3, 16, 16, torch.float32),
            ("8 chunks in groups of 2, V = 32", 8, 2, 16, 32, torch.float32),
            ("6 chunks in groups of 4, fp16 maps", 6, 4, 16, 16, torch.float16),
            ("5 chunks in one group of 8", 5, 8, 16, 16, torch.float32)):
        A, Bc = _chunk_maps(gen, n, K, V)
        if starts:
            M, b = scan_math.group_summaries(A[None, None], Bc[None, None], gs)
            S0 = 0.5 * torch.randn(K, V, generator=gen, dtype=torch.float64)
            inputs = {"M": M[0, 0], "b": b[0, 0], "S0": S0}
        else:
            inputs = {"A": A, "Bc": Bc}
        inputs = {k: v.to(device=device, dtype=dt) for k, v in inputs.items()}
        if not starts:
            inputs["group_size"] = gs
        chain = -(-n // gs) if starts else min(gs, n)  # products one output is the end of
        out.append(Case(label, inputs, _tol(dt, chain)))
    return out


def _group_summaries_reference(case: Case):
    x = case.inputs
    M, b = scan_math.group_summaries(x["A"].double().cpu()[None, None], x["Bc"].double().cpu()[None, None],
                                     x["group_size"])
    return M[0, 0], b[0, 0]


GROUP_SUMMARIES = Puzzle(
    name="group_summaries", notebook=NB, step=3, minutes=8, title="A group's maps composed into one",
    statement="""\
**Ladder 3: summarise each group.** The group scan cuts the chunks into groups of `group_size` and
composes each group's chunk maps, in order, into one summary `(M, b)`, with no state needed: start
from the identity `(I, 0)` and fold in chunk `c` as `M = A_c M`, `b = A_c b + B_c` (ladder 1's
composition). `group_summaries(kernel, A, Bc, group_size)` runs one program per group over
`A [n, K, K]`, `Bc [n, K, V]`; the last group may hold fewer chunks. Fill the loop's body (the loop is a
`while`: Triton's interpreter cannot run a `for` to a bound known only at run time). All groups run at
once: this is the parallel half of the group scan. Graded against `scan_math.group_summaries` in fp64.""",
    kernel_name="group_summaries_kernel", stub=GROUP_SUMMARIES_STUB, wrapper=group_summaries,
    solution=_group_summaries, cases=lambda seed, device: _group_cases(seed, device, starts=False),
    reference=_group_summaries_reference, outputs=("M", "b"))


# ------------------------------------------------------------------------------------ group_starts
@triton.jit
def _group_starts(m_ptr, b_ptr, s0_ptr, out_ptr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BV: tl.constexpr):
    v0 = tl.program_id(0) * BV
    rk = tl.arange(0, K)
    rv = v0 + tl.arange(0, BV)
    kk = rk[:, None] * K + rk[None, :]
    kv = rk[:, None] * V + rv[None, :]
    S = tl.load(s0_ptr + kv).to(tl.float32)
    for j in range(G):
        tl.store(out_ptr + j * K * V + kv, S.to(out_ptr.dtype.element_ty))
        M = tl.load(m_ptr + j * K * K + kk).to(tl.float32)
        S = tl.dot(M, S) + tl.load(b_ptr + j * K * V + kv).to(tl.float32)


def group_starts(kernel, M, b, S0):
    """The state where each group starts, starts [G, K, V] (S0's dtype): starts[0] = S0 [K, V], then
    starts[j + 1] = M[j] starts[j] + b[j] from the summaries M [G, K, K], b [G, K, V]. One program per
    BV = 16 value columns walks all G groups."""
    G, K, V = b.shape
    out = torch.empty(G, K, V, dtype=S0.dtype, device=S0.device)
    BV = 16
    kernel[(triton.cdiv(V, BV),)](M.contiguous(), b.contiguous(), S0.contiguous(), out, G=G, K=K, V=V, BV=BV)
    return out


GROUP_STARTS_STUB = '''\
@triton.jit
def group_starts_kernel(m_ptr, b_ptr, s0_ptr, out_ptr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                        BV: tl.constexpr):
    v0 = tl.program_id(0) * BV                 # this program's BV value columns of the state
    rk = tl.arange(0, K)
    rv = v0 + tl.arange(0, BV)
    kk = rk[:, None] * K + rk[None, :]         # offsets inside one [K, K] summary
    kv = rk[:, None] * V + rv[None, :]         # offsets of this program's columns of a [K, V] state
    S = tl.load(s0_ptr + kv).to(tl.float32)    # the state before group 0
    for j in range(G):
        tl.store(out_ptr + j * K * V + kv, S.to(out_ptr.dtype.element_ty))   # where group j starts
        # TODO: apply group j's summary: S = M_j @ S + b_j (load this program's columns of b_j)
'''


def _group_starts_reference(case: Case):
    x = {k: v.double().cpu() for k, v in case.inputs.items()}
    S, starts = x["S0"], []
    for j in range(x["M"].shape[0]):  # the plain walk over the summaries
        starts.append(S)
        S = scan_math.apply((x["M"][j], x["b"][j]), S)
    return torch.stack(starts)


GROUP_STARTS = Puzzle(
    name="group_starts", notebook=NB, step=4, minutes=8, title="The scan over the group summaries",
    statement="""\
**Ladder 4: the ordered scan.** With every group summarised, one walk over the summaries gives the state
where each group starts: `starts[0] = S0`, `starts[j + 1] = M_j starts[j] + b_j`, G dependent steps
instead of one per chunk. The state's value columns are independent (`M` mixes rows only), so
`group_starts(kernel, M, b, S0)` gives each block of `BV = 16` columns its own program. Fill the step
(`tl.dot`). This is `k3lab.ops.kda_chunk.scan`'s kernel without its heads and sequences (and with `M`
whole, where the op splits it into a diagonal and a low-rank part). Graded against the plain walk with
`scan_math.apply` in fp64.""",
    kernel_name="group_starts_kernel", stub=GROUP_STARTS_STUB, wrapper=group_starts, solution=_group_starts,
    cases=lambda seed, device: _group_cases(seed, device, starts=True), reference=_group_starts_reference,
    outputs=("starts",))

PUZZLES = (COMPOSE_MAPS, LINEAR_SCAN, GROUP_SUMMARIES, GROUP_STARTS)
