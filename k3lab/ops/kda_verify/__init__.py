"""KDA speculative verification: T = 1..8 draft positions per sequence, in one launch (seed section 5).

A verification step runs the KDA recurrence (k3lab.nn.kda.kda_recurrent) over a few draft tokens
and keeps the state after *every* position, so that when the sampler accepts only the first j drafts
the server rolls back to state j without recomputing (`select_accepted`).

* `kda_verify_before`: the shape of the original kernel (Triton streaming kernel): one program per
  (sequence, head, 32 value columns), 128-thread workgroups, the token loop's length read at run
  time and each token's inputs loaded inside it, so every position waits for its own memory round
  trip. At TP8 (12 heads) one sequence makes 48 programs for 132 SMs (H200) or 256 CUs (MI355X).
* `kda_verify` (after): the seed's four changes. Narrow tiles (8 value columns on NVIDIA, whose L2
  works in 32-byte sectors; 4 on AMD, the seed's), chosen from batch x heads against the device's
  compute units (`choose_tile_v`); few waves per program; the length a compile-time constant
  (ragged batches keep a masked path); every position's inputs loaded, and exp(g), d k, d q, q.k and
  beta v computed, before the recurrence. When batch x heads already fills the device,
  `choose_tile_v` returns a wide tile and the streaming kernel runs it.

Backends of the narrow path (`BACKENDS`, k3lab.ops' contract: first available by priority; `backend=`
or K3LAB_KDA_VERIFY_BACKEND=cuda|triton|torch forces one, and a forced backend that cannot run the inputs is
an error):

* 'cuda' (`k3lab.ops.kda_verify.cuda`, kernels/kda_verify.cu): a lane mapping Triton will not choose
  (lane pairs own 4 columns of 2 key rows, 4 warps per 8-column tile, 16-byte state loads and stores),
  launched as a programmatic dependent of the previous kernel on compute capability 9.0+ (`pdl=`,
  K3LAB_KDA_VERIFY_PDL). CUDA devices only; inputs it does not take (V != 128, other dtypes,
  misaligned buffers, tiles other than 8) run the Triton kernel instead unless 'cuda' was forced.
* 'triton' (`k3lab.ops.kda_verify.triton`): the narrow kernel; everywhere (CPU through Triton's
  interpreter; ROCm: not yet run on AMD hardware by this project).
* 'torch' (`reference.reference_into`): the plain-PyTorch reference in fp32, the before and the after
  alike; any device; last in priority, so it runs when forced.

Shapes: q, k [B, T, H, 128] (L2-normalised), v [B, T, H, V], g [B, T, H, 128] log-decay (fp32
advised), beta [B, T, H], initial_state fp32 [N, H, 128, V]. States come back fp32 [B, T, H, 128, V]
(ragged: [1, total_tokens, H, 128, V]) or, with `final_state_only`, [N, H, 128, V]. Figures and the
forms that lost: docs/kda_verify.md; records: profiles/<device>/kda_verify/.

Values are not read (no host sync on the decode path, and none is possible under graph capture): the
kernels run the recurrence position by position, so a NaN or infinity in one position's q, k, v, g or
beta reaches that position's output and the states from it on, and never an earlier position, another
head or another sequence (tests/test_bad_inputs_values.py checks this on every backend). The sampler
then rejects that draft and everything after it.
"""

from __future__ import annotations

from k3lab import env
from k3lab.ops import Backend, Backends, triton_status
from k3lab.ops.kda_verify import cuda, triton
from k3lab.ops.kda_verify.inputs import (
    BEFORE_THREADS,
    BEFORE_TILE_V,
    HEAD_DIM,
    MAX_POSITIONS,
    MIN_ROW_BYTES,
    NARROW_MAX,
    PROGRAMS_PER_UNIT,
    TILE_WIDTHS,
    before_num_warps,
    choose_num_warps,
    choose_tile_v,
    VerifyInputs,
    min_tile_v,
    prepare,
    workgroups,
)
from k3lab.ops.kda_verify.reference import reference_into, reference_verify, select_accepted

__all__ = [
    "BACKENDS", "BACKEND_ENV", "BEFORE_THREADS", "BEFORE_TILE_V", "HEAD_DIM", "MAX_POSITIONS",
    "MIN_ROW_BYTES", "NARROW_MAX", "PROGRAMS_PER_UNIT", "TILE_WIDTHS", "before_num_warps", "choose_num_warps",
    "choose_tile_v", "kda_verify", "kda_verify_before", "min_tile_v",
    "VARIANTS", "VerifyInputs", "reference_verify", "select_accepted", "workgroups",
]


def _cuda_available() -> tuple[bool, str]:
    if env.detect().backend != "cuda":
        return False, f"not a CUDA device ({env.detect().backend}): the Triton kernel runs instead"
    return cuda.available()


def _stream(x: VerifyInputs, tile_v: int, num_warps: int | None) -> tuple:
    triton.launch_stream(*x.kernel_args(), v_dim=x.v_dim, tile_v=tile_v,
                         num_warps=num_warps or choose_num_warps(tile_v), **x.common())
    return x.o, x.hs


def _cuda_after(x: VerifyInputs, tile_v: int, num_warps: int | None, pdl) -> tuple:
    if num_warps not in (None, cuda.NUM_WARPS):
        raise ValueError(f"num_warps: the CUDA kernel runs {cuda.NUM_WARPS} warps per tile, got {num_warps}")
    cuda.launch(*x.kernel_args(), positions=x.positions, pdl=pdl, **x.common())
    return x.o, x.hs


def _triton_after(x: VerifyInputs, tile_v: int, num_warps: int | None, pdl) -> tuple:
    if tile_v > NARROW_MAX:  # a wide tile: the device is already full, the streaming kernel runs it
        if x.mode == 2:  # the streaming kernel skips padded positions: their output rows start at zero
            x.o.zero_()
        return _stream(x, tile_v, num_warps)
    triton.launch_narrow(*x.kernel_args(), positions=x.positions, v_dim=x.v_dim, tile_v=tile_v,
                         num_warps=num_warps or choose_num_warps(tile_v), **x.common())
    return x.o, x.hs


def _triton_before(x: VerifyInputs, tile_v: int, num_warps: int | None, pdl) -> tuple:
    return _stream(x, tile_v, num_warps or before_num_warps())


# verify: (q, k, v, g, beta, initial_state, tile_v, states=None) -> (ok, why). Callables (on `prepare`d
# inputs): after(x, tile_v, num_warps, pdl) the narrow kernel (Triton: the streaming one for tiles wider
# than NARROW_MAX, where the device is full already; the CUDA kernel takes 8-column tiles only); before(x,
# ...) the streaming kernel; 'torch' the reference, before and after alike, on any device.
BACKENDS = Backends("kda_verify",
                    Backend("cuda", 0, _cuda_available, cuda.verify, parts={"after": _cuda_after}),
                    Backend("triton", 1, triton_status,
                            parts={"after": _triton_after, "before": _triton_before}),
                    Backend("torch", 2, lambda: (True, "the PyTorch reference (kda_recurrent in fp32)"),
                            parts={"after": reference_into, "before": reference_into}))
BACKEND_ENV = BACKENDS.env


def kda_verify(q, k, v, g, beta, initial_state, *, scale=None, cu_seqlens=None, lengths=None, max_seqlen=None,
               final_state_only=False, states_out=None, tile_v=None, num_warps=None, backend=None, pdl=None):
    """Verify T = 1..8 draft positions per sequence (after: narrow tiles where parallelism is short).

    Ragged batches: either `cu_seqlens` [N + 1] with tensors flattened to [1, total, ...] (fla's
    convention; `max_seqlen`, at least the longest sequence, is checked against cu_seqlens by one host
    read outside graph capture and required under it), or `lengths` [B] with
    padded [B, T, ...] tensors (positions at or past a length: o = 0, state not written).
    Returns (o in q's dtype, shaped like v; states), see the module docstring; `states_out` writes the
    states into a caller buffer of that shape.
    `tile_v`: None chooses from the device (`choose_tile_v`); tiles up to NARROW_MAX columns run the
    narrow path, wider ones the streaming kernel. `num_warps`: waves per program of the Triton kernels
    (None: `choose_num_warps`); the CUDA kernel always runs 4 warps per tile. `backend`: force 'cuda'
    (8-column tiles), 'triton' or 'torch' (the reference). `pdl`: the CUDA kernel as a programmatic
    dependent launch (None: on where supported, or as K3LAB_KDA_VERIFY_PDL says)."""
    x = prepare(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, final_state_only,
                states_out, tile_v, scale)
    bv = tile_v or choose_tile_v(x.n_seq, x.heads, x.v_dim)
    row = BACKENDS.pick(backend, x.q, x.k, x.v, x.g, x.beta, x.h0, bv, states=x.hs, need="after")
    return row.after(x, bv, num_warps, pdl)


def kda_verify_before(q, k, v, g, beta, initial_state, *, scale=None, cu_seqlens=None, lengths=None,
                      max_seqlen=None, final_state_only=False, states_out=None, tile_v=BEFORE_TILE_V,
                      num_warps=None):
    """The original verification kernel: 32-column tiles, 128-thread workgroups, run-time length,
    per-token loads (the streaming kernel). Same arguments and results as `kda_verify`."""
    x = prepare(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, final_state_only,
                states_out, tile_v, scale, zero_outputs=True)
    row = BACKENDS.pick(None, x.q, x.k, x.v, x.g, x.beta, x.h0, tile_v, states=x.hs, need="before")
    return row.before(x, tile_v, num_warps, None)


VARIANTS = {"before": kda_verify_before, "after": kda_verify}
