// The grouped LoRA shrink and expand (lora_kernel.h) as entry points of their own, for the
// module path (pagedllm/lora/layers.py `LoRALinear` on the CPU): each one OpenMP parallel
// region. The fused decoder runs the same loops inside its layer's region instead.
//
// dtype codes: 0 float32, 1 bfloat16 (x, y, and LoRALinearWeights.dtype for A and B).

#include <cstdint>

#include "lora_kernel.h"
#include "pagedllm_abi.h"

namespace {

using namespace pagedllm;

template <typename TX>
int shrink(const TX* x, int64_t ldx, const LoRALinearWeights& w, const LoRAStepArgs& step,
           float* shrunk) {
  if (w.dtype == 0) {
#pragma omp parallel
    lora::shrink_tiles<TX, float>(x, ldx, w, step, shrunk);
  } else if (w.dtype == 1) {
#pragma omp parallel
    lora::shrink_tiles<TX, uint16_t>(x, ldx, w, step, shrunk);
  } else {
    return -1;
  }
  return 0;
}

template <typename TY>
int expand(const float* shrunk, const LoRALinearWeights& w, const LoRAStepArgs& step, TY* y,
           int64_t ldy) {
  if (w.dtype == 0) {
#pragma omp parallel
    lora::expand_tiles<float, TY>(shrunk, w, step, y, ldy);
  } else if (w.dtype == 1) {
#pragma omp parallel
    lora::expand_tiles<uint16_t, TY>(shrunk, w, step, y, ldy);
  } else {
    return -1;
  }
  return 0;
}

}  // namespace

extern "C" {

// shrunk [num_lora_tokens, width] float32 = per segment x[tokens] @ A[slot]^T (columns beyond
// a segment's rank in each slice are left as they were). Returns 0, or -1 for a bad dtype.
int lora_shrink(const void* x, int64_t ldx, int x_dtype, const LoRALinearWeights* w,
                const LoRAStepArgs* step, float* shrunk) {
  if (x_dtype == 0) return shrink(static_cast<const float*>(x), ldx, *w, *step, shrunk);
  if (x_dtype == 1) return shrink(static_cast<const uint16_t*>(x), ldx, *w, *step, shrunk);
  return -1;
}

// y[tokens] += per segment shrunk @ B[slot]^T (slice by slice, in place; y rounded once).
// Returns 0, or -1 for a bad dtype.
int lora_expand(const float* shrunk, const LoRALinearWeights* w, const LoRAStepArgs* step,
                void* y, int64_t ldy, int y_dtype) {
  if (y_dtype == 0) return expand(shrunk, *w, *step, static_cast<float*>(y), ldy);
  if (y_dtype == 1) return expand(shrunk, *w, *step, static_cast<uint16_t*>(y), ldy);
  return -1;
}

}  // extern "C"
