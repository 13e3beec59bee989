// The two integer walks of a routing that run on every CPU call, decode included: slot
// assignment (fmoe.routing.assign_slots) and its inverse, the kept pairs listed by expert and
// slot (fmoe.engine.plan.make_plan's rows). Built as their own small extension (fmoe_walks) so
// that inference never needs numba's LLVM in the process; fmoe/_slots_numba.py holds the numba
// twins, the fallback where this is not built. Both are serial running counts, O(k*T), and
// integer-exact: equal to the twins and to the pure-torch references by construction.
//
// A third, route_rows, is a small no-grad CPU call's whole routing after the router's scores: top-k,
// the gates' normalisation, slots, capacity and the kept rows, in one call (fmoe.routers.route_native).
// Its arithmetic is torch's, operation for operation: the same selection and tie order as
// torch.topk on the CPU, the same order of additions as torch.sum over the k gates (the caller
// names which, fmoe/_slots.py probes it) and one IEEE division; so its gates equal the torch
// path's bit for bit.
//
// The Python front (fmoe/_slots.py) converts the arguments (int64, contiguous, CPU) and turns
// the status codes into errors; the checks here are the backstop that keeps a caller who skips
// it from reading or writing outside a buffer.
#include <torch/extension.h>

#include <ATen/EmptyTensor.h>
#include <ATen/OpMathType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace {

void check_int64(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "fmoe walks: ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kLong, "fmoe walks: ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "fmoe walks: ", name, " must be ", dim, "-D, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), "fmoe walks: ", name, " must be contiguous");
}

// assign_slots' status codes (fmoe/_slots.py ASSIGN_ERRORS)
constexpr int64_t kIdTooLarge = 1, kOrderOutOfRange = 2, kOrderRepeats = 3;

// One slot j of the walk: tokens in `perm` order (token order where null). Whether an id was >= E.
inline bool count_row(const int64_t* __restrict__ row, const int64_t* __restrict__ perm, int64_t T, int64_t E,
                      int64_t* __restrict__ count, int64_t* __restrict__ out) {
  bool bad = false;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t t = perm ? perm[i] : i;
    const int64_t e = row[t];
    if (e >= 0 && e < E) {
      out[t] = count[e]++;
    } else {
      bad |= e >= E;
      out[t] = -1;
    }
  }
  return bad;
}

// Slot-major slots (spec section 6): j outer, tokens in `order` inner (token order when order is
// empty), one counter per expert. Negative ids get slot -1 and are not counted. Returns (slots
// [k, T], counts [E], status): status 0, or kIdTooLarge where an id is >= E (those pairs get
// -1), kOrderOutOfRange / kOrderRepeats where order is not a permutation of 0..T-1 (then
// nothing is walked and slots is all -1).
std::tuple<at::Tensor, at::Tensor, int64_t> assign_slots(const at::Tensor& ids, const at::Tensor& order,
                                                        int64_t num_experts) {
  check_int64(ids, "ids", 2);
  check_int64(order, "order", 1);
  TORCH_CHECK(num_experts >= 0, "fmoe walks: num_experts must be >= 0, got ", num_experts);
  const int64_t k = ids.size(0), T = ids.size(1);
  const bool use_order = order.numel() > 0;
  TORCH_CHECK(!use_order || order.numel() == T, "fmoe walks: order must have 0 or T=", T, " entries, got ",
              order.numel());
  at::Tensor slots = at::empty({k, T}, ids.options());
  at::Tensor counts = at::zeros({num_experts}, ids.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* perm = order.data_ptr<int64_t>();
  int64_t* slot = slots.data_ptr<int64_t>();
  int64_t* count = counts.data_ptr<int64_t>();
  if (use_order) {   // every token exactly once, or slots would be left unwritten
    std::vector<uint8_t> seen(T, 0);
    int64_t status = 0;
    for (int64_t i = 0; i < T && status == 0; ++i) {
      const int64_t t = perm[i];
      if (t < 0 || t >= T) status = kOrderOutOfRange;
      else if (seen[t]++) status = kOrderRepeats;
    }
    if (status) {
      slots.fill_(-1);
      return {slots, counts, status};
    }
  }
  bool bad = false;
  for (int64_t j = 0; j < k; ++j) {
    if (use_order) bad |= count_row(id + j * T, perm, T, num_experts, count, slot + j * T);
    else bad |= count_row(id + j * T, nullptr, T, num_experts, count, slot + j * T);
  }
  return {slots, counts, bad ? kIdTooLarge : 0};
}

// The kept pairs sorted by (expert, slot). ids, slots: [k, T]; counts: [E]. `out` [>= E + 2 + k*T]
// receives bounds [E + 1] (prefix sums of min(counts[e], capacity)), dropped [1] (the valid pairs
// at or past capacity), tokens [k*T]; `pairs` [>= k*T] the pair index j*T + t of each row. Returns
// N = bounds[E], or a negative code of fmoe/_slots.py KEPT_ROWS_ERRORS; nothing is written past
// either buffer's end.
int64_t kept_rows(const at::Tensor& ids, const at::Tensor& slots, const at::Tensor& counts, int64_t capacity,
                  const at::Tensor& out, const at::Tensor& pairs) {
  check_int64(ids, "ids", 2);
  check_int64(slots, "slots", 2);
  check_int64(counts, "counts", 1);
  check_int64(out, "out", 1);
  check_int64(pairs, "pairs", 1);
  TORCH_CHECK(slots.sizes() == ids.sizes(), "fmoe walks: slots must have ids' shape ", ids.sizes(), ", got ",
              slots.sizes());
  const int64_t k = ids.size(0), T = ids.size(1), E = counts.size(0), kt = k * T;
  if (out.numel() < E + 2 + kt || pairs.numel() < kt) return -4;
  if (capacity < 0) return -5;
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* cnt = counts.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  int64_t* pr = pairs.data_ptr<int64_t>();
  int64_t* tokens = o + E + 2;
  o[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t c = cnt[e];
    if (c < 0) return -5;
    o[e + 1] = o[e] + (c < capacity ? c : capacity);
    if (o[e + 1] > kt) return -3;   // more rows than pairs (checked as it grows: no overflow)
  }
  const int64_t N = o[E];
  for (int64_t p = 0; p < N; ++p) pr[p] = -1;
  int64_t lost = 0;
  for (int64_t j = 0; j < k; ++j) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t e = id[j * T + t], s = sl[j * T + t];
      if (e < 0) continue;
      if (s >= capacity) {
        ++lost;
        continue;
      }
      if (e >= E || s < 0 || s >= o[e + 1] - o[e]) return -1;
      const int64_t p = o[e] + s;
      if (pr[p] >= 0) return -2;
      pr[p] = j * T + t;
      tokens[p] = t;
    }
  }
  for (int64_t p = 0; p < N; ++p)
    if (pr[p] < 0) return -3;
  o[E + 1] = lost;
  return N;
}

// --------------------------------------------------------------------------- route_rows

// torch.topk's queue element on the CPU: (value in the accumulate type, index); for float
// and the half types the accumulate type is double or float, either exact for the value.
using Elem = std::pair<double, int64_t>;

// torch.topk(largest=True)'s order: NaN first, then greater values. Not a total order on ties,
// so the tie order is the algorithm's: top_k_row runs torch's algorithm (the same libstdc++
// heap, nth_element and sort on the same sequence), which picks the same indices in the same order.
struct Greater {
  bool operator()(const Elem& a, const Elem& b) const {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  }
};

template <typename scalar_t>
inline double widen(scalar_t v) {
  return static_cast<double>(static_cast<at::opmath_type<scalar_t>>(v));
}

// The k largest of row[0:E] into q[0:k], as torch.topk on the CPU: std::partial_sort for
// k * 64 <= E (largest first), else nth_element, then (sorted) a sort of the first k - 1.
template <typename scalar_t>
void top_k_row(const scalar_t* row, int64_t E, int64_t k, std::vector<Elem>& q, bool sorted = true) {
  const Greater comp;
  q.resize(E);
  for (int64_t j = 0; j < E; ++j) q[j] = Elem(widen(row[j]), j);
  if (k * 64 <= E) {
    std::partial_sort(q.begin(), q.begin() + k, q.end(), comp);
  } else {
    std::nth_element(q.begin(), q.begin() + k - 1, q.end(), comp);
    if (sorted) std::sort(q.begin(), q.begin() + k - 1, comp);
  }
}

// The sum of v[0:k] in the order torch.sum(dim=-1) adds a contiguous float row of k (its
// cascade sum, aten/native/cpu/SumKernel.cpp). kSumScalar: k below the vector width, four
// running sums over the columns mod 4, the tail added to the first, then the four added in
// order. kSumVector8: 8 <= k < 16 with 8-float vectors, the tail k - 8 added first, then the
// 8 lanes in order. (The +0.0f steps are torch's empty partial sums: they turn a -0 into +0.)
constexpr int64_t kSumScalar = 0, kSumVector8 = 1;

float torch_row_sum(const float* v, int64_t k, int64_t order) {
  if (order == kSumVector8 && k >= 8) {
    float acc = 0.0f;
    for (int64_t i = 8; i < k; ++i) acc += v[i];
    for (int64_t i = 0; i < 8; ++i) acc += ((((0.0f + v[i]) + 0.0f) + 0.0f) + 0.0f);
    return acc;
  }
  const int64_t rows = k / 4;
  float p[4];
  for (int64_t c = 0; c < 4; ++c) {
    float a = 0.0f;
    for (int64_t i = 0; i < rows; ++i) a += v[i * 4 + c];
    p[c] = ((a + 0.0f) + 0.0f) + 0.0f;
  }
  for (int64_t i = rows * 4; i < k; ++i) p[0] += v[i];
  return ((p[0] + p[1]) + p[2]) + p[3];
}

// The GShard loss's reductions in torch's orders (aten/native/cpu/SumKernel.cpp, float accumulators):
// cascade_sum is multi_row_sum's four-level cascade over n values (level 0 adds 2^p values in order,
// then flushes into level 1, which flushes on every 2^(2p)-th value, ...), p = max(4, ceil_log2(n) / 4);
// ilp4_sum is row_sum: four interleaved cascades over the positions mod 4, the tail into the first,
// then the four added in order. Which one a column or a vector lane gets depends on the shape and
// on W, the float vector width torch's kernels run with in this process (fmoe/_slots.py loss_width
// reads it, and checks these orders against torch's ops for each shape before route_rows uses them).
inline int64_t ceil_log2(int64_t n) {
  if (n <= 2) return 1;
  int64_t b = 0;
  for (uint64_t v = static_cast<uint64_t>(n - 1); v; v >>= 1) ++b;
  return b;
}

template <typename Load>
float cascade_sum(const Load& load, int64_t n) {
  const int64_t p = std::max<int64_t>(4, ceil_log2(n) / 4), step = int64_t(1) << p, mask = step - 1;
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  int64_t i = 0;
  while (i + step <= n) {
    for (int64_t j = 0; j < step; ++j, ++i) acc[0] += load(i);
    for (int64_t l = 1; l < 4; ++l) {
      acc[l] += acc[l - 1];
      acc[l - 1] = 0.0f;
      if (i & (mask << (l * p))) break;
    }
  }
  for (; i < n; ++i) acc[0] += load(i);
  for (int64_t l = 1; l < 4; ++l) acc[0] += acc[l];
  return acc[0];
}

template <typename Load>
float ilp4_sum(const Load& load, int64_t n) {
  const int64_t rows = n / 4;
  float part[4];
  for (int64_t c = 0; c < 4; ++c) part[c] = cascade_sum([&](int64_t i) { return load(i * 4 + c); }, rows);
  for (int64_t i = rows * 4; i < n; ++i) part[0] += load(i);
  return ((part[0] + part[1]) + part[2]) + part[3];
}

// torch.sum of a contiguous float vector v[0:n] (vectorized_inner_sum for n >= W: each lane's
// ilp4_sum over the n / W vectors, added in lane order after the tail; else scalar_inner_sum), then
// added to the zero-filled output as torch stores it.
float torch_vector_sum(const float* v, int64_t n, int64_t W) {
  float r;
  if (n >= W) {
    const int64_t nv = n / W;
    r = 0.0f;
    for (int64_t i = nv * W; i < n; ++i) r += v[i];
    for (int64_t l = 0; l < W; ++l) r += ilp4_sum([&](int64_t i) { return v[i * W + l]; }, nv);
  } else {
    r = ilp4_sum([&](int64_t i) { return v[i]; }, n);
  }
  return 0.0f + r;
}

// l = E * sum_e(mean_t(s[t, e]) * frac[e]) as gshard_loss's torch ops on float32 s [T, E] (E >= 2):
// mean(0) is a sum over dim 0 (vectorized_outer_sum for E >= W: columns in whole groups of 4 vectors
// take cascade_sum, the rest ilp4_sum; scalar_outer_sum below W: groups of 4 columns, the rest
// ilp4_sum), stored onto zeros, then divided by float(T); the product's torch.sum; float(E) times it.
void torch_mean0(const float* s, int64_t T, int64_t E, int64_t W, float* mean) {
  const int64_t grouped = E >= W ? E / (4 * W) * (4 * W) : E / 4 * 4;
  for (int64_t e = 0; e < E; ++e) {
    const auto col = [&](int64_t t) { return s[t * E + e]; };
    mean[e] = (0.0f + (e < grouped ? cascade_sum(col, T) : ilp4_sum(col, T))) / static_cast<float>(T);
  }
}

float torch_gshard_loss(const float* s, const float* frac, int64_t T, int64_t E, int64_t W, float* buf) {
  torch_mean0(s, T, E, W, buf);
  for (int64_t e = 0; e < E; ++e) buf[e] = buf[e] * frac[e];
  return static_cast<float>(E) * torch_vector_sum(buf, E, W);
}

template <typename scalar_t>
bool all_finite(const scalar_t* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(widen(v[i]))) return false;
  return true;
}

// The gates' normalisation (fmoe/_slots.py ROUTE_*): kRaw keeps the selected scores; kTutel
// divides by max(sum, float eps) (Tutel's); kSum by the sum (qwen, mixtral); kDeepseek by
// (sum + float(1e-20)), then multiplies by float(scale); kScale only multiplies (DeepSeek's
// unnormalised gates): torch's float ops with its Python scalars rounded to float.
constexpr int64_t kRaw = 0, kTutel = 1, kSum = 2, kDeepseek = 3, kScale = 4;
// route_rows' status codes (fmoe/_slots.py ROUTE_ERRORS)
constexpr int64_t kNonFinite = 1, kZeroCapacity = 2;

template <typename out_t>
void write_gates(float* v, int64_t k, int64_t norm, int64_t order, float scale, int64_t t, int64_t T,
                 bool by_token, out_t* w) {
  if (norm == kTutel || norm == kSum || norm == kDeepseek) {
    float d = torch_row_sum(v, k, order);
    if (norm == kTutel) d = std::max(d, FLT_EPSILON);
    if (norm == kDeepseek) d = d + static_cast<float>(1e-20);
    for (int64_t j = 0; j < k; ++j) v[j] = v[j] / d;
  }
  if (norm == kDeepseek || norm == kScale)
    for (int64_t j = 0; j < k; ++j) v[j] = v[j] * scale;
  for (int64_t j = 0; j < k; ++j) w[by_token ? t * k + j : j * T + t] = static_cast<out_t>(v[j]);
}

// One small call's routing from its scores. sel: [T, E] the values top-k selects on (float32,
// bfloat16 or float16; kRaw only for the half types); logits: [T, E] the router's logits (checked
// finite first). k <= min(E, 64). norm, order: as above. out_dtype: the gates' dtype (each gate
// computed in float, then rounded to it once, as a torch cast does). by_token: gates [T, k] (a softmax over them follows) instead
// of [k, T]. cap_fixed >= 0: the capacity (padded mode); else the largest load, capped at cap_limit
// when >= 0 (capped dropless), rounded up to align. frac: also the fraction of tokens whose slot-0
// expert is e (float32 [E], the GShard loss's). choice (DeepSeek; empty otherwise): float32 [T, E]
// selected on with n_group / topk_group groups (deepseek_row), the gates then read from sel; scale:
// kDeepseek and kScale's factor.
//
// Returns (status, ids [k, T], gates, slots [k, T], counts [E], tokens [N], pairs [N], offsets
// [E + 1], dropped [], row gates [N] (undefined for by_token), bounds (a tuple of E + 1 ints),
// capacity, frac [E] or undefined; with loss_width > 0 the GShard loss of loss_scores [T, E] and frac,
// a 0-dim float32 tensor, in frac's place: torch_gshard_loss). status kNonFinite: a logit is NaN or Inf (nothing else is
// valid); kZeroCapacity: a capped capacity of 0 would drop every pair.
// DeepSeek's group-limited selection of one token (fmoe.routers._deepseek) into q[0:k]: a group's
// score is the sum of its two largest choice values (torch.topk(2) and a sum of two), the
// topk_group best groups are kept (torch.topk(sorted=False): only which), every other expert's
// choice is -inf, and the k best of that row are taken as torch.topk(sorted=False) orders them.
void deepseek_row(const float* choice, int64_t E, int64_t k, int64_t n_group, int64_t topk_group,
                  std::vector<Elem>& q, std::vector<float>& masked) {
  const int64_t G = E / n_group;
  std::vector<float> group(n_group);
  for (int64_t g = 0; g < n_group; ++g) {
    top_k_row(choice + g * G, G, 2, q);
    const float two[2] = {static_cast<float>(q[0].first), static_cast<float>(q[1].first)};
    group[g] = torch_row_sum(two, 2, kSumScalar);
  }
  top_k_row(group.data(), n_group, topk_group, q, false);
  masked.assign(E, -INFINITY);
  for (int64_t i = 0; i < topk_group; ++i) {
    const int64_t g = q[i].second;
    std::copy(choice + g * G, choice + (g + 1) * G, masked.begin() + g * G);
  }
  top_k_row(masked.data(), E, k, q, false);
}

py::tuple route_rows(const at::Tensor& sel, const at::Tensor& logits, int64_t k, int64_t norm, int64_t order,
                     at::ScalarType out_dtype, bool by_token, int64_t cap_fixed, int64_t cap_limit, int64_t align,
                     bool frac, const at::Tensor& choice, int64_t n_group, int64_t topk_group, double scale,
                     const at::Tensor& loss_scores, int64_t loss_width) {
  TORCH_CHECK(sel.device().is_cpu() && logits.device().is_cpu(), "fmoe route_rows: CPU tensors only");
  TORCH_CHECK(sel.dim() == 2 && sel.is_contiguous() && logits.sizes() == sel.sizes() && logits.is_contiguous(),
              "fmoe route_rows: sel and logits must be contiguous [T, E] of one shape, got ", sel.sizes(), " and ",
              logits.sizes());
  const int64_t T = sel.size(0), E = sel.size(1);
  TORCH_CHECK(k >= 1 && k <= E && k <= 64, "fmoe route_rows: k must be in [1, min(E, 64)], got ", k, " for E=", E);
  TORCH_CHECK(norm == kRaw || norm == kScale
                  || (sel.scalar_type() == at::kFloat && (k < 8 || (order == kSumVector8 && k < 16))),
              "fmoe route_rows: normalised gates need float32 scores and k < 8 (or k < 16 with 8-float sums)");
  const auto st = sel.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
              "fmoe route_rows: sel must be float32, bfloat16 or float16, got ", st);
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "fmoe route_rows: out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  TORCH_CHECK(align >= 1, "fmoe route_rows: align must be >= 1, got ", align);
  const bool grouped = choice.defined() && choice.numel() > 0;
  TORCH_CHECK(!grouped || (choice.sizes() == sel.sizes() && choice.is_contiguous() && choice.scalar_type() == at::kFloat
                           && st == at::kFloat && n_group >= 1 && E % n_group == 0 && E / n_group >= 2
                           && topk_group >= 1 && topk_group <= n_group && k <= E / n_group * topk_group),
              "fmoe route_rows: a group-limited choice must be float32 [T, E] like sel, with n_group dividing E into "
              "groups of >= 2 and k <= E / n_group * topk_group");
  const bool loss = frac && loss_width > 0;
  TORCH_CHECK(!loss || (E >= 2 && loss_scores.sizes() == sel.sizes() && loss_scores.is_contiguous()
                        && loss_scores.scalar_type() == at::kFloat && loss_scores.device().is_cpu()),
              "fmoe route_rows: the loss's scores must be contiguous float32 [T, E] like sel, with E >= 2");
  const auto none = py::none();
  bool finite = true;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "route_rows_logits",
                                  [&] { finite = all_finite(logits.data_ptr<scalar_t>(), T * E); });
  if (!finite) return py::make_tuple(kNonFinite, none, none, none, none, none, none, none, none, none, none, 0, none);
  const at::ScalarType gate_dtype = out_dtype;
  at::Tensor ids = at::detail::empty_cpu({k, T}, at::kLong);
  at::Tensor gates = at::detail::empty_cpu(by_token ? std::vector<int64_t>{T, k} : std::vector<int64_t>{k, T},
                                           gate_dtype);
  at::Tensor slots = at::detail::empty_cpu({k, T}, at::kLong);
  at::Tensor counts = at::detail::empty_cpu({E}, at::kLong);
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* sl = slots.data_ptr<int64_t>();
  int64_t* cnt = counts.data_ptr<int64_t>();
  std::fill(cnt, cnt + E, 0);
  std::vector<Elem> q;
  q.reserve(E);
  std::vector<float> masked;
  float v[64];
  for (int64_t t = 0; t < T; ++t) {
    if (grouped) {   // selected on the choice, gated by the scores
      deepseek_row(choice.data_ptr<float>() + t * E, E, k, n_group, topk_group, q, masked);
      const float* score = sel.data_ptr<float>() + t * E;
      for (int64_t j = 0; j < k; ++j) v[j] = score[q[j].second];
    } else {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sel.scalar_type(), "route_rows_topk",
                                      [&] { top_k_row(sel.data_ptr<scalar_t>() + t * E, E, k, q); });
      for (int64_t j = 0; j < k; ++j) v[j] = static_cast<float>(q[j].first);
    }
    for (int64_t j = 0; j < k; ++j) id[j * T + t] = q[j].second;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_dtype, "route_rows_gates", [&] {
      write_gates(v, k, norm, order, static_cast<float>(scale), t, T, by_token, gates.data_ptr<scalar_t>());
    });
  }
  // slot-major slots (spec section 6): j outer, tokens inner, one counter per expert
  for (int64_t p = 0; p < k * T; ++p) sl[p] = cnt[id[p]]++;
  int64_t C = cap_fixed;
  if (C < 0) {
    C = E ? *std::max_element(cnt, cnt + E) : 0;
    if (cap_limit >= 0) {
      if (cap_limit == 0 && C > 0) {
        return py::make_tuple(kZeroCapacity, none, none, none, none, none, none, none, none, none, none, 0, none);
      }
      C = std::min(C, cap_limit);
    }
  }
  C = (C + align - 1) / align * align;
  at::Tensor offsets = at::detail::empty_cpu({E + 1}, at::kLong);
  int64_t* b = offsets.data_ptr<int64_t>();
  py::tuple bounds(E + 1);
  b[0] = 0;
  bounds[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    b[e + 1] = b[e] + std::min(cnt[e], C);
    bounds[e + 1] = b[e + 1];
  }
  const int64_t N = b[E];
  at::Tensor tokens = at::detail::empty_cpu({N}, at::kLong);
  at::Tensor pairs = at::detail::empty_cpu({N}, at::kLong);
  at::Tensor dropped = at::detail::empty_cpu({}, at::kLong);
  at::Tensor row_gates = by_token ? at::Tensor() : at::detail::empty_cpu({N}, gate_dtype);
  int64_t* tok = tokens.data_ptr<int64_t>();
  int64_t* pr = pairs.data_ptr<int64_t>();
  int64_t lost = 0;
  for (int64_t p = 0; p < k * T; ++p) {
    if (sl[p] >= C) {
      ++lost;
      continue;
    }
    const int64_t r = b[id[p]] + sl[p];
    pr[r] = p;
    tok[r] = p % T;
  }
  *dropped.data_ptr<int64_t>() = lost;
  if (!by_token) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_dtype, "route_rows_rows", [&] {
      const scalar_t* g = gates.data_ptr<scalar_t>();
      scalar_t* rg = row_gates.data_ptr<scalar_t>();
      for (int64_t r = 0; r < N; ++r) rg[r] = g[pr[r]];
    });
  }
  // frac: numpy's bincount / T in float32, as fmoe.losses computes it (exact counts, one division);
  // with loss_width, the GShard loss made from it (torch_gshard_loss) in its place
  py::object share = none;
  if (frac) {
    at::Tensor fraction = at::detail::empty_cpu({E}, at::kFloat);
    float* f = fraction.data_ptr<float>();
    std::fill(f, f + E, 0.0f);
    for (int64_t t = 0; t < T; ++t) f[id[t]] += 1.0f;
    for (int64_t e = 0; e < E; ++e) f[e] = f[e] / static_cast<float>(T);
    if (loss) {
      std::vector<float> buf(E);
      at::Tensor l = at::detail::empty_cpu({}, at::kFloat);
      *l.data_ptr<float>() = torch_gshard_loss(loss_scores.data_ptr<float>(), f, T, E, loss_width, buf.data());
      share = py::cast(l);
    } else {
      share = py::cast(fraction);
    }
  }
  return py::make_tuple(0, ids, gates, slots, counts, tokens, pairs, offsets, dropped,
                        by_token ? py::object(none) : py::cast(row_gates), bounds, C, share);
}

// A Python object of class cls with the given attributes in its __dict__ and no __init__ run (as
// object.__new__(cls) and __dict__.update in Python: fmoe.routing._trusted_routing's way of building a
// value that is right by construction).
py::object bare_object(py::handle cls, std::initializer_list<std::pair<const char*, py::object>> fields) {
  static const py::tuple no_args;
  PyObject* o = PyBaseObject_Type.tp_new(reinterpret_cast<PyTypeObject*>(cls.ptr()), no_args.ptr(), nullptr);
  if (o == nullptr) throw py::error_already_set();
  py::object obj = py::reinterpret_steal<py::object>(o);
  py::dict d = obj.attr("__dict__");
  for (const auto& f : fields) d[f.first] = f.second;
  return obj;
}

// route_rows of a linear gate ('top', fmoe.routers.linear_gate with x and wg of one dtype): logits =
// at::linear(x, wg) (linear_gate's x @ wg.t(): the same mm), scores = softmax(logits, -1) or sigmoid,
// the gates in the scores' dtype, the loss of the scores; the same aten ops the Python path dispatches,
// from here (one call from Python instead of three: a decode call's host work). types: the classes
// (Routing, KeptRows, RouterOutput), built here with fields route_rows made (no __init__ runs).
// Returns fmoe.routers.route_native's (routing, router output, frac or loss, rows); or, where route_rows
// fails or the capacity passes bound, (status: route_rows' or 3 for the bound, the largest load or 1,
// logits) for route_native to raise the torch path's error from.
py::tuple route_gate(const at::Tensor& x, const at::Tensor& wg, bool sigmoid, int64_t k, int64_t norm, int64_t order,
                     int64_t cap_fixed, int64_t cap_limit, int64_t align, bool frac, int64_t loss_width, int64_t bound,
                     const py::tuple& types) {
  TORCH_CHECK(types.size() == 3, "fmoe route_gate: types must be (Routing, KeptRows, RouterOutput)");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && wg.dim() == 2 && wg.scalar_type() == x.scalar_type()
                  && wg.size(1) == x.size(1),
              "fmoe route_gate: x [T, M] and wg [E, M] must be CPU tensors of one dtype, got ", x.sizes(), " and ",
              wg.sizes());
  at::Tensor logits = at::linear(x, wg);
  at::Tensor scores = sigmoid ? at::sigmoid(logits) : at::softmax(logits, -1);
  py::tuple r = route_rows(scores, logits, k, norm, order, scores.scalar_type(), false, cap_fixed, cap_limit, align,
                           frac, at::Tensor(), 1, 1, 1.0, scores, loss_width);
  const int64_t status = r[0].cast<int64_t>(), C = r[11].cast<int64_t>();
  if (status != 0 || C > bound) {
    int64_t load = 1;
    if (status == 0) {
      const at::Tensor counts = r[4].cast<at::Tensor>();
      const int64_t* c = counts.data_ptr<int64_t>();
      load = counts.numel() ? *std::max_element(c, c + counts.numel()) : 0;
    }
    return py::make_tuple(status != 0 ? status : 3, load, logits);
  }
  const auto none = py::none();
  py::object ids = r[1], gates = r[2];
  py::object routing = bare_object(types[0], {{"expert_ids", ids}, {"slots", r[3]}, {"weights", gates},
                                              {"counts", r[4]}, {"capacity", r[11]}, {"num_experts", py::int_(wg.size(0))}});
  py::object rows = bare_object(types[1], {{"tokens", r[5]}, {"pairs", r[6]}, {"bounds", r[10]}, {"dropped", r[8]},
                                           {"offsets", r[7]}, {"row_gates", r[9]}});
  py::object lg = py::cast(logits);
  py::object out = bare_object(types[2], {{"expert_ids", ids}, {"weights", gates}, {"logits", lg},
                                          {"scores", py::cast(scores)}, {"noisy_logits", lg}, {"importance", none},
                                          {"slots", none}, {"tokens", none}, {"capacity", none},
                                          {"type", py::str("top")}});
  return py::make_tuple(routing, out, r[12], rows);
}

// gshard_loss's torch ops on float32 scores [T, E] and fraction [E] in W's orders (torch_gshard_loss):
// a 0-dim float32 tensor. For fmoe/_slots.py loss_width's check against torch and for the tests.
at::Tensor gshard_loss(const at::Tensor& scores, const at::Tensor& fraction, int64_t width) {
  TORCH_CHECK(scores.device().is_cpu() && scores.dim() == 2 && scores.is_contiguous()
                  && scores.scalar_type() == at::kFloat && scores.size(1) >= 2,
              "fmoe gshard_loss: scores must be contiguous float32 [T, E] on the CPU with E >= 2, got ", scores.sizes());
  TORCH_CHECK(fraction.device().is_cpu() && fraction.dim() == 1 && fraction.is_contiguous()
                  && fraction.scalar_type() == at::kFloat && fraction.size(0) == scores.size(1),
              "fmoe gshard_loss: fraction must be contiguous float32 [E] on the CPU");
  TORCH_CHECK(width >= 1, "fmoe gshard_loss: width must be >= 1, got ", width);
  const int64_t T = scores.size(0), E = scores.size(1);
  std::vector<float> buf(E);
  at::Tensor l = at::detail::empty_cpu({}, at::kFloat);
  *l.data_ptr<float>() = torch_gshard_loss(scores.data_ptr<float>(), fraction.data_ptr<float>(), T, E, width,
                                           buf.data());
  return l;
}

// The loss's two reductions alone, for loss_width's check: s.mean(0) of float32 [T, E] and v.sum() of
// float32 [n], in W's orders.
at::Tensor mean0(const at::Tensor& s, int64_t width) {
  TORCH_CHECK(s.device().is_cpu() && s.dim() == 2 && s.is_contiguous() && s.scalar_type() == at::kFloat
                  && s.size(1) >= 2 && width >= 1,
              "fmoe mean0: s must be contiguous float32 [T, E] on the CPU with E >= 2, width >= 1");
  at::Tensor m = at::detail::empty_cpu({s.size(1)}, at::kFloat);
  torch_mean0(s.data_ptr<float>(), s.size(0), s.size(1), width, m.data_ptr<float>());
  return m;
}

at::Tensor vector_sum(const at::Tensor& v, int64_t width) {
  TORCH_CHECK(v.device().is_cpu() && v.dim() == 1 && v.is_contiguous() && v.scalar_type() == at::kFloat
                  && width >= 1,
              "fmoe vector_sum: v must be contiguous float32 [n] on the CPU, width >= 1");
  at::Tensor r = at::detail::empty_cpu({}, at::kFloat);
  *r.data_ptr<float>() = torch_vector_sum(v.data_ptr<float>(), v.size(0), width);
  return r;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fmoe's routing walks (see fmoe/_slots.py for the API and semantics)";
  m.def("assign_slots", &assign_slots, "(slots, counts, status) of the slot-major counter walk", py::arg("ids"),
        py::arg("order"), py::arg("num_experts"), py::call_guard<py::gil_scoped_release>());
  m.def("kept_rows", &kept_rows, "the kept pairs sorted by (expert, slot) into out and pairs; N or an error code",
        py::arg("ids"), py::arg("slots"), py::arg("counts"), py::arg("capacity"), py::arg("out"), py::arg("pairs"),
        py::call_guard<py::gil_scoped_release>());
  m.def("route_rows", &route_rows, "a small call's routing and kept rows from its scores (see route_rows above)",
        py::arg("sel"), py::arg("logits"), py::arg("k"), py::arg("norm"), py::arg("order"), py::arg("out_dtype"),
        py::arg("by_token"), py::arg("cap_fixed"), py::arg("cap_limit"), py::arg("align"), py::arg("frac"),
        py::arg("choice"), py::arg("n_group"), py::arg("topk_group"), py::arg("scale"), py::arg("loss_scores"),
        py::arg("loss_width"));
  m.def("route_gate", &route_gate, "route_rows of a linear gate's softmax or sigmoid scores (see above)",
        py::arg("x"), py::arg("wg"), py::arg("sigmoid"), py::arg("k"), py::arg("norm"), py::arg("order"),
        py::arg("cap_fixed"), py::arg("cap_limit"), py::arg("align"), py::arg("frac"), py::arg("loss_width"),
        py::arg("bound"), py::arg("types"));
  m.def("gshard_loss", &gshard_loss, "gshard_loss's torch ops in the orders of vector width W (see above)",
        py::arg("scores"), py::arg("fraction"), py::arg("width"), py::call_guard<py::gil_scoped_release>());
  m.def("mean0", &mean0, "s.mean(0) in the orders of vector width W", py::arg("s"), py::arg("width"),
        py::call_guard<py::gil_scoped_release>());
  m.def("vector_sum", &vector_sum, "v.sum() in the orders of vector width W", py::arg("v"), py::arg("width"),
        py::call_guard<py::gil_scoped_release>());
}
