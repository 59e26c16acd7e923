// kda_verify.cu: KDA speculative verification (seed section 5) as one hand-written kernel.
//
// For every (sequence b, head h, tile of BV value columns) a block walks the T draft positions:
//   u = S^T (d k),  p = S^T (d q),  delta = beta (v - u),  S <- d S + k delta^T,
//   o = S^T q = p + (q . k) delta          (d = exp g per key row, q pre-scaled),
// and writes the fp32 state after every position (for rollback) or only the last one.
//
// Measured on the H200 (B = 1, T = 4, 12 heads, graph replay, one run, commit c53e93d): FORM 2 on
// 4 warps launched as a programmatic dependent 3.19 us (without PDL 3.96), FORM 0 4.20 (3.38 with
// PDL), the Triton step form 4.20, the original 32-column kernel 10.39, fla's fused_recurrent_kda
// 6.69. FORM 2 with PDL is k3lab.ops.kda_verify's default 'after' on CUDA devices.
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
//   * FORM 2 ('warp', further below): lane pairs own 4 columns of 8 / W key rows; see its comment;
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
  int pdl;                // launched as a programmatic dependent: wait for the stream's previous grid
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

// N 16-byte vector loads from p into w[0 .. 4N).
template <int N, int W>
K3_DEVICE void load_vec16(const void* p, uint32_t (&w)[W]) {
  static_assert(4 * N <= W, "load_vec16: more words than the destination holds");
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const uint4 u = reinterpret_cast<const uint4*>(p)[i];
    w[4 * i] = u.x;
    w[4 * i + 1] = u.y;
    w[4 * i + 2] = u.z;
    w[4 * i + 3] = u.w;
  }
}

// Raw loads: R contiguous elements as 32-bit words (bf16: R / 2 words, two elements each; fp32: R
// words), converted only after the gate below, so no conversion (a consumer) sits among the loads.
template <int R>
K3_DEVICE void load_words(const void* base, long long off, bool bf16, uint32_t (&w)[R]) {
  const uint32_t* p = reinterpret_cast<const uint32_t*>(static_cast<const char*>(base) + off * (bf16 ? 2 : 4));
  if constexpr (R % 8 == 0) {  // 16-byte pieces: R / 8 of them (bf16) or R / 4 (fp32)
    if (bf16)
      load_vec16<R / 8>(p, w);
    else
      load_vec16<R / 4>(p, w);
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

// Request b's first token and its live positions (<= TM): packed sequences (mode 1: cu_seqlens),
// per-request lengths (mode 2) or a uniform batch (mode 0), with 32- or 64-bit integers.
template <int TM>
K3_DEVICE void seq_span(const Args& a, int b, long long& bos, int& L) {
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
}

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
  if (a.pdl) k3_pdl_enter();

  long long bos;
  int L;
  seq_span<TM>(a, b, bos, L);

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


// ---------------------------------------------------------------------------------------------
// FORM 2 ('warp'): a block of W warps (W = 1 or 4 built) owns one 8-column tile; warp w holds key
// rows w 128 / W .. (w + 1) 128 / W - 1, so with W = 1 a reduction over K never leaves the warp (no
// shared memory, no barrier on the chain) and with W = 4 it takes one shared-memory exchange per
// position after the in-warp part.
//   lane = 2 rg + half: key group rg = 0..15 holds RR = 8 / W consecutive rows of the warp's share,
//   half picks columns 4 half .. 4 half + 3 of the tile's 8. Each thread keeps an RR x 4 block of the
//   state: its state rows load and store as 16-byte vectors (a lane pair writes one whole 32-byte
//   sector per row), and its q, k, g rows are one vector load shared by the pair, so the per-row work
//   (decays, d k, d q) is done by two lanes, not by every column's lane.
// Per position the 8 partial sums (u and p for 4 columns) are reduced over the 16 key groups by
// recursive halving: at each of 4 lane-exchange levels a lane keeps half of its values and sends
// the other half, so 8 shuffles (not 32) leave every lane with one sum: u or p of one column (lane
// bit 4: u / p, bits 3..2: the column); with W > 1 the warps' sums are then added in one fixed order
// through shared memory (double-buffered: one barrier per position), so every warp holds the same
// value. The u lanes form delta = beta (v - u), four shuffles hand every lane the deltas of its 4
// columns, and warp 0's p lanes write o = scale (p + (q . k) delta), q . k reduced before the chain.
// On the H200 (B = 1, T = 4, graph replay, with PDL): W = 4 3.19 us, W = 2 3.76, W = 1 3.87. W = 4 has
// the least per-thread work (~620 SASS instructions after the loads at T = 4, ~1,190 at W = 1) and
// 768 warps for 528 SM sub-partitions.
// Every word loaded passes the same gate as above before its first use; the conversions fold the
// gate's zero in (bf16 halves: one LEA / LOP3 each; fp32 gates: the exp's multiply becomes an FMA).
// RR contiguous elements of 2 (IS16) or 4 bytes as raw 32-bit words: one or two vector loads.
template <int RR, bool IS16>
K3_DEVICE void load_rows(const char* p, uint32_t (&w)[8]) {
  constexpr int NB = RR * (IS16 ? 2 : 4);  // bytes: 4, 8, 16 or 32
  if constexpr (NB >= 16) {
    load_vec16<NB / 16>(p, w);
  } else if constexpr (NB == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    w[0] = u.x;
    w[1] = u.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

// Words -> RR floats with the gate's zero folded into each conversion (bf16 halves: one LEA or LOP3).
template <int RR, bool IS16>
K3_DEVICE void rows_to_floats(const uint32_t (&w)[8], uint32_t z, float (&x)[8]) {
  if constexpr (IS16) {
#pragma unroll
    for (int i = 0; i < RR / 2; ++i) {
      x[2 * i] = __uint_as_float((w[i] << 16) + z);
      x[2 * i + 1] = __uint_as_float((w[i] & 0xffff0000u) | z);
    }
  } else {
#pragma unroll
    for (int i = 0; i < RR; ++i) x[i] = __uint_as_float(w[i] + z);
  }
}

K3_DEVICE float fast_exp2(float x) {
#if defined(K3_CUDA) && defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

K3_DEVICE float k3_shfl_idx(float v, int src) {
#if defined(K3_HIP)
  return __shfl(v, src, 32);  // aligned 32-lane groups (not yet run on AMD hardware by this project)
#else
  return __shfl_sync(0xffffffffu, v, src);
#endif
}

// KW warps share one 8-column tile: warp w holds key rows w * 128 / KW .. (w + 1) * 128 / KW - 1,
// RR = 8 / KW of them per thread (KW = 1: no exchange at all; KW = 2, 4: after the in-warp halving,
// one shared-memory exchange and one barrier per position, with RR / 8 of the per-thread work).
template <int KW, int TM, bool IN16, bool G16>
__global__ void __launch_bounds__(KW * 32) kda_verify_warp_kernel(const Args a) {
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr int RR = 8 / KW;  // key rows per thread
  static_assert(KW == 1 || KW == 2 || KW == 4, "1, 2 or 4 warps per tile (K3_KV_CONFIGS builds 1 and 4)");
  __shared__ uint32_t zero_word;
  __shared__ float red[KW > 1 ? 2 : 1][KW][32];  // per-position partial sums, double-buffered
  __shared__ float qk_red[KW][TM];                // each warp's part of q_t . k_t
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int half = lane & 1;
  const int r0 = warp * (HK / KW) + (lane >> 1) * RR;      // first of this thread's key rows
  const int wc = blockIdx.x * 8;                           // the tile's first column
  const int c0 = wc + 4 * half;                            // this thread's 4 columns
  const int cr = c0 + ((lane >> 2) & 3);                   // the column whose sums this lane ends with
  const bool p_lane = (lane & 16) != 0;                    // ends with p (else u) of column cr
  const int h = blockIdx.y, b = blockIdx.z;
  const int H = a.H;
  const long long bh = (long long)b * H + h;
  const bool b16 = a.beta_bf16 != 0;
  if (a.pdl) k3_pdl_enter();

  long long bos;
  int L;
  seq_span<TM>(a, b, bos, L);

  // ---- every load first: the RR x 4 state block, then each live position's rows. Addresses are one
  // 64-bit base per tensor plus a per-position step, so the loads wait on little integer work.
  if (threadIdx.x == 0) zero_word = 0u;
  constexpr int IN_B = IN16 ? 2 : 4, G_B = G16 ? 2 : 4;  // bytes per element
  const long long slab = (long long)HK * HV;
  const long long row0 = bos * H + h;  // token-head row of position 0
  const float* s0 = a.h0 + bh * slab + r0 * HV + c0;
  uint4 ws[RR];
#pragma unroll
  for (int j = 0; j < RR; ++j) ws[j] = *reinterpret_cast<const uint4*>(s0 + j * HV);
  const char* qp = static_cast<const char*>(a.q) + (row0 * HK + r0) * IN_B;
  const char* kp = static_cast<const char*>(a.k) + (row0 * HK + r0) * IN_B;
  const char* gp = static_cast<const char*>(a.g) + (row0 * HK + r0) * G_B;
  const char* vp = static_cast<const char*>(a.v) + (row0 * HV + cr) * IN_B;
  const char* bp = static_cast<const char*>(a.beta) + row0 * (b16 ? 2 : 4);
  const long long in_step = (long long)H * HK * IN_B, g_step = (long long)H * HK * G_B;  // bytes per position
  const int b_step = H * (b16 ? 2 : 4);
  uint32_t wq[TM][8], wk[TM][8], wg[TM][8], wv[TM], wb[TM];
#pragma unroll
  for (int t = 0; t < TM; ++t) {
    if (t < L) {
      load_rows<RR, IN16>(qp + t * in_step, wq[t]);
      load_rows<RR, IN16>(kp + t * in_step, wk[t]);
      load_rows<RR, G16>(gp + t * g_step, wg[t]);
      wv[t] = IN16 ? (uint32_t)(*reinterpret_cast<const uint16_t*>(vp + t * in_step))
                   : *reinterpret_cast<const uint32_t*>(vp + t * in_step);
      wb[t] = b16 ? (uint32_t)(*reinterpret_cast<const uint16_t*>(bp + t * b_step))
                  : *reinterpret_cast<const uint32_t*>(bp + t * b_step);
    } else {  // a dead position: k = g = beta = 0 is the identity update, q = 0 gives o = 0
#pragma unroll
      for (int j = 0; j < 8; ++j) wq[t][j] = wk[t][j] = wg[t][j] = 0u;
      wv[t] = wb[t] = 0u;
    }
  }
  __syncthreads();
  const uint32_t z = *reinterpret_cast<volatile uint32_t*>(&zero_word);
  const float zf = __uint_as_float(z);

  // The state needs no gate: every instruction that reads it also reads a gated value.
  float S[RR][4];
#pragma unroll
  for (int j = 0; j < RR; ++j) {
    S[j][0] = __uint_as_float(ws[j].x);
    S[j][1] = __uint_as_float(ws[j].y);
    S[j][2] = __uint_as_float(ws[j].z);
    S[j][3] = __uint_as_float(ws[j].w);
  }
  // q_t . k_t of every position (state-independent): over this warp's rows, then (KW > 1) across
  // the warps through shared memory, summed in one fixed order so every warp holds the same value.
  float qk[TM];
#pragma unroll
  for (int t = 0; t < TM; ++t) {
    float q[8], k[8];
    rows_to_floats<RR, IN16>(wq[t], z, q);
    rows_to_floats<RR, IN16>(wk[t], z, k);
    qk[t] = q[0] * k[0];
#pragma unroll
    for (int j = 1; j < RR; ++j) qk[t] = fmaf(q[j], k[j], qk[t]);
#pragma unroll
    for (int off = 2; off < 32; off <<= 1) qk[t] += k3_shfl_xor(qk[t], off);
  }
  if constexpr (KW > 1) {
    if (lane == 0) {
#pragma unroll
      for (int t = 0; t < TM; ++t) qk_red[warp][t] = qk[t];
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < TM; ++t) {
      float x = qk_red[0][t];
#pragma unroll
      for (int w = 1; w < KW; ++w) x += qk_red[w][t];
      qk[t] = x;
    }
  }

#pragma unroll
  for (int t = 0; t < TM; ++t) {
    // inputs of position t (no state in them: the scheduler may run them ahead)
    float q[8], k[8], d[8], dk[8], dq[8];
    rows_to_floats<RR, IN16>(wq[t], z, q);
    rows_to_floats<RR, IN16>(wk[t], z, k);
    if constexpr (G16) {
      float g[8];
      rows_to_floats<RR, true>(wg[t], z, g);
#pragma unroll
      for (int j = 0; j < RR; ++j) d[j] = fast_exp2(g[j] * LOG2E);
    } else {
#pragma unroll
      for (int j = 0; j < RR; ++j) d[j] = fast_exp2(fmaf(__uint_as_float(wg[t][j]), LOG2E, zf));
    }
#pragma unroll
    for (int j = 0; j < RR; ++j) {
      dk[j] = d[j] * k[j];
      dq[j] = d[j] * q[j];
    }
    const float vt = __uint_as_float((IN16 ? (wv[t] << 16) : wv[t]) + z);
    const float bt = __uint_as_float((b16 ? (wb[t] << 16) : wb[t]) + z);

    // u = S^T (d k) and p = S^T (d q) over this thread's rows, 4 columns (8 rows: two half chains)
    float x[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (RR == 8) {
        float u0 = S[0][i] * dk[0], u1 = S[4][i] * dk[4], p0 = S[0][i] * dq[0], p1 = S[4][i] * dq[4];
#pragma unroll
        for (int j = 1; j < 4; ++j) {
          u0 = fmaf(S[j][i], dk[j], u0);
          u1 = fmaf(S[4 + j][i], dk[4 + j], u1);
          p0 = fmaf(S[j][i], dq[j], p0);
          p1 = fmaf(S[4 + j][i], dq[4 + j], p1);
        }
        x[i] = u0 + u1;
        x[4 + i] = p0 + p1;
      } else {
        float u0 = S[0][i] * dk[0], p0 = S[0][i] * dq[0];
#pragma unroll
        for (int j = 1; j < RR; ++j) {
          u0 = fmaf(S[j][i], dk[j], u0);
          p0 = fmaf(S[j][i], dq[j], p0);
        }
        x[i] = u0;
        x[4 + i] = p0;
      }
    }
    // recursive halving over the key groups (lane bits 4, 3, 2, 1)
    float y[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float send = p_lane ? x[i] : x[4 + i];
      const float keep = p_lane ? x[4 + i] : x[i];
      y[i] = keep + k3_shfl_xor(send, 16);
    }
    const bool hi3 = (lane & 8) != 0, hi2 = (lane & 4) != 0;
    float y2[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float send = hi3 ? y[i] : y[2 + i];
      const float keep = hi3 ? y[2 + i] : y[i];
      y2[i] = keep + k3_shfl_xor(send, 8);
    }
    float s;
    {
      const float send = hi2 ? y2[0] : y2[1];
      const float keep = hi2 ? y2[1] : y2[0];
      s = keep + k3_shfl_xor(send, 4);
    }
    s += k3_shfl_xor(s, 2);  // u (p_lane false) or p of column cr, summed over this warp's rows
    if constexpr (KW > 1) {  // and over the other warps' rows, in one fixed order
      red[t & 1][warp][lane] = s;
      __syncthreads();
      s = red[t & 1][0][lane];
#pragma unroll
      for (int w = 1; w < KW; ++w) s += red[t & 1][w][lane];
    }

    const float dl = bt * (vt - s);  // delta of column cr (meaningful in the u lanes)
    float D[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) D[i] = k3_shfl_idx(dl, ((i >> 1) << 3) | ((i & 1) << 2) | half);
    const float dp = k3_shfl_xor(dl, 16);  // in a p lane: delta of its column
    if (warp == 0 && p_lane && !(lane & 2) && (t < L || a.mode == 2)) {
      const float o = a.scale * fmaf(qk[t], dp, s);
      char* op = static_cast<char*>(a.o) + (row0 * HV + cr) * IN_B + t * in_step;
      if constexpr (IN16) *reinterpret_cast<k3_bf16*>(op) = k3_f32_to_bf16(o);
      else *reinterpret_cast<float*>(op) = o;
    }
#pragma unroll
    for (int j = 0; j < RR; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) S[j][i] = fmaf(k[j], D[i], S[j][i] * d[j]);
    }
    if (a.all_states && t < L) {
      float* dst = a.hs + (row0 + (long long)t * H) * slab + r0 * HV + c0;
#pragma unroll
      for (int j = 0; j < RR; ++j)
        *reinterpret_cast<float4*>(dst + j * HV) = make_float4(S[j][0], S[j][1], S[j][2], S[j][3]);
    }
  }
  if (!a.all_states) {  // the sequence's last live state (dead positions were identity updates)
    float* dst = a.hs + bh * slab + r0 * HV + c0;
#pragma unroll
    for (int j = 0; j < RR; ++j)
      *reinterpret_cast<float4*>(dst + j * HV) = make_float4(S[j][0], S[j][1], S[j][2], S[j][3]);
  }
}

}  // namespace k3kv

// ---------------------------------------------------------------------------------------------
// exported launchers

// (BV value columns, W 32-lane groups, FORM) compiled; each for T = 1..8 (a template argument).
// form: 0 step, 1 chunk (both: plain loads behind a gate), 2 warp (lane pairs hold 4 columns of
// 8 / W key rows each; W warps share the tile's key rows).
// Only configurations that compile without register spills at every T (ptxas, sm_90a): 8 x 2 spilled
// at T >= 5, 4 x 4 at T = 4 and the chunk form on 4 groups at T = 8, so they are not built.
// The warp form is built on 1 warp per tile (one wave, no exchange) and 4 (the default); 2 compiled
// without spills too but measured between them (H200, B = 1, T = 4, PDL: 3.87 / 3.76 / 3.19 us for
// 1 / 2 / 4 warps), so it is no longer built.
#define K3_KV_CONFIGS(X) \
  X(8, 4, 0)             \
  X(8, 8, 0)             \
  X(4, 2, 0)             \
  X(8, 8, 1)             \
  X(8, 1, 2)             \
  X(8, 4, 2)

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

// One launch of `kernel`; with a.pdl (CUDA) as a programmatic dependent of the stream's previous
// kernel (cudaLaunchAttributeProgrammaticStreamSerialization; kept by CUDA-graph capture).
static void k3_launch_args(void (*kernel)(k3kv::Args), const dim3 grid, const dim3 block, k3_stream_t stream,
                           const k3kv::Args& a) {
#if defined(K3_CUDA)
  if (a.pdl) {
    k3_launch_pdl(kernel, grid, block, 0, stream, a);
    return;
  }
#endif
  kernel<<<grid, block, 0, stream>>>(a);
}

template <int KW, int TM>
static void k3_launch_warp_tm(const k3kv::Args& a, const dim3 grid, const dim3 block, k3_stream_t stream) {
  if (a.in_bf16) {
    if (a.g_bf16) k3_launch_args(k3kv::kda_verify_warp_kernel<KW, TM, true, true>, grid, block, stream, a);
    else k3_launch_args(k3kv::kda_verify_warp_kernel<KW, TM, true, false>, grid, block, stream, a);
  } else {
    if (a.g_bf16) k3_launch_args(k3kv::kda_verify_warp_kernel<KW, TM, false, true>, grid, block, stream, a);
    else k3_launch_args(k3kv::kda_verify_warp_kernel<KW, TM, false, false>, grid, block, stream, a);
  }
}

template <int BV, int W, int F>
static void k3_launch_tm(const k3kv::Args& a, k3_stream_t stream) {
  const dim3 grid(k3kv::HV / BV, a.H, a.n_seq);
  const dim3 block(W * 32);
  if constexpr (F == 2) {  // warp form: W warps share an 8-column tile's key rows
    static_assert(BV == 8, "the warp form holds 8 columns per warp");
    switch (a.T) {
      case 1: k3_launch_warp_tm<W, 1>(a, grid, block, stream); break;
      case 2: k3_launch_warp_tm<W, 2>(a, grid, block, stream); break;
      case 3: k3_launch_warp_tm<W, 3>(a, grid, block, stream); break;
      case 4: k3_launch_warp_tm<W, 4>(a, grid, block, stream); break;
      case 5: k3_launch_warp_tm<W, 5>(a, grid, block, stream); break;
      case 6: k3_launch_warp_tm<W, 6>(a, grid, block, stream); break;
      case 7: k3_launch_warp_tm<W, 7>(a, grid, block, stream); break;
      default: k3_launch_warp_tm<W, 8>(a, grid, block, stream); break;
    }
    return;
  } else {
    switch (a.T) {
      case 1: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 1, F == 1>, grid, block, stream, a); break;
      case 2: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 2, F == 1>, grid, block, stream, a); break;
      case 3: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 3, F == 1>, grid, block, stream, a); break;
      case 4: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 4, F == 1>, grid, block, stream, a); break;
      case 5: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 5, F == 1>, grid, block, stream, a); break;
      case 6: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 6, F == 1>, grid, block, stream, a); break;
      case 7: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 7, F == 1>, grid, block, stream, a); break;
      default: k3_launch_args(k3kv::kda_verify_kernel<BV, W, 8, F == 1>, grid, block, stream, a); break;
    }
  }
}

// Launch one verification step. tile_v: value columns per block; warps: 32-lane groups per block;
// form: 0 step, 1 chunk, 2 warp. Returns 0, -1 (no such compiled config), -4 (bad sizes) or the
// runtime's error code.
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
