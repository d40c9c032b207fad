// What the CPU attention kernels share about the paged KV pool they read in place: its checks,
// and its values (or q's) loaded as float32 SIMD vectors whatever the pool's dtype.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

namespace metrale_cpu {

using Vec = at::vec::Vectorized<float>;

// Vec::size() values of a cache or q, as float32.
template <typename T>
inline Vec widen(const T* p) {
  Vec v;
  at::vec::load_to_float<T>(p, v);
  return v;
}
template <>
inline Vec widen<float>(const float* p) {
  return Vec::loadu(p);
}

// The caches [blocks, block_size, kv_heads, D] of one dtype (float32, bfloat16 or float16),
// contiguous, and q [rows, heads, D] of that dtype whose heads divide over the caches' and
// whose D is a multiple of `lanes`.
inline void check_paged_caches(const at::Tensor& q, const at::Tensor& k_cache,
                               const at::Tensor& v_cache, int64_t lanes) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "the caches must hold float32, bfloat16 or float16");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == dtype,
              "q must be [rows, heads, D] of the caches' dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == dtype && v_cache.is_contiguous(),
              "the caches must be [blocks, block_size, kv_heads, D] of one dtype, contiguous");
  const int64_t d = q.size(2), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d % lanes == 0, "head size ", d, " (a multiple of ", lanes,
              ", the caches' too)");
  TORCH_CHECK(q.size(1) % kv_heads == 0, q.size(1), " query heads over ", kv_heads, " KV heads");
}

}  // namespace metrale_cpu
