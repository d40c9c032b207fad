// A step's keys and values written to their slots of the paged KV pool on a CPU
// (kernels/cpu_extension.py builds this), for the compiled decode steps: one call a layer copies
// each token's kv_heads x D keys and values, where the torch formula (two index_copy_ through
// views of the pool) took 37-54 us a call (1 and 16 rows), most of it dispatch.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

namespace {

// kv: the pool [layers, 2, blocks, block_size, kv_heads, D] (float32, bfloat16 or float16); k, v:
// [tokens, kv_heads, D] of the pool's dtype with contiguous rows of D; slot_mapping: int64
// [tokens], a slot a token. Values are copied as bytes.
void store_kv(const at::Tensor& kv, int64_t layer, const at::Tensor& slot_mapping,
              const at::Tensor& k, const at::Tensor& v) {
  const auto dtype = kv.scalar_type();
  TORCH_CHECK(kv.dim() == 6 && kv.size(1) == 2 && kv.is_contiguous() &&
                  (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
              "kv must be the pool [layers, 2, blocks, block_size, kv_heads, D] of float32, "
              "bfloat16 or float16, contiguous");
  TORCH_CHECK(layer >= 0 && layer < kv.size(0), "layer ", layer, " of ", kv.size(0));
  const int64_t kv_heads = kv.size(4), d = kv.size(5);
  const int64_t num_slots = kv.size(2) * kv.size(3);
  for (const at::Tensor* x : {&k, &v}) {
    TORCH_CHECK(x->dim() == 3 && x->size(1) == kv_heads && x->size(2) == d &&
                    x->scalar_type() == dtype && x->stride(2) == 1,
                "k and v must be [tokens, ", kv_heads, ", ", d, "] of the pool's dtype with "
                "contiguous rows");
  }
  const int64_t tokens = k.size(0);
  TORCH_CHECK(v.size(0) == tokens && slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be int64 [tokens]");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t item = kv.element_size();
  const int64_t slot_bytes = kv_heads * d * item, row_bytes = d * item;
  char* keys = static_cast<char*>(kv.data_ptr()) + layer * 2 * num_slots * slot_bytes;
  char* values = keys + num_slots * slot_bytes;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " is not in the pool");
  }
  const char* kbase = static_cast<const char*>(k.data_ptr());
  const char* vbase = static_cast<const char*>(v.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    const char* kt = kbase + t * k.stride(0) * item;
    const char* vt = vbase + t * v.stride(0) * item;
    char* kd = keys + slot[t] * slot_bytes;
    char* vd = values + slot[t] * slot_bytes;
    for (int64_t h = 0; h < kv_heads; ++h) {
      std::memcpy(kd + h * row_bytes, kt + h * k.stride(1) * item, row_bytes);
      std::memcpy(vd + h * row_bytes, vt + h * v.stride(1) * item, row_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(metrale_cpu, m) {
  m.def("store_kv(Tensor(a!) kv, int layer, Tensor slot_mapping, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(metrale_cpu, CPU, m) { m.impl("store_kv", &store_kv); }
