// Shared helpers of the CPU kernels: float32 / bfloat16 loads, and the AVX2 vector forms.
// A bfloat16 is the upper half of a float32, so widening one is a 16-bit shift.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
#endif

namespace pagedllm {

inline float to_float(float v) { return v; }

inline float to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store(float v, float* p) { *p = v; }

// float32 -> bfloat16 with round-to-nearest-even (NaN stays a quiet NaN), as torch rounds.
inline void store(float v, uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *p = static_cast<uint16_t>(bits >> 16);
}

#ifdef PAGEDLLM_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace pagedllm
