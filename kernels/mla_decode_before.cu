// mla_decode_before.cu: the conservative MLA decode ("before", seed section 4) as a CUDA-core kernel, the CUDA
// backend's before (k3lab/ops/mla_decode/cuda.py binds it): one block per query row (request x
// verify token x head) walking the row's whole history, no matrix units, no padding. The policy is
// the Triton backend's `_before_kernel`; this form of it exists so that the before / after ratios
// measure the policy, not a slow kernel.
//
// Layout: 576-wide latent rows [c 512 | k_pe 64] in bf16, scores over the whole row, values its first
// 512 columns, natural-log lse out. A block of 16 warps; each warp owns positions warp, warp + 16, ...
// and keeps its own online softmax (max, sum, 512-column accumulator: 16 per lane); the warps are
// combined once at the end through shared memory. Per position a lane reads 9 bf16 pairs (pairs
// lane + 32 i), so a row is read by the warp in 128-byte pieces; the dot product is reduced by xor
// shuffles. Four positions per warp step (UNROLL).
//
// Two ways to bring the rows in:
//   * ring_kernel (rows dense and 16-byte aligned, the usual case): the history streams through a ring
//     of three 64-row tiles in shared memory, filled by the copy engine (cp.async.bulk, one copy per
//     page piece) from one thread, so the SM keeps ~144 KB in flight while its warps compute;
//   * direct_kernel (any row layout): each lane loads its pairs from global memory, 36 loads in flight
//     per warp.
// Why this shape: per position the block does 1,088 multiply-adds and 576 bf16 conversions on CUDA
// cores, so the arithmetic bounds it, not the stream; the ring beats direct loads on the H200, and
// other unrolls and ring depths were slower (figures: docs/mla_padding.md).
// Limits: bf16, rows 4-byte aligned. The HIP build compiles but is not yet run on AMD hardware by this
// project (the ring is CUDA sm_90 only; HIP always takes the direct kernel).
#include "k3lab_portability.h"
#include "k3lab_mma.h"  // CUDA builds: mbarriers and bulk copies (k3mma), for the ring kernel

namespace k3mb {

constexpr int D = 576, DV = 512;
constexpr int PAIRS = D / 2 / 32;  // 9 bf16 pairs per lane per row (8 value pairs + 1 rope pair)
constexpr int WARPS = 16;
constexpr int UNROLL = 4;             // positions per warp step (9 UNROLL loads in flight per warp)
constexpr int TILE = WARPS * UNROLL;  // ring_kernel: rows per tile (one warp step of every warp)
constexpr int STAGES = 3;             // ring_kernel: tiles in flight
constexpr int ROW_BYTES = D * 2;
constexpr int RING_BYTES = STAGES * TILE * ROW_BYTES;  // 221,184 bytes
static_assert(RING_BYTES <= 227 * 1024 && RING_BYTES >= WARPS * DV * 4 + 2 * WARPS * 4, "the ring must fit and hold the combine");

struct Args {
  const uint16_t* q;           // [B, T, H, 576] bf16 bits
  const uint16_t* kv;          // contiguous [B, L, 576] or a paged pool [pages, page, 576]
  const int* block_table;      // [B, max_pages] or null (contiguous)
  const int* lengths;          // [B]
  uint16_t* out;               // [B, T, H, 512] bf16 bits
  float* lse;                  // [B, T, H] natural log
  long long q_sb, q_st, q_sh;  // strides in elements
  long long kv_sp, kv_sr;      // page (contiguous: request) and row strides
  long long bt_sb;
  long long o_sb, o_st, o_sh;
  long long l_sb, l_st;
  int B, T, H, page_shift;     // page_shift: log2(page size); unused for a contiguous cache
  float scale_log2;            // softmax scale x log2(e)
  int ring;                    // 1: rows dense (576 apart) and 16-byte aligned: ring_kernel may run
};

K3_DEVICE float lo_f(uint32_t x) { return __uint_as_float(x << 16); }
K3_DEVICE float hi_f(uint32_t x) { return __uint_as_float(x & 0xFFFF0000u); }

K3_DEVICE const uint32_t* row_ptr(const Args& a, int b, int pos) {
  long long off;
  if (a.block_table != nullptr) {
    const int page = a.block_table[(long long)b * a.bt_sb + (pos >> a.page_shift)];
    off = (long long)page * a.kv_sp + (long long)(pos & ((1 << a.page_shift) - 1)) * a.kv_sr;
  } else {
    off = (long long)b * a.kv_sp + (long long)pos * a.kv_sr;
  }
  return reinterpret_cast<const uint32_t*>(a.kv + off);
}

K3_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += k3_shfl_xor(v, off);
  return v;
}

// One warp's online softmax over its positions: base-2 max, sum and the 512-column accumulator
// (columns 2 (lane + 32 i) and 2 (lane + 32 i) + 1 for i < 8).
struct WarpState {
  float m = -INFINITY, l = 0.f, acc[PAIRS - 1][2] = {};
};

// The query row's pairs for this lane, the scale folded in so that scores come out in base-2 units.
K3_DEVICE void load_query(const Args& a, int b, int t, int h, int lane, float (&q2)[PAIRS][2]) {
  const uint32_t* qrow = reinterpret_cast<const uint32_t*>(a.q + (long long)b * a.q_sb + (long long)t * a.q_st +
                                                           (long long)h * a.q_sh);
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const uint32_t x = qrow[lane + 32 * i];
    q2[i][0] = lo_f(x) * a.scale_log2;
    q2[i][1] = hi_f(x) * a.scale_log2;
  }
}

// One warp step: UNROLL rows in registers, the first `valid` of them real positions (the rest are
// masked and must hold finite values: they still meet p = 0 in the value sums).
K3_DEVICE void warp_step(WarpState& st, const float (&q2)[PAIRS][2], const uint32_t (&k)[UNROLL][PAIRS], int valid) {
  float s[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    float d = 0.f;
#pragma unroll
    for (int i = 0; i < PAIRS; ++i) d += q2[i][0] * lo_f(k[u][i]) + q2[i][1] * hi_f(k[u][i]);
    s[u] = u < valid ? warp_sum(d) : -INFINITY;
  }
  float mnew = st.m;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) mnew = fmaxf(mnew, s[u]);
  const float alpha = exp2f(st.m - mnew);  // m = -inf at the first step: alpha = 0
  float p[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) p[u] = exp2f(s[u] - mnew);
  st.m = mnew;
  st.l *= alpha;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) st.l += p[u];
#pragma unroll
  for (int i = 0; i < PAIRS - 1; ++i) {
    float x0 = st.acc[i][0] * alpha, x1 = st.acc[i][1] * alpha;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      x0 += p[u] * lo_f(k[u][i]);
      x1 += p[u] * hi_f(k[u][i]);
    }
    st.acc[i][0] = x0;
    st.acc[i][1] = x1;
  }
}

// Combine the warps' states through shared memory (sm_acc: WARPS x 512 floats, sm_ml: 2 x WARPS) and
// write the row's output and natural-log lse. Every thread of the block calls it.
K3_DEVICE void combine_and_store(const Args& a, const WarpState& st, float* sm_acc, float* sm_ml, int b, int t, int h) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    sm_ml[warp] = st.m;
    sm_ml[WARPS + warp] = st.l;
  }
#pragma unroll
  for (int i = 0; i < PAIRS - 1; ++i) {
    sm_acc[warp * DV + 2 * (lane + 32 * i)] = st.acc[i][0];
    sm_acc[warp * DV + 2 * (lane + 32 * i) + 1] = st.acc[i][1];
  }
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_ml[w]);
  float wsum = 0.f, wt[WARPS];
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    wt[w] = sm_ml[w] == -INFINITY ? 0.f : exp2f(sm_ml[w] - mx);  // a warp with no position weighs 0
    wsum += sm_ml[WARPS + w] * wt[w];
  }
  const float inv = 1.f / wsum;
  uint16_t* orow = a.out + (long long)b * a.o_sb + (long long)t * a.o_st + (long long)h * a.o_sh;
  for (int c = threadIdx.x; c < DV; c += WARPS * 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += sm_acc[w * DV + c] * wt[w];
    orow[c] = k3_f32_to_bf16(v * inv);
  }
  if (threadIdx.x == 0) a.lse[(long long)b * a.l_sb + (long long)t * a.l_st + h] = (mx + __log2f(wsum)) * 0.6931471805599453f;
}

// Rows straight from global memory, any row layout.
__global__ void __launch_bounds__(WARPS * 32) direct_kernel(const Args a) {
  const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float q2[PAIRS][2];
  load_query(a, b, t, h, lane, q2);
  const int end = a.lengths[b] - a.T + t + 1;  // causal inside a verification group
  WarpState st;
  for (int p0 = warp * UNROLL; p0 < end; p0 += WARPS * UNROLL) {
    uint32_t k[UNROLL][PAIRS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const uint32_t* r = row_ptr(a, b, min(p0 + u, end - 1));  // a missing position re-reads the last one
#pragma unroll
      for (int i = 0; i < PAIRS; ++i) k[u][i] = r[lane + 32 * i];
    }
    warp_step(st, q2, k, end - p0);
  }
  __shared__ float sm_acc[WARPS * DV], sm_ml[2 * WARPS];
  combine_and_store(a, st, sm_acc, sm_ml, b, t, h);
}

#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define K3_MB_RING 1
using namespace k3mma;
#endif

// Rows through a ring of STAGES tiles of TILE rows in shared memory, each filled by the copy engine
// (one copy per page piece of the tile; rows past `end` are not copied and never read). Warp w reads
// rows UNROLL w .. UNROLL w + 3 of each tile. Needs dense rows, 16-byte aligned (Args::ring).
__global__ void __launch_bounds__(WARPS * 32, 1) ring_kernel(const Args a) {
#if defined(K3_MB_RING)
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) unsigned long long bars[STAGES];
  const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int end = a.lengths[b] - a.T + t + 1;
  const int ntiles = (end + TILE - 1) / TILE;
  auto issue = [&](int j) {  // thread 0: tile j into stage j % STAGES
    const int r0 = j * TILE, r1 = min(r0 + TILE, end);
    const uint32_t bar = smem_u32(&bars[j % STAGES]), dst = smem_u32(ring + (j % STAGES) * TILE * ROW_BYTES);
    mbar_expect_tx(bar, (uint32_t)(r1 - r0) * ROW_BYTES);
    for (int r = r0; r < r1;) {
      const int n = a.block_table ? min(r1 - r, (1 << a.page_shift) - (r & ((1 << a.page_shift) - 1))) : r1 - r;
      bulk_copy(dst + (r - r0) * ROW_BYTES, row_ptr(a, b, r), (uint32_t)n * ROW_BYTES, bar);
      r += n;
    }
  };
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(smem_u32(&bars[s]), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int j = 0; j < STAGES && j < ntiles; ++j) issue(j);
  }
  float q2[PAIRS][2];
  load_query(a, b, t, h, lane, q2);
  __syncthreads();
  WarpState st;
  for (int j = 0; j < ntiles; ++j) {
    mbar_wait(smem_u32(&bars[j % STAGES]), (j / STAGES) & 1);
    const int p0 = j * TILE + warp * UNROLL;
    if (p0 < end) {
      const uint32_t* rows = reinterpret_cast<const uint32_t*>(ring + (j % STAGES) * TILE * ROW_BYTES) +
                             warp * UNROLL * (ROW_BYTES / 4);
      uint32_t k[UNROLL][PAIRS];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const bool real = p0 + u < end;  // rows past the end were not copied: zeros, not stale bytes
#pragma unroll
        for (int i = 0; i < PAIRS; ++i) k[u][i] = real ? rows[u * (ROW_BYTES / 4) + lane + 32 * i] : 0u;
      }
      warp_step(st, q2, k, end - p0);
    }
    __syncthreads();  // every warp is done with this stage: refill it
    if (threadIdx.x == 0 && j + STAGES < ntiles) issue(j + STAGES);
  }
  // the ring is idle now (every issued copy was waited for): it holds the combine's buffers
  float* sm_acc = reinterpret_cast<float*>(ring);
  combine_and_store(a, st, sm_acc, sm_acc + WARPS * DV, b, t, h);
#endif
}

}  // namespace k3mb

K3_EXPORT int k3_mla_decode_before_args_size() { return (int)sizeof(k3mb::Args); }

// 1 when k3_mla_decode_before takes the ring kernel for arguments with Args::ring set (CUDA builds), else 0.
K3_EXPORT int k3_mla_decode_before_has_ring() {
#if defined(K3_CUDA)
  return 1;
#else
  return 0;
#endif
}

// One block per (head, verify token, request): the ring kernel when a.ring is set (CUDA), else the
// direct one. 0, -4 for bad sizes, or the runtime's error code.
K3_EXPORT int k3_mla_decode_before(const k3mb::Args* args, void* stream) {
  const k3mb::Args& a = *args;
  if (a.B < 1 || a.B > 65535 || a.T < 1 || a.T > 65535 || a.H < 1 || a.H > 65535 ||
      (a.block_table != nullptr && (a.page_shift < 0 || a.page_shift > 30)))
    return -4;
  const dim3 grid(a.H, a.T, a.B);
#if defined(K3_CUDA)
  if (a.ring) {
    static bool configured = false;  // the opt-in above 48 KB of shared memory, once per process
    if (!configured) {
      const cudaError_t e = cudaFuncSetAttribute(k3mb::ring_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 k3mb::RING_BYTES);
      if (e != cudaSuccess) return (int)e;
      configured = true;
    }
    k3mb::ring_kernel<<<grid, k3mb::WARPS * 32, k3mb::RING_BYTES, (k3_stream_t)stream>>>(a);
    return (int)k3_get_last_error();
  }
#endif
  k3mb::direct_kernel<<<grid, k3mb::WARPS * 32, 0, (k3_stream_t)stream>>>(a);
  return (int)k3_get_last_error();
}
