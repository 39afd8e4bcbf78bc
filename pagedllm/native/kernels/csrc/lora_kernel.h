// Grouped LoRA products for the CPU (Punica's SGMV, Chen et al. 2023; S-LoRA, Sheng et al.
// 2023): the adapter tokens of a step, sorted by adapter slot into segments, each multiplied by
// its slot's A^T (shrink) and then B^T (expand), added to the base layer's output. Base tokens are
// in no segment and are never touched. Used inside the fused decoder layer (cpu_decoder.cpp,
// after each of its four linears) and by the module path's entry points (cpu_lora.cpp).
//
// Layouts (LoRALinearWeights / LoRAStepArgs, pagedllm/native/kernels/abi.py):
//
//   lora_a  [max_loras, width, K]   width = num_slices * R (R = max_lora_rank); slice i's rows
//                                   of A are [i R, i R + rank), the rest zero
//   lora_b  [max_loras, width, N]   B^T: row j of slice i holds that slice's output columns
//                                   [slice_start(i), slice_end[i]); its other columns are zero
//   segments [S, 4]                 (slot, start, end, rank): the tokens token_indices[start:end]
//                                   take slot `slot`, whose adapter has rank <= R
//   shrunk  [num_lora_tokens, width] float32 scratch, indexed like token_indices
//
// A merged layer (qkv = q | k | v, gate_up = gate | up) holds one slice per projection: an
// output column of slice i reads only columns [i R, i R + rank) of the shrunk row, so expand
// costs N * rank per token, not N * width. Shrink: one work item per (segment, row j of A), its
// tokens' dot products over K (the A row is read once per segment). Expand: one work item per
// (segment, tile of output columns), each token's tile accumulated in registers over the rank's
// rows of B^T, vectorized along N (B^T rows are contiguous along N). Math in float32.
#pragma once

#include <algorithm>
#include <cstdint>

#include <omp.h>

#include "cpu_vec.h"
#include "pagedllm_abi.h"

namespace pagedllm::lora {

// sum_k a[k] * b[k] in float32.
template <typename TA, typename TB>
inline float dot(const TA* a, const TB* b, int64_t n) {
  int64_t k = 0;
  float s = 0.f;
#ifdef PAGEDLLM_AVX2
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    acc0 = _mm256_fmadd_ps(load8(a + k), load8(b + k), acc0);
    acc1 = _mm256_fmadd_ps(load8(a + k + 8), load8(b + k + 8), acc1);
  }
  for (; k + 8 <= n; k += 8) acc0 = _mm256_fmadd_ps(load8(a + k), load8(b + k), acc0);
  s = hsum(_mm256_add_ps(acc0, acc1));
#endif
  for (; k < n; ++k) s += to_float(a[k]) * to_float(b[k]);
  return s;
}

inline int64_t width(const LoRALinearWeights& w) { return w.num_slices * w.max_rank; }

// shrunk[i, j] = x[token_indices[i]] . A[slot, j] for every segment's tokens i and the rows j of
// A its rank uses (an orphaned work-sharing loop: call from every thread of a parallel region,
// or serially outside one; it ends with a barrier).
template <typename TX, typename TW>
void shrink_tiles(const TX* x, int64_t ldx, const LoRALinearWeights& w, const LoRAStepArgs& step,
                  float* shrunk) {
  const int64_t W = width(w), K = w.in_features;
  const TW* a = static_cast<const TW*>(w.lora_a);
#pragma omp for schedule(static)
  for (int64_t item = 0; item < step.num_segments * W; ++item) {
    const int64_t* seg = step.segments + (item / W) * 4;
    const int64_t j = item % W;
    if (j % w.max_rank >= seg[3]) continue;   // beyond this adapter's rank: never read
    const TW* row = a + (seg[0] * W + j) * K;
    for (int64_t i = seg[1]; i < seg[2]; ++i)
      shrunk[i * W + j] = dot(x + step.token_indices[i] * ldx, row, K);
  }
}

// y[token, n0:n1) += shrunk[i, col:col + rank) @ B^T[slot, col:col + rank, n0:n1) for one token,
// with the tile accumulated in float32 (n1 - n0 <= kExpandTile).
constexpr int64_t kExpandTile = 64;

template <typename TW, typename TY>
inline void expand_tile(const float* t, const TW* bt, int64_t N, int64_t rank, int64_t n0,
                        int64_t n1, TY* y) {
  float acc[kExpandTile];
  const int64_t len = n1 - n0;
  for (int64_t n = 0; n < len; ++n) acc[n] = 0.f;
  int64_t n = 0;
#ifdef PAGEDLLM_AVX2
  if (len == kExpandTile) {
    __m256 v[kExpandTile / 8];
    for (int q = 0; q < kExpandTile / 8; ++q) v[q] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 tr = _mm256_set1_ps(t[r]);
      const TW* row = bt + r * N + n0;
      for (int q = 0; q < kExpandTile / 8; ++q)
        v[q] = _mm256_fmadd_ps(tr, load8(row + 8 * q), v[q]);
    }
    for (int q = 0; q < kExpandTile / 8; ++q) _mm256_storeu_ps(acc + 8 * q, v[q]);
    n = len;
  }
#endif
  for (int64_t r = 0; r < rank && n < len; ++r) {
    const TW* row = bt + r * N + n0;
    for (int64_t c = 0; c < len; ++c) acc[c] += t[r] * to_float(row[c]);
  }
  for (int64_t c = 0; c < len; ++c) store(to_float(y[n0 + c]) + acc[c], y + n0 + c);
}

// The expand of every segment (an orphaned work-sharing loop, as shrink_tiles). Tiles never
// cross a slice boundary, so each reads one slice's columns of the shrunk row.
template <typename TW, typename TY>
void expand_tiles(const float* shrunk, const LoRALinearWeights& w, const LoRAStepArgs& step,
                  TY* y, int64_t ldy) {
  const int64_t W = width(w), N = w.out_features, R = w.max_rank;
  const TW* b = static_cast<const TW*>(w.lora_b);
  // Tiles per slice, then the tile index space: slice-major, kExpandTile columns each.
  int64_t tiles[3] = {0, 0, 0}, total = 0;
  for (int64_t s = 0, start = 0; s < w.num_slices; start = w.slice_end[s++]) {
    tiles[s] = (w.slice_end[s] - start + kExpandTile - 1) / kExpandTile;
    total += tiles[s];
  }
#pragma omp for schedule(static)
  for (int64_t item = 0; item < step.num_segments * total; ++item) {
    const int64_t* seg = step.segments + (item / total) * 4;
    int64_t tile = item % total, s = 0;
    while (tile >= tiles[s]) tile -= tiles[s++];
    const int64_t start = s == 0 ? 0 : w.slice_end[s - 1];
    const int64_t n0 = start + tile * kExpandTile;
    const int64_t n1 = std::min(w.slice_end[s], n0 + kExpandTile);
    const TW* bt = b + (seg[0] * W + s * R) * N;
    for (int64_t i = seg[1]; i < seg[2]; ++i)
      expand_tile(shrunk + i * W + s * R, bt, N, seg[3], n0, n1,
                  y + step.token_indices[i] * ldy);
  }
}

// y[tokens] += (x[tokens] A^T) B^T per segment, inside a parallel region (both phases' loops
// end with a barrier, so `shrunk` is complete before expand reads it). x and y float32 (the
// fused decoder's activations); A/B float32 (dtype 0) or bfloat16 (dtype 1).
inline void apply_tiles(const LoRALinearWeights& w, const LoRAStepArgs& step, const float* x,
                        int64_t ldx, float* y, int64_t ldy, float* shrunk) {
  if (w.dtype == 0) {
    shrink_tiles<float, float>(x, ldx, w, step, shrunk);
    expand_tiles<float, float>(shrunk, w, step, y, ldy);
  } else {
    shrink_tiles<float, uint16_t>(x, ldx, w, step, shrunk);
    expand_tiles<uint16_t, float>(shrunk, w, step, y, ldy);
  }
}

// The number of adapter tokens of a step (the end of its last segment).
inline int64_t num_tokens(const LoRAStepArgs& step) {
  int64_t m = 0;
  for (int64_t s = 0; s < step.num_segments; ++s) m = std::max(m, step.segments[s * 4 + 2]);
  return m;
}

}  // namespace pagedllm::lora
