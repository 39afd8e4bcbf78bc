// Paged attention for the CPU (the kernel behind `cpu_attention.cpp` and the attention step of the
// fused decoder layer in `cpu_decoder.cpp`). See cpu_attention.cpp for the algorithm and layouts.
// This header holds the per-token work items (decodes, split over long contexts) and the plan
// of one call; the query-tiled path (several query tokens of a request per item) is in
// attention_query_tiles.h, included below.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "attention_primitives.h"   // element types, dot / exp / block loops
#include "cpu_vec.h"

namespace pagedllm {

// The work items of one call: (query token, split of its context, chunk of KV heads). A chunk
// reads whole K/V rows of a block (contiguous memory); all KV heads form one chunk unless there
// are too few (token, split) units to give every thread work.
//
// Split-KV decode (flash-decoding, Dao et al. 2023; llama.cpp and vLLM split long contexts
// likewise): a query token whose context is longer than kSplitLen positions is cut into pieces
// of kSplitLen positions (at the absolute positions 0, kSplitLen, 2 kSplitLen, ...), each an
// item of its own with its own online-softmax state, merged after all items ran
// (`attention_items`). One request's long context is then read by all threads at once, block by
// block over all heads (sequential memory), instead of by one thread per chunk of heads (rows
// of 128-256 bytes a KV row apart). The split depends only on the token's own context length
// (causal: its position + 1), so a token's result on this path is the same whatever else is in
// the step and whether it comes as a decode or inside a prefill chunk: with every request on
// this path (`query_tile` <= 1, the batch-invariant mode) a token's floats depend on its
// context alone.
constexpr int kSplitLen = 256;

// The end (exclusive) of the key positions query token t at position pos sees: pos + 1
// (causal), attend_until[t] + 1 with `attend_until` (at most seq_len), or seq_len (not causal).
inline int key_end(int causal, const int64_t* attend_until, int t, int pos, int seq_len) {
  if (!causal) return seq_len;
  if (attend_until == nullptr) return pos + 1;
  return static_cast<int>(std::min<int64_t>(attend_until[t] + 1, seq_len));
}

struct AttentionPlan {
  // Per unit (query token, split): its request, its token index, its split (-1: not split,
  // the output is written directly) and, for a split, where its partial state goes.
  std::vector<int32_t> item_row, item_tok, item_split, item_partial;
  // Per split token: its token index, first partial slot and number of splits.
  std::vector<int32_t> merge_tok, merge_first, merge_count;
  int chunk_kv_heads = 0, num_chunks = 0;
  int64_t num_items = 0;
  // The splits' partial states, [partials][num_heads][head_size + 2] (acc, then m and l):
  // written by the items, read by the merge (shared by the threads of the call).
  mutable std::vector<float> partial;
};

inline AttentionPlan plan_attention(const int32_t* query_start_loc, const int32_t* rows,
                                    int num_rows, const int32_t* seq_lens, int num_kv_heads,
                                    int num_heads, int head_size, int num_threads, int causal,
                                    const int64_t* attend_until = nullptr) {
  AttentionPlan p;
  int32_t partials = 0;
  for (int i = 0; i < num_rows; ++i) {
    const int r = rows[i];
    const int q_len = query_start_loc[r + 1] - query_start_loc[r];
    for (int t = query_start_loc[r]; t < query_start_loc[r + 1]; ++t) {
      // The token's context: keys [0, its horizon] (causal) or the whole sequence.
      const int ctx = key_end(causal, attend_until, t,
                              seq_lens[r] - q_len + (t - query_start_loc[r]), seq_lens[r]);
      const int splits = (ctx + kSplitLen - 1) / kSplitLen;
      if (splits <= 1) {
        p.item_row.push_back(r);
        p.item_tok.push_back(t);
        p.item_split.push_back(-1);
        p.item_partial.push_back(-1);
        continue;
      }
      p.merge_tok.push_back(t);
      p.merge_first.push_back(partials);
      p.merge_count.push_back(splits);
      for (int sp = 0; sp < splits; ++sp) {
        p.item_row.push_back(r);
        p.item_tok.push_back(t);
        p.item_split.push_back(sp);
        p.item_partial.push_back(partials++);
      }
    }
  }
  const int64_t num_units = static_cast<int64_t>(p.item_tok.size());
  if (num_units == 0) return p;
  const int64_t wanted = 4 * static_cast<int64_t>(num_threads);
  const int max_chunks = static_cast<int>(
      std::min<int64_t>(num_kv_heads, (wanted + num_units - 1) / num_units));
  p.chunk_kv_heads = (num_kv_heads + max_chunks - 1) / max_chunks;
  p.num_chunks = (num_kv_heads + p.chunk_kv_heads - 1) / p.chunk_kv_heads;  // none empty
  p.num_items = num_units * p.num_chunks;
  p.partial.resize(static_cast<size_t>(partials) * num_heads * (head_size + 2));
  return p;
}

// The shapes and step inputs of one attention call. query [num_tokens, q_row_stride] holds the
// heads at [0, num_heads * head_size) of each row, unscaled; out rows are num_heads * head_size
// apart.
template <typename T, typename TQ>
struct AttentionArgs {
  const TQ* query;
  int64_t q_row_stride;
  const T* key_cache;
  const T* value_cache;
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  float* out;
  int num_heads, num_kv_heads, head_size, block_size;
  float scale;
  int causal;
  // Sliding window: query at position p attends only to key positions > p - window (HF's
  // `kv_idx > q_idx - sliding_window`: the query and the window - 1 keys before it); 0 = none.
  int window = 0;
  // Gemma 2's attention logit soft-capping: score = soft_cap * tanh(score / soft_cap), applied
  // to the scaled score before the softmax; 0 = none.
  float soft_cap = 0.f;
  // Quantized caches: per-row scales [num_blocks, block_size, num_kv_heads] (int8; nullptr =
  // none), and per-tensor scales (fp8; 1 = none). A stored value x stands for x * scale.
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  float k_scale = 1.f, v_scale = 1.f;
  // Per query token (flat index) the last key position it may see, causal only (Gemma 3's image
  // tokens see their whole image); nullptr = its own position.
  const int64_t* attend_until = nullptr;
  // The output channels wanted, [0, value_size) of each head; 0 = all head_size. MLA's
  // absorbed decode reads only the first kv_lora_rank channels (the c_kv part of its latent
  // values); the eight-head decode path (`decode_8heads_two_pass`) then skips the rest and
  // writes zeros there (other paths compute them).
  int value_size = 0;
};

#ifdef PAGEDLLM_AVX512
// `block_values_heads`' AVX-512 form for exactly 8 heads (head_size % 16 == 0), the same FMAs
// in the same order.
template <typename T>
inline void block_values_8heads(float* acc, int64_t acc_stride, const float* p, int p_stride,
                                const T* v, int64_t stride, int n, int head_size) {
  for (int d = 0; d < head_size; d += 16) {
    __m512 a[8];
    for (int h = 0; h < 8; ++h) a[h] = _mm512_loadu_ps(acc + h * acc_stride + d);
    for (int j = 0; j < n; ++j) {
      const __m512 vv = load16(v + j * stride + d);
      for (int h = 0; h < 8; ++h)
        a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * p_stride + j]), vv, a[h]);
    }
    for (int h = 0; h < 8; ++h) _mm512_storeu_ps(acc + h * acc_stride + d, a[h]);
  }
}
#endif

#ifdef PAGEDLLM_AVX512
// Decode of eight query heads that share one KV head (MQA / GQA with rep % 8 == 0; MLA's
// absorbed decode, whose latent row is both key and value) over the key positions [begin, end)
// of one token, at most kSplitLen of them: the two-pass softmax of one split-KV piece
// (flash-decoding, Dao et al. 2023). Pass 1 writes all the range's scores (`block_scores_pair`,
// the same floats per score as the block-wise walk), prefetching the next block; the exact
// maximum and sum per head then come from the whole range, so no running maximum, no
// correction of the accumulators per block. Pass 2 sums the values 16 channels at a time over
// every row of the range with the 8 heads' accumulators in registers, read once from L1 / L2,
// and writes out[h][0, value_size) = sum_j p_h[j] v_j (not yet divided by the sum); channels
// [value_size, head_size) are zeroed. m[h], l[h] get each head's maximum and exp-sum (-inf and
// 0 for an empty range). Replaces the per-block online softmax, whose bookkeeping (maxima,
// corrections of 8 x head_size accumulators, accumulator loads and stores per block) cost about
// as much as the arithmetic for MLA's 144-value rows (docs/benchmarks.md, "MLA decode attention
// in two passes"). Float32 and bfloat16 caches; head_size % 16 == 0; no per-row scales or soft
// cap.
//   q: [8][head_size] scaled queries; q_pairs: the pairs interleaved (`interleave_query_pair`)
//   k, v: the caches at this KV head (row `slot` at k + slot * stride; v may be k); table: the
//   request's blocks
//   scores: scratch [8][kSplitLen]; out: [8][head_size], out_stride apart
template <typename T>
inline void decode_8heads_two_pass(const float* q, const float* q_pairs, const T* k,
                                   const T* v, int64_t stride, const int32_t* table, int block_size,
                                   int begin, int end, int head_size, int value_size,
                                   float* scores, float* out, int64_t out_stride, float* m,
                                   float* l) {
  const int len = end - begin;
  if (len <= 0) {
    for (int h = 0; h < 8; ++h) {
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.f;
      std::fill(out + h * out_stride, out + h * out_stride + head_size, 0.f);
    }
    return;
  }
  // Pass 1: scores[h][i] for key position begin + i.
  for (int start = begin; start < end;) {
    const int offset = start % block_size;
    const int n = std::min(block_size - offset, end - start);
    const T* rows = k + (static_cast<int64_t>(table[start / block_size]) * block_size + offset) *
                            stride;
    const int i0 = start - begin;
    start += n;
    const int64_t next = start < end ? static_cast<int64_t>(table[start / block_size]) *
                                           block_size * stride : -1;
    for (int h = 0; h < 8; h += 2) {
      if (next >= 0) {   // the next block's rows, a quarter per head pair
        const int j0 = h * block_size / 8, j1 = (h + 2) * block_size / 8;
        prefetch_head_rows(k, v, next + j0 * stride, stride, j1 - j0, head_size);
      }
      block_scores_pair(q_pairs + h * head_size, q + h * head_size, q + (h + 1) * head_size,
                        rows, stride, n, head_size, scores + h * kSplitLen + i0,
                        scores + (h + 1) * kSplitLen + i0);
    }
  }
  // The softmax weights, unnormalised: exp(s - max).
  for (int h = 0; h < 8; ++h) {
    float* s = scores + h * kSplitLen;
    m[h] = row_max(s, len);
    l[h] = exp_shift_sum(s, len, m[h]);
  }
  // Pass 2: the value sums, 16 channels at a time over the whole range (rows from L1 / L2).
  for (int d = 0; d < value_size; d += 16) {
    __m512 a[8];
    for (int h = 0; h < 8; ++h) a[h] = _mm512_setzero_ps();
    for (int start = begin; start < end;) {
      const int offset = start % block_size;
      const int n = std::min(block_size - offset, end - start);
      const T* rows = v + (static_cast<int64_t>(table[start / block_size]) * block_size +
                           offset) * stride + d;
      const float* p = scores + (start - begin);
      start += n;
      for (int j = 0; j < n; ++j) {
        const __m512 vv = load16(rows + j * stride);
        for (int h = 0; h < 8; ++h)
          a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * kSplitLen + j]), vv, a[h]);
      }
    }
    for (int h = 0; h < 8; ++h) _mm512_storeu_ps(out + h * out_stride + d, a[h]);
  }
  for (int h = 0; h < 8; ++h)
    std::fill(out + h * out_stride + value_size, out + h * out_stride + head_size, 0.f);
}
#endif

// acc_h[0, head_size) += sum_j p_h[j] * v_j for the nr query heads h sharing the V rows
// v_j = v + j * stride (acc_h = acc + h * acc_stride, p_h = p + h * p_stride). With AVX2 and
// head_size % 16 == 0 each V vector is loaded (and widened) once for up to 4 heads (AVX-512:
// 8); every element still sums its terms in `block_values`' order with the same FMAs (the same
// floats).
template <typename T>
inline void block_values_heads(float* acc, int64_t acc_stride, const float* p, int p_stride,
                               int nr, const T* v, int64_t stride, int n, int head_size) {
#ifdef PAGEDLLM_AVX512
  // One zmm per 16 values: up to 8 heads per V vector load (float32 / bfloat16 caches; the
  // 8-bit ones take the AVX2 form).
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
    if (head_size % 16 == 0) {
      for (int h0 = 0; h0 < nr; h0 += 8) {
        const int nh = std::min(8, nr - h0);
        if (nh == 8) {   // (a fixed count keeps the accumulators in registers)
          block_values_8heads(acc + h0 * acc_stride, acc_stride, p + h0 * p_stride, p_stride,
                              v, stride, n, head_size);
          continue;
        }
        for (int d = 0; d < head_size; d += 16) {
          __m512 a[8];
          for (int h = 0; h < nh; ++h) a[h] = _mm512_loadu_ps(acc + (h0 + h) * acc_stride + d);
          for (int j = 0; j < n; ++j) {
            const __m512 vv = load16(v + j * stride + d);
            for (int h = 0; h < nh; ++h)
              a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[(h0 + h) * p_stride + j]), vv, a[h]);
          }
          for (int h = 0; h < nh; ++h) _mm512_storeu_ps(acc + (h0 + h) * acc_stride + d, a[h]);
        }
      }
      return;
    }
  }
#endif
#ifdef PAGEDLLM_AVX2
  if (head_size % 16 == 0) {
    for (int h0 = 0; h0 < nr; h0 += 4) {
      const int nh = std::min(4, nr - h0);
      for (int d = 0; d < head_size; d += 16) {
        __m256 a[4][2];
        for (int h = 0; h < nh; ++h) {
          a[h][0] = _mm256_loadu_ps(acc + (h0 + h) * acc_stride + d);
          a[h][1] = _mm256_loadu_ps(acc + (h0 + h) * acc_stride + d + 8);
        }
        for (int j = 0; j < n; ++j) {
          const __m256 v0 = load8(v + j * stride + d), v1 = load8(v + j * stride + d + 8);
          for (int h = 0; h < nh; ++h) {
            const __m256 pj = _mm256_set1_ps(p[(h0 + h) * p_stride + j]);
            a[h][0] = _mm256_fmadd_ps(pj, v0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(pj, v1, a[h][1]);
          }
        }
        for (int h = 0; h < nh; ++h) {
          _mm256_storeu_ps(acc + (h0 + h) * acc_stride + d, a[h][0]);
          _mm256_storeu_ps(acc + (h0 + h) * acc_stride + d + 8, a[h][1]);
        }
      }
    }
    return;
  }
#endif
  for (int h = 0; h < nr; ++h)
    block_values(acc + h * acc_stride, p + h * p_stride, v, stride, n, head_size);
}

// The work-sharing loops over the plan's items, then the merge of the split rows, to be called
// by every thread of an enclosing OpenMP parallel region (orphaned `omp for`s, each ending with
// a barrier).
template <typename T, typename TQ>
void attention_items(const AttentionArgs<T, TQ>& a, const AttentionPlan& plan) {
  if (plan.num_items == 0) return;
  const int head_size = a.head_size, block_size = a.block_size, num_heads = a.num_heads;
  const int num_kv_heads = a.num_kv_heads, rep = num_heads / num_kv_heads;
  const int chunk_kv_heads = plan.chunk_kv_heads, num_chunks = plan.num_chunks;
  const int64_t kv_row_stride = static_cast<int64_t>(num_kv_heads) * head_size;
  const int64_t partial_stride = static_cast<int64_t>(num_heads) * (head_size + 2);
  const int max_heads = chunk_kv_heads * rep;
  std::vector<float> q(static_cast<size_t>(max_heads) * head_size);
  std::vector<float> acc(static_cast<size_t>(max_heads) * head_size);
  std::vector<float> scores(static_cast<size_t>(max_heads) * block_size);
  std::vector<float> m(max_heads), l(max_heads);
  const float q_scale = a.scale * a.k_scale;
  // Query heads two at a time where they share a KV head (`block_scores_pair`: the same
  // floats), with the pair's chunks interleaved in q_pairs.
  int head_step = 1;
#ifdef PAGEDLLM_AVX512
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>)
    head_step = rep % 2 == 0 && head_size % 8 == 0 ? 2 : 1;
#endif
  std::vector<float> q_pairs(head_step == 2 ? q.size() : 0);
  // Eight query heads per KV head at a time in two passes (`decode_8heads_two_pass`) where
  // the shapes allow: MLA's absorbed decode (8-128 heads on one latent) and GQA with rep % 8
  // == 0, float32 / bfloat16 caches without per-row scales or soft cap.
  bool two_pass = false;
  const int value_size = a.value_size > 0 ? a.value_size : head_size;
#ifdef PAGEDLLM_AVX512
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>)
    two_pass = head_step == 2 && rep % 8 == 0 && head_size % 16 == 0 &&
               value_size % 16 == 0 && value_size <= head_size && a.k_scales == nullptr &&
               a.v_scales == nullptr && a.soft_cap == 0.f;
  if (two_pass && scores.size() < static_cast<size_t>(8) * kSplitLen)
    scores.resize(static_cast<size_t>(8) * kSplitLen);
#endif

#pragma omp for schedule(dynamic, 1)
  for (int64_t item = 0; item < plan.num_items; ++item) {
    const int64_t unit = item / num_chunks;
    const int kv0 = static_cast<int>(item % num_chunks) * chunk_kv_heads;
    const int kv1 = std::min(num_kv_heads, kv0 + chunk_kv_heads);
    const int nh = (kv1 - kv0) * rep;  // query heads of this item: kv0 * rep + [0, nh)
    const int r = plan.item_row[unit];
    const int t = plan.item_tok[unit];
    const int split = plan.item_split[unit];
    const int q_len = a.query_start_loc[r + 1] - a.query_start_loc[r];
    const int seq_len = a.seq_lens[r];
    const int pos = seq_len - q_len + (t - a.query_start_loc[r]);
    const int32_t* table = a.block_table + static_cast<int64_t>(r) * a.block_table_stride;
    const TQ* q_src = a.query + static_cast<int64_t>(t) * a.q_row_stride +
                      static_cast<int64_t>(kv0) * rep * head_size;

    for (int h = 0; h < nh; ++h) {
      for (int d = 0; d < head_size; ++d)
        q[h * head_size + d] = to_float(q_src[h * head_size + d]) * q_scale;
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.f;
    }
#ifdef PAGEDLLM_AVX512
    if (head_step == 2)
      for (int h = 0; h < nh; h += 2)
        interleave_query_pair(&q[h * head_size], &q[(h + 1) * head_size], head_size,
                              &q_pairs[h * head_size]);
#endif

    // Key positions [ctx_begin, ctx_end) (within the split's piece, if split), walked block by
    // block; a range starting inside a block enters it at an offset (n keys from `offset`).
    int ctx_begin = a.window > 0 ? std::max(0, pos + 1 - a.window) : 0;
    int ctx_end = key_end(a.causal, a.attend_until, t, pos, seq_len);
    if (split >= 0) {
      ctx_begin = std::max(ctx_begin, split * kSplitLen);
      ctx_end = std::min(ctx_end, (split + 1) * kSplitLen);
    }
#ifdef PAGEDLLM_AVX512
    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
    if (two_pass) {   // groups of 8 query heads, each over its KV head's rows
      for (int h0 = 0; h0 < nh; h0 += 8) {
        const int64_t off = static_cast<int64_t>(kv0 + h0 / rep) * head_size;
        float* dst = split >= 0 ? &acc[h0 * head_size]
                                : a.out + (static_cast<int64_t>(t) * num_heads + kv0 * rep + h0) *
                                              head_size;
        decode_8heads_two_pass(&q[h0 * head_size], &q_pairs[h0 * head_size], a.key_cache + off,
                               a.value_cache + off, kv_row_stride,
                               table, block_size, ctx_begin, ctx_end, head_size, value_size,
                               scores.data(), dst, head_size, &m[h0], &l[h0]);
        if (split >= 0) continue;
        for (int h = 0; h < 8; ++h) {
          const float inv = l[h0 + h] > 0.f ? a.v_scale / l[h0 + h] : 0.f;
          float* row = dst + h * head_size;
          for (int d = 0; d < value_size; ++d) row[d] *= inv;
        }
      }
      if (split < 0) continue;
    }
    }
#endif
    if (!two_pass)
      std::fill(acc.begin(), acc.begin() + static_cast<int64_t>(nh) * head_size, 0.f);
    // Two-pass rows were attended above (a split's piece goes on to the merge below the walk):
    // they skip the block walk.
    const int walk_begin = two_pass ? ctx_end : ctx_begin;
    for (int start = walk_begin; start < ctx_end;) {
      const int offset = start % block_size;
      const int n = std::min(block_size - offset, ctx_end - start);
      const int64_t slot0 = static_cast<int64_t>(table[start / block_size]) * block_size + offset;
      const int64_t base = slot0 * kv_row_stride + static_cast<int64_t>(kv0) * head_size;
      start += n;
      // The next block's first row (-1: none), prefetched a KV head at a time below.
      const int64_t next = start < ctx_end ? static_cast<int64_t>(table[start / block_size]) *
                                                 block_size * kv_row_stride : -1;
      for (int h = 0; h < nh; h += head_step) {
        // The next block's rows of this KV head, spread over its rep heads (a share per
        // head): issued all at once they stalled on the line fill buffers (MLA's 144-576
        // value rows are 9-36 lines a row).
        if (next >= 0) {
          const int g = h % rep, j0 = g * block_size / rep;
          const int j1 = std::min(rep, g + head_step) * block_size / rep;
          if (j1 > j0)
            prefetch_head_rows(a.key_cache + next + j0 * kv_row_stride,
                               a.value_cache + next + j0 * kv_row_stride,
                               static_cast<int64_t>(kv0 + h / rep) * head_size, kv_row_stride,
                               j1 - j0, head_size);
        }
        const T* k = a.key_cache + base + (h / rep) * head_size;
#ifdef PAGEDLLM_AVX512
        if constexpr (std::is_same_v<T, float> || std::is_same_v<T, uint16_t>) {
          if (head_step == 2) {
            block_scores_pair(&q_pairs[h * head_size], &q[h * head_size],
                              &q[(h + 1) * head_size], k, kv_row_stride, n, head_size,
                              &scores[h * block_size], &scores[(h + 1) * block_size]);
            continue;
          }
        }
#endif
        block_scores(&q[h * head_size], k, kv_row_stride, n, head_size,
                     &scores[h * block_size]);
      }
      if (a.k_scales != nullptr) {
        for (int h = 0; h < nh; ++h) {
          const float* ks = a.k_scales + slot0 * num_kv_heads + kv0 + h / rep;
          float* s = &scores[h * block_size];
          for (int j = 0; j < n; ++j) s[j] *= ks[j * num_kv_heads];
        }
      }
      if (a.soft_cap > 0.f) {
        for (int h = 0; h < nh; ++h) {
          float* s = &scores[h * block_size];
          for (int j = 0; j < n; ++j) s[j] = a.soft_cap * std::tanh(s[j] / a.soft_cap);
        }
      }
      for (int h = 0; h < nh; ++h) {
        float* s = &scores[h * block_size];
        const float m_new = std::max(m[h], row_max(s, n));
        const float correction = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first block
        l[h] = l[h] * correction + exp_shift_sum(s, n, m_new);
        m[h] = m_new;
        if (correction != 1.f) {
          float* acc_h = &acc[h * head_size];
          for (int d = 0; d < head_size; ++d) acc_h[d] *= correction;
        }
      }
      if (a.v_scales != nullptr) {  // the softmax weights times each row's scale
        for (int h = 0; h < nh; ++h) {
          const float* vs = a.v_scales + slot0 * num_kv_heads + kv0 + h / rep;
          float* p = &scores[h * block_size];
          for (int j = 0; j < n; ++j) p[j] *= vs[j * num_kv_heads];
        }
      }
      if (rep > 1 && head_size != 64 && head_size != 128) {
        // Heads of one KV head share its V rows: each V vector loaded once for up to 4 heads
        // (the same floats). MLA's absorbed decode (one latent "KV head" of 144-576 values for
        // all query heads) spent most of its attention time in the per-head loop below, which
        // for these sizes has no in-register kernel (docs/benchmarks.md, "Batch 32 of
        // DeepSeek-V2-Lite 200M on an AVX-512 host").
        for (int g = 0; g < nh; g += rep)
          block_values_heads(&acc[g * head_size], head_size, &scores[g * block_size],
                             block_size, rep, a.value_cache + base + (g / rep) * head_size,
                             kv_row_stride, n, head_size);
      } else {
        for (int h = 0; h < nh; ++h)
          block_values(&acc[h * head_size], &scores[h * block_size],
                       a.value_cache + base + (h / rep) * head_size, kv_row_stride, n,
                       head_size);
      }
    }

    if (split >= 0) {   // the piece's state, for the merge below
      float* dst = plan.partial.data() + plan.item_partial[unit] * partial_stride +
                   static_cast<int64_t>(kv0) * rep * (head_size + 2);
      for (int h = 0; h < nh; ++h) {
        std::copy(&acc[h * head_size], &acc[h * head_size] + head_size, dst);
        dst[head_size] = m[h];
        dst[head_size + 1] = l[h];
        dst += head_size + 2;
      }
      continue;
    }
    float* dst = a.out + (static_cast<int64_t>(t) * num_heads + kv0 * rep) * head_size;
    for (int h = 0; h < nh; ++h) {
      const float inv = l[h] > 0.f ? a.v_scale / l[h] : 0.f;
      for (int d = 0; d < head_size; ++d) dst[h * head_size + d] = acc[h * head_size + d] * inv;
    }
  }

  // The split rows: out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max_s m_s.
  const int64_t num_merges = static_cast<int64_t>(plan.merge_tok.size()) * num_heads;
  if (num_merges == 0) return;
#pragma omp for schedule(static)
  for (int64_t item = 0; item < num_merges; ++item) {
    const int64_t i = item / num_heads;
    const int h = static_cast<int>(item % num_heads);
    const float* first = plan.partial.data() + plan.merge_first[i] * partial_stride +
                         static_cast<int64_t>(h) * (head_size + 2);
    const int count = plan.merge_count[i];
    float big_m = -std::numeric_limits<float>::infinity();
    for (int sp = 0; sp < count; ++sp)
      big_m = std::max(big_m, first[sp * partial_stride + head_size]);
    float* dst = a.out + (static_cast<int64_t>(plan.merge_tok[i]) * num_heads + h) * head_size;
    std::fill(dst, dst + head_size, 0.f);
    float total = 0.f;
    for (int sp = 0; sp < count; ++sp) {
      const float* part = first + sp * partial_stride;
      if (part[head_size + 1] == 0.f) continue;   // an empty piece (outside a window)
      const float w = std::exp(part[head_size] - big_m);
      total += w * part[head_size + 1];
      for (int d = 0; d < head_size; ++d) dst[d] += w * part[d];
    }
    const float inv = total > 0.f ? a.v_scale / total : 0.f;
    for (int d = 0; d < head_size; ++d) dst[d] *= inv;
  }
}

#include "attention_query_tiles.h"   // plan_query_tiles, attention_tile_items

// ---- One call's plan: query tiles for the rows with several query tokens, per-token items
// (split for long contexts) for the decodes.

// Query tokens per work item on the tiled path (measured in docs/benchmarks.md, "Query-tiled
// CPU paged attention").
constexpr int kDefaultQueryTile = 16;

struct StepAttentionPlan {
  QueryTilePlan tiles;
  AttentionPlan tokens;
};

// The plan of one attention call over the requests `rows`: with `query_tile` > 1 the requests
// with several query tokens are tiled (`plan_query_tiles`) and the rest take per-token items
// (`plan_attention`); `query_tile` <= 1 puts every request on the per-token path, where each
// token's floats depend only on its own context (the batch-invariant mode). The per-row tiles
// give the per-token items' floats while a context is not split (at most kSplitLen keys), the
// register-blocked tiles of long query runs the same up to float32 rounding.
inline StepAttentionPlan plan_step_attention(const int32_t* query_start_loc, const int32_t* rows,
                                             int num_rows, const int32_t* seq_lens,
                                             int num_kv_heads, int num_heads, int head_size,
                                             int num_threads, int query_tile, int causal,
                                             const int64_t* attend_until = nullptr) {
  StepAttentionPlan p;
  std::vector<int32_t> token_rows;  // the requests left to the per-token items
  if (query_tile > 1) {
    p.tiles = plan_query_tiles(query_start_loc, rows, num_rows, num_kv_heads, num_threads,
                               query_tile, gemm_tiles_apply(head_size));
    for (int i = 0; i < num_rows; ++i)
      if (query_start_loc[rows[i] + 1] - query_start_loc[rows[i]] < 2)
        token_rows.push_back(rows[i]);
  } else {
    token_rows.assign(rows, rows + num_rows);
  }
  p.tokens = plan_attention(query_start_loc, token_rows.data(),
                            static_cast<int>(token_rows.size()), seq_lens, num_kv_heads,
                            num_heads, head_size, num_threads, causal, attend_until);
  return p;
}

// Both work-sharing loops of a plan, for every thread of an enclosing parallel region.
template <typename T, typename TQ>
void step_attention_items(const AttentionArgs<T, TQ>& a, const StepAttentionPlan& plan) {
  attention_tile_items(a, plan.tiles);
  attention_items(a, plan.tokens);
}

}  // namespace pagedllm
