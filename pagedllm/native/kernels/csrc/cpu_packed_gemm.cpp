// Entry points of the packed-B GEMM (packed_gemm.h): packing a [N, K] weight at load, the
// linear on a packed weight, and the FMA peak probe the benchmark reports the GEMM against.
//
// Layout and rounding: see packed_gemm.h. x [M, K] (row stride ldx), w packed from [N, K]
// (K a multiple of 8, checked by the caller), bias [N] float32 or null, y [M, N] (row stride
// ldy).

#include <cstdint>

#include <omp.h>

#include "packed_gemm.h"

namespace {

// A register-only FMA loop: kChains independent accumulator chains (enough to cover the FMA
// latency on both pipes), `iterations` steps, on every thread. Returns the flops executed.
template <int kChains>
double fma_loop(int64_t iterations, int kind) {
  double flops = 0;
#pragma omp parallel reduction(+ : flops)
  {
#if defined(PAGEDLLM_AVX512)
    __m512 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(1e-3f * (i + 1));
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-6f);
#if defined(PAGEDLLM_AVX512_BF16)
    const __m512bh ab = _mm512_cvtne2ps_pbh(a, a), bb = _mm512_cvtne2ps_pbh(b, b);
#endif
#if defined(PAGEDLLM_AVX512_BF16)
    if (kind == 1)
      for (int64_t it = 0; it < iterations; ++it)
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], ab, bb);
    else
#endif
      for (int64_t it = 0; it < iterations; ++it)
        for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    float sink = 0;
    for (int i = 0; i < kChains; ++i) sink += _mm512_reduce_add_ps(acc[i]);
    flops += static_cast<double>(iterations) * kChains * (kind == 1 ? 64 : 32);
#elif defined(PAGEDLLM_AVX2)
    __m256 acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(1e-3f * (i + 1));
    const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-6f);
    for (int64_t it = 0; it < iterations; ++it)
      for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    float sink = 0;
    for (int i = 0; i < kChains; ++i) sink += pagedllm::hsum(acc[i]);
    flops += static_cast<double>(iterations) * kChains * 16;
#else
    float acc[kChains];
    for (int i = 0; i < kChains; ++i) acc[i] = 1e-3f * (i + 1);
    for (int64_t it = 0; it < iterations; ++it)
      for (int i = 0; i < kChains; ++i) acc[i] = acc[i] * 0.999f + 1e-6f;
    float sink = 0;
    for (int i = 0; i < kChains; ++i) sink += acc[i];
    flops += static_cast<double>(iterations) * kChains * 2;
#endif
    // Keep the loop from being optimised away.
    if (sink == 12345.678f) flops += 1;
  }
  (void)kind;
  return flops;
}

}  // namespace

extern "C" {

// Whether bf16 weights are packed as k pairs for vdpbf16ps (1) or plain (0); a weight packed by
// one build is only valid for a library that answers the same.
int packed_gemm_bf16_pairs() { return pagedllm::packed::pairs<uint16_t>() ? 1 : 0; }

// The kernel that reads bf16 pair panels: 1 vdpbf16ps, 2 the widening FMAs, 0 none in this
// build (packed_gemm.h `Kernel`, `pairs_form`).
int packed_gemm_pairs_form() {
  if (!pagedllm::packed::pairs<uint16_t>()) return 0;
  return pagedllm::packed::pairs_form() == pagedllm::packed::Kernel::kWiden ? 2 : 1;
}

int packed_gemm_set_pairs_form(int form) {
  using pagedllm::packed::Kernel;
  if (form != 1 && form != 2) return -1;
  if (!pagedllm::packed::set_pairs_form(form == 1 ? Kernel::kDot : Kernel::kWiden)) return -1;
  return packed_gemm_pairs_form();
}

// dtype: 0 float32, 1 bfloat16. w [N, K] -> out (packed); out must not overlap w.
void pack_linear_weight(const void* w, int64_t N, int64_t K, int dtype, void* out) {
  if (dtype == 0)
    pagedllm::packed::pack(static_cast<const float*>(w), N, K, static_cast<float*>(out));
  else
    pagedllm::packed::pack(static_cast<const uint16_t*>(w), N, K, static_cast<uint16_t*>(out));
}

void unpack_linear_weight(const void* packed, int64_t N, int64_t K, int dtype, void* out) {
  if (dtype == 0)
    pagedllm::packed::unpack(static_cast<const float*>(packed), N, K, static_cast<float*>(out));
  else
    pagedllm::packed::unpack(static_cast<const uint16_t*>(packed), N, K,
                             static_cast<uint16_t*>(out));
}

// Rows `ids` [n] of a weight packed by pack_linear_weight into out [n, K] (dtype as above).
// Returns 0, or -1 with nothing written if an id is outside [0, N).
int packed_weight_rows(const void* packed, int64_t N, int64_t K, int dtype, const int64_t* ids,
                       int64_t n, void* out) {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= N) return -1;
  if (dtype == 0)
    pagedllm::packed::gather_rows(static_cast<const float*>(packed), N, K, ids, n,
                                  static_cast<float*>(out));
  else
    pagedllm::packed::gather_rows(static_cast<const uint16_t*>(packed), N, K, ids, n,
                                  static_cast<uint16_t*>(out));
  return 0;
}

void packed_linear_f32(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w,
                       int64_t N, const float* bias, float* y, int64_t ldy) {
  pagedllm::packed::linear(x, ldx, M, K, w, N, bias, y, ldy);
}

void packed_linear_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, const uint16_t* w,
                        int64_t N, const float* bias, float* y, int64_t ldy) {
  pagedllm::packed::linear(x, ldx, M, K, w, N, bias, y, ldy);
}

// bfloat16 activations in and out (bfloat16 weight).
void packed_linear_bf16_act(const uint16_t* x, int64_t ldx, int64_t M, int64_t K,
                            const uint16_t* w, int64_t N, const float* bias, uint16_t* y,
                            int64_t ldy) {
  pagedllm::packed::linear(x, ldx, M, K, w, N, bias, y, ldy);
}

// Runs the FMA peak loop on every thread of a parallel region: kind 0 float32 FMAs at the
// widest vector width built, kind 1 bf16 dot products (vdpbf16ps; -1 when not built).
// Returns the floating-point operations executed (time it to get the peak rate).
double fma_peak_probe(int64_t iterations, int kind) {
#if !defined(PAGEDLLM_AVX512_BF16)
  if (kind == 1) return -1;
#endif
  return fma_loop<12>(iterations, kind);
}

}  // extern "C"
