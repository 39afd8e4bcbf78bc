// The routed experts of one mixture-of-experts layer in one call (CPU), for `fused_experts` in
// pagedllm/layers/fused_moe.py:
//
//   out[t] = sum over j < k with a local expert e = topk_ids[t, j]:
//            topk_weights[t, j] * (silu(x[t] @ W1[e]^T) * (x[t] @ W3[e]^T)) @ W2[e]^T
//
// Why: the module path is two GEMM calls per active expert plus a dozen torch operations around
// them (sort, gather, un-sort, sum), each paying Python dispatch and an OpenMP fork/join; a
// decode step of a small MoE model spent more time there than streaming the experts' weights.
// Here the whole layer is one OpenMP parallel region whose phases (fused_moe_kernel.h: sort,
// gather, gate/up, down, combine) are separated by the implicit barriers of their work-sharing
// loops (as in cpu_decoder.cpp). The whole MoE block (router, routing, shared expert) in one
// call is cpu_moe_block.cpp.

#include <algorithm>
#include <cstdint>

#include <omp.h>

#include "fused_moe_kernel.h"

namespace {

using namespace pagedllm;

template <typename TA, typename TW>
void fused_moe(const TA* hidden, int64_t num_tokens, int64_t H, const TW* w13, const TW* w2,
               int64_t num_experts, int64_t I, const int64_t* topk_ids,
               const float* topk_weights, int64_t top_k, TA* out) {
  moe::Plan<TA> p;
  moe::plan<TA, TW>(topk_ids, num_tokens, top_k, num_experts, H, I, omp_get_max_threads(), p);
  const int64_t chunks = (H + moe::kCombineChunk - 1) / moe::kCombineChunk;
#pragma omp parallel
  {
    moe::expert_phases(hidden, w13, w2, p);
#pragma omp for
    for (int64_t item = 0; item < num_tokens * chunks; ++item) {
      const int64_t t = item / chunks, c0 = (item % chunks) * moe::kCombineChunk;
      const int64_t c1 = std::min(H, c0 + moe::kCombineChunk);
      float acc[moe::kCombineChunk];
      moe::routed_sum(p, topk_weights, top_k, t, c0, c1, acc);
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
