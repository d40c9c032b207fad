// Decode attention over the paged KV cache on a CPU (kernels/cpu_extension.py builds this): each
// query row is one decode that sees the first seq_lens[i] slots of its block table (the last
// `window` of them with a sliding window), its keys and values read in place from the pool, one
// pass, online softmax. The cache and q hold float32, bfloat16 or float16; 16-bit values are
// widened to float32 as they are loaded, and every sum is float32. Rows split across torch's
// threads.
#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "paged_cache.h"
#include "task_claims.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using metrale_cpu::Vec;
using metrale_cpu::widen;

constexpr int64_t kLanes = 16;
// exp(x) for x <= 0, 0 below -80: past that a weight is under 2e-35 of the largest (nothing to a
// float32 sum), and exp's results would soon be denormal floats, which x86 cores compute with
// at a fraction of the speed of normal ones.
inline float weight_of(float x) { return x < -80.f ? 0.f : std::exp(x); }

// The lanes' sum, by shuffles.
inline float sum_of(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& x, const Vec& y) { return x + y; }, v);
}

// a . b over d values (d a multiple of kLanes): one SIMD partial sum, reduced by shuffles. A
// scalar sum of the partial's lanes is a chain of 16 dependent adds, and at 1,500 dot products a
// row and layer that chain was most of the kernel's time.
template <typename T>
inline float dot(const float* a, const T* b, int64_t d) {
  Vec sum = Vec::loadu(a) * widen(b);
  for (int64_t j = Vec::size(); j < d; j += Vec::size()) {
    sum = at::vec::fmadd(Vec::loadu(a + j), widen(b + j), sum);
  }
  return sum_of(sum);
}

// w[0, n) = weight_of(w - m), SIMD-wide, returned with their sum.
inline float weigh(float* w, int64_t n, float m) {
  const Vec shift(m), cutoff(-80.f), zero(0.f);
  Vec sum(0.f);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t count = std::min<int64_t>(Vec::size(), n - j);
    const Vec x = Vec::loadu(w + j, count) - shift;
    const Vec e = Vec::blendv(x.exp(), zero, x < cutoff);
    e.store(w + j, count);
    sum += count == Vec::size() ? e : Vec::set(zero, e, count);
  }
  return sum_of(sum);
}

// acc[0, d) = c * acc + sum over t of w[t] * v_t, v_t = v + t * stride: each SIMD slice of the
// accumulator stays in a register across the slots.
template <typename T>
inline void accumulate(float* acc, float c, const float* w, const T* v, int64_t n, int64_t stride,
                       int64_t d) {
  for (int64_t j = 0; j < d; j += Vec::size()) {
    Vec a = Vec::loadu(acc + j) * Vec(c);
    for (int64_t t = 0; t < n; ++t) {
      a = at::vec::fmadd(Vec(w[t]), widen(v + t * stride + j), a);
    }
    a.store(acc + j);
  }
}

// Asks for the cache lines of p[0, n) ahead of their use, into L2 (prefetcht1), not L1: the
// block being read (32 KB of keys and values in float32) and the next one fill a 48-64 KB L1,
// so the next block's lines asked into L1 evicted this block's before their use (a cold pool
// read at 355 us a layer against 224 into L2, the bandwidth's floor 197-214:
// bench/cpu_decode_attention.py).
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  for (int64_t j = 0; j < n * static_cast<int64_t>(sizeof(T)); j += 64) {
    __builtin_prefetch(bytes + j, 0, 1);
  }
}

template <typename T>
void attend_rows(const at::Tensor& qc, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& tables, const int64_t* len, float s, int64_t window,
                 at::Tensor& out) {
  const int64_t rows = qc.size(0), heads = qc.size(1), d = qc.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t row_stride = tables.stride(0), num_blocks = k_cache.size(0);
  const int64_t group = heads / kv_heads;
  const T* qp = qc.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t slot_stride = kv_heads * d;  // values from one slot to the next
  const int64_t block_values = block_size * slot_stride;  // and from one block to the next
  // A task is a row. Each of its blocks is read front to back, keys then values (a slot's heads
  // lie side by side): the order the memory's prefetchers follow. Reading one KV head at a time
  // strode through the blocks and took 2x the gather + SDPA's time in a real step. The blocks lie
  // wherever the pool had room, which no prefetcher guesses, so the next block's keys and values
  // (the row's next block, or the next row's first) are asked for while this block's are read,
  // a slot's worth with each slot: asked for all at once as a block began (32 KB in float32),
  // most requests found the core's miss buffers full and the kernel read a cold pool at ~19
  // GB/s, 3x its time over a warm one; spread, 1.35x it (bench/cpu_step_ab.py: 16-row steps
  // 1.15-1.39x faster).
  // The first slot row i sees: the last `window` of its slots with a sliding window.
  const auto first_slot = [&](int64_t i) {
    return window > 0 ? std::max<int64_t>(0, len[i] - window) : int64_t{0};
  };
  metrale_cpu::parallel_claims(rows, 1, [&](metrale_cpu::TaskClaims& claims) {
    std::vector<float> acc(heads * d), weight(heads * block_size), best(heads), total(heads),
        query(heads * d);
    int64_t begin = 0, end = 0;
    while (claims.next(begin, end)) {
      for (int64_t i = begin; i < end; ++i) {
        for (int64_t j = 0; j < heads * d; ++j) {
          query[j] = static_cast<float>(qp[i * heads * d + j]);
        }
        const float* qi = query.data();
        const int64_t stop = len[i];
        const int64_t start = first_slot(i);
        std::fill(acc.begin(), acc.end(), 0.f);
        std::fill(best.begin(), best.end(), -std::numeric_limits<float>::infinity());
        std::fill(total.begin(), total.end(), 0.f);
        for (int64_t b = start / block_size; b * block_size < stop; ++b) {
          const int64_t block = bt[i * row_stride + b];
          TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is not in the pool");
          const int64_t lo = std::max(start, b * block_size) - b * block_size;
          const int64_t hi = std::min(stop, (b + 1) * block_size) - b * block_size;
          const T* kb = kp + block * block_values;
          const T* vb = vp + block * block_values;
          // The block after this one: this row's next, else the next row's first.
          const T* next_k = nullptr;
          const T* next_v = nullptr;
          {
            int64_t next = -1;
            if ((b + 1) * block_size < stop) {
              next = bt[i * row_stride + b + 1];
            } else if (i + 1 < end) {
              next = bt[(i + 1) * row_stride + first_slot(i + 1) / block_size];
            }
            if (next >= 0 && next < num_blocks) {  // checked again when it is read
              next_k = kp + next * block_values;
              next_v = vp + next * block_values;
            }
          }
          for (int64_t t = lo; t < hi; ++t) {
            if (next_k != nullptr) {  // a slot's worth of the next block a slot: spread, not burst
              prefetch(next_k + t * slot_stride, slot_stride);
              prefetch(next_v + t * slot_stride, slot_stride);
            }
            for (int64_t head = 0; head < heads; ++head) {
              const T* k = kb + t * slot_stride + (head / group) * d;
              weight[head * block_size + t] = s * dot(qi + head * d, k, d);
            }
          }
          if (next_k != nullptr) {  // the next block's slots this one has not (a partial block)
            prefetch(next_k, lo * slot_stride);
            prefetch(next_v, lo * slot_stride);
            prefetch(next_k + hi * slot_stride, (block_size - hi) * slot_stride);
            prefetch(next_v + hi * slot_stride, (block_size - hi) * slot_stride);
          }
          // Per head: the block's new maximum, its slots' weights, and what came before rescaled
          // to that maximum as the block's values are added.
          for (int64_t head = 0; head < heads; ++head) {
            float* w = weight.data() + head * block_size + lo;
            const float m = std::max(best[head], *std::max_element(w, w + (hi - lo)));
            const float c = weight_of(best[head] - m);
            total[head] = total[head] * c + weigh(w, hi - lo, m);
            best[head] = m;
            accumulate(acc.data() + head * d, c, w, vb + lo * slot_stride + (head / group) * d,
                       hi - lo, slot_stride, d);
          }
        }
        for (int64_t head = 0; head < heads; ++head) {
          T* o = op + (i * heads + head) * d;
          const float inv = 1.f / total[head];
          for (int64_t j = 0; j < d; ++j) o[j] = static_cast<T>(acc[head * d + j] * inv);
        }
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window) {
  metrale_cpu::check_paged_caches(q, k_cache, v_cache, kLanes);
  const auto dtype = k_cache.scalar_type();
  const int64_t rows = q.size(0), block_size = k_cache.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == rows &&
                  block_tables.scalar_type() == at::kLong,
              "block_tables must be int64 [rows, max_blocks]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == rows && seq_lens.scalar_type() == at::kLong,
              "seq_lens must be int64 [rows]");
  const at::Tensor qc = q.contiguous();
  // Rows of a wider table (a slice of the runner's buffer) are read where they lie.
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  const int64_t max_blocks = tables.size(1);
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows; ++i) {
    TORCH_CHECK(len[i] >= 1 && len[i] <= max_blocks * block_size, "row ", i, " sees ", len[i],
                " slots, its block table holds ", max_blocks * block_size);
  }
  at::Tensor out = at::empty_like(qc);
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    attend_rows<float>(qc, k_cache, v_cache, tables, len, s, window, out);
  } else if (dtype == at::kBFloat16) {
    attend_rows<at::BFloat16>(qc, k_cache, v_cache, tables, len, s, window, out);
  } else {
    attend_rows<at::Half>(qc, k_cache, v_cache, tables, len, s, window, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
