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

    rms_inv(x_ptr, eps, D, BLOCK) 1 / sqrt(mean(x[:D]^2) + eps) of one row, the squares summed in fp32
                                  BLOCK at a time (the RMS prologue of every fused norm)
    rms_row(x_ptr, w_ptr, o_ptr, eps, D, BLOCK, INT_ROUND)
                                  o[:D] = x * rms_inv(x) * w, rounded once to o's dtype (`round_to`)

and on the host:

    launch_rows(tuned, kernel, programs, args, common, blocks=, fallback=, tune=)
                                  one launch of a kernel whose programs own BLOCK_N rows: the autotuned
                                  kernel (`tuned`, where `tune` and no blocks are given: a GPU) or the
                                  plain `kernel` with fixed (BLOCK_N, BLOCK_K, warps)

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

    @triton.jit
    def rms_inv(x_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr):
        ks = tl.arange(0, BLOCK)
        ss = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, D, BLOCK):
            x = tl.load(x_ptr + k0 + ks, mask=(k0 + ks) < D, other=0.0).to(tl.float32)
            ss += x * x
        return 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + eps)

    @triton.jit
    def rms_row(x_ptr, w_ptr, o_ptr, eps, D: tl.constexpr, BLOCK: tl.constexpr, INT_ROUND: tl.constexpr):
        inv = rms_inv(x_ptr, eps, D, BLOCK)
        ks = tl.arange(0, BLOCK)
        for k0 in range(0, D, BLOCK):
            ok = (k0 + ks) < D
            x = tl.load(x_ptr + k0 + ks, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + k0 + ks, mask=ok, other=0.0).to(tl.float32)
            tl.store(o_ptr + k0 + ks, round_to(x * inv * w, o_ptr.dtype.element_ty, INT_ROUND), mask=ok)

    def launch_rows(tuned, kernel, programs, args, common, *, blocks=None, fallback=None, tune=True) -> None:
        """One launch of `kernel` (programs of BLOCK_N rows, a BLOCK_K-wide loop): the autotuned `tuned`
        when `tune` (a GPU) and no `blocks` are given, else `kernel` with (BLOCK_N, BLOCK_K, warps) =
        blocks, or `fallback` (the interpreter's shape). programs(BLOCK_N) -> the grid's size; args and
        common: the kernel's positional and keyword arguments beside the block shape."""
        if blocks is None and tune:
            tuned[lambda meta: (programs(meta["BLOCK_N"]),)](*args, **common)
            return
        bn, bk, warps = fallback if blocks is None else blocks
        kernel[(programs(bn),)](*args, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **common)
