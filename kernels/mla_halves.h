// mla_halves.h: the MLA decode's split kernel as two teams of four warps, each warp owning half of a
// tile's positions and half of its columns (form 'halves'); included by mla_decode.cu in its CUDA build
// only (it uses that file's Args, tile ring helpers, softmax pieces and partial layout).
//
// Why. On the H200 the data path of the mma.sync split kernel (32-row tiles by bulk copy, five
// stages) reads the 128K cache at 96% of the copy bandwidth with its arithmetic removed, but the
// kernel is compute-bound (one warp per SM sub-partition, each of four warps redoing the tile's
// softmax). The team kernel gave every sub-partition two warps but held two of five stages while
// computing. Here:
//   * warp (team, ph, kh) scores positions half ph of its team's tile over columns half kh
//     (18 k-steps, two n-tiles), trades that partial with its partner (kh ^ 1) through 1 KB of
//     shared memory, and runs its own online softmax over its 16 positions: no max is shared, and no
//     warp exponentiates positions another warp already did;
//   * its value product is its 16 positions (one k-step) times value columns half kh (32 n-tiles), so
//     P never leaves its registers; the four (team, ph) states per column are combined once, at the end;
//   * with 1 KB of exchange per warp the ring holds six 37 KB stages: while each team computes a tile,
//     four stream (the probe ring's depth).
// Rows past a request's length are never read (the copies stop there, the rest is zero-filled).
//
// Measured on an H200 (commit fe78661, graph replay, paged, same run as the other forms;
// profiles/nvidia-h200/mla_padding/extra/halves_fe78661.json): right on every GPU test (146 passed,
// 50 graph replays at 128K included), and the fastest form at 64 x 8K with 3 pieces a request, 1.45
// waves (184.1 us, 77% of the copy bandwidth; split kernel 217.5, wgmma 199.6; in one wave of pieces,
// commit 083abc8, the three are level: 164.4 / 164.8 / 167.6 us), but slower at B = 1 (1K 9.1, 32K 22.3, 128K 49.7 us
// against the split kernel's 7.0 / 19.9 / 47.4), where each block streams only 8 to 32 tiles and
// the end-of-piece combine of four states (~100 KB through shared memory) and the last tile's
// single-team compute are not amortised. Opt-in (form='halves'); form='auto' does not pick it.

namespace k3mla {

constexpr int HSTAGES = 6;           // ring depth: each team holds one tile, four stream
constexpr int HWARPS = 8;            // warp = 4 team + 2 ph + kh
constexpr int HTHREADS = HWARPS * 32;
constexpr int HKS = D / 16 / 2;      // 18 k-steps: a warp's half of the score product's columns
constexpr int HVNT = DV / 8 / 2;     // 32 value n-tiles: a warp's half of the value columns
constexpr int HXCH = 2 * 32 * 16;    // one warp's partial scores: 2 n-tiles x 32 lanes x float4 = 1 KB
constexpr int halves_smem_bytes() { return HSTAGES * STAGE_BYTES + HWARPS * HXCH + HSTAGES * 8; }

__global__ void __launch_bounds__(HTHREADS, 1) halves_kernel(const Args a) {
  extern __shared__ __align__(128) unsigned char smem[];
#if defined(K3_MLA_SM90)
  const int split = blockIdx.x, b = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int team = warp >> 2, ph = (warp >> 1) & 1, kh = warp & 1;
  const int g = lane >> 2, t4 = lane & 3;
  launch_dependents();  // the merge may launch now; it waits for this grid
  const uint32_t stages = smem_u32(smem);
  float4* xch = reinterpret_cast<float4*>(smem + HSTAGES * STAGE_BYTES);  // [warp][n-tile][lane]
  const uint32_t full = smem_u32(smem + HSTAGES * STAGE_BYTES + HWARPS * HXCH);
  const int length = __ldg(a.lengths + b);
  const int start = split * a.chunk;
  const int end = min(length, start + a.chunk);
  const int ntiles = end > start ? (end - start + BN - 1) / BN : 0;
  int base = -1, page_l = 0;  // the fetching warp's page window
  if (tid == 0) {
    for (int s = 0; s < HSTAGES; ++s) mbar_init(full + 8 * s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // warp 0 fills the ring in tile order (tile i: stage i % 6, team i % 2: each team keeps its own three stages)
  if (warp == 0)
    for (int i = 0; i < HSTAGES && i < ntiles; ++i)
      warp_fetch(a, b, start + i * BN, end, stages + i * STAGE_BYTES, full + 8 * i, base, page_l, lane);

  uint32_t qf[HKS][4];
  load_query<HKS>(a, b, kh * HKS, g, t4, qf);
  // ldmatrix lane addresses (stage-relative), as in split_kernel: scores, K as B: matrices (n-tile 2 ph +
  // mi / 2, k half mi % 2); values, V as B transposed: (k half mi % 2 = n-tile 2 ph + mi % 2, value
  // n-tile 2 np + mi / 2). A tile's position order is split_kernel's (n-tile nt, row i: position 4 i + nt).
  const int mi = lane >> 3, r8 = lane & 7;
  const uint32_t k_lane = (uint32_t)(r8 * BPITCH + (2 * ph + (mi >> 1)) * ROW_BYTES + (kh * 2 * HKS + (mi & 1)) * 16);
  const uint32_t v_lane = (uint32_t)(r8 * BPITCH + (2 * ph + (mi & 1)) * ROW_BYTES + (kh * HVNT + (mi >> 1)) * 16);

  float acc[HVNT][4];  // o for rows g, g + 8 and value columns 256 kh .. 256 kh + 255, this warp's positions
#pragma unroll
  for (int i = 0; i < HVNT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  for (int j = team; j < ntiles; j += 2) {
    const int st = j % HSTAGES;
    const uint32_t stage = stages + st * STAGE_BYTES;
    mbar_wait(full + 8 * st, (uint32_t)((j / HSTAGES) & 1));
    // this warp's half of the scores of its 16 positions (two accumulators per n-tile: shorter chains)
    float t[2][2][4] = {};
#pragma unroll
    for (int kk = 0; kk < HKS; ++kk) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4(stage + k_lane + kk * 32, b0, b1, b2, b3);
      mma_bf16(t[kk & 1][0], qf[kk], b0, b1);
      mma_bf16(t[kk & 1][1], qf[kk], b2, b3);
    }
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] = t[0][nt][e] + t[1][nt][e];
      xch[(warp * 2 + nt) * 32 + lane] = make_float4(s[nt][0], s[nt][1], s[nt][2], s[nt][3]);
    }
    named_sync(1 + team, 128);  // the team's partials are published
    const int tile_pos = start + j * BN;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const float4 o = xch[((warp ^ 1) * 2 + nt) * 32 + lane];
      const float other[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        // both partners add the two halves in the same order (columns half 0 first): identical scores
        float v = (kh == 0 ? s[nt][e] + other[e] : other[e] + s[nt][e]) * a.scale_log2;
        if (tile_pos + 8 * t4 + 4 * (e & 1) + 2 * ph + nt >= end) v = -INFINITY;
        s[nt][e] = v;
      }
    }
    uint32_t pf[1][4];  // p as the value product's A fragment: this warp's 16 positions are one k-step
    online_softmax<2, HVNT>(s, m0, m1, l0, l1, pf, acc);
#pragma unroll
    for (int np = 0; np < HVNT / 2; ++np) {
      uint32_t b0, b1, b2, b3;
      ldsm_x4_t(stage + v_lane + np * 32, b0, b1, b2, b3);
      mma_bf16(acc[2 * np], pf[0], b0, b1);
      mma_bf16(acc[2 * np + 1], pf[0], b2, b3);
    }
    named_sync(1 + team, 128);  // the team is done with this stage and its partials: refill the stage
    if ((warp & 3) == 0 && j + HSTAGES < ntiles)
      warp_fetch(a, b, start + (j + HSTAGES) * BN, end, stage, full + 8 * st, base, page_l, lane);
  }

  // the four (team, ph) states of each column half meet in warps 0 and 1 (the ring is free now)
  __syncthreads();
  float4* hand = reinterpret_cast<float4*>(smem);
  if (warp >= 2) {
    float4* mine = hand + ((warp - 2) * 32 + lane) * (HVNT + 1);
#pragma unroll
    for (int i = 0; i < HVNT; ++i) mine[i] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    mine[HVNT] = make_float4(m0, m1, l0, l1);
  }
  __syncthreads();
  if (warp >= 2) return;
  float M0 = m0, M1 = m1;
#pragma unroll
  for (int w = 1; w < 4; ++w) {
    const float4 st = hand[((warp + 2 * w - 2) * 32 + lane) * (HVNT + 1) + HVNT];
    M0 = fmaxf(M0, st.x);
    M1 = fmaxf(M1, st.y);
  }
  const float U0 = M0 == -INFINITY ? 0.f : M0, U1 = M1 == -INFINITY ? 0.f : M1;
  const float c0 = fast_exp2(m0 - U0), c1 = fast_exp2(m1 - U1);
  l0 *= c0;
  l1 *= c1;
#pragma unroll
  for (int i = 0; i < HVNT; ++i) {
    acc[i][0] *= c0;
    acc[i][1] *= c0;
    acc[i][2] *= c1;
    acc[i][3] *= c1;
  }
#pragma unroll
  for (int w = 1; w < 4; ++w) {  // warps kh + 2, kh + 4, kh + 6: the same column half, other positions
    const float4* other = hand + ((warp + 2 * w - 2) * 32 + lane) * (HVNT + 1);
    const float4 st = other[HVNT];
    const float d0 = fast_exp2(st.x - U0), d1 = fast_exp2(st.y - U1);
    l0 += st.z * d0;
    l1 += st.w * d1;
#pragma unroll
    for (int i = 0; i < HVNT; ++i) {
      const float4 v = other[i];
      acc[i][0] += v.x * d0;
      acc[i][1] += v.y * d0;
      acc[i][2] += v.z * d1;
      acc[i][3] += v.w * d1;
    }
  }
  store_piece<HVNT>(a, acc, M0, M1, l0, l1, b, split, kh, g, t4);
#endif  // K3_MLA_SM90
}

inline int launch_halves(const Args& a, int max_shared, cudaStream_t st) {
  const int bytes = halves_smem_bytes();
  if (bytes > max_shared) return -3;
  static bool configured = false;
  if (!configured) {
    const cudaError_t e = cudaFuncSetAttribute(halves_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return (int)e;
    configured = true;
  }
  halves_kernel<<<dim3(a.splits, a.B), HTHREADS, bytes, st>>>(a);
  return (int)cudaGetLastError();
}

}  // namespace k3mla
