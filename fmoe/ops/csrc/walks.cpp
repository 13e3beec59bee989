// The two integer walks of a routing that run on every CPU call, decode included: slot
// assignment (fmoe.routing.assign_slots) and its inverse, the kept pairs listed by expert and
// slot (fmoe.engine.plan.make_plan's rows). Built as their own small extension (fmoe_walks) so
// that inference never needs numba's LLVM in the process; fmoe/_slots_numba.py holds the numba
// twins, the fallback where this is not built. Both are serial running counts, O(k*T), and
// integer-exact: equal to the twins and to the pure-torch references by construction.
//
// The Python front (fmoe/_slots.py) converts the arguments (int64, contiguous, CPU) and turns
// the status codes into errors; the checks here are the backstop that keeps a caller who skips
// it from reading or writing outside a buffer.
#include <torch/extension.h>

#include <cstdint>
#include <tuple>
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fmoe's routing walks (see fmoe/_slots.py for the API and semantics)";
  m.def("assign_slots", &assign_slots, "(slots, counts, status) of the slot-major counter walk", py::arg("ids"),
        py::arg("order"), py::arg("num_experts"), py::call_guard<py::gil_scoped_release>());
  m.def("kept_rows", &kept_rows, "the kept pairs sorted by (expert, slot) into out and pairs; N or an error code",
        py::arg("ids"), py::arg("slots"), py::arg("counts"), py::arg("capacity"), py::arg("out"), py::arg("pairs"),
        py::call_guard<py::gil_scoped_release>());
}
