"""Inputs and launch choices shared by every KDA verification backend: argument checks, buffers,
and the tile width and waves chosen from the device."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3lab import env
from k3lab.ops import capturing, expect, positive_finite

HEAD_DIM = 128  # K3's KDA head dim; the kernels hold one full K = 128 column of the state per lane group
MAX_POSITIONS = 8  # drafts + 1 verified by one call; beyond this, use the chunked prefill path
TILE_WIDTHS = (32, 16, 8, 4)  # value columns per program, widest first
NARROW_MAX = 8  # tiles up to this width run the narrow kernel; wider ones the streaming kernel
BEFORE_TILE_V = 32  # the original kernel's tile
BEFORE_THREADS = 128  # the original kernel's workgroup size, in threads


# ----------------------------------------------------------------------------------------------
# launch choices, from the device


def workgroups(batch: int, heads: int, tile_v: int, v_dim: int = HEAD_DIM) -> int:
    """Programs (workgroups, CTAs) one launch creates: one per (sequence, head, tile of V)."""
    return batch * heads * (v_dim // tile_v)


# The narrowest row segment a tile should write per state row, by backend. NVIDIA's L2 works in
# 32-byte sectors: a 4-column fp32 row (16 B) leaves every sector half written (docs/kda_verify.md
# has the sweep). On AMD the seed's 4-column tiles (16 B) are kept (not yet run on AMD hardware
# by this project); the CPU interpreter has no sectors.
MIN_ROW_BYTES = {"cuda": 32, "rocm": 16, "cpu": 16}
# Programs per compute unit above which a wider tile pays (fewer q/k/g re-reads, fewer instructions).
# The threshold and its sweep are in docs/kda_verify.md.
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


def choose_num_warps(tile_v: int, k_dim: int = HEAD_DIM, wave_width: int | None = None) -> int:
    """Waves per program of the Triton kernels: one wave until a lane would hold more than 32 state
    values (narrow kernel) or 64 (streaming kernel, which keeps fewer vectors per lane). A 128 x 4 or
    128 x 8 fp32 tile is one wave on NVIDIA's 32 lanes and on AMD's 64; so is a 128 x 16 tile in the
    streaming kernel (docs/kda_verify.md, "Waves per program")."""
    wave = wave_width or _wave_width()
    per_lane = 32 if tile_v <= NARROW_MAX else 64
    return max(1, (k_dim * tile_v) // (wave * per_lane))


def before_num_warps(wave_width: int | None = None) -> int:
    """The original kernel's 128-thread workgroup, in waves of this device (4 on NVIDIA, 2 on AMD)."""
    return max(1, BEFORE_THREADS // (wave_width or _wave_width()))


# ----------------------------------------------------------------------------------------------
# argument checks (before any kernel runs)


def check(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, tile_v):
    """Validate shapes and dtypes; return (N sequences, T positions per call, H, V, ragged mode)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        expect(name, t)
    if initial_state is not None:
        expect("initial_state", initial_state, what="(float32) or None")
    expect("q", q, shape=4, what="[B, T, H, K]")
    B, T, H, K = q.shape
    if K != HEAD_DIM:
        raise ValueError(f"q/k head dim K must be {HEAD_DIM} (K3's KDA head), got K={K}")
    for name, t in (("k", k), ("g", g)):
        expect(name, t, shape=q.shape, what=f"q's shape {tuple(q.shape)}")
    expect("v", v, shape=(B, T, H, None), what=f"[B={B}, T={T}, H={H}, V]")
    V = v.shape[-1]
    expect("beta", beta, shape=(B, T, H), what=f"[B={B}, T={T}, H={H}] (one scalar per head)")
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        expect(name, t, dtype="float", device=q.device)  # q's
    if cu_seqlens is not None and lengths is not None:
        raise ValueError("give cu_seqlens or lengths, not both")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int)
                                   or max_seqlen < 1):
        raise ValueError(f"max_seqlen must be a positive int (the longest sequence), got {max_seqlen!r}")
    for name, t in (("cu_seqlens", cu_seqlens), ("lengths", lengths)):
        if t is not None:
            expect(name, t, device=q.device, what="(int32 or int64)")  # q's: the kernels read it
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens, q must be [1, total_tokens, H, K] (flattened), got B={B}")
        expect("cu_seqlens", cu_seqlens, shape=1, dtype=(torch.int32, torch.int64), what="[N + 1]")
        if cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be [N + 1] with N >= 1, got {tuple(cu_seqlens.shape)}")
        N = cu_seqlens.numel() - 1
        mode = 1
        steps = _check_offsets(cu_seqlens, T, max_seqlen)
    elif lengths is not None:
        expect("lengths", lengths, shape=(B,), dtype=(torch.int32, torch.int64), what=f"[B={B}]")
        N, mode, steps = B, 2, T
        if max_seqlen is not None and max_seqlen != T:
            raise ValueError(f"with lengths, max_seqlen must be the padded length T={T}, got {max_seqlen}")
        if not capturing() and not (0 <= int(lengths.min()) and int(lengths.max()) <= T):
            raise ValueError(f"lengths must lie in 0..T={T} (the padded length), got {lengths.tolist()}")
    else:
        N, mode, steps = B, 0, T
        if max_seqlen is not None and max_seqlen != T:
            raise ValueError(f"without cu_seqlens or lengths, max_seqlen must be T={T} (q.shape[1]), "
                             f"got {max_seqlen}")
    if not 1 <= steps <= MAX_POSITIONS:
        raise ValueError(f"T (positions per sequence) must be in 1..{MAX_POSITIONS}, got {steps}")
    if initial_state is not None:  # fp32: the recurrent state is kept in fp32; on q's device
        expect("initial_state", initial_state, dtype=torch.float32)
        expect("initial_state", initial_state, shape=(N, H, K, V), device=q.device,
               what=f"[N={N}, H={H}, K={K}, V={V}]")
    if tile_v is not None and (tile_v not in TILE_WIDTHS or V % tile_v):
        raise ValueError(f"tile_v must be one of {TILE_WIDTHS} and divide V={V}, got {tile_v}")
    return N, steps, H, V, mode


def _check_offsets(cu_seqlens: torch.Tensor, T: int, max_seqlen: int | None) -> int:
    """The positions the kernels compile in for a flattened batch: `max_seqlen`, or the longest
    sequence when it is None. Outside graph capture the offsets are read on the host and checked
    (start at 0, never decrease, end at T) together with the promise `max_seqlen` >= every length:
    the narrow kernel runs exactly `max_seqlen` positions, so a longer sequence would leave its
    later outputs and states unwritten. The read costs one device-to-host copy of N + 1 integers
    (one sync, a few microseconds); graph replay, where that would matter, skips it. Under capture
    nothing can be read: `max_seqlen` is required and is the caller's promise."""
    if capturing():
        if max_seqlen is None:
            raise ValueError("under graph capture, pass max_seqlen with cu_seqlens (it cannot be read)")
        return max_seqlen
    offsets = cu_seqlens.tolist()  # the one host read
    seq_lens = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if offsets[0] != 0 or min(seq_lens) < 0 or offsets[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at the token count {T}, "
                         f"got {offsets}")
    longest = max(seq_lens)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"max_seqlen = {max_seqlen} is shorter than the longest sequence in cu_seqlens "
                         f"({longest}, lengths {seq_lens})")
    return longest if max_seqlen is None else max_seqlen


def check_scale(scale) -> float:
    """The query scale: HEAD_DIM^-0.5 when None, else a positive finite number (ValueError otherwise),
    the rule of the reference (k3lab.nn.kda) and of every backend."""
    return HEAD_DIM ** -0.5 if scale is None else positive_finite("scale", scale)


def states_buffer(states_out, shape, device):
    if states_out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    return expect("states_out", states_out, shape=shape, dtype=torch.float32, device=device, contiguous=True)


@dataclass(frozen=True)
class VerifyInputs:
    """One call's checked, contiguous inputs and output buffers, what every kernel takes (`prepare`).

    q, k, v, g, beta: contiguous; h0 fp32 [N, H, 128, V] (zeros when no initial state); o: the output,
    shaped like v in q's dtype; hs: the states buffer; seq_info: cu_seqlens (mode 1), lengths (mode
    2) or h0 as an unused placeholder (mode 0); n_seq N, positions T (the draft length), heads H,
    v_dim V; mode 0 dense, 1 cu_seqlens, 2 lengths; scale a float; all_states: a state per position."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    h0: torch.Tensor
    o: torch.Tensor
    hs: torch.Tensor
    seq_info: torch.Tensor
    n_seq: int
    positions: int
    heads: int
    v_dim: int
    mode: int
    scale: float
    all_states: bool

    def kernel_args(self) -> tuple:
        """The tensors every launcher takes first: (q, k, v, g, beta, h0, o, hs, seq_info)."""
        return self.q, self.k, self.v, self.g, self.beta, self.h0, self.o, self.hs, self.seq_info

    def common(self) -> dict:
        """The keyword arguments every launcher takes."""
        return {"scale": self.scale, "n_seq": self.n_seq, "heads": self.heads, "mode": self.mode,
                "all_states": self.all_states}


def prepare(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, final_state_only, states_out,
            tile_v, scale=None, zero_outputs=False) -> VerifyInputs:
    """Checked, contiguous inputs and the output buffers every kernel takes (`VerifyInputs`)."""
    scale = check_scale(scale)
    N, steps, H, V, mode = check(q, k, v, g, beta, initial_state, cu_seqlens, lengths, max_seqlen, tile_v)
    B, T = q.shape[:2]
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    state = (HEAD_DIM, V)
    h0 = (torch.zeros(N, H, *state, dtype=torch.float32, device=q.device) if initial_state is None
          else initial_state.contiguous())
    if final_state_only:
        shape = (N, H, *state)
    else:
        shape = (B, T, H, *state)  # ragged: B = 1 and T = total tokens, i.e. one state per token
    hs = states_buffer(states_out, shape, q.device)
    # the before kernel skips dead padded positions, so their output rows must start at zero
    o = (torch.zeros_like if zero_outputs and mode == 2 else torch.empty_like)(v, dtype=q.dtype)
    seq_info = cu_seqlens if mode == 1 else lengths if mode == 2 else h0  # h0: an unused placeholder
    return VerifyInputs(q, k, v, g, beta, h0, o, hs, seq_info, N, steps, H, V, mode, scale,
                        not final_state_only)


# ----------------------------------------------------------------------------------------------
# entry points
