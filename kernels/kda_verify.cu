// kda_verify.cu: KDA speculative verification (seed section 5), T = 1..8 draft positions, one launch.
//
// For every (sequence b, head h, 8 value columns) one block of 4 warps walks the T positions:
//   u = S^T (d k),  p = S^T (d q),  delta = beta (v - u),  S <- d S + k delta^T,
//   o = scale (p + (q . k) delta)          (d = exp g per key row)
// and writes the fp32 state after every position (for rollback) or only the last one.
//
// Lane mapping (chosen by hand, so no value changes register layout): warp w holds key rows
// 32 w .. 32 w + 31; lane = 2 rg + half: key group rg holds 2 consecutive rows, half picks 4 of the
// tile's 8 columns. A thread's 2 x 4 state block loads and stores as 16-byte vectors (a lane pair
// fills a 32-byte sector); its q, k, g rows are one vector load. Per position the 8 partial sums
// (u and p of 4 columns) are reduced over the key groups by recursive halving (8 shuffles), then
// across the 4 warps through shared memory (one barrier per position).
// Every input is loaded before any arithmetic: each loaded word passes a zero read from shared
// memory after a barrier behind the last load, so the block waits for one memory round trip, not T.
// T is a template argument (loops unroll); positions at or past a ragged sequence's length read
// nothing, run as identity updates and are not written (lengths mode: their o rows are zeros).
// With Args.pdl the kernel is a programmatic dependent of the stream's previous kernel: it waits
// (griddepcontrol.wait) before its first memory access, so only the launch latency overlaps.
//
// Layouts: q, k, g [rows, H, 128], v, o [rows, H, 128], beta [rows, H]; rows = the token index
// (B * T, or total tokens with cu_seqlens). q, k, v, o bf16 or fp32 (one dtype); g, beta bf16 or
// fp32 each; states fp32 [.., H, 128 (K), 128 (V)]; buffers 16-byte aligned.
// Limits: K = V = 128, T <= 8, N and H <= 65535; other shapes run k3lab.ops.kda_verify's Triton kernel.
// Figures (H200, graph replay) and the forms that lost: docs/kda_verify.md.
// Single source for CUDA and HIP (k3lab_portability.h); the HIP build is not yet run on AMD
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

// ---------------------------------------------------------------------------------------------
// The kernel: a block of KW warps owns one 8-column tile; warp w holds key rows w 128 / KW ..
// (w + 1) 128 / KW - 1, RR = 8 / KW per thread (KW = 4 is built). Recursive halving: at each of 4
// lane-exchange levels a lane keeps half of its values and sends the other half, so 8 shuffles leave
// every lane with one sum, u or p of one column (lane bit 4: u / p, bits 3..2: the column); the warps'
// sums are then added in one fixed order through shared memory (double-buffered), so every warp holds
// the same value. The u lanes form delta = beta (v - u), four shuffles hand every lane the deltas of
// its 4 columns, and warp 0's p lanes write o. The conversions fold the gate's zero in (bf16 halves:
// one LEA / LOP3 each; fp32 gates: the exp's multiply becomes an FMA).
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

// The kernel proper (KW warps per tile; RR key rows per thread).
template <int KW, int TM, bool IN16, bool G16>
__global__ void __launch_bounds__(KW * 32) kda_verify_warp_kernel(const Args a) {
  constexpr float LOG2E = 1.4426950408889634f;
  constexpr int RR = 8 / KW;  // key rows per thread
  static_assert(KW == 1 || KW == 2 || KW == 4, "1, 2 or 4 warps per tile");
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

namespace {
constexpr int KV_WARPS = 4;  // warps per 8-column tile
}

K3_EXPORT int k3_kda_verify_args_size() { return (int)sizeof(k3kv::Args); }

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

template <int TM>
static void k3_launch_tm(const k3kv::Args& a, const dim3 grid, const dim3 block, k3_stream_t stream) {
  constexpr int W = KV_WARPS;
  if (a.in_bf16) {
    if (a.g_bf16) k3_launch_args(k3kv::kda_verify_warp_kernel<W, TM, true, true>, grid, block, stream, a);
    else k3_launch_args(k3kv::kda_verify_warp_kernel<W, TM, true, false>, grid, block, stream, a);
  } else {
    if (a.g_bf16) k3_launch_args(k3kv::kda_verify_warp_kernel<W, TM, false, true>, grid, block, stream, a);
    else k3_launch_args(k3kv::kda_verify_warp_kernel<W, TM, false, false>, grid, block, stream, a);
  }
}

// Launch one verification step on `stream`. Returns 0, -4 (bad sizes) or the runtime's error code.
K3_EXPORT int k3_kda_verify(const k3kv::Args* args, void* stream) {
  const k3kv::Args& a = *args;
  if (a.T < 1 || a.T > 8 || a.H <= 0 || a.n_seq <= 0 || a.n_seq > 65535 || a.H > 65535) return -4;
  const k3_stream_t s = static_cast<k3_stream_t>(stream);
  const dim3 grid(k3kv::HV / 8, a.H, a.n_seq);
  const dim3 block(KV_WARPS * 32);
  switch (a.T) {
    case 1: k3_launch_tm<1>(a, grid, block, s); break;
    case 2: k3_launch_tm<2>(a, grid, block, s); break;
    case 3: k3_launch_tm<3>(a, grid, block, s); break;
    case 4: k3_launch_tm<4>(a, grid, block, s); break;
    case 5: k3_launch_tm<5>(a, grid, block, s); break;
    case 6: k3_launch_tm<6>(a, grid, block, s); break;
    case 7: k3_launch_tm<7>(a, grid, block, s); break;
    default: k3_launch_tm<8>(a, grid, block, s); break;
  }
  const k3_error_t err = k3_get_last_error();
  return err == K3_SUCCESS ? 0 : (int)err;
}
