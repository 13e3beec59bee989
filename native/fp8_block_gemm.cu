// Grouped FP8 (E4M3) block-scaled GEMM, DeepSeek convention (spec §4.1-§4.3).
//
// CUDA-core kernel, honest about what it is: 64x64 output tile per CTA, 256 threads with 4x4
// outputs each, K walked in 128-wide blocks that coincide with the scale blocks. FP8 tiles are
// staged as bytes in shared memory (8 KB each, transposed so a thread reads 4 consecutive rows
// with one 32-bit load), converted to FP32 on the fly, summed in FP32 within the K block and
// promoted with a_s[m, kb] * b_s[n/128, kb] at block end. No wgmma/TMA: expect a fraction of the
// Hopper FP8 tensor-core rate; it exists for correctness and as the W8A8 data path.
#include "common.cuh"
#include "fmoe_native.h"

namespace {

constexpr int kTileM = 64, kTileN = 64, kBK = 128;

__device__ __forceinline__ void cvt4(uint32_t v, float out[4]) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(v >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  out[0] = a.x; out[1] = a.y; out[2] = b.x; out[3] = b.y;
}

// Stage rows [r0, r0+64) x cols [k0, k0+128) of src [rows, K] into dst[k][r] (zero padded).
__device__ __forceinline__ void stage(uint8_t (*dst)[kTileM], const uint8_t *src, int rows, int K,
                                      int r0, int k0, bool vec_ok) {
  const int tid = threadIdx.x;
  const int r = tid >> 2, c = (tid & 3) * 32;  // 64 rows x 4 chunks of 32 bytes
  const int gr = r0 + r, gk = k0 + c;
  uint8_t buf[32];
  if (vec_ok && gr < rows && gk + 32 <= K) {
    const uint4 *p = reinterpret_cast<const uint4 *>(src + (size_t)gr * K + gk);
    const uint4 a = __ldg(p), b = __ldg(p + 1);
    *reinterpret_cast<uint4 *>(buf) = a;
    *reinterpret_cast<uint4 *>(buf + 16) = b;
  } else {
#pragma unroll
    for (int i = 0; i < 32; ++i)
      buf[i] = (gr < rows && gk + i < K) ? src[(size_t)gr * K + gk + i] : (uint8_t)0;
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) dst[c + i][r] = buf[i];
}

__global__ void __launch_bounds__(256)
fp8_block_gemm_kernel(const uint8_t *__restrict__ a, const float *__restrict__ a_s,
                      const uint8_t *__restrict__ b, const float *__restrict__ b_s,
                      __nv_bfloat16 *__restrict__ y, int M, int N, int K, bool vec_a, bool vec_b) {
  __shared__ __align__(16) uint8_t sA[kBK][kTileM];
  __shared__ __align__(16) uint8_t sB[kBK][kTileN];
  const int e = blockIdx.z;
  const int m0 = blockIdx.y * kTileM, n0 = blockIdx.x * kTileN;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const int KB = (K + kBK - 1) / kBK, NB = (N + 127) / 128;
  const uint8_t *ae = a + (size_t)e * M * K;
  const uint8_t *be = b + (size_t)e * N * K;
  const float *ase = a_s + (size_t)e * M * KB;
  const float *bse = b_s + (size_t)e * NB * KB;
  float acc[4][4] = {};
  for (int kb = 0; kb < KB; ++kb) {
    stage(sA, ae, M, K, m0, kb * kBK, vec_a);
    stage(sB, be, N, K, n0, kb * kBK, vec_b);
    __syncthreads();
    float part[4][4] = {};
#pragma unroll 8
    for (int k = 0; k < kBK; ++k) {
      float av[4], bv[4];
      cvt4(*reinterpret_cast<const uint32_t *>(&sA[k][ty * 4]), av);
      cvt4(*reinterpret_cast<const uint32_t *>(&sB[k][tx * 4]), bv);
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) part[i][j] = fmaf(av[i], bv[j], part[i][j]);
    }
    __syncthreads();
    // A 64-wide N tile never straddles a 128-row weight block, so one b scale per tile.
    const float sb = n0 < N ? bse[(size_t)(n0 / 128) * KB + kb] : 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = m0 + ty * 4 + i;
      const float sa = m < M ? ase[(size_t)m * KB + kb] * sb : 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(part[i][j], sa, acc[i][j]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty * 4 + i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx * 4 + j;
      if (n < N) y[((size_t)e * M + m) * N + n] = __float2bfloat16_rn(acc[i][j]);
    }
  }
}

}  // namespace

extern "C" int fmoe_fp8_block_grouped_gemm(const uint8_t *a, const float *a_s, const uint8_t *b,
                                           const float *b_s, void *y, int E, int M, int N, int K,
                                           void *stream) {
  // E is the grid's z dimension and ceil(M / 64) its y dimension (each at most 65535).
  if (E < 0 || M < 0 || N < 0 || K < 0 || E > 65535 || (M + kTileM - 1) / kTileM > 65535)
    return FMOE_ERR_BAD_SHAPE;
  if (E == 0 || M == 0 || N == 0) return 0;
  if (K == 0) return FMOE_ERR_BAD_SHAPE;
  if (!a || !a_s || !b || !b_s || !y) return FMOE_ERR_BAD_ARGUMENT;
  // 16-byte staging loads only where every row start is 16-byte aligned; byte loads otherwise.
  const bool vec_a = K % 16 == 0 && reinterpret_cast<uintptr_t>(a) % 16 == 0;
  const bool vec_b = K % 16 == 0 && reinterpret_cast<uintptr_t>(b) % 16 == 0;
  const dim3 grid((N + kTileN - 1) / kTileN, (M + kTileM - 1) / kTileM, E);
  fp8_block_gemm_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      a, a_s, b, b_s, static_cast<__nv_bfloat16 *>(y), M, N, K, vec_a, vec_b);
  return (int)cudaGetLastError();
}
