// The query-tiled path of the CPU paged attention (attention_kernel.h includes this header
// after its per-token items, inside namespace pagedllm, for AttentionArgs, key_end and
// block_values_heads): the plan of query tiles (`plan_query_tiles`), their per-row walk, the
// register-blocked tiles of long query runs (`attend_tile_gemm`; attention_row_lanes.h's
// `attend_tile_lanes` on AVX-512 builds) and the work-sharing loop over the tiles
// (`attention_tile_items`). See cpu_attention.cpp for the algorithm and layouts.
#pragma once

// ---- Query-tiled path: a tile of one request's query tokens per work item -------------------
//
// A request with several query tokens this step (a prefill continuation, a chunked prefill,
// speculative-decoding verification) re-reads its K/V blocks once per query token on the path
// above. Here a work item is (request, tile of up to `query_tile` consecutive query tokens,
// chunk of KV heads): each block of a KV head is walked once for the tile, and while its K/V
// rows are in the L1/L2 cache all the tile's queries of the rep query heads sharing that KV head
// consume them (FlashAttention's query blocking, Dao et al., 2022; llama.cpp's CPU flash
// attention tiles queries the same way); a token's rep heads also share each widened V vector
// (`block_values_heads`). Each query row keeps its own online softmax state and
// visits exactly the key ranges, in the same block pieces, as on the per-token path (its
// causal end, its window start), so its result is the same float for float.

// Requests with at least kGemmMinQueryLen query tokens take the register-blocked tiles below
// (AVX2 builds, head_size % 32 == 0), kGemmTileFactor times longer than query_tile.
constexpr int kGemmMinQueryLen = 16, kGemmTileFactor = 4;

inline bool gemm_tiles_apply(int head_size) {
#ifdef PAGEDLLM_AVX2
  return head_size % 32 == 0;
#else
  (void)head_size;
  return false;
#endif
}

struct QueryTilePlan {
  std::vector<int32_t> tile_row, tile_tok, tile_len;  // per tile: request, first token, tokens
  int chunk_kv_heads = 0, num_chunks = 0, max_tile = 0;
  int64_t num_items = 0;
};

// Tiles of at most `query_tile` tokens (the last one of a request may be shorter) for the rows
// with more than one query token, kGemmTileFactor x query_tile for runs of kGemmMinQueryLen
// or more where `gemm` (gemm_tiles_apply); rows with one (decodes) are left to
// `plan_attention`.
inline QueryTilePlan plan_query_tiles(const int32_t* query_start_loc, const int32_t* rows,
                                      int num_rows, int num_kv_heads, int num_threads,
                                      int query_tile, bool gemm = false) {
  QueryTilePlan p;
  for (int i = 0; i < num_rows; ++i) {
    const int r = rows[i];
    const int begin = query_start_loc[r], end = query_start_loc[r + 1];
    if (end - begin < 2) continue;
    const int tile = gemm && end - begin >= kGemmMinQueryLen ? kGemmTileFactor * query_tile
                                                             : query_tile;
    for (int t = begin; t < end; t += tile) {
      p.tile_row.push_back(r);
      p.tile_tok.push_back(t);
      p.tile_len.push_back(std::min(tile, end - t));
      p.max_tile = std::max(p.max_tile, p.tile_len.back());
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(p.tile_row.size());
  if (num_tiles == 0) return p;
  const int64_t wanted = 4 * static_cast<int64_t>(num_threads);
  const int max_chunks = static_cast<int>(
      std::min<int64_t>(num_kv_heads, (wanted + num_tiles - 1) / num_tiles));
  p.chunk_kv_heads = (num_kv_heads + max_chunks - 1) / max_chunks;
  p.num_chunks = (num_kv_heads + p.chunk_kv_heads - 1) / p.chunk_kv_heads;
  p.num_items = num_tiles * p.num_chunks;
  return p;
}

// One query row's scores and online-softmax update over keys [j0, j1) of a block piece (k = the
// piece's first row of this KV head, ks / vs its int8 row scales or nullptr): the same
// operations, in the same order, as one head of `attention_items`. Leaves in s the weights
// (times the V row scales) that `block_values` takes.
template <typename T>
inline void piece_row_weights(const float* q, const T* k, const float* ks, const float* vs,
                              int64_t kv_row_stride, int num_kv_heads, int j0, int j1,
                              int head_size, float soft_cap, float* s, float& m, float& l,
                              float* acc) {
  const int n = j1 - j0;
  block_scores(q, k + j0 * kv_row_stride, kv_row_stride, n, head_size, s);
  if (ks != nullptr)
    for (int j = 0; j < n; ++j) s[j] *= ks[(j0 + j) * num_kv_heads];
  if (soft_cap > 0.f)
    for (int j = 0; j < n; ++j) s[j] = soft_cap * std::tanh(s[j] / soft_cap);
  const float m_new = std::max(m, row_max(s, n));
  const float correction = std::exp(m - m_new);
  l = l * correction + exp_shift_sum(s, n, m_new);
  m = m_new;
  if (correction != 1.f)
    for (int d = 0; d < head_size; ++d) acc[d] *= correction;
  if (vs != nullptr)
    for (int j = 0; j < n; ++j) s[j] *= vs[(j0 + j) * num_kv_heads];
}


#ifdef PAGEDLLM_AVX2
// ---- Register-blocked tiles for long query runs (chunked prefill, long prefix-cache suffixes)
//
// The path above walks one query row at a time (a GEMV per row and block, the same floats as
// the per-token items). For a request with at least kGemmMinQueryLen query tokens this step the
// tile's query rows instead meet the keys kGemmKeys at a time as two small GEMMs per KV head,
// FlashAttention's inner loop (Dao et al., 2022; FlashAttention-2's online softmax per key
// chunk): S = Q K^T with 4 query rows x 4 keys per register block, the chunk's online-softmax
// update per row, then O += P V with 4 rows x 32 dims per block. The K/V rows of a chunk are
// widened to float32 once (exact) and shared by every row of the tile. The sums run in another
// order than the per-row path (results agree to float32 rounding, not bit for bit), so short
// query runs (speculative-decoding verification) keep the per-row path, whose floats equal a
// decode's. Such runs take tiles of kGemmTileFactor x query_tile tokens (`plan_query_tiles`):
// each tile re-reads its request's whole context, and the GEMMs keep a larger tile's rows busy.
constexpr int kGemmKeys = 64;

// out[d] = float(row[d]) for d < head_size (exact; head_size % 8 == 0).
template <typename T>
inline void widen_row(const T* row, int head_size, float* out) {
  for (int d = 0; d < head_size; d += 8) _mm256_storeu_ps(out + d, load8(row + d));
}

// k / v [n4][head_size] = the float32 K / V rows of KV head kv at key positions [c0, c0 + n)
// (exact), ks / vs [n4] their int8 row scales if the cache has them; the rows [n, n4) are zero
// (and their scales), padding the chunk to whole 4-key blocks. The tile kernels' chunk walk.
template <typename T, typename TQ>
inline void widen_chunk(const AttentionArgs<T, TQ>& a, const int32_t* table, int kv, int c0,
                        int n, int n4, float* k, float* v, float* ks, float* vs) {
  const int head_size = a.head_size, block_size = a.block_size;
  const int64_t kv_row_stride = static_cast<int64_t>(a.num_kv_heads) * head_size;
  for (int j = 0; j < n4; ++j) {
    float* kd = k + static_cast<int64_t>(j) * head_size;
    float* vd = v + static_cast<int64_t>(j) * head_size;
    if (j >= n) {
      std::fill(kd, kd + head_size, 0.f);
      std::fill(vd, vd + head_size, 0.f);
      ks[j] = vs[j] = 0.f;
      continue;
    }
    const int pos = c0 + j;
    const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size +
                         pos % block_size;
    const int64_t base = slot * kv_row_stride + static_cast<int64_t>(kv) * head_size;
    widen_row(a.key_cache + base, head_size, kd);
    widen_row(a.value_cache + base, head_size, vd);
    if (a.k_scales != nullptr) {
      ks[j] = a.k_scales[slot * a.num_kv_heads + kv];
      vs[j] = a.v_scales[slot * a.num_kv_heads + kv];
    }
  }
}

// The 4 sums of a0..a3 (8 lanes each).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// s[r * lds + j] = dot(q[r], k + j * head_size) for r < RB, j < 4 (head_size % 8 == 0).
template <int RB>
inline void scores_block(const float* const* q, const float* k, int head_size, float* s,
                         int lds) {
  __m256 acc[RB][4];
  #pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int d = 0; d < head_size; d += 8) {
    __m256 kv[4];
    #pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) kv[j] = _mm256_loadu_ps(k + j * head_size + d);
    #pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_loadu_ps(q[r] + d);
      #pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm256_fmadd_ps(qv, kv[j], acc[r][j]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    _mm_storeu_ps(s + r * lds, hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

// o[r][d] += sum_j p[r][j] v[j][d] for r < RB, j < n, d in [d0, d0 + 32).
template <int RB>
inline void values_block(float* const* o, const float* const* p, const float* v, int n,
                         int head_size, int d0) {
  __m256 acc[RB][4];
  #pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_loadu_ps(o[r] + d0 + 8 * c);
  for (int j = 0; j < n; ++j) {   // (acc stays in registers: 16 of AVX-512VL's 32)
    __m256 vv[4];
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) vv[c] = _mm256_loadu_ps(v + j * head_size + d0 + 8 * c);
    #pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      const __m256 pj = _mm256_broadcast_ss(p[r] + j);
      #pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(pj, vv[c], acc[r][c]);
    }
  }
  #pragma GCC unroll 4
  for (int r = 0; r < RB; ++r)
    #pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(o[r] + d0 + 8 * c, acc[r][c]);
}

// Scratch of one thread for `attend_tile_gemm`.
struct GemmTileScratch {
  std::vector<float> k, v, s, ks, vs;   // widened chunk rows, scores, row scales
  std::vector<const float*> q_rows, p_rows;
  std::vector<float*> o_rows;
  GemmTileScratch(int max_rows, int head_size)
      : k(static_cast<size_t>(kGemmKeys) * head_size), v(k.size()),
        s(static_cast<size_t>(max_rows) * kGemmKeys), ks(kGemmKeys), vs(kGemmKeys),
        q_rows(max_rows), p_rows(max_rows), o_rows(max_rows) {}
};

// The rows of KV head kv (rows r = i * rep + h, i < nq tile tokens, h < rep heads; q / o / m /
// l at their row index row(r)) over key positions [lo, hi), token i limited to [begin[i],
// end[i]). head_size % 32 == 0.
template <typename T, typename TQ>
void attend_tile_gemm(const AttentionArgs<T, TQ>& a, const int32_t* table, int kv, int nq,
                      int rep, const int* begin, const int* end, int lo, int hi,
                      const int64_t* row_index, float* q, float* o, float* m, float* l,
                      GemmTileScratch& w) {
  const int head_size = a.head_size;
  const int R = nq * rep, R4 = R / 4 * 4;
  for (int r = 0; r < R; ++r) {
    w.q_rows[r] = q + row_index[r] * head_size;
    w.o_rows[r] = o + row_index[r] * head_size;
    w.p_rows[r] = w.s.data() + static_cast<int64_t>(r) * kGemmKeys;
  }
  for (int c0 = lo; c0 < hi; c0 += kGemmKeys) {
    const int n = std::min(kGemmKeys, hi - c0), n4 = (n + 3) / 4 * 4;
    widen_chunk(a, table, kv, c0, n, n4, w.k.data(), w.v.data(), w.ks.data(), w.vs.data());
    // S = Q K^T for every row (rows outside their range are masked below).
    for (int j = 0; j < n4; j += 4) {
      const float* kj = w.k.data() + static_cast<int64_t>(j) * head_size;
      int r = 0;
      for (; r < R4; r += 4)
        scores_block<4>(&w.q_rows[r], kj, head_size, w.s.data() + r * kGemmKeys + j, kGemmKeys);
      for (; r < R; ++r)
        scores_block<1>(&w.q_rows[r], kj, head_size, w.s.data() + r * kGemmKeys + j, kGemmKeys);
    }
    // Per row: its keys of the chunk, the online-softmax update, P in place of S.
    for (int r = 0; r < R; ++r) {
      const int i = r / rep;
      const int j0 = std::max(0, begin[i] - c0), j1 = std::min(n, end[i] - c0);
      float* sr = w.s.data() + static_cast<int64_t>(r) * kGemmKeys;
      const int64_t row = row_index[r];
      if (j1 <= j0) {   // no key of this chunk: nothing changes
        std::fill(sr, sr + n4, 0.f);
        continue;
      }
      if (a.k_scales != nullptr)
        for (int j = j0; j < j1; ++j) sr[j] *= w.ks[j];
      if (a.soft_cap > 0.f)
        for (int j = j0; j < j1; ++j) sr[j] = a.soft_cap * std::tanh(sr[j] / a.soft_cap);
      const float m_new = std::max(m[row], row_max(sr + j0, j1 - j0));
      const float correction = std::exp(m[row] - m_new);
      std::fill(sr, sr + j0, 0.f);
      l[row] = l[row] * correction + exp_shift_sum(sr + j0, j1 - j0, m_new);
      std::fill(sr + j1, sr + n4, 0.f);
      m[row] = m_new;
      if (correction != 1.f) {
        float* orow = w.o_rows[r];
        for (int d = 0; d < head_size; ++d) orow[d] *= correction;
      }
      if (a.v_scales != nullptr)
        for (int j = j0; j < j1; ++j) sr[j] *= w.vs[j];
    }
    // O += P V.
    for (int d0 = 0; d0 < head_size; d0 += 32) {
      int r = 0;
      for (; r < R4; r += 4)
        values_block<4>(&w.o_rows[r], &w.p_rows[r], w.v.data(), n, head_size, d0);
      for (; r < R; ++r)
        values_block<1>(&w.o_rows[r], &w.p_rows[r], w.v.data(), n, head_size, d0);
    }
  }
}
#endif

#include "attention_row_lanes.h"   // attend_tile_lanes (AVX-512 builds)

// The work-sharing loop over the tiles of `plan_query_tiles`, to be called by every thread of
// an enclosing OpenMP parallel region (an orphaned `omp for`, ending with a barrier).
template <typename T, typename TQ>
void attention_tile_items(const AttentionArgs<T, TQ>& a, const QueryTilePlan& plan) {
  if (plan.num_items == 0) return;
  const int head_size = a.head_size, block_size = a.block_size, num_heads = a.num_heads;
  const int num_kv_heads = a.num_kv_heads, rep = num_heads / num_kv_heads;
  const int chunk_kv_heads = plan.chunk_kv_heads, num_chunks = plan.num_chunks;
  const int64_t kv_row_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  // Query rows of an item: (tile token i, head h of the chunk) at index i * nh + h.
  const int64_t max_rows = static_cast<int64_t>(plan.max_tile) * chunk_kv_heads * rep;
  std::vector<float> q(max_rows * head_size), acc(max_rows * head_size);
  std::vector<float> scores(static_cast<size_t>(rep) * block_size), m(max_rows), l(max_rows);
  std::vector<int> begin(plan.max_tile), end(plan.max_tile);  // each token's key range
  const float q_scale = a.scale * a.k_scale;
#ifdef PAGEDLLM_AVX2
  const bool gemm_heads = gemm_tiles_apply(head_size);
#ifdef PAGEDLLM_ATTENTION_ROW_LANES
  LaneTileScratch gemm(gemm_heads ? plan.max_tile * rep : 0, gemm_heads ? head_size : 0);
#else
  GemmTileScratch gemm(gemm_heads ? plan.max_tile * rep : 0, gemm_heads ? head_size : 0);
#endif
  std::vector<int64_t> gemm_rows(gemm_heads ? static_cast<size_t>(plan.max_tile) * rep : 0);
#endif

#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < plan.num_items; ++item) {
    const int64_t tile = item / num_chunks;
    const int kv0 = static_cast<int>(item % num_chunks) * chunk_kv_heads;
    const int kv1 = std::min(num_kv_heads, kv0 + chunk_kv_heads);
    const int nh = (kv1 - kv0) * rep;
    const int r = plan.tile_row[tile], t0 = plan.tile_tok[tile], nq = plan.tile_len[tile];
    const int q_len = a.query_start_loc[r + 1] - a.query_start_loc[r];
    const int seq_len = a.seq_lens[r];
    const int32_t* table = a.block_table + static_cast<int64_t>(r) * a.block_table_stride;
    int lo = std::numeric_limits<int>::max(), hi = 0;  // the union of the tile's key ranges
    for (int i = 0; i < nq; ++i) {
      const int pos = seq_len - q_len + (t0 + i - a.query_start_loc[r]);
      end[i] = key_end(a.causal, a.attend_until, t0 + i, pos, seq_len);
      begin[i] = a.window > 0 ? std::max(0, pos + 1 - a.window) : 0;
      lo = std::min(lo, begin[i]);
      hi = std::max(hi, end[i]);
      const TQ* q_src = a.query + static_cast<int64_t>(t0 + i) * a.q_row_stride +
                        static_cast<int64_t>(kv0) * rep * head_size;
      float* q_dst = &q[static_cast<int64_t>(i) * nh * head_size];
      for (int d = 0; d < nh * head_size; ++d) q_dst[d] = to_float(q_src[d]) * q_scale;
    }
    std::fill(m.begin(), m.begin() + nq * nh, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + nq * nh, 0.f);
    std::fill(acc.begin(), acc.begin() + static_cast<int64_t>(nq) * nh * head_size, 0.f);

#ifdef PAGEDLLM_AVX2
    if (gemm_heads && q_len >= kGemmMinQueryLen) {
      for (int g = 0; g < kv1 - kv0; ++g) {
        for (int i = 0; i < nq; ++i)
          for (int h = 0; h < rep; ++h)
            gemm_rows[i * rep + h] = static_cast<int64_t>(i) * nh + g * rep + h;
#ifdef PAGEDLLM_ATTENTION_ROW_LANES
        attend_tile_lanes(a, table, kv0 + g, nq, rep, begin.data(), end.data(), lo, hi,
                          gemm_rows.data(), q.data(), acc.data(), m.data(), l.data(), gemm);
#else
        attend_tile_gemm(a, table, kv0 + g, nq, rep, begin.data(), end.data(), lo, hi,
                         gemm_rows.data(), q.data(), acc.data(), m.data(), l.data(), gemm);
#endif
      }
    } else
#endif
    // Per KV head (its queries' q / acc rows stay in the L1/L2 cache while its K/V stream by),
    // the union walked in the per-token path's pieces: [lo, end of its block), whole blocks; each
    // token clips a piece to its own range (so it sees the pieces it would see alone).
    for (int g = 0; g < kv1 - kv0; ++g) {
      for (int start = lo; start < hi;) {
        const int offset = start % block_size;
        const int n = std::min(block_size - offset, hi - start);
        const int64_t slot0 =
            static_cast<int64_t>(table[start / block_size]) * block_size + offset;
        const int64_t base = slot0 * kv_row_stride + static_cast<int64_t>(kv0 + g) * head_size;
        const float* ks = a.k_scales ? a.k_scales + slot0 * num_kv_heads + kv0 + g : nullptr;
        const float* vs = a.v_scales ? a.v_scales + slot0 * num_kv_heads + kv0 + g : nullptr;
        if (start + n < hi) {
          const int64_t next = static_cast<int64_t>(table[(start + n) / block_size]) *
                               block_size * kv_row_stride;
          prefetch_head_rows(a.key_cache + next, a.value_cache + next,
                             static_cast<int64_t>(kv0 + g) * head_size, kv_row_stride, block_size,
                             head_size);
        }
        for (int i = 0; i < nq; ++i) {
          const int j0 = std::max(0, begin[i] - start), j1 = std::min(n, end[i] - start);
          if (j1 <= j0) continue;
          const int64_t row0 = static_cast<int64_t>(i) * nh + g * rep;  // its rep heads
          for (int h = 0; h < rep; ++h)
            piece_row_weights(&q[(row0 + h) * head_size], a.key_cache + base, ks, vs,
                              kv_row_stride, num_kv_heads, j0, j1, head_size, a.soft_cap,
                              &scores[h * block_size], m[row0 + h], l[row0 + h],
                              &acc[(row0 + h) * head_size]);
          block_values_heads(&acc[row0 * head_size], head_size, scores.data(), block_size, rep,
                             a.value_cache + base + j0 * kv_row_stride, kv_row_stride, j1 - j0,
                             head_size);
        }
        start += n;
      }
    }

    for (int i = 0; i < nq; ++i) {
      float* dst = a.out + (static_cast<int64_t>(t0 + i) * num_heads + kv0 * rep) * head_size;
      for (int h = 0; h < nh; ++h) {
        const int64_t row = static_cast<int64_t>(i) * nh + h;
        const float inv = l[row] > 0.f ? a.v_scale / l[row] : 0.f;
        for (int d = 0; d < head_size; ++d) dst[h * head_size + d] = acc[row * head_size + d] * inv;
      }
    }
  }
}
