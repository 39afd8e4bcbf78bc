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
//   kScoreSpan positions), so one long request spreads over all threads. Scoring is a GEMM
//   [Hi, D] x [D, S] per row (compute-bound: a key row serves all Hi heads), so keys are
//   converted kKeyTile at a time to float32 and scored in register tiles of 2 heads x 4 keys
//   (AVX2; scalar dots otherwise). Then the top-k of each row is a std::nth_element (O(S)) and
//   a sort of the topk chosen positions.
//
// dsa_sparse_mla_decode, per decode row and head h (q absorbed: [W_UK^T q_nope | q_pe]):
//   p   = softmax_j(scale * q[h] . c[pos_j])      over the row's selected positions j
//   out = sum_j p_j * c[pos_j][:kv_lora_rank]     (the latent's first L values are the values)
//   Each selected latent row is read once per work item (while in L1, by all the item's heads);
//   items are (row, a chunk of heads), one per thread at batch 1.
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
constexpr int kKeyTile = 16;      // keys converted to float32 at a time (a multiple of 4)

inline int64_t slot_of(const int32_t* block_table, int64_t stride, int block_size, int32_t req,
                       int64_t pos) {
  return static_cast<int64_t>(block_table[req * stride + pos / block_size]) * block_size +
         pos % block_size;
}

// The keys of positions [pos0, pos0 + n) of request `req` as float32 rows kf[n][D] (tile rows
// past n zero), with their C8 scales (1 for float rows) in k_scale[n].
template <typename T>
void load_key_tile(const DSAIndexerArgs& a, int32_t req, int64_t pos0, int n, float* kf,
                   float* k_scale) {
  const int D = a.head_dim;
  const bool c8 = a.cache_dtype >= 2;
  const int64_t row_bytes = c8 ? D + 4 : static_cast<int64_t>(D) * sizeof(T);
  const auto* cache = static_cast<const uint8_t*>(a.k_cache);
  for (int i = 0; i < n; ++i) {
    const uint8_t* k = cache + slot_of(a.block_table, a.block_table_stride, a.block_size, req,
                                       pos0 + i) * row_bytes;
    const T* v = reinterpret_cast<const T*>(k);
    float* dst = kf + static_cast<int64_t>(i) * D;
    int d = 0;
#ifdef PAGEDLLM_AVX2
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, load8(v + d));
#endif
    for (; d < D; ++d) dst[d] = to_float(v[d]);
    k_scale[i] = 1.f;
    if (c8) std::memcpy(&k_scale[i], k + D, sizeof(float));
  }
  std::fill(kf + static_cast<int64_t>(n) * D, kf + static_cast<int64_t>(kKeyTile) * D, 0.f);
}

#ifdef PAGEDLLM_AVX2
// Lane i of the result = the sum of a[i]'s 8 lanes (a transpose by horizontal adds).
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The 8 dot products qa . k[j] (lanes 0-3) and qb . k[j] (lanes 4-7) of 2 query rows with 4 key
// rows (D % 8 == 0): a register tile of 8 accumulators, each vector loaded once per tile.
template <typename T>
inline __m256 dots_2x4(const float* qa, const float* qb, const T* const* k, int D) {
  __m256 acc[8];
  for (auto& v : acc) v = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(qa + d), y = _mm256_loadu_ps(qb + d);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(k[j] + d);
      acc[j] = _mm256_fmadd_ps(x, kv, acc[j]);
      acc[4 + j] = _mm256_fmadd_ps(y, kv, acc[4 + j]);
    }
  }
  return hsum8x8(acc);
}

// out[j] = sum_h w[h] * relu(q[h] . kf[j]) for the 4 keys kf[0..4) (D % 8 == 0), by 2 x 4 tiles.
inline void head_sum_4keys(const float* q, const float* w, int H, int D, const float* kf,
                           float* out) {
  const float* k[4] = {kf, kf + D, kf + 2 * D, kf + 3 * D};
  __m128 total = _mm_setzero_ps();
  for (int h0 = 0; h0 < H; h0 += 2) {
    const int h1 = h0 + 1 < H ? h0 + 1 : h0;           // an odd last head pairs with itself
    const float w1 = h0 + 1 < H ? w[h1] : 0.f;          // ... at weight 0
    const __m256 dots = dots_2x4(q + static_cast<int64_t>(h0) * D,
                                 q + static_cast<int64_t>(h1) * D, k, D);
    const __m256 weights = _mm256_setr_ps(w[h0], w[h0], w[h0], w[h0], w1, w1, w1, w1);
    const __m256 v = _mm256_mul_ps(_mm256_max_ps(dots, _mm256_setzero_ps()), weights);
    total = _mm_add_ps(total, _mm_add_ps(_mm256_castps256_ps128(v),
                                         _mm256_extractf128_ps(v, 1)));
  }
  _mm_storeu_ps(out, total);
}
#endif

// Scores of positions [begin, end) of one row into s[begin..end): keys converted kKeyTile at a
// time into a float32 tile, then each tile against all the row's heads.
template <typename T>
void score_span(const DSAIndexerArgs& a, int64_t row, int64_t begin, int64_t end, float* s,
                float* kf) {
  const int D = a.head_dim, H = a.n_heads;
  const int32_t req = a.rows[row];
  const int64_t token = a.tokens[row];
  const float* q = a.q + token * H * D;
  const float* w = a.weights + token * H;
  float k_scale[kKeyTile], sums[kKeyTile];
  for (int64_t p0 = begin; p0 < end; p0 += kKeyTile) {
    const int n = static_cast<int>(std::min<int64_t>(kKeyTile, end - p0));
    load_key_tile<T>(a, req, p0, n, kf, k_scale);
    int j = 0;
#ifdef PAGEDLLM_AVX2
    if (D % 8 == 0)
      for (; j < n; j += 4) head_sum_4keys(q, w, H, D, kf + static_cast<int64_t>(j) * D,
                                           sums + j);
#endif
    for (; j < n; ++j) {
      float acc = 0.f;
      for (int h = 0; h < H; ++h) {
        const float d = dot(q + static_cast<int64_t>(h) * D, kf + static_cast<int64_t>(j) * D,
                            D);
        if (d > 0.f) acc += w[h] * d;
      }
      sums[j] = acc;
    }
    for (int i = 0; i < n; ++i) s[p0 + i] = sums[i] * a.scale * k_scale[i];
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
#pragma omp parallel
  {
    std::vector<float> kf(static_cast<size_t>(kKeyTile) * a.head_dim);
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      const int64_t r = items[i].first, b = items[i].second;
      const int64_t S = a.seq_lens[a.rows[r]];
      score_span<T>(a, r, b, std::min<int64_t>(S, b + kScoreSpan), s + offsets[r], kf.data());
    }
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

// Scores p[h - h0][j] = scale * q[h] . lat[j] for heads [h0, h1) and the n latents (a key row
// stays in L1 while the item's heads read it; AVX2: 2 heads x 4 latents register tiles).
template <typename T>
void mla_scores(const float* q, int h0, int h1, int E, const T* const* lat, int n, int K,
                float scale, float* p) {
  int j = 0;
#ifdef PAGEDLLM_AVX2
  if (E % 8 == 0) {
    for (; j + 4 <= n; j += 4) {
      for (int h = h0; h < h1; h += 2) {
        const int hb = h + 1 < h1 ? h + 1 : h;
        float v[8];
        _mm256_storeu_ps(v, dots_2x4(q + static_cast<int64_t>(h) * E,
                                     q + static_cast<int64_t>(hb) * E, lat + j, E));
        for (int i = 0; i < 4; ++i) {
          p[static_cast<int64_t>(h - h0) * K + j + i] = v[i] * scale;
          p[static_cast<int64_t>(hb - h0) * K + j + i] = v[4 + i] * scale;
        }
      }
    }
  }
#endif
  for (; j < n; ++j)
    for (int h = h0; h < h1; ++h)
      p[static_cast<int64_t>(h - h0) * K + j] = dot(q + static_cast<int64_t>(h) * E, lat[j], E) *
                                                 scale;
}

template <typename T>
void sparse_mla(const SparseMLADecodeArgs& a) {
  const int H = a.num_heads, E = a.latent_size, L = a.kv_lora_rank, K = a.topk;
  const int threads = std::max(1, omp_get_max_threads());
  // Heads per item: one item per thread where the batch is smaller than the thread count
  // (each item reads its row's K latents once).
  const int per_row = std::max(1, std::min(H, (threads + a.num_rows - 1) / a.num_rows));
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
      float* out = a.out + (r * H + h0) * static_cast<int64_t>(L);
      std::fill(out, out + static_cast<int64_t>(h1 - h0) * L, 0.f);
      if (n == 0) continue;
      const float* q = a.q + r * H * static_cast<int64_t>(E);
      mla_scores(q, h0, h1, E, lat.data(), n, K, a.scale, p.data());
      for (int h = h0; h < h1; ++h) {
        float* ph = p.data() + static_cast<int64_t>(h - h0) * K;
        const float m = row_max(ph, n);
        const float inv = 1.f / exp_shift_sum(ph, n, m);
        for (int j = 0; j < n; ++j) ph[j] *= inv;
      }
      for (int j = 0; j < n; ++j)          // each latent read once for the item's heads
        for (int h = h0; h < h1; ++h)
          axpy(out + static_cast<int64_t>(h - h0) * L, p[static_cast<int64_t>(h - h0) * K + j],
               lat[j], L);
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
