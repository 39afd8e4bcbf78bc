// The routed experts of one mixture-of-experts layer in one call (CPU), for `fused_experts` in
// pagedllm/layers/fused_moe.py:
//
//   out[t] = sum over j < k with a local expert e = topk_ids[t, j]:
//            topk_weights[t, j] * (silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T)) @ W2[e]^T
//
// Why: the module path is two GEMM calls per active expert plus a dozen torch operations around
// them (sort, gather, un-sort, sum), each paying Python dispatch and an OpenMP fork/join; a
// decode step of a small MoE model spent more time there than streaming the experts' weights.
// Here the whole layer is one OpenMP parallel region whose phases are separated by the implicit
// barriers of their work-sharing loops (as in cpu_decoder.cpp):
//
//   0. (serial)  counting sort of the T*k (token, slot) pairs by local expert, stable (an
//                expert's rows keep token order); ids < 0 or >= num_experts (another rank's
//                expert under expert parallelism) are dropped:
//                  sorted rows [ expert 0 | expert 1 | ... ],  pos[t*k + j] = row or -1
//   1. gather    xs[row] = x[token of row]                                  [m, H]
//   2. gate/up   per work item (expert, block of <= 96 rows, tile of intermediate columns):
//                gate and up tiles by the register-blocked micro-kernels of linear_kernel.h,
//                then act[row, i] = silu(gate) * up                          [m, I]
//   3. down      per work item (expert, row block, tile of hidden columns):
//                ys[rows] = act[rows] @ W2[e]^T                              [m, H]
//   4. combine   per (token, column chunk): out[t] = sum_j w[t, j] * ys[pos[t*k + j]], in slot
//                order j = 0..k-1: deterministic, no atomics.
//
// Each weight tile is read once per block of up to 96 rows of its expert (not once per token),
// and the work items of all experts share one loop, so a batch-1 decode with two active experts
// still spreads over every thread.
//
// Rounding: activations are in the model dtype TA (float32 or bfloat16), weights TW (float32 or
// bfloat16), math in float32. With bfloat16 activations every intermediate is rounded where the
// module path's torch ops round it: gate and up (GEMM outputs), silu(gate), silu(gate) * up, the
// down GEMM's output, each weighted row; the k weighted rows of a token are summed in float32
// and rounded once (torch's bf16 sum accumulates in float32).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <omp.h>

#include "linear_kernel.h"

namespace {

using namespace pagedllm;

constexpr int64_t kRowBlock = 96;    // rows per work item: a multiple of the 6/3-row kernels
constexpr int64_t kMaxTile = 64;     // weight rows per work item (a tile stays in L2)
constexpr int64_t kCombineChunk = 256;

// The bfloat16 value nearest to v (round to nearest even), as a float.
inline float round_to(float v, const uint16_t*) {
  uint16_t b;
  store(v, &b);
  return to_float(b);
}

inline float round_to(float v, const float*) { return v; }

template <typename TA>
inline float rounded(float v) {
  return round_to(v, static_cast<const TA*>(nullptr));
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// y[r, n] = dot(x[r], w[n]) for rows [0, rows) of x, weight rows [0, n) of w (K each).
// Each pass of a micro-kernel over the tile reads its weights once, so the rows past the last
// 6-row pass take as few passes as fit the 16 AVX2 registers: 1-4 rows one pass (MB = 1..4),
// 5 rows two (3 + 2). An expert's typical decode share (a few rows) is then 1-2 passes.
template <typename TW, typename TX, typename TY>
void tile_gemm(const TX* x, int64_t ldx, int64_t rows, const TW* w, int64_t K, int64_t n,
               TY* y, int64_t ldy) {
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

// One expert's contiguous block of sorted rows [r0, r1).
struct RowBlock {
  int64_t expert, r0, r1;
};

// Columns per tile so that the work items number about 8 per thread (at least 8 columns).
int64_t tile_width(int64_t columns, int64_t num_blocks, int num_threads) {
  const int64_t want = (columns * num_blocks + 8 * num_threads - 1) / (8 * num_threads);
  return std::max<int64_t>(8, std::min<int64_t>(kMaxTile, want));
}

template <typename TA, typename TW>
void fused_moe(const TA* hidden, int64_t num_tokens, int64_t H, const TW* w13, const TW* w2,
               int64_t num_experts, int64_t I, const int64_t* topk_ids,
               const float* topk_weights, int64_t top_k, TA* out) {
  const int64_t num_pairs = num_tokens * top_k;
  // 0. Counting sort of the pairs by local expert.
  std::vector<int64_t> offsets(num_experts + 1, 0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const int64_t e = topk_ids[p];
    if (e >= 0 && e < num_experts) ++offsets[e + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[e + 1] += offsets[e];
  const int64_t m = offsets[num_experts];
  std::vector<int64_t> pos(num_pairs, -1), token_of_row(m);
  {
    std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
    for (int64_t p = 0; p < num_pairs; ++p) {
      const int64_t e = topk_ids[p];
      if (e < 0 || e >= num_experts) continue;
      pos[p] = next[e]++;
      token_of_row[pos[p]] = p / top_k;
    }
  }
  std::vector<RowBlock> blocks;
  for (int64_t e = 0; e < num_experts; ++e)
    for (int64_t r0 = offsets[e]; r0 < offsets[e + 1]; r0 += kRowBlock)
      blocks.push_back({e, r0, std::min(offsets[e + 1], r0 + kRowBlock)});
  const int64_t num_blocks = static_cast<int64_t>(blocks.size());

  const int max_threads = omp_get_max_threads();
  const int64_t tile_i = tile_width(I, num_blocks, max_threads);
  const int64_t tile_h = tile_width(H, num_blocks, max_threads);
  const int64_t tiles_i = (I + tile_i - 1) / tile_i, tiles_h = (H + tile_h - 1) / tile_h;
  const int64_t chunks = (H + kCombineChunk - 1) / kCombineChunk;
  std::unique_ptr<TA[]> xs(new TA[std::max<int64_t>(1, m * H)]);
  std::unique_ptr<TA[]> act(new TA[std::max<int64_t>(1, m * I)]);
  std::unique_ptr<TA[]> ys(new TA[std::max<int64_t>(1, m * H)]);
  // Per thread: the gate and up tiles of one work item.
  const int64_t scratch_size = 2 * kRowBlock * tile_i;
  std::unique_ptr<TA[]> scratch(new TA[scratch_size * max_threads]);

#pragma omp parallel
  {
    // 1. Gather the rows of every expert.
#pragma omp for
    for (int64_t r = 0; r < m; ++r)
      std::copy(hidden + token_of_row[r] * H, hidden + (token_of_row[r] + 1) * H,
                xs.get() + r * H);

    // 2. Gate and up tiles, then silu(gate) * up into act.
    TA* gate = scratch.get() + omp_get_thread_num() * scratch_size;
    TA* up = gate + kRowBlock * tile_i;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_blocks * tiles_i; ++item) {
      const RowBlock& b = blocks[item / tiles_i];
      const int64_t n0 = (item % tiles_i) * tile_i, n = std::min(I, n0 + tile_i) - n0;
      const int64_t rows = b.r1 - b.r0;
      const TW* w_gate = w13 + (b.expert * 2 * I + n0) * H;
      const TW* w_up = w_gate + I * H;
      const TA* x = xs.get() + b.r0 * H;
      tile_gemm(x, H, rows, w_gate, H, n, gate, tile_i);
      tile_gemm(x, H, rows, w_up, H, n, up, tile_i);
      for (int64_t r = 0; r < rows; ++r) {
        TA* a = act.get() + (b.r0 + r) * I + n0;
        for (int64_t i = 0; i < n; ++i) {
          const float g = rounded<TA>(silu(to_float(gate[r * tile_i + i])));
          store(g * to_float(up[r * tile_i + i]), a + i);
        }
      }
    }

    // 3. Down projection of every row.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_blocks * tiles_h; ++item) {
      const RowBlock& b = blocks[item / tiles_h];
      const int64_t n0 = (item % tiles_h) * tile_h, n = std::min(H, n0 + tile_h) - n0;
      tile_gemm(act.get() + b.r0 * I, I, b.r1 - b.r0, w2 + (b.expert * H + n0) * I, I, n,
                ys.get() + b.r0 * H + n0, H);
    }

    // 4. Weighted sum of each token's rows, slot by slot.
#pragma omp for
    for (int64_t item = 0; item < num_tokens * chunks; ++item) {
      const int64_t t = item / chunks, c0 = (item % chunks) * kCombineChunk;
      const int64_t c1 = std::min(H, c0 + kCombineChunk);
      float acc[kCombineChunk];
      std::fill(acc, acc + (c1 - c0), 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t row = pos[t * top_k + j];
        if (row < 0) continue;
        const float wt = topk_weights[t * top_k + j];
        const TA* y = ys.get() + row * H;
        for (int64_t c = c0; c < c1; ++c) acc[c - c0] += rounded<TA>(to_float(y[c]) * wt);
      }
      for (int64_t c = c0; c < c1; ++c) store(acc[c - c0], out + t * H + c);
    }
  }
}

}  // namespace

extern "C" {

// hidden [num_tokens, H] and out [num_tokens, H] in the activation dtype (act_dtype 0: float32,
// 1: bfloat16); w13 [num_experts, 2 * I, H] and w2 [num_experts, H, I] contiguous in the weight
// dtype (weight_dtype, same codes); topk_ids [num_tokens, top_k] int64 local expert slots (out of
// [0, num_experts): not on this rank, skipped); topk_weights [num_tokens, top_k] float32. With
// AVX2, H and I must be multiples of 8 (checked by the caller). Returns 0, or -1 for an unknown
// dtype code.
int fused_moe_experts(const void* hidden, int act_dtype, int64_t num_tokens, int64_t H,
                      const void* w13, const void* w2, int weight_dtype, int64_t num_experts,
                      int64_t I, const int64_t* topk_ids, const float* topk_weights,
                      int64_t top_k, void* out) {
  if (num_tokens <= 0) return 0;
  const auto run = [&](auto act_tag, auto weight_tag) {
    using TA = decltype(act_tag);
    using TW = decltype(weight_tag);
    fused_moe<TA, TW>(static_cast<const TA*>(hidden), num_tokens, H,
                      static_cast<const TW*>(w13), static_cast<const TW*>(w2), num_experts, I,
                      topk_ids, topk_weights, top_k, static_cast<TA*>(out));
  };
  if (act_dtype == 0 && weight_dtype == 0) run(float{}, float{});
  else if (act_dtype == 0 && weight_dtype == 1) run(float{}, uint16_t{});
  else if (act_dtype == 1 && weight_dtype == 0) run(uint16_t{}, float{});
  else if (act_dtype == 1 && weight_dtype == 1) run(uint16_t{}, uint16_t{});
  else return -1;
  return 0;
}

}  // extern "C"
