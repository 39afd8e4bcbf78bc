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
//   key_cache    [num_blocks, block_size, num_kv_heads, head_size]  float32, bfloat16 (uint16),
//                int8 (with k_scales, same index without head_size) or float8 e4m3fn (k_scale)
//   value_cache  same as key_cache
//   block_table  [num_reqs, block_table_stride]               int32
//   query_start_loc [num_reqs + 1], seq_lens [num_reqs]        int32
//   rows         [num_rows] int32: the requests to process (the others are left untouched)
//   out          [num_tokens, num_heads, head_size]            float32
// Query i of request r sits at position p = seq_lens[r] - query_len[r] + i; with `causal` it attends
// to positions [0, p], otherwise to [0, seq_lens[r]). A sliding `window` > 0 (Mistral, Gemma's local
// layers) drops the positions <= p - window, so a causal query sees its last `window` positions
// (itself included), as HF's sliding-window mask does; the blocks before the window are not read.
// A `soft_cap` > 0 (Gemma 2) maps each scaled score s to soft_cap * tanh(s / soft_cap) before
// the softmax.
//
// Query tiling: requests with several query tokens are processed `query_tile` tokens per work
// item (`attention_tile_items`), so each K/V block is read once per tile instead of once per
// token; requests with one query token (decodes) take the per-token items. `query_tile` <= 1
// puts every request on the per-token path, where a token's floats depend only on its own
// context (the batch-invariant mode). Both give the same floats while no context is split
// (kSplitLen), except for requests of at least 16 query tokens (chunked prefill), whose tiles
// run as register-blocked GEMMs that agree up to float32 rounding (attention_kernel.h,
// `attend_tile_gemm`).
//
// Threads: OpenMP, whose runtime is the one torch already loaded (same soname), so the kernel
// shares torch's thread pool and honours torch.set_num_threads.

#include <cstdint>
#include <vector>

#include <omp.h>

#include "attention_kernel.h"

namespace {

using namespace pagedllm;

template <typename T>
void paged_attention(const float* query, const T* key_cache, const T* value_cache,
                     const int32_t* block_table, int64_t block_table_stride,
                     const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int32_t* rows, int num_rows, float* out, int num_heads,
                     int num_kv_heads, int head_size, int block_size, float scale, int causal,
                     int window, float soft_cap, const float* k_scales = nullptr,
                     const float* v_scales = nullptr, float k_scale = 1.f,
                     float v_scale = 1.f, int query_tile = kDefaultQueryTile) {
  const StepAttentionPlan plan =
      plan_step_attention(query_start_loc, rows, num_rows, seq_lens, num_kv_heads, num_heads,
                          head_size, omp_get_max_threads(), query_tile, causal);
  AttentionArgs<T, float> args{query, static_cast<int64_t>(num_heads) * head_size,
                               key_cache, value_cache, block_table, block_table_stride,
                               query_start_loc, seq_lens, out, num_heads, num_kv_heads,
                               head_size, block_size, scale, causal, window, soft_cap};
  args.k_scales = k_scales;
  args.v_scales = v_scales;
  args.k_scale = k_scale;
  args.v_scale = v_scale;
#pragma omp parallel
  step_attention_items(args, plan);
}

}  // namespace

extern "C" {

// ABI version: bump when a signature below changes (checked by the Python loader).
int pagedllm_cpu_kernels_version() { return 9; }

void paged_attention_f32(const float* query, const float* key_cache, const float* value_cache,
                         const int32_t* block_table, int64_t block_table_stride,
                         const int32_t* query_start_loc, const int32_t* seq_lens,
                         const int32_t* rows, int num_rows, float* out, int num_heads,
                         int num_kv_heads, int head_size, int block_size, float scale,
                         int causal, int window, float soft_cap) {
  paged_attention<float>(query, key_cache, value_cache, block_table, block_table_stride,
                         query_start_loc, seq_lens, rows, num_rows, out, num_heads, num_kv_heads,
                         head_size, block_size, scale, causal, window, soft_cap);
}

void paged_attention_bf16(const float* query, const uint16_t* key_cache,
                          const uint16_t* value_cache, const int32_t* block_table,
                          int64_t block_table_stride, const int32_t* query_start_loc,
                          const int32_t* seq_lens, const int32_t* rows, int num_rows, float* out,
                          int num_heads, int num_kv_heads, int head_size, int block_size,
                          float scale, int causal, int window, float soft_cap) {
  paged_attention<uint16_t>(query, key_cache, value_cache, block_table, block_table_stride,
                            query_start_loc, seq_lens, rows, num_rows, out, num_heads,
                            num_kv_heads, head_size, block_size, scale, causal, window,
                            soft_cap);
}

// int8 caches: k_scales / v_scales [num_blocks, block_size, num_kv_heads] float32, one per row.
void paged_attention_int8(const float* query, const int8_t* key_cache, const int8_t* value_cache,
                          const float* k_scales, const float* v_scales,
                          const int32_t* block_table, int64_t block_table_stride,
                          const int32_t* query_start_loc, const int32_t* seq_lens,
                          const int32_t* rows, int num_rows, float* out, int num_heads,
                          int num_kv_heads, int head_size, int block_size, float scale,
                          int causal, int window, float soft_cap) {
  paged_attention<int8_t>(query, key_cache, value_cache, block_table, block_table_stride,
                          query_start_loc, seq_lens, rows, num_rows, out, num_heads,
                          num_kv_heads, head_size, block_size, scale, causal, window, soft_cap,
                          k_scales, v_scales);
}

// float8 e4m3fn caches (bytes) with one scale per tensor.
void paged_attention_fp8_e4m3(const float* query, const uint8_t* key_cache,
                              const uint8_t* value_cache, float k_scale, float v_scale,
                              const int32_t* block_table, int64_t block_table_stride,
                              const int32_t* query_start_loc, const int32_t* seq_lens,
                              const int32_t* rows, int num_rows, float* out, int num_heads,
                              int num_kv_heads, int head_size, int block_size, float scale,
                              int causal, int window, float soft_cap) {
  paged_attention<fp8_e4m3>(query, reinterpret_cast<const fp8_e4m3*>(key_cache),
                            reinterpret_cast<const fp8_e4m3*>(value_cache), block_table,
                            block_table_stride, query_start_loc, seq_lens, rows, num_rows, out,
                            num_heads, num_kv_heads, head_size, block_size, scale, causal,
                            window, soft_cap, nullptr, nullptr, k_scale, v_scale);
}

// The entry points above with the query tile as a last argument (tokens per work item for the
// requests with several query tokens; <= 1: the per-token path for all), for tests and
// measurements.
void paged_attention_f32_tiled(const float* query, const float* key_cache,
                               const float* value_cache, const int32_t* block_table,
                               int64_t block_table_stride, const int32_t* query_start_loc,
                               const int32_t* seq_lens, const int32_t* rows, int num_rows,
                               float* out, int num_heads, int num_kv_heads, int head_size,
                               int block_size, float scale, int causal, int window,
                               float soft_cap, int query_tile) {
  paged_attention<float>(query, key_cache, value_cache, block_table, block_table_stride,
                         query_start_loc, seq_lens, rows, num_rows, out, num_heads, num_kv_heads,
                         head_size, block_size, scale, causal, window, soft_cap, nullptr,
                         nullptr, 1.f, 1.f, query_tile);
}

void paged_attention_bf16_tiled(const float* query, const uint16_t* key_cache,
                                const uint16_t* value_cache, const int32_t* block_table,
                                int64_t block_table_stride, const int32_t* query_start_loc,
                                const int32_t* seq_lens, const int32_t* rows, int num_rows,
                                float* out, int num_heads, int num_kv_heads, int head_size,
                                int block_size, float scale, int causal, int window,
                                float soft_cap, int query_tile) {
  paged_attention<uint16_t>(query, key_cache, value_cache, block_table, block_table_stride,
                            query_start_loc, seq_lens, rows, num_rows, out, num_heads,
                            num_kv_heads, head_size, block_size, scale, causal, window, soft_cap,
                            nullptr, nullptr, 1.f, 1.f, query_tile);
}

void paged_attention_int8_tiled(const float* query, const int8_t* key_cache,
                                const int8_t* value_cache, const float* k_scales,
                                const float* v_scales, const int32_t* block_table,
                                int64_t block_table_stride, const int32_t* query_start_loc,
                                const int32_t* seq_lens, const int32_t* rows, int num_rows,
                                float* out, int num_heads, int num_kv_heads, int head_size,
                                int block_size, float scale, int causal, int window,
                                float soft_cap, int query_tile) {
  paged_attention<int8_t>(query, key_cache, value_cache, block_table, block_table_stride,
                          query_start_loc, seq_lens, rows, num_rows, out, num_heads,
                          num_kv_heads, head_size, block_size, scale, causal, window, soft_cap,
                          k_scales, v_scales, 1.f, 1.f, query_tile);
}

void paged_attention_fp8_e4m3_tiled(const float* query, const uint8_t* key_cache,
                                    const uint8_t* value_cache, float k_scale, float v_scale,
                                    const int32_t* block_table, int64_t block_table_stride,
                                    const int32_t* query_start_loc, const int32_t* seq_lens,
                                    const int32_t* rows, int num_rows, float* out,
                                    int num_heads, int num_kv_heads, int head_size,
                                    int block_size, float scale, int causal, int window,
                                    float soft_cap, int query_tile) {
  paged_attention<fp8_e4m3>(query, reinterpret_cast<const fp8_e4m3*>(key_cache),
                            reinterpret_cast<const fp8_e4m3*>(value_cache), block_table,
                            block_table_stride, query_start_loc, seq_lens, rows, num_rows, out,
                            num_heads, num_kv_heads, head_size, block_size, scale, causal,
                            window, soft_cap, nullptr, nullptr, k_scale, v_scale, query_tile);
}

}  // extern "C"
