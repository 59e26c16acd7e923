// kda_decode.cu: Kimi K3's single-token KDA step in one launch (seed section 3).
//
// The unfused path ran a short-conv kernel, then a kernel fusing the q/k L2 norm, the decay and
// beta gates and the recurrent update, then the gated output RMSNorm, with copies in between.
// Here one launch does, for every (sequence b, head h):
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
// head (so B = 1 with 12 heads still fills the GPU). Each recomputes the head's q/k vectors (cheap,
// L2-resident) instead of waiting for another launch. The output RMSNorm needs all V outputs of the
// head: each block publishes its slice to a workspace, and the last block of the head to arrive
// (an atomic counter) normalises all V and writes them, then resets the counter; it also writes the
// q/k conv states, which its siblings have all finished reading by then.
//
// Layouts: per-token inputs are bf16 rows [B, X] with a row stride (last dim contiguous), so views
// of one packed projection output work. Conv states [B, H*K, 3] bf16 per q, k, v (channel c's last
// three inputs contiguous, oldest first; the k3lab.nn.KDACache layout). State fp32 [B, H, K, V]
// (state_vk = 0, fla's default) or [B, H, V, K] (state_vk = 1), batch stride given.
//
// Single source for CUDA and HIP through k3lab_portability.h; warp width, shared-memory limit and
// unit counts come from the caller. The HIP build is not yet run on AMD hardware by this project.
#include "k3lab_portability.h"

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
  // workspace for split heads: counters [B*H] (zero, left zero), o_part [B*H*V]
  int* counters;
  float* o_part;
  int B, H;
  float lower_bound, eps, scale;
  int warp_size;
  int hints;  // bit 0: streaming loads of S, bit 1: streaming stores of S
};

template <int W, int NT>
struct Smem {
  float q[HK], k[HK], dec[HK];  // conv+SiLU q and k (not yet normalised), exp(g)
  float v[W], delta[W];
  float gate[HV], o[HV];        // sigmoid(gate) * o_norm, and the head's outputs before the norm
  float ru[(NT / 32) * W], rw[(NT / 32) * W];  // partial S^T k and S^T q per 32-lane group
  float red[3][32];             // per-warp partial sums
  float beta;
  int last;
};

template <int N>
K3_DEVICE void zero(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) x[i] = 0.f;
}

K3_DEVICE float4 f4_mul(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }
K3_DEVICE float f4_dot(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }

// Sum over a whole warp/wavefront of `warp_size` lanes (read from the device by the launcher).
K3_DEVICE float warp_sum(float x, int warp_size) {
  for (int off = warp_size >> 1; off > 0; off >>= 1) x += k3_shfl_xor(x, off);
  return x;
}

// Causal depthwise conv over [s0, s1, s2, x] with weights w (w.w multiplies x), then SiLU.
K3_DEVICE float conv_silu(float s0, float s1, float s2, float x, float4 w) {
  float y = w.x * s0 + w.y * s1 + w.z * s2 + w.w * x;
  return y / (1.0f + expf(-y));
}

template <int W, int NT, bool VK>
__global__ void __launch_bounds__(NT) kda_decode_kernel(const Args a) {
  constexpr int NS = HV / W;            // blocks sharing one head
  constexpr bool SPLIT = NS > 1;
  constexpr int NF4 = 32 * W / NT;      // float4 of state per thread
  constexpr int NG = NT / 32;           // 32-lane groups per block
  static_assert(HV % W == 0 && W % 4 == 0 && W <= 128, "slice width");
  static_assert(NT % 32 == 0 && (32 * W) % NT == 0 && NF4 >= 1, "threads per block");
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
  const int nwarps = NT / a.warp_size;
  const int lane = tid % a.warp_size, warp = tid / a.warp_size;

  // ---- 1. the state slice: its loads go out first and stay in flight during the vector work
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

  // ---- 2. every per-token input this block needs, loaded before any is used (one round trip)
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

  // ---- 3. conv + SiLU, gates; q/k norms and q.k reduced over the head
  float pqq = 0.f, pkk = 0.f, pqk = 0.f;
  const float expA = expf(A);
#pragma unroll
  for (int it = 0; it < QK_IT; ++it) {
    const int d = tid + it * NT;
    if (d < HK) {
      const float yq = conv_silu(k3_bf16_to_f32(lq[it][0]), k3_bf16_to_f32(lq[it][1]),
                                 k3_bf16_to_f32(lq[it][2]), k3_bf16_to_f32(lq[it][3]), lwq[it]);
      const float yk = conv_silu(k3_bf16_to_f32(lk[it][0]), k3_bf16_to_f32(lk[it][1]),
                                 k3_bf16_to_f32(lk[it][2]), k3_bf16_to_f32(lk[it][3]), lwk[it]);
      sm.q[d] = yq;
      sm.k[d] = yk;
      pqq += yq * yq;
      pkk += yk * yk;
      pqk += yq * yk;
      const float z = expA * (lg[it] + lbias[it]);
      sm.dec[d] = expf(a.lower_bound * k3_sigmoid(z));
      if (!SPLIT) {  // sole reader of these conv states: roll them now
#pragma unroll
        for (int t = 0; t < CONV_T; ++t) {
          cq[d * CONV_T + t] = lq[it][t + 1];
          ck[d * CONV_T + t] = lk[it][t + 1];
        }
      }
    }
  }
#pragma unroll
  for (int it = 0; it < V_IT; ++it) {
    const int i = tid + it * NT;
    if (i < W) {
      sm.v[i] = conv_silu(k3_bf16_to_f32(lv[it][0]), k3_bf16_to_f32(lv[it][1]), k3_bf16_to_f32(lv[it][2]),
                          k3_bf16_to_f32(lv[it][3]), lwv[it]);
#pragma unroll
      for (int t = 0; t < CONV_T; ++t) cv[i * CONV_T + t] = lv[it][t + 1];  // this block's own channels
    }
  }
#pragma unroll
  for (int it = 0; it < G_IT; ++it) {
    const int i = tid + it * NT;
    if (i < HV) sm.gate[i] = k3_sigmoid(lgate[it]) * lnorm[it];
  }
  if (tid == 0) sm.beta = k3_sigmoid(braw);
  pqq = warp_sum(pqq, a.warp_size);
  pkk = warp_sum(pkk, a.warp_size);
  pqk = warp_sum(pqk, a.warp_size);
  if (lane == 0) {
    sm.red[0][warp] = pqq;
    sm.red[1][warp] = pkk;
    sm.red[2][warp] = pqk;
  }
  __syncthreads();
  float qq = 0.f, kk = 0.f, qk = 0.f;
  for (int w = 0; w < nwarps; ++w) {
    qq += sm.red[0][w];
    kk += sm.red[1][w];
    qk += sm.red[2][w];
  }
  const float rq = 1.0f / sqrtf(qq + L2_EPS);
  const float rk = 1.0f / sqrtf(kk + L2_EPS);
  const float qscale = rq * a.scale;  // q_n = q * qscale (normalised and scaled)
  const float kq = qk * rk * qscale;  // k_n . q_n
  const float beta = sm.beta;

  // ---- 4. decay S and reduce S_dec^T k, S_dec^T q over K in one pass
  if (VK) {
    float u[NC], w[NC];
    zero(u);
    zero(w);
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
      const int base = (tid >> 5) * W + 4 * kv_tv;
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
    if (SPLIT) a.o_part[((long long)b * a.H + h) * HV + v0 + tid] = o;
  }
  if (!SPLIT) {
    o2 = warp_sum(o2, a.warp_size);
    if (lane == 0) sm.red[0][warp] = o2;
  } else {
    __threadfence();  // publish this slice of o before the arrival below
  }
  __syncthreads();

  // ---- 6. S <- S_dec + k delta^T, written back
  if (VK) {
#pragma unroll
    for (int j = 0; j < NF4; ++j) {
      const int kq4 = vk_l + 8 * (j % 4);
      float4 k4 = reinterpret_cast<const float4*>(sm.k)[kq4];
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

  // ---- 7. gated RMSNorm of the head's V outputs, straight into the caller's bf16 buffer
  k3_bf16* out = a.out + (long long)b * a.out_rs + h * HV;
  if (!SPLIT) {
    float tot = 0.f;
    for (int w = 0; w < nwarps; ++w) tot += sm.red[0][w];
    const float rstd = 1.0f / sqrtf(tot / HV + a.eps);
    for (int i = tid; i < HV; i += NT) out[i] = k3_f32_to_bf16(sm.o[i] * rstd * sm.gate[i]);
    return;
  }
  int* counter = a.counters + (long long)b * a.H + h;
  if (tid == 0) sm.last = atomicAdd(counter, 1) == NS - 1;
  __syncthreads();
  if (!sm.last) return;
  // The last block of this head: every slice of o is published and every sibling has read the
  // q/k conv states, so it normalises the whole head and rolls those states.
  __threadfence();
  const float* op = a.o_part + ((long long)b * a.H + h) * HV;
  o2 = 0.f;
  for (int i = tid; i < HV; i += NT) {
    const float o = k3_load_coherent(op + i);
    sm.o[i] = o;
    o2 += o * o;
  }
  o2 = warp_sum(o2, a.warp_size);
  if (lane == 0) sm.red[1][warp] = o2;  // red[0] may still be read by no one; [1] keeps it separate
  __syncthreads();
  float tot = 0.f;
  for (int w = 0; w < nwarps; ++w) tot += sm.red[1][w];
  const float rstd = 1.0f / sqrtf(tot / HV + a.eps);
  for (int i = tid; i < HV; i += NT) out[i] = k3_f32_to_bf16(sm.o[i] * rstd * sm.gate[i]);
#pragma unroll
  for (int it = 0; it < QK_IT; ++it) {
    const int d = tid + it * NT;
    if (d < HK) {
#pragma unroll
      for (int t = 0; t < CONV_T; ++t) {
        cq[d * CONV_T + t] = lq[it][t + 1];
        ck[d * CONV_T + t] = lk[it][t + 1];
      }
    }
  }
  if (tid == 0) *counter = 0;  // ready for the next launch
}

// The (slice width W, threads) pairs compiled, each for both state layouts.
#define K3_KDA_CONFIGS(X) \
  X(128, 256)             \
  X(128, 512)             \
  X(64, 128)              \
  X(32, 128)              \
  X(16, 64)               \
  X(16, 128)              \
  X(8, 64)

}  // namespace k3kda

// ---------------------------------------------------------------------------------------------
// C entry points (ctypes): no C++ or torch ABI crosses the boundary.

K3_EXPORT int k3_kda_decode_args_size() { return (int)sizeof(k3kda::Args); }

// Writes up to `max_pairs` (W, threads, static shared bytes) triples; returns how many exist.
K3_EXPORT int k3_kda_decode_configs(int* out, int max_pairs) {
  int n = 0;
#define K3_LIST(W_, NT_)                                          \
  if (n < max_pairs) {                                            \
    out[3 * n] = W_;                                              \
    out[3 * n + 1] = NT_;                                         \
    out[3 * n + 2] = (int)sizeof(k3kda::Smem<W_, NT_>);           \
  }                                                               \
  ++n;
  K3_KDA_CONFIGS(K3_LIST)
#undef K3_LIST
  return n;
}

// Launch one decode step. tile_v: value columns per block (W); threads: block size; state_vk: 0 for
// [B, H, K, V], 1 for [B, H, V, K]; max_shared: the device's shared memory (LDS) per block in bytes.
// Returns 0, or -1 (no such compiled config), -2 (warp width does not divide the block or exceeds
// 32 * 32 lanes of partial sums), -3 (config needs more shared memory than the device has),
// -4 (bad sizes), or the runtime's error code from the launch.
K3_EXPORT int k3_kda_decode(const k3kda::Args* args, int tile_v, int threads, int state_vk, int max_shared,
                            void* stream) {
  const k3kda::Args& a = *args;
  if (a.B <= 0 || a.H <= 0 || a.B > 65535 || a.H > 65535) return -4;
  if (a.warp_size <= 0 || threads % a.warp_size != 0 || threads / a.warp_size > 32) return -2;
  k3_stream_t st = (k3_stream_t)stream;
  int found = 0;
#define K3_LAUNCH(W_, NT_)                                                                    \
  if (!found && tile_v == W_ && threads == NT_) {                                             \
    found = 1;                                                                                \
    if ((int)sizeof(k3kda::Smem<W_, NT_>) > max_shared) return -3;                            \
    dim3 grid(k3kda::HV / W_, a.H, a.B);                                                      \
    if (state_vk) {                                                                           \
      k3kda::kda_decode_kernel<W_, NT_, true><<<grid, NT_, 0, st>>>(a);                       \
    } else {                                                                                  \
      k3kda::kda_decode_kernel<W_, NT_, false><<<grid, NT_, 0, st>>>(a);                      \
    }                                                                                         \
  }
  K3_KDA_CONFIGS(K3_LAUNCH)
#undef K3_LAUNCH
  if (!found) return -1;
  return (int)k3_get_last_error();
}
