// GGML block formats (llama.cpp's ggml-common.h) and their unpacking to float32, one block of 32
// weights at a time, in scalar form and (with AVX2) as four 8-lane vectors.
//
//   Q8_0 (34 bytes): fp16 d | int8 q[32]              w[i] = d * q[i]
//   Q4_0 (18 bytes): fp16 d | uint8 qs[16]            w[i] = d * (nibble_i - 8)
//   Q4_1 (20 bytes): fp16 d | fp16 m | uint8 qs[16]   w[i] = d * nibble_i + m
//
// Nibble order of Q4_0/Q4_1: weight i < 16 is the low nibble of qs[i], weight i + 16 its high
// nibble. A row of K weights is K / 32 consecutive blocks.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_vec.h"

#if defined(__F16C__) && !defined(PAGEDLLM_AVX2)
#include <immintrin.h>
#endif

namespace pagedllm {
namespace gguf {

constexpr int kBlock = 32;  // weights per block of every type here

// IEEE half -> float (exact; subnormals, infinities and NaN included).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof(h));
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise the mantissa
      exp = 113;
      while (!(mant & 0x400u)) {
        mant <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

struct Q8_0 {
  static constexpr int kBytes = 34;
  static void unpack(const uint8_t* b, float* out) {
    const float d = half_to_float(b);
    for (int i = 0; i < kBlock; ++i) out[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    for (int c = 0; c < 4; ++c) {
      const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * c));
      w[c] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    }
  }
#endif
};

struct Q4_0 {
  static constexpr int kBytes = 18;
  static void unpack(const uint8_t* b, float* out) {
    const float d = half_to_float(b);
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>((b[2 + i] & 0x0f) - 8);
      out[i + 16] = d * static_cast<float>((b[2 + i] >> 4) - 8);
    }
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
    const __m128i mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, mask), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), eight);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d);
  }
#endif
};

struct Q4_1 {
  static constexpr int kBytes = 20;
  static void unpack(const uint8_t* b, float* out) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    for (int i = 0; i < 16; ++i) {
      out[i] = d * static_cast<float>(b[4 + i] & 0x0f) + m;
      out[i + 16] = d * static_cast<float>(b[4 + i] >> 4) + m;
    }
  }
#ifdef PAGEDLLM_AVX2
  static void unpack(const uint8_t* b, __m256 w[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(b)), m = _mm256_set1_ps(half_to_float(b + 2));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c])), d, m);
  }
#endif
};

}  // namespace gguf
}  // namespace pagedllm
