"""Binding for kernels/mla_decode.cu, the hand-written split-history MLA decode (one job: check the
arguments, size the pieces, pack the arguments, launch on the current stream).

The default after for one-token bf16 decodes on NVIDIA sm_90 with nvcc: `mla_decode.plan_after`
returns this module's plan there (`mla_decode.cuda_after_status` says whether it does, and why not);
the Triton kernels run everywhere else. Verification groups of 2 to 8 tokens run here too (`plan_verify`). Checked on an H200; figures
and the probe's findings are in kernels/mla_decode.cu's header and profiles/nvidia-h200/mla_padding.

Same semantics as `mla_decode.reference` for one decode token: q [B, 1, H <= 16, 576] bf16, a bf16
latent cache that is contiguous [B, L, 576] or paged (pool [pages, page_size >= 32, 576] with an
integer block table and per-request lengths), softmax scale (default 192^-0.5). Returns
(o [B, 1, H, 512] bf16, lse [B, 1, H] fp32, natural log). A verification group (q_len > 1, causal)
runs here only through `plan_verify`, each token as a one-token request over the same pages; the wgmma
form can take two such requests per block (`tokens_per_block=2`: both tokens' 16 heads as the 32 columns
of one product, so the pair reads each tile once).

How the kernel is built and why is in its header: the 16 padded heads are one mma.sync tile of
rows; tiles of 32 latent rows arrive by bulk copies (Hopper's copy engine) into a 5-deep ring in
shared memory; one block per SM and one block-wide barrier per tile. The history of each request
is cut into `num_splits` pieces (one block each, `choose_splits` fills the SMs once); the pieces'
fp32 partials [B, H, splits, 512] and base-2 log-sum-exps [B, H, splits] (the layout of
mla_decode.py's `_store_piece`) are merged by a second kernel, launched early (programmatic
dependent launch); with one piece the first kernel writes the result itself.

Form 'wgmma' (kernels/mla_wgmma.h): the same split-and-merge decode with both products on Hopper's
warpgroup MMA, positions on M (64-row tiles, so no row of the product is padding) and tiles and
queries fetched as TMA boxes with the 128-byte swizzle, in two 72 KB stages. It needs pages of >= 64
rows (or a contiguous cache) that follow each other in memory, and 16-byte aligned queries
(`wgmma_refusal`). form='auto' (the default, `choose_form`) takes it where each piece holds >= 4 of its
tiles: on the H200 (e3fdbef, same run) 18.1 against 19.9 us at 32K, 45.8 against 47.4 at 128K, 199
against 216 at 64 x 8K (168 against 165 since the pieces fill one wave, 083abc8), but 8.6 against 7.0 at
1K, where a piece is one tile. With the merge kernel's shorter latency chain (74f98a3, the main records):
17.4 against 19.4 us at 32K (51% of the copy bandwidth), 45.0 against 47.1 at 128K (79%); with lazy
softmax references in the wgmma form (01aba0b) 17.1 (52%) and 44.9 (79%); with the tile map's L2
promotion at 128 bytes and partials stored from the accumulators (20255de, the main records) 16.9 (53%),
43.3 (82%) and 156 us at 64 x 8K (91%; the split kernel 166 in the same call).

Form 'halves' (kernels/mla_halves.h, opt-in): two teams of four warps on alternate 32-row tiles,
each warp half of its team's positions times half of the columns, with its own online softmax, so
only 1 KB of partial scores per warp is exchanged and six bulk-copy stages fit. Right on the H200
and the fastest form at 64 x 8K while that case ran in 1.45 waves (184 against 217 us for the split
kernel and 200 for wgmma, fe78661; level with them in one wave: 164 / 165 / 168 us, 083abc8), slower
at B = 1 (22.3 us at 32K, 49.7 at 128K), so 'auto' does not pick it.

The fused form (merge='fused' or 'auto', or K3LAB_MLA_MERGE=fused / auto; opt-in): the split
kernel merges the pieces itself after a grid-wide barrier, one cooperative launch
(cudaLaunchAttributeCooperative: the runtime refuses a grid that cannot be all resident, so the
barrier never relies on luck). It applies where B x splits blocks fit the co-resident capacity (the
occupancy API x SMs: 132 on the H200) and the launch survives CUDA-graph capture with its attribute
(checked once per process); 'auto' takes the merge kernel elsewhere and `plan.merge_why` says why,
'fused' refuses. On the H200 it is right (GPU tests, 50 graph replays at 128K, PDL launches around
it) but not faster: 7.72 / 19.97 / 47.95 us at 1K / 32K / 128K and 28.80 us at B = 8 x 8K against
the two-kernel form's 6.71 / 19.80 / 47.76 / 28.61 in the same run (commit a13fe58; kernels/
mla_decode.cu's header says why), so DEFAULT_MERGE stays 'kernel'.

`status()` says whether it can run here and, if not, why (no GPU, a HIP build, a GPU older than
compute capability 9.0, no nvcc, or a failed build). The HIP build of the source is a stub whose
launcher returns an error (no mma.sync / bulk-copy path on AMD; not yet run on AMD hardware by this
project).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
from dataclasses import dataclass, field

import torch

from k3lab.ops import _build
from k3lab.ops import mla_decode as mla

NAME = "mla_decode"
LATENT_DIM = mla.LATENT_DIM  # 576
VALUE_DIM = mla.VALUE_DIM  # 512
MAX_HEADS = 16  # one mma tile of rows
BLOCK_N = 32  # latent rows per tile (kernels/mla_decode.cu, BN)
STAGES = (3, 4, 5)  # compiled ring depths
DEFAULT_STAGES = 5  # 5 x 37 KB in shared memory: one block per SM, ~150 KB of copies in flight
WARPS = (4, 8)  # compiled block sizes: 4 warps (one per SM sub-partition) or 8 (two each)
DEFAULT_WARPS = 4
MAX_SPLITS = 65535
# the team kernel (2 teams of 4 warps on one ring), the 4/8-warp mma.sync split kernel, the split kernel on
# warpgroup MMA with TMA tiles of 64 rows (kernels/mla_wgmma.h), or two teams of warps each owning half the
# positions x half the columns (kernels/mla_halves.h)
FORMS = ("team", "split", "wgmma", "halves")
# 'auto' (the default; K3LAB_MLA_FORM overrides it): 'wgmma' where it applies and each piece holds at least
# WG_MIN_TILES of its 64-row tiles, else 'split' (`choose_form`; measured on the H200 in
# profiles/nvidia-h200/mla_padding/extra/wgmma_*.json: wgmma faster from 8K up, slower at 1K, where a piece is one tile)
FORM_CHOICES = FORMS + ("auto",)
DEFAULT_FORM = "auto"
WG_MIN_TILES = 4
TEAM_STAGES = 5  # the team kernel's ring depth (fixed)
_TEAM_WARPS_CODE = 9  # the launchers' `warps` value that selects the team kernel (K3_MLA_TEAM)
HALVES_STAGES = 6  # form 'halves' (kernels/mla_halves.h): its ring depth (fixed)
_HALVES_WARPS_CODE = 10  # ... and its `warps` value (K3_MLA_HALVES)
# How the pieces are merged (splits > 1): 'kernel' = a second kernel (k3_mla_merge, launched early by
# PDL); 'fused' = inside the split kernel after a grid-wide barrier (one cooperative launch; only
# where the whole grid is co-resident, 5 stages, 4 warps); 'auto' = fused where it applies, else the
# kernel. K3LAB_MLA_MERGE sets the default; `choose_merge` decides.
MERGES = ("auto", "fused", "kernel")
DEFAULT_MERGE = "kernel"
FUSED_STAGES, FUSED_WARPS = 5, 4  # the compiled fused form (kernels/mla_decode.cu, FUSED_STAGES / FUSED_WARPS)
_COOPERATIVE_TOO_LARGE = 720  # cudaErrorCooperativeLaunchTooLarge
_STAGE_BYTES = 8 * (4 * LATENT_DIM * 2 + 16)  # 8 blocks of 4 rows, 16 bytes of padding each
_XCH_BYTES = 4 * 4 * 32 * 16  # one score-partial exchange buffer
WG_BLOCK_N = 64  # form 'wgmma': latent rows per tile (one TMA box height, the M of its score product)
WG_STAGES = 2  # form 'wgmma': tiles of 72 KB in its ring
_ERRORS = {-1: "no compiled kernel for this (stages, warps) pair", -3: "more shared memory than the device allows per block",
           -4: "bad sizes", -5: "this build has no MLA decode kernel (HIP, or not sm_90)",
           -6: "the driver's tensor-map encoder (cuTensorMapEncodeTiled) is unavailable",
           _COOPERATIVE_TOO_LARGE: "cooperative launch too large: the grid cannot be co-resident"}
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher uses


def team_smem_bytes() -> int:
    """Dynamic shared memory of the team kernel: its 5-stage ring, two teams' double-buffered score
    exchanges, an mbarrier per (team, stage) and a reader count per stage."""
    return TEAM_STAGES * _STAGE_BYTES + 2 * 2 * _XCH_BYTES + TEAM_STAGES * (2 * 8 + 4)


def wg_smem_bytes() -> int:
    """Dynamic shared memory of form 'wgmma' (kernels/mla_wgmma.h): 1 KB of alignment slack, two
    72 KB tiles, Q^T (18 KB), P (2 KB), the max and sum exchanges and three mbarriers (the tiles', Q's)."""
    return 1024 + WG_STAGES * 9 * 64 * 128 + 9 * 16 * 128 + 16 * 128 + 3 * 4 * 16 * 4 + (WG_STAGES + 1) * 8


def halves_smem_bytes() -> int:
    """Dynamic shared memory of form 'halves' (kernels/mla_halves.h): six 32-row stages, 1 KB of
    partial scores per warp, an mbarrier per stage."""
    return HALVES_STAGES * _STAGE_BYTES + 8 * 2 * 32 * 16 + HALVES_STAGES * 8


def form_smem_bytes(form: str, stages: int = DEFAULT_STAGES) -> int:
    """Dynamic shared memory of one block of `form` ('split' with `stages` tiles in its ring)."""
    fixed = {"team": team_smem_bytes, "wgmma": wg_smem_bytes, "halves": halves_smem_bytes}.get(form)
    return fixed() if fixed is not None else smem_bytes(stages)


def smem_bytes(stages: int = DEFAULT_STAGES) -> int:
    """Dynamic shared memory of the split kernel with `stages` tiles in its ring (kernels/mla_decode.cu,
    smem_bytes)."""
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    return stages * _STAGE_BYTES + 2 * _XCH_BYTES + stages * 8


class Args(ctypes.Structure):
    """kernels/mla_decode.cu's k3mla::Args, field by field (its size is checked against the library's)."""

    _fields_ = [("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("block_table", ctypes.c_void_p),
                ("lengths", ctypes.c_void_p), ("part_o", ctypes.c_void_p), ("part_lse", ctypes.c_void_p),
                ("out", ctypes.c_void_p), ("lse", ctypes.c_void_p),
                ("q_sb", ctypes.c_longlong), ("q_sh", ctypes.c_longlong), ("kv_sp", ctypes.c_longlong),
                ("bt_sb", ctypes.c_longlong), ("o_sb", ctypes.c_longlong), ("o_sh", ctypes.c_longlong),
                ("l_sb", ctypes.c_longlong),
                ("B", ctypes.c_int), ("heads", ctypes.c_int), ("page_shift", ctypes.c_int), ("splits", ctypes.c_int),
                ("chunk", ctypes.c_int), ("max_pages", ctypes.c_int), ("scale_log2", ctypes.c_float),
                ("probe", ctypes.c_void_p), ("barrier", ctypes.c_void_p), ("q_run", ctypes.c_int), ("q_tq", ctypes.c_int)]


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the exported launchers' signatures and check the Args layout and the shared-memory
    formula against the library's; returns lib."""
    lib.k3_mla_decode.restype = ctypes.c_int
    lib.k3_mla_decode.argtypes = [ctypes.POINTER(Args), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_void_p]
    for fn in ("k3_mla_decode_args_size", "k3_mla_decode_supported"):
        getattr(lib, fn).restype = ctypes.c_int
    lib.k3_mla_decode_smem.restype = ctypes.c_int
    lib.k3_mla_decode_smem.argtypes = [ctypes.c_int]
    lib.k3_mla_decode_team_smem.restype = ctypes.c_int
    lib.k3_mla_halves_smem.restype = ctypes.c_int
    lib.k3_mla_decode_regs.restype = ctypes.c_int
    lib.k3_mla_decode_regs.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.k3_mla_decode_fused.restype = ctypes.c_int
    lib.k3_mla_decode_fused.argtypes = [ctypes.POINTER(Args), ctypes.c_int, ctypes.c_void_p]
    for fn in ("k3_mla_fused_max_blocks", "k3_mla_fused_capturable"):
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).argtypes = [ctypes.c_int]
    lib.k3_mla_fused_regs.restype = ctypes.c_int
    lib.k3_mla_wg_smem.restype = ctypes.c_int
    lib.k3_mla_wg_regs.restype = ctypes.c_int
    lib.k3_mla_wg_map.restype = ctypes.c_int
    lib.k3_mla_wg_map.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong]
    lib.k3_mla_decode_wg.restype = ctypes.c_int
    lib.k3_mla_wg_qmap.restype = ctypes.c_int
    lib.k3_mla_wg_qmap.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_longlong, ctypes.c_longlong, ctypes.c_longlong]
    lib.k3_mla_decode_wg.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                     ctypes.c_void_p]
    lib.k3_mla_decode_wg_tokens.restype = ctypes.c_int
    lib.k3_mla_decode_wg_tokens.argtypes = [ctypes.POINTER(Args), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                            ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.k3_mla_wg_tokens_smem.restype = ctypes.c_int
    lib.k3_mla_wg_tokens_smem.argtypes = [ctypes.c_int]
    size = lib.k3_mla_decode_args_size()
    if size != ctypes.sizeof(Args):
        raise _build.KernelUnavailable(f"{NAME}.cu's Args is {size} bytes but the Python Args is "
                                       f"{ctypes.sizeof(Args)}: the two disagree")
    if lib.k3_mla_decode_supported() and lib.k3_mla_decode_team_smem() != team_smem_bytes():
        raise _build.KernelUnavailable(f"{NAME}.cu's team kernel needs {lib.k3_mla_decode_team_smem()} bytes of "
                                       f"shared memory but the Python formula says {team_smem_bytes()}")
    if lib.k3_mla_decode_supported() and lib.k3_mla_halves_smem() != halves_smem_bytes():
        raise _build.KernelUnavailable(f"{NAME}.cu's halves form needs {lib.k3_mla_halves_smem()} bytes of shared "
                                       f"memory but the Python formula says {halves_smem_bytes()}")
    if lib.k3_mla_decode_supported() and lib.k3_mla_wg_smem() != wg_smem_bytes():
        raise _build.KernelUnavailable(f"{NAME}.cu's wgmma form needs {lib.k3_mla_wg_smem()} bytes of shared "
                                       f"memory but the Python formula says {wg_smem_bytes()}")
    for s in STAGES:
        if lib.k3_mla_decode_smem(s) != smem_bytes(s):
            raise _build.KernelUnavailable(f"{NAME}.cu needs {lib.k3_mla_decode_smem(s)} bytes of shared memory "
                                           f"for {s} stages but the Python formula says {smem_bytes(s)}")
    return lib


def load_variants(spec: str) -> dict[str, ctypes.CDLL]:
    """Other builds of kernels/mla_decode.cu (diagnostic or experimental flags, each compiled with its
    own -Dk3mla=... namespace so that several load at once), bound as `bind` binds the default: spec is
    'label:path,label:path'. A variant's wgmma form may size its shared memory differently from this
    module's formula, so that one check takes the variant's own figure. A missing file is an error."""
    global wg_smem_bytes
    out = {}
    for item in filter(None, spec.split(",")):
        label, sep, path = item.partition(":")
        if not sep or not label or not path:
            raise ValueError(f"variants must be 'label:path' items separated by commas, got {item!r}")
        if not os.path.exists(path):
            raise FileNotFoundError(f"variant {label!r}: no library at {path}")
        lib, formula = ctypes.CDLL(path), wg_smem_bytes
        wg_smem_bytes = lib.k3_mla_wg_smem
        try:
            out[label] = bind(lib)
        finally:
            wg_smem_bytes = formula
    return out


@functools.cache
def _library() -> ctypes.CDLL:
    return bind(_build.load(NAME))


def status() -> tuple[bool, str]:
    """(True, what runs) when the kernel can run here; else (False, why). Builds on first call."""
    ok, why = _build.cuda_status(
        NAME, _library, instead="the Triton kernels of k3lab.ops.mla_decode run instead", min_capability=(9, 0),
        needs=" (bulk copies, mbarrier)",
        hip_note=f"has no AMD path (mma.sync and Hopper bulk copies; the HIP build is a stub, {_build.NOT_RUN_ON_AMD})")
    if ok and not _library().k3_mla_decode_supported():
        return False, f"kernels/{NAME}.cu was built without its CUDA path"
    return ok, why


@functools.cache
def available() -> bool:
    return status()[0]


def registers(stages: int = DEFAULT_STAGES, warps: int = DEFAULT_WARPS, form: str = "split") -> int:
    """Registers per thread of the split kernel (or, form='team' / 'wgmma' / 'halves', that kernel) as
    compiled for this GPU (GPU only)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    if form == "halves":
        n = _library().k3_mla_decode_regs(HALVES_STAGES, _HALVES_WARPS_CODE)
        if n < 0:
            raise RuntimeError(f"{NAME}.cu could not report the halves kernel's registers (error {-n})")
        return n
    if form == "wgmma":
        n = _library().k3_mla_wg_regs()
        if n < 0:
            raise RuntimeError(f"{NAME}.cu could not report the wgmma kernel's registers (error {-n})")
        return n
    smem_bytes(stages)  # checks stages
    if warps not in WARPS:
        raise ValueError(f"warps must be one of {WARPS}, got {warps!r}")
    n = (_library().k3_mla_decode_regs(TEAM_STAGES, _TEAM_WARPS_CODE) if form == "team"
         else _library().k3_mla_decode_regs(stages, warps))
    if n < 0:
        raise RuntimeError(f"{NAME}.cu could not report its registers (error {-n})")
    return n


def fused_registers() -> int:
    """Registers per thread of the fused form's kernel as compiled for this GPU (GPU only)."""
    n = _library().k3_mla_fused_regs()
    if n < 0:
        raise RuntimeError(f"{NAME}.cu could not report the fused kernel's registers (error {-n})")
    return n


@functools.cache
def fused_max_blocks(device: int, max_shared: int) -> int:
    """Blocks of the fused kernel that can be resident at once on GPU `device` (the occupancy API's
    blocks per SM x SMs; 0 where the device has no cooperative launch). GPU only."""
    with torch.cuda.device(device):
        n = _library().k3_mla_fused_max_blocks(max_shared)
    if n < 0:
        raise RuntimeError(f"{NAME}.cu could not size the fused grid ({_ERRORS.get(n, f'CUDA error {-n}')})")
    return n


@functools.cache
def _fused_capture(device: int, max_shared: int) -> tuple[bool, str]:
    with torch.cuda.device(device):
        rc = _library().k3_mla_fused_capturable(max_shared)
    if rc == 1:
        return True, "a cooperative launch keeps its attribute under CUDA-graph capture here"
    if rc == 0:
        return False, ("CUDA-graph capture drops the cooperative attribute here (the grid barrier would rely on "
                       "luck)")
    return False, f"CUDA-graph capture of a cooperative launch is refused here ({_ERRORS.get(rc, f'CUDA error {-rc}')})"


def fused_capturable(device: int, max_shared: int) -> tuple[bool, str]:
    """(True, why) when a cooperative launch of the fused kernel can be captured in a CUDA graph with
    its cooperative attribute kept (tested once per process and device: one launch captured on a
    private stream, never run); else (False, why). Not tested while the current stream is capturing
    (the answer is then False, saying so, and nothing is cached)."""
    if torch.cuda.is_current_stream_capturing():
        return False, "planned while the stream is being captured: the capture test of the fused form did not run"
    return _fused_capture(device, max_shared)


def _wanted(value: str | None, label: str, env_name: str, choices: tuple, default: str) -> str:
    """`value` if given, else the environment variable `env_name`, else `default`; checked against choices."""
    if value is None:
        env = os.environ.get(env_name, "")
        if env and env not in choices:
            raise ValueError(f"{env_name} must be one of {choices}, got {env!r}")
        return env or default
    if value not in choices:
        raise ValueError(f"{label} must be one of {choices} or None, got {value!r}")
    return value


def merge_wanted(merge: str | None) -> str:
    """The merge choice: `merge` if given, else K3LAB_MLA_MERGE, else DEFAULT_MERGE (checked)."""
    return _wanted(merge, "merge", "K3LAB_MLA_MERGE", MERGES, DEFAULT_MERGE)


def choose_merge(merge: str, *, splits: int, batch: int, max_blocks: int, form: str = "split",
                 stages: int = DEFAULT_STAGES, warps: int = DEFAULT_WARPS, probe: bool = False,
                 capturable: tuple[bool, str] = (True, "")) -> tuple[str, str]:
    """(path, why) for one plan: path 'none' (one piece: the split kernel writes the result), 'fused'
    (one cooperative launch merging after a grid barrier) or 'kernel' (the merge kernel). merge='auto'
    takes 'fused' where it applies and says why not otherwise; merge='fused' raises ValueError where it
    cannot apply; max_blocks: co-resident blocks of the fused kernel (`fused_max_blocks`)."""
    if merge not in MERGES:
        raise ValueError(f"merge must be one of {MERGES}, got {merge!r}")
    if splits == 1:
        return "none", "one piece: the split kernel writes the result, nothing to merge"
    if merge == "kernel":
        return "kernel", "merge='kernel' (K3LAB_MLA_MERGE or the default): the merge kernel, launched by PDL"
    blocks = batch * splits
    why_not = None
    if form != "split" or stages != FUSED_STAGES or warps != FUSED_WARPS:
        why_not = (f"the fused form is compiled for the split kernel with {FUSED_STAGES} stages and {FUSED_WARPS} "
                   f"warps, not form={form!r}, {stages} stages, {warps} warps")
    elif probe:
        why_not = "the timeline probe is compiled for the two-kernel form only"
    elif blocks > max_blocks:
        why_not = (f"the grid of {batch} x {splits} = {blocks} blocks cannot all be resident at once (at most "
                   f"{max_blocks} here): a grid barrier needs every block resident")
    elif not capturable[0]:
        why_not = capturable[1]
    if why_not is None:
        return "fused", (f"{blocks} blocks <= {max_blocks} co-resident: one cooperative launch, merged after a grid "
                         f"barrier")
    if merge == "fused":
        raise ValueError(f"merge='fused' cannot run here: {why_not}")
    return "kernel", f"merge='auto' took the merge kernel: {why_not}"


# ----------------------------------------------------------------------------------------------
# pieces


def choose_splits(batch: int, max_len: int, compute_units: int, *, blocks_per_unit: int = 1,
                  num_splits: int | None = None, block_n: int = BLOCK_N) -> tuple[int, int]:
    """(pieces per request, positions per piece). By default at most one wave: the batch's blocks cover
    the compute units once and never spill into a second wave (blocks_per_unit each; the 5-stage kernel
    fits one per H200 SM), each piece a whole number of 32-row tiles. Why never spill: at 64 x 8K on
    the H200, 3 pieces a request (192 blocks: a full wave and a 45% one, each block 43 tiles) took
    202.7 us where 2 pieces (128 blocks, 64 tiles each) took 165.8 (form 'wgmma', same run;
    profiles/nvidia-h200/mla_padding/extra/balanced_988492b.json): the second wave's blocks start only
    when the first's end, so the time is two pieces long either way, and the fuller wave streams faster.
    The piece length comes from the longest request; the returned
    count is how many pieces that longest request fills (shorter requests leave their last pieces
    empty: zero-weight partials). num_splits forces the count (rounded the same way). block_n: the
    kernel's tile (32 rows; 64 for form 'wgmma')."""
    for label, v in (("batch", batch), ("max_len", max_len), ("compute_units", compute_units),
                     ("blocks_per_unit", blocks_per_unit), ("block_n", block_n)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{label} must be a positive integer, got {v!r}")
    tiles = -(-max_len // block_n)
    if num_splits is None:
        want = max(1, compute_units * blocks_per_unit // batch)
    else:
        if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be an integer in 1..{MAX_SPLITS}, got {num_splits!r}")
        want = num_splits
    want = min(want, tiles)
    chunk_tiles = -(-tiles // want)
    return -(-tiles // chunk_tiles), chunk_tiles * block_n


# ----------------------------------------------------------------------------------------------
# argument checks


@dataclass(frozen=True)
class _Checked:
    inp: object  # mla_decode._Inputs
    scale: float
    stages: int
    warps: int
    form: str
    merge: str


def check(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, stages=DEFAULT_STAGES,
          warps=DEFAULT_WARPS, form=None, merge=None) -> _Checked:
    """Every refusal, by name, before anything runs on a device (ValueError). Reads `lengths` and
    the block table on the host once (see mla_decode's plans)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a tensor [B, 1, H, {LATENT_DIM}], got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if q.shape[1] != 1:
        raise ValueError(f"q_len (q.shape[1]) must be 1: this kernel decodes one token (verification groups, "
                         f"q_len > 1, run on mla_decode's Triton kernels), got {q.shape[1]}")
    if q.shape[3] != LATENT_DIM:
        raise ValueError(f"q's last dim must be the latent width {LATENT_DIM} (512 absorbed nope + 64 rope), "
                         f"got {q.shape[3]}")
    if not 1 <= q.shape[2] <= MAX_HEADS:
        raise ValueError(f"heads (q.shape[2]) must be 1..{MAX_HEADS} (one 16-row mma tile), got {q.shape[2]}")
    if q.dtype != torch.bfloat16:
        raise ValueError(f"q.dtype must be bfloat16 (the kernel multiplies bf16 on the matrix units), got {q.dtype}")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.shape[2] != LATENT_DIM:
        raise ValueError(f"cache must be [B, L, {LATENT_DIM}] or [num_pages, page_size, {LATENT_DIM}], got "
                         f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__}")
    if cache.dtype != torch.bfloat16:
        raise ValueError(f"cache.dtype must be bfloat16 like q, got {cache.dtype}")
    if cache.stride(2) != 1 or cache.stride(1) != LATENT_DIM:
        raise ValueError(f"cache rows must be contiguous {LATENT_DIM}-element rows (cache.stride(1) == "
                         f"{LATENT_DIM}, cache.stride(2) == 1; a tile of 32 rows is copied in blocks of 4 rows), "
                         f"got strides {tuple(cache.stride())}")
    form = form_wanted(form)
    merge = merge_wanted(merge)
    if stages not in STAGES:
        raise ValueError(f"stages must be one of {STAGES}, got {stages!r}")
    if warps not in WARPS:
        raise ValueError(f"warps must be one of {WARPS}, got {warps!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or isinstance(num_splits, bool)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be an integer in 1..{MAX_SPLITS}, got {num_splits!r}")
    s = mla.DEFAULT_SCALE if scale is None else scale
    if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if block_table is not None and cache.shape[1] < BLOCK_N:
        raise ValueError(f"page size (cache.shape[1]) must be a power of two >= {BLOCK_N} (a {BLOCK_N}-row tile "
                         f"must not cross a page), got {cache.shape[1]}")
    if cache.data_ptr() % 16 or cache.stride(0) % 8:
        raise ValueError("cache must start on a 16-byte boundary and its pages (or requests) too: bulk copies move "
                         "16-byte units (cache.data_ptr() % 16 == 0, cache.stride(0) % 8 == 0)")
    if q.data_ptr() % 4 or q.stride(0) % 2 or q.stride(2) % 2:
        raise ValueError("q must start on a 4-byte boundary with even batch and head strides (the kernel reads "
                         "pairs of bf16)")
    if form == "wgmma" and (why := wgmma_refusal(q, cache, block_table)):
        raise ValueError(why)
    inp = mla._validate(q, cache, lengths, block_table, max_heads=MAX_HEADS)  # lengths, block table, devices
    return _Checked(inp, float(s), stages, warps, form, merge)


def wgmma_refusal(q, cache, block_table) -> str | None:
    """Why form 'wgmma' cannot take these (checked) inputs, or None."""
    if block_table is not None and cache.shape[1] < WG_BLOCK_N:
        return (f"form='wgmma' needs pages (cache.shape[1]) of >= {WG_BLOCK_N} rows (its {WG_BLOCK_N}-row tile is one "
                f"TMA box inside a page), got {cache.shape[1]}; form='split' takes pages of 32")
    if cache.stride(0) != cache.shape[1] * LATENT_DIM:
        return (f"form='wgmma' reads the cache through one tensor map of rows, so pages (or requests) must follow "
                f"each other: cache.stride(0) must be {cache.shape[1] * LATENT_DIM}, got {cache.stride(0)}")
    if q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(2) % 8:
        return ("form='wgmma' reads q in 16-byte units: q must start on a 16-byte boundary with batch and head "
                f"strides that are multiples of 8, got strides {tuple(q.stride())}")
    return None


def form_wanted(form: str | None) -> str:
    """The form asked for: `form` if given, else K3LAB_MLA_FORM, else DEFAULT_FORM (checked)."""
    return _wanted(form, "form", "K3LAB_MLA_FORM", FORM_CHOICES, DEFAULT_FORM)


def choose_form(batch: int, max_len: int, compute_units: int, *, refusal: str | None = None,
                num_splits: int | None = None, stages: int = DEFAULT_STAGES, warps: int = DEFAULT_WARPS,
                probe: bool = False, merge: str = DEFAULT_MERGE) -> tuple[str, str]:
    """(form, why) for form='auto': 'wgmma' where it applies (`refusal` None: its inputs' rules) and
    each piece holds at least WG_MIN_TILES of its 64-row tiles; 'split' elsewhere. Where a piece is
    one or two tiles the whole decode is a few microseconds of start-up, and the mma.sync kernel's
    32-row tiles start sooner (H200: 8.5 against 7.0 us at 1K)."""
    if refusal is not None:
        return "split", refusal
    if (stages, warps) != (DEFAULT_STAGES, DEFAULT_WARPS) or probe or merge == "fused":
        return "split", ("stages, warps, the probe and the fused merge belong to the split kernel: "
                         f"stages={stages}, warps={warps}, probe={probe}, merge={merge!r}")
    splits, chunk = choose_splits(batch, max_len, compute_units, num_splits=num_splits, block_n=WG_BLOCK_N)
    tiles = chunk // WG_BLOCK_N
    if tiles < WG_MIN_TILES:
        return "split", f"pieces of {tiles} tile(s) of {WG_BLOCK_N} rows (< {WG_MIN_TILES}): the split kernel starts sooner"
    return "wgmma", f"{splits} piece(s) of {tiles} tiles of {WG_BLOCK_N} rows each: warpgroup MMA on TMA tiles"


# ----------------------------------------------------------------------------------------------
# plans


@dataclass
class CudaDecodePlan:
    """A checked decode, ready to launch: `plan()` runs it and returns (o, lse), the plan's own
    buffers, overwritten by each call (capturable in a CUDA graph: no host sync, no allocation)."""

    num_splits: int
    chunk: int
    stages: int
    warps: int
    pdl: bool
    form: str
    out: torch.Tensor
    lse: torch.Tensor
    _args: Args = field(repr=False)
    _keep: tuple = field(repr=False)  # tensors the raw pointers in _args point into
    _max_shared: int = field(repr=False, default=0)
    _device: int = field(repr=False, default=0)
    merge: str = "kernel"  # 'none' (one piece), 'fused' (one cooperative launch) or 'kernel' (two launches)
    merge_why: str = ""  # why that path (choose_merge)
    _barrier: torch.Tensor | None = field(repr=False, default=None)  # fused: [counter, give-ups] (int64)
    _tensor_map: object = field(repr=False, default=None)  # form 'wgmma': the cache's and q's 128-byte CUtensorMaps
    form_why: str = ""  # why this form (choose_form, or 'asked')
    tokens: int = 1  # 2: each block two consecutive requests that are two tokens of one verification group

    # the names a Triton `mla_decode.DecodePlan` answers to, so callers need not care which runs
    variant = "after"
    kernel = "cuda"
    pad = "registers"
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
    def config(self) -> mla.LaunchConfig:
        if self.form == "wgmma":
            return mla.LaunchConfig(WG_BLOCK_N, 4, WG_STAGES)
        if self.form == "halves":
            return mla.LaunchConfig(BLOCK_N, 8, HALVES_STAGES)
        team = self.form == "team"
        return mla.LaunchConfig(BLOCK_N, 8 if team else self.warps, TEAM_STAGES if team else self.stages)

    @property
    def launches(self) -> int:
        return 1 if self.num_splits == 1 or self.merge == "fused" else 2

    def barrier_timeouts(self) -> int:
        """Blocks of the fused form that gave up waiting at the grid barrier since the plan was made
        (bounded spin: 0 unless the barrier is broken; reads the GPU, so it syncs). 0 for other paths."""
        return 0 if self._barrier is None else int(self._barrier[1].item())

    def facts(self) -> dict:
        cfg = self.config
        smem = form_smem_bytes(self.form, self.stages)
        return {"kernel": "cuda", "form": self.form, "tokens_per_block": self.tokens, "num_splits": self.num_splits,
                "chunk": self.chunk,
                "block_n": cfg.block_n, "num_stages": cfg.num_stages, "num_warps": cfg.num_warps, "smem_bytes": smem,
                "programs": self.programs, "launches": self.launches, "pdl": self.pdl, "rows_per_program": 16,
                "merge": self.merge, "form_why": self.form_why}

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        lib = _library()
        stream = _raw_stream(self._device) if _raw_stream is not None else torch.cuda.current_stream().cuda_stream
        if self.merge == "fused":
            rc = lib.k3_mla_decode_fused(ctypes.byref(self._args), self._max_shared, ctypes.c_void_p(stream))
            if rc != 0:
                raise RuntimeError(f"{NAME}.cu refused the fused launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")
            return self.out, self.lse
        if self.form == "wgmma":
            rc = lib.k3_mla_decode_wg_tokens(ctypes.byref(self._args), ctypes.addressof(self._tensor_map[0]),
                                             ctypes.addressof(self._tensor_map[1]), int(self.pdl), self._max_shared,
                                             self.tokens, ctypes.c_void_p(stream))
            if rc != 0:
                raise RuntimeError(f"{NAME}.cu refused the wgmma launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")
            return self.out, self.lse
        stages, warps = {"team": (TEAM_STAGES, _TEAM_WARPS_CODE),
                         "halves": (HALVES_STAGES, _HALVES_WARPS_CODE)}.get(self.form, (self.stages, self.warps))
        rc = lib.k3_mla_decode(ctypes.byref(self._args), stages, warps, int(self.pdl), self._max_shared,
                               ctypes.c_void_p(stream))
        if rc != 0:
            raise RuntimeError(f"{NAME}.cu refused the launch ({rc}: {_ERRORS.get(rc, 'CUDA runtime error')})")
        return self.out, self.lse


def plan(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None, stages=DEFAULT_STAGES,
         warps=DEFAULT_WARPS, pdl: bool = True, compute_units: int | None = None,
         probe: torch.Tensor | None = None, form: str | None = None, merge: str | None = None,
         tokens_per_block: int = 1, q_group: tuple | None = None) -> CudaDecodePlan:
    """Check once (ValueError by name), then build a launchable plan on the GPU (KernelUnavailable,
    with the reason, where the kernel cannot run). num_splits: None = `choose_splits` for the
    device's SM count; stages / warps: the compiled ring depth and block size (5 and 4 by default);
    pdl: launch the merge early (programmatic dependent launch). probe: diagnostics only, an int64
    tensor on the GPU of at least `probe_size(plan)` entries that each launch fills with the
    timeline of kernels/mla_decode.cu's Args.probe (default plan only; `timeline` reads it).
    merge: 'kernel', 'fused', 'auto' or None (= K3LAB_MLA_MERGE, else DEFAULT_MERGE): how the pieces
    are merged, see `choose_merge`; `plan.merge` says which path runs and `plan.merge_why` why.
    form: 'split', 'wgmma', 'halves', 'team', 'auto' or None (= K3LAB_MLA_FORM, else 'auto'): which split kernel,
    see `choose_form`; `plan.form` says which runs and `plan.form_why` why.
    tokens_per_block = 2 (plan_verify): consecutive requests in pairs, each pair two tokens of one
    verification group over the same pages, scored and summed in one product (form 'wgmma', merge
    kernel, no probe). q_group = (queries [G, Tq, H, 576], run) with two tokens per block: request r's
    query is token r % run of group r / run, and a token index >= Tq (a group padded to run tokens)
    reads zeros; q then only gives the requests' shape (its data is not read)."""
    if tokens_per_block not in (1, 2):
        raise ValueError(f"tokens_per_block must be 1 or 2, got {tokens_per_block!r}")
    if q_group is not None:
        src, run = q_group
        if tokens_per_block != 2 or not isinstance(src, torch.Tensor) or src.dim() != 4 or not isinstance(run, int):
            raise ValueError("q_group must be (a tensor [G, Tq, H, 576], run) and needs tokens_per_block=2")
        if (src.shape[0] * run != q.shape[0] or not 1 <= src.shape[1] <= run or src.shape[2:] != q.shape[2:]
                or src.dtype != q.dtype or src.device != q.device or src.stride(3) != 1):
            raise ValueError(f"q_group's queries {tuple(src.shape)} with run {run} do not give q's {q.shape[0]} "
                             f"requests of {tuple(q.shape[2:])} ({q.dtype} on {q.device}, last dim contiguous)")
    if tokens_per_block == 2:
        if form not in (None, "auto", "wgmma"):
            raise ValueError(f"tokens_per_block=2 runs form 'wgmma' only, got form={form!r}")
        if probe is not None or merge == "fused":
            raise ValueError("tokens_per_block=2 takes no probe and no fused merge")
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] % 2:
            raise ValueError(f"tokens_per_block=2 needs an even batch of token requests, got q.shape[0] = {q.shape[0]}")
        form, merge = "wgmma", "kernel"
    form = form_wanted(form)
    c = check(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits, stages=stages,
              warps=warps, form=form, merge=merge)
    ok, why = status()
    if not ok:
        raise _build.KernelUnavailable(f"{NAME}.cu cannot run here: {why}")
    if q.device.type != "cuda":
        raise ValueError(f"q must be on a CUDA device, got {q.device}")
    inp = c.inp
    dev = q.device.index if q.device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    form_why = f"form={form!r} asked" if tokens_per_block == 1 else "two tokens per block need 'wgmma'"
    if form == "auto":
        form, form_why = choose_form(inp.batch, inp.max_len, compute_units or props.multi_processor_count,
                                     refusal=wgmma_refusal(q, cache, block_table), num_splits=num_splits,
                                     stages=stages, warps=warps, probe=probe is not None, merge=c.merge)
    max_shared = int(getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block)
    need = form_smem_bytes(form, stages) if tokens_per_block == 1 else _library().k3_mla_wg_tokens_smem(2)
    if need > max_shared:
        raise _build.KernelUnavailable(f"the {form} kernel needs {need} bytes of shared memory per block; "
                                       f"this GPU allows {max_shared}")
    per_unit = int(getattr(props, "shared_memory_per_multiprocessor", 0) or max_shared)
    blocks_per_unit = max(1, per_unit // (need + 1024))  # the driver keeps 1 KB per block
    units = compute_units or props.multi_processor_count
    splits, chunk = choose_splits(inp.batch // tokens_per_block, inp.max_len, units, blocks_per_unit=blocks_per_unit,
                                  num_splits=num_splits, block_n=WG_BLOCK_N if form == "wgmma" else BLOCK_N)
    B, H = inp.batch, inp.heads
    out = torch.empty(B, 1, H, VALUE_DIM, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, 1, H, dtype=torch.float32, device=q.device)
    part_o = torch.empty(B, H, splits, VALUE_DIM, dtype=torch.float32, device=q.device) if splits > 1 else None
    part_lse = torch.empty(B, H, splits, dtype=torch.float32, device=q.device) if splits > 1 else None
    bt = inp.block_table if inp.paged else None
    page_shift = int(math.log2(inp.page_size)) if inp.paged else 30
    args = Args(q.data_ptr(), cache.data_ptr(), bt.data_ptr() if bt is not None else None, inp.lengths.data_ptr(),
                part_o.data_ptr() if part_o is not None else None,
                part_lse.data_ptr() if part_lse is not None else None, out.data_ptr(), lse.data_ptr(),
                q.stride(0), q.stride(2), cache.stride(0), bt.stride(0) if bt is not None else 0,
                out.stride(0), out.stride(2), lse.stride(0),
                B, H, page_shift, splits, chunk, bt.shape[1] if bt is not None else 0, c.scale * mla._LOG2E, None, None,
                1, 1)
    # the queries' map: one token per request, or (q_group) tokens of verification groups, padded ones included
    qsrc, tq, groups = (q[:, 0], 1, B) if q_group is None else (q_group[0], q_group[0].shape[1], q_group[0].shape[0])
    if q_group is not None:
        args.q, args.q_run, args.q_tq = q_group[0].data_ptr(), q_group[1], tq
    tensor_map = None
    if form == "wgmma":  # the cache's rows and the queries as tensor maps (TMA boxes, 128 B swizzle)
        tensor_map = ((ctypes.c_ubyte * 128)(), (ctypes.c_ubyte * 128)())
        lib = _library()
        for what, rc in (("cache's", lib.k3_mla_wg_map(ctypes.addressof(tensor_map[0]), cache.data_ptr(),
                                                         cache.shape[0] * cache.shape[1])),
                         ("queries'", lib.k3_mla_wg_qmap(ctypes.addressof(tensor_map[1]), qsrc.data_ptr(), H, tq,
                                                           groups, qsrc.stride(-2), qsrc.stride(-3) if tq > 1 else qsrc.stride(0),
                                                           qsrc.stride(0)))):
            if rc != 0:
                raise _build.KernelUnavailable(f"{NAME}.cu could not encode the {what} tensor map ({rc}: "
                                               f"{_ERRORS.get(rc, 'driver refused')})")
    if probe is not None:
        if form == "halves":
            raise ValueError(f"probe is compiled for the team kernel, the 5-stage 4-warp split kernel and form "
                             f"'wgmma' only, not form={form!r}")
        need = probe_size(B, H, splits)
        if form == "split" and (stages != 5 or warps != 4):
            raise ValueError(f"probe is compiled for the team kernel, the 5-stage 4-warp split kernel and form "
                             f"'wgmma' only, got {stages} stages, {warps} warps")
        if probe.dtype != torch.int64 or probe.device != q.device or probe.numel() < need or not probe.is_contiguous():
            raise ValueError(f"probe must be a contiguous int64 tensor on {q.device} of >= {need} entries, got "
                             f"{probe.dtype} on {probe.device} with {probe.numel()}")
        args.probe = probe.data_ptr()
    if c.merge == "kernel" or splits == 1:
        path, why = choose_merge(c.merge, splits=splits, batch=B, max_blocks=0)
    else:
        path, why = choose_merge(c.merge, splits=splits, batch=B, max_blocks=fused_max_blocks(dev, max_shared),
                                 form=form, stages=stages, warps=warps, probe=probe is not None,
                                 capturable=fused_capturable(dev, max_shared))
    barrier = None
    if path == "fused":
        barrier = torch.zeros(2, dtype=torch.int64, device=q.device)
        args.barrier = barrier.data_ptr()
    keep = (q, cache, bt, inp.lengths, part_o, part_lse, out, lse, probe, barrier, q_group)
    return CudaDecodePlan(splits, chunk, stages, warps, bool(pdl) and path == "kernel", form, out, lse, args, keep,
                          max_shared, dev, path, why, barrier, tensor_map, form_why, tokens_per_block)


def probe_size(batch: int, heads: int, splits: int) -> int:
    """Entries of the timeline probe: 8 per split block, 2 per merge block."""
    return batch * splits * 8 + (batch * heads * (VALUE_DIM // 32) * 2 if splits > 1 else 0)


def timeline(probe: torch.Tensor, batch: int, heads: int, splits: int) -> dict:
    """The probe's stamps as numbers (us from the first block's start): per split block its start,
    first tile landed, loop end and end, SM id, tile count, and the SM cycles thread 0 waited for
    tiles and at barriers (form 'wgmma': for the tiles after the first, and, as 'sync_cycles', from
    its start until its first tiles were requested); per merge block its start and end."""
    p = probe.detach().cpu().tolist()
    n = batch * splits
    t0 = min(p[8 * i] for i in range(n))
    us = lambda t: (t - t0) / 1000.0  # noqa: E731
    blocks = [{"start": us(p[8 * i]), "first": us(p[8 * i + 1]) if p[8 * i + 5] else None, "loop_end": us(p[8 * i + 2]),
               "end": us(p[8 * i + 3]), "sm": p[8 * i + 4], "tiles": p[8 * i + 5], "wait_cycles": p[8 * i + 6],
               "sync_cycles": p[8 * i + 7]} for i in range(n)]
    merge = []
    if splits > 1:
        m = batch * heads * (VALUE_DIM // 32)
        merge = [{"start": us(p[8 * n + 2 * i]), "end": us(p[8 * n + 2 * i + 1])} for i in range(m)]
    return {"blocks": blocks, "merge": merge}


def mla_decode_cuda(q, cache, lengths=None, *, block_table=None, scale=None, num_splits=None,
                    stages=DEFAULT_STAGES, warps=DEFAULT_WARPS, pdl: bool = True,
                    form: str | None = None, merge: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step on the CUDA kernel: (o [B, 1, H, 512] in q's dtype, lse [B, 1, H] natural log),
    as `mla_decode.reference` computes them."""
    o, lse = plan(q, cache, lengths, block_table=block_table, scale=scale, num_splits=num_splits, stages=stages,
                  warps=warps, pdl=pdl, form=form, merge=merge)()
    return o.clone(), lse.clone()


# ----------------------------------------------------------------------------------------------
# verification groups as one-token requests

class VerifyAsRequestsPlan:
    """A verification group of q_len tokens run by the one-token kernel: token t of request b becomes
    request b * q_len + t, reading the same pages with length lengths[b] - q_len + 1 + t (so each
    token sees its own prefix: causal inside the group). Two tokens per block share each tile in one
    product (inner.tokens == 2); an odd group is then padded to an even one (padded_len) by a token whose
    query reads as zeros and whose output is dropped, as the padded heads' are. With a block per token the
    group's blocks read the same tiles at about the same time, so DRAM serves each tile once and L2 the
    rest. Calling it returns (o [B, q_len, H, 512], lse [B, q_len, H]) as views of the inner plan's
    buffers (strided when the group was padded)."""

    def __init__(self, inner: CudaDecodePlan, batch: int, q_len: int, padded_len: int, keep: tuple):
        self.inner, self.batch, self.q_len, self.padded_len, self._keep = inner, batch, q_len, padded_len, keep

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


def plan_verify(q, cache, lengths, *, block_table, scale=None, num_splits=None, pdl: bool = True,
                compute_units: int | None = None, form: str | None = None,
                share: str | None = None) -> VerifyAsRequestsPlan:
    """Plan a verification group (q [B, q_len >= 1, H, 576], a paged cache) on this module's kernel,
    each token as its own one-token request over the same pages (VerifyAsRequestsPlan). share: how
    the tokens share a tile: 'pairs' (two tokens per block in one product, N = 32: a tile read once per
    pair; an odd q_len is padded by one token whose query reads zeros), 'l2' (a block per token: DRAM serves a
    tile once and L2 once per further token), or None = 'pairs' from q_len 2 up, 'l2' for one token.
    Refusals by name as in `check`, plus: a paged cache (block_table=) and lengths are required."""
    if share not in (None, "pairs", "l2"):
        raise ValueError(f"share must be 'pairs', 'l2' or None, got {share!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a tensor [B, q_len, H, {LATENT_DIM}], got "
                         f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if block_table is None or lengths is None:
        raise ValueError("plan_verify needs a paged cache: block_table= and lengths= (each token becomes a request "
                         "over the same pages)")
    inp = mla._validate(q, cache, lengths, block_table)  # q_len, lengths >= q_len, pages in the pool
    B, Tq = inp.batch, inp.q_len
    pairs = share == "pairs" or (share is None and Tq >= 2)
    Tp = Tq + (pairs and Tq % 2)  # tokens per group as run: an odd group of pairs gets one more (zero query, last length)
    steps = torch.arange(Tp, dtype=torch.int32, device=q.device).clamp(max=Tq - 1)
    token_lengths = (inp.lengths[:, None] - Tq + 1 + steps[None, :]).reshape(-1).contiguous()
    token_table = inp.block_table.repeat_interleave(Tp, dim=0).contiguous()
    if Tp == Tq:
        token_q, q_group = q.contiguous().view(B * Tq, 1, q.shape[2], q.shape[3]), None
    else:  # the kernel reads each token's query from q itself (the repeat reads zeros): this only has the shape
        token_q, q_group = torch.as_strided(q, (B * Tp, 1, q.shape[2], q.shape[3]), (0, 0, q.stride(2), 1)), (q, Tp)
    inner = plan(token_q, cache, token_lengths, block_table=token_table, scale=scale, num_splits=num_splits,
                 pdl=pdl, compute_units=compute_units, form=form, tokens_per_block=2 if pairs else 1,
                 q_group=q_group)
    return VerifyAsRequestsPlan(inner, B, Tq, Tp, (q, token_q, token_lengths, token_table))
