// The register-blocked dot-product kernel behind `cpu_linear.cpp` and the fused decoder layer
// (`cpu_decoder.cpp`): y = x @ w^T (+ bias), weight bfloat16 or float32, x and y float32 or
// bfloat16, math in float32. See cpu_linear.cpp for why and for the layout.
#pragma once

#include <algorithm>
#include <cstdint>

#include <omp.h>

#include "cpu_vec.h"

namespace pagedllm {

#ifdef PAGEDLLM_AVX2
// y[i][j] = dot(x[i], w[j]) for i < MB, j < NB; K a multiple of 8.
template <int MB, int NB, typename T, typename TX, typename TY>
inline void micro(const TX* x, int64_t ldx, const T* w, int64_t K, const float* bias, TY* y,
                  int64_t ldy) {
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  if constexpr (MB == 1) {
    // GEMV: a second accumulator set halves the FMA dependency chains' share of the time, and
    // the next rows of w are prefetched while these stream in (the rows are short: K values).
    __m256 acc2[NB];
    for (int j = 0; j < NB; ++j) acc2[j] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + NB) * K + k), _MM_HINT_T0);
      const __m256 x0 = load8(x + k), x1 = load8(x + k + 8);
      for (int j = 0; j < NB; ++j) {
        acc[0][j] = _mm256_fmadd_ps(x0, load8(w + j * K + k), acc[0][j]);
        acc2[j] = _mm256_fmadd_ps(x1, load8(w + j * K + k + 8), acc2[j]);
      }
    }
    for (int j = 0; j < NB; ++j) acc[0][j] = _mm256_add_ps(acc[0][j], acc2[j]);
  }
  for (; k < K; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = load8(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j)
      store(hsum(acc[i][j]) + (bias != nullptr ? bias[j] : 0.f), y + i * ldy + j);
}
#else
template <int MB, int NB, typename T, typename TX, typename TY>
inline void micro(const TX* x, int64_t ldx, const T* w, int64_t K, const float* bias, TY* y,
                  int64_t ldy) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = bias != nullptr ? bias[j] : 0.f;
      for (int64_t k = 0; k < K; ++k) s += to_float(x[i * ldx + k]) * to_float(w[j * K + k]);
      store(s, y + i * ldy + j);
    }
}
#endif

// Rows [m0, m1) of x against w rows [n0, n1).
template <int MB, typename T, typename TX, typename TY>
void rows_block(const TX* x, int64_t ldx, int64_t m0, int64_t m1, const T* w, int64_t K,
                int64_t n0, int64_t n1, const float* bias, TY* y, int64_t ldy) {
  constexpr int NB = MB >= 6 ? 2 : (MB >= 3 ? 3 : 4);
  for (int64_t m = m0; m + MB <= m1; m += MB) {
    int64_t n = n0;
    for (; n + NB <= n1; n += NB)
      micro<MB, NB>(x + m * ldx, ldx, w + n * K, K, bias != nullptr ? bias + n : nullptr,
                    y + m * ldy + n, ldy);
    for (; n < n1; ++n)
      micro<MB, 1>(x + m * ldx, ldx, w + n * K, K, bias != nullptr ? bias + n : nullptr,
                   y + m * ldy + n, ldy);
  }
}

// The work-sharing loop of a linear, to be called by every thread of an enclosing OpenMP parallel
// region (an orphaned `omp for`: it ends with a barrier); called outside one, it runs serially.
template <typename T, typename TX, typename TY>
void linear_tiles(const TX* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N,
                  const float* bias, TY* y, int64_t ldy) {
  // Work items are (block of x rows, tile of w rows). A tile of w is small enough to stay in L2
  // while the rows of x stream past it; x is cut into blocks so that a block of x stays in L2
  // too when M is large (a prefill), instead of streaming all of x from L3 for every tile.
  const int64_t tile = std::max<int64_t>(8, std::min<int64_t>(64, N / (8 * omp_get_num_threads())));
  const int64_t num_tiles = (N + tile - 1) / tile;
  constexpr int64_t kRowBlock = 96;  // a multiple of the 6- and 3-row micro-kernels
  const int64_t num_row_blocks = (M + kRowBlock - 1) / kRowBlock;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_row_blocks * num_tiles; ++item) {
    const int64_t t = item % num_tiles, b = item / num_tiles;
    const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
    const int64_t r0 = b * kRowBlock, r1 = std::min(M, r0 + kRowBlock);
    const int64_t r6 = r0 + (r1 - r0) / 6 * 6;
    rows_block<6>(x, ldx, r0, r6, w, K, n0, n1, bias, y, ldy);
    int64_t m = r6;
    if (r1 - r6 >= 3) {
      rows_block<3>(x, ldx, r6, r6 + 3, w, K, n0, n1, bias, y, ldy);
      m += 3;
    }
    for (; m < r1; ++m) rows_block<1>(x, ldx, m, m + 1, w, K, n0, n1, bias, y, ldy);
  }
}

template <typename T, typename TX, typename TY>
void linear(const TX* x, int64_t ldx, int64_t M, int64_t K, const T* w, int64_t N,
            const float* bias, TY* y, int64_t ldy) {
#pragma omp parallel
  linear_tiles(x, ldx, M, K, w, N, bias, y, ldy);
}

}  // namespace pagedllm
