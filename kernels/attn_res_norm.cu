// attn_res_norm.cu: AttnRes + RMSNorm for a few tokens, one token's row spread over a cluster.
//
// Per token: prefix <- bf16(prefix + delta) (round to nearest even, as torch); sources = the stored
// blocks then the partial; logit_i = (w . v_i) / rms(v_i), w = the folded AttnRes weight (fp32);
// h = sum_i softmax(logit)_i v_i in fp32; out = bf16(h / rms(h) * w_next); at a block boundary
// (push) blocks[n] <- the partial and prefix <- 0.
//
// Why this shape: at one token a single program (the Triton kernel, k3lab/ops/attn_res_norm/) runs on
// one SM, and that SM's instruction issue bounds the step (9 sources, hidden 7168: ~2,450
// instructions per thread). Here a token's row is cut into 1024-column pieces, one block of 128
// threads each (7 blocks for 7168), and the blocks of a row form a thread-block cluster. What a
// block needs from the others is small:
//   1. each source's (w . v, v . v) over its columns: 18 floats, pushed into every peer's shared
//      memory, then every block forms the logits and the softmax weights and mixes its columns;
//   2. its partial h . h: one float, pushed the same way, then every block normalises and stores.
// Each exchange is a cluster barrier (arrive with release, wait with acquire), no memory round trip.
//
// Layouts: prefix, delta, out [T, D] bf16; blocks [max_blocks, T, D] bf16 (block stride given);
// w_mix, w_next [D] fp32; rows 16-byte aligned, D a multiple of 8.
// Limits: CUDA, compute capability 9.0+, D <= 8 x 1024, at most 8 stored blocks. HIP builds compile
// but have no kernel (k3_attn_res_has_cluster() == 0). Figures: docs/copy_removal.md.
#include "k3lab_portability.h"

#if defined(K3_CUDA)
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#endif

namespace k3arn {

constexpr int NT = 128;             // threads per block
constexpr int VEC = 8;              // bf16 columns per thread and piece: one 16-byte load
constexpr int PIECE = NT * VEC;     // 1024 columns per piece
constexpr int MAXB = 8;             // stored blocks at most (K3: 9 sources)
constexpr int NSTAT = 2 * MAXB + 2; // (w . v, v . v) per stored block, then the partial's
constexpr int GROUPS = NT / 32;     // 32-lane reduction groups (a warp, or half an AMD wavefront)
constexpr int MAX_PIECES = 8;       // a portable cluster

struct Args {
  uint16_t* prefix;        // [T, D] bf16, updated in place
  const uint16_t* delta;   // [T, D] bf16, or null
  uint16_t* blocks;        // [max_blocks, T, D] bf16
  uint16_t* out;           // [T, D] bf16
  const float* w_mix;      // [D] fp32: res_norm_w * res_proj_w
  const float* w_next;     // [D] fp32: the next RMSNorm's weight
  long long stride_block;  // elements between two stored blocks (T * D when contiguous)
  int T, D, n_blocks, push;
  float eps;
};

struct Chunk {  // one thread's VEC columns of every source
  float x[VEC];             // the updated partial, as fp32
  uint4 b[MAXB];            // stored blocks, 8 bf16 each
};

K3_DEVICE void unpack(uint4 q, float* f) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

K3_DEVICE uint4 pack(const float* f) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    w[i] = (uint32_t)k3_f32_to_bf16(f[2 * i]) | ((uint32_t)k3_f32_to_bf16(f[2 * i + 1]) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Load a thread's columns [col, col + VEC) of the row: read the partial, the delta and the stored
// blocks, then update the partial (and store it, or push it into blocks[n_blocks]). Every load comes
// before the first store in the source: the compiler cannot move a load past a store that may alias
// it, and one DRAM round trip after another is most of a one-token step. Columns past D read as zero
// and store nothing.
K3_DEVICE void load_chunk(const Args& a, long long base, int col, bool update, Chunk& c) {
  const bool in = col < a.D;
  uint4 xq = make_uint4(0, 0, 0, 0), dq = make_uint4(0, 0, 0, 0);
  if (in) xq = *(const uint4*)(a.prefix + base + col);
  if (update && in && a.delta) dq = *(const uint4*)(a.delta + base + col);
#pragma unroll
  for (int b = 0; b < MAXB; ++b)
    c.b[b] = (in && b < a.n_blocks) ? *(const uint4*)(a.blocks + b * a.stride_block + base + col)
                                    : make_uint4(0, 0, 0, 0);
  unpack(xq, c.x);
  if (update && in) {
    if (a.delta) {
      float d[VEC];
      unpack(dq, d);
#pragma unroll
      for (int j = 0; j < VEC; ++j) c.x[j] = __uint_as_float((uint32_t)k3_f32_to_bf16(c.x[j] + d[j]) << 16);
      xq = pack(c.x);  // exact: every value is already a bf16
    }
    if (a.push) {
      *(uint4*)(a.blocks + a.n_blocks * a.stride_block + base + col) = xq;
      *(uint4*)(a.prefix + base + col) = make_uint4(0, 0, 0, 0);
    } else if (a.delta) {
      *(uint4*)(a.prefix + base + col) = xq;
    }
  }
}

K3_DEVICE void add_stats(const Chunk& c, const float* w, float* st, int n_blocks) {
#pragma unroll
  for (int b = 0; b < MAXB; ++b) {
    if (b >= n_blocks) break;
    float f[VEC];
    unpack(c.b[b], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      st[2 * b] = fmaf(f[j], w[j], st[2 * b]);
      st[2 * b + 1] = fmaf(f[j], f[j], st[2 * b + 1]);
    }
  }
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    st[2 * MAXB] = fmaf(c.x[j], w[j], st[2 * MAXB]);
    st[2 * MAXB + 1] = fmaf(c.x[j], c.x[j], st[2 * MAXB + 1]);
  }
}

K3_DEVICE void mix(const Chunk& c, const float* p, float px, float* h, int n_blocks) {
#pragma unroll
  for (int j = 0; j < VEC; ++j) h[j] = px * c.x[j];
#pragma unroll
  for (int b = 0; b < MAXB; ++b) {
    if (b >= n_blocks) break;
    float f[VEC];
    unpack(c.b[b], f);
#pragma unroll
    for (int j = 0; j < VEC; ++j) h[j] = fmaf(p[b], f[j], h[j]);
  }
}

K3_DEVICE void load_weights(const float* w, int col, int D, float* out) {
  if (col < D) {
    const float4 lo = *(const float4*)(w + col), hi = *(const float4*)(w + col + 4);
    out[0] = lo.x; out[1] = lo.y; out[2] = lo.z; out[3] = lo.w;
    out[4] = hi.x; out[5] = hi.y; out[6] = hi.z; out[7] = hi.w;
  } else {
#pragma unroll
    for (int j = 0; j < VEC; ++j) out[j] = 0.f;
  }
}

// Sum `n` per-thread values over the block: each 32-lane group reduces, then thread i < n adds the
// groups' i-th sums. red is [GROUPS][n] in shared memory; the result is valid in threads i < n.
template <int N>
K3_DEVICE void block_sums(const float* v, float (*red)[N], float* out_lane) {
  const int tid = threadIdx.x, grp = tid / 32, lane = tid % 32;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float s = k3_group32_sum(v[i]);
    if (lane == 0) red[grp][i] = s;
  }
  __syncthreads();
  if (tid < N) {
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < GROUPS; ++g) s += red[g][tid];
    *out_lane = s;
  }
}

// The softmax weights from the row's statistics st[NSTAT] (every thread computes them).
K3_DEVICE void weights(const float* st, int n_blocks, int D, float eps, float* p, float* px) {
  float logit[MAXB + 1];
  float m = -INFINITY;
#pragma unroll
  for (int b = 0; b <= MAXB; ++b) {
    const int s = b < MAXB ? b : MAXB;  // slot MAXB is the partial
    const bool live = b < n_blocks || b == MAXB;
    logit[b] = live ? st[2 * s] * rsqrtf(st[2 * s + 1] / D + eps) : -INFINITY;
    m = fmaxf(m, logit[b]);
  }
  float e[MAXB + 1], sum = 0.f;
#pragma unroll
  for (int b = 0; b <= MAXB; ++b) {
    e[b] = (b < n_blocks || b == MAXB) ? __expf(logit[b] - m) : 0.f;
    sum += e[b];
  }
  const float inv = 1.f / sum;
#pragma unroll
  for (int b = 0; b < MAXB; ++b) p[b] = e[b] * inv;
  *px = e[MAXB] * inv;
}

K3_DEVICE void store_out(const Args& a, long long base, int col, const float* h, float r, const float* wn) {
  if (col >= a.D) return;
  float y[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) y[j] = h[j] * r * wn[j];
  *(uint4*)(a.out + base + col) = pack(y);
}

#if defined(K3_CUDA)
// One row per cluster of P blocks, one 1024-column piece per block; grid (P, T), cluster (P, 1, 1).
// Declared in every CUDA pass, its body compiled for sm_90 and later only (clusters).
template <int P>
__global__ void __launch_bounds__(NT) arn_cluster_kernel(Args a) {
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  __shared__ float red[GROUPS][NSTAT];
  __shared__ float peer_stats[P][NSTAT];  // written by every block of the cluster (DSMEM)
  __shared__ float peer_hh[P];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  k3_cluster_arrive_relaxed();  // phase 1: "started" (my shared memory exists), waited on before a push
  const int tid = threadIdx.x;
  const long long base = (long long)blockIdx.y * a.D;
  const int col = rank * PIECE + tid * VEC;
  float w[VEC], wn[VEC];  // both weights read now, with the row: no memory wait after the barriers
  load_weights(a.w_mix, col, a.D, w);
  load_weights(a.w_next, col, a.D, wn);
  Chunk c;
  load_chunk(a, base, col, true, c);
  float st[NSTAT] = {};
  add_stats(c, w, st, a.n_blocks);
  float mine = 0.f;
  block_sums<NSTAT>(st, red, &mine);
  k3_cluster_wait();
  if (tid < NSTAT) {
#pragma unroll
    for (int q = 0; q < P; ++q) *cluster.map_shared_rank(&peer_stats[rank][tid], q) = mine;
  }
  k3_cluster_arrive_release();  // phase 2: my statistics are in every peer
  k3_cluster_wait();
  float all[NSTAT];
#pragma unroll
  for (int i = 0; i < NSTAT; ++i) {
    float s = 0.f;
#pragma unroll
    for (int q = 0; q < P; ++q) s += peer_stats[q][i];
    all[i] = s;
  }
  float p[MAXB], px, h[VEC];
  weights(all, a.n_blocks, a.D, a.eps, p, &px);
  mix(c, p, px, h, a.n_blocks);
  float hh[1] = {0.f};
#pragma unroll
  for (int j = 0; j < VEC; ++j) hh[0] = fmaf(h[j], h[j], hh[0]);
  __syncthreads();  // red is reused
  float mine_hh = 0.f;
  block_sums<1>(hh, (float(*)[1])red, &mine_hh);
  if (tid == 0) {
#pragma unroll
    for (int q = 0; q < P; ++q) *cluster.map_shared_rank(&peer_hh[rank], q) = mine_hh;
  }
  k3_cluster_arrive_release();  // phase 3: my |h|^2 part is in every peer (no push comes after this)
  k3_cluster_wait();
  float total = 0.f;
#pragma unroll
  for (int q = 0; q < P; ++q) total += peer_hh[q];
  store_out(a, base, col, h, rsqrtf(total / a.D + a.eps), wn);
#else
  (void)a;
#endif
}
#endif

#if defined(K3_CUDA)
template <int P>
static int launch_cluster(const Args& a, k3_stream_t st) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(P, a.T, 1);
  cfg.blockDim = dim3(NT);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = P;  // the pieces of one row
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return (int)cudaLaunchKernelEx(&cfg, arn_cluster_kernel<P>, a);
}
#endif

}  // namespace k3arn

// ---------------------------------------------------------------------------------------------
// C entry points (ctypes).

K3_EXPORT int k3_attn_res_args_size() { return (int)sizeof(k3arn::Args); }

// 1 when this build has the cluster kernel (CUDA builds; the device must also be sm_90 or later).
K3_EXPORT int k3_attn_res_has_cluster() {
#if defined(K3_CUDA)
  return 1;
#else
  return 0;
#endif
}

// A cluster of ceil(D / 1024) <= 8 blocks per row (CUDA, sm_90 and later). Returns 0, a runtime
// error code, -2 for bad arguments, -5 where this build or row width has no kernel.
K3_EXPORT int k3_attn_res_norm(const k3arn::Args* a, void* stream) {
  if (a->D % k3arn::VEC != 0 || a->n_blocks < 0 || a->n_blocks > k3arn::MAXB || a->T < 0) return -2;
  if (a->T == 0) return 0;
#if defined(K3_CUDA)
  k3_stream_t st = (k3_stream_t)stream;
  switch ((a->D + k3arn::PIECE - 1) / k3arn::PIECE) {
    case 1: return k3arn::launch_cluster<1>(*a, st);
    case 2: return k3arn::launch_cluster<2>(*a, st);
    case 3: return k3arn::launch_cluster<3>(*a, st);
    case 4: return k3arn::launch_cluster<4>(*a, st);
    case 5: return k3arn::launch_cluster<5>(*a, st);
    case 6: return k3arn::launch_cluster<6>(*a, st);
    case 7: return k3arn::launch_cluster<7>(*a, st);
    case 8: return k3arn::launch_cluster<8>(*a, st);
    default: return -5;
  }
#else
  (void)stream;
  return -5;
#endif
}
