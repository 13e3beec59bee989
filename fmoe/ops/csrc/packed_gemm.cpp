// Native CPU grouped GEMM over packed low-precision expert weights (fmoe.quant.QuantizedTensor):
// out[r] = a[r] @ dequant(w[e]).T for the rows r of every busy expert e, in ONE call per
// projection. The weights are decoded in registers and never written out as floats (except
// by the many-rows path below, one L2-sized tile at a time). The Python front
// (fmoe/quant/packed.py) validates every argument and allocates the output; the checks here
// are a backstop so that a caller who skips it still cannot make us read outside a buffer.
//
// Formats (fmoe/quant/tensor.py's layout, expert-major, rows = output channels):
//   fp4: data uint8 [E, N, K/2] (E2M1 codes, low nibble = even k), scales uint8 [E, N, K/bk]
//        decoded through a 256-entry float table (E8M0 for mxfp4, E4M3 for nvfp4), and an
//        optional per-expert float gscale [E] (nvfp4's second-level scale).
//   fp8: data uint8 [E, N, K] (E4M3 bytes), scales either float32 [E, ceil(N/bn), ceil(K/bk)]
//        (fp8_block, fp8_row) or uint8 E8M0 [E, N, K/32] through the table (mxfp8).
//
// Work split: jobs = (busy expert, tile of weight rows); each intra-op thread runs its own
// contiguous stretch of them and then takes what is left of the others' (per-stretch counters),
// so the threads split the weight stream in long runs. Per job, experts with few rows
// (C <= dense_from) run register tiles (run_tiles): a group of 1, 2 or 4 weight rows is decoded
// once and multiplied with up to 4 (FP4 on AVX-512) or 8 activation rows held in registers;
// more rows go in passes over slices of weight rows that stay in L1, so every weight byte comes
// from memory once. Experts with more rows decode the tile once (to bf16 for bf16 rows where that
// is exact, else float32; on AVX-512 float32 tiles over 1 MiB in 1024-k slices) and multiply it
// with one BLAS call per tile (single-threaded inside the parallel region): run_job_dense.
//
// ISA: every path is compiled into this one library with per-function target attributes
// (no -march flag); the caller picks one at run time (`isa`: 0 auto, 1 portable, 2 AVX2+FMA
// +F16C, 3 AVX-512 F/BW/VL/DQ), auto taking the best the CPU reports.
//
// Numerics: accumulation in float32; the decoded weight times its block scale is the
// product dequantize() forms (exact for FP4: 2 significant bits times a power of two or an
// E4M3 value); the summation order differs from dequantize-then-matmul, so results agree
// within the forward-error bound of a K-term dot product. nvfp4's global scale multiplies
// the finished dot product (dequantize() rounds it into every weight): one more rounding.
// The AVX-512 tiles sum a scale block's products unscaled and multiply the block sum by the
// scale (FP4: per lane; FP8: per block), another order of the same exact-product sum. Rows near
// float32's limit, where that sum could overflow, run scaled by a power of two (grouped_run);
// bf16 rows near the denormals take the float32 paths (bf16_far_from_denormals).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// MKL's bf16 GEMM with a float32 result (C = alpha A op(B) + beta C, LP64 ints), which the x86
// torch wheels export from libtorch_cpu: for bf16 rows of weights with a scale the bf16 tile cannot
// hold exactly (NVFP4's second-level scale, FP8's float block scales), its alpha, on CPUs where
// fmoe's own bf16 tile GEMM (gemm_bf16_scaled: AVX-512 BF16 without AMX) does not run. On an AMD
// EPYC (Zen 4) MKL's took 2.3x at::mm's time on MXFP4 tiles, and 1.7x / 1.5x gemm_bf16_scaled's on
// FP8 ones; on a Xeon (AMX) it had run at 0.86-1.10x bf16 experts' time. MXFP4 tiles take at::mm
// (torch's bf16 GEMM, oneDNN in the x86 wheels, the one bf16 experts run). A weak reference: null
// where this torch build has no MKL, and then NVFP4 and FP8 bf16 rows take fmoe's GEMM or the
// float32 path. Called inside the OpenMP region, MKL and oneDNN run on the calling thread alone
// (their default for nested calls).
extern "C" __attribute__((weak)) void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n,
                                                             int k, float alpha, const uint16_t* a, int lda,
                                                             const uint16_t* b, int ldb, float beta, float* c,
                                                             int ldc);

namespace {

// How far ahead the register tiles prefetch: the byte this many bytes after the one they load
// (an expert's rows are contiguous, so this is the same column of a later row), at least
// kPrefetchRows rows and kPrefetchBytes bytes (Params::pf). From memory, the hardware prefetchers
// alone left the decode-bound loops waiting on DRAM: measured 1.7x faster expert GEMMs at T = 1
// with it. A tile reads up to 4 rows side by side, so the distance must exceed 4 rows to reach
// rows not yet read; in bytes so that short rows (down_proj's) still run far enough ahead. The
// hint is L2 (T1), not L1: L2 holds more misses in flight than L1's fill buffers, which the
// tiles' own loads need (FP8 block at T = 1 and 4: 8% faster cold, FP4 2-3%).
constexpr int64_t kPrefetchRows = 8;
constexpr int64_t kPrefetchBytes = 8192;
#define FMOE_PREFETCH(ptr) _mm_prefetch(reinterpret_cast<const char*>(ptr), _MM_HINT_T1)
constexpr int64_t kTileN = 64;        // weight rows per job (register kernels)
constexpr int64_t kTileDense = 256;   // weight rows per job decoded to float or bf16 (2 MiB of float32 at K = 2048)
constexpr int64_t kSliceK = (int64_t(1) << 20) / (kTileDense * 4);  // 1024: k per 1 MiB float32 slice (run_job_dense_ksplit)

// E2M1 code -> value (spec table); sign is bit 3.
constexpr float kE2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

struct Params {
  const float* a;       // [R, K] activations, plan order (possibly a permuted copy, see prep_*)
  int64_t K, N;         // reduction length, weight rows per expert
  const uint8_t* data;  // packed weights
  const uint8_t* data_end;  // one past data's last byte
  int64_t d_e, d_r;     // strides (bytes) of data: per expert, per row
  const uint8_t* sb;    // byte scales (table) or nullptr
  const float* sf;      // float scales or nullptr
  int64_t s_e, s_r;     // strides (elements) of the scales: per expert, per scale row
  int64_t bn, bk;       // scale block (rows, k)
  const float* table;   // [256] byte scale -> value
  const float* e4m3;    // [256] E4M3 byte -> value (fp8 portable decode)
  const float* gscale;  // [E] or nullptr
  float* out;           // [R, N]
  bool fp4;
  bool e8m0;            // table is E8M0's (e8m0_table)
  bool e4m3_scales;     // table is the E4M3 one (nvfp4's scales), bit for bit
  bool blas;            // bf16 rows may take MKL's bf16 GEMM where it is there (false: the fallbacks)
  bool dot_bf16;        // bf16 rows may take the vdpbf16ps kernels: the dot-product tiles (FP4) and
                        // gemm_bf16_scaled (false: the float tiles, MKL's GEMM or the float32 path)
  int64_t pf;           // prefetch distance in bytes of data (a multiple of 64 and of d_r)
  int64_t pf_s;         // the same rows' distance in the byte scales (pf / d_r scale rows)
};

struct Job {
  int64_t e, lo, c, n0, n1;  // expert, its first row, its row count, weight rows [n0, n1)
};

inline float scale_of(const Params& p, int64_t e, int64_t n, int64_t kb) {
  const int64_t i = e * p.s_e + (n / p.bn) * p.s_r + kb;
  return p.sf != nullptr ? p.sf[i] : p.table[p.sb[i]];
}

// The scales of one weight row: the index arithmetic (a division by bn) done once per row, not
// per block.
struct RowScales {
  const uint8_t* b;
  const float* f;
  const float* table;
  RowScales() = default;
  RowScales(const Params& p, int64_t e, int64_t n)
      : b(p.sb != nullptr ? p.sb + e * p.s_e + (n / p.bn) * p.s_r : nullptr),
        f(p.sf != nullptr ? p.sf + e * p.s_e + (n / p.bn) * p.s_r : nullptr),
        table(p.table) {}
  float operator[](int64_t kb) const { return f != nullptr ? f[kb] : table[b[kb]]; }
};

inline float gscale_of(const Params& p, int64_t e) { return p.gscale != nullptr ? p.gscale[e] : 1.0f; }

// ------------------------------------------------------------------ portable (and the decode-to-float tile)

// Row n of expert e decoded to float32 (natural k order), value * block scale, as dequantize()
// forms it (the global scale left out: it multiplies the dot product).
void decode_row_portable(const Params& p, int64_t e, int64_t n, float* w) {
  const uint8_t* row = p.data + e * p.d_e + n * p.d_r;
  for (int64_t k0 = 0; k0 < p.K; k0 += p.bk) {
    const int64_t k1 = std::min(p.K, k0 + p.bk);
    const float s = scale_of(p, e, n, k0 / p.bk);
    if (p.fp4) {
      for (int64_t k = k0; k < k1; ++k) {
        const uint8_t b = row[k >> 1];
        w[k] = kE2M1[(k & 1) ? (b >> 4) : (b & 15)] * s;
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) w[k] = p.e4m3[row[k]] * s;
    }
  }
}

void rows_portable(const Params& p, const Job& j, std::vector<float>& w) {
  w.resize(p.K);
  const float g = gscale_of(p, j.e);
  for (int64_t n = j.n0; n < j.n1; ++n) {
    decode_row_portable(p, j.e, n, w.data());
    for (int64_t c = 0; c < j.c; ++c) {
      const float* x = p.a + (j.lo + c) * p.K;
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) acc += x[k] * w[k];
      p.out[(j.lo + c) * p.N + n] = acc * g;
    }
  }
}

// ------------------------------------------------------------------ AVX2 + FMA + F16C

#define FMOE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define FMOE_INLINE inline __attribute__((always_inline))

using TileFn = void (*)(const Params&, int64_t, int64_t, const float*, float*);

// Weight rows n0, n0 + NR, ... (while a whole group of NR fits below n1) against NT activation
// rows through the tile kernel F, inlined, so a job pays the call, the constants and the register
// setup once rather than per group; out = the first activation row's output row, g = gscale.
template <TileFn F, int NR, int NT>
FMOE_AVX2 void rows_avx2(const Params& p, int64_t e, int64_t n0, int64_t n1, const float* x, float* out, float g) {
  float res[NR * NT];
  for (int64_t n = n0; n + NR <= n1; n += NR) {
    F(p, e, n, x, res);
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < NR; ++i) out[t * p.N + n + i] = res[t * NR + i] * g;
  }
}

FMOE_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 E4M3 bytes -> 8 floats * 2^-8 (E4M3 placed in binary16: exponent bias 7 vs 15, the
// subnormals line up too), NaN codes 0x7F / 0xFF to NaN.
FMOE_AVX2 inline __m256 e4m3x8_avx2(const uint8_t* q) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
  __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3F80)),
                           _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(static_cast<short>(0x8000))));
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), _mm_set1_epi16(0x7F));
  h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7E00)));
  return _mm256_cvtph_ps(h);
}

// 16 packed FP4 bytes (32 codes) -> signed int8 of 2 * E2M1 for the low (even k) and high
// (odd k) nibbles.
FMOE_AVX2 inline void fp4x32_i8_avx2(const uint8_t* q, __m128i& lo, __m128i& hi) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i m = _mm_set1_epi8(15);
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  lo = _mm_shuffle_epi8(lut, _mm_and_si128(v, m));
  hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), m));
}

FMOE_AVX2 inline __m256 i8x8_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

FMOE_AVX2 void decode_row_avx2(const Params& p, int64_t e, int64_t n, float* w) {
  const uint8_t* row = p.data + e * p.d_e + n * p.d_r;
  if (p.fp4) {
    if (p.K % 32 != 0) return decode_row_portable(p, e, n, w);
    for (int64_t k = 0; k < p.K; k += 32) {
      // 2 * E2M1 * (s / 2): exact, the same value as dequantize()'s E2M1 * s.
      const __m256 s0 = _mm256_set1_ps(0.5f * scale_of(p, e, n, k / p.bk));
      const __m256 s1 = _mm256_set1_ps(0.5f * scale_of(p, e, n, (k + 16) / p.bk));
      __m128i lo, hi;
      fp4x32_i8_avx2(row + k / 2, lo, hi);
      const __m128i a = _mm_unpacklo_epi8(lo, hi), b = _mm_unpackhi_epi8(lo, hi);  // k order
      _mm256_storeu_ps(w + k, _mm256_mul_ps(i8x8_ps(a), s0));
      _mm256_storeu_ps(w + k + 8, _mm256_mul_ps(i8x8_ps(_mm_srli_si128(a, 8)), s0));
      _mm256_storeu_ps(w + k + 16, _mm256_mul_ps(i8x8_ps(b), s1));
      _mm256_storeu_ps(w + k + 24, _mm256_mul_ps(i8x8_ps(_mm_srli_si128(b, 8)), s1));
    }
    return;
  }
  for (int64_t k0 = 0; k0 < p.K; k0 += p.bk) {
    const int64_t k1 = std::min(p.K, k0 + p.bk);
    const float s = scale_of(p, e, n, k0 / p.bk);
    const __m256 s8 = _mm256_set1_ps(s * 256.0f);
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) _mm256_storeu_ps(w + k, _mm256_mul_ps(e4m3x8_avx2(row + k), s8));
    for (; k < k1; ++k) w[k] = p.e4m3[row[k]] * s;
  }
}

// One FP8 weight row's E4M3 values without their scale (float32, exact).
FMOE_AVX2 void decode_e4m3_row_avx2(const Params& p, const uint8_t* row, float* w) {
  const __m256 s8 = _mm256_set1_ps(256.0f);
  int64_t k = 0;
  for (; k + 8 <= p.K; k += 8) _mm256_storeu_ps(w + k, _mm256_mul_ps(e4m3x8_avx2(row + k), s8));
  for (; k < p.K; ++k) w[k] = p.e4m3[row[k]];
}

// FP4 tile on AVX2: NR consecutive weight rows n.. against NT activation rows (x permuted per 32 k
// as [16 even k, 16 odd k], prep_acts), res[t * NR + i]. 16 packed bytes (32 k) at a time,
// decoded once for all NT rows to 2 * E2M1 int8 (vpshufb), widened to float and multiplied by
// half the block scale (exact: the product dequantize() forms). P accumulator chains per
// (row, activation row) hide the FMA latency when NR * NT is small. Requires K % 32 == 0 and
// bk in {16, 32}.
template <int NR, int NT>
FMOE_AVX2 FMOE_INLINE void fp4_tile_avx2(const Params& p, int64_t e, int64_t n, const float* x0, float* res) {
  constexpr int P = NR * NT <= 2 ? 2 : 1;
  const int sh = p.bk == 32 ? 5 : 4;
  const uint8_t* r[NR];
  const uint8_t* sr[NR];
  for (int i = 0; i < NR; ++i) {
    r[i] = p.data + e * p.d_e + (n + i) * p.d_r;
    sr[i] = p.sb + e * p.s_e + (n + i) * p.s_r;
  }
  __m256 acc[NR][NT][P];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t)
      for (int c = 0; c < P; ++c) acc[i][t][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < p.K; k += 32) {
    for (int i = 0; i < NR; ++i) {
      const __m256 s0 = _mm256_set1_ps(0.5f * p.table[sr[i][k >> sh]]);
      const __m256 s1 = _mm256_set1_ps(0.5f * p.table[sr[i][(k + 16) >> sh]]);
      __m128i lo, hi;
      fp4x32_i8_avx2(r[i] + k / 2, lo, hi);
      FMOE_PREFETCH(r[i] + k / 2 + p.pf);
      const __m256 w0 = _mm256_mul_ps(i8x8_ps(lo), s0);                     // even k 0..14
      const __m256 w1 = _mm256_mul_ps(i8x8_ps(_mm_srli_si128(lo, 8)), s1);  // even k 16..30
      const __m256 w2 = _mm256_mul_ps(i8x8_ps(hi), s0);                     // odd k 1..15
      const __m256 w3 = _mm256_mul_ps(i8x8_ps(_mm_srli_si128(hi, 8)), s1);  // odd k 17..31
      for (int t = 0; t < NT; ++t) {
        const float* x = x0 + t * p.K + k;
        acc[i][t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[i][t][0]);
        acc[i][t][P - 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[i][t][P - 1]);
        acc[i][t][0] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), acc[i][t][0]);
        acc[i][t][P - 1] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), acc[i][t][P - 1]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t)
      res[t * NR + i] = hsum256(P == 2 ? _mm256_add_ps(acc[i][t][0], acc[i][t][P - 1]) : acc[i][t][0]);
}

// 16 E4M3 bytes -> two vectors of 8 floats * 2^-8 (the binary16 placement of e4m3x32_avx512;
// NaN codes come out finite, the caller checks them).
FMOE_AVX2 inline void e4m3x16_avx2(__m128i b8, __m256& f0, __m256& f1) {
  const __m256i b = _mm256_cvtepu8_epi16(b8);
  const __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(b, 8), 1),
                                     _mm256_set1_epi16(static_cast<short>(0xBF80)));
  f0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  f1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// FP8 tile on AVX2 (see fp8_tile_avx512): 16 weights at a time decoded once for all NT rows and
// multiplied by the block scale (times 2^8); k beyond the last whole 16 of a block run scalar.
template <int NR, int NT>
FMOE_AVX2 FMOE_INLINE void fp8_tile_avx2(const Params& p, int64_t e, int64_t n, const float* x0, float* res) {
  constexpr int P = NR * NT <= 2 ? 2 : 1;
  const uint8_t* r[NR];
  RowScales rs[NR];
  for (int i = 0; i < NR; ++i) {
    r[i] = p.data + e * p.d_e + (n + i) * p.d_r;
    rs[i] = RowScales(p, e, n + i);
  }
  __m256 acc[NR][NT][P];
  float tail[NR][NT];
  int nan[NR];
  for (int i = 0; i < NR; ++i) {
    nan[i] = 0;
    for (int t = 0; t < NT; ++t) {
      tail[i][t] = 0.0f;
      for (int c = 0; c < P; ++c) acc[i][t][c] = _mm256_setzero_ps();
    }
  }
  const __m128i m7f = _mm_set1_epi8(0x7F);
  for (int64_t k0 = 0; k0 < p.K; k0 += p.bk) {
    const int64_t k1 = std::min(p.K, k0 + p.bk);
    __m256 s8[NR];
    float s[NR];
    for (int i = 0; i < NR; ++i) {
      s[i] = rs[i][k0 / p.bk];
      s8[i] = _mm256_set1_ps(s[i] * 256.0f);
    }
    int64_t k = k0;
    for (; k + 16 <= k1; k += 16) {
      for (int i = 0; i < NR; ++i) {
        const __m128i b8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[i] + k));
        FMOE_PREFETCH(r[i] + k + p.pf);
        nan[i] |= _mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(b8, m7f), m7f));
        __m256 w0, w1;
        e4m3x16_avx2(b8, w0, w1);
        w0 = _mm256_mul_ps(w0, s8[i]);
        w1 = _mm256_mul_ps(w1, s8[i]);
        for (int t = 0; t < NT; ++t) {
          const float* x = x0 + t * p.K + k;
          acc[i][t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x), acc[i][t][0]);
          acc[i][t][P - 1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), acc[i][t][P - 1]);
        }
      }
    }
    for (int i = 0; i < NR; ++i)
      for (int64_t kk = k; kk < k1; ++kk) {
        const float wv = p.e4m3[r[i][kk]] * s[i];
        for (int t = 0; t < NT; ++t) tail[i][t] += wv * x0[t * p.K + kk];
      }
  }
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t)
      res[t * NR + i] = nan[i] ? std::numeric_limits<float>::quiet_NaN()
                               : hsum256(P == 2 ? _mm256_add_ps(acc[i][t][0], acc[i][t][P - 1]) : acc[i][t][0]) + tail[i][t];
}

// ------------------------------------------------------------------ AVX-512 (F, BW, VL, DQ)

#define FMOE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

template <TileFn F, int NR, int NT>  // rows_avx2 for the AVX-512 tiles
FMOE_AVX512 void rows_avx512(const Params& p, int64_t e, int64_t n0, int64_t n1, const float* x, float* out, float g) {
  float res[NR * NT];
  for (int64_t n = n0; n + NR <= n1; n += NR) {
    F(p, e, n, x, res);
    for (int t = 0; t < NT; ++t)
      for (int i = 0; i < NR; ++i) out[t * p.N + n + i] = res[t * NR + i] * g;
  }
}

// 16 scale values for one 64-byte FP4 chunk (128 k), lane j covering k = 8j .. 8j + 7 (the lanes
// of every AVX-512 FP4 tile: float, int8 and bf16 dot products): lane j's block is 8j / BK; sr
// points at the chunk's first scale byte. E8 (BK = 32, E8M0 bytes none 0 or 255: e8m0_plain): the
// floats are the bits b << 23, spread with one vpshufb (per 128-bit lane L, lanes j = 4L .. 4L + 3,
// every dword takes byte L), the table's values without its four reads.
template <int BK, bool E8 = false>
FMOE_AVX512 inline __m512 fp4_scales16(const Params& p, const uint8_t* sr) {
  static_assert(!E8 || BK == 32, "the E8M0 bit path spreads 4 scales per chunk");
  const float* table = p.table;
  if constexpr (E8) {
    int32_t b4;
    std::memcpy(&b4, sr, 4);
    const __m512i spread = _mm512_set_epi32(0x80808003, 0x80808003, 0x80808003, 0x80808003, 0x80808002, 0x80808002,
                                            0x80808002, 0x80808002, 0x80808001, 0x80808001, 0x80808001, 0x80808001,
                                            0x80808000, 0x80808000, 0x80808000, 0x80808000);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_shuffle_epi8(_mm512_set1_epi32(b4), spread), 23));
  } else if constexpr (BK == 32) {
    const __m128 s = _mm_setr_ps(table[sr[0]], table[sr[1]], table[sr[2]], table[sr[3]]);
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(s));
  }
  // E4M3 scales (nvfp4) decode by arithmetic (the same floats as the table's, NaN codes to NaN):
  // a gather of 8 table entries costs more than the rest of a chunk's scale work on some CPUs
  const __m256 s = p.e4m3_scales ? _mm256_mul_ps(e4m3x8_avx2(sr), _mm256_set1_ps(256.0f))
                                 : _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                                                                  reinterpret_cast<const __m128i*>(sr))), 4);
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                               _mm512_castps256_ps512(s));
}

// FP4 tile: NR consecutive weight rows n.. against NT activation rows (x0, stride K, permuted by
// permute_acts), res[t * NR + i] = row (n + i) . x[t]. 64 packed bytes (128 k) at a time: dword j
// of the load holds the codes of k = 8j .. 8j + 7; vpermps reads only the low 4 bits of each
// index, so shifting by 4q and permuting the 16-entry E2M1 table gives k = 8j + q in lane j.
// Every lane of a chunk stays inside one scale block (8 | BK), so the chunk's products are summed
// per lane unscaled (two chains) and the lane's scale multiplies that sum once. The NR weight rows
// share every activation load; the tile is decoded once for all NT rows. The scales: fp4_scales16
// (E8: from their bits). Requires K % 128 == 0 and bk in {16, 32}.
template <int NR, int NT, int BK, bool E8>
FMOE_AVX512 FMOE_INLINE void fp4_tile_avx512(const Params& p, int64_t e, int64_t n, const float* x0, float* res) {
  constexpr int P = 2;
  constexpr int kSpc = 128 / BK;  // scales per chunk
  const int64_t nc = p.K / 128;
  const uint8_t* r[NR];
  const uint8_t* sr[NR];
  for (int i = 0; i < NR; ++i) {
    r[i] = p.data + e * p.d_e + (n + i) * p.d_r;
    sr[i] = p.sb + e * p.s_e + (n + i) * p.s_r;  // bn == 1 for FP4
  }
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  __m512 acc[NR][NT];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  // The index of k = 8j + q in lane j: the dword's nibble q (vpermps reads the low 4). Shifting
  // the chunk by 4q costs 7 shifts per chunk and row, which share the two vector ports with the
  // permutes and the FMAs (this loop is bound by them, not by memory). Where 3 more bytes follow
  // the chunk in data (all but the tensor's last chunk), the load o bytes further holds nibble
  // 2o in each dword's low 4 bits and nibble 2o + 1 in the next 4: loads (other ports) and 4
  // shifts instead. The same indices, so the same weights and sums.
#define FMOE_IDX_LOADS(i, q) \
  ((q) % 2 ? _mm512_srli_epi32(_mm512_loadu_si512(r[i] + 64 * c + (q) / 2), 4) : _mm512_loadu_si512(r[i] + 64 * c + (q) / 2))
#define FMOE_IDX_SHIFTS(i, q) ((q) ? _mm512_srli_epi32(v[i], 4 * (q)) : v[i])
#define FMOE_FP4_Q(IDX, q)                                                                        \
    {                                                                                             \
      __m512 w[NR];                                                                               \
      for (int i = 0; i < NR; ++i) w[i] = _mm512_permutexvar_ps(IDX(i, q), lut);                 \
      for (int t = 0; t < NT; ++t) {                                                              \
        const __m512 xv = _mm512_loadu_ps(xc + t * p.K + 16 * q);                                 \
        for (int i = 0; i < NR; ++i)                                                              \
          part[i][t][q % P] = q < P ? _mm512_mul_ps(w[i], xv) : _mm512_fmadd_ps(w[i], xv, part[i][t][q % P]); \
      }                                                                                           \
    }
#define FMOE_FP4_CHUNK(IDX)                                                                       \
  {                                                                                               \
    __m512i v[NR];                                                                                \
    for (int i = 0; i < NR; ++i) {                                                                \
      v[i] = _mm512_loadu_si512(r[i] + 64 * c);                                                   \
      FMOE_PREFETCH(r[i] + 64 * c + p.pf);                                                        \
      /* the scale rows too (kSpc bytes per chunk: one line per 64 / kSpc chunks) */              \
      if ((kSpc * c) % 64 == 0) FMOE_PREFETCH(sr[i] + kSpc * c + p.pf_s);                         \
    }                                                                                             \
    (void)v;                                                                                      \
    const float* xc = x0 + 128 * c;                                                               \
    __m512 part[NR][NT][P];                                                                       \
    FMOE_FP4_Q(IDX, 0) FMOE_FP4_Q(IDX, 1) FMOE_FP4_Q(IDX, 2) FMOE_FP4_Q(IDX, 3)                   \
    FMOE_FP4_Q(IDX, 4) FMOE_FP4_Q(IDX, 5) FMOE_FP4_Q(IDX, 6) FMOE_FP4_Q(IDX, 7)                   \
    for (int i = 0; i < NR; ++i) {                                                                \
      const __m512 s = fp4_scales16<BK, E8>(p, sr[i] + kSpc * c);                                 \
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_fmadd_ps(_mm512_add_ps(part[i][t][0], part[i][t][1]), s, acc[i][t]); \
    }                                                                                             \
  }
  const int64_t nloads = r[NR - 1] + p.d_r + 3 <= p.data_end ? nc : nc - 1;
  int64_t c = 0;
  for (; c < nloads; ++c) FMOE_FP4_CHUNK(FMOE_IDX_LOADS)
  for (; c < nc; ++c) FMOE_FP4_CHUNK(FMOE_IDX_SHIFTS)
#undef FMOE_FP4_CHUNK
#undef FMOE_FP4_Q
#undef FMOE_IDX_SHIFTS
#undef FMOE_IDX_LOADS
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) res[t * NR + i] = _mm512_reduce_add_ps(acc[i][t]);
}

// Whether the table is E8M0's (b -> 2^(b - 127), i.e. the float bits b << 23 for b in 1 .. 254).
bool e8m0_table(const float* table) {
  for (uint32_t b = 1; b < 255; ++b) {
    uint32_t bits;
    std::memcpy(&bits, table + b, 4);
    if (bits != b << 23) return false;
  }
  return true;
}

// Whether none of the n bytes is 0 or 255 (the E8M0 codes whose float is not b << 23).
FMOE_AVX512 bool e8m0_plain(const uint8_t* s, int64_t n) {
  __mmask64 bad = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i v = _mm512_loadu_si512(s + i);
    bad |= _mm512_cmpeq_epi8_mask(v, _mm512_setzero_si512()) | _mm512_cmpeq_epi8_mask(v, _mm512_set1_epi8(-1));
  }
  for (; i < n; ++i) bad |= (s[i] == 0 || s[i] == 255);
  return bad == 0;
}

// 32 E4M3 bytes -> two vectors of 16 floats * 2^-8: byte b placed in binary16 as (b << 8) >> 1
// (arithmetic: the sign lands in bits 15 and 14) & 0xBF80, i.e. sign, then exponent and
// mantissa with the bias 7 of E4M3 read as binary16's 15 (subnormals line up too). The NaN
// codes 0x7F / 0xFF decode to finite values here; the caller checks for them (clear_nan_bytes).
FMOE_AVX512 inline void e4m3x32_avx512(__m256i b8, __m512& f0, __m512& f1) {
  const __m512i b = _mm512_cvtepu8_epi16(b8);
  const __m512i h = _mm512_and_si512(_mm512_srai_epi16(_mm512_slli_epi16(b, 8), 1),
                                     _mm512_set1_epi16(static_cast<short>(0xBF80)));
  f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// ok with the bits of b8's NaN bytes (0x7F, 0xFF) cleared: a running "no NaN yet" mask per row,
// through the compare's write mask (no mask OR in the loop).
FMOE_AVX512 inline __mmask32 clear_nan_bytes(__mmask32 ok, __m256i b8) {
  return _mm256_mask_cmpneq_epi8_mask(ok, _mm256_and_si256(b8, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
}

// FP8 tile: NR consecutive weight rows n.. against NT activation rows (stride K, natural order),
// res[t * NR + i]. Per scale block of bk: 32 weights at a time decoded once for all NT rows,
// products summed unscaled in two chains, the block's scale (times 2^8) multiplies the block's
// sum once; k beyond the last whole 32 of a block run scalar through the E4M3 table. A row
// holding a NaN byte gives NaN, as dequantize() then matmul does.
// PRE (short blocks, mxfp8's 32): the decoded weights are multiplied by the scale instead and
// accumulated across blocks (a block sum per 32 weights costs more than it saves).
template <int NR, int NT, bool PRE>
FMOE_AVX512 FMOE_INLINE void fp8_tile_avx512(const Params& p, int64_t e, int64_t n, const float* x0, float* res) {
  const uint8_t* r[NR];
  RowScales rs[NR];
  for (int i = 0; i < NR; ++i) {
    r[i] = p.data + e * p.d_e + (n + i) * p.d_r;
    rs[i] = RowScales(p, e, n + i);
  }
  __m512 acc[NR][NT];
  float tail[NR][NT];
  __mmask32 ok[NR];  // all ones while the row has no NaN byte
  for (int i = 0; i < NR; ++i) {
    ok[i] = ~__mmask32(0);
    for (int t = 0; t < NT; ++t) {
      acc[i][t] = _mm512_setzero_ps();
      tail[i][t] = 0.0f;
    }
  }
  __m512 part[NR][NT][2];
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t) part[i][t][0] = part[i][t][1] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < p.K; k0 += p.bk) {
    const int64_t k1 = std::min(p.K, k0 + p.bk);
    float sb[NR];
    __m512 spre[NR];
    for (int i = 0; i < NR; ++i) sb[i] = rs[i][k0 / p.bk];
    if constexpr (PRE) {
      for (int i = 0; i < NR; ++i) spre[i] = _mm512_set1_ps(sb[i] * 256.0f);
    } else {
      for (int i = 0; i < NR; ++i)
        for (int t = 0; t < NT; ++t) part[i][t][0] = part[i][t][1] = _mm512_setzero_ps();
    }
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      __m512 w[NR][2];
      for (int i = 0; i < NR; ++i) {
        const __m256i b8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[i] + k));
        FMOE_PREFETCH(r[i] + k + p.pf);
        ok[i] = clear_nan_bytes(ok[i], b8);
        e4m3x32_avx512(b8, w[i][0], w[i][1]);
        if constexpr (PRE) {
          w[i][0] = _mm512_mul_ps(w[i][0], spre[i]);
          w[i][1] = _mm512_mul_ps(w[i][1], spre[i]);
        }
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 xa = _mm512_loadu_ps(x0 + t * p.K + k), xb = _mm512_loadu_ps(x0 + t * p.K + k + 16);
        for (int i = 0; i < NR; ++i) {
          part[i][t][0] = _mm512_fmadd_ps(w[i][0], xa, part[i][t][0]);
          part[i][t][1] = _mm512_fmadd_ps(w[i][1], xb, part[i][t][1]);
        }
      }
    }
    for (int i = 0; i < NR; ++i) {
      const float s = sb[i];
      if constexpr (!PRE) {
        const __m512 s8 = _mm512_set1_ps(s * 256.0f);
        for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_fmadd_ps(_mm512_add_ps(part[i][t][0], part[i][t][1]), s8, acc[i][t]);
      }
      for (int64_t kk = k; kk < k1; ++kk) {
        const float wv = p.e4m3[r[i][kk]] * s;
        for (int t = 0; t < NT; ++t) tail[i][t] += wv * x0[t * p.K + kk];
      }
    }
  }
  if constexpr (PRE)
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_add_ps(part[i][t][0], part[i][t][1]);
  for (int i = 0; i < NR; ++i)
    for (int t = 0; t < NT; ++t)
      res[t * NR + i] = ok[i] != ~__mmask32(0) ? std::numeric_limits<float>::quiet_NaN()
                                               : _mm512_reduce_add_ps(acc[i][t]) + tail[i][t];
}

// ------------------------------------------------------------------ int8 activations (AVX-512 VNNI), FP4 only

#define FMOE_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

// Activations quantized per 32-k block (d = amax / 127, q = round(x / d)), stored per 128-k chunk
// as int8 q in the FP4 byte order: 64 bytes of the even k (k = 2b), then 64 of the odd k.
// xd: 16 floats per chunk, lane j = the scale of k = 8j's block (the lanes of the VNNI sums).
// xs: 16 int32 per chunk, lane j = kW0 * (q_8j + ... + q_8j+7), which the weights' offset adds
// to lane j's sum (fp4_rows2_vnni).
constexpr int kW0 = 12;   // 2 * E2M1 lies in [-12, 12]: the weights enter vpdpbusd as 2 * E2M1 + kW0 (unsigned)

void quantize_acts_int8(const float* a, int64_t R, int64_t K, int8_t* xq, float* xd, int32_t* xs) {
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = a + r * K;
      for (int64_t c = 0; c < K / 128; ++c) {
        float d[4];
        for (int b = 0; b < 4; ++b) {
          float amax = 0.0f;
          for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[128 * c + 32 * b + i]));
          d[b] = amax / 127.0f;
        }
        int8_t* q = xq + (r * (K / 128) + c) * 128;
        int32_t* ss = xs + (r * (K / 128) + c) * 16;
        for (int j = 0; j < 16; ++j) ss[j] = 0;
        for (int i = 0; i < 128; ++i) {
          const int k = (i < 64) ? 2 * i : 2 * (i - 64) + 1;
          const float db = d[k / 32];
          const float v = db > 0.0f ? std::nearbyint(x[128 * c + k] / db) : 0.0f;
          q[i] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, v)));
          ss[k / 8] += kW0 * q[i];
        }
        float* dd = xd + (r * (K / 128) + c) * 16;
        for (int j = 0; j < 16; ++j) dd[j] = d[j / 4];
      }
    }
  });
}

// FP4 weight rows n, n2 against NT int8 activation rows: 2 * E2M1 + kW0 as unsigned bytes through
// vpshufb, vpdpbusd of those x the activations (s8) into 16 int32 lanes (lane j: k = 8j .. 8j + 7,
// one weight and one activation block), minus the activations' kW0 * sum (xs, made once per row),
// which leaves the exact integer sum of 2 * E2M1 * q; then lane * weight scale * activation scale
// into float. Requires K % 128 == 0 and bk in {16, 32}.
template <int NT, int BK, bool E8>
FMOE_VNNI void fp4_rows2_vnni(const Params& p, const Job& j, int64_t n, int64_t n2, const int8_t* xq,
                              const float* xd, const int32_t* xs, float* res, float* res2) {
  const uint8_t* r0 = p.data + j.e * p.d_e + n * p.d_r;
  const uint8_t* r1 = p.data + j.e * p.d_e + n2 * p.d_r;
  const uint8_t* sr0 = p.sb + j.e * p.s_e + n * p.s_r;
  const uint8_t* sr1 = p.sb + j.e * p.s_e + n2 * p.s_r;
  const __m512i lut = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i m4 = _mm512_set1_epi8(15);
  const int64_t nc = p.K / 128;
  __m512 acc[2][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t c = 0; c < nc; ++c) {
    const __m512i v0 = _mm512_loadu_si512(r0 + 64 * c), v1 = _mm512_loadu_si512(r1 + 64 * c);
    FMOE_PREFETCH(r0 + 64 * c + p.pf);
    FMOE_PREFETCH(r1 + 64 * c + p.pf);
    const __m512i a_lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v0, m4));
    const __m512i a_hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4));
    const __m512i b_lo = _mm512_shuffle_epi8(lut, _mm512_and_si512(v1, m4));
    const __m512i b_hi = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4));
    const __m512 s0 = fp4_scales16<BK, E8>(p, sr0 + 128 * c / BK);
    const __m512 s1 = fp4_scales16<BK, E8>(p, sr1 + 128 * c / BK);
    for (int t = 0; t < NT; ++t) {
      const int8_t* q = xq + (t * nc + c) * 128;
      const __m512i xl = _mm512_loadu_si512(q), xh = _mm512_loadu_si512(q + 64);
      const __m512i off = _mm512_loadu_si512(xs + (t * nc + c) * 16);
      const __m512 d = _mm512_loadu_ps(xd + (t * nc + c) * 16);
      const __m512i ia = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a_lo, xl), a_hi, xh), off);
      const __m512i ib = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), b_lo, xl), b_hi, xh), off);
      acc[0][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(s0, d), acc[0][t]);
      acc[1][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ib), _mm512_mul_ps(s1, d), acc[1][t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    res[t] = 0.5f * _mm512_reduce_add_ps(acc[0][t]);   // the sums hold 2 * E2M1
    res2[t] = 0.5f * _mm512_reduce_add_ps(acc[1][t]);
  }
}

template <int NT>
void rows_vnni(const Params& p, const Job& j, const int8_t* xq, const float* xd, const int32_t* xs, int64_t row0,
               bool e8) {
  float r0[4], r1[4];
  const float g = gscale_of(p, j.e);
  for (int64_t n = j.n0; n < j.n1; n += 2) {
    const int64_t n2 = std::min(n + 1, j.n1 - 1);
    if (p.bk == 16) fp4_rows2_vnni<NT, 16, false>(p, j, n, n2, xq, xd, xs, r0, r1);
    else if (e8) fp4_rows2_vnni<NT, 32, true>(p, j, n, n2, xq, xd, xs, r0, r1);
    else fp4_rows2_vnni<NT, 32, false>(p, j, n, n2, xq, xd, xs, r0, r1);
    for (int t = 0; t < NT; ++t) {
      p.out[(row0 + t) * p.N + n] = r0[t] * g;
      p.out[(row0 + t) * p.N + n2] = r1[t] * g;
    }
  }
}

void run_job_vnni(const Params& p, const Job& j, const int8_t* xq, const float* xd, const int32_t* xs) {
  const int64_t nc = p.K / 128;
  const bool e8 = p.bk == 32 && p.e8m0 && e8m0_plain(p.sb + j.e * p.s_e + j.n0 * p.s_r, (j.n1 - j.n0) * p.s_r);
  for (int64_t c = 0; c < j.c; c += 4) {
    const int64_t nt = std::min<int64_t>(4, j.c - c), r = j.lo + c;
    const int8_t* q = xq + r * nc * 128;
    const float* d = xd + r * nc * 16;
    const int32_t* sm = xs + r * nc * 16;
    switch (nt) {
      case 1: rows_vnni<1>(p, j, q, d, sm, r, e8); break;
      case 2: rows_vnni<2>(p, j, q, d, sm, r, e8); break;
      case 3: rows_vnni<3>(p, j, q, d, sm, r, e8); break;
      default: rows_vnni<4>(p, j, q, d, sm, r, e8); break;
    }
  }
}

// ------------------------------------------------------------------ bf16 rows: bf16 dot products (AVX-512 BF16), FP4 only

// bf16 rows of FP4 weights at decode. Both factors are exact in bf16 (an E2M1 value has 2
// significant bits, a bf16 row 8), so vdpbf16ps multiplies the same products the float tiles do,
// exactly, 32 a step against the float tiles' 16, and the decode is word table lookups (vpermw,
// 32 weights a step) instead of vpermps (16): about half the vector instructions a weight byte, which bounds
// these tiles on a CPU whose 512-bit units are two 256-bit halves (AMD Zen 4). Another order of
// the same exact-product sum (within the K-term bound); vdpbf16ps treats denormal inputs and
// results as zero, so it runs only where every nonzero activation is at least 2^-100 in magnitude
// (bf16_far_from_denormals), whence every product and partial sum is zero or far from the denormals.
#define FMOE_BF16DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")))

constexpr int64_t kDotBf16 = 4;   // grouped_run's return where these tiles ran
constexpr int64_t kGemmBf16 = 8;  // or'ed into it where gemm_bf16_scaled ran a job
// The most rows an expert these tiles take (past dense_from, which the float tiles keep). Each
// group of 4 rows decodes the weights again, and still they ran faster than the decoded tile's GEMM
// (gate_up [1536, 2048] / down [2048, 768], 64 experts, 2 threads, warm):
// - MXFP4 (a bf16 tile through at::mm, oneDNN; kOwnGemmRows) up to 32 rows: 12 rows 16.8 / 9.9 against
//   27.6 / 18.9 ms, 32 rows 43.9 / 25.1 against 48.4 / 28.9, 40 rows about level, 64 rows 87.4 / 50.1
//   against 76.1 / 45.0;
// - NVFP4 (its tile through gemm_bf16_scaled, the global scale its block scale) up to 16 rows: 9 rows
//   19.4 / 11.3 against 21.3 / 12.5 ms, 12 and 16 rows level (22.4 / 12.9 against 21.6 / 13.5, 31.0 /
//   15.8 against 29.2 / 16.1), 24 rows 47.3 / 25.5 against 38.4 / 21.6, 48 rows 74.1 / 46.1 against
//   62.3 / 37.0. (Against MKL's GEMM, which that tile took before, the tiles had won up to 128 rows.)
int64_t dot_rows(int64_t bk) { return bk == 16 ? 16 : 32; }

// The most rows an expert whose decoded bf16 tile needs no scale (MXFP4's) fmoe's tile GEMM
// (gemm_bf16_scaled) multiplies where it runs; more take at::mm (oneDNN). gemm_bf16_scaled's time
// over at::mm's (the shapes above, warm): 48 rows 0.90 / 0.92, 64 rows 0.95 / 0.97, 96 rows 1.00 /
// 1.01, 128 rows 1.01 / 1.08, 160 rows 1.05-1.14.
constexpr int64_t kOwnGemmRows = 64;

bool has_avx512_bf16() {
  static const bool has = [] {   // asked on every call of grouped_run: once per process
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512bf16");
  }();
  return has;
}

// A chunk of 64 packed bytes (128 k) decodes to four vectors of 32 bf16 words, straight from the
// chunk's 32 words: word i holds k = 4i + o in its nibble o (bytes 2i, 2i + 1, low nibble first).
// vpermw reads the low 5 bits of each index word, so the word shifted right by 4o indexes a
// 32-word table that holds the 16 E2M1 bf16 values twice (the fifth bit, the next nibble's low
// one, picks a copy): vector o word i is k = 4i + o. Four table lookups and three shifts a chunk
// (a widening to words first took six shuffles: on Zen 4 the shuffles share the units of
// vdpbf16ps, and this cut the tile's time a weight by a fifth). vdpbf16ps's lane j sums words
// 2j, 2j + 1 of each vector: k = 8j .. 8j + 7 over the four, inside one scale block for BK = 32
// (block j / 4) and BK = 16 (j / 2), so the four products of a chunk take one scale vector.
// Activations are stored per chunk in that order (4 x 32 words), for the rows of the experts the
// tiles run (those with at most max_rows rows; the others' rows are left unwritten).
void arrange_acts_bf16(const uint16_t* a, const int64_t* o, int64_t E, int64_t max_rows, int64_t K,
                       uint16_t* xb) {
  const int64_t nc = K / 128;
  for (int64_t e = 0; e < E; ++e) {
    if (o[e + 1] - o[e] > max_rows) continue;
    for (int64_t r = o[e]; r < o[e + 1]; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        const uint16_t* x = a + r * K + 128 * c;
        uint16_t* d = xb + (r * nc + c) * 128;
        for (int q = 0; q < 4; ++q)
          for (int i = 0; i < 32; ++i) d[q * 32 + i] = x[4 * i + q];
      }
  }
}

// Whether every nonzero value of the bf16 rows a [n] is at least 2^-100 in magnitude (biased
// exponent 27). vdpbf16ps, and the bf16 GEMMs that run on it on an AVX-512 BF16 CPU (oneDNN's
// at::mm, MKL's), read denormal inputs (below 2^-126) as zero and flush denormal results: a
// denormal activation times a weight of 2^125 is a product of 2^-1 lost. Rows that fail take the
// float32 paths (their float32 twin is exact). Past 2^-100, an FP4 value (at least 0.5) times a scale
// of at least 2^-25 (mxfp4_tile_in_bf16) or an E4M3 value or scale (at least 2^-9) gives products
// and partial sums that are zero or far from the denormals. In blocks, so the test vectorizes.
bool bf16_far_from_denormals(const uint16_t* a, int64_t n) {
  constexpr int64_t kBlock = 4096;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    int near = 0;
    for (int64_t i = b; i < end; ++i) near |= (((a[i] >> 7) & 0xFF) < 27) & ((a[i] & 0x7FFF) != 0);
    if (near) return false;
  }
  return true;
}

// 16 E4M3 scale bytes (two chunks' NVFP4 scales; m: the bytes to read, the others 0) as floats times
// 256 (exact): e4m3x32_avx512's decode, its NaN codes made NaN (as e4m3x8_avx2 makes them). One
// decode serves two chunks (fp4_rows2_bf16 spreads each half with one permute): decoding eight
// scales for every chunk took about a quarter of these tiles' time on NVFP4 (measured with the
// scales held constant).
FMOE_BF16DP inline __m512 e4m3x16_scales(const uint8_t* q, __mmask16 m) {
  const __m128i b8 = _mm_maskz_loadu_epi8(m, q);
  __m512 f, unused;
  e4m3x32_avx512(_mm256_zextsi128_si256(b8), f, unused);
  const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(b8, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
  return _mm512_mask_blend_ps(nan, _mm512_mul_ps(f, _mm512_set1_ps(256.0f)),
                              _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// FP4 weight rows n, n2 against NT bf16 activation rows (xb: arrange_acts_bf16's), res / res2.
// Requires K % 128 == 0 and bk in {16, 32}.
template <int NT, int BK, bool E8>
FMOE_BF16DP void fp4_rows2_bf16(const Params& p, const Job& j, int64_t n, int64_t n2, const uint16_t* xb,
                                float* res, float* res2) {
  constexpr int kSpc = 128 / BK;
  const uint8_t* r[2] = {p.data + j.e * p.d_e + n * p.d_r, p.data + j.e * p.d_e + n2 * p.d_r};
  const uint8_t* sr[2] = {p.sb + j.e * p.s_e + n * p.s_r, p.sb + j.e * p.s_e + n2 * p.s_r};
  // E2M1 code -> its bf16 (sign in bit 3), twice: index bit 4 is the next nibble's low bit
  const __m512i tab = _mm512_set_epi16(
      -16192, -16256, -16320, -16384, -16448, -16512, -16640, -32768, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0,
      -16192, -16256, -16320, -16384, -16448, -16512, -16640, -32768, 0x40C0, 0x4080, 0x4040, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
  const int64_t nc = p.K / 128;
  __m512 acc[2][NT];
  for (int t = 0; t < NT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  // NVFP4 with E4M3 scales: two chunks' scales decoded at once (e4m3x16_scales), each chunk's
  // spread to its lanes (lane j: scale j / 2) by one permute of its half
  const bool pair16 = BK == 16 && p.e4m3_scales;
  __m512 s16[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t c = 0; c < nc; ++c) {
    __m512bh w[2][4];
    __m512 sc[2];
    if (pair16 && c % 2 == 0) {
      const __mmask16 m = c + 1 < nc ? 0xFFFF : 0x00FF;
      for (int i = 0; i < 2; ++i) s16[i] = e4m3x16_scales(sr[i] + kSpc * c, m);
    }
    for (int i = 0; i < 2; ++i) {
      FMOE_PREFETCH(r[i] + 64 * c + p.pf);
      if ((kSpc * c) % 64 == 0) FMOE_PREFETCH(sr[i] + kSpc * c + p.pf_s);
      const __m512i v = _mm512_loadu_si512(r[i] + 64 * c);
      w[i][0] = (__m512bh)_mm512_permutexvar_epi16(v, tab);
      w[i][1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), tab);
      w[i][2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), tab);
      w[i][3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), tab);
      sc[i] = pair16 ? _mm512_permutexvar_ps(c % 2 ? _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)
                                                 : _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), s16[i])
                     : fp4_scales16<BK, E8>(p, sr[i] + kSpc * c);
    }
    for (int t = 0; t < NT; ++t) {
      const uint16_t* x = xb + (t * nc + c) * 128;
      __m512bh xv[4];
      for (int q = 0; q < 4; ++q) xv[q] = (__m512bh)_mm512_loadu_si512(x + 32 * q);
      for (int i = 0; i < 2; ++i) {
        __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), w[i][0], xv[0]), w[i][1], xv[1]);
        d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(d, w[i][2], xv[2]), w[i][3], xv[3]);
        acc[i][t] = _mm512_fmadd_ps(d, sc[i], acc[i][t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    res[t] = _mm512_reduce_add_ps(acc[0][t]);
    res2[t] = _mm512_reduce_add_ps(acc[1][t]);
  }
}

template <int NT, int BK, bool E8>
void rows_bf16(const Params& p, const Job& j, const uint16_t* xb, int64_t row0) {
  float r0[4], r1[4];
  const float g = gscale_of(p, j.e);
  for (int64_t n = j.n0; n < j.n1; n += 2) {
    const int64_t n2 = std::min(n + 1, j.n1 - 1);
    fp4_rows2_bf16<NT, BK, E8>(p, j, n, n2, xb, r0, r1);
    for (int t = 0; t < NT; ++t) {
      p.out[(row0 + t) * p.N + n] = r0[t] * g;
      p.out[(row0 + t) * p.N + n2] = r1[t] * g;
    }
  }
}

template <int BK, bool E8>
void run_job_bf16_bk(const Params& p, const Job& j, const uint16_t* xb) {
  const int64_t nc = p.K / 128;
  for (int64_t c = 0; c < j.c; c += 4) {
    const int64_t nt = std::min<int64_t>(4, j.c - c), r = j.lo + c;
    const uint16_t* x = xb + r * nc * 128;
    switch (nt) {
      case 1: rows_bf16<1, BK, E8>(p, j, x, r); break;
      case 2: rows_bf16<2, BK, E8>(p, j, x, r); break;
      case 3: rows_bf16<3, BK, E8>(p, j, x, r); break;
      default: rows_bf16<4, BK, E8>(p, j, x, r); break;
    }
  }
}

void run_job_bf16(const Params& p, const Job& j, const uint16_t* xb) {
  if (p.bk == 16) return run_job_bf16_bk<16, false>(p, j, xb);
  if (p.e8m0 && e8m0_plain(p.sb + j.e * p.s_e + j.n0 * p.s_r, (j.n1 - j.n0) * p.s_r))
    return run_job_bf16_bk<32, true>(p, j, xb);
  run_job_bf16_bk<32, false>(p, j, xb);
}

// ------------------------------------------------------------------ bf16 GEMM of a decoded tile, per-block scales

// Whether the CPU has AMX-BF16 (CPUID leaf 7, EDX bit 22), where MKL's bf16 GEMM runs on the tile
// units and the GEMM below (vdpbf16ps) would be the slower one.
bool has_amx_bf16() {
  static const bool has = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) != 0 && ((d >> 22) & 1u) != 0;
  }();
  return has;
}

// The lane sums of one block [k0, k1) into part (zeroed here). Its own function: inlined into the
// block loop of gemm_bf16_tile, GCC kept the sums in a stack array and stored them every step (a
// build that ran 1.3x slower than MKL's GEMM instead of 1.7x faster).
template <int MR, int NR>
FMOE_BF16DP FMOE_INLINE void gemm_bf16_block(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw,
                                             int64_t k0, int64_t k1, __m512 (&part)[MR][NR]) {
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int i = 0; i < NR; ++i) part[r][i] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 32) {
    const __mmask32 m = k1 - k >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << (k1 - k)) - 1);
    __m512bh wv[NR];
#pragma GCC unroll 3
    for (int i = 0; i < NR; ++i) wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, w + i * ldw + k);
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m, a + r * lda + k);
#pragma GCC unroll 3
      for (int i = 0; i < NR; ++i) part[r][i] = _mm512_dpbf16_ps(part[r][i], av, wv[i]);
    }
  }
}

// MR activation rows (bf16, stride lda) against NR decoded weight rows (bf16, stride ldw) over K:
// c[r * ldc + i] = sum over the scale blocks kb of s[i * nb + kb] * (the block's dot product).
// Each block's products (exact: two bf16) are summed by vdpbf16ps per lane, the block sum scaled
// once by an FMA into the running lanes, the lanes summed at the end: another order of the
// reference's sum of the products of the scaled weights, within the K-term bound. vdpbf16ps's
// flush of denormals as for the dot-product tiles (bf16_far_from_denormals; the weights it takes
// are E4M3 values or FP4 values times E4M3 or E8M0 scales of at least 2^-25). A block's last
// chunk is a masked load (zeros past its end), so any bk and K run.
template <int MR, int NR>
FMOE_BF16DP void gemm_bf16_tile(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t ldw, int64_t K,
                                int64_t bk, const float* s, int64_t nb, float* c, int64_t ldc) {
  __m512 part[MR][NR], tot[MR][NR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int i = 0; i < NR; ++i) tot[r][i] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < nb; ++kb) {
    gemm_bf16_block<MR, NR>(a, lda, w, ldw, kb * bk, std::min(K, kb * bk + bk), part);
#pragma GCC unroll 3
    for (int i = 0; i < NR; ++i) {
      const __m512 sv = _mm512_set1_ps(s[i * nb + kb]);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) tot[r][i] = _mm512_fmadd_ps(part[r][i], sv, tot[r][i]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int i = 0; i < NR; ++i) c[r * ldc + i] = _mm512_reduce_add_ps(tot[r][i]);
}

template <int MR>
void gemm_bf16_cols(const uint16_t* a, const uint16_t* w, int64_t tn, int64_t K, int64_t bk, const float* s,
                    int64_t nb, float* c, int64_t ldc) {
  int64_t n = 0;
  for (; n + 3 <= tn; n += 3) gemm_bf16_tile<MR, 3>(a, K, w + n * K, K, K, bk, s + n * nb, nb, c + n, ldc);
  if (tn - n == 2) gemm_bf16_tile<MR, 2>(a, K, w + n * K, K, K, bk, s + n * nb, nb, c + n, ldc);
  if (tn - n == 1) gemm_bf16_tile<MR, 1>(a, K, w + n * K, K, K, bk, s + n * nb, nb, c + n, ldc);
}

// c [m, tn] (stride ldc, written) = a [m, K] (bf16, contiguous) times the decoded bf16 tile w
// [tn, K]^T, block kb = [kb * bk, (kb + 1) * bk) of weight row n scaled by scale(n, kb): FP8's
// bare E4M3 values with their float block scales (fp8_block, fp8_row: bk = K), or an FP4 tile
// with NVFP4's global scale (bk = K). Register tiles of 4 activation rows (in L1 while they pass
// the weights) by 3 weight rows: 12 block sums and 12 running sums. The weights go in slices of
// about 256 KiB, which stay in L2 while every group of 4 rows passes them.
template <class Scale>
void gemm_bf16_scaled(const uint16_t* a, int64_t m, const uint16_t* w, int64_t tn, int64_t K, int64_t bk,
                      Scale scale, float* c, int64_t ldc) {
  const int64_t nb = (K + bk - 1) / bk;
  std::vector<float> s(tn * nb);
  for (int64_t n = 0; n < tn; ++n)
    for (int64_t kb = 0; kb < nb; ++kb) s[n * nb + kb] = scale(n, kb);
  const int64_t slice = std::max<int64_t>(3, ((int64_t(256) << 10) / (2 * K)) / 3 * 3);
  for (int64_t n0 = 0; n0 < tn; n0 += slice) {
    const int64_t sn = std::min(slice, tn - n0);
    const uint16_t* ws = w + n0 * K;
    const float* ss = s.data() + n0 * nb;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) gemm_bf16_cols<4>(a + r * K, ws, sn, K, bk, ss, nb, c + r * ldc + n0, ldc);
    switch (m - r) {
      case 1: gemm_bf16_cols<1>(a + r * K, ws, sn, K, bk, ss, nb, c + r * ldc + n0, ldc); break;
      case 2: gemm_bf16_cols<2>(a + r * K, ws, sn, K, bk, ss, nb, c + r * ldc + n0, ldc); break;
      case 3: gemm_bf16_cols<3>(a + r * K, ws, sn, K, bk, ss, nb, c + r * ldc + n0, ldc); break;
      default: break;
    }
  }
}

// ------------------------------------------------------------------ AVX-512 row decode (the many-rows path)

// Weight row n of expert e decoded in natural k order for the many-rows path, the values
// decode_row_avx2 writes (bit for bit: every FP4 product E2M1 * s is exact, and FP8 takes the
// same x * 2^-8 * (s * 256) and the same scalar tail), g (nvfp4's second-level scale, 1 for the
// others) multiplied into every weight as at::mul_ would (one rounding per weight; the bf16
// output takes g == 1 only). BF16: each value's bf16 bits (its top half, exact: at most 6
// significant bits for FP4, 4 for bare E4M3) are stored instead of the float. FP4 needs
// K % 64 == 0 and bk in {16, 32} (effective_isa guarantees both on this path).
//
// FP4: 32 bytes (64 k) per step. Byte i holds k = 2i (low nibble) and 2i + 1 (high nibble);
// interleaving the bytes with themselves shifted right by 4 puts each code in the low 4 bits of
// its own byte in k order (per 128-bit lane: unpacklo gives k 0..15 | 32..47, unpackhi 16..31 |
// 48..63), which vpmovzxbd widens to the dword indices of vpermps (only their low 4 bits are read,
// so nothing is masked). One table lookup, one multiply by the 16 lanes' scale per 16 weights, in
// place of the AVX2 path's shuffles, widenings and two divisions per 32.
//
// BF16 stores take the float pairs' top halves with one vpermt2w per 32 weights (a vpmovdw per 16
// cost a third more: measured 0.104 against 0.084 ns a weight, one thread). mxfp4 rows whose E8M0
// scales all lie in [2, 252] skip the floats: the E2M1 codes widened to words in k order index a
// bf16 table (vpermw) and the scale is an add of (s - 127) << 7 to the words of nonzero codes,
// which for those scales keeps every exponent normal, so the bits are those of the float product
// (0.065 ns a weight).
template <bool BF16>
FMOE_AVX512 FMOE_INLINE void store32_avx512(void* dst, int64_t k, __m512 v0, __m512 v1) {
  if constexpr (BF16) {
    const __m512i hi_words = _mm512_setr_epi32(0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015,
                                               0x001B0019, 0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D,
                                               0x00330031, 0x00370035, 0x003B0039, 0x003F003D);
    _mm512_storeu_si512(static_cast<uint16_t*>(dst) + k,
                        _mm512_permutex2var_epi16(_mm512_castps_si512(v0), hi_words, _mm512_castps_si512(v1)));
  } else {
    _mm512_storeu_ps(static_cast<float*>(dst) + k, v0);
    _mm512_storeu_ps(static_cast<float*>(dst) + k + 16, v1);
  }
}

// Whether all n E8M0 bytes lie in [2, 252] (decode_row_avx512's exponent-add range).
FMOE_AVX512 bool e8m0_mid(const uint8_t* s, int64_t n) {
  __mmask64 bad = 0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i v = _mm512_loadu_si512(s + i);
    bad |= _mm512_cmplt_epu8_mask(v, _mm512_set1_epi8(2)) | _mm512_cmpgt_epu8_mask(v, _mm512_set1_epi8(static_cast<char>(252)));
  }
  for (; i < n; ++i) bad |= (s[i] < 2 || s[i] > 252);
  return bad == 0;
}

template <bool BF16>
FMOE_AVX512 void decode_row_avx512(const Params& p, int64_t e, int64_t n, float g, void* dst, int64_t kb = 0,
                                   int64_t ke = -1) {
  if (ke < 0) ke = p.K;
  const uint8_t* row = p.data + e * p.d_e + n * p.d_r;
  const __m512 gv = _mm512_set1_ps(g);
  const bool scale_g = g != 1.0f;
  if (p.fp4) {
    const uint8_t* sr = p.sb + e * p.s_e + n * p.s_r;  // bn == 1 for FP4
    const int sh = p.bk == 32 ? 5 : 4;
    const __m512 lut = _mm512_loadu_ps(kE2M1);
    if (BF16 && p.e8m0 && p.bk == 32 && e8m0_mid(sr, p.K / 32)) {
      // E2M1 in bf16: 0, .5, 1, 1.5, 2, 3, 4, 6 and their negatives (words 0 .. 15)
      const __m512i lutw = _mm512_setr_epi32(0x3F000000, 0x3FC03F80, 0x40404000, 0x40C04080, 0xBF008000, 0xBFC0BF80,
                                             0xC040C000, 0xC0C0C080, 0, 0, 0, 0, 0, 0, 0, 0);
      const __m512i m7 = _mm512_set1_epi16(7);
      for (int64_t k = 0; k < p.K; k += 64) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2));
        const __m256i h = _mm256_srli_epi16(v, 4);
        const __m256i lo = _mm256_unpacklo_epi8(v, h), hi = _mm256_unpackhi_epi8(v, h);  // k 0-15|32-47, 16-31|48-63
        // the codes as words in k order (vpermw reads the low 5 bits: clear the neighbour's nibble)
        const __m512i c0 = _mm512_and_si512(_mm512_cvtepu8_epi16(_mm256_permute2x128_si256(lo, hi, 0x20)), _mm512_set1_epi16(15));
        const __m512i c1 = _mm512_and_si512(_mm512_cvtepu8_epi16(_mm256_permute2x128_si256(lo, hi, 0x31)), _mm512_set1_epi16(15));
        const __m512i e0 = _mm512_set1_epi16(static_cast<int16_t>((sr[k >> 5] - 127) << 7));
        const __m512i e1 = _mm512_set1_epi16(static_cast<int16_t>((sr[(k >> 5) + 1] - 127) << 7));
        const __m512i w0 = _mm512_permutexvar_epi16(c0, lutw), w1 = _mm512_permutexvar_epi16(c1, lutw);
        uint16_t* d = static_cast<uint16_t*>(dst) + k;
        _mm512_storeu_si512(d, _mm512_mask_add_epi16(w0, _mm512_test_epi16_mask(c0, m7), w0, e0));
        _mm512_storeu_si512(d + 32, _mm512_mask_add_epi16(w1, _mm512_test_epi16_mask(c1, m7), w1, e1));
      }
      return;
    }
    for (int64_t k = kb; k < ke; k += 64) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k / 2));
      const __m256i h = _mm256_srli_epi16(v, 4);
      const __m256i lo = _mm256_unpacklo_epi8(v, h), hi = _mm256_unpackhi_epi8(v, h);
      const __m512i idx[4] = {_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)),
                              _mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)),
                              _mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)),
                              _mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1))};
      __m512 w[4];
      for (int q = 0; q < 4; ++q) {
        w[q] = _mm512_mul_ps(_mm512_permutexvar_ps(idx[q], lut), _mm512_set1_ps(p.table[sr[(k + 16 * q) >> sh]]));
        if (scale_g) w[q] = _mm512_mul_ps(w[q], gv);
      }
      store32_avx512<BF16>(dst, k - kb, w[0], w[1]);
      store32_avx512<BF16>(dst, k - kb + 32, w[2], w[3]);
    }
    return;
  }
  const RowScales rs(p, e, n);
  const __m512 nan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  for (int64_t k0 = kb; k0 < ke; k0 += p.bk) {
    const int64_t k1 = std::min(ke, k0 + p.bk);
    const float s = BF16 ? 1.0f : rs[k0 / p.bk];  // bf16: the bare E4M3 values
    const __m512 s8 = _mm512_set1_ps(s * 256.0f);
    int64_t k = k0;
    for (; k + 32 <= k1; k += 32) {
      const __m256i b8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
      const __mmask32 isnan = _mm256_cmpeq_epi8_mask(_mm256_and_si256(b8, _mm256_set1_epi8(0x7F)), _mm256_set1_epi8(0x7F));
      __m512 f0, f1;
      e4m3x32_avx512(b8, f0, f1);
      f0 = _mm512_mask_mov_ps(_mm512_mul_ps(f0, s8), static_cast<__mmask16>(isnan), nan);
      f1 = _mm512_mask_mov_ps(_mm512_mul_ps(f1, s8), static_cast<__mmask16>(isnan >> 16), nan);
      if (scale_g) {
        f0 = _mm512_mul_ps(f0, gv);
        f1 = _mm512_mul_ps(f1, gv);
      }
      store32_avx512<BF16>(dst, k - kb, f0, f1);
    }
    if (k < k1) {
      // the rest of the block as decode_row_avx2 decodes it (its 8-wide steps from k0 cover the
      // same whole eights): 8 at a time x * 2^-8 * (s * 256), then the scalar table
      float buf[32];
      const int64_t kv = k + (k1 - k) / 8 * 8;
      const __m256 s8a = _mm256_set1_ps(s * 256.0f);
      for (int64_t kk = k; kk < kv; kk += 8) _mm256_storeu_ps(buf + (kk - k), _mm256_mul_ps(e4m3x8_avx2(row + kk), s8a));
      for (int64_t kk = kv; kk < k1; ++kk) buf[kk - k] = p.e4m3[row[kk]] * s;
      for (int64_t kk = k; kk < k1; ++kk) {
        float w = buf[kk - k];
        if (scale_g) w *= g;
        if constexpr (BF16) {
          uint32_t u;
          std::memcpy(&u, &w, 4);
          static_cast<uint16_t*>(dst)[kk - kb] = static_cast<uint16_t>(u >> 16);
        } else {
          static_cast<float*>(dst)[kk - kb] = w;
        }
      }
    }
  }
}

// ------------------------------------------------------------------ drivers

enum Isa { kAuto = 0, kPortable = 1, kAvx2 = 2, kAvx512 = 3 };

bool has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

int best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return kAvx2;
  return kPortable;
}

// The path a format can take on an ISA: the vector FP4 kernels need whole 128-k (AVX-512) or
// 32-k (AVX2) chunks and blocks of 16 or 32; otherwise the next narrower path runs.
int effective_isa(const Params& p, int isa) {
  if (p.fp4 && isa == kAvx512 && !(p.K % 128 == 0 && (p.bk == 16 || p.bk == 32) && p.sb != nullptr)) isa = kAvx2;
  if (p.fp4 && isa == kAvx2 && !(p.K % 32 == 0 && (p.bk == 16 || p.bk == 32))) isa = kPortable;
  return isa;
}

// Activations in the order the ISA's FP4 kernel reads them (FP8 and portable: as given).
void permute_acts(const float* a, int64_t R, int64_t K, int isa, float* out) {
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = a + r * K;
      float* y = out + r * K;
      if (isa == kAvx512) {
        for (int64_t u = 0; u < K; u += 128)
          for (int q = 0; q < 8; ++q)
            for (int j = 0; j < 16; ++j) y[u + 16 * q + j] = x[u + 8 * j + q];
      } else {
        for (int64_t u = 0; u < K; u += 32)
          for (int i = 0; i < 16; ++i) {
            y[u + i] = x[u + 2 * i];
            y[u + 16 + i] = x[u + 2 * i + 1];
          }
      }
    }
  });
}

// The register kernels of one ISA and format: rows[r][nt] for groups of r weight rows (1, 2, 4)
// against nt activation rows (1 .. max_nt); nullptr where that shape is not instantiated. An
// expert's activation rows go in passes of at most max_nt; groups of 2 weight rows serve up to
// two_upto rows (then single rows, whose tiles hold more activation rows in registers).
using RowsFn = void (*)(const Params&, int64_t, int64_t, int64_t, const float*, float*, float);
struct Tiles {
  int max_nt, two_upto;
  RowsFn one[9], two[9], four[2];
};

#define FMOE_R(W, F, R, T, ...) W<F<R, T __VA_ARGS__>, R, T>
#define FMOE_T4(W, F, R, ...)                                                                        \
  nullptr, FMOE_R(W, F, R, 1, __VA_ARGS__), FMOE_R(W, F, R, 2, __VA_ARGS__), FMOE_R(W, F, R, 3, __VA_ARGS__), \
      FMOE_R(W, F, R, 4, __VA_ARGS__)
#define FMOE_T8(W, F, R, ...)                                                                        \
  FMOE_T4(W, F, R, __VA_ARGS__), FMOE_R(W, F, R, 5, __VA_ARGS__), FMOE_R(W, F, R, 6, __VA_ARGS__),        \
      FMOE_R(W, F, R, 7, __VA_ARGS__), FMOE_R(W, F, R, 8, __VA_ARGS__)

// FP4 on AVX-512: pairs of weight rows in passes of 4 activation rows (measured faster than
// single rows with 8: half the activation loads per FMA).
const Tiles kFp4Avx512[3] = {  // bk 16, 32, 32 with plain E8M0 scales
    {4, 16, {FMOE_T4(rows_avx512, fp4_tile_avx512, 1, , 16, false)}, {FMOE_T4(rows_avx512, fp4_tile_avx512, 2, , 16, false)},
     {nullptr, FMOE_R(rows_avx512, fp4_tile_avx512, 4, 1, , 16, false)}},
    {4, 16, {FMOE_T4(rows_avx512, fp4_tile_avx512, 1, , 32, false)}, {FMOE_T4(rows_avx512, fp4_tile_avx512, 2, , 32, false)},
     {nullptr, FMOE_R(rows_avx512, fp4_tile_avx512, 4, 1, , 32, false)}},
    {4, 16, {FMOE_T4(rows_avx512, fp4_tile_avx512, 1, , 32, true)}, {FMOE_T4(rows_avx512, fp4_tile_avx512, 2, , 32, true)},
     {nullptr, FMOE_R(rows_avx512, fp4_tile_avx512, 4, 1, , 32, true)}}};
// FP8 with block sums: single weight rows against 2 to 8 activation rows. Pairs of weight rows (up to
// 4 activation rows before) ran at 0.55-0.65x their speed: one expert [1536, 2048] fp8_block, one
// thread, warm, 2 / 3 / 4 rows 6.5 / 4.9 / 3.4 against 10.0 / 8.0 / 6.2 GB/s (their block sums and
// running sums outgrew the registers). One row keeps the tile of 4 weight rows (level with single
// rows on fp8_block, 4-8 % faster on fp8_row). Scaled weights (mxfp8's 32-blocks) measured level
// either way and keep their pairs.
const Tiles kFp8Avx512[2] = {  // block sums (bk >= 64), scaled weights (shorter blocks)
    {8, 0, {FMOE_T8(rows_avx512, fp8_tile_avx512, 1, , false)}, {},
     {nullptr, FMOE_R(rows_avx512, fp8_tile_avx512, 4, 1, , false)}},
    {4, 16, {FMOE_T4(rows_avx512, fp8_tile_avx512, 1, , true)}, {FMOE_T4(rows_avx512, fp8_tile_avx512, 2, , true)},
     {nullptr, nullptr}}};
const Tiles kFp4Avx2 = {8, 4, {FMOE_T8(rows_avx2, fp4_tile_avx2, 1)}, {FMOE_T4(rows_avx2, fp4_tile_avx2, 2)}, {nullptr, nullptr}};
const Tiles kFp8Avx2 = {8, 4, {FMOE_T8(rows_avx2, fp8_tile_avx2, 1)}, {FMOE_T4(rows_avx2, fp8_tile_avx2, 2)}, {nullptr, nullptr}};
#undef FMOE_R
#undef FMOE_T8
#undef FMOE_T4

// Weight rows [j.n0, j.n1) of expert j.e against its j.c (<= dense_from) activation rows, in
// groups of r weight rows (4 for one activation row where the ISA has it, else 2 or 1 as the
// Tiles say; the rows left at the tile's end one at a time). Up to max_nt activation rows: one
// sweep over the weight rows. More: the weight rows in slices of kSlice, each slice swept once
// per pass (it stays in L1 between the passes), so each weight row comes from memory once.
constexpr int64_t kSlice = 4;

void run_tiles(const Params& p, const Job& j, const float* xs, const Tiles& T) {
  const int nr = (j.c == 1 && T.four[1] != nullptr) ? 4 : j.c <= T.two_upto ? 2 : 1;
  const float g = gscale_of(p, j.e);
  const int64_t slice = j.c <= T.max_nt ? j.n1 - j.n0 : kSlice;
  for (int64_t s0 = j.n0; s0 < j.n1; s0 += slice) {
    const int64_t s1 = std::min(j.n1, s0 + slice);
    for (int64_t c = 0; c < j.c; c += T.max_nt) {
      const int nt = static_cast<int>(std::min<int64_t>(T.max_nt, j.c - c));
      const float* x = xs + (j.lo + c) * p.K;
      float* out = p.out + (j.lo + c) * p.N;
      const int64_t whole = s0 + (s1 - s0) / nr * nr;
      (nr == 4 ? T.four[nt] : nr == 2 ? T.two[nt] : T.one[nt])(p, j.e, s0, whole, x, out, g);
      if (whole < s1) T.one[nt](p, j.e, whole, s1, x, out, g);
    }
  }
}

void run_job_small(const Params& p, const Job& j, const float* xs, int isa, std::vector<float>& w) {
  if (isa == kPortable) return rows_portable(p, j, w);
  if (isa == kAvx512 && p.fp4) {
    const bool e8 = p.bk == 32 && p.e8m0 && e8m0_plain(p.sb + j.e * p.s_e + j.n0 * p.s_r, (j.n1 - j.n0) * p.s_r);
    return run_tiles(p, j, xs, kFp4Avx512[e8 ? 2 : p.bk == 32]);
  }
  if (isa == kAvx512) return run_tiles(p, j, xs, kFp8Avx512[p.bk < 64]);
  run_tiles(p, j, xs, p.fp4 ? kFp4Avx2 : kFp8Avx2);
}

// FP32 values exact in bf16 (the low 16 bits zero) -> their bf16 bits: the top half of each
// word, no rounding to do. (packus reads the shifted words as int32 in [0, 65535]: no saturation.)
FMOE_AVX2 void bf16_of_exact_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(_mm256_loadu_ps(src + i)), 16);
    const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(_mm256_loadu_ps(src + i + 8)), 16);
    // packus interleaves per 128-bit lane (a0-3 b0-3 | a4-7 b4-7); the permute restores k order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
  }
  for (; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, 4);
    dst[i] = static_cast<uint16_t>(u >> 16);
  }
}

// The calling thread's buffer of at least n elements of dtype, reused from call to call. An
// ATen allocation (64-byte aligned, like a fresh tensor's): the GEMM library picks its kernel
// by the operands' alignment, and a std::vector's would change the results' rounding with the
// address.
at::Tensor thread_buffer(int64_t n, at::ScalarType dtype) {
  thread_local at::Tensor f32, b16;
  at::Tensor& t = dtype == at::kFloat ? f32 : b16;
  if (!t.defined() || t.numel() < n) t = at::empty({n}, dtype);
  return t;
}

// FP8 weights with float32 scales (fp8_block's bn x bk blocks, fp8_row's one scale per row) and
// bf16 rows: the E4M3 values (exact in bf16) decoded without their scale, then (own)
// gemm_bf16_scaled with the block scales, or with MKL's bf16 GEMM per scale block, its alpha the
// block's scale, the blocks along K summed in float32 in out (beta 1; one k-block, fp8_row: one
// GEMM, then each output column times its row's scale). dequantize() rounds q * s once per weight;
// here each block's sum is scaled once: both within the K-term bound. Returns false (nothing
// written) where MKL's blocks are too thin for it to pay (bn < 16 with several k-blocks).
bool run_job_fp8_blocks(const Params& p, const Job& j, const at::Tensor& a_bf16, int isa, bool own) {
  const int64_t tn = j.n1 - j.n0, kblocks = (p.K + p.bk - 1) / p.bk;
  if (!own && p.bn < 16 && kblocks > 1) return false;
  const at::Tensor w32 = thread_buffer(p.K, at::kFloat);
  const at::Tensor b16 = thread_buffer(tn * p.K, at::kBFloat16);
  float* wp = w32.data_ptr<float>();
  uint16_t* w16 = reinterpret_cast<uint16_t*>(b16.data_ptr());
  for (int64_t n = j.n0; n < j.n1; ++n) {
    const uint8_t* row = p.data + j.e * p.d_e + n * p.d_r;
    uint16_t* row16 = w16 + (n - j.n0) * p.K;
    if (isa == kPortable) {
      for (int64_t k = 0; k < p.K; ++k) {
        uint32_t u;
        std::memcpy(&u, p.e4m3 + row[k], 4);
        row16[k] = static_cast<uint16_t>(u >> 16);
      }
      continue;
    }
    if (isa == kAvx512) {
      decode_row_avx512<true>(p, j.e, n, 1.0f, row16);
      continue;
    }
    decode_e4m3_row_avx2(p, row, wp);
    bf16_of_exact_avx2(wp, row16, p.K);
  }
  const auto* ab = reinterpret_cast<const uint16_t*>(a_bf16.const_data_ptr()) + j.lo * p.K;
  float* c = p.out + j.lo * p.N;
  if (own) {
    gemm_bf16_scaled(ab, j.c, w16, tn, p.K, p.bk, [&](int64_t n, int64_t kb) { return scale_of(p, j.e, j.n0 + n, kb); },
                     c + j.n0, p.N);
    return true;
  }
  const int m = static_cast<int>(j.c), K = static_cast<int>(p.K), N = static_cast<int>(p.N);
  if (kblocks == 1) {
    cblas_gemm_bf16bf16f32(101, 111, 112, m, static_cast<int>(tn), K, 1.0f, ab, K, w16, K, 0.0f, c + j.n0, N);
    for (int64_t r = 0; r < j.c; ++r)
      for (int64_t n = j.n0; n < j.n1; ++n) c[r * p.N + n] *= scale_of(p, j.e, n, 0);
    return true;
  }
  for (int64_t n0 = j.n0; n0 < j.n1; n0 = std::min(j.n1, (n0 / p.bn + 1) * p.bn)) {
    const int64_t n1 = std::min(j.n1, (n0 / p.bn + 1) * p.bn);
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const int64_t k0 = kb * p.bk, kn = std::min(p.K, k0 + p.bk) - k0;
      cblas_gemm_bf16bf16f32(101, 111, 112, m, static_cast<int>(n1 - n0), static_cast<int>(kn),
                             scale_of(p, j.e, n0, kb), ab + k0, K, w16 + (n0 - j.n0) * p.K + k0, K,
                             kb == 0 ? 0.0f : 1.0f, c + n0, N);
    }
  }
  return true;
}

// Whether the bf16 tile of MXFP4 job j holds no denormal weight and no product of one with a bf16
// row that passed bf16_far_from_denormals is denormal: every E8M0 scale of its rows at least
// 2^-25 (byte 102), so that an FP4 value (at least 0.5) times it, times 2^-100, is at least 2^-126.
// MXFP4's scale rows (one a weight row) are contiguous, as e8m0_plain reads them.
bool mxfp4_tile_in_bf16(const Params& p, const Job& j) {
  const uint8_t* s = p.sb + j.e * p.s_e + j.n0 * p.s_r;
  int low = 0;
  for (int64_t i = 0; i < (j.n1 - j.n0) * p.s_r; ++i) low |= s[i] < 102;
  return low == 0;
}

// Many rows: decode the tile once, then one single-threaded GEMM. The tile buffers are the
// thread's own and reused from job to job (a fresh 2 MiB tile per job was a fresh mapping and
// its page faults). bf16 rows of FP4 weights: each row decoded to float32 in L1 and stored as
// bf16 (exact: an E2M1 value times an E8M0 or E4M3 scale has at most 6 significant bits), so
// the bf16 GEMM (fp32 accumulation) multiplies the same products. MXFP4: gemm_bf16_scaled up to
// kOwnGemmRows rows where it runs, else at::mm, which rounds the sum to bf16 once (the caller's
// rounding of out to bf16 then changes nothing). NVFP4: the sum lands in
// out as float32 with the second-level scale g applied once (gemm_bf16_scaled, or MKL's GEMM with g
// as its alpha; at::mm then g would round twice), the float32 path where neither runs. FP8 with
// float scales: run_job_fp8_blocks. The caller rounds out to bf16 once. Otherwise float32 weights
// and rows. Returns whether gemm_bf16_scaled ran.
bool run_job_dense(const Params& p, const Job& j, const at::Tensor& a, const c10::optional<at::Tensor>& a_bf16,
                   const at::Tensor& out, int isa) {
  const int64_t tn = j.n1 - j.n0;
  const float g = gscale_of(p, j.e);
  at::Tensor o = out.narrow(0, j.lo, j.c).narrow(1, j.n0, tn);
  const bool mkl = p.blas && cblas_gemm_bf16bf16f32 != nullptr;
  // bf16 tiles with a scale they cannot hold (FP8's, NVFP4's global one): our GEMM on AVX-512 BF16
  // without AMX (gemm_bf16_scaled), else MKL's, else the float32 path
  const bool own = p.dot_bf16 && isa == kAvx512 && has_avx512_bf16() && !has_amx_bf16();
  if ((own || mkl) && a_bf16.has_value() && !p.fp4 && p.sf != nullptr && run_job_fp8_blocks(p, j, *a_bf16, isa, own))
    return own;
  const bool bf16 = a_bf16.has_value() && p.fp4 && (g == 1.0f || mkl || own) && (!p.e8m0 || mxfp4_tile_in_bf16(p, j));
  const at::Tensor w32 = thread_buffer(bf16 ? p.K : tn * p.K, at::kFloat);
  const at::Tensor b16 = bf16 ? thread_buffer(tn * p.K, at::kBFloat16) : at::Tensor();
  float* wp = w32.data_ptr<float>();
  uint16_t* w16 = bf16 ? reinterpret_cast<uint16_t*>(b16.data_ptr()) : nullptr;
  // AVX-512: each row straight to the tile's dtype, nvfp4's g folded into the float32 weights
  const bool g_in_decode = isa == kAvx512 && !bf16;
  for (int64_t n = j.n0; n < j.n1; ++n) {
    if (isa == kAvx512) {
      if (bf16) decode_row_avx512<true>(p, j.e, n, 1.0f, w16 + (n - j.n0) * p.K);
      else decode_row_avx512<false>(p, j.e, n, g, wp + (n - j.n0) * p.K);
      continue;
    }
    float* dst = bf16 ? wp : wp + (n - j.n0) * p.K;
    if (isa == kPortable) decode_row_portable(p, j.e, n, dst);
    else decode_row_avx2(p, j.e, n, dst);
    if (!bf16) continue;
    uint16_t* row16 = w16 + (n - j.n0) * p.K;
    if (isa != kPortable) {
      bf16_of_exact_avx2(dst, row16, p.K);
      continue;
    }
    for (int64_t k = 0; k < p.K; ++k) {
      uint32_t u;
      std::memcpy(&u, dst + k, 4);
      row16[k] = static_cast<uint16_t>(u >> 16);
    }
  }
  if (bf16 && (g != 1.0f || (own && j.c <= kOwnGemmRows))) {
    const auto* ab = reinterpret_cast<const uint16_t*>(a_bf16->const_data_ptr()) + j.lo * p.K;
    if (own) {
      gemm_bf16_scaled(ab, j.c, w16, tn, p.K, p.K, [g](int64_t, int64_t) { return g; }, p.out + j.lo * p.N + j.n0, p.N);
      return true;
    }
    cblas_gemm_bf16bf16f32(101 /* row major */, 111 /* a as is */, 112 /* w transposed */, static_cast<int>(j.c),
                           static_cast<int>(tn), static_cast<int>(p.K), g, ab, static_cast<int>(p.K), w16,
                           static_cast<int>(p.K), 0.0f, p.out + j.lo * p.N + j.n0, static_cast<int>(p.N));
    return false;
  }
  if (bf16) {
    const at::Tensor w = b16.narrow(0, 0, tn * p.K).view({tn, p.K});
    o.copy_(at::mm(a_bf16->narrow(0, j.lo, j.c), w.t()));
    return false;
  }
  const at::Tensor w = w32.narrow(0, 0, tn * p.K).view({tn, p.K});
  if (g != 1.0f && !g_in_decode) w.mul_(g);  // nvfp4: dequantize()'s (value * s) * g, rounded once per weight
  at::mm_out(o, a.narrow(0, j.lo, j.c), w.t());
  return false;
}

// The float32 many-rows job on AVX-512 in k-slices of kc (a multiple of 128 and of bk; the last may
// be shorter): each slice of the tile decoded (tn x kc floats, 1 MiB) and multiplied, the slices'
// products summed in out (at::addmm_, beta 1). A whole 256 x 2048 float32 tile is 2 MiB, all of a
// 2 MiB L2, so its decode's stores went to L3 (0.17-0.20 ns a weight against 0.12 into an L2-sized
// tile, one thread) and the GEMM read it back from there: gate_up_proj at 48 rows an expert took
// 0.90-1.00x the unsliced build's time (two interleaved runs, mxfp4 / nvfp4 / fp8_block, one
// thread's CPU time, benchmarks/bench_packed_kernels.py --prefill). The slices' sum is one more
// rounding per slice than one GEMM over K: another summation order, within the same K-term bound.
void run_job_dense_ksplit(const Params& p, const Job& j, const at::Tensor& a, const at::Tensor& out, int64_t kc) {
  const int64_t tn = j.n1 - j.n0;
  const float g = gscale_of(p, j.e);
  at::Tensor o = out.narrow(0, j.lo, j.c).narrow(1, j.n0, tn);
  const at::Tensor w32 = thread_buffer(tn * kc, at::kFloat);
  float* wp = w32.data_ptr<float>();
  for (int64_t k0 = 0; k0 < p.K; k0 += kc) {
    const int64_t kn = std::min(kc, p.K - k0);
    for (int64_t n = j.n0; n < j.n1; ++n) decode_row_avx512<false>(p, j.e, n, g, wp + (n - j.n0) * kn, k0, k0 + kn);
    const at::Tensor w = w32.narrow(0, 0, tn * kn).view({tn, kn});
    const at::Tensor ak = a.narrow(0, j.lo, j.c).narrow(1, k0, kn);
    if (k0 == 0) at::mm_out(o, ak, w.t());
    else o.addmm_(ak, w.t());
  }
}

// A job that does not continue the rows its thread read last starts where no prefetch has run
// ahead: prefetch its first p.pf bytes of weights (and their scale rows) before the tiles start.
void prefetch_start(const Params& p, const Job& j) {
  const char* d = reinterpret_cast<const char*>(p.data + j.e * p.d_e + j.n0 * p.d_r);
  const int64_t nd = std::min(p.pf, (j.n1 - j.n0) * p.d_r);
  for (int64_t b = 0; b < nd; b += 64) FMOE_PREFETCH(d + b);
  if (p.sb != nullptr) {
    const char* s = reinterpret_cast<const char*>(p.sb + j.e * p.s_e + (j.n0 / p.bn) * p.s_r);
    const int64_t ns = std::min(p.pf_s, (j.n1 - j.n0) * p.s_r);
    for (int64_t b = 0; b < ns; b += 64) FMOE_PREFETCH(s + b);
  }
}

// One packed weight's operands (fmoe/quant/packed.py's _operands), checked against the reduction
// length K: every field of Params but the activations and the output. Byte tensors may come in
// any one-byte dtype (uint8, float8_*: their bits are read), scales as bytes or float32.
Params weight_params(int64_t K, const at::Tensor& data, const at::Tensor& scales, const at::Tensor& table,
                     const at::Tensor& e4m3, const c10::optional<at::Tensor>& gscale, bool fp4, int64_t bn,
                     int64_t bk, bool blas, bool dot_bf16) {
  TORCH_CHECK_VALUE(data.element_size() == 1 && data.dim() == 3 && data.is_contiguous(),
                    "data must be contiguous one-byte [E, N, K']");
  const int64_t E = data.size(0), N = data.size(1);
  TORCH_CHECK_VALUE(data.size(2) == (fp4 ? K / 2 : K) && (!fp4 || K % 2 == 0), "data's last dim does not match K = ", K);
  TORCH_CHECK_VALUE(bn >= 1 && bk >= 1 && (!fp4 || (bn == 1 && K % bk == 0 && bk % 2 == 0)), "bad scale block");
  TORCH_CHECK_VALUE(scales.dim() == 3 && scales.is_contiguous() && scales.size(0) == E &&
                        scales.size(1) == (N + bn - 1) / bn && scales.size(2) == (K + bk - 1) / bk,
                    "scales must be contiguous [E, ceil(N/bn), ceil(K/bk)]");
  const bool byte_scales = scales.element_size() == 1;
  TORCH_CHECK_VALUE(byte_scales || scales.scalar_type() == at::kFloat, "scales must be one-byte or float32");
  TORCH_CHECK_VALUE(table.scalar_type() == at::kFloat && table.numel() == 256 && table.is_contiguous(), "table must be float32 [256]");
  TORCH_CHECK_VALUE(e4m3.scalar_type() == at::kFloat && e4m3.numel() == 256 && e4m3.is_contiguous(), "e4m3 must be float32 [256]");
  TORCH_CHECK_VALUE(!fp4 || byte_scales, "fp4 weights take byte scales");
  if (gscale.has_value())
    TORCH_CHECK_VALUE(gscale->scalar_type() == at::kFloat && gscale->numel() == E && gscale->is_contiguous(),
                      "gscale must be contiguous float32 [E]");
  Params p{};
  p.K = K;
  p.N = N;
  p.data = static_cast<const uint8_t*>(data.const_data_ptr());
  p.data_end = p.data + data.numel();
  p.d_r = data.size(2);
  p.d_e = N * p.d_r;
  p.sb = byte_scales ? static_cast<const uint8_t*>(scales.const_data_ptr()) : nullptr;
  p.sf = byte_scales ? nullptr : scales.const_data_ptr<float>();
  p.s_r = scales.size(2);
  p.s_e = scales.size(1) * p.s_r;
  p.bn = bn;
  p.bk = bk;
  p.table = table.const_data_ptr<float>();
  p.e4m3 = e4m3.const_data_ptr<float>();
  p.gscale = gscale.has_value() ? gscale->const_data_ptr<float>() : nullptr;
  p.fp4 = fp4;
  p.e8m0 = byte_scales && e8m0_table(p.table);
  p.e4m3_scales = byte_scales && std::memcmp(p.table, p.e4m3, 256 * sizeof(float)) == 0;
  p.blas = blas;
  p.dot_bf16 = dot_bf16;
  const int64_t pf_rows = std::max(kPrefetchRows, (kPrefetchBytes + p.d_r - 1) / std::max<int64_t>(p.d_r, 1));
  p.pf = pf_rows * p.d_r;
  p.pf_s = pf_rows * p.s_r;
  return p;
}

// The offsets [E + 1] as a pointer, checked (0 first, never decreasing, R last) before any reader.
const int64_t* checked_offsets(const at::Tensor& offsets, int64_t E, int64_t R) {
  TORCH_CHECK_VALUE(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.size(0) == E + 1 &&
                        offsets.is_contiguous(), "offsets must be contiguous int64 [E + 1]");
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(o[0] == 0 && o[E] == R, "offsets must start at 0 and end at R = ", R);
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK_VALUE(o[e] <= o[e + 1], "offsets must be non-decreasing");
  return o;
}

// grouped_run on rows with no finite value of 2^90 or more (see there).
int64_t grouped_run_rows(Params& p, const at::Tensor& a, const int64_t* o, int64_t E, int64_t isa, int64_t dense_from,
                         bool act_int8, const c10::optional<at::Tensor>& a_bf16, const at::Tensor& out) {
  const int64_t R = a.size(0), K = p.K, N = p.N, bk = p.bk;
  const bool fp4 = p.fp4, byte_scales = p.sb != nullptr;
  p.a = a.const_data_ptr<float>();
  p.out = out.data_ptr<float>();
  const int best = best_isa();
  TORCH_CHECK_VALUE(isa >= 0 && isa <= 3, "isa must be 0 (auto), 1 (portable), 2 (avx2) or 3 (avx512), got ", isa);
  TORCH_CHECK_VALUE(isa <= best, "isa ", isa, " is not supported by this CPU (best: ", best, ")");
  const int run = effective_isa(p, isa == kAuto ? best : static_cast<int>(isa));

  if (act_int8)
    TORCH_CHECK_VALUE(fp4 && has_vnni() && K % 128 == 0 && (bk == 16 || bk == 32),
                      "int8 activations need FP4 weights, K % 128 == 0 and an AVX-512 VNNI CPU");
  at::Tensor xq, xd, xqsum;
  if (act_int8) {
    xq = at::empty({R * (K / 128) * 128}, at::kChar);
    xd = at::empty({R * (K / 128) * 16}, at::kFloat);
    xqsum = at::empty({R * (K / 128) * 16}, at::kInt);
    quantize_acts_int8(p.a, R, K, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xqsum.data_ptr<int32_t>());
  }
  const auto any_up_to = [&](int64_t rows) {
    bool any = false;
    for (int64_t e = 0; e < E; ++e) any |= (o[e + 1] > o[e] && o[e + 1] - o[e] <= rows);
    return any;
  };
  // bf16 rows with a value near the denormals: the float32 paths for all (bf16_far_from_denormals)
  const c10::optional<at::Tensor> a16 =
      a_bf16.has_value() &&
              bf16_far_from_denormals(reinterpret_cast<const uint16_t*>(a_bf16->const_data_ptr()), R * K)
          ? a_bf16
          : c10::nullopt;
  // bf16 rows of FP4 weights: the small-rows jobs take the bf16 dot-product tiles where they run,
  // and there "small" reaches dot_rows(bk) rows an expert (small_from below)
  at::Tensor xb;
  const int64_t dot_from = std::max(dense_from, dot_rows(bk));
  const bool dot16 = p.dot_bf16 && a16.has_value() && fp4 && run == kAvx512 && !act_int8 && any_up_to(dot_from) &&
                     K % 128 == 0 && (bk == 16 || bk == 32) && has_avx512_bf16();
  if (dot16) {
    xb = at::empty({R * K}, at::kBFloat16);
    arrange_acts_bf16(reinterpret_cast<const uint16_t*>(a16->const_data_ptr()), o, E, dot_from, K,
                      reinterpret_cast<uint16_t*>(xb.data_ptr()));
  }
  // the experts the register tiles run (at most small_from rows); the others decode a tile and multiply it
  const int64_t small_from = dot16 ? dot_from : dense_from;
  const bool any_small = any_up_to(small_from);
  const uint16_t* xbp = dot16 ? reinterpret_cast<const uint16_t*>(xb.const_data_ptr()) : nullptr;
  // The permuted activations are only read by the float small-rows vector kernels.
  at::Tensor xs = a;
  if (p.fp4 && run != kPortable && any_small && !act_int8 && !dot16) {
    xs = at::empty({R, K}, at::kFloat);
    permute_acts(p.a, R, K, run, xs.data_ptr<float>());
  }
  const float* xsp = xs.const_data_ptr<float>();

  // float32 tiles of the many-rows path on AVX-512 larger than 1 MiB go in k-slices of kc
  // (run_job_dense_ksplit); kc = 0: whole rows. FP8 slices end on scale blocks, so each block's
  // weights decode as in one pass (fp8_row's one block a row: no slices).
  int64_t kc = 0;
  if (run == kAvx512 && !(a16.has_value() && (fp4 || !byte_scales)) && K > kSliceK && (fp4 || kSliceK % bk == 0))
    kc = kSliceK;
  std::vector<Job> jobs;
  for (int64_t e = 0; e < E; ++e) {
    if (o[e + 1] == o[e]) continue;
    // Fewer, larger tiles for the decode + at::mm path: each at::mm call has a fixed cost.
    const int64_t tile = (o[e + 1] - o[e] > small_from) ? kTileDense : kTileN;
    for (int64_t n0 = 0; n0 < N; n0 += tile) jobs.push_back({e, o[e], o[e + 1] - o[e], n0, std::min(N, n0 + tile)});
  }
  // Each thread starts on its own contiguous run of the jobs (expert-major, rows in order), so it
  // streams long stretches of each expert's [N, K'] block and its prefetches run ahead into rows
  // it will read itself; a thread done with its run takes jobs from the others' runs (their
  // counters), so on a shared or busy host a thread that starts late (descheduled) leaves its
  // run to the others instead of holding the call until it has done it.
  const int64_t njobs = static_cast<int64_t>(jobs.size());
  const int64_t nth = std::min<int64_t>(njobs, at::get_num_threads());
  std::atomic<bool> own_gemm{false};
  std::vector<std::atomic<int64_t>> next(std::max<int64_t>(nth, 1));
  for (int64_t t = 0; t < nth; ++t) next[t] = t * njobs / nth;
  at::parallel_for(0, nth, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> w;
    const uint8_t* streamed = nullptr;  // the end of the weight rows this thread read last
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < nth; ++k) {
        const int64_t run_of = (t + k) % nth, end = (run_of + 1) * njobs / nth;
        for (int64_t i = next[run_of].fetch_add(1); i < end; i = next[run_of].fetch_add(1)) {
          const Job& j = jobs[i];
          const uint8_t* first = p.data + j.e * p.d_e + j.n0 * p.d_r;
          if (first != streamed && j.c <= small_from) prefetch_start(p, j);
          streamed = p.data + j.e * p.d_e + j.n1 * p.d_r;
          if (j.c > small_from && kc > 0) run_job_dense_ksplit(p, j, a, out, kc);
          else if (j.c > small_from) {
            if (run_job_dense(p, j, a, a16, out, run)) own_gemm = true;
          }
          else if (act_int8) run_job_vnni(p, j, xq.const_data_ptr<int8_t>(), xd.const_data_ptr<float>(),
                                            xqsum.const_data_ptr<int32_t>());
          else if (dot16) run_job_bf16(p, j, xbp);
          else run_job_small(p, j, xsp, run, w);
        }
      }
  });
  return (dot16 ? kDotBf16 : run) | (own_gemm ? kGemmBf16 : 0);
}

// Rows with a finite value of at least 2^kHugeExp in magnitude run scaled by 2^-kHugeShift.
constexpr int kHugeExp = 90, kHugeShift = 40;

// Whether the row v [K] (float32 bits) holds a finite value of 2^kHugeExp or more. Compiled for
// each ISA (the loop vectorizes): at prefill the scan reads every row once.
FMOE_INLINE bool row_is_huge(const uint32_t* v, int64_t K) {
  int huge = 0;
  for (int64_t k = 0; k < K; ++k) {
    const uint32_t e = (v[k] >> 23) & 0xFF;
    huge |= (e >= 127 + kHugeExp) & (e != 0xFF);
  }
  return huge != 0;
}
bool row_is_huge_portable(const uint32_t* v, int64_t K) { return row_is_huge(v, K); }
FMOE_AVX2 bool row_is_huge_avx2(const uint32_t* v, int64_t K) { return row_is_huge(v, K); }
FMOE_AVX512 bool row_is_huge_avx512(const uint32_t* v, int64_t K) { return row_is_huge(v, K); }

// The rows of a [R, K] (float32 bits) holding a finite value of 2^kHugeExp or more.
std::vector<int64_t> rows_with_huge_values(const uint32_t* a, int64_t R, int64_t K) {
  const int best = best_isa();
  const auto test = best == kAvx512 ? row_is_huge_avx512 : best == kAvx2 ? row_is_huge_avx2 : row_is_huge_portable;
  std::vector<char> huge(R, 0);
  at::parallel_for(0, R, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(K, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) huge[r] = test(a + r * K, K);
  });
  std::vector<int64_t> rows;
  for (int64_t r = 0; r < R; ++r)
    if (huge[r]) rows.push_back(r);
  return rows;
}

// out [R, N] float32 = a [R, K] (contiguous float32) times the weights of p (weight_params) for
// the rows o[e] .. o[e + 1] of every expert e (o: checked_offsets). Returns the ISA run, or
// kDotBf16 where the bf16 dot-product tiles ran the small experts (AVX-512 for the others), with
// kGemmBf16 set where gemm_bf16_scaled ran a many-rows job.
//
// The tiles sum a scale block's products before they multiply it by the scale (FP4 values up to 6,
// E4M3 up to 448), and NVFP4's global scale multiplies the finished sum: against small scales, rows
// of values near float32's limit would overflow where dequantize-then-matmul's products of the
// scaled weights stay finite. Rows with a finite value of 2^90 or more (some sum of them could pass
// 2^128 in a block of up to 2^26 terms) run scaled by 2^-40 and their outputs are scaled back: a
// power of two, so every scaled value, product and sum that stays in float32's normal range (bf16's
// is the same) is the unscaled one's, 2^40 apart; those that leave it (from values far below the
// row's 2^90) lose low bits, far inside the bound the row's large values set.
int64_t grouped_run(Params& p, const at::Tensor& a, const int64_t* o, int64_t E, int64_t isa, int64_t dense_from,
                    bool act_int8, const c10::optional<at::Tensor>& a_bf16, const at::Tensor& out) {
  const int64_t R = a.size(0), K = p.K, N = p.N;
  const std::vector<int64_t> huge = rows_with_huge_values(reinterpret_cast<const uint32_t*>(a.const_data_ptr()), R, K);
  if (huge.empty()) return grouped_run_rows(p, a, o, E, isa, dense_from, act_int8, a_bf16, out);
  const float down = std::ldexp(1.0f, -kHugeShift), up = std::ldexp(1.0f, kHugeShift);
  at::Tensor scaled = a.clone();
  c10::optional<at::Tensor> scaled16;
  if (a_bf16.has_value()) scaled16 = a_bf16->clone();
  float* s = scaled.data_ptr<float>();
  for (const int64_t r : huge) {
    for (int64_t k = 0; k < K; ++k) s[r * K + k] *= down;
    if (scaled16.has_value()) {
      c10::BFloat16* s16 = scaled16->data_ptr<c10::BFloat16>() + r * K;
      for (int64_t k = 0; k < K; ++k) s16[k] = c10::BFloat16(static_cast<float>(s16[k]) * down);
    }
  }
  const int64_t ran = grouped_run_rows(p, scaled, o, E, isa, dense_from, act_int8, scaled16, out);
  float* y = out.data_ptr<float>();
  for (const int64_t r : huge)
    for (int64_t n = 0; n < N; ++n) y[r * N + n] *= up;
  return ran;
}


// out [R, N] float32 (written); see the file comment for the operands. Returns grouped_run's path.
int64_t packed_grouped_mm(const at::Tensor& a, const at::Tensor& offsets, const at::Tensor& data,
                          const at::Tensor& scales, const at::Tensor& table, const at::Tensor& e4m3,
                          const c10::optional<at::Tensor>& gscale, bool fp4, int64_t bn, int64_t bk,
                          at::Tensor& out, int64_t isa, int64_t dense_from, bool act_int8,
                          const c10::optional<at::Tensor>& a_bf16, bool blas, bool dot_bf16) {
  TORCH_CHECK_VALUE(a.scalar_type() == at::kFloat && a.dim() == 2 && a.is_contiguous(), "a must be contiguous float32 [R, K]");
  const int64_t R = a.size(0), K = a.size(1);
  Params p = weight_params(K, data, scales, table, e4m3, gscale, fp4, bn, bk, blas, dot_bf16);
  const int64_t E = data.size(0);
  TORCH_CHECK_VALUE(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == R && out.size(1) == p.N &&
                        out.is_contiguous(), "out must be contiguous float32 [R, N]");
  if (a_bf16.has_value())
    TORCH_CHECK_VALUE(a_bf16->scalar_type() == at::kBFloat16 && a_bf16->dim() == 2 && a_bf16->size(0) == R &&
                          a_bf16->size(1) == K && a_bf16->is_contiguous(), "a_bf16 must be contiguous bfloat16 [R, K]");
  const int64_t* o = checked_offsets(offsets, E, R);
  return grouped_run(p, a, o, E, isa, dense_from, act_int8, a_bf16, out);
}

// ------------------------------------------------------------------ the whole expert stage (fused)
//
// packed_expert_stage: a rows plan's expert stage in one call, for the composition that
// fmoe/engine/kinds.py's reference() runs over the packed GEMMs, with float32 or bfloat16 rows
// (fmoe/quant/packed.py's expert_stage states the contract). Every step computes what the
// unfused torch op computes, in the rows' dtype dt: a bf16 op is its float32 operation on the
// bf16 values, rounded to bf16 (rd below; fp32 rows: no rounding):
//   gather   x_r = x[tokens]                           (copies: index_select's values)
//   GEMM 1   z_i = rd(grouped_run(x_r, w_in[i]))        (the same call on the same operands)
//   bias     z_0 = rd(z_0 + b_in[expert])
//   act      h = relu(z) | silu(z) | silu(g) * u | GPT-OSS's clamped SwiGLU (stage_activation)
//   GEMM 2   y_r = rd(grouped_run(h, w_out)) (+ b_out[expert], rounded)
//   combine  y[t] = the sum of gate_r * y_r[r] over t's rows, in the order and dtypes of
//            kinds._accumulate's 'fmoe', 'eager' and 'grouped' (stage_combine)
// The float operations sit in functions without an FMA target, so each rounds once, as torch's.
// Values are held as float32 (a bf16 value is exact in float32); bf16 copies are made where a
// GEMM reads bf16 rows.

// exp on 16 / 8 lanes as torch's Vectorized<float>::exp computes it (Sleef's u10 functions,
// exported by the x86 torch wheels' libtorch_cpu); weak: null where a torch build lacks them,
// and then every lane takes std::exp.
extern "C" __attribute__((weak)) __m512 Sleef_expf16_u10(__m512);
extern "C" __attribute__((weak)) __m256 Sleef_expf8_u10(__m256);

enum StageAct { kActRelu = 0, kActSilu = 1, kActGlu = 2, kActGptOss = 3 };
enum StageOrder { kOrderFmoe = 0, kOrderEager = 1, kOrderGrouped = 2 };

// to bf16 and back (round to nearest even, c10::BFloat16's conversion, as torch's casts)
inline float bf16_round(float v) { return static_cast<float>(c10::BFloat16(v)); }
// bf16 bits to float32 (exact)
inline float bf16_value(uint16_t bits) { return c10::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

FMOE_AVX512 void exp_neg_avx512(const float* v, float* e, int64_t n) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 16)
    _mm512_storeu_ps(e + i, Sleef_expf16_u10(_mm512_xor_ps(_mm512_loadu_ps(v + i), sign)));
}

FMOE_AVX2 void exp_neg_avx2(const float* v, float* e, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(e + i, Sleef_expf8_u10(_mm256_xor_ps(_mm256_loadu_ps(v + i), sign)));
}

// e[i] = exp(-v[i]) over one piece that torch's elementwise loop runs as one inner loop: its
// vectorized loop takes whole steps of two vectors of the dtype (fp32: 32 elements on AVX-512,
// 16 on AVX2; bf16: 64 and 32, each vector widened to two float vectors) through Sleef, the
// rest its scalar loop, through std::exp. vec: kAvx512, kAvx2, else scalar only.
void exp_neg_piece(const float* v, float* e, int64_t n, int vec, bool bf16) {
  const int64_t step = (vec == kAvx512 ? 32 : vec == kAvx2 ? 16 : 0) * (bf16 ? 2 : 1);
  const int64_t whole = step > 0 ? n / step * step : 0;
  if (vec == kAvx512) exp_neg_avx512(v, e, whole);
  else if (vec == kAvx2) exp_neg_avx2(v, e, whole);
  for (int64_t i = whole; i < n; ++i) e[i] = std::exp(-v[i]);
}

// The pieces of [0, total) that torch's TensorIterator hands its vectorized loop for an
// elementwise op over `total` elements in rows of `row` (row == total: one contiguous run):
// below the grain (32768) or on one thread one range, else at::parallel_for's split into
// ceil(total / nthreads')-sized thread ranges; each range cut at row ends. f(begin, end).
template <typename F>
void torch_pieces(int64_t total, int64_t row, F f) {
  constexpr int64_t kGrain = 32768;
  int64_t nt = at::get_num_threads();
  if (total < kGrain || nt == 1) nt = 1;
  nt = std::max<int64_t>(1, std::min(nt, (total + kGrain - 1) / kGrain));
  const int64_t chunk = (total + nt - 1) / nt;
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t * chunk, end = std::min(total, b + chunk);
      for (int64_t i = b; i < end;) {
        const int64_t j = std::min(end, (i / row + 1) * row);
        f(i, j);
        i = j;
      }
    }
  });
}

// The elementwise step, h [N, H] from z (see packed_expert_stage), each operation the one torch
// runs in ExpertForm.hidden, in the same order (rd: bf16_round for bf16 rows, else nothing):
//   relu   h = z < 0 ? 0 : z                        (clamp_min's max(0, z): NaN and -0.0 kept)
//   silu   h = rd(z / (1 + exp(-z)))
//   glu    h = rd(silu(g) * u)                      (g, u: halves of z [N, 2H], or z0 and z1)
//   gpt    g' = rd(min(g, limit)), u' = rd(clamp(u, -limit, limit)) (NaN kept), t = rd(g' * alpha),
//          h = rd(rd(u' + 1) * rd(g' * rd(1 / (1 + exp(-t)))))  (g, u: alternate columns of z)
// exp(-v) is computed in the pieces torch's loops would use (torch_pieces, exp_neg_piece), on
// torch's vector width (vec: its CPU capability). h16: h's bf16 bits too (bf16 rows), or null.
template <bool BF16>
void stage_activation(int act, const float* z0, const float* z1, float* h, uint16_t* h16, float* tmp, int64_t N,
                      int64_t H, float alpha, float limit, int vec) {
  const auto rd = [](float v) { return BF16 ? bf16_round(v) : v; };
  const int64_t total = N * H;
  if (act == kActRelu) {
    at::parallel_for(0, total, 16384, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) h[i] = z0[i] < 0.0f ? 0.0f : z0[i];
    });
  } else if (act == kActSilu || (act == kActGlu && z1 != nullptr)) {   // contiguous [N, H] inputs
    torch_pieces(total, total, [&](int64_t b, int64_t end) {
      exp_neg_piece(z0 + b, tmp + b, end - b, vec, BF16);
      for (int64_t i = b; i < end; ++i) h[i] = rd(z0[i] / (1.0f + tmp[i]));
      if (z1 != nullptr)
        for (int64_t i = b; i < end; ++i) h[i] = rd(h[i] * z1[i]);
    });
  } else if (act == kActGlu) {   // g, u: the halves of each row of z [N, 2H] (strided views, rows of H)
    torch_pieces(total, H, [&](int64_t b, int64_t end) {
      const int64_t r = b / H, c0 = b - r * H, n = end - b;
      const float* g = z0 + r * 2 * H + c0;
      const float* u = g + H;
      exp_neg_piece(g, tmp + b, n, vec, BF16);
      for (int64_t i = 0; i < n; ++i) h[b + i] = rd(rd(g[i] / (1.0f + tmp[b + i])) * u[i]);
    });
  } else {
    // GPT-OSS: t over the whole [N, H] first (the clamps are exact, in any order), then exp(-t)
    // in the pieces of torch's sigmoid over the contiguous t [N, H]; t is written into h and
    // each element read before h overwrites it
    const float lim = rd(limit);
    float* t = h;
    at::parallel_for(0, total, 16384, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) {
        const float g = z0[2 * i];
        t[i] = rd((lim < g ? lim : g) * alpha);
      }
    });
    torch_pieces(total, total, [&](int64_t b, int64_t end) {
      exp_neg_piece(t + b, tmp + b, end - b, vec, BF16);
      for (int64_t i = b; i < end; ++i) {
        float g = z0[2 * i], u = z0[2 * i + 1];
        g = lim < g ? lim : g;
        u = -lim > u ? -lim : u;
        u = lim < u ? lim : u;
        h[i] = rd(rd(u + 1.0f) * rd(g * rd(1.0f / (1.0f + tmp[i]))));
      }
    });
  }
  if (h16 != nullptr)
    at::parallel_for(0, total, 16384, [&](int64_t b, int64_t end) {
      for (int64_t i = b; i < end; ++i) h16[i] = c10::BFloat16(h[i]).x;
    });
}

// y [T, O] (float32, or bf16 bits into y16) from y_r [N, O] (values in dt, the out-projection's
// bias not yet added), kinds._accumulate's orders (rd: bf16_round for bf16 rows):
//   fmoe     acc = 0 (fp32); rows in plan order: acc += rd(y_r + b) * gate; y = rd(acc)
//   grouped  the same over the rows in ascending pair (slot-major) order, each product rounded
//            to bf16 where the gates are bf16 (torch's promotion of dt x dt); y = rd(acc)
//   eager    per token, its k slots in rank order (its rows in plan order, then +0 for each
//            missing one): y = s_0, y = rd(y + s_i), s = rd(rd(y_r + b) * gate)
// fp32 rows: 'eager' is 'fmoe' (no roundings either way). Split over column blocks; each element's
// terms in that order.
template <bool BF16>
void stage_combine(const float* yr, const int64_t* tokens, int order, const int64_t* by_pair, int64_t k,
                   const int64_t* tok_start, const int64_t* tok_rows, const int64_t* row_expert, const float* gates,
                   bool gates_bf16, const float* b_out, const uint16_t* b_out16, float* y, uint16_t* y16, int64_t T,
                   int64_t N, int64_t O) {
  const auto rd = [](float v) { return BF16 ? bf16_round(v) : v; };
  // a decode call's few rows in one block on the calling thread: a parallel region costs more
  // than the adds (and, on a busy host, waits for a descheduled thread)
  const int64_t grain = N * O < (int64_t(1) << 16) ? O : 256;
  at::parallel_for(0, O, grain, [&](int64_t c0, int64_t c1) {
    const int64_t w = c1 - c0;
    std::vector<float> acc(static_cast<size_t>(BF16 ? T * w : 0));
    float* a = BF16 ? acc.data() : nullptr;
    const auto term = [&](int64_t r, int64_t c) {
      float v = yr[r * O + c];
      if (b_out != nullptr) v = rd(v + b_out[row_expert[r] * O + c]);
      if (b_out16 != nullptr) v = rd(v + bf16_value(b_out16[row_expert[r] * O + c]));
      return v;
    };
    if (BF16 && order == kOrderEager) {
      for (int64_t t = 0; t < T; ++t) {
        float* dst = a + t * w;
        const int64_t n = tok_start[t + 1] - tok_start[t];
        for (int64_t i = 0; i < k; ++i) {
          const int64_t r = i < n ? tok_rows[tok_start[t] + i] : -1;
          for (int64_t c = c0; c < c1; ++c) {
            const float s = r >= 0 ? rd(term(r, c) * gates[r]) : 0.0f;
            dst[c - c0] = i == 0 ? s : rd(dst[c - c0] + s);
          }
        }
      }
    } else {
      for (int64_t t = 0; t < T; ++t) std::fill(BF16 ? a + t * w : y + t * O + c0, BF16 ? a + t * w + w : y + t * O + c1, 0.0f);
      const bool round_product = BF16 && order == kOrderGrouped && gates_bf16;
      for (int64_t i = 0; i < N; ++i) {
        const int64_t r = by_pair != nullptr ? by_pair[i] : i;
        float* dst = BF16 ? a + tokens[r] * w - c0 : y + tokens[r] * O;
        const float g = gates[r];
        for (int64_t c = c0; c < c1; ++c) {
          float v = term(r, c) * g;
          if (round_product) v = bf16_round(v);
          dst[c] = dst[c] + v;
        }
      }
    }
    if (BF16)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = c0; c < c1; ++c) y16[t * O + c] = c10::BFloat16(a[t * w + c - c0]).x;
  });
}

at::Tensor stage_buffer(const std::vector<at::Tensor>& given, size_t i, int64_t rows, int64_t cols) {
  if (given.empty()) return at::empty({rows, cols}, at::kFloat);
  const at::Tensor& b = given.at(i);
  TORCH_CHECK_VALUE(b.scalar_type() == at::kFloat && b.dim() == 2 && b.size(0) == rows && b.size(1) == cols &&
                        b.is_contiguous(), "buffer ", i, " must be contiguous float32 [", rows, ", ", cols, "]");
  return b;
}

// v = rd(v) over n floats (bf16 rows: a GEMM's float32 output as grouped_matmul returns it in bf16)
void round_bf16_inplace(float* v, int64_t n) {
  at::parallel_for(0, n, 16384, [&](int64_t b, int64_t end) {
    for (int64_t i = b; i < end; ++i) v[i] = bf16_round(v[i]);
  });
}

// A bias's rows added to z [N, W] by expert (rd after each add for bf16 rows); b: float32 or bf16 [E, W].
void add_bias_rows(float* z, const at::Tensor& b, const int64_t* row_expert, int64_t N, int64_t W, bool bf16) {
  const bool b16 = b.scalar_type() == at::kBFloat16;
  const float* bf = b16 ? nullptr : b.const_data_ptr<float>();
  const c10::BFloat16* bh = b16 ? b.const_data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t o = row_expert[r] * W;
      for (int64_t c = 0; c < W; ++c) {
        const float v = z[r * W + c] + (b16 ? static_cast<float>(bh[o + c]) : bf[o + c]);
        z[r * W + c] = bf16 ? bf16_round(v) : v;
      }
    }
  });
}

// One GEMM of the stage: out [R, N] float32 from a32 (and its bf16 twin a16 where grouped_matmul
// hands bf16 rows to the kernel: FP4 or float-scaled weights), rounded to bf16 for bf16 rows;
// act_int8: the rows rounded to int8 per 32-block, as grouped_matmul(activations="int8").
void stage_gemm(Params& p, const at::Tensor& a32, const c10::optional<at::Tensor>& a16, const int64_t* o, int64_t E,
                int64_t isa, int64_t dense_from, bool act_int8, const at::Tensor& out) {
  const bool bf16 = a16.has_value();
  const c10::optional<at::Tensor> none;
  grouped_run(p, a32, o, E, isa, dense_from, act_int8, bf16 && (p.fp4 || p.sf != nullptr) ? a16 : none, out);
  if (bf16) round_bf16_inplace(out.data_ptr<float>(), out.numel());
}

// See fmoe/quant/packed.py's expert_stage. Weights: data/scales/tables/gscales/meta (fp4, bn, bk)
// per weight, the in-projection(s) first and the out-projection last (gscales: an empty tensor
// for none). buffers: empty, or float32 [z_0, (z_1,) h] to compute in (tests read them).
at::Tensor packed_expert_stage(const at::Tensor& x, const at::Tensor& tokens, const at::Tensor& offsets,
                               const at::Tensor& gates, const c10::optional<at::Tensor>& pairs, int64_t order,
                               int64_t num_slots, const std::vector<at::Tensor>& data,
                               const std::vector<at::Tensor>& scales, const std::vector<at::Tensor>& tables,
                               const std::vector<at::Tensor>& gscales, const std::vector<int64_t>& meta,
                               const at::Tensor& e4m3, const c10::optional<at::Tensor>& b_in,
                               const c10::optional<at::Tensor>& b_out, int64_t act, double alpha, double limit,
                               int64_t isa, int64_t dense_from, int64_t exp_isa,
                               const std::vector<at::Tensor>& buffers, bool act_int8) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE((bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.stride(1) == 1 &&
                        x.stride(0) >= x.size(1), "x must be float32 or bfloat16 [T, M] with unit column stride");
  TORCH_CHECK_VALUE(act >= kActRelu && act <= kActGptOss, "act must be 0 (relu), 1 (silu), 2 (glu), 3 (gpt_oss)");
  TORCH_CHECK_VALUE(order >= kOrderFmoe && order <= kOrderGrouped, "order must be 0 (fmoe), 1 (eager), 2 (grouped)");
  const size_t nw = data.size();
  const size_t n_in = nw - 1;
  TORCH_CHECK_VALUE((nw == 2 || (nw == 3 && act == kActGlu)) && scales.size() == nw && tables.size() == nw &&
                        gscales.size() == nw && meta.size() == 3 * nw,
                    "one in-projection (two for glu) and one out-projection, each with data, scales, table, gscale "
                    "and (fp4, bn, bk)");
  const int64_t T = x.size(0), M = x.size(1);
  TORCH_CHECK_VALUE(tokens.scalar_type() == at::kLong && tokens.dim() == 1 && tokens.is_contiguous(),
                    "tokens must be contiguous int64 [N]");
  const int64_t N = tokens.size(0);
  // a fused gate/up in-projection (glu with one in-weight, gpt_oss) has 2H rows, H of each
  const bool fused_in = (act == kActGlu && nw == 2) || act == kActGptOss;
  std::vector<Params> ps;
  int64_t H = 0;
  for (size_t i = 0; i < nw; ++i) {
    const at::Tensor& gs = gscales[i];
    const c10::optional<at::Tensor> g = gs.numel() > 0 ? c10::optional<at::Tensor>(gs) : c10::nullopt;
    ps.push_back(weight_params(i < n_in ? M : H, data[i], scales[i], tables[i], e4m3, g, meta[3 * i] != 0,
                               meta[3 * i + 1], meta[3 * i + 2], true, true));
    if (i == 0) {
      H = fused_in ? ps[0].N / 2 : ps[0].N;
      TORCH_CHECK_VALUE(!fused_in || ps[0].N % 2 == 0, "a fused gate/up in-projection needs an even number of rows, "
                        "got ", ps[0].N);
    }
  }
  const int64_t E = data[0].size(0), O = ps[n_in].N;
  for (size_t i = 1; i < nw; ++i) TORCH_CHECK_VALUE(data[i].size(0) == E, "every weight must have E = ", E, " experts");
  if (nw == 3) TORCH_CHECK_VALUE(ps[1].N == H, "gate and up projections must have the same rows");
  const int64_t* o = checked_offsets(offsets, E, N);
  const int64_t* tok = tokens.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK_VALUE(tok[r] >= 0 && tok[r] < T, "tokens must lie in [0, T = ", T, ")");
  const bool gates_bf16 = gates.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE((gates.scalar_type() == at::kFloat || (bf16 && gates_bf16)) && gates.dim() == 1 &&
                        gates.size(0) == N && gates.is_contiguous(),
                    "gates must be contiguous float32 [N] (or bfloat16 with bfloat16 x)");
  std::vector<float> gate_values;
  const float* gw = nullptr;
  if (gates_bf16) {
    const c10::BFloat16* g16 = gates.const_data_ptr<c10::BFloat16>();
    gate_values.resize(N);
    for (int64_t r = 0; r < N; ++r) gate_values[r] = static_cast<float>(g16[r]);
    gw = gate_values.data();
  } else {
    gw = gates.const_data_ptr<float>();
  }
  std::vector<int64_t> by_pair;
  if (order == kOrderGrouped) {
    TORCH_CHECK_VALUE(pairs.has_value() && pairs->scalar_type() == at::kLong && pairs->dim() == 1 &&
                          pairs->size(0) == N && pairs->is_contiguous(),
                      "pairs must be contiguous int64 [N] (the 'grouped' order sums by pair)");
    const int64_t* pr = pairs->const_data_ptr<int64_t>();
    by_pair.resize(N);
    for (int64_t r = 0; r < N; ++r) by_pair[r] = r;
    std::sort(by_pair.begin(), by_pair.end(), [&](int64_t a, int64_t b) { return pr[a] < pr[b] || (pr[a] == pr[b] && a < b); });
  }
  // bf16 'eager': each token's rows in plan order (their rank), and k slots per token
  std::vector<int64_t> tok_start, tok_rows;
  if (bf16 && order == kOrderEager) {
    tok_start.assign(T + 1, 0);
    for (int64_t r = 0; r < N; ++r) ++tok_start[tok[r] + 1];
    int64_t most = 0;
    for (int64_t t = 0; t < T; ++t) {
      most = std::max(most, tok_start[t + 1]);
      tok_start[t + 1] += tok_start[t];
    }
    TORCH_CHECK_VALUE(num_slots >= most, "num_slots (k) must be at least a token's rows (", most, "), got ", num_slots);
    tok_rows.resize(N);
    std::vector<int64_t> fill(tok_start.begin(), tok_start.end() - 1);
    for (int64_t r = 0; r < N; ++r) tok_rows[fill[tok[r]]++] = r;
  }
  const auto check_bias = [&](const c10::optional<at::Tensor>& b, int64_t W, const char* name) {
    if (!b.has_value()) return;
    TORCH_CHECK_VALUE(b->scalar_type() == x.scalar_type() && b->dim() == 2 && b->size(0) == E && b->size(1) == W &&
                          b->is_contiguous(), name, " must be contiguous [E, ", W, "] in x's dtype");
  };
  check_bias(b_in, ps[0].N, "b_in");
  check_bias(b_out, O, "b_out");
  TORCH_CHECK_VALUE(buffers.empty() || buffers.size() == n_in + 1, "buffers: none, or z per in-projection and h");
  const int best = best_isa();
  TORCH_CHECK_VALUE(isa >= 0 && isa <= best, "isa ", isa, " is not supported by this CPU (best: ", best, ")");
  // exp's vector width is torch's (its CPU capability, exp_isa), not the GEMMs' isa: h is then
  // what torch's silu / sigmoid compute here, whichever GEMM path runs (never wider than this
  // CPU runs: a capability this file does not see would take the narrower exp, within 1 ulp)
  TORCH_CHECK_VALUE(exp_isa >= kPortable && exp_isa <= kAvx512, "exp_isa must be 1, 2 or 3, got ", exp_isa);
  const int64_t exp_level = std::min<int64_t>(exp_isa, best);
  const int exp_vec = (exp_level == kAvx512 && Sleef_expf16_u10 != nullptr) ? kAvx512
                      : (exp_level == kAvx2 && Sleef_expf8_u10 != nullptr) ? kAvx2 : kPortable;

  // the expert of each row (biases): from the offsets, no search
  std::vector<int64_t> row_expert;
  if (b_in.has_value() || b_out.has_value()) {
    row_expert.resize(N);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = o[e]; r < o[e + 1]; ++r) row_expert[r] = e;
  }
  // the rows of x: float32 (the kernels' a), and for bf16 rows their bf16 bits too
  at::Tensor xr = at::empty({N, M}, at::kFloat);
  c10::optional<at::Tensor> xr16;
  if (bf16) xr16 = at::empty({N, M}, at::kBFloat16);
  {
    float* dst = xr.data_ptr<float>();
    const int64_t ld = x.stride(0);
    if (bf16) {
      const c10::BFloat16* xp = x.const_data_ptr<c10::BFloat16>();
      c10::BFloat16* d16 = xr16->data_ptr<c10::BFloat16>();
      at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          std::memcpy(d16 + r * M, xp + tok[r] * ld, M * sizeof(c10::BFloat16));
          for (int64_t c = 0; c < M; ++c) dst[r * M + c] = static_cast<float>(xp[tok[r] * ld + c]);
        }
      });
    } else {
      const float* xp = x.const_data_ptr<float>();
      at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) std::memcpy(dst + r * M, xp + tok[r] * ld, M * sizeof(float));
      });
    }
  }
  std::vector<at::Tensor> z;
  for (size_t i = 0; i < n_in; ++i) {
    z.push_back(stage_buffer(buffers, i, N, ps[i].N));
    stage_gemm(ps[i], xr, xr16, o, E, isa, dense_from, act_int8, z[i]);
  }
  if (b_in.has_value()) add_bias_rows(z[0].data_ptr<float>(), *b_in, row_expert.data(), N, ps[0].N, bf16);
  at::Tensor h = stage_buffer(buffers, n_in, N, H);
  c10::optional<at::Tensor> h16;
  if (bf16) h16 = at::empty({N, H}, at::kBFloat16);
  at::Tensor tmp = at::empty({N * H}, at::kFloat);
  (bf16 ? stage_activation<true> : stage_activation<false>)(
      static_cast<int>(act), z[0].const_data_ptr<float>(), nw == 3 ? z[1].const_data_ptr<float>() : nullptr,
      h.data_ptr<float>(), bf16 ? reinterpret_cast<uint16_t*>(h16->data_ptr()) : nullptr, tmp.data_ptr<float>(), N, H,
      static_cast<float>(alpha), static_cast<float>(limit), exp_vec);
  at::Tensor yr = at::empty({N, O}, at::kFloat);
  stage_gemm(ps[n_in], h, h16, o, E, isa, dense_from, act_int8, yr);
  // the out-projection's bias: added inside the combine (stage_combine's term), read in place in
  // its dtype (a float32 copy of the whole [E, O] would cost more than the decode rows it serves)
  at::Tensor y = at::empty({T, O}, bf16 ? at::kBFloat16 : at::kFloat);
  (bf16 ? stage_combine<true> : stage_combine<false>)(
      yr.const_data_ptr<float>(), tok, static_cast<int>(order), by_pair.empty() ? nullptr : by_pair.data(), num_slots,
      tok_start.empty() ? nullptr : tok_start.data(), tok_rows.empty() ? nullptr : tok_rows.data(),
      row_expert.empty() ? nullptr : row_expert.data(), gw, gates_bf16,
      b_out.has_value() && !bf16 ? b_out->const_data_ptr<float>() : nullptr,
      b_out.has_value() && bf16 ? reinterpret_cast<const uint16_t*>(b_out->const_data_ptr()) : nullptr,
      bf16 ? nullptr : y.data_ptr<float>(),
      bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr()) : nullptr, T, N, O);
  return y;
}

int64_t packed_best_isa() { return best_isa(); }
bool packed_has_vnni() { return has_vnni(); }

}  // namespace (internal linkage: a second build loaded beside this one, e.g. by
   // benchmarks/bench_packed_kernels.py --old, cannot bind its calls to ours)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_grouped_mm", &packed_grouped_mm, "grouped GEMM over packed expert weights (see packed_gemm.cpp)");
  m.def("packed_expert_stage", &packed_expert_stage,
        "a rows plan's whole expert stage over packed weights (see packed_gemm.cpp and fmoe.quant.packed.expert_stage)");
  m.def("has_bf16_dot", &has_avx512_bf16, "whether bf16 rows of FP4 weights take the bf16 dot-product tiles here");
  m.def("dot_rows", &dot_rows, "the most rows an expert the bf16 dot-product tiles take, for FP4 blocks of bk");
  m.def("has_amx_bf16", &has_amx_bf16, "whether the CPU has AMX-BF16 (bf16 tiles then take MKL's GEMM or at::mm, not fmoe's)");
  m.def("has_vnni", &packed_has_vnni, "whether the int8-activation (AVX-512 VNNI) FP4 path runs here");
  m.def("best_isa", &packed_best_isa, "the widest ISA path this CPU runs: 1 portable, 2 AVX2, 3 AVX-512");
}
