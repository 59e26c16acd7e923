// mla_decode.cu: absorbed MLA decode, split history, for Hopper (seed section 4): the CUDA backend's
// after (k3lab/ops/mla_decode/cuda.py binds it). Form 'mma' is this file's split kernel; form 'wgmma'
// (mla_decode_wgmma.h, included below) the same decode on warpgroup MMA, taken where a piece of history
// holds >= 4 of its 64-row tiles. Both write pieces that `merge_kernel` here combines.
//
// What it computes (one decode token per request). For each request b and piece p (positions
// [p*chunk, min((p+1)*chunk, length_b))):
//   s[h, n] = scale * q[b, h, :576] . kv[n, :576]      (keys: the whole latent row)
//   o[h, :] = sum_n softmax(s)[h, n] kv[n, :512]         (values: its first 512 columns)
// and writes the normalised fp32 o [B, heads, splits, 512] and the base-2 lse [B, heads, splits];
// with one piece the split kernel writes the bf16 result and the natural-log lse itself.
//
// Layout and why this shape:
//   * The 12 heads padded to 16 are one mma.sync m16n8k16 tile of rows; positions are N in the
//     score product and K in the value product, so no operand is padded beyond 16 rows.
//   * A tile is 32 latent rows (37 KB) brought by bulk copies (cp.async.bulk, no tensor map), one per
//     4-row block, landing with a 1168-byte pitch so an ldmatrix's 8 rows fall in 8 bank groups.
//   * 5 tiles ring in shared memory (199 KB with the exchanges: one block per SM), one mbarrier each,
//     so ~150 KB per SM are in flight, several times the H200's bandwidth x latency.
//   * Four warps: the score product split by the 576 columns (144 each, query slice in registers),
//     the partial [16 x 32] scores meeting through shared memory (double buffered); every warp then
//     holds the full score tile in the accumulator layout, which is the value product's A layout.
//     The value product is split by value columns (128 per warp). One __syncthreads per tile.
// Limits: q_len 1 (verification groups run as one-token requests over the same pages), <= 16 heads,
// bf16, pages of >= 32 rows (a tile never crosses a page), rows 16-byte aligned. Rows past a
// request's length are never read (zero-filled in shared memory), so NaN there cannot leak.
//
// Build: nvcc for sm_90a (cp.async.bulk, mbarrier tx counts, griddepcontrol). Other CUDA targets
// and HIP build a stub whose launchers return K3_MLA_UNSUPPORTED (the HIP build is not yet run on
// AMD hardware by this project). Figures, and the forms measured and removed: docs/mla_padding.md.
#include "k3lab_mma.h"  // smem_u32, mbarriers, bulk copies, ldmatrix, bf16 mma.sync, pack_bf16 (k3mma)

#define K3_MLA_UNSUPPORTED (-5)

namespace k3mla {

constexpr int D = 576;      // latent row: 512 value columns + 64 rope
constexpr int DV = 512;     // value columns
constexpr int BN = 32;      // positions per tile
constexpr int KGROUPS = 4;  // the score product's 576 columns in 4 groups of 144 (9 k-steps)
constexpr int ROWS = 16;    // padded heads = one mma tile of rows
constexpr int ROW_BYTES = D * 2;            // 1152 bytes per latent row
constexpr int BPITCH = 4 * ROW_BYTES + 16;  // a block of 4 rows + 16 bytes: 8 blocks start in 8 bank groups
constexpr int STAGE_BYTES = 8 * BPITCH;     // a tile = 8 blocks of 4 rows: 36,992 bytes
constexpr int XCH_BYTES = KGROUPS * 4 * 32 * 16;  // one score-partial exchange buffer: 8 KB
constexpr int KSTEPS = D / 16 / KGROUPS;    // 9 k-steps of the score product per warp
constexpr int MERGE_COLS = 32;              // value columns per merge block
constexpr int MERGE_THREADS = 128;
constexpr int STAGES = 5;                  // form 'mma': tiles in the ring
constexpr int WARPS = 4;                   // form 'mma': one warp per SM sub-partition

constexpr int smem_bytes() { return STAGES * STAGE_BYTES + 2 * XCH_BYTES + STAGES * 8; }

struct Args {
  const k3_bf16* q;     // [B, 1, H, 576]
  const k3_bf16* kv;    // paged pool [pages, page_size, 576] or contiguous [B, L, 576] (rows of 576)
  const int* block_table;  // [B, max_pages] int32, or null (contiguous)
  const int* lengths;   // [B] int32
  float* part_o;        // [B, H, splits, 512] fp32 (splits > 1)
  float* part_lse;      // [B, H, splits] fp32, base 2
  k3_bf16* out;         // [B, 1, H, 512] (written by the merge, or by the split kernel if splits == 1)
  float* lse;           // [B, 1, H] natural log
  long long q_sb, q_sh;           // q strides (elements): batch, head
  long long kv_sp;                // elements between pages (paged) or requests (contiguous)
  long long bt_sb;                // block table row stride
  long long o_sb, o_sh, l_sb;     // out strides: batch, head; lse batch stride
  int B, heads, page_shift, splits, chunk;  // chunk: positions per piece, a multiple of BN
  int max_pages;                  // block table columns (paged)
  float scale_log2;               // softmax scale x log2(e)
  // Form 'wgmma': request r's query is token r % q_run of group r / q_run in the queries' tensor map
  // ([groups, q_tq, H, 576]); a token index >= q_tq (a verification group padded to an even count of
  // tokens) lies outside the map and reads as zeros (its output is dropped). 1, 1 for plain decodes.
  int q_run, q_tq;
};

}  // namespace k3mla

#if defined(K3_CUDA)

namespace k3mla {

// ---------------------------------------------------------------------------------------------
// Hopper primitives (sm_90): PDL here; mbarriers, bulk copies, ldmatrix and mma.sync: k3lab_mma.h.
using namespace k3mma;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define K3_MLA_SM90 1
#endif

// smem_u32, mbar_init, mbar_expect_tx, mbar_wait and bulk_copy come from k3lab_mma.h (k3mma).

K3_DEVICE void launch_dependents() {
#if defined(K3_MLA_SM90)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

K3_DEVICE void wait_prerequisites() {
#if defined(K3_MLA_SM90)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

K3_DEVICE float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------
// the split kernel

struct Tile {
  long long row0;  // element offset of the tile's first latent row
  int rows;        // rows inside the request's length (1..BN)
};

K3_DEVICE int tile_rows(int pos, int end) { return min(BN, end - pos); }

// Element offset of the latent row at position `pos` of request b (paged: one block-table read; a
// position past the table reads nothing and gives 0, never used).
K3_DEVICE long long row_at(const Args& a, int b, int pos) {
  if (a.block_table != nullptr) {
    const int col = pos >> a.page_shift;
    const int page = col < a.max_pages ? __ldg(a.block_table + (long long)b * a.bt_sb + col) : 0;
    return (long long)page * a.kv_sp + (long long)(pos & ((1 << a.page_shift) - 1)) * D;
  }
  return (long long)b * a.kv_sp + (long long)pos * D;
}

K3_DEVICE Tile tile_at(const Args& a, int b, int pos, int end) {
  Tile t;
  t.rows = tile_rows(pos, end);
  t.row0 = row_at(a, b, pos);
  return t;
}

// Every warp: fetch its BPW blocks of 4 latent rows (BPW w ...) of one tile into `stage`, one bulk
// copy each (lanes 0..BPW-1); rows past the request's length are zero-filled instead. The stage's
// mbarrier was told the tile's byte count beforehand (thread 0, before a barrier this follows).
template <int BPW>  // 4-row blocks per warp: 2 (4 warps) or 1 (8 warps)
K3_DEVICE void issue_tile(const Args& a, const Tile& t, uint32_t stage, uint32_t bar, int warp, int lane) {
  if (t.rows < BN) {
    // the request's last tile: zero what the copies leave out (generic stores, made visible to the
    // other warps by the barrier that precedes this tile's use)
#pragma unroll
    for (int k = 0; k < BPW; ++k) {
      const int blk = BPW * warp + k;
      const int keep = min(4, max(0, t.rows - 4 * blk));
      const uint32_t base = stage + blk * BPITCH;
      for (int c = keep * (ROW_BYTES / 16) + lane; c < 4 * (ROW_BYTES / 16); c += 32)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(base + c * 16), "r"(0) : "memory");
    }
  }
  if (lane < BPW) {
    const int blk = BPW * warp + lane;
    const int keep = min(4, max(0, t.rows - 4 * blk));
    if (keep > 0)
      bulk_copy(stage + blk * BPITCH, a.kv + t.row0 + (long long)blk * 4 * D, (uint32_t)(keep * ROW_BYTES), bar);
  }
}

// Score partial of this warp's 144 columns for one tile: 4 n-tiles of 8 positions, fp32 [16 x 32].
// Two accumulators per n-tile (even and odd k-steps) halve the chain of dependent mma. SNT: score
// n-tiles of this warp (4: all 32 positions; 2: one half, with 8 warps).
template <int SNT>
K3_DEVICE void score_tile(float (&s)[4][4], const uint32_t (&qf)[KSTEPS][4], uint32_t b_lane) {
  float t[2][SNT][4];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int nt = 0; nt < SNT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) t[h][nt][e] = 0.f;
#pragma unroll
  for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
    for (int np = 0; np < SNT / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(b_lane + np * 2 * ROW_BYTES + kk * 32, b0, b1, b2, b3);
      mma_bf16(t[kk & 1][2 * np], qf[kk], b0, b1);
      mma_bf16(t[kk & 1][2 * np + 1], qf[kk], b2, b3);
    }
  }
#pragma unroll
  for (int nt = 0; nt < SNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] = t[0][nt][e] + t[1][nt][e];
}

// Exchange layout [k-group][n-tile][lane] float4: warp (kg, ph) writes n-tiles ph*SNT .. ph*SNT+SNT-1.
template <int SNT>
K3_DEVICE void publish_scores(const float (&s)[4][4], float4* xch, int kg, int ph, int lane) {
#pragma unroll
  for (int nt = 0; nt < SNT; ++nt)
    xch[(kg * 4 + ph * SNT + nt) * 32 + lane] = make_float4(s[nt][0], s[nt][1], s[nt][2], s[nt][3]);
}

// The end of a piece: row sums across the quad, normalise, store (o and base-2 lse as partials, or,
// with one piece, the bf16 output and the natural-log lse). `warp` picks the VNT x 8 value columns.
template <int VNT>
K3_DEVICE void store_piece(const Args& a, const float (&acc)[VNT][4], float m0, float m1, float l0, float l1, int b,
                           int split, int warp, int g, int t4) {
  l0 += k3_shfl_xor(l0, 1);
  l0 += k3_shfl_xor(l0, 2);
  l1 += k3_shfl_xor(l1, 1);
  l1 += k3_shfl_xor(l1, 2);
  const float r0 = l0 > 0.f ? 1.f / l0 : 0.f, r1 = l1 > 0.f ? 1.f / l1 : 0.f;
  const float lse0 = l0 > 0.f ? m0 + __log2f(l0) : -INFINITY;
  const float lse1 = l1 > 0.f ? m1 + __log2f(l1) : -INFINITY;
  const int col0 = warp * VNT * 8 + 2 * t4;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int h = g + 8 * half;
    if (h >= a.heads) continue;
    const float rr = half ? r1 : r0, ls = half ? lse1 : lse0;
    if (a.splits == 1) {
      k3_bf16* o = a.out + (long long)b * a.o_sb + (long long)h * a.o_sh + col0;
#pragma unroll
      for (int nt = 0; nt < VNT; ++nt) {
        const uint32_t v = pack_bf16(acc[nt][2 * half] * rr, acc[nt][2 * half + 1] * rr);
        *reinterpret_cast<uint32_t*>(o + nt * 8) = v;
      }
      if (warp == 0 && t4 == 0) a.lse[(long long)b * a.l_sb + h] = ls * 0.6931471805599453f;
    } else {
      const long long prow = ((long long)b * a.heads + h) * a.splits + split;
      float* o = a.part_o + prow * DV + col0;
#pragma unroll
      for (int nt = 0; nt < VNT; ++nt)
        *reinterpret_cast<float2*>(o + nt * 8) = make_float2(acc[nt][2 * half] * rr, acc[nt][2 * half + 1] * rr);
      if (warp == 0 && t4 == 0) a.part_lse[prow] = ls;
    }
  }
}

// One online-softmax step over NT score n-tiles of 8 positions, already scaled to base 2 and masked:
// rows g (s[.][0..1]) and g + 8 (s[.][2..3]). Moves the running max (m0, m1), updates this thread's
// sums (l0, l1), rescales the accumulator of VNT value n-tiles when the max moved, and writes p as
// the value product's A fragments (k-step nt / 2).
template <int NT, int VNT>
K3_DEVICE void online_softmax(const float (&s)[NT][4], float& m0, float& m1, float& l0, float& l1,
                              uint32_t (&pf)[NT / 2][4], float (&acc)[VNT][4]) {
  float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
    mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
  }
  mx0 = fmaxf(mx0, k3_shfl_xor(mx0, 1));
  mx0 = fmaxf(mx0, k3_shfl_xor(mx0, 2));
  mx1 = fmaxf(mx1, k3_shfl_xor(mx1, 1));
  mx1 = fmaxf(mx1, k3_shfl_xor(mx1, 2));
  const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
  const float al0 = fast_exp2(m0 - u0), al1 = fast_exp2(m1 - u1);
  m0 = n0;
  m1 = n1;
  float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const float p0 = fast_exp2(s[nt][0] - u0), p1 = fast_exp2(s[nt][1] - u0);
    const float p2 = fast_exp2(s[nt][2] - u1), p3 = fast_exp2(s[nt][3] - u1);
    ps0 += p0 + p1;
    ps1 += p2 + p3;
    pf[nt >> 1][(nt & 1) * 2 + 0] = pack_bf16(p0, p1);
    pf[nt >> 1][(nt & 1) * 2 + 1] = pack_bf16(p2, p3);
  }
  l0 = l0 * al0 + ps0;
  l1 = l1 * al1 + ps1;
  if (__any_sync(0xffffffffu, al0 != 1.f || al1 != 1.f)) {  // the max moved: rescale (warp-uniform skip)
#pragma unroll
    for (int i = 0; i < VNT; ++i) {
      acc[i][0] *= al0;
      acc[i][1] *= al0;
      acc[i][2] *= al1;
      acc[i][3] *= al1;
    }
  }
}

// Softmax and value product of one tile whose four score partials are in `xj` and whose rows start
// at position `tile_pos` (the request's rows end at `end`); `vs`: this lane's ldmatrix address in the
// tile's stage for the value product. Updates the running max (m0, m1: rows g, g + 8), this thread's
// share of the sums (l0, l1) and the accumulator of this warp's VNT x 8 value columns.
template <int VNT>
K3_DEVICE void softmax_value(const Args& a, const float4* xj, int tile_pos, int end, uint32_t vs, float (&s)[4][4],
                             float (&acc)[VNT][4], float& m0, float& m1, float& l0, float& l1, int lane, int t4) {
  // full scores: the four partials summed in one fixed order (from shared memory, this warp's own
  // too), so every warp holds bit-identical scores, hence the same max, p and sum
#pragma unroll
  for (int nt = 0; nt < 4; ++nt) {
    const float4 v0 = xj[nt * 32 + lane];
    s[nt][0] = v0.x;
    s[nt][1] = v0.y;
    s[nt][2] = v0.z;
    s[nt][3] = v0.w;
  }
#pragma unroll
  for (int w = 1; w < KGROUPS; ++w) {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const float4 v = xj[(w * 4 + nt) * 32 + lane];
      s[nt][0] += v.x;
      s[nt][1] += v.y;
      s[nt][2] += v.z;
      s[nt][3] += v.w;
    }
  }
  // online softmax in base 2, rows g (s[.][0..1]) and g + 8 (s[.][2..3])
  const int pos0 = tile_pos + 8 * t4;  // element (nt, e): position pos0 + 4 (e & 1) + nt
  const bool partial = tile_pos + BN > end;
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float v = s[nt][e] * a.scale_log2;
      if (partial && pos0 + 4 * (e & 1) + nt >= end) v = -INFINITY;
      s[nt][e] = v;
    }
  uint32_t pf[2][4];  // p as the value product's A fragments (k-steps of 16 positions)
  online_softmax<4, VNT>(s, m0, m1, l0, l1, pf, acc);
  // o += p V over this warp's 128 columns
#pragma unroll
  for (int ks = 0; ks < 2; ++ks) {
#pragma unroll
    for (int np = 0; np < VNT / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(vs + ks * 2 * ROW_BYTES + np * 32, b0, b1, b2, b3);
      mma_bf16(acc[2 * np], pf[ks], b0, b1);
      mma_bf16(acc[2 * np + 1], pf[ks], b2, b3);
    }
  }
}

// This warp's query slice (KS k-steps of 16 columns from k-step k0: columns 16 k0 .. 16 (k0 + KS) - 1) as
// mma A fragments, kept for the whole piece. Rows past the real heads are zero (the padding: computed,
// never stored).
template <int KS>
K3_DEVICE void load_query(const Args& a, int b, int k0, int g, int t4, uint32_t (&qf)[KS][4]) {
  const int h0 = g, h1 = g + 8;
  const uint32_t* q0 = reinterpret_cast<const uint32_t*>(a.q + (long long)b * a.q_sb + (long long)h0 * a.q_sh);
  const uint32_t* q1 = reinterpret_cast<const uint32_t*>(a.q + (long long)b * a.q_sb + (long long)h1 * a.q_sh);
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const int c = (k0 + kk) * 16 + 2 * t4;  // element column of a0/a1
    qf[kk][0] = h0 < a.heads ? __ldg(q0 + c / 2) : 0u;
    qf[kk][1] = h1 < a.heads ? __ldg(q1 + c / 2) : 0u;
    qf[kk][2] = h0 < a.heads ? __ldg(q0 + c / 2 + 4) : 0u;
    qf[kk][3] = h1 < a.heads ? __ldg(q1 + c / 2 + 4) : 0u;
  }
}


// Form 'mma'. Score product: warp w takes column group kg = w (144 columns) and all 32 positions;
// value product: warp w takes 128 value columns.
__global__ void __launch_bounds__(WARPS * 32, 1) split_kernel(const Args a) {
  constexpr int SNT = 4;               // score n-tiles per warp (all 32 positions)
  constexpr int VNT = DV / 8 / WARPS;  // value n-tiles per warp (16)
  constexpr int BPW = 8 / WARPS;       // 4-row blocks copied per warp
  extern __shared__ __align__(128) unsigned char smem[];
#if defined(K3_MLA_SM90)
  const int split = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment row group, thread in quad
  const int kg = warp & (KGROUPS - 1), ph = 0;  // ph: which positions a warp scores (all 32 here)
  launch_dependents();  // the merge may launch now; it waits (griddepcontrol.wait) for this grid
  // The first tiles' rows, read before the request's length is known: the block-table reads and the
  // length read are in flight together (one memory round trip before the first copies, not two).
  long long first_rows[STAGES];
#pragma unroll
  for (int i = 0; i < STAGES; ++i) first_rows[i] = row_at(a, blockIdx.y, blockIdx.x * a.chunk + i * BN);

  const uint32_t stages = smem_u32(smem);
  float4* xch = reinterpret_cast<float4*>(smem + STAGES * STAGE_BYTES);  // [2][KGROUPS][4][32]
  const uint32_t bars = smem_u32(smem + STAGES * STAGE_BYTES + 2 * XCH_BYTES);
  const int length = __ldg(a.lengths + b);
  const int start = split * a.chunk;
  const int end = min(length, start + a.chunk);
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // each stage's first tile: its byte count, announced before any copy is issued (a tile's
    // count depends only on positions, so no memory read is waited for here)
    for (int i = 0; i < STAGES && i < ntiles; ++i)
      mbar_expect_tx(bars + 8 * i, (uint32_t)(tile_rows(start + i * BN, end) * ROW_BYTES));
  }
  __syncthreads();
  // the first STAGES - 1 tiles: their copies start before anything else
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i)
    if (i < ntiles) issue_tile<BPW>(a, Tile{first_rows[i], tile_rows(start + i * BN, end)}, stages + i * STAGE_BYTES,
                               bars + 8 * i, warp, lane);

  uint32_t qf[KSTEPS][4];
  load_query<KSTEPS>(a, b, kg * KSTEPS, g, t4, qf);

  // Position order inside a tile: score n-tile nt (0..3), row i (0..7) is position 4i + nt (row nt of
  // block i), so the 8 rows of every ldmatrix lie in 8 different blocks, hence bank groups. The
  // value product's k index is the same n (the accumulator layout is the A-operand layout), so
  // both products see one consistent order and the sum over positions is unchanged.
  // ldmatrix lane addresses (stage-relative): lanes 8m..8m+7 give the rows (i = lane & 7) of
  // matrix m. Scores (K as B, not transposed): m = (n-tile 2np + m/2, k half m%2); values (V as B,
  // transposed): m = (k half m%2 = n-tile 2ks + m%2, value n-tile 2np + m/2).
  const int mi = lane >> 3, r8 = lane & 7;
  const uint32_t k_lane =
      (uint32_t)(r8 * BPITCH + (ph * SNT + (mi >> 1)) * ROW_BYTES + (kg * 2 * KSTEPS + (mi & 1)) * 16);
  const uint32_t v_lane = (uint32_t)(r8 * BPITCH + (mi & 1) * ROW_BYTES + (warp * VNT + (mi >> 1)) * 16);

  float acc[VNT][4];  // o for rows g, g+8 and this warp's 128 value columns
#pragma unroll
  for (int i = 0; i < VNT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // running max / sum (this thread's share)

  Tile next{};
  if (STAGES - 1 < ntiles) next = Tile{first_rows[STAGES - 1], tile_rows(start + (STAGES - 1) * BN, end)};
  __syncthreads();  // the zero-filled rows of a short first tile are visible to every warp

  float s[4][4];
  if (ntiles > 0) {
    mbar_wait(bars, 0);
    score_tile<SNT>(s, qf, stages + k_lane);
    publish_scores<SNT>(s, xch, kg, ph, lane);
  }

  // Softmax and value product of tile j (its scores published, its stage landed).

  // Every tile but the last: one barrier, refill the freed stage, then tile j's softmax and value
  // product and tile j + 1's scores in one straight run (no branch between them, so the compiler
  // can interleave the two products' mma and ldmatrix).
  for (int j = 0; j + 1 < ntiles; ++j) {
    __syncthreads();  // scores of tile j published; every warp is done with tile j - 1's stage
    const int nxt = j + STAGES - 1;
    if (nxt < ntiles) {  // the stage of tile j - 1 is free: refill it (its byte count was announced)
      const int st = nxt % STAGES;
      issue_tile<BPW>(a, next, stages + st * STAGE_BYTES, bars + 8 * st, warp, lane);
      if (nxt + 1 < ntiles) next = tile_at(a, b, start + (nxt + 1) * BN, end);  // used next iteration
    }
    mbar_wait(bars + 8 * ((j + 1) % STAGES), ((j + 1) / STAGES) & 1);
    softmax_value<VNT>(a, xch + (j & 1) * (KGROUPS * 4 * 32), start + j * BN, end,
                       stages + (j % STAGES) * STAGE_BYTES + v_lane, s, acc, m0, m1, l0, l1, lane, t4);
    score_tile<SNT>(s, qf, stages + ((j + 1) % STAGES) * STAGE_BYTES + k_lane);
    publish_scores<SNT>(s, xch + ((j + 1) & 1) * (KGROUPS * 4 * 32), kg, ph, lane);
    // announce tile nxt + 1's bytes on its stage's mbarrier (tile j's phase there completed, and
    // every thread waited for it before this iteration's barrier; its copies are issued only after
    // the next barrier, so the count always comes first)
    if (tid == 0 && nxt + 1 < ntiles)
      mbar_expect_tx(bars + 8 * ((nxt + 1) % STAGES), (uint32_t)(tile_rows(start + (nxt + 1) * BN, end) * ROW_BYTES));
  }
  if (ntiles > 0) {  // the last tile: nothing left to fetch or score
    __syncthreads();
    const int j = ntiles - 1;
    softmax_value<VNT>(a, xch + (j & 1) * (KGROUPS * 4 * 32), start + j * BN, end,
                       stages + (j % STAGES) * STAGE_BYTES + v_lane, s, acc, m0, m1, l0, l1, lane, t4);
  }

  store_piece<VNT>(a, acc, m0, m1, l0, l1, b, split, warp, g, t4);
#endif  // K3_MLA_SM90
}

// ---------------------------------------------------------------------------------------------
// the merge: one block per (request, head) and MERGE_COLS value columns; lse-weighted sum of pieces.
// 128 threads = 16 split groups x 8 float4 column groups. The latency chain is kept short: each thread
// issues its pieces' column loads before anything else (they do not depend on the weights), the
// block's maximum log-sum-exp comes from one load per thread and a shuffle tree, each piece's weight is
// computed once (by the thread that loaded its lse) into shared memory, and the 16 split groups' sums
// meet by shuffles inside each warp and in shared memory across the 4 warps.
// Why: the merge is latency-bound (a few MB over many small blocks), so the shortest chain of
// dependent memory round trips wins; the alternatives measured are in docs/mla_padding.md.
// AHEAD: pieces per thread whose loads are issued up front (1 where splits <= 16, 8 up to 128; beyond,
// batches of 8 after the maximum). Two builds because the 8-deep one's registers cost occupancy where
// the merge grid is large (B = 64 x 8K: 12,288 blocks of 2 pieces each).
template <int AHEAD>
__global__ void __launch_bounds__(MERGE_THREADS) merge_kernel(const Args a) {
#if defined(K3_MLA_SM90)
  wait_prerequisites();  // launched early (programmatic dependent launch): the partials are complete now
#endif
  constexpr int WARPS = MERGE_THREADS / 32, GROUPS = MERGE_THREADS / 8;
  __shared__ float red_m[WARPS];
  __shared__ float wts[AHEAD * GROUPS];
  __shared__ float4 red_o[WARPS][8];
  __shared__ float red_d[WARPS];
  const int row = blockIdx.x;  // b * heads + h
  const int b = row / a.heads, h = row % a.heads;
  const int tid = threadIdx.x, sg = tid >> 3, cq = tid & 7, warp = tid >> 5, lane = tid & 31;
  const float* lse = a.part_lse + (long long)row * a.splits;
  const int col = blockIdx.y * MERGE_COLS + cq * 4;
  const float* part = a.part_o + (long long)row * a.splits * DV + col;
  const bool ahead = a.splits <= AHEAD * GROUPS;  // up to AHEAD pieces per thread: all loads up front
  float4 v[AHEAD];
#pragma unroll
  for (int i = 0; i < AHEAD; ++i) {
    const int s = sg + i * GROUPS;
    v[i] = ahead && s < a.splits ? *reinterpret_cast<const float4*>(part + (long long)s * DV) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  float m = -INFINITY;
  for (int s = tid; s < a.splits; s += MERGE_THREADS) m = fmaxf(m, lse[s]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, k3_shfl_xor(m, off));
  if (lane == 0) red_m[warp] = m;
  __syncthreads();
  m = red_m[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) m = fmaxf(m, red_m[w]);
  const float mu = m == -INFINITY ? 0.f : m;
  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
  float den = 0.f;
  if (ahead) {
    if (tid < a.splits) wts[tid] = exp2f(lse[tid] - mu);  // the lse load above is still in L1 (splits <= 128)
    __syncthreads();
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {
      const int s = sg + i * GROUPS;
      if (s < a.splits) {
        const float w = wts[s];
        den += w;
        o.x += w * v[i].x;
        o.y += w * v[i].y;
        o.z += w * v[i].z;
        o.w += w * v[i].w;
      }
    }
  } else {  // more pieces than 8 per thread: loads in batches of 8 after the maximum
#pragma unroll 8
    for (int s = sg; s < a.splits; s += GROUPS) {
      const float w = exp2f(lse[s] - mu);
      const float4 x = *reinterpret_cast<const float4*>(part + (long long)s * DV);
      den += w;
      o.x += w * x.x;
      o.y += w * x.y;
      o.z += w * x.z;
      o.w += w * x.w;
    }
  }
#pragma unroll
  for (int off = 8; off < 32; off <<= 1) {  // the warp's 4 split groups (lanes 8 apart hold the same columns)
    o.x += k3_shfl_xor(o.x, off);
    o.y += k3_shfl_xor(o.y, off);
    o.z += k3_shfl_xor(o.z, off);
    o.w += k3_shfl_xor(o.w, off);
    den += k3_shfl_xor(den, off);
  }
  if (lane < 8) red_o[warp][lane] = o;
  if (lane == 0) red_d[warp] = den;
  __syncthreads();
  if (tid < 8) {
    float d = red_d[0];
    for (int w = 1; w < WARPS; ++w) {
      const float4 x = red_o[w][tid];
      o.x += x.x;
      o.y += x.y;
      o.z += x.z;
      o.w += x.w;
      d += red_d[w];
    }
    const float r = d > 0.f ? 1.f / d : 0.f;
    k3_bf16* out = a.out + (long long)b * a.o_sb + (long long)h * a.o_sh + blockIdx.y * MERGE_COLS + tid * 4;
    const uint32_t lo = (uint32_t)k3_f32_to_bf16(o.x * r) | ((uint32_t)k3_f32_to_bf16(o.y * r) << 16);
    const uint32_t hi = (uint32_t)k3_f32_to_bf16(o.z * r) | ((uint32_t)k3_f32_to_bf16(o.w * r) << 16);
    *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
    if (blockIdx.y == 0 && tid == 0)
      a.lse[(long long)b * a.l_sb + h] = d > 0.f ? (mu + __log2f(d)) * 0.6931471805599453f : -INFINITY;
  }
}

// The merge kernel for splits > 1 (grid B*heads x 512/32), launched early by programmatic dependent launch
// when pdl != 0. 0 or the CUDA runtime's error code.
inline int launch_merge(const Args& a, int pdl, cudaStream_t st) {
  const dim3 grid(a.B * a.heads, DV / MERGE_COLS);
  void (*kernel)(Args) = a.splits <= MERGE_THREADS / 8 ? merge_kernel<1> : merge_kernel<8>;
  if (pdl) return (int)k3_launch_pdl(kernel, grid, dim3(MERGE_THREADS), 0, st, a);
  kernel<<<grid, MERGE_THREADS, 0, st>>>(a);
  return (int)cudaGetLastError();
}

inline int launch_split(const Args& a, int max_shared, cudaStream_t st) {
  const int bytes = smem_bytes();
  if (bytes > max_shared) return -3;
  static bool configured = false;  // the opt-in above 48 KB, once per process
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  split_kernel<<<dim3(a.splits, a.B), WARPS * 32, bytes, st>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace k3mla

#include <cudaTypedefs.h>  // CUtensorMap and the driver's tensor-map encoder (form 'wgmma', host side)
#include "mla_decode_wgmma.h"     // the split kernel on warpgroup MMA (form 'wgmma')

// Whether this build has the kernel: 1 for a CUDA build that includes sm_90 code (checked at launch
// against the device: cudaFuncGetAttributes fails for an architecture that was not compiled).
K3_EXPORT int k3_mla_decode_supported() { return 1; }

K3_EXPORT int k3_mla_decode_args_size() { return (int)sizeof(k3mla::Args); }

K3_EXPORT int k3_mla_decode_smem() { return k3mla::smem_bytes(); }

// Form 'wgmma''s dynamic shared memory with `tokens` (1 or 2) tokens per block; -4 otherwise.
K3_EXPORT int k3_mla_wg_smem(int tokens) {
  return tokens == 1 ? k3mla::wg_smem_bytes_t<1>() : tokens == 2 ? k3mla::wg_smem_bytes_t<2>() : -4;
}

// Registers per thread of form 0 ('mma') or 1 ('wgmma', one token per block) as compiled for the
// current device (<0: error).
K3_EXPORT int k3_mla_decode_regs(int form) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaErrorInvalidValue;
  if (form == 0) e = cudaFuncGetAttributes(&attr, k3mla::split_kernel);
  if (form == 1) e = cudaFuncGetAttributes(&attr, k3mla::wg_kernel<1>);
  return e == cudaSuccess ? attr.numRegs : -(int)e;
}

// One decode step of form 'mma': the split kernel (grid splits x B), then, for splits > 1, the merge
// (grid B*heads x 512/32), launched with programmatic dependent launch when pdl != 0.
// Returns 0, -3 (more shared memory than max_shared), -4 (bad sizes), or the CUDA runtime's error code.
K3_EXPORT int k3_mla_decode(const k3mla::Args* args, int pdl, int max_shared, void* stream) {
  const k3mla::Args& a = *args;
  if (a.B < 1 || a.B > 65535 || a.heads < 1 || a.heads > k3mla::ROWS || a.splits < 1 || a.splits > 65535 ||
      a.chunk < k3mla::BN || a.chunk % k3mla::BN != 0 || a.page_shift < 5 || a.page_shift > 30 ||
      (a.block_table != nullptr && a.max_pages < 1))
    return -4;
  cudaStream_t st = (cudaStream_t)stream;
  const int rc = k3mla::launch_split(a, max_shared, st);
  if (rc != 0 || a.splits == 1) return rc;
  return k3mla::launch_merge(a, pdl, st);
}

// Form 'wgmma' (kernels/mla_decode_wgmma.h): its tensor maps of a cache's rows and of the queries (each
// written into the caller's 128-byte buffer, once per plan), and one decode step with it (the merge
// as in k3_mla_decode). Same return codes, and -6: the driver's tensor-map encoder is unavailable,
// <= -1000: the encoder refused the map.
K3_EXPORT int k3_mla_wg_map(void* map, const void* base, long long rows) {
  if (map == nullptr || base == nullptr || rows < 1) return -4;
  return k3mla::wg_make_map(reinterpret_cast<CUtensorMap*>(map), base, rows);
}

K3_EXPORT int k3_mla_wg_qmap(void* map, const void* q, int heads, int tq, int groups, long long q_sh, long long q_st,
                             long long q_sg) {
  if (map == nullptr || q == nullptr || heads < 1 || heads > k3mla::ROWS || tq < 1 || groups < 1 || q_sh % 8 ||
      q_st % 8 || q_sg % 8)
    return -4;
  return k3mla::wg_make_qmap(reinterpret_cast<CUtensorMap*>(map), q, heads, tq, groups, q_sh, q_st, q_sg);
}

// tokens = 2: blocks of two consecutive requests that are two tokens of one verification group
// (kernels/mla_decode_wgmma.h, NT = 2; a.B even). 0 or an error code.
K3_EXPORT int k3_mla_decode_wg(const k3mla::Args* args, const void* map, const void* qmap, int pdl, int max_shared,
                               int tokens, void* stream) {
  const k3mla::Args& a = *args;
  if ((tokens != 1 && tokens != 2) || a.B % tokens != 0 || a.q_run < 1 || a.q_tq < 1 || a.q_tq > a.q_run) return -4;
  if (map == nullptr || qmap == nullptr || a.B < 1 || a.B > 65535 || a.heads < 1 || a.heads > k3mla::ROWS ||
      a.splits < 1 || a.splits > 65535 || a.chunk < k3mla::WG_BN || a.chunk % k3mla::WG_BN != 0 ||
      (a.block_table != nullptr && (a.max_pages < 1 || a.page_shift < 6 || a.page_shift > 30)) ||
      a.kv_sp % k3mla::D != 0)
    return -4;
  CUtensorMap m, qm;
  memcpy(&m, map, sizeof(m));
  memcpy(&qm, qmap, sizeof(qm));
  cudaStream_t st = (cudaStream_t)stream;
  const int rc = tokens == 2 ? k3mla::launch_wg<2>(a, m, qm, max_shared, st) : k3mla::launch_wg<1>(a, m, qm, max_shared, st);
  if (rc != 0 || a.splits == 1) return rc;
  return k3mla::launch_merge(a, pdl, st);
}

#else  // HIP (or anything but CUDA): no mma.sync / bulk-copy path; the launchers say so

K3_EXPORT int k3_mla_decode_supported() { return 0; }
K3_EXPORT int k3_mla_decode_args_size() { return (int)sizeof(k3mla::Args); }
K3_EXPORT int k3_mla_decode_smem() { return k3mla::smem_bytes(); }
K3_EXPORT int k3_mla_wg_smem(int) { return -1; }
K3_EXPORT int k3_mla_decode_regs(int) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_decode(const k3mla::Args*, int, int, void*) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_wg_map(void*, const void*, long long) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_wg_qmap(void*, const void*, int, int, int, long long, long long, long long) {
  return K3_MLA_UNSUPPORTED;
}
K3_EXPORT int k3_mla_decode_wg(const k3mla::Args*, const void*, const void*, int, int, int, void*) {
  return K3_MLA_UNSUPPORTED;
}

#endif
