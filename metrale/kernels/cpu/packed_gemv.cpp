// One-row products over packed GGUF weights on a CPU (kernels/cpu_packed_gemv.py builds this):
// y = x @ dequant(W).T for x float32 [1, K] and W in kernels/quant_layout.py's layout
// (qweight, float16 scales, float16 mins). Each output row is a sum over 32-value blocks of
// d * (q . x) (+ m * sum(x) for Q4_1; Q4_0's -8 is m = -8 d), in float32: the weights' values are
// those of the dequantized weight, only the order of the sums differs. AVX-512 where the
// machine has it (-march=native), plain loops otherwise; rows split across torch's threads.
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "task_claims.h"

#include <vector>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTask = 64;
enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };  // quant_layout.FORMAT_IDS

inline float to_float(c10::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

#if defined(__AVX512F__)
// The sum over a row's blocks of block(b, sum), which adds block b's 16 lanes into `sum`: four
// blocks a turn into four sums, so that their dependency chains run side by side.
template <typename Block>
inline float sum_blocks(int64_t blocks, Block block) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4) {
    block(b, acc[0]);
    block(b + 1, acc[1]);
    block(b + 2, acc[2]);
    block(b + 3, acc[3]);
  }
  for (; b < blocks; ++b) block(b, acc[0]);
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
#endif

// sum_b d[b] * (q_b . x_b) of a 4-bit row; xe and xo are x's even and odd columns (byte j of a
// block holds columns 2j in its low nibble and 2j + 1 in its high one).
inline float dot_q4(const uint8_t* q, const c10::Half* d, const float* xe, const float* xo,
                    int64_t blocks) {
#if defined(__AVX512F__)
  const __m512i nibble = _mm512_set1_epi32(15);
  return sum_blocks(blocks, [&](int64_t b, __m512& sum) {
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16)));
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
    const __m512 t = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xe + b * 16),
                                     _mm512_mul_ps(hi, _mm512_loadu_ps(xo + b * 16)));
    sum = _mm512_fmadd_ps(t, _mm512_set1_ps(to_float(d[b])), sum);
  });
#else
  float acc[16] = {0};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = q + b * 16;
    const float scale = to_float(d[b]);
    for (int j = 0; j < 16; ++j) {
      acc[j] += scale * (static_cast<float>(p[j] & 15) * xe[b * 16 + j] +
                         static_cast<float>(p[j] >> 4) * xo[b * 16 + j]);
    }
  }
  float y = 0.f;
  for (int j = 0; j < 16; ++j) y += acc[j];
  return y;
#endif
}

// sum_b d[b] * (q_b . x_b) of a Q8_0 row.
inline float dot_q8(const int8_t* q, const c10::Half* d, const float* x, int64_t blocks) {
#if defined(__AVX512F__)
  return sum_blocks(blocks, [&](int64_t b, __m512& sum) {
    const __m128i* p = reinterpret_cast<const __m128i*>(q + b * kBlock);
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    const float* xb = x + b * kBlock;
    const __m512 t =
        _mm512_fmadd_ps(q0, _mm512_loadu_ps(xb), _mm512_mul_ps(q1, _mm512_loadu_ps(xb + 16)));
    sum = _mm512_fmadd_ps(t, _mm512_set1_ps(to_float(d[b])), sum);
  });
#else
  float acc[kBlock] = {0};
  for (int64_t b = 0; b < blocks; ++b) {
    const float scale = to_float(d[b]);
    for (int j = 0; j < kBlock; ++j) {
      acc[j] += scale * static_cast<float>(q[b * kBlock + j]) * x[b * kBlock + j];
    }
  }
  float y = 0.f;
  for (int j = 0; j < kBlock; ++j) y += acc[j];
  return y;
#endif
}

at::Tensor packed_gemv(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins, int64_t fmt) {
  TORCH_CHECK(fmt == kQ8_0 || fmt == kQ4_0 || fmt == kQ4_1, "unknown format ", fmt);
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat,
              "x must be float32 [1, K]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be float16 [N, K / 32], contiguous");
  const int64_t n = scales.size(0), blocks = scales.size(1), k = blocks * kBlock;
  TORCH_CHECK(x.size(1) == k, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(0) == n &&
                  qweight.size(1) == (fmt == kQ8_0 ? k : k / 2) &&
                  qweight.scalar_type() == (fmt == kQ8_0 ? at::kChar : at::kByte),
              "qweight does not match the format and the scales");
  TORCH_CHECK(fmt != kQ4_1 || (mins.sizes() == scales.sizes() && mins.is_contiguous() &&
                               mins.scalar_type() == at::kHalf),
              "Q4_1 needs float16 mins shaped as its scales");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({1, n}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const c10::Half* dp = scales.data_ptr<c10::Half>();
  if (fmt == kQ8_0) {
    const int8_t* qp = qweight.data_ptr<int8_t>();
    metrale_cpu::parallel_for_claimed(n, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) yp[r] = dot_q8(qp + r * k, dp + r * blocks, xp, blocks);
    });
    return out;
  }
  // x split into its even and odd columns, and each block's sum (for the offsets).
  std::vector<float> xe(k / 2), xo(k / 2), xsum(blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    float s = 0.f;
    for (int64_t j = 0; j < 16; ++j) {
      xe[b * 16 + j] = xp[b * kBlock + 2 * j];
      xo[b * 16 + j] = xp[b * kBlock + 2 * j + 1];
      s += xp[b * kBlock + 2 * j] + xp[b * kBlock + 2 * j + 1];
    }
    xsum[b] = s;
  }
  const uint8_t* qp = qweight.data_ptr<uint8_t>();
  const c10::Half* mp = fmt == kQ4_1 ? mins.data_ptr<c10::Half>() : nullptr;
  metrale_cpu::parallel_for_claimed(n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const c10::Half* d = dp + r * blocks;
      float offset = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        offset += (mp ? to_float(mp[r * blocks + b]) : -8.f * to_float(d[b])) * xsum[b];
      }
      yp[r] = offset + dot_q4(qp + r * (k / 2), d, xe.data(), xo.data(), blocks);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def("packed_gemv(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int fmt) -> Tensor");
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) { m.impl("packed_gemv", &packed_gemv); }
