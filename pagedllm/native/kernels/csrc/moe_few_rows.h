// The dot-product form of the routed experts' GEMMs (`tile_gemm`): an expert's few rows (a
// decode step's share, under fused_moe_kernel.h's kPanelMinRows) against a tile of its weight
// rows in one pass over those weights, which stream from memory once per step. Kept apart from
// fused_moe_kernel.h's phases and panel form (the prefill-sized blocks), which include it.

#pragma once

#include <cstdint>

#include "linear_kernel.h"

namespace pagedllm {
namespace moe {

#ifdef PAGEDLLM_AVX2
// y[i][j] = dot(x[i], w[j]) for i < MB, j < NB, K a multiple of 8: linear_kernel.h's `micro`
// (the same sums: 8 lanes over k, then the horizontal sum, so the same bits), prefetching the
// next NB weight rows while these stream in. An expert's decode share of a step (a few rows)
// reads its weights from DRAM once; without the prefetch the core waits on each row's first
// lines (the hardware prefetcher restarts at every row, 2 KiB long at K = 512 float32).
template <int MB, int NB, typename TW, typename TX, typename TY>
inline void few_rows_micro(const TX* x, int64_t ldx, const TW* w, int64_t K, TY* y,
                           int64_t ldy) {
  constexpr int64_t kLine = 64 / sizeof(TW);   // weights per cache line
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if (k % kLine == 0)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + NB) * K + k), _MM_HINT_T0);
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load8(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m256 xv = load8(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) store(hsum(acc[i][j]), y + i * ldy + j);
}

// Rows [0, MB) of x against weight rows [0, n), in one pass over the weights.
template <int MB, typename TW, typename TX, typename TY>
void few_rows(const TX* x, int64_t ldx, const TW* w, int64_t K, int64_t n, TY* y,
              int64_t ldy) {
  // As many weight rows per step as the 16 registers hold next to MB x NB accumulators.
  constexpr int NB = MB <= 2 ? 4 : (MB <= 4 ? 3 : (MB <= 6 ? 2 : 1));
  int64_t j = 0;
  for (; j + NB <= n; j += NB) few_rows_micro<MB, NB>(x, ldx, w + j * K, K, y + j, ldy);
  for (; j < n; ++j) few_rows_micro<MB, 1>(x, ldx, w + j * K, K, y + j, ldy);
}
#endif

#ifdef PAGEDLLM_AVX512
// 16 weights at w as float32 for `few_rows_micro16`: float32 loaded as is; bfloat16 (with
// AVX512BW) by one word permutation that moves weight l into the high half of lane l and zeroes
// the low halves (`shift`: `widen_index()`), where `load16` takes a zero extension and a shift
// (two vector operations, on the ports the FMAs use). The same values, hence the same sums.
inline __m512i widen_index() {
#ifdef __AVX512BW__
  return _mm512_slli_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 16);
#else
  return _mm512_setzero_si512();
#endif
}

inline __m512 weights16(const float* w, __m512i) { return _mm512_loadu_ps(w); }

inline __m512 weights16(const uint16_t* w, __m512i shift) {
#ifdef __AVX512BW__
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(
      _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, shift, _mm512_castsi256_si512(raw)));
#else
  (void)shift;
  return load16(w);
#endif
}

// The AVX-512 form of `few_rows_micro` (K a multiple of 16): 16 lanes over k, then the
// horizontal sum; with 32 vector registers more weight rows share each x load. The sums differ
// from the 8-lane form's only in their order. The NB weight rows are `lane` rows apart (row j
// at w + j * lane * K, its outputs in column j * lane of y); each row's next row in its lane
// (K values on) is prefetched while it streams in.
template <int MB, int NB, typename TW, typename TX, typename TY>
inline void few_rows_micro16(const TX* x, int64_t ldx, const TW* w, int64_t K, TY* y,
                             int64_t ldy, int64_t lane) {
  constexpr int64_t kLine = 64 / sizeof(TW);   // weights per cache line
  const __m512i shift = widen_index();
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const TW* row[NB];
  for (int j = 0; j < NB; ++j) row[j] = w + j * lane * K;
  for (int64_t k = 0; k < K; k += 16) {
    if (k % kLine == 0)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(row[j] + K + k), _MM_HINT_T0);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = weights16(row[j] + k, shift);
      // NOTE(moe): kept in a register: without this GCC folded the load into each of the MB
      // FMAs that use it (MB loads of every weight line; the FMAs alone ran ~8% slower with
      // the weights in L2, docs/benchmarks.md, "DeepSeek float32 at batch 32").
      asm("" : "+v"(wv[j]));
    }
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = load16(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) store(hsum(acc[i][j]), y + i * ldy + j * lane);
}

// Rows [0, MB) of x against weight rows [0, n), in one pass over the weights (AVX-512): the
// rows in NB lanes of n / NB consecutive rows each (then the last n % NB rows one at a time),
// one row of every lane per micro-kernel call. Each lane reads a contiguous run of memory in
// address order, which the hardware prefetchers follow as NB separate streams; NB adjacent
// rows at a time (the form before 2026-12-07) put two rows' streams in each 4 KiB page and
// left the stream to the software prefetches: a 32-row DeepSeek-V2-Lite 200M decode step's
// experts ran ~5-9% slower (docs/benchmarks.md, "DeepSeek float32 at batch 32"). Every output
// is the same dot product either way (the same bits).
template <int MB, typename TW, typename TX, typename TY>
void few_rows16(const TX* x, int64_t ldx, const TW* w, int64_t K, int64_t n, TY* y,
                int64_t ldy) {
  // As many weight rows per step as the 32 registers hold next to MB x NB accumulators (and
  // enough independent sums to cover the FMA latency at one row).
  constexpr int NB = MB <= 3 ? 6 : (MB <= 6 ? 4 : (MB <= 8 ? 3 : 2));
  const int64_t per_lane = n / NB;
  for (int64_t j = 0; j < per_lane; ++j)
    few_rows_micro16<MB, NB>(x, ldx, w + j * K, K, y + j, ldy, per_lane);
  for (int64_t j = per_lane * NB; j < n; ++j)
    few_rows_micro16<MB, 1>(x, ldx, w + j * K, K, y + j, ldy, 1);
}

// Up to kFewRows16 rows in one pass over the weights; false (nothing done) for more rows or K
// not a multiple of 16.
constexpr int64_t kFewRows16 = 12;

template <typename TW, typename TX, typename TY>
bool tile_gemm16(const TX* x, int64_t ldx, int64_t rows, const TW* w, int64_t K, int64_t n,
                 TY* y, int64_t ldy) {
  if (K % 16 != 0) return false;
  switch (rows) {
    case 1: few_rows16<1>(x, ldx, w, K, n, y, ldy); return true;
    case 2: few_rows16<2>(x, ldx, w, K, n, y, ldy); return true;
    case 3: few_rows16<3>(x, ldx, w, K, n, y, ldy); return true;
    case 4: few_rows16<4>(x, ldx, w, K, n, y, ldy); return true;
    case 5: few_rows16<5>(x, ldx, w, K, n, y, ldy); return true;
    case 6: few_rows16<6>(x, ldx, w, K, n, y, ldy); return true;
    case 7: few_rows16<7>(x, ldx, w, K, n, y, ldy); return true;
    case 8: few_rows16<8>(x, ldx, w, K, n, y, ldy); return true;
    case 9: few_rows16<9>(x, ldx, w, K, n, y, ldy); return true;
    case 10: few_rows16<10>(x, ldx, w, K, n, y, ldy); return true;
    case 11: few_rows16<11>(x, ldx, w, K, n, y, ldy); return true;
    case 12: few_rows16<12>(x, ldx, w, K, n, y, ldy); return true;
    default: return false;
  }
}
#endif

// y[r, n] = dot(x[r], w[n]) for rows [0, rows) of x, weight rows [0, n) of w (K each).
// AVX-512 (K a multiple of 16): up to 12 rows in one pass over the tile's weights
// (`tile_gemm16`, one row included). AVX2: up to 8 rows (an expert's typical decode share) take
// one pass (`few_rows`; one row: linear_kernel.h's GEMV kernel, which prefetches itself); more
// rows take 6-row passes, then the rest as few passes as fit the 16 AVX2 registers (5 rows:
// 3 + 2).
template <typename TW, typename TX, typename TY>
void tile_gemm(const TX* x, int64_t ldx, int64_t rows, const TW* w, int64_t K, int64_t n,
               TY* y, int64_t ldy) {
#ifdef PAGEDLLM_AVX512
  if (tile_gemm16(x, ldx, rows, w, K, n, y, ldy)) return;
#endif
#ifdef PAGEDLLM_AVX2
  switch (rows) {
    case 2: return few_rows<2>(x, ldx, w, K, n, y, ldy);
    case 3: return few_rows<3>(x, ldx, w, K, n, y, ldy);
    case 4: return few_rows<4>(x, ldx, w, K, n, y, ldy);
    case 5: return few_rows<5>(x, ldx, w, K, n, y, ldy);
    case 6: return few_rows<6>(x, ldx, w, K, n, y, ldy);
    case 7: return few_rows<7>(x, ldx, w, K, n, y, ldy);
    case 8: return few_rows<8>(x, ldx, w, K, n, y, ldy);
    default: break;
  }
#endif
  const int64_t r6 = rows / 6 * 6;
  rows_block<6>(x, ldx, 0, r6, w, K, 0, n, nullptr, y, ldy);
  switch (rows - r6) {
    case 5:
      rows_block<3>(x, ldx, r6, r6 + 3, w, K, 0, n, nullptr, y, ldy);
      rows_block<2>(x, ldx, r6 + 3, rows, w, K, 0, n, nullptr, y, ldy);
      break;
    case 4: rows_block<4>(x, ldx, r6, rows, w, K, 0, n, nullptr, y, ldy); break;
    case 3: rows_block<3>(x, ldx, r6, rows, w, K, 0, n, nullptr, y, ldy); break;
    case 2: rows_block<2>(x, ldx, r6, rows, w, K, 0, n, nullptr, y, ldy); break;
    case 1: rows_block<1>(x, ldx, r6, rows, w, K, 0, n, nullptr, y, ldy); break;
    default: break;
  }
}

}  // namespace moe
}  // namespace pagedllm
