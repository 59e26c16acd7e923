"""KDA speculative verification: T = 1..8 draft positions per sequence, in one launch.

A verification step runs the KDA recurrence (k3lab.nn.kda.kda_recurrent) over a few draft tokens
and must keep the state after *every* position, so that when the sampler accepts only the first j
drafts the server can roll back to state j without recomputing (`states[b, j - 1]`).

Two kernels compute the same thing:

* the streaming kernel (`kda_verify_before`, the shape of the original): one program per
  (sequence, head, 32 value columns), a 128-thread workgroup, the token loop's length read at run
  time, each token's q, k, v, g, beta loaded inside the loop, so every position waits for its own
  memory round trip. At TP8 (12 heads, V = 128) one sequence makes 12 x 4 = 48 programs: a GPU with
  132 SMs (H200) or 256 CUs (MI355X) is mostly idle, and what runs is a chain of T round trips.
* the narrow kernel (`kda_verify`, after): the seed's four changes (section 5, vLLM PR 58045).
  1. narrow tiles: 8 (H200) or 4 (MI355X, the seed) value columns per program, chosen from
     batch x heads against the device's compute-unit count (`choose_tile_v`): 192 or 384 programs
     at B = 1 on 12 heads instead of 48;
  2. single-wave workgroups: a 128 x 4 fp32 tile is 16 values per lane of one wave, so the reduction
     over K is lane shuffles only, no shared memory and no barrier (`choose_num_warps` reads the wave
     width from the device). The Triton forms keep this; the CUDA default on the H200 ('cuda_warp',
     below) measured faster with 4 warps sharing a tile's key rows and one shared-memory exchange per
     position (3.19 us) than with one warp per tile (3.87), both launched with PDL;
  3. uniform-length specialisation: T is a compile-time constant and the loops unroll; ragged
     batches (cu_seqlens or per-sequence lengths) keep a dynamic path (masked positions);
  4. hoisted token-invariant work: every position's inputs are loaded before the recurrence (one
     round trip instead of T), exp(g), d*k, d*q, q.k and beta*v are computed up front, and the output
     o_t = S^T (d q) + (q.k) delta needs two reductions of the old state that run side by side.

The narrow kernel comes in three Triton forms (`form`): 'step' (the Triton default, used on CPU and
ROCm and wherever the CUDA kernel below cannot run) walks the positions one after
another as above (T reductions of the state in series); 'chunk' (`_verify_chunk_kernel`) treats the
T positions as one small chunk of the chunked algorithm: every state-dependent reduction happens in
one round, the T x T algebra between positions (a unit-triangular inverse) is done while the state
is still in flight, and the per-position states come out of one scan. On the H200 the chunk form
lost at every depth (B = 1, tile 8, graph replay, its best wave count against the step form's one
wave): T = 1 3.17 vs 2.77 us, T = 2 4.02 vs 3.50, T = 4 6.04 vs 4.15, T = 8 14.5 vs 7.11
(profiles/nvidia-h200/kda_verify, the '.chunk*' sweep points). The chain it shortens is only
~0.1 us per position; what it adds is larger: Triton 3.6 compiles its [T, K], [T, T] and
[T, K, tile] operands into ~9 register layouts and moves them between each other through shared
memory (24 layout conversions and ~60 barriers at 4 waves, against 16 and 16 for the step form,
from ptxas for sm_90a), and its instruction count per program is higher. It is kept as an option
because the trade may differ where layouts are chosen by hand or on other hardware. A third form,
'tile', is the step form with q, k and g loaded straight into the [K, tile] shape of the state tile
(every column reading the same addresses) instead of as [K] vectors moved into the tile's layout
through shared memory. Storing the states [V, K] (`state_layout='vk'`, the layout `kda_decode` can
also keep) goes further: a tile's K values are then contiguous, and loads, arithmetic and stores
share one register layout. Compiled for sm_90a (one wave, tile 8, with the 16-byte alignment a
launch sees; ptxas and cuobjdump) the trade is visible but not its outcome: at T = 4 'step' is 1,698
instructions with 16 barriers, 'tile' 1,867 with 8, 'vk' 1,883 with 4 (T = 8: 3,353 / 3,694 / 3,699
with 32 / 16 / 8). Fewer shared-memory round trips on the recurrence's path, a tenth more
instructions. The H200 run of those sweep points (commit 7ebd1a1, B = 1, T = 4, graph replay,
records b1_t4.tile*/vk*) kept 'step' ahead: step 4.19 us, tile8_w1 5.40, tile8_w2 4.85,
tile4_w1 6.54, vk8_w1 4.79, vk8_w2 4.35, vk4_w1 4.56; so 'step' with 'kv' stays the Triton default.

A hand-written CUDA kernel (kernels/kda_verify.cu, forms 'cuda' and 'cuda_chunk'; binding
in k3lab.ops.kda_verify_cuda) chooses the lane mapping Triton will not: a 128 x 8 tile over 4 warps,
each thread 8 contiguous key rows of one column, so its q/k/g slices are 16-byte loads and a reduction
over K is 8 in-thread products, 2 shuffles and one shared-memory exchange (the step form: ~840 SASS
instructions per thread at T = 4 against Triton's ~1,700 for one warp; sm_90a, ptxas). Its first
version staged every position's inputs through shared memory with cp.async, so that no load's
consumer could be scheduled before the later positions' loads were issued.
On the H200 (commit a33990d, B = 1, T = 4, graph replay, one run) it lost to the Triton step form:
7.57 us against 4.15 (chunk form 8.10; T = 1 / 2 / 8: 3.88 / 5.17 / 13.66 against Triton's earlier
2.77 / 3.50 / 7.11), every output and state within the fp32 bounds. Its time grew ~1.3 us per
position and with the number of cp.async instructions per block (2, 4 and 8 warps: 7.54, 7.57,
9.98 us), which points at the copies themselves (eight column lanes copy the same 16 bytes to the
same place). The current 'cuda' and 'cuda_chunk' forms load into registers instead and gate every
loaded word through a zero read from shared memory after a barrier that follows the last load, so no
consumer is scheduled among the loads. On the H200 (third session of 2026-11-30, graph replay, one
run; GPU tests of both forms passed): 'cuda' 8 columns x 4 warps 4.09 us against 4.16 us for the
Triton step form (2 warps 4.76, 4-column tiles 5.91 / 6.15, 'cuda_chunk' on 4 warps 5.15; T = 1 / 8: 2.78 /
6.65 us); 2% is within run-to-run noise. The cp.async version faulted on the H200 in that session's
tests and was removed. Records of it: profiles/nvidia-h200/kda_verify/extra/cuda_v1_cp_async.json.

The third CUDA form, 'cuda_warp' (kernels/kda_verify.cu FORM 2), is the default 'after' on CUDA
devices where the .cu builds (CUDA_DEFAULT, CUDA_FORM). A lane pair owns 4 columns of RR = 8 / W key
rows each (W = 1, 2 or 4 warps share an 8-column tile's key rows), so a thread's state rows load and
store as 16-byte vectors (the pair fills a 32-byte sector), its q/k/g rows are one vector load, and
the per-row work (decay, d k, d q) is done by 2 lanes instead of 8. Per position the 8 partial sums
(u and p of 4 columns) are reduced by recursive halving (8 shuffles instead of 32), and with W > 1 one
shared-memory exchange joins the warps. And it is launched as a programmatic dependent of the
stream's previous kernel (PDL, k3lab.ops.kda_verify_cuda): its blocks are placed while that kernel
finishes and wait (griddepcontrol.wait) for its completion before their first memory access, so the
results are the same and the launch latency is hidden. On the H200 (fourth session of 2026-11-30,
commit c53e93d, B = 1, T = 4, 12 heads, graph replay, one run; its 65 GPU tests passed): W = 4 with
PDL 3.19 us against 10.39 before (3.26x) and 6.69 for fla (2.10x); without PDL 3.96 (W = 1 / 2:
4.45 / 4.50, with PDL 3.87 / 3.76); the 4-warp 'cuda' form 4.20 (3.38 with PDL) and the Triton step
form 4.20 in the same run. PDL was worth 0.58-0.82 us per call in every form and depth. W = 4 (768
warps at B = 1, up to two per SM sub-partition) beats 1 and 2: the least work per thread (~620 SASS
instructions after the loads at T = 4, against ~800 for W = 2 and ~1,190 for W = 1) outweighs its
shared-memory exchange per position. Depths (after = W 4 + PDL): T = 1 / 2 / 8: 2.44 / 2.73 / 5.31 us (before 3.60 /
5.80 / 17.77, fla 3.94 / 4.75 / 10.76); at B = 8 it is 13.95 us against fla's 9.81 (the Triton step
form measured 13.39 in an earlier run), so beyond B = 1 the narrow kernels are not yet the answer.
K3LAB_KDA_VERIFY_FORM, K3LAB_KDA_VERIFY_WARPS and K3LAB_KDA_VERIFY_PDL name the form, its warps and
PDL for one run. Where the .cu cannot run (CPU: Triton's interpreter; ROCm: not yet run on AMD
hardware by this project; no nvcc; inputs it does not take, e.g. V != 128 or misaligned buffers) the
Triton step form runs instead, and `kda_verify_cuda.status()` says why.

When batch x heads already gives every compute unit enough programs, `choose_tile_v` returns a wide
tile and `kda_verify` runs the streaming kernel with it: there is no idle hardware for narrow tiles
to fill, and a wide tile writes whole memory sectors per row with fewer instructions.

States are fp32 [B, T, H, K, V] (ragged: [1, total_tokens, H, K, V], the state after each token of
the flattened batch), or only the final [N, H, K, V] with `final_state_only=True`.

Measured on an NVIDIA H200 (profiles/nvidia-h200/kda_verify); the ROCm path (wave 64, 4-column
tiles) is the same Triton code but has not yet been run on AMD hardware by this project.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3lab import env
from k3lab.nn.kda import kda_recurrent

HEAD_DIM = 128  # K3's KDA head dim; the kernels hold one full K = 128 column of the state per lane group
MAX_POSITIONS = 8  # drafts + 1 verified by one call; beyond this, use the chunked prefill path
TILE_WIDTHS = (32, 16, 8, 4)  # value columns per program, widest first
NARROW_MAX = 8  # tiles up to this width run the narrow kernel; wider ones the streaming kernel
BEFORE_TILE_V = 32
# How the narrow kernel walks the positions: 'chunk' (all positions as one small chunk: one
# state-dependent reduction round, `_verify_chunk_kernel`), 'step' (position after position,
# `_verify_narrow_kernel`) or 'tile' (the step form with its inputs loaded in the tile's shape).
NARROW_FORMS = ("chunk", "step", "tile", "cuda", "cuda_chunk", "cuda_warp")
NARROW_FORM = "step"  # the Triton form (CPU, ROCm, fallback): faster than 'chunk' and 'tile' on the H200
# The hand-written kernel (kernels/kda_verify.cu via k3lab.ops.kda_verify_cuda): step ('cuda'), chunk
# and warp forms. The warp form (launched as a programmatic dependent) is the default on CUDA devices
# where the .cu builds: 3.19 us against 4.20 for the Triton step form on the H200 (module docstring).
CUDA_FORMS = ("cuda", "cuda_chunk", "cuda_warp")
CUDA_FORM = "cuda_warp"
CUDA_DEFAULT = True  # True: `default_form` picks CUDA_FORM on CUDA devices where the .cu builds
FORM_ENV = "K3LAB_KDA_VERIFY_FORM"  # names the default form for one run (e.g. a device measurement)
WARPS_ENV = "K3LAB_KDA_VERIFY_WARPS"  # names the CUDA forms' 32-lane groups per block for one run
CUDA_WARP_WARPS = 4  # the warp form's warps per 8-column tile (1 or 4 are built; module docstring)
STATE_LAYOUTS = ("kv", "vk")  # the recurrent state per head: [K, V] (fla's) or [V, K]
BEFORE_THREADS = 128
CHUNK_PER_LANE = 64  # values per lane of the chunk form's [T, K, tile] products (measured, below)  # the original kernel's workgroup size, in threads


# ----------------------------------------------------------------------------------------------
# launch choices, from the device


def workgroups(batch: int, heads: int, tile_v: int, v_dim: int = HEAD_DIM) -> int:
    """Programs (workgroups, CTAs) one launch creates: one per (sequence, head, tile of V)."""
    return batch * heads * (v_dim // tile_v)


# The narrowest row segment a tile should write per state row, by backend. NVIDIA's L2 works in
# 32-byte sectors: a 4-column fp32 row (16 B) leaves every sector half written, and on the H200
# 8-column tiles ran B = 1, T = 4 in 4.21 us against 6.03 us for 4 columns (profiles/nvidia-h200/
# kda_verify, sweep). On AMD the seed's 4-column tiles (16 B) are kept (not yet run on AMD hardware
# by this project); the CPU interpreter has no sectors.
MIN_ROW_BYTES = {"cuda": 32, "rocm": 16, "cpu": 16}
# Programs per compute unit above which a wider tile pays (fewer q/k/g re-reads, fewer instructions).
# Measured on the H200 (12 heads, T = 4, all states): at B = 8, 1,536 programs of 8 columns (13.5 us)
# beat 768 of 16 (14.2 us) and 384 of 32 (16.0 us); at B = 32, 3,072 programs of 16 columns
# (40.5 us) beat 6,144 of 8 (47.5 us) and 1,536 of 32 (47.0 us).
PROGRAMS_PER_UNIT = 12


def min_tile_v(backend: str | None = None, state_bytes: int = 4) -> int:
    """Narrowest tile width for this backend: MIN_ROW_BYTES / bytes per state value."""
    backend = backend or env.detect().backend
    return max(TILE_WIDTHS[-1], MIN_ROW_BYTES.get(backend, 16) // state_bytes)


def choose_tile_v(batch: int, heads: int, v_dim: int = HEAD_DIM, compute_units: int | None = None,
                  programs_per_unit: int = PROGRAMS_PER_UNIT, backend: str | None = None) -> int:
    """The widest tile that still gives every compute unit `programs_per_unit` programs, else the
    narrowest the backend allows (`min_tile_v`).

    Narrow tiles make more programs for a short batch (12 heads x 128 columns / 32 = 48 programs
    for one sequence, against 132 SMs or 256 CUs); wide tiles re-read each position's q, k, g for
    fewer programs and run fewer instructions per state value, which wins once the GPU is full.
    12 heads, H200 (132 SMs): B = 1 -> 8 (192 programs), B = 8 -> 8 (1,536), B = 32 -> 16 (3,072);
    MI355X (256 CUs): B = 1 -> 4 (384 programs, the seed's choice)."""
    units = compute_units if compute_units is not None else env.detect().compute_units
    narrowest = min_tile_v(backend)
    for width in TILE_WIDTHS:
        if width < narrowest:
            break
        if v_dim % width == 0 and workgroups(batch, heads, width, v_dim) >= programs_per_unit * units:
            return width
    return narrowest


def _wave_width() -> int:
    # The interpreter (CPU) has no waves; 32 only sizes the (ignored) num_warps there.
    return env.detect().wave_width or 32


def choose_num_warps(tile_v: int, k_dim: int = HEAD_DIM, wave_width: int | None = None, form: str = "step",
                     positions: int = 4) -> int:
    """Waves per program: one wave until a lane would hold more than 32 state values (narrow
    kernel) or 64 (streaming kernel, which keeps fewer vectors per lane). A 128 x 4 or 128 x 8 fp32
    tile is one wave on NVIDIA's 32 lanes and on AMD's 64; so is a 128 x 16 tile in the streaming
    kernel (on the H200 it ran faster with one wave than with four at B = 1, 8 and 32)."""
    if form in CUDA_FORMS:
        return cuda_warps(form, positions)
    wave = wave_width or _wave_width()
    if form == "chunk" and tile_v <= NARROW_MAX:
        # the chunk form's [T, K, tile] products: CHUNK_PER_LANE values per lane, 2..8 waves; one
        # position is 4 (at 2 it spills: ptxas reports a 168-byte stack). H200, tile 8: T = 1 4 waves
        # 3.17 us (2: 5.75), T = 2 2 waves 4.02 (4: 4.10), T = 4 2 waves 6.04 (1: 7.19, 4: 6.23,
        # 8: 8.44), T = 8 4 waves 14.5 (8: 24.3).
        span = triton.next_power_of_2(max(1, positions))
        if span == 1:
            return max(1, (4 * 32) // wave)
        return min(8, max(2, (span * k_dim * tile_v) // (wave * CHUNK_PER_LANE)))
    per_lane = 32 if tile_v <= NARROW_MAX else 64
    return max(1, (k_dim * tile_v) // (wave * per_lane))


def cuda_warps(form: str = CUDA_FORM, positions: int = 4) -> int:
    """32-lane groups per block of the CUDA kernel (its lane mapping is in 32-lane groups whatever the
    device's warp width): 'cuda' 4, so each thread holds 8 key rows of one column (tile 8); the chunk
    form 8 (its T^2 partial sums per thread spill at 4 groups at T = 8: ptxas, sm_90a); the warp form
    1 (each warp owns its 8 columns whole, so a block is one warp). `positions` is kept for callers
    that size by depth."""
    del positions
    import os

    named = os.environ.get(WARPS_ENV)
    if named:
        if named not in ("1", "2", "4", "8"):
            raise ValueError(f"{WARPS_ENV} must be 1, 2, 4 or 8, got {named!r}")
        return int(named)
    return {"cuda_chunk": 8, "cuda_warp": CUDA_WARP_WARPS}.get(form, 4)


def default_form(tile_v: int, backend: str | None = None) -> str:
    """The narrow kernel's form before looking at the inputs: the Triton step form, or CUDA_FORM
    (kernels/kda_verify.cu) on a CUDA device where it builds when CUDA_DEFAULT is set. The
    environment variable K3LAB_KDA_VERIFY_FORM, when set, names the form instead (one of
    NARROW_FORMS; a CUDA form it names is still used only where the .cu runs). The CPU interpreter and
    ROCm always get the Triton form (the .cu is not yet run on AMD hardware by this project)."""
    import os

    backend = backend or env.detect().backend
    wanted = os.environ.get(FORM_ENV) or (CUDA_FORM if CUDA_DEFAULT else NARROW_FORM)
    if wanted not in NARROW_FORMS:
        raise ValueError(f"{FORM_ENV} must be one of {NARROW_FORMS}, got {wanted!r}")
    if wanted not in CUDA_FORMS:
        return wanted
    if tile_v > NARROW_MAX or backend != "cuda":
        return NARROW_FORM
    from k3lab.ops import kda_verify_cuda as kc

    return wanted if kc.available() else NARROW_FORM


def choose_form(q, k, v, g, beta, initial_state, tile_v: int, positions: int, state_layout: str = "kv") -> str:
    """The narrow kernel's form for these inputs: `default_form`, except that a CUDA form falls back
    to the Triton step form for inputs the .cu does not take (V != 128, other dtypes, 'vk' states,
    tensors not 16-byte aligned)."""
    form = default_form(tile_v)
    if form not in CUDA_FORMS:
        return form
    if state_layout != "kv":
        return NARROW_FORM
    from k3lab.ops import kda_verify_cuda as kc

    why = kc.supports(q, k, v, g, beta, initial_state, tile_v, cuda_warps(form, positions), form)
    return form if why is None else NARROW_FORM


def before_num_warps(wave_width: int | None = None) -> int:
    """The original kernel's 128-thread workgroup, in waves of this device (4 on NVIDIA, 2 on AMD)."""
    return max(1, BEFORE_THREADS // (wave_width or _wave_width()))


# ----------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _sequence_span(seq_info, i_b, T, RAGGED: tl.constexpr):
    """(first token row, length) of sequence i_b: RAGGED 1 reads cu_seqlens [N + 1] (flattened
    tokens), 2 reads lengths [N] in a padded [N, T] layout, 0 is the uniform [N, T] batch."""
    if RAGGED == 1:
        bos = tl.load(seq_info + i_b).to(tl.int64)
        L = tl.load(seq_info + i_b + 1).to(tl.int64) - bos
    elif RAGGED == 2:
        bos = i_b.to(tl.int64) * T
        L = tl.load(seq_info + i_b).to(tl.int64)
    else:
        bos = i_b.to(tl.int64) * T
        L = T
    return bos, L


@triton.jit
def _verify_stream_kernel(q, k, v, g, beta, h0, o, hs, seq_info, scale, T_run,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
                          RAGGED: tl.constexpr, ALL_STATES: tl.constexpr):
    """One program per (tile of BV columns, sequence x head). The token loop's length is read at
    run time and each token's inputs are loaded inside it: T memory round trips in series."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, L = _sequence_span(seq_info, i_b, T_run, RAGGED)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    tile = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(h0 + (i_b * H + i_h).to(tl.int64) * K * V + tile)
    t = 0
    while t < L:  # a while loop: the interpreter cannot range() over a run-time scalar
        row = (bos + t) * H + i_h
        q_t = tl.load(q + row * K + offs_k).to(tl.float32) * scale
        k_t = tl.load(k + row * K + offs_k).to(tl.float32)
        g_t = tl.load(g + row * K + offs_k).to(tl.float32)
        v_t = tl.load(v + row * V + offs_v).to(tl.float32)
        b_t = tl.load(beta + row).to(tl.float32)
        S = S * tl.exp(g_t)[:, None]
        u = tl.sum(S * k_t[:, None], axis=0)
        S = S + k_t[:, None] * (b_t * (v_t - u))[None, :]
        o_t = tl.sum(S * q_t[:, None], axis=0)
        tl.store(o + row * V + offs_v, o_t.to(o.dtype.element_ty))
        if ALL_STATES:
            tl.store(hs + row * K * V + tile, S)
        t += 1
    if not ALL_STATES:
        tl.store(hs + (i_b * H + i_h).to(tl.int64) * K * V + tile, S)


@triton.jit
def _verify_narrow_kernel(q, k, v, g, beta, h0, o, hs, seq_info, scale,
                          T: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BV: tl.constexpr, RAGGED: tl.constexpr, ALL_STATES: tl.constexpr,
                          TILE_LOADS: tl.constexpr = False, STATE_VK: tl.constexpr = False):
    """Narrow tiles, one wave. T is a compile-time constant (the uniform length, or the ragged
    batch's longest sequence), so the loops unroll. Three phases: every load, then every
    state-independent quantity, then the recurrence. TILE_LOADS (form 'tile'): q, k and g are loaded
    straight into the [K, BV] tile's shape, every column reading the same address, instead of as [K]
    vectors that then move into the tile's register layout through shared memory (a barrier each)."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, L = _sequence_span(seq_info, i_b, T, RAGGED)
    offs_k = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)[None, :]  # [1, BV]: a row of the tile
    if STATE_VK:  # states stored [V, K]: a tile's K values are contiguous
        tile = cv * K + offs_k[:, None]
    else:
        tile = offs_k[:, None] * V + cv
    S = tl.load(h0 + (i_b * H + i_h).to(tl.int64) * K * V + tile)
    # Phase 1, hoisted loads: every position's inputs are requested before any is used, so the T
    # loads overlap: one memory round trip, not T. A dead ragged position reads k = g = beta = 0,
    # which makes its update the identity, so the unrolled loop needs no branch.
    qs = ()
    ks = ()
    gs = ()
    vs = ()
    bs = ()
    if TILE_LOADS:
        offs_in = offs_k[:, None] + cv * 0  # [K, BV]: column j of the tile reads the same K values
    else:
        offs_in = offs_k
    for t in tl.static_range(T):
        row = (bos + t) * H + i_h
        if RAGGED == 0:
            qs = qs + (tl.load(q + row * K + offs_in),)
            ks = ks + (tl.load(k + row * K + offs_in),)
            gs = gs + (tl.load(g + row * K + offs_in),)
            vs = vs + (tl.load(v + row * V + cv),)
            bs = bs + (tl.load(beta + row),)
        else:
            alive = L > t
            qs = qs + (tl.load(q + row * K + offs_in, mask=(offs_in < K) & alive, other=0.0),)
            ks = ks + (tl.load(k + row * K + offs_in, mask=(offs_in < K) & alive, other=0.0),)
            gs = gs + (tl.load(g + row * K + offs_in, mask=(offs_in < K) & alive, other=0.0),)
            vs = vs + (tl.load(v + row * V + cv, mask=(cv < V) & alive, other=0.0),)
            bs = bs + (tl.load(beta + row, mask=alive, other=0.0),)
    # Loads may not move across a barrier: without it the compiler interleaves position t+1's loads
    # with the arithmetic on position t's data and pays a round trip per position again.
    tl.debug_barrier()
    # Phase 2, token-invariant work (nothing here depends on the state). Each vector is broadcast to
    # the tile's shape here, so its move into the tile's register layout (through shared memory)
    # happens now and not on the recurrence's critical path: decay d = exp(g), d*k, d*q, k, and the
    # scalars q.k and beta*v.
    ds = ()
    dks = ()
    dqs = ()
    kf = ()
    qks = ()
    bvs = ()
    for t in tl.static_range(T):
        if TILE_LOADS:  # already [K, BV] in the tile's layout
            q_t = qs[t].to(tl.float32) * scale
            k_t = ks[t].to(tl.float32)
            d_t = tl.exp(gs[t].to(tl.float32))
        else:
            q_t = tl.broadcast_to(qs[t][:, None], (K, BV)).to(tl.float32) * scale
            k_t = tl.broadcast_to(ks[t][:, None], (K, BV)).to(tl.float32)
            d_t = tl.exp(tl.broadcast_to(gs[t][:, None], (K, BV)).to(tl.float32))
        ds = ds + (d_t,)
        dks = dks + (d_t * k_t,)
        dqs = dqs + (d_t * q_t,)
        kf = kf + (k_t,)
        qks = qks + (tl.sum(q_t * k_t, axis=0, keep_dims=True),)  # [1, BV], every column the same
        bvs = bvs + (bs[t].to(tl.float32) * vs[t].to(tl.float32),)
    # Phase 3, the recurrence. With S the state before position t:
    #   u = S^T (d*k) and p = S^T (d*q): two independent reductions of the same tile, side by side;
    #   delta = beta (v - u);  S' = d*S + k delta^T;  o = S'^T q = p + (q.k) delta.
    # The chain from S to S' is one multiply, one reduction over K and one fused multiply-add.
    for t in tl.static_range(T):
        u = tl.sum(S * dks[t], axis=0, keep_dims=True)  # [1, BV]
        p = tl.sum(S * dqs[t], axis=0, keep_dims=True)
        S_dec = S * ds[t]
        delta = bvs[t] - bs[t].to(tl.float32) * u
        S = S_dec + kf[t] * delta
        o_t = p + qks[t] * delta
        row_t = (bos + t) * H + i_h
        if RAGGED == 0:
            tl.store(o + row_t * V + cv, o_t.to(o.dtype.element_ty))
            if ALL_STATES:
                tl.store(hs + row_t * K * V + tile, S)
        else:
            alive = L > t
            # padded layout (lengths): a dead position's q is 0, so its output row is written as 0;
            # flattened layout (cu_seqlens): the row belongs to the next sequence, so it is skipped
            if RAGGED == 1:
                tl.store(o + row_t * V + cv, o_t.to(o.dtype.element_ty), mask=(cv < V) & alive)
            else:
                tl.store(o + row_t * V + cv, o_t.to(o.dtype.element_ty))
            if ALL_STATES:
                tl.store(hs + row_t * K * V + tile, S, mask=(tile >= 0) & alive)
    if not ALL_STATES:
        tl.store(hs + (i_b * H + i_h).to(tl.int64) * K * V + tile, S)


@triton.jit
def _decay_scan(a1, x1, a2, x2):
    # (decay, value) pairs of the recurrence S_t = a_t S_{t-1} + x_t, composed left to right
    return a1 * a2, a2 * x1 + x2


@triton.jit
def _small_mm(a, b):
    """[P, P] @ [P, P] for the tiny per-call matrices (no tensor cores: broadcast and sum)."""
    return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _verify_chunk_kernel(q, k, v, g, beta, h0, o, hs, seq_info, scale,
                         T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BV: tl.constexpr, RAGGED: tl.constexpr, ALL_STATES: tl.constexpr):
    """The T positions as one small chunk (the WY form of chunked prefill, at chunk size T): the chain
    from the state load to the outputs holds one round of reductions over K instead of T in series.
    With c_t the cumulative decay, E[t, i] = c_t / c_i (i <= t), a_t = S0^T (c_t k_t) and
    b_t = S0^T (c_t q_t):
        delta = P (v - a),  o = b + R (v - a),
    where P = (I + diag(beta) A)^-1 diag(beta), A[t, i] = (E[t, i] k_i) . k_t (i < t), and
    R = B P, B[t, i] = (E[t, i] k_i) . q_t (i <= t), are T x T and state-independent (computed while
    the state is in flight; the unit-triangular inverse is a finite Neumann product). The states
    S_t = d_t S_{t-1} + k_t delta_t^T are then elementwise: one scan over positions, one 3-D store.
    TP is T rounded up to a power of two; positions past the sequence read k = g = beta = 0 (an
    identity update) and are not written."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // H
    i_h = i_bh % H
    bos, L = _sequence_span(seq_info, i_b, T, RAGGED)
    offs_t = tl.arange(0, TP)
    offs_k = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    alive = (offs_t < L) & (offs_t < T)  # [TP]
    rows = (bos + offs_t) * H + i_h  # [TP] token-head rows
    m_tk = alive[:, None] & (offs_k[None, :] < K)
    m_tv = alive[:, None] & (cv[None, :] < V)
    # every load is issued before any is used: inputs of all positions and the state slice
    qt = tl.load(q + rows[:, None] * K + offs_k[None, :], mask=m_tk, other=0.0)
    kt = tl.load(k + rows[:, None] * K + offs_k[None, :], mask=m_tk, other=0.0)
    gt = tl.load(g + rows[:, None] * K + offs_k[None, :], mask=m_tk, other=0.0)
    vt = tl.load(v + rows[:, None] * V + cv[None, :], mask=m_tv, other=0.0)
    bt = tl.load(beta + rows, mask=alive, other=0.0)
    tile = offs_k[:, None] * V + cv[None, :]
    S0 = tl.load(h0 + (i_b * H + i_h).to(tl.int64) * K * V + tile)
    qf = qt.to(tl.float32) * scale
    kf = kt.to(tl.float32)
    gf = gt.to(tl.float32)
    vf = vt.to(tl.float32)
    bf = bt.to(tl.float32)
    # state-independent T x T algebra
    gc = tl.cumsum(gf, axis=0)  # log of the cumulative decay c_t
    lower = offs_t[:, None] >= offs_t[None, :]  # i <= t
    strict = offs_t[:, None] > offs_t[None, :]  # i < t
    e = tl.exp(tl.where(lower[:, :, None], gc[:, None, :] - gc[None, :, :], float("-inf")))  # [TP, TP, K]
    ek = e * kf[None, :, :]
    A = tl.where(strict, tl.sum(ek * kf[:, None, :], axis=2), 0.0)
    Bm = tl.sum(ek * qf[:, None, :], axis=2)
    eye = tl.where(offs_t[:, None] == offs_t[None, :], 1.0, 0.0)
    N = bf[:, None] * A  # strictly lower: N^TP = 0
    minv = eye - N
    if TP > 2:
        n2 = _small_mm(N, N)
        minv = _small_mm(minv, eye + n2)
        if TP > 4:
            minv = _small_mm(minv, eye + _small_mm(n2, n2))
    P = minv * bf[None, :]
    R = _small_mm(Bm, P)
    c = tl.exp(gc)
    ck = c * kf
    # delta = P (v - a) and o = b + R (v - a) with a = S0^T (c k), b = S0^T (c q), rearranged so that
    # the state meets two [T, K] matrices and nothing after: delta = P v - S0^T (P ck),
    # o = R v + S0^T (c q - R ck). Everything but the two reductions is state-independent.
    ck_p = tl.sum(P[:, :, None] * ck[None, :, :], axis=1)  # [TP, K]
    cq_r = c * qf - tl.sum(R[:, :, None] * ck[None, :, :], axis=1)
    pv = tl.sum(P[:, :, None] * vf[None, :, :], axis=1)  # [TP, BV]
    rv = tl.sum(R[:, :, None] * vf[None, :, :], axis=1)
    # the state-dependent part: one round of reductions over K, every position at once
    delta = pv - tl.sum(S0[None, :, :] * ck_p[:, :, None], axis=1)  # [TP, BV]
    out = rv + tl.sum(S0[None, :, :] * cq_r[:, :, None], axis=1)
    if RAGGED == 1:  # flattened rows past this sequence belong to the next one
        tl.store(o + rows[:, None] * V + cv[None, :], out.to(o.dtype.element_ty), mask=m_tv)
    else:  # padded positions of a dead sequence tail have q = 0, so their rows are written as 0
        tl.store(o + rows[:, None] * V + cv[None, :], out.to(o.dtype.element_ty),
                 mask=(offs_t[:, None] < T) & (cv[None, :] < V))
    x = kf[:, :, None] * delta[:, None, :]  # [TP, K, BV]: k_t delta_t^T
    if ALL_STATES:
        dec = tl.broadcast_to(tl.exp(gf)[:, :, None], (TP, K, BV))
        _, u = tl.associative_scan((dec, x), axis=0, combine_fn=_decay_scan)
        states = u + c[:, :, None] * S0[None, :, :]
        ptr = hs + rows[:, None, None] * K * V + tile[None, :, :]
        tl.store(ptr, states, mask=alive[:, None, None] & (tile[None, :, :] >= 0))
    else:
        glast = tl.sum(gf, axis=0)  # dead positions carry g = 0
        w = tl.exp(glast[None, :] - gc)  # c_T / c_i
        S = tl.exp(glast)[:, None] * S0 + tl.sum(w[:, :, None] * x, axis=0)
        tl.store(hs + (i_b * H + i_h).to(tl.int64) * K * V + tile, S)


# ----------------------------------------------------------------------------------------------
# argument checks (before any kernel runs)


def _check(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, tile_v, state_layout="kv"):
    """Validate shapes and dtypes; return (N sequences, T positions per call, H, ragged mode)."""
    if state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be one of {STATE_LAYOUTS}, got {state_layout!r}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if K != HEAD_DIM:
        raise ValueError(f"q/k head dim K must be {HEAD_DIM} (K3's KDA head), got K={K}")
    for name, t in (("k", k), ("g", g)):
        if t.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(t.shape)}")
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [B={B}, T={T}, H={H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B={B}, T={T}, H={H}] (one scalar per head), got {tuple(beta.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if cu_seqlens is not None and lengths is not None:
        raise ValueError("give cu_seqlens or lengths, not both")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens, q must be [1, total_tokens, H, K] (flattened), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [N + 1], got "
                             f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
        mode = 1
        if max_seqlen is None:
            # One host read, which also checks the offsets; pass max_seqlen to skip it (needed under
            # graph capture): the caller then promises no sequence is longer and cu_seqlens[-1] == T.
            if _capturing():
                raise ValueError("under graph capture, pass max_seqlen with cu_seqlens (it cannot be read)")
            seq_lens = cu_seqlens[1:] - cu_seqlens[:-1]
            if int(cu_seqlens[0]) != 0 or int(seq_lens.min()) < 0 or int(cu_seqlens[-1]) != T:
                raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the token count {T}, "
                                 f"got {cu_seqlens.tolist()}")
            max_seqlen = int(seq_lens.max())
        steps = max_seqlen
    elif lengths is not None:
        if lengths.dim() != 1 or lengths.numel() != B or lengths.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"lengths must be a 1-D int32/int64 tensor [B={B}], got "
                             f"{lengths.dtype} {tuple(lengths.shape)}")
        N, mode, steps = B, 2, T
        if max_seqlen is not None and max_seqlen != T:
            raise ValueError(f"with lengths, max_seqlen must be the padded length T={T}, got {max_seqlen}")
        if not _capturing() and not (0 <= int(lengths.min()) and int(lengths.max()) <= T):
            raise ValueError(f"lengths must lie in 0..T={T} (the padded length), got {lengths.tolist()}")
    else:
        N, mode, steps = B, 0, T
    if not 1 <= steps <= MAX_POSITIONS:
        raise ValueError(f"T (positions per sequence) must be in 1..{MAX_POSITIONS}, got {steps}")
    if initial_state is not None:
        if initial_state.dtype != torch.float32:
            raise ValueError(f"initial_state must be float32 (the recurrent state is kept in fp32), "
                             f"got {initial_state.dtype}")
        want = (N, H, K, V) if state_layout == "kv" else (N, H, V, K)
        if initial_state.shape != want:
            dims = "K={K}, V={V}" if state_layout == "kv" else "V={V}, K={K}"
            raise ValueError(f"initial_state must be [N={N}, H={H}, {dims.format(K=K, V=V)}] "
                             f"(state_layout {state_layout!r}), got {tuple(initial_state.shape)}")
    if tile_v is not None and (tile_v not in TILE_WIDTHS or V % tile_v):
        raise ValueError(f"tile_v must be one of {TILE_WIDTHS} and divide V={V}, got {tile_v}")
    return N, steps, H, V, mode


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _states_buffer(states_out, shape, device):
    if states_out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if states_out.shape != shape or states_out.dtype != torch.float32 or not states_out.is_contiguous():
        raise ValueError(f"states_out must be a contiguous float32 tensor of shape {shape}, got "
                         f"{states_out.dtype} {tuple(states_out.shape)}")
    return states_out


def _prepare(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, final_state_only, states_out,
             tile_v, zero_outputs=False, state_layout="kv"):
    N, steps, H, V, mode = _check(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, tile_v,
                                  state_layout)
    B, T = q.shape[:2]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    state = (HEAD_DIM, V) if state_layout == "kv" else (V, HEAD_DIM)
    h0 = (torch.zeros(N, H, *state, dtype=torch.float32, device=q.device) if initial_state is None
          else initial_state.contiguous())
    if final_state_only:
        shape = (N, H, *state)
    else:
        shape = (B, T, H, *state)  # ragged: B = 1 and T = total tokens, i.e. one state per token
    hs = _states_buffer(states_out, shape, q.device)
    # the before kernel skips dead padded positions, so their output rows must start at zero
    o = (torch.zeros_like if zero_outputs and mode == 2 else torch.empty_like)(v, dtype=q.dtype)
    seq_info = cu_seqlens if mode == 1 else lengths if mode == 2 else h0  # h0: an unused placeholder
    return q, k, v, g, beta, h0, o, hs, seq_info, N, steps, H, V, mode


# ----------------------------------------------------------------------------------------------
# entry points


def kda_verify(q, k, v, g, beta, initial_state, *, scale=None, cu_seqlens=None, lengths=None, max_seqlen=None,
               final_state_only=False, states_out=None, tile_v=None, num_warps=None, form=None,
               state_layout="kv", pdl=None):
    """Verify T = 1..8 draft positions per sequence (after: narrow tiles where parallelism is short).

    q, k: [B, T, H, 128] (L2-normalised); v: [B, T, H, V]; g: [B, T, H, 128] log-decay (fp32 advised);
    beta: [B, T, H]; initial_state: [N, H, 128, V] float32 (None: zeros). Ragged batches: either
    `cu_seqlens` [N + 1] with tensors flattened to [1, total, ...] (fla's convention; pass
    `max_seqlen` to skip a host read, and under graph capture), or `lengths` [B] with padded
    [B, T, ...] tensors (positions at or past a length: o = 0, state not written).
    Returns (o in q's dtype, shaped like v; states): float32 [B, T, H, 128, V] (ragged:
    [1, total, H, 128, V]) holding the state after each position, or [N, H, 128, V] with
    `final_state_only`. `states_out` writes into a caller buffer of that shape.
    `tile_v`, `num_warps`: None chooses from the device (`choose_tile_v`, `choose_num_warps`); tiles
    up to NARROW_MAX columns run the narrow kernel, wider ones the streaming kernel.
    `state_layout`: 'kv' (states [.., K, V], fla's) or 'vk' ([.., V, K], as `kda_decode` can keep
    them): with 'vk' a tile's K values are contiguous and the narrow kernel computes, loads and stores
    in one register layout (narrow kernel, step and tile forms only).
    `pdl`: launch the CUDA warp form as a programmatic dependent of the stream's previous kernel (it
    waits for that kernel before touching memory, but its launch overlaps that kernel's end); None
    reads K3LAB_KDA_VERIFY_PDL (default off); ignored by the Triton forms."""
    if form is not None and form not in NARROW_FORMS:
        raise ValueError(f"form must be one of {NARROW_FORMS}, got {form!r}")
    (q, k, v, g, beta, h0, o, hs, seq_info, N, steps, H, V, mode) = _prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, final_state_only, states_out, tile_v,
        state_layout=state_layout)
    bv = tile_v or choose_tile_v(N, H, V)
    if state_layout == "vk" and (bv > NARROW_MAX or form in ("chunk", *CUDA_FORMS)):
        raise ValueError(f"state_layout 'vk' runs on the narrow kernel's step and tile forms (tile_v <= "
                         f"{NARROW_MAX}); got tile_v={bv}, form={form!r}")
    if bv > NARROW_MAX:
        if mode == 2:  # the streaming kernel skips padded positions: their output rows start at zero
            o.zero_()
        return _launch_stream(q, k, v, g, beta, h0, o, hs, seq_info, scale, N, H, V, mode, final_state_only, bv,
                              num_warps or choose_num_warps(bv))
    scale = HEAD_DIM ** -0.5 if scale is None else float(scale)
    grid = (V // bv, N * H)
    explicit = form is not None
    form = form or choose_form(q, k, v, g, beta, h0, bv, steps, state_layout)
    if form in CUDA_FORMS:
        from k3lab.ops import kda_verify_cuda as kc

        warps = num_warps or cuda_warps(form, steps)
        if state_layout != "kv":
            raise ValueError(f"form {form!r} keeps the states [.., K, V] (state_layout 'kv'), got {state_layout!r}")
        ok, why = kc.status()
        why = kc.supports(q, k, v, g, beta, h0, bv, warps, form, states=hs) if ok else why
        if why is None:
            kc.launch(q, k, v, g, beta, h0, o, hs, seq_info, n_seq=N, positions=steps, heads=H, mode=mode,
                      all_states=not final_state_only, tile_v=bv, num_warps=warps, form=form, scale=scale,
                      pdl=pdl)
            return o, hs
        if explicit:
            raise ValueError(f"form {form!r} (kernels/kda_verify.cu) cannot run these inputs here: {why}")
        form, num_warps = NARROW_FORM, None  # the default form, refused by these buffers: the Triton step form
    if form == "chunk":
        _verify_chunk_kernel[grid](q, k, v, g, beta, h0, o, hs, seq_info, scale,
                                   T=steps, TP=triton.next_power_of_2(steps), H=H, K=HEAD_DIM, V=V, BV=bv,
                                   RAGGED=mode, ALL_STATES=not final_state_only,
                                   num_warps=num_warps or choose_num_warps(bv, form="chunk", positions=steps))
        return o, hs
    _verify_narrow_kernel[grid](q, k, v, g, beta, h0, o, hs, seq_info, scale,
                                T=steps, H=H, K=HEAD_DIM, V=V, BV=bv, RAGGED=mode,
                                ALL_STATES=not final_state_only, TILE_LOADS=form == "tile",
                                STATE_VK=state_layout == "vk", num_warps=num_warps or choose_num_warps(bv))
    return o, hs


def _launch_stream(q, k, v, g, beta, h0, o, hs, seq_info, scale, N, H, V, mode, final_state_only, bv, warps):
    scale = HEAD_DIM ** -0.5 if scale is None else float(scale)
    grid = (V // bv, N * H)
    _verify_stream_kernel[grid](q, k, v, g, beta, h0, o, hs, seq_info, scale, q.shape[1],
                                H=H, K=HEAD_DIM, V=V, BV=bv, RAGGED=mode, ALL_STATES=not final_state_only,
                                num_warps=warps)
    return o, hs


def kda_verify_before(q, k, v, g, beta, initial_state, *, scale=None, cu_seqlens=None, lengths=None,
                      max_seqlen=None, final_state_only=False, states_out=None, tile_v=BEFORE_TILE_V,
                      num_warps=None):
    """The original verification kernel: 32-column tiles, 128-thread workgroups, run-time length,
    per-token loads (the streaming kernel). Same arguments and results as `kda_verify`."""
    (q, k, v, g, beta, h0, o, hs, seq_info, N, steps, H, V, mode) = _prepare(
        q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, final_state_only, states_out, tile_v,
        zero_outputs=True)
    return _launch_stream(q, k, v, g, beta, h0, o, hs, seq_info, scale, N, H, V, mode, final_state_only, tile_v,
                          num_warps or before_num_warps())


def select_accepted(states: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """The state to keep after verification: states [B, T, H, K, V] (or [.., V, K]), num_accepted [B]
    in 1..T (accepted drafts + the bonus/recovery token) -> [B, H, K, V] (or [B, H, V, K])."""
    if states.dim() != 5:
        raise ValueError(f"states must be [B, T, H, K, V], got {tuple(states.shape)}")
    if num_accepted.shape != states.shape[:1]:
        raise ValueError(f"num_accepted must be [B={states.shape[0]}], got {tuple(num_accepted.shape)}")
    idx = (num_accepted.long() - 1).view(-1, 1, 1, 1, 1).expand(-1, 1, *states.shape[2:])
    return states.gather(1, idx).squeeze(1)


# ----------------------------------------------------------------------------------------------
# reference


def reference_verify(q, k, v, g, beta, initial_state, *, scale=None, cu_seqlens=None, lengths=None,
                     dtype=torch.float64):
    """Per-position outputs and states from k3lab.nn.kda.kda_recurrent, one position at a time, in
    `dtype` (fp64 by default) on the inputs' device. Same layouts as `kda_verify`; ragged positions
    past a length get o = 0 and state = NaN, so a comparison that reads them fails."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    dev = q.device
    cast = [t.detach().to(dtype) for t in (q, k, v, g, beta)]
    o = torch.zeros(B, T, H, V, dtype=dtype, device=dev)
    states = torch.full((B, T, H, K, V), float("nan"), dtype=dtype, device=dev)
    if cu_seqlens is None and lengths is None:  # uniform: the whole batch steps together
        S = (torch.zeros(B, H, K, V, dtype=dtype, device=dev) if initial_state is None
             else initial_state.detach().to(dtype))
        for t in range(T):
            out, S = kda_recurrent(*[x[:, t:t + 1] for x in cast], scale=scale, initial_state=S)
            o[:, t], states[:, t] = out[:, 0], S
        return o, states
    if cu_seqlens is not None:
        bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
        seqs = [(0, a, b - a) for a, b in bounds]  # (batch row, first token, length)
    else:
        seqs = [(i, 0, int(n)) for i, n in enumerate(lengths.tolist())]
    h0 = (torch.zeros(len(seqs), H, K, V, dtype=dtype, device=dev) if initial_state is None
          else initial_state.detach().to(dtype))
    for n, (row, start, length) in enumerate(seqs):
        S = h0[n:n + 1]
        for t in range(start, start + length):
            out, S = kda_recurrent(*[x[row:row + 1, t:t + 1] for x in cast], scale=scale, initial_state=S)
            o[row, t], states[row, t] = out[0, 0], S[0]
    return o, states
