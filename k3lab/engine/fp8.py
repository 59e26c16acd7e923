"""The decode step's projection forms: FP8 (float8_e4m3fn weights with one fp32 scale per output row,
activations quantized per token at run time, the product by `torch._scaled_mm`) and, beside the plain
matmul, k3lab's one-row GEMV (`k3lab.ops.gemv.GemvWeight`); `linear(x, w)` is the step's one call for
any of them and `resolve_projections` says which runs here.

    w = quantize_weight(weight)          # Fp8Linear: wq [N', K'] e4m3fn, scale [1, N'] fp32
    y = fp8_linear(x, w)                 # x [M, K] -> [M, N] in x's dtype
    xin = quantize_input(x, w)           # x quantized once for several projections that read it
    ok, why = fp8_status(device, dtype)  # can FP8 matmul run here?

Scaling: a row r of the weight is stored as round(W[r] * 448 / amax(W[r])) in e4m3fn (448 is its
largest finite value), with scale[r] = amax / 448; a token's activation row likewise. `_scaled_mm`
multiplies the two fp8 operands with fp32 accumulation and applies both scales to its output, so
y[m, n] = sx[m] * sw[n] * sum_k xq[m, k] wq[n, k]. e4m3fn keeps 3 mantissa bits: a quantized value is
within 2^-4 of the original (relative; 2^-10 of the row's scale, absolute, below e4m3fn's smallest
normal), about 2.6% rms, and a projection's output is about 3.5% rms from the unquantized product.
An activation's quantization is five small PyTorch ops (row amax, two on the scale, divide, cast)
before the one `_scaled_mm`.

One row (decode at batch 1; on a GPU, or a CPU in Triton's interpreter): the activation is not
quantized; `k3lab.ops.gemv` reads the e4m3fn weight with its row scales and multiplies the activation
as it is (W8A16), one launch per projection.
At one row a projection is a weight stream, so the saving is the weight's bytes, and the five
quantization launches (each a few microseconds of latency) would cost more than the product itself.
The result is the product with the dequantized weight (`Fp8Linear.dequantize`), closer to the
unquantized one than W8A8's. More rows, or emulated weights, take the W8A8 path above.

Shapes: cuBLASLt takes the inner dimension K and the output width N in multiples of 16; the token
dimension M is not restricted (torch checks only K and N), so decode's M = batch x q_len runs unpadded.
`quantize_weight` pads N and K with zero rows / columns to multiples of 16 (a KDA layer's stacked input
projection is 4C + H + r = 6,284 rows at TP8) and `fp8_linear` pads x's columns to match and slices
the output back to N.

Devices: on CUDA the product needs compute capability >= 8.9 and a torch whose `_scaled_mm` takes
per-row scales (bf16 output there); on a CPU, torch's `_scaled_mm` runs e4m3fn with fp32 output where
this torch has it. Where it has not, `emulated=True` weights run the same arithmetic in plain PyTorch
(dequantize, then an fp32 matmul): a CPU-only stand-in so the step's tests run everywhere; a step
never takes it on a GPU. `fp8_status` probes one small product on the device and says why not.

Everything here is device ops only (no host reads), so a step with FP8 projections is captured in one
CUDA graph like the bf16 one (tests/test_step_fp8.py's GPU tests, the decode_step study's all_on_fp8).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import torch.nn.functional as F

from k3lab.ops.gemv import BACKENDS as GEMV_BACKENDS
from k3lab.ops.gemv import GemvWeight

FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_FLOOR = 1e-12  # an all-zero row gets this amax: its scale stays finite and its values zero
ALIGN = 16  # cuBLASLt's multiple for K and N
PROJECTIONS = ("bf16", "gemv", "fp8")  # gemv: bf16 weights, one-row products by k3lab.ops.gemv
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}


@dataclass
class Fp8Linear:
    """One projection in FP8: wq [N', K'] float8_e4m3fn (row-major; N', K' = out_features,
    in_features rounded up to 16, the padding zero), scale [1, N'] fp32 (row r's dequantization
    scale), emulated: run the plain-PyTorch stand-in instead of `_scaled_mm` (CPU tests only)."""

    wq: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int
    emulated: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def nbytes(self) -> int:
        return self.wq.numel() * self.wq.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self) -> torch.Tensor:
        """The weight this projection multiplies by, [N, K] fp32 (wq * scale, padding cut)."""
        return (self.wq.float() * self.scale.t())[:self.out_features, :self.in_features]


def round_up(n: int) -> int:
    """n rounded up to a multiple of ALIGN (16)."""
    return -(-n // ALIGN) * ALIGN


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3fn quantization of t [M, K] (any float dtype): (q [M, K] float8_e4m3fn, scale [M, 1]
    fp32) with t ~= q * scale; each row's largest magnitude maps to 448. Device ops only."""
    amax = torch.linalg.vector_norm(t, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_min_(AMAX_FLOOR).div_(FP8_MAX)
    # |t / scale| <= 448 up to one fp32 rounding, which e4m3fn's round-to-nearest maps to 448 (values
    # only turn NaN from 480 up), so no clamp is needed.
    return (t / scale).to(FP8).contiguous(), scale  # row-major, as _scaled_mm's first operand must be


def quantize_weight(w: torch.Tensor, *, emulated: bool = False, chunk_rows: int = 4096) -> Fp8Linear:
    """w [N, K] (bf16 / fp32, the layout `x @ w.t()` reads) -> Fp8Linear, per-row scales, N and K
    padded to multiples of 16. Quantized `chunk_rows` rows at a time (bounded fp32 scratch on a GPU)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"w must be a 2-D float weight [out_features, in_features], got {tuple(w.shape)} "
                         f"{w.dtype}")
    N, K = w.shape
    wq = torch.zeros(round_up(N), round_up(K), dtype=FP8, device=w.device)
    scale = torch.ones(1, wq.shape[0], dtype=torch.float32, device=w.device)
    w = w.detach()
    for lo in range(0, N, chunk_rows):
        q, s = quantize_rows(w[lo:lo + chunk_rows])
        wq[lo:lo + q.shape[0], :K] = q
        scale[0, lo:lo + q.shape[0]] = s[:, 0]
    return Fp8Linear(wq, scale, N, K, emulated)


@dataclass
class Fp8Input:
    """An activation quantized once for the FP8 projections that read it: q [M, K'] float8_e4m3fn
    (K' = in_features rounded up to 16, the padding zero), scale [M, 1] fp32, dtype: the activation's."""

    q: torch.Tensor
    scale: torch.Tensor
    in_features: int
    dtype: torch.dtype


# the one-row GEMV's row (k3lab.ops.gemv): its `after` (x, w, scale, glu, N, K) and `stack` (x, parts) run
# every one-row product of a step, on inputs of the shapes checked here, where `_gemv_runs` says it runs
GEMV = GEMV_BACKENDS["triton"]


@functools.lru_cache(maxsize=None)
def _gemv_runs(device: str) -> bool:
    return GEMV_BACKENDS.check("triton", torch.device(device))[0]


def _one_row_x(x, cpu: bool = False) -> bool:
    """x is one row with contiguous columns where the one-row GEMV runs (on a GPU; cpu: on CPU tensors
    too, in Triton's interpreter, as a `GemvWeight` takes them)."""
    return (isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[0] == 1 and x.stride(-1) == 1
            and (cpu or x.device.type != "cpu") and _gemv_runs(str(x.device)))


def gemv_one_row(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                 glu: bool = False) -> torch.Tensor:
    """x [1, K] (or [1, 2K] gate | up with glu) @ w [N, K]^T by the one-row GEMV's row (times the row
    scales of an e4m3fn w): [1, N] in x's dtype."""
    N, K = w.shape
    return GEMV.after(x, w, scale, glu, N, K)


def one_row(x, w) -> bool:
    """Whether `fp8_linear(x, w)` takes the one-row W8A16 path (module docstring): x a single row with
    contiguous columns where k3lab.ops.gemv runs (a GPU, or Triton's interpreter on a CPU: the same
    arithmetic as the GPU's), w real (not emulated) FP8."""
    return isinstance(w, Fp8Linear) and not w.emulated and _one_row_x(x, cpu=True)


def one_row_parts(x, weights) -> list | None:
    """[(weight, row scales or None), ...] for `k3lab.ops.gemv.gemv_stack` when every weight of
    `weights` takes x by the one-row GEMV (a `GemvWeight`, or an FP8 weight where `one_row(x, w)`) and
    x is one row where the GEMV runs (`one_row`); else None (each runs through `linear`)."""
    if not _one_row_x(x, cpu=True):
        return None
    out = []
    for w in weights:
        if isinstance(w, GemvWeight):
            out.append((w.weight, None))
        elif isinstance(w, Fp8Linear) and one_row(x, w):
            out.append((w.wq[:w.out_features, :w.in_features], w.scale[0]))
        else:
            return None
    return out


def quantize_input(x: torch.Tensor, w):
    """x [M, K] quantized per row for the FP8 weight w (an Fp8Input, reusable by every projection of the
    same in_features); x itself when w is a plain weight tensor, or where the product takes the one-row
    path (`one_row`), which reads the activation unquantized."""
    if not isinstance(w, Fp8Linear) or one_row(x, w):
        return x
    if x.shape[-1] != w.in_features:
        raise ValueError(f"x must be [M, {w.in_features}] for this projection, got {tuple(x.shape)}")
    padded = x if w.wq.shape[1] == w.in_features else F.pad(x, (0, w.wq.shape[1] - w.in_features))
    q, scale = quantize_rows(padded)
    return Fp8Input(q, scale, w.in_features, x.dtype)


def _dequantized_product(xq: torch.Tensor, sx: torch.Tensor, w: Fp8Linear) -> torch.Tensor:
    """The plain-PyTorch form of `_scaled_mm` with per-row scales: fp32, [M, N']."""
    return (xq.float() @ w.wq.float().t()) * sx * w.scale


def fp8_linear(x, w: Fp8Linear) -> torch.Tensor:
    """x [M, K] (any float dtype, any strides; or an Fp8Input of it) @ the weight.t(): the activation
    quantized per row, the product by `torch._scaled_mm` (or its stand-in for emulated weights); [M, N]
    in x's dtype (a view of the padded output where N is not a multiple of 16). One row on a GPU:
    `k3lab.ops.gemv` on the FP8 weight and its row scales, x unquantized (module docstring)."""
    if one_row(x, w):
        if x.shape[1] != w.in_features:
            raise ValueError(f"x must be [M, {w.in_features}] for this projection, got {tuple(x.shape)}")
        return gemv_one_row(x, w.wq[:w.out_features, :w.in_features], w.scale[0])
    if not isinstance(x, Fp8Input):
        x = quantize_input(x, w)
    elif x.in_features != w.in_features:
        raise ValueError(f"x is quantized for {x.in_features} input features, this projection takes "
                         f"{w.in_features}")
    if w.emulated:
        y = _dequantized_product(x.q, x.scale, w)
    else:
        out = torch.bfloat16 if x.q.is_cuda else x.dtype  # per-row scales on CUDA give bf16 only
        y = torch._scaled_mm(x.q, w.wq.t(), scale_a=x.scale, scale_b=w.scale, out_dtype=out,
                             use_fast_accum=False)
    y = y if y.dtype == x.dtype else y.to(x.dtype)
    return y if w.out_features == y.shape[1] else y[:, :w.out_features]


def linear(x, w) -> torch.Tensor:
    """x @ w.t() for a plain weight tensor, `fp8_linear` for an Fp8Linear (x a tensor or an Fp8Input
    from `quantize_input`): the step's one projection call."""
    if isinstance(w, Fp8Linear):
        return fp8_linear(x, w)
    if isinstance(w, GemvWeight):
        if _one_row_x(x, cpu=True):
            if x.shape[1] != w.shape[1]:
                raise ValueError(f"x must be [1, {w.shape[1]}] for this projection, got {tuple(x.shape)}")
            return gemv_one_row(x, w.weight)
        return x @ w.weight.t()
    if isinstance(x, Fp8Input):
        raise ValueError("x is an FP8-quantized activation but the weight is a plain tensor")
    return x @ w.t()


@functools.lru_cache(maxsize=None)
def _probe(device: str, dtype: torch.dtype) -> str:
    """'' when a 16 x 16 x 16 product with per-row scales runs on `device`, else torch's error."""
    dev = torch.device(device)
    a = torch.ones(16, 16, device=dev).to(FP8)
    b = torch.ones(16, 16, device=dev).to(FP8)
    s = torch.ones(16, 1, device=dev)
    out = torch.bfloat16 if dev.type == "cuda" else dtype
    try:
        y = torch._scaled_mm(a, b.t(), scale_a=s, scale_b=s.t().contiguous(), out_dtype=out)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as e:
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
    if not isinstance(y, torch.Tensor):
        return f"torch {torch.__version__}'s _scaled_mm returns {type(y).__name__}, not one tensor"
    if not bool((y.float() == 16.0).all()):
        return "torch._scaled_mm ran but gave a wrong product on a 16 x 16 x 16 probe"
    return ""


def fp8_status(device, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """(True, '') when `torch._scaled_mm` with float8_e4m3fn and per-row scales runs on `device` for a
    step in `dtype`, else (False, why). CUDA: compute capability >= 8.9 and a passing probe; CPU: the
    probe (torch's CPU kernel); other devices: no."""
    device = torch.device(device)
    if FP8 is None or not hasattr(torch, "_scaled_mm"):
        return False, f"torch {torch.__version__} has no float8_e4m3fn / torch._scaled_mm"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if torch.version.hip is None and cap < (8, 9):
            return False, (f"FP8 matmul needs CUDA compute capability >= 8.9 (Ada, Hopper and later); this "
                           f"GPU is {cap[0]}.{cap[1]}")
    elif device.type != "cpu":
        return False, f"FP8 projections run on CUDA or the CPU, not on {device.type}"
    why = _probe(str(device), dtype)
    if why:
        return (
            False,
            f"torch._scaled_mm with e4m3fn and per-row scales does not run on {device.type} here ({why})",
        )
    return True, ""


def check_projections(projections) -> str:
    """projections itself when it is one of PROJECTIONS, else a ValueError naming it."""
    if projections not in PROJECTIONS:
        raise ValueError(f"projections must be one of {PROJECTIONS}, got {projections!r}")
    return projections


def resolve_projections(projections: str, device, dtype: torch.dtype, *,
                        strict: bool = False) -> tuple[str, str]:
    """(what runs, note): 'fp8', 'fp8_emulated' or the step's dtype ('bf16'; 'fp32' for the CPU's fp32
    steps, whose plain projections are fp32) and why it differs from `projections` ('' when it does not).
    FP8 that cannot run: a GPU falls back to the step's dtype (ValueError with strict=True); a CPU
    runs the plain-PyTorch emulation, so the CPU tests still check the FP8 arithmetic."""
    check_projections(projections)
    plain = DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))
    if projections == "bf16":
        return plain, ""
    device = torch.device(device)
    if projections == "gemv":
        ok, why = GEMV_BACKENDS.check("triton", device)
        if ok:
            return "gemv", ""
        if strict:
            raise ValueError(f"projections='gemv' cannot run here ({why}); pass strict=False to run "
                             f"torch.matmul")
        return plain, f"{why}: the projections run as torch.matmul in {plain}"
    ok, why = fp8_status(device, dtype)
    if ok:
        return "fp8", ""
    if strict:
        raise ValueError(f"projections='fp8' cannot run here ({why}); pass strict=False to run the "
                         "step's dtype instead, or projections='bf16'")
    if device.type == "cpu" and FP8 is not None:
        return "fp8_emulated", (f"{why}: the FP8 arithmetic runs as a plain-PyTorch emulation (dequantize, "
                                "fp32 matmul), for CPU tests only")
    return plain, f"{why}: the projections run in {plain}"


def weights_for(weights, ran: str):
    """(weights in the form a step whose projections resolved to `ran` reads, what then runs, why that
    differs from `ran`): RankWeights in the step's dtype are converted (`to_fp8`, the step's own copy)
    for FP8 and the one-row GEMV; converted ones are taken as they are (a later step reusing an earlier
    step's `weights`). ValueError for converted weights and a plain step,
    emulated weights off the CPU, or `_scaled_mm` weights where it cannot run."""
    held = weights.projections
    if ran == "gemv":
        if held == "gemv":
            return weights, ran, ""
        if held != "bf16":
            raise ValueError(f"weights hold {held} projections but this step runs gemv: pass the unconverted "
                             f"RankWeights")
        return weights.to_gemv(), ran, ""
    if not ran.startswith("fp8"):
        if held != "bf16":
            raise ValueError(f"weights hold {held} projections but this step runs {ran}: pass "
                             f"projections='fp8', or the unconverted RankWeights")
        return weights, ran, ""
    if held == "bf16":
        return weights.to_fp8(emulated=ran == "fp8_emulated"), ran, ""
    if held == "fp8_emulated" and ran == "fp8":
        if weights.device.type != "cpu":
            raise ValueError("weights were converted with to_fp8(emulated=True), the CPU-only stand-in; "
                             "convert them with to_fp8() on a GPU")
        return weights, held, "weights converted with to_fp8(emulated=True): the plain-PyTorch product runs"
    if held == "fp8" and ran == "fp8_emulated":
        raise ValueError("weights were converted with to_fp8() but torch._scaled_mm cannot run here: convert "
                         "the unconverted RankWeights with to_fp8(emulated=True), or pass them to the step")
    return weights, ran, ""
