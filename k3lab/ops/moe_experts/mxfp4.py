"""MXFP4 weights (OCP Microscaling, the format the article serves K3's routed experts in): FP4 E2M1
values, two per byte, and one E8M0 scale (a power of two) per block of 32 values along K.

    w = quantize(weight)             # Mxfp4Weight: packed uint8 [N, K/2], scale_exp int8 [N, K/32]
    wd = w.dequantize(torch.float32) # [N, K]: value * 2^scale_exp, exactly (every value is representable)
    w.nbytes                         # 0.5 B per value + 1 B per 32 values = 4.25 bits a weight
    quantize(experts)                # a stack [E, N, K] (every expert's w1, say): packed [E, N, K/2], ...

E2M1 holds sign x {0, 0.5, 1, 1.5, 2, 3, 4, 6}. A block's scale is 2^(floor(log2(amax)) - 2): the block's
largest magnitude then lands in [4, 8) before rounding, at the top of E2M1's range (its largest exponent
is 2), and values past 6 saturate to 6, as the OCP specification's conversion does. Values round to the
nearest E2M1 value, ties to the even code. A block of zeros gets scale 2^-127 (E8M0's smallest) and
zeros. Packing: the value of the even column k in the low nibble of byte k // 2, the odd one in the high
nibble; a nibble is sign (bit 3) and the magnitude's code (bits 0-2, the index into the list above).

Error: below 6 x scale a value is within half a grid step of its code (a step is 0.5, 1 or 2 scale
units), so at most 1/8 of the block's largest magnitude; a block whose largest magnitude is in
(6, 8) x scale saturates it to 6 x scale, up to 1/4 of it (the specification's choice: the scale stays a
power of two). A kernel reading this format is checked against the fp64 product of `dequantize()`,
which it must reproduce up to its accumulation order.

Host-side PyTorch: the packing and the reference the MXFP4 expert kernels (mxfp4_kernels.py beside
it) are checked against. Blocks run along the last dim, so a stack of experts [E, N, K] quantizes as the
E x N rows it is. The format lives with the op whose kernels read it, since ops/ never imports engine/;
the engine quantizes its routed experts with it (`RankWeights.to_article`) and the decode-step study
counts their bytes with `nbytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3lab.ops import expect

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E2M1_EMAX = 2          # the exponent of E2M1's largest binade (4, 6)
E8M0_MIN = -127        # the smallest scale exponent E8M0 encodes (255 is NaN)
E8M0_MAX = 127


@dataclass(frozen=True)
class Mxfp4Weight:
    """A weight [N, K] (or a stack [E, N, K]) in MXFP4: `packed` uint8 [..., N, K // 2] (two E2M1 codes
    a byte, even column low), `scale_exp` int8 [..., N, K // BLOCK] (each block's power-of-two exponent)."""

    packed: torch.Tensor
    scale_exp: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def nbytes(self) -> int:
        """The bytes a kernel streams for this weight: the codes and one byte per block's scale."""
        return self.packed.numel() + self.scale_exp.numel()

    def codes(self) -> torch.Tensor:
        """uint8 [..., N, K]: each value's 4-bit code (sign in bit 3)."""
        lo, hi = self.packed & 0x0F, self.packed >> 4
        return torch.stack((lo, hi), dim=-1).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., N, K] in `dtype`: each value times its block's 2^scale_exp (exact in fp32 and fp64)."""
        if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be a floating dtype (fp32, fp64, bf16, fp16), got {dtype}")
        c = self.codes()
        table = torch.tensor(E2M1, dtype=torch.float64, device=c.device)
        mag = table[(c & 0x07).long()]
        val = torch.where((c & 0x08) != 0, -mag, mag)
        *lead, k = self.shape
        scale = torch.pow(2.0, self.scale_exp.to(torch.float64))  # [..., N, K/32]
        return (val.view(*lead, k // BLOCK, BLOCK) * scale[..., None]).reshape(*lead, k).to(dtype)


def _check_weight(weight) -> None:
    expect("weight", weight)
    if weight.dim() not in (2, 3):
        raise ValueError(f"weight must be 2-D [N, K] or 3-D [E, N, K] (a stack of experts), got shape "
                         f"{tuple(weight.shape)}")
    expect("weight", weight, dtype="float")
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"weight's K ({weight.shape[-1]}) must be a multiple of the block, {BLOCK}")
    if weight.numel() and not bool(torch.isfinite(weight).all()):
        raise ValueError("weight must be finite (no NaN or inf): MXFP4 has no code for them")


# Rows are quantized a slab at a time so the fp64 working copies stay near 8 x _SLAB_VALUES bytes
# each, whatever the weight's size: a whole-stack pass over K3's TP8 experts would want tens of GiB.
_SLAB_VALUES = 1 << 24
# The midpoints between neighbouring E2M1 magnitudes: a magnitude rounds to the code whose interval
# holds it; one exactly on a midpoint is a tie.
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1[:-1], E2M1[1:]))


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `w` [R, K] (any floating dtype) -> packed uint8 [R, K/2], scale exponents int8 [R, K/32]."""
    r, k = w.shape
    w = w.to(torch.float64).reshape(r, k // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1)                                          # [R, K/32]
    exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** E8M0_MIN))) - E2M1_EMAX
    exp = torch.where(amax > 0, exp, torch.full_like(exp, E8M0_MIN)).clamp(E8M0_MIN, E8M0_MAX)
    x = (w / torch.pow(2.0, exp)[..., None]).clamp(-E2M1_MAX, E2M1_MAX)
    mag = x.abs()
    # bucketize puts a magnitude equal to a midpoint in the lower code's bucket; such a tie goes up
    # when the lower code is odd (ties to the even code)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float64, device=w.device)
    best = torch.bucketize(mag, mids)
    tie = mag == mids[best.clamp(max=len(_MIDPOINTS) - 1)]
    best = torch.where(tie & (best % 2 == 1), best + 1, best)
    code = best.to(torch.uint8) | torch.where(x < 0, 8, 0).to(torch.uint8)
    code = torch.where(code == 8, torch.zeros_like(code), code)         # no negative zero
    c = code.view(r, k)
    return c[:, 0::2] | (c[:, 1::2] << 4), exp.to(torch.int8)


def quantize(weight: torch.Tensor) -> Mxfp4Weight:
    """`weight` [N, K] or [E, N, K] (K a multiple of 32, finite, any floating dtype) in MXFP4 (module
    docstring). ValueError / TypeError naming `weight` for anything else. Works a slab of rows at a
    time, so its scratch memory (a few fp64 copies of a 2^24-value slab) does not grow with the weight."""
    _check_weight(weight)
    *lead, k = weight.shape
    n = 1
    for d in lead:
        n *= d
    flat = weight.detach().reshape(n, k)
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(n, k // BLOCK, dtype=torch.int8, device=weight.device)
    rows = max(1, _SLAB_VALUES // max(k, 1))
    for r0 in range(0, n, rows):
        packed[r0:r0 + rows], scale[r0:r0 + rows] = _quantize_rows(flat[r0:r0 + rows])
    return Mxfp4Weight(packed.reshape(*lead, k // 2), scale.reshape(*lead, k // BLOCK))


def bytes_per_weight() -> float:
    """Bytes a kernel streams per MXFP4 weight: half a byte of code and 1/32 of a scale byte
    (4.25 bits)."""
    return 0.5 + 1.0 / BLOCK


def nbytes(*shape: int) -> int:
    """Bytes of an MXFP4 weight of `shape` (the last dim K a multiple of 32): codes plus scales."""
    if not shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    if shape[-1] % BLOCK:
        raise ValueError(f"shape's last dim K ({shape[-1]}) must be a multiple of the block, {BLOCK}")
    n = 1
    for d in shape:
        n *= d
    return n // 2 + n // BLOCK


__all__ = ["BLOCK", "E2M1", "Mxfp4Weight", "bytes_per_weight", "nbytes", "quantize"]
