// mla_cluster.h: the wgmma split kernel's merge without a second kernel (merge 'cluster'), included
// by mla_decode.cu in its CUDA build, before mla_wgmma.h (which calls wg_cluster_finish).
//
// Why. With the merge kernel, the H200's timeline at 32K showed ~0.7-1.7 us between the last piece's
// end and the merge's start (the dependent launch waiting for the whole grid) and ~2.3 us of merge:
// 128 pieces x 12 heads x 512 fp32 columns (3.1 MB) written to and read back from L2, with a few
// dependent L2 round trips per merge block. Here the blocks of a request are launched in clusters
// of C (4, 8 or 16) consecutive pieces, and:
//   1. each block leaves its normalised piece [16 x 512] fp32 and base-2 log-sum-exps in its own
//      shared memory; after one cluster barrier, block `rank` of the cluster combines the C pieces
//      for the value columns [rank * 512 / C, (rank + 1) * 512 / C) by reading its peers' shared
//      memory (distributed shared memory, ld.shared::cluster): C times fewer partials reach L2;
//   2. with one cluster per request that is the result; otherwise the block writes its column slice
//      of the cluster's partial, and the last block (of all the request's clusters) to finish a slice
//      merges that slice from L2: a counter per (request, slice) in global memory, incremented after
//      a memory fence, says which block is last (no block ever waits for another), and the last
//      block sets it back to zero for the next launch.
// So the only waiting is the cluster barrier among blocks that run together, and the last slice's
// merge reads ncl x heads x 512 / C floats (49 KB at 128 pieces in clusters of 8).
// The counters make a plan single-stream: two launches of one plan must not overlap in time.

namespace k3mla {

constexpr int MAX_CLUSTER_PIECES = 1024;  // clusters per request in merge 'cluster' (the last block's weight table)

// Host check of merge 'cluster''s sizes: off (cluster 0 or 1), or 2..16 blocks dividing the pieces, at
// most MAX_CLUSTER_PIECES clusters per request, counters given when there is more than one.
inline bool wg_cluster_ok(const Args& a) {
  if (a.cluster <= 1) return true;
  if (a.cluster > 16 || DV % (4 * a.cluster) != 0 || a.splits % a.cluster != 0) return false;
  const int ncl = a.splits / a.cluster;
  return ncl <= MAX_CLUSTER_PIECES && (ncl == 1 || a.counters != nullptr);
}

#if defined(K3_MLA_SM90)
K3_DEVICE int cluster_rank() {
  int r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
K3_DEVICE void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
K3_DEVICE void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// the address of the same shared-memory variable in block `rank` of this cluster
K3_DEVICE uint32_t peer_addr(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
K3_DEVICE float peer_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
K3_DEVICE float4 peer_f32x4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr)
               : "memory");
  return v;
}

// Thread h < heads: turn w[0..n) (base-2 log-sum-exps of n pieces of head h, stride `step`) into the
// pieces' normalised weights in place; returns the combined base-2 log-sum-exp.
K3_DEVICE float lse_weights(float* w, int n, int step) {
  float m = -INFINITY;
  for (int p = 0; p < n; ++p) m = fmaxf(m, w[p * step]);
  const float mu = m == -INFINITY ? 0.f : m;
  float d = 0.f;
  for (int p = 0; p < n; ++p) {
    const float e = exp2f(w[p * step] - mu);
    w[p * step] = e;
    d += e;
  }
  const float r = d > 0.f ? 1.f / d : 0.f;
  for (int p = 0; p < n; ++p) w[p * step] *= r;
  return d > 0.f ? mu + __log2f(d) : -INFINITY;
}

K3_DEVICE void fma4(float4& acc, float w, const float4 v) {
  acc.x += w * v.x;
  acc.y += w * v.y;
  acc.z += w * v.z;
  acc.w += w * v.w;
}

K3_DEVICE void store_bf16x4(k3_bf16* dst, const float4 v) {
  const uint32_t lo = (uint32_t)k3_f32_to_bf16(v.x) | ((uint32_t)k3_f32_to_bf16(v.y) << 16);
  const uint32_t hi = (uint32_t)k3_f32_to_bf16(v.z) | ((uint32_t)k3_f32_to_bf16(v.w) << 16);
  *reinterpret_cast<uint2*>(dst) = make_uint2(lo, hi);
}

// The end of a piece in merge 'cluster' (all 128 threads of every block of the cluster call it).
// ob: this block's normalised piece in shared memory, [16 heads][opitch] fp32; plse: its 16 base-2
// log-sum-exps; tab: free shared memory (16 C + 32 + 16 ncl floats) for weights and flags.
K3_DEVICE void wg_cluster_finish(const Args& a, uint32_t ob, int opitch, uint32_t plse, float* tab, int b, int split,
                                 int tid) {
  const int C = a.cluster, H = a.heads, rank = cluster_rank();
  const int cols = DV / C, ncl = a.splits / C, cl = split / C, quads = cols / 4;
  cluster_arrive();
  cluster_wait();  // every block of the cluster has its piece in shared memory
  for (int i = tid; i < C * ROWS; i += 128) tab[i] = peer_f32(peer_addr(plse + 4 * (i % ROWS), i / ROWS));
  __syncthreads();
  float* cl_lse = tab + C * ROWS;  // [16] the cluster's combined log-sum-exps (base 2)
  if (tid < H) cl_lse[tid] = lse_weights(tab + tid, C, ROWS);
  __syncthreads();
  for (int u = tid; u < H * quads; u += 128) {
    const int h = u / quads, col = rank * cols + 4 * (u % quads);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int p = 0; p < C; ++p) fma4(acc, tab[p * ROWS + h], peer_f32x4(peer_addr(ob + 4 * (h * opitch + col), p)));
    if (ncl == 1) store_bf16x4(a.out + (long long)b * a.o_sb + (long long)h * a.o_sh + col, acc);
    else *reinterpret_cast<float4*>(a.part_o + (((long long)b * H + h) * ncl + cl) * DV + col) = acc;
  }
  if (ncl == 1 && rank == 0 && tid < H) a.lse[(long long)b * a.l_sb + tid] = cl_lse[tid] * 0.6931471805599453f;
  // every rank keeps its own copy of the cluster's lse, so a slice's last block needs only its slice's counter
  if (ncl > 1 && tid < H) a.part_lse[(((long long)b * C + rank) * H + tid) * ncl + cl] = cl_lse[tid];
  cluster_arrive();  // done with the peers' shared memory (they wait for this before exiting)
  if (ncl > 1) {
    int* last = reinterpret_cast<int*>(cl_lse + ROWS);
    __threadfence();  // this block's slice is visible device-wide before it is counted
    __syncthreads();
    unsigned int* counter = a.counters + (long long)b * C + rank;
    if (tid == 0) *last = atomicAdd(counter, 1u) == (unsigned int)(ncl - 1);
    __syncthreads();
    if (*last) {  // every cluster has written this slice: merge it from L2
      __threadfence();
      float* w = cl_lse + 2 * ROWS;  // [H][ncl]
      const float* pl = a.part_lse + ((long long)b * C + rank) * H * ncl;
      for (int i = tid; i < H * ncl; i += 128) w[i] = __ldcg(pl + i);
      __syncthreads();
      if (tid < H) {
        const float ls = lse_weights(w + tid * ncl, ncl, 1);
        if (rank == 0) a.lse[(long long)b * a.l_sb + tid] = ls * 0.6931471805599453f;
      }
      __syncthreads();
      for (int u = tid; u < H * quads; u += 128) {
        const int h = u / quads, col = rank * cols + 4 * (u % quads);
        const float* part = a.part_o + ((long long)b * H + h) * ncl * DV + col;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8  // independent loads in flight together
        for (int k = 0; k < ncl; ++k) fma4(acc, w[h * ncl + k], __ldcg(reinterpret_cast<const float4*>(part + (long long)k * DV)));
        store_bf16x4(a.out + (long long)b * a.o_sb + (long long)h * a.o_sh + col, acc);
      }
      if (tid == 0) *counter = 0u;  // every cluster has counted: ready for the next launch
    }
  }
  cluster_wait();  // the peers are done reading this block's shared memory
}
#endif

}  // namespace k3mla
