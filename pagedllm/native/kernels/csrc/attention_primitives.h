// The element types and vector primitives of the CPU paged attention kernel
// (attention_kernel.h): quantized cache values, dot / axpy over a head, the softmax's exp and
// max, and the per-block score and value loops with their prefetch. AVX2 builds use 8-lane
// vectors (PAGEDLLM_AVX2, cpu_vec.h); others the scalar loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_vec.h"

namespace pagedllm {

// Quantized KV caches (pagedllm/kv_cache_layout.py): int8 rows with a float32 scale
// per (token, KV head), or float8 e4m3fn values with one scale per tensor. The kernels read the
// one-byte values here; the scales are applied in `attention_items`.
struct fp8_e4m3 {
  uint8_t bits;
};

// float8 e4m3fn (OCP FP8, "fn": no infinities): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; exponent 0 is subnormal (m / 8 * 2^-6), S.1111.111 is NaN.
inline std::vector<float> make_fp8_e4m3_table() {
  std::vector<float> table(256);
  for (int b = 0; b < 256; ++b) {
    const int sign = b >> 7, exponent = (b >> 3) & 15, mantissa = b & 7;
    float v;
    if (exponent == 15 && mantissa == 7)
      v = std::numeric_limits<float>::quiet_NaN();
    else if (exponent == 0)
      v = std::ldexp(static_cast<float>(mantissa) / 8.f, -6);
    else
      v = std::ldexp(1.f + static_cast<float>(mantissa) / 8.f, exponent - 7);
    table[b] = sign ? -v : v;
  }
  return table;
}

inline const std::vector<float> kFp8E4m3ToFloat = make_fp8_e4m3_table();

inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(fp8_e4m3 v) { return kFp8E4m3ToFloat[v.bits]; }

#ifdef PAGEDLLM_AVX2
inline __m256 load8(const int8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}

inline __m256 load8(const fp8_e4m3* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_i32gather_ps(kFp8E4m3ToFloat.data(), _mm256_cvtepu8_epi32(raw), 4);
}
#endif

template <typename T>
inline float dot_scalar(const float* __restrict a, const T* __restrict b, int n) {
  float s = 0.f;
  for (int d = 0; d < n; ++d) s += a[d] * to_float(b[d]);
  return s;
}

template <typename T>
inline void axpy_scalar(float* __restrict acc, float w, const T* __restrict v, int n) {
  for (int d = 0; d < n; ++d) acc[d] += w * to_float(v[d]);
}

#ifdef PAGEDLLM_AVX2
template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int n) {
  if (n % 16 != 0) return dot_scalar(a, b, n);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int d = 0; d < n; d += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), load8(b + d), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), load8(b + d + 8), s1);
  }
  return hsum(_mm256_add_ps(s0, s1));
}

template <typename T>
inline void axpy(float* __restrict acc, float w, const T* __restrict v, int n) {
  if (n % 8 != 0) return axpy_scalar(acc, w, v, n);
  const __m256 wv = _mm256_set1_ps(w);
  for (int d = 0; d < n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, load8(v + d), _mm256_loadu_ps(acc + d)));
}

// s[j] = exp(s[j] - m) for j < n; returns the sum.
inline float exp_shift_sum(float* s, int n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
    _mm256_storeu_ps(s + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// max(s[0], ..., s[n - 1]), n >= 1 (8 lanes at a time: no chain of n dependent maxes).
inline float row_max(const float* s, int n) {
  __m256 vmax = _mm256_set1_ps(s[0]);
  int j = 0;
  for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}
#else
inline float row_max(const float* s, int n) {
  float m = s[0];
  for (int j = 1; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

inline float exp_shift_sum(float* s, int n, float m) {
  float sum = 0.f;
  for (int j = 0; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int n) {
  return dot_scalar(a, b, n);
}

template <typename T>
inline void axpy(float* __restrict acc, float w, const T* __restrict v, int n) {
  axpy_scalar(acc, w, v, n);
}
#endif

// Prefetch into L2 the K and V rows of one KV head in a block (n rows `stride` values apart,
// head_size values each, from offset `off`). The decode paths call it for the next block of
// their walk while they compute on this one: a head's rows are 128-256 bytes a whole KV row
// apart, a pattern the hardware prefetchers follow poorly, and the table's blocks need not be
// adjacent. With it bf16 decode reads its KV from DRAM much faster and verification tiles run
// faster; into L1 (T0) it was slower than none (docs/benchmarks.md, "Measurements behind
// choices in the code").
template <typename T>
inline void prefetch_head_rows(const T* k, const T* v, int64_t off, int64_t stride, int n,
                               int head_size) {
#ifdef PAGEDLLM_AVX2
  const int64_t bytes = static_cast<int64_t>(head_size) * sizeof(T);
  const bool shared = k == v;   // one cache for both (MLA's latent): its rows once
  for (int j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k + off + j * stride) + b, _MM_HINT_T1);
      if (!shared)
        _mm_prefetch(reinterpret_cast<const char*>(v + off + j * stride) + b, _MM_HINT_T1);
    }
#endif
}

// scores[j] = dot(q, k_j) for the n keys k_j = k + j * stride (head_size values each).
template <typename T>
inline void block_scores(const float* q, const T* k, int64_t stride, int n, int head_size,
                         float* scores) {
  int j = 0;
#ifdef PAGEDLLM_AVX2
  if (head_size % 8 == 0) {
    // Eight keys at a time, each with its own accumulator, reduced together at the end (three
    // rounds of horizontal adds for all eight instead of one full reduction per key).
    for (; j + 8 <= n; j += 8) {
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int d = 0; d < head_size; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; ++i)
          acc[i] = _mm256_fmadd_ps(qv, load8(k + (j + i) * stride + d), acc[i]);
      }
      const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
      _mm256_storeu_ps(scores + j, _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                                                 _mm256_permute2f128_ps(s03, s47, 0x31)));
    }
  }
#endif
  for (; j < n; ++j) scores[j] = dot(q, k + j * stride, head_size);
}

#ifdef PAGEDLLM_AVX512
// The eight scores of eight keys from their accumulators (lane sums), reduced as `block_scores`
// reduces them (three rounds of horizontal adds, then the 128-bit halves added).
inline __m256 reduce_scores8(const __m256* acc) {
  const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                       _mm256_permute2f128_ps(s03, s47, 0x31));
}

// Eight key values k[0, 8) widened to float32, in both 256-bit halves of a zmm.
inline __m512 load8_twice(const float* k) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(
      reinterpret_cast<const double*>(k))));
}

inline __m512 load8_twice(const uint16_t* k) {
  const __m256i raw = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(k)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Two query heads interleaved for `block_scores_pair`: pair[2 d + i] = q0[d + i] and
// pair[2 d + 8 + i] = q1[d + i] for each 8-value chunk d (head_size % 8 == 0).
inline void interleave_query_pair(const float* q0, const float* q1, int head_size,
                                  float* pair) {
  for (int d = 0; d < head_size; d += 8) {
    std::copy(q0 + d, q0 + d + 8, pair + 2 * d);
    std::copy(q1 + d, q1 + d + 8, pair + 2 * d + 8);
  }
}

// `block_scores` of two query heads q0, q1 (their chunks interleaved in `pair`) over the same
// n keys: s0 and s1 get exactly the floats two `block_scores` calls give. Each 8-key group's
// per-key accumulators hold head 0 in the low and head 1 in the high 256 bits of one zmm, so
// every lane sums its products in the same order with half the FMA instructions, and each key
// row chunk is loaded once for both heads (grouped-query and MLA decode, where the heads of
// one KV head read the same rows). Float32 and bfloat16 keys; head_size % 8 == 0.
template <typename T>
inline void block_scores_pair(const float* pair, const float* q0, const float* q1,
                              const T* k, int64_t stride, int n, int head_size, float* s0,
                              float* s1) {
  int j = 0;
  for (; j + 8 <= n; j += 8) {
    __m512 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
    for (int d = 0; d < head_size; d += 8) {
      const __m512 qv = _mm512_loadu_ps(pair + 2 * d);
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_fmadd_ps(qv, load8_twice(k + (j + i) * stride + d), acc[i]);
    }
    __m256 lo[8], hi[8];
    for (int i = 0; i < 8; ++i) {
      lo[i] = _mm512_castps512_ps256(acc[i]);
      hi[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1));
    }
    _mm256_storeu_ps(s0 + j, reduce_scores8(lo));
    _mm256_storeu_ps(s1 + j, reduce_scores8(hi));
  }
  for (; j < n; ++j) {
    s0[j] = dot(q0, k + j * stride, head_size);
    s1[j] = dot(q1, k + j * stride, head_size);
  }
}
#endif

#ifdef PAGEDLLM_AVX2
// block_values for head_size == 8 * NV: the accumulator stays in NV registers across the rows.
template <int NV, typename T>
inline void block_values_in_registers(float* acc, const float* p, const T* v, int64_t stride,
                                      int n) {
  __m256 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm256_loadu_ps(acc + 8 * i);
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    const T* row = v + j * stride;
    for (int i = 0; i < NV; ++i) a[i] = _mm256_fmadd_ps(pj, load8(row + 8 * i), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + 8 * i, a[i]);
}
#endif

// acc[0, head_size) += sum_j p[j] * v_j for the n rows v_j = v + j * stride.
template <typename T>
inline void block_values(float* acc, const float* p, const T* v, int64_t stride, int n,
                         int head_size) {
#ifdef PAGEDLLM_AVX2
  if (head_size == 64) return block_values_in_registers<8>(acc, p, v, stride, n);
  if (head_size == 128) return block_values_in_registers<16>(acc, p, v, stride, n);
#endif
  for (int j = 0; j < n; ++j) axpy(acc, p[j], v + j * stride, head_size);
}

// dst[i] = num[i] / (1 + exp(-x[i])) = num[i] * sigmoid(x[i]) for i < n (the recurrent layers'
// SiLU, num = x, and Qwen3-Next's output gates; cpu_state_scan.cpp / cpu_gdn_decoder.cpp): 16
// lanes at a time with exp16 (AVX-512), then 8 with exp8 (glibc's scalar expf does not
// vectorise; relative difference ~1e-7), the tail with std::exp. exp16 runs exp8's operations
// and the division is the same, so an element gets the same bits in either width. dst may be
// num or x.
inline void mul_sigmoid(const float* num, const float* x, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef PAGEDLLM_AVX512
  const __m512 one16 = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(x + i)));
    _mm512_storeu_ps(dst + i, _mm512_div_ps(_mm512_loadu_ps(num + i), _mm512_add_ps(one16, e)));
  }
#endif
#ifdef PAGEDLLM_AVX2
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_loadu_ps(x + i)));
    _mm256_storeu_ps(dst + i, _mm256_div_ps(_mm256_loadu_ps(num + i), _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) dst[i] = num[i] / (1.0f + std::exp(-x[i]));
}

inline void silu_inplace(float* a, int64_t n) { mul_sigmoid(a, a, a, n); }

}  // namespace pagedllm
