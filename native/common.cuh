// Shared device helpers for the fmoe native kernels.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace fmoe {

// E2M1 code -> value (spec §1.3).
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  // 2*|v| for codes 0..7 is 0,1,2,3,4,6,8,12 = u + relu(u-4) + 2*relu(u-6): branch-free.
  int u = code & 7;
  int m = u + max(u - 4, 0) + 2 * max(u - 6, 0);
  float v = 0.5f * (float)m;
  return (code & 8) ? -v : v;
}

// E8M0 byte -> 2^(b-127); 0x00 is the FP32 subnormal 2^-127 and 0xFF is NaN (spec §1.4).
__device__ __forceinline__ float e8m0_value(uint32_t b) {
  if (b == 0) return __uint_as_float(0x00400000u);
  if (b == 255) return __uint_as_float(0x7fc00000u);
  return __uint_as_float(b << 23);
}

// E4M3FN byte -> float (exact).
__device__ __forceinline__ float e4m3_value(uint32_t b) {
  __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3);
  return __half2float(__half(h));
}

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace fmoe
