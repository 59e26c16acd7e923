// mla_decode.cu: absorbed MLA decode, split history, hand-written for Hopper (seed section 4).
//
// The default `after` for one-token bf16 decodes on NVIDIA sm_90 (k3lab/ops/mla_decode_cuda.py binds
// it; mla_decode.plan_after picks it where `cuda_after_status` allows, the Triton kernels elsewhere).
// Since commit e3fdbef the binding's form='auto' runs this file's mma.sync split kernel only where a
// piece of history is under four 64-row tiles (1K, 8K at B = 1); longer pieces take the warpgroup-MMA
// split kernel of mla_wgmma.h (included below), which is 4-10% faster there. The figures just below
// are the mma.sync kernel's.
// Checked on an H200 (tests/test_mla_decode_cuda.py on the GPU: paged and contiguous, mixed lengths,
// NaN past the lengths, one piece, 128K with 50 graph replays). Graph replay, B = 1, 12 heads, paged
// bf16 (profiles/nvidia-h200/mla_padding, commit 1a77c32): 7.3 us at 1K, 20.0 us at 32K (44% of
// the copy bandwidth; Triton 21.9), 47.6 us at 128K (75%; Triton 52.3), 216 us at B = 64 x 8K (66%; 165 us, 86%, at
// 083abc8 once mla_decode_cuda.choose_splits stopped spilling pieces into a second wave).
// The timeline probe (Args.probe) found the 32K time: the first tile lands ~2.5 us after the start,
// 8 tiles take ~10.5 us (compute-bound, ~1.3 us a tile against ~1.1 us of DRAM share), and the
// merge ends ~3.5 us after the last piece. The team kernel below makes the tile loop memory-bound
// (it waits for data, not instructions) but is not faster end to end: the DRAM stream is the bound.
// The fused form (split_kernel<5, 4, false, true>, opt-in: merge='fused' / 'auto' or
// K3LAB_MLA_MERGE in the binding) merges inside the split kernel after a grid-wide barrier, one
// cooperative launch instead of two. Right on the H200 (tests, 50 graph replays at 128K, PDL
// neighbours in one graph) but NOT faster, so the two-kernel form stays the default. Same run,
// commit a13fe58, graph replay, fused / two-kernel / Triton: 1K 7.72 / 6.71 / 7.83 us, 32K 19.97 /
// 19.80 / 21.83, 128K 47.95 / 47.76 / 52.17, B = 8 x 8K 28.80 / 28.61 / 33.02. The cooperative
// attribute is not the cost (the same kernel launched without it: 7.81, 20.15, 47.92, 28.81), and
// an earlier barrier (atomicAdd between two fence.sc, 8 merge loads in flight; 3c744c5) was no
// better (7.86, 19.98, 48.30, 29.03 against 6.87, 19.98, 47.53, 28.58). Likely why: the fused merge
// runs only on the split grid's SMs (at 1K, 32 blocks merge what the merge kernel spreads over 192
// blocks on the idle SMs), and the barrier's release fence, arrival and polling cost about what the
// merge kernel's early (PDL) launch already hid.
//
// What it computes (q_len = 1 only: one decode token; verify groups use the Triton path). For each
// request b and history piece p (positions [p*chunk, min((p+1)*chunk, length_b))):
//   s[h, n] = scale * q[b, h, :576] . kv[n, :576]      (keys: the whole latent row)
//   o[h, :] = sum_n softmax(s)[h, n] kv[n, :512]         (values: its first 512 columns)
// and writes, per piece, the normalised fp32 o [16 rows -> the real heads, 512] and the base-2
// log-sum-exp, in the layout of mla_decode.py's `_store_piece` ([B, heads, splits, 512] and
// [B, heads, splits]), so the Triton `_merge_kernel` could merge them too; `k3_mla_merge` here does
// it in CUDA. With one piece the split kernel writes the result (bf16) and the natural-log lse itself.
//
// Why it is built this way (the Triton kernel reached 41% of copy bandwidth at 32K, ncu:
// issue-bound, ~1,000 instructions and 9 block-wide barriers per warp per 32-row tile):
//   * The 12 heads padded to 16 are exactly one mma.sync m16n8k16 tile of rows (M); positions are N
//     in the score product and K in the value product, so no operand is padded beyond 16 rows.
//   * A tile is 32 latent rows (37 KB). Each row of a tile is contiguous in memory (paged: a 32-row
//     tile never crosses a page), so one lane of warp 0 moves one row with a bulk copy
//     (cp.async.bulk, the Hopper copy engine, no tensor map needed): 32 instructions per tile for the
//     whole block, instead of 18 cp.async per thread. Rows land with a 1168-byte pitch (1152 + 16),
//     so the 8 rows an ldmatrix reads fall in 8 different bank groups (no conflicts, no swizzle).
//   * STAGES tiles ring in shared memory (5 x 37 KB + 16 KB exchange = 199 KB, one block per SM)
//     with one mbarrier each; after a tile's products STAGES - 1 tiles are in flight: ~150 KB per
//     SM, several times the ~30 KB that the H200's bandwidth x latency asks for.
//   * Score product split over 4 warps by the 576 columns (warp w: columns 144w..144w+143, 9 k-steps
//     x 4 n-tiles = 36 mma), with its query slice in registers for the whole piece (36 registers).
//     The four partial [16 x 32] score tiles meet through shared memory (double buffered), and
//     every warp then holds the full score tile in the mma accumulator layout, which is already the
//     A-operand layout of the value product (p never goes through shared memory).
//   * Value product split by value columns (warp w: 128 columns, 16 n-tiles, 2 k-steps = 32 mma;
//     V fragments by ldmatrix.trans from the same tile).
//   * One __syncthreads per tile: it publishes the score partials of tile j and frees the stage of
//     tile j - 1 for the next copy; the copies' arrival is waited on per stage (mbarrier).
//   Per warp per tile: 68 mma, 34 ldmatrix, ~20 shared loads/stores for the exchange, 16 exp2, a
//   few dozen fp32 ops for the online softmax and (only when a row's max moved) 64 multiplies to
//   rescale the accumulator: ~370 SASS instructions in the loop's straight run for sm_90a.
//   An 8-warp form (template NW = 8: two warps per SM sub-partition, so one issues while the other
//   waits) splits the score product also by position halves (18 mma) and the value columns in 8
//   (16 mma); its softmax work per warp is the same.
// Rows past a request's length are never read: the bulk copies stop at the length and the rest of
// the last tile is zero-filled (scores there are masked to -inf), so NaN in unused cache rows
// cannot reach the output.
//
// Build: nvcc for sm_90a (cp.async.bulk, mbarrier tx counts and griddepcontrol need sm_90). Other
// CUDA architectures and HIP build a stub whose launchers return K3_MLA_UNSUPPORTED, so
// kernels/*.cu keeps compiling for every target (scripts/compile_hip.sh); the HIP build is not yet
// run on AMD hardware by this project (and has no fast path: AMD MFMA would need its own kernel).
#include "k3lab_mma.h"  // smem_u32, mbarriers, bulk copies, ldmatrix, bf16 mma.sync, pack_bf16 (k3mma)

#define K3_MLA_UNSUPPORTED (-5)
#define K3_MLA_TEAM 9  // the launchers' `warps` value that selects the team kernel (2 teams of 4 warps)
#define K3_MLA_HALVES 10  // ... and the halves kernel (mla_halves.h)

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

constexpr int smem_bytes(int stages) { return stages * STAGE_BYTES + 2 * XCH_BYTES + stages * 8; }

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
  // Timeline probe (diagnostics only; null in normal use): the split kernel instantiated with PROBE, and
  // form 'wgmma' whenever this is set, write per block 8 u64 at probe[(b * splits + split) * 8]:
  // global-timer ns at start, after the first tile landed, after the tile loop, at the end; the SM id;
  // the tile count; the SM clock cycles thread 0 spent waiting for tiles (mbarrier) and at the per-tile
  // barrier (form 'wgmma': waiting for the tiles after the first, and from its start until its first
  // tiles were requested). The merge writes 2 u64 per block after those: start (after its grid
  // dependency resolved) and end.
  unsigned long long* probe;
  // The fused form (split_kernel<..., FUSED = true>, launched cooperatively): 2 u64 of the plan's
  // own, zero at plan time: [0] the grid barrier's arrival counter (never reset: it grows by the
  // grid's block count per launch), [1] how many blocks gave up waiting at the barrier (bounded spin;
  // 0 unless something is badly wrong; the host reads it). Null for the two-kernel form.
  unsigned long long* barrier;
  // Form 'wgmma': request r's query is token r % q_run of group r / q_run in the queries' tensor map
  // ([groups, q_tq, H, 576]); a token index >= q_tq (a verification group padded to an even count of
  // tokens) lies outside the map and reads as zeros (its output is dropped). 1, 1 for plain decodes.
  int q_run, q_tq;
};

}  // namespace k3mla

#if defined(K3_CUDA)

namespace k3mla {

// ---------------------------------------------------------------------------------------------
// Hopper primitives (sm_90): PDL and timers here; mbarriers, bulk copies, ldmatrix and mma.sync: k3lab_mma.h.
using namespace k3mma;
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
#define K3_MLA_SM90 1
#endif

// smem_u32, mbar_init, mbar_expect_tx, mbar_wait and bulk_copy come from k3lab_mma.h (k3mma).

K3_DEVICE unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

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

// The timeline probe's 8 words for block (b, split) (Args.probe), by thread 0.
K3_DEVICE void write_probe(const Args& a, int b, int split, unsigned long long t_start, unsigned long long t_first,
                           unsigned long long t_loop, int ntiles, long long wait_cycles, long long sync_cycles) {
  unsigned int sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* p = a.probe + ((long long)b * a.splits + split) * 8;
  p[0] = t_start;
  p[1] = t_first;
  p[2] = t_loop;
  p[3] = now_ns();
  p[4] = sm;
  p[5] = (unsigned long long)ntiles;
  p[6] = (unsigned long long)wait_cycles;
  p[7] = (unsigned long long)sync_cycles;
}

// ---------------------------------------------------------------------------------------------
// the fused form: the split kernel merges the pieces itself, after a grid-wide barrier.
//
// Why: at 32K on the H200 the separate merge kernel ended ~3.5 us after the last piece was written
// (timeline probe): its launch, its wait for the whole split grid, then two dependent L2 round trips.
// Here every block, once its piece is stored, arrives at one barrier for the whole grid and then
// merges a slice of the (request, head, column group) units from the partials, which are in L2.
//
// Co-residency is guaranteed, never assumed: the kernel is launched with the cooperative attribute
// (cudaLaunchAttributeCooperative), which the runtime refuses (cudaErrorCooperativeLaunchTooLarge)
// unless every block of the grid can be resident at once, and the host picks this form only when
// B * splits <= blocks per SM (occupancy API) x SMs (`k3_mla_fused_max_blocks`); otherwise the
// two-kernel form runs.
//
// The barrier: a 64-bit counter per plan that only grows, by one per block per launch (every launch
// of a plan has the same grid of nblocks). Thread 0 reads it when its block starts (the read's
// latency hides behind the tile loop): launch n's blocks see a value in [n * nblocks, n * nblocks +
// nblocks - 1] (launch n - 1 is complete, and this block has not arrived, so fewer than nblocks of
// launch n have), so value / nblocks = n, and the block waits at the end until the counter reaches
// (n + 1) * nblocks: reusable across launches and graph replays without a reset, and the arrival is
// a fire-and-forget reduction (no round trip for an old value).
// Memory order (the pattern of CUTLASS's generic barrier): __syncthreads (the block's stores of its
// piece precede thread 0's next step), fence.acq_rel.gpu + red.relaxed.gpu (release: cumulative over
// the writes thread 0 observed through the barrier), ld.acquire.gpu in the spin, __syncthreads (every
// thread's later reads come after thread 0's acquire), and those reads use ld.global.cg (L2), never
// a stale L1 line.
// Why launches never mix on one counter, with programmatic dependent launch (PDL) around it: this
// kernel is launched WITHOUT the programmatic-serialization attribute, so it starts only after the
// previous kernel in the stream has completed, including a previous launch of itself: every arrival
// of launch n precedes every block start of launch n + 1, hence value / nblocks numbers the launch. It
// does call griddepcontrol.launch_dependents at its start, so a following kernel launched with PDL
// may start early; it can do so only once every block of this grid has issued the instruction (all
// are resident then), it only takes resources left over (it cannot evict a block here, so the
// barrier cannot wait on it), and its griddepcontrol.wait returns only when this whole grid,
// merge included, has completed and its writes are visible. A following launch of this fused
// kernel is not a PDL launch, so it waits for completion like any other.
// The spin is bounded (2^26 polls, seconds): a block that gives up counts itself in barrier[1] and
// goes on (wrong results, flagged, instead of a hung GPU); the host checks the count.
constexpr long long BARRIER_SPIN_LIMIT = 1ll << 26;
constexpr int MERGE_BATCH = 16;  // pieces whose loads a merge thread keeps in flight together

K3_DEVICE unsigned long long barrier_read(const unsigned long long* ctr) {  // thread 0, at block start
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
  return v;
}

// Every block arrives once; returns when all `nblocks` of this launch have (`seen`: thread 0's
// barrier_read at block start; other threads pass anything).
K3_DEVICE void grid_barrier(unsigned long long* ctr, unsigned long long seen, unsigned nblocks, int tid) {
  __syncthreads();
  if (tid == 0) {
    const unsigned long long target = (seen / nblocks + 1) * nblocks;
    asm volatile("fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
    long long polls = 0;
    for (;;) {
      unsigned long long v;
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
      if (v >= target) break;
      if (++polls > BARRIER_SPIN_LIMIT) {
        atomicAdd(ctr + 1, 1ull);
        break;
      }
    }
  }
  __syncthreads();
}

// This block's share of the merge: units (row = b * heads + h, group of value columns), unit u to
// block u % nblocks. The column group is the narrowest (32 .. 512 columns) whose unit count still
// fits the grid in one round, so each thread reads about `heads` pieces whatever the shape. THREADS =
// column float4s (CQ) x split groups (SG); thread (sg, cq) runs an online log-sum-exp over pieces sg,
// sg + SG, ... in batches of MERGE_BATCH independent loads (lse and partial together: one L2 round
// trip per batch, no separate pass for the maximum; 16 covers the H200's shapes in one batch), then
// the SG partial states meet in shared memory.
template <int THREADS>
K3_DEVICE void merge_share(const Args& a, unsigned char* smem, int block, int nblocks, int tid) {
  float4* red_o = reinterpret_cast<float4*>(smem);  // the ring is free: every tile has been read
  float2* red_md = reinterpret_cast<float2*>(smem + THREADS * sizeof(float4));
  const int rows = a.B * a.heads;
  int cq_log = 3;  // log2(CQ): 8 float4 = 32 columns .. 128 float4 = all 512
  while (cq_log < 7 && rows * ((DV / 4) >> cq_log) > nblocks) ++cq_log;
  const int groups = (DV / 4) >> cq_log;  // units per row
  const int units = rows * groups;
  const int cq = tid & ((1 << cq_log) - 1), sg = tid >> cq_log, nsg = THREADS >> cq_log;
  for (int u = block; u < units; u += nblocks) {
    const int row = u / groups, grp = u % groups;
    const int col = ((grp << cq_log) + cq) * 4;
    const float* lse = a.part_lse + (long long)row * a.splits;
    const float* part = a.part_o + (long long)row * a.splits * DV + col;
    float m = -INFINITY, den = 0.f;
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = sg; s0 < a.splits; s0 += MERGE_BATCH * nsg) {
      float l[MERGE_BATCH];
      float4 v[MERGE_BATCH];
#pragma unroll
      for (int k = 0; k < MERGE_BATCH; ++k) {
        const int s = s0 + k * nsg;
        l[k] = s < a.splits ? __ldcg(lse + s) : -INFINITY;
        v[k] = s < a.splits ? __ldcg(reinterpret_cast<const float4*>(part + (long long)s * DV))
                            : make_float4(0.f, 0.f, 0.f, 0.f);
      }
      float nm = m;
#pragma unroll
      for (int k = 0; k < MERGE_BATCH; ++k) nm = fmaxf(nm, l[k]);
      if (nm == -INFINITY) continue;  // only empty pieces so far
      const float sc = exp2f(m - nm);  // 0 while m is -inf
      o.x *= sc;
      o.y *= sc;
      o.z *= sc;
      o.w *= sc;
      den *= sc;
#pragma unroll
      for (int k = 0; k < MERGE_BATCH; ++k) {
        const float w = exp2f(l[k] - nm);  // an empty piece: lse -inf, weight 0
        o.x += w * v[k].x;
        o.y += w * v[k].y;
        o.z += w * v[k].z;
        o.w += w * v[k].w;
        den += w;
      }
      m = nm;
    }
    red_o[tid] = o;
    red_md[tid] = make_float2(m, den);
    __syncthreads();
    if (tid < (1 << cq_log)) {
      float mx = -INFINITY;
      for (int i = 0; i < nsg; ++i) mx = fmaxf(mx, red_md[(i << cq_log) + tid].x);
      float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
      float d = 0.f;
      if (mx != -INFINITY) {
        for (int i = 0; i < nsg; ++i) {
          const float2 md = red_md[(i << cq_log) + tid];
          const float4 x = red_o[(i << cq_log) + tid];
          const float w = exp2f(md.x - mx);
          t.x += w * x.x;
          t.y += w * x.y;
          t.z += w * x.z;
          t.w += w * x.w;
          d += w * md.y;
        }
      }
      const float r = d > 0.f ? 1.f / d : 0.f;
      const int b = row / a.heads, h = row % a.heads;
      k3_bf16* out = a.out + (long long)b * a.o_sb + (long long)h * a.o_sh + col;
      const uint32_t lo = (uint32_t)k3_f32_to_bf16(t.x * r) | ((uint32_t)k3_f32_to_bf16(t.y * r) << 16);
      const uint32_t hi = (uint32_t)k3_f32_to_bf16(t.z * r) | ((uint32_t)k3_f32_to_bf16(t.w * r) << 16);
      *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
      if (grp == 0 && tid == 0)
        a.lse[(long long)b * a.l_sb + h] = d > 0.f ? (mx + __log2f(d)) * 0.6931471805599453f : -INFINITY;
    }
    __syncthreads();  // the shared buffers are reused by the next unit
  }
}

// NW warps: 4 (one per SM sub-partition) or 8 (two, so one can issue while the other waits).
// Score product: warp w takes column group kg = w % 4 and, with 8 warps, half ph = w / 4 of the 32
// positions; value product: warp w takes 512 / NW value columns.
template <int STAGES, int NW, bool PROBE = false, bool FUSED = false>
__global__ void __launch_bounds__(NW * 32, 1) split_kernel(const Args a) {
  constexpr int SNT = NW == 8 ? 2 : 4;  // score n-tiles per warp
  constexpr int VNT = DV / 8 / NW;      // value n-tiles per warp (16 or 8)
  constexpr int BPW = 8 / NW;           // 4-row blocks copied per warp
  extern __shared__ __align__(128) unsigned char smem[];
#if defined(K3_MLA_SM90)
  const int split = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;  // mma fragment row group, thread in quad
  const int kg = warp & (KGROUPS - 1), ph = warp / KGROUPS;
  const unsigned long long t_start = PROBE ? now_ns() : 0ull;
  long long wait_cycles = 0, sync_cycles = 0;  // PROBE: thread 0's time in tile waits and barriers
  launch_dependents();  // the merge may launch now; it waits (griddepcontrol.wait) for this grid
  unsigned long long barrier_seen = 0;  // FUSED: the grid barrier's counter at block start (thread 0)
  if (FUSED && tid == 0) barrier_seen = barrier_read(a.barrier);
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

  float acc[VNT][4];  // o for rows g, g+8 and this warp's 512 / NW value columns
#pragma unroll
  for (int i = 0; i < VNT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // running max / sum (this thread's share)

  Tile next{};
  if (STAGES - 1 < ntiles) next = Tile{first_rows[STAGES - 1], tile_rows(start + (STAGES - 1) * BN, end)};
  __syncthreads();  // the zero-filled rows of a short first tile are visible to every warp

  float s[4][4];
  unsigned long long t_first = 0;
  if (ntiles > 0) {
    mbar_wait(bars, 0);
    if (PROBE) t_first = now_ns();
    score_tile<SNT>(s, qf, stages + k_lane);
    publish_scores<SNT>(s, xch, kg, ph, lane);
  }

  // Softmax and value product of tile j (its scores published, its stage landed).

  // Every tile but the last: one barrier, refill the freed stage, then tile j's softmax and value
  // product and tile j + 1's scores in one straight run (no branch between them, so the compiler
  // can interleave the two products' mma and ldmatrix).
  for (int j = 0; j + 1 < ntiles; ++j) {
    long long c0 = PROBE ? clock64() : 0;
    __syncthreads();  // scores of tile j published; every warp is done with tile j - 1's stage
    if (PROBE) sync_cycles += clock64() - c0;
    const int nxt = j + STAGES - 1;
    if (nxt < ntiles) {  // the stage of tile j - 1 is free: refill it (its byte count was announced)
      const int st = nxt % STAGES;
      issue_tile<BPW>(a, next, stages + st * STAGE_BYTES, bars + 8 * st, warp, lane);
      if (nxt + 1 < ntiles) next = tile_at(a, b, start + (nxt + 1) * BN, end);  // used next iteration
    }
    if (PROBE) c0 = clock64();
    mbar_wait(bars + 8 * ((j + 1) % STAGES), ((j + 1) / STAGES) & 1);
    if (PROBE) wait_cycles += clock64() - c0;
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

  const unsigned long long t_loop = PROBE ? now_ns() : 0ull;
  store_piece<VNT>(a, acc, m0, m1, l0, l1, b, split, warp, g, t4);
  if (PROBE && tid == 0) write_probe(a, b, split, t_start, t_first, t_loop, ntiles, wait_cycles, sync_cycles);
  if constexpr (FUSED) {  // every piece of the grid written: the blocks share the merge (splits > 1)
    const int nblocks = gridDim.x * gridDim.y;
    grid_barrier(a.barrier, barrier_seen, (unsigned)nblocks, tid);
    merge_share<NW * 32>(a, smem, blockIdx.y * gridDim.x + blockIdx.x, nblocks, tid);
  }
#endif  // K3_MLA_SM90
}

// ---------------------------------------------------------------------------------------------
// the team kernel (form='team', opt-in): two teams of 4 warps share one ring of tiles.
//
// Measured on the H200 (1a77c32): correct, and 20.9 us at 32K / 48.5 at 128K against the split
// kernel's 19.8 / 47.5; its probe shows the tile loop waiting for data (13-15K cycles of tile waits
// per block at 128K) where the split kernel's waited ~2K: the compute bound is gone and the stream
// of bytes is what is left. Kept for that lesson (notebook 04), not the default.
//
// Why it was built: the H200 timeline probe of the 4-warp split kernel (profiles/nvidia-h200/mla_padding/extra/)
// showed its tile loop compute-bound, not memory-bound: ~1.3 us per 32-row tile against ~1.1 us of
// DRAM share per SM, thread 0 waiting for tiles only ~470 cycles in 8 tiles, and Nsight Compute's
// stalls per issue led by 'wait' and the scoreboards: with one warp per SM sub-partition every
// dependent instruction's latency is exposed. Here team t (warps 4t..4t+3) takes tiles t, t+2, ...,
// each with the 4-warp split kernel's product split, its own score exchange, named barrier and
// online softmax, so every sub-partition has two independent warps: one issues while the other
// waits. A team holds one tile at a time (score, barrier, softmax and value product), so of the 5
// stages 3 are in flight. The last warp to finish reading a stage refills it with the tile 5 ahead
// (a shared-memory counter per stage picks it), so no copy waits for a whole team. At the end team 1
// hands its (max, sum, accumulator) to team 0 through shared memory, which combines them: the
// piece's output and log-sum-exp are those of the split kernel, and the merge is unchanged.
constexpr int TEAMS = 2;
constexpr int TEAM_WARPS = KGROUPS;                  // the 4-warp product split
constexpr int TSTAGES = 5;                           // ring depth
constexpr int TEAM_THREADS = TEAMS * TEAM_WARPS * 32;
constexpr int TVNT = DV / 8 / TEAM_WARPS;            // value n-tiles per warp (16)

constexpr int team_smem_bytes() { return TSTAGES * STAGE_BYTES + TEAMS * 2 * XCH_BYTES + TEAMS * TSTAGES * 8 + TSTAGES * 4; }

// Tile i lands on stage i % TSTAGES and signals the barrier of the team that reads it: one barrier per
// (team, stage). With one barrier per stage, a team running ahead would wait for its next tile on a
// stage whose pending phase still belongs to the other team's tile; the parity test cannot tell two
// phases apart, so it would pass early and read the wrong tile (this happened: an H200 fault under
// graph replay at 128K). Per team, each barrier's phases are that team's tiles in order.
K3_DEVICE uint32_t team_bar(uint32_t full, int i) { return full + 8 * ((i & 1) * TSTAGES + i % TSTAGES); }
K3_DEVICE uint32_t team_parity(int i) { return (uint32_t)((i / (2 * TSTAGES)) & 1); }

// a barrier of `threads` threads on hardware barrier `id` (1..15; 0 is __syncthreads)
K3_DEVICE void named_sync(int id, int threads) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory"); }

// Where tile `i` of a piece starts (element offset) and its row count. Paged caches: lane l of the
// calling warp holds the page of the l-th page of a 32-page window (`base`, `page_l`), re-read only
// when a tile leaves the window (a tile never crosses a page).
K3_DEVICE long long team_tile_row(const Args& a, int b, int pos, int& base, int& page_l, int lane) {
  if (a.block_table == nullptr) return (long long)b * a.kv_sp + (long long)pos * D;
  const int col = pos >> a.page_shift;
  if (base < 0 || col >= base + 32) {
    base = col;
    const int c = base + lane;
    page_l = c < a.max_pages ? __ldg(a.block_table + (long long)b * a.bt_sb + c) : 0;
  }
  const int page = __shfl_sync(0xffffffffu, page_l, col - base);
  return (long long)page * a.kv_sp + (long long)(pos & ((1 << a.page_shift) - 1)) * D;
}

// One warp fetches the tile at position `pos` into `stage`, completing on `bar`: a short last
// tile's missing rows zero-filled by the whole warp, lane 0 announces the byte count (its arrive also
// publishes the zero fill), lanes 0..7 copy one block of 4 rows each.
K3_DEVICE void warp_fetch(const Args& a, int b, int pos, int end, uint32_t stage, uint32_t bar, int& base, int& page_l,
                          int lane) {
  const int rows = tile_rows(pos, end);
  const long long row0 = team_tile_row(a, b, pos, base, page_l, lane);
  if (rows < BN) {
    for (int blk = 0; blk < 8; ++blk) {
      const int keep = min(4, max(0, rows - 4 * blk));
      for (int c = keep * (ROW_BYTES / 16) + lane; c < 4 * (ROW_BYTES / 16); c += 32)
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(stage + blk * BPITCH + c * 16), "r"(0) : "memory");
    }
  }
  __syncwarp();
  if (lane == 0) mbar_expect_tx(bar, (uint32_t)(rows * ROW_BYTES));
  __syncwarp();
  if (lane < 8) {
    const int keep = min(4, max(0, rows - 4 * lane));
    if (keep > 0)
      bulk_copy(stage + lane * BPITCH, a.kv + row0 + (long long)lane * 4 * D, (uint32_t)(keep * ROW_BYTES), bar);
  }
}

// The team kernel's fetch of its tile `i` (stage i % TSTAGES, the barrier of the team that reads it).
K3_DEVICE void team_fetch(const Args& a, int b, int start, int end, int i, uint32_t stages, uint32_t full, int& base,
                          int& page_l, int lane) {
  warp_fetch(a, b, start + i * BN, end, stages + (i % TSTAGES) * STAGE_BYTES, team_bar(full, i), base, page_l, lane);
}

template <bool PROBE = false>
__global__ void __launch_bounds__(TEAM_THREADS, 1) team_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
#if defined(K3_MLA_SM90)
  const int split = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int team = warp / TEAM_WARPS, kg = warp % TEAM_WARPS;
  const int g = lane >> 2, t4 = lane & 3;
  const unsigned long long t_start = PROBE ? now_ns() : 0ull;
  long long wait_cycles = 0, sync_cycles = 0;
  launch_dependents();
  const uint32_t stages = smem_u32(smem);
  float4* xch = reinterpret_cast<float4*>(smem + TSTAGES * STAGE_BYTES) + team * 2 * (KGROUPS * 4 * 32);
  const uint32_t full = smem_u32(smem + TSTAGES * STAGE_BYTES + TEAMS * 2 * XCH_BYTES);
  int* readers = reinterpret_cast<int*>(smem + TSTAGES * STAGE_BYTES + TEAMS * 2 * XCH_BYTES + TEAMS * TSTAGES * 8);
  const int length = __ldg(a.lengths + b);
  const int start = split * a.chunk;
  const int end = min(length, start + a.chunk);
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;
  int base = -1, page_l = 0;  // this warp's page window
  if (tid == 0) {  // one thread: its fence makes every initialised barrier visible to the copy engine
    for (int s = 0; s < TEAMS * TSTAGES; ++s) mbar_init(full + 8 * s, 1);
    for (int s = 0; s < TSTAGES; ++s) readers[s] = 0;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // warp 0 fills the ring in tile order: the memory system serves roughly in arrival order, so the
  // first tile lands first and the teams start while the rest streams in (five warps each asking
  // for one tile made every first tile wait for about all five: H200 probe, first tile at ~6 us)
  if (warp == 0)
    for (int i = 0; i < TSTAGES && i < ntiles; ++i) team_fetch(a, b, start, end, i, stages, full, base, page_l, lane);

  uint32_t qf[KSTEPS][4];
  load_query<KSTEPS>(a, b, kg * KSTEPS, g, t4, qf);
  const int mi = lane >> 3, r8 = lane & 7;
  const uint32_t k_lane = (uint32_t)(r8 * BPITCH + (mi >> 1) * ROW_BYTES + (kg * 2 * KSTEPS + (mi & 1)) * 16);
  const uint32_t v_lane = (uint32_t)(r8 * BPITCH + (mi & 1) * ROW_BYTES + (kg * TVNT + (mi >> 1)) * 16);
  float acc[TVNT][4];
#pragma unroll
  for (int i = 0; i < TVNT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float s[4][4];
  unsigned long long t_first = 0;

  for (int j = team, it = 0; j < ntiles; j += TEAMS, ++it) {
    const int st = j % TSTAGES;
    long long c0 = PROBE ? clock64() : 0;
    mbar_wait(team_bar(full, j), team_parity(j));
    if (PROBE) {
      wait_cycles += clock64() - c0;
      if (it == 0) t_first = now_ns();
    }
    const uint32_t stage = stages + st * STAGE_BYTES;
    score_tile<4>(s, qf, stage + k_lane);
    float4* xj = xch + (it & 1) * (KGROUPS * 4 * 32);
    publish_scores<4>(s, xj, kg, 0, lane);
    if (PROBE) c0 = clock64();
    named_sync(1 + team, TEAM_WARPS * 32);  // the team's four score partials of tile j are published
    if (PROBE) sync_cycles += clock64() - c0;
    softmax_value<TVNT>(a, xj, start + j * BN, end, stage + v_lane, s, acc, m0, m1, l0, l1, lane, t4);
    // done with the stage: the team's last warp to get here refills it with the tile TSTAGES ahead
    if (j + TSTAGES < ntiles) {
      __syncwarp();
      __threadfence_block();  // this warp's reads of the stage come before its count (and the refill)
      int last = 0;
      if (lane == 0) last = atomicAdd(readers + st, 1) == TEAM_WARPS - 1;
      last = __shfl_sync(0xffffffffu, last, 0);
      if (last) {
        if (lane == 0) readers[st] = 0;
        team_fetch(a, b, start, end, j + TSTAGES, stages, full, base, page_l, lane);
      }
    }
  }
  const unsigned long long t_loop = PROBE ? now_ns() : 0ull;

  // team 1 hands its partial softmax state to team 0 through the ring's memory (every tile has
  // been read by then: the first barrier), team 0 combines the two
  named_sync(3, TEAM_THREADS);
  float4* hand = reinterpret_cast<float4*>(smem) + (kg * 32 + lane) * (TVNT + 1);
  if (team == 1) {
#pragma unroll
    for (int i = 0; i < TVNT; ++i) hand[i] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    hand[TVNT] = make_float4(m0, m1, l0, l1);
  }
  named_sync(3, TEAM_THREADS);
  if (team == 1) return;
  {
    const float4 o = hand[TVNT];
    const float n0 = fmaxf(m0, o.x), n1 = fmaxf(m1, o.y);
    const float u0 = n0 == -INFINITY ? 0.f : n0, u1 = n1 == -INFINITY ? 0.f : n1;
    const float a0 = fast_exp2(m0 - u0), a1 = fast_exp2(m1 - u1);
    const float c0 = fast_exp2(o.x - u0), c1 = fast_exp2(o.y - u1);
#pragma unroll
    for (int i = 0; i < TVNT; ++i) {
      const float4 v = hand[i];
      acc[i][0] = acc[i][0] * a0 + v.x * c0;
      acc[i][1] = acc[i][1] * a0 + v.y * c0;
      acc[i][2] = acc[i][2] * a1 + v.z * c1;
      acc[i][3] = acc[i][3] * a1 + v.w * c1;
    }
    l0 = l0 * a0 + o.z * c0;
    l1 = l1 * a1 + o.w * c1;
    m0 = n0;
    m1 = n1;
  }
  store_piece<TVNT>(a, acc, m0, m1, l0, l1, b, split, kg, g, t4);
  if (PROBE && tid == 0) write_probe(a, b, split, t_start, t_first, t_loop, ntiles, wait_cycles, sync_cycles);
#endif  // K3_MLA_SM90
}

// ---------------------------------------------------------------------------------------------
// the merge: one block per (request, head) and MERGE_COLS value columns; lse-weighted sum of pieces.
// 128 threads = 16 split groups x 8 float4 column groups. The latency chain is kept short: each thread
// issues its pieces' column loads before anything else (they do not depend on the weights), the
// block's maximum log-sum-exp comes from one load per thread and a shuffle tree, each piece's weight is
// computed once (by the thread that loaded its lse) into shared memory, and the 16 split groups' sums
// meet by shuffles inside each warp and in shared memory across the 4 warps.
// Why: the merge's work was 2.2 us of a 32K decode on the H200 (commit 6aa92d8: 15.9 us with the merge
// kernel emptied by -DK3_MLA_MERGE_EMPTY, 18.1 with it; profiles/nvidia-h200/mla_padding/extra/
// merge_cost_6aa92d8.json); the timeline probe had each merge block taking ~2 us. The previous merge
// (maximum first, then the column loads, and 8 threads summing 16 groups one by one; commit 6aa92d8)
// against this one, same run (commit f0ca511, extra/merge_short_chain_f0ca511.json), wgmma form, us:
// 32K 18.25 / 17.44, 128K 45.44 / 44.73, 1K 8.58 / 7.93, 8 x 8K 27.32 / 27.01, 64 x 8K 167.4 / 167.7.
// Tried and not faster: one round trip with a running (max, sum) state per thread (commit 4ee46c3: its
// chain of rescalings is as long as the round trip it saves), and each thread weighing its own pieces
// instead of one shared weight table (commit d986384: 17.70 against 17.50 us at 32K), and 256 threads of
// 4 pieces each instead of 128 of 8 (commit 71bcec7, extra/merge_wide_71bcec7.json: 16.65 against 16.65
// us at 32K, 42.58 against 42.56 at 128K).
// AHEAD: pieces per thread whose loads are issued up front (1 where splits <= 16, 8 up to 128; beyond,
// batches of 8 after the maximum). Two builds because the 8-deep one's registers cost occupancy where
// the merge grid is large (B = 64 x 8K: 12,288 blocks of 2 pieces each).
template <int AHEAD>
__global__ void __launch_bounds__(MERGE_THREADS) merge_kernel(const Args a) {
#if defined(K3_MLA_SM90)
  wait_prerequisites();  // launched early (programmatic dependent launch): the partials are complete now
#endif
#if defined(K3_MLA_MERGE_EMPTY)  // diagnostics only (scripts/device_mla_wgmma.py variants): the merge's launch, no work
  return;
#endif
  const unsigned long long t_begin = a.probe != nullptr ? now_ns() : 0ull;
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
  } else {  // more pieces than 8 per thread: loads in batches of 8 after the maximum (the previous merge's
    // loop; checked on the H200 by the GPU test case with more than 128 pieces, commit 6ec79aa)
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
    if (a.probe != nullptr && tid == 0) {
      unsigned long long* p = a.probe + (long long)a.B * a.splits * 8 + ((long long)row * gridDim.y + blockIdx.y) * 2;
      p[0] = t_begin;
      p[1] = now_ns();
    }
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

template <int STAGES, int NW, bool PROBE = false>
int launch_split(const Args& a, int max_shared, cudaStream_t st) {
  const int bytes = smem_bytes(STAGES);
  if (bytes > max_shared) return -3;
  static bool configured = false;  // the opt-in above 48 KB, once per process and template
  if (!configured) {
    const cudaError_t e =
        cudaFuncSetAttribute(split_kernel<STAGES, NW, PROBE>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  split_kernel<STAGES, NW, PROBE><<<dim3(a.splits, a.B), NW * 32, bytes, st>>>(a);
  return (int)cudaGetLastError();
}

// The fused form's kernel (5 stages, 4 warps: the default split kernel plus the merge) and its
// opt-in above 48 KB of dynamic shared memory, once per process.
constexpr int FUSED_STAGES = 5, FUSED_WARPS = 4;
inline void (*fused_kernel())(const Args) { return split_kernel<FUSED_STAGES, FUSED_WARPS, false, true>; }

inline int configure_fused(int max_shared) {
  const int bytes = smem_bytes(FUSED_STAGES);
  if (bytes > max_shared) return -3;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(fused_kernel(), cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  return 0;
}

// One cooperative launch of the fused kernel: the runtime refuses it (cudaErrorCooperativeLaunchTooLarge)
// unless the whole grid can be resident at once. No programmatic-serialization attribute: see
// grid_barrier's comment for why the barrier needs the previous kernel complete.
inline cudaError_t launch_fused_raw(const Args& a, cudaStream_t st) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  return k3_launch_with(fused_kernel(), dim3(a.splits, a.B), dim3(FUSED_WARPS * 32), smem_bytes(FUSED_STAGES), st, a,
                        attr);
}

template <bool PROBE>
int launch_team(const Args& a, int max_shared, cudaStream_t st) {
  const int bytes = team_smem_bytes();
  if (bytes > max_shared) return -3;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(team_kernel<PROBE>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  team_kernel<PROBE><<<dim3(a.splits, a.B), TEAM_THREADS, bytes, st>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace k3mla

#include <cudaTypedefs.h>  // CUtensorMap and the driver's tensor-map encoder (form 'wgmma', host side)
#include "mla_wgmma.h"     // the split kernel on warpgroup MMA (form 'wgmma')
#include "mla_halves.h"    // two teams of warps on half positions x half columns (form 'halves')

// Whether this build has the kernel: 1 for a CUDA build that includes sm_90 code (checked at launch
// against the device: cudaFuncGetAttributes fails for an architecture that was not compiled).
K3_EXPORT int k3_mla_decode_supported() { return 1; }

K3_EXPORT int k3_mla_decode_args_size() { return (int)sizeof(k3mla::Args); }

K3_EXPORT int k3_mla_decode_smem(int stages) {
  return stages >= 3 && stages <= 5 ? k3mla::smem_bytes(stages) : -1;
}

// Register count of the split kernel for `stages` as compiled for the current device (<0: error).
// The compiled (stages, warps) pairs.
#define K3_MLA_CONFIGS(X) X(3, 4) X(4, 4) X(5, 4) X(3, 8) X(4, 8) X(5, 8)

K3_EXPORT int k3_mla_decode_team_smem() { return k3mla::team_smem_bytes(); }
K3_EXPORT int k3_mla_halves_smem() { return k3mla::halves_smem_bytes(); }

K3_EXPORT int k3_mla_decode_regs(int stages, int warps) {
  cudaFuncAttributes attr;
  cudaError_t e = cudaErrorInvalidValue;
  if (stages == k3mla::TSTAGES && warps == K3_MLA_TEAM) e = cudaFuncGetAttributes(&attr, k3mla::team_kernel<false>);
  if (stages == k3mla::HSTAGES && warps == K3_MLA_HALVES) e = cudaFuncGetAttributes(&attr, k3mla::halves_kernel);
#define K3_REGS(S_, W_) \
  if (stages == S_ && warps == W_) e = cudaFuncGetAttributes(&attr, k3mla::split_kernel<S_, W_>);
  K3_MLA_CONFIGS(K3_REGS)
#undef K3_REGS
  return e == cudaSuccess ? attr.numRegs : -(int)e;
}

// One decode step: the split kernel (grid splits x B), then, for splits > 1, the merge (grid
// B*heads x 512/32), launched with programmatic dependent launch when pdl != 0.
// Returns 0, -1 (no such (stages, warps) pair), -3 (more shared memory than max_shared), -4 (bad sizes),
// or the CUDA runtime's error code.
K3_EXPORT int k3_mla_decode(const k3mla::Args* args, int stages, int warps, int pdl, int max_shared, void* stream) {
  const k3mla::Args& a = *args;
  if (a.B < 1 || a.B > 65535 || a.heads < 1 || a.heads > k3mla::ROWS || a.splits < 1 || a.splits > 65535 ||
      a.chunk < k3mla::BN || a.chunk % k3mla::BN != 0 || a.page_shift < 5 || a.page_shift > 30 ||
      (a.block_table != nullptr && a.max_pages < 1))
    return -4;
  cudaStream_t st = (cudaStream_t)stream;
  int rc = -1;
  if (warps == K3_MLA_HALVES) {
    if (stages == k3mla::HSTAGES && a.probe == nullptr) rc = k3mla::launch_halves(a, max_shared, st);
  } else if (warps == K3_MLA_TEAM) {
    if (stages == k3mla::TSTAGES)
      rc = a.probe != nullptr ? k3mla::launch_team<true>(a, max_shared, st) : k3mla::launch_team<false>(a, max_shared, st);
  } else if (a.probe != nullptr) {  // the timeline probe: the 4-warp, 5-stage split kernel and the team kernel
    rc = stages == 5 && warps == 4 ? k3mla::launch_split<5, 4, true>(a, max_shared, st) : -1;
  } else {
#define K3_LAUNCH(S_, W_) \
  if (stages == S_ && warps == W_) rc = k3mla::launch_split<S_, W_>(a, max_shared, st);
    K3_MLA_CONFIGS(K3_LAUNCH)
#undef K3_LAUNCH
  }
  if (rc != 0 || a.splits == 1) return rc;
  return k3mla::launch_merge(a, pdl, st);
}

// Form 'wgmma' (kernels/mla_wgmma.h): its shared memory, its tensor maps of a cache's rows and of the
// queries (each written into the caller's 128-byte buffer, once per plan), and one decode step with it (the merge as in
// k3_mla_decode). Same return codes, and -6: the driver's tensor-map encoder is unavailable,
// <= -1000: the encoder refused the map.
K3_EXPORT int k3_mla_wg_smem() { return k3mla::wg_smem_bytes(); }

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

K3_EXPORT int k3_mla_wg_regs() {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, k3mla::wg_kernel<1>);
  return e == cudaSuccess ? attr.numRegs : -(int)e;
}

// The wgmma form's launch and merge; tokens = 2: blocks of two consecutive requests that are two tokens of
// one verification group (kernels/mla_wgmma.h, NT = 2; a.B even). 0 or an error code.
static int decode_wg(const k3mla::Args* args, const void* map, const void* qmap, int pdl, int max_shared, int tokens,
                     void* stream) {
  const k3mla::Args& a = *args;
  if ((tokens != 1 && tokens != 2) || a.B % tokens != 0 || a.q_run < 1 || a.q_tq < 1 || a.q_tq > a.q_run) return -4;
  if (map == nullptr || qmap == nullptr || a.B < 1 || a.B > 65535 || a.heads < 1 || a.heads > k3mla::ROWS || a.splits < 1 ||
      a.splits > 65535 || a.chunk < k3mla::WG_BN || a.chunk % k3mla::WG_BN != 0 ||
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

K3_EXPORT int k3_mla_decode_wg(const k3mla::Args* args, const void* map, const void* qmap, int pdl, int max_shared,
                               void* stream) {
  return decode_wg(args, map, qmap, pdl, max_shared, 1, stream);
}

K3_EXPORT int k3_mla_decode_wg_tokens(const k3mla::Args* args, const void* map, const void* qmap, int pdl, int max_shared,
                                      int tokens, void* stream) {
  return decode_wg(args, map, qmap, pdl, max_shared, tokens, stream);
}

K3_EXPORT int k3_mla_wg_tokens_smem(int tokens) {
  return tokens == 1 ? k3mla::wg_smem_bytes_t<1>() : tokens == 2 ? k3mla::wg_smem_bytes_t<2>() : -4;
}

// The fused form's capacity: blocks of the fused kernel that can be resident at once on the current
// device (occupancy API x SMs); a grid of B * splits blocks runs fused only up to this. <0: error.
K3_EXPORT int k3_mla_fused_max_blocks(int max_shared) {
  const int rc = k3mla::configure_fused(max_shared);
  if (rc != 0) return rc < 0 ? rc : -rc;
  int per_sm = 0, dev = 0, sms = 0;
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k3mla::fused_kernel(),
                                                               k3mla::FUSED_WARPS * 32,
                                                               k3mla::smem_bytes(k3mla::FUSED_STAGES));
  if (e == cudaSuccess) e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  int coop = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, dev);
  if (e != cudaSuccess) return -(int)e;
  return coop ? per_sm * sms : 0;
}

// Whether a cooperative launch of the fused kernel survives CUDA-graph stream capture here: captures
// one launch (dummy arguments, never run) on a private stream in thread-local mode, checks that the
// captured node still carries the cooperative attribute, instantiates the graph and throws it all
// away. 1: yes; 0: captured without the attribute (not safe: the barrier would rely on luck);
// <0: the CUDA error that refused it (-(code)).
K3_EXPORT int k3_mla_fused_capturable(int max_shared) {
  const int rc = k3mla::configure_fused(max_shared);
  if (rc != 0) return rc < 0 ? rc : -rc;
  cudaStream_t st = nullptr;
  cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  if (e != cudaSuccess) return -(int)e;
  int result = 1;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal);
  if (e == cudaSuccess) {
    k3mla::Args dummy = {};
    dummy.B = 1;
    dummy.splits = 2;
    const cudaError_t le = k3mla::launch_fused_raw(dummy, st);
    e = cudaStreamEndCapture(st, &graph);
    if (le != cudaSuccess) e = le;
  }
  if (e == cudaSuccess) {
    size_t n = 0;
    e = cudaGraphGetNodes(graph, nullptr, &n);
    cudaGraphNode_t node = nullptr;
    if (e == cudaSuccess && n == 1) e = cudaGraphGetNodes(graph, &node, &n);
    cudaLaunchAttributeValue v = {};
    if (e == cudaSuccess && node != nullptr) e = cudaGraphKernelNodeGetAttribute(node, cudaLaunchAttributeCooperative, &v);
    if (e == cudaSuccess && (node == nullptr || !v.cooperative)) result = 0;
  }
  if (e == cudaSuccess && result == 1) e = cudaGraphInstantiate(&exec, graph, 0);
  if (e != cudaSuccess) result = -(int)e;
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaStreamDestroy(st);
  cudaGetLastError();  // a refused capture leaves a (non-sticky) error behind: clear it
  return result;
}

// One decode step in the fused form (splits > 1, barrier set): one cooperative launch.
// Returns 0, -3 (shared memory), -4 (bad sizes) or the CUDA runtime's error code
// (cudaErrorCooperativeLaunchTooLarge = 720 when the grid cannot be co-resident).
K3_EXPORT int k3_mla_decode_fused(const k3mla::Args* args, int max_shared, void* stream) {
  const k3mla::Args& a = *args;
  if (a.B < 1 || a.B > 65535 || a.heads < 1 || a.heads > k3mla::ROWS || a.splits < 2 || a.splits > 65535 ||
      a.chunk < k3mla::BN || a.chunk % k3mla::BN != 0 || a.page_shift < 5 || a.page_shift > 30 ||
      (a.block_table != nullptr && a.max_pages < 1) || a.barrier == nullptr || a.probe != nullptr)
    return -4;
  const int rc = k3mla::configure_fused(max_shared);
  if (rc != 0) return rc;
  return (int)k3mla::launch_fused_raw(a, (cudaStream_t)stream);
}

// Registers per thread of the fused kernel (<0: error).
K3_EXPORT int k3_mla_fused_regs() {
  cudaFuncAttributes attr;
  const cudaError_t e = cudaFuncGetAttributes(&attr, k3mla::fused_kernel());
  return e == cudaSuccess ? attr.numRegs : -(int)e;
}

#else  // HIP (or anything but CUDA): no mma.sync / bulk-copy path; the launchers say so

K3_EXPORT int k3_mla_decode_supported() { return 0; }
K3_EXPORT int k3_mla_decode_args_size() { return (int)sizeof(k3mla::Args); }
K3_EXPORT int k3_mla_decode_smem(int stages) { return stages >= 3 && stages <= 5 ? k3mla::smem_bytes(stages) : -1; }
K3_EXPORT int k3_mla_decode_team_smem() { return -1; }
K3_EXPORT int k3_mla_halves_smem() { return -1; }
K3_EXPORT int k3_mla_decode_regs(int, int) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_decode(const k3mla::Args*, int, int, int, int, void*) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_fused_max_blocks(int) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_fused_capturable(int) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_decode_fused(const k3mla::Args*, int, void*) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_fused_regs() { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_wg_smem() { return -1; }
K3_EXPORT int k3_mla_wg_map(void*, const void*, long long) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_wg_regs() { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_wg_qmap(void*, const void*, int, int, long long, long long) { return K3_MLA_UNSUPPORTED; }
K3_EXPORT int k3_mla_decode_wg(const k3mla::Args*, const void*, const void*, int, int, int, void*) {
  return K3_MLA_UNSUPPORTED;
}
K3_EXPORT int k3_mla_decode_wg_tokens(const k3mla::Args*, const void*, const void*, int, int, int, void*) {
  return K3_MLA_UNSUPPORTED;
}
K3_EXPORT int k3_mla_wg_tokens_smem(int) { return -1; }

#endif
