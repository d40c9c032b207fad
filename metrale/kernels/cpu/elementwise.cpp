// The small operators around a CPU step's products, each one pass over its rows in float32 where
// eager torch takes two to five (kernels/cpu_extension.py builds this): SiLU-and-mul, the
// residual add with RMSNorm, and the rotary embedding of q and k in place. Eager steps call
// them (prompt chunks chiefly: a 16 x 128-token prefill of peers.md's 33.6M Llama spends ~50 ms
// in these operators), compiled decode steps all but the rotary (cpu_extension.takes). Rows
// claimed in runs by torch's threads (task_claims.h); at::vec's SIMD width is the one
// cpu_extension.py compiles for.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "task_claims.h"

#include <cmath>
#include <tuple>

namespace {

using Vec = at::vec::Vectorized<float>;

// Rows per task: enough work that a task outweighs the fork (a row is a few hundred values).
constexpr int64_t kGrain = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1, name,
              " must be float32 [rows, features] with contiguous rows");
}

// gate_up [T, 2I] -> silu(gate) * up [T, I], silu(x) = x / (1 + exp(-x)) as torch computes it.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up has an odd number of features");
  at::Tensor out = at::empty({rows, n}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  metrale_cpu::parallel_for_claimed(rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* gate = in + t * stride;
      const float* up = gate + n;
      float* y = op + t * n;
      int64_t j = 0;
      for (; j + Vec::size() <= n; j += Vec::size()) {
        const Vec x = Vec::loadu(gate + j);
        (x / (Vec(1.f) + x.neg().exp()) * Vec::loadu(up + j)).store(y + j);
      }
      for (; j < n; ++j) y[j] = gate[j] / (1.f + std::exp(-gate[j])) * up[j];
    }
  });
  return out;
}

// out = weight * norm(s), norm(s) = s / sqrt(mean(s^2) + eps), over rows s = x + residual
// (stored to `sum`) or, without a residual, s = x.
void rms_norm_rows(const at::Tensor& x, const at::Tensor* residual, at::Tensor* sum,
                   const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == at::kFloat &&
                  weight.is_contiguous(),
              "weight must be float32 [features], contiguous");
  if (residual != nullptr) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must be x's shape");
  }
  const float* xp = x.data_ptr<float>();
  const float* rp = residual != nullptr ? residual->data_ptr<float>() : nullptr;
  float* sp = sum != nullptr ? sum->data_ptr<float>() : nullptr;
  const int64_t x_stride = x.stride(0), r_stride = residual != nullptr ? residual->stride(0) : 0;
  float* op = out.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  metrale_cpu::parallel_for_claimed(rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* s = xp + t * x_stride;
      Vec squares(0.f);
      float tail = 0.f;  // the squares past the last whole vector
      int64_t j = 0;
      if (rp != nullptr) {  // s = x + residual, stored as the next residual
        const float* xi = s;
        const float* ri = rp + t * r_stride;
        float* si = sp + t * n;
        for (; j + Vec::size() <= n; j += Vec::size()) {
          const Vec v = Vec::loadu(xi + j) + Vec::loadu(ri + j);
          v.store(si + j);
          squares = at::vec::fmadd(v, v, squares);
        }
        for (; j < n; ++j) {
          si[j] = xi[j] + ri[j];
          tail += si[j] * si[j];
        }
        s = si;
      } else {
        for (; j + Vec::size() <= n; j += Vec::size()) {
          const Vec v = Vec::loadu(s + j);
          squares = at::vec::fmadd(v, v, squares);
        }
        for (; j < n; ++j) tail += s[j] * s[j];
      }
      float lanes[Vec::size()];
      squares.store(lanes);
      float total = tail;
      for (int64_t u = 0; u < Vec::size(); ++u) total += lanes[u];
      const float inv = 1.f / std::sqrt(total / static_cast<float>(n) + static_cast<float>(eps));
      float* o = op + t * n;
      j = 0;
      for (; j + Vec::size() <= n; j += Vec::size()) {
        (Vec::loadu(w + j) * (Vec::loadu(s + j) * Vec(inv))).store(o + j);
      }
      for (; j < n; ++j) o[j] = w[j] * (s[j] * inv);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_rows(x, nullptr, nullptr, weight, eps, out);
  return out;
}

// (weight * norm(x + residual), x + residual): the sum is the next layer's residual.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor sum = at::empty({x.size(0), x.size(1)}, x.options());
  rms_norm_rows(x, &residual, &sum, weight, eps, out);
  return {out, sum};
}

// x [T, heads, D] (rows of any stride, heads contiguous) rotated in place to its row's position
// (the "rotate half" layout): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, over halves of D.
void rotate(const at::Tensor& x, const float* cos, const float* sin, const int64_t* pos,
            int64_t cache_stride) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 &&
                  x.stride(1) == x.size(2),
              "q and k must be float32 [tokens, heads, head_dim], each row's heads contiguous");
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  float* xp = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  metrale_cpu::parallel_for_claimed(rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + pos[t] * cache_stride;
      const float* s = sin + pos[t] * cache_stride;
      for (int64_t h = 0; h < heads; ++h) {
        float* a = xp + t * stride + h * d;
        float* b = a + half;
        int64_t j = 0;
        for (; j + Vec::size() <= half; j += Vec::size()) {
          const Vec x1 = Vec::loadu(a + j), x2 = Vec::loadu(b + j);
          (x1 * Vec::loadu(c + j) - x2 * Vec::loadu(s + j)).store(a + j);
          (x2 * Vec::loadu(c + half + j) + x1 * Vec::loadu(s + half + j)).store(b + j);
        }
        for (; j < half; ++j) {
          const float x1 = a[j], x2 = b[j];
          a[j] = x1 * c[j] - x2 * s[j];
          b[j] = x2 * c[half + j] + x1 * s[half + j];
        }
      }
    }
  });
}

// q and k rotated in place to `positions`; cos and sin [max_positions, head_dim] float32.
void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos_cache,
             const at::Tensor& sin_cache, const at::Tensor& positions) {
  TORCH_CHECK(cos_cache.dim() == 2 && cos_cache.scalar_type() == at::kFloat &&
                  cos_cache.is_contiguous() && sin_cache.sizes() == cos_cache.sizes() &&
                  sin_cache.scalar_type() == at::kFloat && sin_cache.is_contiguous(),
              "cos and sin must be float32 [max_positions, head_dim], contiguous");
  TORCH_CHECK(q.size(2) == cos_cache.size(1) && k.size(2) == cos_cache.size(1),
              "q, k and the tables must have one head_dim");
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong &&
                  positions.size(0) == q.size(0) && k.size(0) == q.size(0),
              "positions must be int64 [tokens], a row of q and k each");
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_cache.size(0);
  for (int64_t t = 0; t < pos.size(0); ++t) {
    TORCH_CHECK(pp[t] >= 0 && pp[t] < max_pos, "position ", pp[t], " is past the tables");
  }
  const float* c = cos_cache.data_ptr<float>();
  const float* s = sin_cache.data_ptr<float>();
  rotate(q, c, s, pp, cos_cache.size(1));
  rotate(k, c, s, pp, cos_cache.size(1));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos_cache, Tensor sin_cache, "
      "Tensor positions) -> ()");
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
}
