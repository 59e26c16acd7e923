// kda_chunk_prologue.cu: the chunk prologue of KDA prefill (seed section 5) in one launch, for NVIDIA GPUs.
//
// What: per (chunk of 64 tokens, head), from q, k, v (bf16), g (fp32 log-decay) and beta, what the walks
// read (k3lab.ops.kda_chunk.scan_math.ChunkQuantities, in kda_chunk.Work's layout): Qg = scale q e^G,
// Kd^T = (k e^(G_last - G))^T, d = e^G_last (fp32), Aqk (bf16, zeros above the diagonal), and from
// Akk (fp32, on chip) R = (I + Akk)^-1 in fp32, W = R (beta k e^G), U = R (beta v), R rounded to bf16
// only there (the seed's precision note). G: the cumulative log-decay inside the chunk.
// Layout: one block of 8 warps per (chunk, head), the chunk held in shared memory (93 KB, 120
// registers: two blocks per SM); every stage reads it from there:
//   1. cp.async brings g, then q, k, v; rows past a sequence's end are zero-filled (no-op tokens);
//   2. thread c scans column c: G in base-2 units (every decay one ex2), P_b = G before 16-row block b;
//   3. Qg (warps 4-5) and Kd^T (warps 0-3) straight to memory;
//   4. the A's on tensor cores in tf32 (m16n8k8) over 16-row blocks, e^(G_i - G_j) = e^(G_i - P_I)
//      e^(P_I - G_j): both factors <= 1 off the diagonal, the right one <= e^(block spread) on it; ten
//      (I, J) pairs over 8 warps. A diagonal block whose spread exceeds Args.spread is summed exactly;
//   5. the inverse in fp32: diagonal 16 x 16 blocks by forward substitution (a thread per column), the
//      rest by distance from the diagonal, a warp per block, products in three tf32 passes;
//   6. W and U in bf16 m16n8k16 (ldmatrix.trans B operands), written as 16-byte rows.
// Shared rows are padded (q, k, v: 272 bytes; G: 528) so fragment reads fall in distinct banks.
// Why: the Triton prologue needs three launches and its A launch runs at 2 programs per SM; here every
// stage reuses the chunk from shared memory in one launch. Limits: K = V = 128, bf16, sm_80 or later;
// the HIP build is a stub returning K3_KP_UNSUPPORTED (AMD needs its own MFMA kernel; not yet run on
// AMD hardware by this project). Figures (H200, against the Triton prologue): docs/kda_scan.md.
// Without the timeline probe this build compiles (sm_90a: 120 registers, no spills) but is not yet run
// on a GPU.
#include "k3lab_mma.h"

#define K3_KP_UNSUPPORTED (-5)

namespace k3kp {

constexpr int C = 64;         // chunk
constexpr int K = 128;        // key and value head dim (K3's KDA head)
constexpr int NB = 4;         // 16-row blocks per chunk
constexpr int THREADS = 256;  // 8 warps
constexpr int XP = 136;       // bf16 per shared row of q, k, v (272 bytes)
constexpr int GP = 132;       // fp32 per shared row of G (528 bytes)
constexpr int AP = 68;        // fp32 per shared row of Akk and R (64 x 68 x 4 = the q tile's bytes)
constexpr int X_BYTES = C * XP * 2;
constexpr int G_BYTES = C * GP * 4;
constexpr int PART_FLOATS = 32 * 32;  // one warp's partial A's (4 n-tiles x 4 x 2 per lane), lane-major
constexpr int SMEM_BYTES = 3 * X_BYTES + G_BYTES + (NB + 1) * K * 4 + C * 4 + 16 + PART_FLOATS * 4;

struct Args {
  const k3_bf16* q;  // [tokens, H, 128]
  const k3_bf16* k;
  const k3_bf16* v;
  const float* g;     // [tokens, H, 128]
  const float* beta;  // [tokens, H]
  const int* chunk_tok;  // [n_chunks] first token of each chunk
  const int* chunk_len;  // [n_chunks] its tokens (1..64)
  k3_bf16* w;    // [n_chunks, H, 64, 128]
  k3_bf16* u;    // [n_chunks, H, 64, 128]
  k3_bf16* qg;   // [n_chunks, H, 64, 128]
  k3_bf16* kdt;  // [n_chunks, H, 128, 64]
  k3_bf16* aqk;  // [n_chunks, H, 64, 64]
  float* d;      // [n_chunks, H, 128]
  int n_chunks, H;
  float scale;
  float spread;  // largest block decay spread (natural log) the factored diagonal accepts
};

}  // namespace k3kp

#if defined(K3_CUDA)

namespace k3kp {

using namespace k3mma;

constexpr float LOG2E = 1.4426950408889634f;

// 2^x by one ex2.approx (results below 2^-126 flush to 0). G lives in shared memory in base-2 units
// (G log2 e), so every e^(G_i - G_j) of the kernel is one subtraction and this.
K3_DEVICE float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// x as a tf32 mma operand, rounded to nearest (ties away, as cvt.rna): the mma reads the upper 19
// bits only, so adding half a tf32 unit is the whole rounding (cvt.rna.tf32 compiles to four
// instructions on sm_90, with an infinity check these finite values do not need).
K3_DEVICE uint32_t tf32(float x) { return __float_as_uint(x) + 0x1000u; }

K3_DEVICE float bf(k3_bf16 x) { return k3_bf16_to_f32(x); }

// d (16x8 fp32) += a (16x8 tf32, row) * b (8x8 tf32, col)
K3_DEVICE void mma_tf32(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct Smem {
  k3_bf16* q;  // [64][XP]; after the A's: Akk (fp32 [64][AP]) in its bytes
  k3_bf16* k;  // [64][XP]; after the A's: beta k e^G (W's right factor), then W
  k3_bf16* v;  // [64][XP]; after the A's: beta v (U's right factor), then U
  float* G;    // [64][GP]; after step 3b: R (fp32 [64][AP]) and the inverse's scratch
  float* P;    // [NB + 1][128]: G before block b's first row (P[NB] = G_last)
  float* beta; // [64]
  int* wide;   // bit b: block b's spread exceeds Args.spread
  float* part; // [32][32]: warp 6's half of row block 1's A's, for warp 7 to add
};

K3_DEVICE Smem carve(unsigned char* base) {
  Smem s;
  s.q = reinterpret_cast<k3_bf16*>(base);
  s.k = reinterpret_cast<k3_bf16*>(base + X_BYTES);
  s.v = reinterpret_cast<k3_bf16*>(base + 2 * X_BYTES);
  s.G = reinterpret_cast<float*>(base + 3 * X_BYTES);
  s.P = reinterpret_cast<float*>(base + 3 * X_BYTES + G_BYTES);
  s.beta = s.P + (NB + 1) * K;
  s.wide = reinterpret_cast<int*>(s.beta + C);
  s.part = reinterpret_cast<float*>(base + 3 * X_BYTES + G_BYTES + (NB + 1) * K * 4 + C * 4 + 16);
  return s;
}

// ---------------------------------------------------------------------------------------------
// step 4: the A's of row block I against columns [j0, j0 + 8 NT) (whole 16-column blocks J <= I).
// Fragment rows g and g + 8 of block I; mma k-steps of 8 channels. With a wide diagonal block the
// diagonal's right factors are zeroed here and step 4b sums that block exactly.
template <int NT>
K3_DEVICE void a_block(const Smem& s, int I, int j0, bool skip_diag, float (&ak)[NT][4], float (&aq)[NT][4], int g,
                       int t, int ks_begin = 0, int ks_end = K / 8) {
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) ak[n][e] = aq[n][e] = 0.f;
  const int r0 = 16 * I + g, r1 = r0 + 8;
#pragma unroll 4
  for (int ks = ks_begin; ks < ks_end; ++ks) {
    const int c0 = ks * 8 + t, c1 = c0 + 4;
    const float p0 = s.P[I * K + c0], p1 = s.P[I * K + c1];
    // left operands: x_i e^(G_i - P_I) <= |x_i|, a-fragment order (r0,c0) (r1,c0) (r0,c1) (r1,c1)
    const float f00 = exp2_fast(s.G[r0 * GP + c0] - p0), f10 = exp2_fast(s.G[r1 * GP + c0] - p0);
    const float f01 = exp2_fast(s.G[r0 * GP + c1] - p1), f11 = exp2_fast(s.G[r1 * GP + c1] - p1);
    uint32_t lk[4], lq[4];
    lk[0] = tf32(bf(s.k[r0 * XP + c0]) * f00);
    lk[1] = tf32(bf(s.k[r1 * XP + c0]) * f10);
    lk[2] = tf32(bf(s.k[r0 * XP + c1]) * f01);
    lk[3] = tf32(bf(s.k[r1 * XP + c1]) * f11);
    lq[0] = tf32(bf(s.q[r0 * XP + c0]) * f00);
    lq[1] = tf32(bf(s.q[r1 * XP + c0]) * f10);
    lq[2] = tf32(bf(s.q[r0 * XP + c1]) * f01);
    lq[3] = tf32(bf(s.q[r1 * XP + c1]) * f11);
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int j = j0 + 8 * n + g;  // this lane's key row (the fragment's column n = g)
      const bool zero = skip_diag && (j >> 4) == I;
      // right operand: k_j e^(P_I - G_j), b-fragment rows (channels) t and t + 4
      const float e0 = zero ? 0.f : exp2_fast(p0 - s.G[j * GP + c0]);
      const float e1 = zero ? 0.f : exp2_fast(p1 - s.G[j * GP + c1]);
      const uint32_t b0 = tf32(bf(s.k[j * XP + c0]) * e0), b1 = tf32(bf(s.k[j * XP + c1]) * e1);
      mma_tf32(ak[n], lk, b0, b1);
      mma_tf32(aq[n], lq, b0, b1);
    }
  }
}

// Akk (x beta_i, strictly below the diagonal) into shared memory, Aqk (x scale, on and below it) to
// memory, from the accumulators of a_block. The diagonal block is left alone when it is wide.
template <int NT>
K3_DEVICE void a_store(const Smem& s, float* akk, k3_bf16* aqk, float scale, int I, int j0, bool skip_diag,
                       const float (&ak)[NT][4], const float (&aq)[NT][4], int g, int t) {
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    const int j = j0 + 8 * n + 2 * t;
    if (skip_diag && (j >> 4) == I) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = 16 * I + g + 8 * half;
      const float bi = s.beta[i];
      const float k0 = j < i ? ak[n][2 * half] * bi : 0.f, k1 = j + 1 < i ? ak[n][2 * half + 1] * bi : 0.f;
      const float q0 = j <= i ? aq[n][2 * half] * scale : 0.f, q1 = j + 1 <= i ? aq[n][2 * half + 1] * scale : 0.f;
      *reinterpret_cast<float2*>(akk + i * AP + j) = make_float2(k0, k1);
      *reinterpret_cast<uint32_t*>(aqk + i * C + j) = pack_bf16(q0, q1);
    }
  }
}

// step 4b (only for a chunk with a wide diagonal block): that block's entries summed exactly, one
// (i, j) pair per thread and pass, e^(G_i - G_j) <= 1 for j <= i. Results stay in registers until
// q and k may be overwritten.
constexpr int EXACT_PASSES = 256 / THREADS;  // pairs of a 16 x 16 block per thread
struct Exact {
  float kk[EXACT_PASSES], qk[EXACT_PASSES];
};

K3_DEVICE Exact exact_diag(const Smem& s, int b, int tid) {
  Exact r;
#pragma unroll
  for (int p = 0; p < EXACT_PASSES; ++p) {
    const int idx = tid + p * THREADS;  // 256 pairs of the 16 x 16 block
    const int i = 16 * b + (idx >> 4), j = 16 * b + (idx & 15);
    float kk = 0.f, qk = 0.f;
    if (j <= i) {
      for (int c = 0; c < K; ++c) {
        const float e = exp2f(s.G[i * GP + c] - s.G[j * GP + c]);
        const float kj = bf(s.k[j * XP + c]) * e;
        kk += bf(s.k[i * XP + c]) * kj;
        qk += bf(s.q[i * XP + c]) * kj;
      }
    }
    r.kk[p] = kk;
    r.qk[p] = qk;
  }
  return r;
}

K3_DEVICE void exact_store(const Smem& s, float* akk, k3_bf16* aqk, float scale, int b, const Exact& r, int tid) {
#pragma unroll
  for (int p = 0; p < EXACT_PASSES; ++p) {
    const int idx = tid + p * THREADS;
    const int i = 16 * b + (idx >> 4), j = 16 * b + (idx & 15);
    akk[i * AP + j] = j < i ? r.kk[p] * s.beta[i] : 0.f;
    aqk[i * C + j] = k3_f32_to_bf16(j <= i ? r.qk[p] * scale : 0.f);
  }
}

// ---------------------------------------------------------------------------------------------
// step 5, off the diagonal: R_IJ = -R_II (sum_{J <= M < I} L_IM R_MJ) for one 16 x 16 block, by one
// warp. Each product in three tf32 passes (hi*lo + lo*hi + hi*hi, x = hi + lo): fp32-class, as the
// seed asks of the inverse. T, the inner sum, goes through `scratch` (16 x TP, this warp's) to become
// the second product's B operand.
constexpr int TP = 24;  // scratch row pitch: the B-fragment reads (row t, column g) hit 32 banks

K3_DEVICE void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32(x) & 0xffffe000u;  // the value the mma will read, exactly
  lo = tf32(x - __uint_as_float(hi));
}

K3_DEVICE void mma_3xtf32(float* d, const float (&a)[4], float b0, float b1) {
  uint32_t ah[4], al[4], bh0, bl0, bh1, bl1;
#pragma unroll
  for (int e = 0; e < 4; ++e) split_tf32(a[e], ah[e], al[e]);
  split_tf32(b0, bh0, bl0);
  split_tf32(b1, bh1, bl1);
  mma_tf32(d, al, bh0, bh1);
  mma_tf32(d, ah, bl0, bl1);
  mma_tf32(d, ah, bh0, bh1);
}

K3_DEVICE void inverse_block(const float* L, float* R, float* scratch, int I, int J, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float acc[2][4] = {};
  for (int M = J; M < I; ++M) {
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      const float* l = L + (16 * I + g) * AP + 16 * M + 8 * ks + t;
      const float a[4] = {l[0], l[8 * AP], l[4], l[8 * AP + 4]};
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const float* r = R + (16 * M + 8 * ks + t) * AP + 16 * J + 8 * n + g;
        mma_3xtf32(acc[n], a, r[0], r[4 * AP]);
      }
    }
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    scratch[g * TP + 8 * n + 2 * t] = acc[n][0];
    scratch[g * TP + 8 * n + 2 * t + 1] = acc[n][1];
    scratch[(g + 8) * TP + 8 * n + 2 * t] = acc[n][2];
    scratch[(g + 8) * TP + 8 * n + 2 * t + 1] = acc[n][3];
  }
  __syncwarp();
  float out[2][4] = {};
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
    const float* r = R + (16 * I + g) * AP + 16 * I + 8 * ks + t;
    const float a[4] = {r[0], r[8 * AP], r[4], r[8 * AP + 4]};
#pragma unroll
    for (int n = 0; n < 2; ++n) {
      const float* x = scratch + (8 * ks + t) * TP + 8 * n + g;
      mma_3xtf32(out[n], a, x[0], x[4 * TP]);
    }
  }
#pragma unroll
  for (int n = 0; n < 2; ++n) {
    float* o = R + (16 * I + g) * AP + 16 * J + 8 * n + 2 * t;
    o[0] = -out[n][0];
    o[1] = -out[n][1];
    o[8 * AP] = -out[n][2];
    o[8 * AP + 1] = -out[n][3];
  }
}

// ---------------------------------------------------------------------------------------------
// step 6: out[:, 32 w .. 32 w + 31] = R (bf16) @ X (bf16 [64 x 128] in shared memory) for warp w,
// written back over X's own columns (each warp reads and writes only its columns).
K3_DEVICE void r_times(const float* R, k3_bf16* X, int warp, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int n0 = 32 * warp;
  float acc[NB][4][4];
#pragma unroll
  for (int m = 0; m < NB; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
  const uint32_t xs = smem_u32(X) + (uint32_t)(((lane & 15) * XP + n0 + (lane >> 4) * 8) * 2);
#pragma unroll
  for (int kk = 0; kk < NB; ++kk) {
    uint32_t b[4][2];  // 4 n-tiles of 8 columns, k rows 16 kk .. 16 kk + 15
#pragma unroll
    for (int np = 0; np < 2; ++np)
      ldsm_x4_t(xs + (uint32_t)((16 * kk * XP + np * 16) * 2), b[2 * np][0], b[2 * np][1], b[2 * np + 1][0],
                b[2 * np + 1][1]);
#pragma unroll
    for (int m = kk; m < NB; ++m) {  // R is block lower triangular: row block m needs k blocks <= m
      const float* r0 = R + (16 * m + g) * AP + 16 * kk + 2 * t;
      const float2 x00 = *reinterpret_cast<const float2*>(r0);
      const float2 x10 = *reinterpret_cast<const float2*>(r0 + 8 * AP);
      const float2 x01 = *reinterpret_cast<const float2*>(r0 + 8);
      const float2 x11 = *reinterpret_cast<const float2*>(r0 + 8 * AP + 8);
      const uint32_t a[4] = {pack_bf16(x00.x, x00.y), pack_bf16(x10.x, x10.y), pack_bf16(x01.x, x01.y),
                             pack_bf16(x11.x, x11.y)};
#pragma unroll
      for (int n = 0; n < 4; ++n) mma_bf16(acc[m][n], a, b[n][0], b[n][1]);
    }
  }
  __syncwarp();  // every lane's ldmatrix reads of these columns are done before they are overwritten
#pragma unroll
  for (int m = 0; m < NB; ++m)
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const int col = n0 + 8 * n + 2 * t;
      *reinterpret_cast<uint32_t*>(X + (16 * m + g) * XP + col) = pack_bf16(acc[m][n][0], acc[m][n][1]);
      *reinterpret_cast<uint32_t*>(X + (16 * m + g + 8) * XP + col) = pack_bf16(acc[m][n][2], acc[m][n][3]);
    }
}

// A [64 x 128] bf16 tile from shared memory (row pitch XP) to memory, 16 bytes per thread and step.
K3_DEVICE void tile_out(const k3_bf16* X, k3_bf16* dst, int tid) {
#pragma unroll
  for (int p = 0; p < C * K / 8 / THREADS; ++p) {
    const int idx = tid + p * THREADS, row = idx >> 4, c8 = (idx & 15) * 8;
    *reinterpret_cast<uint4*>(dst + row * K + c8) = *reinterpret_cast<const uint4*>(X + row * XP + c8);
  }
}

__global__ void __launch_bounds__(THREADS, 2) prologue_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  const Smem s = carve(smem_raw);
  const int chunk = blockIdx.x, h = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const long long item = (long long)chunk * a.H + h;
  const long long tok0 = __ldg(a.chunk_tok + chunk);
  const int L = __ldg(a.chunk_len + chunk);
  const long long row_stride = (long long)a.H * K;  // elements between tokens
  const long long base = tok0 * row_stride + (long long)h * K;

  // 1. loads: g first (its own group), then q, k, v; beta by plain loads
#pragma unroll
  for (int p = 0; p < C * K / 4 / THREADS; ++p) {  // g: 32 16-byte pieces per row
    const int idx = tid + p * THREADS, row = idx >> 5, c4 = (idx & 31) * 4;
    const bool ok = row < L;
    cp16(s.G + row * GP + c4, a.g + (ok ? base + row * row_stride + c4 : 0), ok);
  }
  cp_commit();
#pragma unroll
  for (int p = 0; p < C * K / 8 / THREADS; ++p) {  // q, k, v: 16 pieces per row
    const int idx = tid + p * THREADS, row = idx >> 4, c8 = (idx & 15) * 8;
    const bool ok = row < L;
    const long long off = ok ? base + row * row_stride + c8 : 0;
    cp16(s.q + row * XP + c8, a.q + off, ok);
    cp16(s.k + row * XP + c8, a.k + off, ok);
    cp16(s.v + row * XP + c8, a.v + off, ok);
  }
  cp_commit();
  if (tid < C) s.beta[tid] = tid < L ? __ldg(a.beta + (tok0 + tid) * a.H + h) : 0.f;
  if (tid == 0) *s.wide = 0;
  cp_wait<1>();
  __syncthreads();

  // 2. column scan: thread c turns column c of g into G, records P_b and the block spreads
  if (tid < K) {
    const int c = tid;
    float G = 0.f;
    int wide = 0;
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      s.P[b * K + c] = G * LOG2E;
      const float before = G;
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        G += s.G[(16 * b + r) * GP + c];
        s.G[(16 * b + r) * GP + c] = G * LOG2E;
      }
      if (before - G > a.spread) wide |= 1 << b;
    }
    s.P[NB * K + c] = G * LOG2E;
    if (wide) atomicOr(s.wide, wide);
  }
  cp_wait<0>();
  __syncthreads();
  const int wide = *s.wide;

  // 3. warps 4-5: Qg rows (16 bytes per thread and step); warps 0-3: Kd^T row c and d[c] by thread
  // c; warps 6-7 go on to their larger share of the A's
  if (warp == 4 || warp == 5) {
    k3_bf16* qg = a.qg + item * C * K;
#pragma unroll 2
    for (int p = 0; p < C * K / 8 / 64; ++p) {
      const int idx = tid - K + p * 64, row = idx >> 4, c8 = (idx & 15) * 8;
      const float4 g0 = *reinterpret_cast<const float4*>(s.G + row * GP + c8);
      const float4 g1 = *reinterpret_cast<const float4*>(s.G + row * GP + c8 + 4);
      const uint4 qv = *reinterpret_cast<const uint4*>(s.q + row * XP + c8);
      const k3_bf16* qe = reinterpret_cast<const k3_bf16*>(&qv);
      const float e[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
      uint32_t o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m)
        o[m] = pack_bf16(a.scale * bf(qe[2 * m]) * exp2_fast(e[2 * m]), a.scale * bf(qe[2 * m + 1]) * exp2_fast(e[2 * m + 1]));
      *reinterpret_cast<uint4*>(qg + row * K + c8) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  } else if (tid < K) {
    const int c = tid;
    const float last = s.P[NB * K + c];
    a.d[item * K + c] = exp2_fast(last);
    k3_bf16* kd = a.kdt + item * K * C + (long long)c * C;
#pragma unroll
    for (int r8 = 0; r8 < C / 8; ++r8) {
      uint32_t o[4];
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int i = 8 * r8 + 2 * m;
        o[m] = pack_bf16(bf(s.k[i * XP + c]) * exp2_fast(last - s.G[i * GP + c]),
                         bf(s.k[(i + 1) * XP + c]) * exp2_fast(last - s.G[(i + 1) * GP + c]));
      }
      *reinterpret_cast<uint4*>(kd + 8 * r8) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }

  // 4. the A's, (row block I, column block J) pairs: warps 0-3 (3, 0..3), warps 4-6 (2, 0..2), warp 6
  // also (1, 0..1) over the first 64 channels and warp 7 over the last 64, then (0, 0). Each (I, J)
  // costs the same right-operand work; each distinct I a warp takes costs its left operand again,
  // so the split keeps every warp near one pair's left and right work plus the Kd / Qg share.
  float* akk = reinterpret_cast<float*>(s.q);  // written only after everyone's A's are done
  k3_bf16* aqk = a.aqk + item * C * C;
  const int bI = warp < 4 ? 3 : 2, bJ = warp < 4 ? warp : warp - 4;
  const bool skip = (wide >> bI) & 1 && bJ == bI;
  float ak4[4][4], aq4[4][4], ak2[2][4], aq2[2][4];
  if (warp < 7) a_block<2>(s, bI, 16 * bJ, skip, ak2, aq2, g, t);
  if (warp >= 6) a_block<4>(s, 1, 0, (wide >> 1) & 1, ak4, aq4, g, t, warp == 6 ? 0 : K / 16, warp == 6 ? K / 16 : K / 8);
  if (warp == 7) a_block<2>(s, 0, 0, wide & 1, ak2, aq2, g, t);
  if (warp == 6) {  // hand the first half of row block 1 to warp 7 (read after the barrier below)
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s.part[(8 * n + e) * 32 + lane] = ak4[n][e];
        s.part[(8 * n + 4 + e) * 32 + lane] = aq4[n][e];
      }
  }
  Exact ex[NB];
  if (wide) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
      if ((wide >> b) & 1) ex[b] = exact_diag(s, b, tid);
  }
  __syncthreads();  // q and k are no longer read as such
  if (warp < 7) a_store<2>(s, akk, aqk, a.scale, bI, 16 * bJ, skip, ak2, aq2, g, t);
  if (warp == 7) {
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        ak4[n][e] += s.part[(8 * n + e) * 32 + lane];
        aq4[n][e] += s.part[(8 * n + 4 + e) * 32 + lane];
      }
    a_store<4>(s, akk, aqk, a.scale, 1, 0, (wide >> 1) & 1, ak4, aq4, g, t);
    a_store<2>(s, akk, aqk, a.scale, 0, 0, wide & 1, ak2, aq2, g, t);
  }
  if (wide) {
#pragma unroll
    for (int b = 0; b < NB; ++b)
      if ((wide >> b) & 1) exact_store(s, akk, aqk, a.scale, b, ex[b], tid);
  }
  // Aqk above the diagonal blocks: zeros (the walks multiply the whole 64 x 64)
#pragma unroll
  for (int p = 0; p < (192 + THREADS - 1) / THREADS; ++p) {
    const int idx = tid + p * THREADS;  // 6 blocks x 16 rows x 2 halves = 192 16-byte pieces
    if (idx < 192) {
      const int blk = idx >> 5, rem = idx & 31, row16 = rem >> 1, half = rem & 1;
      const int I = blk < 3 ? 0 : (blk < 5 ? 1 : 2);
      const int J = blk < 3 ? blk + 1 : (blk < 5 ? blk - 1 : 3);
      *reinterpret_cast<uint4*>(aqk + (16 * I + row16) * C + 16 * J + 8 * half) = make_uint4(0, 0, 0, 0);
    }
  }
  // W's and U's right factors in place: beta k e^G (rounded to bf16, as the Triton prologue does)
  // and beta v
#pragma unroll 2
  for (int p = 0; p < C * K / 8 / THREADS; ++p) {
    const int idx = tid + p * THREADS, row = idx >> 4, c8 = (idx & 15) * 8;
    const float bt = s.beta[row];
    const float4 g0 = *reinterpret_cast<const float4*>(s.G + row * GP + c8);
    const float4 g1 = *reinterpret_cast<const float4*>(s.G + row * GP + c8 + 4);
    const float e[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
    uint4 kv = *reinterpret_cast<const uint4*>(s.k + row * XP + c8);
    uint4 vv = *reinterpret_cast<const uint4*>(s.v + row * XP + c8);
    const k3_bf16* ke = reinterpret_cast<const k3_bf16*>(&kv);
    const k3_bf16* ve = reinterpret_cast<const k3_bf16*>(&vv);
    uint32_t ok[4], ov[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      ok[m] = pack_bf16(bt * bf(ke[2 * m]) * exp2_fast(e[2 * m]), bt * bf(ke[2 * m + 1]) * exp2_fast(e[2 * m + 1]));
      ov[m] = pack_bf16(bt * bf(ve[2 * m]), bt * bf(ve[2 * m + 1]));
    }
    *reinterpret_cast<uint4*>(s.k + row * XP + c8) = make_uint4(ok[0], ok[1], ok[2], ok[3]);
    *reinterpret_cast<uint4*>(s.v + row * XP + c8) = make_uint4(ov[0], ov[1], ov[2], ov[3]);
  }
  __syncthreads();  // Akk complete; G no longer needed: R and the scratch take its place

  // 5. R = (I + Akk)^-1 in fp32. Diagonal blocks: thread (b, j) solves column j of block b.
  float* R = s.G;
  float* T = s.G + C * AP;  // [3][16][TP] scratch for the off-diagonal products
  if (tid < C) {
    const int b = tid >> 4, j = tid & 15;
    const float* Lb = akk + 16 * b * AP + 16 * b;
    float x[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float acc = i == j ? 1.f : 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) acc -= Lb[i * AP + m] * x[m];
      x[i] = acc;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) R[(16 * b + i) * AP + 16 * b + j] = x[i];
  }
  __syncthreads();
  // off-diagonal blocks by distance dd from the diagonal, one warp per block (I, I - dd), in three
  // tf32 passes (fp32-class products on the tensor cores)
#pragma unroll 1
  for (int dd = 1; dd < NB; ++dd) {
    if (warp < NB - dd) inverse_block(akk, R, T + warp * 16 * TP, dd + warp, warp, lane);
    __syncthreads();
  }

  // 6. W = R (beta k e^G), U = R (beta v), each warp its 32 columns, then 16-byte rows out
  r_times(R, warp < 4 ? s.k : s.v, warp & 3, lane);
  __syncthreads();
  tile_out(s.k, a.w + item * C * K, tid);
  tile_out(s.v, a.u + item * C * K, tid);
}

}  // namespace k3kp

K3_EXPORT int k3_kda_chunk_prologue_supported() { return 1; }
K3_EXPORT int k3_kda_chunk_prologue_args_size() { return (int)sizeof(k3kp::Args); }

// One launch, grid (n_chunks, H). Returns 0, -3 (more shared memory than max_shared), -4 (bad sizes)
// or the CUDA runtime's error code.
K3_EXPORT int k3_kda_chunk_prologue(const k3kp::Args* args, int max_shared, void* stream) {
  const k3kp::Args& a = *args;
  if (a.n_chunks < 1 || a.H < 1 || a.H > 65535) return -4;
  if (k3kp::SMEM_BYTES > max_shared) return -3;
  static bool configured = false;  // the opt-in above 48 KB, once per process
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(k3kp::prologue_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               k3kp::SMEM_BYTES);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  k3kp::prologue_kernel<<<dim3(a.n_chunks, a.H), k3kp::THREADS, k3kp::SMEM_BYTES, (cudaStream_t)stream>>>(a);
  return (int)cudaGetLastError();
}

#else  // HIP: no cp.async / tf32 mma path; the launcher says so

K3_EXPORT int k3_kda_chunk_prologue_supported() { return 0; }
K3_EXPORT int k3_kda_chunk_prologue_args_size() { return (int)sizeof(k3kp::Args); }
K3_EXPORT int k3_kda_chunk_prologue(const k3kp::Args*, int, void*) { return K3_KP_UNSUPPORTED; }

#endif
