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
// to positions [0, p], otherwise to [0, seq_lens[r]). With `attend_until` ([num_tokens] int64,
// causal only) token t attends to [0, attend_until[t]] instead: Gemma 3's image tokens see their
// whole image (HF's "causal OR same image" mask); the window still counts from p. A sliding
// `window` > 0 (Mistral, Gemma's local layers) drops the positions <= p - window, so a causal
// query sees its last `window` positions (itself included), as HF's sliding-window mask does;
// the blocks before the window are not read.
// A `soft_cap` > 0 (Gemma 2) maps each scaled score s to soft_cap * tanh(s / soft_cap) before
// the softmax.
//
// Query tiling: requests with several query tokens are processed `query_tile` tokens per work
// item (`attention_tile_items`), so each K/V block is read once per tile instead of once per
// token; requests with one query token (decodes) take the per-token items. `query_tile` <= 1
// puts every request on the per-token path, where a token's floats depend only on its own
// context (the batch-invariant mode). Both give the same floats while no context is split
// (kSplitLen), except for requests of at least 16 query tokens (chunked prefill), whose tiles
// run as register-blocked GEMMs that agree up to float32 rounding (attention_query_tiles.h,
// `attend_tile_gemm`), and for eight or more query heads per KV head on AVX-512 builds
// (float32 / bfloat16 caches, head_size % 16 == 0), whose per-token items take the two-pass
// decode (`decode_8heads_two_pass`: scores of a whole piece, then one softmax) while the tiles
// keep the block-wise online softmax: the same up to float32 rounding past one block.
//
// Threads: OpenMP, whose runtime is the one torch already loaded (same soname), so the kernel
// shares torch's thread pool and honours torch.set_num_threads.

#include <cstdint>
#include <vector>

#include <omp.h>

#include "attention_kernel.h"
#include "pagedllm_abi.h"

namespace {

using namespace pagedllm;

template <typename T>
void attend_paged(const float* query, const T* key_cache, const T* value_cache,
                     const int32_t* block_table, int64_t block_table_stride,
                     const int32_t* query_start_loc, const int32_t* seq_lens,
                     const int64_t* attend_until, const int32_t* rows, int num_rows,
                     float* out, int num_heads,
                     int num_kv_heads, int head_size, int block_size, float scale, int causal,
                     int window, float soft_cap, const float* k_scales = nullptr,
                     const float* v_scales = nullptr, float k_scale = 1.f,
                     float v_scale = 1.f, int query_tile = kDefaultQueryTile) {
  const StepAttentionPlan plan =
      plan_step_attention(query_start_loc, rows, num_rows, seq_lens, num_kv_heads, num_heads,
                          head_size, omp_get_max_threads(), query_tile, causal,
                          attend_until);
  AttentionArgs<T, float> args{query, static_cast<int64_t>(num_heads) * head_size,
                               key_cache, value_cache, block_table, block_table_stride,
                               query_start_loc, seq_lens, out, num_heads, num_kv_heads,
                               head_size, block_size, scale, causal, window, soft_cap};
  args.attend_until = attend_until;
  args.k_scales = k_scales;
  args.v_scales = v_scales;
  args.k_scale = k_scale;
  args.v_scale = v_scale;
#pragma omp parallel
  step_attention_items(args, plan);
}

}  // namespace

extern "C" {

int pagedllm_abi_version(void) { return PAGEDLLM_ABI_VERSION; }

// One call over a KV cache of `args->cache_dtype` (PagedAttentionArgs, abi.py): 0 float32,
// 1 bfloat16, 2 int8 (with the per-row scales), 3 float8 e4m3fn (with the per-tensor scales);
// `query_tile` 0 takes the default tile.
void paged_attention(const PagedAttentionArgs* args) {
  const PagedAttentionArgs& a = *args;
  const int tile = a.query_tile > 0 ? a.query_tile : kDefaultQueryTile;
#define PAGEDLLM_ATTEND(T, k_scales, v_scales, k_scale, v_scale)                             \
  attend_paged<T>(a.query, static_cast<const T*>(a.key_cache),                             \
                     static_cast<const T*>(a.value_cache), a.block_table,                     \
                     a.block_table_stride, a.query_start_loc, a.seq_lens,              \
                     a.causal ? a.attend_until : nullptr, a.rows, a.num_rows,                 \
                     a.out, a.num_heads, a.num_kv_heads, a.head_size, a.block_size, a.scale,  \
                     a.causal, a.window, a.soft_cap, k_scales, v_scales, k_scale, v_scale,    \
                     tile)
  switch (a.cache_dtype) {
    case 0: PAGEDLLM_ATTEND(float, nullptr, nullptr, 1.f, 1.f); break;
    case 1: PAGEDLLM_ATTEND(uint16_t, nullptr, nullptr, 1.f, 1.f); break;
    case 2: PAGEDLLM_ATTEND(int8_t, a.k_scales, a.v_scales, 1.f, 1.f); break;
    case 3: PAGEDLLM_ATTEND(fp8_e4m3, nullptr, nullptr, a.k_scale, a.v_scale); break;
    default: break;
  }
#undef PAGEDLLM_ATTEND
}

}  // extern "C"
