// Dispatch / combine between token rows x[T, M] and expert-slot rows D[R, M] (capacity layout).
// pos[j, t] is the flat destination row of token t's j-th choice (negative = dropped / skipped).
// One CTA per (j, t) row for dispatch and per token for combine; threads stride over M with
// scalar accesses (natural alignment is all they need). Combine accumulates in FP32 in a fixed
// j order, so it is deterministic. A position >= R is never dereferenced: it sets *bad (when
// given) so the caller raises the reference's IndexError.
#include <climits>

#include "common.cuh"
#include "fmoe_native.h"

namespace {

template <typename T>
__global__ void dispatch_kernel(const T *__restrict__ x, const int64_t *__restrict__ pos,
                                const float *__restrict__ w, T *__restrict__ D, int T_, int M,
                                int64_t R, int32_t *__restrict__ bad) {
  const int jt = blockIdx.x;
  const int64_t p = pos[jt];
  if (p < 0) return;
  if (p >= R) {
    if (bad && threadIdx.x == 0) *bad = 1;
    return;
  }
  const int t = jt % T_;
  const float s = w ? w[jt] : 1.0f;
  const T *src = x + (size_t)t * M;
  T *dst = D + (size_t)p * M;
  for (int m = threadIdx.x; m < M; m += blockDim.x)
    dst[m] = fmoe::from_f32<T>(s * fmoe::to_f32<T>(src[m]));
}

template <typename T>
__global__ void combine_kernel(const T *__restrict__ Y, const int64_t *__restrict__ pos,
                               const float *__restrict__ w, T *__restrict__ y, int k, int T_,
                               int M, int64_t R, int32_t *__restrict__ bad) {
  const int t = blockIdx.x;
  if (bad && threadIdx.x == 0)
    for (int j = 0; j < k; ++j)
      if (pos[(size_t)j * T_ + t] >= R) *bad = 1;
  for (int m = threadIdx.x; m < M; m += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      const int64_t p = pos[(size_t)j * T_ + t];
      if (p < 0 || p >= R) continue;
      const float s = w ? w[(size_t)j * T_ + t] : 1.0f;
      acc = fmaf(s, fmoe::to_f32<T>(Y[(size_t)p * M + m]), acc);
    }
    y[(size_t)t * M + m] = fmoe::from_f32<T>(acc);
  }
}

int threads_for(int M) { return M >= 1024 ? 256 : (M >= 256 ? 128 : 64); }

}  // namespace

extern "C" int fmoe_dispatch(const void *x, const int64_t *pos, const float *w, void *D, int dtype,
                             int k, int T, int M, int64_t R, int32_t *bad, void *stream) {
  // One CTA per (j, t): k * T must fit the grid's x dimension.
  if (k < 0 || T < 0 || M < 0 || R < 0 || (int64_t)k * T > INT_MAX) return FMOE_ERR_BAD_SHAPE;
  if (k == 0 || T == 0) return 0;
  // M == 0 still launches: the positions are range-checked. R == 0: D is never written.
  if (!pos || (M > 0 && (!x || (R > 0 && !D)))) return FMOE_ERR_BAD_ARGUMENT;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int nb = k * T, th = threads_for(M);
  if (dtype == FMOE_DTYPE_F32)
    dispatch_kernel<float><<<nb, th, 0, s>>>(static_cast<const float *>(x), pos, w,
                                             static_cast<float *>(D), T, M, R, bad);
  else if (dtype == FMOE_DTYPE_BF16)
    dispatch_kernel<__nv_bfloat16><<<nb, th, 0, s>>>(static_cast<const __nv_bfloat16 *>(x), pos, w,
                                                     static_cast<__nv_bfloat16 *>(D), T, M, R, bad);
  else
    return FMOE_ERR_BAD_DTYPE;
  return (int)cudaGetLastError();
}

extern "C" int fmoe_combine(const void *Y, const int64_t *pos, const float *w, void *y, int dtype,
                            int k, int T, int M, int64_t R, int32_t *bad, void *stream) {
  if (k < 0 || T < 0 || M < 0 || R < 0) return FMOE_ERR_BAD_SHAPE;
  if (T == 0) return 0;
  // k == 0 still launches: every token's row is written (as zeros). M == 0: the positions are
  // still range-checked.
  if ((k > 0 && !pos) || (M > 0 && (!y || (k > 0 && R > 0 && !Y)))) return FMOE_ERR_BAD_ARGUMENT;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int th = threads_for(M);
  if (dtype == FMOE_DTYPE_F32)
    combine_kernel<float><<<T, th, 0, s>>>(static_cast<const float *>(Y), pos, w,
                                           static_cast<float *>(y), k, T, M, R, bad);
  else if (dtype == FMOE_DTYPE_BF16)
    combine_kernel<__nv_bfloat16><<<T, th, 0, s>>>(static_cast<const __nv_bfloat16 *>(Y), pos, w,
                                                   static_cast<__nv_bfloat16 *>(y), k, T, M, R, bad);
  else
    return FMOE_ERR_BAD_DTYPE;
  return (int)cudaGetLastError();
}
