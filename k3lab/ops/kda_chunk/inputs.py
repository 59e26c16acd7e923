"""What every backend of chunked KDA prefill shares: the sizes the kernels are built for, the check of
a call's arguments (before any kernel runs) and the matrix-product precisions per input dtype.

Values: the chunked form reaches a chunk's earlier tokens from its later ones (the in-chunk inverse of
I + strictly-lower beta K K^T terms, and decays taken relative to the chunk's last token), so a NaN or
an infinity in one token's k, v, g or beta would poison the outputs of the tokens before it in its
chunk, and every state after. `validate` refuses them (one sum per tensor, one device sync). A NaN in q
stays in its own token's output, as in the recurrence, so q is not read."""

from __future__ import annotations

import itertools

import torch

from k3lab import env
from k3lab.ops import check_finite, expect, int_arg, positive_finite
from k3lab.ops import int_list as ops_int_list

HEAD_DIM = 128  # K = V = 128 for K3's KDA; the kernels hold whole 128-row state tiles
CHUNK = 64  # tokens per chunk: the 64 x 64 in-chunk inverse the seed prescribes
SUB = 16  # the inverse and the decay factoring work on 16 x 16 blocks
SAFE_SPREAD = 64.0  # largest decay spread (natural log) inside a 16-row block the factored form accepts
MAX_GRID = 65535  # groups, summaries or sequences: a launch grid's second and third dimensions
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Triton's interpreter (CPU) turns a run-time loop bound into a 1-element array that numpy >= 2.3 will not
# convert to an int; the kernels then loop with `while`, which it handles (compiled code keeps `for`).
WHILE = env.triton_interpreted()
# one-instruction exponentials by inline PTX: compiled for NVIDIA only (the interpreter runs no PTX)
FAST_EXP = not env.triton_interpreted() and env.detect().backend == "cuda"


def check_positive_int(name: str, value, *, allow_none: bool = False) -> None:
    """ValueError unless `value` is an int >= 1 (bool refused), or None when allowed."""
    if value is None and allow_none:
        return
    int_arg(name, value, low=1, what="an int (or None)" if allow_none else "an int")


def int_list(name: str, values) -> list[int]:
    """`values` by `ops.int_list`'s rule (ints >= 0, never bools or floats), and not empty."""
    out = ops_int_list(name, values)
    if not out:
        raise ValueError(f"{name} must be a non-empty list of ints >= 0, got an empty one")
    return out


def _check_tensors(q, k, v, g, beta) -> None:
    expect("q", q, shape=4, what="[B, T, H, K]")
    B, T, H, K = q.shape
    if K != HEAD_DIM:
        raise ValueError(f"q's head dim K must be {HEAD_DIM} (the kernels hold 128-row state tiles), got {K}")
    if B < 1 or H < 1:
        raise ValueError(f"q must have B >= 1 and H >= 1, got {tuple(q.shape)}")
    if H > MAX_GRID:
        raise ValueError(f"q has {H} heads; the launch grids take at most {MAX_GRID}")
    # contiguous: the kernels address [B, T, H, .] by fixed strides
    expect("q", q, dtype=DTYPES, contiguous=True)
    like_q = f"of q's shape {tuple(q.shape)}"
    expect("k", k, shape=q.shape, dtype=q.dtype, device=q.device, contiguous=True, what=like_q)
    expect("v", v, shape=(B, T, H, HEAD_DIM), dtype=q.dtype, device=q.device, contiguous=True,
           what=f"[B={B}, T={T}, H={H}, V={HEAD_DIM}]")
    expect("g", g, shape=q.shape, dtype=torch.float32, device=q.device, contiguous=True,
           what=f"{like_q} (log-decays)")
    expect("beta", beta, shape=(B, T, H), dtype=torch.float32, device=q.device, contiguous=True,
           what=f"[B={B}, T={T}, H={H}]")


def _lengths(cu_seqlens, B: int, T: int) -> list[int]:
    if cu_seqlens is None:
        return [T] * B
    if B != 1:
        raise ValueError(f"with cu_seqlens, q must be packed as B = 1, got B = {B}")
    cu = int_list("cu_seqlens", cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T = {T}, got "
                         f"{cu[:4]}...{cu[-2:]} ({len(cu)} entries)")
    return [b - a for a, b in itertools.pairwise(cu)]


def validate(q, k, v, g, beta, initial_state=None, cu_seqlens=None, scale=None, *,
             check_values: bool = True) -> tuple[list[int], int, float]:
    """Check one prefill call's arguments; returns (sequence lengths, heads H, scale).

    q, k [B, T, H, 128] and v [B, T, H, 128] of one dtype (bf16, fp16 or fp32), contiguous; g [B, T, H, 128]
    fp32 log-decay; beta [B, T, H] fp32; initial_state [N, H, 128, 128] fp32 or None; cu_seqlens [N + 1]
    (packed variable-length batch, B = 1) or None (N = B): ints, never bools or floats. k, v, g and beta
    finite (module docstring; check_values=False skips that read, for inputs the caller made itself).
    Raises ValueError naming the argument. Reading cu_seqlens and the finite check wait for the GPU:
    callers validate once per call (or once per binding)."""
    _check_tensors(q, k, v, g, beta)
    B, T, H, _ = q.shape
    if scale is not None:
        positive_finite("scale", scale)  # the rule every op shares: a real, finite, positive fp32 scale
    lengths = _lengths(cu_seqlens, B, T)
    if check_values:
        check_finite("the chunked form would spread it to the earlier tokens of its chunk (module docstring)",
                     {"k": k, "v": v, "g": g, "beta": beta})
    N = len(lengths)
    if N > MAX_GRID:
        raise ValueError(f"{N} sequences: the launch grids take at most {MAX_GRID}; split the batch")
    if initial_state is not None:
        expect("initial_state", initial_state, shape=(N, H, HEAD_DIM, HEAD_DIM), dtype=torch.float32,
               device=q.device, contiguous=True, what=f"[N={N}, H={H}, {HEAD_DIM}, {HEAD_DIM}]")
    return lengths, H, HEAD_DIM**-0.5 if scale is None else float(scale)


def has_tf32() -> bool:
    """Whether the device multiplies fp32 operands in one tf32 (xf32) matrix pass: NVIDIA's tensor cores
    and CDNA3 (gfx94x). CDNA4 (gfx950) and other AMD chips have no xf32 instruction and Triton refuses
    input_precision='tf32' there. On CPU (the interpreter ignores the precision) 'tf32' is kept."""
    info = env.detect()
    if info.backend != "rocm":
        return True
    return (info.arch or "").split(":")[0] in ("gfx940", "gfx941", "gfx942")


def amd_lds_bytes() -> int | None:
    """LDS per compute unit of an AMD device in bytes: 160 KiB on CDNA4 (gfx950), 64 KiB on CDNA3 and
    older. None on NVIDIA and CPU, where no launch of this op nears the shared-memory limit."""
    info = env.detect()
    if info.backend != "rocm":
        return None
    return (160 if (info.arch or "").startswith("gfx950") else 64) * 1024


def pipeline_stages(two_stage_lds: int) -> int:
    """Software-pipeline depth of a walk or scan launch: 2 (the next chunk's operands fetched early),
    or 1 on an AMD device whose LDS cannot hold `two_stage_lds`, the bytes two stages ask for as
    Triton compiles the launch (k3lab.isa reports them). A request over the LDS fails at launch."""
    lds = amd_lds_bytes()
    return 2 if lds is None or two_stage_lds <= lds else 1


def dot_precisions(dtype: torch.dtype) -> dict[str, str]:
    """Triton dot precisions per product. fp32 inputs: exact fp32 ('ieee') everywhere (what the CPU tests
    check). 16-bit inputs: one tf32 pass for Aqk, W / U and the walks where the device has one
    (`has_tf32`), else exact fp32 (gfx950: the native 16x16x4 fp32 MFMA); for Akk on NVIDIA too (its
    operands are decay factors <= 1: docs/kda_scan.md has the error it costs), exact fp32 elsewhere; the
    inverse's products and the scan in three tf32 passes ('tf32x3', fp32-class) on NVIDIA, exact fp32
    elsewhere (the seed's rule: the inverse and the composed state maps keep fp32 precision)."""
    if dtype == torch.float32:
        return dict.fromkeys(("akk", "aqk", "inv", "out", "scan", "walk"), "ieee")
    one = "tf32" if has_tf32() else "ieee"
    near, akk = ("tf32x3", "tf32") if env.detect().backend == "cuda" else ("ieee", "ieee")
    return {"akk": akk, "aqk": one, "inv": near, "out": one, "scan": near, "walk": one}
