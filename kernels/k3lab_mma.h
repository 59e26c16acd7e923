// k3lab_mma.h: the NVIDIA tensor-core and async-copy building blocks shared by the hand-written
// kernels (kda_chunk_prologue.cu, kda_chunk_walk.cu, mla_decode.cu, mla_decode_before.cu): 16-byte cp.async, ldmatrix,
// bf16 packing, the bf16 m16n8k16 mma.sync, and Hopper's mbarriers and bulk copies. CUDA only (sm_80
// and later; the bulk copies sm_90); HIP builds of those kernels do not use it.
#pragma once

#include "k3lab_portability.h"

#if defined(K3_CUDA)

namespace k3mma {

K3_DEVICE uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared by the async copy unit; `valid` false zero-fills instead of reading.
K3_DEVICE void cp16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
K3_DEVICE void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
K3_DEVICE void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

K3_DEVICE uint32_t pack_bf16(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// d (16x8 fp32) += a (16x16 bf16, row) * b (16x8 bf16, col)
K3_DEVICE void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// four 8x8 bf16 matrices from shared memory, each lane giving one row address: as stored (an A
// operand from a row-major tile) or transposed (a B operand from a [k][n] row-major tile)
K3_DEVICE void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
K3_DEVICE void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}


// Hopper's mbarriers and bulk copies (sm_90; the bodies are empty for older targets, whose kernels
// never call them): a barrier expecting `bytes` of copies, waiting on its phase, and `bytes` (a
// multiple of 16, both addresses 16-byte aligned) copied global -> shared by the copy engine,
// completing on `bar`. Used by mla_decode.cu (and the forms it includes) and mla_decode_before.cu.
K3_DEVICE void mbar_init(uint32_t bar, int count) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

K3_DEVICE void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

K3_DEVICE void mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile(
      "{\n\t.reg .pred P1;\n"
      "K3_MBAR_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
      "@!P1 bra K3_MBAR_WAIT;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

K3_DEVICE void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
#endif
}

}  // namespace k3mma

#endif
