// mla_decode_wgmma.h: form 'wgmma' of the MLA decode's split kernel, on Hopper's warpgroup matrix units.
// Included by mla_decode.cu in its CUDA build only (it uses that file's Args, mbarrier helpers and
// partial layout; the merge kernel there merges its pieces unchanged).
//
// What: the same pieces as form 'mma', for one token per block (NT = 1) or two tokens of one
// verification group per block (NT = 2, N = 32: the pair reads each tile once).
// Layout:
//   * positions on M: S^T [64 positions x 16 NT heads] = K_tile [64 x 576] . Q^T (36 k-steps of
//     m64nNk16), so a tile is 64 latent rows and no row of the product is padding;
//   * O^T [512 value columns x 16 NT] += V_tile^T [512 x 64] . P^T [64 x 16 NT] (8 x 4 steps with
//     the tile read M-major: the same shared bytes serve both products);
//   * each warp owns 16 positions of the tile: the softmax's max over the tile is one shuffle tree
//     and one exchange, and only when a score passes its head's reference by more than WG_LAZY
//     (lazy references: most tiles skip the exchange, a barrier and the accumulator's rescale);
//   * a tile arrives as 9 TMA boxes of 64 rows x 64 columns with the 128-byte swizzle (the layout
//     wgmma reads), 72 KB; two stages, a stage refilled as soon as its value product is done.
//     Q^T arrives by TMA too (heads past H, and a padded group's extra token, read as zeros).
// Why this shape: the mma.sync form is bound by its dependent instruction chains; wgmma reads its
// operands from shared memory itself and runs asynchronously, 4-10% faster from pieces of 4 tiles up
// on the H200. Other stage counts, box shapes, ring layouts, prefetches and warpgroup splits were
// measured and were slower (docs/mla_padding.md, "Design choices").
// Limits: tiles of 64 rows inside one page (contiguous caches or pages of >= 64 rows laid end to end,
// one tensor map of rows), 16-byte aligned queries. Rows past a request's length inside its last
// tile are zeroed in shared memory before use (NaN in unused cache rows cannot reach p V).

namespace k3mla {

constexpr int WG_BN = 64;                         // positions per tile
constexpr int WG_BOX = 64 * 128;                  // one TMA box: 64 rows x 64 bf16 columns = 8 KB
constexpr int WG_BOXES = D / 64;                  // 9 boxes per tile
constexpr int WG_STAGE = WG_BOXES * WG_BOX;       // 73,728 bytes
constexpr int WG_STAGES = 2;
constexpr int WG_QBOX = ROWS * 128;               // Q^T box: 16 heads x 64 columns = 2 KB
constexpr int WG_Q = WG_BOXES * WG_QBOX;          // 18,432 bytes
constexpr int WG_P = ROWS * 128;                  // P: 16 heads x 64 positions (bf16), one swizzled 128 B row each
constexpr int WG_RED = 3 * 4 * ROWS * 4;          // two max exchanges and one sum exchange: [4 warps][16 heads] fp32
constexpr int WG_OPITCH = DV + 4;               // the finished piece staged in shared memory: [16 heads][516] fp32
// NT tokens per block (a verification group's tokens as one product, NT = 2): N = 16 NT columns of S^T and
// O^T, token-major (column 16 t + head). The sizes above are NT = 1's; these are any NT's.
template <int NT> __host__ __device__ constexpr int wg_qbox() { return NT * WG_QBOX; }
template <int NT> __host__ __device__ constexpr int wg_q() { return WG_BOXES * wg_qbox<NT>(); }
template <int NT> __host__ __device__ constexpr int wg_p() { return NT * WG_P; }
template <int NT> __host__ __device__ constexpr int wg_red() { return NT * WG_RED; }
template <int NT>
__host__ __device__ constexpr int wg_smem_bytes_t() { return 1024 + WG_STAGES * WG_STAGE + wg_q<NT>() + wg_p<NT>() + wg_red<NT>() + (WG_STAGES + 1) * 8; }
constexpr int wg_smem_bytes() { return wg_smem_bytes_t<1>(); }
static_assert(2 * ROWS * WG_OPITCH * 4 <= WG_STAGES * WG_STAGE, "the piece is staged in the free ring");

#if defined(K3_MLA_SM90)
// A shared-memory matrix descriptor with the 128-byte swizzle (PTX ISA, wgmma "matrix descriptor"):
// start address, leading and stride byte offsets, all >> 4; layout type 1 (128B swizzle) in bits 62-63.
K3_DEVICE uint64_t wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

K3_DEVICE void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
K3_DEVICE void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
K3_DEVICE void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// generic-proxy writes to shared memory (zero fill, P, Q) made visible to the async proxy (wgmma, TMA)
K3_DEVICE void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// d (+)= A . B, m64n16k16, bf16 in, fp32 accumulate; A from shared memory, K-major (TRANS_A = 0) or
// M-major (1); B from shared memory, K-major. accumulate = 0 ignores d's old value.
template <int TRANS_A>
K3_DEVICE void wg_mma(float (&d)[8], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %10, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, %11, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TRANS_A)
      : "memory");
}
// the same, m64n32k16 (two tokens' 16 heads as N)
template <int TRANS_A>
K3_DEVICE void wg_mma(float (&d)[16], uint64_t da, uint64_t db, int accumulate) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tsetp.ne.b32 p, %18, 0;\n\t"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, "
      "%13, %14, %15}, %16, %17, p, 1, 1, %19, 0;\n}"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db), "r"(accumulate), "n"(TRANS_A)
      : "memory");
}

K3_DEVICE void tma_box(uint32_t dst, const void* map, int col, int row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(map), "r"(col), "r"(row), "r"(bar)
      : "memory");
}

// Thread 0, at the start: the tile maps prefetched, the barriers (WG_STAGES tiles + the queries at
// bars + 8 WG_STAGES) initialised, and Q^T requested by the copy engine: 9 boxes of [16 heads x 64
// columns], swizzled; heads past a.heads lie outside the map and arrive as zeros (the padding). Every
// block reads the same 18 KB: 16-byte loads from 128 threads of every SM cost ~1.2 us on the H200,
// the boxes do not.
// With NT tokens (requests b .. b + NT - 1), token t's 16 rows follow token t - 1's in each box; request r's
// query is token r % q_run of group r / q_run in the map (Args::q_run).
template <int NT>
K3_DEVICE void wg_start(const Args& a, const void* map, const void* qmap, uint32_t bars, uint32_t qs, int b) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(map) : "memory");
  for (int s = 0; s <= WG_STAGES; ++s) mbar_init(bars + 8 * s, 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const uint32_t qbar = bars + 8 * WG_STAGES;
  mbar_expect_tx(qbar, (uint32_t)wg_q<NT>());
#pragma unroll
  for (int i = 0; i < WG_BOXES; ++i)
#pragma unroll
    for (int t = 0; t < NT; ++t)
      asm volatile(
          "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(
              qs + i * wg_qbox<NT>() + t * WG_QBOX),
          "l"(qmap), "r"(64 * i), "r"(0), "r"((b + t) % a.q_run), "r"((b + t) / a.q_run), "r"(qbar)
          : "memory");
}

// The first cache row (of the tensor map's rows) of position `pos` of request b: row_at's element
// offset in rows (the launcher checks that pages, or requests, are whole rows apart).
K3_DEVICE int wg_row(const Args& a, int b, int pos) { return (int)(row_at(a, b, pos) / D); }

// Thread 0: tile at row `row` into `stage` (9 boxes), completing on `bar`.
K3_DEVICE void wg_issue(const Args& a, const void* map, int row, uint32_t stage, uint32_t bar) {
  mbar_expect_tx(bar, (uint32_t)WG_STAGE);
#pragma unroll
  for (int i = 0; i < WG_BOXES; ++i) tma_box(stage + i * WG_BOX, map, 64 * i, row, bar);
}

// The thread's heads in the accumulator layout (columns of S^T and O^T): 8 jn + 2 t4 + e, index 2 jn + e.
K3_DEVICE int wg_head(int c, int t4) { return 8 * (c >> 1) + 2 * t4 + (c & 1); }

// Lazy references: P = 2^(s - m) with m a head's reference, moved only when a score passes it by more
// than WG_LAZY (so P <= 2^8: far from fp32's and bf16's range limits, and bf16 keeps the same relative
// precision at any scale), which after the first tiles is rare; most tiles then skip the exchange of maxima, a block-wide barrier and the accumulator's
// rescale. The final log-sum-exp is m + log2(sum P) either way.
constexpr float WG_LAZY = 8.f;

// p = 2^(s - m) for this thread's 2 positions x 4 heads, stored as bf16 into P (head h, position q: row h
// of 128 B, 16-byte unit q / 8 swizzled by h % 8). m: the references (-inf: no reference yet, 0 used).
template <int NC>
K3_DEVICE void wg_store_p(float (&p)[2 * NC], const float (&s)[2 * NC], const float (&m)[NC], uint32_t ps, int q0, int t4) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int h = wg_head(c, t4), i = 4 * (c >> 1) + (c & 1);
    const float u = m[c] == -INFINITY ? 0.f : m[c];
    p[i] = fast_exp2(s[i] - u);
    p[i + 2] = fast_exp2(s[i + 2] - u);
    const uint32_t row = ps + h * 128, sw = h & 7;
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(row + ((((uint32_t)q0 >> 3) ^ sw) << 4) + (q0 & 7) * 2),
                 "h"(k3_f32_to_bf16(p[i]))
                 : "memory");
    asm volatile("st.shared.b16 [%0], %1;" ::"r"(row + ((((uint32_t)(q0 + 8) >> 3) ^ sw) << 4) + (q0 & 7) * 2),
                 "h"(k3_f32_to_bf16(p[i + 2]))
                 : "memory");
  }
}
#endif

// NT = 1: one token (request) per block, the decode. NT = 2: a block per pair of consecutive requests that
// are two tokens of one verification group (same pages): both tokens' scores and values in one product
// each (N = 32), so the pair reads each tile once. Requests b0 = NT blockIdx.y + t.
template <int NT>
__global__ void __launch_bounds__(128, 1) wg_kernel(const Args a, const __grid_constant__ CUtensorMap map,
                                                   const __grid_constant__ CUtensorMap qmap) {
  constexpr int N = NT * ROWS, NC = N / 4;  // columns of S^T / O^T; columns per thread
  constexpr int SACC = NT == 1 ? 4 : 2;     // score accumulators used in turn
  extern __shared__ unsigned char wg_raw[];
#if defined(K3_MLA_SM90)
  // 1024-byte aligned base: the 128-byte swizzle pattern is a function of the address bits
  const uint32_t raw = smem_u32(wg_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gbase = wg_raw + (base - raw);
  const uint32_t stages = base, qs = base + WG_STAGES * WG_STAGE, ps = qs + wg_q<NT>();
  float* red = reinterpret_cast<float*>(gbase + WG_STAGES * WG_STAGE + wg_q<NT>() + wg_p<NT>());  // [3][4][N]
  const uint32_t bars = ps + wg_p<NT>() + wg_red<NT>();
  const int split = blockIdx.x, b = NT * blockIdx.y;  // b: the block's first request (token)
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  launch_dependents();  // the merge may launch now; it waits for this grid

  const int start = split * a.chunk;
  const uint32_t qbar = bars + 8 * WG_STAGES;
  int end_t[NT], end = start;  // each token's end in this piece, and the latest
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    end_t[t] = min(__ldg(a.lengths + b + t), start + a.chunk);
    end = max(end, end_t[t]);
  }
  const int ntiles = end > start ? (end - start + WG_BN - 1) / WG_BN : 0;
  if (tid == 0) {
    wg_start<NT>(a, &map, &qmap, bars, qs, b);
    for (int i = 0; i < WG_STAGES && i < ntiles; ++i)
      wg_issue(a, &map, wg_row(a, b, start + i * WG_BN), stages + i * WG_STAGE, bars + 8 * i);
  }
  __syncthreads();  // the barriers are initialised before anyone waits on them
  mbar_wait(qbar, 0);

  float o[8][2 * NC];  // O^T: value columns 64 mb + 16 warp + g (+8) x this thread's NC columns
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int e = 0; e < 2 * NC; ++e) o[mb][e] = 0.f;
  float m_run[NC], l_run[NC];
#pragma unroll
  for (int c = 0; c < NC; ++c) m_run[c] = -INFINITY, l_run[c] = 0.f;

  for (int j = 0; j < ntiles; ++j) {
    const int st = j % WG_STAGES;
    const uint32_t stage = stages + st * WG_STAGE;
    // the row of the tile that will refill this stage, read now: its latency hides behind this tile
    const int refill_row = (tid == 0 && j + WG_STAGES < ntiles) ? wg_row(a, b, start + (j + WG_STAGES) * WG_BN) : 0;
    mbar_wait(bars + 8 * st, (uint32_t)((j / WG_STAGES) & 1));
    const int pos0 = start + j * WG_BN;
    const int valid = min(WG_BN, end - pos0);  // rows of the latest token; each token masks its own below
    if (valid < WG_BN) {  // the request's last tile: zero the rows past its length (whole 128 B rows)
      const int units = WG_BOXES * (WG_BN - valid) * 8;
      for (int u = tid; u < units; u += 128) {
        const int box = u / ((WG_BN - valid) * 8), r = valid + (u / 8) % (WG_BN - valid), c = u & 7;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(stage + box * WG_BOX + r * 128 + c * 16), "r"(0)
                     : "memory");
      }
      fence_async_smem();
      __syncthreads();
    }
    // scores S^T = K Q^T: 36 k-steps of 16 columns (4 per 64-column box, +32 bytes each), into four
    // accumulators in turn so that consecutive wgmma do not wait for each other
    float s4[SACC][2 * NC];
#pragma unroll
    for (int c = 0; c < SACC; ++c)
#pragma unroll
      for (int e = 0; e < 2 * NC; ++e) s4[c][e] = 0.f;
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg_mma<0>(s4[kk % SACC], wg_desc(stage + (kk >> 2) * WG_BOX + (kk & 3) * 32, 16, 1024),
                wg_desc(qs + (kk >> 2) * wg_qbox<NT>() + (kk & 3) * 32, 16, 1024), kk >= SACC);
    wg_commit();
    wg_wait_all();
    float s[2 * NC];
#pragma unroll
    for (int e = 0; e < 2 * NC; ++e) {
      if constexpr (SACC == 4) s[e] = (s4[0][e] + s4[1][e]) + (s4[2][e] + s4[3][e]);
      else s[e] = s4[0][e] + s4[1][e];
    }
    // this thread's rows: positions q0 = 16 warp + g and q0 + 8 of the tile; s[4 jn + e]: row q0, s[4 jn + 2 + e]: row q0 + 8
    const int q0 = 16 * warp + g;
    bool raise = false;  // a score more than WG_LAZY above its head's reference: the references must move
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int i = 4 * (c >> 1) + (c & 1);
      const int vt = NT == 1 ? valid : min(WG_BN, end_t[wg_head(c, t4) / ROWS] - pos0);  // this column's token
      const bool in0 = q0 < vt, in1 = q0 + 8 < vt;
      s[i] = in0 ? s[i] * a.scale_log2 : -INFINITY;
      s[i + 2] = in1 ? s[i + 2] * a.scale_log2 : -INFINITY;
      raise |= fmaxf(s[i], s[i + 2]) > m_run[c] + WG_LAZY;
    }
    // P against the current references m_run (one per head, the same in every thread): no exchange of
    // maxima unless some score is far above its reference
    float p[2 * NC];
    wg_store_p<NC>(p, s, m_run, ps, q0, t4);
    fence_async_smem();
    if (__syncthreads_or(raise)) {  // P complete, unless the references move (always at the first tile)
      float mx[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int i = 4 * (c >> 1) + (c & 1);
        mx[c] = fmaxf(s[i], s[i + 2]);
#pragma unroll
        for (int off = 4; off < 32; off <<= 1) mx[c] = fmaxf(mx[c], k3_shfl_xor(mx[c], off));
      }
      float* rb = red + (j & 1) * (4 * N);
      if (g == 0) {
#pragma unroll
        for (int c = 0; c < NC; ++c) rb[warp * N + wg_head(c, t4)] = mx[c];
      }
      __syncthreads();  // the four warps' maxima
      float alpha[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int h = wg_head(c, t4);
        const float tmax = fmaxf(fmaxf(rb[h], rb[N + h]), fmaxf(rb[2 * N + h], rb[3 * N + h]));
        const float mnew = fmaxf(m_run[c], tmax);
        alpha[c] = fast_exp2(m_run[c] - (mnew == -INFINITY ? 0.f : mnew));  // 0 while m_run is -inf
        m_run[c] = mnew;
        l_run[c] *= alpha[c];
      }
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const int i = 4 * (c >> 1) + (c & 1);
          o[mb][i] *= alpha[c];
          o[mb][i + 2] *= alpha[c];
        }
      wg_store_p<NC>(p, s, m_run, ps, q0, t4);
      fence_async_smem();
      __syncthreads();  // P complete
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int i = 4 * (c >> 1) + (c & 1);
      l_run[c] += p[i] + p[i + 2];
    }
    // O^T += V^T P^T: value columns in 8 boxes of 64 (M-major A), positions in 4 k-steps of 16 rows
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)  // k-steps outside: consecutive wgmma update different accumulators
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
        wg_mma<1>(o[mb], wg_desc(stage + mb * WG_BOX + ks * 16 * 128, WG_BOX, 1024), wg_desc(ps + ks * 32, 16, 1024), 1);
    wg_commit();
    wg_wait_all();
    __syncthreads();  // every warp is done with this stage and with P: refill the stage
    if (tid == 0 && j + WG_STAGES < ntiles)
      wg_issue(a, &map, refill_row, stage, bars + 8 * st);
  }

  // totals per head: the sums over this warp's rows (lanes of one t4), then over the four warps
  float* rs = red + 2 * (4 * N);
#pragma unroll
  for (int c = 0; c < NC; ++c) {
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) l_run[c] += k3_shfl_xor(l_run[c], off);
  }
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < NC; ++c) rs[warp * N + wg_head(c, t4)] = l_run[c];
  }
  __syncthreads();
  float rcp[NC], lse2[NC];  // this thread's NC columns: 1 / their sums, and their base-2 log-sum-exp
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int h = wg_head(c, t4);
    const float l = rs[h] + rs[N + h] + rs[2 * N + h] + rs[3 * N + h];
    rcp[c] = l > 0.f ? 1.f / l : 0.f;
    lse2[c] = l > 0.f ? m_run[c] + __log2f(l) : -INFINITY;
  }
  if (a.splits > 1) {
    // the normalised piece straight from the accumulators: each store instruction writes 4 heads x
    // 8 consecutive columns, whole 32-byte sectors (faster than staging them in shared memory)
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int col = wg_head(c, t4), h = col % ROWS, bt = b + col / ROWS, i = 4 * (c >> 1) + (c & 1);
      if (h < a.heads) {
        float* po = a.part_o + (((long long)bt * a.heads + h) * a.splits + split) * DV + 16 * warp + g;
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) {
          po[64 * mb] = o[mb][i] * rcp[c];
          po[64 * mb + 8] = o[mb][i + 2] * rcp[c];
        }
        if (warp == 0 && g == 0) a.part_lse[((long long)bt * a.heads + h) * a.splits + split] = lse2[c];
      }
    }
    return;
  }
  // one piece: the bf16 result through shared memory (the ring is free now: every tile was consumed),
  // so that the global stores are whole 8-byte pieces of each head's 1 KB row
  float* ob = reinterpret_cast<float*>(gbase);  // [N columns][WG_OPITCH]: t4's columns fall in 4 bank groups
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int h = wg_head(c, t4), i = 4 * (c >> 1) + (c & 1);
#pragma unroll
    for (int mb = 0; mb < 8; ++mb) {
      const int col = 64 * mb + 16 * warp + g;
      ob[h * WG_OPITCH + col] = o[mb][i] * rcp[c];
      ob[h * WG_OPITCH + col + 8] = o[mb][i + 2] * rcp[c];
    }
    if (warp == 0 && g == 0 && h % ROWS < a.heads)  // natural log
      a.lse[(long long)(b + h / ROWS) * a.l_sb + h % ROWS] = lse2[c] * 0.6931471805599453f;
  }
  __syncthreads();
  for (int v = tid; v < NT * a.heads * (DV / 4); v += 128) {
    const int t = v / (a.heads * (DV / 4)), h = v / (DV / 4) % a.heads, k = v % (DV / 4);
    const float4 x = *reinterpret_cast<const float4*>(ob + (t * ROWS + h) * WG_OPITCH + 4 * k);
    const uint32_t lo = (uint32_t)k3_f32_to_bf16(x.x) | ((uint32_t)k3_f32_to_bf16(x.y) << 16);
    const uint32_t hi = (uint32_t)k3_f32_to_bf16(x.z) | ((uint32_t)k3_f32_to_bf16(x.w) << 16);
    *reinterpret_cast<uint2*>(a.out + (long long)(b + t) * a.o_sb + (long long)h * a.o_sh + 4 * k) = make_uint2(lo, hi);
  }
#endif  // K3_MLA_SM90
}

// The tensor map of a cache's rows ([rows, 576] bf16, 1152-byte rows): boxes of 64 rows x 64
// columns with the 128-byte swizzle; rows past the end read as zeros. 0 or an error code.
// The driver's tensor-map encoder, looked up once (null where the driver lacks it).
inline PFN_cuTensorMapEncodeTiled_v12000 wg_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q);
    if (e == cudaSuccess && q == cudaDriverEntryPointSuccess) encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return encode;
}

inline int wg_make_map(CUtensorMap* map, const void* base, long long rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = wg_encoder();
  if (encode == nullptr) return -6;
  const cuuint64_t dims[2] = {(cuuint64_t)D, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)ROW_BYTES};
  const cuuint32_t box[2] = {64, (cuuint32_t)WG_BN};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -1000 - (int)r;
}

// The tensor map of the queries ([groups, tq, H, 576] bf16 with element strides q_sg, q_st, q_sh): boxes of
// 16 heads x 64 columns of one token with the 128-byte swizzle; heads past H, and tokens past tq (a padded
// verification group's repeat), read as zeros.
inline int wg_make_qmap(CUtensorMap* map, const void* q, int heads, int tq, int groups, long long q_sh, long long q_st,
                        long long q_sg) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = wg_encoder();
  if (encode == nullptr) return -6;
  const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)heads, (cuuint64_t)tq, (cuuint64_t)groups};
  const cuuint64_t strides[3] = {(cuuint64_t)q_sh * 2, (cuuint64_t)q_st * 2, (cuuint64_t)q_sg * 2};
  const cuuint32_t box[4] = {64, (cuuint32_t)ROWS, 1, 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(q), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? 0 : -1000 - (int)r;
}

// NT tokens per block: a.B requests in blocks of NT (a.B a multiple of NT).
template <int NT>
inline int launch_wg(const Args& a, const CUtensorMap& map, const CUtensorMap& qmap, int max_shared, cudaStream_t st) {
  const int bytes = wg_smem_bytes_t<NT>();
  if (bytes > max_shared) return -3;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(wg_kernel<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  wg_kernel<NT><<<dim3(a.splits, a.B / NT), 128, bytes, st>>>(a, map, qmap);
  return (int)cudaGetLastError();
}

}  // namespace k3mla
