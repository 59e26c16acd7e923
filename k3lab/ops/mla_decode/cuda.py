"""The CUDA backend of the MLA decode: bindings for kernels/mla_decode.cu (the after, split history)
and kernels/mla_decode_before.cu (the before on CUDA cores). Each binding checks the arguments, sizes the
pieces, packs a ctypes Args and launches on the current stream; plans are CUDA-graph capturable.

After (`plan`, one decode token; `plan_verify`, verification groups of 2..8): q [B, 1, H <= 16, 576]
bf16, a bf16 cache contiguous [B, L, 576] or paged (pool [pages, page_size >= 32, 576], block table,
lengths). Returns (o [B, 1, H, 512] bf16, lse [B, 1, H] fp32, natural log). Two forms of the split
kernel, both followed by the merge kernel (launched early by programmatic dependent launch):

* 'mma': the 16 padded heads as one mma.sync tile of rows; 32-row tiles by bulk copies into a
  5-deep ring; one block per SM, four warps.
* 'wgmma' (kernels/mla_decode_wgmma.h): both products on Hopper's warpgroup MMA with positions on M
  (64-row tiles, so no row of the product is padding), tiles and queries as TMA boxes with the
  128-byte swizzle, two 72 KB stages. It needs pages of >= 64 rows that follow each other in memory
  and 16-byte aligned queries (`wgmma_refusal`).

form='auto' (`choose_form`) takes 'wgmma' where each piece holds >= WG_MIN_TILES of its tiles and
'mma' elsewhere: at 1K a piece is one tile and the mma.sync kernel starts sooner. The pieces come
from `inputs.choose_splits` (one wave of blocks). A verification group runs each token as a one-token
request over the same pages, two tokens per block in one product (`plan_verify`).

Before (`plan_before`): q [B, T, H, 576] bf16, one block per query row walking the whole history on
CUDA cores; the history streams through a ring of bulk copies where the rows are dense and 16-byte
aligned (`ring_ok`), else direct loads.

`status()` / `before_status()` say whether each runs here and, if not, why (no GPU, a HIP build,
a GPU older than compute capability 9.0, no nvcc, a failed build). The HIP builds are stubs (no
mma.sync / bulk-copy path on AMD; not yet run on AMD hardware by this project). Figures: docs/mla_padding.md.
The bindings' argument blocks are checked against the library's Args at load; the GPU tests in
tests/test_mla_decode_cuda.py and tests/test_mla_decode_before_cuda.py run them.
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass, field

import torch

from k3lab.ops import _build, expect
from k3lab.ops.mla_decode.inputs import (LATENT_DIM, LOG2E, MAX_Q_LEN, VALUE_DIM, Inputs, LaunchConfig,
                                         check_num_splits, check_scale, choose_splits, validate)

NAME = "mla_decode"
BEFORE_NAME = "mla_decode_before"
MAX_HEADS = 16  # one mma tile of rows
BLOCK_N = 32  # form 'mma': latent rows per tile (kernels/mla_decode.cu, BN)
STAGES = 5  # form 'mma': tiles in its ring (5 x 37 KB: one block per SM, ~150 KB of copies in flight)
WARPS = 4  # form 'mma': one warp per SM sub-partition
WG_BLOCK_N = 64  # form 'wgmma': latent rows per tile (one TMA box height, the M of its score product)
WG_STAGES = 2  # form 'wgmma': tiles of 72 KB in its ring
WG_MIN_TILES = 4  # form='auto' takes 'wgmma' for pieces of at least this many 64-row tiles
FORMS = ("mma", "wgmma")
MAX_SPLITS = 65535
VERIFY_Q_LENS = tuple(range(1, MAX_Q_LEN + 1))  # groups plan_after sends here (pages required for q_len > 1)
BEFORE_WARPS = 16  # kernels/mla_decode_before.cu: warps per block
_STAGE_BYTES = 8 * (4 * LATENT_DIM * 2 + 16)  # 8 blocks of 4 rows, 16 bytes of padding each
_XCH_BYTES = 4 * 4 * 32 * 16  # one score-partial exchange buffer
_ERRORS = {-1: "no such compiled form", -3: "more shared memory than the device allows per block",
           -4: "bad sizes", -5: "this build has no MLA decode kernel (HIP, or not sm_90)",
           -6: "the driver's tensor-map encoder (cuTensorMapEncodeTiled) is unavailable"}


def smem_bytes() -> int:
    """Dynamic shared memory of one block of form 'mma': the ring, two score exchanges, an mbarrier
    per stage (kernels/mla_decode.cu, smem_bytes)."""
    return STAGES * _STAGE_BYTES + 2 * _XCH_BYTES + STAGES * 8


def wg_smem_bytes(tokens: int = 1) -> int:
    """Dynamic shared memory of one block of form 'wgmma' with `tokens` tokens per block: 1 KB of
    alignment slack, two 72 KB tiles, Q^T (18 KB per token), P (2 KB per token), the max and sum
    exchanges (768 bytes per token) and three mbarriers (kernels/mla_decode_wgmma.h, wg_smem_bytes_t)."""
    return 1024 + WG_STAGES * 9 * 64 * 128 + tokens * (9 * 16 * 128 + 16 * 128 + 3 * 4 * 16
                                                       * 4) + (WG_STAGES + 1) * 8


class Args(ctypes.Structure):
    """kernels/mla_decode.cu's k3mla::Args, field by field (its size is checked against the library's)."""

    _fields_ = [("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("lengths", ctypes.c_void_p), ("part_o", ctypes.c_void_p), ("part_lse", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p)] + \
               [(n, ctypes.c_longlong) for n
                in ("q_sb", "q_sh", "kv_sp", "bt_sb", "o_sb", "o_sh", "l_sb")] + \
               [(n, ctypes.c_int) for n in ("B", "heads", "page_shift", "splits", "chunk", "max_pages")] + \
               [("scale_log2", ctypes.c_float), ("q_run", ctypes.c_int), ("q_tq", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the exported launchers' signatures and check the Args layout and the shared-memory
    formulas against the library's; returns lib."""
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    for fn, argtypes in (("k3_mla_decode_supported", []), ("k3_mla_decode_smem", []),
                         ("k3_mla_decode_regs", [i32]), ("k3_mla_wg_smem", [i32]),
                         ("k3_mla_decode", [ctypes.POINTER(Args), i32, i32, ptr]),
                         ("k3_mla_wg_map", [ptr, ptr, ctypes.c_longlong]),
                         ("k3_mla_wg_qmap", [ptr, ptr, i32, i32, i32] + [ctypes.c_longlong] * 3),
                         ("k3_mla_decode_wg", [ctypes.POINTER(Args), ptr, ptr, i32, i32, i32, ptr])):
        getattr(lib, fn).restype = i32
        getattr(lib, fn).argtypes = argtypes
    _build.check_library(lib, NAME, Args, supported=False)
    if lib.k3_mla_decode_supported():
        for what, theirs, ours in (("form 'mma'", lib.k3_mla_decode_smem(), smem_bytes()),
                                   ("form 'wgmma'", lib.k3_mla_wg_smem(1), wg_smem_bytes(1)),
                                   ("form 'wgmma' with two tokens", lib.k3_mla_wg_smem(2), wg_smem_bytes(2))):
            if theirs != ours:
                raise _build.KernelUnavailable(f"{NAME}.cu's {what} needs {theirs} bytes of shared memory "
                                               f"but the Python formula says {ours}")
    return lib


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


def status() -> tuple[bool, str]:
    """(True, what runs) when the after kernel can run here; else (False, why). Builds on first call."""
    ok, why = _build.cuda_status(
        NAME, _library, instead="the Triton kernels of k3lab.ops.mla_decode run instead",
        min_capability=(9, 0),
        needs=" (bulk copies, mbarrier)",
        hip_note=f"has no AMD path (mma.sync and Hopper bulk copies; the HIP build is a stub, "
                 f"{_build.NOT_RUN_ON_AMD})")
    if ok and not _library().k3_mla_decode_supported():
        return False, f"kernels/{NAME}.cu was built without its CUDA path"
    return ok, why


def registers(form: str = "mma") -> int:
    """Registers per thread of a form's split kernel as compiled for this GPU (GPU only)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    n = _library().k3_mla_decode_regs(FORMS.index(form))
    if n < 0:
        raise RuntimeError(f"{NAME}.cu could not report the {form} kernel's registers (error {-n})")
    return n


# ----------------------------------------------------------------------------------------------
# argument checks and the form rule


def _check_layout(q, cache, block_table) -> None:
    """The after kernel's own limits beyond inputs.validate (ValueError by name)."""
    expect("q", q, shape=4, what=f"[B, 1, H, {LATENT_DIM}]")
    if q.shape[1] != 1:
        raise ValueError(f"q_len (q.shape[1]) must be 1: this kernel decodes one token (verification groups "
                         f"run through plan_verify), got {q.shape[1]}")
    if q.shape[3] != LATENT_DIM:
        raise ValueError(f"q's last dim must be the latent width {LATENT_DIM} (512 absorbed nope + 64 rope), "
                         f"got {q.shape[3]}")
    if not 1 <= q.shape[2] <= MAX_HEADS:
        raise ValueError(f"heads (q.shape[2]) must be 1..{MAX_HEADS} (one 16-row mma tile), got {q.shape[2]}")
    expect("q", q, dtype=torch.bfloat16)  # the kernel multiplies bf16 on the matrix units
    expect("cache", cache, shape=(None, None, LATENT_DIM), dtype=torch.bfloat16,
           what=f"[B, L, {LATENT_DIM}] or [num_pages, page_size, {LATENT_DIM}]")
    if cache.stride(2) != 1 or cache.stride(1) != LATENT_DIM:
        raise ValueError(f"cache rows must be contiguous {LATENT_DIM}-element rows (cache.stride(1) == "
                         f"{LATENT_DIM}, cache.stride(2) == 1; a tile of 32 rows is copied in blocks of 4 "
                         f"rows), got strides {tuple(cache.stride())}")
    if block_table is not None and cache.shape[1] < BLOCK_N:
        raise ValueError(f"page size (cache.shape[1]) must be a power of two >= {BLOCK_N} (a {BLOCK_N}-row "
                         f"tile must not cross a page), got {cache.shape[1]}")
    if cache.data_ptr() % 16 or cache.stride(0) % 8:
        raise ValueError("cache must start on a 16-byte boundary and its pages (or requests) too: bulk "
                         "copies move 16-byte units (cache.data_ptr() % 16 == 0, cache.stride(0) % 8 == 0)")
    if q.data_ptr() % 4 or q.stride(0) % 2 or q.stride(2) % 2:
        raise ValueError("q must start on a 4-byte boundary with even batch and head strides (the kernel "
                         "reads pairs of bf16)")


def check(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, form=None) -> Inputs:
    """Every refusal of the after kernel, by name, before anything runs on a device (ValueError).
    Reads `lengths` and the block table on the host once. Returns the validated inputs."""
    _check_layout(q, cache, block_table)
    if form not in (None, "auto") + FORMS:
        raise ValueError(f"form must be 'auto', 'mma', 'wgmma' or None, got {form!r}")
    check_num_splits(num_splits, MAX_SPLITS)
    check_scale(scale)
    if form == "wgmma" and (why := wgmma_refusal(q, cache, block_table)):
        raise ValueError(why)
    return validate(q, cache, lengths, block_table, max_heads=MAX_HEADS)


def wgmma_refusal(q, cache, block_table) -> str | None:
    """Why form 'wgmma' cannot take these (checked) inputs, or None."""
    if block_table is not None and cache.shape[1] < WG_BLOCK_N:
        return (f"form='wgmma' needs pages (cache.shape[1]) of >= {WG_BLOCK_N} rows (its {WG_BLOCK_N}-row "
                f"tile is one TMA box inside a page), got {cache.shape[1]}; form='mma' takes pages of 32")
    if cache.stride(0) != cache.shape[1] * LATENT_DIM:
        return (f"form='wgmma' reads the cache through one tensor map of rows, so pages (or requests) must "
                f"follow each other: cache.stride(0) must be {cache.shape[1] * LATENT_DIM}, got "
                f"{cache.stride(0)}")
    if q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(2) % 8:
        return ("form='wgmma' reads q in 16-byte units: q must start on a 16-byte boundary with batch and "
                f"head strides that are multiples of 8, got strides {tuple(q.stride())}")
    return None


def choose_form(batch: int, max_len: int, compute_units: int, *, refusal: str | None = None,
                num_splits: int | None = None) -> tuple[str, str]:
    """(form, why) for form='auto': 'wgmma' where it applies (`refusal` None) and each piece holds at
    least WG_MIN_TILES of its 64-row tiles; 'mma' elsewhere. Where a piece is one or two tiles the
    whole decode is dominated by start-up, and the mma.sync kernel's 32-row tiles start sooner
    (docs/mla_padding.md)."""
    if refusal is not None:
        return "mma", refusal
    splits, chunk = choose_splits(batch, max_len, compute_units, num_splits=num_splits, block_n=WG_BLOCK_N)
    tiles = chunk // WG_BLOCK_N
    if tiles < WG_MIN_TILES:
        return (
            "mma",
            f"pieces of {tiles} tile(s) of {WG_BLOCK_N} rows (< {WG_MIN_TILES}): the mma kernel starts "
            "sooner",
        )
    return (
        "wgmma",
        f"{splits} piece(s) of {tiles} tiles of {WG_BLOCK_N} rows each: warpgroup MMA on TMA tiles",
    )


# ----------------------------------------------------------------------------------------------
# the after's plans


@dataclass
class CudaDecodePlan:
    """A checked decode, ready to launch: `plan()` runs it and returns (o, lse), the plan's own
    buffers, overwritten by each call (capturable in a CUDA graph: no host sync, no allocation).
    Answers to the attribute names of the Triton plan (variant, grid, programs, num_splits,
    launches, config, facts())."""

    num_splits: int
    chunk: int
    form: str
    form_why: str
    out: torch.Tensor
    lse: torch.Tensor
    _args: Args = field(repr=False)
    _keep: tuple = field(repr=False)  # tensors the raw pointers in _args point into
    _max_shared: int = field(repr=False, default=0)
    _device: int = field(repr=False, default=0)
    # form 'wgmma': the cache's and q's 128-byte CUtensorMaps
    _tensor_map: object = field(repr=False, default=None)
    tokens: int = 1  # 2: each block two consecutive requests that are two tokens of one verification group

    variant = "after"
    backend = "cuda"
    pad = "registers"
    pdl = True
    rows_per_program = MAX_HEADS
    programs_per_unit = 1

    @property
    def programs(self) -> int:
        return self.num_splits * self._args.B // self.tokens

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.num_splits, self._args.B // self.tokens, 1)

    @property
    def heads(self) -> int:
        return self._args.heads

    @property
    def config(self) -> LaunchConfig:
        return (
            LaunchConfig(WG_BLOCK_N, 4, WG_STAGES)
            if self.form == "wgmma"
            else LaunchConfig(BLOCK_N, WARPS, STAGES)
        )

    @property
    def launches(self) -> int:
        return 1 if self.num_splits == 1 else 2

    def facts(self) -> dict:
        cfg = self.config
        return {"backend": "cuda", "form": self.form, "tokens_per_block": self.tokens,
                "num_splits": self.num_splits,
                "chunk": self.chunk, "block_n": cfg.block_n, "num_stages": cfg.num_stages,
                "num_warps": cfg.num_warps, "smem_bytes": wg_smem_bytes(self.tokens) if self.form == "wgmma"
                else smem_bytes(), "programs": self.programs, "launches": self.launches, "pdl": self.pdl,
                "rows_per_program": 16, "form_why": self.form_why}

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        lib = _library()
        stream = ctypes.c_void_p(_build.stream_handle(self._device))
        if self.form == "wgmma":
            rc = lib.k3_mla_decode_wg(ctypes.byref(self._args), ctypes.addressof(self._tensor_map[0]),
                                      ctypes.addressof(self._tensor_map[1]), int(self.pdl), self._max_shared,
                                      self.tokens, stream)
        else:
            rc = lib.k3_mla_decode(ctypes.byref(self._args), int(self.pdl), self._max_shared, stream)
        if rc != 0:
            raise RuntimeError(f"{NAME}.cu refused the {self.form} launch ({rc}: "
                               f"{_ERRORS.get(rc, 'CUDA runtime error')})")
        return self.out, self.lse


def _check_q_group(q, q_group, tokens_per_block: int) -> None:
    src, run = q_group
    if (
        tokens_per_block != 2
        or not isinstance(src, torch.Tensor)
        or src.dim() != 4
        or not isinstance(run, int)
    ):
        raise ValueError("q_group must be (a tensor [G, Tq, H, 576], run) and needs tokens_per_block=2")
    if (src.shape[0] * run != q.shape[0] or not 1 <= src.shape[1] <= run or src.shape[2:] != q.shape[2:]
            or src.dtype != q.dtype or src.device != q.device or src.stride(3) != 1):
        raise ValueError(f"q_group's queries {tuple(src.shape)} with run {run} do not give q's {q.shape[0]} "
                         f"requests of {tuple(q.shape[2:])} ({q.dtype} on {q.device}, last dim contiguous)")


def _tensor_maps(cache, qsrc, heads: int, tq: int, groups: int):
    """The cache's rows and the queries as TMA tensor maps (128-byte boxes, swizzled), for form 'wgmma'."""
    maps = ((ctypes.c_ubyte * 128)(), (ctypes.c_ubyte * 128)())
    lib = _library()
    st_token = qsrc.stride(-3) if tq > 1 else qsrc.stride(0)
    for what, rc in (
        (
            "cache's",
            lib.k3_mla_wg_map(ctypes.addressof(maps[0]), cache.data_ptr(), cache.shape[0] * cache.shape[1]),
        ),
        (
            "queries'",
            lib.k3_mla_wg_qmap(
                ctypes.addressof(maps[1]),
                qsrc.data_ptr(),
                heads,
                tq,
                groups,
                qsrc.stride(-2),
                st_token,
                qsrc.stride(0),
            ),
        ),
    ):
        if rc != 0:
            raise _build.KernelUnavailable(f"{NAME}.cu could not encode the {what} tensor map ({rc}: "
                                           f"{_ERRORS.get(rc, 'driver refused')})")
    return maps


def plan(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, compute_units: int
         | None = None,
         form: str | None = None, tokens_per_block: int = 1, q_group: tuple | None = None) -> CudaDecodePlan:
    """Check once (ValueError by name), then build a launchable plan on the GPU (KernelUnavailable,
    with the reason, where the kernel cannot run). num_splits: None = `choose_splits` for the
    device's SM count (or `compute_units`); form: 'mma', 'wgmma' or None / 'auto' (`choose_form`);
    `plan.form` says which runs and `plan.form_why` why.
    tokens_per_block = 2 (plan_verify): consecutive requests in pairs, each pair two tokens of one
    verification group over the same pages, scored and summed in one product (form 'wgmma').
    q_group = (queries [G, Tq, H, 576], run) with two tokens per block: request r's query is token
    r % run of group r / run, and a token index >= Tq (a group padded to run tokens) reads zeros; q
    then only gives the requests' shape (its data is not read)."""
    if tokens_per_block not in (1, 2):
        raise ValueError(f"tokens_per_block must be 1 or 2, got {tokens_per_block!r}")
    if q_group is not None:
        _check_q_group(q, q_group, tokens_per_block)
    if tokens_per_block == 2:
        if form not in (None, "auto", "wgmma"):
            raise ValueError(f"tokens_per_block=2 runs form 'wgmma' only, got form={form!r}")
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] % 2:
            raise ValueError(f"tokens_per_block=2 needs an even batch of token requests, got q.shape[0] = "
                             f"{q.shape[0]}")
        form = "wgmma"
    inp = check(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits, form=form)
    ok, why = status()
    if not ok:
        raise _build.KernelUnavailable(f"{NAME}.cu cannot run here: {why}")
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    units = compute_units or props.multi_processor_count
    form_why = f"form={form!r} asked" if tokens_per_block == 1 else "two tokens per block need 'wgmma'"
    if form in (None, "auto"):
        form, form_why = choose_form(inp.batch, inp.max_len, units,
                                     refusal=wgmma_refusal(q, cache, block_table),
                                     num_splits=num_splits)
    max_shared = int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)
    need = wg_smem_bytes(tokens_per_block) if form == "wgmma" else smem_bytes()
    if need > max_shared:
        raise _build.KernelUnavailable(f"the {form} kernel needs {need} bytes of shared memory per block; "
                                       f"this GPU allows {max_shared}")
    per_unit = int(getattr(props, "shared_memory_per_multiprocessor", 0) or max_shared)
    splits, chunk = choose_splits(inp.batch // tokens_per_block, inp.max_len, units,
                                  # the driver keeps 1 KB per block
                                  blocks_per_unit=max(1, per_unit // (need + 1024)),
                                  num_splits=num_splits, block_n=WG_BLOCK_N if form == "wgmma" else BLOCK_N,
                                  max_splits=MAX_SPLITS)
    B, H = inp.batch, inp.heads
    out = torch.empty(B, 1, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, 1, H, dtype=torch.float32, device=q.device)
    part_o = torch.empty(B, H, splits, VALUE_DIM, dtype=torch.float32,
                         device=q.device) if splits > 1 else None
    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device) if splits > 1 else None
    bt = inp.block_table if inp.paged else None

    def ptr(t):
        return t.data_ptr() if t is not None else None

    args = Args(q.data_ptr(), cache.data_ptr(), ptr(bt), inp.lengths.data_ptr(), ptr(part_o), ptr(part_lse),
                out.data_ptr(), lse.data_ptr(), q.stride(0), q.stride(2), cache.stride(0),
                bt.stride(0) if bt is not None else 0, out.stride(0), out.stride(2), lse.stride(0),
                B, H, int(math.log2(inp.page_size)) if inp.paged else 30, splits, chunk,
                bt.shape[1] if bt is not None else 0, check_scale(scale) * LOG2E, 1, 1)
    tensor_map = None
    if form == "wgmma":
        qsrc, tq, groups = (q[:, 0], 1, B) if q_group is None else (q_group[0], q_group[0].shape[1],
                                                                    q_group[0].shape[0])
        if q_group is not None:
            args.q, args.q_run, args.q_tq = q_group[0].data_ptr(), q_group[1], tq
        tensor_map = _tensor_maps(cache, qsrc, H, tq, groups)
    keep = (q, cache, bt, inp.lengths, part_o, part_lse, out, lse, q_group)
    return CudaDecodePlan(splits, chunk, form, form_why, out, lse, args, keep, max_shared, dev, tensor_map,
                          tokens_per_block)


class VerifyAsRequestsPlan:
    """A verification group of q_len tokens run by the one-token kernel: token t of request b becomes
    request b * q_len + t, reading the same pages with length lengths[b] - q_len + 1 + t (so each
    token sees its own prefix: causal inside the group). Two tokens per block share each tile in one
    product (inner.tokens == 2); an odd group is then padded to an even one (padded_len) by a token
    whose query reads as zeros and whose output is dropped, as the padded heads' are. With a block per
    token the group's blocks read the same tiles at about the same time, so DRAM serves each tile once
    and L2 the rest. Calling it returns (o [B, q_len, H, 512], lse [B, q_len, H]) as views of the inner
    plan's buffers (strided when the group was padded)."""

    def __init__(self, inner: CudaDecodePlan, batch: int, q_len: int, padded_len: int, keep: tuple):
        self.inner, self.batch, self.q_len, self.padded_len, self._keep = (
            inner,
            batch,
            q_len,
            padded_len,
            keep,
        )

    def __getattr__(self, name):  # the inner plan's attributes (form, num_splits, programs, ...)
        return getattr(self.inner, name)

    def facts(self) -> dict:
        share = "pairs" if self.inner.tokens == 2 else "l2"
        return dict(self.inner.facts(), verify="tokens as requests", share=share, q_len=self.q_len,
                    padded_q_len=self.padded_len)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = self.inner()
        H, T = o.shape[2], self.padded_len
        o, lse = o.view(self.batch, T, H, VALUE_DIM), lse.view(self.batch, T, H)
        return (o, lse) if T == self.q_len else (o[:, :self.q_len], lse[:, :self.q_len])


def plan_verify(q, cache, lengths, *, block_table, scale=None, num_splits=None, compute_units: int
                | None = None,
                form: str | None = None, share: str | None = None) -> VerifyAsRequestsPlan:
    """Plan a verification group (q [B, q_len >= 1, H, 576], a paged cache) on the after kernel,
    each token as its own one-token request over the same pages (VerifyAsRequestsPlan). share: how
    the tokens share a tile: 'pairs' (two tokens per block in one product, N = 32: a tile read once
    per pair; an odd q_len is padded by one token whose query reads zeros), 'l2' (a block per token:
    DRAM serves a tile once and L2 once per further token), or None = 'pairs' from q_len 2 up, 'l2'
    for one token. Refusals by name as in `check`, plus: a paged cache and lengths are required."""
    if share not in (None, "pairs", "l2"):
        raise ValueError(f"share must be 'pairs', 'l2' or None, got {share!r}")
    expect("q", q, shape=4, what=f"[B, q_len, H, {LATENT_DIM}]")
    if block_table is None or lengths is None:
        raise ValueError("plan_verify needs a paged cache: block_table= and lengths= (each token becomes a "
                         "request over the same pages)")
    inp = validate(q, cache, lengths, block_table)  # q_len, lengths >= q_len, pages in the pool
    B, Tq = inp.batch, inp.q_len
    pairs = share == "pairs" or (share is None and Tq >= 2)
    Tp = Tq + (pairs and Tq % 2)  # tokens per group as run: an odd group of pairs gets one more (zero query)
    steps = torch.arange(Tp, dtype=torch.int32, device=q.device).clamp(max=Tq - 1)
    token_lengths = (inp.lengths[:, None] - Tq + 1 + steps[None, :]).reshape(-1).contiguous()
    token_table = inp.block_table.repeat_interleave(Tp, dim=0).contiguous()
    if Tp == Tq:
        token_q, q_group = q.contiguous().view(B * Tq, 1, q.shape[2], q.shape[3]), None
    # the kernel reads each token's query from q itself (the extra token reads zeros): this only has the shape
    else:
        token_q, q_group = torch.as_strided(q, (B * Tp, 1, q.shape[2], q.shape[3]),
                                            (0, 0, q.stride(2), 1)), (q, Tp)
    inner = plan(token_q, cache, token_lengths, block_table=token_table, scale=scale, num_splits=num_splits,
                 compute_units=compute_units, form=form, tokens_per_block=2 if pairs else 1, q_group=q_group)
    return VerifyAsRequestsPlan(inner, B, Tq, Tp, (q, token_q, token_lengths, token_table))


def after_refusal(q, cache, lengths=None, block_table=None) -> str | None:
    """Why `plan_after` would not send these inputs to this backend (None: it would); no device work
    beyond the host reads of validation. One token: `check`'s rules; a verification group: a paged
    cache and every token's checks."""
    try:
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[1] > 1:
            if block_table is None:
                return (
                    "verification groups run on this backend only over a paged cache (tokens share its pages)"
                )
            check(q[:, :1], cache, None if lengths is None else torch.as_tensor(lengths) - q.shape[1] + 1,
                  block_table=block_table)
        else:
            check(q, cache, lengths, block_table=block_table)
    except ValueError as exc:
        return str(exc)
    return None


# ----------------------------------------------------------------------------------------------
# the before on CUDA cores (kernels/mla_decode_before.cu)


class BeforeArgs(ctypes.Structure):
    """kernels/mla_decode_before.cu's k3mb::Args, field by field (its size is checked against the
    library's)."""

    _fields_ = (
        [
            ("q", ctypes.c_void_p),
            ("kv", ctypes.c_void_p),
            ("block_table", ctypes.c_void_p),
            ("lengths", ctypes.c_void_p),
            ("out", ctypes.c_void_p),
            ("lse", ctypes.c_void_p),
        ]
        + [
            (n, ctypes.c_longlong)
            for n in (
                "q_sb",
                "q_st",
                "q_sh",
                "kv_sp",
                "kv_sr",
                "bt_sb",
                "o_sb",
                "o_st",
                "o_sh",
                "l_sb",
                "l_st",
            )
        ]
        + [(n, ctypes.c_int) for n in ("B", "T", "H", "page_shift")]
        + [("scale_log2", ctypes.c_float), ("ring", ctypes.c_int)]
    )


def bind_before(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the before launcher's signature and check the Args layout; returns lib."""
    lib.k3_mla_decode_before.restype = ctypes.c_int
    lib.k3_mla_decode_before.argtypes = [ctypes.POINTER(BeforeArgs), ctypes.c_void_p]
    lib.k3_mla_decode_before_has_ring.restype = ctypes.c_int
    return _build.check_library(lib, BEFORE_NAME, BeforeArgs, supported=False)


@functools.cache
def _before_library() -> ctypes.CDLL:
    return bind_before(_build.load(BEFORE_NAME))


def before_status() -> tuple[bool, str]:
    """(True, what runs) when the before kernel can run here; else (False, why). Builds on first call."""
    return _build.cuda_status(BEFORE_NAME, _before_library, instead="the Triton before kernel runs instead")


def check_before(q, cache, lengths=None, *, block_table=None) -> Inputs:
    """inputs.validate plus the before kernel's own limits (bf16, 4-byte aligned rows); ValueError by
    name. Returns the validated inputs."""
    inp = validate(q, cache, lengths, block_table)
    expect("q", q, dtype=torch.bfloat16)  # the CUDA before kernel reads bf16 pairs
    if cache.stride(1) % 2 or cache.stride(0) % 2 or cache.data_ptr() % 4:
        raise ValueError("cache rows must start on 4-byte boundaries (even strides): the kernel reads bf16 "
                         "pairs")
    if q.stride(0) % 2 or q.stride(1) % 2 or q.stride(2) % 2 or q.data_ptr() % 4:
        raise ValueError("q rows must start on 4-byte boundaries (even strides): the kernel reads bf16 pairs")
    return inp


def ring_ok(cache) -> bool:
    """Whether the ring kernel can bring this cache's rows in: a CUDA build, rows dense (576 elements
    apart) and every page or request starting on a 16-byte boundary (what bulk copies need). Else
    the direct kernel loads them, whatever their layout."""
    return (bool(_before_library().k3_mla_decode_before_has_ring()) and cache.stride(-2) == LATENT_DIM
            and cache.stride(0) % 8 == 0 and cache.data_ptr() % 16 == 0)


class BeforePlan:
    """A checked before decode, ready to launch; calling it returns (o, lse), the plan's own buffers
    (no host sync, no allocation: capturable in a CUDA graph)."""

    variant = "before"
    backend = "cuda"
    num_splits = 1
    launches = 1
    pad = "none"
    rows_per_program = 1
    config = LaunchConfig(64, BEFORE_WARPS, 3)  # the ring kernel: 64-row tiles (4 per warp step), 3 in flight

    def __init__(self, args: BeforeArgs, out, lse, keep: tuple, device: int):
        self._args, self.out, self.lse, self._keep, self._device = args, out, lse, keep, device

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self._args.H, self._args.T, self._args.B)

    @property
    def programs(self) -> int:
        return self._args.B * self._args.T * self._args.H

    @property
    def rows_via(self) -> str:
        """'ring' (the history streams through shared memory by bulk copies) or 'direct' (loads)."""
        return "ring" if self._args.ring else "direct"

    def facts(self) -> dict:
        return {"backend": "cuda", "programs": self.programs, "num_warps": BEFORE_WARPS,
                "rows_per_program": 1,
                "rows_via": self.rows_via, "num_splits": 1, "launches": 1}

    def __call__(self):
        rc = _before_library().k3_mla_decode_before(ctypes.byref(self._args),
                                             ctypes.c_void_p(_build.stream_handle(self._device)))
        if rc != 0:
            raise RuntimeError(f"{BEFORE_NAME}.cu refused the launch ({rc})")
        return self.out, self.lse


def plan_before(q, cache, lengths=None, *, block_table=None, scale=None, ring: bool
                | None = None) -> BeforePlan:
    """Check once (ValueError by name), then a launchable plan on the GPU (KernelUnavailable where the
    kernel cannot run). ring: None = the ring kernel where `ring_ok(cache)`, else the direct one;
    False = the direct kernel; True = the ring kernel or a ValueError saying why it cannot."""
    if ring not in (None, True, False):
        raise ValueError(f"ring must be None, True or False, got {ring!r}")
    inp = check_before(q, cache, lengths, block_table=block_table)
    s = check_scale(scale)
    ok, why = before_status()
    if not ok:
        raise _build.KernelUnavailable(why)
    if ring and not ring_ok(cache):
        raise ValueError("ring=True needs cache rows 576 elements apart and pages (or requests) on 16-byte "
                         f"boundaries; got strides {tuple(cache.stride())}, data_ptr % 16 = "
                         f"{cache.data_ptr() % 16}")
    use_ring = ring_ok(cache) if ring is None else ring
    B, T, H = inp.batch, inp.q_len, inp.heads
    out = torch.empty(B, T, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
    bt = inp.block_table if inp.paged else None
    args = BeforeArgs(q.data_ptr(), cache.data_ptr(), bt.data_ptr() if bt is not None else None,
                      inp.lengths.data_ptr(), out.data_ptr(), lse.data_ptr(), q.stride(0), q.stride(1),
                      q.stride(2),
                      cache.stride(0), cache.stride(1), bt.stride(0) if bt is not None else 0, out.stride(0),
                      out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), B, T, H,
                      int(math.log2(inp.page_size)) if inp.paged else 0, s * LOG2E, int(use_ring))
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return BeforePlan(args, out, lse, (q, cache, bt, inp.lengths, out, lse), dev)
