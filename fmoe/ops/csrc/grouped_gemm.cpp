// Native CPU grouped GEMM for the ragged (expert-sorted) layout: every expert of one
// projection in one call, rows gathered and experts looped here, so no Python runs per
// expert. The Python front (fmoe/ops/native.py) validates every argument, allocates
// the outputs and picks the threading regime; the checks below are only a backstop
// so that a caller who skips the front still cannot make us read outside a buffer.
//
// Regimes (chosen by the caller, `parallel`):
//   serial   - experts one after the other; each at::mm uses the intra-op threads.
//   parallel - at::parallel_for over the busy experts, each at::mm single-threaded
//              (MKL and ATen both run one thread inside an OpenMP parallel region).
//              Pays when experts have few rows (decode): the per-call overhead and the
//              weight read, not the flops, are the time then. float32 and bfloat16
//              products there run fmoe's few-rows loops (1-8 rows an expert, AVX2 + FMA or
//              AVX-512, bf16 x @ W^T by AVX-512 BF16 dot products where the CPU has them);
//              float32 ones of more rows call BLAS's sgemm_ directly (f32_rows_mm): the call
//              at::mm makes, without its dispatch and the operands' views.
//
// Numerics: each expert's product is the same at::mm call on operands of the same
// shape, strides and contiguity as the pure-torch reference in native.py, and the
// scatter-add does the reference's element-wise roundings in the same order, so the
// serial regime equals the reference bit for bit. The reference writes each product into a
// fresh (64-byte aligned) tensor, and MKL's result can depend on where its output lies (a
// one-row float32 product into an unaligned row sums in another order), so a product whose
// destination is not so aligned is computed into a fresh tensor and copied (mm_into).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

// BLAS's single-precision GEMM (Fortran ABI, LP64 ints, as ATen declares and calls it), which the
// x86 torch wheels export from libtorch_cpu. A weak reference: null where a build lacks it, and
// then the parallel regime keeps at::mm.
extern "C" __attribute__((weak)) void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                                             const int* k, const float* alpha, const float* a, const int* lda,
                                             const float* b, const int* ldb, const float* beta, float* c,
                                             const int* ldc);

namespace {

// o = a @ b, as the reference's fresh-tensor torch.mm computes it (see the numerics note).
void mm_into(at::Tensor o, const at::Tensor& a, const at::Tensor& b) {
  if (reinterpret_cast<std::uintptr_t>(o.data_ptr()) % 64 == 0) {
    at::mm_out(o, a, b);
  } else {
    o.copy_(at::mm(a, b));
  }
}

struct Span {
  int64_t expert;
  int64_t lo;
  int64_t n;
};

// Busy experts in ascending id, after checking offsets: [E + 1], 0 = o[0] <= ... <= o[E] = R.
std::vector<Span> busy_spans(const at::Tensor& offsets, int64_t E, int64_t R) {
  TORCH_CHECK_VALUE(offsets.scalar_type() == at::kLong && offsets.dim() == 1 &&
                        offsets.size(0) == E + 1 && offsets.is_contiguous(),
                    "offsets must be contiguous int64 [E + 1] = [", E + 1, "]");
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(o[0] == 0 && o[E] == R, "offsets must start at 0 and end at R = ", R);
  std::vector<Span> spans;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK_VALUE(o[e] <= o[e + 1], "offsets must be non-decreasing (at expert ", e, ")");
    if (o[e + 1] > o[e]) spans.push_back({e, o[e], o[e + 1] - o[e]});
  }
  return spans;
}

int64_t max_rows(const std::vector<Span>& spans) {
  int64_t m = 0;
  for (const auto& s : spans) m = std::max(m, s.n);
  return m;
}

void check_index(const at::Tensor& idx, int64_t R, int64_t bound, const char* name) {
  TORCH_CHECK_VALUE(idx.scalar_type() == at::kLong && idx.dim() == 1 && idx.size(0) == R &&
                        idx.is_contiguous(),
                    name, " must be contiguous int64 [", R, "]");
  const int64_t* p = idx.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK_VALUE(p[r] >= 0 && p[r] < bound, name, "[", r, "] = ", p[r],
                      " is outside [0, ", bound, ")");
}

// bias, when given: [E, N] of the product's dtype, one row per expert.
void check_bias(const c10::optional<at::Tensor>& bias, int64_t E, int64_t N) {
  if (!bias.has_value()) return;
  TORCH_CHECK_VALUE(bias->dim() == 2 && bias->size(0) == E && bias->size(1) == N && bias->device().is_cpu(),
                    "bias must be a CPU [E, N] = [", E, ", ", N, "] tensor");
}

// o += bias[e] (broadcast over the expert's rows), while the block is still in cache: the
// reference's separate add, one rounding in o's dtype.
void add_bias(at::Tensor& o, const c10::optional<at::Tensor>& bias, int64_t e) {
  if (bias.has_value()) o.add_(bias->select(0, e));
}

// (K, N) of op(w[e]): w [E, K, N], or [E, N, K] read as its transpose.
std::pair<int64_t, int64_t> op_dims(const at::Tensor& w, bool transposed) {
  return transposed ? std::make_pair(w.size(2), w.size(1)) : std::make_pair(w.size(1), w.size(2));
}

at::Tensor expert_weight(const at::Tensor& w, int64_t e, bool transposed) {
  at::Tensor we = w.select(0, e);
  return transposed ? we.t() : we;
}

// dst[i] = src[rows[i]] for i < n; src and dst contiguous 2-D of one dtype and width.
// A plain copy: the gathered operand is byte-identical to the reference's index_select.
void gather_rows(const at::Tensor& src, const int64_t* rows, int64_t n, at::Tensor& dst) {
  const int64_t row_bytes = src.size(1) * src.element_size();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  // Worth threads only for a large copy; inside a parallel region this runs inline.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      std::memcpy(d + i * row_bytes, s + rows[i] * row_bytes, static_cast<size_t>(row_bytes));
  });
}

// gather_rows into raw memory (dst: n rows of src's width), run inline: the caller's thread.
void gather_rows_raw(const at::Tensor& src, const int64_t* rows, int64_t n, void* dst) {
  const int64_t row_bytes = src.size(1) * src.element_size();
  const char* s = static_cast<const char*>(src.const_data_ptr());
  char* d = static_cast<char*>(dst);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(d + i * row_bytes, s + rows[i] * row_bytes, static_cast<size_t>(row_bytes));
}

// The operand of expert span s: x's rows in place, or gathered into `scratch` (>= s.n rows).
at::Tensor expert_rows(const at::Tensor& x, const int64_t* rows, const Span& s, at::Tensor& scratch) {
  if (rows == nullptr) return x.narrow(0, s.lo, s.n);
  at::Tensor g = scratch.narrow(0, 0, s.n);
  gather_rows(x, rows + s.lo, s.n, g);
  return g;
}

// out[index[r]] += p[r] * scale[r] for r < n, serially in r (so a token that several
// experts reach sums them in ascending expert order). p and scale are already in out's
// dtype; the product is rounded to that dtype before the add, as the reference's
// separate mul and index_add_ do. Threads split columns, never rows, which keeps the
// order of the additions into each element fixed.
template <typename T>
void scatter_add_rows(const T* p, const int64_t* index, const T* scale, int64_t n, int64_t N, T* out) {
  // Threads only for a big block: at least 32 Ki elements and 64 columns a chunk.
  constexpr int64_t kMinChunk = int64_t{1} << 15;
  const int64_t grain = n * N < kMinChunk ? N : std::max<int64_t>(64, kMinChunk / n);
  at::parallel_for(0, N, grain, [&](int64_t j0, int64_t j1) {
    for (int64_t r = 0; r < n; ++r) {
      T* o = out + index[r] * N;
      const T* pr = p + r * N;
      if (scale != nullptr) {
        const T s = scale[r];
        for (int64_t j = j0; j < j1; ++j) o[j] = o[j] + static_cast<T>(pr[j] * s);
      } else {
        for (int64_t j = j0; j < j1; ++j) o[j] = o[j] + pr[j];
      }
    }
  });
}

void scatter_add(const at::Tensor& p, const int64_t* index, const at::Tensor& scale_o, int64_t offset,
                 at::Tensor& out) {
  const at::Tensor pc = p.to(out.scalar_type()).contiguous();
  const int64_t n = pc.size(0), N = out.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "fmoe_scatter_add", [&] {
    const scalar_t* s = scale_o.defined() ? scale_o.const_data_ptr<scalar_t>() + offset : nullptr;
    scatter_add_rows<scalar_t>(pc.const_data_ptr<scalar_t>(), index + offset, s, n, N,
                               out.data_ptr<scalar_t>());
  });
}

// ------------------------------------------------------------------ few rows, float32 and bfloat16
// An expert with a handful of rows at decode reads its weight matrix once and does little
// arithmetic per byte, so its time is the weight stream. BLAS's small-row kernels do not all reach
// it: on an AMD EPYC (Zen 4, MKL 2024.2) a single-threaded [2, 2048] @ [2048, 1536] ran at 9 GB/s
// and the same product against a transposed [1536, 2048] view at 1.6, against 16 for one row. The
// loops below read every weight byte once in a few sequential streams (8 weight rows side by side
// for x @ W, 1-4 for x @ W^T), hold the rows' partial sums in registers (x @ W: in the output
// between blocks of 8 weight rows), and give every output element ONE fixed order of operations,
// whatever the ISA path, the number of rows beside it or the blocking:
//   x @ W   (W [K, N] row-major): o[t, j] = fma chain over k = 0, 1, ..., K - 1, from +0.
//   x @ W^T (W [N, K] row-major): lane l (0..15) = fma chain over k = l, l + 16, ... (k < 16 * (K / 16)),
//            the 16 lanes summed as ((l0 + l8) + (l4 + l12)) + ((l2 + l10) + (l6 + l14)) + (odd lanes
//            alike), then k >= 16 * (K / 16) added in order.
// AVX2 runs 16 lanes as two registers of 8, so both paths give the same bits; a CPU without
// AVX2 + FMA keeps BLAS.
constexpr int64_t kFewRows = 8;        // up to this many rows per expert

#define FMOE_FR_AVX512 __attribute__((target("avx512f,avx2,fma")))
#define FMOE_FR_AVX2 __attribute__((target("avx2,fma")))

// Weights are float32, or bfloat16 (WT = uint16_t, the bits) read as the float32 they equal
// exactly (the bits << 16): a bf16 expert's loop is the float32 loop on its weights' exact values.
inline float wvalue(float w) { return w; }
inline float wvalue(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
FMOE_FR_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
FMOE_FR_AVX512 inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
FMOE_FR_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
FMOE_FR_AVX2 inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// x @ W for NT rows, accumulated in o itself (row stride N): KB weight rows at a time (KB
// sequential streams), each 16-column strip's NT sums in registers across the KB rows.
constexpr int64_t kKB = 8;

template <int NT, typename WT>
FMOE_FR_AVX512 void few_kn_avx512(const float* a, int64_t K, const WT* w, int64_t N, float* o) {
  const int64_t nv = N / 16;
  std::fill(o, o + NT * N, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kKB) {
    const int64_t kb = std::min(kKB, K - k0);
    const WT* wk = w + k0 * N;
    for (int64_t v = 0; v < nv; ++v) {
      __m512 acc[NT];
      for (int t = 0; t < NT; ++t) acc[t] = _mm512_loadu_ps(o + t * N + 16 * v);
      for (int64_t kk = 0; kk < kb; ++kk) {
        const __m512 wv = load16(wk + kk * N + 16 * v);
        for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(a[t * K + k0 + kk]), wv, acc[t]);
      }
      for (int t = 0; t < NT; ++t) _mm512_storeu_ps(o + t * N + 16 * v, acc[t]);
    }
    for (int64_t j = 16 * nv; j < N; ++j)
      for (int64_t kk = 0; kk < kb; ++kk)
        for (int t = 0; t < NT; ++t) o[t * N + j] = std::fma(a[t * K + k0 + kk], wvalue(wk[kk * N + j]), o[t * N + j]);
  }
}

template <int NT, typename WT>
FMOE_FR_AVX2 void few_kn_avx2(const float* a, int64_t K, const WT* w, int64_t N, float* o) {
  const int64_t nv = N / 8;
  std::fill(o, o + NT * N, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += kKB) {
    const int64_t kb = std::min(kKB, K - k0);
    const WT* wk = w + k0 * N;
    for (int64_t v = 0; v < nv; ++v) {
      __m256 acc[NT];
      for (int t = 0; t < NT; ++t) acc[t] = _mm256_loadu_ps(o + t * N + 8 * v);
      for (int64_t kk = 0; kk < kb; ++kk) {
        const __m256 wv = load8(wk + kk * N + 8 * v);
        for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(a[t * K + k0 + kk]), wv, acc[t]);
      }
      for (int t = 0; t < NT; ++t) _mm256_storeu_ps(o + t * N + 8 * v, acc[t]);
    }
    for (int64_t j = 8 * nv; j < N; ++j)
      for (int64_t kk = 0; kk < kb; ++kk)
        for (int t = 0; t < NT; ++t) o[t * N + j] = std::fma(a[t * K + k0 + kk], wvalue(wk[kk * N + j]), o[t * N + j]);
  }
}

// The 16 lane sums of x @ W^T in their fixed order (see above), then the tail k in order.
template <typename WT>
inline float lanes_sum(const float* l, const float* a, const WT* w, int64_t k0, int64_t K) {
  float s = (((l[0] + l[8]) + (l[4] + l[12])) + ((l[2] + l[10]) + (l[6] + l[14]))) +
            (((l[1] + l[9]) + (l[5] + l[13])) + ((l[3] + l[11]) + (l[7] + l[15])));
  for (int64_t k = k0; k < K; ++k) s = std::fma(a[k], wvalue(w[k]), s);
  return s;
}

// x @ W^T: NR weight rows at a time share the activation loads (NR * NT register chains; AVX2 has
// 16 registers for them). AVX-512 takes one row at a time for 1-2 rows an expert: a thread's reads
// are then one sequential stream through the expert, which read 39-46 GB/s from DRAM on the AMD
// host against 36-39 for 4 rows side by side (2 threads, the host's fast-memory phase). Above 2 rows
// an expert the shared activation loads keep their old blocking: one row at a time was not shown
// to pay there (the layer suite's decode_64, 6 rows an expert, was within its run-to-run spread
// either way). The order of each output element's operations does not depend on NR.
template <int NT, bool AVX512>
constexpr int nk_rows() { return AVX512 ? (NT <= 2 ? 1 : NT <= 4 ? 4 : 2) : NT <= 2 ? 4 : NT <= 4 ? 2 : 1; }

template <int NT, typename WT>
FMOE_FR_AVX512 void few_nk_avx512(const float* a, int64_t K, const WT* w, int64_t N, float* o) {
  constexpr int NR = nk_rows<NT, true>();
  const int64_t kv = K / 16;
  alignas(64) float l[16];
  for (int64_t n0 = 0; n0 < N; n0 += NR) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, N - n0));
    const WT* wn = w + n0 * K;
    __m512 acc[NR][NT];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
    if (nr == NR) {
      for (int64_t c = 0; c < kv; ++c) {
        __m512 wv[NR];
        for (int i = 0; i < NR; ++i) wv[i] = load16(wn + i * K + 16 * c);
        for (int t = 0; t < NT; ++t) {
          const __m512 av = _mm512_loadu_ps(a + t * K + 16 * c);
          for (int i = 0; i < NR; ++i) acc[i][t] = _mm512_fmadd_ps(av, wv[i], acc[i][t]);
        }
      }
    } else {
      for (int i = 0; i < nr; ++i)
        for (int64_t c = 0; c < kv; ++c) {
          const __m512 wv = load16(wn + i * K + 16 * c);
          for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_fmadd_ps(_mm512_loadu_ps(a + t * K + 16 * c), wv, acc[i][t]);
        }
    }
    for (int i = 0; i < nr; ++i)
      for (int t = 0; t < NT; ++t) {
        _mm512_store_ps(l, acc[i][t]);
        o[t * N + n0 + i] = lanes_sum(l, a + t * K, wn + i * K, 16 * kv, K);
      }
  }
}

template <int NT, typename WT>
FMOE_FR_AVX2 void few_nk_avx2(const float* a, int64_t K, const WT* w, int64_t N, float* o) {
  constexpr int NR = nk_rows<NT, false>();
  const int64_t kv = K / 16;
  alignas(64) float l[16];
  for (int64_t n0 = 0; n0 < N; n0 += NR) {
    const int nr = static_cast<int>(std::min<int64_t>(NR, N - n0));
    const WT* wn = w + n0 * K;
    __m256 lo[NR][NT], hi[NR][NT];
    for (int i = 0; i < NR; ++i)
      for (int t = 0; t < NT; ++t) lo[i][t] = hi[i][t] = _mm256_setzero_ps();
    for (int i = 0; i < nr; ++i)
      for (int64_t c = 0; c < kv; ++c) {
        const __m256 w0 = load8(wn + i * K + 16 * c), w1 = load8(wn + i * K + 16 * c + 8);
        for (int t = 0; t < NT; ++t) {
          lo[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(a + t * K + 16 * c), w0, lo[i][t]);
          hi[i][t] = _mm256_fmadd_ps(_mm256_loadu_ps(a + t * K + 16 * c + 8), w1, hi[i][t]);
        }
      }
    for (int i = 0; i < nr; ++i)
      for (int t = 0; t < NT; ++t) {
        _mm256_store_ps(l, lo[i][t]);
        _mm256_store_ps(l + 8, hi[i][t]);
        o[t * N + n0 + i] = lanes_sum(l, a + t * K, wn + i * K, 16 * kv, K);
      }
  }
}

// bf16 rows of a bf16 x @ W^T on a CPU with AVX-512 BF16: vdpbf16ps multiplies 32 pairs a step
// straight from the bf16 bits (no widening), exact products summed in float32 in 16 lanes, the
// lanes reduced, the tail (K % 32) added in order. Another order of the same products than the
// float32 loops (within the K-term bound, not their bits). vdpbf16ps counts denormal inputs and
// partial sums as zero (a weight or activation below 2^-126 in magnitude adds nothing), as
// torch's own bf16 GEMM does on such a CPU for more than one row.
#define FMOE_FR_BF16DP __attribute__((target("avx512f,avx512bw,avx512bf16,avx2,fma")))

template <int NT>
FMOE_FR_BF16DP void few_nk_bf16dp(const uint16_t* a, int64_t K, const uint16_t* w, int64_t N, float* o) {
  // One weight row at a time: a thread's reads are then one sequential stream through the expert,
  // which read 31-33 GB/s from DRAM here against 25-30 for 2-8 rows side by side (2 threads).
  const int64_t kv = K / 32;
  for (int64_t n = 0; n < N; ++n) {
    const uint16_t* wn = w + n * K;
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kv; ++c) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wn + 32 * c);
      for (int t = 0; t < NT; ++t) acc[t] = _mm512_dpbf16_ps(acc[t], (__m512bh)_mm512_loadu_si512(a + t * K + 32 * c), wv);
    }
    for (int t = 0; t < NT; ++t) {
      float s = _mm512_reduce_add_ps(acc[t]);
      for (int64_t k = 32 * kv; k < K; ++k) s = std::fma(wvalue(a[t * K + k]), wvalue(wn[k]), s);
      o[t * N + n] = s;
    }
  }
}

// isa: 0 the widest float32 path this CPU runs, 2 AVX2 + FMA, 3 AVX-512, 4 AVX-512 with BF16 (bf16
// x @ W^T by dot products; every other product as 3) (tests force each). Returns 0 where the
// forced or best path does not run here, else the path taken.
int few_rows_isa(int isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  const bool bf16dp = avx512 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16");
  if (isa == 0) return avx512 ? 3 : avx2 ? 2 : 0;
  if (isa == 4) return bf16dp ? 4 : 0;
  if (isa == 3) return avx512 ? 3 : 0;
  if (isa == 2) return avx2 ? 2 : 0;
  return 0;
}

template <int NT, typename WT>
void few_rows_nt(int isa, bool transposed, const float* a, int64_t K, const WT* w, int64_t N, float* o) {
  if (transposed)
    (isa >= 3 ? few_nk_avx512<NT, WT> : few_nk_avx2<NT, WT>)(a, K, w, N, o);
  else
    (isa >= 3 ? few_kn_avx512<NT, WT> : few_kn_avx2<NT, WT>)(a, K, w, N, o);
}

// o [n, N] (row stride N) = a [n, K] (row stride K) @ op(w_e), w_e [K, N] or [N, K] (transposed),
// for 1 <= n <= kFewRows on path `isa` (as few_rows_isa returned it, nonzero).
template <typename WT>
void few_rows_mm(int isa, bool transposed, const float* a, int64_t n, int64_t K, const WT* we, int64_t N,
                 float* o) {
  switch (n) {
    case 1: return few_rows_nt<1>(isa, transposed, a, K, we, N, o);
    case 2: return few_rows_nt<2>(isa, transposed, a, K, we, N, o);
    case 3: return few_rows_nt<3>(isa, transposed, a, K, we, N, o);
    case 4: return few_rows_nt<4>(isa, transposed, a, K, we, N, o);
    case 5: return few_rows_nt<5>(isa, transposed, a, K, we, N, o);
    case 6: return few_rows_nt<6>(isa, transposed, a, K, we, N, o);
    case 7: return few_rows_nt<7>(isa, transposed, a, K, we, N, o);
    default: return few_rows_nt<8>(isa, transposed, a, K, we, N, o);
  }
}

// bf16 rows and weights, each output rounded once to bf16 (to nearest even, as torch's bf16 GEMM
// rounds its float32 sums). Path 4, x @ W^T: the dot products above. Otherwise the rows widened to
// float32 (exact) and the float32 loops on the weights' exact values: those bits, rounded.
// o: n rows of N bf16 (row stride N); scratch: thread-local float32.
void few_rows_bf16(int isa, bool transposed, const uint16_t* a, int64_t n, int64_t K, const uint16_t* we,
                   int64_t N, uint16_t* o) {
  thread_local std::vector<float> a32, o32;
  o32.resize(static_cast<size_t>(n * N));
  if (isa == 4 && transposed) {
    float* r = o32.data();
    switch (n) {
      case 1: few_nk_bf16dp<1>(a, K, we, N, r); break;
      case 2: few_nk_bf16dp<2>(a, K, we, N, r); break;
      case 3: few_nk_bf16dp<3>(a, K, we, N, r); break;
      case 4: few_nk_bf16dp<4>(a, K, we, N, r); break;
      case 5: few_nk_bf16dp<5>(a, K, we, N, r); break;
      case 6: few_nk_bf16dp<6>(a, K, we, N, r); break;
      case 7: few_nk_bf16dp<7>(a, K, we, N, r); break;
      default: few_nk_bf16dp<8>(a, K, we, N, r); break;
    }
  } else {
    a32.resize(static_cast<size_t>(n * K));
    for (int64_t i = 0; i < n * K; ++i) a32[i] = wvalue(a[i]);
    few_rows_mm(isa, transposed, a32.data(), n, K, we, N, o32.data());
  }
  for (int64_t i = 0; i < n * N; ++i) o[i] = c10::BFloat16(o32[i]).x;
}

// The few-rows product alone on a forced path (tests): a [n, K] @ op(w) for w [K, N] (or [N, K],
// transposed), all float32 contiguous. isa as few_rows_isa's; raises where that path does not run.
at::Tensor few_rows(const at::Tensor& a, const at::Tensor& w, bool transposed, int64_t isa) {
  const bool bf16 = a.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE((a.scalar_type() == at::kFloat || bf16) && w.scalar_type() == a.scalar_type() && a.dim() == 2 &&
                        w.dim() == 2 && a.is_contiguous() && w.is_contiguous() && a.device().is_cpu() &&
                        w.device().is_cpu(),
                    "few_rows takes contiguous float32 (or bfloat16) CPU a [n, K] and w [K, N] (or [N, K], "
                    "transposed) of one dtype");
  const int64_t K = transposed ? w.size(1) : w.size(0), N = transposed ? w.size(0) : w.size(1), n = a.size(0);
  TORCH_CHECK_VALUE(a.size(1) == K, "few_rows: a [n, K] does not match w");
  TORCH_CHECK_VALUE(n >= 1 && n <= kFewRows, "few_rows takes 1 to ", kFewRows, " rows, got ", n);
  const int path = few_rows_isa(static_cast<int>(isa));
  TORCH_CHECK_VALUE(path != 0, "few_rows: ISA path ", isa, " does not run on this CPU");
  at::Tensor o = at::empty({n, N}, a.options());
  if (bf16)
    few_rows_bf16(path, transposed, reinterpret_cast<const uint16_t*>(a.const_data_ptr()), n, K,
                  reinterpret_cast<const uint16_t*>(w.const_data_ptr()), N, reinterpret_cast<uint16_t*>(o.data_ptr()));
  else
    few_rows_mm(path, transposed, a.const_data_ptr<float>(), n, K, w.const_data_ptr<float>(), N, o.data_ptr<float>());
  return o;
}

// The parallel regime's float32 product (1-8 rows: the few-rows loops above), else straight
// through BLAS: o [n, N] (row stride N) = a [n, K]
// (row stride K) @ op(w[e]), w contiguous [E, K, N], or [E, N, K] read as its transpose. At
// decode an expert has a handful of rows and the ATen calls around each product (the views of
// its operands and output, at::mm's dispatch) cost about as much as a small product's
// arithmetic. These are the arguments at::mm passes BLAS (the row-major product as its
// column-major transpose) where its float32 GEMM is BLAS's, as in the x86 MKL wheels: equal bits
// there; the parallel regime's tests hold it to the K-term bound, not to bits, since another
// build's at::mm may take another kernel. False where it does not apply (another dtype, a weight
// that is a view, no BLAS symbol): the caller takes at::mm.
bool f32_rows_mm(const at::Tensor& w, int64_t e, bool transposed, const float* a, int64_t n, float* o) {
  if (w.scalar_type() != at::kFloat || !w.is_contiguous()) return false;
  const auto [K, N] = op_dims(w, transposed);
  if (K < 1 || N < 1) return false;
  const float* we = w.const_data_ptr<float>() + e * K * N;
  static const int few_isa = few_rows_isa(0);
  if (few_isa != 0 && n <= kFewRows) {
    few_rows_mm(few_isa, transposed, a, n, K, we, N, o);
    return true;
  }
  // BLAS's int dimensions and its leading-dimension rule (>= 1): at::mm handles the rest
  constexpr int64_t kMax = std::numeric_limits<int>::max();
  if (sgemm_ == nullptr || K > kMax || N > kMax || n > kMax) return false;
  // column-major: o^T [N, n] = op(w_e)^T [N, K] @ a^T [K, n]
  const char ta = transposed ? 'T' : 'N', tb = 'N';
  const int m = static_cast<int>(N), nn = static_cast<int>(n), k = static_cast<int>(K);
  const int lda = static_cast<int>(transposed ? K : N), ldb = k, ldc = m;
  const float one = 1.0f, zero = 0.0f;
  if (reinterpret_cast<std::uintptr_t>(o) % 64 == 0) {
    sgemm_(&ta, &tb, &m, &nn, &k, &one, we, &lda, a, &ldb, &zero, o, &ldc);
    return true;
  }
  // as mm_into: an unaligned destination gets the product computed where the reference's lies
  thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < n * N) scratch = at::empty({n * N}, at::kFloat);
  float* t = scratch.data_ptr<float>();
  sgemm_(&ta, &tb, &m, &nn, &k, &one, we, &lda, a, &ldb, &zero, t, &ldc);
  std::memcpy(o, t, static_cast<size_t>(n * N) * sizeof(float));
  return true;
}

// The parallel regime's bf16 product of 1-8 rows (few_rows_bf16): o [n, N] bf16 (row stride N) =
// a [n, K] bf16 (row stride K) @ op(w[e]), w contiguous bf16 [E, K, N] or [E, N, K] (transposed).
// at::mm's bf16 GEMM read an expert at about half the float32 loops' bytes a second here (both
// took the same time, for half the bytes). False where it does not apply: the caller takes at::mm.
bool bf16_rows_mm(const at::Tensor& w, int64_t e, bool transposed, const uint16_t* a, int64_t n, uint16_t* o) {
  if (w.scalar_type() != at::kBFloat16 || !w.is_contiguous() || n > kFewRows) return false;
  static const int few_isa = few_rows_isa(4) ? 4 : few_rows_isa(0);
  const auto [K, N] = op_dims(w, transposed);
  if (few_isa == 0 || K < 1 || N < 1) return false;
  few_rows_bf16(few_isa, transposed, a, n, K, reinterpret_cast<const uint16_t*>(w.const_data_ptr()) + e * K * N, N, o);
  return true;
}

// o[r] += bias[e] for the n rows of o (float32, row stride N): the reference's add, one rounding.
void add_bias_rows(float* o, int64_t n, int64_t N, const c10::optional<at::Tensor>& bias, int64_t e) {
  if (!bias.has_value()) return;
  const at::Tensor b = bias->select(0, e).contiguous();
  const float* bp = b.const_data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < N; ++j) o[r * N + j] = o[r * N + j] + bp[j];
}

// Runs body(span) for every busy expert, the experts spread over the intra-op threads
// (inline when there is one expert or we already are inside a parallel region).
template <typename F>
void parallel_over_experts(const std::vector<Span>& spans, const F& body) {
  if (spans.size() > 1 && !at::in_parallel_region()) {
    at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t b0, int64_t b1) {
      // Grad mode is thread-local: the worker threads need the guard of their own.
      at::AutoDispatchBelowADInplaceOrView guard;
      for (int64_t b = b0; b < b1; ++b) body(spans[b]);
    });
  } else {
    for (const auto& s : spans) body(s);
  }
}

void check_cpu_contiguous_out(const at::Tensor& out, const char* name) {
  TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous(), name, " must be a contiguous CPU tensor");
}

// y[r] = x[rows[r]] @ op(w[e]) for r in expert e's rows, written into out [R, N].
void gather_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets,
               const c10::optional<at::Tensor>& rows, bool transposed, at::Tensor out, bool parallel,
               const c10::optional<at::Tensor>& bias) {
  at::AutoDispatchBelowADInplaceOrView guard;
  check_cpu_contiguous_out(out, "out");
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() && w.dim() == 3 && out.dim() == 2,
                    "x must be contiguous 2-D, w 3-D, out 2-D");
  const int64_t E = w.size(0), R = out.size(0);
  const auto [K, N] = op_dims(w, transposed);
  TORCH_CHECK_VALUE(x.size(1) == K && out.size(1) == N, "x [., K] / out [R, N] do not match w");
  const auto spans = busy_spans(offsets, E, R);
  const int64_t* rp = nullptr;
  if (rows.has_value()) {
    check_index(*rows, R, x.size(0), "rows");
    rp = rows->const_data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(x.size(0) == R, "x must have R = ", R, " rows when rows is None");
  }
  check_bias(bias, E, N);
  if (parallel) {
    // One gather buffer, each expert filling its own slice: no sharing between threads.
    at::Tensor g = rp ? at::empty({R, K}, x.options()) : at::Tensor();
    const bool blas = x.scalar_type() == at::kFloat && (!bias.has_value() || bias->scalar_type() == at::kFloat);
    const bool b16 = x.scalar_type() == at::kBFloat16;
    parallel_over_experts(spans, [&](const Span& s) {
      if (blas) {
        const float* xe = (rp ? g : x).const_data_ptr<float>() + s.lo * K;
        if (rp) gather_rows_raw(x, rp + s.lo, s.n, g.data_ptr<float>() + s.lo * K);
        float* o = out.data_ptr<float>() + s.lo * N;
        if (f32_rows_mm(w, s.expert, transposed, xe, s.n, o)) {
          add_bias_rows(o, s.n, N, bias, s.expert);
          return;
        }
      } else if (b16) {
        const uint16_t* xe = reinterpret_cast<const uint16_t*>((rp ? g : x).const_data_ptr()) + s.lo * K;
        if (rp) gather_rows_raw(x, rp + s.lo, s.n, reinterpret_cast<uint16_t*>(g.data_ptr()) + s.lo * K);
        if (bf16_rows_mm(w, s.expert, transposed, xe, s.n, reinterpret_cast<uint16_t*>(out.data_ptr()) + s.lo * N)) {
          at::Tensor o = out.narrow(0, s.lo, s.n);
          add_bias(o, bias, s.expert);
          return;
        }
      }
      at::Tensor xe = rp ? g.narrow(0, s.lo, s.n) : x.narrow(0, s.lo, s.n);
      if (rp && !blas && !b16) gather_rows(x, rp + s.lo, s.n, xe);
      at::Tensor o = out.narrow(0, s.lo, s.n);
      mm_into(o, xe, expert_weight(w, s.expert, transposed));
      add_bias(o, bias, s.expert);
    });
  } else {
    // One scratch the size of the largest expert, reused: stays in cache, bounded memory.
    at::Tensor scratch = rp ? at::empty({max_rows(spans), K}, x.options()) : at::Tensor();
    for (const auto& s : spans) {
      at::Tensor o = out.narrow(0, s.lo, s.n);
      mm_into(o, expert_rows(x, rp, s, scratch), expert_weight(w, s.expert, transposed));
      add_bias(o, bias, s.expert);
    }
  }
}

// out[index[r]] += scale[r] * (a[r] @ op(w[e])) for r in expert e's rows, ascending e.
void mm_scatter(const at::Tensor& a, const at::Tensor& w, const at::Tensor& offsets,
                const at::Tensor& index, at::Tensor out, const c10::optional<at::Tensor>& scale,
                bool transposed, bool parallel, const c10::optional<at::Tensor>& bias) {
  at::AutoDispatchBelowADInplaceOrView guard;
  check_cpu_contiguous_out(out, "out");
  TORCH_CHECK_VALUE(a.dim() == 2 && a.is_contiguous() && w.dim() == 3 && out.dim() == 2,
                    "a must be contiguous 2-D, w 3-D, out 2-D");
  const int64_t E = w.size(0), R = a.size(0);
  const auto [K, N] = op_dims(w, transposed);
  TORCH_CHECK_VALUE(a.size(1) == K && out.size(1) == N, "a [R, K] / out [T, N] do not match w");
  const auto spans = busy_spans(offsets, E, R);
  check_index(index, R, out.size(0), "index");
  check_bias(bias, E, N);
  at::Tensor scale_o;
  if (scale.has_value()) {
    TORCH_CHECK_VALUE(scale->dim() == 1 && scale->size(0) == R, "scale must be [R] = [", R, "]");
    scale_o = scale->to(out.scalar_type()).contiguous();
  }
  const int64_t* ip = index.const_data_ptr<int64_t>();
  if (parallel) {
    // Products in parallel into one buffer, then one serial (ascending-row) scatter.
    at::Tensor p = at::empty({R, N}, a.options());
    const bool blas = a.scalar_type() == at::kFloat && (!bias.has_value() || bias->scalar_type() == at::kFloat);
    const bool b16 = a.scalar_type() == at::kBFloat16;
    parallel_over_experts(spans, [&](const Span& s) {
      float* po = blas ? p.data_ptr<float>() + s.lo * N : nullptr;
      if (blas && f32_rows_mm(w, s.expert, transposed, a.const_data_ptr<float>() + s.lo * K, s.n, po)) {
        add_bias_rows(po, s.n, N, bias, s.expert);
        return;
      }
      if (b16 && bf16_rows_mm(w, s.expert, transposed,
                              reinterpret_cast<const uint16_t*>(a.const_data_ptr()) + s.lo * K, s.n,
                              reinterpret_cast<uint16_t*>(p.data_ptr()) + s.lo * N)) {
        at::Tensor pe = p.narrow(0, s.lo, s.n);
        add_bias(pe, bias, s.expert);
        return;
      }
      at::Tensor pe = p.narrow(0, s.lo, s.n);
      mm_into(pe, a.narrow(0, s.lo, s.n), expert_weight(w, s.expert, transposed));
      add_bias(pe, bias, s.expert);
    });
    scatter_add(p, ip, scale_o, 0, out);
  } else {
    at::Tensor scratch = at::empty({max_rows(spans), N}, a.options());
    for (const auto& s : spans) {
      at::Tensor pe = scratch.narrow(0, 0, s.n);
      at::mm_out(pe, a.narrow(0, s.lo, s.n), expert_weight(w, s.expert, transposed));
      add_bias(pe, bias, s.expert);
      scatter_add(pe, ip, scale_o, s.lo, out);
    }
  }
}

// z[e] = a[rows of e]^T @ b[rows of e] into out [E, P, Q]; experts without rows get zeros.
void gather_wgrad(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets,
                  const c10::optional<at::Tensor>& rows, at::Tensor out, bool parallel,
                  const c10::optional<at::Tensor>& rows_b) {
  at::AutoDispatchBelowADInplaceOrView guard;
  check_cpu_contiguous_out(out, "out");
  TORCH_CHECK_VALUE(a.dim() == 2 && a.is_contiguous() && b.dim() == 2 && b.is_contiguous() &&
                        out.dim() == 3,
                    "a and b must be contiguous 2-D, out 3-D");
  const int64_t E = out.size(0), P = a.size(1), Q = b.size(1);
  const int64_t R = rows_b.has_value() ? rows_b->size(0) : b.size(0);
  TORCH_CHECK_VALUE(out.size(1) == P && out.size(2) == Q, "out must be [E, P, Q]");
  const auto spans = busy_spans(offsets, E, R);
  const int64_t* rp = nullptr;
  if (rows.has_value()) {
    check_index(*rows, R, a.size(0), "rows");
    rp = rows->const_data_ptr<int64_t>();
  } else {
    TORCH_CHECK_VALUE(a.size(0) == R, "a must have R = ", R, " rows when rows is None");
  }
  const int64_t* rbp = nullptr;
  if (rows_b.has_value()) {
    check_index(*rows_b, R, b.size(0), "rows_b");
    rbp = rows_b->const_data_ptr<int64_t>();
  }
  {
    const int64_t* o = offsets.const_data_ptr<int64_t>();
    for (int64_t e = 0; e < E; ++e)
      if (o[e + 1] == o[e]) out.select(0, e).zero_();
  }
  auto product = [&](const Span& s, const at::Tensor& ae, const at::Tensor& be) {
    mm_into(out.select(0, s.expert), ae.t(), be);
  };
  if (parallel) {
    at::Tensor g = rp ? at::empty({R, P}, a.options()) : at::Tensor();
    at::Tensor gb = rbp ? at::empty({R, Q}, b.options()) : at::Tensor();
    parallel_over_experts(spans, [&](const Span& s) {
      at::Tensor ae = rp ? g.narrow(0, s.lo, s.n) : a.narrow(0, s.lo, s.n);
      if (rp) gather_rows(a, rp + s.lo, s.n, ae);
      at::Tensor be = rbp ? gb.narrow(0, s.lo, s.n) : b.narrow(0, s.lo, s.n);
      if (rbp) gather_rows(b, rbp + s.lo, s.n, be);
      product(s, ae, be);
    });
  } else {
    // Scratch the size of the largest expert, reused: the gathered rows stay in cache and the
    // memory is bounded by one expert's rows, never all R.
    const int64_t m = max_rows(spans);
    at::Tensor scratch = rp ? at::empty({m, P}, a.options()) : at::Tensor();
    at::Tensor scratch_b = rbp ? at::empty({m, Q}, b.options()) : at::Tensor();
    for (const auto& s : spans) product(s, expert_rows(a, rp, s, scratch), expert_rows(b, rbp, s, scratch_b));
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fmoe native CPU grouped GEMM (see fmoe/ops/native.py for the API and semantics)";
  m.def("gather_mm", &gather_mm, "y[r] = x[rows[r]] @ op(w[e]) (+ bias[e]) into out", py::arg("x"), py::arg("w"),
        py::arg("offsets"), py::arg("rows"), py::arg("transposed"), py::arg("out"), py::arg("parallel"),
        py::arg("bias"));
  m.def("mm_scatter", &mm_scatter, "out[index[r]] += scale[r] * (a[r] @ op(w[e]) (+ bias[e]))", py::arg("a"),
        py::arg("w"), py::arg("offsets"), py::arg("index"), py::arg("out"), py::arg("scale"),
        py::arg("transposed"), py::arg("parallel"), py::arg("bias"));
  m.def("gather_wgrad", &gather_wgrad, "z[e] = a[rows of e]^T b[rows_b of e] into out", py::arg("a"),
        py::arg("b"), py::arg("offsets"), py::arg("rows"), py::arg("out"), py::arg("parallel"), py::arg("rows_b"));
  m.def("few_rows", &few_rows, "a @ op(w) for 1-8 float32 or bfloat16 rows on a forced ISA path (tests)", py::arg("a"),
        py::arg("w"), py::arg("transposed"), py::arg("isa"));
  m.def("few_rows_isa", &few_rows_isa, "the few-rows path that runs for a request: 0 none, 2 AVX2, 3 AVX-512",
        py::arg("isa"));
}
