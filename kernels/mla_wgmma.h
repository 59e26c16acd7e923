// mla_wgmma.h: the MLA decode's split kernel on Hopper's warpgroup matrix units (form 'wgmma'),
// included by mla_decode.cu in its CUDA build only (it uses that file's Args, mbarrier helpers and
// partial layout; the merge kernel there merges its pieces unchanged).
//
// Why another split kernel. The mma.sync kernel (split_kernel) is compute-bound: ~1.3 us per 32-row
// tile on the H200 against ~1.15 us of DRAM share per SM, because with one warp per SM
// sub-partition every dependent mma, ldmatrix, shuffle and barrier is exposed, and each of its
// four warps redoes the whole tile's softmax. The same data path with the arithmetic removed reads
// the 32K cache in 11.1 us and the 128K one in 37.0 us (scripts/mla_read_probe.cu) where the
// decode takes 19.6 and 47.5. Here the products go to wgmma, which reads its operands from shared
// memory itself (no ldmatrix) and runs asynchronously:
//   * positions on M: S^T [64 positions x 16 heads] = K_tile [64 x 576] . Q^T (36 m64n16k16 steps),
//     so a tile is 64 latent rows and no row of the product is padding; the 16 heads (12 real) are
//     N = 16;
//   * O^T [512 value columns x 16 heads] += V_tile^T [512 x 64] . P^T [64 x 16] (8 x 4 steps with
//     the tile read M-major: the same shared bytes serve both products);
//   * each warp owns 16 positions of the tile: the softmax's max over the tile's positions is one
//     shuffle tree and one 64-float exchange; the sums stay per thread until the end;
//   * a tile arrives as 9 TMA boxes of 64 rows x 64 columns with the 128-byte swizzle (the layout
//     wgmma expects), 72 KB; two stages: a tile is refilled as soon as its value product is done,
//     so two tiles (144 KB) stream while the SM waits.
// Rows past a request's length inside its last tile are loaded by the box and then zeroed in shared
// memory before use (their scores are masked; zeros keep NaN in unused cache rows out of p V).
// Q^T arrives by TMA too (a 3D map over [B, H, 576]; heads past H lie outside it and arrive as zeros).
// Needs tiles of 64 rows inside one page: contiguous caches, or pages of >= 64 rows.
//
// Measured on an H200 (profiles/nvidia-h200/mla_padding, commit e3fdbef, graph replay, B = 1, paged):
// 18.1 us at 32K (the split kernel 19.9 in the same run), 45.8 us at 128K (47.4), 27.4 at 8 x 8K
// (28.6), 199 at 64 x 8K (216; 168 against 165 in one wave of pieces, 083abc8), but 8.6 at 1K (7.0:
// one tile per piece, start-up dominates), so mla_decode_cuda.choose_form takes this form only for
// pieces of >= 4 tiles. With the short-chain merge
// kernel (commit 74f98a3): 17.4 us at 32K (51% of the copy bandwidth), 45.0 at 128K (79%), 27.3 at
// 8 x 8K, 167 at 64 x 8K; the split kernel 19.4, 47.1, 28.2, 166. With lazy softmax references
// (WG_LAZY below; commit 01aba0b): 17.1 us at 32K (52%), 44.9 at 128K (79%), 27.0 at 8 x 8K, 169 at
// 64 x 8K (the previous build in the same run: 17.48, 44.78, 27.31, 167.3; extra/lazy_01aba0b.json).
// With the ninth session's two changes below (commit 20255de, the main records): 16.9 us at 32K (53%),
// 43.3 at 128K (82%), 26.4 at 8 x 8K, 156 at 64 x 8K (91%).
// Built with K3_MLA_WG_DATA_ONLY (no arithmetic) it takes 16.1 / 42.7 us: the two 72 KB stages stream slower than
// the five 37 KB stages of scripts/mla_read_probe.cu's ring (11.1 / 37.0 us with an empty second
// kernel 11.8 / 37.9), and the arithmetic the two stages cannot hide adds 2-3 us.
// Tried and measured slower (same H200): a ring of 25 box slots of 8 KB (a box may land in any slot,
// so ~1.8 tiles stream while one is computed): 21.9 / 49.5 us, data-only 17.5 / 45.0 (each tile's
// boxes then go out in two batches); filling the stages with 16-byte cp.async (rows in memory order):
// 21.4 / 51.9 us; issuing tile j+1's scores behind tile j's value product (two wgmma groups):
// 19.05 / 46.35 against 18.24 / 45.70 (commit 9e3c240), since the stage of tile j is then freed
// only after tile j+1 has landed; tiles of 32 rows in five stages (the M of 64 reading the next box
// or a zero pad as masked rows; commit 090ffa0): 22.7 / 62.4 us, data-only 17.4 / 44.5, so neither
// the arithmetic (the score product costs the same per tile, now per 32 rows) nor the stream gains;
// the TMA boxes' 128-byte pieces stream slower than the probe ring's 4.6 KB bulk copies whatever
// the depth. Merging without the second kernel (commit 656605d: clusters of 2-16 blocks combining
// through distributed shared memory, the last block per column slice merging from L2) was right but
// slower: only 15 clusters of 8 fit at once, and with pieces that fit, 24.6 against 20.0 us at 32K
// (profiles/nvidia-h200/mla_padding/extra/cluster_merge_*.json). The box shape is not the limit either
// (commits 5b157f3, 0985f1b; extra/box_rows_5b157f3.json, extra/one_copy_0985f1b.json): boxes of 8, 16
// or 32 rows issued row group by row group are slower (128K: 73.9, 57.3, 46.7 against 45.7 us), and the
// whole tile as one 3D TMA copy (a map over 64 columns x rows x 9 column chunks) streams exactly as fast
// as the 9 boxes (data-only 42.77 against 42.81 us at 128K). Tiles handed out one by one from a
// per-request counter (atomicAdd, asked a tile ahead, so that faster SMs take more; commit 7533f65,
// extra/dynamic_tiles_7533f65.json) were right but slower everywhere (128K 60.4 against 45.8 us, 32K 22.7
// against 18.5): whatever the slowest pieces cost, a counter round trip per tile costs more. Taking
// the accumulator's rescale off the path from the softmax to the value product (each tile's values into
// their own accumulator, folded into o while the next tile's scores run; commit 0f564b9,
// extra/fold_0f564b9.json: 220 registers, and a copy of the accumulator so that ptxas adds no wgmma
// wait) was slower too: 17.95 against 17.40 us at 32K, 45.21 against 44.83 at 128K.
// Loading Q^T with 16-byte loads from all 128 threads of every block cost ~1.2 us (every SM reads the
// same 18 KB), hence the TMA boxes.
// Ninth session (H200, same-run comparisons, us): the tile map's L2 promotion of 256 bytes cost time;
// 128 bytes (the box row) or none: 128K 42.9 against 44.8-45.0, 64 x 8K 153.1 against 169.5, 32K and
// 8 x 8K level (commits 6ec79aa, dd95d29; extra/tile_stream_6ec79aa.json, extra/direct_store_dd95d29.json;
// why 256 costs is not measured). The same runs: each tile read as ONE bulk copy of its 64 contiguous
// rows (the wrong layout for wgmma, timing only; -DK3_MLA_WG_BULK_TILE=1) is level at 32K (17.26
// against 17.21), so the 9 boxes are not what holds 32K back; partials stored straight from the
// accumulators instead of staged in shared memory: 32K 16.65 against 17.22, 128K 42.30 against 42.91,
// 8 x 8K 25.97 against 26.62 (kept); the first tiles' block-table entries read beside the length
// instead of after it: slower everywhere (32K 18.01, 128K 43.92; not kept). The timeline probe at 32K
// (commit dd95d29, after an L2 flush; again at 20255de: extra/probe_wgmma_20255de.json): the median
// block's first tile lands 5.4-5.7 us after its start (the slowest block's 7.6-9.1), its 4 tiles take
// 8.3-8.8 us more, the slowest block ends ~2 us after the median one, and the merge ends ~2.3 us
// after the slowest block. The arithmetic
// alone (-DK3_MLA_WG_COMPUTE_ONLY=1: one tile loaded, every tile's products run on it; commit 7d8f848,
// extra/merge_cost_7d8f848.json): 13.6 us at 32K and 25.8 at 128K, so ~1.0 us per 64-row tile against
// the tile's ~2.2 us share of DRAM time; with two stages only one tile streams while one is computed.
// Nsight Compute on that build at 128K (commit 754be47, extra/ncu_wgmma_compute_only_754be47.txt): L1 /
// shared-memory throughput 55% of peak, issue slots 32% busy, which read as a latency chain (score
// products, wait, softmax, barrier, value products, wait); the tenth session's two-warpgroup build (below)
// says otherwise: halving each chain made the arithmetic slower. Two warpgroups in
// ping-pong, one per stage, each with its own softmax state combined at the end, so that two tiles'
// chains overlap (commit 9ebdfe4, extra/pingpong_9ebdfe4.json): right, but slower (32K 17.86 against
// 16.65 us, 128K 44.96 against 43.26, 64 x 8K level), since both stages are then computed at once
// and neither streams; not kept.
// Issuing the second tile after the queries landed, or after the first tile landed, so that the first
// is not served interleaved with it: level, or slower (32K 16.51 / 16.93 against 16.41 us, 128K 42.18 /
// 42.84 against 42.27; commit dd2e0a2, extra/stagger_dd2e0a2.json; not kept). The prologue: thread 0
// needs ~2 us from its start until the first tiles are requested (probe after an L2 flush: the
// length, then the block-table entry, each from DRAM; extra/probe_wgmma_20255de.json), but requesting
// the queries before the length is read is level, and the first tiles before the length is known
// (speculative, waited for before leaving) slower (32K 16.65 / 17.10 against 16.65, 128K 42.84 /
// 43.33 against 43.08; commit 9ecacad, extra/prologue_9ecacad.json; not kept).

// Tenth session (H200, same-run comparisons, us; JSON in profiles/nvidia-h200/mla_padding/extra/):
// * A stage refilled box by box as it frees up (the rope box after the scores, value boxes 0-3 and 4-7
//   after their halves of the value product; commit 2b80e34, early_refill_6bba63d.json): level or
//   slower (32K 16.88 against 16.60, 128K 43.31 against 43.17); not kept.
// * Three 64 KB stages of value boxes, with the rope kept out of shared memory (commits 07e1932 to
//   7691e31). The stream alone gains: data-only 13.88 / 36.32 us at 32K / 128K against 15.10 / 41.29
//   (97.8% of the copy bandwidth at 128K), 134.9 against 154.1 at 64 x 8K (rope_lead_7baa66e.json). But
//   the rope must then reach the arithmetic some other way, and neither way found is faster:
//   - each thread loads its two rows' rope into registers 2 or 3 tiles ahead, scored by mma.sync beside
//     the wgmma: 32K 20.35-20.66, 128K 46.9-48.0 against 16.54 / 42.54. ptxas puts every such load on one
//     scoreboard and waits for all of them, so a tile waits for the loads issued one tile earlier. Loads
//     of the first tile's rope again (cache hits) are as slow (20.51 / 50.31). With no rope loads at all
//     (wrong scores, timing only) it is 17.84 / 40.30 / 138.5 (rope_diag_bc7d619.json). The probe
//     (probe_rope_161620f.json) shows the first tile landing 11 us after the block starts, not 6.
//   - a ring of two rope boxes, with P and the max exchange in the current tile's slot once its scores
//     are done. This is the only layout found that fits: 231,472 bytes, with no alignment slack. 32K 18.97,
//     128K 45.36 against 16.68 / 43.05; data-only 16.35 / 42.12 against 14.91 / 40.41 (ring3_7691e31.json).
//     Two rope slots are a lead of two tiles where the values have three; a third slot does not fit.
// * The SM clock over the tile loop (-DK3_MLA_WG_PROBE_CLOCK=1, probe_clock_5ab23b0.json): 1.74-1.78 GHz
//   while the decode or its compute-only build runs, 1.98 GHz for the data-only build. Per 64-row tile the
//   loop takes 2.3 / 2.4 us at 32K / 128K; the compute-only build 1.3 / 1.2, the data-only one 1.7 / 2.25.
//   At 32K the first tile lands ~6 us after the block starts (~2 us of dependent reads before the requests).
// * With q, lengths and block table shared by every rotated input set (only the caches rotate, as in a
//   model whose layers all read the same small tensors): level (32K 16.67 against 16.72, 128K 43.07
//   against 43.17; hot_small_5a79830.json).
// * Two warpgroups sharing each tile (256 threads; warpgroup w runs half of the score k-steps, the halves
//   of S swapped through shared memory and added in the same order by both, and the value product of
//   columns 256 w .. 256 w + 255; commit 1d337b1, split2_1d337b1.json): right on the four variant checks,
//   but slower or level: 1K 8.30 against 7.14, 32K 18.11 against 16.65, 128K 43.89 against 42.51, 8 x 8K
//   26.91 against 25.95, 64 x 8K 152.89 against 152.80. Its compute-only build is slower than the
//   one-warpgroup compute-only build (32K 15.34 against 13.55, 128K 30.79 against 25.89), so the
//   arithmetic is not a latency chain that a second warpgroup overlaps: with the same matrix work and
//   shared-memory operand reads, the swap and its extra barrier only add. Not kept.

// Eleventh session (H200): verification groups run this kernel with each token a one-token request over
// the same pages (mla_decode_cuda.plan_verify), an even group two tokens per block (wg_kernel<2>: N = 32,
// a tile read once per pair; 32K 19.5 / 25.2 / 40.7 us for 2 / 4 / 8 positions against the Triton kernel's
// 39.4 / 37.1 / 59.9, commits 09a1819 and 21566bb; extra/verify_pairs_21566bb.json). With a block per token
// DRAM serves each tile once and L2 once per further token
// (ncu at 32K: 37.8 MB from DRAM for 1, 2 and 4 tokens; extra/ncu_verify_4656917.txt). Tried and removed
// (commits 9a73b86, 947b7b6; extra/verify_share_*.json): the group's blocks as one cluster, each tile's
// boxes requested once and multicast to every block, a cluster barrier per tile before a stage is
// refilled. Right (every GPU test), but slower than sharing through L2: 2 positions at 32K 23.97 against
// 21.68 us, 4 positions 42.88 against 35.92, 2 at 8 x 8K 41.74 against 38.01 (with a release barrier
// per tile: 26.72, 49.55, 47.33). The blocks then move in step and each waits for DRAM with two stages;
// independent blocks let the leading one fetch a tile into L2 for the others.

// Tried and removed (commit 13b25de, extra/l2_ahead_13b25de.json): tiles requested into L2 ahead of the
// two stages by TMA prefetch (cp.async.bulk.prefetch.tensor), 1, 2 or 4 tiles beyond the refill, so that a
// refill finds its tile in L2. Right, but slower everywhere and more so the further ahead: 32K 17.64 /
// 18.08 / 18.13 against 16.82 us, 128K 46.35 / 49.08 / 58.42 against 43.09, 64 x 8K 174.1 / 177.8 / 229.8
// against 155.8. An L2 lead is not a third stage here.

// Twelfth session (H200, commit 5519d66, extra/verify_padded_5519d66.json): odd verification groups run in
// pairs too, padded by one token whose index lies outside the 4D query map ([groups, tokens, heads, 576]),
// so TMA fills its query with zeros and its output is dropped: 3 / 5 / 7 positions at 32K take 25.2 / 33.3 /
// 40.6 us, what 4 / 6 / 8 take (a copy of q into a padded buffer before each call had cost ~4 us more).

// Diagnostics only: built with -DK3_MLA_WG_DATA_ONLY=1 (scripts/device_mla_wgmma.py), the kernel streams
// its tiles exactly as below but skips the arithmetic (its outputs are then meaningless).
#ifndef K3_MLA_WG_DATA_ONLY
#define K3_MLA_WG_DATA_ONLY 0
#endif
// Diagnostics only: built with -DK3_MLA_WG_COMPUTE_ONLY=1, only the first tile is loaded and every tile's
// arithmetic runs on it (outputs meaningless): the arithmetic's own time per tile.
#ifndef K3_MLA_WG_COMPUTE_ONLY
#define K3_MLA_WG_COMPUTE_ONLY 0
#endif
// Diagnostics only (-DK3_MLA_WG_PROBE_CLOCK=1): the probe's tile-wait word holds instead thread 0's clock
// cycles from its first tile landing to the loop's end, so that cycles / (loop_end - first) is the SM clock.
#ifndef K3_MLA_WG_PROBE_CLOCK
#define K3_MLA_WG_PROBE_CLOCK 0
#endif



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
K3_DEVICE void wg_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }  // all but the last group
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
// block reads the same 18 KB: 16-byte loads from 128 threads of every SM cost ~1.2 us here (H200,
// data-only build), the boxes do not.
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

// Diagnostics only: built with -DK3_MLA_WG_BULK_TILE=1, a tile arrives as ONE bulk copy of its 64
// contiguous rows (73,728 bytes, no tensor map): the stream of the row layout, in the wrong shared
// layout for wgmma (outputs meaningless; timing only: is the 9-box TMA stream the cost?).
#ifndef K3_MLA_WG_BULK_TILE
#define K3_MLA_WG_BULK_TILE 0
#endif

// Thread 0: tile at row `row` into `stage` (9 boxes), completing on `bar`.
K3_DEVICE void wg_issue(const Args& a, const void* map, int row, uint32_t stage, uint32_t bar) {
  mbar_expect_tx(bar, (uint32_t)WG_STAGE);
#if K3_MLA_WG_BULK_TILE
  bulk_copy(stage, a.kv + (long long)row * D, (uint32_t)WG_STAGE, bar);
#else
#pragma unroll
  for (int i = 0; i < WG_BOXES; ++i) tma_box(stage + i * WG_BOX, map, 64 * i, row, bar);
#endif
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
  const unsigned long long t_start = a.probe != nullptr ? now_ns() : 0ull;
  unsigned long long t_first = 0ull;
  long long wait_cycles = 0;
  const long long c_start = a.probe != nullptr ? clock64() : 0;

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
    for (int i = 0; i < (K3_MLA_WG_COMPUTE_ONLY ? 1 : WG_STAGES) && i < ntiles; ++i)
      wg_issue(a, &map, wg_row(a, b, start + i * WG_BN), stages + i * WG_STAGE, bars + 8 * i);
  }
  // thread 0 (probe): cycles from its start until the first tiles were requested
  const long long issue_cycles = a.probe != nullptr ? clock64() - c_start : 0;
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
    const int st = K3_MLA_WG_COMPUTE_ONLY ? 0 : j % WG_STAGES;
    const uint32_t stage = stages + st * WG_STAGE;
    // the row of the tile that will refill this stage, read now: its latency hides behind this tile
    const int refill_row = (tid == 0 && j + WG_STAGES < ntiles) ? wg_row(a, b, start + (j + WG_STAGES) * WG_BN) : 0;
    const long long c0 = a.probe != nullptr ? clock64() : 0;
    if (!K3_MLA_WG_COMPUTE_ONLY || j == 0) mbar_wait(bars + 8 * st, (uint32_t)((j / WG_STAGES) & 1));
    if (a.probe != nullptr) {  // thread 0's clock cycles waiting for tiles after the first
      if (j == 0) {
        t_first = now_ns();
        if (K3_MLA_WG_PROBE_CLOCK) wait_cycles = -clock64();  // the loop's cycles from here (see the flag)
      } else if (!K3_MLA_WG_PROBE_CLOCK) {
        wait_cycles += clock64() - c0;
      }
    }
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
    if (K3_MLA_WG_DATA_ONLY) {
      __syncthreads();
      if (tid == 0 && j + WG_STAGES < ntiles) wg_issue(a, &map, refill_row, stage, bars + 8 * st);
      continue;
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
    if (tid == 0 && j + WG_STAGES < ntiles && !K3_MLA_WG_COMPUTE_ONLY)
      wg_issue(a, &map, refill_row, stage, bars + 8 * st);
  }

  const unsigned long long t_loop = a.probe != nullptr ? now_ns() : 0ull;
  if (K3_MLA_WG_PROBE_CLOCK && a.probe != nullptr) wait_cycles += clock64();
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
    // 8 consecutive columns, whole 32-byte sectors (staged through shared memory it took longer:
    // commit dd95d29, 0.1-0.6 us; profiles/nvidia-h200/mla_padding/extra/direct_store_dd95d29.json)
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
    if (NT == 1 && a.probe != nullptr && tid == 0)
      write_probe(a, b, split, t_start, t_first, t_loop, ntiles, wait_cycles, issue_cycles);
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
  if (NT == 1 && a.probe != nullptr && tid == 0)
    write_probe(a, b, split, t_start, t_first, t_loop, ntiles, wait_cycles, issue_cycles);
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

#ifndef K3_MLA_WG_PROMOTION  // diagnostics: -DK3_MLA_WG_PROMOTION=CU_TENSOR_MAP_L2_PROMOTION_NONE etc.
#define K3_MLA_WG_PROMOTION CU_TENSOR_MAP_L2_PROMOTION_L2_128B
#endif
inline int wg_make_map(CUtensorMap* map, const void* base, long long rows) {
  PFN_cuTensorMapEncodeTiled_v12000 encode = wg_encoder();
  if (encode == nullptr) return -6;
  const cuuint64_t dims[2] = {(cuuint64_t)D, (cuuint64_t)rows};
  const cuuint64_t strides[1] = {(cuuint64_t)ROW_BYTES};
  const cuuint32_t box[2] = {64, (cuuint32_t)WG_BN};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, K3_MLA_WG_PROMOTION,
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
