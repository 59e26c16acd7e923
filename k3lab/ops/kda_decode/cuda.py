"""The fused KDA decode step (kernels/kda_decode.cu): one launch per step, intermediates on chip in
fp32, the output written straight into the caller's buffer; only the conv states and S go back to
memory. Built once by k3lab.ops._build and loaded with ctypes; `status()` says whether it runs here.

`FusedStep` packs everything that stays the same from token to token (cache, weights, output buffer,
launch configuration) into the kernel's argument block once; a call rewrites only the six per-token
pointers and launches on the current stream (capturable in a CUDA graph).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from k3lab.ops import _build
from k3lab.ops.kda_decode.inputs import HEAD_DIM


def status() -> tuple[bool, str]:
    """(True, what runs) when the fused kernel can be built and loaded here, else (False, why)."""
    return _build.status("kda_decode")


# (tile_v value columns per block, threads per block) compiled into the library, widest first.
CONFIGS = ((128, 256), (32, 128), (16, 128))
# kernels/kda_decode.cu's Args, field by field (checked against the library's sizeof at load)
_ARGS_FORMAT = (
    "<" + "Q" * 6 + "q" * 6 + "Q" * 3 + "q" * 3 + "Q" * 6 + "Qq" + "Qq" + "QQ" + "ii" + "fff" + "iii"
)
_TOKEN_FORMAT = "<" + "Q" * 6 + "q" * 6  # the leading per-token fields, rewritten every step
_ARGS_SIZE = struct.calcsize(_ARGS_FORMAT)
HINT_STREAM_LOADS, HINT_STREAM_STORES, HINT_PREFETCH_L2 = 1, 2, 4
# How the blocks of a split head exchange their partial sums for the output norm.
SPLIT_MODES = {"whole": 0, "atomic": 1, "cluster": 2}
_LAUNCH_ERRORS = {-1: "no compiled kernel for this (tile_v, threads)",
                  -2: "warp width does not fit the block",
                  -3: "the config needs more shared memory than the device has", -4: "bad sizes",
                  -5: "this split mode is not compiled for this tile width"}


@dataclass
class _Fused:
    lib: ctypes.CDLL
    configs: dict  # (tile_v, threads) -> static shared bytes
    split_modes: set  # names of the split modes this build has
    clusters: bool  # the device runs thread-block clusters (compute capability >= 9)
    warp_size: int
    max_shared: int
    units: int
    l2_bytes: int

    def occupancy(self, tile_v: int, threads: int, state_vk: int, mode: int) -> int:
        return self.lib.k3_kda_decode_occupancy(tile_v, threads, state_vk, mode)


_fused_cache: dict = {}
_workspaces: dict = {}


def load_fused(device) -> _Fused:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    f = _fused_cache.get(idx)
    if f is not None:
        return f
    lib = _build.load("kda_decode")
    lib.k3_kda_decode.restype = ctypes.c_int
    lib.k3_kda_decode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_void_p]
    size = lib.k3_kda_decode_args_size()
    if size != _ARGS_SIZE:
        raise _build.KernelUnavailable(f"kda_decode.cu's Args is {size} bytes but the Python packing is "
                                       f"{_ARGS_SIZE}: the two disagree, rebuild or fix _ARGS_FORMAT")
    buf = (ctypes.c_int * 96)()
    n = lib.k3_kda_decode_configs(buf, 32)
    configs = {(buf[3 * i], buf[3 * i + 1]): buf[3 * i + 2] for i in range(min(n, 32))}
    bits = lib.k3_kda_decode_split_modes()
    modes = {name for name, m in SPLIT_MODES.items() if m and bits & (1 << m)}
    props = torch.cuda.get_device_properties(idx)
    warp = int(getattr(props, "warp_size", 0) or 0)
    if warp <= 0:
        raise _build.KernelUnavailable("torch does not report this GPU's warp/wavefront width")
    max_shared = int(getattr(props, "shared_memory_per_block", 0) or 48 * 1024)
    clusters = _build.clusters_available(idx)[0]
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    f = _Fused(lib, configs, modes, clusters, warp, max_shared, props.multi_processor_count, l2)
    _fused_cache[idx] = f
    return f


SPLIT_TILE = (32, 128)  # a split head: 4 blocks of 32 value columns, 128 threads each
SPLIT_TILE_FINE = (16, 128)  # 8 blocks of 16 columns: where even 8 blocks per head fit on the units


def choose_config(batch: int, heads: int, units: int, warp_size: int = 32, clusters: bool = True
                  ) -> tuple[int, int]:
    """(tile_v, threads) for `batch` x `heads` heads on a device with `units` compute units.

    One head per block (no exchange for the output norm) once the heads alone give half the units
    a block; below that, each head is split over a cluster of blocks so the state moves through
    more units: 8 blocks of 16 value columns when they all fit on the units at once, else 4 of 32.
    Without clusters (the split then needs an atomic exchange through memory) whole heads always.
    The sweep behind the rule, with its figures and records, is in docs/kda_decode.md."""
    whole = (HEAD_DIM, 256)
    if not clusters or batch * heads * 2 >= units:
        tile_v, threads = whole
    elif batch * heads * (HEAD_DIM // SPLIT_TILE_FINE[0]) <= units:
        tile_v, threads = SPLIT_TILE_FINE
    else:
        tile_v, threads = SPLIT_TILE
    if threads % warp_size:
        raise ValueError(f"block size {threads} is not a multiple of the warp width {warp_size}")
    return tile_v, threads


def choose_split(f: _Fused, tile_v: int) -> str:
    """'whole' for a head per block; else clusters where the device and build have them and the
    head's blocks fit a portable cluster (<= 8), else the portable atomic exchange."""
    if tile_v == HEAD_DIM:
        return "whole"
    if "cluster" in f.split_modes and f.clusters and HEAD_DIM // tile_v <= 8:
        return "cluster"
    return "atomic"


def default_hints(batch: int, heads: int, l2_bytes: int) -> int:
    """The L2 prefetch of a later block's state always; streaming (evict-first) loads and stores of S
    once the step's states (B x H x 64 KiB) exceed L2, where keeping them would only evict the
    per-token inputs and weights (docs/kda_decode.md has the timings of each combination)."""
    hints = HINT_PREFETCH_L2
    if batch * heads * HEAD_DIM * HEAD_DIM * 4 > l2_bytes:
        hints |= HINT_STREAM_LOADS | HINT_STREAM_STORES
    return hints


def _workspace(device, n_heads_total: int):
    """Counters (left at zero by every launch) and o slices for heads split across blocks (atomic
    mode); one per device, grown as needed. Launches sharing it must be ordered (one stream/graph)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    ws = _workspaces.get(idx)
    if ws is None or ws[0].numel() < n_heads_total:
        n = max(n_heads_total, 1024)
        ws = (torch.zeros(n, dtype=torch.int32, device=device), torch.empty(n * HEAD_DIM, device=device))
        _workspaces[idx] = ws
    return ws



class FusedStep:
    """The fused kernel bound to one (cache, weights, out): `tile_v` (a compiled width; threads follow
    from CONFIGS), `split` ('whole', 'cluster', 'atomic') and `hints` override what `choose_config`,
    `choose_split` and `default_hints` pick from the device."""

    def __init__(self, cache, weights, out, *, state_layout="kv", tile_v=None, hints=None, split=None):
        S = cache.state
        self.device = S.device
        f = load_fused(self.device)
        B, H = S.shape[0], S.shape[1]
        if tile_v is None:
            tile_v, threads = choose_config(B, H, f.units, f.warp_size,
                                            clusters=f.clusters and "cluster" in f.split_modes)
        else:
            threads = dict(CONFIGS).get(tile_v)
        if (tile_v, threads) not in f.configs:
            raise ValueError(f"tile_v must be one of {sorted(t for t, _ in f.configs)}, got {tile_v}")
        split = choose_split(f, tile_v) if split is None else split
        if split not in SPLIT_MODES or (split == "whole") != (tile_v == HEAD_DIM):
            raise ValueError(f"split must be 'whole' (tile_v={HEAD_DIM}), 'atomic' or 'cluster' (tile_v < "
                             f"{HEAD_DIM}), got {split!r} with tile_v={tile_v}")
        if split == "cluster" and not (f.clusters and "cluster" in f.split_modes and HEAD_DIM // tile_v <= 8):
            raise ValueError("split='cluster' needs a CUDA GPU of compute capability >= 9.0 and tile_v >= 16")
        hints = default_hints(B, H, f.l2_bytes) if hints is None else int(hints)
        # One block per unit ahead in launch order (docs/kda_decode.md); further ahead, prefetched
        # lines are evicted unused.
        ahead = f.units if hints & HINT_PREFETCH_L2 else 0
        self.tile_v, self.threads, self.hints, self.split, self.prefetch_ahead = (
            tile_v,
            threads,
            hints,
            split,
            ahead,
        )
        counters, o_part = _workspace(self.device, B * H) if split == "atomic" else (None, None)
        self._workspace = (counters, o_part)  # held, so it outlives a regrown shared one
        w, c = weights, cache
        self._args = ctypes.create_string_buffer(_ARGS_SIZE)
        struct.pack_into(
            _ARGS_FORMAT, self._args, 0, *([0] * 12),
            c.conv_q.data_ptr(), c.conv_k.data_ptr(), c.conv_v.data_ptr(),
            c.conv_q.stride(0), c.conv_k.stride(0), c.conv_v.stride(0),
            w.conv_q.data_ptr(), w.conv_k.data_ptr(), w.conv_v.data_ptr(), w.A_log.data_ptr(),
            w.dt_bias.data_ptr(), w.o_norm.data_ptr(), S.data_ptr(), S.stride(0), out.data_ptr(),
            out.stride(0),
            counters.data_ptr() if counters is not None else 0, o_part.data_ptr() if o_part is not None
            else 0,
            B, H, float(w.lower_bound), float(w.eps), HEAD_DIM ** -0.5, f.warp_size, hints, ahead)
        self._launch = f.lib.k3_kda_decode
        self._launch_tail = (tile_v, threads, int(state_layout == "vk"), SPLIT_MODES[split], f.max_shared)
        self._dev_index = self.device.index if self.device.index is not None else torch.cuda.current_device()

    def __call__(self, q, k, v, g_raw, beta_raw, gate) -> None:
        """One launch on the current stream; the inputs are already checked by the caller."""
        struct.pack_into(_TOKEN_FORMAT, self._args, 0, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                         g_raw.data_ptr(), beta_raw.data_ptr(), gate.data_ptr(), q.stride(0), k.stride(0),
                         v.stride(0), g_raw.stride(0), beta_raw.stride(0), gate.stride(0))
        rc = self._launch(self._args, *self._launch_tail, _build.stream_handle(self._dev_index))
        if rc != 0:
            raise RuntimeError(f"kda_decode launch failed: {_LAUNCH_ERRORS.get(rc, f'runtime error {rc}')}")
