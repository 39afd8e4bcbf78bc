// y = x @ w^T (+ bias) for the CPU: weight in bfloat16 or float32; x and y in float32, or both
// in bfloat16 (a bf16 model's activations, so no casts around the call); math in float32.
//
// Why: on CPUs without native bf16 math (AVX2), torch's bf16 GEMM/GEMV runs far below memory
// bandwidth, so bf16 weights (half the bytes of fp32, hence up to twice the decode speed) only pay
// off with a kernel that widens them in registers: a bf16 value is the upper half of a float32,
// so widening is a 16-bit shift. This is the approach of llama.cpp's ggml bf16 dot products.
//
// Layout: x [M, K] (row stride ldx), w [N, K] contiguous (a torch nn.Linear weight), bias [N]
// float32 or null, y [M, N] (row stride ldy). Register blocking: MB rows of x times NB rows of w per
// micro-kernel call, each a K-long dot product accumulated in 8-lane vectors. Threads split the
// N axis into tiles (OpenMP, sharing torch's runtime).

#include <cstdint>

#include "linear_kernel.h"

using pagedllm::linear;

extern "C" {

// K must be a multiple of 8 (checked by the caller).
void linear_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                 const float* bias, float* y, int64_t ldy) {
  linear(x, ldx, M, K, w, N, bias, y, ldy);
}

void linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t N,
                const float* bias, float* y, int64_t ldy) {
  linear(x, ldx, M, K, w, N, bias, y, ldy);
}

// bfloat16 activations in and out (bfloat16 weight).
void linear_bf16_act(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
                     int64_t N, const float* bias, uint16_t* y, int64_t ldy) {
  linear(x, ldx, M, K, w, N, bias, y, ldy);
}

}  // extern "C"
