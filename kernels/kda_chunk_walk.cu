// kda_chunk_walk.cu: the walking launches of KDA prefill's group scan (seed section 5), for NVIDIA GPUs:
// the summaries and the replay (k3lab.ops.kda_chunk.cuda; the scan between them stays Triton).
//
// What: both walk a group's chunks in order, carrying a 128 x 64 fp32 tile X of a state-like matrix:
//   replay:    E = U - W S;  O = Qg S + Aqk E (written);  S <- diag(d) S + Kd^T E
//              (tile = 64 value columns of the state, from the scan's starting state)
//   summaries: E = R - W X;  X <- diag(d) X + Kd^T E, from X = 0
//              (tile = 64 columns of N (R = -W diag(D so far), D tracked exactly) or of b (R = U))
// Layout: one block of 8 warps per (tiles, head, group). Chunk t + 1's W, Kd^T, d (and U, Qg, Aqk) are
// copied into shared memory by cp.async while chunk t is computed (two stages), into tiles whose
// 16-byte pieces are XOR-swizzled so ldmatrix reads fall in distinct banks (each thread's offsets
// computed once). Every product is bf16 m16n8k16 mma.sync with fp32 accumulation; X lives in registers
// in the accumulator layout (warp w: rows 16w .. 16w + 15) and is rounded to bf16 in shared memory once
// per chunk as the next B operand, as the Triton walks round it. Two barriers per chunk: after the copy
// wait and after E. The replay takes both 64-column halves of the state in one block when that still
// gives every SM a block (W, Qg, Aqk and Kd^T fragments read once for both halves).
// Shared memory: replay 2 x 72.5 KB stages + 48 KB (one block per SM); summaries 2 x 40.5 KB + 24 KB
// (two per SM).
// Why: the Triton walks leave the copies to the compiler; here the next chunk's operands arrive while
// the current one computes. The plain walk (few long walks) stays Triton: its narrower programs won.
// Limits: K = V = 128, bf16, sm_80 or later, at most 65535 groups; the HIP build is a stub returning
// K3_KW_UNSUPPORTED (not yet run on AMD hardware by this project). Figures: docs/kda_scan.md.
// With two stages fixed this build compiles (sm_90a, no spills) but is not yet run on a GPU.
#include "k3lab_mma.h"

#define K3_KW_UNSUPPORTED (-5)

namespace k3kw {

constexpr int C = 64;         // chunk
constexpr int K = 128;        // key and value head dim
constexpr int BV = 64;        // columns per tile
constexpr int THREADS = 256;  // 8 warps
constexpr int STAGES = 2;     // chunks whose operands are in shared memory at once
constexpr int W_BYTES = C * K * 2;    // W, Qg, U: [64][128] bf16
constexpr int KDT_BYTES = K * C * 2;  // Kd^T: [128][64] bf16
constexpr int T64_BYTES = C * BV * 2; // 64 of U's columns, Aqk, E: [64][64] bf16
constexpr int D_BYTES = K * 4;
constexpr int XB_BYTES = K * BV * 2;  // X rounded to bf16: [128][64]
// a stage: W | Kd^T | U (TILES x 64 columns) | d, then (replay) Qg | Aqk
constexpr int OFF_KDT = W_BYTES, OFF_U = OFF_KDT + KDT_BYTES;
__host__ __device__ constexpr int off_d(int tiles) { return OFF_U + tiles * T64_BYTES; }
__host__ __device__ constexpr int off_qg(int tiles) { return off_d(tiles) + D_BYTES; }
__host__ __device__ constexpr int off_a(int tiles) { return off_qg(tiles) + W_BYTES; }
__host__ __device__ constexpr int stage_bytes(bool replay, int tiles) { return replay ? off_a(tiles) + T64_BYTES : off_qg(tiles); }
__host__ __device__ constexpr int smem_bytes(bool replay, int tiles) {
  return STAGES * stage_bytes(replay, tiles) + tiles * (XB_BYTES + T64_BYTES);
}

struct Args {
  // prologue outputs (kda_chunk.Work), bf16 except d
  const k3_bf16* w;    // [n_chunks, H, 64, 128]
  const k3_bf16* u;    // [n_chunks, H, 64, 128]
  const k3_bf16* qg;   // [n_chunks, H, 64, 128]
  const k3_bf16* kdt;  // [n_chunks, H, 128, 64]
  const k3_bf16* aqk;  // [n_chunks, H, 64, 64]
  const float* d;      // [n_chunks, H, 128]
  // the plan (int32)
  const int* chunk_tok;
  const int* chunk_len;
  const int* grp_chunk0;
  const int* grp_nchunks;
  const int* grp_seq;
  const int* grp_sin;   // replay: row of s_in that starts group g
  const int* grp_last;
  const int* sum_grp;   // summaries: group of each summary slot
  const float* s_in;    // replay: [*, H, 128, 128] fp32, or null (zeros)
  k3_bf16* o;           // replay: [tokens, H, 128]
  float* s_final;       // replay: [N, H, 128, 128]
  float* sum_n;         // summaries: [n_summaries, H, 128, 128]
  float* sum_b;         // summaries: [n_summaries, H, 128, 128]
  float* sum_d;         // summaries: [n_summaries, H, 128]
  int n_items;          // groups (replay) or summary slots
  int H;
};

}  // namespace k3kw

#if defined(K3_CUDA)

namespace k3kw {

using namespace k3mma;

// Every shared tile is swizzled: 16-byte piece c of row r sits at piece c ^ (r % 8), so the 8 rows an
// ldmatrix reads (or 8 lanes' fragment accesses) fall in 8 different bank groups. For a fixed lane,
// the pieces a loop visits differ from one base by an XOR with a constant; the bases are computed once
// (Offsets) and each access costs one logic op at most.
struct Offsets {
  uint32_t a16[4];  // A operand rows 16 mi + (lane & 15) of a 128-column tile, k-step j (j + 4: + 128 B)
  uint32_t a8e[4];  // A operand rows 16 mi + (lane & 15) of a 64-column tile (Aqk), k-step j
  uint32_t a8x[4];  // A operand rows 16 warp + (lane & 15) of a 64-column tile (Kd^T), k-step j
  uint32_t b_nh;    // B operand (transposed) of a [k][64] tile, columns from 32 nh: ^ (np << 5), + 2048 ks
  uint32_t b_0;     // the same from column 0
  uint32_t e;       // E's element (16 mi + g, 32 nh + 2t) of a 64-column tile: ^ (n << 4), + 1024 half
  uint32_t w;       // W's or U's element (16 mi + g, 32 nh + 2t) of a 128-column tile: ^ (n << 4),
                    // + 2048 half, + 2 c for column c + 32 nh + 2t
  uint32_t x;       // X's element (16 warp + g, 2t) of the [128][64] tile: ^ (n << 4), + 1024 half
  uint32_t cp16;    // this thread's piece of a 128-column tile (+ 4096 B per 16 rows)
  uint32_t cp8;     // its piece of a 64-column tile (+ 4096 B per 32 rows)
};

K3_DEVICE Offsets offsets(int tid) {
  const int lane = tid & 31, warp = (tid >> 5) & 7, g = lane >> 2, t = lane & 3, mi = warp & 3, nh = warp >> 2;
  const int l15 = lane & 15, hr = (lane >> 4) ^ (lane & 7);
  Offsets o;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    o.a16[j] = (16 * mi + l15) * 256 + ((hr ^ (2 * j)) << 4);
    o.a8e[j] = (16 * mi + l15) * 128 + ((hr ^ (2 * j)) << 4);
    o.a8x[j] = (16 * warp + l15) * 128 + ((hr ^ (2 * j)) << 4);
  }
  o.b_0 = ((lane & 7) + 8 * ((lane >> 3) & 1)) * 128 + (hr << 4);
  o.b_nh = o.b_0 ^ (nh << 6);
  o.e = (16 * mi + g) * 128 + (((4 * nh) ^ g) << 4) + 4 * t;
  o.w = (16 * mi + g) * 256 + (((4 * nh) ^ g) << 4) + 4 * t;
  o.x = (16 * warp + g) * 128 + (g << 4) + 4 * t;
  o.cp16 = (tid >> 4) * 256 + (((tid & 15) ^ ((tid >> 4) & 7)) << 4);
  o.cp8 = (tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4);
  return o;
}

K3_DEVICE float2 bf2(const unsigned char* p) {
  const uint32_t x = *reinterpret_cast<const uint32_t*>(p);
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// a contiguous [ROWS][8 NC] bf16 tile from global into its swizzled shared copy: thread tid copies
// pieces tid, tid + 256, ... (256 / NC rows apart)
template <int ROWS, int NC>
K3_DEVICE void copy_tile(unsigned char* dst, uint32_t off, const k3_bf16* src, int tid) {
#pragma unroll
  for (int p = 0; p < ROWS * NC / THREADS; ++p) cp16(dst + off + p * THREADS * 16, src + tid * 8 + p * THREADS * 8, true);
}

template <bool REPLAY, int TILES>
K3_DEVICE void load_stage(unsigned char* st, const Args& a, const Offsets& o, long long item, int ucol0, bool load_u,
                          int tid) {
  copy_tile<C, K / 8>(st, o.cp16, a.w + item * C * K, tid);
  copy_tile<K, C / 8>(st + OFF_KDT, o.cp8, a.kdt + item * K * C, tid);
  if (TILES == 2) {  // all of U (TILES: the block's tiles)
    if (load_u) copy_tile<C, K / 8>(st + OFF_U, o.cp16, a.u + item * C * K, tid);
  } else if (load_u) {  // 64 of U's 128 columns: rows 256 bytes apart in global memory
    const k3_bf16* u = a.u + item * C * K + ucol0 + (tid >> 3) * K + (tid & 7) * 8;
#pragma unroll
    for (int p = 0; p < C * BV / 8 / THREADS; ++p) cp16(st + OFF_U + o.cp8 + p * 4096, u + p * 32 * K, true);
  }
  if (tid < D_BYTES / 16) cp16(st + off_d(TILES) + tid * 16, a.d + item * K + tid * 4, true);
  if (REPLAY) {
    copy_tile<C, K / 8>(st + off_qg(TILES), o.cp16, a.qg + item * C * K, tid);
    copy_tile<C, C / 8>(st + off_a(TILES), o.cp8, a.aqk + item * C * C, tid);
  }
}

// this warp's X (rows 16 warp + g and + 8, columns 8 n + 2t and + 1) to the bf16 tile
template <int TILES>
K3_DEVICE void store_xb(unsigned char* xb, const float (&X)[TILES][8][4], uint32_t x) {
#pragma unroll
  for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      unsigned char* p = xb + tt * XB_BYTES + (x ^ (n << 4));
      *reinterpret_cast<uint32_t*>(p) = pack_bf16(X[tt][n][0], X[tt][n][1]);
      *reinterpret_cast<uint32_t*>(p + 1024) = pack_bf16(X[tt][n][2], X[tt][n][3]);
    }
}

// acc[tt][n] += A[16 rows, k] B_tt[k, NT n-tiles] over KSTEPS 16-deep steps for each of TILES B tiles
// (b_stride bytes apart), the A fragments loaded once; with TWO, also acc2 += A2 B on the same B
// fragments. A: a_tile + aoff[ks % 4] (+128 B per 4 k-steps: a 128-column tile); B: a [k][64] tile
// at b_tile + (boff ^ (np << 5)) + 2048 ks.
template <int NT, int KSTEPS, bool TWO, int TILES>
K3_DEVICE void mma_rows(float (&acc)[TILES][NT][4], float (&acc2)[TILES][NT][4], uint32_t a_tile, uint32_t a2_tile,
                        const uint32_t (&aoff)[4], uint32_t b_tile, int b_stride, uint32_t boff) {
#pragma unroll
  for (int ks = 0; ks < KSTEPS; ++ks) {
    const uint32_t ao = aoff[ks & 3] + (ks >> 2) * 128;
    uint32_t af[4], af2[4];
    ldsm_x4(a_tile + ao, af[0], af[1], af[2], af[3]);
    if (TWO) ldsm_x4(a2_tile + ao, af2[0], af2[1], af2[2], af2[3]);
#pragma unroll
    for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        uint32_t b0, b1, b2, b3;
        ldsm_x4_t(b_tile + tt * b_stride + (boff ^ (np << 5)) + 2048 * ks, b0, b1, b2, b3);
        mma_bf16(acc[tt][2 * np], af, b0, b1);
        mma_bf16(acc[tt][2 * np + 1], af, b2, b3);
        if (TWO) {
          mma_bf16(acc2[tt][2 * np], af2, b0, b1);
          mma_bf16(acc2[tt][2 * np + 1], af2, b2, b3);
        }
      }
  }
}

// TILES: 64-column tiles of X per block (the replay takes both halves of the state at once: the
// A operands W, Qg, Aqk, Kd^T are read from shared memory once for both, and each warp has twice the
// independent mma work between barriers).
template <bool REPLAY, int TILES>
__global__ void __launch_bounds__(THREADS, (REPLAY || TILES > 1) ? 1 : 2) walk_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int STAGE = stage_bytes(REPLAY, TILES), OFF_D = off_d(TILES), OFF_QG = off_qg(TILES);
  constexpr int OFF_A = off_a(TILES);
  unsigned char* xb = smem + STAGES * STAGE;  // X in bf16, TILES x [128][64]
  unsigned char* eb = xb + TILES * XB_BYTES;  // E in bf16, TILES x [64][64]
  const int tid = threadIdx.x, warp = (tid >> 5) & 7, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int tile = blockIdx.x, h = blockIdx.y, item = blockIdx.z, H = a.H;
  const int mi = warp & 3, nh = warp >> 2;  // E and O: rows 16 mi, columns 32 nh
  const int gi = REPLAY ? item : a.sum_grp[item];
  const long long c0 = a.grp_chunk0[gi];
  const int nch = a.grp_nchunks[gi];
  const bool is_n = !REPLAY && tile < K / BV / TILES;  // summaries: tiles of N (else of b)
  // first column of tile tt: N: columns of M; b and replay: value columns
  const int col0 = TILES == 2 ? 0 : (tile % (K / BV)) * BV;  // + 64 tt for tile tt
  const bool load_u = REPLAY || !is_n;
  const Offsets off = offsets(tid);

  float X[TILES][8][4];
#pragma unroll
  for (int tt = 0; tt < TILES; ++tt) {
    const float* src = REPLAY && a.s_in != nullptr
                           ? a.s_in + ((long long)a.grp_sin[gi] * H + h) * K * K + col0 + tt * BV
                           : nullptr;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      float2 lo = make_float2(0.f, 0.f), hi = lo;
      if (src != nullptr) {
        lo = *reinterpret_cast<const float2*>(src + (16 * warp + g) * K + 8 * n + 2 * t);
        hi = *reinterpret_cast<const float2*>(src + (16 * warp + g + 8) * K + 8 * n + 2 * t);
      }
      X[tt][n][0] = lo.x, X[tt][n][1] = lo.y, X[tt][n][2] = hi.x, X[tt][n][3] = hi.y;
    }
  }
  float Dc[TILES][4][2];  // N tiles: D so far for E's columns col0 + 64 tt + 32 nh + 8 n + 2t (+1)
#pragma unroll
  for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
    for (int n = 0; n < 4; ++n) Dc[tt][n][0] = Dc[tt][n][1] = 1.f;

#pragma unroll
  for (int sidx = 0; sidx < STAGES - 1; ++sidx) {  // chunks 0 .. STAGES - 2 in flight, one group each
    if (sidx < nch)
      load_stage<REPLAY, TILES>(smem + sidx * STAGE, a, off, (c0 + sidx) * H + h, col0, load_u, tid);
    cp_commit();
  }
  store_xb<TILES>(xb, X, off.x);
  const uint32_t xb_s = smem_u32(xb), eb_s = smem_u32(eb);

#pragma unroll 1
  for (int step = 0; step < nch; ++step) {
    unsigned char* st = smem + (step % STAGES) * STAGE;
    const uint32_t st_s = smem_u32(st);
    const long long cidx = c0 + step;
    long long tok0 = 0;
    int len = 0;
    if (REPLAY) tok0 = a.chunk_tok[cidx], len = a.chunk_len[cidx];  // early: off the chain to the stores
    cp_wait<STAGES - 2>();
    __syncthreads();  // this chunk's tiles and X visible; the stage read in the last step is free
    const int ahead = step + STAGES - 1;
    if (ahead < nch)
      load_stage<REPLAY, TILES>(smem + (ahead % STAGES) * STAGE, a, off, (c0 + ahead) * H + h, col0, load_u, tid);
    cp_commit();

    // E = R - W X (and O = Qg X), rows 16 mi, columns 32 nh of each tile
    float E[TILES][4][4] = {}, O[TILES][4][4] = {};
    mma_rows<4, K / 16, REPLAY, TILES>(E, O, st_s, st_s + OFF_QG, off.a16, xb_s, XB_BYTES, off.b_nh);
    const float* dvec = reinterpret_cast<const float*>(st + OFF_D);
#pragma unroll
    for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint32_t eo = (off.e ^ (n << 4)) + 1024 * half;
          const uint32_t wo = (off.w ^ (n << 4)) + 2048 * half;
          float2 rhs;
          if (!load_u) {
            const float2 wc = bf2(st + wo + 2 * (col0 + BV * tt));
            rhs = make_float2(-wc.x * Dc[tt][n][0], -wc.y * Dc[tt][n][1]);
          } else if (TILES == 2) {
            rhs = bf2(st + OFF_U + wo + 2 * (col0 + BV * tt));
          } else {
            rhs = bf2(st + OFF_U + eo);
          }
          E[tt][n][2 * half] = rhs.x - E[tt][n][2 * half];
          E[tt][n][2 * half + 1] = rhs.y - E[tt][n][2 * half + 1];
          *reinterpret_cast<uint32_t*>(eb + tt * T64_BYTES + eo) = pack_bf16(E[tt][n][2 * half], E[tt][n][2 * half + 1]);
        }
        if (is_n) {
          const int col = col0 + BV * tt + 32 * nh + 8 * n + 2 * t;
          Dc[tt][n][0] *= dvec[col];
          Dc[tt][n][1] *= dvec[col + 1];
        }
      }
    __syncthreads();  // E complete in shared memory; every read of X's bf16 copy done

    if (REPLAY) {  // O += Aqk E, then out (rows past the sequence's end are not written)
      mma_rows<4, C / 16, false, TILES>(O, O, st_s + OFF_A, 0, off.a8e, eb_s, T64_BYTES, off.b_nh);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 16 * mi + g + 8 * half;
        if (r < len) {
          k3_bf16* dst = a.o + ((tok0 + r) * H + h) * K + col0 + 32 * nh + 2 * t;
#pragma unroll
          for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
            for (int n = 0; n < 4; ++n)
              *reinterpret_cast<uint32_t*>(dst + tt * BV + 8 * n) = pack_bf16(O[tt][n][2 * half], O[tt][n][2 * half + 1]);
        }
      }
    }
    // X <- diag(d) X + Kd^T E, rows 16 warp
    const float d0 = dvec[16 * warp + g], d1 = dvec[16 * warp + g + 8];
#pragma unroll
    for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
      for (int n = 0; n < 8; ++n) X[tt][n][0] *= d0, X[tt][n][1] *= d0, X[tt][n][2] *= d1, X[tt][n][3] *= d1;
    mma_rows<8, C / 16, false, TILES>(X, X, st_s + OFF_KDT, 0, off.a8x, eb_s, T64_BYTES, off.b_0);
    store_xb<TILES>(xb, X, off.x);
  }

  // results: rows 16 warp + g (+ 8), columns col0 + 64 tt + 8 n + 2t (+ 1)
  float* dst = nullptr;
  if (REPLAY) {
    if (a.grp_last[gi]) dst = a.s_final + ((long long)a.grp_seq[gi] * H + h) * K * K + col0;
  } else {
    const long long sb = (long long)item * H + h;
    dst = (is_n ? a.sum_n : a.sum_b) + sb * K * K + col0;
    if (is_n && mi == 0 && g == 0) {
#pragma unroll
      for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
        for (int n = 0; n < 4; ++n)
          *reinterpret_cast<float2*>(a.sum_d + sb * K + col0 + BV * tt + 32 * nh + 8 * n + 2 * t) =
              make_float2(Dc[tt][n][0], Dc[tt][n][1]);
    }
  }
  if (dst != nullptr) {
#pragma unroll
    for (int tt = 0; tt < TILES; ++tt)
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        float* p = dst + tt * BV + (16 * warp + g) * K + 8 * n + 2 * t;
        *reinterpret_cast<float2*>(p) = make_float2(X[tt][n][0], X[tt][n][1]);
        *reinterpret_cast<float2*>(p + 8 * K) = make_float2(X[tt][n][2], X[tt][n][3]);
      }
  }
}

template <bool REPLAY, int TILES>
int launch(const Args& a, int max_shared, cudaStream_t stream) {
  constexpr int bytes = smem_bytes(REPLAY, TILES);
  if (bytes > max_shared) return -3;
  static bool configured = false;  // the opt-in above 48 KB, once per process and form
  if (!configured) {
    const cudaError_t e =
        cudaFuncSetAttribute(walk_kernel<REPLAY, TILES>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  const dim3 grid((REPLAY ? K : 2 * K) / BV / TILES, a.H, a.n_items);
  walk_kernel<REPLAY, TILES><<<grid, THREADS, bytes, stream>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace k3kw

K3_EXPORT int k3_kda_chunk_walk_supported() { return 1; }
K3_EXPORT int k3_kda_chunk_walk_args_size() { return (int)sizeof(k3kw::Args); }

// One launch: the replay (`tiles` = 1: grid 2 x H x groups, one 64-column half of the state per block;
// 2: grid 1 x H x groups, both halves) or the summaries (tiles = 1: grid 4 x H x summary slots).
// Returns 0, -3 (more shared memory than max_shared), -4 (bad sizes), -6 (a form not built) or the
// CUDA runtime's error.
K3_EXPORT int k3_kda_chunk_walk(const k3kw::Args* args, int replay, int tiles, int max_shared, void* stream) {
  const k3kw::Args& a = *args;
  if (a.n_items < 1 || a.H < 1 || a.H > 65535 || a.n_items > 65535) return -4;
  const cudaStream_t st = (cudaStream_t)stream;
  using namespace k3kw;
  if (replay) {
    if (tiles == 2) return launch<true, 2>(a, max_shared, st);
    if (tiles == 1) return launch<true, 1>(a, max_shared, st);
    return -6;
  }
  return tiles == 1 ? launch<false, 1>(a, max_shared, st) : -6;
}

#else  // HIP: no cp.async / mma.sync path; the launcher says so

K3_EXPORT int k3_kda_chunk_walk_supported() { return 0; }
K3_EXPORT int k3_kda_chunk_walk_args_size() { return (int)sizeof(k3kw::Args); }
K3_EXPORT int k3_kda_chunk_walk(const k3kw::Args*, int, int, int, void*) { return K3_KW_UNSUPPORTED; }

#endif
