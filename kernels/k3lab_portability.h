// k3lab_portability.h: one source for CUDA (nvcc) and HIP (hipcc, or torch's hipify).
//
// The kernels in kernels/*.cu include only this header for their runtime API, so they compile as
// CUDA with nvcc and as HIP with hipcc (`hipcc -x hip`). Everything that differs between the two
// lives here, under names starting with K3_ / k3_:
//   * runtime types and calls (stream, error, launch, device attributes);
//   * lane shuffles: CUDA needs a member mask (`__shfl_xor_sync`), HIP has none;
//   * cache hints for data read or written once (streaming loads and stores);
//   * bf16 <-> fp32 by bit manipulation, so no vendor bf16 header (cuda_bf16.h, hip_bf16.h,
//     whose names and classes differ between ROCm releases) is needed.
// Nothing here fixes a warp or wavefront width, a shared-memory size or a unit count: launchers
// read those from the device (or receive them from the caller) at launch time.
//
// The HIP branch compiles with Debian's hipcc for gfx90a and gfx940 (scripts/compile_hip.sh); it is
// not yet run on AMD hardware by this project.
#pragma once

#include <stdint.h>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__)
#define K3_HIP 1
#include <hip/hip_runtime.h>
typedef hipStream_t k3_stream_t;
typedef hipError_t k3_error_t;
#define K3_SUCCESS hipSuccess
#define k3_get_last_error hipGetLastError
#define k3_get_device hipGetDevice
#define k3_device_attr hipDeviceGetAttribute
#define K3_ATTR_MAX_SHARED_PER_BLOCK hipDeviceAttributeMaxSharedMemoryPerBlock
#define K3_ATTR_WARP_SIZE hipDeviceAttributeWarpSize
#define K3_ATTR_UNITS hipDeviceAttributeMultiprocessorCount
#define k3_occupancy hipOccupancyMaxActiveBlocksPerMultiprocessor
#else
#define K3_CUDA 1
#include <cuda_runtime.h>
typedef cudaStream_t k3_stream_t;
typedef cudaError_t k3_error_t;
#define K3_SUCCESS cudaSuccess
#define k3_get_last_error cudaGetLastError
#define k3_get_device cudaGetDevice
#define k3_device_attr cudaDeviceGetAttribute
#define K3_ATTR_MAX_SHARED_PER_BLOCK cudaDevAttrMaxSharedMemoryPerBlock
#define K3_ATTR_WARP_SIZE cudaDevAttrWarpSize
#define K3_ATTR_UNITS cudaDevAttrMultiProcessorCount
#define k3_occupancy cudaOccupancyMaxActiveBlocksPerMultiprocessor
#endif

#define K3_DEVICE __device__ __forceinline__

// Exported launchers: C linkage and default visibility, so ctypes finds them in the shared library.
#define K3_EXPORT extern "C" __attribute__((visibility("default")))

// ---------------------------------------------------------------------------------------------
// Lane exchange within a warp (NVIDIA, 32 lanes) or wavefront (AMD, 64 or 32 lanes).
// Callers that reduce over a whole warp pass the width they read from the device; callers that
// reduce inside aligned groups of at most 32 lanes are valid on every width.
K3_DEVICE float k3_shfl_xor(float v, int lane_mask) {
#if defined(K3_HIP)
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// ---------------------------------------------------------------------------------------------
// Cache hints. A decode step reads each recurrent-state byte once and writes it once; telling the
// cache so keeps the small per-token vectors and weights resident instead.
K3_DEVICE float4 k3_load_stream(const float4* p) {
#if defined(K3_HIP)
  // not yet run on AMD hardware by this project
  float4 r;
  r.x = __builtin_nontemporal_load(&p->x);
  r.y = __builtin_nontemporal_load(&p->y);
  r.z = __builtin_nontemporal_load(&p->z);
  r.w = __builtin_nontemporal_load(&p->w);
  return r;
#else
  return __ldcs(p);
#endif
}

K3_DEVICE void k3_store_stream(float4* p, float4 v) {
#if defined(K3_HIP)
  __builtin_nontemporal_store(v.x, &p->x);
  __builtin_nontemporal_store(v.y, &p->y);
  __builtin_nontemporal_store(v.z, &p->z);
  __builtin_nontemporal_store(v.w, &p->w);
#else
  __stcs(p, v);
#endif
}

// Ask L2 to fetch `bytes` (a multiple of 16, 16-byte aligned) from `p` ahead of a later load.
// Hopper's bulk-copy engine does it from one thread; elsewhere there is no portable equivalent and
// it is a no-op (HIP: not yet run on AMD hardware by this project).
K3_DEVICE void k3_prefetch_l2(const void* p, unsigned bytes) {
#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#else
  (void)p;
  (void)bytes;
#endif
}

// Programmatic dependent launch (Hopper and later). A kernel launched by k3_launch_pdl may start
// while the previous kernel in the stream is finishing; k3_pdl_enter, before its first memory
// access, waits until that kernel has completed and its writes are visible, then lets the next
// kernel start the same way. Without the launch attribute both instructions return at once.
K3_DEVICE void k3_pdl_enter() {
#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

#if defined(K3_CUDA)
// `kernel(args)` on `stream` with one launch attribute (CUDA-graph capture keeps it); returns the
// launch's error code.
template <typename A>
static cudaError_t k3_launch_with(void (*kernel)(A), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                  const A& args, cudaLaunchAttribute attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, args);
}

// ... with the programmatic-stream-serialization attribute (see k3_pdl_enter).
template <typename A>
static cudaError_t k3_launch_pdl(void (*kernel)(A), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                 const A& args) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  return k3_launch_with(kernel, grid, block, smem, stream, args, attr);
}
#endif

// Thread-block cluster barrier in two halves (Hopper and later), so a block can arrive, keep
// working, and wait only where it needs its peers: arrive.relaxed orders nothing (a "started"
// signal); arrive (release) publishes this thread's earlier writes, including those into a peer's
// shared memory, to whoever waits (acquire). Every thread of the block calls each one.
#if defined(K3_CUDA) && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
K3_DEVICE void k3_cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
K3_DEVICE void k3_cluster_arrive_release() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
K3_DEVICE void k3_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
#endif

// Sum over an aligned group of 32 lanes. A group of 32 fits inside a warp or wavefront on every
// vendor (NVIDIA 32 lanes, AMD 64 or 32), so this needs no device's width as a constant.
K3_DEVICE float k3_group32_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += k3_shfl_xor(x, off);
  return x;
}

// A load that bypasses the (incoherent) per-unit L1, for values another block wrote in this launch
// and published with a fence + atomic.
K3_DEVICE float k3_load_coherent(const float* p) { return *(const volatile float*)p; }

// ---------------------------------------------------------------------------------------------
// bf16 stored as its 16 bits; conversions by bit manipulation (round to nearest even, NaN kept).
typedef uint16_t k3_bf16;

K3_DEVICE float k3_bf16_to_f32(k3_bf16 h) { return __uint_as_float(((uint32_t)h) << 16); }

K3_DEVICE k3_bf16 k3_f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (k3_bf16)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (k3_bf16)(u >> 16);
}

K3_DEVICE float k3_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
