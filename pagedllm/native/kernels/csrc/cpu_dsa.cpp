// DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) decode kernels: the lightning indexer's
// scores and top-k over a request's cached indexer keys, and MLA in the absorbed form over the
// selected latents only (pagedllm/attention/backends/dsa_cpu.py; the torch reference ops are in
// dsa_torch.py, the formulas in its module docstring and in docs/mla.md).
//
// dsa_indexer_topk, per decode row (one query token t of request r, context length S):
//   I[s] = scale * k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])      for s < S
//   out  = the topk positions s of largest I[s], in increasing position order, -1 padded;
//          while S <= topk every position 0..S-1 (nothing is scored: all are selected).
//   k_scale is the C8 row's float32 scale (1 for float rows); relu(x * c) = c * relu(x) for
//   c >= 0 lets the scales apply after the head sum. Work items are (row, a span of
//   kScoreSpan positions), so one long request spreads over all threads; then the top-k of each
//   row is a std::nth_element (O(S)) and a sort of the topk chosen positions.
//
// dsa_sparse_mla_decode, per decode row and head h (q absorbed: [W_UK^T q_nope | q_pe]):
//   p   = softmax_j(scale * q[h] . c[pos_j])      over the row's selected positions j
//   out = sum_j p_j * c[pos_j][:kv_lora_rank]     (the latent's first L values are the values)
//   Each selected latent row is read once per work item for the item's heads; items are
//   (row, a chunk of heads) sized so that every thread has work at batch 1.
//
// Cache rows are located through the block table: slot = block_table[r, pos / block_size] *
// block_size + pos % block_size. dtype codes: 0 float32, 1 bfloat16, 2 int8, 3 float8 e4m3fn
// (C8 indexer rows: head_dim values then a float32 scale).

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "attention_primitives.h"
#include "pagedllm_abi.h"

namespace {

using namespace pagedllm;

constexpr int kScoreSpan = 256;   // indexer positions per work item

inline int64_t slot_of(const int32_t* block_table, int64_t stride, int block_size, int32_t req,
                       int64_t pos) {
  return static_cast<int64_t>(block_table[req * stride + pos / block_size]) * block_size +
         pos % block_size;
}

// Scores of positions [begin, end) of one row into s[begin..end).
template <typename T>
void score_span(const DSAIndexerArgs& a, int64_t row, int64_t begin, int64_t end, float* s) {
  const int D = a.head_dim, H = a.n_heads;
  const bool c8 = a.cache_dtype >= 2;
  const int64_t row_bytes = c8 ? D + 4 : static_cast<int64_t>(D) * sizeof(T);
  const auto* cache = static_cast<const uint8_t*>(a.k_cache);
  const int32_t req = a.rows[row];
  const int64_t token = a.tokens[row];
  const float* q = a.q + token * H * D;
  const float* w = a.weights + token * H;
  for (int64_t pos = begin; pos < end; ++pos) {
    const uint8_t* k = cache + slot_of(a.block_table, a.block_table_stride, a.block_size, req,
                                       pos) * row_bytes;
    float acc = 0.f;
    for (int h = 0; h < H; ++h) {
      const float d = dot(q + static_cast<int64_t>(h) * D, reinterpret_cast<const T*>(k), D);
      if (d > 0.f) acc += w[h] * d;
    }
    float k_scale = 1.f;
    if (c8) std::memcpy(&k_scale, k + D, sizeof(float));
    s[pos] = acc * a.scale * k_scale;
  }
}

template <typename T>
void indexer_scores(const DSAIndexerArgs& a, const std::vector<int64_t>& offsets, float* s) {
  // Items: (row, span) over the rows that need scoring (context longer than topk).
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const int64_t S = a.seq_lens[a.rows[r]];
    if (S <= a.topk) continue;
    for (int64_t b = 0; b < S; b += kScoreSpan) items.emplace_back(r, b);
  }
#pragma omp parallel for schedule(dynamic)
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    const int64_t r = items[i].first, b = items[i].second;
    const int64_t S = a.seq_lens[a.rows[r]];
    score_span<T>(a, r, b, std::min<int64_t>(S, b + kScoreSpan), s + offsets[r]);
  }
}

void select_topk(const DSAIndexerArgs& a, const std::vector<int64_t>& offsets, const float* s) {
#pragma omp parallel for schedule(dynamic)
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const int64_t S = a.seq_lens[a.rows[r]];
    int64_t* out = a.out + r * a.topk;
    const int64_t k = std::min<int64_t>(S, a.topk);
    std::vector<int64_t> pos(static_cast<size_t>(S));
    std::iota(pos.begin(), pos.end(), 0);
    if (S > a.topk) {
      const float* sr = s + offsets[r];
      // Larger score first; equal scores: the earlier position (a fixed order).
      std::nth_element(pos.begin(), pos.begin() + k, pos.end(), [sr](int64_t x, int64_t y) {
        return sr[x] > sr[y] || (sr[x] == sr[y] && x < y);
      });
      std::sort(pos.begin(), pos.begin() + k);
    }
    std::copy(pos.begin(), pos.begin() + k, out);
    std::fill(out + k, out + a.topk, int64_t{-1});
  }
}

template <typename T>
void sparse_mla(const SparseMLADecodeArgs& a) {
  const int H = a.num_heads, E = a.latent_size, L = a.kv_lora_rank, K = a.topk;
  const int threads = std::max(1, omp_get_max_threads());
  // Heads per item: enough items for every thread (two each where the batch allows).
  const int per_row = std::max(1, std::min(H, (2 * threads + a.num_rows - 1) / a.num_rows));
  const int chunk = (H + per_row - 1) / per_row;
  const int chunks = (H + chunk - 1) / chunk;
  const auto* cache = static_cast<const T*>(a.latent_cache);
#pragma omp parallel
  {
    std::vector<float> p(static_cast<size_t>(chunk) * K);
    std::vector<const T*> lat(static_cast<size_t>(K));
#pragma omp for schedule(dynamic)
    for (int64_t item = 0; item < static_cast<int64_t>(a.num_rows) * chunks; ++item) {
      const int64_t r = item / chunks;
      const int h0 = static_cast<int>(item % chunks) * chunk, h1 = std::min(H, h0 + chunk);
      const int32_t req = a.rows[r];
      const int64_t* pos = a.positions + r * K;
      int n = 0;   // the selected latents (a decode row has at least one: its own token)
      for (int j = 0; j < K; ++j)
        if (pos[j] >= 0)
          lat[n++] = cache + slot_of(a.block_table, a.block_table_stride, a.block_size, req,
                                     pos[j]) * E;
      for (int h = h0; h < h1 && n == 0; ++h)
        std::fill(a.out + (r * H + h) * static_cast<int64_t>(L),
                  a.out + (r * H + h + 1) * static_cast<int64_t>(L), 0.f);
      for (int h = h0; h < h1 && n > 0; ++h) {
        const float* q = a.q + (r * H + h) * static_cast<int64_t>(E);
        float* ph = p.data() + static_cast<int64_t>(h - h0) * K;
        for (int j = 0; j < n; ++j) ph[j] = dot(q, lat[j], E) * a.scale;
        const float m = row_max(ph, n);
        const float inv = 1.f / exp_shift_sum(ph, n, m);
        float* o = a.out + (r * H + h) * static_cast<int64_t>(L);
        std::fill(o, o + L, 0.f);
        for (int j = 0; j < n; ++j) axpy(o, ph[j] * inv, lat[j], L);
      }
    }
  }
}

}  // namespace

extern "C" {

int dsa_indexer_topk(const DSAIndexerArgs* args) {
  const DSAIndexerArgs& a = *args;
  if (a.topk < 1 || a.head_dim < 1 || a.n_heads < 1 || a.cache_dtype < 0 || a.cache_dtype > 3)
    return -1;
  std::vector<int64_t> offsets(static_cast<size_t>(a.num_rows) + 1, 0);
  for (int64_t r = 0; r < a.num_rows; ++r) {
    const int64_t S = a.seq_lens[a.rows[r]];
    offsets[r + 1] = offsets[r] + (S > a.topk ? S : 0);
  }
  std::vector<float> scores(static_cast<size_t>(offsets[a.num_rows]));
  switch (a.cache_dtype) {
    case 0: indexer_scores<float>(a, offsets, scores.data()); break;
    case 1: indexer_scores<uint16_t>(a, offsets, scores.data()); break;
    case 2: indexer_scores<int8_t>(a, offsets, scores.data()); break;
    default: indexer_scores<fp8_e4m3>(a, offsets, scores.data()); break;
  }
  select_topk(a, offsets, scores.data());
  return 0;
}

int dsa_sparse_mla_decode(const SparseMLADecodeArgs* args) {
  const SparseMLADecodeArgs& a = *args;
  if (a.topk < 1 || a.kv_lora_rank > a.latent_size || a.num_heads < 1) return -1;
  if (a.cache_dtype == 0) {
    sparse_mla<float>(a);
  } else if (a.cache_dtype == 1) {
    sparse_mla<uint16_t>(a);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
