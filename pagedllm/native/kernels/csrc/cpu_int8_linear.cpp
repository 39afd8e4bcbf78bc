// The module path's int8 linears (ops.int8_linear, layers/quantization/int8.py):
// y = x @ W^T * scale (+ bias) with W kept as int8, one float32 scale per output row, weight-only
// (linear_int8_f32) or with per-token int8 activations (linear_w8a8_f32). The kernels and their
// math are in int8_blocks.h, shared with the fused decoder (cpu_decoder.cpp).

#include <cstdint>
#include <vector>

#include <omp.h>

#include "int8_blocks.h"

extern "C" {

void linear_int8_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w,
                     int64_t N, const float* scale, const float* bias, float* y, int64_t ldy) {
#pragma omp parallel
  pagedllm::int8::linear_tiles(x, ldx, M, K, w, N, scale, bias, y, ldy, nullptr, nullptr);
}

void linear_w8a8_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w,
                     int64_t N, const float* scale, const float* bias, float* y, int64_t ldy) {
  std::vector<int8_t> xq(static_cast<size_t>(M * K));
  std::vector<float> xs(static_cast<size_t>(M));
#pragma omp parallel
  pagedllm::int8::linear_tiles(x, ldx, M, K, w, N, scale, bias, y, ldy, xq.data(), xs.data());
}

// The per-token activation quantization of linear_w8a8_f32 alone (for tests and references):
// xq [M, K] int8 contiguous, xs [M] float32.
void quantize_rows_int8(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* xq,
                        float* xs) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m)
    pagedllm::int8::quantize_row(x + m * ldx, K, xq + m * K, xs + m);
}

}  // extern "C"
