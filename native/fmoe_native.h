/* fmoe native CUDA kernels: C ABI.
 *
 * All pointers are device pointers; `stream` is a cudaStream_t passed as void* so this header
 * needs no CUDA include. Every function returns 0 on success, or a cudaError_t / negative
 * fmoe error code (see fmoe_native_error_string) and never synchronises the stream.
 * Layouts are row-major and contiguous; shapes are in the comments.
 * Arguments are validated before anything touches CUDA, in this order: sizes (negative or past
 * the grid limits: FMOE_ERR_BAD_SHAPE), empty work (returns 0 and launches nothing), NULL data
 * pointers (FMOE_ERR_BAD_ARGUMENT), alignment (FMOE_ERR_MISALIGNED), dtype / format codes.
 */
#ifndef FMOE_NATIVE_H
#define FMOE_NATIVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library builds with -fvisibility=hidden; only these entry points are exported. */
#define FMOE_API __attribute__((visibility("default")))

#define FMOE_ERR_BAD_SHAPE (-1)
#define FMOE_ERR_BAD_DTYPE (-2)
#define FMOE_ERR_BAD_FORMAT (-3)
#define FMOE_ERR_BAD_ARGUMENT (-4) /* a NULL pointer where the sizes need data */
#define FMOE_ERR_MISALIGNED (-5)   /* a pointer the kernel's 16-byte loads need 16-byte aligned */

#define FMOE_DTYPE_F32 0
#define FMOE_DTYPE_BF16 1

#define FMOE_FMT_MXFP4 0 /* E2M1, 32-element blocks, E8M0 scale bytes */
#define FMOE_FMT_NVFP4 1 /* E2M1, 16-element blocks, UE4M3 scale bytes, fp32 scale per expert */

/* Version string of the library, e.g. "fmoe_native 0.3.0 (sm_80 sm_90 sm_100)". */
FMOE_API const char *fmoe_native_version(void);
FMOE_API const char *fmoe_native_error_string(int code);

/* Grouped W4A16 expert matmul (GEMV-style for decode): y[e] = x[e] @ dequant(w[e])^T.
 *   x      bf16 [E, C, K]
 *   w      uint8 [E, N, K/2]     packed E2M1, element 2i in the low nibble
 *   scales uint8 [E, N, K/32] (MXFP4, E8M0) or [E, N, K/16] (NVFP4, E4M3 bytes)
 *   gscale fp32 [E] (NVFP4 weight_scale_2, applied as epilogue alpha) or NULL (MXFP4)
 *   y      bf16 [E, C, N]
 * K must be a multiple of 32; x and w 16-byte aligned (FMOE_ERR_MISALIGNED otherwise: the kernel
 * reads both with 16-byte loads). E, C or N == 0: nothing to do. E <= 65535. Weights are dequantized in
 * registers; FP32 accumulation. */
FMOE_API int fmoe_w4a16_grouped_matmul(const void *x, const uint8_t *w, const uint8_t *scales,
                              const float *gscale, void *y, int fmt, int E, int C, int N, int K,
                              void *stream);

/* The same W4A16 matmul over rows sorted by expert (a rows plan, no padding):
 *   y[r] = x[r] @ dequant(w[e])^T for offsets[e] <= r < offsets[e + 1]
 *   x       bf16 [R, K]          rows of expert 0, then expert 1, ...
 *   offsets int64 [E + 1]        device memory, read by the kernel (the host never reads them)
 *   w, scales, gscale            as fmoe_w4a16_grouped_matmul
 *   y       bf16 [R, N]          rows outside every expert's range are left untouched (pass a zeroed y)
 * Grid (N tiles, E): a block whose expert has no rows returns before reading a weight byte. Each
 * range is clamped to [0, R], so bad offsets never move an access outside x and y. Same per-row
 * code as the padded entry: an expert's rows give the same bits as its C rows there. Checks and
 * codes as fmoe_w4a16_grouped_matmul (E, R or N == 0: nothing to do; offsets NULL:
 * FMOE_ERR_BAD_ARGUMENT). */
FMOE_API int fmoe_w4a16_rows_matmul(const void *x, const int64_t *offsets, const uint8_t *w,
                                    const uint8_t *scales, const float *gscale, void *y, int fmt, int E,
                                    int R, int N, int K, void *stream);

/* Grouped FP8 block-scaled GEMM (DeepSeek convention): for each expert e,
 *   y[e, m, n] = sum_kb a_s[e, m, kb] * b_s[e, n/128, kb] * sum_{k in kb} a[e,m,k] * b[e,n,k]
 *   a    e4m3 bytes [E, M, K]      activations, 1x128 tiles
 *   a_s  fp32 [E, M, ceil(K/128)]
 *   b    e4m3 bytes [E, N, K]      weights, 128x128 blocks
 *   b_s  fp32 [E, ceil(N/128), ceil(K/128)]  (weight_scale_inv)
 *   y    bf16 [E, M, N]
 * CUDA-core kernel (no wgmma): FP8 decoded to FP32 in shared-memory tiles, FP32 partial sums
 * per 128-wide K block, scales applied at block end (the promotion scheme of spec §4.3).
 * 16-byte loads are used only where K % 16 == 0 and a / b are 16-byte aligned (byte loads
 * otherwise), so any pointer is accepted. E, M or N == 0: nothing to do. E <= 65535. */
FMOE_API int fmoe_fp8_block_grouped_gemm(const uint8_t *a, const float *a_s, const uint8_t *b,
                                const float *b_s, void *y, int E, int M, int N, int K,
                                void *stream);

/* Dispatch: D[pos[j,t], :] = w[j,t] * x[t, :] for 0 <= pos[j,t] < R (rows of D not named by pos
 * are left untouched; pass a zeroed D). pos int64 [k, T] flat row index into D [R, M]; negative
 * entries are skipped; an entry >= R is skipped and sets *bad = 1 (bad: a device int32 the
 * caller zeroed, or NULL) so the caller can raise without this call synchronising.
 * w fp32 [k, T] or NULL (weight 1). x [T, M], D [R, M] of `dtype`. k or T == 0: nothing to do.
 * Element-wise (scalar) accesses: natural alignment suffices. */
FMOE_API int fmoe_dispatch(const void *x, const int64_t *pos, const float *w, void *D, int dtype, int k,
                  int T, int M, int64_t R, int32_t *bad, void *stream);

/* Combine: y[t, :] = sum_j w[j,t] * Y[pos[j,t], :] over 0 <= pos < R, FP32 accumulation; an
 * entry >= R is skipped and sets *bad = 1 (as for dispatch). Y [R, M], y [T, M] of `dtype`;
 * w fp32 [k, T] or NULL (weight 1). T == 0: nothing to do; k == 0 writes zeros. */
FMOE_API int fmoe_combine(const void *Y, const int64_t *pos, const float *w, void *y, int dtype, int k,
                 int T, int M, int64_t R, int32_t *bad, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* FMOE_NATIVE_H */
