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
// 1.4-1.6x oneDNN's prepacked product). The sums run over k in order, as oneDNN's do.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "task_claims.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <utility>

namespace {

// One register of float32 lanes: AVX-512's 16 or AVX2's 8 (raw intrinsics: an array of at::vec's
// Vectorized accumulators stayed on the stack, one load and store around every FMA), or 8
// scalars elsewhere.
#if defined(__AVX512F__)
using Reg = __m512;
constexpr int64_t kLanes = 16;
constexpr int kGroupRows = 16;  // 16 sums, the weights and a broadcast in 32 registers
// Past one group of rows, 4 panels a pass over groups of 6 rows (24 sums; 3 x 8 and 2 x 12
// measured no faster on prompt chunks of 64-256 rows)
constexpr int kWide = 4;
constexpr int kWideRows = 6;
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
constexpr int kWide = 2;
constexpr int kWideRows = 6;
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
constexpr int kWide = 2;
constexpr int kWideRows = 4;
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

// out[m, 0:cols] = x[m, :] . W (+ bias) over `width` adjacent panels (cols of their columns)
// for the `rows` rows of one group, both template arguments: the rows x width sums live in
// registers. x is the group's first row, the next ones ldx floats apart (read as they lie: the
// rows' current lines stay in L1, where a transposed copy of x cost a prompt chunk ~5%); with
// width > 1 each broadcast of x feeds `width` products, for x of more rows than one group, where
// the arithmetic bounds the time. With `interleaved`, x is the group's rows interleaved instead,
// x.T [K, rows] (ldx unused): one pointer walks them all, where one a row ran out of registers
// (16 row pointers: some reloaded every k, a 16-row decode step's products ~17% slower).
template <int rows, int width, bool interleaved>
void panel_rows(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t K,
                float* __restrict out, int64_t ldo, int64_t cols, const float* bias,
                bool prefetch) {
  Reg acc[width][rows];
#pragma GCC unroll 4
  for (int j = 0; j < width; ++j)
#pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) acc[j][m] = zero();
  for (int64_t k = 0; k < K; ++k) {
    Reg w[width];
#pragma GCC unroll 4
    for (int j = 0; j < width; ++j) {
      const float* at = panel + (j * K + k) * kLanes;
      if (prefetch) __builtin_prefetch(at + kPrefetchRows * kLanes, 0, 2);
      w[j] = load(at);
    }
#pragma GCC unroll 16
    for (int m = 0; m < rows; ++m)
#pragma GCC unroll 4
      for (int j = 0; j < width; ++j)
        acc[j][m] = fma(interleaved ? x[k * rows + m] : x[m * ldx + k], w[j], acc[j][m]);
  }
#pragma GCC unroll 4
  for (int j = 0; j < width; ++j) {
    const int64_t n = std::min<int64_t>(kLanes, cols - j * kLanes);
    const Reg b = bias == nullptr ? zero() : load_part(bias + j * kLanes, n);
#pragma GCC unroll 16
    for (int m = 0; m < rows; ++m) store_part(out + m * ldo + j * kLanes, add(acc[j][m], b), n);
  }
}

using PanelRows = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t,
                           int64_t, const float*, bool);

template <int width, bool interleaved, int... rows>
constexpr auto kernel_table(std::integer_sequence<int, rows...>) {
  return std::array<PanelRows, sizeof...(rows) + 1>{
      nullptr, panel_rows<rows + 1, width, interleaved>...};
}
// The kernel for a group of r rows: kOne[r] over one panel (rows interleaved: decode steps);
// kWideKernels[r] over kWide panels and kWideRest[r] over one (rows as they lie: prompts).
constexpr auto kOne = kernel_table<1, true>(std::make_integer_sequence<int, kGroupRows>{});
constexpr auto kWideKernels =
    kernel_table<kWide, false>(std::make_integer_sequence<int, kWideRows>{});
constexpr auto kWideRest = kernel_table<1, false>(std::make_integer_sequence<int, kWideRows>{});

// x [M, K] (rows ldx floats apart) -> x.T [K, M], contiguous.
at::Tensor interleave_rows(const float* x, int64_t ldx, int64_t M, int64_t K,
                           const at::TensorOptions& options) {
  at::Tensor out = at::empty({K, M}, options);
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) o[k * M + m] = x[m * ldx + k];
  return out;
}

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
  // more run kWide at a time, in groups of kWideRows (prompts: the arithmetic does).
  const bool wide = M > kGroupRows;
  const int64_t group_rows = wide ? kWideRows : kGroupRows;
  const int64_t groups = (M + group_rows - 1) / group_rows;
  // Prompts read x's rows as they lie; one group of rows (decode steps) reads them interleaved.
  const at::Tensor rows_x = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t ldx = rows_x.stride(0);
  const at::Tensor xc = wide || M == 1
                            ? rows_x
                            : interleave_rows(rows_x.data_ptr<float>(), ldx, M, K, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  const float* bp = bias.has_value() ? b.data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  // Tasks: single panels, or kWide of them (the last ones, short of kWide, one at a time).
  const int64_t step = wide ? kWide : 1, tasks = (P + step - 1) / step;
  metrale_cpu::parallel_claims(tasks, 1, [&](metrale_cpu::TaskClaims& claims) {
    int64_t t0 = 0, t1 = 0;
    while (claims.next(t0, t1)) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t p = t * step, last = std::min(p + step, P);
        const bool whole = wide && last - p == kWide;
        // The panels' weights stay in L1/L2 while each group of rows multiplies them: they are
        // prefetched from memory for the first group only.
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t first = g * group_rows, rows = std::min<int64_t>(group_rows, M - first);
          const float* xg = xp + first * ldx;
          for (int64_t q = p; q < last; q += whole ? kWide : 1) {
            const int64_t cols = std::min<int64_t>((whole ? kWide : 1) * kLanes, N - q * kLanes);
            // rows <= group_rows, which the tables cover
            const PanelRows kernel = whole  ? kWideKernels[rows]
                                     : wide ? kWideRest[rows]
                                            : kOne[rows];
            kernel(xg, ldx, w + q * K * kLanes, K, o + first * N + q * kLanes, N, cols,
                   bp == nullptr ? nullptr : bp + q * kLanes, g == 0);
          }
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
