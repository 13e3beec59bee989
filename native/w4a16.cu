// Grouped W4A16 expert matmul for MXFP4 / NVFP4 weights (decode-sized C), over padded
// activations [E, C, K] or over rows sorted by expert [R, K] with device offsets [E + 1].
//
// One warp per output row n of one expert: each lane streams 16 packed bytes (32 weights, one
// MX block or two NVFP4 blocks) with a 16-byte load, decodes them in registers, and dots them
// with the matching 32 activations of up to kTok tokens; a warp shuffle reduces the lanes.
// Weights are read exactly once per kTok tokens, which is what matters when C is small
// (memory-bound decode, spec §9.4). This is a CUDA-core kernel, not an MMA kernel: for large C
// it is compute-bound far below tensor-core rates.
#include "common.cuh"
#include "fmoe_native.h"

#include <type_traits>

namespace {

constexpr int kWarps = 8;   // rows per CTA
constexpr int kTok = 8;     // tokens accumulated per weight pass

// Expert e's output row n for `rows` activation rows: x points at the first of them (row stride K),
// y at its output row (row stride N). One warp; every lane returns with the same trip counts, so the
// shuffles of warp_sum see the whole warp. Both entry points (padded [E, C, K] and rows sorted by
// expert) call this for each (expert, row range), so their results are the same bits.
template <int FMT>
__device__ __forceinline__ void w4a16_rows(const __nv_bfloat16 *__restrict__ x,
                                           const uint8_t *__restrict__ w,
                                           const uint8_t *__restrict__ sc,
                                           const float *__restrict__ gscale,
                                           __nv_bfloat16 *__restrict__ y, int e, int n, int rows,
                                           int N, int K, int lane) {
  constexpr int kBlock = FMT == FMOE_FMT_MXFP4 ? 32 : 16;
  const int kb_per_row = K / kBlock;
  const uint8_t *wrow = w + ((size_t)e * N + n) * (K / 2);
  const uint8_t *srow = sc + ((size_t)e * N + n) * kb_per_row;
  const float g = FMT == FMOE_FMT_NVFP4 ? gscale[e] : 1.0f;

  for (int c0 = 0; c0 < rows; c0 += kTok) {
    const int cn = min(kTok, rows - c0);
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
          const uint4 *xr = reinterpret_cast<const uint4 *>(x + (size_t)(c0 + c) * K + k0);
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
      if (lane == 0 && c < cn) y[(size_t)(c0 + c) * N] = __float2bfloat16_rn(v * g);
    }
  }
}

// Padded activations: expert e (grid y) owns x[e] = C rows.
template <int FMT>
__global__ void __launch_bounds__(kWarps * 32)
w4a16_kernel(const __nv_bfloat16 *__restrict__ x, const uint8_t *__restrict__ w,
             const uint8_t *__restrict__ sc, const float *__restrict__ gscale,
             __nv_bfloat16 *__restrict__ y, int C, int N, int K) {
  const int e = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= N) return;
  w4a16_rows<FMT>(x + (size_t)e * C * K, w, sc, gscale, y + (size_t)e * C * N + n, e, n, C, N, K, lane);
}

// Rows sorted by expert: expert e (grid y) owns rows offsets[e]:offsets[e + 1], read here on the
// device (no host sync). The range is clamped to [0, R] so a bad offsets tensor can never move a
// load or store outside x and y; an empty range returns before any weight byte is read.
template <int FMT>
__global__ void __launch_bounds__(kWarps * 32)
w4a16_rows_kernel(const __nv_bfloat16 *__restrict__ x, const int64_t *__restrict__ offsets,
                  const uint8_t *__restrict__ w, const uint8_t *__restrict__ sc,
                  const float *__restrict__ gscale, __nv_bfloat16 *__restrict__ y, int R, int N, int K) {
  const int e = blockIdx.y;
  const int64_t lo = min(max(offsets[e], (int64_t)0), (int64_t)R);
  const int64_t hi = min(max(offsets[e + 1], lo), (int64_t)R);
  if (hi == lo) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * kWarps + warp;
  if (n >= N) return;
  w4a16_rows<FMT>(x + (size_t)lo * K, w, sc, gscale, y + (size_t)lo * N + n, e, n, (int)(hi - lo), N, K,
                  lane);
}

// The checks both entry points share, in the order of fmoe_native.h: 0 to launch, 1 for nothing
// to do, or an error code. `rows` is C (padded) or R (rows sorted by expert, which also need
// their offsets: `ragged`).
int check_w4a16(const void *x, bool ragged, const void *offsets, const void *w, const void *scales,
                const float *gscale, const void *y, int fmt, int E, int rows, int N, int K) {
  // E is the grid's y dimension (at most 65535); each lane covers 32 weights of K per load.
  if (E < 0 || rows < 0 || N < 0 || K < 0 || K % 32 || E > 65535) return FMOE_ERR_BAD_SHAPE;
  if (E == 0 || rows == 0 || N == 0) return 1;
  if (K == 0) return FMOE_ERR_BAD_SHAPE;  // y would be all zeros; no caller means that
  if (!x || !w || !scales || !y || (ragged && !offsets)) return FMOE_ERR_BAD_ARGUMENT;
  if (reinterpret_cast<uintptr_t>(x) % 16 || reinterpret_cast<uintptr_t>(w) % 16)
    return FMOE_ERR_MISALIGNED;
  if (fmt != FMOE_FMT_MXFP4 && fmt != FMOE_FMT_NVFP4) return FMOE_ERR_BAD_FORMAT;
  if (fmt == FMOE_FMT_NVFP4 && !gscale) return FMOE_ERR_BAD_ARGUMENT;
  return 0;
}

// Launches kernel<MXFP4> or kernel<NVFP4> (``launch(format tag, grid, block, stream)``) over
// (N tiles, E) on the caller's stream; returns the launch's error.
template <typename Launch>
int launch_w4a16(int fmt, int E, int N, void *stream, Launch &&launch) {
  const dim3 grid((N + kWarps - 1) / kWarps, E), block(kWarps * 32);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (fmt == FMOE_FMT_MXFP4)
    launch(std::integral_constant<int, FMOE_FMT_MXFP4>{}, grid, block, s);
  else
    launch(std::integral_constant<int, FMOE_FMT_NVFP4>{}, grid, block, s);
  return (int)cudaGetLastError();
}

}  // namespace

extern "C" int fmoe_w4a16_grouped_matmul(const void *x, const uint8_t *w, const uint8_t *scales,
                                         const float *gscale, void *y, int fmt, int E, int C,
                                         int N, int K, void *stream) {
  const int rc = check_w4a16(x, false, nullptr, w, scales, gscale, y, fmt, E, C, N, K);
  if (rc) return rc == 1 ? 0 : rc;
  const auto *xb = static_cast<const __nv_bfloat16 *>(x);
  auto *yb = static_cast<__nv_bfloat16 *>(y);
  return launch_w4a16(fmt, E, N, stream, [&](auto f, dim3 grid, dim3 block, cudaStream_t s) {
    constexpr int F = decltype(f)::value;
    w4a16_kernel<F><<<grid, block, 0, s>>>(xb, w, scales, F == FMOE_FMT_NVFP4 ? gscale : nullptr, yb, C, N, K);
  });
}

extern "C" int fmoe_w4a16_rows_matmul(const void *x, const int64_t *offsets, const uint8_t *w,
                                      const uint8_t *scales, const float *gscale, void *y, int fmt,
                                      int E, int R, int N, int K, void *stream) {
  const int rc = check_w4a16(x, true, offsets, w, scales, gscale, y, fmt, E, R, N, K);
  if (rc) return rc == 1 ? 0 : rc;
  const auto *xb = static_cast<const __nv_bfloat16 *>(x);
  auto *yb = static_cast<__nv_bfloat16 *>(y);
  return launch_w4a16(fmt, E, N, stream, [&](auto f, dim3 grid, dim3 block, cudaStream_t s) {
    constexpr int F = decltype(f)::value;
    w4a16_rows_kernel<F><<<grid, block, 0, s>>>(xb, offsets, w, scales, F == FMOE_FMT_NVFP4 ? gscale : nullptr, yb,
                                                R, N, K);
  });
}
