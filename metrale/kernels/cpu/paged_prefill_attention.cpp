// Prompt chunks attending over the paged KV cache on a CPU (kernels/cpu_extension.py builds this):
// each sequence's query tokens see the slots of its block table up to their own position (the last
// `window` of them with a sliding window), the chunk's own keys already stored there, read in place
// from the pool. One call covers every prompt chunk of a step.
//
// A task is one KV head's query rows of a few consecutive tokens: `L` rows (L the SIMD lanes, 16
// with AVX-512), each row a (token, query head of the group) pair, tokens outermost. Its queries
// are held transposed, qt[d] the L rows' d-th values, so every step of the online softmax works on
// all L rows at once: a key's scores are one vector (sum over d of k[d] * qt[d], the key's values
// broadcast), the rows' maxima, weights and sums are vector operations, and so is the values'
// product, ot[d] += sum over keys of w_key * v_key[d], the accumulator kept transposed the same
// way. Each multiply-add is useful work (no horizontal sums; the one transposition of a task is
// its queries', in, and its output's, out), where torch's SDPA over a gathered copy ran at ~40
// GFLOP/s on 256-token chunks of peers.md's 33.6M Llama. The cache and q hold float32, bfloat16 or
// float16; every sum is float32.
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
constexpr int64_t L = Vec::size();
constexpr int64_t R = 2 * L;  // a task's rows: two vectors

// v held in a register: without this the compiler reloads a vector that several multiply-adds
// share as each one's memory operand (cheap where a core loads two full vectors a cycle; Zen 4
// loads one, and the loops below ran at half their multiply-add rate).
inline Vec in_register(Vec v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 x = v;
  __asm__("" : "+v"(x));
  return Vec(x);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 x = v;
  __asm__("" : "+v"(x));
  return Vec(x);
#else
  return v;
#endif
}

// acc[2i] += x[i] * a and acc[2i + 1] += x[i] * b, i < 4: two vectors of rows by four values
// (four keys' values at one d for the scores; one key's values at four d for the output), each
// value broadcast once and each vector used four times.
inline void multiply_add_2x4(Vec (&acc)[8], const Vec& a, const Vec& b, const float (&x)[4]) {
  for (int64_t i = 0; i < 4; ++i) {
    const Vec xi(x[i]);
    acc[2 * i] = at::vec::fmadd(xi, a, acc[2 * i]);
    acc[2 * i + 1] = at::vec::fmadd(xi, b, acc[2 * i + 1]);
  }
}

// The sequences' layout in the step: rows of q, positions, block tables.
struct Chunks {
  const int64_t* starts;     // [seqs] first row of q
  const int64_t* lens;       // [seqs] query tokens
  const int64_t* positions;  // [seqs] position of the first query token
  const int64_t* tables;     // [seqs, row_stride] block ids
  int64_t row_stride;
};

// A task: sequence `seq`, KV head `kv`, its rows [first_row, first_row + L) of the
// tokens x group rows (token-major) of that sequence.
struct Task {
  int64_t seq, kv, first_row;
};

// Keys of one block as float32 [n, D] rows (16-bit caches widened once a block and task; float32
// read where they lie).
template <typename T>
inline const float* as_float(const T* src, int64_t n, int64_t stride, int64_t d, float* buffer) {
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < d; j += L) widen(src + t * stride + j).store(buffer + t * d + j);
  }
  return buffer;
}
template <>
inline const float* as_float<float>(const float* src, int64_t, int64_t, int64_t, float*) {
  return src;
}

template <typename T>
void attend_chunks(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const Chunks& chunks, const std::vector<Task>& tasks, float scale,
                   int64_t window, at::Tensor& out) {
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t num_blocks = k_cache.size(0), group = heads / kv_heads;
  const int64_t slot_stride = kv_heads * d, block_values = block_size * slot_stride;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), o_row = out.stride(0);
  // With T = float the keys' and values' rows are read from the pool (stride slot_stride);
  // widened, from the buffers (stride d).
  const int64_t kv_stride = std::is_same_v<T, float> ? slot_stride : d;
  const float neg_inf = -std::numeric_limits<float>::infinity();

  metrale_cpu::parallel_claims(static_cast<int64_t>(tasks.size()), 1,
                               [&](metrale_cpu::TaskClaims& claims) {
    std::vector<float> qt(d * R), ot(d * R), staged(R * d), keys, values;
    std::vector<float> weights((block_size + 3) * R);  // a block's scores, and 3 keys' spare
    if (!std::is_same_v<T, float>) {
      keys.resize(block_size * d);
      values.resize(block_size * d);
    }
    float row_pos[R];
    int64_t begin = 0, end = 0;
    while (claims.next(begin, end)) {
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        const int64_t seq = task.seq;
        const int64_t rows = chunks.lens[seq] * group;
        const int64_t count = std::min(R, rows - task.first_row);
        const int64_t first_pos = chunks.positions[seq];
        // Rows in, scaled, into `staged` [R, D], then transposed; a padding row (zeros) sits at
        // position -1, where it sees nothing.
        int64_t last_pos = 0, lowest_pos = std::numeric_limits<int64_t>::max();
        for (int64_t r = 0; r < R; ++r) {
          float* row_values = staged.data() + r * d;
          if (r >= count) {
            row_pos[r] = -1.f;
            std::fill(row_values, row_values + d, 0.f);
            continue;
          }
          const int64_t row = task.first_row + r;
          const int64_t token = row / group, head = task.kv * group + row % group;
          const int64_t pos = first_pos + token;
          row_pos[r] = static_cast<float>(pos);
          last_pos = std::max(last_pos, pos);
          lowest_pos = std::min(lowest_pos, pos);
          const T* src = qp + (chunks.starts[seq] + token) * q_row + head * d;
          for (int64_t j = 0; j < d; j += L) (widen(src + j) * Vec(scale)).store(row_values + j);
        }
        at::vec::transpose_mxn<float>(staged.data(), d, qt.data(), R, R, d);
        std::fill(ot.begin(), ot.end(), 0.f);
        Vec best[2] = {Vec(neg_inf), Vec(neg_inf)}, total[2] = {Vec(0.f), Vec(0.f)};
        const Vec positions[2] = {Vec::loadu(row_pos), Vec::loadu(row_pos + L)};
        const int64_t first_slot = window > 0 ? std::max<int64_t>(0, lowest_pos - window + 1) : 0;
        const int64_t* table = chunks.tables + seq * chunks.row_stride;
        for (int64_t b = first_slot / block_size; b * block_size <= last_pos; ++b) {
          const int64_t block = table[b];
          TORCH_CHECK(block >= 0 && block < num_blocks, "block ", block, " is not in the pool");
          const int64_t lo = std::max(first_slot, b * block_size) - b * block_size;
          const int64_t hi = std::min(last_pos + 1, (b + 1) * block_size) - b * block_size;
          const int64_t n = hi - lo;
          const int64_t offset = block * block_values + lo * slot_stride + task.kv * d;
          const float* kb = as_float<T>(kp + offset, n, slot_stride, d, keys.data());
          const float* vb = as_float<T>(vp + offset, n, slot_stride, d, values.data());
          // Scores: two vectors of L rows a key, four keys at a time (each query value loaded
          // serves four keys, each key value two vectors of rows).
          int64_t t = 0;
          for (; t < n; t += 4) {
            const int64_t keys_now = std::min<int64_t>(4, n - t);
            const float* k0 = kb + t * kv_stride;
            // Past the block's last key, the last one again (its scores are not read).
            const float* k1 = kb + (t + std::min<int64_t>(1, keys_now - 1)) * kv_stride;
            const float* k2 = kb + (t + std::min<int64_t>(2, keys_now - 1)) * kv_stride;
            const float* k3 = kb + (t + std::min<int64_t>(3, keys_now - 1)) * kv_stride;
            Vec scores[8] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f),
                             Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
            for (int64_t j = 0; j < d; ++j) {
              const Vec qa = in_register(Vec::loadu(qt.data() + j * R));
              const Vec qb = in_register(Vec::loadu(qt.data() + j * R + L));
              multiply_add_2x4(scores, qa, qb, {k0[j], k1[j], k2[j], k3[j]});
            }
            // All eight stored (indexed by constants, they stay in registers): past the block's
            // last key into the buffer's spare rows, never read.
            float* w = weights.data() + t * R;
            for (int64_t k = 0; k < 8; ++k) scores[k].store(w + k * L);
          }
          // Keys past a row's position (or before its window) are -inf for it; the rows' new
          // maxima.
          // A block wholly at or before every row's position (without a window) is all visible.
          const bool masked = window > 0 || b * block_size + hi - 1 > lowest_pos;
          Vec top[2] = {best[0], best[1]};
          for (t = 0; t < n; ++t) {
            const Vec slot(static_cast<float>(b * block_size + lo + t));
            for (int64_t h = 0; h < 2; ++h) {
              float* w = weights.data() + t * R + h * L;
              Vec s = Vec::loadu(w);
              if (masked) {
                Vec visible = slot <= positions[h];
                if (window > 0) visible = visible & (slot > positions[h] - Vec(float(window)));
                s = Vec::blendv(Vec(neg_inf), s, visible);
                s.store(w);
              }
              top[h] = at::vec::maximum(top[h], s);
            }
          }
          // A row that has seen nothing yet keeps -inf: its weights and rescale come out 0 against
          // a maximum of 0. Weights under exp(-80) are 0 (denormals cost x86 cores dearly).
          Vec rescale[2];
          for (int64_t h = 0; h < 2; ++h) {
            const Vec shift = Vec::blendv(Vec(0.f), top[h], top[h] != Vec(neg_inf));
            const Vec cutoff(-80.f);
            const auto weigh = [&](const Vec& x) {
              const Vec y = x - shift;
              return Vec::blendv(y.exp(), Vec(0.f), y < cutoff);
            };
            rescale[h] = weigh(best[h]);
            Vec sum = total[h] * rescale[h];
            for (t = 0; t < n; ++t) {
              float* w = weights.data() + t * R + h * L;
              const Vec e = weigh(Vec::loadu(w));
              e.store(w);
              sum += e;
            }
            total[h] = sum;
            best[h] = top[h];
          }
          // Values: ot[j] = rescale * ot[j] + sum over keys of w_t * v_t[j], four j at a time
          // (each weight vector loaded serves four values of a key).
          for (int64_t j = 0; j < d; j += 4) {
            float* o = ot.data() + j * R;
            Vec acc[8];
            for (int64_t i = 0; i < 4; ++i) {
              acc[2 * i] = Vec::loadu(o + i * R) * rescale[0];
              acc[2 * i + 1] = Vec::loadu(o + i * R + L) * rescale[1];
            }
            for (t = 0; t < n; ++t) {
              const Vec wa = in_register(Vec::loadu(weights.data() + t * R));
              const Vec wb = in_register(Vec::loadu(weights.data() + t * R + L));
              const float* v = vb + t * kv_stride + j;
              multiply_add_2x4(acc, wa, wb, {v[0], v[1], v[2], v[3]});
            }
            for (int64_t i = 0; i < 4; ++i) {
              acc[2 * i].store(o + i * R);
              acc[2 * i + 1].store(o + i * R + L);
            }
          }
        }
        // Out, transposed back: row r's values are its column of ot over total[r].
        at::vec::transpose_mxn<float>(ot.data(), R, staged.data(), d, d, R);
        float inv[R];
        (Vec(1.f) / total[0]).store(inv);
        (Vec(1.f) / total[1]).store(inv + L);
        for (int64_t r = 0; r < count; ++r) {
          const int64_t row = task.first_row + r;
          const int64_t token = row / group, head = task.kv * group + row % group;
          T* dst = op + (chunks.starts[seq] + token) * o_row + head * d;
          const float* values = staged.data() + r * d;
          for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(values[j] * inv[r]);
        }
      }
    }
  });
}

// out[rows of each chunk] = attention of q's rows there over their sequence's cached slots.
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& query_starts, const at::Tensor& query_lens,
                             const at::Tensor& start_positions, double scale, int64_t window) {
  metrale_cpu::check_paged_caches(q, k_cache, v_cache, L);
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q's tokens must hold their heads contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == dtype && out.stride(2) == 1 &&
                  out.stride(1) == q.size(2),
              "out must be shaped and laid out as q");
  const int64_t tokens = q.size(0), heads = q.size(1);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t seqs = query_starts.numel();
  for (const at::Tensor* t : {&query_starts, &query_lens, &start_positions}) {
    TORCH_CHECK(t->dim() == 1 && t->numel() == seqs && t->scalar_type() == at::kLong,
                "query_starts, query_lens and start_positions must be int64 [seqs]");
  }
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == seqs &&
                  block_tables.scalar_type() == at::kLong,
              "block_tables must be int64 [seqs, max_blocks]");
  // Rows of a wider table (a slice of the runner's buffer) are read where they lie.
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor starts = query_starts.contiguous(), lens = query_lens.contiguous(),
                   positions = start_positions.contiguous();
  const Chunks chunks{starts.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                      positions.data_ptr<int64_t>(), tables.data_ptr<int64_t>(), tables.stride(0)};
  const int64_t group = heads / kv_heads, capacity = tables.size(1) * block_size;
  // The tasks, each sequence's last rows first: they see the most keys, and claimed first they
  // leave the short ones to even out the threads' ends.
  std::vector<Task> tasks;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t start = chunks.starts[s], len = chunks.lens[s], pos = chunks.positions[s];
    TORCH_CHECK(len >= 1 && start >= 0 && start + len <= tokens, "sequence ", s, "'s rows ",
                start, "..", start + len, " are not in q's ", tokens);
    TORCH_CHECK(pos >= 0 && pos + len <= capacity, "sequence ", s, " sees ", pos + len,
                " slots, its block table holds ", capacity);
    for (int64_t row = 0; row < len * group; row += R) tasks.push_back({s, 0, row});
  }
  std::sort(tasks.begin(), tasks.end(), [&](const Task& a, const Task& b) {
    const int64_t ka = chunks.positions[a.seq] + a.first_row / group;
    const int64_t kb = chunks.positions[b.seq] + b.first_row / group;
    return ka > kb;
  });
  std::vector<Task> all;
  all.reserve(tasks.size() * kv_heads);
  for (const Task& t : tasks) {
    for (int64_t kv = 0; kv < kv_heads; ++kv) all.push_back({t.seq, kv, t.first_row});
  }
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    attend_chunks<float>(q, k_cache, v_cache, chunks, all, s, window, out);
  } else if (dtype == at::kBFloat16) {
    attend_chunks<at::BFloat16>(q, k_cache, v_cache, chunks, all, s, window, out);
  } else {
    attend_chunks<at::Half>(q, k_cache, v_cache, chunks, all, s, window, out);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor query_starts, Tensor query_lens, Tensor start_positions, "
      "float scale, int window) -> ()");
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
