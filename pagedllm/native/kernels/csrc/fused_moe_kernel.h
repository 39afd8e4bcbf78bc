// The routed experts of one mixture-of-experts layer as phases of an OpenMP parallel region, shared
// by cpu_fused_moe.cpp (the experts alone, `fused_experts`) and cpu_moe_block.cpp (the whole MoE
// block: router, routing, experts, shared expert):
//
//   out[t] = sum over j < k with a local expert e = topk_ids[t, j]:
//            topk_weights[t, j] * (silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T)) @ W2[e]^T
//
//   0. `plan` (serial)  counting sort of the T*k (token, slot) pairs by local expert, stable (an
//                expert's rows keep token order); ids < 0 or >= num_experts (another rank's
//                expert under expert parallelism) are dropped:
//                  sorted rows [ expert 0 | expert 1 | ... ],  pos[t*k + j] = row or -1
//   1. gather    xs[row] = x[token of row]                                  [m, H]
//   2. gate/up   per work item (expert, block of <= 96 rows, tile of intermediate columns):
//                gate and up tiles by the register-blocked micro-kernels of linear_kernel.h,
//                then act[row, i] = silu(gate) * up                          [m, I]
//   3. down      per work item (expert, row block, tile of hidden columns):
//                ys[rows] = act[rows] @ W2[e]^T                              [m, H]
//   4. combine   per token and column: sum_j w[t, j] * ys[pos[t*k + j]], in slot order
//                j = 0..k-1 (`routed_sum`): deterministic, no atomics.
//
// Phases 1-3 (`expert_phases`) are orphaned work-sharing loops: every thread of the enclosing
// region calls them, and each ends with the loop's implicit barrier. Each weight tile is read
// once per block of up to 96 rows of its expert (not once per token), and the work items of all
// experts share one loop, so a batch-1 decode with two active experts still spreads over every
// thread.
//
// Rounding: activations are in the model dtype TA (float32 or bfloat16), weights TW (float32 or
// bfloat16), math in float32. With bfloat16 activations every intermediate is rounded where the
// module path's torch ops round it: gate and up (GEMM outputs), silu(gate), silu(gate) * up, the
// down GEMM's output, each weighted row; the k weighted rows of a token are summed in float32
// and rounded once by the caller (torch's bf16 sum accumulates in float32).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "linear_kernel.h"

namespace pagedllm {
namespace moe {

constexpr int64_t kRowBlock = 96;    // rows per work item: a multiple of the 6/3-row kernels
constexpr int64_t kMaxTile = 64;     // weight rows per work item (a tile stays in L2)
constexpr int64_t kCombineChunk = 256;
constexpr int64_t kPanel = 16;            // rows of x per panel of the transposed layout
constexpr int64_t kPanelMinRows = 32;     // a row block this long takes the panel form
#ifdef PAGEDLLM_AVX512
constexpr int64_t kPanelsPerStep = 2;     // adjacent panels sharing each weight broadcast
#else
constexpr int64_t kPanelsPerStep = 1;
#endif

// The bfloat16 value nearest to v (round to nearest even), as a float.
inline float round_to(float v, const uint16_t*) {
  uint16_t b;
  store(v, &b);
  return to_float(b);
}

inline float round_to(float v, const float*) { return v; }

// v rounded to T's precision (float32: unchanged).
template <typename T>
inline float rounded(float v) {
  return round_to(v, static_cast<const T*>(nullptr));
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

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
// The AVX-512 form of `few_rows_micro` (K a multiple of 16): 16 lanes over k, then the
// horizontal sum; with 32 vector registers more weight rows share each x load. The sums differ
// from the 8-lane form's only in their order.
template <int MB, int NB, typename TW, typename TX, typename TY>
inline void few_rows_micro16(const TX* x, int64_t ldx, const TW* w, int64_t K, TY* y,
                             int64_t ldy) {
  constexpr int64_t kLine = 64 / sizeof(TW);   // weights per cache line
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    if (k % kLine == 0)
      for (int j = 0; j < NB; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (j + NB) * K + k), _MM_HINT_T0);
    __m512 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = load16(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const __m512 xv = load16(x + i * ldx + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) store(hsum(acc[i][j]), y + i * ldy + j);
}

// Rows [0, MB) of x against weight rows [0, n), in one pass over the weights (AVX-512).
template <int MB, typename TW, typename TX, typename TY>
void few_rows16(const TX* x, int64_t ldx, const TW* w, int64_t K, int64_t n, TY* y,
                int64_t ldy) {
  // As many weight rows per step as the 32 registers hold next to MB x NB accumulators (and
  // enough independent sums to cover the FMA latency at one row).
  constexpr int NB = MB <= 3 ? 6 : (MB <= 6 ? 4 : (MB <= 8 ? 3 : 2));
  int64_t j = 0;
  for (; j + NB <= n; j += NB) few_rows_micro16<MB, NB>(x, ldx, w + j * K, K, y + j, ldy);
  for (; j < n; ++j) few_rows_micro16<MB, 1>(x, ldx, w + j * K, K, y + j, ldy);
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

// One expert's contiguous block of sorted rows [r0, r1); its x and act rows lie from row s0 of
// xs / act (`panel`: as panels, header of `panel_form`), its outputs at rows [r0, r1) of ys.
struct RowBlock {
  int64_t expert, r0, r1, s0;
  bool panel;
};

// Whether a block of `rows` rows runs in the panel form: float32 activations and weights (the
// form computes in float32 on x as given), and rows enough that the padding to whole panels
// and the transposes are small next to the multiply-adds.
//
// Panel form (prefill-sized blocks): the block's x rows are stored transposed, in panels of
// kPanel rows, [K][kPanel] each (row r, value k at k * kPanel + r % kPanel of panel r /
// kPanel; a last panel padded with zero rows), and the products are computed as
// y^T = W x^T by outer-product register tiles (as packed_gemm.h's) with the weight rows in the
// broadcast operand and the x panel in the other (`panel_micro`): one panel load per MR
// multiply-adds and no horizontal sums, where the dot-product kernels (`tile_gemm`) load x and
// w once each per multiply-add group and sum 8 lanes per output. The gate / up outputs come out
// transposed, so silu(gate) * up is written as act panels directly ([I][kPanel]), the down
// GEMM's input; its outputs are transposed back into ys rows.
template <typename TA, typename TW>
constexpr bool panel_form_types() {
  return std::is_same_v<TA, float> && std::is_same_v<TW, float>;
}

// Columns per tile so that the work items number about 8 per thread (at least 8 columns, at
// most `max_tile`).
inline int64_t tile_width(int64_t columns, int64_t num_blocks, int num_threads,
                          int64_t max_tile) {
  const int64_t want = (columns * num_blocks + 8 * num_threads - 1) / (8 * num_threads);
  return std::max<int64_t>(8, std::min<int64_t>(max_tile, want));
}

// Buffers of one call that the calling thread keeps for its next calls (slots below): a
// prefill-sized call's intermediates are tens of MB, and fresh allocations of that size are
// mmap'ed and page-faulted in again at every call (~15K faults, ~10% of a 2048-token DeepSeek
// MoE block). Slot s of this thread holds at least n elements of T (grown, never shrunk;
// contents unspecified); a pointer stays valid until the same slot is asked for again on this
// thread.
enum BufferSlot { kSlotXs, kSlotAct, kSlotYs, kSlotScratch, kSlotShared0, kSlotShared1,
                  kSlotShared2, kNumSlots };

template <typename T>
T* reused_buffer(BufferSlot slot, int64_t n) {
  thread_local std::unique_ptr<char[]> data[kNumSlots];
  thread_local size_t capacity[kNumSlots] = {};
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, n)) * sizeof(T);
  if (bytes > capacity[slot]) {
    data[slot].reset();   // freed before the larger allocation: the peak stays one buffer
    data[slot].reset(new char[bytes]);
    capacity[slot] = bytes;
  }
  return reinterpret_cast<T*>(data[slot].get());
}

// The sorted pairs of one step and the buffers of phases 1-3 (built by `plan`, serially).
template <typename TA>
struct Plan {
  int64_t num_pairs = 0, m = 0, H = 0, I = 0, stored = 0;
  std::vector<int64_t> pos, token_of_row;   // [T*k] row or -1; [m] token
  std::vector<RowBlock> blocks;
  int64_t tile_i = 8, tile_h = 8, tiles_i = 0, tiles_h = 0, scratch_size = 0;
  // [stored, H], [stored, I] (rows padded to whole panels), [m, H], per thread: buffers of the
  // thread that ran `plan` (`reused_buffer`), valid until it plans again
  TA *xs = nullptr, *act = nullptr, *ys = nullptr, *scratch = nullptr;
};

// For weights TW: blocks of kPanelMinRows rows or more take the panel form when
// `panel_form_types<TA, TW>`.
template <typename TA, typename TW>
void plan(const int64_t* topk_ids, int64_t num_tokens, int64_t top_k, int64_t num_experts,
          int64_t H, int64_t I, int num_threads, Plan<TA>& p) {
  constexpr bool panels = panel_form_types<TA, TW>();
  p.num_pairs = num_tokens * top_k;
  p.H = H;
  p.I = I;
  std::vector<int64_t> offsets(num_experts + 1, 0);
  for (int64_t q = 0; q < p.num_pairs; ++q) {
    const int64_t e = topk_ids[q];
    if (e >= 0 && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  p.m = offsets[num_experts];
  p.pos.assign(p.num_pairs, -1);
  p.token_of_row.resize(p.m);
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t q = 0; q < p.num_pairs; ++q) {
      const int64_t e = topk_ids[q];
      if (e < 0 || e >= num_experts) continue;
      p.pos[q] = next[e]++;
      p.token_of_row[p.pos[q]] = q / top_k;
    }
  }
  p.blocks.clear();
  p.stored = 0;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += kRowBlock) {
      const int64_t r1 = std::min(offsets[e + 1], r0 + kRowBlock);
      const bool panel = panels && r1 - r0 >= kPanelMinRows;
      p.blocks.push_back({e, r0, r1, p.stored, panel});
      p.stored += panel ? (r1 - r0 + kPanel - 1) / kPanel * kPanel : r1 - r0;
    }
  const int64_t num_blocks = static_cast<int64_t>(p.blocks.size());
  // Blocks of up to 8 rows (a decode step's) read each weight tile once whatever its width, so
  // the tiles need not stay in L2 and may span a whole matrix when the threads are few: fewer,
  // longer streams (one expert's gate and up rows are adjacent, so gate then up is one stream),
  // each paying its restart of the prefetchers once. A single-thread batch-1 decode's routed
  // experts run ~5% faster (docs/benchmarks.md, "Batch 1 against llama.cpp"); the sums are
  // unchanged (each output is the same dot product).
  int64_t max_rows = 0;
  for (const RowBlock& b : p.blocks) max_rows = std::max(max_rows, b.r1 - b.r0);
  const bool few_rows = max_rows <= 8;
  p.tile_i = tile_width(I, num_blocks, num_threads, few_rows ? I : kMaxTile);
  p.tile_h = tile_width(H, num_blocks, num_threads, few_rows ? H : kMaxTile);
  p.tiles_i = (I + p.tile_i - 1) / p.tile_i;
  p.tiles_h = (H + p.tile_h - 1) / p.tile_h;
  p.xs = reused_buffer<TA>(kSlotXs, p.stored * H);
  p.act = reused_buffer<TA>(kSlotAct, p.stored * I);
  p.ys = reused_buffer<TA>(kSlotYs, p.m * H);
  // Per thread: the gate and up tiles of one work item (panel form: [np][tile][kPanel] each).
  p.scratch_size = 2 * std::max(kRowBlock * p.tile_i, kPanelsPerStep * kMaxTile * kPanel);
  p.scratch = reused_buffer<TA>(kSlotScratch, p.scratch_size * num_threads);
}

// c[j][0..kPanel) = the products of weight rows w[j] (K values each) with the panel's kPanel
// columns (x rows), for j < MR: an outer-product register tile (one panel row load per MR
// broadcasts of w and 2 MR multiply-adds; the order of packed_gemm.h's micro-kernels, written
// here so that it is inlined into its loop: a separate copy kept the tile on the stack).
template <int MR>
__attribute__((always_inline)) inline void panel_micro(const float* w, int64_t K,
                                                       const float* panel, float* c) {
#ifdef PAGEDLLM_AVX2
  static_assert(kPanel == 16, "two ymm per panel row");
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m256 p0 = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 p1 = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 wv = _mm256_broadcast_ss(w + i * K + k);
      acc[i][0] = _mm256_fmadd_ps(wv, p0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(wv, p1, acc[i][1]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(c + i * kPanel, acc[i][0]);
    _mm256_storeu_ps(c + i * kPanel + 8, acc[i][1]);
  }
#else
  for (int i = 0; i < MR; ++i)
    for (int r = 0; r < kPanel; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += w[i * K + k] * panel[k * kPanel + r];
      c[i * kPanel + r] = sum;
    }
#endif
}

#ifdef PAGEDLLM_AVX512
// The AVX-512 form of `panel_micro` over NP adjacent panels (panel q at panel + q * kPanel * K):
// one zmm per panel row, MR weight rows broadcast against NP panel rows, so one broadcast per NP
// multiply-adds (the AVX2 form: one per 2 half-rows of one panel). Outputs of panel q at
// c + q * cq, [MR][kPanel]. Each output is the same k-ordered chain of multiply-adds as the
// AVX2 form's, so both give the same bits.
template <int MR, int NP>
__attribute__((always_inline)) inline void panel_micro16(const float* w, int64_t K,
                                                         const float* panel, float* c,
                                                         int64_t cq) {
  static_assert(kPanel == 16, "one zmm per panel row");
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 pv[NP];
    for (int q = 0; q < NP; ++q) pv[q] = _mm512_loadu_ps(panel + q * kPanel * K + k * kPanel);
    for (int i = 0; i < MR; ++i) {
      const __m512 wv = _mm512_set1_ps(w[i * K + k]);
      for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_fmadd_ps(wv, pv[q], acc[i][q]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) _mm512_storeu_ps(c + q * cq + i * kPanel, acc[i][q]);
}

// Weight rows [0, n) against NP panels: 12-row register tiles (24 accumulators at NP = 2), then
// 8 / 4 / 2 / 1 rows.
template <int NP>
inline void panel_gemm16(const float* w, int64_t K, const float* panel, int64_t n, float* c) {
  const int64_t cq = n * kPanel;
  int64_t j = 0;
  for (; j + 12 <= n; j += 12) panel_micro16<12, NP>(w + j * K, K, panel, c + j * kPanel, cq);
  if (n - j >= 8) {
    panel_micro16<8, NP>(w + j * K, K, panel, c + j * kPanel, cq);
    j += 8;
  }
  if (n - j >= 4) {
    panel_micro16<4, NP>(w + j * K, K, panel, c + j * kPanel, cq);
    j += 4;
  }
  if (n - j >= 2) {
    panel_micro16<2, NP>(w + j * K, K, panel, c + j * kPanel, cq);
    j += 2;
  }
  if (n - j >= 1) panel_micro16<1, NP>(w + j * K, K, panel, c + j * kPanel, cq);
}
#endif

// c[q][j][0..kPanel) (panel q's outputs at c + q * n * kPanel) for the weight rows j < n and
// the np <= kPanelsPerStep adjacent panels from `panel` (panel q at panel + q * kPanel * K):
// AVX-512 the two-panel tiles (`panel_gemm16`), else 6-row tiles per panel, then one for the
// rest.
inline void panel_gemm(const float* w, int64_t K, const float* panel, int64_t np, int64_t n,
                       float* c) {
#ifdef PAGEDLLM_AVX512
  if (np == 2) return panel_gemm16<2>(w, K, panel, n, c);
  return panel_gemm16<1>(w, K, panel, n, c);
#else
  (void)np;   // kPanelsPerStep == 1
  int64_t j = 0;
  for (; j + 6 <= n; j += 6) panel_micro<6>(w + j * K, K, panel, c + j * kPanel);
  w += j * K;
  c += j * kPanel;
  switch (n - j) {
    case 5: panel_micro<5>(w, K, panel, c); break;
    case 4: panel_micro<4>(w, K, panel, c); break;
    case 3: panel_micro<3>(w, K, panel, c); break;
    case 2: panel_micro<2>(w, K, panel, c); break;
    case 1: panel_micro<1>(w, K, panel, c); break;
    default: break;
  }
#endif
}

// Phases 1-3 for every thread of the enclosing parallel region (w13 [E, 2I, H], w2 [E, H, I]).
template <typename TA, typename TW>
void expert_phases(const TA* hidden, const TW* w13, const TW* w2, Plan<TA>& p) {
  const int64_t H = p.H, I = p.I;
  const int64_t num_blocks = static_cast<int64_t>(p.blocks.size());
#pragma omp for schedule(dynamic, 1)
  for (int64_t bi = 0; bi < num_blocks; ++bi) {
    const RowBlock& b = p.blocks[bi];
    TA* xs = p.xs + b.s0 * H;
    if (!b.panel) {
      for (int64_t r = b.r0; r < b.r1; ++r)
        std::copy(hidden + p.token_of_row[r] * H, hidden + (p.token_of_row[r] + 1) * H,
                  xs + (r - b.r0) * H);
      continue;
    }
    const int64_t rows = b.r1 - b.r0, padded = (rows + kPanel - 1) / kPanel * kPanel;
    std::fill(xs + rows / kPanel * kPanel * H, xs + padded * H, TA{});
    for (int64_t r = 0; r < rows; ++r) {
      const TA* src = hidden + p.token_of_row[b.r0 + r] * H;
      TA* dst = xs + r / kPanel * kPanel * H + r % kPanel;
      for (int64_t k = 0; k < H; ++k) dst[k * kPanel] = src[k];
    }
  }

  TA* gate = p.scratch + omp_get_thread_num() * p.scratch_size;
  TA* up = gate + p.scratch_size / 2;
  const int64_t tile_i = p.tile_i, tiles_i = p.tiles_i;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_blocks * tiles_i; ++item) {
    const RowBlock& b = p.blocks[item / tiles_i];
    const int64_t n0 = (item % tiles_i) * tile_i, n = std::min(I, n0 + tile_i) - n0;
    const int64_t rows = b.r1 - b.r0;
    const TW* w_gate = w13 + (b.expert * 2 * I + n0) * H;
    const TW* w_up = w_gate + I * H;
    const TA* x = p.xs + b.s0 * H;
    if constexpr (panel_form_types<TA, TW>()) {
      if (b.panel) {
        const int64_t num_panels = (rows + kPanel - 1) / kPanel;
        for (int64_t q = 0; q < num_panels; q += kPanelsPerStep) {
          const int64_t np = std::min(kPanelsPerStep, num_panels - q);
          const float* panel = x + q * kPanel * H;
          panel_gemm(w_gate, H, panel, np, n, gate);
          panel_gemm(w_up, H, panel, np, n, up);
          for (int64_t pp = 0; pp < np; ++pp) {
            float* a = p.act + (b.s0 + (q + pp) * kPanel) * I + n0 * kPanel;
            const float* g = gate + pp * n * kPanel;
            const float* u = up + pp * n * kPanel;
            for (int64_t i = 0; i < n * kPanel; ++i) a[i] = silu(g[i]) * u[i];
          }
        }
        continue;
      }
    }
    tile_gemm(x, H, rows, w_gate, H, n, gate, tile_i);
    tile_gemm(x, H, rows, w_up, H, n, up, tile_i);
    for (int64_t r = 0; r < rows; ++r) {
      TA* a = p.act + (b.s0 + r) * I + n0;
      for (int64_t i = 0; i < n; ++i) {
        const float g = rounded<TA>(silu(to_float(gate[r * tile_i + i])));
        store(g * to_float(up[r * tile_i + i]), a + i);
      }
    }
  }

  const int64_t tile_h = p.tile_h, tiles_h = p.tiles_h;
#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < num_blocks * tiles_h; ++item) {
    const RowBlock& b = p.blocks[item / tiles_h];
    const int64_t n0 = (item % tiles_h) * tile_h, n = std::min(H, n0 + tile_h) - n0;
    const TW* w = w2 + (b.expert * H + n0) * I;
    if constexpr (panel_form_types<TA, TW>()) {
      if (b.panel) {
        const int64_t num_panels = (b.r1 - b.r0 + kPanel - 1) / kPanel;
        for (int64_t q = 0; q < num_panels; q += kPanelsPerStep) {
          const int64_t np = std::min(kPanelsPerStep, num_panels - q);
          panel_gemm(w, I, p.act + (b.s0 + q * kPanel) * I, np, n, gate);
          for (int64_t pp = 0; pp < np; ++pp) {
            const int64_t r0 = b.r0 + (q + pp) * kPanel, rows = std::min(kPanel, b.r1 - r0);
            const float* c = gate + pp * n * kPanel;
            for (int64_t r = 0; r < rows; ++r) {
              float* y = p.ys + (r0 + r) * H + n0;
              for (int64_t j = 0; j < n; ++j) y[j] = c[j * kPanel + r];
            }
          }
        }
        continue;
      }
    }
    tile_gemm(p.act + b.s0 * I, I, b.r1 - b.r0, w, I, n, p.ys + b.r0 * H + n0, H);
  }
}

// acc[c - c0] = sum_j rounded(ys[pos[t, j], c] * w[t, j]) for columns [c0, c1), float32, slot
// by slot (phase 4 of one token's column chunk).
template <typename TA>
void routed_sum(const Plan<TA>& p, const float* topk_weights, int64_t top_k, int64_t t,
                int64_t c0, int64_t c1, float* acc) {
  std::fill(acc, acc + (c1 - c0), 0.f);
  for (int64_t j = 0; j < top_k; ++j) {
    const int64_t row = p.pos[t * top_k + j];
    if (row < 0) continue;
    const float wt = topk_weights[t * top_k + j];
    const TA* y = p.ys + row * p.H;
    for (int64_t c = c0; c < c1; ++c) acc[c - c0] += rounded<TA>(to_float(y[c]) * wt);
  }
}

}  // namespace moe
}  // namespace pagedllm
