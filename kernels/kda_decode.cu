// kda_decode.cu: Kimi K3's single-token KDA step in one launch (seed section 3).
//
// Replaces the unfused chain (conv kernel, norm/gates/recurrence kernel, output-norm kernel and two
// copies). One launch does, for every (sequence b, head h):
//   1. short conv (kernel 4) + SiLU of the projected q, k, v, reading and rolling the conv states;
//   2. q, k <- x / sqrt(sum x^2 + 1e-6); q *= scale (K^-0.5);
//   3. g = lower_bound * sigmoid(exp(A_log[h]) * (g_raw + dt_bias)); beta = sigmoid(b_raw);
//   4. S <- diag(exp g) S;  u = S^T k;  S <- S + k (beta (v - u))^T;  o = S^T q   (S: fp32, K x V)
//   5. out = RMSNorm_V(o) * o_norm * sigmoid(gate), written as bf16 straight into the caller's buffer.
// The conv states and S go back to device memory for the next token; nothing else leaves the chip.
//
// One pass over S: o = S_new^T q = S_dec^T q + delta (k . q), with delta = beta (v - S_dec^T k),
// so the two reductions over K (u and S_dec^T q) share one read of S_dec, then S_new is written.
//
// Work split: a block owns one (b, h, slice of W value columns); with W < V several blocks share a
// head (so B = 1 with 12 heads still spreads over the GPU). Each recomputes the head's q/k vectors
// (cheap, L2-resident) instead of waiting for another launch. The output RMSNorm needs all V
// outputs of the head, so the blocks of a head exchange one number, their partial sum of o^2:
//   * cluster mode (CUDA, Hopper and later): the head's blocks form a thread-block cluster; each
//     pushes its partial sum into every peer's shared memory (distributed shared memory) and arrives
//     on a split cluster barrier, stores its slice of S while the barrier completes, then waits and
//     normalises. No memory round trip, and no barrier at exit (nothing reads a peer after it);
//   * atomic mode (portable, e.g. HIP): each block publishes its o slice to a workspace; the last
//     block of the head to arrive (an atomic counter) normalises all V and resets the counter.
// Either way the q/k conv states are rolled by one block once every sibling has read them.
//
// Layouts: per-token inputs are bf16 rows [B, X] with a row stride (last dim contiguous), so views
// of one packed projection output work. Conv states [B, H*K, 3] bf16 per q, k, v (channel c's last
// three inputs contiguous, oldest first; the k3lab.nn.KDACache layout). State fp32 [B, H, K, V]
// (state_vk = 0, fla's default) or [B, H, V, K] (state_vk = 1), batch stride given.
//
// Configurations (K3_KDA_CONFIGS): whole heads (128 columns, 256 threads) and split heads of 32 or 16
// columns (128 threads); k3lab.ops.kda_decode.cuda picks one from the device. Figures: docs/kda_decode.md.
// Single source for CUDA and HIP through k3lab_portability.h; warp width, shared-memory limit and
// unit counts come from the caller. The HIP build is not yet run on AMD hardware by this project.
#include "k3lab_portability.h"
#if defined(K3_CUDA)
#include <cooperative_groups.h>
#endif

namespace k3kda {

constexpr int HK = 128;    // key head dim (K3: 128)
constexpr int HV = 128;    // value head dim (K3: 128)
constexpr int CONV_T = 3;  // inputs kept per channel: conv kernel 4 - 1
constexpr float L2_EPS = 1e-6f;

struct Args {
  // per-token inputs, bf16 rows: q, k, v are the projections before the conv
  const k3_bf16* q;
  const k3_bf16* k;
  const k3_bf16* v;
  const k3_bf16* g_raw;  // [B, H*K] f_b(f_a x), before dt_bias
  const k3_bf16* b_raw;  // [B, H]   b_proj x
  const k3_bf16* gate;   // [B, H*V] g_proj x
  long long q_rs, k_rs, v_rs, g_rs, b_rs, gate_rs;
  // conv states, updated in place
  k3_bf16* conv_q;
  k3_bf16* conv_k;
  k3_bf16* conv_v;
  long long conv_q_bs, conv_k_bs, conv_v_bs;
  // weights (fp32, prepared once)
  const float* w_q;  // [H*K, 4]; column 3 multiplies the current token
  const float* w_k;
  const float* w_v;
  const float* A_log;    // [H]
  const float* dt_bias;  // [H*K]
  const float* o_norm;   // [V]
  // recurrent state, updated in place
  float* state;
  long long state_bs;
  // output
  k3_bf16* out;
  long long out_rs;
  // workspace for atomic mode: counters [B*H] (zero, left zero), o_part [B*H*V]
  int* counters;
  float* o_part;
  int B, H;
  float lower_bound, eps, scale;
  int warp_size;       // checked by the launcher; the kernel reduces in aligned 32-lane groups
  int hints;           // bit 0: streaming loads of S, bit 1: streaming stores of S, bit 2: L2 prefetch
  int prefetch_ahead;  // blocks ahead (in launch order) whose state slice bit 2 prefetches
};

enum Mode { WHOLE_HEAD = 0, SPLIT_ATOMIC = 1, SPLIT_CLUSTER = 2 };

template <int W, int NT>
struct Smem {
  float q[HK], k[HK], dec[HK];  // conv+SiLU q and k (not yet normalised), exp(g)
  float v[W], delta[W];
  float gate[HV], o[HV];        // sigmoid(gate) * o_norm, and the outputs before the norm
  float ru[(NT / 32) * W], rw[(NT / 32) * W];  // partial S^T k and S^T q per 32-lane group
  float red[3][NT / 32];        // per-group partial sums
  float o2s[8];                 // cluster mode: every block's sum of o^2, pushed here by each block
  float beta;
  int last;
};

K3_DEVICE float4 f4_mul(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }
K3_DEVICE float f4_dot(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Causal depthwise conv over [s0, s1, s2, x] with weights w (w.w multiplies x), then SiLU.
K3_DEVICE float conv_silu(const k3_bf16 (&x)[4], float4 w) {
  float y = w.x * k3_bf16_to_f32(x[0]) + w.y * k3_bf16_to_f32(x[1]) + w.z * k3_bf16_to_f32(x[2]) +
            w.w * k3_bf16_to_f32(x[3]);
  return y / (1.0f + expf(-y));
}

K3_DEVICE void roll(k3_bf16* st, const k3_bf16 (&x)[4]) {  // [s0, s1, s2] <- [s1, s2, x]
#pragma unroll
  for (int t = 0; t < CONV_T; ++t) st[t] = x[t + 1];
}

template <int NG>
K3_DEVICE float sum_groups(const float (&red)[NG]) {
  float t = 0.f;
#pragma unroll
  for (int g = 0; g < NG; ++g) t += red[g];
  return t;
}

template <int W, int NT, bool VK, int MODE>
__global__ void __launch_bounds__(NT) kda_decode_kernel(const Args a) {
  constexpr int NS = HV / W;            // blocks sharing one head
  constexpr int NF4 = 32 * W / NT;      // float4 of state per thread
  constexpr int NG = NT / 32;           // 32-lane groups per block
  static_assert(HV % W == 0 && W % 4 == 0 && W <= 128, "slice width");
  static_assert(NT % 32 == 0 && (32 * W) % NT == 0 && NF4 >= 1, "threads per block");
  static_assert((MODE == WHOLE_HEAD) == (NS == 1), "a whole head per block, or a split mode");
  static_assert(MODE != SPLIT_CLUSTER || NS <= 8, "a cluster of at most 8 blocks (sm.o2s)");
  // 'kv' mapping: CG threads across the W columns (4 each), RG row groups
  constexpr int CG = W / 4;
  constexpr int RG = NT / CG;
  static_assert(VK || (CG <= 32 && NT % CG == 0 && HK % RG == 0), "kv mapping");
  // 'vk' mapping: 8 threads along K (4 float4 each), CPP columns per pass, NC columns per thread
  constexpr int CPP = NT / 8;
  constexpr int NC = VK ? W / CPP : 1;
  static_assert(!VK || (W % CPP == 0 && NC * 4 == NF4), "vk mapping");
  constexpr int QK_IT = (HK + NT - 1) / NT;
  constexpr int V_IT = (W + NT - 1) / NT;
  constexpr int G_IT = (HV + NT - 1) / NT;

  __shared__ __align__(16) Smem<W, NT> sm;

  const int tid = threadIdx.x;
  const int slice = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int v0 = slice * W;
  const int grp = tid >> 5;
  const bool grp_lead = (tid & 31) == 0;
#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  // Phase 1 of the cluster barrier: "this block has started". Waited on just before the first write
  // into a peer's shared memory, long after every peer has arrived, so it costs no round trip.
  if (MODE == SPLIT_CLUSTER) k3_cluster_arrive_relaxed();
#endif

  // ---- 1. every per-token input this block needs, loaded before any is used (one round trip);
  // issued first because the conv/norm work waits on them, the state only later
  const k3_bf16* xq = a.q + (long long)b * a.q_rs + h * HK;
  const k3_bf16* xk = a.k + (long long)b * a.k_rs + h * HK;
  const k3_bf16* xv = a.v + (long long)b * a.v_rs + h * HV + v0;
  k3_bf16* cq = a.conv_q + (long long)b * a.conv_q_bs + (long long)h * HK * CONV_T;
  k3_bf16* ck = a.conv_k + (long long)b * a.conv_k_bs + (long long)h * HK * CONV_T;
  k3_bf16* cv = a.conv_v + (long long)b * a.conv_v_bs + (long long)(h * HV + v0) * CONV_T;
  const float4* wq = reinterpret_cast<const float4*>(a.w_q) + h * HK;
  const float4* wk = reinterpret_cast<const float4*>(a.w_k) + h * HK;
  const float4* wv = reinterpret_cast<const float4*>(a.w_v) + h * HV + v0;

  k3_bf16 lq[QK_IT][4], lk[QK_IT][4];  // [s0, s1, s2, x] per channel
  float4 lwq[QK_IT], lwk[QK_IT];
  float lg[QK_IT], lbias[QK_IT];
#pragma unroll
  for (int it = 0; it < QK_IT; ++it) {
    const int d = min(tid + it * NT, HK - 1);  // clamped: loads stay unconditional
#pragma unroll
    for (int t = 0; t < CONV_T; ++t) {
      lq[it][t] = cq[d * CONV_T + t];
      lk[it][t] = ck[d * CONV_T + t];
    }
    lq[it][3] = xq[d];
    lk[it][3] = xk[d];
    lwq[it] = wq[d];
    lwk[it] = wk[d];
    lg[it] = k3_bf16_to_f32(a.g_raw[(long long)b * a.g_rs + h * HK + d]);
    lbias[it] = a.dt_bias[h * HK + d];
  }
  k3_bf16 lv[V_IT][4];
  float4 lwv[V_IT];
#pragma unroll
  for (int it = 0; it < V_IT; ++it) {
    const int i = min(tid + it * NT, W - 1);
#pragma unroll
    for (int t = 0; t < CONV_T; ++t) lv[it][t] = cv[i * CONV_T + t];
    lv[it][3] = xv[i];
    lwv[it] = wv[i];
  }
  float lgate[G_IT], lnorm[G_IT];
#pragma unroll
  for (int it = 0; it < G_IT; ++it) {
    const int i = min(tid + it * NT, HV - 1);
    lgate[it] = k3_bf16_to_f32(a.gate[(long long)b * a.gate_rs + h * HV + i]);
    lnorm[it] = a.o_norm[i];
  }
  const float A = a.A_log[h];
  const float braw = k3_bf16_to_f32(a.b_raw[(long long)b * a.b_rs + h]);

  // ---- 2. the state slice: in flight during the vector work below
  float* S = a.state + (long long)b * a.state_bs + (long long)h * HK * HV;
  float4 s[NF4];
  const int kv_tv = tid % CG, kv_tk = tid / CG;  // 'kv' mapping
  const int vk_l = tid % 8, vk_vg = tid / 8;     // 'vk' mapping
  auto s_index = [&](int j) -> long long {
    if (VK) {
      const int col = v0 + vk_vg + CPP * (j / 4);
      const int kq = vk_l + 8 * (j % 4);
      return (long long)col * HK + 4 * kq;
    } else {
      const int row = kv_tk + RG * j;
      return (long long)row * HV + v0 + 4 * kv_tv;
    }
  };
  if (a.hints & 1) {
#pragma unroll
    for (int j = 0; j < NF4; ++j) s[j] = k3_load_stream(reinterpret_cast<const float4*>(S + s_index(j)));
  } else {
#pragma unroll
    for (int j = 0; j < NF4; ++j) s[j] = *reinterpret_cast<const float4*>(S + s_index(j));
  }
  if (a.hints & 4) {
    // Warm L2 with the slice of a block `prefetch_ahead` places later in launch order, so DRAM keeps
    // streaming while resident blocks compute (large batches; a no-op where unsupported).
    const long long total = (long long)NS * a.H * a.B;
    const long long lin = slice + NS * ((long long)h + (long long)a.H * b) + a.prefetch_ahead;
    if (lin < total) {
      const int s2 = (int)(lin % NS), h2 = (int)((lin / NS) % a.H);
      const long long b2 = lin / ((long long)NS * a.H);
      const float* S2 = a.state + b2 * a.state_bs + (long long)h2 * HK * HV;
      if (VK || NS == 1) {
        if (tid == 0) k3_prefetch_l2(S2 + (long long)s2 * W * HK, W * HK * 4);
      } else {
        for (int r = tid; r < HK; r += NT) k3_prefetch_l2(S2 + (long long)r * HV + s2 * W, W * 4);
      }
    }
  }

  // ---- 3. conv + SiLU, gates; q/k norms and q.k reduced over the head
  float pqq = 0.f, pkk = 0.f, pqk = 0.f;
  const float expA = expf(A);
#pragma unroll
  for (int it = 0; it < QK_IT; ++it) {
    const int d = tid + it * NT;
    if (d < HK) {
      const float yq = conv_silu(lq[it], lwq[it]);
      const float yk = conv_silu(lk[it], lwk[it]);
      sm.q[d] = yq;
      sm.k[d] = yk;
      pqq += yq * yq;
      pkk += yk * yk;
      pqk += yq * yk;
      const float z = expA * (lg[it] + lbias[it]);
      sm.dec[d] = expf(a.lower_bound * k3_sigmoid(z));
      if (MODE == WHOLE_HEAD) {  // sole reader of these conv states: roll them now
        roll(cq + d * CONV_T, lq[it]);
        roll(ck + d * CONV_T, lk[it]);
      }
    }
  }
#pragma unroll
  for (int it = 0; it < V_IT; ++it) {
    const int i = tid + it * NT;
    if (i < W) sm.v[i] = conv_silu(lv[it], lwv[it]);
  }
#pragma unroll
  for (int it = 0; it < G_IT; ++it) {
    const int i = tid + it * NT;
    if (i < HV) sm.gate[i] = k3_sigmoid(lgate[it]) * lnorm[it];
  }
  if (tid == 0) sm.beta = k3_sigmoid(braw);
  pqq = k3_group32_sum(pqq);
  pkk = k3_group32_sum(pkk);
  pqk = k3_group32_sum(pqk);
  if (grp_lead) {
    sm.red[0][grp] = pqq;
    sm.red[1][grp] = pkk;
    sm.red[2][grp] = pqk;
  }
  __syncthreads();
  const float rq = 1.0f / sqrtf(sum_groups(sm.red[0]) + L2_EPS);
  const float rk = 1.0f / sqrtf(sum_groups(sm.red[1]) + L2_EPS);
  const float qscale = rq * a.scale;                // q_n = q * qscale (normalised and scaled)
  const float kq = sum_groups(sm.red[2]) * rk * qscale;  // k_n . q_n
  const float beta = sm.beta;

  // ---- 4. decay S and reduce S_dec^T k, S_dec^T q over K in one pass
  if (VK) {
    float u[NC], w[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) u[c] = w[c] = 0.f;
#pragma unroll
    for (int j = 0; j < NF4; ++j) {
      const int kq4 = vk_l + 8 * (j % 4);
      const float4 d4 = reinterpret_cast<const float4*>(sm.dec)[kq4];
      const float4 k4 = reinterpret_cast<const float4*>(sm.k)[kq4];
      const float4 q4 = reinterpret_cast<const float4*>(sm.q)[kq4];
      s[j] = f4_mul(s[j], d4);
      u[j / 4] += f4_dot(s[j], k4);
      w[j / 4] += f4_dot(s[j], q4);
    }
#pragma unroll
    for (int c = 0; c < NC; ++c) {
#pragma unroll
      for (int off = 1; off < 8; off <<= 1) {  // the 8 lanes along K: aligned groups of 8
        u[c] += k3_shfl_xor(u[c], off);
        w[c] += k3_shfl_xor(w[c], off);
      }
      if (vk_l == 0) {
        const int col = vk_vg + CPP * c;
        sm.ru[col] = u[c] * rk;
        sm.rw[col] = w[c] * qscale;
      }
    }
  } else {
    float4 u4 = make_float4(0.f, 0.f, 0.f, 0.f), w4 = u4;
#pragma unroll
    for (int j = 0; j < NF4; ++j) {
      const int row = kv_tk + RG * j;
      const float d = sm.dec[row], kr = sm.k[row], qr = sm.q[row];
      s[j].x *= d; s[j].y *= d; s[j].z *= d; s[j].w *= d;
      u4.x += s[j].x * kr; u4.y += s[j].y * kr; u4.z += s[j].z * kr; u4.w += s[j].w * kr;
      w4.x += s[j].x * qr; w4.y += s[j].y * qr; w4.z += s[j].z * qr; w4.w += s[j].w * qr;
    }
#pragma unroll
    for (int off = CG; off < 32; off <<= 1) {  // row groups inside an aligned 32-lane group
      u4.x += k3_shfl_xor(u4.x, off); u4.y += k3_shfl_xor(u4.y, off);
      u4.z += k3_shfl_xor(u4.z, off); u4.w += k3_shfl_xor(u4.w, off);
      w4.x += k3_shfl_xor(w4.x, off); w4.y += k3_shfl_xor(w4.y, off);
      w4.z += k3_shfl_xor(w4.z, off); w4.w += k3_shfl_xor(w4.w, off);
    }
    if ((tid & 31) < CG) {
      const int base = grp * W + 4 * kv_tv;
      sm.ru[base + 0] = u4.x; sm.ru[base + 1] = u4.y; sm.ru[base + 2] = u4.z; sm.ru[base + 3] = u4.w;
      sm.rw[base + 0] = w4.x; sm.rw[base + 1] = w4.y; sm.rw[base + 2] = w4.z; sm.rw[base + 3] = w4.w;
    }
  }
  __syncthreads();

  // ---- 5. per column: delta = beta (v - u), o = S_dec^T q + delta (k . q)
  float o2 = 0.f;
  if (tid < W) {
    float u, w;
    if (VK) {
      u = sm.ru[tid];
      w = sm.rw[tid];
    } else {
      u = 0.f;
      w = 0.f;
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        u += sm.ru[g * W + tid];
        w += sm.rw[g * W + tid];
      }
      u *= rk;
      w *= qscale;
    }
    const float delta = beta * (sm.v[tid] - u);
    const float o = w + delta * kq;
    sm.delta[tid] = delta;
    sm.o[v0 + tid] = o;
    o2 = o * o;
    if (MODE == SPLIT_ATOMIC) {
      a.o_part[((long long)b * a.H + h) * HV + v0 + tid] = o;
      __threadfence();  // published before this block's arrival below
    }
  }
  o2 = k3_group32_sum(o2);
  if (grp_lead) sm.red[0][grp] = o2;  // red[0] was last read before the previous barrier
  __syncthreads();

#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  if (MODE == SPLIT_CLUSTER) {
    // Push this block's sum of o^2 into every peer's shared memory, then arrive (release) on phase 2.
    // The round trip of that barrier overlaps the state update and its stores below; nothing reads a
    // peer's shared memory after phase 2, so no block waits for its peers before exiting.
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    k3_cluster_wait();  // phase 1: every peer has started (its shared memory exists)
    if (tid < NS) *cluster.map_shared_rank(&sm.o2s[slice], tid) = sum_groups(sm.red[0]);
    k3_cluster_arrive_release();  // phase 2: my o^2 is in every peer; I have read the conv states
  }
#endif

  // ---- 6. S <- S_dec + k delta^T written back and this block's v conv states rolled. Split heads in
  // cluster mode do it before the output norm, so the stores drain while the cluster barrier's round
  // trip completes; the other modes after it (for the atomic mode, that order spills no registers).
  auto update_state = [&]() {
    if (VK) {
#pragma unroll
      for (int j = 0; j < NF4; ++j) {
        const int kq4 = vk_l + 8 * (j % 4);
        const float4 k4 = reinterpret_cast<const float4*>(sm.k)[kq4];
        const float dl = sm.delta[vk_vg + CPP * (j / 4)] * rk;
        s[j].x += k4.x * dl; s[j].y += k4.y * dl; s[j].z += k4.z * dl; s[j].w += k4.w * dl;
      }
    } else {
      const float4 d4 = reinterpret_cast<const float4*>(sm.delta)[kv_tv];
#pragma unroll
      for (int j = 0; j < NF4; ++j) {
        const float kr = sm.k[kv_tk + RG * j] * rk;
        s[j].x += kr * d4.x; s[j].y += kr * d4.y; s[j].z += kr * d4.z; s[j].w += kr * d4.w;
      }
    }
    if (a.hints & 2) {
#pragma unroll
      for (int j = 0; j < NF4; ++j) k3_store_stream(reinterpret_cast<float4*>(S + s_index(j)), s[j]);
    } else {
#pragma unroll
      for (int j = 0; j < NF4; ++j) *reinterpret_cast<float4*>(S + s_index(j)) = s[j];
    }
#pragma unroll
    for (int it = 0; it < V_IT; ++it) {
      const int i = tid + it * NT;
      if (i < W) roll(cv + i * CONV_T, lv[it]);
    }
  };
  if (MODE == SPLIT_CLUSTER) update_state();

  // ---- 7. gated RMSNorm of the head's V outputs, straight into the caller's bf16 buffer
  k3_bf16* out = a.out + (long long)b * a.out_rs + h * HV;
  if (MODE == WHOLE_HEAD) {
    const float rstd = 1.0f / sqrtf(sum_groups(sm.red[0]) / HV + a.eps);
    for (int i = tid; i < HV; i += NT) out[i] = k3_f32_to_bf16(sm.o[i] * rstd * sm.gate[i]);
  }
#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  if (MODE == SPLIT_CLUSTER) {
    k3_cluster_wait();  // phase 2 (acquire): every peer's o^2 is in sm.o2s
    float tot = 0.f;
#pragma unroll
    for (int r = 0; r < NS; ++r) tot += sm.o2s[r];
    const float rstd = 1.0f / sqrtf(tot / HV + a.eps);
    if (tid < W) out[v0 + tid] = k3_f32_to_bf16(sm.o[v0 + tid] * rstd * sm.gate[v0 + tid]);
    if (slice == 0) {  // every sibling has read the q/k conv states (it arrived on phase 2)
#pragma unroll
      for (int it = 0; it < QK_IT; ++it) {
        const int d = tid + it * NT;
        if (d < HK) {
          roll(cq + d * CONV_T, lq[it]);
          roll(ck + d * CONV_T, lk[it]);
        }
      }
    }
  }
#endif
  if (MODE == SPLIT_ATOMIC) {
    int* counter = a.counters + (long long)b * a.H + h;
    if (tid == 0) sm.last = atomicAdd(counter, 1) == NS - 1;
    __syncthreads();
    if (sm.last) {
      // Every slice of o is published and every sibling has read the q/k conv states: normalise the
      // whole head and roll those states.
      __threadfence();
      const float* op = a.o_part + ((long long)b * a.H + h) * HV;
      float p = 0.f;
      for (int i = tid; i < HV; i += NT) {
        const float o = k3_load_coherent(op + i);
        sm.o[i] = o;
        p += o * o;
      }
      p = k3_group32_sum(p);
      if (grp_lead) sm.red[1][grp] = p;
      __syncthreads();
      const float rstd = 1.0f / sqrtf(sum_groups(sm.red[1]) / HV + a.eps);
      for (int i = tid; i < HV; i += NT) out[i] = k3_f32_to_bf16(sm.o[i] * rstd * sm.gate[i]);
#pragma unroll
      for (int it = 0; it < QK_IT; ++it) {
        const int d = tid + it * NT;
        if (d < HK) {
          roll(cq + d * CONV_T, lq[it]);
          roll(ck + d * CONV_T, lk[it]);
        }
      }
      if (tid == 0) *counter = 0;  // ready for the next launch
    }
  }
  if (MODE != SPLIT_CLUSTER) update_state();
}

// The (slice width W, threads) pairs compiled, each for both state layouts and every split mode
// that applies (cluster mode: CUDA builds, at most 8 blocks per head, the portable cluster size).
#define K3_KDA_CONFIGS(X) \
  X(128, 256)             \
  X(32, 128)              \
  X(16, 128)

template <int W, int NT, bool VK, int MODE>
static int launch_kernel(const Args& a, k3_stream_t st) {
  const dim3 grid(HV / W, a.H, a.B);
#if defined(K3_CUDA)
  if (MODE == SPLIT_CLUSTER) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(NT);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = st;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = HV / W;  // the blocks of one head
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return (int)cudaLaunchKernelEx(&cfg, kda_decode_kernel<W, NT, VK, MODE>, a);
  }
#endif
  kda_decode_kernel<W, NT, VK, MODE><<<grid, NT, 0, st>>>(a);
  return (int)k3_get_last_error();
}

template <int W, int NT, bool VK, int MODE>
static int occupancy(int* blocks) {
  return (int)k3_occupancy(blocks, kda_decode_kernel<W, NT, VK, MODE>, NT, 0);
}

// query = 0: launch; 1: write resident blocks per unit to *blocks. Returns 0, a runtime error code,
// or -5 when this build has no such split mode for this slice width.
template <int W, int NT, int MODE>
static int run_layout(const Args* a, int vk, k3_stream_t st, int* blocks) {
  if (blocks) return vk ? occupancy<W, NT, true, MODE>(blocks) : occupancy<W, NT, false, MODE>(blocks);
  return vk ? launch_kernel<W, NT, true, MODE>(*a, st) : launch_kernel<W, NT, false, MODE>(*a, st);
}

template <int W, int NT>
static int run_mode(const Args* a, int vk, int mode, k3_stream_t st, int* blocks) {
  if constexpr (W == HV) {
    return mode == WHOLE_HEAD ? run_layout<W, NT, WHOLE_HEAD>(a, vk, st, blocks) : -5;
  } else {
    if (mode == SPLIT_ATOMIC) return run_layout<W, NT, SPLIT_ATOMIC>(a, vk, st, blocks);
#if defined(K3_CUDA)
    if constexpr (HV / W <= 8) {
      if (mode == SPLIT_CLUSTER) return run_layout<W, NT, SPLIT_CLUSTER>(a, vk, st, blocks);
    }
#endif
    return -5;
  }
}

}  // namespace k3kda

// ---------------------------------------------------------------------------------------------
// C entry points (ctypes): no C++ or torch ABI crosses the boundary.

K3_EXPORT int k3_kda_decode_args_size() { return (int)sizeof(k3kda::Args); }

// Split modes this build has: bit 1 atomic (always), bit 2 cluster (CUDA builds).
K3_EXPORT int k3_kda_decode_split_modes() {
#if defined(K3_CUDA)
  return (1 << k3kda::SPLIT_ATOMIC) | (1 << k3kda::SPLIT_CLUSTER);
#else
  return 1 << k3kda::SPLIT_ATOMIC;
#endif
}

// Writes up to `max_configs` (W, threads, static shared bytes) triples; returns how many exist.
K3_EXPORT int k3_kda_decode_configs(int* out, int max_configs) {
  int n = 0;
#define K3_LIST(W_, NT_)                                \
  if (n < max_configs) {                                \
    out[3 * n] = W_;                                    \
    out[3 * n + 1] = NT_;                               \
    out[3 * n + 2] = (int)sizeof(k3kda::Smem<W_, NT_>); \
  }                                                     \
  ++n;
  K3_KDA_CONFIGS(K3_LIST)
#undef K3_LIST
  return n;
}

// mode: 0 whole head per block (tile_v = V), 1 split heads with atomics, 2 split heads in clusters.
static int k3_dispatch(const k3kda::Args* a, int tile_v, int threads, int state_vk, int mode, void* stream,
                       int* blocks) {
  k3_stream_t st = (k3_stream_t)stream;
#define K3_RUN(W_, NT_) \
  if (tile_v == W_ && threads == NT_) return k3kda::run_mode<W_, NT_>(a, state_vk, mode, st, blocks);
  K3_KDA_CONFIGS(K3_RUN)
#undef K3_RUN
  return -1;
}

// Resident blocks per compute unit for one kernel variant (for the L2 prefetch distance), or < 0.
K3_EXPORT int k3_kda_decode_occupancy(int tile_v, int threads, int state_vk, int mode) {
  int blocks = 0;
  const int rc = k3_dispatch(nullptr, tile_v, threads, state_vk, mode, nullptr, &blocks);
  return rc == 0 ? blocks : (rc < 0 ? rc : -100 - rc);
}

// Launch one decode step. tile_v: value columns per block (W); threads: block size; state_vk: 0 for
// [B, H, K, V], 1 for [B, H, V, K]; mode: see above; max_shared: the device's shared memory (LDS)
// per block in bytes. Returns 0, or -1 (no such compiled config), -2 (block size not a multiple of
// the warp width, or warps narrower than 32 lanes), -3 (more shared memory than the device has),
// -4 (bad sizes), -5 (no such mode for this config/build), or the runtime's error code.
K3_EXPORT int k3_kda_decode(const k3kda::Args* args, int tile_v, int threads, int state_vk, int mode,
                            int max_shared, void* stream) {
  const k3kda::Args& a = *args;
  if (a.B <= 0 || a.H <= 0 || a.B > 65535 || a.H > 65535) return -4;
  if (a.warp_size < 32 || threads % a.warp_size != 0) return -2;
  int smem = -1;
#define K3_SMEM(W_, NT_) \
  if (tile_v == W_ && threads == NT_) smem = (int)sizeof(k3kda::Smem<W_, NT_>);
  K3_KDA_CONFIGS(K3_SMEM)
#undef K3_SMEM
  if (smem < 0) return -1;
  if (smem > max_shared) return -3;
  return k3_dispatch(args, tile_v, threads, state_vk, mode, stream, nullptr);
}
