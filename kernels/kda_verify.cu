// kda_verify.cu: KDA speculative verification (seed section 5) as one hand-written kernel.
//
// For every (sequence b, head h, tile of BV value columns) a block walks the T draft positions:
//   u = S^T (d k),  p = S^T (d q),  delta = beta (v - u),  S <- d S + k delta^T,
//   o = S^T q = p + (q . k) delta          (d = exp g per key row, q pre-scaled),
// and writes the fp32 state after every position (for rollback) or only the last one.
//
// Measured on the H200 (B = 1, T = 4, 12 heads, graph replay): 4.09 us for FORM 0 with 8 columns x
// 4 warps against 4.16 us for the Triton step form in the same run; so it is opt-in, not the default.
//
// Why a CUDA kernel next to the Triton one (k3lab/ops/kda_verify.py): at B = 1 the kernel is a chain
// of dependent steps run by a few hundred programs, so what counts is the instruction stream of one
// warp between the state load and the last store. Triton 3.6 gives the narrow kernel one warp with
// 32 state values per lane and moves its [K] vectors into the tile's register layout through shared
// memory (16 barriers, ~1,700 SASS instructions at T = 4 for sm_90a). Here the mapping is chosen by
// hand so no value ever changes layout:
//   * a block of W warps owns a [128 x BV] state tile; lane = (column c = lane % BV, key group
//     lane / BV); warp w holds key groups w * (32 / BV) ..; each thread keeps R = 4 BV / W contiguous
//     key rows of one column, so its q, k, g slices are contiguous (16-byte vector loads) and the
//     reduction over K is R in-thread products, log2(32 / BV) lane shuffles and, across warps, one
//     shared-memory exchange (one barrier per reduction round);
//   * every load (state and every position's q, k, g, v, beta) is issued before any arithmetic, so
//     the whole block waits for one memory round trip: every loaded word passes through a zero read
//     from shared memory after a barrier, so no arithmetic can be scheduled before the last load
//     (a first version staged the inputs through shared memory with cp.async instead: 7.57 us at
//     B = 1, T = 4 on the H200, against 4.09 us for this form; removed after it faulted there);
//   * FORM 0 ('step'): one reduction round per position (u, p and q.k together);
//     FORM 1 ('chunk'): the T positions as one small chunk: every reduction over K happens in one
//     round, a_t = S0^T (c_t k_t), b_t = S0^T (c_t q_t) with c_t the cumulative decay, and the
//     state-independent T x T products A[t][i] = k_t . (c_t / c_i) k_i (i < t) and
//     B[t][i] = q_t . (c_t / c_i) k_i (i <= t); then, per column and with no communication,
//     delta_t = beta_t (v_t - a_t - sum_{i<t} A[t][i] delta_i), o_t = b_t + sum_{i<=t} B[t][i] delta_i,
//     and the states by the elementwise recursion S_t = d_t S_{t-1} + k_t delta_t^T. One barrier
//     instead of T, at the price of ~T^2 more products per key row.
// T (1..8) is a template argument, so every loop unrolls and no branch splits the chain; positions
// at or past a ragged sequence's length read nothing, run as identity updates and are not written
// (lengths mode: their o rows are zeros).
//
// Layouts: q, k [rows, H, 128], v, o [rows, H, 128], g [rows, H, 128], beta [rows, H] with rows the
// token index (B * T uniform and lengths modes, total tokens with cu_seqlens); q, k, v, o bf16 or
// fp32 (one dtype), g and beta bf16 or fp32 each. States fp32 [.., H, 128 (K), 128 (V)] (fla's).
// Other value widths and the [V, K] state layout run the Triton kernels.
//
// Single source for CUDA and HIP through k3lab_portability.h: the lane mapping works inside aligned
// 32-lane groups, so a 64-wide wavefront holds two of them. The HIP build is not yet run on AMD
// hardware by this project.
#include "k3lab_portability.h"

namespace k3kv {

constexpr int HK = 128;  // key head dim (K3's KDA head)
constexpr int HV = 128;  // value head dim (K3's); other widths run the Triton kernels

struct Args {
  const void* q;
  const void* k;
  const void* v;
  const void* g;
  const void* beta;
  const float* h0;        // initial states [N, H, 128, 128]
  void* o;                // outputs, q's dtype
  float* hs;              // states: [rows, H, ..] (all_states) or [N, H, ..]
  const void* seq_info;   // cu_seqlens [N + 1] (mode 1) or lengths [N] (mode 2); unused in mode 0
  long long beta_numel;   // elements in beta (its last word may be half outside)
  int n_seq, T, H;
  int mode;               // 0 uniform [N, T]; 1 cu_seqlens (flattened rows); 2 lengths (padded [N, T])
  int seq64;              // seq_info holds int64 (else int32)
  int all_states;         // 1: the state after every position; 0: only each sequence's last
  int in_bf16;            // q, k, v and o are bf16 (else fp32)
  int g_bf16, beta_bf16;  // g, beta bf16 (else fp32)
  float scale;
};

// ---------------------------------------------------------------------------------------------
// Loads. Plain loads on purpose: read-only (__ldg, ld.global.nc) loads may be moved past
// __syncthreads, and the compiler then sinks later positions' loads to their first use, one memory
// round trip per position.

K3_DEVICE void unpack2(uint32_t w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// exp for the decays: one MUFU.EX2 (flush-to-zero: a decay below 1e-38 is 0)
K3_DEVICE float fast_exp(float x) {
#if defined(K3_CUDA) && defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
#else
  return __expf(x);
#endif
}

K3_DEVICE void store_out(void* o, long long off, bool bf16, float x) {
  if (bf16) static_cast<k3_bf16*>(o)[off] = k3_f32_to_bf16(x);
  else static_cast<float*>(o)[off] = x;
}

// Raw loads: R contiguous elements as 32-bit words (bf16: R / 2 words, two elements each; fp32: R
// words), converted only after the gate below, so no conversion (a consumer) sits among the loads.
template <int R>
K3_DEVICE void load_words(const void* base, long long off, bool bf16, uint32_t (&w)[R]) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(static_cast<const char*>(base) + off * (bf16 ? 2 : 4));
  if constexpr (R % 8 == 0) {  // 16-byte pieces: R / 8 of them (bf16) or R / 4 (fp32)
    if (bf16) {
#pragma unroll
      for (int i = 0; i < R / 8; ++i) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = u.x;
        w[4 * i + 1] = u.y;
        w[4 * i + 2] = u.z;
        w[4 * i + 3] = u.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[i];
        w[4 * i] = u.x;
        w[4 * i + 1] = u.y;
        w[4 * i + 2] = u.z;
        w[4 * i + 3] = u.w;
      }
    }
  } else if constexpr (R == 4) {
    if (bf16) {
      const uint2 u = *reinterpret_cast<const uint2*>(p);
      w[0] = u.x;
      w[1] = u.y;
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(p);
      w[0] = u.x;
      w[1] = u.y;
      w[2] = u.z;
      w[3] = u.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i) w[i] = (!bf16 || i < R / 2) ? p[i] : 0u;
  }
}

// Words -> floats, each word first added to `z` (a zero the compiler cannot see: see the gate).
template <int R>
K3_DEVICE void words_to_floats(const uint32_t (&w)[R], bool bf16, uint32_t z, float (&x)[R]) {
  if (bf16) {
#pragma unroll
    for (int i = 0; i < R / 2; ++i) unpack2(w[i] + z, x[2 * i], x[2 * i + 1]);
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i) x[i] = __uint_as_float(w[i] + z);
  }
}

K3_DEVICE uint32_t load_word(const void* base, long long off, bool bf16) {  // one element, bf16 in the low half
  return bf16 ? static_cast<uint32_t>(static_cast<const k3_bf16*>(base)[off]) : static_cast<const uint32_t*>(base)[off];
}

K3_DEVICE float word_to_float(uint32_t w, bool bf16, uint32_t z) {
  return bf16 ? __uint_as_float((w + z) << 16) : __uint_as_float(w + z);
}


// Sum NV values over the key groups of one column: shuffles inside the 32-lane group, then (W > 1)
// one exchange through shared memory `buf` [NV][BV][W]. Every thread of the column ends with the
// same sums, added in the same order.
template <int BV, int W, int NV>
K3_DEVICE void reduce_columns(float (&x)[NV], float* buf, int warp, int lane) {
#pragma unroll
  for (int off = BV; off < 32; off <<= 1) {
#pragma unroll
    for (int v = 0; v < NV; ++v) x[v] += k3_shfl_xor(x[v], off);
  }
  if constexpr (W > 1) {
    const int c = lane % BV;
    if (lane < BV) {
#pragma unroll
      for (int v = 0; v < NV; ++v) buf[(v * BV + c) * W + warp] = x[v];
    }
    __syncthreads();
#pragma unroll
    for (int v = 0; v < NV; ++v) {
      const float* p = buf + (v * BV + c) * W;
      if constexpr (W == 4) {
        const float4 f = *reinterpret_cast<const float4*>(p);
        x[v] = ((f.x + f.y) + f.z) + f.w;
      } else if constexpr (W == 8) {
        const float4 f = reinterpret_cast<const float4*>(p)[0];
        const float4 e = reinterpret_cast<const float4*>(p)[1];
        x[v] = ((((((f.x + f.y) + f.z) + f.w) + e.x) + e.y) + e.z) + e.w;
      } else {
        float s = p[0];
#pragma unroll
        for (int w = 1; w < W; ++w) s += p[w];
        x[v] = s;
      }
    }
  }
}

__host__ __device__ constexpr int step_values() { return 3; }
__host__ __device__ constexpr int chunk_values(int tm) { return 2 * tm + tm * tm; }

template <int BV, int W, int TM, int FORM>
struct Smem {
  static constexpr int NV = FORM == 0 ? step_values() : chunk_values(TM);
  static constexpr int BUFS = FORM == 0 ? 2 : 1;  // step: double-buffered, one barrier per round
  float red[BUFS][NV * BV * W];
  uint32_t zero;  // the gate's zero (plain loads)
};

template <int BV, int W, int TM, int FORM>
__global__ void __launch_bounds__(W * 32) kda_verify_kernel(const Args a) {
  constexpr int LG = 32 / BV;         // key groups per warp
  constexpr int R = HK / (LG * W);    // key rows per thread
  static_assert(32 % BV == 0 && HK % (LG * W) == 0 && R >= 2, "tile and warps");
  __shared__ __align__(16) Smem<BV, W, TM, FORM> sm;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cl = lane % BV;
  const int k0 = (warp * LG + lane / BV) * R;
  const int c = blockIdx.x * BV + cl;
  const int h = blockIdx.y, b = blockIdx.z;
  const int H = a.H;
  const long long bh = (long long)b * H + h;
  const bool in16 = a.in_bf16 != 0;
  const bool writer = lane < BV && warp == 0;  // one thread per column writes o
  const int tile = k0 * HV + c;                // this thread's first state value in a [128, V] slab

  long long bos;
  int L;
  if (a.mode == 1) {
    const long long s0 = a.seq64 ? static_cast<const long long*>(a.seq_info)[b]
                                 : static_cast<const int*>(a.seq_info)[b];
    const long long s1 = a.seq64 ? static_cast<const long long*>(a.seq_info)[b + 1]
                                 : static_cast<const int*>(a.seq_info)[b + 1];
    bos = s0;
    L = (int)(s1 - s0);
  } else {
    bos = (long long)b * TM;
    L = a.mode == 2 ? (int)(a.seq64 ? static_cast<const long long*>(a.seq_info)[b]
                                    : static_cast<const int*>(a.seq_info)[b])
                    : TM;
  }
  L = L < TM ? L : TM;

  // ---- every load first: the state slice, then each live position's inputs
  float S[R];
  float q[TM][R], kk[TM][R], g[TM][R], vv[TM], bb[TM];
  const bool g16 = a.g_bf16 != 0, b16 = a.beta_bf16 != 0;
  const float* s0 = a.h0 + bh * HK * HV + tile;
  // Plain loads, then a gate. The scheduler is free to place a load's first consumer before the
  // next position's loads are issued, and a consumer stalls the warp until its data arrives (it
  // did: positions 2 and 3 were issued after position 0's arithmetic had waited, a second round
  // trip). Here every loaded word is added to `z`, a zero read from shared memory after a barrier
  // that follows the last load: no consumer can run before every load is in flight, and loads
  // may not sink below a barrier.
  if (tid == 0) sm.zero = 0u;
  uint32_t ws[R], wq[TM][R], wk[TM][R], wg[TM][R], wv[TM], wb[TM];
#pragma unroll
  for (int j = 0; j < R; ++j) ws[j] = __float_as_uint(s0[j * HV]);
#pragma unroll
  for (int t = 0; t < TM; ++t) {
    const long long row = (bos + t) * H + h;
    if (t < L) {
      load_words<R>(a.q, row * HK + k0, in16, wq[t]);
      load_words<R>(a.k, row * HK + k0, in16, wk[t]);
      load_words<R>(a.g, row * HK + k0, g16, wg[t]);
      wv[t] = load_word(a.v, row * HV + c, in16);
      wb[t] = load_word(a.beta, row, b16);
    } else {  // a dead position: k = g = beta = 0 is the identity update, q = 0 gives o = 0
#pragma unroll
      for (int j = 0; j < R; ++j) wq[t][j] = wk[t][j] = wg[t][j] = 0u;
      wv[t] = wb[t] = 0u;
    }
  }
  __syncthreads();
  const uint32_t z = *reinterpret_cast<volatile uint32_t*>(&sm.zero);
#pragma unroll
  for (int j = 0; j < R; ++j) S[j] = __uint_as_float(ws[j] + z);
#pragma unroll
  for (int t = 0; t < TM; ++t) {
    words_to_floats<R>(wq[t], in16, z, q[t]);
    words_to_floats<R>(wk[t], in16, z, kk[t]);
    words_to_floats<R>(wg[t], g16, z, g[t]);
    vv[t] = word_to_float(wv[t], in16, z);
    bb[t] = word_to_float(wb[t], b16, z);
  }
  // Where position t's state goes: its own slab (every state), or the sequence's final slab, written
  // at every position (the last write wins; L2 absorbs the repeats), so no branch splits the chain.
  // A dead position writes nothing when every state is kept (the row belongs to someone else or is
  // padding); with the final state only, its identity update rewrites the same values.
  auto state_dst = [&](int t) -> float* {
    return a.hs + (a.all_states ? ((bos + t) * H + h) : bh) * HK * HV + tile;
  };
  auto o_live = [&](int t) -> bool { return t < L || a.mode == 2; };  // padded rows get o = 0

  // the decays of every position, before the chain (they depend on the inputs only)
  float d[TM][R];
#pragma unroll
  for (int t = 0; t < TM; ++t) {
#pragma unroll
    for (int j = 0; j < R; ++j) d[t][j] = fast_exp(g[t][j]);
  }
  if constexpr (FORM == 0) {
    // ---- step form: one reduction round per position. Everything that depends on the inputs only
    // (d k, d q and the partial q . k) is computed before the chain starts.
    float dk[TM][R], dq[TM][R], qk[TM];
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      qk[t] = 0.f;
#pragma unroll
      for (int j = 0; j < R; ++j) {
        dk[t][j] = d[t][j] * kk[t][j];
        dq[t][j] = d[t][j] * q[t][j];
        qk[t] = fmaf(q[t][j], kk[t][j], qk[t]);
      }
    }
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      // u = S^T (d k) and p = S^T (d q) over this thread's rows, each as two half-length chains
      float x[3], y[2];
      x[0] = S[0] * dk[t][0];
      x[1] = S[0] * dq[t][0];
      x[2] = qk[t];
      y[0] = S[R / 2] * dk[t][R / 2];
      y[1] = S[R / 2] * dq[t][R / 2];
#pragma unroll
      for (int j = 1; j < R / 2; ++j) {
        x[0] = fmaf(S[j], dk[t][j], x[0]);
        x[1] = fmaf(S[j], dq[t][j], x[1]);
        y[0] = fmaf(S[R / 2 + j], dk[t][R / 2 + j], y[0]);
        y[1] = fmaf(S[R / 2 + j], dq[t][R / 2 + j], y[1]);
      }
      x[0] += y[0];
      x[1] += y[1];
      reduce_columns<BV, W, 3>(x, sm.red[t & 1], warp, lane);
      const float delta = bb[t] * (vv[t] - x[0]);
#pragma unroll
      for (int j = 0; j < R; ++j) S[j] = fmaf(S[j], d[t][j], kk[t][j] * delta);
      const float o = a.scale * fmaf(x[2], delta, x[1]);
      if (writer && o_live(t)) store_out(a.o, ((bos + t) * H + h) * HV + c, in16, o);
      if (t < L || !a.all_states) {
        float* dst = state_dst(t);
#pragma unroll
        for (int j = 0; j < R; ++j) dst[j * HV] = S[j];
      }
    }
  } else {
    // ---- chunk form: every reduction over K in one round
    constexpr int NV = chunk_values(TM);
    float x[NV];
#pragma unroll
    for (int v = 0; v < NV; ++v) x[v] = 0.f;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      float cum = 1.f;
      float e[TM];  // e[i] = c_t / c_i for the current t (i < t), products of decays only
#pragma unroll
      for (int t = 0; t < TM; ++t) {
        cum *= d[t][j];
#pragma unroll
        for (int i = 0; i < t; ++i) e[i] = (i == t - 1) ? d[t][j] : e[i] * d[t][j];
        const float sc = S[j] * cum;
        x[t] = fmaf(sc, kk[t][j], x[t]);            // a_t
        x[TM + t] = fmaf(sc, q[t][j], x[TM + t]);   // b_t
        const int base = 2 * TM + t * t;            // t entries of A (i < t), then t + 1 of B
#pragma unroll
        for (int i = 0; i < t; ++i) {
          const float ek = e[i] * kk[i][j];
          x[base + i] = fmaf(kk[t][j], ek, x[base + i]);
          x[base + t + i] = fmaf(q[t][j], ek, x[base + t + i]);
        }
        x[base + 2 * t] = fmaf(q[t][j], kk[t][j], x[base + 2 * t]);
      }
    }
    reduce_columns<BV, W, NV>(x, sm.red[0], warp, lane);
    float delta[TM];
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      const int base = 2 * TM + t * t;
      float u = x[t];
      float o = x[TM + t];
#pragma unroll
      for (int i = 0; i < t; ++i) u = fmaf(x[base + i], delta[i], u);
      delta[t] = bb[t] * (vv[t] - u);
#pragma unroll
      for (int i = 0; i < t; ++i) o = fmaf(x[base + t + i], delta[i], o);
      o = a.scale * fmaf(x[base + 2 * t], delta[t], o);
      if (writer && o_live(t)) store_out(a.o, ((bos + t) * H + h) * HV + c, in16, o);
    }
#pragma unroll
    for (int t = 0; t < TM; ++t) {
#pragma unroll
      for (int j = 0; j < R; ++j) S[j] = fmaf(S[j], d[t][j], kk[t][j] * delta[t]);
      if (t < L || !a.all_states) {
        float* dst = state_dst(t);
#pragma unroll
        for (int j = 0; j < R; ++j) dst[j * HV] = S[j];
      }
    }
  }
}

}  // namespace k3kv

// ---------------------------------------------------------------------------------------------
// exported launchers

// (BV value columns, W 32-lane groups, FORM) compiled; each for T = 1..8 (a template argument).
// form: 0 step, 1 chunk (both: plain loads behind a gate).
// Only configurations that compile without register spills at every T (ptxas, sm_90a): 8 x 2 spilled
// at T >= 5, 4 x 4 at T = 4 and the chunk form on 4 groups at T = 8, so they are not built.
#define K3_KV_CONFIGS(X) \
  X(8, 4, 0)             \
  X(8, 8, 0)             \
  X(4, 2, 0)             \
  X(8, 8, 1)

K3_EXPORT int k3_kda_verify_args_size() { return (int)sizeof(k3kv::Args); }

// Writes up to `max_configs` (tile_v, warps, form) triples; returns how many exist.
K3_EXPORT int k3_kda_verify_configs(int* out, int max_configs) {
  int n = 0;
#define K3_LIST(BV_, W_, F_) \
  if (n < max_configs) {     \
    out[3 * n] = BV_;        \
    out[3 * n + 1] = W_;     \
    out[3 * n + 2] = F_;     \
  }                          \
  ++n;
  K3_KV_CONFIGS(K3_LIST)
#undef K3_LIST
  return n;
}

template <int BV, int W, int F>
static void k3_launch_tm(const k3kv::Args& a, k3_stream_t stream) {
  const dim3 grid(k3kv::HV / BV, a.H, a.n_seq);
  const dim3 block(W * 32);
  switch (a.T) {
    case 1: k3kv::kda_verify_kernel<BV, W, 1, F == 1><<<grid, block, 0, stream>>>(a); break;
    case 2: k3kv::kda_verify_kernel<BV, W, 2, F == 1><<<grid, block, 0, stream>>>(a); break;
    case 3: k3kv::kda_verify_kernel<BV, W, 3, F == 1><<<grid, block, 0, stream>>>(a); break;
    case 4: k3kv::kda_verify_kernel<BV, W, 4, F == 1><<<grid, block, 0, stream>>>(a); break;
    case 5: k3kv::kda_verify_kernel<BV, W, 5, F == 1><<<grid, block, 0, stream>>>(a); break;
    case 6: k3kv::kda_verify_kernel<BV, W, 6, F == 1><<<grid, block, 0, stream>>>(a); break;
    case 7: k3kv::kda_verify_kernel<BV, W, 7, F == 1><<<grid, block, 0, stream>>>(a); break;
    default: k3kv::kda_verify_kernel<BV, W, 8, F == 1><<<grid, block, 0, stream>>>(a); break;
  }
}

// Launch one verification step. tile_v: value columns per block; warps: 32-lane groups per block;
// form: 0 step, 1 chunk. Returns 0, -1 (no such compiled config), -4 (bad sizes) or the runtime's
// error code.
K3_EXPORT int k3_kda_verify(const k3kv::Args* args, int tile_v, int warps, int form, void* stream) {
  const k3kv::Args& a = *args;
  if (a.T < 1 || a.T > 8 || a.H <= 0 || a.n_seq <= 0 || a.n_seq > 65535 || a.H > 65535) return -4;
  const k3_stream_t s = static_cast<k3_stream_t>(stream);
  bool found = false;
#define K3_GO(BV_, W_, F_)                                           \
  if (!found && tile_v == BV_ && warps == W_ && form == F_) {         \
    found = true;                                                     \
    k3_launch_tm<BV_, W_, F_>(a, s);                                  \
  }
  K3_KV_CONFIGS(K3_GO)
#undef K3_GO
  if (!found) return -1;
  const k3_error_t err = k3_get_last_error();
  return err == K3_SUCCESS ? 0 : (int)err;
}
