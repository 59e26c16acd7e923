// mla_read_probe.cu: how fast can the MLA decode's cache bytes be read at all on this GPU? (issue 5)
//
// Diagnostics only, not part of the library (built by scripts/device_mla_read_probe.py with nvcc for
// sm_90a). Three readers of the same bytes, none of which computes anything:
//   ldg_read   - the best plain reader: every thread streams 16-byte loads (8 in flight) over a
//                contiguous buffer, grid-stride, a few blocks per SM;
//   ring_read  - the decode's own data path with the arithmetic taken out: one block per SM, a ring of
//                STAGES 32-row tiles in shared memory filled by the copy engine (cp.async.bulk, one copy
//                per 4-row block as the decode does, or one per tile), over the paged cache through
//                its block table; tiles given to blocks in contiguous pieces (the decode's split) or
//                round-robin;
//   ldg_each / ring with interleave = 2 - every block reads the whole buffer or history by itself: the
//                data path of the before policy (one block walking a request's whole history), so one
//                block's time is what a single SM can stream;
//   tail_kernel - an empty second kernel launched with programmatic dependent launch (PDL) after a
//                reader, as the decode's merge is: what the kernel boundary alone costs.
// Each reader folds what it read into one word that is stored only if it matches a value no input
// produces, so nothing can be optimised away.
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int ROW_BYTES = 576 * 2;
constexpr int TILE_ROWS = 32;
constexpr int BLOCK_ROWS = 4;
constexpr int PITCH = BLOCK_ROWS * ROW_BYTES + 16;
constexpr int STAGE_BYTES = (TILE_ROWS / BLOCK_ROWS) * PITCH;
constexpr unsigned MAGIC = 0x9e3779b9u;

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred P1;\n"
      "PROBE_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
      "@!P1 bra PROBE_WAIT;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// each_block: every block reads all n16 words (the before policy's path), else the grid shares them
__global__ void __launch_bounds__(512) ldg_read(const uint4* __restrict__ p, long long n16, unsigned* sink, int each_block) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  unsigned acc = 0;
  const long long stride = each_block ? (long long)blockDim.x : (long long)gridDim.x * blockDim.x;
  long long i = each_block ? (long long)threadIdx.x : (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 7 * stride < n16; i += 8 * stride) {
    uint4 v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __ldcs(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < 8; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n16; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == MAGIC) sink[0] = acc;
}

// tile t of the request: rows [32 t, 32 t + 32) = half (t % 2) of page table[t / 2] (64-row pages)
template <int STAGES>
__global__ void __launch_bounds__(128, 1) ring_read(const unsigned char* __restrict__ pool, const int* __restrict__ table,
                                                   int ntiles, int interleave, int copies_per_tile, unsigned* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) unsigned long long bars[STAGES];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int nb = gridDim.x, blk = blockIdx.x, tid = threadIdx.x;
  const int per = (ntiles + nb - 1) / nb;
  // interleave: 0 contiguous pieces, 1 round-robin, 2 every block reads every tile
  const int mine = interleave == 2 ? ntiles
                   : interleave  ? (ntiles - blk + nb - 1) / nb
                                 : max(0, min(per, ntiles - blk * per));
  auto tile_of = [&](int j) { return interleave == 2 ? j : interleave ? blk + j * nb : blk * per + j; };
  auto issue = [&](int j) {
    const int t = tile_of(j), st = j % STAGES;
    const unsigned char* src = pool + ((long long)__ldg(table + t / 2) * 64 + (t % 2) * TILE_ROWS) * ROW_BYTES;
    const uint32_t bar = smem_u32(&bars[st]);
    mbar_expect(bar, TILE_ROWS * ROW_BYTES);
    if (copies_per_tile == 1) {
      bulk(smem_u32(smem + st * STAGE_BYTES), src, TILE_ROWS * ROW_BYTES, bar);
    } else {
      for (int c = 0; c < TILE_ROWS / BLOCK_ROWS; ++c)
        bulk(smem_u32(smem + st * STAGE_BYTES + c * PITCH), src + c * BLOCK_ROWS * ROW_BYTES, BLOCK_ROWS * ROW_BYTES, bar);
    }
  };
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&bars[s]));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int j = 0; j < STAGES && j < mine; ++j) issue(j);
  }
  __syncthreads();
  unsigned acc = 0;
  for (int j = 0; j < mine; ++j) {
    mbar_wait(smem_u32(&bars[j % STAGES]), (j / STAGES) & 1);
    acc ^= reinterpret_cast<const unsigned*>(smem + (j % STAGES) * STAGE_BYTES)[tid * 9];
    __syncthreads();  // every thread is done with this stage: refill it
    if (tid == 0 && j + STAGES < mine) issue(j + STAGES);
  }
  if (acc == MAGIC) sink[1 + blk % 8] = acc;
}

__global__ void tail_kernel(unsigned* sink) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0 && blockIdx.x == 0) sink[15] += 1;
}

int launch_tail(int blocks, cudaStream_t st, unsigned* sink) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(128);
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, tail_kernel, sink);
}

}  // namespace

extern "C" {

// tail_blocks > 0: an empty PDL kernel of that many blocks follows the reader
int probe_ldg(const void* p, long long bytes, int blocks, unsigned* sink, int tail_blocks, void* stream) {
  auto st = (cudaStream_t)stream;
  ldg_read<<<blocks, 512, 0, st>>>((const uint4*)p, bytes / 16, sink, 0);
  if (tail_blocks > 0) return launch_tail(tail_blocks, st, sink);
  return (int)cudaGetLastError();
}

// every one of `blocks` blocks reads all `bytes` by itself
int probe_ldg_each(const void* p, long long bytes, int blocks, unsigned* sink, void* stream) {
  ldg_read<<<blocks, 512, 0, (cudaStream_t)stream>>>((const uint4*)p, bytes / 16, sink, 1);
  return (int)cudaGetLastError();
}

int probe_ring(const void* pool, const int* table, int ntiles, int blocks, int stages, int interleave, int copies_per_tile,
               unsigned* sink, int tail_blocks, void* stream) {
  auto st = (cudaStream_t)stream;
  const int bytes = stages * STAGE_BYTES;
  cudaError_t e = cudaSuccess;
  static bool configured = false;  // the opt-in above 48 KB once (never inside a graph capture)
  if (!configured) {
    cudaFuncSetAttribute(ring_read<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * STAGE_BYTES);
    cudaFuncSetAttribute(ring_read<5>, cudaFuncAttributeMaxDynamicSharedMemorySize, 5 * STAGE_BYTES);
    configured = true;
  }
  if (stages == 4) {
    ring_read<4><<<blocks, 128, bytes, st>>>((const unsigned char*)pool, table, ntiles, interleave, copies_per_tile, sink);
  } else if (stages == 5) {
    ring_read<5><<<blocks, 128, bytes, st>>>((const unsigned char*)pool, table, ntiles, interleave, copies_per_tile, sink);
  } else {
    return -1;
  }
  e = cudaGetLastError();
  if (e != cudaSuccess) return (int)e;
  if (tail_blocks > 0) return launch_tail(tail_blocks, st, sink);
  return 0;
}
}
