// Int8 linear kernels shared by cpu_int8_linear.cpp (the module path's `int8_linear`) and the
// fused decoder (cpu_decoder.cpp): y = x @ W^T * scale (+ bias) with W kept as int8, one float32
// scale per output row (symmetric per-channel quantization: W[n, :] ~= scale[n] * q[n, :]):
//
//   weight-only  activations and sums in float32, each int8 weight widened to float32 in
//                registers inside the dot product (the weight streams from memory at 1 byte per
//                value: a quarter of float32, half of bfloat16).
//   w8a8         activations quantized too, per token (row) of x: xs[m] = max|x[m, :]| / 127,
//                xq = round(x / xs) (to nearest even), int8 x int8 products summed exactly in
//                int32, y = float(acc) * xs[m] * scale[n] (the W8A8 scheme of SmoothQuant-style
//                int8 GEMMs, without smoothing). Not exact: each activation is rounded to 1/127
//                of its row's largest magnitude.
//
// Layout: x [M, K] float32 (row stride ldx), w [N, K] int8 contiguous, scale [N] float32, bias [N]
// float32 or null, y [M, N] float32 (row stride ldy). Any K >= 1 (vector body plus scalar tail).
// `linear_tiles` holds the work-sharing loops of one linear (work items: a block of x rows, a
// tile of w rows, as linear_kernel.h), for every thread of an enclosing OpenMP parallel region;
// both callers go through it, so the fused and module paths compute the same sums in the same
// order.
//
// The int8 dot product (AVX2) uses llama.cpp's sign trick: `_mm256_maddubs_epi16` multiplies
// unsigned by signed bytes, so |w| (unsigned; -128 becomes 128) is multiplied with x carrying
// w's sign (`_mm256_sign_epi8`, which also zeroes x where w == 0). A pair sum is at most
// 2 * 128 * 127 = 32512 (x is in [-127, 127]), below int16 saturation, so the sums are exact.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <omp.h>

#include "cpu_vec.h"

namespace pagedllm {
namespace int8 {

#ifdef PAGEDLLM_AVX2
inline __m256 load8_i8(const int8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#endif

// --- weight-only: y[i][j] = scale[j] * dot(x[i], w[j]) + bias[j] for i < MB, j < NB.
template <int MB, int NB>
inline void micro_w8(const float* x, int64_t ldx, const int8_t* w, int64_t K, const float* scale,
                     const float* bias, float* y, int64_t ldy) {
  float s[MB][NB];
  int64_t k = 0;
#ifdef PAGEDLLM_AVX2
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  if constexpr (MB == 1) {
    // GEMV: a second accumulator set halves the FMA dependency chains.
    __m256 acc2[NB];
    for (int j = 0; j < NB; ++j) acc2[j] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
      for (int j = 0; j < NB; ++j) {
        acc[0][j] = _mm256_fmadd_ps(x0, load8_i8(w + j * K + k), acc[0][j]);
        acc2[j] = _mm256_fmadd_ps(x1, load8_i8(w + j * K + k + 8), acc2[j]);
      }
    }
    for (int j = 0; j < NB; ++j) acc[0][j] = _mm256_add_ps(acc[0][j], acc2[j]);
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load8_i8(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) s[i][j] = hsum(acc[i][j]);
#else
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) s[i][j] = 0.f;
#endif
  for (; k < K; ++k)
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) s[i][j] += x[i * ldx + k] * static_cast<float>(w[j * K + k]);
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      y[i * ldy + j] = s[i][j] * scale[j] + (bias != nullptr ? bias[j] : 0.f);
}

template <int MB>
inline void rows_block_w8(const float* x, int64_t ldx, int64_t m0, int64_t m1, const int8_t* w,
                          int64_t K, int64_t n0, int64_t n1, const float* scale,
                          const float* bias, float* y, int64_t ldy) {
  constexpr int NB = MB == 1 ? 4 : 3;
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    int64_t n = n0;
    for (; n + NB <= n1; n += NB)
      micro_w8<MB, NB>(x + m * ldx, ldx, w + n * K, K, scale + n,
                       bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
    for (; n < n1; ++n)
      micro_w8<MB, 1>(x + m * ldx, ldx, w + n * K, K, scale + n,
                      bias != nullptr ? bias + n : nullptr, y + m * ldy + n, ldy);
  }
}

// --- w8a8: per-token activation quantization and int8 dot products.

// q[0..K) = round(x / d) in [-127, 127], *xs = d = max|x| / 127 (0 for a zero row).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* xs) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float d = amax / 127.f;
  *xs = d;
  for (int64_t k = 0; k < K; ++k) {
    const float v = d != 0.f ? std::nearbyint(x[k] / d) : 0.f;
    q[k] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
  }
}

// acc[j] = sum_k a[k] * w[j][k] exactly, for NB rows of w.
template <int NB>
inline void dot_i8(const int8_t* a, const int8_t* w, int64_t K, int32_t* acc) {
  int64_t k = 0;
#ifdef PAGEDLLM_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums[NB];
  for (int j = 0; j < NB; ++j) sums[j] = _mm256_setzero_si256();
  for (; k + 32 <= K; k += 32) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + k));
    for (int j = 0; j < NB; ++j) {
      const __m256i qw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
      const __m256i p16 =
          _mm256_maddubs_epi16(_mm256_sign_epi8(qw, qw), _mm256_sign_epi8(qa, qw));
      sums[j] = _mm256_add_epi32(sums[j], _mm256_madd_epi16(p16, ones));
    }
  }
  for (int j = 0; j < NB; ++j) acc[j] = hsum_i32(sums[j]);
#else
  for (int j = 0; j < NB; ++j) acc[j] = 0;
#endif
  for (; k < K; ++k)
    for (int j = 0; j < NB; ++j)
      acc[j] += static_cast<int32_t>(a[k]) * static_cast<int32_t>(w[j * K + k]);
}

inline void rows_block_w8a8(const int8_t* xq, const float* xs, int64_t m0, int64_t m1,
                            const int8_t* w, int64_t K, int64_t n0, int64_t n1,
                            const float* scale, const float* bias, float* y, int64_t ldy) {
  constexpr int NB = 4;
  int32_t acc[NB];
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* a = xq + m * K;
    float* yr = y + m * ldy;
    int64_t n = n0;
    for (; n + NB <= n1; n += NB) {
      dot_i8<NB>(a, w + n * K, K, acc);
      for (int j = 0; j < NB; ++j)
        yr[n + j] = static_cast<float>(acc[j]) * xs[m] * scale[n + j] +
                    (bias != nullptr ? bias[n + j] : 0.f);
    }
    for (; n < n1; ++n) {
      dot_i8<1>(a, w + n * K, K, acc);
      yr[n] = static_cast<float>(acc[0]) * xs[m] * scale[n] + (bias != nullptr ? bias[n] : 0.f);
    }
  }
}

// The work-sharing loops of one int8 linear, for every thread of an enclosing OpenMP parallel
// region (orphaned `omp for`s, each ending with a barrier); outside one it runs serially.
// xq [M, K] int8 and xs [M] float32 are scratch for W8A8 (per-token quantized x); with xq null
// the linear is weight-only.
inline void linear_tiles(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w,
                         int64_t N, const float* scale, const float* bias, float* y, int64_t ldy,
                         int8_t* xq, float* xs) {
  if (xq != nullptr) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, K, xq + m * K, xs + m);
  }
  const int64_t tile =
      std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * omp_get_num_threads())));
  const int64_t num_tiles = (N + tile - 1) / tile;
  constexpr int64_t kRowBlock = 96;  // a multiple of the 4-row weight-only kernel
  const int64_t num_row_blocks = (M + kRowBlock - 1) / kRowBlock;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_row_blocks * num_tiles; ++item) {
    const int64_t t = item % num_tiles, b = item / num_tiles;
    const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
    const int64_t r0 = b * kRowBlock, r1 = std::min(M, r0 + kRowBlock);
    if (xq != nullptr) {
      rows_block_w8a8(xq, xs, r0, r1, w, K, n0, n1, scale, bias, y, ldy);
    } else {
      const int64_t r4 = r0 + (r1 - r0) / 4 * 4;
      rows_block_w8<4>(x, ldx, r0, r4, w, K, n0, n1, scale, bias, y, ldy);
      rows_block_w8<1>(x, ldx, r4, r1, w, K, n0, n1, scale, bias, y, ldy);
    }
  }
}

}  // namespace int8
}  // namespace pagedllm
