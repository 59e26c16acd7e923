// mla_before.cu: the conservative MLA decode ("before", seed section 4) written as a competent CUDA-core
// kernel: one block per query row (request x verify token x head) walking the row's whole history, no
// matrix units, no padding. The policy is the one k3lab.ops.mla_decode's Triton `_before_kernel` runs;
// this form of it exists so that the before/after ratios measure the policy, not a slow kernel.
//
// Shape: 576-wide latent rows [c 512 | k_pe 64] in bf16, scores over the whole row, values its first 512
// columns, natural-log lse out. A block of 16 warps; each warp owns positions warp, warp + 16, ... and
// keeps its own online softmax (max, sum, 512-column accumulator: 16 per lane); the warps are combined
// once at the end through shared memory. Per position a lane reads 9 bf16 pairs (pairs lane + 32 i: the
// warp's loads are 128 contiguous bytes each), so a row is one coalesced 1,152-byte read; the dot product
// is reduced by xor shuffles. Four positions per step give each warp 36 loads in flight.
//
// The HIP build compiles (scripts/compile_hip.sh) but is not yet run on AMD hardware by this project.
#include "k3lab_portability.h"

namespace k3mb {

constexpr int D = 576, DV = 512;
constexpr int PAIRS = D / 2 / 32;  // 9 bf16 pairs per lane per row (8 value pairs + 1 rope pair)
constexpr int WARPS = 16;
constexpr int UNROLL = 4;  // positions per warp step (36 loads in flight per warp)

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

__global__ void __launch_bounds__(WARPS * 32) before_kernel(const Args a) {
  const int h = blockIdx.x, t = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint32_t* qrow = reinterpret_cast<const uint32_t*>(a.q + (long long)b * a.q_sb + (long long)t * a.q_st +
                                                           (long long)h * a.q_sh);
  float q2[PAIRS][2];
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const uint32_t x = qrow[lane + 32 * i];
    q2[i][0] = lo_f(x) * a.scale_log2;  // the scale folded into q: scores come out in base-2 units
    q2[i][1] = hi_f(x) * a.scale_log2;
  }
  const int end = a.lengths[b] - a.T + t + 1;  // causal inside a verification group
  float m = -INFINITY, l = 0.f, acc[PAIRS - 1][2];
#pragma unroll
  for (int i = 0; i < PAIRS - 1; ++i) acc[i][0] = acc[i][1] = 0.f;

  for (int p0 = warp * UNROLL; p0 < end; p0 += WARPS * UNROLL) {
    uint32_t k[UNROLL][PAIRS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int pos = min(p0 + u, end - 1);  // a missing second position re-reads the last one, masked below
      const uint32_t* r = row_ptr(a, b, pos);
#pragma unroll
      for (int i = 0; i < PAIRS; ++i) k[u][i] = r[lane + 32 * i];
    }
    float s[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < PAIRS; ++i) d += q2[i][0] * lo_f(k[u][i]) + q2[i][1] * hi_f(k[u][i]);
      s[u] = p0 + u < end ? warp_sum(d) : -INFINITY;
    }
    float mnew = m;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) mnew = fmaxf(mnew, s[u]);
    const float alpha = exp2f(m - mnew);  // m = -inf at the first step: alpha = 0
    float p[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) p[u] = exp2f(s[u] - mnew);
    m = mnew;
    l *= alpha;
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) l += p[u];
#pragma unroll
    for (int i = 0; i < PAIRS - 1; ++i) {
      float x0 = acc[i][0] * alpha, x1 = acc[i][1] * alpha;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        x0 += p[u] * lo_f(k[u][i]);
        x1 += p[u] * hi_f(k[u][i]);
      }
      acc[i][0] = x0;
      acc[i][1] = x1;
    }
  }

  // combine the warps: each warp's (m, l) and accumulator through shared memory
  __shared__ float sm_m[WARPS], sm_l[WARPS];
  __shared__ float sm_acc[WARPS][DV];
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < PAIRS - 1; ++i) {
    sm_acc[warp][2 * (lane + 32 * i)] = acc[i][0];
    sm_acc[warp][2 * (lane + 32 * i) + 1] = acc[i][1];
  }
  __syncthreads();
  float mx = -INFINITY;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, sm_m[w]);
  float wsum = 0.f, wt[WARPS];
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    wt[w] = sm_m[w] == -INFINITY ? 0.f : exp2f(sm_m[w] - mx);  // a warp with no position weighs 0
    wsum += sm_l[w] * wt[w];
  }
  const float inv = 1.f / wsum;
  uint16_t* orow = a.out + (long long)b * a.o_sb + (long long)t * a.o_st + (long long)h * a.o_sh;
  for (int c = threadIdx.x; c < DV; c += WARPS * 32) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) v += sm_acc[w][c] * wt[w];
    orow[c] = k3_f32_to_bf16(v * inv);
  }
  if (threadIdx.x == 0) a.lse[(long long)b * a.l_sb + (long long)t * a.l_st + h] = (mx + __log2f(wsum)) * 0.6931471805599453f;
}

}  // namespace k3mb

K3_EXPORT int k3_mla_before_args_size() { return (int)sizeof(k3mb::Args); }

// One block per (head, verify token, request). 0, -4 for bad sizes, or the runtime's error code.
K3_EXPORT int k3_mla_before(const k3mb::Args* args, void* stream) {
  const k3mb::Args& a = *args;
  if (a.B < 1 || a.B > 65535 || a.T < 1 || a.T > 65535 || a.H < 1 || a.H > 65535 ||
      (a.block_table != nullptr && (a.page_shift < 0 || a.page_shift > 30)))
    return -4;
  k3mb::before_kernel<<<dim3(a.H, a.T, a.B), k3mb::WARPS * 32, 0, (k3_stream_t)stream>>>(a);
  return (int)k3_get_last_error();
}
