// Register-blocked attention tiles with the query rows in vector lanes (AVX-512 builds): the
// `attend_tile_gemm` of attention_query_tiles.h for long query runs (that header includes this
// one after it, inside namespace pagedllm, for its AttentionArgs, widen_chunk and kGemmKeys), with
// every per-row quantity of the online softmax held transposed, 16 query rows per zmm vector:
//
//   qt [head_size][RP]   the tile's query rows (RP = rows rounded up to 16; padded rows are
//                        zero with an empty key range, so they never weigh a key)
//   st [kGemmKeys][RP]   S^T = K Q^T for one chunk of keys, then P^T in place
//   ot [head_size][RP]   O^T, the unnormalised output
//   m, l [RP]            running max and sum
//
// S^T = K Q^T and O^T += V^T P^T are outer products (a K or V value broadcast against 16 rows
// of Q^T or P^T: no horizontal sums), and the mask, the running max, exp and the rescaling of
// O run 16 rows per instruction instead of one row at a time. The math and the order of each
// row's key chunks are those of `attend_tile_gemm` (FlashAttention-2's online softmax per
// chunk, Dao 2023); the float sums run in another order, so results agree with the per-row
// path to float32 rounding. `-DPAGEDLLM_NO_ROW_LANES` (build_cpu_kernels' extra flags) builds
// attend_tile_gemm instead, for A/B runs in one process.
#pragma once

#if defined(PAGEDLLM_AVX2) && defined(__AVX512F__) && !defined(PAGEDLLM_NO_ROW_LANES)
#define PAGEDLLM_ATTENTION_ROW_LANES 1

constexpr int kRowLanes = 16;

// st[j][0, 16 G) = sum_d k[j][d] qt[d][0, 16 G) for the 4 keys j < 4 (k rows head_size apart,
// qt and st rows ld apart).
template <int G>
inline void lane_scores(const float* qt, const float* k, int head_size, float* st, int64_t ld) {
  __m512 acc[4][G];
  for (int j = 0; j < 4; ++j)
    for (int g = 0; g < G; ++g) acc[j][g] = _mm512_setzero_ps();
  for (int d = 0; d < head_size; ++d) {
    __m512 qv[G];
    for (int g = 0; g < G; ++g) qv[g] = _mm512_loadu_ps(qt + d * ld + g * kRowLanes);
    for (int j = 0; j < 4; ++j) {
      const __m512 kb = _mm512_set1_ps(k[j * head_size + d]);
      for (int g = 0; g < G; ++g) acc[j][g] = _mm512_fmadd_ps(kb, qv[g], acc[j][g]);
    }
  }
  for (int j = 0; j < 4; ++j)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(st + j * ld + g * kRowLanes, acc[j][g]);
}

// ot[d][0, 16 G) += sum_{j < n} v[j][d] st[j][0, 16 G) for the 4 dims d < 4 (v rows head_size
// apart, ot and st rows ld apart).
template <int G>
inline void lane_values(float* ot, const float* st, const float* v, int head_size, int n,
                        int64_t ld) {
  __m512 acc[4][G];
  for (int d = 0; d < 4; ++d)
    for (int g = 0; g < G; ++g) acc[d][g] = _mm512_loadu_ps(ot + d * ld + g * kRowLanes);
  for (int j = 0; j < n; ++j) {
    __m512 pv[G];
    for (int g = 0; g < G; ++g) pv[g] = _mm512_loadu_ps(st + j * ld + g * kRowLanes);
    for (int d = 0; d < 4; ++d) {
      const __m512 vb = _mm512_set1_ps(v[j * head_size + d]);
      for (int g = 0; g < G; ++g) acc[d][g] = _mm512_fmadd_ps(vb, pv[g], acc[d][g]);
    }
  }
  for (int d = 0; d < 4; ++d)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(ot + d * ld + g * kRowLanes, acc[d][g]);
}

// fn(g0, std::integral_constant<int, G>{}) for the 16-row groups [g0, g0 + G) of `groups`, up
// to 4 at a time (lane_scores / lane_values: 4 x G zmm accumulators and G loaded vectors).
template <typename F>
inline void for_row_groups(int groups, F&& fn) {
  for (int g0 = 0; g0 < groups; g0 += 4) {
    switch (std::min(4, groups - g0)) {
      case 4: fn(g0, std::integral_constant<int, 4>{}); break;
      case 3: fn(g0, std::integral_constant<int, 3>{}); break;
      case 2: fn(g0, std::integral_constant<int, 2>{}); break;
      default: fn(g0, std::integral_constant<int, 1>{}); break;
    }
  }
}

// Scratch of one thread for `attend_tile_lanes`.
struct LaneTileScratch {
  std::vector<float> k, v, ks, vs, qt, ot, st, m, l;
  std::vector<int32_t> begin, end;   // each row's key range
  LaneTileScratch(int max_rows, int head_size) {
    const int64_t rp = (max_rows + kRowLanes - 1) / kRowLanes * kRowLanes;
    k.resize(static_cast<size_t>(kGemmKeys) * head_size);
    v.resize(k.size());
    ks.resize(kGemmKeys);
    vs.resize(kGemmKeys);
    qt.resize(static_cast<size_t>(head_size) * rp);
    ot.resize(qt.size());
    st.resize(static_cast<size_t>(kGemmKeys) * rp);
    m.resize(rp);
    l.resize(rp);
    begin.resize(rp);
    end.resize(rp);
  }
};

// The mask, scales, soft cap and online-softmax update of one chunk (keys c0 + j, j < n4) for
// the 16 rows of st / m / l / ot at column offset `col`; P^T (times the V row scales) is left
// in st. Rows whose range misses every key of the chunk weigh none of them and keep m, l, O.
template <typename T, typename TQ>
inline void lane_softmax(const AttentionArgs<T, TQ>& a, LaneTileScratch& w, int64_t ld,
                         int64_t col, int c0, int n4, int head_size) {
  const __m512i rb = _mm512_loadu_si512(w.begin.data() + col);
  const __m512i re = _mm512_loadu_si512(w.end.data() + col);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  float* st = w.st.data() + col;
  auto valid = [&](int j) {
    const __m512i pos = _mm512_set1_epi32(c0 + j);
    return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(pos, rb) &
                                  _mm512_cmplt_epi32_mask(pos, re));
  };
  __m512 chunk_max = neg_inf;
  for (int j = 0; j < n4; ++j) {
    __m512 s = _mm512_loadu_ps(st + j * ld);
    if (a.k_scales != nullptr) s = _mm512_mul_ps(s, _mm512_set1_ps(w.ks[j]));
    if (a.soft_cap > 0.f) {
      alignas(64) float lanes[kRowLanes];
      _mm512_store_ps(lanes, s);
      for (float& x : lanes) x = a.soft_cap * std::tanh(x / a.soft_cap);
      s = _mm512_load_ps(lanes);
    }
    s = _mm512_mask_mov_ps(neg_inf, valid(j), s);
    _mm512_storeu_ps(st + j * ld, s);
    chunk_max = _mm512_max_ps(chunk_max, s);
  }
  const __m512 m_old = _mm512_loadu_ps(w.m.data() + col);
  const __m512 m_new = _mm512_max_ps(m_old, chunk_max);
  // Rows with no key yet (m_new = -inf) take no weights; rows whose max stays keep O as is.
  const __m512 shift = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ),
                                          _mm512_setzero_ps());
  const __mmask16 moved = _mm512_cmp_ps_mask(m_old, m_new, _CMP_NEQ_OQ);
  const __m512 correction =
      _mm512_mask_mov_ps(_mm512_set1_ps(1.f), moved, exp16(_mm512_sub_ps(m_old, shift)));
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n4; ++j) {
    __m512 p = _mm512_maskz_mov_ps(valid(j),
                                   exp16(_mm512_sub_ps(_mm512_loadu_ps(st + j * ld), shift)));
    sum = _mm512_add_ps(sum, p);
    if (a.v_scales != nullptr) p = _mm512_mul_ps(p, _mm512_set1_ps(w.vs[j]));
    _mm512_storeu_ps(st + j * ld, p);
  }
  _mm512_storeu_ps(w.l.data() + col,
                   _mm512_fmadd_ps(_mm512_loadu_ps(w.l.data() + col), correction, sum));
  _mm512_storeu_ps(w.m.data() + col, m_new);
  if (moved != 0) {
    float* ot = w.ot.data() + col;
    for (int d = 0; d < head_size; ++d)
      _mm512_storeu_ps(ot + d * ld, _mm512_mul_ps(_mm512_loadu_ps(ot + d * ld), correction));
  }
}

// `attend_tile_gemm` (same arguments) with the rows in vector lanes: the rows of KV head kv
// (r = i * rep + h, q / o / m / l at row_index[r]) over key positions [lo, hi), token i limited
// to [begin[i], end[i]). head_size % 4 == 0.
template <typename T, typename TQ>
void attend_tile_lanes(const AttentionArgs<T, TQ>& a, const int32_t* table, int kv, int nq,
                       int rep, const int* begin, const int* end, int lo, int hi,
                       const int64_t* row_index, const float* q, float* o, float* m, float* l,
                       LaneTileScratch& w) {
  const int head_size = a.head_size;
  const int R = nq * rep, groups = (R + kRowLanes - 1) / kRowLanes;
  const int64_t ld = static_cast<int64_t>(groups) * kRowLanes;
  for (int64_t r = 0; r < ld; ++r) {   // transpose the rows in (padded rows: empty, zero)
    const bool row = r < R;
    const float* qr = row ? q + row_index[r] * head_size : nullptr;
    const float* orow = row ? o + row_index[r] * head_size : nullptr;
    for (int d = 0; d < head_size; ++d) {
      w.qt[d * ld + r] = row ? qr[d] : 0.f;
      w.ot[d * ld + r] = row ? orow[d] : 0.f;
    }
    w.m[r] = row ? m[row_index[r]] : -std::numeric_limits<float>::infinity();
    w.l[r] = row ? l[row_index[r]] : 0.f;
    w.begin[r] = row ? begin[r / rep] : 0;
    w.end[r] = row ? end[r / rep] : 0;
  }
  for (int c0 = lo; c0 < hi; c0 += kGemmKeys) {
    const int n = std::min(kGemmKeys, hi - c0), n4 = (n + 3) / 4 * 4;
    widen_chunk(a, table, kv, c0, n, n4, w.k.data(), w.v.data(), w.ks.data(), w.vs.data());
    for_row_groups(groups, [&](int g0, auto G) {
      for (int j = 0; j < n4; j += 4)
        lane_scores<decltype(G)::value>(w.qt.data() + g0 * kRowLanes,
                                        w.k.data() + static_cast<int64_t>(j) * head_size,
                                        head_size, w.st.data() + j * ld + g0 * kRowLanes, ld);
    });
    for (int g = 0; g < groups; ++g) lane_softmax(a, w, ld, g * kRowLanes, c0, n4, head_size);
    for_row_groups(groups, [&](int g0, auto G) {
      for (int d = 0; d < head_size; d += 4)
        lane_values<decltype(G)::value>(w.ot.data() + d * ld + g0 * kRowLanes,
                                        w.st.data() + g0 * kRowLanes, w.v.data() + d,
                                        head_size, n4, ld);
    });
  }
  for (int r = 0; r < R; ++r) {   // transpose the rows out
    float* orow = o + row_index[r] * head_size;
    for (int d = 0; d < head_size; ++d) orow[d] = w.ot[d * ld + r];
    m[row_index[r]] = w.m[r];
    l[row_index[r]] = w.l[r];
  }
}

#endif
