// Grouped W4A16 expert matmul for MXFP4 / NVFP4 weights (decode-sized C).
//
// One warp per output row n of one expert: each lane streams 16 packed bytes (32 weights, one
// MX block or two NVFP4 blocks) with a 16-byte load, decodes them in registers, and dots them
// with the matching 32 activations of up to kTok tokens; a warp shuffle reduces the lanes.
// Weights are read exactly once per kTok tokens, which is what matters when C is small
// (memory-bound decode, spec §9.4). This is a CUDA-core kernel, not an MMA kernel: for large C
// it is compute-bound far below tensor-core rates.
#include "common.cuh"
#include "fmoe_native.h"

namespace {

constexpr int kWarps = 8;   // rows per CTA
constexpr int kTok = 8;     // tokens accumulated per weight pass

template <int FMT>
__global__ void __launch_bounds__(kWarps * 32)
w4a16_kernel(const __nv_bfloat16 *__restrict__ x, const uint8_t *__restrict__ w,
             const uint8_t *__restrict__ sc, const float *__restrict__ gscale,
             __nv_bfloat16 *__restrict__ y, int C, int N, int K) {
  const int e = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= N) return;
  constexpr int kBlock = FMT == FMOE_FMT_MXFP4 ? 32 : 16;
  const int kb_per_row = K / kBlock;
  const uint8_t *wrow = w + ((size_t)e * N + n) * (K / 2);
  const uint8_t *srow = sc + ((size_t)e * N + n) * kb_per_row;
  const __nv_bfloat16 *xe = x + (size_t)e * C * K;
  const float g = FMT == FMOE_FMT_NVFP4 ? gscale[e] : 1.0f;

  for (int c0 = 0; c0 < C; c0 += kTok) {
    const int cn = min(kTok, C - c0);
    float acc[kTok];
#pragma unroll
    for (int c = 0; c < kTok; ++c) acc[c] = 0.f;
    for (int k0 = lane * 32; k0 < K; k0 += 32 * 32) {
      // Weights are streamed once: bypass L1 and mark them evict-first.
      const uint4 p = __ldcs(reinterpret_cast<const uint4 *>(wrow + k0 / 2));
      float wv[32];
      const uint32_t words[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) wv[i * 8 + j] = fmoe::e2m1_value((words[i] >> (4 * j)) & 15u);
      if (FMT == FMOE_FMT_MXFP4) {
        const float s = fmoe::e8m0_value(srow[k0 / 32]);
#pragma unroll
        for (int i = 0; i < 32; ++i) wv[i] *= s;
      } else {
        const float s0 = fmoe::e4m3_value(srow[k0 / 16]), s1 = fmoe::e4m3_value(srow[k0 / 16 + 1]);
#pragma unroll
        for (int i = 0; i < 16; ++i) { wv[i] *= s0; wv[16 + i] *= s1; }
      }
#pragma unroll
      for (int c = 0; c < kTok; ++c) {
        if (c < cn) {
          const uint4 *xr = reinterpret_cast<const uint4 *>(xe + (size_t)(c0 + c) * K + k0);
          float s = 0.f;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint4 v = __ldg(xr + q);
            const uint32_t xs[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
              const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&xs[h]));
              s = fmaf(wv[q * 8 + 2 * h], f.x, s);
              s = fmaf(wv[q * 8 + 2 * h + 1], f.y, s);
            }
          }
          acc[c] += s;
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kTok; ++c) {
      const float v = fmoe::warp_sum(acc[c]);
      if (lane == 0 && c < cn) y[((size_t)e * C + c0 + c) * N + n] = __float2bfloat16_rn(v * g);
    }
  }
}

}  // namespace

extern "C" int fmoe_w4a16_grouped_matmul(const void *x, const uint8_t *w, const uint8_t *scales,
                                         const float *gscale, void *y, int fmt, int E, int C,
                                         int N, int K, void *stream) {
  // E is the grid's y dimension (at most 65535); each lane covers 32 weights of K per load.
  if (E < 0 || C < 0 || N < 0 || K < 0 || K % 32 || E > 65535) return FMOE_ERR_BAD_SHAPE;
  if (E == 0 || C == 0 || N == 0) return 0;
  if (K == 0) return FMOE_ERR_BAD_SHAPE;  // y would be all zeros; no caller means that
  if (!x || !w || !scales || !y) return FMOE_ERR_BAD_ARGUMENT;
  if (reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(w) % 16)
    return FMOE_ERR_MISALIGNED;
  const dim3 grid((N + kWarps - 1) / kWarps, E), block(kWarps * 32);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const auto *xb = static_cast<const __nv_bfloat16 *>(x);
  auto *yb = static_cast<__nv_bfloat16 *>(y);
  if (fmt == FMOE_FMT_MXFP4) {
    w4a16_kernel<FMOE_FMT_MXFP4><<<grid, block, 0, s>>>(xb, w, scales, nullptr, yb, C, N, K);
  } else if (fmt == FMOE_FMT_NVFP4) {
    if (!gscale) return FMOE_ERR_BAD_ARGUMENT;
    w4a16_kernel<FMOE_FMT_NVFP4><<<grid, block, 0, s>>>(xb, w, scales, gscale, yb, C, N, K);
  } else {
    return FMOE_ERR_BAD_FORMAT;
  }
  return (int)cudaGetLastError();
}
