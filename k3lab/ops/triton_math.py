"""Small Triton device functions that several of k3lab's kernels share (import inside a kernel module).

    tanh(x)                       tanh from exp(-2|x|): no overflow for any |x|, and a short series
                                  near 0, where (1 - e) / (1 + e) would cancel, keeps fp32 accuracy;
                                  portable (Triton's interpreter and every GPU backend)
    situ(g, u, GATE, UP)          SiTU-GLU of one gate and up value in fp32 (k3lab.nn.situ's bounds GATE,
                                  UP): GATE tanh(g / GATE) sigmoid(g) * UP tanh(u / UP), the sigmoid
                                  from exp(-|g|) so nothing overflows; the SiTU-GLU kernel and the GEMV
                                  that takes a gate|up row both compute it, so their roundings agree
    round_to(x, dtype, INT_ROUND) x cast to dtype, rounding to nearest even as torch does. A GPU's
                                  conversion instruction already does (tests check it bit-exact on a GPU);
                                  Triton's interpreter (the CPU path) truncates bf16 casts, so with
                                  INT_ROUND bf16 is rounded with integer arithmetic.

`triton` is None when Triton is not installed; then nothing else is defined.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the kernels' modules say what runs instead
    triton = None

if triton is not None:

    @triton.jit
    def tanh(x):
        a = tl.abs(x)
        e = tl.exp(-2.0 * a)
        far = (1.0 - e) / (1.0 + e)
        x2 = a * a
        near = a * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
        t = tl.where(a < 0.125, near, far)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def sigmoid(x):
        e = tl.exp(-tl.abs(x))
        return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    @triton.jit
    def situ(g, u, GATE: tl.constexpr, UP: tl.constexpr):
        # the tensor on the left of each product: the interpreter keeps constexpr * tensor a constexpr
        return tanh(g / GATE) * GATE * sigmoid(g) * (tanh(u / UP) * UP)

    @triton.jit
    def round_to(x, dtype: tl.constexpr, INT_ROUND: tl.constexpr):
        if INT_ROUND and dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
