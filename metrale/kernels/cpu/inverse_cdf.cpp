// One token per row drawn from its tempered logits by the inverse CDF, in one op
// (runner/inverse_cdf.py: `tempered_weights` then `inverse_cdf_torch`, whose tokens it returns):
// per row, three passes over the float32 logits (their maximum over the temperature, the
// fixed-point total of exp(l - max l), then the running sum up to the draw's target), where
// torch's formula writes four row-sized tensors and converts each weight to int64 in a pass
// of its own. The exponential is at::vec's, as torch's own exp on this CPU, so the weights,
// their int64 sums and the token are the formula's. Rows split across torch's threads.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "task_claims.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

using Vec = at::vec::Vectorized<float>;

constexpr float kScale = 1099511627776.0f;  // 2**40, runner/inverse_cdf.py's PROB_SCALE

// Calls f(offset, count, scaled) over a row's logits over t, a vector at a time (the last one
// partial, as torch's own loops take a row's tail).
template <typename F>
inline void for_scaled(const float* x, int64_t n, float t, F&& f) {
  const Vec vt(t);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - j);
    f(j, count, Vec::loadu(x + j, count) / vt);
  }
}

// The fixed-point weights of `count` tokens whose scaled logits are `scaled`, into `out`.
inline void fixed_point(const Vec& scaled, float row_max, int64_t count, int64_t* out) {
  alignas(64) float w[Vec::size()];
  ((scaled - Vec(row_max)).exp() * Vec(kScale)).store(w);
  for (int64_t k = 0; k < count; ++k) out[k] = static_cast<int64_t>(w[k]);
}

int64_t draw_row(const float* x, int64_t n, float t, double draw) {
  float row_max = -std::numeric_limits<float>::infinity();
  for_scaled(x, n, t, [&](int64_t, int64_t count, const Vec& scaled) {
    alignas(64) float s[Vec::size()];
    scaled.store(s);
    for (int64_t k = 0; k < count; ++k) row_max = std::max(row_max, s[k]);
  });
  int64_t total = 0;
  int64_t q[Vec::size()];
  for_scaled(x, n, t, [&](int64_t, int64_t count, const Vec& scaled) {
    fixed_point(scaled, row_max, count, q);
    for (int64_t k = 0; k < count; ++k) total += q[k];
  });
  const int64_t target =
      std::min(static_cast<int64_t>(draw * static_cast<double>(total)), total - 1);
  // The number of tokens whose running sum is at most the target: the first token past it.
  int64_t running = 0, below = 0;
  bool found = false;
  for_scaled(x, n, t, [&](int64_t, int64_t count, const Vec& scaled) {
    if (found) return;
    fixed_point(scaled, row_max, count, q);
    for (int64_t k = 0; k < count; ++k) {
      running += q[k];
      if (running > target) {
        found = true;
        return;
      }
      ++below;
    }
  });
  return std::min(below, n - 1);
}

at::Tensor tempered_inverse_cdf(const at::Tensor& logits, const at::Tensor& temperature,
                                const at::Tensor& draws) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits must be float32 [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows &&
                  temperature.scalar_type() == at::kFloat,
              "temperature must be float32 [rows]");
  TORCH_CHECK(draws.dim() == 1 && draws.size(0) == rows && draws.scalar_type() == at::kDouble,
              "draws must be float64 [rows]");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  auto t = temperature.accessor<float, 1>();
  auto d = draws.accessor<double, 1>();
  int64_t* ids = out.data_ptr<int64_t>();
  metrale_cpu::parallel_for_claimed(rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) ids[r] = draw_row(x + r * stride, n, t[r], d[r]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def("tempered_inverse_cdf(Tensor logits, Tensor temperature, Tensor draws) -> Tensor");
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) { m.impl("tempered_inverse_cdf", &tempered_inverse_cdf); }
