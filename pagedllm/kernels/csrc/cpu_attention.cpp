// Paged attention for the CPU: each query reads its request's K/V in place through the block
// table (no gather into a contiguous copy), with a block-wise online softmax.
//
// Algorithm: the online softmax of Milakov & Gimelshein, "Online normalizer calculation for
// softmax" (2018), applied per KV block as in FlashAttention (Dao et al., 2022) and vLLM's
// paged attention (Kwon et al., SOSP 2023). Grouped-query attention: the `rep` query heads that
// share a KV head are processed together, so each K/V row is loaded once for all of them.
//
// Layouts (all contiguous, row-major):
//   query        [num_tokens, num_heads, head_size]            float32
//   key_cache    [num_blocks, block_size, num_kv_heads, head_size]  float32 or bfloat16 (uint16)
//   value_cache  same as key_cache
//   block_table  [num_reqs, block_table_stride]               int32
//   query_start_loc [num_reqs + 1], seq_lens [num_reqs]        int32
//   rows         [num_rows] int32: the requests to process (the others are left untouched)
//   out          [num_tokens, num_heads, head_size]            float32
// Query i of request r sits at position seq_lens[r] - query_len[r] + i; with `causal` it attends to
// positions [0, that position], otherwise to [0, seq_lens[r]).
//
// Threads: OpenMP, whose runtime is the one torch already loaded (same soname), so the kernel
// shares torch's thread pool and honours torch.set_num_threads.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const uint16_t* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < n; ++d) s += a[d] * load(b, d);
  return s;
}

template <typename T>
inline void axpy(float* __restrict acc, float w, const T* __restrict v, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) acc[d] += w * load(v, d);
}

template <typename T>
void paged_attention(const float* query, const T* key_cache, const T* value_cache,
                     const int32_t* block_table, int64_t block_table_stride,
                     const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int32_t* rows, int num_rows, float* out, int num_heads,
                     int num_kv_heads, int head_size, int block_size, float scale, int causal) {
  const int rep = num_heads / num_kv_heads;
  // One work item = (query token, KV head). Flatten the selected rows' tokens first.
  std::vector<int32_t> item_row, item_tok;
  for (int i = 0; i < num_rows; ++i) {
    const int r = rows[i];
    for (int t = query_start_loc[r]; t < query_start_loc[r + 1]; ++t) {
      item_row.push_back(r);
      item_tok.push_back(t);
    }
  }
  const int64_t num_items = static_cast<int64_t>(item_tok.size()) * num_kv_heads;
  const int64_t kv_row_stride = static_cast<int64_t>(num_kv_heads) * head_size;

#pragma omp parallel
  {
    std::vector<float> q(static_cast<size_t>(rep) * head_size);
    std::vector<float> acc(static_cast<size_t>(rep) * head_size);
    std::vector<float> scores(static_cast<size_t>(rep) * block_size);
    std::vector<float> m(rep), l(rep);

#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < num_items; ++item) {
      const int64_t tok_idx = item / num_kv_heads;
      const int kvh = static_cast<int>(item % num_kv_heads);
      const int r = item_row[tok_idx];
      const int t = item_tok[tok_idx];
      const int q_len = query_start_loc[r + 1] - query_start_loc[r];
      const int seq_len = seq_lens[r];
      const int pos = seq_len - q_len + (t - query_start_loc[r]);
      const int ctx_end = causal ? pos + 1 : seq_len;
      const int32_t* table = block_table + static_cast<int64_t>(r) * block_table_stride;

      for (int h = 0; h < rep; ++h) {
        const float* src = query + (static_cast<int64_t>(t) * num_heads + kvh * rep + h) * head_size;
        for (int d = 0; d < head_size; ++d) q[h * head_size + d] = src[d] * scale;
        m[h] = -std::numeric_limits<float>::infinity();
        l[h] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);

      for (int start = 0; start < ctx_end; start += block_size) {
        const int n = std::min(block_size, ctx_end - start);
        const int64_t base =
            static_cast<int64_t>(table[start / block_size]) * block_size * kv_row_stride +
            static_cast<int64_t>(kvh) * head_size;
        for (int j = 0; j < n; ++j) {
          const T* k = key_cache + base + j * kv_row_stride;
          for (int h = 0; h < rep; ++h)
            scores[h * block_size + j] = dot(&q[h * head_size], k, head_size);
        }
        for (int h = 0; h < rep; ++h) {
          float* s = &scores[h * block_size];
          float block_max = s[0];
          for (int j = 1; j < n; ++j) block_max = std::max(block_max, s[j]);
          const float m_new = std::max(m[h], block_max);
          const float correction = std::exp(m[h] - m_new);  // exp(-inf) = 0 on the first block
          float block_sum = 0.f;
          for (int j = 0; j < n; ++j) {
            s[j] = std::exp(s[j] - m_new);
            block_sum += s[j];
          }
          l[h] = l[h] * correction + block_sum;
          m[h] = m_new;
          if (correction != 1.f) {
            float* a = &acc[h * head_size];
#pragma omp simd
            for (int d = 0; d < head_size; ++d) a[d] *= correction;
          }
        }
        for (int j = 0; j < n; ++j) {
          const T* v = value_cache + base + j * kv_row_stride;
          for (int h = 0; h < rep; ++h)
            axpy(&acc[h * head_size], scores[h * block_size + j], v, head_size);
        }
      }

      for (int h = 0; h < rep; ++h) {
        float* dst = out + (static_cast<int64_t>(t) * num_heads + kvh * rep + h) * head_size;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        for (int d = 0; d < head_size; ++d) dst[d] = acc[h * head_size + d] * inv;
      }
    }
  }
}

}  // namespace

extern "C" {

// ABI version: bump when a signature below changes (checked by the Python loader).
int pagedllm_cpu_kernels_version() { return 1; }

void paged_attention_f32(const float* query, const float* key_cache, const float* value_cache,
                         const int32_t* block_table, int64_t block_table_stride,
                         const int32_t* query_start_loc, const int32_t* seq_lens,
                         const int32_t* rows, int num_rows, float* out, int num_heads,
                         int num_kv_heads, int head_size, int block_size, float scale,
                         int causal) {
  paged_attention<float>(query, key_cache, value_cache, block_table, block_table_stride,
                         query_start_loc, seq_lens, rows, num_rows, out, num_heads, num_kv_heads,
                         head_size, block_size, scale, causal);
}

void paged_attention_bf16(const float* query, const uint16_t* key_cache,
                          const uint16_t* value_cache, const int32_t* block_table,
                          int64_t block_table_stride, const int32_t* query_start_loc,
                          const int32_t* seq_lens, const int32_t* rows, int num_rows, float* out,
                          int num_heads, int num_kv_heads, int head_size, int block_size,
                          float scale, int causal) {
  paged_attention<uint16_t>(query, key_cache, value_cache, block_table, block_table_stride,
                            query_start_loc, seq_lens, rows, num_rows, out, num_heads,
                            num_kv_heads, head_size, block_size, scale, causal);
}

}  // extern "C"
