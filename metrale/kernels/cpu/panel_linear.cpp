// Float32 products over a weight laid out in panels of output columns (kernels/cpu_extension.py
// builds this; layers/linear.py packs the weights): y = x @ W.T (+ bias) for x [M, K] and W
// [N, K] held as panels [P, K, L], P = ceil(N / L), L the machine's float32 lanes (16 with
// AVX-512, 8 with AVX2), panel p's row k the L weights W[p * L .. p * L + L - 1, k].
//
// A panel's weights stream from memory once, in order, as rows of L floats; each one multiplies
// every row of x (up to kGroupRows of them held in registers, the lanes' sums of L columns) and
// the next rows of the panel are prefetched into L2 as they go. oneDNN's product for a few rows
// reads the weights at about 2/3 of the machine's bandwidth; this one at or above the read
// bandwidth measured by a copy (bench/cpu_products.py: 2-16 rows of peers.md's 33.6M Llama,
// 1.15-1.9x oneDNN's prepacked product). The sums run over k in order, as oneDNN's do.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

namespace {

// One register of float32 lanes: AVX-512's 16 or AVX2's 8 (raw intrinsics: an array of at::vec's
// Vectorized accumulators stayed on the stack, one load and store around every FMA), or 8
// scalars elsewhere.
#if defined(__AVX512F__)
using Reg = __m512;
constexpr int64_t kLanes = 16;
constexpr int kGroupRows = 16;  // 16 sums, the weights and a broadcast in 32 registers
constexpr int kPairRows = 12;   // two panels: 24 sums
inline Reg zero() { return _mm512_setzero_ps(); }
inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
inline Reg fma(float x, Reg w, Reg acc) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
inline __mmask16 lanes_mask(int64_t n) { return n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1); }
inline Reg load_part(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes_mask(n), p); }
inline void store_part(float* p, Reg v, int64_t n) { _mm512_mask_storeu_ps(p, lanes_mask(n), v); }
inline Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using Reg = __m256;
constexpr int64_t kLanes = 8;
constexpr int kGroupRows = 12;  // 16 registers
constexpr int kPairRows = 6;
inline Reg zero() { return _mm256_setzero_ps(); }
inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
inline Reg fma(float x, Reg w, Reg acc) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, acc); }
inline __m256i lanes_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Reg load_part(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes_mask(n)); }
inline void store_part(float* p, Reg v, int64_t n) { _mm256_maskstore_ps(p, lanes_mask(n), v); }
inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
#else
constexpr int64_t kLanes = 8;
constexpr int kGroupRows = 8;
constexpr int kPairRows = 4;
struct Reg {
  float v[kLanes];
};
inline Reg zero() { return Reg{}; }
inline Reg load(const float* p) {
  Reg r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = p[i];
  return r;
}
inline Reg fma(float x, Reg w, Reg acc) {
  for (int64_t i = 0; i < kLanes; ++i) acc.v[i] += x * w.v[i];
  return acc;
}
inline Reg load_part(const float* p, int64_t n) {
  Reg r{};
  for (int64_t i = 0; i < n; ++i) r.v[i] = p[i];
  return r;
}
inline void store_part(float* p, Reg v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = v.v[i];
}
inline Reg add(Reg a, Reg b) {
  for (int64_t i = 0; i < kLanes; ++i) a.v[i] += b.v[i];
  return a;
}
#endif

// How far ahead of the row being read a panel's rows are prefetched into L2 (8 KB at 16 lanes):
// nearer ones arrived late, measured at 2-16 rows of x.
constexpr int64_t kPrefetchRows = 128;

// out[m, 0:cols] = xt[:, m] . panel (+ bias) for the `rows` (a template argument: its sums live
// in registers) rows of one group; xt is the group's x transposed, [K][rows].
template <int rows>
void panel_rows(const float* __restrict xt, const float* __restrict panel, int64_t K,
                float* __restrict out, int64_t ldo, int64_t cols, const float* bias,
                bool prefetch) {
  Reg acc[rows];
#pragma GCC unroll 16
  for (int m = 0; m < rows; ++m) acc[m] = zero();
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch) __builtin_prefetch(panel + (k + kPrefetchRows) * kLanes, 0, 2);
    const Reg w = load(panel + k * kLanes);
    const float* xk = xt + k * rows;
#pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) acc[m] = fma(xk[m], w, acc[m]);
  }
  const Reg b = bias == nullptr ? zero() : load_part(bias, cols);
#pragma GCC unroll 16
  for (int m = 0; m < rows; ++m) store_part(out + m * ldo, add(acc[m], b), cols);
}

// The same over two adjacent panels (2 * kLanes columns, all of them real): each broadcast of x
// feeds two products, for x of more rows than one group, where the arithmetic bounds the time.
template <int rows>
void panel_pair_rows(const float* __restrict xt, const float* __restrict panel, int64_t K,
                     float* __restrict out, int64_t ldo, int64_t cols, const float* bias,
                     bool prefetch) {
  const float* __restrict next = panel + K * kLanes;
  Reg acc[rows], acc2[rows];
#pragma GCC unroll 16
  for (int m = 0; m < rows; ++m) acc[m] = acc2[m] = zero();
  for (int64_t k = 0; k < K; ++k) {
    if (prefetch) {
      __builtin_prefetch(panel + (k + kPrefetchRows) * kLanes, 0, 2);
      __builtin_prefetch(next + (k + kPrefetchRows) * kLanes, 0, 2);
    }
    const Reg w = load(panel + k * kLanes), w2 = load(next + k * kLanes);
    const float* xk = xt + k * rows;
#pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) {
      acc[m] = fma(xk[m], w, acc[m]);
      acc2[m] = fma(xk[m], w2, acc2[m]);
    }
  }
  const Reg b = bias == nullptr ? zero() : load(bias);
  const Reg b2 = bias == nullptr ? zero() : load(bias + kLanes);
#pragma GCC unroll 16
  for (int m = 0; m < rows; ++m) {
    store_part(out + m * ldo, add(acc[m], b), kLanes);
    store_part(out + m * ldo + kLanes, add(acc2[m], b2), kLanes);
  }
}

using PanelRows = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t,
                           const float*, bool);

template <template <int> class Kernel, int... rows>
constexpr auto kernel_table(std::integer_sequence<int, rows...>) {
  return std::array<PanelRows, sizeof...(rows) + 1>{nullptr, Kernel<rows + 1>::run...};
}
template <int rows>
struct One {
  static constexpr PanelRows run = panel_rows<rows>;
};
template <int rows>
struct Pair {
  static constexpr PanelRows run = panel_pair_rows<rows>;
};
// kPanelRows[r], kPairRows_[r]: the kernel for a group of r rows.
constexpr auto kPanelRows = kernel_table<One>(std::make_integer_sequence<int, kGroupRows>{});
constexpr auto kPanelPairRows = kernel_table<Pair>(std::make_integer_sequence<int, kPairRows>{});

// x: float32 [M, K]; panels: float32 [P, K, kLanes], contiguous (pack_panels); bias: float32
// [N] or None; N: the product's columns (P * kLanes rounded up from it).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels,
                        const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [rows, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kLanes && panels.size(1) == x.size(1),
              "panels must be float32 [P, ", x.size(1), ", ", kLanes, "], contiguous");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(N > (P - 1) * kLanes && N <= P * kLanes, "N = ", N, " is not in ", P, " panels");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == N, "bias must be float32 [", N,
                "]");
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  // Up to one group's rows run one panel at a time (decode steps: the weights' bytes bound them);
  // more run two at a time, in groups of kPairRows (prompts: the arithmetic does).
  const bool pairs = M > kGroupRows;
  const int64_t group_rows = pairs ? kPairRows : kGroupRows;
  const int64_t groups = (M + group_rows - 1) / group_rows;
  // x transposed by groups: group g's [K][rows] at xt + g * group_rows * K.
  std::vector<float> xt(static_cast<size_t>(M * K));
  const at::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t first = g * group_rows, rows = std::min<int64_t>(group_rows, M - first);
    float* t = xt.data() + first * K;
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t k = 0; k < K; ++k) t[k * rows + m] = xp[(first + m) * K + k];
  }
  const float* w = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  // Tasks: single panels, or pairs of whole panels (a last odd or partial one alone).
  const int64_t step = pairs ? 2 : 1, tasks = (P + step - 1) / step;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t * step;
      const bool pair = pairs && p + 1 < P && N >= (p + 2) * kLanes;
      // The panels' weights stay in L1/L2 while each group of rows multiplies them: they are
      // prefetched from memory for the first group only.
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t first = g * group_rows, rows = std::min<int64_t>(group_rows, M - first);
        const float* xg = xt.data() + first * K;
        float* og = o + first * N;
        const float* bias_at = bp == nullptr ? nullptr : bp + p * kLanes;
        if (pair) {
          kPanelPairRows[rows](xg, w + p * K * kLanes, K, og + p * kLanes, N, 2 * kLanes,
                               bias_at, g == 0);
          continue;
        }
        for (int64_t q = p; q < std::min(p + step, P); ++q) {
          const int64_t cols = std::min<int64_t>(kLanes, N - q * kLanes);
          // a group of up to kPairRows rows when pairing, kGroupRows otherwise: both tables
          // have the row count
          kPanelRows[rows](xg, w + q * K * kLanes, K, og + q * kLanes, N, cols,
                           bp == nullptr ? nullptr : bp + q * kLanes, g == 0);
        }
      }
    }
  });
  return out;
}

// W float32 [N, K] -> panels [P, K, kLanes], the last panel's missing columns zero.
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "weight must be float32 [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kLanes - 1) / kLanes;
  at::Tensor padded = at::zeros({P * kLanes, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kLanes, K}).transpose(1, 2).contiguous();
}

int64_t panel_lanes() { return kLanes; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int N) -> Tensor");
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_lanes() -> int", &panel_lanes);
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("pack_panels", &pack_panels);
}
